"""A stretch of plainly decoded tokens over a sharded target, pipelined as core/engine.py's `_plain`.

Every rank builds the same steps: step i+1's pass is built and started before token i is read. Rank 0
samples each token (under a grammar, masked by its matcher) and shares it in a plain-token packet
(packets.py) that every rank's next step takes as its input, lazily: one collective per token beside the
model's, one host read per token on every rank.

Who builds which step: a follower builds step i+1 before it reads token i, so it must know in advance that
rank 0 will build it. Rank 0's packet of step j promises step j+2 (the announced stretch length promises
steps 0 and 1); rank 0 fills the packet in after reading token j-1 (the pass itself is started before), so
a stop it alone decides after token i (its drafter has a draft again, the consumer of the generation left)
ends the stretch after step i+2: one token later than on one machine. Steps promised are still built and
read on every rank. End of sequence and max_tokens end the stretch on every rank at the same token.
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
    def _forward(self, inputs: mx.array, window: mx.array):
        """Build and start a step's pass. -> (logits, penalty window, hidden rows or None)."""
        logits, hidden = self.e.target.forward(inputs, self.e.cache, self.want_hidden)
        host.start(logits)  # its collectives now, before the packet's, on every rank
        return logits, mx.concatenate([window, inputs[-1:]])[-self.width :], hidden

    def _packet(self, logits: mx.array, window: mx.array, j: int) -> mx.array:
        """Step j's packet: rank 0's token and its promise of step j+2 (decided now, after the last read)."""
        e, sampling = self.e, self.cfg.sampling
        key = e._next_key()  # every rank draws its keys in step (only rank 0's are used)
        value = None
        if self.leader:
            promise = not self.stopping and j + 2 < self.n
            if promise:
                self.promised = max(self.promised, j + 2)
            context = window if sampling.penalized else None
            masks = e._matcher.mask() if e._matcher is not None else None  # (it has every token before)
            token = e._choose(logits[-1:], context, self.no_draft, sampling, key, masks)[1:2]
            value = mx.concatenate([token, mx.array([int(promise), int(self.closing), 0], dtype=mx.int32)])
        with e.collective("token"):
            packet = share(e.group, value, TOKEN_WIDTH, after=[logits])
        host.start(packet)
        self.built = j
        return packet

    def start(self) -> None:
        e = self.e
        first = e._replay + [e._last]
        e._replay = []
        window = mx.array(e._history[:-1][-self.width :], dtype=mx.int32)
        logits, self.window, self.hidden = self._forward(mx.array(first, dtype=mx.int32), window)
        self.packet = self._packet(logits, self.window, 0)
        e.held.fed(first, self.hidden)

    def advance(self, emit: bool) -> tuple[list[int], bool, bool]:
        """Start the next step's pass if promised, read the current token, keep the books, then the next
        step's packet. -> (tokens emitted, stopped by a stop token, the stretch is over)."""
        e, i, stats = self.e, self.i, self.e.stats
        t_cycle = time.perf_counter()
        current, current_hidden = self.packet, self.hidden
        build = i + 1 <= self.promised
        if build:
            logits, window, hidden = self._forward(current[0:1], self.window)
        t_sync = time.perf_counter()
        e.guard.beat(f"decoding plain token {stats.generated + 1} (its collectives and rank 0's token)")
        tok, promise, closing, _ = host.read(current)  # the token's one host synchronisation
        t_back = time.perf_counter()
        if not self.leader:
            if promise:
                self.promised = max(self.promised, i + 2)
            self.closing = self.closing or bool(closing)
        if e._matcher is not None:  # rank 0's grammar, before it masks the next step's token
            e._matcher.consume([tok])
        drafter = e._drafting  # (under a grammar, the grammar's drafter ahead of rank 0's)
        if drafter is not None:
            drafter.commit(Verdict(0, 0, [tok]), current_hidden[-1:] if self.want_hidden else None)
            if self.until is not None and not self.stopping and i + 2 < self.n and self.until():
                self.stopping = True  # a member has a draft: no more promises
        if build:
            self.packet = self._packet(logits, window, i + 1)
            self.window, self.hidden = window, hidden
            e.held.fed([tok], hidden)
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
