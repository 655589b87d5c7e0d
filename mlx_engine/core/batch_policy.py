"""How many tokens to draft in a batched step: per batch size, from what a step measures.

A step of B sequences at draft length k costs T(B, k) seconds and yields E(k) tokens per sequence, so
the batch makes B * E(k) / T(B, k) tokens per second: the k that wins is the one that maximises
E(k) / T(B, k), the single-sequence criterion of AdaptivePolicy (policy.py) with the batch's own step
costs. Those costs change with B: a verify of B * (k + 1) rows is memory-bound and nearly free per row at
small B, compute-bound at large B (on a CPU the step time grows with the rows), so drafting that wins
for one sequence can lose for eight. Hence one AdaptivePolicy per batch size, each timing its own steps
(plain ones included) and turning drafting down or off where it measures a loss; the acceptance a
drafter earns depends on the text, not on B, so a batch size seen for the first time starts from the
acceptance evidence gathered so far (its costs it measures itself).

Each row's verdict is evidence for acceptance; the step time is counted once per step.
"""

from __future__ import annotations

import copy

from .policy import AdaptivePolicy


class BatchPolicy:
    def __init__(self, max_k: int = 8):
        self.max_k = max_k
        self.by_size: dict[int, AdaptivePolicy] = {}
        self._last: AdaptivePolicy | None = None

    def _policy(self, b: int) -> AdaptivePolicy:
        p = self.by_size.get(b)
        if p is None:
            p = self.by_size[b] = AdaptivePolicy(max_k=self.max_k)
            if self._last is not None:  # acceptance so far (not costs: those are this batch size's own)
                p.hits, p.tries = copy.copy(self._last.hits), copy.copy(self._last.tries)
                p._estimate()
            p.begin(None)
        self._last = p
        return p

    def next_k(self, b: int) -> int:
        return self._policy(b).next_k()

    def observe(self, b: int, k: int, accepted: list[int], seconds: float) -> None:
        """A step of b rows at length k that took `seconds`; `accepted`: each row's accepted drafts."""
        p = self._policy(b)
        if k == 0:
            p.observe(0, 0, seconds, tokens=1)
            return
        p.observe(k, accepted[0], seconds)
        for n in accepted[1:]:  # acceptance evidence only: the step's time is already counted
            p.observe(k, n, p.cost[k])

    def costs(self) -> dict:
        """Measured seconds per step, by batch size and k (for reports)."""
        return {b: dict(sorted(p.cost.items())) for b, p in sorted(self.by_size.items())}


class FixedBatchPolicy:
    def __init__(self, k: int):
        self.k = int(k)

    def next_k(self, b: int) -> int:
        return self.k

    def observe(self, b: int, k: int, accepted: list[int], seconds: float) -> None:
        pass

    def costs(self) -> dict:
        return {}
