"""A target pass over a token tree, and the cache operation that keeps one path of it.

The pass (`tree_pass`): the verify inputs are the root (the last committed token) and the tree's nodes,
each row at RoPE position P + its depth (P: tokens the cache holds), attending to the P cached tokens and
to its own ancestors and itself only. No model class is forked:
- the mask: every layer cache's `make_mask` (what mlx-lm's `create_attention_mask` asks the cache for)
  answers the tree mask for the pass, [L, P + L] bool;
- the positions: the model's RoPE modules are wrapped once (the instance's class swapped for a subclass,
  as target_model/model.py captures hidden states) to rotate row i at its own position while a pass is on:
  `mx.fast.rope` over the rows as a batch of one-token sequences, each at its own offset, the very
  computation of a one-token step at that position.

Compaction (`compact`): after the pass the cache holds the P tokens and all L rows; the kept path's rows
(the root first, then the accepted nodes, in order) are moved to positions P, P + 1, ... and the rest cut
off: an exact copy of entries, each at the position it was rotated for (a node's position is its depth,
and the kept path's node at depth d lands at P + d). Only plain and quantized KV caches can do this;
recurrent states (their state after a node mixes its siblings' nothing, but a snapshot per node is not
kept) and rotating windows cannot: `unsupported` says why, and the engine drafts the best chain instead.
"""

from __future__ import annotations

import contextlib
import sys
from contextvars import ContextVar

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from .. import host, kernels
from ..kernels.batch_attention import supported as attention_supported
from .fixed_rows import fixed_rows
from .mla import is_deepseek_mla

_positions: ContextVar = ContextVar("mlx_engine_tree_positions", default=None)
_bits: ContextVar = ContextVar("mlx_engine_tree_bits", default=None)  # per row: the rows it sees (host ints)


def _is_rope(module) -> bool:
    name = type(module).__name__
    return "RoPE" in name or "Rotary" in name or "Rope" in name


def _install_rope(module: nn.Module) -> None:
    cls = type(module)
    if getattr(cls, "_mlx_engine_tree_rope", False):
        return

    def __call__(self, x, offset=0, *args, **kwargs):
        pos = _positions.get()
        if pos is not None and x.ndim == 4 and x.shape[0] == 1 and x.shape[2] == pos.shape[0]:
            # [1, H, L, D] -> L one-token sequences [L, H, 1, D], sequence i at position pos[i]
            y = cls.__call__(self, x.swapaxes(0, 2), pos, *args, **kwargs)
            return y.swapaxes(0, 2)
        return cls.__call__(self, x, offset, *args, **kwargs)

    module.__class__ = type(cls.__name__, (cls,), {"__call__": __call__, "_mlx_engine_tree_rope": True})


def install(model: nn.Module) -> int:
    """Wrap the model's RoPE modules (once); returns how many there are (0: trees cannot place positions)."""
    found = [m for _, m in model.named_modules() if _is_rope(m)]
    for m in found:
        _install_rope(m)
    return len(found)


def unsupported(caches: list, model: nn.Module | None = None) -> str | None:
    """Why this model's cache cannot verify trees (None: it can)."""
    for c in caches:
        if type(c) not in (KVCache, QuantizedKVCache):
            return f"its {type(c).__name__} layers cannot keep one branch of a tree (only KV caches compact)"
    if model is not None and install(model) == 0:
        return "no RoPE module found to place tree nodes at their depths"
    return None


def install_invariant(model: nn.Module) -> str | None:
    """Make a batch-invariant model's tree passes invariant (see the module docstring); why not, or None."""
    if fixed_rows(model) is not None:
        return "fixed-row passes verify chains only"
    if any(is_deepseek_mla(m) for _, m in model.named_modules()):
        return "batch-invariant MLA attention verifies chains only (its rope scores ride in the mask)"
    for name in {type(m).__module__ for _, m in model.named_modules()}:
        mod = sys.modules.get(name)
        inner = getattr(mod, "scaled_dot_product_attention", None)
        if inner is not None and getattr(inner, "_mlx_engine_batch_invariant", False) \
                and not getattr(inner, "_mlx_engine_tree", False):
            mod.scaled_dot_product_attention = _tree_attention(inner)
    return None


