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

Sequences join and leave between steps. `add` only queues a new sequence (core/batch_prefill.py): it gets
a row at once (the longest prefix the prefix tree or another row holds copied in) and its prompt is fed a
chunk per step AS ROWS OF THE BATCH'S OWN PASS, beside the decoding rows' [last, drafts]: the weights are
read once for both, and the chunk is sized so the whole step stays within a bound of the decoding steps'
median. The step that feeds the last prompt token hands out its first token; a drafter that keeps prompt
state is then fed the prompt a chunk per step, and the row drafts once it is. A finished or cancelled
sequence's row is dropped at once, its entries stored in the shared prefix tree
(target_model/prefix_cache.py) within a byte budget.

Lossless: sampled rows follow the target's distribution by the usual acceptance rule. Greedy output
equals the same request served alone where a row's logits do not depend on the other rows: its keys sit
at the same cache indices as alone and masked entries add exact zeros, which MLX's CPU kernels keep bit
for bit; with batch_invariant=True on any device (each sequence over its own keys, target_model/invariant_attention.py).
"""

from __future__ import annotations

import time

import mlx.core as mx

from ..drafters.base import hidden_request
from ..drafters.mtp.batched import BatchedMTP, batchable_mtp
from ..sampling import SamplingConfig, check_logprobs
from ..target_model import prefix_cache as prefix_ops
from ..target_model import batch_kinds
from ..target_model.batch_cache import BatchKVCache
from ..target_model.cache import check_kv_quantization, make_cache
from ..target_model.fixed_rows import make_invariant_batches
from ..target_model import layer_span, sequence_attention
from ..target_model.model import Target
from .confidence import CONFIDENT
from . import invariance_default
from . import batch_grammar
from . import drafter_prefix
from .batch_accept import Acceptance
from .batch_pass import VerifyPass
from .batch_plan import StepPlan
from .batch_policy import BatchPolicy, FixedBatchPolicy
from .batch_prefill import PrefillQueue
from .batch_rows import BatchRows
from .batch_sequence import Output, RunningSequence, padded
from .batch_settle import Settle
from .batch_turn import REMEASURE, PromptTurn
from .context import check_request
from .disk_prefix import disk_tier_for
from .memory import MemoryBudget


class BatchEngine(BatchRows, PromptTurn, VerifyPass, Acceptance, Settle):
    """Call from one thread (the one that owns MLX): add / cancel / step."""

    def __init__(self, model, drafter=None, num_draft: int | str = "auto", max_batch: int = 8, max_draft: int = 8,
                 prefill_step: int = 512, prefix_cache_bytes: int = 1 << 30, batched_drafting: bool = True,
                 batch_invariant: bool | str | None = None, context_length: int | None = None,
                 idle_budget: float = 1.0, kv_bits: int | None = None, kv_group_size: int = 64,
                 memory: MemoryBudget | None = None, prefix_cache_dir: str | None = None,
                 prefix_disk_bytes: int | None = None):
        """batch_invariant: every step's rows batch invariant ("kernels" / True; None: as Engine's default),
        so each sequence's tokens equal, bit for bit, that request decoded alone by Engine(batch_invariant=True).
        prefill_step: the largest prefill chunk; prefix_cache_bytes: the prefix tree's budget (0: none);
        context_length: prompt + max_tokens beyond it are refused (None: not checked); idle_budget: seconds
        a prefill chunk may take when no sequence is decoding. kv_bits / kv_group_size: the target's KV cache
        quantized (each row's entries, target_model/batch_cache.py), as in Engine (batch invariant by default, prompts
        fed in chunks of at most the contract's rows). memory: a budget (core/memory.py):
        a request that cannot fit even alone is refused at add(); `can_admit` tells whether one fits now.
        prefix_cache_dir: the prefix tree's disk tier (target_model/disk_tier.py) in that folder (None: RAM
        only), within prefix_disk_bytes (None: core/disk_prefix.py's default)."""
        self.memory = memory
        check_kv_quantization(kv_bits, kv_group_size)
        if batch_invariant is None:  # the device's default; a quantized KV cache: the kernels' mode (Engine says why)
            batch_invariant = "kernels" if kv_bits is not None else \
                invariance_default.default_invariance(several_sequences=True)
        if kv_bits is not None and batch_invariant == "fixed":
            raise ValueError("fixed-row passes do not cover a quantized KV cache: use --batch-invariant kernels")
        single = make_cache(model, kv_bits, kv_group_size)
        windows = batch_invariant not in (None, False, "off") and batch_kinds.windowed(single)
        # a model refused here is not patched (the patch is in place, for every later engine on it)
        rows, why_not = (None, None) if windows else make_invariant_batches(model, batch_invariant)
        self.batch_invariant = rows is not None
        self.max_k = rows - 1 if rows else 1 << 30  # the invariance covers passes of k + 1 <= rows tokens
        self.target = Target(model, kv_bits, kv_group_size)
        sequence_attention.install(model)  # each row attends over its own keys, not the batch's padded length
        self.target.check_cache()
        self.drafter = drafter  # the prototype: every sequence drafts with its own copy
        self.want_hidden = hidden_request(drafter)
        # a prompt token may cross the layers over several steps (layer_span; the inner layers' states a
        # drafter reads kept as it crosses them) unless the attention takes layer 0's mask (MLA's additive
        # one: a crossing row's layers hold different lengths)
        self.layer_count = len(self.target.layers)
        self.split_layers = self.layer_count > 1 \
            and getattr(getattr(self.target.text, "args", None), "kv_lora_rank", None) is None
        if self.split_layers:
            layer_span.install(self.target.layers)
        # an MTP head drafts for all rows in one pass; any other drafter with a copy per row
        self.batched = BatchedMTP(drafter) if batched_drafting and batchable_mtp(drafter) else None
        self.num_draft = num_draft if drafter is not None else 0
        self.confident = CONFIDENT  # constrained rows: model drafts verified up to the first less sure position
        self.policy = (BatchPolicy(min(max_draft, self.max_k), per_row_drafting=self.batched is None)
                       if self.num_draft == "auto" else FixedBatchPolicy(self.num_draft))
        self.max_batch = max_batch
        self.context_length = context_length
        self.seqs: list[RunningSequence] = []
        self.cache: list[BatchKVCache] = []
        self.supported = why_not or batch_kinds.why_not(single, model)  # None, or why this model cannot batch
        if self.supported is None and windows:
            self.supported = "batch-invariant passes do not cover sliding-window layers yet (--batch-invariant off)"
        if self.supported is None and getattr(drafter, "reads_target_cache", False):
            self.supported = f"the {drafter.name} drafter reads the single-sequence target cache"
        # every layer's row a run of per-token entries (else recurrent states: the tree keeps checkpoints)
        self.positional = all(batch_kinds.positional(c) for c in single)
        tree = None
        if prefix_cache_bytes > 0 and self.supported is None:
            tree = prefix_ops.PrefixCache(prefix_cache_bytes, with_hidden=self.want_hidden is not None,
                                          checkpoints=not self.positional)
        self.prefix_cache = tree
        self.drafter_kept = drafter_prefix.why_not(drafter)  # None: the tree keeps the drafter's state too
        if tree is not None and prefix_cache_dir is not None:
            tree.disk = disk_tier_for(model, drafter, kv_bits, kv_group_size, prefix_cache_dir, prefix_disk_bytes,
                                      checkpoints=not self.positional)
        if self.batch_invariant and kv_bits is not None:  # prompts in covered passes, as in Engine
            prefill_step = min(prefill_step, rows)
        self.prefills = PrefillQueue(self.target, self.want_hidden, tree, prefill_step, idle_budget)
        self.steps = 0
        self.step_times: list[float] = []  # seconds of recent steps that only decoded (the prefill chunks' budget)
        self.adopted: list[RunningSequence] = []  # the batched MTP head's rows, in its order
        self._decoded_alone = -REMEASURE  # the last step that fed no prompt chunk
        self._reshaped = False  # rows joined or left since the last step (its time carries the re-layout)
        self.k_steps: dict[int, int] = {}  # steps run at each draft length (reports)

    # -- joining and leaving ---------------------------------------------------------------------------
    def running(self) -> int:
        """Sequences decoding or being prefilled."""
        return len(self.seqs) + len(self.prefills.queued)

    def free_slots(self) -> int:
        return self.max_batch - self.running()

    def prefilling(self) -> list[dict]:
        """Sequences whose prompt or drafter is still being fed: {"id", "done", "total", "stage"}."""
        return self.prefills.status()

    def kv_bytes(self) -> int:
        """Bytes of the batch's KV caches and the prefix tree's."""
        n = sum(a.nbytes for bc in self.cache for a in bc.state)
        return n + (self.prefix_cache.nbytes if self.prefix_cache is not None else 0)

    def layer_kinds(self) -> dict[str, int]:
        """How many of the target's layers are of each batch cache kind (/health, the start-up line)."""
        return batch_kinds.count(self.target.make_cache())

    def reuse(self) -> str:
        """What a prefix-tree hit restores (/health)."""
        if self.positional:
            return "entries of every layer, to the token"
        return (f"attention entries and recurrent-state checkpoints (where prompts part, every "
                f"{self.prefills.checkpoint_every} tokens, before a long prompt's end, a row's end)")

    def check(self, prompt: list[int], max_tokens: int = 1) -> None:
        check_request(prompt, max_tokens, self.target.vocab_size, self.context_length, self.memory)

    def _extent(self, s: RunningSequence) -> int:
        return len(s.prompt) + s.max_tokens

    def can_admit(self, prompt_tokens: int, max_tokens: int) -> bool:
        """Whether a new request fits the memory budget beside the running and waiting ones now. The batch
        cache gives every row the longest row's capacity, so that is what is counted."""
        if self.memory is None:
            return True
        extents = [self._extent(s) for s in self.seqs] + [self._extent(p.seq) for p in self.prefills.queued]
        rows = len(extents) + 1
        need = rows * max(extents + [prompt_tokens + max_tokens]) * self.memory.kv_per_token
        return need <= self.memory.limit - self.memory.base

    def add(self, seq_id, prompt: list[int], max_tokens: int, sampling: SamplingConfig | None = None, seed: int = 0,
            stop_tokens: frozenset[int] = frozenset(), num_draft: int | str | None = None, grammar=None,
            reasoning: bool = False, grammar_drafts: bool = True, logprobs: int | None = None) -> None:
        """Queue a new sequence: the next steps prefill it (a chunk per step, inside the batch's pass) and
        its first token comes out of the step that feeds its last prompt token. `num_draft`: this request's
        ceiling on its draft length per step (0: it never drafts; None or "auto": the batch's choice).
        `grammar` (mlx_engine/grammar): every token it emits is one the grammar allows (core/batch_grammar.py);
        `reasoning`: its answer opens inside the model's reasoning (the grammar waits for the end marker);
        `grammar_drafts`: the grammar's forced tokens drafted (off: its masks and cuts only).
        `logprobs` (None: off; 0: each token's; n in 1..20: and the n most likely): Output.logprobs, the
        target's log-probabilities of its tokens, read with the step's one host read."""
        if self.supported is not None:
            raise ValueError(f"this model cannot be batched: {self.supported}")
        if self.free_slots() <= 0:
            raise ValueError(f"the batch is full ({self.max_batch} sequences)")
        if max_tokens < 1:
            raise ValueError(f"max tokens must be >= 1, got {max_tokens}")
        if num_draft not in (None, "auto") and (not isinstance(num_draft, int) or num_draft < 0):
            raise ValueError(f"num_draft must be an integer >= 0 or 'auto', got {num_draft!r}")
        self.check(prompt, max_tokens)
        check_logprobs(logprobs)
        sampling = sampling or SamplingConfig()
        sampling.check_vocab(self.target.vocab_size)
        seq = RunningSequence(seq_id, list(prompt), max_tokens, sampling, frozenset(stop_tokens),
                              mx.random.key(seed), None, list(prompt), -1,
                              max_draft=None if num_draft in (None, "auto") else int(num_draft),
                              evidence=self.policy.row(),
                              matcher=grammar.matcher(reasoning) if grammar is not None else None,
                              grammar_drafts=grammar_drafts, logprobs=logprobs)
        self.prefills.add(seq)

    def cancel(self, seq_id) -> None:
        """Stop a sequence, running or still waiting to join (it leaves at the next step)."""
        for s in self.seqs:
            if s.id == seq_id:
                s.cancelled = True
        for p in self.prefills.queued:
            if p.seq.id == seq_id:
                p.seq.cancelled = True

    def reset(self) -> None:
        """Drop every running and waiting sequence, keeping none of their entries (after a failed step their
        caches are in doubt). The prefix tree keeps what it held before."""
        self.seqs, self.cache, self.adopted, self._reshaped = [], [], [], True
        self.prefills.queued.clear()
        self.prefills.joining.clear()
        if self.batched is not None:
            self.batched.keep_rows([])

    # -- one step ---------------------------------------------------------------------------------------
    def step(self) -> list[Output]:
        """Advance every running sequence by one verify pass (or one plain token), and every row still
        feeding its prompt by one chunk, in ONE forward pass. Returns the new tokens. The stages: rows
        leave and join, the plan (who decodes, drafts how many: _plan), drafting, the prompt turn
        (core/batch_turn.py), the pass (core/batch_pass.py), acceptance and the one host read
        (core/batch_accept.py), rollback, commit and emitting (core/batch_settle.py)."""
        outputs = []
        self._leave_cancelled(outputs)
        self._start_next(outputs)
        self._grow_ahead()
        feeding = [self.prefills.feeding(s) for s in self.seqs]
        self._feed_drafter(sum(f is not None for f in feeding))
        if not self.seqs:
            return outputs
        plan = self._plan(feeding)
        t0 = time.perf_counter()
        self._draft(plan)
        self._prompt_turn(plan)
        if not plan.decoding and not any(plan.fed):  # every row waits (its drafter being fed, or a row just made)
            self.steps += 1
            return outputs
        plan.width = max([plan.widest + 1 if plan.decoding else 1] + plan.fed)  # the pass's tokens per row
        plan.idle = [plan.idle[i] or (f is not None and plan.fed[i] == 0)  # (a remeasuring step)
                     for i, f in enumerate(feeding)]
        logits, hidden = self._verify_pass(plan)
        verdicts = self._accept(plan, logits, hidden)
        seconds = time.perf_counter() - t0
        self._observe_turn(plan, seconds)
        reshaped, self._reshaped = self._reshaped, False
        finished, accepted = self._settle(plan, verdicts, hidden, outputs)
        # a step right after rows joined or left, or that fed prompt chunks, costs more than (b, k) alone
        # positions cut before the pass (a forbidden token, an unsure one) count as drafts not accepted, as in
        # core/engine.py: the policy's k is a most, and what a step at that most brings is what it learns
        decoding = plan.decoding
        self.policy.observe(len(decoding), plan.k, accepted, seconds,
                            [0 if i in plan.forced else plan.asked[i] for i in decoding],
                            [self.seqs[i].evidence for i in decoding], timed=not reshaped and len(decoding) == len(self.seqs))
        if decoding:
            self.k_steps[plan.k] = self.k_steps.get(plan.k, 0) + 1
        self._drop(finished)
        self.steps += 1
        return outputs

    def _leave_cancelled(self, outputs: list[Output]) -> None:
        cancelled = [i for i, s in enumerate(self.seqs) if s.cancelled]
        for i in cancelled:
            s = self.seqs[i]
            outputs.append(Output(s.id, [], "cancelled", s.stats(self.num_draft)))
        self._drop(cancelled)

    def _plan(self, feeding: list) -> StepPlan:
        """Which rows decode, and how many drafts each verifies (the policy's k, each row's caps, a grammar's
        forced run)."""
        b = len(self.seqs)
        # a row whose drafter is still being fed its prompt waits (its pass rows are trimmed whole): a row's
        # tokens never depend on when the steps around it let its drafter catch up
        idle = [feeding[i] is None and s.id in self.prefills.joining for i, s in enumerate(self.seqs)]
        decoding = [i for i in range(b) if feeding[i] is None and not idle[i]]
        ready = [self._ready_to_draft(s) for s in self.seqs]
        k = self.policy.next_k(len(decoding)) if self.drafter is not None and decoding and any(ready) else 0
        caps = [self._cap(s) if ready[i] else 0 for i, s in enumerate(self.seqs)]
        drafting = self.policy.row_ks(k, [self.seqs[i].evidence for i in decoding], [caps[i] for i in decoding]) \
            if k else [0] * len(decoding)
        ks = [0] * b
        for i, d in zip(decoding, drafting):
            ks[i] = min(d, self.seqs[i].max_tokens - self.seqs[i].generated - 1)
        plan = StepPlan(feeding, idle, decoding, ks, list(ks))
        plan.constrained = any(self.seqs[i].matcher is not None for i in decoding)
        # a constrained row whose grammar forces text drafts it (its model drafter drafts nothing for it)
        plan.forced = batch_grammar.forced_runs(self.seqs, decoding, ks, self.max_k) if plan.constrained else {}
        plan.k = max(ks)  # what the model drafters draft this step
        plan.asked = list(ks)  # each row's draft length before a grammar's cuts (what the policy learns from)
        return plan

    def _draft(self, plan: StepPlan) -> None:
        """Each decoding row's drafts (lazy); the grammar's forced runs put in, other constrained rows' drafts
        cut at their first illegal token."""
        k = plan.k
        plan.drafts = self._drafts(k, plan.ks, k + 1, plan.decoding) if k > 0 else {}
        for i, d in plan.drafts.items():  # a lookup that found fewer drafts: its padding is not verified
            real = getattr(d, "n_real", None)  # (known on the host: prompt lookup, suffix; None for a model's)
            if real is not None and real < plan.ks[i]:
                plan.ks[i] = plan.asked[i] = real  # (a miss is no rejection: the policy learns from real drafts)
        if plan.constrained:
            plan.on_host = batch_grammar.cut_drafts(self.seqs, plan.decoding, plan.ks, plan.drafts, plan.forced,
                                                    self.confident)

    def _drafts(self, k: int, ks: list[int], width: int, decoding: list[int]) -> dict:
        """Each decoding row's drafts, padded to the pass's width - 1 (rows that draw no key draft nothing)."""
        if self.batched is not None:  # one head pass per draft step drafts k for every adopted row
            drafting = [bool(ks[self.seqs.index(s)]) for s in self.adopted]
            keys = [s.next_key() if d else mx.random.key(0) for s, d in zip(self.adopted, drafting)]
            # a constrained row's first draft token chosen among the tokens its grammar allows there
            allowed = batch_grammar.first_allowed([s if s.matcher is not None and d else None
                                                   for s, d in zip(self.adopted, drafting)])
            samplings = [s.sampling for s in self.adopted]
            proposed = self.batched.propose(k, samplings, keys) if allowed is None else \
                self.batched.propose(k, samplings, keys, first_allowed=allowed)
            by_seq = {id(s): d for s, d in zip(self.adopted, proposed)}
            return {i: padded(by_seq.get(id(self.seqs[i])) if ks[i] else None, width - 1, self.seqs[i].last)
                    for i in decoding}
        return {i: padded(self.seqs[i].propose(ks[i]) if ks[i] else None, width - 1, self.seqs[i].last)
                for i in decoding}

    def _cap(self, s: RunningSequence) -> int:
        """The most row s may draft: its request's ceiling and its drafter's limit."""
        cap = self.max_k if s.max_draft is None else min(s.max_draft, self.max_k)
        limit = s.drafter.max_draft() if s.drafter is not None and cap > 0 else None
        return min(cap, limit) if limit is not None else cap
