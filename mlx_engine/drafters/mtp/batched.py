"""One MTP head drafting for every row of a batch: each row keeps its own slot bookkeeping (history,
pending slots, its rows of the head's BatchKVCache), but the head runs once per draft step for all rows
([B, ...] matmuls read the head's and the output layer's weights once, not once per row).

Same slot bookkeeping as MTPDrafter (drafter.py, mtp-heads.md §0), per row:
- `add_row(tokens, hidden)`: begin + flush of a single-sequence MTPDrafter, whose head cache becomes the
  row's rows of the batch caches (the prompt's exact entries) and whose last output h' starts the chain.
- `propose(k, ...)`: feed every row's pending slots in ONE pass (rows with fewer pending slots are padded;
  their padding entries are trimmed right after, per row), then chain k-1 steps on h' for all rows.
- `commit(i, verdict, hidden)`: row i drops its chained draft-time entries and queues its accepted slots
  with the verify pass's true hidden states.
Only heads without sliding windows whose logits come from MTPDrafter's own scorer are batched
(`batchable_mtp`); others draft with a copy per row (BatchEngine's generic path).
"""

from __future__ import annotations

import copy

import mlx.core as mx

from ... import host
from ...sampling import SamplingConfig, choose
from ...target_model.batch_cache import BatchKVCache, append_sequence
from ...target_model.prefix_cache import shifted
from ..base import Draft, Verdict
from .drafter import MTPDrafter, sureness, within


def batchable_mtp(drafter) -> bool:
    return (isinstance(drafter, MTPDrafter) and type(drafter)._logits is MTPDrafter._logits
            and type(drafter).propose is MTPDrafter.propose and all(w is None for w in drafter.head.windows))


