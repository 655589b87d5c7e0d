"""The loop: prefill -> propose -> verify -> commit, with one host synchronisation per cycle.

Each cycle the drafter proposes k tokens (lazily), the target scores [last, d_1..d_k] in one forward pass,
the acceptance rule picks a prefix and the next token on device, and a single host read brings back
`[n_accepted, t_0..t_k]`. Then `_commit` rolls the target cache back to the kept prefix (the one place
that bookkeeping happens) and the drafter advances. When the draft policy picks k = 0, or no member of
the drafter has a draft (core/members.py), a stretch of tokens is decoded plainly, pipelined as in
mlx-lm, with the drafter kept in step. A drafter that drafts token trees gets core/tree_verify.py's cycle.

State between cycles: the target cache holds every committed token except `_last` (sampled, not yet
fed) and `_replay` (kept tokens a cache without per-token states, e.g. a wrapped rotating window, must
be fed again after a rollback to its snapshot; fed before the next checkpoint). core/held_cache.py keeps
that cache between generations with exactly the tokens it holds (prefill, reuse of a common prefix, the
shared prefix tree).
"""

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterator

import mlx.core as mx
import mlx.nn as nn

from ..target_model import cache as cache_ops
from .. import host, kernels
from ..target_model.fixed_rows import make_invariant
from ..kernels.acceptance import uniforms_from_key
from ..drafters.base import Draft, Drafter, HiddenRequest, Verdict, hidden_request
from ..grammar import Grammar, apply_bitmask
from ..grammar.drafter import GRAMMAR, GrammarDrafter
from . import invariance_default, members
from .confidence import CONFIDENT, confident_prefix
from .context import check_request
from .held_cache import HeldCache
from .disk_prefix import disk_tier_for
from .memory import MemoryBudget
from .policy import AdaptivePolicy
from ..sampling import (SamplingConfig, TokenLogprob, check_logprobs, host_logprobs, logprob_rows, probabilities,
                        process_logits, row_counts, token_counts)
from .stats import SpecStats
from ..target_model.model import Target
from ..target_model.prefix_cache import PrefixCache
from .tree_verify import Trees
from .verify import accept_greedy, accept_sampled


@dataclass
class GenerationConfig:
    max_tokens: int = 256
    num_draft: int | str = 4  # k drafted per cycle (0 = plain decoding), or "auto" (the adaptive policy)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    seed: int = 0
    stop_tokens: frozenset[int] = frozenset()
    # prompt tokens per prefill pass: each chunk is a point where progress is reported and a stop is seen
    # (512: on this CPU also faster than one 2048-token pass, whose score matrices outgrow the caches)
    prefill_step: int = 512
    reuse_cache: bool = True  # keep the target cache of the common prefix with the previous generation
    profile_every: int = 0  # every n-th cycle synchronise at phase boundaries to time them (0 = never)
    on_prefill: Callable[[int, int], None] | None = None  # (tokens prefilled, tokens to prefill), chunk by chunk
    should_stop: Callable[[], bool] | None = None  # asked between prefill chunks: True ends generate() there
    grammar: Grammar | None = None  # structured output (mlx_engine/grammar): every token emitted is one it allows
    reasoning: bool = False  # the answer opens inside the model's reasoning: the grammar starts after its end marker
    grammar_drafts: bool = True  # the grammar's forced tokens drafted ahead of the drafter (off: masks and cuts only)
    # the target's log-probabilities of the emitted tokens (Step.logprobs): None off, 0 the token's own,
    # n in 1..20 also the n most likely tokens at its position
    logprobs: int | None = None

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ValueError(f"max tokens must be >= 1, got {self.max_tokens}")
        if self.num_draft != "auto" and (not isinstance(self.num_draft, int) or self.num_draft < 0):
            raise ValueError(f"number of draft tokens must be an integer >= 0 or 'auto', got {self.num_draft!r}")
        if self.prefill_step < 1:
            raise ValueError(f"prefill step must be >= 1, got {self.prefill_step}")
        check_logprobs(self.logprobs)


