"""Continuous batching with speculative decoding: several sequences decoded together, drafting kept on.

Each step every running sequence drafts k tokens with its OWN drafter state (a copy of the prototype
drafter per sequence, or one batched MTP head with per-row state), the target scores all sequences'
[last, d_1..d_k] in ONE forward pass over a BatchKVCache (per-row lengths), the acceptance rule runs per
row on device, and one host read brings back every row's verdict. Rollback is per row: the cache row
drops its rejected drafts (`trim_row`), the row's drafter commits its own verdict. k is chosen per step
(batch_policy.py) from the measured cost of a step at this batch size, and per row up to it: a row drafts
fewer where its request's `num_draft`, its room before max_tokens or its drafter caps it (or, with a
drafter per row, where its own acceptance cannot pay for its drafting); its verify input is padded to the
step's k + 1 and the acceptance rule reads only its own drafts. With k = 0 a step is one plain decoding
step for every row.

Sequences join and leave between steps: `add` prefills a new sequence alone (a plain single-sequence
cache, with the longest common prefix of a recently finished sequence reused), samples its first token,
and appends its row; a finished or cancelled sequence's row is dropped at once.

Lossless: sampled rows follow the target's distribution by the usual acceptance rule. Greedy output
equals the same request served alone where a row's logits do not depend on the other rows: its keys sit
at the same cache indices as alone and masked entries add exact zeros, which MLX's CPU kernels keep bit
for bit; with batch_invariant=True on any device (each sequence over its own keys, target/invariant_attention.py).
"""

from __future__ import annotations

import copy
import time

import mlx.core as mx

from .. import host
from ..drafters.base import Draft, Verdict, hidden_request
from ..drafters.mtp.batched import BatchedMTP, batchable_mtp
from ..sampling import SamplingConfig, probabilities, process_logits
from ..target.batch_cache import BatchKVCache, append_sequence, batchable
from ..target.fixed_rows import make_invariant_batches
from ..target.model import Target
from . import invariance_default
from .batch_policy import BatchPolicy, FixedBatchPolicy
from .batch_sequence import Output, RunningSequence
from .verify import accept_greedy, accept_sampled


def choose_row(logits, context, draft_tokens, draft_probs, cfg: SamplingConfig, key) -> mx.array:
    """[n_accepted, t_0..t_k] for one row (the Engine's acceptance rule, verify.py)."""
    logits = process_logits(logits, context, cfg)
    if cfg.greedy:
        return accept_greedy(logits, draft_tokens)
    return accept_sampled(probabilities(logits, cfg), draft_tokens, draft_probs, key)


