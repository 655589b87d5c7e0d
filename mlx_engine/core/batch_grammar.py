"""The batch engine's rows under a grammar (mlx_engine/grammar): each constrained row keeps its own matcher,
and a step does for it what core/engine.py does for one sequence, without touching the other rows.

Before the pass: a row whose grammar forces text drafts that run (the grammar as a drafter; its model
drafter drafts nothing for it this step), any other constrained row's model draft is cut at its first
token the grammar forbids (the drafts of all such rows read in one host read). While the device runs the
pass: each constrained row's masks along its draft. After the verdict: its matcher settled to the kept
drafts and the token after them. An unconstrained row is never cut, masked or slowed down beyond the
pass's width; speculation stays on for every row.
"""

from __future__ import annotations

import mlx.core as mx

from .. import host
from ..drafters.base import Draft
from ..grammar.masks import allowed_tokens
from ..grammar.drafter import MAX_FORCED
from .confidence import CONFIDENT, confident_prefix


def forced_runs(seqs, decoding: list[int], ks: list[int], cap: int) -> dict[int, list[int]]:
    """{row: the tokens its grammar forces from here} for constrained decoding rows (cut to `cap` and to the
    row's room before max_tokens); those rows' model drafters draft nothing this step (ks set to 0)."""
    out = {}
    for i in decoding:
        s = seqs[i]
        if s.matcher is None or not s.grammar_drafts:
            continue
        run = s.matcher.forced()[: min(cap, MAX_FORCED, s.max_tokens - s.generated - 1)]
        if run:
            out[i] = run
            ks[i] = 0
    return out


def cut_drafts(seqs, decoding: list[int], ks: list[int], drafts: dict, forced: dict,
               threshold: float = CONFIDENT) -> dict[int, list[int]]:
    """Put the forced runs in as drafts and cut every other constrained row's draft at its first illegal
    token, or before its first position below `threshold` where the draft carries its confidence
    (core/confidence.py), whichever comes first (one host read for all of them). Updates `ks` and `drafts`;
    -> {row: its draft on the host}."""
    on_host = {}
    for i, run in forced.items():
        drafts[i] = Draft(mx.array(run, dtype=mx.int32), None, list(run))
        object.__setattr__(drafts[i], "n_real", len(run))
        ks[i] = len(run)
        on_host[i] = list(run)
    rows = [i for i in decoding if seqs[i].matcher is not None and i not in forced and ks[i] > 0]
    if rows:
        sure_rows = [i for i in rows if drafts[i].confidence is not None]
        tokens_flat = mx.concatenate([drafts[i].tokens[: ks[i]].astype(mx.int32) for i in rows])
        if sure_rows:
            flat, conf = host.read_all(tokens_flat, mx.concatenate(
                [drafts[i].confidence[: ks[i]].astype(mx.float32) for i in sure_rows]))
        else:
            flat, conf = host.read(tokens_flat), []
        at = c_at = 0
        for i in rows:
            tokens, at = flat[at : at + ks[i]], at + ks[i]
            sure = None
            if drafts[i].confidence is not None:
                sure, c_at = confident_prefix(conf[c_at : c_at + ks[i]], threshold), c_at + ks[i]
            ks[i] = seqs[i].matcher.legal(tokens[:sure])
            on_host[i] = tokens[: ks[i]]
            d = drafts[i]
            drafts[i] = first(d, ks[i])
            if ks[i] < len(tokens[:sure]) and d.probs is not None:  # the cut token's q (core/verify.py accept_sampled)
                object.__setattr__(drafts[i], "cut_probs", d.probs[ks[i] : ks[i] + 1])
    for i in decoding:
        if seqs[i].matcher is not None and i not in on_host:
            on_host[i] = []
    return on_host


def first(d: Draft, n: int) -> Draft:
    """A draft's first n tokens (and probabilities), its count of real drafts kept."""
    out = Draft(d.tokens[:n], d.probs[:n] if d.probs is not None else None, cut_probs=d.cut_probs)
    object.__setattr__(out, "n_real", min(getattr(d, "n_real", n), n))
    return out


def first_allowed(rows: list) -> mx.array | None:
    """[len(rows), V'] bool for a batched head's first draft step: the tokens each row's grammar allows at its
    first draft position (rows: a sequence whose grammar holds its draft, or None: every token); None when
    no row has a grammar."""
    masks = [allowed_tokens(s.matcher.mask()) if s is not None else None for s in rows]
    if all(m is None for m in masks):
        return None
    width = next(m.shape[0] for m in masks if m is not None)
    return mx.stack([m if m is not None else mx.ones((width,), mx.bool_) for m in masks])


def masks(seqs, on_host: dict[int, list[int]]) -> dict:
    """{row: [k_i + 1, W] masks along its draft}; each matcher is left advanced through its draft."""
    return {i: seqs[i].matcher.masks(tokens) for i, tokens in on_host.items()}
