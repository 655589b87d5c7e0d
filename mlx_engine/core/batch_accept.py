"""The acceptance stage of a batch step: the acceptance rule of each row over its own drafts (and a feeding
row's first token from its last prompt token's logits), on device, then the step's ONE host read of every
row's verdict (with the logprob rows of the rows that ask for them).

A decoding row's verdict is [n, t_0..t_ki] (n drafts accepted, then the tokens to emit: accepted drafts and
the target's own); a row whose prompt ends in this pass reads [0, first]. A constrained row's target rows
are masked by its grammar first (the masks built on the host while the device runs the pass).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

from .. import host
from ..sampling import host_logprobs, logprob_rows, row_counts, token_counts
from . import batch_grammar
from .batch_plan import StepPlan
from .verify import choose_row


@dataclass
class Verdicts:
    values: list  # the read verdicts, row after row
    flat: list = field(default_factory=list)  # the logprob rows, flattened
    at: dict = field(default_factory=dict)  # row -> (offset in flat, rows, width)

    def logprobs_of(self, i: int, tokens: list[int]):
        """Row i's emitted tokens with their logprobs (None: it did not ask for them)."""
        if i not in self.at:
            return None
        at, n, w = self.at[i]
        flat = self.flat
        return host_logprobs(tokens, [flat[at + r * w : at + (r + 1) * w] for r in range(min(n, len(tokens)))])


class Acceptance:
    def _accept(self, plan: StepPlan, logits: mx.array, hidden) -> Verdicts:
        """Every row's verdict, read in one host synchronisation (plan.firsts: the rows whose first token it
        holds)."""
        masks = {}
        if plan.constrained or any(f is not None and self.seqs[i].matcher is not None
                                   for i, f in enumerate(plan.feeding)):
            host.start(logits)  # the device runs the pass while the host builds the constrained rows' masks
            masks = batch_grammar.masks(self.seqs, plan.on_host)
        outs = []
        vocab = logits.shape[-1]
        lp_parts, lp_at = [], {}  # the logprob rows of rows that ask for them; row i's: (offset, rows, width)

        def with_logprobs(i: int, rows: mx.array, out: mx.array) -> None:
            """Row i's tokens out[1:] (one per logits row) with their logprob rows, when it asks for them."""
            if self.seqs[i].logprobs is None:
                return
            part = logprob_rows(rows, out[1 : rows.shape[0] + 1], self.seqs[i].logprobs)
            lp_at[i] = (sum(p.size for p in lp_parts), part.shape[0], part.shape[1])
            lp_parts.append(part.reshape(-1))

        for i, s in enumerate(self.seqs):  # the acceptance rule over the row's own ki drafts; a prompt's first token
            f = plan.feeding[i]
            if plan.idle[i]:
                continue
            if f is not None:
                fed = plan.fed[i]
                if f.done + fed == f.total and (i not in plan.spans or plan.spans[i].end == self.layer_count):
                    context = mx.array(s.prompt[-s.sampling.repetition_context:]) if s.sampling.penalized else None
                    outs.append(choose_row(logits[i, fed - 1 : fed], context, mx.zeros((0,), mx.int32), None,
                                           s.sampling, s.next_key(), s.matcher.mask() if s.matcher else None))
                    with_logprobs(i, logits[i, fed - 1 : fed], outs[-1])
                    plan.firsts.append(i)
                continue
            ki = plan.ks[i]
            draft = plan.drafts.get(i)
            d_tokens = draft.tokens[:ki] if ki > 0 else mx.zeros((0,), mx.int32)
            d_probs = draft.probs[:ki] if ki > 0 and draft.probs is not None else None
            context = None
            if s.sampling.penalized:
                context = mx.concatenate([mx.array(s.history[-s.sampling.repetition_context :]), d_tokens])
            counts = row_counts(token_counts(s.counts, vocab), d_tokens) if s.sampling.counted else None
            outs.append(choose_row(logits[i, : ki + 1], context, d_tokens, d_probs, s.sampling, s.next_key(),
                                   masks.get(i), draft.cut_probs if draft is not None else None, counts))
            with_logprobs(i, logits[i, : ki + 1], outs[-1])
        carried = [sp.captured for sp in plan.spans.values() if sp.end < self.layer_count]
        carried += [h for sp in plan.spans.values() for h in (sp.kept or {}).values()]
        if carried:
            host.start(*carried)  # (evaluated with the read below)
        if lp_parts:  # the step's one host synchronisation, with the logprob rows
            values, flat = host.read_all(mx.concatenate(outs), mx.concatenate(lp_parts))
            return Verdicts(values, flat, lp_at)
        if outs:
            return Verdicts(host.read(mx.concatenate(outs)))  # the step's one host synchronisation
        # a pass that only fed prompt chunks: wait for it, or nothing ever runs it until a later read
        # (the chunks' graph would pile up, the sizer would time empty steps, a later step would pay all)
        host.wait([a for bc in self.cache for a in bc.state] + carried + ([hidden] if hidden is not None else []))
        return Verdicts([])
