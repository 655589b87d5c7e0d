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
own wrapper (target_model/invariant_attention.py), which handles batch caches itself while it is active.
"""

from __future__ import annotations

import sys

import mlx.core as mx
import mlx.nn as nn

from .batch_cache import BatchKVCache
from .batch_sequences import over_sequences, value_width
from .invariant_rows import active


def per_sequence(original, queries, keys, values, cache: BatchKVCache, scale: float, **kw) -> mx.array:
    """Each sequence's L queries over its own keys, causal (one query: every key; a sliding-window layer:
    its last `cache.window`), joined on the batch axis; idle rows are zeros."""
    causal = "causal" if queries.shape[2] > 1 else None
    return over_sequences(lambda q, k, v, mask=causal: original(q, k, v, cache=cache, scale=scale, mask=mask, **kw),
                          cache.lens, (queries,), (keys, values), value_width(values, getattr(cache, "group_size", 0)),
                          ragged=causal is not None, window=cache.window)


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
