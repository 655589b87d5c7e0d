"""How many prompt tokens a prefill chunk may take while other sequences are decoding.

A running stream waits for the chunk, so the chunk's step must fit a time budget (core/batch_prefill.py:
a multiple of the median decoding step). A step that carries a chunk of n tokens costs about base + n * c:
base what the step costs without the chunk (the decoding rows, and reading the weights once), c a prompt
token's share, which grows with the keys it attends to (on this CPU, MLX's softmax is the bulk of it: ~12 ns
an exp, so ~30 ms a token at 8k keys for a 135M model). Neither is known in advance and c drifts as the
prompt grows, so the size is steered from the last measured chunk: c = (t - base) / n, the next n the most
that fits budget x margin, at most doubling per chunk, at least one token, starting small. Without a base
(a chunk that is its own pass) the model is t = n * c.

Deep in a long prompt even one token may not fit (its attention alone outweighs a decoding step): `fits`
then says what share of one token's pass does, and `layers` turns that into the decoder layers a chunk
crosses this step (target/layer_span.py). A chunk that crossed m of L layers counts as n * m / L tokens.
"""

from __future__ import annotations


class ChunkSizer:
    def __init__(self, first: int = 32, largest: int = 512, margin: float = 0.85):
        self.first, self.largest, self.margin = first, largest, margin
        self.n = min(first, largest)
        self.last: tuple[float, float] | None = None  # (tokens, seconds) of the last timed chunk
        self.fits = float(self.n)  # tokens of a whole pass that fit the budget, as measured (may be < 1)

    def size(self, budget: float | None, base: float = 0.0) -> int:
        """Tokens for the next chunk; budget None: no one is waiting, take the largest. base: seconds of the
        step without a chunk (0 when the chunk is its own pass)."""
        if budget is None:
            self.fits = float(self.largest)
            return self.largest
        if self.last is not None:
            n, t = self.last
            per_token = (t - base) / n
            room = self.margin * budget - base
            self.fits = room / per_token if per_token > 0 else 2.0 * n
            self.n = max(1, min(int(self.fits), 2 * max(1, int(n)), self.largest))
        return self.n

    def layers(self, tokens: int, total: int) -> int:
        """Decoder layers (of `total`) a chunk of `tokens` may cross in this step, from the last `size`: all
        of them when it fits, at least one."""
        return max(1, min(total, int(self.fits * total / tokens)))

    def observe(self, tokens: float, seconds: float, budgeted: bool) -> None:
        """A chunk's measured time (only chunks sized to a budget steer the next size)."""
        if budgeted and tokens > 0:
            self.last = (tokens, seconds)
