"""How many tokens to draft next: fixed, or adaptive from measured costs and acceptance.

The adaptive policy keeps, as it runs, the wall time of a cycle at each draft length k (draft + verify
+ acceptance + host work, what a user waits for) and the conditional acceptance a_i at each draft
position i. It picks the k (0 = plain decoding) that maximises expected tokens per second:

    E(k) = 1 + a_1 + a_1 a_2 + ... + a_1..a_k        tokens per cycle
    S(k) = E(k) / T(k)                                T(k): seconds per cycle at length k

Unmeasured lengths are extrapolated linearly from measured ones. Every `probe_every` cycles it tries a
neighbour of the current best so a change of text (code vs prose) or of costs is noticed. When plain
decoding wins, the engine decodes plainly (pipelined, as fast as `--drafter none`) for a stretch of
tokens that doubles while drafting keeps losing, then probes again.
"""

from dataclasses import dataclass, field


class FixedPolicy:
    def __init__(self, k: int):
        self.k = k

    def next_k(self) -> int:
        return self.k

    def plain_run(self) -> int:
        return 1 << 30

    def observe(self, k: int, n_accepted: int, seconds: float, tokens: int = 1) -> None:
        pass


@dataclass
class AdaptivePolicy:
    max_k: int = 8
    probe_every: int = 16
    smoothing: float = 0.15  # weight of a new observation in the moving averages
    prior_acceptance: float = 0.5  # for positions never observed (optimistic enough to try them)
    min_stretch: int = 16
    max_stretch: int = 512
    cost: dict = field(default_factory=dict)  # k -> seconds per cycle (moving average)
    acceptance: list = field(default_factory=list)  # conditional acceptance per draft position
    cycles: int = 0
    stretch: int = 16
    best: int = 1

    def _avg(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.smoothing * (new - old)

    def expected_tokens(self, k: int) -> float:
        total, run = 1.0, 1.0
        for i in range(k):
            a = self.acceptance[i] if i < len(self.acceptance) else (self.acceptance[-1] if self.acceptance else self.prior_acceptance)
            run *= a
            total += run
        return total

    def estimated_cost(self, k: int) -> float | None:
        if k in self.cost:
            return self.cost[k]
        known = sorted(self.cost, key=lambda j: (abs(j - k), j))
        if len(known) < 2:
            return None
        a, b = sorted(known[:2])  # linear in k through the two nearest measured lengths
        slope = max((self.cost[b] - self.cost[a]) / (b - a), 0.0)
        return self.cost[a] + slope * (k - a)

    def speed(self, k: int) -> float:
        cost = self.estimated_cost(k)
        return self.expected_tokens(k) / cost if cost else 0.0

    def choose(self) -> int:
        return max(range(self.max_k + 1), key=lambda k: (self.speed(k), -k))

    def next_k(self) -> int:
        self.cycles += 1
        if len(self.cost) < 2:  # bootstrap: measure plain and one drafting length
            return 0 if 0 not in self.cost else max(1, min(2, self.max_k))
        self.best = self.choose()
        if self.cycles % self.probe_every == 0:
            probe = self.best + 1 if (self.cycles // self.probe_every) % 2 else self.best - 1
            if self.best == 0:
                probe = 1
            return max(0, min(self.max_k, probe))
        return self.best

    def plain_run(self) -> int:
        """Tokens to decode plainly now that k = 0 won; doubles while drafting keeps losing."""
        if len(self.cost) < 2:
            return 4  # bootstrap: just enough to time a plain step
        run = self.stretch
        self.stretch = min(self.stretch * 2, self.max_stretch)
        return run

    def observe(self, k: int, n_accepted: int, seconds: float, tokens: int = 1) -> None:
        """One cycle at length k (or, for k = 0, `tokens` plain tokens that took `seconds`)."""
        self.cost[k] = self._avg(self.cost.get(k), seconds / (tokens if k == 0 else 1))
        if k > 0:
            self.stretch = self.min_stretch if self.choose() > 0 else self.stretch
        for i in range(min(n_accepted + 1, k)):  # positions the draft reached with all before accepted
            while len(self.acceptance) <= i:
                self.acceptance.append(self.prior_acceptance)
            self.acceptance[i] = self._avg(self.acceptance[i], 1.0 if i < n_accepted else 0.0)


def make_policy(num_draft: int | str, max_k: int = 8):
    if num_draft == "auto":
        return AdaptivePolicy(max_k=max_k)
    return FixedPolicy(int(num_draft))
