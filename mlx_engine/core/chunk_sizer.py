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
crosses this step (target_model/layer_span.py). A chunk that crossed m of L layers counts as n * m / L tokens.
`fits` grows at most twofold per chunk, as the token count does (one noisy short step must not make the
next one take a whole deep token at once), times the growth of the room itself: when the budget widens
(the streams beside it ended: the idle budget now), the chunk widens with it at once, not by doublings
from the one-token chunks a stream beside it allowed (a short prompt arriving then went 1, 2, 4, 8 tokens
over four steps).
"""

from __future__ import annotations

import math


class ChunkSizer:
    def __init__(self, first: int = 32, largest: int = 512, margin: float = 0.85, reach: int = 1024):
        """reach: a prompt token's cost taken as proportional to (its depth + reach): attention grows with
        the keys, the rest does not (one token beside a decoding stream, measured here: 13 ms at 300 keys,
        107 ms at 8k, so ~1,000 keys' worth of fixed cost). A measurement at one depth is scaled by it to
        size a chunk at another (a row that starts deep, from the prefix tree, after a shallow one)."""
        self.first, self.largest, self.margin, self.reach = first, largest, margin, reach
        self.n = min(first, largest)
        self.last: tuple[float, float] | None = None  # (tokens, seconds) of the last timed chunk
        self.depth = 0  # prompt positions before the last timed chunk
        self.fits = float(self.n)  # tokens of a whole pass that fit the budget, as measured (may be < 1)
        self.room = 0.0  # seconds the last sized chunk had (margin x budget - base)
        self.timed_room = 0.0  # that of the last timed chunk
        self.timed_n = self.n  # the size that chunk was given (its prompt's end may have cut it shorter)

    def size(self, budget: float | None, base: float = 0.0, depth: int | None = None) -> int:
        """Tokens for the next chunk; budget None: no one is waiting, take the largest. base: seconds of the
        step without a chunk (0 when the chunk is its own pass); depth: prompt positions before it (None:
        as deep as the last)."""
        if budget is None:
            self.fits = float(self.largest)
            return self.largest
        if self.last is not None:
            n, t = self.last
            per_token = (t - base) / n
            if depth is not None:
                per_token *= (depth + self.reach) / (self.depth + self.reach)
            room = self.margin * budget - base
            grow = 2.0 * max(1.0, room / self.timed_room) if self.timed_room > 0 else 2.0
            # at most doubling, from the size the last chunk was given: one cut short by its prompt's end is
            # no evidence that a larger one does not fit (a 2-token tail made a short prompt after it go 4,
            # then 8 tokens); a share of one token's layers (n < 1) grows from itself
            ref = n if n < 1 else max(n, self.timed_n)
            self.fits = min(room / per_token, grow * ref) if per_token > 0 else grow * ref
            self.n = max(1, min(int(self.fits), self.largest))  # (fits holds the doubling bound)
            self.room = room
        return self.n

    def predict(self, tokens: int, depth: int) -> float | None:
        """Seconds a chunk of `tokens` at `depth` takes as its own pass, from the last timed chunk (None:
        none timed yet)."""
        if self.last is None:
            return None
        n, t = self.last
        return tokens * t / n * (depth + self.reach) / (self.depth + self.reach)

    def layers(self, tokens: int, left: int, total: int) -> int:
        """Decoder layers a chunk of `tokens` with `left` of the model's `total` layers still to cross takes
        in this step, from the last `size`: all that are left when they fit, else an even share of them
        over the fewest steps that fit (two steps of 15 layers, not 23 and 7: the step's peak is lower and
        every step measures a like-sized piece), at least one."""
        fit = max(1.0, self.fits * total / tokens)
        if fit >= left:
            return left
        steps = math.ceil(left / math.floor(fit))
        return math.ceil(left / steps)

    def observe(self, tokens: float, seconds: float, budgeted: bool, depth: int = 0) -> None:
        """A chunk's measured time (only chunks sized to a budget steer the next size); depth: prompt
        positions before it."""
        if budgeted and tokens > 0:
            self.last, self.depth, self.timed_room, self.timed_n = (tokens, seconds), depth, self.room, self.n
