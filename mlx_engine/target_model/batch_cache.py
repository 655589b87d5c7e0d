"""A KV cache of several sequences with their own lengths: what continuous batching with speculation needs.

Layer cache for mlx-lm attention (`offset`, `make_mask`, `update_and_fetch`). Row i holds `lens[i]` valid
entries at positions 0..lens[i]-1 (no left padding: a row's entries sit at the same indices as when the
sequence runs alone, so its attention reduces over the same values in the same order). A pass feeds T
tokens to every row at once: row i's token t goes to position lens[i] + t (a slice write per row), gets
RoPE position lens[i] + t (`offset` is an array, one per row) and sees keys 0..lens[i] + t (the mask).
Entries past a row's length are stale and masked out.

Rollback is per row and free: `trim_row(i, n)` lowers lens[i] (a verify pass's rejected drafts, or the
padding of a row that fed fewer than T tokens). Rows join (`add_row`, from a single-sequence prefill) and
leave (`keep_rows`) between passes.

Spare rows: the arrays hold `allocated` >= B rows; rows B.. are spare (stale, never written nor attended:
a pass writes each live row's entries by a slice write and returns the first B rows). The last rows leave by shortening `lens`
(their memory kept as spare rows, at most MAX_SPARE), and a row joins into a spare row in place (writing
only its own entries: nothing for an empty row). Before, every join and leave copied every row's entries
into new arrays: ~0.35 s with an 8k-token row beside on this CPU, paid by the short request that joined.
A join with no spare row, a leave from the middle, or a capacity grown copies as before, into arrays of
the live rows and `spare` more (0 unless the owner asks: the batch engine asks for one while another request
could still join and the memory budget holds its row, core/batch_rows.py `_spare_rows`). A long prompt
fed alone grows its arrays as it is fed, so its first neighbour then joins in place: without it, that join
copied the long row's entries (0.31-0.41 s beside a 4-8k-token row on this CPU, paid by the request that
joined). A spare row costs one more row of the longest row's entries: what that join allocates anyway.

QuantizedBatchKVCache holds each entry as mlx-lm's QuantizedKVCache does, (data, scales, biases) per
token in groups along the head dimension (`bits` / `group_size` make mlx-lm's attention take the
quantized path); each part is [B, H, cap, *] and moves like the plain arrays above.

A sliding-window layer (`window`) keeps every entry too: its rows roll back, join and leave like any other
(a window's entries are functions of their tokens), and its attention reads each query's last `window` keys.
Memory: a full layer's, not a window's (the cost of exact per-row rollback without a ring buffer).
"""

from __future__ import annotations

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map

STEP = 256  # capacity grows in steps of this many positions
MAX_SPARE = 2  # rows that left kept as spare rows for the next joins (a leave leaving more copies)


