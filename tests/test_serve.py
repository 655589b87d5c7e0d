"""The OpenAI-compatible server, through the real `openai` client, on the embedded model with its MTP head:
chat and completions, streamed and not, stop strings, errors in OpenAI's shape, cancellation on
disconnect, the next turn reusing the prompt cache, and speculation figures per request."""

import json
import time

import httpx2 as httpx  # what the openai client itself speaks HTTP with
import openai
import pytest

from mlx_engine import text as text_ops
from mlx_engine.core.engine import Engine, GenerationConfig
from mlx_engine.serve.app import encode_chat
from mlx_engine.serve.schemas import ChatMessage
from mlx_engine.serve.stream import TextStream
from serve_util import RunningServer


@pytest.fixture(scope="module")
def server():
    s = RunningServer("--batching", "fair", "--max-tokens", "64")
    yield s
    s.close()


def plain_greedy(server, prompt: list[int], n: int) -> list[int]:
    worker = server.service.worker
    engine = Engine(worker.engine.target.model)  # no drafter: plain decoding
    cfg = GenerationConfig(max_tokens=n, num_draft=0, stop_tokens=worker.eos)
    return [t for s in engine.generate(prompt, cfg) for t in s.tokens]


def test_models_and_health(server):
    client = server.client()
    assert [m.id for m in client.models.list().data] == [server.model]
    h = httpx.get(server.base + "/health").json()
    assert h["status"] == "ok" and h["model"] == server.model and h["mode"] == "fair-queue"


