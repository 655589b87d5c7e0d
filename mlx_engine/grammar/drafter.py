"""The grammar as a drafter: the tokens a grammar forces (keys, punctuation, enum tails, closing brackets)
drafted ahead of the model drafter, on by default under a grammar.

Each cycle the member is chosen on the host from the matcher's state, as a chain's is (drafters/chain.py):
"grammar" when the grammar forces a run of text from here, else the wrapped drafter's own member (or
None: plain decoding). A forced draft is the forced text tokenized as the model's tokenizer writes it
(Matcher.forced): llguidance's fast-forward tokens, which the target accepts nearly always, then the
tokens they hold back at the run's end, which could merge with the free text after it (forced TEXT is not
forced TOKENS), drafted as a guess. It is deterministic (probs None), so the usual acceptance rule keeps the
output lossless.

The wrapped drafter did not propose a grammar cycle: it is told the cycle's tokens one at a time, as
verdicts of k = 0 with one hidden row each, exactly as in a plain stretch, which every drafter follows.
"""

from __future__ import annotations

import mlx.core as mx

from ..drafters.base import Draft, Verdict
from .masks import allowed_tokens

GRAMMAR = "grammar"
MAX_FORCED = 16  # the longest forced draft of one cycle (a long const string is drafted over several)


class ForcedRunPolicy:
    """The grammar member's draft length: the whole forced run (the engine cuts it to max_draft()); it
    learns nothing, and the other members' policies never see a grammar cycle."""

    def next_k(self) -> int:
        return 1 << 30

    def begin(self, regime=None) -> None:
        pass

    def plain_run(self) -> int:
        return 0

    def observe(self, k: int, n_accepted: int, seconds: float, tokens: int = 1) -> None:
        pass


class GrammarDrafter:
    needs_hidden: bool

    def __init__(self, inner, matcher, max_forced: int = MAX_FORCED):
        """inner: the model drafter (or chain) it drafts ahead of, or None."""
        self.inner = inner
        self.matcher = matcher
        self.max_forced = max_forced
        self.name = f"{GRAMMAR}+{inner.name}" if inner is not None else GRAMMAR
        self.needs_hidden = bool(getattr(inner, "needs_hidden", False))
        if hasattr(inner, "hidden_request"):
            self.hidden_request = inner.hidden_request
        self.reads_target_cache = bool(getattr(inner, "reads_target_cache", False))
        self.primary = getattr(inner, "primary", getattr(inner, "name", None))
        self.members = dict(getattr(inner, "members", {}))  # the inner members' own policies (core/members.py)
        self.policy = ForcedRunPolicy()
        self._forced: list[int] | None = None  # this cycle's run, computed once per matcher state
        self._drafted = False  # the last proposal was the grammar's

    def forced(self) -> list[int]:
        if self._forced is None:
            self._forced = self.matcher.forced()[: self.max_forced]
        return self._forced

    # -- the drafter protocol, with "grammar" as a member ahead of the inner drafter's ---------------
    def next_member(self) -> str | None:
        if self.forced():
            return GRAMMAR
        if self.inner is None:
            return None
        return self.inner.next_member() if hasattr(self.inner, "next_member") else self.inner.name

    def begin(self, tokens: list[int], hidden: mx.array | None) -> None:
        self._forced = None
        if self.inner is not None:
            self.inner.begin(tokens, hidden)

    def attach_target_cache(self, cache) -> None:
        self.inner.attach_target_cache(cache)

    def prefill_pending(self, limit: int) -> int:
        feed = getattr(self.inner, "prefill_pending", None)
        return feed(limit) if feed is not None else 0

    def propose(self, k: int, sampling, key: mx.array) -> Draft:
        run = self.forced()
        self._drafted = bool(run)
        if run:
            run = run[:k]
            return Draft(mx.array(run, dtype=mx.int32), None, host_tokens=list(run))
        if getattr(self.inner, "takes_first_allowed", False):  # its first token chosen among the legal ones
            return self.inner.propose(k, sampling, key, first_allowed=allowed_tokens(self.matcher.mask()))
        return self.inner.propose(k, sampling, key)

    def drafts_tree(self, member: str | None = None) -> bool:
        if member == GRAMMAR or self.inner is None or not hasattr(self.inner, "drafts_tree"):
            return False
        return self.inner.drafts_tree(member)

    def propose_tree(self, k: int, sampling, key: mx.array):
        self._drafted = False
        return self.inner.propose_tree(k, sampling, key)

    def commit(self, verdict: Verdict, hidden: mx.array | None) -> None:
        self._forced = None
        if self.inner is None:
            return
        if not self._drafted:
            self.inner.commit(verdict, hidden)
            return
        self._drafted = False
        for i, tok in enumerate(verdict.tokens):  # as a plain stretch: input i's hidden row, then its token
            self.inner.commit(Verdict(0, 0, [tok]), hidden[i : i + 1] if hidden is not None else None)

    def max_draft(self) -> int | None:
        run = self.forced()
        if run:
            return len(run)
        return self.inner.max_draft() if self.inner is not None else 0

    def __getattr__(self, name):  # cycles, flush, cache, ... of the inner drafter (stats, tests, tools)
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)
