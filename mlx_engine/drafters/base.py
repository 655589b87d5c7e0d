"""The Drafter protocol: what the engine asks of anything that proposes tokens.

Token bookkeeping shared by every drafter: after `begin` and each `commit`, the drafter knows the full
committed sequence; its last token ("the last token") has been sampled but not yet fed to the target.
`propose(k)` drafts the k tokens that follow it. The engine then verifies and calls `commit` with the
verdict: `n_accepted` drafts kept and the emitted tokens (accepted drafts + one corrected/bonus token).
"""

from dataclasses import dataclass, field
from typing import Protocol

import mlx.core as mx

from ..sampling import SamplingConfig
from ..target_model.hidden import FINAL_HIDDEN, HiddenRequest  # noqa: F401  (a drafter's request; the target captures it)


@dataclass(frozen=True)
class Draft:
    tokens: mx.array  # [k] int32, lazy
    probs: mx.array | None  # [k, V] after the sampler chain; None = deterministic (greedy / n-gram)
    host_tokens: list[int] | None = None  # set when the drafter already holds them on the host
    # a draft cut before a token a grammar forbids: the probabilities that token was drafted from ([1, V]),
    # so the acceptance rule rejects it as the uncut draft would have (core/verify.py accept_sampled)
    cut_probs: mx.array | None = None
    # [k] the largest probability of the distribution each drafted token was chosen from (set by drafters
    # that know it): under a grammar, where the host reads the draft anyway, the engine verifies only the
    # positions before the first one below its threshold (core/confidence.py)
    confidence: mx.array | None = None


@dataclass(frozen=True)
class Verdict:
    n_drafted: int
    n_accepted: int
    tokens: list[int] = field(default_factory=list)  # emitted: accepted drafts, then one target token


class Drafter(Protocol):
    name: str
    needs_hidden: bool  # wants target hidden states in begin/commit (which: `hidden_request`)
    # optional: `hidden_request: HiddenRequest` (default FINAL_HIDDEN when needs_hidden)
    # optional: `reads_target_cache = True` + `attach_target_cache(cache)`: the engine hands over its target
    # cache after prefill (a read-only view; the engine feeds any replayed tokens before `propose`)

    def begin(self, tokens: list[int], hidden: mx.array | None) -> None:
        """Start a sequence. `tokens`: committed so far (prompt + first sampled token).
        `hidden`: target hidden states [len(tokens) - 1, H'] for the fed tokens, if needs_hidden
        (H' = hidden_request.width(H))."""

    def propose(self, k: int, sampling: SamplingConfig, key: mx.array) -> Draft:
        """Draft k tokens after the last committed token. Lazy: no host synchronisation."""

    def commit(self, verdict: Verdict, hidden: mx.array | None) -> None:
        """Advance past the verdict. `hidden`: target hidden states [k + 1, H] of the verify pass
        (rows 0..n_accepted belong to kept inputs), if needs_hidden."""

    def max_draft(self) -> int | None:
        """Largest k this drafter can produce now (None = unbounded)."""


def hidden_request(drafter) -> HiddenRequest | None:
    """What `drafter` asks of the target's forward pass (None: nothing)."""
    if drafter is None or not getattr(drafter, "needs_hidden", False):
        return None
    return getattr(drafter, "hidden_request", None) or FINAL_HIDDEN


def quantize_kv(drafter, bits: int | None, group_size: int = 64) -> str | None:
    """Ask a drafter to keep its own KV cache quantized (its choice is separate from the target's).
    None when it will, else why not (it then keeps full precision). Drafters that can set
    `kv_quantizable = True` and make their caches through target.cache.quantized(..., *drafter.kv_quant)."""
    if bits is None:
        return None
    inner = getattr(drafter, "model", None) if hasattr(drafter, "ngram") else drafter  # a chain: its model drafter
    if inner is None or not getattr(inner, "kv_quantizable", False):
        name = getattr(inner, "name", None) or getattr(drafter, "name", "this drafter")
        return f"the {name} drafter keeps no quantizable KV cache"
    inner.kv_quant = (bits, group_size)
    return None
