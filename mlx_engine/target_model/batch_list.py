"""A layer whose cache is several caches (mlx-lm's CacheList: LongCat-Flash's two attentions per layer,
DeepSeek-V3.2's attention and its indexer's keys): a batch cache of each, moved together.

The model reads `cache[j]` and runs each part as its own layer cache; the batch engine sees one layer and
calls the list, which calls every part (rows join, leave, roll back and are stored in the prefix tree as a
tuple of the parts' states). Positional when every part is.
"""

from __future__ import annotations


class BatchCacheList:
    def __init__(self, *caches):
        self.caches = tuple(caches)

    def __getitem__(self, j: int):
        return self.caches[j]

    # -- what every part does alike ------------------------------------------------------------------------
    @property
    def lens(self) -> list[int]:
        return self.caches[0].lens

    @property
    def capacity(self) -> int:
        return min(c.capacity for c in self.caches)

    @property
    def room(self) -> int:
        return self.caches[0].room

    @room.setter
    def room(self, n: int) -> None:
        for c in self.caches:
            c.room = n

    @property
    def spare(self) -> int:
        return self.caches[0].spare

    @spare.setter
    def spare(self, n: int) -> None:
        for c in self.caches:
            c.spare = n

    @property
    def state(self) -> list:
        return [a for c in self.caches for a in c.state]

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.caches)

    def toward_room(self, need: int = 0) -> int:
        return max(c.toward_room(need) for c in self.caches)

    def reserve(self, need: int) -> None:
        for c in self.caches:
            c.reserve(need)

    def begin_pass(self, real: list[int], verified: int) -> None:
        for c in self.caches:
            c.begin_pass(real, verified)

    def end_pass(self, width: int, kept: list[int]) -> None:
        for c in self.caches:
            c.end_pass(width, kept)

    def skip(self, t: int) -> None:
        for c in self.caches:
            c.skip(t)

    def keep_rows(self, rows: list[int]) -> None:
        for c in self.caches:
            c.keep_rows(rows)

    def row(self, i: int) -> tuple:
        return tuple(c.row(i) for c in self.caches)
