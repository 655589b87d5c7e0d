"""Grammar masks on the device: logits of disallowed tokens set to -inf before the sampler chain.

    allowed[r, v] = (bits[r, v // 32] >> (v % 32)) & 1          bits: [n, W] int32 (llguidance's bitmask)
    masked[r, v]  = logits[r, v] if allowed[r, v] else -inf      logits: [n, V], V <= 32 W

Plain MLX ops (an unpack and a select), the same on every device: a mask is a small part of a cycle
(V = 49,152: 0.1-0.2 ms for 9 rows on this CPU) and must not depend on a Metal-only kernel, which is
how a grammar failed on Linux in one MLX server (../shared/reference/anchors.md, "Agents").
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np


def allowed_tokens(bits: np.ndarray | mx.array) -> mx.array:
    """[V'] bool (V' = 32 W) from one mask row `bits` [1, W]: token v allowed iff bit v is set."""
    words = mx.array(bits, dtype=mx.int32) if not isinstance(bits, mx.array) else bits
    return (((words.reshape(-1, 1) >> mx.arange(32, dtype=mx.int32)) & 1) == 1).reshape(-1)


def apply_bitmask(logits: mx.array, bits: np.ndarray | mx.array) -> mx.array:
    """logits [n, V] with the tokens `bits` [n, W] forbids at -inf (float32 out)."""
    n, vocab = logits.shape
    words = mx.array(bits, dtype=mx.int32) if not isinstance(bits, mx.array) else bits
    if words.shape[0] != n:
        raise ValueError(f"{words.shape[0]} mask rows for {n} rows of logits")
    shifts = mx.arange(32, dtype=mx.int32)
    allowed = ((words[:, :, None] >> shifts) & 1).reshape(n, -1)[:, :vocab]
    if allowed.shape[1] < vocab:
        raise ValueError(f"a mask of {allowed.shape[1]} tokens for logits over {vocab}")
    return mx.where(allowed.astype(mx.bool_), logits.astype(mx.float32), mx.array(-mx.inf, mx.float32))
