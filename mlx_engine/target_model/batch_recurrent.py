"""The recurrent layers of a batch: each row's GatedDeltaNet state, rolled back per row to its own accepted
length.

A recurrent layer's state after a prompt is not a list of per-token entries (a KV cache's) but one
[conv, ssm] pair: conv [B, K-1, C] (the last K-1 inputs of the causal convolution) and ssm [B, Hv, Dv, Dk]
(the delta-rule state). A batch pass feeds every row `width` positions, of which row i's first real[i] are
real (a verify row's [last, d_1..d_k], a prompt's chunk; none for an idle row): the layer
(target_model/gdn_rows.py) runs the recurrence with the padding masked out, so each row's state after the
pass is its state after its last real token, and keeps the state after each of the first `verified`
positions of every row (the longest verify row's k + 1, never a prompt chunk's width: a state is
Hv * Dv * Dk floats). The rollback (`end_pass(width, kept)`) then sets each row, in one gather per array, to

    kept[i] == 0          the state before the pass (an idle row, a prompt row outside its layers' span)
    kept[i] == real[i]    the state after the pass (a prompt chunk, a verify row that accepted all)
    kept[i] <= verified   the state after its kept[i]-th token (a verify row that rejected drafts)

so a row never replays a token. Rows join with a state of their own (a prefix-tree checkpoint, a first
chunk fed alone, or zeros for an empty row) and leave by index, like the KV rows beside them.

`lens` counts each row's positions, as a KV layer's does (the batch engine's room and length checks read
every layer alike). `make_mask` answers None: the padding is the layer's business, not a mask's.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

NO_LIMIT = 1 << 62  # positions a row may hold: a recurrent state does not grow


class BatchRecurrentCache(ArraysCache):
    def __init__(self, size: int = 2):
        super().__init__(size)
        self.lens: list[int] = []
        self.room = 0
        self.spare = 0
        self.real: list[int] | None = None  # the coming pass: each row's real tokens
        self.verified = 0  # the coming pass: positions whose states are kept (the widest verify row's)
        self.before: list | None = None  # the last pass: each array as it was before it
        self.kept_states: list | None = None  # the last pass: [B, verified, ...] states after each position
        self.passed: list[int] | None = None  # the last pass: each row's real tokens as the layer ran them
        self.started: list[int] = []  # the last pass: each row's length before it

    # -- the layer's side -------------------------------------------------------------------------------
    def make_mask(self, n: int):
        return None

    def begin_pass(self, real: list[int], verified: int) -> None:
        self.real, self.verified = list(real), verified

    def record(self, before: list, kept_states: list | None, passed: list[int], width: int) -> None:
        """The layer ran a pass of `width` positions (gdn_rows.py): what rollback may need of it."""
        self.before, self.kept_states, self.passed = before, kept_states, passed
        self.started = list(self.lens)
        self.lens = [n + width for n in self.lens]
        self.real = None

    def skip(self, t: int) -> None:
        """A pass no row computes in (layer_span.py): every row keeps its state."""
        self.record(list(self.cache), None, [0] * len(self.lens), t)

    # -- rollback ---------------------------------------------------------------------------------------
    def end_pass(self, width: int, kept: list[int]) -> None:
        """Row i keeps the first kept[i] of the pass's positions: its state after its kept[i]-th token."""
        if self.passed is None:
            raise ValueError("no pass to roll back")
        verified = self.kept_states[0].shape[1] if self.kept_states is not None else 0
        picks = []  # per row: 0 before, 1 after, 2 + t after token t of the kept states
        for i, n in enumerate(kept):
            real = self.passed[i]
            if n == 0:
                picks.append(0)
            elif n == real:
                picks.append(1)
            elif n <= min(verified, real):
                picks.append(1 + n)
            else:
                raise ValueError(f"row {i} keeps {n} of the pass's tokens: its state was kept after "
                                 f"{min(verified, real)} of its {real} only")
            self.lens[i] = self.started[i] + n
        if any(p != 1 for p in picks):
            self.cache = [self._pick(j, picks) for j in range(len(self.cache))]
        self.before = self.kept_states = self.passed = None

    def _pick(self, j: int, picks: list[int]) -> mx.array:
        """Array j of every row's kept state (one gather)."""
        options = [self.before[j][:, None], self.cache[j][:, None]]
        if self.kept_states is not None:
            options.append(self.kept_states[j])
        stacked = mx.concatenate(options, axis=1)  # [B, 2 + verified, ...]
        idx = mx.array(picks, dtype=mx.int32).reshape((-1, 1) + (1,) * (stacked.ndim - 2))
        return mx.take_along_axis(stacked, idx, axis=1)[:, 0]

    def trim_row(self, i: int, n: int) -> None:
        if n:
            raise ValueError("a recurrent row rolls back within its last pass only (end_pass)")

    # -- rows -------------------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return NO_LIMIT

    @property
    def allocated(self) -> int:
        return len(self.lens)

    def reserve(self, need: int) -> None:
        pass

    def toward_room(self, need: int = 0) -> int:
        return need

    @property
    def state(self) -> list:
        return [a for a in self.cache if a is not None]

    @state.setter
    def state(self, v) -> None:
        self.cache = list(v)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.state)

    def add_row(self, state, capacity: int = 0, length: int = 0) -> bool:
        """Append a row whose state is `state` ([1, ...] per array) after `length` positions. -> True when
        the other rows' states were copied (always, when there are some: the arrays are joined)."""
        b = len(self.lens)
        if b == 0 or self.cache[0] is None:
            self.cache = [mx.array(a) for a in state]
        else:
            self.cache = [mx.concatenate([old, new.astype(old.dtype)]) for old, new in zip(self.cache, state)]
        self.lens.append(length)
        return b > 0

    def keep_rows(self, rows: list[int]) -> None:
        if not rows:
            self.cache = [None] * len(self.cache)
            self.lens = []
            return
        if rows != list(range(len(self.lens))):
            idx = mx.array(rows, dtype=mx.int32)
            self.cache = [a[idx] for a in self.cache]
        self.lens = [self.lens[i] for i in rows]

    def row(self, i: int) -> tuple:
        """Row i's state, [1, ...] per array."""
        return tuple(a[i : i + 1] for a in self.cache)

    def empty_row(self) -> tuple:
        """The state of a row that holds nothing yet: zeros shaped like the others'."""
        return tuple(mx.zeros((1,) + a.shape[1:], a.dtype) for a in self.cache)
