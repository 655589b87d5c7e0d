"""The engine thread, fair-queue form: requests are served one at a time, first come first served, by the
engine the CLI uses (any model, any drafter). The next conversation turn reuses the cache of the common
prefix (Engine keeps it). Used where continuous batching cannot run, and /health says why (`why_fair_queue`):
--batching fair, a sharded target, a cache kind the batch engine does not run (LFM2's short convolutions,
Mamba layers, attention sinks kept in a window), a drafter that reads the single-sequence target cache
(Gemma 4's assistant), sliding windows under --batch-invariant.

WorkerBase holds what both forms share: admission (at most `max_queue` requests in, counted from
submission to their terminal event), the counts /health and /metrics show, and the rule that a failure
fails its own job only: the queue goes on."""

from __future__ import annotations

import queue
import sys
import threading
import traceback

from .. import text as text_ops
from ..core.engine import Engine, GenerationConfig
from ..target_model import batch_kinds
from .jobs import Done, Failed, Job, Output, speculation
from .metrics import ServeMetrics
from .progress import PrefillProgress


class WorkerBase:
    mode = "?"

    def __init__(self, tokenizer, max_queue: int = 64, num_draft: int | str = "auto"):
        self.tokenizer = tokenizer
        self.special = text_ops.special_ids(tokenizer)
        self.eos = frozenset(getattr(tokenizer, "eos_token_ids", None) or ())
        self.max_queue = max_queue
        self.num_draft = num_draft
        self.queue: queue.Queue = queue.Queue()
        self.counts = {"served": 0, "cancelled": 0, "failed": 0}
        self.draft_totals = {"drafted": 0, "accepted": 0, "verify_passes": 0, "verify_tokens": 0}
        self.running = 0
        self.admitted = 0  # requests in: queued, being prefilled or decoded (the HTTP side's 503 reads it)
        self.kv_bytes = 0  # sampled by the engine thread (an MLX call stays on it)
        self.prefix_figures: dict = {}  # the prefix cache's counters per tier, sampled by the engine thread
        self.progress = PrefillProgress()  # prompts being prefilled: /health, /metrics, the log
        self.metrics = ServeMetrics(self.metrics_snapshot)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- HTTP side -------------------------------------------------------------------------------
    def try_submit(self, job: Job) -> bool:
        """Queue the job unless `max_queue` requests are already in (then False: the caller answers 503)."""
        with self._lock:
            if self.admitted >= self.max_queue:
                return False
            self.admitted += 1
        job.on_end = self._ended
        self.queue.put(job)
        return True

    def cancel(self, job: Job) -> None:
        """The client left: flag the job, and if it still waits in the queue take it out now (its place in
        --max-queue is free at once, not when the engine thread would have reached it)."""
        job.cancel()
        with self.queue.mutex:
            try:
                self.queue.queue.remove(job)
            except ValueError:  # the engine thread has it: it sees the flag between steps
                return
        job.put(Done("cancelled", len(job.request.prompt), 0, {}))

    def status(self) -> dict:
        engine = getattr(self, "engine", None)
        return {"mode": self.mode, "batch_invariant": bool(getattr(engine, "batch_invariant", False)),
                "queued": self.queue.qsize(), "running": self.running, **self.counts,
                "prefilling": self.progress.snapshot}

    def metrics_snapshot(self) -> dict:
        with self.queue.mutex:  # prompts still in the queue: none of their tokens is prefilled yet
            waiting = sum(len(j.request.prompt) for j in self.queue.queue if not j.cancelled)
        return {"queued": self.queue.qsize(), "running": self.running, **self.counts, **self.draft_totals,
                "prefill_pending_tokens": waiting + self.progress.pending_tokens(), "kv_bytes": self.kv_bytes,
                "prefix_cache": self.prefix_figures}

    def sample_prefix(self, tree) -> None:
        """The prefix cache's counters per tier, as plain values (the engine thread's call)."""
        if tree is None:
            return
        disk = tree.disk.status() if tree.disk is not None else {}
        self.prefix_figures = {
            "ram_hits": tree.hits - disk.get("hits", 0), "ram_hit_tokens": tree.hit_tokens - disk.get("hit_tokens", 0),
            "disk_hits": disk.get("hits", 0), "disk_hit_tokens": disk.get("hit_tokens", 0), "ram_bytes": tree.nbytes,
            "disk_bytes": disk.get("bytes", 0), "disk_load_seconds": disk.get("load_seconds", 0.0)}

    def start(self) -> None:
        self._thread = threading.Thread(target=self._main, name="mlx-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        engine = getattr(self, "engine", None)
        tree = getattr(engine, "prefix_cache", None) or getattr(getattr(engine, "held", None), "prefix_cache", None)
        if tree is not None and tree.disk is not None:  # what is queued for the disk tier goes there first
            tree.disk.flush(timeout=30)

    # -- engine thread ---------------------------------------------------------------------------
    def _main(self) -> None:
        while not self._stop.is_set():
            try:
                self.loop_once()
            except Exception as e:  # a bug: fail the requests it touched, keep serving the queue
                traceback.print_exc()
                try:
                    self.abort_running(f"internal error: {type(e).__name__}: {e}")
                except Exception:  # the thread must live on: the queued requests still get served
                    traceback.print_exc()

    def _ended(self, job: Job, event) -> None:
        """A job's terminal event (the engine thread's, or the HTTP side's for a job taken out of the queue)."""
        outcome = "failed" if isinstance(event, Failed) else \
            "cancelled" if event.finish_reason == "cancelled" else "served"
        spec = event.speculation if isinstance(event, Done) else {}
        with self._lock:
            self.admitted -= 1
            self.counts[outcome] += 1
            if spec.get("verify_passes"):
                self.draft_totals["drafted"] += spec["drafted"]
                self.draft_totals["accepted"] += spec["accepted"]
                self.draft_totals["verify_passes"] += spec["verify_passes"]
                self.draft_totals["verify_tokens"] += round(spec["tokens_per_verify"] * spec["verify_passes"])

    def fail(self, job: Job, e: BaseException) -> None:
        """One job's failure: it alone gets the error; a ValueError is the engine refusing the request (no
        traceback), anything else a bug (its traceback in the log)."""
        if not isinstance(e, ValueError):
            print(f"request {job.id} failed:", file=sys.stderr)
            traceback.print_exception(e)
        job.put(Failed(str(e) if isinstance(e, ValueError) else f"internal error: {type(e).__name__}: {e}"))

    def output(self, job: Job) -> Output:
        return Output(job, self.tokenizer, self.special, self.eos, self.metrics)

    def next_job(self, timeout: float | None) -> Job | None:
        while True:
            try:
                job = self.queue.get(timeout=timeout) if timeout else self.queue.get_nowait()
            except queue.Empty:
                return None
            if not job.cancelled:
                return job
            job.put(Done("cancelled", len(job.request.prompt), 0, {}))  # its client left while it waited
            timeout = None

    def abort_running(self, message: str) -> None:
        """After an unexpected error in the engine thread: fail the requests being served (not the queued)."""

    def loop_once(self) -> None:
        raise NotImplementedError


class FairQueueWorker(WorkerBase):
    mode = "fair-queue"

    def __init__(self, engine: Engine, tokenizer, why: str | None = None, **kw):
        """why: why this server takes the fair queue (/health says it: --batching fair, a model or drafter the
        batch engine does not run, a sharded target)."""
        super().__init__(tokenizer, **kw)
        self.engine = engine
        self.why = why
        self.current: Job | None = None

    def status(self) -> dict:
        target = getattr(self.engine, "target", None)
        layers = batch_kinds.count(target.make_cache()) if target is not None else None
        return {**super().status(), "why_fair_queue": self.why, "layers": layers,
                "prefix_cache": self.prefix_figures or None}

    def loop_once(self) -> None:
        job = self.next_job(0.1)
        if job is None:
            return
        self.running, self.current = 1, job
        try:
            self.serve(job)
        except Exception as e:
            self.fail(job, e)
        finally:
            self.running, self.current = 0, None
            self.kv_bytes = self.engine.kv_bytes()
            self.sample_prefix(getattr(getattr(self.engine, "held", None), "prefix_cache", None))

    def abort_running(self, message: str) -> None:
        if self.current is not None:
            self.current.put(Failed(message))

    def serve(self, job: Job) -> None:
        req, engine = job.request, self.engine
        num_draft = self.num_draft if req.num_draft is None else req.num_draft
        out = self.output(job)
        # progress per prefill chunk; a client that left stops the prefill at the next chunk
        cfg = GenerationConfig(max_tokens=req.max_tokens, num_draft=num_draft, sampling=req.sampling, seed=req.seed,
                               stop_tokens=self.eos, should_stop=lambda: job.cancelled, grammar=req.grammar,
                               reasoning=req.answer is not None and req.answer.reasoning, logprobs=req.logprobs,
                               on_prefill=lambda done, total: self.progress.update(job.name, done, total))
        gen = engine.generate(req.prompt, cfg)
        try:
            for step in gen:
                self.progress.finish(job.name)
                if job.cancelled or out.add(step.tokens, step.logprobs):
                    break
        finally:
            gen.close()
            self.progress.finish(job.name)
        cancelled = job.cancelled and out.finish_reason is None  # left before its end (mid-prefill included)
        s = engine.stats
        drafter = engine.drafter.name if engine.drafter is not None else None
        spec = speculation(s.drafted, s.accepted, s.cycles, s.generated, s.decode_time, drafter, s.forced,
                           s.forced_accepted)
        out.finish(spec, "cancelled" if cancelled else None, s.reused_tokens)