@dataclass(frozen=True)
class Step:
    """What one cycle produced. `tokens` are emitted in order; the first `n_accepted` came from the draft.
    `logprobs` (GenerationConfig.logprobs set): one TokenLogprob per token, the target's, from the pass that
    verified it (the drafter's probabilities never)."""

    tokens: list[int]
    draft: list[int]
    n_accepted: int
    logprobs: list[TokenLogprob] | None = None


def _no_draft() -> Draft:
    # made per call, not at import: a lazy MLX constant belongs to the stream of the thread that made it
    return Draft(mx.zeros((0,), dtype=mx.int32), None, [])


class Engine:
    def __init__(
        self, model: nn.Module, drafter: Drafter | None = None, max_draft: int | None = None,
        batch_invariant: bool | str | None = None, context_length: int | None = None,
        prefix_cache_bytes: int = 0, kv_bits: int | None = None, kv_group_size: int = 64,
        memory: MemoryBudget | None = None, prefix_tree: PrefixCache | None = None,
        prefix_cache_dir: str | None = None, prefix_disk_bytes: int | None = None,
    ):
        """max_draft: the longest draft the adaptive policy tries (None: the drafter's own, else 8).
        batch_invariant: decode (plain and verify) batch invariant, so speculative output equals plain output
        bit for bit on any device: True / "kernels" (target_model/batch_invariant.py), "fixed" (fixed-row passes,
        target_model/fixed_rows.py). None: core/invariance_default.py's rule; "kernels" with a quantized KV cache.
        context_length: the model's context window (models.context_length); a prompt plus max_tokens beyond
        it is refused before any work (ContextLengthError). None: not checked.
        prefix_cache_bytes: > 0 keeps a prefix tree of that size (target_model/prefix_cache.py) that prompts of other
        conversations start from, filled after each generation (`held.prefix_cache_off` says why a model's
        cache cannot be kept by prefix); prefix_tree: a tree shared with other engines instead (one that keeps
        hidden rows serves engines that read none as well). prefix_cache_dir: the tree's disk tier in that folder
        (core/disk_prefix.py; prefix_disk_bytes its budget): a prompt of an earlier process starts from it.
        kv_bits / kv_group_size: the target's KV cache quantized (target_model/cache.py), batch invariant by default
        and its prompt fed in passes of at most max_rows tokens: a float-level difference in a key flips its
        code (README, Long contexts); batch_invariant=False: stock passes (not lossless with such a cache).
        memory: a budget (core/memory.py) each prompt + max_tokens is checked against before any work."""
        self.memory = memory
        self.context_length = context_length
        if batch_invariant is None:
            batch_invariant = invariance_default.default_invariance() if kv_bits is None else "kernels"
        cache_ops.check_kv_quantization(kv_bits, kv_group_size)
        if kv_bits is not None and batch_invariant == "fixed":
            raise ValueError("fixed-row passes do not cover a quantized KV cache: use --batch-invariant kernels")
        self.max_rows = make_invariant(model, batch_invariant)  # invariant passes: k + 1 <= max_rows
        self.batch_invariant = self.max_rows is not None
        self.target = Target(model, kv_bits, kv_group_size)
        self.target.check_cache()
        self.drafter = drafter
        self._drafting = drafter  # this generation's drafter: under a grammar, the grammar ahead of `drafter`
        self._matcher = None  # this generation's grammar state (grammar/matcher.py), or None
        self.max_draft = max_draft
        self.policy = AdaptivePolicy(**members.settings(drafter, max_draft))  # kept across generations
        self.member_policies: dict[str, AdaptivePolicy] = {}  # a chain's other members' own policies
        # the fused acceptance kernel when a GPU backend is selected; on CPU verify.py's reference
        self._fused_accept = kernels.get("acceptance") if kernels.backend("acceptance") != "reference" else None
        self.stats = SpecStats()
        self.confident = CONFIDENT  # under a grammar: draft positions verified up to the first less sure (0: all)
        tree = prefix_tree or (PrefixCache(prefix_cache_bytes, with_hidden=hidden_request(drafter) is not None)
                               if prefix_cache_bytes > 0 else None)
        self.held = HeldCache(self.target, tree)  # the target cache and exactly the tokens it holds
        if self.held.prefix_cache is not None and prefix_cache_dir is not None and tree.disk is None:
            tree.disk = disk_tier_for(model, drafter, kv_bits, kv_group_size, prefix_cache_dir, prefix_disk_bytes)
        if self.batch_invariant and kv_bits is not None:  # the prompt's codes too as token-by-token decoding's
            self.held.largest_chunk = self.max_rows
        self.trees = Trees(self)  # token-tree drafts (core/tree_verify.py); `trees.off` says why not
        self._logprobs_n: int | None = None  # this generation's GenerationConfig.logprobs
        self._rows: list | None = None  # the logprob rows of the tokens the last host read brought, when asked for
        self._generated: Counter = Counter()  # this generation's tokens (the presence and frequency penalties')

    @property
    def cache(self) -> list:
        return self.held.cache

    @property
    def _cached(self) -> list[int]:
        return self.held.tokens

    def kv_bytes(self) -> int:
        """Bytes of the target's KV cache and the prefix tree."""
        tree = self.held.prefix_cache
        return cache_ops.kv_bytes(self.cache) + (tree.nbytes if tree is not None else 0)

    # -- the one place where cache bookkeeping happens -------------------------------------------
    def _commit(self, ckpt, verdict: Verdict, hidden) -> None:
        """Roll the target back to the kept inputs [last, d_1..d_n]; advance the drafter.
        `hidden`: rows of the verify pass, or None."""
        kept = [self._last] + verdict.tokens[: verdict.n_accepted]
        replay = cache_ops.rollback(self.cache, ckpt, len(kept)) if ckpt is not None else 0
        self.held.fed(kept[: len(kept) - replay], hidden)
        self._replay = kept[len(kept) - replay :] if replay else []
        self._last = verdict.tokens[verdict.n_accepted]
        if self._drafting is not None:
            self._drafting.commit(verdict, hidden)

    def _choose(self, logits, context, draft: Draft, cfg: SamplingConfig, key, masks=None, counts=None) -> mx.array:
        """[n_accepted, t_0..t_k] on device (see verify.py); `masks` [k + 1, W]: the grammar's, row by row;
        `counts` [k + 1, V]: each row's counts of the generated tokens (presence / frequency penalties)."""
        logits = process_logits(logits, context, cfg, counts)
        if masks is not None:
            logits = apply_bitmask(logits, masks)
        target = logits if cfg.greedy else probabilities(logits, cfg)
        if self._fused_accept is not None and draft.cut_probs is None:
            return self._fused(target, draft, cfg.greedy, key)
        if cfg.greedy:
            return accept_greedy(target, draft.tokens)
        return accept_sampled(target, draft.tokens, draft.probs, key, draft.cut_probs)

    def _fused(self, target, draft: Draft, greedy: bool, key) -> mx.array:
        """The fused acceptance kernel (GPU): (n, next) -> the same packed layout as verify.py."""
        k = draft.tokens.shape[0]
        uniforms, sample_uniform = uniforms_from_key(key, k)
        n, nxt = self._fused_accept(target, draft.tokens, draft.probs, uniforms, sample_uniform, greedy)
        drafts = mx.concatenate([draft.tokens.astype(mx.int32), mx.zeros((1,), mx.int32)])
        return mx.concatenate([n.reshape(1), mx.where(mx.arange(k + 1) < n, drafts, nxt)]).astype(mx.int32)

    def _context(self, cfg: SamplingConfig, draft: mx.array):
        """Penalty history of each verified row: the last committed tokens, then the drafts."""
        if not cfg.penalized:
            return None
        return mx.concatenate([mx.array(self._history[-cfg.repetition_context :]), draft])

    def _counts(self, cfg: SamplingConfig, draft: mx.array, vocab: int):
        """Counts of the generated tokens (the prompt excluded) for each verified row: row i adds drafts 1..i."""
        if not cfg.counted:
            return None
        return row_counts(token_counts(self._generated, vocab), draft)

    def _read(self, out: mx.array, logits: mx.array, n: int | None) -> tuple[list, list | None]:
        """The cycle's one host read: `out` and, when logprobs are asked for (n not None), the logprob rows of
        the token out[1 + i] at logits row i, every row (the host keeps the emitted ones)."""
        if n is None:
            return host.read(out), None
        values, rows = host.read_all(out, logprob_rows(logits, out[1 : logits.shape[0] + 1], n))
        return values, rows

    def _emit(self, tokens: list[int], cfg: GenerationConfig) -> tuple[list[int], bool]:
        """Cut emitted tokens at max_tokens and after a stop token; add them to the history."""
        tokens = tokens[: cfg.max_tokens - self.stats.generated]
        stopped = False
        for i, tok in enumerate(tokens):
            if tok in cfg.stop_tokens:
                tokens, stopped = tokens[: i + 1], True
                break
        self._history += tokens
        self._generated.update(tokens)
        if self._matcher is not None:
            self.stats.grammar_seconds = self._matcher.seconds
        return tokens, stopped

    def flush_prefix_disk(self, timeout: float = 60.0) -> None:
        """Wait until what the prefix tree queued for its disk tier is written (a command about to exit)."""
        tree = self.held.prefix_cache
        if tree is not None and tree.disk is not None:
            tree.disk.flush(timeout)

    def generate(self, prompt: list[int], config: GenerationConfig | None = None) -> Iterator[Step]:
        """Yield one Step per cycle (the first holds the token sampled after the prompt).

        The cycle: prefill -> (propose -> verify -> accept -> commit -> emit)*, each phase a method below;
        a policy asking for k = 0 gets a pipelined plain stretch instead. However it ends (finished,
        closed, stopped while prefilling), what the cache holds goes to the prefix tree, if there is one."""
        cfg = config or GenerationConfig()
        self._check_prompt(prompt, cfg.max_tokens)
        cfg.sampling.check_vocab(self.target.vocab_size)
        try:
            yield from self._cycles(prompt, cfg)
        finally:
            self.held.remember()

    def _cycles(self, prompt: list[int], cfg: GenerationConfig) -> Iterator[Step]:
        sampling = cfg.sampling
        matcher = self._matcher = cfg.grammar.matcher(cfg.reasoning) if cfg.grammar is not None else None
        # under a grammar, its forced tokens are drafted ahead of the drafter (grammar/drafter.py)
        drafts_forced = matcher is not None and cfg.grammar_drafts
        drafter = self._drafting = GrammarDrafter(self.drafter, matcher) if drafts_forced else self.drafter
        want_hidden = hidden_request(drafter)  # which target hidden states the drafter reads, or None
        default, own = members.policies(drafter, self.policy, self.member_policies, cfg.num_draft, self.max_draft)
        if drafts_forced:
            own = {**own, GRAMMAR: drafter.policy}
        stats = self.stats = SpecStats(prompt_tokens=len(prompt))
        self._logprobs_n = cfg.logprobs
        mx.reset_peak_memory()
        self._target_key, draft_key = mx.random.split(mx.random.key(cfg.seed))
        first = self._start(prompt, cfg, want_hidden)
        if first is None:  # stopped while prefilling
            return
        yield Step([first], [], 0, self._logprobs([first]))
        if first in cfg.stop_tokens:
            return

        members.begin(default, own, sampling)  # what the adaptive policy learns is kept per sampling config
        t_decode = time.perf_counter()
        while stats.generated < cfg.max_tokens:
            remaining = cfg.max_tokens - stats.generated
            member = members.next_member(drafter)  # who drafts this cycle (None: no one has a draft)
            policy = own.get(member, default)
            if member is not None and hasattr(policy, "at_context"):  # costs are learnt per context range
                policy.at_context(len(self.held.tokens))
            wanted = policy.next_k() if member is not None else 0
            k = self._draft_length(wanted, remaining)
            if k <= 0:
                t = time.perf_counter()
                n, stopped = 0, False
                # a plain stretch the policy asked for, or until a member has a draft, cut short when another
                # member could draft; or the last token (no room for a draft): not timed
                todo = (remaining if member is None else min(policy.plain_run(), remaining)) if wanted <= 0 else 1
                until = (lambda m=member: members.next_member(drafter) not in (None, m)) if drafter is not None else None
                for step in self._plain(cfg, todo, want_hidden, t_decode, until):
                    n += 1
                    stopped = step.tokens[-1] in cfg.stop_tokens
                    yield step
                if wanted <= 0 and member is not None:
                    members.observe_plain(policy, default, own, time.perf_counter() - t, n)
                if stopped:
                    return
                continue

            t_cycle = time.perf_counter()
            profile = cfg.profile_every > 0 and stats.cycles % cfg.profile_every == 0
            draft_key, dkey = mx.random.split(draft_key)
            self._feed_replay(want_hidden)  # before the drafter (it may read the target cache) and the checkpoint
            self._rows = None
            if self.trees.wanted(member, sampling):  # a token tree: one pass, the kept path compacted
                k, verdict, drafted, waited = self.trees.cycle(k, sampling, dkey, want_hidden, profile, policy)
                asked = k
                stats.cut += self.trees.cut
            else:
                draft = self._propose(k, sampling, dkey, profile)
                asked = proposed = draft.tokens.shape[0]
                unsure = 0
                if matcher is not None:  # cut at the first token the grammar forbids, before it is verified
                    draft, unsure = self._legal(draft)
                draft = self._to_verify(draft)
                k = draft.tokens.shape[0]
                stats.unsure += unsure
                stats.cut += proposed - k - unsure
                ckpt, logits, hidden = self._verify(draft, want_hidden, profile)
                masks = self._draft_masks(draft, logits) if matcher is not None else None
                verdict, drafted, waited = self._accept(logits, draft, sampling, profile, masks)
                if matcher is not None:  # the rejected drafts leave the matcher; the drafter hears of all it drafted
                    matcher.settle(k, verdict.n_accepted, verdict.tokens[verdict.n_accepted])
                    verdict = Verdict(proposed, verdict.n_accepted, verdict.tokens)
                self._commit(ckpt, verdict, hidden)
            emitted, stopped = self._emit(verdict.tokens, cfg)
            n = min(verdict.n_accepted, len(emitted))
            stats.record_cycle(k, n, len(emitted), forced=member == GRAMMAR)
            stats.time_host += time.perf_counter() - t_cycle - waited  # all but the wait for the device
            stats.decode_time = time.perf_counter() - t_decode
            stats.peak_memory = mx.get_peak_memory()
            # the policy's own length: positions cut before the pass count as drafts not accepted (its k is a
            # most, and what a cycle at that most brings is what it learns)
            policy.observe(asked, n, time.perf_counter() - t_cycle)
            yield Step(emitted, drafted, n, self._logprobs(emitted))
            if stopped:
                return

    def _logprobs(self, emitted: list[int]) -> list[TokenLogprob] | None:
        """The emitted tokens' logprobs from the rows the cycle's read brought (`_rows`, one per emitted
        token in order), or None when they were not asked for."""
        if self._rows is None:
            return None
        return host_logprobs(emitted, self._rows[: len(emitted)])

    # -- the phases of a cycle -------------------------------------------------------------------
    def _check_prompt(self, prompt: list[int], max_tokens: int) -> None:
        check_request(prompt, max_tokens, self.target.vocab_size, self.context_length, self.memory)

    def _start(self, prompt: list[int], cfg: GenerationConfig, want_hidden: HiddenRequest | None) -> int | None:
        """Prefill, sample the first token, and start the drafter on the prompt + that token.
        None: cfg.should_stop() ended the prefill."""
        t0 = time.perf_counter()
        self._history = list(prompt)
        self._generated, self._rows = Counter(), None
        prefilled = self.held.prefill(prompt, cfg, want_hidden)
        if prefilled is None:
            self.stats.cancelled = True
            self.stats.prompt_time = time.perf_counter() - t0
            return None
        logits, hidden, self.stats.reused_tokens = prefilled
        no_draft = _no_draft()
        masks = self._matcher.mask() if self._matcher is not None else None
        out = self._choose(logits, self._context(cfg.sampling, no_draft.tokens), no_draft, cfg.sampling,
                           self._next_key(), masks)  # (nothing generated yet: no counts)
        values, self._rows = self._read(out, logits[-1:], cfg.logprobs)
        first = values[1]
        if self._matcher is not None:
            self._matcher.consume([first])
        self._history.append(first)
        self._generated[first] += 1
        self._last, self._replay = first, []
        drafter = self._drafting
        if drafter is not None:
            if getattr(drafter, "reads_target_cache", False):  # Gemma 4's assistant: a read-only view
                drafter.attach_target_cache(self.cache)
            drafter.begin(list(self._history), hidden)
        self.stats.generated = 1
        self.stats.prompt_time = time.perf_counter() - t0
        return first

    def _draft_length(self, wanted: int, remaining: int) -> int:
        """The policy's k, cut so the cycle cannot pass max_tokens nor the drafter's own limit."""
        k = min(wanted, remaining - 1, self.max_rows - 1 if self.max_rows else wanted)
        limit = self._drafting.max_draft() if self._drafting is not None else None
        return min(k, limit) if limit is not None else k

    def _propose(self, k: int, sampling: SamplingConfig, key: mx.array, profile: bool) -> Draft:
        """The drafter's k tokens (lazy); the device starts on them while Python builds the verify graph."""
        draft = self._drafting.propose(k, sampling, key)
        host.start(draft.tokens)
        if profile:
            t = time.perf_counter()
            host.wait(draft.tokens, *([draft.probs] if draft.probs is not None else []))
            self.stats.time_draft += time.perf_counter() - t
        return draft

    def _verify(self, draft: Draft, want_hidden: HiddenRequest | None, profile: bool):
        """Score [last, d_1..d_k] in one target pass after a cache checkpoint. -> (ckpt, logits [k+1, V], hidden)."""
        k = draft.tokens.shape[0]
        inputs = mx.concatenate([mx.array([self._last], dtype=mx.int32), draft.tokens])
        ckpt = cache_ops.checkpoint(self.cache, inputs.shape[0])
        logits, hidden = self.target.forward(inputs, self.cache, want_hidden)
        logits = logits[-(k + 1) :]
        if profile:
            t = time.perf_counter()
            host.wait(logits)
            self.stats.time_verify += time.perf_counter() - t
        return ckpt, logits, hidden

    def _legal(self, draft: Draft) -> tuple[Draft, int]:
        """The draft cut at its first token the grammar forbids, or before its first position the drafter was
        unsure of (core/confidence.py), whichever comes first; -> (the draft, positions dropped as unsure). A
        drafter that drafts on the device has its tokens (and confidences) read first: under a grammar a cycle
        reads the host twice (the drafts, then the verdict)."""
        tokens, sure = draft.host_tokens, None
        if draft.confidence is not None:
            if tokens is None:
                tokens, confidence = host.read_all(draft.tokens, draft.confidence)
            else:
                confidence = host.read(draft.confidence)
            sure = confident_prefix(confidence, self.confident)
        elif tokens is None:
            tokens = host.read(draft.tokens)
        sure_tokens = tokens[:sure]
        n = self._matcher.legal(sure_tokens)
        if n == len(tokens):
            return Draft(draft.tokens, draft.probs, list(tokens)), 0
        probs = draft.probs
        cut = probs is not None and n < len(sure_tokens)  # the grammar's cut: the forbidden token's q
        return Draft(draft.tokens[:n], probs[:n] if probs is not None else None, list(tokens[:n]),
                     cut_probs=probs[n : n + 1] if cut else None), len(tokens) - len(sure_tokens)

    def _to_verify(self, draft: Draft) -> Draft:
        """The draft the verify pass takes, as cut (a sharded target's rank 0 sends it to the other ranks here)."""
        return draft

    def _draft_masks(self, draft: Draft, logits: mx.array):
        """The grammar's mask of every verified row, built on the host while the device runs the verify pass;
        the matcher is left advanced through the draft (settled after the verdict)."""
        host.start(logits)
        return self._matcher.masks(draft.host_tokens)

    def _feed_replay(self, want_hidden: HiddenRequest | None) -> None:
        """Feed the kept tokens a snapshot rollback handed back, in a pass of their own at the start of a
        drafting cycle: the verify checkpoint comes after them, and a drafter reading the target cache sees
        the whole prefix."""
        if self._replay:
            _, h = self.target.forward(mx.array(self._replay, dtype=mx.int32), self.cache, want_hidden)
            self.held.fed(self._replay, h)
            self._replay = []

    def _accept(self, logits, draft: Draft, sampling: SamplingConfig, profile: bool, masks=None):
        """The acceptance rule on device (over the grammar's masked rows, when there is one), then the cycle's
        one host read (with the logprob rows of t_0..t_k, when asked for: `_rows`).
        -> (verdict, the drafted tokens, seconds spent waiting for the device)."""
        k = draft.tokens.shape[0]
        out = self._choose(logits, self._context(sampling, draft.tokens), draft, sampling, self._next_key(), masks,
                           self._counts(sampling, draft.tokens, logits.shape[-1]))
        packed = mx.concatenate([out, draft.tokens.astype(mx.int32)])  # drafts ride along for the trace
        t_sync = time.perf_counter()
        values, self._rows = self._read(packed, logits, self._logprobs_n)  # the cycle's one host synchronisation
        waited = time.perf_counter() - t_sync
        if profile:
            self.stats.time_sample += waited
            self.stats.profiled_cycles += 1
        n = values[0]
        return Verdict(k, n, values[1 : n + 2]), values[k + 2 :], waited

    def _next_key(self) -> mx.array:
        self._target_key, key = mx.random.split(self._target_key)
        return key

    def _plain(
        self, cfg: GenerationConfig, n_tokens: int, want_hidden: HiddenRequest | None, t_decode: float, until=None
    ) -> Iterator[Step]:
        """Decode n_tokens plainly, pipelined as in mlx-lm: step i+1 is built and started before token i
        is read. One host read per token; the drafter (if any) is kept in step with k = 0 commits.
        Under a grammar, step i+1's pass still starts before token i is read, its sampling after (its mask
        needs token i): the host builds the mask while the device runs the pass.
        `until()` true after a token: stop after the next one (already in flight), the stretch cut short.
        Under a grammar that drafts its forced runs (`serial`), step i+1 starts after token i is read: a
        token that opens a forced run ends the stretch at once, and the run is drafted whole by the next
        cycle instead of its first token costing a pass of its own (in JSON, one pass a key)."""
        sampling, stats, drafter, matcher = cfg.sampling, self.stats, self._drafting, self._matcher
        width = sampling.repetition_context
        no_draft = _no_draft()

        def forward(inputs: mx.array, window: mx.array):
            """Feed inputs; -> (logits of the next token [1, V], penalty window, hidden rows of the inputs or None)."""
            logits, hidden = self.target.forward(inputs, self.cache, want_hidden)
            window = mx.concatenate([window, inputs[-1:]])[-width:]  # history up to the newest input
            return logits[-1:], window, hidden

        def advance(current: mx.array, window: mx.array, counts: mx.array | None):
            """forward() over the token just chosen, and the generated tokens' counts with it."""
            logits, window, hidden = forward(current, window)
            if counts is not None:  # the history up to the newest input
                counts = counts + (mx.arange(logits.shape[-1]) == current).astype(mx.float32)
            return logits, window, hidden, counts

        def choose(logits: mx.array, window: mx.array, counts: mx.array | None):
            """The next token [1] and its logprob row (None when not asked for), both started; under a grammar,
            masked by the matcher as it stands (every token before fed). `counts` [V]: the generated tokens'."""
            context = window if sampling.penalized else None
            masks = matcher.mask() if matcher is not None else None
            token = self._choose(logits, context, no_draft, sampling, self._next_key(), masks,
                                 counts[None] if counts is not None else None)[1:2]
            rows = logprob_rows(logits, token, cfg.logprobs) if cfg.logprobs is not None else None
            host.start(token, *([rows] if rows is not None else []))
            return token, rows

        first = self._replay + [self._last]
        self._replay = []
        logits, window, hidden = forward(mx.array(first, dtype=mx.int32),
                                         mx.array(self._history[:-1][-width:], dtype=mx.int32))
        vocab = logits.shape[-1]
        counts = token_counts(self._generated, vocab) if sampling.counted else None  # (`_last` counted)
        token, rows = choose(logits, window, counts)
        self.held.fed(first, hidden)
        # under a grammar that drafts, a token may open a forced run, which the next cycle drafts whole: the
        # next step is built after the token is read, so no step is spent on the run's first token alone
        serial = until is not None and isinstance(drafter, GrammarDrafter)
        for i in range(n_tokens):
            t_cycle = time.perf_counter()
            current, current_rows, current_hidden = token, rows, hidden
            if i + 1 < n_tokens and not serial:
                logits, window, hidden, counts = advance(current, window, counts)
                if matcher is None:
                    token, rows = choose(logits, window, counts)
                else:
                    host.start(logits)
            t_sync = time.perf_counter()
            if current_rows is None:
                tok = host.read(current)[0]  # the cycle's one host synchronisation
            else:  # (with the token's logprob row)
                (tok,), self._rows = host.read_all(current, current_rows)
            t_back = time.perf_counter()
            if matcher is not None:
                matcher.consume([tok])
                if i + 1 < n_tokens and not serial:
                    token, rows = choose(logits, window, counts)
            if drafter is not None:
                drafter.commit(Verdict(0, 0, [tok]), current_hidden[-1:] if want_hidden else None)
                if serial and i + 1 < n_tokens and until():
                    n_tokens = i + 1  # nothing in flight: the stretch ends with this token
                elif not serial and until is not None and i + 1 < n_tokens - 1 and until():
                    n_tokens = i + 2  # token i + 1 is in flight: it ends the stretch
            if serial and i + 1 < n_tokens:
                logits, window, hidden, counts = advance(current, window, counts)
                token, rows = choose(logits, window, counts)
            if i + 1 < n_tokens:  # the step built above has fed `tok`
                self.held.fed([tok], hidden)
            self._last = tok
            emitted, stopped = self._emit([tok], cfg)
            stats.record_cycle(0, 0, len(emitted))
            stats.time_host += (t_sync - t_cycle) + (time.perf_counter() - t_back)
            stats.decode_time = time.perf_counter() - t_decode
            stats.peak_memory = mx.get_peak_memory()
            yield Step(emitted, [], 0, self._logprobs(emitted))
            if stopped or i + 1 >= n_tokens:
                return
