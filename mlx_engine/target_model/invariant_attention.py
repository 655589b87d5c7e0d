"""Attention in a batch-invariant pass: mlx-lm's `scaled_dot_product_attention`, wrapped.

While a patched model runs (target_model/batch_invariant.py), a decode or verify pass's attention is computed
so that each query row gets the bits of its sequence's single-token decode step:

  * causal or unmasked attention over one sequence's cache: kernels "batch_attention" (one pass over
    the keys per query row, an order fixed by the query's own keys). Where that op has no GPU kernel
    (the CPU), each real query row runs MLX's own attention alone over exactly its keys: the decode
    step's own call, so equal to it by construction, and 2-3x cheaper there than the reference.
  * several sequences over a BatchKVCache (the batch engine; each row its own length, the mask an
    array): each sequence over its own keys `k[b, :, :lens[b]]`, its L queries the last L of them: one
    kernel launch told the row lengths (`lens`), or on a CPU one sequence and row at a time.
  * other masks: the kernels' reference with the mask.

  * a quantized KV cache (keys and values as (codes, scales, biases)): each real query row alone over
    exactly its keys through mlx-lm's quantized attention (the decode step's own call), per sequence
    over a batch cache; on every device (no kernel reads quantized keys). A float-level difference in a
    key flips its quantization code, so a quantized cache needs this more than a float one does.

Attention sinks and passes of more than MAX_ROWS queries (prefill) run stock.
"""

from __future__ import annotations

import sys

import mlx.core as mx

from .. import kernels
from ..kernels.batch_attention import attention_reference
from ..kernels.batch_attention import supported as attention_supported
from .batch_cache import BatchKVCache
from .batch_sequences import over_sequences, value_width
from .invariant_rows import MAX_ROWS, active, concat, live


def row_attention(original, q, k, v, scale: float, causal: bool, live_n: int | None, qp=None, kp=None) -> mx.array:
    """Without a GPU attention kernel: each real query row alone, over exactly the keys it sees, through
    MLX's own attention (`original`): the call of the decode step at that position. With qp / kp (MLA's
    rope part), their scores are that call's additive mask, as mlx-lm's DeepSeek-V3 decode step passes
    them. Pad rows of a fixed-row pass are zeros."""
    L, N = q.shape[2], k.shape[2]
    outs = []
    for i in range(live_n or L):
        n = N - L + i + 1 if causal else N
        mask = None if qp is None else (qp[:, :, i : i + 1] * scale) @ kp[:, :, :n].swapaxes(-1, -2)
        outs.append(original(q[:, :, i : i + 1], k[:, :, :n], v[:, :, :n], cache=None, scale=scale, mask=mask))
    out = concat(outs, axis=2)
    return mx.pad(out, [(0, 0), (0, 0), (0, L - live_n), (0, 0)]) if live_n else out


def quantized_rows(original, q, k: tuple, v: tuple, scale: float, cache, causal: bool,
                   live_n: int | None) -> mx.array:
    """Attention over a quantized cache (k, v: mlx-lm's (codes, scales, biases) triples), each real query
    row alone over its keys: original(q_row, k[:n], v[:n], cache) takes mlx-lm's quantized path (the
    cache gives its bits and group size), the decode step's call at that position."""
    def rows(q, k, v):
        L, N = q.shape[2], k[0].shape[2]
        outs = []
        for i in range(live_n or L):
            n = N - L + i + 1 if causal else N
            kn, vn = (tuple(x[:, :, :n] for x in t) for t in (k, v))
            outs.append(original(q[:, :, i : i + 1], kn, vn, cache=cache, scale=scale, mask=None))
        out = concat(outs, axis=2)
        return mx.pad(out, [(0, 0), (0, 0), (0, L - live_n), (0, 0)]) if live_n else out

    if not isinstance(cache, BatchKVCache):
        return rows(q, k, v)
    return over_sequences(rows, cache.lens, (q,), (k, v), value_width(v, cache.group_size))


def sequences_attention(original, q, k, v, scale: float, lens: list[int], qp=None, kp=None) -> mx.array:
    """Causal attention of B sequences over a batch cache, sequence b over its first lens[b] keys."""
    if kernels.backend("batch_attention") != "reference" and attention_supported(q, k, v, qp):
        return kernels.get("batch_attention")(q, k, v, scale, True, qp, kp, lens=lens)  # one launch
    return over_sequences(lambda q, qp, k, v, kp: causal_attention(original, q, k, v, scale, True, qp, kp),
                          lens, (q, qp), (k, v, kp), value_width(v))


def cache_attention(original, q, k, v, scale: float, cache, qp=None, kp=None, live_n: int | None = None,
                    causal: bool = True) -> mx.array:
    """Invariant attention over `cache`'s keys: each sequence of a BatchKVCache over its own, else one
    sequence (causal_attention)."""
    if isinstance(cache, BatchKVCache):
        return sequences_attention(original, q, k, v, scale, cache.lens, qp, kp)
    return causal_attention(original, q, k, v, scale, causal, qp, kp, live_n)


def causal_attention(original, q, k, v, scale: float, causal: bool = True, qp=None, kp=None,
                     live_n: int | None = None) -> mx.array:
    """One sequence's invariant attention (causal: its L queries are the last L of the keys)."""
    if kernels.backend("batch_attention") == "reference" and original is not None:
        return row_attention(original, q, k, v, scale, causal, live_n, qp, kp)
    if attention_supported(q, k, v, qp):
        return kernels.get("batch_attention")(q, k, v, scale, causal, qp, kp, live=live_n)
    return attention_reference(q, k, v, scale, causal, qp, kp, live=live_n)


def wrap_attention_module(modname: str) -> None:
    """Wrap the `scaled_dot_product_attention` an mlx-lm model module calls (once per module)."""
    mod = sys.modules.get(modname)
    if mod is None:
        return
    original = getattr(mod, "scaled_dot_product_attention", None)
    if original is None or getattr(original, "_mlx_engine_batch_invariant", False):
        return

    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None, **kw):
        plain = kw or sinks is not None or queries.shape[2] > MAX_ROWS
        if active.get() and not plain:
            live_n = live(queries, axis=2)
            causal = mask == "causal" or queries.shape[2] == 1  # one query, no mask: the causal case too
            # a batch cache's mask is an array: each sequence's keys are cut to its own length instead
            simple = isinstance(cache, BatchKVCache) or mask is None or mask == "causal"
            if hasattr(cache, "bits") and simple:
                return quantized_rows(original, queries, keys, values, scale, cache,
                                      causal or isinstance(cache, BatchKVCache), live_n)
            if hasattr(cache, "bits"):  # another mask over quantized keys: stock (correct, not invariant)
                return original(queries, keys, values, cache=cache, scale=scale, mask=mask)
            if simple:
                return cache_attention(original, queries, keys, values, scale, cache, live_n=live_n, causal=causal)
            return attention_reference(queries, keys, values, scale, False,
                                       mask=None if isinstance(mask, str) else mask, live=live_n)
        if sinks is not None:
            kw["sinks"] = sinks
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, **kw)

    for name in ("_mlx_engine_per_sequence", "_mlx_engine_tree"):  # wrappers installed before stay visible: a
        if getattr(original, name, False):  # second per-sequence wrapper over this one cut every row's keys twice
            setattr(scaled_dot_product_attention, name, True)
    scaled_dot_product_attention._mlx_engine_batch_invariant = True
    scaled_dot_product_attention.original = original
    mod.scaled_dot_product_attention = scaled_dot_product_attention
