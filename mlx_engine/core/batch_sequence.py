"""The batch engine's per-sequence records: a running sequence's state, its drafts and emitted tokens, its
figures, and a step's output."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import mlx.core as mx

from ..drafters.base import Draft
from ..grammar.masks import allowed_tokens
from ..sampling import SamplingConfig


@dataclass
class Output:
    """What a step produced for one sequence: new token ids, and when it ended, why and its figures.
    `logprobs` (asked for at add()): one sampling.TokenLogprob per token, the target's."""

    seq_id: object
    tokens: list[int]
    finished: str | None = None  # "stop" (a stop token) | "length" (max_tokens) | "cancelled"
    stats: dict | None = None
    logprobs: list | None = None


@dataclass
class RunningSequence:
    """A sequence in the running batch: its request, its drafter, where it stands, its figures."""

    id: object
    prompt: list[int]
    max_tokens: int
    sampling: SamplingConfig
    stop_tokens: frozenset[int]
    key: mx.array
    drafter: object
    history: list[int]
    last: int
    reused: int = 0
    max_draft: int | None = None  # the request's own ceiling on its draft length (None: the policy's)
    evidence: object = None  # the batch policy's per-row state (its own acceptance)
    hidden_rows: list = field(default_factory=list)  # its tokens' target hidden rows (a drafter that reads them)
    generated: int = 1
    drafted: int = 0
    accepted: int = 0
    verifies: int = 0  # steps that drafted (plain steps are not verify passes)
    verified_tokens: int = 0  # tokens those steps emitted
    prompt_time: float = 0.0
    t_decode: float = field(default_factory=time.perf_counter)
    decode_time: float = 0.0
    cancelled: bool = False
    matcher: object = None  # the request's grammar state (grammar/matcher.py), or None: unconstrained
    grammar_drafts: bool = True  # its grammar's forced tokens are drafted
    forced: int = 0  # tokens its grammar drafted (forced text), apart from `drafted`
    forced_accepted: int = 0
    logprobs: int | None = None  # the request's logprobs (None: off; 0: the token's; n: and the top n)
    counts: Counter = field(default_factory=Counter)  # its generated tokens (presence / frequency penalties)

    def next_key(self) -> mx.array:
        self.key, k = mx.random.split(self.key)
        return k

    def propose(self, k: int) -> Draft:
        """k drafts from the row's own drafter. One that found fewer (prompt lookup) is padded with copies of
        the last token: lossless, a padded draft is checked like any other (kept only where the target
        agrees); `n_real` says how many were drafted."""
        if self.matcher is not None and getattr(self.drafter, "takes_first_allowed", False):  # its first token legal
            d = self.drafter.propose(k, self.sampling, self.next_key(), first_allowed=allowed_tokens(self.matcher.mask()))
        else:
            d = self.drafter.propose(k, self.sampling, self.next_key())
        n = d.tokens.shape[0]
        if n == k:
            return d
        pad = mx.full((k - n,), self.last, dtype=mx.int32)
        out = Draft(mx.concatenate([d.tokens.astype(mx.int32), pad]), None)
        object.__setattr__(out, "n_real", n)
        return out

    def emit(self, tokens: list[int]) -> tuple[list[int], str | None]:
        """Take a verdict's tokens, cut at max_tokens and after a stop token. -> (tokens, why it ended or None)."""
        tokens = tokens[: self.max_tokens - self.generated]
        reason = None
        for i, t in enumerate(tokens):
            if t in self.stop_tokens:
                tokens, reason = tokens[: i + 1], "stop"
                break
        self.generated += len(tokens)
        self.history += tokens
        self.counts.update(tokens)
        if reason is None and self.generated >= self.max_tokens:
            reason = "length"
        return tokens, reason

    def stats(self, num_draft) -> dict:
        d, a, v, g = self.drafted, self.accepted, self.verifies, self.generated
        return {
            "num_draft": num_draft, "drafted": d, "accepted": a, "acceptance": a / d if d else 0.0,
            "verify_passes": v, "tokens_per_verify": self.verified_tokens / v if v else 0.0,
            "decode_tokens_per_second": (g - 1) / self.decode_time if self.decode_time > 0 else 0.0,
            "prompt_tokens": len(self.prompt), "completion_tokens": g, "reused_prompt_tokens": self.reused,
            "prompt_seconds": self.prompt_time, "decode_seconds": self.decode_time,
            "forced": self.forced, "forced_accepted": self.forced_accepted,
            "grammar_seconds": self.matcher.seconds if self.matcher is not None else 0.0,
            # the names of core/stats.py's SpecStats, for callers that read those
            "cycles": v, "generated": g, "decode_time": self.decode_time,
        }


def padded(d: Draft | None, k: int, last: int) -> Draft:
    """A row's draft (None: it drafted nothing) padded to the pass's k with copies of its last token; the
    acceptance rule reads only the row's own drafts, so the padding is never emitted."""
    n = d.tokens.shape[0] if d is not None else 0
    if n == k:
        return d
    tokens = mx.full((k - n,), last, dtype=mx.int32)
    if d is not None:
        tokens = mx.concatenate([d.tokens.astype(mx.int32), tokens])
    sure = d.confidence if d is not None else None
    if sure is not None:  # (the padding's confidence 0: never verified as a draft of its own anyway)
        sure = mx.concatenate([sure.astype(mx.float32), mx.zeros((k - n,), mx.float32)])
    out = Draft(tokens, d.probs if d is not None else None, cut_probs=d.cut_probs if d is not None else None,
                confidence=sure)
    object.__setattr__(out, "n_real", min(getattr(d, "n_real", n), n) if d is not None else 0)
    return out