def test_chat_streamed_and_not_equal_plain_greedy_with_speculation_figures(server):
    client = server.client()
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    r = client.chat.completions.create(model=server.model, messages=msgs, max_tokens=12, temperature=0)
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length") and text
    assert r.usage.completion_tokens <= 12 and r.usage.prompt_tokens > 5
    spec = r.model_extra["speculation"]
    assert spec["drafter"] == "mtp" and spec["verify_passes"] > 0 and 0 <= spec["accepted"] <= spec["drafted"]
    # speculation is lossless: the text is plain greedy decoding's
    tok = server.service.tokenizer
    ids = plain_greedy(server, encode_chat(tok, [ChatMessage(**m) for m in msgs]), 12)
    assert text == text_ops.decode(tok, ids) and r.usage.completion_tokens == len(ids)
    # streamed: the same text; the last chunk carries finish_reason, usage and the speculation figures
    chunks = list(client.chat.completions.create(model=server.model, messages=msgs, max_tokens=12, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    last = chunks[-1]
    assert last.choices[0].finish_reason == r.choices[0].finish_reason
    assert last.usage.completion_tokens == r.usage.completion_tokens
    figures = last.model_extra["speculation"]  # (the adaptive policy may draft otherwise the second time)
    assert set(figures) == set(spec) and 0 <= figures["accepted"] <= figures["drafted"]


def test_completions_streamed_and_not(server):
    client = server.client()
    prompt = "The numbers 1, 2, 3, 4,"
    r = client.completions.create(model=server.model, prompt=prompt, max_tokens=10, temperature=0)
    assert r.object == "text_completion" and r.usage.completion_tokens == 10 and r.choices[0].finish_reason == "length"
    ids = plain_greedy(server, list(server.service.tokenizer.encode(prompt)), 10)
    assert r.choices[0].text == text_ops.decode(server.service.tokenizer, ids)
    s = client.completions.create(model=server.model, prompt=prompt, max_tokens=10, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in s if c.choices) == r.choices[0].text
    # raw SSE: every event a `data:` line, the last one `data: [DONE]`
    with httpx.stream("POST", server.base + "/v1/completions", json={
            "model": server.model, "prompt": "Hi", "max_tokens": 3, "stream": True}) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in resp.iter_lines() if ln]
    assert all(ln.startswith("data: ") for ln in lines) and lines[-1] == "data: [DONE]"
    assert "speculation" in json.loads(lines[-2][6:])


def test_sampled_request_is_reproducible_with_a_seed(server):
    client = server.client()
    kw = dict(model=server.model, prompt="Tell me a story:", max_tokens=8, temperature=0.8, top_p=0.9, seed=7,
              extra_body={"top_k": 40, "min_p": 0.02, "repetition_penalty": 1.1})
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text and a.usage.completion_tokens == 8


def test_stop_string(server):
    client = server.client()
    prompt = "Count: 1, 2, 3, 4, 5, 6, 7, 8, 9,"
    full = client.completions.create(model=server.model, prompt=prompt, max_tokens=16, temperature=0).choices[0].text
    assert " 12" in full, full  # the model counts on
    cut = client.completions.create(model=server.model, prompt=prompt, max_tokens=16, temperature=0, stop=[" 12"])
    assert cut.choices[0].text == full[: full.index(" 12")] and cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=server.model, prompt=prompt, max_tokens=16, temperature=0,
                                         stop=" 12", stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == cut.choices[0].text


@pytest.mark.parametrize("body,status,param", [
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": -1}, 400, "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_p": 0}, 400, "top_p"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, "max_tokens"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 2}, 400, "n"),
])
def test_errors_in_openai_shape(server, body, status, param):
    body = {"model": server.model, **body}
    r = httpx.post(server.base + "/v1/chat/completions", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] and err["param"] == param
    with pytest.raises(openai.APIStatusError) as e:  # the client raises the matching exception
        server.client().chat.completions.create(**body)
    assert e.value.status_code == status


def test_agents_habits_another_model_name_and_a_max_tokens_beyond_the_context(server):
    """Claude Code and Codex send their own model names: served by the one model (named in the answer);
    --strict-model-name restores the 404. max_tokens 32000 (or a million) is cut to the context left."""
    msgs = [{"role": "user", "content": "hi"}]
    r = server.client().chat.completions.create(model="claude-sonnet-4-5", messages=msgs, max_tokens=4)
    assert r.model == server.model and r.choices[0].message.content
    server.service.strict_model_name = True
    try:
        bad = httpx.post(server.base + "/v1/chat/completions", json={"model": "gpt-4", "messages": msgs}, timeout=60)
        assert bad.status_code == 404 and bad.json()["error"]["param"] == "model"
    finally:
        server.service.strict_model_name = False
    big = server.client().chat.completions.create(model=server.model, messages=msgs, max_tokens=10**6)
    assert big.choices[0].finish_reason in ("stop", "length")
    assert big.usage.prompt_tokens + big.usage.completion_tokens <= server.service.context_length


def test_malformed_json_and_prompt_longer_than_the_context(server):
    r = httpx.post(server.base + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()
    long = [1] * (server.service.context_length + 1)
    r = httpx.post(server.base + "/v1/completions", json={"model": server.model, "prompt": long, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_saturated_server_answers_503(server):
    worker = server.service.worker
    old, worker.max_queue = worker.max_queue, 0
    try:
        r = httpx.post(server.base + "/v1/completions", json={"model": server.model, "prompt": "Hi", "max_tokens": 1})
    finally:
        worker.max_queue = old
    assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"


def test_disconnect_cancels_and_the_server_keeps_serving(server):
    worker = server.service.worker
    before = worker.counts["cancelled"]
    with httpx.stream("POST", server.base + "/v1/completions", json={
            "model": server.model, "prompt": "Once upon a time", "max_tokens": 60, "stream": True,
            "temperature": 0}, timeout=60) as resp:
        got = 0
        for line in resp.iter_lines():
            got += line.startswith("data: {")
            if got >= 3:
                break  # leave mid-stream: the connection closes
    deadline = time.time() + 30
    while worker.counts["cancelled"] == before and time.time() < deadline:
        time.sleep(0.05)
    assert worker.counts["cancelled"] == before + 1
    assert worker.engine.stats.generated < 60  # it stopped early
    r = server.client().completions.create(model=server.model, prompt="Hi", max_tokens=2)
    assert r.usage.completion_tokens == 2


def test_next_turn_reuses_the_prompt_cache(server):
    client = server.client()
    msgs = [{"role": "user", "content": "Name a colour."}]
    r = client.chat.completions.create(model=server.model, messages=msgs, max_tokens=8)
    msgs += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": "Another?"}]
    client.chat.completions.create(model=server.model, messages=msgs, max_tokens=4)
    assert server.service.worker.engine.stats.reused_tokens > 10


def test_text_stream_holds_back_a_partial_stop_string():
    class Tok:  # one character per id
        def decode(self, ids, **kw):
            return "".join(chr(i) for i in ids)

    ts = TextStream(Tok(), frozenset(), ["END"])
    assert ts.add([ord("a"), ord("E")]) == "a"  # "E" may start "END"
    assert ts.add([ord("N")]) == ""
    assert ts.add([ord("x")]) == "ENx"  # it did not
    assert ts.add([ord(c) for c in "yEND"]) == "y" and ts.stopped and ts.finish() == ""


def test_a_taken_port_is_refused_before_loading(monkeypatch):
    import argparse
    import socket

    import mlx_engine.serve.main as serve_main
    from mlx_engine.prepare import UsageError

    monkeypatch.setattr(serve_main, "build_service", lambda args: pytest.fail("loaded before the port was bound"))
    p = argparse.ArgumentParser()
    serve_main.add_serve_args(p)
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(UsageError, match=f"cannot listen on 127.0.0.1:{port}"):
            serve_main.run_serve(p.parse_args(["--port", str(port)]))
