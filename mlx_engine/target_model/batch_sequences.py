"""Attention over a BatchKVCache one sequence at a time, each over exactly its own keys: what the batch
engine's stock passes (sequence_attention.py) and its batch-invariant ones (invariant_attention.py) share.

A BatchKVCache pads every row to the longest; sequence b's valid keys are its first `lens[b]` (after the
pass: its L queries are the last L of them). `over_sequences` cuts each sequence's queries and keys out
(plain arrays or a quantized cache's (codes, scales, biases) parts) and joins the outputs on the batch
axis. Rows the batch engine throws away in this pass (a row waiting while others' prompts are fed, a
prompt token outside the layers it crosses: layer_span.py) are `idle_rows`: their attention is skipped,
zeros stand in.
"""

from __future__ import annotations

import contextvars
from contextlib import contextmanager
from typing import Callable

import mlx.core as mx

_idle: contextvars.ContextVar[frozenset] = contextvars.ContextVar("mlx_engine_idle_rows", default=frozenset())


@contextmanager
def idle_rows(rows):
    """These rows idle too while inside (added to the rows already idle)."""
    token = _idle.set(_idle.get() | frozenset(rows))
    try:
        yield
    finally:
        _idle.reset(token)


def idle() -> frozenset:
    return _idle.get()


_real: contextvars.ContextVar[dict] = contextvars.ContextVar("mlx_engine_real_widths", default={})


@contextmanager
def real_widths(widths: dict):
    """Rows with fewer real tokens than the pass while inside ({row: r}: its first r tokens are real, the rest
    padding whose outputs are thrown away): their padding runs no attention (stock passes, over_sequences)."""
    token = _real.set(widths)
    try:
        yield
    finally:
        _real.reset(token)


def cut(x, b: int, n: int | None = None):
    """Sequence b of x [B, H, S, D] (its first n keys when n is given; a tuple of parts cut alike; None: None)."""
    if x is None:
        return None
    if isinstance(x, tuple):
        return tuple(cut(p, b, n) for p in x)
    return x[b : b + 1] if n is None else x[b : b + 1, :, :n]


def value_width(values, group_size: int | None = None) -> int:
    """Width of the attention's output rows: the values' last axis (quantized: scales x group size)."""
    return values[1].shape[-1] * group_size if isinstance(values, tuple) else values.shape[-1]


def window_mask(queries: int, keys: int, window: int) -> mx.array:
    """[queries, keys] booleans: the last `queries` of `keys` positions, each seeing itself and the
    window - 1 keys before it (a sliding window's causal mask, keys cut to the first one any query sees)."""
    q = mx.arange(keys - queries, keys)[:, None]
    k = mx.arange(keys)[None, :]
    return (k <= q) & (k > q - window)


def windowed(keyed: tuple, n: int, lq: int, window: int):
    """A sliding window over one sequence's n keys whose last lq positions are the queries: (the keys from
    the first one a query sees, the mask for them: None for one query, 'causal' where the window hides
    nothing, else window_mask)."""
    if n <= window:
        return keyed, None if lq == 1 else "causal"
    start = max(0, n - lq - window + 1)
    return tuple(None if k is None else _from(k, start) for k in keyed), \
        None if lq == 1 else window_mask(lq, n - start, window)


def _from(x, start: int):
    """x [1, H, S, *] (or its quantized parts) from position start on."""
    if isinstance(x, tuple):
        return tuple(_from(p, start) for p in x)
    return x[:, :, start:]


def over_sequences(attend: Callable, lens: list[int], queries: tuple, keyed: tuple, width: int,
                   skip_idle: bool = True, ragged: bool = False, window: int | None = None) -> mx.array:
    """attend(*queries_b, *keyed_b) for each sequence b: `queries` (arrays [B, H, L, *] or None) cut to b,
    `keyed` (keys, values, ... [B, H, S, *], or their quantized parts) cut to b's first lens[b] keys;
    joined on the batch axis. An idle row gives zeros [1, H, L, width] without attending. `ragged` (causal
    attend only): a row with r < L real tokens (`real_widths`: a decoding row padded to a prompt chunk's
    width) attends with its first r queries over its first lens[b] - (L - r) keys, exactly what those
    queries saw causally, and gives zeros for its padding. `window` (a sliding-window layer, causal attend
    only): each query sees its last `window` keys: the keys are cut to the first one any query sees, and
    attend is called with mask= that window's mask (none for one query)."""
    q0 = queries[0]
    rows = idle() if skip_idle else frozenset()
    real = _real.get() if ragged else {}
    L = q0.shape[2]

    def call(qs, ks, n, lq):
        if window is None:
            return attend(*qs, *ks)
        ks, mask = windowed(ks, n, lq, window)
        return attend(*qs, *ks, mask=mask)

    def one(b, n):
        if b in rows:
            return mx.zeros((1, q0.shape[1], L, width), q0.dtype)
        r = real.get(b, L)
        if r >= L:
            return call(tuple(cut(q, b) for q in queries), tuple(cut(k, b, n) for k in keyed), n, L)
        out = call(tuple(None if q is None else cut(q, b)[:, :, :r] for q in queries),
                   tuple(cut(k, b, n - (L - r)) for k in keyed), n - (L - r), r)
        return mx.pad(out, [(0, 0), (0, 0), (0, L - r), (0, 0)])

    outs = [one(b, n) for b, n in enumerate(lens)]
    return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)
