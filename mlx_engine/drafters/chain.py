"""Drafter chains (`ngram+mtp`, `ngram+eagle3`, `suffix+mtp`): prompt lookup (or the suffix drafter,
drafters/suffix.py) when the context has a match, the model drafter otherwise (llama.cpp's
n-gram-before-MTP chain, its PR 23269). The lookup member is any drafter with `members`, `next_member()`,
`match()` and `lookup(k)`; `self.ngram` holds it, whichever it is.

Each cycle's member ("ngram" or the model drafter's name) is known before the engine picks k
(`next_member`), so the engine keeps one draft-length policy per member: the n-gram drafts long where the
text copies (its acceptance is high once it matches), the model drafter at its own short k, or not at all
where it does not pay, without one member's misses shortening the other's drafts.

Decided per cycle on the host from the committed tokens the engine already holds (the n-gram index is a
dict on the host; no device read is added). Lossless at every temperature: which drafter drafts depends
only on the committed history, and each drafter's proposal is verified by the same rule (an n-gram draft
is deterministic: probs None = a point mass, verify.py).

The model drafter still sees every committed token and hidden state: `commit` always goes to both. A
model drafter that did not propose this cycle has nothing to trim; its pending slots (MTP / EAGLE-3)
grow and are fed in one batch the next time it proposes.
"""

from __future__ import annotations

import mlx.core as mx

from ..sampling import SamplingConfig
from .base import Draft, Verdict
from .ngram import NgramDrafter


class ChainDrafter:
    needs_hidden: bool

    def __init__(self, model_drafter, ngram=None):
        """ngram: the lookup member (default: prompt lookup, NgramDrafter)."""
        self.model = model_drafter
        self.ngram = ngram or NgramDrafter()
        self.name = f"{self.ngram.name}+{model_drafter.name}"
        self.members = {**self.ngram.members, model_drafter.name: model_drafter}  # the n-gram's match classes
        self.primary = model_drafter.name  # the member the engine's own policy serves (the others get theirs)
        self.needs_hidden = bool(getattr(model_drafter, "needs_hidden", False))
        if hasattr(model_drafter, "hidden_request"):
            self.hidden_request = model_drafter.hidden_request
        self.cycles = {self.ngram.name: 0, model_drafter.name: 0}  # which drafter drafted, per cycle
        self.last = None  # the member that drafted the last cycle

    def begin(self, tokens: list[int], hidden: mx.array | None) -> None:
        self.ngram.begin(tokens, None)
        self.model.begin(tokens, hidden)

    def prefill_pending(self, limit: int) -> int:
        """The model drafter's pending prompt, a piece at a time (the n-gram has none)."""
        feed = getattr(self.model, "prefill_pending", None)
        return feed(limit) if feed is not None else 0

    def keepable(self) -> bool:
        """The model drafter's state can go to the prefix tree (the n-gram index is rebuilt from tokens)."""
        return bool(getattr(self.model, "keepable", lambda: False)())

    def prefix_states(self) -> tuple[list, int]:
        return self.model.prefix_states()

    def restore(self, states: list, n: int) -> None:
        self.model.restore(states, n)

    def next_member(self) -> str:
        """Who drafts the next cycle: the lookup member when the context has a match ("ngram" or
        "ngram:long" by its length; "suffix" / "suffix:long"), else the model drafter."""
        return self.ngram.next_member() or self.model.name

    @property
    def takes_first_allowed(self) -> bool:
        """Whether the model member takes a grammar's first-position mask (the lookup member's drafts are cut)."""
        return bool(getattr(self.model, "takes_first_allowed", False))

    def propose(self, k: int, sampling: SamplingConfig, key: mx.array, first_allowed: mx.array | None = None) -> Draft:
        member = self.ngram.next_member()
        found = self.ngram.lookup(k)
        if found:
            self.last = member
            self.cycles[self.ngram.name] += 1
            return Draft(mx.array(found, dtype=mx.int32), None, host_tokens=found)
        self.last = self.model.name
        self.cycles[self.model.name] += 1
        if first_allowed is not None:
            return self.model.propose(k, sampling, key, first_allowed=first_allowed)
        return self.model.propose(k, sampling, key)

    def drafts_tree(self, member: str | None = None) -> bool:
        """Whether `member` drafts token trees (the suffix drafter's classes do; prompt lookup does not)."""
        owner = self.model if member == self.model.name else self.ngram
        return bool(getattr(owner, "drafts_tree", lambda m: False)(member))

    def propose_tree(self, k: int, sampling: SamplingConfig, key: mx.array):
        """The lookup member's tree when the context has a match, else the model drafter's."""
        member = self.next_member()
        owner = self.model if member == self.model.name else self.ngram
        self.last = member
        self.cycles[owner.name] += 1
        return owner.propose_tree(k, sampling, key)

    def commit(self, verdict: Verdict, hidden: mx.array | None) -> None:
        self.ngram.commit(verdict, None)
        self.model.commit(verdict, hidden)

    def max_draft(self) -> int | None:
        return None if self.ngram.match() else self.model.max_draft()

    def __getattr__(self, name):  # flush, cache, history, ... of the model drafter (tests, tools)
        if name == "model":
            raise AttributeError(name)
        return getattr(self.model, name)
