"""One request cannot break the server for others: every field checked in the schema (a 400 naming it,
null = the default), every error in OpenAI's shape (bad bytes, bad JSON, unknown route, wrong method),
no traceback in the log for bad input, and a failure inside the engine thread fails its own request only
(fair queue and continuous batching), counted in /health's `failed`."""

import threading
import time

import httpx2 as httpx
import openai
import pytest

from serve_util import RunningServer

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server():
    s = RunningServer("--batching", "fair", "--drafter", "ngram", "--max-tokens", "16")
    yield s
    s.close()


@pytest.fixture(scope="module")
def batch_server():
    s = RunningServer("--batching", "continuous", "--drafter", "ngram", "--max-concurrency", "2", "--max-tokens", "16")
    yield s
    s.close()


def assert_openai_error(r: httpx.Response, status: int, param=None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["type"]
    assert err["param"] == param, err
    return err


def together(*calls):
    results = [None] * len(calls)
    barrier = threading.Barrier(len(calls))

    def run(i):
        barrier.wait()
        results[i] = calls[i]()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


@pytest.mark.parametrize("fields,param,unsupported", [
    ({"seed": -1}, "seed", False),
    ({"seed": 2**63}, "seed", False),
    ({"seed": 2**64}, "seed", False),
    ({"seed": 1.5}, "seed", False),
    ({"temperature": "hot"}, "temperature", False),
    ({"temperature": True}, "temperature", False),
    ({"max_tokens": 2.0}, "max_tokens", False),
    ({"stream": 1}, "stream", False),
    ({"stream_options": {"include_usage": "yes"}}, "stream_options", False),
    ({"n": 2}, "n", True),
    ({"tools": [{"type": "web_search"}]}, "tools", True),
    ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools", False),
    ({"tool_choice": "required"}, "tool_choice", False),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "sometimes"}, "tool_choice", False),
    ({"response_format": {"type": "xml"}}, "response_format", True),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "strin"}}}},
     "response_format", False),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p"}}}, "response_format", False),
    ({"response_format": {"type": "regex", "regex": "a(b"}}, "response_format", False),
    ({"top_logprobs": 21}, "top_logprobs", False),
    ({"presence_penalty": 2.5}, "presence_penalty", False),
    ({"logit_bias": {"a": 5}}, "logit_bias", False),
    ({"logit_bias": {"42": 500}}, "logit_bias", False),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages", True),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages", False),
    ({"model": None}, "model", False),
])
def test_every_field_is_checked_in_the_schema(server, capfd, fields, param, unsupported):
    body = {"model": server.model, "messages": HI, "max_tokens": 2, **fields}
    err = assert_openai_error(httpx.post(server.base + "/v1/chat/completions", json=body, timeout=60), 400, param)
    assert (err["code"] == "unsupported_parameter") == unsupported, err
    assert param in err["message"]
    assert "Traceback" not in capfd.readouterr().err


@pytest.mark.parametrize("fields,param", [
    ({"logprobs": 6}, "logprobs"), ({"echo": True}, "echo"), ({"best_of": 3}, "best_of"), ({"suffix": "end"}, "suffix"),
    ({"prompt": ["a", "b"]}, "prompt"), ({"seed": -1}, "seed"),
])
def test_completion_fields_are_checked(server, fields, param):
    body = {"model": server.model, "prompt": "Hi", "max_tokens": 2, **fields}
    assert_openai_error(httpx.post(server.base + "/v1/completions", json=body, timeout=60), 400, param)


def test_null_is_the_default_wherever_openai_allows_it(server):
    nulls = dict.fromkeys(["temperature", "top_p", "max_tokens", "max_completion_tokens", "stop", "seed", "n", "stream",
                           "stream_options", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs",
                           "top_logprobs", "tools", "tool_choice", "response_format", "user", "num_draft"])
    plain = httpx.post(server.base + "/v1/chat/completions", json={"model": server.model, "messages": HI}, timeout=120)
    nulled = httpx.post(server.base + "/v1/chat/completions", json={"model": server.model, "messages": HI, **nulls},
                        timeout=120)
    assert plain.status_code == nulled.status_code == 200, nulled.text
    # the defaults applied: greedy (temperature 0), the server's --max-tokens
    assert nulled.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")  # (the second finds the first's prefix cached)
    assert [nulled.json()["usage"][k] for k in counts] == [plain.json()["usage"][k] for k in counts]


