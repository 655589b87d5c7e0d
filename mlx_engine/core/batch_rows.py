"""The batch engine's rows: a queued sequence getting its row (a prefix copied in from the prefix tree or
another row, or an empty row), a row leaving (its entries stored in the prefix tree), a row's first token,
and its drafter's stage (begun on the prompt, fed a chunk per step, then drafting: adopted by the batched
MTP head or kept as the row's own). BatchEngine (core/batch_engine.py) holds the state; this is its half
that changes which rows there are.
"""

from __future__ import annotations

import copy
import time

import mlx.core as mx
from mlx.utils import tree_map

from .. import host
from ..drafters.base import Verdict
from ..target_model import batch_kinds
from .batch_prefill import Prefilling, row_prefix
from .batch_sequence import Output, RunningSequence
from . import drafter_prefix

GROW_BYTES = 16 << 20  # new cache buffers a step may allocate ahead of a prompt being fed (~1 ms a MB here)


class BatchRows:
    # -- a new sequence's row --------------------------------------------------------------------------
    def _held(self, s: RunningSequence) -> tuple[list[int], int, bool]:
        """(tokens, how many of them row s's cache entries hold, whether it is still feeding its prompt)."""
        p = self.prefills.feeding(s)
        return (s.prompt, p.done, True) if p is not None else (s.history, len(s.history) - 1, False)

    def _hidden_of(self, s: RunningSequence) -> list:
        p = self.prefills.feeding(s)
        return p.hidden if p is not None else s.hidden_rows

    def _start_next(self, outputs: list[Output]) -> None:
        """Give one queued sequence its row: the longest prefix the prefix tree or another row holds is copied
        in; with nothing to reuse the row starts empty (a batch without rows: its first chunk fed alone)."""
        for p in [p for p in self.prefills.queued if p.seq.cancelled]:
            self.prefills.leave(p)
            outputs.append(Output(p.seq.id, [], "cancelled", p.seq.stats(self.num_draft)))
        found = self.prefills.next_start([(*self._held(s), self.prefills.feeding(s)) for s in self.seqs],
                                         copyable=self.positional)
        if found is None:
            return
        p, n, source = found
        self.prefills.mark(p, n)
        states, hidden = None, []
        if n and source is None:
            hit = self.prefills.tree_hit(p)
            n, states = hit.n, self._merged(hit.layers, hit.checkpoint) if hit.n else None  # (shorter than min_tokens: 0)
            hidden = [hit.hidden] if hit.hidden is not None else []
            if hit.drafter is not None:  # the drafter's entries too: its stage skips them (drafter_prefix.py)
                p.drafter_prefix = (hit.drafter, hit.drafter_n)
        elif n:  # a copy made first: a write from views of the arrays it goes into copies every row (~0.1 s a 2k row)
            states = tree_map(mx.contiguous, row_prefix([bc.row(source) for bc in self.cache], n))
            host.wait(states)
            rows = self._hidden_of(self.seqs[source])
            hidden = [mx.concatenate(rows)[:n]] if self.want_hidden and rows else []
        reused, fresh = n, True
        if n:
            fresh = self._append_row(states, n, n + self.prefills.prefill_step) or n > self.prefills.prefill_step
        elif self.cache:
            fresh = self._append_row([batch_kinds.empty_row(bc) for bc in self.cache], 0, self.prefills.prefill_step)
        else:  # no rows to take shapes from: feed the first chunk alone (nobody is decoding to wait for it)
            n = self._first_chunk_alone(p, hidden)
        p.hidden = hidden
        p.fresh = fresh  # its join took this step's time (other rows copied, or a long prefix written): no chunk yet
        self.prefills.start(p, n, reused)
        self.seqs.append(p.seq)
        if n > reused:  # its first chunk fed alone: at a checkpoint mark, its states go to the tree
            self._fed(p)

    def _merged(self, positional: list, checkpoint: list | None) -> list:
        """Per-layer states from the positional layers' and the recurrent layers' (a checkpoint), in layer order."""
        if self.positional:
            return positional
        kinds = iter(positional), iter(checkpoint)
        return [next(kinds[0]) if batch_kinds.positional(c) else next(kinds[1]) for c in self.target.make_cache()]

    def _split_states(self, states: list) -> tuple[list, list | None]:
        """Per-layer states -> (the positional layers', the recurrent layers' or None)."""
        if self.positional:
            return states, None
        single = self.target.make_cache()
        return ([st for c, st in zip(single, states) if batch_kinds.positional(c)],
                [st for c, st in zip(single, states) if not batch_kinds.positional(c)])

    def _append_row(self, states: list, n: int, capacity: int = 0) -> bool:
        """A new row from per-layer states of n positions (KV: (keys, values) [1, H, n, D]; recurrent: its
        arrays [1, ...]): copied into the batch cache, which then has room for `capacity` positions per row
        (what it holds and a chunk: the rest of a long prompt's room is grown a few layers per step,
        `_grow_ahead`). True when the other rows were copied with it (no spare row to join into)."""
        if not self.cache:
            self.cache = [batch_kinds.batch_layer(c) for c in self.target.make_cache()]
        spare, copied = self._spare_rows(), False
        for bc, state in zip(self.cache, states):
            bc.spare = spare
            copied = batch_kinds.join(bc, state, capacity, n) or copied
        host.wait([a for bc in self.cache for a in bc.state])
        self._reshaped = True
        return copied

    def _spare_rows(self) -> int:
        """Rows the batch cache holds beyond the live ones when its arrays are made anew (target_model/
        batch_cache.py): one while another request could still join (a free slot, the rows joining counted,
        and the memory budget holds one more row at the longest extent), so that it joins in place."""
        return int(self.free_slots() > 0 and self.can_admit(1, 1))

    def _first_chunk_alone(self, p: Prefilling, hidden: list) -> int:
        """The first row of an empty batch: p's first chunk through a single-sequence cache (its hidden rows
        added to `hidden`), appended as the batch's first row. A one-token prompt feeds its token and trims
        it again (the row then starts empty). -> the positions the row holds."""
        n = max(1, min(self.prefills.chunk_size([], 0, None), p.total - 1))
        n = min(n, self.prefills.next_mark(p, 0) or n)  # (a recurrent model: up to its first checkpoint)
        single = batch_kinds.single_cache(self.target)
        _, h = self.target.forward(mx.array(p.seq.prompt[:n]), single, self.want_hidden)
        if p.total == 1:
            n = 0
        elif self.want_hidden:
            hidden.append(h)
        self._append_row([batch_kinds.row_state(c, n) for c in single], n, n + self.prefills.prefill_step)
        return n

    def _drop(self, rows: list[int]) -> None:
        """Remove these rows (finished or cancelled), their entries stored in the prefix tree first."""
        if not rows:
            return
        for i in rows:
            s = self.seqs[i]
            tokens, held, _ = self._held(s)
            fed = tokens[:held]  # every token whose entries the row holds
            drafter = drafter_prefix.row_states(self, s) if self.prefix_cache is not None else None
            if self.prefix_cache is not None and (len(fed) > self.prefix_cache.match(fed) or drafter is not None):
                self._store_row(i, fed, self._hidden_of(s), drafter)
            p = self.prefills.joining.get(s.id)
            if p is not None:
                self.prefills.leave(p)
        gone = {id(self.seqs[i]) for i in rows}
        keep = [i for i in range(len(self.seqs)) if i not in set(rows)]
        for bc in self.cache:
            bc.keep_rows(keep)
        if self.batched is not None and any(id(s) in gone for s in self.adopted):
            self.batched.keep_rows([j for j, s in enumerate(self.adopted) if id(s) not in gone])
            self.adopted = [s for s in self.adopted if id(s) not in gone]
        self.seqs = [self.seqs[i] for i in keep]
        if not self.seqs:
            self.cache = []
        self._reshaped = True

    def _store_row(self, i: int, fed: list[int], hidden_rows: list, drafter=None) -> None:
        """Row i's entries of `fed` (every token it holds) into the prefix tree, its recurrent layers' states
        as the checkpoint after them, with its hidden rows and drafter states."""
        states, checkpoint = self._split_states([batch_kinds.prefix(bc, i, len(fed)) for bc in self.cache])
        hidden = mx.concatenate(hidden_rows)[: len(fed)] if hidden_rows else None
        if not (self.prefix_cache.with_hidden and (hidden is None or hidden.shape[0] < len(fed))):
            drafter_prefix.store(self.prefix_cache, fed, states, hidden, drafter, checkpoint)

    def _fed(self, p: Prefilling) -> None:
        """A chunk of p's prompt has crossed every layer (p.done is up to date): at one of its checkpoint marks
        (a recurrent model: prefill_queue.marks) the row's states go into the prefix tree."""
        if self.prefix_cache is None or p.done not in p.marks:
            return
        self._store_row(self.seqs.index(p.seq), p.seq.prompt[: p.done], p.hidden)
        self.prefills.checkpoints += 1

    def _grow_ahead(self) -> None:
        """Capacity for the prompts being fed, grown ahead of need, doubling, the layers with the least first,
        GROW_BYTES of new buffers a step while a row decodes (each layer's cache grows on its own; the
        prompt is fed only as far as the room grown, `fed_room`); all at once when none does. Giving a
        row its whole room at once took ~280 ms for an 8k prompt beside a 300-token row here (3.6
        decoding steps, in the step of a stream beside it)."""
        room = max((p.room for p in self.prefills.joining.values() if not p.sampled), default=0)
        waiting = any(self.prefills.feeding(s) is None for s in self.seqs)
        spent, spare = 0, self._spare_rows()
        for bc in sorted(self.cache, key=lambda bc: bc.capacity):
            bc.room, bc.spare = room, spare
            if not waiting:
                bc.reserve(room)
            elif spent < GROW_BYTES and 0 < bc.capacity < room:
                new = bc.toward_room()
                spent += bc.nbytes * new // bc.capacity
                bc.reserve(new)

    # -- stage 2: the drafter ----------------------------------------------------------------------------
    def _begin_drafter(self, p: Prefilling) -> None:
        """After p's first token: its drafter begun on the prompt (fed a chunk per step from now on)."""
        s = p.seq
        hidden = mx.concatenate(p.hidden) if self.want_hidden else None
        p.hidden = [hidden] if hidden is not None else []
        s.hidden_rows = list(p.hidden)
        if self.batched is not None:
            p.drafter = self.batched.begin_row(s.history, hidden)
        elif self.drafter is not None:
            p.drafter = copy.copy(self.drafter)
            p.drafter.begin(list(s.history), hidden)
        p.drafter_left = len(s.history) if p.drafter is not None else 0
        if p.drafter is not None and p.drafter_prefix is not None:  # a prefix-tree hit held its entries too
            p.drafter.restore(*p.drafter_prefix)
            p.drafter_left -= p.drafter_prefix[1]
            p.drafter_prefix = None
        if p.drafter is None:
            self.prefills.leave(p)
        elif not hasattr(p.drafter, "prefill_pending"):  # nothing to feed (prompt lookup): drafts from the next step
            self._ready(p)

    def _feed_drafter(self, feeding_rows: int) -> None:
        """One chunk of one begun drafter's prompt; a drafter with nothing left joins: its row drafts from the
        next step. Every step feeds one, beside any prompt chunks (then with half the budget: the two share
        the step): its row has handed out its first token and waits for it, and a long prompt arriving must
        not hold that row for its whole prefill."""
        begun = [p for p in self.prefills.joining.values() if p.sampled]
        if not begun:
            return
        p = min(begun, key=lambda p: p.drafter_left)  # the least left first: a short prompt's row waits least
        decoding = sum(s.id not in self.prefills.joining for s in self.seqs)
        budget = self.prefills.budget(self.step_times, decoding)
        if self.prefills.drafter_chunk(p, budget / 2 if feeding_rows else budget):
            self._ready(p)

    def _ready(self, p: Prefilling) -> None:
        s = p.seq
        if self.batched is not None:
            self.batched.adopt(p.drafter)
            self.adopted.append(s)
        else:
            s.drafter = p.drafter
            if hasattr(s.drafter, "flush"):  # what is left of its prefill now, not in the next (timed) step
                s.drafter.flush()
                host.wait([c.state for c in getattr(s.drafter, "cache", [])])
        self.prefills.leave(p)
        self._reshaped = True

    def _commit(self, s: RunningSequence, k: int, ki: int, n: int, tokens: list[int], h, forced: bool = False) -> None:
        """The row's drafter takes the step's verdict: the batched head (drafted k for every row), the row's
        own (drafted ki), or one still being fed its prompt (drafted nothing). `forced`: the row's grammar
        drafted, not its own drafter, which hears of the tokens one at a time, as in a plain stretch."""
        if self.batched is not None and s in self.adopted:
            self.batched.commit(self.adopted.index(s), Verdict(k, n, tokens), h)
            return
        p = self.prefills.joining.get(s.id)
        drafter = p.drafter if p is not None and p.sampled else s.drafter
        if drafter is None:
            return
        if forced:
            for j, t in enumerate(tokens):
                drafter.commit(Verdict(0, 0, [t]), h[j : j + 1] if h is not None else None)
        else:
            drafter.commit(Verdict(ki, n, tokens), h)

    def _ready_to_draft(self, s: RunningSequence) -> bool:
        if self.prefills.feeding(s) is not None:
            return False
        if self.batched is not None:
            return s in self.adopted
        p = self.prefills.joining.get(s.id)
        return s.drafter is not None and p is None

    def _first_token(self, p: Prefilling, first: int, outputs: list[Output], logprobs: list | None = None) -> bool:
        """p's prompt is in: hand out its first token (`logprobs`: its own, when asked for), begin its drafter.
        True when that token ends it."""
        s = p.seq
        s.history.append(first)
        s.counts[first] += 1
        s.last = first
        if s.matcher is not None:
            s.matcher.consume([first])
        s.prompt_time = time.perf_counter() - p.started
        s.t_decode = time.perf_counter()
        p.sampled = True
        if first in s.stop_tokens or s.max_tokens == 1:
            outputs.append(Output(s.id, [first], "stop" if first in s.stop_tokens else "length",
                                  s.stats(self.num_draft), logprobs))
            return True
        outputs.append(Output(s.id, [first], logprobs=logprobs))
        self._begin_drafter(p)
        return False

    def fed_room(self, width: int) -> int:
        """Prompt tokens a row may be fed in this pass without a layer's cache growing in it (a pass of
        `width` tokens a row writes that many positions past every row's length)."""
        if not self.cache:
            return 1 << 30
        return min(bc.capacity - max(bc.lens, default=0) for bc in self.cache) - max(width - 1, 0)
