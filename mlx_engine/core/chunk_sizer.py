"""How many prompt tokens a prefill chunk may take while other sequences are decoding.

A running stream waits for the chunk between two of its steps, so a chunk must fit a time budget (the
batch engine gives 2x the median step time: a stream's gap then stays within ~3x its median). The cost
of a chunk of n tokens at offset o is about w + n * c(o): w a pass's fixed cost (reading the weights),
c(o) a token's, which grows with the keys it attends to. Both are unknown and c drifts as the prompt
grows, so the size is steered from the last measured chunk: proportional to budget / time taken, at most
doubling per chunk, starting small.
"""

from __future__ import annotations


class ChunkSizer:
    def __init__(self, first: int = 32, largest: int = 512, margin: float = 0.85):
        self.first, self.largest, self.margin = first, largest, margin
        self.n = min(first, largest)
        self.last: tuple[int, float] | None = None  # (tokens, seconds) of the last timed chunk

    def size(self, budget: float | None) -> int:
        """Tokens for the next chunk; budget None: no one is waiting, take the largest."""
        if budget is None:
            return self.largest
        if self.last is not None:
            n, t = self.last
            scaled = int(n * self.margin * budget / t) if t > 0 else 2 * n
            self.n = max(1, min(scaled, 2 * n, self.largest))
        return self.n

    def observe(self, tokens: int, seconds: float, budgeted: bool) -> None:
        """A chunk's measured time (only chunks sized to a budget steer the next size)."""
        if budgeted:
            self.last = (tokens, seconds)
