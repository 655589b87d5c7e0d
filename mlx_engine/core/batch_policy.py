"""How many tokens to draft in a batched step, from what steps measure.

A step of B sequences at draft length k yields E(k) tokens per sequence (E(k) = 1 + a_1 + a_1 a_2 + ...,
a_i the conditional acceptance at draft position i) and costs T(B, k) seconds, so the batch makes
B * E(k) / T(B, k) tokens per second; the policy picks the k (0 = plain decoding) that maximises it.

T(B, k) changes with B: the verify pass scores B * (k + 1) rows. On a GPU that is nearly free at small B
(memory-bound); on a CPU the step becomes compute-bound as rows grow, so drafting that wins for one
sequence can lose for eight. The policy therefore does not carry one sequence's costs over: it fits
    T = c_0 + c_rows * B * (k + 1) + c_draft * k
by exponentially weighted least squares over every step it has seen (any B, any k), so a batch size met
for the first time is predicted from the others, and the fit follows a machine whose load changes.
Acceptance is a property of the text and the drafter, not of B: one Beta-smoothed estimate per draft
position from decayed counts, every row's verdict counting.

Step times on a shared CPU are noisy (+-30% from one step to the next here), so the choice is cautious:
it uses the acceptance's lower confidence bound (z = 1), a predicted cost never below a plain step plus
10% of one per drafted token, and drafts only for a predicted gain over 5%. A policy that wrongly drafts
loses throughput; one that wrongly stays plain loses only the speculative gain it did not prove.

Exploration: until the fit has steps at two row counts, drafted and plain, it runs k = 1, 1, 0, ...
While plain decoding wins it still drafts two steps in `probe_every` (k = 1), so a change of text or of
load is noticed at a cost of a few per cent at most; while drafting wins it tries a neighbour of the
best k every `probe_every` steps. The first drafting step after a plain run of several steps is not
timed (it carries the drafter's catch-up over those steps).
"""

from __future__ import annotations

import math

import numpy as np


