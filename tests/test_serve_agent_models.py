"""`serve --model DIR` on the models agents run (issue 51), as a new user starts it: a hybrid (qwen3_next) and a
sliding-window target (gpt-oss) take continuous batching with speculation on (a draft model of their own
kind) and a prefix cache, /health and the start-up line say so and what the cache keeps; concurrent requests
each equal the request served alone; a model the batch engine does not run (LFM2) takes the fair queue and
says exactly why."""

import httpx2 as httpx
import pytest

from model_dirs import save_tiny
from serve_util import RunningServer
from test_serve_batch import ask, together

QUESTIONS = ["What is the capital of France?", "Give me one tip for better sleep.", "Write a haiku about the sea.",
             "def add(a, b):"]


@pytest.fixture(scope="module", params=["qwen3_next", "gpt_oss"])
def served(request, tmp_path_factory):
    folder = save_tiny(tmp_path_factory.mktemp(request.param) / "model", request.param, seed=2)
    s = RunningServer("--model", str(folder), "--drafter", "draft", "--draft-model", str(folder),
                      "--max-concurrency", "4", "--max-tokens", "32")
    yield request.param, s
    s.close()


@pytest.mark.cpu_exact  # a batch row's float arithmetic equals a lone row's: true of MLX's CPU kernels
def test_an_agent_model_is_batched_with_speculation_and_a_prefix_cache(served):
    family, server = served
    health = httpx.get(server.base + "/health").json()
    assert health["mode"] == "continuous" and health["max_batch"] == 4
    kind = "recurrent" if family == "qwen3_next" else "sliding window"
    assert health["layers"].get(kind, 0) > 0, health["layers"]
    tree = health["prefix_cache"]
    assert tree is not None and ("checkpoints" in tree) == (family == "qwen3_next"), tree
    alone = [ask(server, q) for q in QUESTIONS]
    worker = server.service.worker
    worker.largest_batch = 0
    concurrent = together(lambda q, s: ask(server, q, stream=s), [(q, i % 2 == 0) for i, q in enumerate(QUESTIONS)])
    assert worker.largest_batch >= 2 and concurrent == alone
    assert worker.draft_totals["drafted"] > 0  # speculation was on
    again = ask(server, QUESTIONS[0])  # the same prompt again: a prefix hit, the same answer
    assert again == alone[0] and httpx.get(server.base + "/health").json()["prefix_cache"]["hits"] > 0


def test_a_model_the_batch_engine_does_not_run_takes_the_fair_queue_and_says_why(tmp_path, capsys):
    folder = save_tiny(tmp_path / "lfm2", "lfm2", seed=2)
    server = RunningServer("--model", str(folder))
    try:
        health = httpx.get(server.base + "/health").json()
        assert health["mode"] == "fair-queue"
        assert "not GatedDeltaNet" in health["why_fair_queue"] and health["layers"]["recurrent"] == 2
        assert "fair queue" in capsys.readouterr().err
        assert ask(server, QUESTIONS[0])[1] > 0  # and it serves
    finally:
        server.close()
