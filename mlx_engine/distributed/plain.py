"""A stretch of plainly decoded tokens over a sharded target, pipelined as core/engine.py's `_plain`.

Every rank builds the same steps: step i+1 is put on the device before token i is read. Rank 0 samples
each token and shares it in a plain-token packet (packets.py) that every rank's next step takes as its
input, lazily: one collective per token beside the model's, one host read per token on every rank.

Who builds which step: a follower builds step i+1 before it reads token i, so it must know one step in
advance that rank 0 will build it. Rank 0's packet of step j therefore promises step j+2 (the announced
stretch length promises steps 0 and 1). A stop rank 0 alone decides (its drafter has a draft again, the
consumer of the generation left) takes effect after the steps already promised: those are still built
and read on every rank (at most two more tokens). End of sequence and max_tokens end the stretch on every
rank at the same token, as they decide alike.
"""

from __future__ import annotations

import time

import mlx.core as mx

from .. import host
from ..drafters.base import Verdict
from ..core.engine import Step, _no_draft
from .packets import TOKEN_WIDTH, Ended, share


class Stretch:
    def __init__(self, engine, cfg, n_tokens: int, want_hidden, t_decode: float, until=None):
        self.e, self.cfg, self.n = engine, cfg, n_tokens
        self.want_hidden, self.t_decode, self.until = want_hidden, t_decode, until
        self.leader = engine.leader
        self.promised = min(n_tokens - 1, 1)  # the highest step index every rank will build
        self.stopping = False  # rank 0: no further promises (a cut, or the consumer left)
        self.closing = False  # the generation ends after this stretch (rank 0's consumer left)
        self.i = 0
        self.built = -1  # the highest step index built on this rank
        self.live = False  # steps built or promised and not yet read (rank 0 must finish them if it stops)
        self.width = cfg.sampling.repetition_context
        self.no_draft = _no_draft()

    # -- one step ---------------------------------------------------------------------------------
    def _step(self, inputs: mx.array, window: mx.array, j: int):
        """Build step j: feed inputs; -> (its token [1], its packet, window, hidden rows or None)."""
        e, sampling = self.e, self.cfg.sampling
        logits, hidden = e.target.forward(inputs, e.cache, self.want_hidden)
        window = mx.concatenate([window, inputs[-1:]])[-self.width :]
        key = e._next_key()  # every rank draws its keys in step (only rank 0's are used)
        value = None
        if self.leader:
            promise = not self.stopping and j + 2 < self.n
            if promise:
                self.promised = max(self.promised, j + 2)
            context = window if sampling.penalized else None
            token = e._choose(logits[-1:], context, self.no_draft, sampling, key)[1:2]
            value = mx.concatenate([token, mx.array([int(promise), int(self.closing), 0], dtype=mx.int32)])
        with e.collective("token"):
            packet = share(e.group, value, TOKEN_WIDTH, after=[logits])
        self.built = j
        return packet[0:1], packet, window, hidden

    def start(self) -> None:
        e = self.e
        first = e._replay + [e._last]
        e._replay = []
        window = mx.array(e._history[:-1][-self.width :], dtype=mx.int32)
        self.token, self.packet, self.window, self.hidden = self._step(mx.array(first, dtype=mx.int32), window, 0)
        e.held.fed(first, self.hidden)
        host.start(self.packet)

    def advance(self, emit: bool) -> tuple[list[int], bool, bool]:
        """Build the next step if promised, read the current token, keep the books.
        -> (tokens emitted, stopped by a stop token, the stretch is over)."""
        e, i, stats = self.e, self.i, self.e.stats
        t_cycle = time.perf_counter()
        current, current_hidden = self.packet, self.hidden
        build = i + 1 <= self.promised
        if build:
            self.token, self.packet, self.window, self.hidden = self._step(self.token, self.window, i + 1)
            host.start(self.packet)
        t_sync = time.perf_counter()
        e.guard.beat(f"decoding plain token {stats.generated + 1} (its collectives and rank 0's token)")
        tok, promise, closing, _ = host.read(current)  # the token's one host synchronisation
        t_back = time.perf_counter()
        if not self.leader:
            if promise:
                self.promised = max(self.promised, i + 2)
            self.closing = self.closing or bool(closing)
        if e.drafter is not None:
            e.drafter.commit(Verdict(0, 0, [tok]), current_hidden[-1:] if self.want_hidden else None)
            if self.until is not None and not self.stopping and i + 2 < self.n and self.until():
                self.stopping = True  # a member has a draft: no more promises
        if build:
            e.held.fed([tok], self.hidden)
        e._last = tok
        emitted, stopped = e._emit([tok], self.cfg) if emit else ([tok], tok in self.cfg.stop_tokens)
        stats.record_cycle(0, 0, len(emitted))
        stats.time_host += (t_sync - t_cycle) + (time.perf_counter() - t_back)
        stats.decode_time = time.perf_counter() - self.t_decode
        stats.peak_memory = mx.get_peak_memory()
        self.i += 1
        return emitted, stopped, stopped or not build

    # -- the whole stretch ------------------------------------------------------------------------
    def run(self):
        """Yield one Step per token (core/engine.py's `_plain` contract)."""
        self.start()
        while True:
            emitted, stopped, over = self.advance(emit=True)
            self.live = not over
            yield Step(emitted, [], 0)
            if over:
                if self.closing and not stopped and not self.leader:
                    raise Ended  # rank 0's consumer left: the generation ends with the promised steps
                return

    def drain(self) -> tuple[int, bool]:
        """Rank 0, its consumer gone mid-stretch: build and read the steps already promised, flagged
        closing. -> (steps built here, whether a stop token or max_tokens ended them on every rank)."""
        self.stopping = self.closing = True
        built_before = self.built
        while self.live:
            _, stopped, over = self.advance(emit=True)
            self.live = not over
            if stopped:
                return self.built - built_before, True
        return self.built - built_before, self.e.stats.generated >= self.cfg.max_tokens
