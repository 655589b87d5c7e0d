"""How many tokens to draft next: fixed, or adaptive from measured costs and acceptance.

The adaptive policy keeps, as it runs, the wall time of a cycle at each draft length k (draft + verify
+ acceptance + host work, what a user waits for) and the conditional acceptance a_i at each draft
position i. It picks the k (0 = plain decoding) that maximises expected tokens per second:

    E(k) = 1 + a_1 + a_1 a_2 + ... + a_1..a_k        tokens per cycle
    S(k) = E(k) / T(k)                                T(k): seconds per cycle at length k

a_i is a Beta-smoothed estimate from decayed counts, so one lucky or unlucky draft does not flip the
choice. The memory is about `window` tokens of text: counts decay with each draft at their position and
with each token decoded plainly, so after a long plain stretch the next burst measures the text as it is
now. T(k) is a moving average; unmeasured lengths are extrapolated linearly from the two nearest measured
ones. The first drafting cycle after a plain stretch is not timed: it carries the drafter's catch-up over
the stretch, which is the stretch's cost, not k's (when k has no measure yet, it stands in until the next
timed cycle at k replaces it).

Optimistic start: with no evidence at all it drafts at k = `bootstrap_k` (1) from the first cycle, a
burst of `bootstrap_cycles` cycles, then decodes `bootstrap_tokens` tokens plainly to time plain
decoding, and chooses. A short answer is drafted from its start; a useless drafter costs those few cycles
once. A drafter whose drafts cost nothing on the device (prompt lookup) starts at its longest draft
instead: one burst then measures the acceptance at every position and the cost of a long verify, where
climbing from k = 1 by probes would take hundreds of cycles.

While drafting wins, every `probe_every` cycles it tries a neighbour of the best k (k+1, then k-1, which
can be a short plain stretch), so a change of text or of costs is noticed. While plain decoding wins, the
engine decodes plainly (pipelined, as fast as `--drafter none`) for a stretch of tokens, then drafts a
burst of up to ~1/16 of the stretch's tokens (at least `probe_cycles`) to re-measure acceptance; the
stretch doubles while drafting keeps losing. A burst ends early once even the upper confidence bound of
its own acceptance loses to plain decoding, so a useless drafter costs a few cycles per stretch (a cycle
that drafts in vain costs one verify pass for one token), while a drafter near break-even gets the whole
burst, enough drafts to come back.

Costs are kept per range of context length (`at_context`: one table below `context_bucket_from` tokens,
then one per doubling): attention grows with the context, and on some devices a verify pass's cost
relative to a plain step grows with it (this CPU: t(8)/t(1) ~1.6 at 1k tokens, ~3 at 8k). A conversation
that grows into a new range re-measures its costs there (an optimistic burst and a plain stretch, as at
the start) instead of trusting costs from shorter contexts; acceptance is kept across ranges.

Trees (`tree=True`, drafters of token trees, core/tree_verify.py): k is the tree's size in nodes, listed
best first by the drafter, and a_i is the MARGINAL acceptance of the i-th best node (how often it lies on
the accepted path), so E(n) = 1 + a_1 + ... + a_n; a chain is the tree whose i-th node is accepted iff the
first i are, so chain cycles count the same way. Sizes past the measured ranks extrapolate the last two
ranks' ratio. The size is then chosen from measured t(n) as k is.
"""

import copy
import math
from dataclasses import dataclass, field

from .estimates import add_verdict, expected_tokens, extrapolate, smoothed_acceptance, wilson_bound


class FixedPolicy:
    def __init__(self, k: int):
        self.k = k

    def next_k(self) -> int:
        return self.k

    def begin(self, regime=None) -> None:
        pass

    def plain_run(self) -> int:
        return 1 << 30

    def observe(self, k: int, n_accepted: int, seconds: float, tokens: int = 1) -> None:
        pass


