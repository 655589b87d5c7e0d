"""Continuous batching through the server (the real `openai` client, the embedded model + its MTP head):
N concurrent greedy requests each give exactly what the same request gives served alone (and what plain
greedy decoding gives), a client leaving mid-stream frees its sequence while the others go on, stop
strings end one sequence of a batch."""

import threading
import time

import httpx2 as httpx
import pytest

from mlx_engine import text as text_ops
from mlx_engine.core.engine import Engine, GenerationConfig
from serve_util import RunningServer

QUESTIONS = ["What is the capital of France?", "Give me one tip for better sleep.", "Write a haiku about the sea."]


@pytest.fixture(scope="module")
def server():
    s = RunningServer("--batching", "continuous", "--max-concurrency", "4", "--max-tokens", "64")
    yield s
    s.close()


def ask(server, question: str, n: int = 12, stream: bool = False, **kw):
    client = server.client()
    msgs = [{"role": "user", "content": question}]
    if not stream:
        r = client.chat.completions.create(model=server.model, messages=msgs, max_tokens=n, temperature=0, **kw)
        return r.choices[0].message.content, r.usage.completion_tokens, r.choices[0].finish_reason
    chunks = list(client.chat.completions.create(model=server.model, messages=msgs, max_tokens=n, temperature=0,
                                                 stream=True, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks[-1].usage.completion_tokens, chunks[-1].choices[0].finish_reason


def together(fn, args_list):
    results = [None] * len(args_list)
    barrier = threading.Barrier(len(args_list))

    def run(i):
        barrier.wait()
        results[i] = fn(*args_list[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(args_list))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


@pytest.mark.cpu_exact  # a batch row's float arithmetic equals a lone row's: true of MLX's CPU kernels
def test_concurrent_greedy_requests_each_equal_the_request_served_alone(server):
    assert httpx.get(server.base + "/health").json()["mode"] == "continuous"
    alone = [ask(server, q) for q in QUESTIONS]
    worker = server.service.worker
    worker.largest_batch = 0
    concurrent = together(lambda q, s: ask(server, q, stream=s), [(q, i % 2 == 0) for i, q in enumerate(QUESTIONS)])
    assert worker.largest_batch >= 2  # they really ran as one batch
    assert concurrent == alone
    # and served alone is plain greedy decoding (speculation is lossless)
    from mlx_engine.serve.app import encode_chat
    from mlx_engine.serve.schemas import ChatMessage

    tok = server.service.tokenizer
    plain = Engine(worker.engine.target.model)
    for q, (text, n, _) in zip(QUESTIONS[:1], alone[:1]):
        prompt = encode_chat(tok, [ChatMessage(role="user", content=q)])
        ids = [t for s in plain.generate(prompt, GenerationConfig(max_tokens=12, num_draft=0, stop_tokens=worker.eos))
               for t in s.tokens]
        assert text == text_ops.decode(tok, ids) and n == len(ids)


def test_a_client_leaving_frees_its_sequence_and_the_others_go_on(server):
    worker = server.service.worker
    before = worker.counts["cancelled"]
    alone = ask(server, QUESTIONS[1])

    def leaver():
        with httpx.stream("POST", server.base + "/v1/completions", json={
                "model": server.model, "prompt": "Once upon a time", "max_tokens": 60, "stream": True}, timeout=120) as resp:
            got = 0
            for line in resp.iter_lines():
                got += line.startswith("data: {")
                if got >= 3:
                    return "left"

    out = together(lambda f: f(), [(leaver,), (lambda: ask(server, QUESTIONS[1]),)])
    assert out[0] == "left" and out[1] == alone
    def settled():  # the leaver's row is dropped at the engine thread's next step: wait for it
        return worker.counts["cancelled"] == before + 1 and worker.engine.running() == 0 and not worker.active

    deadline = time.time() + 60
    while not settled() and time.time() < deadline:
        time.sleep(0.05)
    assert worker.counts["cancelled"] == before + 1
    assert worker.engine.running() == 0 and not worker.active


def test_stop_string_ends_one_sequence_of_the_batch(server):
    client = server.client()
    prompt = "Count: 1, 2, 3, 4, 5, 6, 7, 8, 9,"
    full = client.completions.create(model=server.model, prompt=prompt, max_tokens=16).choices[0].text
    assert " 12" in full, full

    def cut():
        r = client.completions.create(model=server.model, prompt=prompt, max_tokens=16, stop=[" 12"])
        return r.choices[0].text, r.choices[0].finish_reason

    res = together(lambda f: f(), [(cut,), (lambda: ask(server, QUESTIONS[0]),)])
    assert res[0] == (full[: full.index(" 12")], "stop")


def test_a_stop_string_frees_its_row_at_the_next_step(server, monkeypatch):
    """The stop string is found in the text, so the engine is told at once (cancel): the row leaves at the
    next step, not after decoding on to max_tokens unseen (the client's text would be the same either way:
    only the engine's own ending of the row tells)."""
    client, engine = server.client(), server.service.worker.engine
    prompt = "Count: 1, 2, 3, 4, 5, 6, 7, 8, 9,"
    assert " 12" in client.completions.create(model=server.model, prompt=prompt, max_tokens=16).choices[0].text
    step, ends = engine.step, []

    def step_and_record():
        outs = step()
        ends.extend((o.finished, o.stats["completion_tokens"]) for o in outs if o.finished)
        return outs

    monkeypatch.setattr(engine, "step", step_and_record)
    r = client.completions.create(model=server.model, prompt=prompt, max_tokens=64, stop=[" 12"])
    assert r.choices[0].finish_reason == "stop"
    # the stop string lies within 16 tokens; one more step adds at most the draft length (8 at most) + 1
    assert len(ends) == 1 and ends[0][0] == "cancelled" and ends[0][1] <= 16 + 9, ends


def test_per_request_num_draft_caps_the_request_s_own_row(server):
    """num_draft per request in a batch: 0 turns drafting off for that request alone (nothing drafted, the
    same text), while a concurrent request keeps the server's setting; a bad value is refused (400)."""
    client = server.client()

    def completion(extra):
        r = client.completions.create(model=server.model, prompt="List the planets of the solar system:",
                                      max_tokens=24, temperature=0, extra_body=extra)
        return r.choices[0].text, r.model_extra["speculation"]

    (off_text, off_spec), (on_text, _) = together(completion, [({"num_draft": 0},), (None,)])
    assert off_spec["drafted"] == 0 and off_spec["verify_passes"] == 0
    assert off_text == on_text
    r = httpx.post(server.base + "/v1/completions", json={"model": server.model, "prompt": "Hi", "num_draft": -1},
                   timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "num_draft"


def test_batch_invariant_server_gives_each_request_its_alone_tokens_on_any_device():
    """--batch-invariant: concurrent requests (drafting with the MTP head) each equal, token for token, the
    request decoded alone with plain steps by the invariant engine. Unlike the test above this rests on
    the invariant path, not on the device's arithmetic, so it is not CPU-only."""
    s = RunningServer("--batching", "continuous", "--max-concurrency", "4", "--max-tokens", "64", "--batch-invariant")
    try:
        status = httpx.get(s.base + "/health").json()
        assert status["mode"] == "continuous" and status["batch_invariant"]
        concurrent = together(lambda q: ask(s, q, n=8), [(q,) for q in QUESTIONS])
        assert s.service.worker.largest_batch >= 2
        from mlx_engine.serve.app import encode_chat
        from mlx_engine.serve.schemas import ChatMessage

        tok, worker = s.service.tokenizer, s.service.worker
        plain = Engine(worker.engine.target.model, batch_invariant=True)
        for q, (text, n, _) in zip(QUESTIONS, concurrent):
            prompt = encode_chat(tok, [ChatMessage(role="user", content=q)])
            ids = [t for c in plain.generate(prompt, GenerationConfig(max_tokens=8, num_draft=0, stop_tokens=worker.eos))
                   for t in c.tokens]
            assert text == text_ops.decode(tok, ids) and n == len(ids)
    finally:
        s.close()


def test_fixed_row_invariance_is_refused_with_continuous_batching_before_loading(monkeypatch):
    import argparse

    import mlx_engine.models as models
    from mlx_engine.prepare import UsageError
    from mlx_engine.serve.main import add_serve_args, build_service

    monkeypatch.setattr(models, "load", lambda *a, **kw: pytest.fail("loaded before the flags were checked"))
    p = argparse.ArgumentParser()
    add_serve_args(p)
    for flags in (["--batch-invariant", "fixed"], ["--batch-invariant", "fixed", "--batching", "continuous"]):
        with pytest.raises(UsageError, match="--batching fair"):
            build_service(p.parse_args(flags))
