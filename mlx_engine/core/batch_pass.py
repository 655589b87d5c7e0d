"""The verify pass of a batch step: every row's tokens in one [B, width] forward over the batch cache.

A decoding row is [last, d_1..d_k] padded with its last token; a feeding row its chunk padded with the
chunk's last token; an idle row a placeholder. What a row's padding writes is dropped by the rollback stage
(StepPlan.kept); its attention is skipped where the row is idle (`idle_rows`) or shorter than the pass
(`real_widths`), and a cache kind that carries state across tokens (a recurrent layer) is told each row's
real tokens before the pass (`begin_pass`), so the padding never enters it.
"""

from __future__ import annotations

import mlx.core as mx

from ..drafters.base import Draft
from ..target_model import layer_span
from ..target_model.batch_sequences import idle_rows, real_widths
from . import batch_grammar
from .batch_plan import StepPlan
from .batch_sequence import padded


def fit(d: Draft | None, n: int) -> Draft | None:
    """A draft cut to at most n tokens (the pass is narrower than the step's k when the lookups found fewer
    drafts: what is cut was the row's padding or beyond its own k)."""
    if d is None or d.tokens.shape[0] <= n:
        return d
    out = Draft(d.tokens[:n], d.probs[:n] if d.probs is not None else None, cut_probs=d.cut_probs,
                confidence=d.confidence[:n] if d.confidence is not None else None)
    object.__setattr__(out, "n_real", min(getattr(d, "n_real", n), n))
    return out


class VerifyPass:
    def _pass_tokens(self, plan: StepPlan) -> mx.array:
        """[B, width] token ids of the pass (plan.drafts padded to width - 1 here)."""
        width = plan.width
        plan.drafts = {i: padded(fit(batch_grammar.first(d, plan.ks[i]) if plan.constrained else d, width - 1),
                                 width - 1, self.seqs[i].last) for i, d in plan.drafts.items()}
        rows = []
        for i, s in enumerate(self.seqs):
            if plan.idle[i]:
                rows.append(mx.full((width,), s.prompt[0], dtype=mx.int32))
            elif plan.feeding[i] is not None:
                toks = plan.feeding[i].chunk(plan.fed[i])
                rows.append(mx.array(toks + [toks[-1]] * (width - len(toks)), dtype=mx.int32))
            elif i in plan.drafts:
                rows.append(mx.concatenate([mx.array([s.last], dtype=mx.int32), plan.drafts[i].tokens]))
            else:
                rows.append(mx.full((width,), s.last, dtype=mx.int32))
        return mx.stack(rows)

    def _verify_pass(self, plan: StepPlan):
        """The pass: (logits [B, width, V], hidden [B, width, H'] or None)."""
        tokens = self._pass_tokens(plan)
        b = len(self.seqs)
        real = [plan.real(i) for i in range(b)]
        for bc in self.cache:
            bc.begin_pass(real, plan.widest + 1 if plan.decoding else 0)
        with idle_rows([i for i in range(b) if plan.idle[i]]), \
                real_widths({i: plan.ks[i] + 1 for i in plan.decoding if plan.ks[i] + 1 < plan.width}), \
                layer_span.crossing(list(plan.spans.values())):
            return self.target.forward_batch(tokens, self.cache, self.want_hidden)
