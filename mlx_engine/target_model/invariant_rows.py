"""The rows of a batch-invariant pass: what a patched module is told about them, and how it splits them.

A pass feeds x [B, L, ...]: B sequences (1 in the single-sequence engine, the running requests in the
batch engine) of L tokens each. The contract (target_model/batch_invariant.py) covers passes of L <= max_rows
tokens per sequence, whatever B: every (sequence, token) row gets the bits of that sequence's
single-token decode step. A fixed-row pass (target_model/fixed_rows.py) is one sequence whose first `live`
rows are real and whose other rows pad it to a fixed count.
"""

from __future__ import annotations

import contextvars

import mlx.core as mx

MAX_ROWS = 16  # tokens per sequence in a pass covered by the contract (verify passes are k+1 <= 16)

# set while a patched model runs (its modules run stock when called from anywhere else)
active: contextvars.ContextVar[bool] = contextvars.ContextVar("mlx_engine_batch_invariant", default=False)
# the real rows of a fixed-row pass (target_model/fixed_rows.py: the rest pad it to a fixed row count), else None
live_rows: contextvars.ContextVar[int | None] = contextvars.ContextVar("mlx_engine_live_rows", default=None)


def covered(x: mx.array, max_rows: int) -> bool:
    """A patched model is running and x [B, L, ...] has at most max_rows tokens per sequence."""
    return active.get() and x.ndim >= 3 and x.shape[1] <= max_rows


def live(x: mx.array, axis: int = 1) -> int | None:
    """Real rows of x along `axis` (the token rows: 1 for [B, L, ...], 2 for attention's [B, H, L, D]) when
    the rows after them pad a fixed-row pass, else None."""
    n = live_rows.get()
    return n if n is not None and x.ndim > axis + 1 and n < x.shape[axis] else None


def concat(outs: list, axis: int):
    """Outputs (arrays, or tuples of them) joined along `axis`."""
    if len(outs) == 1:
        return outs[0]
    if isinstance(outs[0], tuple):
        return tuple(mx.concatenate(parts, axis=axis) for parts in zip(*outs))
    return mx.concatenate(outs, axis=axis)


def padded(out, rows: int):
    """out (an array or a tuple of them) [B, live, ...] with zero rows appended along axis 1 up to `rows`."""
    if isinstance(out, tuple):
        return tuple(padded(o, rows) for o in out)
    return mx.pad(out, [(0, 0), (0, rows - out.shape[1])] + [(0, 0)] * (out.ndim - 2))


def each_row(call, x: mx.array, live_n: int | None = None):
    """call(b, i) -> the output of sequence b's token i alone ([1, 1, ...] or a tuple of them), for every
    real row of x [B, L, ...]; joined back to [B, L, ...], zero rows after the real ones of a fixed-row
    pass (live_n of L)."""
    L = x.shape[1]
    seqs = []
    for b in range(x.shape[0]):
        out = concat([call(b, i) for i in range(live_n or L)], axis=1)
        seqs.append(padded(out, L) if live_n else out)
    return concat(seqs, axis=0)


def chunks(n: int, size: int = MAX_ROWS) -> list[tuple[int, int]]:
    """[start, stop) ranges covering 0..n in pieces of at most `size` (the kernels' rows per launch)."""
    return [(i, min(i + size, n)) for i in range(0, n, size)]
