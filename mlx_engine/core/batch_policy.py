"""How many tokens to draft in a batched step, for the batch and for each row, from what steps measure.

A step of B sequences at draft length k yields E(k) tokens per sequence (E(k) = 1 + a_1 + a_1 a_2 + ...,
a_i the conditional acceptance at draft position i) and costs T(B, k) seconds, so the batch makes
B * E(k) / T(B, k) tokens per second; the policy picks the k (0 = plain decoding) that maximises it.

T(B, k) changes with B: the verify pass scores B * (k + 1) rows. On a GPU that is nearly free at small B
(memory-bound); on a CPU the step grows with its rows, so drafting that wins for one sequence can lose
for eight. Costs are kept per (B, k) as measured, and predicted where not yet measured from a model of
the verify cost as a function of rows plus a cost per drafted token (step_costs.py). Acceptance is a
property of the text and the drafter, not of B: one Beta-smoothed estimate per draft position from
decayed counts, every row's verdict counting (estimates.py, as the single-sequence policy).

Step times on a shared CPU are noisy (+-30% from one step to the next here), so the choice is cautious:
it uses the acceptance's lower confidence bound (z = 1), a predicted cost never below a plain step plus
10% of one per drafted token, and drafts only for a predicted gain over 5%. A policy that wrongly drafts
loses throughput; one that wrongly stays plain loses only the speculative gain it did not prove.

Exploration. At a batch size met for the first time it alternates k = 1 and 0 until both have
`min_samples` timed steps there (k = 0 only, once the acceptance so far rules drafting out at any cost).
While plain decoding wins it drafts two steps at k = 1 every `stretch` steps, so a change of text or of
load is noticed; the stretch doubles (up to `max_stretch`) while those probes keep losing, so a useless
drafter costs ever less. While drafting wins it tries a neighbour of the best k every `probe_every`
steps, unless that neighbour is measured already and runs more than 15% slower. The first drafting step
after a plain run of several steps is not timed (it carries the drafter's catch-up over those steps),
nor is a step right after rows joined or left (it carries the batch caches' re-layout).

Per row. The verify pass is one [B, k + 1] array, so a row that drafts fewer than k tokens still takes
k + 1 verify rows (padding): what it saves is its own drafting. A batched MTP head drafts every row in
one pass, so every row drafts k (less only where its request or its room caps it). With a drafter per
row (`per_row_drafting`), a row whose own drafts have been accepted so poorly that even their upper
confidence bound returns fewer tokens than its drafting time would make at the batch's rate drafts 0
(re-tried in the probe steps).
"""

from __future__ import annotations

from .estimates import add_verdict, expected_tokens, smoothed_acceptance, wilson_bound
from .step_costs import StepCosts


class RowEvidence:
    """One sequence's own drafts: decayed accepted/reached counts per draft position."""

    __slots__ = ("hits", "tries")

    def __init__(self):
        self.hits: list[float] = []
        self.tries: list[float] = []


