"""The engine thread, fair-queue form: requests are served one at a time, first come first served, by the
engine the CLI uses (any model, any drafter, recurrent or sliding-window caches included). The next
conversation turn reuses the cache of the common prefix (Engine keeps it). Used where continuous batching
cannot run: a cache that is not plain KV, or a separate draft model."""

from __future__ import annotations

import queue
import threading
import traceback

from .. import text as text_ops
from ..core.engine import Engine, GenerationConfig
from .jobs import Failed, Job, Output, speculation


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
        self.running = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- HTTP side -------------------------------------------------------------------------------
    def saturated(self) -> bool:
        return self.queue.qsize() + self.running >= self.max_queue

    def submit(self, job: Job) -> None:
        self.queue.put(job)

    def status(self) -> dict:
        engine = getattr(self, "engine", None)
        return {"mode": self.mode, "batch_invariant": bool(getattr(engine, "batch_invariant", False)),
                "queued": self.queue.qsize(), "running": self.running, **self.counts}

    def start(self) -> None:
        self._thread = threading.Thread(target=self._main, name="mlx-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    # -- engine thread ---------------------------------------------------------------------------
    def _main(self) -> None:
        while not self._stop.is_set():
            try:
                self.loop_once()
            except Exception as e:  # a bug must not kill the server silently
                traceback.print_exc()
                self.fail_all(f"internal error: {type(e).__name__}: {e}")

    def output(self, job: Job) -> Output:
        return Output(job, self.tokenizer, self.special, self.eos)

    def next_job(self, timeout: float | None) -> Job | None:
        while True:
            try:
                job = self.queue.get(timeout=timeout) if timeout else self.queue.get_nowait()
            except queue.Empty:
                return None
            if not job.cancelled:
                return job
            self.counts["cancelled"] += 1  # its client left while it waited
            timeout = None

    def fail_all(self, message: str) -> None:
        while (job := self.next_job(None)) is not None:
            job.put(Failed(message))

    def loop_once(self) -> None:
        raise NotImplementedError


class FairQueueWorker(WorkerBase):
    mode = "fair-queue"

    def __init__(self, engine: Engine, tokenizer, **kw):
        super().__init__(tokenizer, **kw)
        self.engine = engine

    def loop_once(self) -> None:
        job = self.next_job(0.1)
        if job is None:
            return
        self.running = 1
        try:
            self.serve(job)
        except Exception as e:
            self.counts["failed"] += 1
            job.put(Failed(f"{type(e).__name__}: {e}"))
        finally:
            self.running = 0

    def serve(self, job: Job) -> None:
        req, engine = job.request, self.engine
        num_draft = self.num_draft if req.num_draft is None else req.num_draft
        cfg = GenerationConfig(max_tokens=req.max_tokens, num_draft=num_draft, sampling=req.sampling, seed=req.seed,
                               stop_tokens=self.eos)
        out = self.output(job)
        gen = engine.generate(req.prompt, cfg)
        cancelled = False
        try:
            for step in gen:
                if job.cancelled:
                    cancelled = True
                    break
                if out.add(step.tokens):
                    break
        finally:
            gen.close()
        s = engine.stats
        drafter = engine.drafter.name if engine.drafter is not None else None
        spec = speculation(s.drafted, s.accepted, s.cycles, s.generated, s.decode_time, drafter)
        self.counts["cancelled" if cancelled else "served"] += 1
        out.finish(spec, "cancelled" if cancelled else None)