@dataclass
class AdaptivePolicy:
    max_k: int = 8
    probe_every: int = 16  # while drafting: cycles between tries of a neighbouring length
    probe_cycles: int = 4  # while plain wins: drafting cycles after each plain stretch
    bootstrap_tokens: int = 8  # the first plain stretch (after the first burst), to time a plain token
    bootstrap_cycles: int = 4  # the first drafting burst, at k = bootstrap_k, from the first cycle (optimistic start)
    bootstrap_k: int = 1
    smoothing: float = 0.1  # weight of a new cycle time in the moving averages
    window: float = 128.0  # memory of the acceptance counts, in drafts per position
    prior_acceptance: float = 0.5  # Beta prior: optimistic enough that unobserved positions get tried
    prior_weight: float = 2.0
    min_step_cost: float = 0.05  # extrapolated cycle costs grow by at least this many plain tokens per draft
    min_stretch: int = 16
    max_stretch: int = 512
    context_bucket_from: int = 2048  # costs are learnt per context range: below this, then per doubling
    tree: bool = False  # k counts tree nodes; acceptance[i] is the i-th best node's marginal acceptance
    cost: dict = field(default_factory=dict)  # k -> seconds per cycle (per token for k = 0), this context range
    acceptance: list = field(default_factory=list)  # conditional acceptance estimate per draft position
    hits: list = field(default_factory=list)  # decayed accepted counts per position
    tries: list = field(default_factory=list)  # decayed drafted counts per position
    stretch: int = 16
    best: int = 1
    _burst: int = 0  # drafting cycles left in the current burst
    _burst_k: int = 1
    _in_burst: bool = False
    _burst_hits: int = 0  # first-position accepts and drafts of the current burst alone
    _burst_tries: int = 0
    _plain_left: int = 0  # plain tokens still owed to the current stretch (carried across generations)
    _last_stretch: int = 0
    _after_plain: bool = False  # a plain stretch just ended
    _untimed: bool = False  # the next drafting cycle carries the drafter's catch-up
    _provisional: set = field(default_factory=set)  # lengths whose cost so far comes from an untimed cycle
    _since_probe: int = 0
    _up: bool = False
    _bucket: int = 0  # the context range whose costs `cost` holds
    _costs: dict = field(default_factory=dict)  # other context ranges' cost tables
    _ranks: list | None = None  # the accepted nodes of the tree cycle about to be observed (observe_tree)
    _regime: object = None  # the regime (sampling config) being learnt; others are kept in _learnt
    _learnt: dict = field(default_factory=dict)

    def _avg(self, old: float | None, new: float, weight: float) -> float:
        return new if old is None else old + weight * (new - old)

    def expected_tokens(self, k: int) -> float:
        if self.tree:
            return tree_expected_tokens(self.acceptance, k, self.prior_acceptance)
        return expected_tokens(self.acceptance, k, self.prior_acceptance)

    def estimated_cost(self, k: int) -> float | None:
        # linear in k through the two nearest measured lengths, but never flatter than `min_step_cost` plain
        # tokens per drafted token: a noisy or flat pair of measures (a k = 1 cycle timed as cheap as a plain
        # token) must not make k = 8 look free
        if not self.cost:
            return None
        return extrapolate(self.cost, k, self.min_step_cost * self.cost.get(0, min(self.cost.values())))

    def speed(self, k: int) -> float:
        cost = self.estimated_cost(k)
        return self.expected_tokens(k) / cost if cost else 0.0

    def choose(self, lowest: int = 0) -> int:
        return max(range(lowest, self.max_k + 1), key=lambda k: (self.speed(k), -k))

    def _start_burst(self, cycles: int) -> int:
        self._burst_k = self.choose(lowest=1) if len(self.cost) >= 2 else min(self.bootstrap_k, self.max_k)
        self._burst, self._in_burst = cycles - 1, True
        self._burst_hits = self._burst_tries = 0
        return self._burst_k

    def _burst_hopeless(self) -> bool:
        """The burst so far rules drafting out: even the upper confidence bound of its own first-position
        acceptance would not make drafting at the burst's k beat plain decoding. Ends a useless drafter's
        burst after a few cycles; a drafter near break-even keeps its whole burst."""
        k = self._burst_k
        if self._burst_tries < self.probe_cycles or k not in self.cost or 0 not in self.cost:
            return False
        upper = wilson_bound(self._burst_hits, self._burst_tries)
        rest = self.expected_tokens(k) - 1.0
        first = self.acceptance[0] if self.acceptance else self.prior_acceptance
        optimistic = 1.0 + upper * (rest / first if first > 0 else 1.0)  # E(k) with a_1 at its upper bound
        return optimistic / self.cost[k] < 1.0 / self.cost[0]

    def next_k(self) -> int:
        if self._burst > 0:
            if self._burst_hopeless():
                self._burst = 0
            else:
                self._burst -= 1
                return self._burst_k
        if not self.cost.keys() - {0}:  # no drafting measured (a plain token's cost may be shared by another
            # member's policy, core/members.py): optimistic start, draft at bootstrap_k from the first cycle
            return self._start_burst(self.bootstrap_cycles)
        if 0 not in self.cost or self._plain_left > 0:
            return 0  # time plain decoding (after the first burst), or the rest of a plain stretch
        if self._after_plain:
            self._after_plain = False
            if len(self.cost) < 2:
                return self._start_burst(self.bootstrap_cycles)
            if not self._in_burst and (self.best == 0 or self.choose() == 0):  # plain was chosen (not a
                # probe): re-measure in a burst in proportion to the stretch, ~1/16 of its tokens, cut short
                # if hopeless. (After the first burst and its timing stretch, that burst decides below.)
                return self._start_burst(max(self.probe_cycles, self._last_stretch // 16))
        if self._in_burst:
            self._in_burst = False
            if self.choose() == 0:  # the burst lost too: decode plainly for longer
                self.stretch = min(self.stretch * 2, self.max_stretch)
                self.best, self._plain_left = 0, self.stretch
                return 0
        self.best = self.choose()
        self.stretch = self.min_stretch  # plain stretches start short again once drafting has won
        if self.best == 0:
            self._plain_left = self.stretch
            return 0
        self._since_probe += 1
        if self._since_probe >= self.probe_every:
            self._since_probe, self._up = 0, not self._up
            probe = max(0, min(self.max_k, self.best + (1 if self._up else -1)))
            if probe == 0:
                self._plain_left = self.stretch
            return probe
        return self.best

    def begin(self, regime=None) -> None:
        """A new generation: its first drafting cycle carries the drafter's prefill, so it is not timed.

        `regime` (the engine passes the sampling config): what was learnt is kept per regime, since a draft
        accepted at temperature 0 is not accepted alike at 0.7, nor does a sampled cycle cost the same."""
        if regime != self._regime:
            self._learnt[self._regime] = copy.deepcopy(self._state())
            vars(self).update(self._learnt.pop(regime, None) or self._fresh_state())
            self._regime = regime
        self._untimed = True

    def at_context(self, tokens: int) -> None:
        """The cache holds `tokens` tokens: use (or start) the cost table of that context range."""
        b = 0 if tokens < self.context_bucket_from else int(math.log2(tokens / self.context_bucket_from)) + 1
        if b == self._bucket:
            return
        self._costs[self._bucket] = self.cost
        self.cost = self._costs.pop(b, None) or {}
        self._provisional = set()
        self._bucket = b

    def for_member(self, **settings) -> "AdaptivePolicy":
        """A fresh policy with these settings but `settings` (max_k, bootstrap_k): a chain member's
        (core/members.py)."""
        return type(self)(**{**{k: getattr(self, k) for k in _SETTINGS}, **settings})

    def _state(self) -> dict:
        """Everything learnt or in progress (every field but the settings and the per-regime store)."""
        return {k: v for k, v in vars(self).items() if k not in _SETTINGS and k not in ("_learnt", "_regime")}

    def _fresh_state(self) -> dict:
        return type(self)(**{k: getattr(self, k) for k in _SETTINGS})._state()

    def plain_run(self) -> int:
        """Tokens to decode plainly now that next_k() returned 0 (what is left of the stretch)."""
        return self.bootstrap_tokens if 0 not in self.cost else max(1, self._plain_left)

    def observe(self, k: int, n_accepted: int, seconds: float, tokens: int = 1) -> None:
        """One cycle at length k (or, for k = 0, a plain stretch of `tokens` tokens that took `seconds`)."""
        decay = 1.0 - 1.0 / self.window
        if k == 0:
            if tokens > 0:  # a stretch weighs by its length: its first token is not pipelined
                weight = 1.0 - (1.0 - self.smoothing) ** (tokens / 8)
                self.cost[0] = self._avg(self.cost.get(0), seconds / tokens, weight)
                # acceptance evidence fades with the text decoded since: after a long stretch the next
                # burst measures the text as it is now, not as it was
                self.hits = [h * decay**tokens for h in self.hits]
                self.tries = [t * decay**tokens for t in self.tries]
                self._estimate()
            self._untimed = True
            self._plain_left -= tokens
            self._last_stretch += tokens
            if self._plain_left <= 0:  # the stretch is done (possibly over several generations)
                self._plain_left, self._after_plain = 0, True
            return
        self._last_stretch = 0
        if k not in self.cost or (k in self._provisional and not self._untimed):
            self.cost[k] = seconds  # a first measure; an untimed one only until a timed one replaces it
            (self._provisional.add if self._untimed else self._provisional.discard)(k)
        elif not self._untimed:
            self.cost[k] = self._avg(self.cost[k], seconds, self.smoothing)
        self._untimed = False
        if self._in_burst:
            self._burst_hits += int(n_accepted > 0)
            self._burst_tries += 1
        if self.tree:  # each node a try at its rank; the accepted ones (a chain: the first n) hits
            ranks, self._ranks = (self._ranks if self._ranks is not None else range(n_accepted)), None
            add_ranks(self.hits, self.tries, k, ranks, decay)
        else:
            add_verdict(self.hits, self.tries, k, n_accepted, decay)
        self._estimate()

    def observe_tree(self, k: int, accepted: list[int]) -> None:
        """The next `observe` is a tree cycle of k nodes whose accepted nodes were `accepted` (their ranks)."""
        self._ranks = list(accepted)

    def _estimate(self) -> None:
        """Beta-smoothed conditional acceptance per position; a deeper position's prior is no higher than
        the estimate of the position before it (drafts rarely get easier further out), so a position seen a
        few times does not look better than the evidence above it."""
        self.acceptance = smoothed_acceptance(self.hits, self.tries, self.prior_acceptance, self.prior_weight)


# the settings of AdaptivePolicy (a new setting goes here; every other field is learnt state)
_SETTINGS = ("max_k", "probe_every", "probe_cycles", "bootstrap_tokens", "bootstrap_cycles", "bootstrap_k", "smoothing",
             "window", "prior_acceptance", "prior_weight", "min_step_cost", "min_stretch", "max_stretch",
             "context_bucket_from", "tree")


def add_ranks(hits: list[float], tries: list[float], k: int, accepted, decay: float) -> None:
    """Count one tree of k nodes (in place): every rank a try, the accepted ranks hits, older counts decayed."""
    accepted = set(accepted)
    while len(tries) < k:
        hits.append(0.0)
        tries.append(0.0)
    for i in range(k):
        hits[i] = hits[i] * decay + (1.0 if i in accepted else 0.0)
        tries[i] = tries[i] * decay + 1.0


def tree_expected_tokens(marginals: list[float], k: int, default: float) -> float:
    """E(n) = 1 + a_1 + ... + a_n for marginal node acceptances; ranks past the estimates continue the last
    two's ratio (a geometric tail), or take `default` halving per rank when there is no estimate."""
    total, last = 1.0, None
    ratio = min(1.0, marginals[-1] / marginals[-2]) if len(marginals) >= 2 and marginals[-2] > 0 else 0.5
    for i in range(k):
        last = marginals[i] if i < len(marginals) else (last if last is not None else default) * ratio
        total += last
    return total


def make_policy(num_draft: int | str, max_k: int = 8):
    if num_draft == "auto":
        return AdaptivePolicy(max_k=max_k)
    return FixedPolicy(int(num_draft))
