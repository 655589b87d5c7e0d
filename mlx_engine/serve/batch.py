"""The engine thread, continuous-batching form: requests join and leave one running batch between steps of
core.batch_engine.BatchEngine, which decodes them together with speculation kept on (each sequence its
own drafter state and rollback; one verify forward scores every sequence's k+1 tokens). Here: admission
from the queue while the batch has room, text and stop strings per request, and cancellation (a client
that left, or a stop string found in the text) handed to the engine, which frees the sequence's rows."""

from __future__ import annotations

from .jobs import Failed, Output
from .worker import WorkerBase


class BatchWorker(WorkerBase):
    mode = "continuous"

    def __init__(self, engine, tokenizer, drafter_name: str | None, **kw):
        super().__init__(tokenizer, **kw)
        self.engine = engine
        self.drafter_name = drafter_name or "none"
        self.active: dict[int, Output] = {}
        self.closing: dict[int, str] = {}  # sequences this side ended -> why ("stop": a stop string; "cancelled")
        self._held = None  # the next job, waiting for memory to free (BatchEngine.can_admit)
        self.largest_batch = 0

    def status(self) -> dict:
        tree = self.engine.prefix_cache
        # whether a prefix hit also spares the drafter its re-feed (core/drafter_prefix.py), or why not
        drafter_state = None if self.engine.drafter is None else self.engine.drafter_kept or "kept"
        return {**super().status(), "max_batch": self.engine.max_batch, "largest_batch": self.largest_batch,
                "layers": self.engine.layer_kinds(),
                # every model's rows verify chains: a tree drafter (suffix, mtp-tree) drafts its best path here;
                # token trees run in the single-sequence engine (--batching fair)
                "drafts": "chains",
                "prefix_cache": {**tree.status(), "drafter_state": drafter_state, "reuse": self.engine.reuse(),
                                 "tiers": self.prefix_figures} if tree is not None else None,
                "waiting_for_memory": self._held is not None,
                "step_costs": {str(b): {str(k): round(t, 4) for k, t in c.items()}
                               for b, c in self.engine.policy.costs().items()}}

    def loop_once(self) -> None:
        self._admit()
        if not self.active:
            return
        for sid, out in self.active.items():  # clients that left since the last step
            if out.job.cancelled and sid not in self.closing:
                self.engine.cancel(sid)
                self.closing[sid] = "cancelled"
        self.largest_batch = max(self.largest_batch, self.engine.running())
        for result in self.engine.step():
            try:
                self._deliver(result)
            except Exception as e:  # e.g. its text: this sequence fails, the batch goes on
                out = self.active.pop(result.seq_id, None)
                self.closing.pop(result.seq_id, None)
                if out is not None:
                    self.engine.cancel(result.seq_id)
                    self.fail(out.job, e)
        self.running = len(self.active)
        self.kv_bytes = self.engine.kv_bytes()
        self.sample_prefix(self.engine.prefix_cache)
        # prompts still being prefilled (a chunk per step): /health, /metrics and a log line per long one
        self.progress.replace([{**p, "id": self._name(p["id"])} for p in self.engine.prefilling()])

    def _name(self, seq_id) -> str:
        out = self.active.get(seq_id)
        return out.job.name if out is not None else str(seq_id)

    def _admit(self) -> None:
        while self.engine.free_slots() > 0:
            job, self._held = self._held, None
            if job is not None and job.cancelled:
                job = None
            job = job or self.next_job(None if self.active else 0.1)  # idle: wait a little for work
            if job is None:
                return
            req = job.request
            if self.active and not self.engine.can_admit(len(req.prompt), req.max_tokens):
                self._held = job  # its KV cache does not fit beside the running ones: first in when one ends
                return
            try:
                # a request's num_draft caps its own row's k; the batch's policy chooses within it
                self.engine.add(job.id, req.prompt, req.max_tokens, req.sampling, req.seed, self.eos, req.num_draft,
                                grammar=req.grammar, reasoning=req.answer is not None and req.answer.reasoning,
                                logprobs=req.logprobs)
            except Exception as e:  # this request's failure: the others (running and queued) go on
                self.fail(job, e)
                continue
            self.active[job.id] = self.output(job)
            self.running = len(self.active)

    def abort_running(self, message: str) -> None:
        """A step failed: every running sequence's state is in doubt. Fail them (the queue goes on) and empty
        the batch without keeping their caches as prefixes (a half-updated cache must not be reused)."""
        for out in self.active.values():
            out.job.put(Failed(message))
        self.active.clear()
        self.closing.clear()
        self.running = 0
        self.engine.reset()
        self.progress.replace([])

    def _deliver(self, result) -> None:
        out = self.active.get(result.seq_id)
        if out is None:
            return
        if result.seq_id not in self.closing and result.tokens:
            if out.add(result.tokens, result.logprobs) and result.finished is None:  # a stop string: end it now
                self.engine.cancel(result.seq_id)
                self.closing[result.seq_id] = out.finish_reason
        if result.finished is None:
            return
        reason = self.closing.pop(result.seq_id, None) or result.finished
        s = result.stats or {}
        passes = s.get("verify_passes", 0)
        spec = {
            "drafter": self.drafter_name, "drafted": s.get("drafted", 0), "accepted": s.get("accepted", 0),
            "acceptance": round(s.get("acceptance", 0.0), 4), "verify_passes": s.get("verify_passes", 0),
            # per verify pass that drafted (plain steps of the batch are not verify passes): accepted + 1
            "tokens_per_verify": round((s.get("accepted", 0) + passes) / passes, 4) if passes else 0.0,
            "decode_tps": round(s.get("decode_tokens_per_second", 0.0), 2),
            "forced": s.get("forced", 0), "forced_accepted": s.get("forced_accepted", 0),
        }
        out.finish(spec, reason, s.get("reused_prompt_tokens", 0))
        del self.active[result.seq_id]
