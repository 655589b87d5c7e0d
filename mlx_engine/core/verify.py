"""Acceptance rules: which prefix of a draft the target keeps, and the token that follows it.

Both rules return one int32 array `[k + 2]`: `[n_accepted, t_0, ..., t_k]` where the emitted tokens are
`t_0 .. t_{n_accepted}` (the accepted drafts, then one corrected-or-bonus token). Packing the answer
into one small array is what lets the engine read it with a single host synchronisation.

Greedy (temperature 0): accept the longest prefix where draft_i == argmax(target_i); the next token is
argmax(target_{n}). Lossless by construction.

Rejection sampling (temperature > 0, Leviathan et al. / Chen et al.): accept draft x_i with probability
min(1, p_i(x_i) / q_i(x_i)); at the first rejection sample from norm(max(0, p_i - q_i)); after a full
accept sample the bonus token from p_k. The emitted sequence follows the target distribution p exactly.
Deterministic drafts (greedy drafters, n-gram) have q = one-hot(x_i): the test becomes u < p_i(x_i) and
the residual is p_i with x_i removed.
"""

import mlx.core as mx

from ..grammar.masks import apply_bitmask
from ..sampling import SamplingConfig, probabilities, process_logits, random_draws, sample


def _pack(n_accepted: mx.array, tokens: mx.array) -> mx.array:
    return mx.concatenate([n_accepted.reshape(1), tokens]).astype(mx.int32)


def accepted_prefix(accept: mx.array) -> mx.array:
    """Length of the leading run of True in a [k] bool array (scalar int32)."""
    if accept.size == 0:
        return mx.array(0, mx.int32)
    return mx.cumprod(accept.astype(mx.int32)).sum()


def accept_greedy(target_logits: mx.array, draft_tokens: mx.array) -> mx.array:
    """target_logits: [k+1, V] processed logits; draft_tokens: [k]. Returns [k+2] (see module doc)."""
    best = mx.argmax(target_logits, axis=-1)
    k = draft_tokens.shape[0]
    n = accepted_prefix(draft_tokens == best[:k])
    # accepted drafts equal the target's argmax, so t_0..t_n is just best[:n+1]
    return _pack(n, best)


def accept_sampled(
    target_probs: mx.array,
    draft_tokens: mx.array,
    draft_probs: mx.array | None,
    key: mx.array,
    cut_probs: mx.array | None = None,
) -> mx.array:
    """target_probs: [k+1, V]; draft_tokens: [k]; draft_probs: [k, V] or None (deterministic draft).

    cut_probs [1, V]: the draft went on with a token the target cannot emit (a grammar forbids it; the draft
    was cut before it), drafted from these probabilities. That token is rejected with certainty, so after
    k accepts the next token is drawn from the residual norm(max(0, p_k - cut_probs)), as the uncut draft
    would have drawn it, not from p_k (which would skew the output by P(cut) (p_k - residual)).

    Returns [k+2] (see module doc). The random draws are `random_draws(key, k)`.
    """
    k = draft_tokens.shape[0]
    uniforms, sample_uniform = random_draws(key, k)
    p_draft = mx.take_along_axis(target_probs[:k], draft_tokens[:, None], axis=-1)[:, 0]
    if draft_probs is None:
        q_draft = mx.ones_like(p_draft)
        residual = mx.put_along_axis(target_probs[:k], draft_tokens[:, None], mx.array(0.0), axis=-1)
    else:
        q_draft = mx.take_along_axis(draft_probs, draft_tokens[:, None], axis=-1)[:, 0]
        residual = mx.maximum(target_probs[:k] - draft_probs, 0.0)
    n = accepted_prefix(uniforms * q_draft < p_draft)  # u < p/q without dividing by q

    last = target_probs[k:] if cut_probs is None else mx.maximum(target_probs[k:] - cut_probs, 0.0)
    rows = mx.concatenate([residual, last], axis=0)  # row i: where to sample after i accepts
    row = mx.take(rows, n, axis=0)
    mass = row.sum()
    row = mx.where(mass > 0, row, mx.take(target_probs, n, axis=0))
    nxt = sample(row[None], None, sample_uniform.reshape(1, 1))[0]

    pos = mx.arange(k + 1)
    drafts = mx.concatenate([draft_tokens, mx.zeros((1,), draft_tokens.dtype)])
    tokens = mx.where(pos < n, drafts, nxt)
    return _pack(n, tokens)


def choose_row(logits, context, draft_tokens, draft_probs, cfg: SamplingConfig, key, masks=None,
               cut_probs=None, counts=None) -> mx.array:
    """[n_accepted, t_0..t_k] for one row of a batch: the sampling chain (a grammar's `masks` [k + 1, W]
    applied after the logit processors; `counts` [k + 1, V]: the presence / frequency penalties' per verified
    row), then the rule for its config (`cut_probs`: accept_sampled's)."""
    logits = process_logits(logits, context, cfg, counts)
    if masks is not None:
        logits = apply_bitmask(logits, masks)
    if cfg.greedy:
        return accept_greedy(logits, draft_tokens)
    return accept_sampled(probabilities(logits, cfg), draft_tokens, draft_probs, key, cut_probs)
