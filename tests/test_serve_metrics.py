"""What the server tells about itself and how fast it notices a client leaving: /metrics in Prometheus's
format (parsed by prometheus_client's own parser) agreeing with /health and with the responses' own
figures; a non-streamed request whose client closes its socket cancelled at once (fair queue and
continuous batching), not run to max_tokens; prefill progress in /health and the log, and a client that
leaves mid-prefill stopping the prefill."""

import functools
import io
import json
import socket
import threading
import time

import httpx2 as httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mlx_engine.serve.progress import PrefillProgress
from serve_util import RunningServer

REPEATING = "1 2 3 4 5 6 7 8 1 2 3 4 5 6 7 8 1 2 3 4 5 6 7 8 1 2 3"  # prompt lookup drafts on it


@pytest.fixture(scope="module")
def server():
    s = RunningServer("--batching", "fair", "--drafter", "ngram", "--num-draft", "2", "--max-tokens", "16")
    yield s
    s.close()


@pytest.fixture(scope="module")
def batch_server():
    s = RunningServer("--batching", "continuous", "--drafter", "ngram", "--max-concurrency", "2", "--max-tokens", "16")
    yield s
    s.close()


def wait_for(condition, seconds=60):
    deadline = time.time() + seconds
    while not condition() and time.time() < deadline:
        time.sleep(0.02)
    return condition()


def scrape(s) -> dict:
    r = httpx.get(s.base + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            key = sample.name + "".join(f"{{{k}={v}}}" for k, v in sorted(sample.labels.items()) if k != "le")
            if "le" in sample.labels:
                continue
            out[key] = sample.value
    return out


def test_metrics_agree_with_health_and_the_responses(server):
    worker = server.service.worker
    before = scrape(server)
    client = server.client()
    responses = [client.completions.create(model=server.model, prompt=REPEATING, max_tokens=12, temperature=0)
                 for _ in range(2)]
    responses.append(client.completions.create(model=server.model, prompt="Hello", max_tokens=5, temperature=0))
    m = scrape(server)
    health = httpx.get(server.base + "/health").json()
    for outcome in ("served", "failed", "cancelled"):
        assert m[f"mlx_engine_requests_total{{outcome={outcome}}}"] == health[outcome]
    assert m["mlx_engine_queue_length"] == 0 and m["mlx_engine_requests_running"] == 0
    assert m["mlx_engine_prefill_pending_tokens"] == 0
    assert m["mlx_engine_kv_cache_bytes"] == worker.engine.kv_bytes() > 0  # the held cache of the last request

    def grew(name):
        return m[name] - before.get(name, 0)

    spec = [r.model_extra["speculation"] for r in responses]
    assert grew("mlx_engine_time_to_first_token_seconds_count") == 3
    assert grew("mlx_engine_inter_token_latency_seconds_count") == sum(r.usage.completion_tokens - 1 for r in responses)
    assert grew("mlx_engine_inter_token_latency_seconds_sum") > 0
    assert grew("mlx_engine_draft_tokens_total") == sum(s["drafted"] for s in spec) > 0
    assert grew("mlx_engine_draft_accepted_tokens_total") == sum(s["accepted"] for s in spec)
    totals = worker.draft_totals
    assert m["mlx_engine_draft_acceptance"] == pytest.approx(totals["accepted"] / totals["drafted"])
    assert m["mlx_engine_tokens_per_verify"] == pytest.approx(totals["verify_tokens"] / totals["verify_passes"])
    assert grew("mlx_engine_verify_passes_total") == sum(s["verify_passes"] for s in spec)


def test_queue_and_pending_prefill_tokens_while_the_engine_is_busy(server, monkeypatch):
    worker = server.service.worker
    real, busy, release = worker.engine.generate, threading.Event(), threading.Event()

    def held(prompt, cfg):
        busy.set()
        release.wait(60)
        return real(prompt, cfg)

    monkeypatch.setattr(worker.engine, "generate", held)
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12]]
    threads = [threading.Thread(target=lambda p=p: httpx.post(server.base + "/v1/completions", timeout=120, json={
        "model": server.model, "prompt": p, "max_tokens": 2})) for p in prompts]
    try:
        threads[0].start()
        assert busy.wait(30)
        for t in threads[1:]:
            t.start()
        assert wait_for(lambda: worker.queue.qsize() == 2, 30)
        m = scrape(server)
        assert m["mlx_engine_queue_length"] == 2 and m["mlx_engine_requests_running"] == 1
        assert m["mlx_engine_prefill_pending_tokens"] == len(prompts[1]) + len(prompts[2])
    finally:
        release.set()
        for t in threads:
            t.join(120)


