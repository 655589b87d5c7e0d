"""The prompt turn of a batch step: which row still feeding its prompt puts a chunk into this step's pass, how
many tokens, across which layers; and, after the pass, what its time teaches the chunk sizer.

One prompt a step, the one with the least left, its chunk sized at its own depth: a short prompt arriving
while a long one is fed goes first, alone (beside the long one's chunk it waited a whole budget; sized for
the deepest, it went a token a step). The chunk is sized so the whole step stays within a multiple of the
median decoding step (core/batch_prefill.py); while prompts are fed, every REMEASURE-th step decodes alone to
measure that median again. A prompt of at most SMALL_PROMPT tokens goes in whole. A recurrent model's
chunk ends at the row's next checkpoint mark (core/batch_prefill.py), where its states go to the prefix tree.
"""

from __future__ import annotations

from .batch_plan import StepPlan

REMEASURE = 16  # steps between two that decode alone while prompts are being fed
SMALL_PROMPT = 64  # a prompt of at most this many tokens is fed whole, in a remeasuring step too (a short
# request's first token waits neither for the measurement that sizes long prompts' chunks nor a second chunk;
# the tail of a long prompt is not one: deep in it a token can cost more than a decoding step)


class PromptTurn:
    def _prompt_turn(self, plan: StepPlan) -> None:
        """Set plan.chunk / depth / fed / spans: the prompt tokens this step's pass feeds."""
        feeding, decoding = plan.feeding, plan.decoding
        # while prompts are fed, every REMEASURE-th step decodes alone: the chunks' budget is a multiple of a
        # decoding step's time, which changes with the batch (and is unknown when all steps so far fed chunks)
        remeasure = decoding and self.steps - self._decoded_alone >= REMEASURE
        # A row just made took this step's time with its copies: while none decodes, no prompt is fed beside
        # them (the newcomer's turn is next).
        turn = [i for i, f in enumerate(feeding) if f is not None and not f.fresh]
        if turn:
            turn = [min(turn, key=lambda i: (feeding[i].left(), i))]
        if not decoding and any(f is not None and f.fresh for f in feeding):
            turn = []
        if decoding and turn and self.prefills.paused_beside(feeding[turn[0]]):
            turn = []
        small = bool(turn) and feeding[turn[0]].total <= SMALL_PROMPT  # shallow: cheap whatever the sizer says
        if turn and (not remeasure or small):
            cap = self.max_k + 1 if decoding and self.max_k < 1 << 30 else None  # invariant passes stay covered
            plan.depth = max(feeding[i].done for i in turn)
            chunk = self.prefills.chunk_size(self.step_times, len(decoding), cap, plan.depth)
            if small:  # a short prompt goes in whole (not a first chunk of 32, then the rest)
                chunk = min(max(chunk, feeding[turn[0]].left()), cap or 1 << 30, self.prefills.prefill_step)
            if decoding:  # fed only as far as the room grown ahead (_grow_ahead): no growth inside the pass
                chunk = max(0, min(chunk, self.fed_room(plan.widest + 1)))
            f = feeding[turn[0]]
            mark = self.prefills.next_mark(f, f.done)  # a recurrent model's chunk ends at its next checkpoint
            if mark is not None:
                chunk = min(chunk, mark - f.done)
            plan.chunk = chunk
        plan.fed = [min(plan.chunk, f.total - f.done) if i in turn else 0 for i, f in enumerate(feeding)]
        for i, f in enumerate(feeding):  # rows whose chunk crosses only some layers in this pass
            if f is not None:
                f.fresh = False
                if plan.fed[i] and self.split_layers and len(self.cache) == self.layer_count:
                    span = self.prefills.span(f, i, plan.fed[i], bool(decoding), self.layer_count)
                    if span is not None:
                        plan.spans[i], plan.fed[i] = span, span.tokens

    def _observe_turn(self, plan: StepPlan, seconds: float) -> None:
        """What the step's time says: a step that only decoded is the reference of the chunks' budget; one that
        fed a chunk teaches the sizer its cost at that depth."""
        spans, fed = plan.spans, plan.fed
        if not plan.chunk and plan.decoding:
            self.step_times = self.step_times[-63:] + [seconds]
            self._decoded_alone = self.steps
        elif plan.decoding:  # a chunk that crossed m of the L layers counts as m / L of its tokens
            self.prefills.observe(max(n * (spans[i].end - spans[i].start) / self.layer_count if i in spans else n
                                      for i, n in enumerate(fed)), seconds, plan.depth)
        elif not any(0 < sp.start and sp.end == self.layer_count and not plan.firsts for sp in spans.values()):
            # fed alone: a share of m layers times as a whole pass's L / m (the chunk keeps its token count).
            # Not a chunk's last share when its output is not read (a first token's logits): that layer's
            # attention and MLP are never evaluated (only its keys and values are), and timed as a whole
            # pass it made the next chunk ~2x too large (its first share 0.6-1.4 s at 3k, aiming at 0.25)
            share = max(((sp.end - sp.start) / self.layer_count for sp in spans.values()), default=1.0)
            self.prefills.observe(max(fed), seconds / share, plan.depth)
            for i, sp in spans.items():
                self.prefills.reshare(plan.feeding[i], sp, seconds)
