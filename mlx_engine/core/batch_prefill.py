"""The batch engine's prefill queue: new sequences are prefilled a chunk per engine step, beside the
running batch, so a long prompt never stops the streams already decoding.

A sequence waits here from `add` until it joins the batch, in two stages:
  1. the target: its prompt is fed in chunks into a single-sequence cache (from the longest prefix the
     prefix tree holds); after the last prompt token its first token is sampled and handed out at once
     (time to first token does not wait for the drafter);
  2. the drafter: a drafter that keeps state over the prompt (an MTP head, a draft model) is begun and
     fed its pending prompt a chunk at a time (`prefill_pending`); then the sequence is ready to join.
Each engine step advances ONE chunk of the sequence with the fewest tokens left (short prompts are not
held behind long ones). A chunk is sized to a time budget (core/chunk_sizer.py): twice the median step
of the running batch, or `idle_budget` seconds when nothing runs (new arrivals and cancellations are
then seen within about that). A cancelled sequence leaves at once; what it had fed goes to the prefix
tree, so a retry resumes there.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import mlx.core as mx

from .. import host
from ..target import prefix_cache as prefix_ops
from .batch_sequence import RunningSequence
from .chunk_sizer import ChunkSizer


@dataclass
class Prefilling:
    seq: RunningSequence
    cache: list  # the single-sequence target cache
    done: int  # prompt positions the cache holds
    reused: int  # of which came from the prefix tree
    hidden: list = field(default_factory=list)  # target hidden rows of those positions (drafters that read them)
    drafter: object | None = None  # stage 2: the begun drafter while its pending prompt is fed
    drafter_left: int = 0  # its pending prompt positions (what prefill_pending last said)
    sampled: bool = False  # stage 1 done: the first token is out
    sizer: ChunkSizer = field(default_factory=ChunkSizer)
    drafter_sizer: ChunkSizer = field(default_factory=lambda: ChunkSizer(first=64, largest=2048))
    started: float = field(default_factory=time.perf_counter)

    @property
    def total(self) -> int:
        return len(self.seq.prompt)

    def left(self) -> int:
        """Prompt positions still to feed (the drafter's pending count once the target is done)."""
        return self.total - self.done if not self.sampled else self.drafter_left


class PrefillQueue:
    def __init__(self, target, want_hidden, tree: prefix_ops.PrefixCache | None, prefill_step: int = 512,
                 idle_budget: float = 1.0):
        self.target, self.want_hidden, self.tree = target, want_hidden, tree
        self.prefill_step, self.idle_budget = prefill_step, idle_budget
        self.waiting: list[Prefilling] = []

    def __len__(self) -> int:
        return len(self.waiting)

    def add(self, seq: RunningSequence) -> Prefilling:
        """Queue a sequence (no device work: the prefix tree is read when its prefill runs)."""
        p = Prefilling(seq, self.target.make_cache(), 0, 0, sizer=ChunkSizer(largest=self.prefill_step))
        self.waiting.append(p)
        return p

    def _catch_up(self, p: Prefilling) -> None:
        """Start from the prefix tree when it holds more of p's prompt than p has fed (a sequence with the
        same prompt may have finished its prefill since p was queued)."""
        if self.tree is None or self.tree.match(p.seq.prompt[:-1]) <= p.done:
            return
        hit = self.tree.lookup(p.seq.prompt[:-1])
        if hit.n <= p.done:
            return
        p.cache = self.target.make_cache()
        prefix_ops.fill(p.cache, hit.layers, hit.n)
        p.hidden = [hit.hidden] if hit.hidden is not None else []
        p.done = p.reused = p.seq.reused = hit.n

    def remove(self, p: Prefilling, keep_fed: bool = True) -> None:
        """p leaves the queue; keep_fed: what it fed goes to the prefix tree (its cache is handed over)."""
        self.waiting.remove(p)
        if keep_fed:
            self.remember(p.seq.prompt[: p.done], p.cache, p.hidden)

    def remember(self, tokens: list[int], cache: list, hidden: list) -> None:
        """Store a single-sequence cache's first len(tokens) positions in the prefix tree. The cache is handed
        over (never written again), so the tree keeps views of it: no copy."""
        n = len(tokens)
        if self.tree is None or n == 0:
            return
        rows = None
        if self.tree.with_hidden:
            if sum(h.shape[0] for h in hidden) < n:
                return
            rows = mx.concatenate(hidden)[:n] if len(hidden) > 1 else hidden[0][:n]
        self.tree.insert(tokens, prefix_ops.layer_states(cache, n), rows, copy=False)

    def status(self) -> list[dict]:
        return [{"id": p.seq.id, "done": p.done, "total": p.total, "stage": "drafter" if p.sampled else "target"}
                for p in self.waiting]

    def next(self) -> Prefilling | None:
        """The sequence with the fewest tokens left (shortest first: a short prompt never waits out a long one)."""
        return min(self.waiting, key=lambda p: p.left(), default=None)

    # -- one chunk ---------------------------------------------------------------------------------------
    def target_chunk(self, p: Prefilling, budget: float | None):
        """Feed one chunk of p's prompt. -> the last prompt token's logits [1, V] once the prompt is in, else
        None."""
        body_end = p.total - 1  # the last prompt token is fed alone (its logits give the first token)
        self._catch_up(p)
        if p.done < body_end:
            n = min(p.sizer.size(budget), body_end - p.done)
            t = time.perf_counter()
            chunk = p.seq.prompt[p.done : p.done + n]
            _, h = self.target.forward(mx.array(chunk), p.cache, self.want_hidden)
            host.wait([c.state for c in p.cache] + ([h] if self.want_hidden else []))
            p.sizer.observe(n, time.perf_counter() - t, budget is not None)
            p.done += n
            if self.want_hidden:
                p.hidden.append(h)
            return None
        logits, h = self.target.forward(mx.array(p.seq.prompt[-1:]), p.cache, self.want_hidden)
        p.done += 1
        if self.want_hidden:
            p.hidden.append(h)
        return logits

    def drafter_chunk(self, p: Prefilling, budget: float | None) -> bool:
        """Feed one chunk of the begun drafter's pending prompt. True when it has nothing left to feed."""
        feed = getattr(p.drafter, "prefill_pending", None)
        if feed is None:
            return True
        n = p.drafter_sizer.size(budget)
        t = time.perf_counter()
        p.drafter_left = feed(n)
        p.drafter_sizer.observe(n, time.perf_counter() - t, budget is not None)
        return p.drafter_left == 0

    def budget(self, step_times: list[float], running: int) -> float:
        """Seconds one chunk may take: twice the running batch's median step (its streams then wait at most
        ~3x their median between tokens), or idle_budget when no sequence is decoding."""
        if running == 0 or not step_times:
            return self.idle_budget
        recent = sorted(step_times[-32:])
        return 2.0 * recent[len(recent) // 2]
