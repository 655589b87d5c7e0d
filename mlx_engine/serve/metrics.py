"""GET /metrics: the server's figures in Prometheus's text format, through prometheus_client (its registry,
histograms and exposition; one registry per server, so several servers can live in one process).

Latencies are observed as tokens reach a request (the engine thread calls `first_token` / `later_tokens`);
everything else is read at scrape time from a snapshot the worker keeps in plain Python values (no MLX
call leaves the engine thread). Draft figures add up each finished request's own."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
ITL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class _Snapshot:
    """A custom collector: gauges and counters built from worker.metrics_snapshot() at each scrape."""

    def __init__(self, snapshot):
        self.snapshot = snapshot

    def collect(self):
        s = self.snapshot()
        yield _gauge("queue_length", "requests waiting for a place in the running batch", s["queued"])
        yield _gauge("requests_running", "requests being prefilled or decoded", s["running"])
        outcomes = CounterMetricFamily("mlx_engine_requests", "requests ended, by outcome", labels=["outcome"])
        for outcome in ("served", "failed", "cancelled"):
            outcomes.add_metric([outcome], s[outcome])
        yield outcomes
        yield _counter("draft_tokens", "tokens drafted (finished requests)", s["drafted"])
        yield _counter("draft_accepted_tokens", "drafted tokens the target accepted (finished requests)", s["accepted"])
        yield _gauge("draft_acceptance", "accepted / drafted over finished requests (0 before any draft)",
                     s["accepted"] / s["drafted"] if s["drafted"] else 0.0)
        yield _counter("verify_passes", "verify passes that checked drafts (finished requests)", s["verify_passes"])
        yield _counter("verify_tokens", "tokens emitted by those verify passes", s["verify_tokens"])
        yield _gauge("tokens_per_verify", "tokens emitted per verify pass over finished requests (0 before any)",
                     s["verify_tokens"] / s["verify_passes"] if s["verify_passes"] else 0.0)
        yield _gauge("prefill_pending_tokens", "prompt tokens not yet prefilled (queued requests and the rest "
                                               "of prompts being prefilled)", s["prefill_pending_tokens"])
        yield _gauge("kv_cache_bytes", "bytes held by the engine's KV caches (0 where the engine cannot say)",
                     s["kv_bytes"])
        tree = s.get("prefix_cache") or {}
        if tree:
            hits = CounterMetricFamily("mlx_engine_prefix_cache_hits", "prompts started from the prefix cache, by "
                                       "the tier they were found in", labels=["tier"])
            tokens = CounterMetricFamily("mlx_engine_prefix_cache_hit_tokens", "prompt tokens restored from the "
                                         "prefix cache instead of prefilled, by tier", labels=["tier"])
            for tier in ("ram", "disk"):
                hits.add_metric([tier], tree.get(f"{tier}_hits", 0))
                tokens.add_metric([tier], tree.get(f"{tier}_hit_tokens", 0))
            yield hits
            yield tokens
            yield _gauge("prefix_cache_bytes", "bytes the prefix cache holds in RAM", tree.get("ram_bytes", 0))
            yield _gauge("prefix_cache_disk_bytes", "bytes the prefix cache holds on disk", tree.get("disk_bytes", 0))
            yield _counter("prefix_cache_disk_load_seconds", "seconds spent reading prefix cache entries from disk "
                                                             "(counted in those prompts' prefill)",
                           tree.get("disk_load_seconds", 0.0))


def _gauge(name: str, doc: str, value) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"mlx_engine_{name}", doc, value=float(value))


def _counter(name: str, doc: str, value) -> CounterMetricFamily:
    return CounterMetricFamily(f"mlx_engine_{name}", doc, value=float(value))


class ServeMetrics:
    def __init__(self, snapshot):
        """snapshot: () -> dict of the worker's plain figures (see WorkerBase.metrics_snapshot)."""
        self.registry = CollectorRegistry()  # no auto_describe: collect() runs only at scrape time
        self.ttft = Histogram("mlx_engine_time_to_first_token_seconds",
                              "from a request's arrival to its first token", buckets=TTFT_BUCKETS,
                              registry=self.registry)
        self.itl = Histogram("mlx_engine_inter_token_latency_seconds",
                             "seconds per output token after the first (a verify pass's tokens share its gap)",
                             buckets=ITL_BUCKETS, registry=self.registry)
        self.registry.register(_Snapshot(snapshot))

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def later_tokens(self, seconds: float, n: int) -> None:
        for _ in range(n):
            self.itl.observe(seconds / n)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