class BatchPolicy:
    def __init__(self, max_k: int = 8, probe_every: int = 16, decay: float = 0.98, prior_acceptance: float = 0.5,
                 prior_weight: float = 4.0, window: float = 512.0, margin: float = 1.05,
                 min_draft_cost: float = 0.1, confidence: float = 1.0):
        self.max_k = max_k
        self.margin = margin
        self.min_draft_cost = min_draft_cost
        self.confidence = confidence  # z of the acceptance lower bound the choice uses
        self.probe_every = probe_every
        self.decay = decay  # per step, of the cost fit's weights
        self.prior_acceptance, self.prior_weight = prior_acceptance, prior_weight
        self.window = window  # drafts at a position before its old evidence has faded to 1/e
        self.xtx = np.zeros((3, 3))
        self.xty = np.zeros(3)
        self.hits = [0.0] * max_k
        self.tries = [0.0] * max_k
        self.seen: set[tuple[int, bool]] = set()  # (rows, drafted) of steps seen, for the bootstrap
        self.steps = 0
        self._since_probe = 0
        self._up = False
        self._last_k = 0
        self._plain_run = 0  # plain steps since the last drafting step
        self._probe_left = 0

    # -- estimates ---------------------------------------------------------------------------------------
    def acceptance(self, z: float = 0.0) -> list[float]:
        """Beta-smoothed acceptance per draft position; z > 0: the Wilson lower bound at z deviations (how
        the policy decides: drafting must win on the evidence, not on a lucky few drafts)."""
        out, prior = [], self.prior_acceptance
        for h, t in zip(self.hits, self.tries):
            h, t = h + prior * self.prior_weight, t + self.prior_weight
            p = h / t
            if z > 0:
                z2 = z * z
                p = (p + z2 / (2 * t) - z * math.sqrt(p * (1 - p) / t + z2 / (4 * t * t))) / (1 + z2 / t)
            out.append(p)
            prior = min(prior, p)
        return out

    def expected_tokens(self, k: int, z: float = 0.0) -> float:
        e, p = 1.0, 1.0
        for a in self.acceptance(z)[:k]:
            p *= a
            e += p
        return e

    @staticmethod
    def _features(b: int, k: int) -> np.ndarray:
        x = np.empty(3)  # host numbers, not device arrays
        x[:] = (1.0, b * (k + 1), float(k))
        return x

    def _fit(self, b: int, k: int) -> float:
        ridge = 1e-9 * np.eye(3) * max(1.0, np.trace(self.xtx))
        theta = np.linalg.solve(self.xtx + ridge, self.xty)
        return max(float(self._features(b, k) @ theta), 1e-6)

    def cost(self, b: int, k: int) -> float:
        """Predicted seconds of a step of b rows at draft length k; never below a plain step plus
        `min_draft_cost` of it per drafted token (a noisy fit must not make drafting look free)."""
        plain = self._fit(b, 0)
        return plain if k == 0 else max(self._fit(b, k), plain * (1 + self.min_draft_cost * k))

    def speed(self, b: int, k: int, z: float = 0.0) -> float:
        return b * self.expected_tokens(k, z) / self.cost(b, k)

    def choose(self, b: int) -> int:
        """The fastest k; drafting only when it beats plain decoding by `margin` (step times on a shared
        machine are noisy: a predicted gain within the noise is not worth the risk of a loss)."""
        z = self.confidence
        best = max(range(1, self.max_k + 1), key=lambda k: (self.speed(b, k, z), -k))
        return best if self.speed(b, best, z) > self.margin * self.speed(b, 0) else 0

    # -- the policy -----------------------------------------------------------------------------------------
    def _ready(self) -> bool:
        rows = {r for r, _ in self.seen}
        return len(rows) >= 2 and any(d for _, d in self.seen) and any(not d for _, d in self.seen)

    def next_k(self, b: int) -> int:
        if self._probe_left > 0:
            self._probe_left -= 1
            return 1
        if not self._ready():  # bootstrap: k = 1, 1, 0, 1, 1, 0, ...
            return 0 if self.steps % 3 == 2 else 1
        else:
            best = self.choose(b)
            k = best
            self._since_probe += 1
            if self._since_probe >= self.probe_every:
                self._since_probe = 0
                if best == 0:
                    k, self._probe_left = 1, 1
                else:
                    self._up = not self._up
                    k = max(0, min(self.max_k, best + (1 if self._up else -1)))
        return k

    def observe(self, b: int, k: int, accepted: list[int], seconds: float) -> None:
        """A step of b rows at length k took `seconds`; `accepted`: each row's accepted drafts."""
        untimed = k > 0 and self._plain_run >= 4  # carries the drafter's catch-up over the plain run
        self._plain_run = self._plain_run + 1 if k == 0 else 0
        self._last_k = k
        self.steps += 1
        if not untimed:
            x = self._features(b, k)
            self.xtx = self.xtx * self.decay + np.outer(x, x)
            self.xty = self.xty * self.decay + x * seconds
            self.seen.add((b * (k + 1), k > 0))
        fade = 1.0 - 1.0 / self.window
        for n in accepted if k > 0 else ():
            for i in range(min(n + 1, k)):  # positions the row's draft reached
                self.hits[i] = self.hits[i] * fade + (1.0 if i < n else 0.0)
                self.tries[i] = self.tries[i] * fade + 1.0

    def costs(self) -> dict:
        """Predicted seconds per step by batch size (1, 2, 4, 8) and k (0..3): {B: {k: seconds}}."""
        if not self._ready():
            return {}
        return {b: {k: self.cost(b, k) for k in range(4)} for b in (1, 2, 4, 8)}

    def report(self) -> dict:
        """What the policy believes now: step milliseconds, acceptance per position, its k per batch size."""
        if not self._ready():
            return {}
        return {"step_ms": {b: {k: round(t * 1000, 1) for k, t in c.items()} for b, c in self.costs().items()},
                "acceptance": [round(a, 3) for a in self.acceptance()[:4]],
                "choice": {b: self.choose(b) for b in (1, 2, 4, 8)}}


class FixedBatchPolicy:
    def __init__(self, k: int):
        self.k = int(k)

    def next_k(self, b: int) -> int:
        return self.k

    def observe(self, b: int, k: int, accepted: list[int], seconds: float) -> None:
        pass

    def costs(self) -> dict:
        return {}

    def report(self) -> dict:
        return {}