@pytest.mark.parametrize("raw,param", [
    (b'{"model": "M", "messages": [{"role": "user", "content": "\xff\xfe"}]}', None),  # not UTF-8
    (b'{"model": "M", "messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages"),  # a lone surrogate
    (b'{"model": "M", "messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}',
     "messages"),
    (b'{"model": "M", "messages": [{"role": "user", "content": "hi"}], "stop": ["\\ud83d"]}', "stop"),
    (b'{"model": "M", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', None),
    (b'{"model": "M", "messages": [', None),
    (b'["model"]', None),
    (b'', None),
])
def test_bad_bytes_are_a_400_in_openai_shape_without_a_traceback(server, capfd, raw, param):
    raw = raw.replace(b'"M"', f'"{server.model}"'.encode())
    r = httpx.post(server.base + "/v1/chat/completions", content=raw, headers={"content-type": "application/json"},
                   timeout=60)
    assert_openai_error(r, 400, param)
    assert "Traceback" not in capfd.readouterr().err


def test_a_lone_surrogate_in_a_completion_prompt(server, capfd):
    raw = f'{{"model": "{server.model}", "prompt": "a\\udc00"}}'.encode()
    assert_openai_error(httpx.post(server.base + "/v1/completions", content=raw, timeout=60), 400, "prompt")
    assert "Traceback" not in capfd.readouterr().err


def test_unknown_route_and_wrong_method_answer_in_openai_shape(server, capfd):
    err = assert_openai_error(httpx.get(server.base + "/v1/nothing-here"), 404)
    assert "/v1/nothing-here" in err["message"]
    r = httpx.get(server.base + "/v1/chat/completions")
    err = assert_openai_error(r, 405)
    assert "GET" in err["message"] and r.headers["allow"] == "POST"
    assert "Traceback" not in capfd.readouterr().err


def test_a_bad_seed_does_not_touch_the_requests_beside_it(server):
    """seed -1 used to reach MLX's key() in the engine thread: its request hung and every queued one got a 500."""
    client = server.client()

    def good():
        return client.completions.create(model=server.model, prompt="Once upon a time", max_tokens=4).usage

    def bad():
        return httpx.post(server.base + "/v1/completions", json={"model": server.model, "prompt": "Hi", "seed": -1},
                          timeout=60)

    before = dict(server.service.worker.counts)
    a, r, b = together(good, bad, good)
    assert_openai_error(r, 400, "seed")
    assert a.completion_tokens == b.completion_tokens == 4
    assert server.service.worker.counts["served"] == before["served"] + 2


def fail_one(monkeypatch, engine, method: str, marker: list[int]):
    """Make engine.<method> raise a RuntimeError (not a ValueError) for the prompt `marker` only."""
    real = getattr(engine, method)

    def patched(*args, **kw):
        prompt = args[0] if method == "generate" else args[1]
        if list(prompt) == marker:
            raise RuntimeError("boom in the engine thread")
        return real(*args, **kw)

    monkeypatch.setattr(engine, method, patched)


@pytest.mark.parametrize("which", ["fair", "continuous"])
def test_a_job_failing_in_the_engine_thread_fails_alone(request, monkeypatch, which):
    s = request.getfixturevalue("server" if which == "fair" else "batch_server")
    worker = s.service.worker
    marker = list(s.service.tokenizer.encode("This request will fail."))
    fail_one(monkeypatch, worker.engine, "generate" if which == "fair" else "add", marker)
    client = s.client()
    failed_before = worker.counts["failed"]

    def ok(prompt):
        return lambda: client.completions.create(model=s.model, prompt=prompt, max_tokens=6, temperature=0)

    def failing():
        return httpx.post(s.base + "/v1/completions", json={"model": s.model, "prompt": marker, "max_tokens": 6},
                          timeout=120)

    a, r, b, c = together(ok("The sky is"), failing, ok("One, two,"), ok("Dear diary,"))
    err = assert_openai_error(r, 500)
    assert err["type"] == "server_error" and "RuntimeError: boom" in err["message"]
    assert [x.usage.completion_tokens for x in (a, b, c)] == [6, 6, 6]
    health = httpx.get(s.base + "/health").json()
    assert health["failed"] == failed_before + 1 and health["queued"] == 0
    assert worker.admitted == 0  # every place in the queue given back
    # and streamed: the failure is an error event, then [DONE]
    with httpx.stream("POST", s.base + "/v1/completions", timeout=60, json={
            "model": s.model, "prompt": marker, "max_tokens": 6, "stream": True}) as resp:
        lines = [ln for ln in resp.iter_lines() if ln]
    assert "RuntimeError: boom" in lines[0] and lines[-1] == "data: [DONE]"


def test_a_failed_batch_step_fails_the_running_requests_and_the_queue_goes_on(batch_server, monkeypatch):
    """A step's failure leaves every running row in doubt: those requests fail, the batch is emptied without
    keeping their caches, and the request waiting in the queue is then served, correctly: the same text as the
    same request served before (num_draft 0: plain steps of one row both times, the same arithmetic)."""
    s, worker = batch_server, batch_server.service.worker
    client = s.client()

    def queued_one():
        return client.completions.create(model=s.model, prompt="The capital of France is", max_tokens=6,
                                         extra_body={"num_draft": 0})

    expected = queued_one().choices[0].text
    real, broke = worker.engine.step, []

    def step_broken_once():  # with both rows running and the third request waiting
        if not broke and len(worker.active) == 2 and worker.queue.qsize() == 1:
            broke.append(1)
            raise RuntimeError("a broken step")
        return real()

    monkeypatch.setattr(worker.engine, "step", step_broken_once)

    def long(prompt):
        return lambda: httpx.post(s.base + "/v1/completions", timeout=120, json={
            "model": s.model, "prompt": prompt, "max_tokens": 40})

    results = {}
    threads = [threading.Thread(target=lambda p=p: results.update({p: long(p)()}))
               for p in ("Once upon a time", "In a galaxy far away")]
    for t in threads:
        t.start()
    deadline = time.time() + 60
    while len(worker.active) < 2 and time.time() < deadline:
        time.sleep(0.01)
    after = queued_one()  # waits in the queue behind the two
    for t in threads:
        t.join(120)
    assert broke, "the step never broke with two rows running and one queued"
    for r in results.values():
        assert_openai_error(r, 500)
        assert "a broken step" in r.json()["error"]["message"]
    assert after.choices[0].text == expected and after.usage.completion_tokens == 6
    deadline = time.time() + 30  # the engine thread drops the finished row just after its answer went out
    while (worker.engine.running() or worker.active) and time.time() < deadline:
        time.sleep(0.05)
    assert worker.engine.running() == 0 and not worker.active and worker.admitted == 0


def test_every_chunk_of_a_stream_has_the_same_created(server, monkeypatch):
    import itertools
    import types

    clock = itertools.count(1_800_000_000)  # the app's wall clock ticks a second per reading here
    monkeypatch.setattr("mlx_engine.serve.openai_api.time",
                        types.SimpleNamespace(time=lambda: next(clock), perf_counter=time.perf_counter))
    with httpx.stream("POST", server.base + "/v1/chat/completions", timeout=60, json={
            "model": server.model, "messages": HI, "max_tokens": 8, "stream": True,
            "stream_options": {"include_usage": True}}) as resp:
        chunks = [ln for ln in resp.iter_lines() if ln.startswith("data: {")]
    import json

    created = {json.loads(c[6:])["created"] for c in chunks}
    ids = {json.loads(c[6:])["id"] for c in chunks}
    assert len(chunks) >= 3 and len(created) == 1 and len(ids) == 1


def test_the_openai_client_raises_its_matching_errors(server):
    client = server.client()
    with pytest.raises(openai.BadRequestError, match="seed"):
        client.chat.completions.create(model=server.model, messages=HI, seed=-1)
    with pytest.raises(openai.BadRequestError, match="tools"):
        client.chat.completions.create(model=server.model, messages=HI, tools=[{"type": "web_search"}])
    server.service.strict_model_name = True
    try:
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="gpt-4", messages=HI)
    finally:
        server.service.strict_model_name = False