class BatchKVCache:
    def __init__(self, window: int | None = None):
        """window: a sliding-window layer's (mlx-lm's RotatingKVCache max_size): a query at position p attends
        keys p - window + 1 .. p. Every entry is kept (a row's entries at the same indices as alone, rolled
        back like any other); the attention reads the window (target_model/sequence_attention.py)."""
        self.window = window
        self.keys = None  # [B, H, cap, D] (a quantized cache: a tuple of such parts)
        self.values = None
        self.lens: list[int] = []
        self.room = 0  # positions a row is known to need soon (a prompt being fed): growth goes up to it
        self.spare = 0  # rows beyond the live ones that arrays made anew (a grow, a join by copy) hold

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else tree_flatten(self.keys)[0][1].shape[2]

    @property
    def allocated(self) -> int:
        """Rows the arrays hold: len(lens) live rows, then spare ones."""
        return 0 if self.keys is None else tree_flatten(self.keys)[0][1].shape[0]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.state)

    def _encode(self, x: mx.array):
        """A pass's new keys or values as stored (identity here; quantized in the subclass)."""
        return x

    # -- what mlx-lm's attention calls --------------------------------------------------------------
    @property
    def offset(self) -> mx.array:
        """RoPE position of each row's first new token."""
        return mx.array(self.lens, dtype=mx.int32)

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None) -> mx.array:
        """[B, 1, n, S] booleans: row i's query t sees keys 0..lens[i] + t (S = max length after the pass), the
        last window_size of them when given (a sliding-window layer's mask, as mlx-lm makes it)."""
        lens = mx.array(self.lens, dtype=mx.int32)[:, None, None, None]
        q = mx.arange(n)[None, None, :, None]
        k = mx.arange(max(self.lens) + n)[None, None, None, :]
        if window_size is not None:
            return (k <= lens + q) & (k > lens + q - window_size)
        return k <= lens + q

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        b, h, t, d = keys.shape
        if b != len(self.lens):
            raise ValueError(f"a pass of {b} rows into a cache of {len(self.lens)}")
        keys, values = self._encode(keys), self._encode(values)
        self._reserve(max(self.lens) + t, keys, values)

        def put(stored, new):  # each live row's t entries, a slice write each (in place: the spare rows untouched)
            new = new.astype(stored.dtype)
            for i, n in enumerate(self.lens):
                stored[i : i + 1, :, n : n + t] = new[i : i + 1]
            return stored

        self.keys = tree_map(put, self.keys, keys)
        self.values = tree_map(put, self.values, values)
        self.lens = [n + t for n in self.lens]
        end = max(self.lens)
        return tree_map(lambda x: x[:b, :, :end, :], (self.keys, self.values))

    @property
    def state(self):
        return [a for _, a in tree_flatten((self.keys, self.values)) if a is not None] if self.keys is not None else []

    def is_trimmable(self) -> bool:
        return True

    # -- rows ------------------------------------------------------------------------------------------
    def _reserve(self, need: int, keys, values) -> None:
        """Capacity for `need` positions per row (keys and values may differ in heads and width: MLA)."""
        cap = self.capacity
        if need <= cap:
            return
        new = ((self.toward_room(need) + STEP - 1) // STEP) * STEP
        b = len(self.lens)
        rows = b + self.spare

        def grow(stored, like):  # the live rows copied (a grow copies anyway), spare ones as asked for now
            out = mx.zeros((rows, like.shape[1], new, like.shape[3]), dtype=like.dtype if stored is None else stored.dtype)
            if stored is not None:
                out[:b, :, :cap] = stored[:b]
            return out

        if self.keys is None:
            self.keys = tree_map(lambda like: grow(None, like), keys)
            self.values = tree_map(lambda like: grow(None, like), values)
        else:
            self.keys = tree_map(grow, self.keys, keys)
            self.values = tree_map(grow, self.values, values)

    def toward_room(self, need: int = 0) -> int:
        """The capacity to grow to for `need` positions: while a prompt being fed will need more (`room`),
        double towards it (never past it), not STEP by STEP; `need` itself when that is more."""
        return max(need, min(self.room, 2 * self.capacity))

    def reserve(self, need: int) -> None:
        """Capacity for `need` positions per row now, in one copy (the batch engine grows it ahead a step at a
        time, core/batch_rows.py `_grow_ahead`, each copy bounded: a copy is a stall for the rows decoding
        beside it)."""
        if self.keys is not None and need > self.capacity:  # (called every step: no views built for nothing)
            empty = tree_map(lambda x: x[:1, :, :0], (self.keys, self.values))
            self._reserve(need, *empty)

    def skip(self, t: int) -> None:
        """Count a pass of t positions per row as written without writing them (a layer no row computes in,
        target_model/layer_span.py): what they hold is garbage, as an idle row's, trimmed by the caller."""
        self.lens = [n + t for n in self.lens]

    def begin_pass(self, real: list[int], verified: int) -> None:
        """Told before each batch pass: each row's real tokens, and the most a row may roll back within (a
        recurrent cache needs both; every KV entry is its own token's, so nothing here)."""

    def end_pass(self, width: int, kept: list[int]) -> None:
        """After a pass of `width` positions per row: row i keeps the first kept[i] of them."""
        for i, n in enumerate(kept):
            self.trim_row(i, width - n)

    def trim_row(self, i: int, n: int) -> None:
        """Drop the last n entries of row i."""
        if not 0 <= n <= self.lens[i]:
            raise ValueError(f"cannot trim {n} of row {i}'s {self.lens[i]} entries")
        self.lens[i] -= n

    def add_row(self, keys, values, capacity: int = 0) -> bool:
        """Append a sequence whose entries are keys/values [1, H, L, D] (L = its length; quantized: parts),
        with room for `capacity` positions per row if that is more. Into a spare row when there is one and
        the capacity suffices (its own entries written in place); else one new array per part, the old rows
        and the new one written into it (a join copies each entry once), and `spare` rows more. -> whether
        the other rows' entries were copied."""
        n = tree_flatten(keys)[0][1].shape[2]
        if self.keys is None:
            self.lens = []
        need = max([n, capacity, *self.lens])
        b = len(self.lens)
        if b < self.allocated and need <= self.capacity:
            if n:
                def write(stored, row):
                    stored[b : b + 1, :, :n] = row.astype(stored.dtype)
                    return stored

                self.keys = tree_map(write, self.keys, keys)
                self.values = tree_map(write, self.values, values)
            self.lens.append(n)
            return False
        cap = max(self.capacity, ((need + STEP - 1) // STEP) * STEP)

        def append(stored, row):
            dtype = stored.dtype if stored is not None else row.dtype
            out = mx.zeros((b + 1 + self.spare, row.shape[1], cap, row.shape[3]), dtype=dtype)
            if stored is not None:
                out[:b, :, : stored.shape[2]] = stored[:b]
            out[b : b + 1, :, :n] = row.astype(dtype)
            return out

        if self.keys is None:
            self.keys = tree_map(lambda row: append(None, row), keys)
            self.values = tree_map(lambda row: append(None, row), values)
        else:
            self.keys = tree_map(append, self.keys, keys)
            self.values = tree_map(append, self.values, values)
        self.lens.append(n)
        return b > 0

    def keep_rows(self, rows: list[int]) -> None:
        """Keep only these rows, in this order (the others' entries are freed; capacity beyond the rows'
        lengths and `room` is given back). The first rows kept in order, as long as no more than MAX_SPARE
        rows and no unneeded capacity are left behind: `lens` shortened, nothing copied."""
        if not rows:
            self.keys = self.values = None
            self.lens = []
            return
        end = max([self.lens[i] for i in rows] + [self.room])
        cap = ((end + STEP - 1) // STEP) * STEP  # give back capacity the remaining rows do not use
        if rows == list(range(len(rows))) and self.allocated - len(rows) <= MAX_SPARE and cap >= self.capacity:
            self.lens = self.lens[: len(rows)]
            return
        idx = mx.array(rows, dtype=mx.int32)
        self.keys, self.values = tree_map(lambda x: x[idx], (self.keys, self.values))
        self.lens = [self.lens[i] for i in rows]
        if cap < self.capacity:
            self.keys, self.values = tree_map(lambda x: x[:, :, :cap], (self.keys, self.values))

    def row(self, i: int):
        """Row i's valid entries, [1, H, lens[i], D] each (quantized: parts)."""
        return tree_map(lambda x: x[i : i + 1, :, : self.lens[i]], (self.keys, self.values))


class QuantizedBatchKVCache(BatchKVCache):
    """BatchKVCache whose entries are quantized per token (mlx-lm's QuantizedKVCache layout)."""

    def __init__(self, group_size: int = 64, bits: int = 8):
        super().__init__()
        self.group_size, self.bits = group_size, bits

    def _encode(self, x: mx.array):
        return tuple(mx.quantize(x, group_size=self.group_size, bits=self.bits))


def append_sequence(batch: list[BatchKVCache], cache: list) -> list[BatchKVCache]:
    """`cache` (a single sequence's per-layer KV caches) appended as a new row of `batch` (one BatchKVCache
    per layer, made when `batch` is empty); returns the batch."""
    batch = batch or [QuantizedBatchKVCache(c.group_size, c.bits) if hasattr(c, "bits") else BatchKVCache()
                      for c in cache]
    for bc, c in zip(batch, cache):
        bc.add_row(*tree_map(lambda x: x[:, :, : c.offset], (c.keys, c.values)))
    return batch