class BatchedMTP:
    def __init__(self, proto: MTPDrafter):
        self.proto = proto
        self.head, self.target = proto.head, proto.target
        self.L = proto.num_layers
        self.cache: list[BatchKVCache] = []
        self.history: list[list[int]] = []
        self.pend_h: list[list[mx.array]] = []
        self.pend_tok: list[list[int]] = []
        self.out: list[mx.array | None] = []  # h' [H] of a row's last fed slot, when nothing is pending
        self._chain = [0] * self.L  # chained draft-time entries per layer of the last propose

    # -- rows -------------------------------------------------------------------------------------------
    def add_row(self, tokens: list[int], hidden: mx.array) -> None:
        self.adopt(self.begin_row(tokens, hidden))

    def begin_row(self, tokens: list[int], hidden: mx.array) -> MTPDrafter:
        """A single-sequence drafter begun on a new row's prompt; its pending slots may be fed a piece at a
        time (prefill_pending) before `adopt` makes it a row of the batch."""
        single = copy.copy(self.proto)
        single.begin(list(tokens), hidden)
        return single

    def adopt(self, single: MTPDrafter) -> None:
        """Append a begun single-sequence drafter as a new row (its remaining pending slots fed first)."""
        tokens = single.history
        single.flush()
        self.cache = append_sequence(self.cache, single.cache)
        host.wait([a for bc in self.cache for a in bc.state] + [single._out])
        self.history.append(list(tokens))
        self.pend_h.append([])
        self.pend_tok.append([])
        self.out.append(single._out[0])

    def keep_rows(self, rows: list[int]) -> None:
        for bc in self.cache:
            bc.keep_rows(rows)
        for name in ("history", "pend_h", "pend_tok", "out"):
            setattr(self, name, [getattr(self, name)[i] for i in rows])

    def row_prefix_states(self, i: int) -> tuple[list, int]:
        """Row i's head entries in the prefix tree's frame (MTPDrafter.prefix_states): its fed slots (its
        pending ones are not in the cache yet). Between steps (no chained draft-time entries)."""
        n = self.cache[0].lens[i] if self.cache else 0
        return shifted([bc.row(i) for bc in self.cache], n) if n else ([], 0)

    # -- drafting ---------------------------------------------------------------------------------------
    def _layer(self, i: int, tokens: mx.array, h: mx.array) -> mx.array:
        """Layer i on [B, T] tokens and hidden rows [B, T, H] -> h' [B, T, H] (writes T entries per row)."""
        from mlx_lm.models.base import create_attention_mask

        layer = self.head.layers[i]
        x = layer.project(self.target.embed_tokens(tokens), h)
        mask = create_attention_mask(x, self.cache[i], return_array=True)
        return layer.norm(layer.block(x, mask, self.cache[i]))

    def _feed_pending(self) -> mx.array:
        """Feed every row's pending slots through every layer in one pass; -> h' [B, H] of each row's last slot."""
        counts = [len(t) for t in self.pend_tok]
        width = max(counts)
        if width == 0:
            return mx.stack(self.out)
        hdim = self.out[0].shape[-1] if self.out[0] is not None else self.pend_h[0][0].shape[-1]
        toks, hs = [], []
        for i, n in enumerate(counts):
            toks.append(self.pend_tok[i] + [0] * (width - n))
            h = mx.concatenate(self.pend_h[i]) if n else mx.zeros((0, hdim), mx.float32)
            if n < width:
                h = mx.concatenate([h, mx.zeros((width - n, h.shape[-1]), h.dtype)])
            hs.append(h)
        tokens, hidden = mx.array(toks, dtype=mx.int32), mx.stack(hs)
        first = None
        for li in range(self.L):
            y = self._layer(li, tokens, hidden)
            first = y if li == 0 else first
        for li in range(self.L):
            for i, n in enumerate(counts):
                self.cache[li].trim_row(i, width - n)  # the padding
        outs = []
        for i, n in enumerate(counts):
            outs.append(first[i, n - 1] if n else self.out[i])
            self.pend_h[i], self.pend_tok[i] = [], []
            self.out[i] = None
        return mx.stack(outs)

    def _logits(self, h: mx.array) -> mx.array:
        """[B, H] -> [B, V] (the first layer's scorer, as MTPDrafter._logits for every step)."""
        return self.proto._logits(0, h, [])

    def propose(self, k: int, samplings: list[SamplingConfig], keys: list[mx.array],
                first_allowed: mx.array | None = None) -> list[Draft]:
        """`first_allowed` [B, V'] bool: the tokens each row's grammar allows at its first draft position (all
        True for a row without one); each draft carries its confidence (MTPDrafter.propose)."""
        h = self._feed_pending()  # [B, H]
        self._chain = [0] * self.L
        for s in range(1, k):
            self._chain[s % self.L] += 1
        b = h.shape[0]
        rows_keys = [mx.random.split(key, k) for key in keys]
        all_greedy = all(s.greedy and not s.penalized for s in samplings)
        tokens, probs, confidence = [], [[] for _ in range(b)], []
        for step in range(k):
            li = step % self.L
            allowed = first_allowed if step == 0 else None
            if all_greedy and self.proto._on_subset(li):  # the argmax on the reduced vocabulary's scores alone
                tok, sure = self.proto._subset_argmax(h, allowed)
            else:
                layer = self.head.layers[li]
                logits = layer.head(h) if "head" in layer else self._logits(h)
                if allowed is not None:
                    logits = within(logits, allowed)
                if all_greedy:
                    tok, sure = mx.argmax(logits, axis=-1).astype(mx.int32), sureness(logits, None)
                else:
                    picked, sures = [], []
                    for i, cfg in enumerate(samplings):
                        context = None
                        if cfg.penalized:
                            context = mx.concatenate([mx.array(self.history[i][-cfg.repetition_context :]),
                                                      *[t[i : i + 1] for t in tokens]])
                        t, p = choose(logits[i : i + 1], context, cfg, rows_keys[i][step])
                        picked.append(t.astype(mx.int32))
                        probs[i].append(p)
                        sures.append(sureness(logits[i : i + 1], p))
                    tok, sure = mx.concatenate(picked), mx.concatenate(sures)
            tokens.append(tok)
            confidence.append(sure)
            if step + 1 < k:
                h = self._layer((step + 1) % self.L, tok[:, None], h[:, None])[:, 0]
        drafted, sure = mx.stack(tokens, axis=1), mx.stack(confidence, axis=1)  # [B, k] each
        return [Draft(drafted[i], None if samplings[i].greedy else mx.concatenate(probs[i]), confidence=sure[i])
                for i in range(b)]

    def commit(self, i: int, verdict: Verdict, hidden: mx.array) -> None:
        n, k = verdict.n_accepted, verdict.n_drafted
        if k > 0:
            for li, c in enumerate(self.cache):
                if self._chain[li]:
                    c.trim_row(i, self._chain[li])
        self.pend_h[i].append(hidden[: n + 1])
        self.pend_tok[i].extend(verdict.tokens[: n + 1])
        self.history[i] += verdict.tokens
