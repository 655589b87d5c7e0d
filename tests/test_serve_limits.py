"""What the server lets in and how it leaves: --api-key (401 in OpenAI's shape, /health open), the warning
when listening beyond loopback without one, --max-body-bytes (413 on Content-Length and on a chunked
upload), tokenizing off the event loop (a slow tokenization does not stall /health), --max-queue admitting
exactly N (503 with Retry-After past it), and --shutdown-timeout (running requests finish, or are cancelled
once it passes)."""

import argparse
import json
import socket
import threading
import time

import httpx2 as httpx
import openai
import pytest

from serve_util import RunningServer

KEY = "sekrit-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server():
    s = RunningServer("--batching", "continuous", "--drafter", "ngram", "--max-concurrency", "2", "--max-queue", "2",
                      "--max-tokens", "16", "--max-body-bytes", "65536", "--api-key", KEY)
    yield s
    s.close()


def post(s, path, body, **kw):
    return httpx.post(s.base + path, json=body, headers=kw.pop("headers", AUTH), timeout=kw.pop("timeout", 120), **kw)


def openai_error(r, status):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def wait_for(condition, seconds=60):
    deadline = time.time() + seconds
    while not condition() and time.time() < deadline:
        time.sleep(0.02)
    return condition()


def test_api_key(server):
    body = {"model": server.model, "prompt": "Hi", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = post(server, "/v1/completions", body, headers=headers)
        assert openai_error(r, 401)["code"] == "invalid_api_key" and r.headers["www-authenticate"] == "Bearer"
    assert openai_error(httpx.get(server.base + "/metrics"), 401)
    assert openai_error(httpx.get(server.base + "/v1/models"), 401)
    assert httpx.get(server.base + "/health").status_code == 200  # a liveness probe needs no key
    assert post(server, "/v1/completions", body).json()["usage"]["completion_tokens"] == 2
    assert server.client().completions.create(model=server.model, prompt="Hi", max_tokens=2).usage.completion_tokens == 2
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="wrong").completions.create(model=server.model, prompt="Hi", max_tokens=2)


def test_api_key_from_the_environment(monkeypatch):
    from mlx_engine.serve.main import add_serve_args

    monkeypatch.setenv("MLX_ENGINE_API_KEY", "from-env")
    p = argparse.ArgumentParser()
    add_serve_args(p)
    assert p.parse_args([]).api_key == "from-env"
    assert p.parse_args(["--api-key", "flag"]).api_key == "flag"
    monkeypatch.delenv("MLX_ENGINE_API_KEY")
    p = argparse.ArgumentParser()
    add_serve_args(p)
    assert p.parse_args([]).api_key is None


@pytest.mark.parametrize("host,key,warned", [("0.0.0.0", None, True), ("0.0.0.0", "k", False),
                                              ("127.0.0.1", None, False), ("::1", None, False)])
def test_a_warning_when_listening_beyond_loopback_without_a_key(monkeypatch, capsys, host, key, warned):
    import mlx_engine.serve.main as serve_main

    class Worker:
        mode = "fair-queue"

        def start(self):
            pass

        def stop(self):
            pass

        def status(self):
            return {"batch_invariant": False}

    class Service:
        model_id, worker = "m", Worker()

    class Server:
        def run(self, sockets):
            pass

    monkeypatch.setattr(serve_main, "build_service", lambda args: (Service(), "none"))
    monkeypatch.setattr(serve_main, "make_server", lambda service, args, port: Server())
    p = argparse.ArgumentParser()
    serve_main.add_serve_args(p)
    try:
        serve_main.run_serve(p.parse_args(["--host", host, "--port", "0"] + (["--api-key", key] if key else [])))
    except Exception as e:  # no IPv6 here
        pytest.skip(f"cannot listen on {host}: {e}")
    err = capsys.readouterr().err
    assert ("warning: listening on" in err) == warned, err


def test_a_body_over_the_limit_is_a_413_on_content_length_and_chunked(server):
    big = json.dumps({"model": server.model, "prompt": "word " * 20000}).encode()  # ~100 KB > 64 KiB
    headers = {**AUTH, "content-type": "application/json"}
    r = httpx.post(server.base + "/v1/completions", content=big, headers=headers, timeout=60)
    assert openai_error(r, 413)["code"] == "request_too_large" and str(len(big)) in r.json()["error"]["message"]
    chunks = iter([big[i : i + 8192] for i in range(0, len(big), 8192)])  # no Content-Length: chunked
    r = httpx.post(server.base + "/v1/completions", content=chunks, headers=headers, timeout=60)
    assert openai_error(r, 413)["code"] == "request_too_large"
    # just under the limit is served
    small = json.dumps({"model": server.model, "prompt": "word " * 100, "max_tokens": 2}).encode()
    assert httpx.post(server.base + "/v1/completions", content=small, headers=headers, timeout=60).status_code == 200


def test_tokenizing_runs_off_the_event_loop(server, monkeypatch):
    """While one request's prompt is being tokenized (held here), /health and /v1/models still answer."""
    real = server.service.tokenizer
    started, release = threading.Event(), threading.Event()

    class SlowTokenizer:
        def __getattr__(self, name):
            return getattr(real, name)

        def encode(self, *a, **kw):
            started.set()
            release.wait(60)
            return real.encode(*a, **kw)

    monkeypatch.setattr(server.service, "tokenizer", SlowTokenizer())
    result = {}
    t = threading.Thread(target=lambda: result.update(r=post(server, "/v1/completions", {
        "model": server.model, "prompt": "Hello there", "max_tokens": 2})))
    t.start()
    try:
        assert started.wait(30)
        assert httpx.get(server.base + "/health", timeout=10).json()["status"] == "ok"
        assert httpx.get(server.base + "/v1/models", headers=AUTH, timeout=10).status_code == 200
    finally:
        release.set()
        t.join(60)
    assert result["r"].json()["usage"]["completion_tokens"] == 2


