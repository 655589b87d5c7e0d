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

Sequences join and leave between steps. `add` only queues a new sequence (core/batch_prefill.py): each
step prefills one chunk of a waiting prompt, sized so the running streams' step stays bounded, beside
the batch's own step; after its last prompt token its first token is sampled and returned at once, its
drafter is fed the prompt a chunk at a time, and the sequence joins the batch (its cache appended as a
row). A finished or cancelled sequence's row is dropped at once; a waiting one leaves the queue. Prompts
start from the longest prefix a shared prefix tree (target/prefix_cache.py) holds: every prompt and
every finished sequence is stored there, within a byte budget.

Lossless: sampled rows follow the target's distribution by the usual acceptance rule. Greedy output
equals the same request served alone where a row's logits do not depend on the other rows: its keys sit
at the same cache indices as alone and masked entries add exact zeros, which MLX's CPU kernels keep bit
for bit; with batch_invariant=True on any device (each sequence over its own keys, target/invariant_attention.py).
"""

from __future__ import annotations

import copy
import time

import mlx.core as mx
from mlx.utils import tree_map

from .. import host
from ..drafters.base import Verdict, hidden_request
from ..drafters.mtp.batched import BatchedMTP, batchable_mtp
from ..sampling import SamplingConfig
from ..target import prefix_cache as prefix_ops
from ..target.batch_cache import BatchKVCache, append_sequence, batchable
from ..target.cache import check_kv_quantization, kv_bytes
from ..target.fixed_rows import make_invariant_batches
from ..target.model import Target
from . import invariance_default
from .batch_policy import BatchPolicy, FixedBatchPolicy
from .batch_prefill import Prefilling, PrefillQueue
from .batch_sequence import Output, RunningSequence, padded
from .context import check_context
from .memory import MemoryBudget
from .verify import choose_row


class BatchEngine:
    """Call from one thread (the one that owns MLX): add / cancel / step."""

    def __init__(self, model, drafter=None, num_draft: int | str = "auto", max_batch: int = 8, max_draft: int = 8,
                 prefill_step: int = 512, prefix_cache_bytes: int = 1 << 30, batched_drafting: bool = True,
                 batch_invariant: bool | str | None = None, context_length: int | None = None,
                 idle_budget: float = 1.0, kv_bits: int | None = None, kv_group_size: int = 64,
                 memory: MemoryBudget | None = None):
        """batch_invariant: every step's rows batch invariant ("kernels" / True; None: as Engine's default),
        so each sequence's tokens equal, bit for bit, that request decoded alone by Engine(batch_invariant=True).
        prefill_step: the largest prefill chunk; prefix_cache_bytes: the prefix tree's budget (0: none);
        context_length: prompt + max_tokens beyond it are refused (None: not checked); idle_budget: seconds
        a prefill chunk may take when no sequence is decoding. kv_bits / kv_group_size: the target's KV cache
        quantized (each row's entries, target/batch_cache.py), as in Engine (batch invariant by default, prompts
        fed in chunks of at most the contract's rows). memory: a budget (core/memory.py):
        a request that cannot fit even alone is refused at add(); `can_admit` tells whether one fits now."""
        self.memory = memory
        check_kv_quantization(kv_bits, kv_group_size)
        if batch_invariant is None:  # the device's default; a quantized KV cache: the kernels' mode (Engine says why)
            batch_invariant = "kernels" if kv_bits is not None else \
                invariance_default.default_invariance(several_sequences=True)
        if kv_bits is not None and batch_invariant == "fixed":
            raise ValueError("fixed-row passes do not cover a quantized KV cache: use --batch-invariant kernels")
        rows, why_not = make_invariant_batches(model, batch_invariant)
        self.batch_invariant = rows is not None
        self.max_k = rows - 1 if rows else 1 << 30  # the invariance covers passes of k + 1 <= rows tokens
        self.target = Target(model, kv_bits, kv_group_size)
        self.target.check_cache()
        self.drafter = drafter  # the prototype: every sequence drafts with its own copy
        self.want_hidden = hidden_request(drafter)
        # an MTP head drafts for all rows in one pass; any other drafter with a copy per row
        self.batched = BatchedMTP(drafter) if batched_drafting and batchable_mtp(drafter) else None
        self.num_draft = num_draft if drafter is not None else 0
        self.policy = (BatchPolicy(min(max_draft, self.max_k), per_row_drafting=self.batched is None)
                       if self.num_draft == "auto" else FixedBatchPolicy(self.num_draft))
        self.max_batch = max_batch
        self.context_length = context_length
        self.seqs: list[RunningSequence] = []
        self.cache: list[BatchKVCache] = []
        self.supported = why_not or batchable(self.target.make_cache())  # None, or why this model cannot batch
        if self.supported is None and getattr(drafter, "reads_target_cache", False):
            self.supported = f"the {drafter.name} drafter reads the single-sequence target cache"
        tree = None
        if prefix_cache_bytes > 0 and self.supported is None:
            tree = prefix_ops.PrefixCache(prefix_cache_bytes, with_hidden=self.want_hidden is not None)
        self.prefix_cache = tree
        if self.batch_invariant and kv_bits is not None:  # prompts in covered passes, as in Engine
            prefill_step = min(prefill_step, rows)
        self.prefills = PrefillQueue(self.target, self.want_hidden, tree, prefill_step, idle_budget)
        self.steps = 0
        self.step_times: list[float] = []  # seconds of the batch's recent steps (the prefill chunks' budget)
        self._reshaped = False  # rows joined or left since the last step (its time carries the re-layout)
        self.k_steps: dict[int, int] = {}  # steps run at each draft length (reports)

    # -- joining and leaving ---------------------------------------------------------------------------
    def running(self) -> int:
        """Sequences decoding or being prefilled."""
        return len(self.seqs) + len(self.prefills)

    def free_slots(self) -> int:
        return self.max_batch - len(self.seqs) - len(self.prefills)

    def prefilling(self) -> list[dict]:
        """Sequences waiting to join: {"id", "done", "total", "stage"} (prompt tokens fed of total)."""
        return self.prefills.status()

    def kv_bytes(self) -> int:
        """Bytes of the batch's KV caches, the waiting sequences' and the prefix tree's."""
        n = sum(a.nbytes for bc in self.cache for a in bc.state)
        n += sum(kv_bytes(p.cache) for p in self.prefills.waiting)
        return n + (self.prefix_cache.nbytes if self.prefix_cache is not None else 0)

    def check(self, prompt: list[int], max_tokens: int = 1) -> None:
        if not prompt:
            raise ValueError("the prompt is empty")
        vocab = self.target.vocab_size
        if max(prompt) >= vocab or min(prompt) < 0:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        check_context(len(prompt), max_tokens, self.context_length)
        if self.memory is not None:
            self.memory.check_sequence(len(prompt) + max_tokens)

    def _extent(self, s: RunningSequence) -> int:
        return len(s.prompt) + s.max_tokens

    def can_admit(self, prompt_tokens: int, max_tokens: int) -> bool:
        """Whether a new request fits the memory budget beside the running and waiting ones now. The batch
        cache gives every row the longest row's capacity, so that is what is counted."""
        if self.memory is None:
            return True
        extents = [self._extent(s) for s in self.seqs] + [self._extent(p.seq) for p in self.prefills.waiting]
        rows = len(extents) + 1
        need = rows * max(extents + [prompt_tokens + max_tokens]) * self.memory.kv_per_token
        return need <= self.memory.limit - self.memory.base

    def add(self, seq_id, prompt: list[int], max_tokens: int, sampling: SamplingConfig | None = None, seed: int = 0,
            stop_tokens: frozenset[int] = frozenset(), num_draft: int | str | None = None) -> None:
        """Queue a new sequence: the next steps prefill it (a chunk per step) and its first token comes out
        of the step that finishes its prompt. `num_draft`: this request's ceiling on its draft length per
        step (0: it never drafts; None or "auto": the batch's choice)."""
        if self.supported is not None:
            raise ValueError(f"this model cannot be batched: {self.supported}")
        if self.free_slots() <= 0:
            raise ValueError(f"the batch is full ({self.max_batch} sequences)")
        if max_tokens < 1:
            raise ValueError(f"max tokens must be >= 1, got {max_tokens}")
        if num_draft not in (None, "auto") and (not isinstance(num_draft, int) or num_draft < 0):
            raise ValueError(f"num_draft must be an integer >= 0 or 'auto', got {num_draft!r}")
        self.check(prompt, max_tokens)
        seq = RunningSequence(seq_id, list(prompt), max_tokens, sampling or SamplingConfig(), frozenset(stop_tokens),
                              mx.random.key(seed), None, list(prompt), -1,
                              max_draft=None if num_draft in (None, "auto") else int(num_draft),
                              evidence=self.policy.row())
        self.prefills.add(seq)

    def cancel(self, seq_id) -> None:
        """Stop a sequence, running or still waiting to join (it leaves at the next step)."""
        for s in self.seqs:
            if s.id == seq_id:
                s.cancelled = True
        for p in self.prefills.waiting:
            if p.seq.id == seq_id:
                p.seq.cancelled = True

    def reset(self) -> None:
        """Drop every running and waiting sequence, keeping none of their entries (after a failed step their
        caches are in doubt). The prefix tree keeps what it held before."""
        self.seqs, self.cache, self._reshaped = [], [], True
        self.prefills.waiting.clear()
        if self.batched is not None:
            self.batched.keep_rows([])

    # -- prefill, a chunk per step --------------------------------------------------------------------
    def _prefill_once(self, outputs: list[Output]) -> None:
        """Advance the waiting sequence with the fewest tokens left by one chunk (target, then drafter);
        a sequence whose prompt is in hands out its first token; one whose drafter is fed joins the batch."""
        for p in [p for p in self.prefills.waiting if p.seq.cancelled]:
            self.prefills.remove(p)
            outputs.append(Output(p.seq.id, [], "cancelled", p.seq.stats(self.num_draft)))
        p = self.prefills.next()
        if p is None:
            return
        budget = self.prefills.budget(self.step_times, len(self.seqs))
        if not p.sampled:
            logits = self.prefills.target_chunk(p, budget)
            if logits is None:
                return
            if not self._first_token(p, logits, outputs):
                return
        if p.drafter is None or self.prefills.drafter_chunk(p, budget):
            self._join(p)
            self.prefills.remove(p)  # its prompt's entries go to the prefix tree (the cache is now the batch's copy)

    def _first_token(self, p: Prefilling, logits, outputs: list[Output]) -> bool:
        """Sample p's first token and hand it out; begin its drafter. False when that token ends it."""
        s = p.seq
        context = mx.array(s.prompt[-s.sampling.repetition_context :]) if s.sampling.penalized else None
        first = host.read(choose_row(logits, context, mx.zeros((0,), mx.int32), None, s.sampling, s.next_key()))[1]
        s.history.append(first)
        s.last = first
        s.prompt_time = time.perf_counter() - p.started
        p.sampled = True
        hidden = mx.concatenate(p.hidden) if self.want_hidden else None
        p.hidden = [hidden] if hidden is not None else []
        if first in s.stop_tokens or s.max_tokens == 1:
            self.prefills.remove(p)  # its prompt's entries go to the prefix tree
            outputs.append(Output(s.id, [first], "stop" if first in s.stop_tokens else "length",
                                  s.stats(self.num_draft)))
            return False
        outputs.append(Output(s.id, [first]))
        if self.batched is not None:
            p.drafter = self.batched.begin_row(s.history, hidden)
        elif self.drafter is not None:
            p.drafter = copy.copy(self.drafter)
            p.drafter.begin(list(s.history), hidden)
        p.drafter_left = len(s.history) if p.drafter is not None else 0
        return True

    def _join(self, p: Prefilling) -> None:
        """A prefilled sequence becomes a row of the batch (its cache appended, its drafter adopted)."""
        s = p.seq
        if self.batched is not None:
            self.batched.adopt(p.drafter)
        elif p.drafter is not None:
            s.drafter = p.drafter
            if hasattr(s.drafter, "flush"):  # what is left of its prefill now, not in the next (timed) step
                s.drafter.flush()
                host.wait([c.state for c in getattr(s.drafter, "cache", [])])
        self.cache = append_sequence(self.cache, p.cache)
        s.hidden_rows = list(p.hidden)
        host.wait([a for bc in self.cache for a in bc.state])
        s.t_decode = time.perf_counter()
        self.seqs.append(s)
        self._reshaped = True

    def _drop(self, rows: list[int]) -> None:
        """Remove these rows (finished or cancelled), their entries stored in the prefix tree first."""
        if not rows:
            return
        for i in rows:
            s = self.seqs[i]
            fed = s.history[:-1]  # every committed token but the last is in the cache
            if self.prefix_cache is not None and len(fed) > self.prefix_cache.match(fed):
                states = [tree_map(lambda a: a[:, :, : len(fed)], bc.row(i)) for bc in self.cache]
                hidden = mx.concatenate(s.hidden_rows)[: len(fed)] if s.hidden_rows else None
                if self.prefix_cache.with_hidden and (hidden is None or hidden.shape[0] < len(fed)):
                    continue
                self.prefix_cache.insert(fed, states, hidden)
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
        outputs = []
        cancelled = [i for i, s in enumerate(self.seqs) if s.cancelled]
        for i in cancelled:
            s = self.seqs[i]
            outputs.append(Output(s.id, [], "cancelled", s.stats(self.num_draft)))
        self._drop(cancelled)
        self._prefill_once(outputs)
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
        # a row draws its random keys only for drafts it can keep: its draws never depend on the other rows
        if k > 0 and self.batched is not None:  # one head pass per draft step drafts k for every row
            keys = [s.next_key() if ki else mx.random.key(0) for s, ki in zip(self.seqs, ks)]
            drafts = self.batched.propose(k, [s.sampling for s in self.seqs], keys)
        elif k > 0:
            drafts = [padded(s.propose(ki) if ki else None, k, s.last) for s, ki in zip(self.seqs, ks)]
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
        self.step_times = self.step_times[-63:] + [seconds]
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
            emitted, reason = s.emit(tokens)
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