def leave_a_non_streamed_request(s, max_tokens: int, started) -> None:
    """Send a non-streamed request on a raw socket, wait until it produces tokens, close the socket."""
    body = json.dumps({"model": s.model, "prompt": "Once upon a time", "max_tokens": max_tokens,
                       "temperature": 0}).encode()
    with socket.create_connection(("127.0.0.1", s.args.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        assert wait_for(started, 60)
    # the socket is closed here, long before max_tokens


@pytest.mark.parametrize("which", ["fair", "continuous"])
def test_a_client_leaving_a_non_streamed_request_cancels_it_at_once(request, which):
    """Before: noticed only after 0.5 s without a token, so a request whose tokens kept coming ran to max_tokens.
    Now the request's receive() reports the disconnect: cancelled within a step or two."""
    s = request.getfixturevalue("server" if which == "fair" else "batch_server")
    worker, n = s.service.worker, 400
    before = worker.counts["cancelled"]
    outputs = []  # continuous batching: the request's Output (its token count), taken from the engine side

    def started():
        if which == "fair":
            return worker.running and worker.engine.stats.generated >= 2
        outputs[:] = list(dict(worker.active).values())
        return bool(outputs) and outputs[0].generated >= 2

    leave_a_non_streamed_request(s, n, started)
    assert wait_for(lambda: worker.counts["cancelled"] == before + 1 and worker.running == 0, 60)
    final = worker.engine.stats.generated if which == "fair" else outputs[0].generated
    assert final < n // 2, final  # stopped early: it would have run on to 400
    if which == "continuous":
        assert wait_for(lambda: worker.engine.running() == 0 and not worker.active, 30)


def test_prefill_progress_in_health_and_a_client_leaving_mid_prefill_stops_it(server, monkeypatch):
    """Chunks of 64 tokens here (the engine's default is 512): /health lists the prompt being prefilled with
    its done/total; the client leaving stops the prefill at the next chunk, before any token."""
    import mlx_engine.serve.worker as worker_module

    monkeypatch.setattr(worker_module, "GenerationConfig",
                        functools.partial(worker_module.GenerationConfig, prefill_step=64))
    worker = server.service.worker
    real_update, at_chunk, release, calls = worker.progress.update, threading.Event(), threading.Event(), []

    def update(seq_id, done, total):
        calls.append((done, total))
        real_update(seq_id, done, total)
        if len(calls) == 3:  # hold the engine thread between two chunks
            at_chunk.set()
            release.wait(60)

    monkeypatch.setattr(worker.progress, "update", update)
    prompt = list(range(1000, 1400))  # 400 tokens: 7 chunks of 64
    before = worker.counts["cancelled"]
    body = json.dumps({"model": server.model, "prompt": prompt, "max_tokens": 4}).encode()
    sock = socket.create_connection(("127.0.0.1", server.args.port))
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        assert at_chunk.wait(60)
        health = httpx.get(server.base + "/health").json()
        [entry] = health["prefilling"]
        assert entry["done"] == 128 and entry["total"] == len(prompt) - 1 and health["running"] == 1
    finally:
        sock.close()  # the client leaves mid-prefill
    try:
        assert wait_for(lambda: worker.current is not None and worker.current.cancelled, 30)
    finally:
        release.set()
    assert wait_for(lambda: worker.counts["cancelled"] == before + 1 and worker.running == 0, 60)
    assert max(done for done, _ in calls) == 128  # the prefill stopped at the next chunk boundary
    assert worker.engine.stats.generated == 0
    assert httpx.get(server.base + "/health").json()["prefilling"] == []


@pytest.mark.parametrize("stream", [False, True])
def test_continuous_batching_prefill_progress_and_a_client_leaving_mid_prefill(batch_server, monkeypatch, stream):
    """The batch engine prefills a chunk per step (64 tokens here): /health lists the prompt with done/total,
    and a client leaving mid-prefill (streamed or not) takes it out of the batch engine before its end."""
    worker = batch_server.service.worker
    monkeypatch.setattr(worker.engine.prefills, "prefill_step", 64)
    real_replace, at_chunk, release, seen = worker.progress.replace, threading.Event(), threading.Event(), []

    def replace(current):
        real_replace(current)
        if current:
            seen.append(current[0]["done"])
            if len(seen) == 3:  # hold the engine thread between two chunks
                at_chunk.set()
                release.wait(60)

    monkeypatch.setattr(worker.progress, "replace", replace)
    prompt = list(range(2000, 2400))
    before = worker.counts["cancelled"]
    body = json.dumps({"model": batch_server.model, "prompt": prompt, "max_tokens": 4, "stream": stream}).encode()
    sock = socket.create_connection(("127.0.0.1", batch_server.args.port))
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        assert at_chunk.wait(60)
        health = httpx.get(batch_server.base + "/health").json()
        [entry] = health["prefilling"]
        assert entry["id"].startswith("cmpl-") and entry["total"] == len(prompt) and 0 < entry["done"] < len(prompt)
        assert health["running"] == 1
        [out] = list(worker.active.values())
    finally:
        sock.close()  # the client leaves mid-prefill
    try:
        assert wait_for(lambda: out.job.cancelled, 30)
    finally:
        release.set()
    assert wait_for(lambda: worker.counts["cancelled"] == before + 1 and worker.running == 0, 60)
    assert out.generated == 0 and max(seen) <= seen[2] + 64  # at most one more chunk after the client left
    assert wait_for(lambda: worker.engine.running() == 0 and httpx.get(batch_server.base + "/health").json()[
        "prefilling"] == [], 30)


def test_prefill_progress_logs_a_line_every_few_seconds_per_long_prefill(monkeypatch):
    clock = iter([0.0, 1.0, 6.0, 7.0, 13.0])
    monkeypatch.setattr("mlx_engine.serve.progress.time.perf_counter", lambda: next(clock))
    out = io.StringIO()
    p = PrefillProgress(every=5.0, out=out)
    for done in (0, 512, 3072, 3584, 6144):
        p.update(7, done, 7000)
    assert out.getvalue().splitlines() == ["prefill: request 7: 3072/7000 tokens, 512 tok/s",
                                           "prefill: request 7: 6144/7000 tokens, 473 tok/s"]
    assert p.snapshot == [{"id": 7, "done": 6144, "total": 7000}] and p.pending_tokens() == 856
    p.finish(7)
    assert p.snapshot == [] and p.pending_tokens() == 0
