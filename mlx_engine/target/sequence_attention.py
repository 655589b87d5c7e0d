"""Attention over a batch cache, each sequence over its own keys (the batch engine's stock passes).

A BatchKVCache pads every row to the longest one, and mlx-lm attends over that padded length with an
array mask: a short stream batched beside a long prompt then attends over the long prompt's length at every
step (measured here: a plain stream's step went from 0.07 to 0.30 s while an 8k-token prompt was fed beside
it). Instead each sequence b runs MLX's own attention over exactly its first `lens[b]` keys (after the
pass: its L queries are the last L of them), causal, as it would alone: its cost is its own length's, and
its result is the call the single-sequence engine makes, not a masked one. B calls per layer instead of
one; the batch engine's B is small (`max_batch`, 8 by default). While a batch-invariant pass runs, its
own wrapper decides (it, too, takes each sequence over its own keys).

Only where the mask is the cache's own (booleans, or none): DeepSeek-V3's MLA passes its rope scores as an
additive mask, which keeps mlx-lm's padded call.

`install(model)` wraps the `scaled_dot_product_attention` each of the model's modules calls (once per
module); anything but a BatchKVCache goes to the original untouched. Batch-invariant passes have their
own wrapper (target/invariant_attention.py), which handles batch caches itself while it is active.
"""

from __future__ import annotations

import contextvars
import sys
from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn

from .batch_cache import BatchKVCache
from .invariant_rows import active


def _cut(x, b: int, n: int):
    """Sequence b's first n keys of x [B, H, S, D] (quantized: a tuple of parts)."""
    if isinstance(x, tuple):
        return tuple(p[b : b + 1, :, :n] for p in x)
    return x[b : b + 1, :, :n]


# rows of the running pass whose outputs and entries the batch engine throws away (a row waiting while
# others' prompts are fed): their attention is skipped, zeros stand in
_idle: contextvars.ContextVar[frozenset] = contextvars.ContextVar("mlx_engine_idle_rows", default=frozenset())


@contextmanager
def idle_rows(rows):
    """These rows idle too while inside (added to the rows already idle)."""
    token = _idle.set(_idle.get() | frozenset(rows))
    try:
        yield
    finally:
        _idle.reset(token)


def per_sequence(original, queries, keys, values, cache: BatchKVCache, scale: float, **kw) -> mx.array:
    """Each sequence's L queries over its own keys, causal (one query: every key), joined on the batch axis."""
    L, idle = queries.shape[2], _idle.get()
    dv = values[1].shape[-1] * cache.group_size if isinstance(values, tuple) else values.shape[-1]  # (MLA: not D)
    outs = [mx.zeros((1, queries.shape[1], L, dv), queries.dtype) if b in idle else
            original(queries[b : b + 1], _cut(keys, b, n), _cut(values, b, n), cache=cache, scale=scale,
                     mask="causal" if L > 1 else None, **kw)
            for b, n in enumerate(cache.lens)]
    return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)


def _wrap(modname: str) -> None:
    mod = sys.modules.get(modname)
    original = getattr(mod, "scaled_dot_product_attention", None) if mod is not None else None
    if original is None or getattr(original, "_mlx_engine_per_sequence", False):
        return

    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, **kw):
        plain_mask = mask is None or isinstance(mask, str) or mask.dtype == mx.bool_  # (MLA adds its rope scores)
        if isinstance(cache, BatchKVCache) and len(cache.lens) == queries.shape[0] and plain_mask \
                and not active.get():
            return per_sequence(original, queries, keys, values, cache, scale, **kw)
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, **kw)

    for name in ("_mlx_engine_batch_invariant", "_mlx_engine_tree"):  # wrappers installed before stay visible
        if getattr(original, name, False):
            setattr(scaled_dot_product_attention, name, True)
    scaled_dot_product_attention._mlx_engine_per_sequence = True
    scaled_dot_product_attention.original = getattr(original, "original", original)
    mod.scaled_dot_product_attention = scaled_dot_product_attention


def install(model: nn.Module) -> None:
    for name in {type(m).__module__ for _, m in model.named_modules()}:
        _wrap(name)