class BatchEngine:
    """Call from one thread (the one that owns MLX): add / cancel / step."""

    def __init__(self, model, drafter=None, num_draft: int | str = "auto", max_batch: int = 8, max_draft: int = 8,
                 prefill_step: int = 2048, keep_prefixes: int = 4, batched_drafting: bool = True,
                 batch_invariant: bool | str | None = None):
        """batch_invariant: every step's rows batch invariant ("kernels" / True; None: as Engine's default),
        so each sequence's tokens equal, bit for bit, that request decoded alone by Engine(batch_invariant=True)."""
        if batch_invariant is None:
            batch_invariant = invariance_default.default_invariance(several_sequences=True)
        rows, why_not = make_invariant_batches(model, batch_invariant)
        self.batch_invariant = rows is not None
        self.max_k = rows - 1 if rows else 1 << 30  # the invariance covers passes of k + 1 <= rows tokens
        self.target = Target(model)
        self.drafter = drafter  # the prototype: every sequence drafts with its own copy
        self.want_hidden = hidden_request(drafter)
        # an MTP head drafts for all rows in one pass; any other drafter with a copy per row
        self.batched = BatchedMTP(drafter) if batched_drafting and batchable_mtp(drafter) else None
        self.num_draft = num_draft if drafter is not None else 0
        self.policy = (BatchPolicy(min(max_draft, self.max_k), per_row_drafting=self.batched is None)
                       if self.num_draft == "auto" else FixedBatchPolicy(self.num_draft))
        self.max_batch = max_batch
        self.prefill_step = prefill_step
        self.keep_prefixes = keep_prefixes
        self.seqs: list[RunningSequence] = []
        self.cache: list[BatchKVCache] = []
        self._pending: list[Output] = []  # first tokens of sequences added since the last step
        self._prefixes: list[tuple[list[int], list, mx.array | None]] = []  # (tokens, per-layer (k, v), hidden)
        self.supported = why_not or batchable(self.target.make_cache())  # None, or why this model cannot batch
        if self.supported is None and getattr(drafter, "reads_target_cache", False):
            self.supported = f"the {drafter.name} drafter reads the single-sequence target cache"
        self.steps = 0
        self._reshaped = False  # rows joined or left since the last step (its time carries the re-layout)
        self.k_steps: dict[int, int] = {}  # steps run at each draft length (reports)

    # -- joining and leaving ---------------------------------------------------------------------------
    def running(self) -> int:
        """Sequences in the batch, plus finished ones whose outputs the next step() still returns."""
        return len(self.seqs) + sum(1 for o in self._pending if o.finished)

    def free_slots(self) -> int:
        return self.max_batch - len(self.seqs)

    def check(self, prompt: list[int]) -> None:
        if not prompt:
            raise ValueError("the prompt is empty")
        vocab = self.target.vocab_size
        if max(prompt) >= vocab or min(prompt) < 0:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")

    def _reuse(self, prompt: list[int]):
        """The kept prefix sharing the most leading tokens with prompt[:-1] -> (m, per-layer kv, hidden)."""
        best, m_best = None, 0
        for entry in self._prefixes:
            m = 0
            for a, b in zip(prompt[:-1], entry[0]):
                if a != b:
                    break
                m += 1
            if m > m_best:
                best, m_best = entry, m
        if best is None:
            return 0, None, None
        kv = [(k[:, :, :m_best], v[:, :, :m_best]) for k, v in best[1]]
        return m_best, kv, (best[2][:m_best] if best[2] is not None else None)

    def _prefill(self, prompt: list[int]):
        """Feed the prompt alone; -> (logits of its last token [1, V], single-sequence cache, prompt hidden, reused)."""
        cache = self.target.make_cache()
        reused, kv, hidden0 = self._reuse(prompt)
        if reused:
            for c, (k, v) in zip(cache, kv):
                c.keys, c.values, c.offset = k, v, k.shape[2]
        hidden = [hidden0] if hidden0 is not None else []
        body = prompt[reused:-1]
        for i in range(0, len(body), self.prefill_step):
            _, h = self.target.forward(mx.array(body[i : i + self.prefill_step]), cache, self.want_hidden)
            host.wait([c.state for c in cache] + ([h] if self.want_hidden else []))
            hidden.append(h)
        logits, h = self.target.forward(mx.array(prompt[-1:]), cache, self.want_hidden)
        hidden.append(h)
        return logits, cache, (mx.concatenate(hidden) if self.want_hidden else None), reused

    def add(self, seq_id, prompt: list[int], max_tokens: int, sampling: SamplingConfig | None = None, seed: int = 0,
            stop_tokens: frozenset[int] = frozenset(), num_draft: int | str | None = None) -> None:
        """Prefill a new sequence and put it in the running batch; its first token comes out of the next step().
        `num_draft`: this request's ceiling on its draft length per step (0: it never drafts; None or "auto":
        the batch's choice)."""
        if self.supported is not None:
            raise ValueError(f"this model cannot be batched: {self.supported}")
        if len(self.seqs) >= self.max_batch:
            raise ValueError(f"the batch is full ({self.max_batch} sequences)")
        if max_tokens < 1:
            raise ValueError(f"max tokens must be >= 1, got {max_tokens}")
        if num_draft not in (None, "auto") and (not isinstance(num_draft, int) or num_draft < 0):
            raise ValueError(f"num_draft must be an integer >= 0 or 'auto', got {num_draft!r}")
        self.check(prompt)
        sampling = sampling or SamplingConfig()
        t0 = time.perf_counter()
        key = mx.random.key(seed)
        logits, cache, hidden, reused = self._prefill(prompt)
        context = mx.array(prompt[-sampling.repetition_context :]) if sampling.penalized else None
        seq = RunningSequence(seq_id, list(prompt), max_tokens, sampling, frozenset(stop_tokens), key, None,
                              list(prompt), -1, reused=reused,
                              max_draft=None if num_draft in (None, "auto") else int(num_draft),
                              evidence=self.policy.row())
        out = choose_row(logits, context, mx.zeros((0,), mx.int32), None, sampling, seq.next_key())
        first = host.read(out)[1]
        seq.history.append(first)
        seq.last = first
        seq.prompt_time = time.perf_counter() - t0
        if first in seq.stop_tokens or max_tokens == 1:
            self._remember(seq.history[:-1], cache, hidden)
            self._pending.append(Output(seq_id, [first], "stop" if first in seq.stop_tokens else "length",
                                        seq.stats(self.num_draft)))
            return
        if self.batched is not None:
            self.batched.add_row(seq.history, hidden)
        elif self.drafter is not None:
            seq.drafter = copy.copy(self.drafter)
            seq.drafter.begin(list(seq.history), hidden)
            if hasattr(seq.drafter, "flush"):  # the drafter's own prefill now, not in the next (timed) step
                seq.drafter.flush()
                host.wait([c.state for c in getattr(seq.drafter, "cache", [])])
        self.cache = append_sequence(self.cache, cache)
        seq.hidden_rows = [hidden] if self.want_hidden else []
        host.wait([s for bc in self.cache for s in bc.state])
        seq.t_decode = time.perf_counter()
        self.seqs.append(seq)
        self._reshaped = True
        self._pending.append(Output(seq_id, [first]))

    def cancel(self, seq_id) -> None:
        for s in self.seqs:
            if s.id == seq_id:
                s.cancelled = True

    def _remember(self, tokens: list[int], cache: list, hidden) -> None:
        """Keep a finished sequence's cache (its tokens' keys and values) for a later prompt's common prefix."""
        if self.keep_prefixes <= 0 or not tokens:
            return
        kv = [(c.keys[:, :, : c.offset], c.values[:, :, : c.offset]) for c in cache]
        self._prefixes = [p for p in self._prefixes if p[0] != tokens][-(self.keep_prefixes - 1):] + \
            [(list(tokens), kv, hidden)]

    def _drop(self, rows: list[int]) -> None:
        """Remove these rows (finished or cancelled), keeping their caches as reusable prefixes."""
        if not rows:
            return
        for i in rows:
            s = self.seqs[i]
            if self.keep_prefixes > 0:
                fed = s.history[:-1]  # every committed token but the last is in the cache
                kv = []
                for bc in self.cache:
                    k, v = bc.row(i)
                    # copies: a view would keep the whole batch cache alive after its rows are dropped
                    kv.append((mx.contiguous(k[:, :, : len(fed)]), mx.contiguous(v[:, :, : len(fed)])))
                hidden = mx.contiguous(mx.concatenate(s.hidden_rows)[: len(fed)]) if s.hidden_rows else None
                host.start([a for pair in kv for a in pair] + ([hidden] if hidden is not None else []))
                self._prefixes = [p for p in self._prefixes if p[0] != fed][-(self.keep_prefixes - 1):] + \
                    [(fed, kv, hidden)]
        keep = [i for i in range(len(self.seqs)) if i not in set(rows)]
        for bc in self.cache:
            bc.keep_rows(keep)
        if self.batched is not None:
            self.batched.keep_rows(keep)
        self.seqs = [self.seqs[i] for i in keep]
        self._reshaped = True

    # -- one step ---------------------------------------------------------------------------------------
    def step(self) -> list[Output]:
        """Advance every running sequence by one verify pass (or one plain token). Returns their new tokens."""
        outputs, self._pending = self._pending, []
        cancelled = [i for i, s in enumerate(self.seqs) if s.cancelled]
        for i in cancelled:
            s = self.seqs[i]
            outputs.append(Output(s.id, [], "cancelled", s.stats(self.num_draft)))
        self._drop(cancelled)
        if not self.seqs:
            return outputs
        b = len(self.seqs)
        k = self.policy.next_k(b) if self.drafter is not None else 0
        # each row's own k: what it drafts (at most the batch's k, its request's ceiling, its drafter's limit),
        # and what the acceptance rule reads of it (no more than the row has room for before max_tokens)
        drafting = self.policy.row_ks(k, [s.evidence for s in self.seqs], [self._cap(s) for s in self.seqs]) \
            if k else [0] * b
        ks = [min(d, s.max_tokens - s.generated - 1) for d, s in zip(drafting, self.seqs)]
        k = max(ks)  # the verify pass's width - 1; a row with fewer drafts is padded
        t0 = time.perf_counter()
        if k > 0 and self.batched is not None:  # one head pass per draft step drafts k for every row
            drafts = self.batched.propose(k, [s.sampling for s in self.seqs], [s.next_key() for s in self.seqs])
        elif k > 0:
            drafts = [self._padded(self._propose(s, min(d, k)) if d else None, k, s.last)
                      for s, d in zip(self.seqs, drafting)]
        else:
            drafts = None
        last = mx.array([[s.last] for s in self.seqs], dtype=mx.int32)
        inputs = mx.concatenate([last, mx.stack([d.tokens for d in drafts])], axis=1) if k > 0 else last
        logits, hidden = self.target.forward_batch(inputs, self.cache, self.want_hidden)
        outs = []
        for i, s in enumerate(self.seqs):  # the acceptance rule over the row's own ki drafts
            ki = ks[i]
            d_tokens = drafts[i].tokens[:ki] if ki > 0 else mx.zeros((0,), mx.int32)
            d_probs = drafts[i].probs[:ki] if ki > 0 and drafts[i].probs is not None else None
            context = None
            if s.sampling.penalized:
                context = mx.concatenate([mx.array(s.history[-s.sampling.repetition_context :]), d_tokens])
            row_logits = logits[i] if ki == k else logits[i, : ki + 1]
            outs.append(choose_row(row_logits, context, d_tokens, d_probs, s.sampling, s.next_key()))
        values = host.read(mx.concatenate(outs))  # the step's one host synchronisation
        seconds = time.perf_counter() - t0
        reshaped, self._reshaped = self._reshaped, False
        accepted, finished, start = [], [], 0
        for i, s in enumerate(self.seqs):
            ki = ks[i]
            row = values[start : start + ki + 2]  # [n, t_0..t_ki]
            start += ki + 2
            n = row[0]
            tokens = row[1 : n + 2]
            for bc in self.cache:
                bc.trim_row(i, k - n)  # the rejected drafts and the row's padding
            h = hidden[i] if hidden is not None else None
            if self.batched is not None:
                self.batched.commit(i, Verdict(k, n, tokens), h)
            elif s.drafter is not None:
                s.drafter.commit(Verdict(ki, n, tokens), h)
            if h is not None:
                s.hidden_rows.append(h[: n + 1])
            real = min(getattr(drafts[i], "n_real", k), ki) if ki > 0 else 0
            emitted, reason = self._emit(s, tokens)
            if ki > 0:
                s.verifies += 1
                s.verified_tokens += len(emitted)
                s.drafted += real
                s.accepted += min(n, real, len(emitted))
            s.last = tokens[-1]
            s.decode_time = time.perf_counter() - s.t_decode
            accepted.append(min(n, real))
            outputs.append(Output(s.id, emitted, reason, s.stats(self.num_draft) if reason else None))
            if reason:
                finished.append(i)
        # a step right after rows joined or left also gathers the batch caches anew: not a cost of (b, k)
        self.policy.observe(b, k, accepted, seconds, ks, [s.evidence for s in self.seqs], timed=not reshaped)
        self.k_steps[k] = self.k_steps.get(k, 0) + 1
        self._drop(finished)
        self.steps += 1
        return outputs

    def _cap(self, s: RunningSequence) -> int:
        """The most row s may draft: its request's ceiling and its drafter's limit."""
        cap = self.max_k if s.max_draft is None else min(s.max_draft, self.max_k)
        limit = s.drafter.max_draft() if s.drafter is not None and cap > 0 else None
        return min(cap, limit) if limit is not None else cap

    def _propose(self, s: RunningSequence, k: int) -> Draft:
        d = s.drafter.propose(k, s.sampling, s.next_key())
        n = d.tokens.shape[0]
        if n == k:
            return d
        # a drafter that found fewer than k (prompt lookup): pad with copies of the last token. Lossless:
        # a padded draft is checked like any other (accepted only where the target agrees)
        pad = mx.full((k - n,), s.last, dtype=mx.int32)
        out = Draft(mx.concatenate([d.tokens.astype(mx.int32), pad]), None)
        object.__setattr__(out, "n_real", n)
        return out

    @staticmethod
    def _padded(d: Draft | None, k: int, last: int) -> Draft:
        """A row's draft (None: it drafted nothing) padded to the pass's k with copies of its last token;
        the acceptance rule reads only the row's own drafts, so the padding is never emitted."""
        n = d.tokens.shape[0] if d is not None else 0
        if n == k:
            return d
        tokens = mx.full((k - n,), last, dtype=mx.int32)
        if d is not None:
            tokens = mx.concatenate([d.tokens.astype(mx.int32), tokens])
        out = Draft(tokens, d.probs if d is not None else None)
        object.__setattr__(out, "n_real", min(getattr(d, "n_real", n), n) if d is not None else 0)
        return out

    @staticmethod
    def _emit(s: RunningSequence, tokens: list[int]) -> tuple[list[int], str | None]:
        tokens = tokens[: s.max_tokens - s.generated]
        reason = None
        for i, t in enumerate(tokens):
            if t in s.stop_tokens:
                tokens, reason = tokens[: i + 1], "stop"
                break
        s.generated += len(tokens)
        s.history += tokens
        if reason is None and s.generated >= s.max_tokens:
            reason = "length"
        return tokens, reason
