"""canitoolcall's conformance suite (recorded raw outputs of 9 model families, each judged by the family's
expected parse) through the server's own path: the fixture's tokens through serve.jobs.Output (TextStream, then
the format's reader), non-streamed and streamed in every grouping the suite defines (one token per delta, at
special-token boundaries, seeded random groups: the engine emits several tokens per delta when drafts are
accepted). A case passes when the suite's own checks pass (a soft pass, whitespace at the ends, is counted
apart by scripts/toolcall_conformance.py). tests/toolcall_replay.py builds each family's tokenizer."""

from __future__ import annotations

from canitoolcall.results import Status

import toolcall_replay as replay


def test_a_recorded_answer_parses_as_its_family_writes_it(canitoolcall_fixture):
    obs = replay.observe(canitoolcall_fixture)
    status, bad = replay.verdict(canitoolcall_fixture, obs)
    assert status in (Status.PASS, Status.SOFT_PASS), replay.describe(canitoolcall_fixture, obs, bad)
