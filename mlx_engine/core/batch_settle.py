"""The last stages of a batch step, after the host read: each row's rollback to what it keeps (every cache
layer told at once, core/batch_plan.py's `kept` the one rule), then per row its drafter's commit, its
grammar's advance, and its tokens emitted.

The cache kinds carry their own rollback (`end_pass(width, kept)`): a KV layer lowers each row's length, a
recurrent layer takes each row's state after its last kept token (target_model/batch_recurrent.py).
"""

from __future__ import annotations

import time

from .batch_accept import Verdicts
from .batch_plan import StepPlan
from .batch_sequence import Output


class Settle:
    def _rollback(self, plan: StepPlan, accepted: dict[int, int]) -> None:
        """Every layer keeps, of the pass's positions, what each row keeps there (accepted: row -> n)."""
        rows = range(len(self.seqs))
        for layer, bc in enumerate(self.cache):
            bc.end_pass(plan.width, [plan.kept(i, layer, accepted.get(i)) for i in rows])

    def _settle(self, plan: StepPlan, verdicts: Verdicts, hidden, outputs: list[Output]) -> tuple[list[int], list[int]]:
        """Roll back, commit and emit every row. -> (rows that finished, each decoding row's accepted drafts)."""
        values, start = verdicts.values, 0
        firsts, found = {}, {}  # row -> its first token; decoding row -> (n, tokens)
        for i in range(len(self.seqs)):
            if i in plan.firsts:
                firsts[i] = values[start + 1]
                start += 2
            elif i in plan.decoding:
                ki = plan.ks[i]
                row = values[start : start + ki + 2]  # [n, t_0..t_ki]
                start += ki + 2
                found[i] = (row[0], row[1 : row[0] + 2])
        self._rollback(plan, {i: n for i, (n, _) in found.items()})
        accepted, finished = [], []
        for i, s in enumerate(self.seqs):
            f = plan.feeding[i]
            h = hidden[i] if hidden is not None else None
            if plan.idle[i]:
                continue
            if f is not None:
                fed = plan.fed[i]
                if not self.prefills.crossed(f, plan.spans.get(i), self.layer_count):
                    continue
                if h is not None:
                    f.hidden.append(self.prefills.crossed_hidden(f, h[:fed]))
                f.done += fed
                self._fed(f)
                if i in firsts and self._first_token(f, firsts[i], outputs, verdicts.logprobs_of(i, [firsts[i]])):
                    finished.append(i)
                continue
            n, tokens = found[i]
            accepted.append(self._emit_row(plan, i, n, tokens, h, verdicts, outputs, finished))
        return finished, accepted

    def _emit_row(self, plan: StepPlan, i: int, n: int, tokens: list[int], h, verdicts: Verdicts,
                  outputs: list[Output], finished: list[int]) -> int:
        """Decoding row i accepted n drafts and emits `tokens`: its grammar, drafter and figures follow.
        -> the drafter's drafts it accepted (the policy's evidence)."""
        s, ki, forced = self.seqs[i], plan.ks[i], i in plan.forced
        if s.matcher is not None:  # the rejected drafts leave the matcher, the target's token joins it
            s.matcher.settle(ki, n, tokens[n])
        self._commit(s, plan.k, ki, n, tokens, h, forced=forced)
        if h is not None:
            s.hidden_rows.append(h[: n + 1])
        real = min(getattr(plan.drafts[i], "n_real", plan.k), ki) if ki > 0 else 0
        emitted, reason = s.emit(tokens)
        if ki > 0:
            s.verifies += 1
            s.verified_tokens += len(emitted)
        if forced:  # the grammar's drafts: counted apart, and not the drafter's evidence
            s.forced += real
            s.forced_accepted += min(n, real, len(emitted))
            real = 0
        else:
            s.drafted += real
            s.accepted += min(n, real, len(emitted))
        s.last = tokens[-1]
        s.decode_time = time.perf_counter() - s.t_decode
        outputs.append(Output(s.id, emitted, reason, s.stats(self.num_draft) if reason else None,
                              verdicts.logprobs_of(i, emitted)))
        if reason:
            finished.append(i)
        return min(n, real)