def _tree_attention(inner):
    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, **kw):
        bits = _bits.get()
        L = queries.shape[2]
        if bits is None or len(bits) != L or kw or queries.shape[0] != 1:
            return inner(queries, keys, values, cache=cache, scale=scale, mask=mask, **kw)
        quantized = isinstance(keys, tuple)  # (codes, scales, biases): no kernel reads them
        if not quantized and kernels.backend("batch_attention") != "reference" \
                and attention_supported(queries, keys, values):
            return kernels.get("batch_attention")(queries, keys, values, scale, True, tree=bits)
        P = (keys[0] if quantized else keys).shape[2] - L

        def take(a, idx):
            return tuple(mx.take(x, idx, axis=2) for x in a) if quantized else mx.take(a, idx, axis=2)

        rows = []
        for i, b in enumerate(bits):  # the decode step's own call: one query over exactly its keys
            idx = mx.array(list(range(P)) + [P + t for t in range(L) if (b >> t) & 1], dtype=mx.int32)
            rows.append(inner(queries[:, :, i : i + 1], take(keys, idx), take(values, idx),
                              cache=cache, scale=scale, mask=None))
        return mx.concatenate(rows, axis=2)

    scaled_dot_product_attention._mlx_engine_batch_invariant = True
    scaled_dot_product_attention._mlx_engine_tree = True
    scaled_dot_product_attention.original = getattr(inner, "original", inner)
    return scaled_dot_product_attention


@contextlib.contextmanager
def tree_pass(caches: list, ancestors: mx.array, depths: mx.array | None, bits: list[int] | None = None):
    """While inside: a forward over the L rows of a tree (row 0 the root) attends by `ancestors` [L, L] bool
    (row r sees row c) after every cached token, row r at position P + depths[r]. depths None: a chain,
    row r at P + r, the positions the model gives its rows anyway (its RoPE calls are left as they are).
    bits: the same as host ints (kernels/batch_attention.py `tree`), for batch-invariant passes."""
    P = caches[0].offset
    L = ancestors.shape[0]
    mask = mx.concatenate([mx.ones((L, P), dtype=mx.bool_), ancestors], axis=1) if P else ancestors
    for c in caches:
        c.make_mask = lambda *a, **kw: mask  # an instance attribute: it hides the class's method
    token = _positions.set(None if depths is None else (depths + P).astype(mx.int32))
    bits_token = _bits.set(bits)
    try:
        yield
    finally:
        _bits.reset(bits_token)
        _positions.reset(token)
        for c in caches:
            del c.make_mask


def compact(caches: list, start: int, rows: list[int]) -> None:
    """Keep rows[0], rows[1], ... (increasing, rows[0] = 0) of the pass that began at cache position `start`:
    their entries move to start, start + 1, ...; the cache then holds start + len(rows) tokens.

    The kept rows are gathered and evaluated first, then written back in place: a write whose source is
    the same buffer cannot reuse it (MLX copies the whole cache, ~70 ms a cycle at 8k tokens here); one
    written from a small evaluated array updates the buffer in place. That evaluation is a wait
    (host.wait, counted) on the cycles that moved rows: ~6 ms at 8k tokens here, where an asynchronous
    start left the write copying the cache on some cycles (6-28 ms)."""
    n = len(rows)
    moved = rows != list(range(n))
    if moved:
        idx = mx.array([start + r for r in rows], dtype=mx.int32)
        parts = [(c, name) for c in caches for name in ("keys", "values")]
        kept = [tuple(a[..., idx, :] for a in getattr(c, name)) if isinstance(c, QuantizedKVCache)
                else getattr(c, name)[..., idx, :] for c, name in parts]
        host.wait(kept)
        for (c, name), rows_kept in zip(parts, kept):
            arrays = getattr(c, name)
            if isinstance(c, QuantizedKVCache):
                for a, r in zip(arrays, rows_kept):
                    a[..., start : start + n, :] = r
            else:
                arrays[..., start : start + n, :] = rows_kept
    for c in caches:
        c.offset = start + n