class BatchPolicy:
    def __init__(self, max_k: int = 8, probe_every: int = 16, max_stretch: int = 256, prior_acceptance: float = 0.5,
                 prior_weight: float = 4.0, window: float = 512.0, margin: float = 1.05, min_draft_cost: float = 0.1,
                 confidence: float = 1.0, min_samples: int = 3, per_row_drafting: bool = False,
                 row_window: float = 64.0, row_min_tries: int = 6, probe_tolerance: float = 1.15):
        self.max_k = max_k
        self.margin = margin
        self.min_draft_cost = min_draft_cost
        self.confidence = confidence  # z of the acceptance lower bound the choice uses
        self.probe_every, self.max_stretch = probe_every, max_stretch
        self.probe_tolerance = probe_tolerance
        self.prior_acceptance, self.prior_weight = prior_acceptance, prior_weight
        self.window = window  # drafts at a position before its old evidence has faded to 1/e
        self.min_samples = min_samples  # timed steps at k = 0 and k = 1 before a batch size is decided on
        self.per_row_drafting = per_row_drafting  # a drafter per row (its cost grows with the rows' k)
        self.row_window, self.row_min_tries = row_window, row_min_tries
        self.step_costs = StepCosts()
        self.hits = [0.0] * max_k
        self.tries = [0.0] * max_k
        self.steps = 0
        self.stretch = probe_every  # plain steps between probes while plain decoding wins
        self._since_probe = 0
        self._up = False
        self._plain_run = 0  # plain steps since the last drafting step
        self._probe_left = 0
        self._probed = False  # a probe ran since the last decision
        self._probing = False  # the step being planned is a probe

    # -- estimates ---------------------------------------------------------------------------------------
    def acceptance(self, z: float = 0.0) -> list[float]:
        """Beta-smoothed acceptance per draft position; z > 0: its Wilson lower bound at z deviations."""
        return smoothed_acceptance(self.hits, self.tries, self.prior_acceptance, self.prior_weight, z)

    def expected_tokens(self, k: int, z: float = 0.0) -> float:
        return expected_tokens(self.acceptance(z), k, self.prior_acceptance)

    def _drafted(self, b: int, k: int) -> float:
        return float(k * b if self.per_row_drafting else k)

    def cost(self, b: int, k: int) -> float | None:
        """Predicted seconds of a step of b rows at draft length k (None: nothing known at any size); never
        below a plain step plus `min_draft_cost` of it per drafted token (a noisy fit must not make drafting
        look free)."""
        plain = self.step_costs.predict(b, 0, 0.0)
        if plain is None or plain <= 0:
            return None
        if k == 0:
            return plain
        t = self.step_costs.predict(b, k, self._drafted(b, k))
        return max(t if t is not None else 0.0, plain * (1 + self.min_draft_cost * k))

    def speed(self, b: int, k: int, z: float = 0.0) -> float:
        cost = self.cost(b, k)
        return b * self.expected_tokens(k, z) / cost if cost else 0.0

    def choose(self, b: int) -> int:
        """The fastest k; drafting only when it beats plain decoding by `margin` (step times on a shared
        machine are noisy: a predicted gain within the noise is not worth the risk of a loss)."""
        z = self.confidence
        best = max(range(1, self.max_k + 1), key=lambda k: (self.speed(b, k, z), -k))
        return best if self.speed(b, best, z) > self.margin * self.speed(b, 0) else 0

    def _hopeless(self) -> bool:
        """Even the upper confidence bound of the first-position acceptance cannot pay the cheapest draft."""
        upper = wilson_bound(self.hits[0], self.tries[0])
        return 1.0 + upper < self.margin * (1.0 + self.min_draft_cost)

    # -- the policy -----------------------------------------------------------------------------------------
    def _explored(self, b: int) -> bool:
        c = self.step_costs
        return c.samples(b, 0) >= self.min_samples and (c.samples(b, 1) >= self.min_samples or self._hopeless())

    def next_k(self, b: int) -> int:
        """The batch's draft length for the next step of b rows (the verify pass's width - 1)."""
        self._probing = False
        if self._probe_left > 0:
            self._probe_left -= 1
            self._probing = True
            return 1
        if not self._explored(b):  # a batch size met for the first time: measure k = 1 and k = 0 there
            c = self.step_costs
            return 1 if c.samples(b, 1) <= c.samples(b, 0) and not self._hopeless() else 0
        best = self.choose(b)
        self._since_probe += 1
        if best == 0:
            if self._probed:  # the last probe lost too: probe more rarely
                self.stretch = min(self.stretch * 2, self.max_stretch)
            self._probed = False
            if self._since_probe < self.stretch:
                return 0
            self._since_probe, self._probed = 0, True
            self._probe_left, self._probing = 1, True  # two steps at k = 1 (the first carries the catch-up)
            return 1
        self.stretch, self._probed = self.probe_every, False
        if self._since_probe >= self.probe_every:
            self._since_probe, self._up = 0, not self._up
            probe = max(0, min(self.max_k, best + (1 if self._up else -1)))
            if probe != best and self._worth_probing(b, probe, best):
                self._probing = True
                return probe
        return best

    def _worth_probing(self, b: int, k: int, best: int) -> bool:
        """A neighbour of the best k is tried while it is not measured yet, or while its measured speed is
        within `probe_tolerance` of the best's (a neighbour measured far slower is not re-run every time)."""
        if self.step_costs.samples(b, k) < self.min_samples:
            return True
        return self.speed(b, k) * self.probe_tolerance >= self.speed(b, best)

    def row(self) -> RowEvidence:
        """Per-sequence state for a sequence joining the batch (the engine keeps it with the sequence)."""
        return RowEvidence()

    def row_ks(self, k: int, rows: list, caps: list[int]) -> list[int]:
        """Each row's draft length in a step whose batch draft length is k: at most k and the row's cap;
        with a drafter per row, 0 for a row whose own acceptance cannot pay for its drafting."""
        ks = [max(0, min(k, c)) for c in caps]
        if k == 0 or not self.per_row_drafting or self._probing or not rows:
            return ks
        per_token = self.step_costs.draft_cost()
        b = len(caps)
        cost = self.cost(b, k)
        if not per_token or per_token <= 0 or not cost:
            return ks
        rate = b * self.expected_tokens(k) / cost  # tokens per second of the batch at k
        first = max(self.acceptance()[0], 1e-6)
        for i, r in enumerate(rows):
            if ks[i] == 0 or r is None or not r.tries or r.tries[0] < self.row_min_tries:
                continue
            upper = wilson_bound(r.hits[0], r.tries[0])  # E(k) with a_1 at the row's own upper bound
            gain = upper * (self.expected_tokens(ks[i]) - 1.0) / first
            if gain < rate * per_token * ks[i]:
                ks[i] = 0
        return ks

    def observe(self, b: int, k: int, accepted: list[int], seconds: float, ks: list[int] | None = None,
                rows: list | None = None, timed: bool = True) -> None:
        """A step of b rows at draft length k took `seconds`; `accepted`: each row's accepted drafts; `ks`:
        each row's draft length (default k); `rows`: each row's RowEvidence (or None); timed=False: the
        step's time carries something else (rows joining or leaving), only its verdicts count."""
        ks = ks if ks is not None else [k] * b
        untimed = not timed or (k > 0 and self._plain_run >= 4)  # or carries the drafter's catch-up
        self._plain_run = self._plain_run + 1 if k == 0 else 0
        self.steps += 1
        if not untimed:
            self.step_costs.add(b, k, seconds, sum(ks) if self.per_row_drafting else k)
        fade, row_fade = 1.0 - 1.0 / self.window, 1.0 - 1.0 / self.row_window
        for i, n in enumerate(accepted if k > 0 else ()):
            if ks[i] > 0:
                add_verdict(self.hits, self.tries, ks[i], n, fade)
                if rows and rows[i] is not None:
                    add_verdict(rows[i].hits, rows[i].tries, ks[i], n, row_fade)

    def costs(self) -> dict:
        """Predicted seconds per step by batch size (1, 2, 4, 8) and k (0..3): {B: {k: seconds}}, where known."""
        out = {}
        for b in (1, 2, 4, 8):
            row = {k: t for k in range(4) if (t := self.cost(b, k)) is not None}
            if row:
                out[b] = row
        return out

    def report(self) -> dict:
        """What the policy believes now: step milliseconds, acceptance per position, its k per batch size."""
        costs = self.costs()
        if not costs:
            return {}
        return {"step_ms": {b: {k: round(t * 1000, 1) for k, t in c.items()} for b, c in costs.items()},
                "measured": {f"{b}x{k}": n for (b, k), (_, _, n) in sorted(self.step_costs.cells.items())},
                "acceptance": [round(a, 3) for a in self.acceptance()[:4]],
                "choice": {b: self.choose(b) for b in costs}}


class FixedBatchPolicy:
    def __init__(self, k: int):
        self.k = int(k)

    def next_k(self, b: int) -> int:
        return self.k

    def row(self) -> None:
        return None

    def row_ks(self, k: int, rows: list, caps: list[int]) -> list[int]:
        return [max(0, min(k, c)) for c in caps]

    def observe(self, b: int, k: int, accepted: list[int], seconds: float, ks=None, rows=None, timed=True) -> None:
        pass

    def costs(self) -> dict:
        return {}

    def report(self) -> dict:
        return {}
