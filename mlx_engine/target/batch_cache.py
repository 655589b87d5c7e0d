"""A KV cache of several sequences with their own lengths: what continuous batching with speculation needs.

Layer cache for mlx-lm attention (`offset`, `make_mask`, `update_and_fetch`). Row i holds `lens[i]` valid
entries at positions 0..lens[i]-1 (no left padding: a row's entries sit at the same indices as when the
sequence runs alone, so its attention reduces over the same values in the same order). A pass feeds T
tokens to every row at once: row i's token t goes to position lens[i] + t (one scatter per layer), gets
RoPE position lens[i] + t (`offset` is an array, one per row) and sees keys 0..lens[i] + t (the mask).
Entries past a row's length are stale and masked out.

Rollback is per row and free: `trim_row(i, n)` lowers lens[i] (a verify pass's rejected drafts, or the
padding of a row that fed fewer than T tokens). Rows join (`add_row`, from a single-sequence prefill) and
leave (`keep_rows`) between passes.
"""

from __future__ import annotations

import mlx.core as mx

STEP = 256  # capacity grows in steps of this many positions


class BatchKVCache:
    def __init__(self):
        self.keys: mx.array | None = None  # [B, H, cap, D]
        self.values: mx.array | None = None
        self.lens: list[int] = []

    # -- what mlx-lm's attention calls --------------------------------------------------------------
    @property
    def offset(self) -> mx.array:
        """RoPE position of each row's first new token."""
        return mx.array(self.lens, dtype=mx.int32)

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None) -> mx.array:
        """[B, 1, n, S] booleans: row i's query t sees keys 0..lens[i] + t (S = max length after the pass)."""
        if window_size is not None:
            raise ValueError("sliding-window attention is not batched (BatchKVCache)")
        lens = mx.array(self.lens, dtype=mx.int32)[:, None, None, None]
        q = mx.arange(n)[None, None, :, None]
        k = mx.arange(max(self.lens) + n)[None, None, None, :]
        return k <= lens + q

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        b, h, t, d = keys.shape
        if b != len(self.lens):
            raise ValueError(f"a pass of {b} rows into a cache of {len(self.lens)}")
        self._reserve(max(self.lens) + t, keys, values)
        pos = mx.array(self.lens, dtype=mx.int32)[:, None] + mx.arange(t, dtype=mx.int32)[None]
        pos = pos[:, None, :, None]
        self.keys = mx.put_along_axis(self.keys, mx.broadcast_to(pos, keys.shape), keys, axis=2)
        self.values = mx.put_along_axis(self.values, mx.broadcast_to(pos, values.shape),
                                        values.astype(self.values.dtype), axis=2)
        self.lens = [n + t for n in self.lens]
        end = max(self.lens)
        return self.keys[..., :end, :], self.values[..., :end, :]

    @property
    def state(self):
        return [a for a in (self.keys, self.values) if a is not None]

    def is_trimmable(self) -> bool:
        return True

    # -- rows ------------------------------------------------------------------------------------------
    def _reserve(self, need: int, keys: mx.array, values: mx.array) -> None:
        """Capacity for `need` positions per row (keys and values may differ in heads and width: MLA)."""
        cap = 0 if self.keys is None else self.keys.shape[2]
        if need <= cap:
            return
        new = ((need + STEP - 1) // STEP) * STEP
        b = len(self.lens)
        pk = mx.zeros((b, keys.shape[1], new - cap, keys.shape[3]), dtype=keys.dtype)
        pv = mx.zeros((b, values.shape[1], new - cap, values.shape[3]), dtype=values.dtype)
        if self.keys is None:
            self.keys, self.values = pk, pv
        else:
            self.keys = mx.concatenate([self.keys, pk.astype(self.keys.dtype)], axis=2)
            self.values = mx.concatenate([self.values, pv.astype(self.values.dtype)], axis=2)

    def trim_row(self, i: int, n: int) -> None:
        """Drop the last n entries of row i."""
        if not 0 <= n <= self.lens[i]:
            raise ValueError(f"cannot trim {n} of row {i}'s {self.lens[i]} entries")
        self.lens[i] -= n

    def add_row(self, keys: mx.array, values: mx.array) -> None:
        """Append a sequence whose entries are keys/values [1, H, L, D] (L = its length)."""
        n = keys.shape[2]
        if self.keys is None:
            self.lens = []
        self._reserve(max([n, *self.lens]), keys, values)
        cap = self.keys.shape[2]
        row_k = mx.concatenate([keys, mx.zeros((1, keys.shape[1], cap - n, keys.shape[3]), keys.dtype)], axis=2)
        row_v = mx.concatenate([values, mx.zeros((1, values.shape[1], cap - n, values.shape[3]), values.dtype)], axis=2)
        self.keys = mx.concatenate([self.keys, row_k.astype(self.keys.dtype)])
        self.values = mx.concatenate([self.values, row_v.astype(self.values.dtype)])
        self.lens.append(n)

    def keep_rows(self, rows: list[int]) -> None:
        """Keep only these rows, in this order (the others' entries are freed)."""
        if not rows:
            self.keys = self.values = None
            self.lens = []
            return
        idx = mx.array(rows, dtype=mx.int32)
        self.keys, self.values = self.keys[idx], self.values[idx]
        self.lens = [self.lens[i] for i in rows]
        end = max(self.lens)
        cap = ((end + STEP - 1) // STEP) * STEP  # give back capacity the remaining rows do not use
        if cap < self.keys.shape[2]:
            self.keys, self.values = self.keys[:, :, :cap], self.values[:, :, :cap]

    def row(self, i: int) -> tuple[mx.array, mx.array]:
        """Row i's valid entries, [1, H, lens[i], D] each."""
        return self.keys[i : i + 1, :, : self.lens[i]], self.values[i : i + 1, :, : self.lens[i]]


def append_sequence(batch: list[BatchKVCache], cache: list) -> list[BatchKVCache]:
    """`cache` (a single sequence's per-layer KV caches) appended as a new row of `batch` (one BatchKVCache
    per layer, made when `batch` is empty); returns the batch."""
    batch = batch or [BatchKVCache() for _ in cache]
    for bc, c in zip(batch, cache):
        bc.add_row(c.keys[:, :, : c.offset], c.values[:, :, : c.offset])
    return batch


def batchable(cache: list) -> str | None:
    """None when every layer of this single-sequence mlx-lm cache is a plain KVCache (what BatchKVCache
    replaces), else why not."""
    from mlx_lm.models.cache import KVCache

    for c in cache:
        if type(c) is not KVCache:
            return f"its cache has {type(c).__name__} layers (only plain KV caches are batched yet)"
    return None
