"""canitoolcall's live probe against `serve` on the embedded model (SmolLM2-135M: no tool calls of its own, so the
server describes the tools and reads the generic <tool_call> form). The scenarios the server decides pass: a forced
call (the grammar holds it), a plain answer with no call, the answer after a tool result, and streamed == not
streamed for every scenario (temperature 0, one request at a time). The rest (single, parallel, nested, unicode,
empty-argument calls under tool_choice auto, reasoning) ask the model to choose a call: their outcome is the
small model's, recorded in bench/results/toolcall-probe-cpu.json by scripts/toolcall_probe.py, not asserted.
Also: the base URL answers HEAD, as Claude Code probes it."""

from __future__ import annotations

import urllib.request

import pytest

from serve_util import RunningServer

SERVER_DECIDES = ("forced-tool-choice", "no-call", "tool-result-followup")


@pytest.fixture(scope="module")
def server():
    s = RunningServer("--max-tokens", "96")
    yield s
    s.close()


def test_the_base_url_answers_head_and_get(server):
    for method in ("HEAD", "GET"):
        with urllib.request.urlopen(urllib.request.Request(server.base + "/", method=method), timeout=30) as r:
            assert r.status == 200


@pytest.mark.slow
def test_the_probe_s_server_side_scenarios_pass(server):
    from canitoolcall.probe import probe

    report = probe(server.base + "/v1", server.model, timeout_s=300, concurrency=1)
    rows = {(o.scenario_id, o.check, o.stream): o for o in report.outcomes}
    bad = [f"{s} [{c}, stream={st}]: {o.status} {o.detail}" for (s, c, st), o in rows.items()
           if (s in SERVER_DECIDES or c == "stream_equals_nonstream") and o.status != "pass"]
    assert not bad, "\n".join(bad)
