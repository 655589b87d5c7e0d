"""The batch engine's joining sequences: a new prompt is prefilled INSIDE the batch's own steps, a chunk per
step, so a long prompt never stops the streams already decoding and never pays a pass of its own.

A sequence goes through three stages:
  0. queued (`add`): no row yet. At most one queued sequence starts per step: it gets a row of the batch
     cache at once, holding the longest prefix the prefix tree, or another row of the batch, already has
     (copied in); with nothing to reuse the row is empty (a batch with no rows yet feeds the first chunk
     alone: the cache's shapes come from it). A prompt that shares a longer prefix with a row still being
     prefilled waits for that row to feed it (two clients sending one long prompt prefill it once).
  1. its prompt: every step (while rows decode: one such row a step, the one with the least left), each
     such row feeds the next `chunk` tokens of its prompt as its rows of the batch's forward pass, beside
     the decoding rows' [last, drafts] (a row with fewer tokens is padded and
     its padding trimmed right after, as for drafts). The step that feeds the last prompt token samples its
     first token from that token's logits and hands it out at once.
  2. its drafter: a drafter that keeps state over the prompt (an MTP head, a draft model) is begun on the
     prompt and fed a chunk per step (`prefill_pending`) while the row already decodes plainly; then it
     drafts like the others' (the batched MTP head adopts it as a row).
The chunk is sized from measured step times (core/chunk_sizer.py): the whole step, decoding rows and
chunk together, is held to `STEP_BUDGET` x the median step of decoding alone (a stream's gap between
tokens stays within ~2.2x its median: the weights are read once for both), or `idle_budget` seconds
when no row decodes; such a chunk then crosses the layers in shares of ~IDLE_STEP (`span`), so new
arrivals and cancellations are seen within a share (a drafter's chunk fed alone aims at it too). Where even one
token does not fit (deep in a long prompt, its attention alone outweighs a decoding step), the token
crosses the decoder layers over several steps, as many per step as fit, its hidden state carried
between them (`span`, target_model/layer_span.py). A cancelled
sequence leaves at once; what it had fed goes to the prefix tree, so a retry resumes there.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import mlx.core as mx
from mlx.utils import tree_map

from ..target_model.layer_span import Span
from ..target_model.prefix_cache import common_prefix
from .batch_sequence import RunningSequence
from .batch_turn import SMALL_PROMPT
from .chunk_sizer import ChunkSizer

STEP_BUDGET = 2.2  # a step that feeds prompt chunks may take this many times the median decoding step
WAIT_FOR_TWIN = 32  # a new prompt waits for a row still feeding this many more tokens it shares
IDLE_STEP = 0.12  # seconds a step feeding a prompt alone aims at (its chunk crossing the layers in shares): what a
# request arriving meanwhile may wait for (0.25 s before: a short request's wait ~3.5x its idle TTFT at most)
# such a chunk waits while rows decode (beside them its whole width would run every layer's matmuls each
# step), at most this many steps, then crosses the rest of the layers in one step
PAUSE_STEPS = 32
CHECKPOINT_EVERY = 2048  # a recurrent model's prompt leaves a checkpoint in the prefix tree every this many tokens


@dataclass
class Prefilling:
    seq: RunningSequence
    done: int = 0  # prompt positions its row holds
    reused: int = 0  # of which were copied in (prefix tree or another row)
    hidden: list = field(default_factory=list)  # target hidden rows of those positions (drafters that read them)
    drafter: object | None = None  # stage 2: the begun drafter while its pending prompt is fed
    drafter_left: int = 0  # its pending prompt positions (what prefill_pending last said)
    drafter_prefix: tuple | None = None  # the prefix tree's drafter entries for its prompt (states, positions)
    sampled: bool = False  # stage 1 done: the first token is out
    fresh: bool = True  # its row was made this step (the copies it took are this step's cost: no chunk yet)
    layer: int = 0  # > 0: a chunk is crossing the layers (layer_span): the next layer it enters
    share: int = 0  # layers per step of a chunk fed alone crossing in shares (IDLE_STEP)
    paused: int = 0  # steps that chunk has waited while rows decode (PAUSE_STEPS at most)
    carried: object | None = None  # that chunk's hidden state at the input of `layer` [n, H]
    inflight: int = 0  # that chunk's tokens
    kept: dict = field(default_factory=dict)  # that chunk's outputs of the inner layers its drafter reads
    marks: set = field(default_factory=set)  # a recurrent model: prompt positions whose states go to the tree
    drafter_sizer: ChunkSizer = field(default_factory=lambda: ChunkSizer(first=64, largest=2048))
    started: float = field(default_factory=time.perf_counter)

    @property
    def room(self) -> int:
        """Cache positions its row needs while fed: the whole prompt and the first token."""
        return self.total + 1

    @property
    def total(self) -> int:
        return len(self.seq.prompt)

    def left(self) -> int:
        """Prompt positions still to feed (the drafter's pending count once the target is done)."""
        return self.total - self.done if not self.sampled else self.drafter_left

    def chunk(self, n: int) -> list[int]:
        """The next (at most) n prompt tokens to feed."""
        return self.seq.prompt[self.done : self.done + n]


class PrefillQueue:
    def __init__(self, target, want_hidden, tree, prefill_step: int = 512, idle_budget: float = 1.0,
                 checkpoint_every: int = CHECKPOINT_EVERY):
        self.target, self.want_hidden, self.tree = target, want_hidden, tree
        self.prefill_step, self.idle_budget = prefill_step, idle_budget
        self.checkpoint_every = checkpoint_every
        self.checkpoints = 0  # checkpoints stored at marks (a recurrent model's prompts)
        self.queued: list[Prefilling] = []  # stage 0
        self.joining: dict[object, Prefilling] = {}  # stages 1 and 2, by sequence id (their rows are in the batch)
        self.sizer = ChunkSizer(first=8, largest=prefill_step)
        # the layers whose outputs a chunk crossing in steps keeps for its drafter (as Target reads them:
        # negative indices from the end), in the order of its hidden request
        n = len(target.layers)
        self.keep = tuple(i % n for i in want_hidden.layers) if want_hidden is not None else ()

    def __len__(self) -> int:
        """Sequences that have not joined yet (queued, or a row still feeding its prompt)."""
        return len(self.queued) + sum(not p.sampled for p in self.joining.values())

    @property
    def waiting(self) -> list[Prefilling]:
        return self.queued + list(self.joining.values())

    def add(self, seq: RunningSequence) -> Prefilling:
        p = Prefilling(seq)
        self.queued.append(p)
        return p

    def status(self) -> list[dict]:
        return [{"id": p.seq.id, "done": p.done, "total": p.total, "stage": "drafter" if p.sampled else "target"}
                for p in self.waiting]

    def feeding(self, seq: RunningSequence) -> Prefilling | None:
        """The row's record while its prompt is being fed (stage 1), else None."""
        p = self.joining.get(seq.id)
        return p if p is not None and not p.sampled else None

    # -- stage 0 -> 1 -------------------------------------------------------------------------------------
    def next_start(self, rows: list[tuple], copyable: bool = True) -> tuple[Prefilling, int, int | None] | None:
        """The queued sequence to start now, shortest first: (p, reusable positions, the batch row to copy
        them from or None for the prefix tree), or None. rows: each batch row's (tokens, positions it holds
        of them, whether it is still feeding its prompt, its Prefilling while it does). A prompt that shares
        at least WAIT_FOR_TWIN tokens with a row still feeding them waits until they are fed, then starts
        from them: from that row (copyable: every layer's entries are per token), or else from the prefix
        tree, where the row leaves a checkpoint where the two prompts part (a mark)."""
        for p in sorted(self.queued, key=lambda p: p.total):
            body = p.seq.prompt[:-1]
            best, source = (self.tree.match(body) if self.tree is not None else 0), None
            wait = False
            for r, (tokens, held, feeding, record) in enumerate(rows):
                shared = common_prefix(body, tokens)
                if copyable and min(shared, held) > best:
                    best, source = min(shared, held), r
                twin = feeding and held < shared and shared >= WAIT_FOR_TWIN
                if twin and not copyable and record is not None and self.tree is not None:
                    record.marks.add(shared)
                wait = wait or twin
            if not wait:
                return p, best, source
        return None

    def start(self, p: Prefilling, held: int, reused: int) -> None:
        """p's row holds its first `held` prompt positions, `reused` of them copied in."""
        self.queued.remove(p)
        self.joining[p.seq.id] = p
        p.done, p.reused = held, reused
        p.seq.reused = reused

    def mark(self, p: Prefilling, held: int) -> None:
        """A recurrent model's prompt gets its checkpoint marks past the `held` positions its row starts with:
        where the prefix tree's tokens part from it (its hit ended at an earlier checkpoint, or none: the next
        request sharing as much starts there), every checkpoint_every tokens, and one token before its end (a
        resent prompt starts there; the next turn of the conversation, which extends it, too). Not the end
        itself: a hit must leave a prompt's last token to feed. A short prompt (at most SMALL_PROMPT tokens)
        gets no end mark: it would cost its first token a step, for a re-feed of a few tokens."""
        if self.tree is None or not self.tree.checkpoints:
            return
        parts = self.tree.depth(p.seq.prompt[:-1])
        marks = {parts} | set(range(self.checkpoint_every, p.total, self.checkpoint_every))
        if p.total > SMALL_PROMPT:
            marks.add(p.total - 1)
        p.marks = {m for m in marks if held < m < p.total}

    def next_mark(self, p: Prefilling, done: int) -> int | None:
        """The first checkpoint mark of p past `done` (None: none left)."""
        return min((m for m in p.marks if m > done), default=None)

    def tree_hit(self, p: Prefilling):
        """The prefix tree's entries for p's prompt (per layer (keys, values) of [1, H, n, D]) and hidden rows."""
        return self.tree.lookup(p.seq.prompt[:-1])

    # -- stage 1 --------------------------------------------------------------------------------------
    def chunk_size(self, step_times: list[float], decoding: int, cap: int | None, depth: int | None = None) -> int:
        """Prompt tokens each feeding row may put in this step: sized to STEP_BUDGET x the median decoding
        step, or idle_budget when no row decodes; at most cap (the invariance contract's rows). depth: the
        deepest feeding row's prompt positions."""
        base = 0.0
        if decoding and step_times:
            recent = sorted(step_times[-32:])
            base = recent[len(recent) // 2]
            budget = STEP_BUDGET * base
        else:
            budget = self.idle_budget
        n = min(self.sizer.size(budget, base, depth), self.prefill_step)
        return min(n, cap) if cap else n

    def observe(self, tokens: float, seconds: float, depth: int = 0) -> None:
        self.sizer.observe(tokens, seconds, True, depth)

    def span(self, p: Prefilling, row: int, fed: int, budgeted: bool, layers: int) -> Span | None:
        """The layers p's chunk crosses in this step when not all of them (None: all, the usual chunk). A
        chunk already crossing goes on from its layer; a new one-token chunk crosses only the share of the
        layers that fits the budget while rows decode. While none does, a chunk sized for idle_budget
        crosses in steps of about IDLE_STEP each (the layers it does not cross are skipped: a request
        arriving meanwhile waits for one such step, not for the whole chunk)."""
        if p.layer > 0:
            left = layers - p.layer
            if p.share:  # a chunk fed alone in shares: beside decoding rows (paused long enough) it finishes
                step = left if budgeted else min(left, p.share)
            else:
                step = self.sizer.layers(p.inflight, left, layers) if budgeted else left
            return Span(row, p.layer, p.layer + step, p.inflight, p.carried, keep=self.keep, kept=p.kept)
        p.kept = {}
        if budgeted and fed == 1 and self.sizer.fits < 1:
            m = self.sizer.layers(1, layers, layers)
            return Span(row, 0, m, 1, keep=self.keep, kept=p.kept) if m < layers else None
        seconds = self.sizer.predict(fed, p.done) if not budgeted else None
        if seconds is not None and seconds > 1.5 * IDLE_STEP:
            p.share = math.ceil(layers / math.ceil(seconds / IDLE_STEP))
            return Span(row, 0, p.share, fed, keep=self.keep, kept=p.kept) if p.share < layers else None
        return None

    def reshare(self, p: Prefilling, span: Span, seconds: float) -> None:
        """After a share of p's chunk fed alone took `seconds`: its next shares sized from it, the layers that
        fit IDLE_STEP at this depth. The first share comes from the sizer's prediction of the whole chunk,
        which was off up to 2x here (steps of 0.22 s aimed at 0.12 s), and a request arriving waits for the
        step in flight."""
        if p.share and seconds > 0:
            p.share = max(1, int(IDLE_STEP * (span.end - span.start) / seconds))

    def crossed_hidden(self, p: Prefilling, hidden: mx.array) -> mx.array:
        """The hidden rows [n, H'] a drafter reads of p's chunk after the pass that ends its crossing:
        the inner layers' outputs as kept in the passes that crossed them, the final state (if asked for)
        from this one, whose other columns are the rows' resting garbage. A chunk in one pass: `hidden`."""
        if not p.kept:
            return hidden
        width = hidden.shape[-1] // (len(self.keep) + int(self.want_hidden.final))
        parts = [p.kept[i] for i in self.keep]
        parts += [hidden[:, len(self.keep) * width :]] if self.want_hidden.final else []
        p.kept = {}
        return mx.concatenate(parts, axis=-1)

    def paused_beside(self, p: Prefilling) -> bool:
        """Whether p's chunk, crossing in shares, waits this step (rows decode; PAUSE_STEPS at most)."""
        if p.share and p.layer > 0 and p.paused < PAUSE_STEPS:
            p.paused += 1
            return True
        return False

    def crossed(self, p: Prefilling, span: Span | None, layers: int) -> bool:
        """After the pass: True when p's chunk has crossed every layer (its logits and hidden state are
        real); else it carries on from span.end in the next step."""
        if span is None or span.end == layers:
            p.layer, p.carried, p.inflight, p.share, p.paused = 0, None, 0, 0, 0
            return True
        p.layer, p.carried, p.inflight = span.end, span.captured, span.tokens
        return False

    # -- stage 2 ----------------------------------------------------------------------------------------
    def drafter_chunk(self, p: Prefilling, budget: float | None) -> bool:
        """Feed one chunk of the begun drafter's pending prompt. True when it has nothing left to feed."""
        feed = getattr(p.drafter, "prefill_pending", None)
        if feed is None:
            return True
        n = p.drafter_sizer.size(budget)
        t = time.perf_counter()
        p.drafter_left = feed(n)
        p.drafter_sizer.observe(n, time.perf_counter() - t, budget is not None)
        return p.drafter_left == 0

    def budget(self, step_times: list[float], running: int) -> float:
        """Seconds a drafter chunk may take: the running batch's median step; while none decodes IDLE_STEP (at
        most idle_budget), as a target chunk's share: a request arriving waits for the chunk in flight (the MTP
        head's part of an 8k prompt went in chunks of idle_budget, 1 s, before)."""
        if running == 0 or not step_times:
            return min(self.idle_budget, IDLE_STEP)
        recent = sorted(step_times[-32:])
        return recent[len(recent) // 2]

    def leave(self, p: Prefilling) -> None:
        """p leaves (joined, finished or cancelled)."""
        if p in self.queued:
            self.queued.remove(p)
        self.joining.pop(p.seq.id, None)


def row_prefix(states: list, n: int) -> list:
    """The first n positions of per-layer (keys, values) states [1, H, L, D] (quantized: parts)."""
    return [tree_map(lambda a: a[:, :, :n], s) for s in states]
