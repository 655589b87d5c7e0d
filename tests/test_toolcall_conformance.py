"""canitoolcall's conformance suite (recorded raw outputs of 9 model families, each judged by the family's
expected parse) through the server's own path: the fixture's tokens through serve.jobs.Output (TextStream, then
the format's reader), non-streamed and streamed in every grouping the suite defines (one token per delta, at
special-token boundaries, seeded random groups: the engine emits several tokens per delta when drafts are
accepted). A case passes when the suite's own checks pass (a soft pass, whitespace at the ends, is counted
apart by scripts/toolcall_conformance.py). tests/toolcall_replay.py builds each family's tokenizer."""

from __future__ import annotations

import json

from canitoolcall.results import Status

import toolcall_replay as replay

# Fixtures the project judges wrong, each argued from the family's published files (issue 53's closing note):
# gpt-oss's `<|call|>` (id 200012) is a stop token (generation_config.json eos_token_id [200002, 199999, 200012];
# openai-harmony's stop_tokens_for_assistant_actions), so one generation ends at its first call. These two vLLM
# parser inputs continue past it (a second call, a final message): no engine that stops on the published stop
# tokens can produce them. What the server returns instead is asserted: the first call, alone.
ONE_GENERATION_ENDS_AT_CALL = {"gpt-oss/vllm-sequential-calls", "gpt-oss/vllm-call-then-final"}


def test_a_recorded_answer_parses_as_its_family_writes_it(canitoolcall_fixture):
    fixture = canitoolcall_fixture
    obs = replay.observe(fixture)
    status, bad = replay.verdict(fixture, obs)
    if fixture.id in ONE_GENERATION_ENDS_AT_CALL:
        first = fixture.expected.tool_calls[0]
        for parse in [obs.nonstream, *obs.streams.values()]:
            assert [(c.name, json.loads(c.arguments_raw)) for c in parse.tool_calls] == [(first.name, first.arguments)]
        return
    assert status in (Status.PASS, Status.SOFT_PASS), replay.describe(fixture, obs, bad)