def test_max_queue_admits_exactly_n_then_503_with_retry_after(server, monkeypatch):
    """--max-queue 2: A is taken off the queue and held in its prefill (neither queued nor running: the window
    that used to let one request too many in), B waits in the queue, C gets 503 with Retry-After."""
    worker = server.service.worker
    real, in_prefill, release = worker.engine.add, threading.Event(), threading.Event()

    def held_add(*a, **kw):
        in_prefill.set()
        release.wait(60)
        return real(*a, **kw)

    monkeypatch.setattr(worker.engine, "add", held_add)
    results = {}

    def send(name):
        results[name] = post(server, "/v1/completions", {"model": server.model, "prompt": f"Request {name}:",
                                                          "max_tokens": 3})

    threads = [threading.Thread(target=send, args=("A",))]
    threads[0].start()
    try:
        assert in_prefill.wait(30)
        assert worker.queue.qsize() == 0 and worker.running == 0  # A is between the two
        threads.append(threading.Thread(target=send, args=("B",)))
        threads[1].start()
        assert wait_for(lambda: worker.queue.qsize() == 1, 30)
        r = post(server, "/v1/completions", {"model": server.model, "prompt": "Request C:", "max_tokens": 3})
        err = openai_error(r, 503)
        assert err["type"] == "server_error" and err["code"] == "overloaded"
        assert int(r.headers["retry-after"]) >= 1
    finally:
        release.set()
        for t in threads:
            t.join(120)
    assert results["A"].status_code == results["B"].status_code == 200
    assert wait_for(lambda: worker.admitted == 0, 30)


def test_a_client_leaving_the_queue_frees_its_place_at_once(server, monkeypatch):
    """--max-queue 2, A held in its prefill, B waiting in the queue: B's client leaves, so B is taken out of the
    queue at once (not when the engine thread would reach it) and C gets B's place instead of a 503."""
    worker = server.service.worker
    real, in_prefill, release = worker.engine.add, threading.Event(), threading.Event()

    def held_add(*a, **kw):
        in_prefill.set()
        release.wait(60)
        return real(*a, **kw)

    monkeypatch.setattr(worker.engine, "add", held_add)
    cancelled = worker.counts["cancelled"]
    results = {}

    def send(name):
        results[name] = post(server, "/v1/completions", {"model": server.model, "prompt": f"Request {name}:",
                                                          "max_tokens": 3})

    a = threading.Thread(target=send, args=("A",))
    a.start()
    c = threading.Thread(target=send, args=("C",))
    try:
        assert in_prefill.wait(30)
        b = start_request(server, 3)
        assert wait_for(lambda: worker.queue.qsize() == 1 and worker.admitted == 2, 30)
        b.close()
        assert wait_for(lambda: worker.queue.qsize() == 0 and worker.admitted == 1, 30)
        assert worker.counts["cancelled"] == cancelled + 1
        c.start()
        assert wait_for(lambda: worker.queue.qsize() == 1 or "C" in results, 30)
    finally:
        release.set()
        a.join(120)
        if c.is_alive() or c.ident:
            c.join(120)
    assert results["A"].status_code == results["C"].status_code == 200


def start_request(s, max_tokens: int):
    """A non-streamed request on its own socket (the test decides when the client leaves)."""
    body = json.dumps({"model": s.model, "prompt": "Once upon a time", "max_tokens": max_tokens,
                       "temperature": 0}).encode()
    sock = socket.create_connection(("127.0.0.1", s.args.port))
    key = f"Authorization: Bearer {s.args.api_key}\r\n" if s.args.api_key else ""
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{key}"
                 f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    return sock


def read_response(sock) -> bytes:
    sock.settimeout(120)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


@pytest.mark.parametrize("timeout,finishes", [(60, True), (0.5, False)])
def test_shutdown_timeout(timeout, finishes):
    """On shutdown a running request finishes within --shutdown-timeout, or is cancelled when it passes (a 503
    says so); then the server exits."""
    s = RunningServer("--batching", "fair", "--drafter", "none", "--max-tokens", "16",
                      "--shutdown-timeout", str(timeout))
    worker = s.service.worker
    try:
        n = 24 if finishes else 2000
        sock = start_request(s, n)
        assert wait_for(lambda: worker.running == 1 and worker.engine.stats.generated > 0)
        s.server.should_exit = True
        got = {}
        reader = threading.Thread(target=lambda: got.update(data=read_response(sock)))
        reader.start()
        s.thread.join(60 + timeout)
        assert not s.thread.is_alive()  # the server exited
        reader.join(60)
        head, _, body = got["data"].partition(b"\r\n\r\n")
        if finishes:
            assert head.startswith(b"HTTP/1.1 200") and json.loads(body)["usage"]["completion_tokens"] == n
            assert worker.counts["served"] == 1
        else:  # cancelled, and told so in OpenAI's shape
            assert head.startswith(b"HTTP/1.1 503") and json.loads(body)["error"]["code"] == "shutting_down"
            assert wait_for(lambda: worker.counts["cancelled"] == 1 and worker.running == 0)
            assert worker.engine.stats.generated < n
    finally:
        s.close()
