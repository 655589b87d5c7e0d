"""The loop: prefill -> propose -> verify -> commit, with one host synchronisation per cycle.

Each cycle the drafter proposes k tokens (lazily), the target scores [last, d_1..d_k] in one forward pass,
the acceptance rule picks a prefix and the next token on device, and a single host read brings back
`[n_accepted, t_0..t_k]`. Then `commit` rolls the target cache back to the kept prefix (the one place
that bookkeeping happens) and the drafter advances.
"""

import time
from dataclasses import dataclass, field
from typing import Iterator

import mlx.core as mx
import mlx.nn as nn

from . import cache as cache_ops
from . import host
from .drafters.base import Draft, Drafter, Verdict
from .sampling import SamplingConfig, probabilities, process_logits
from .stats import SpecStats
from .target import Target
from .verify import accept_greedy, accept_sampled


@dataclass
class GenerationConfig:
    max_tokens: int = 256
    num_draft: int = 4  # k: tokens drafted per cycle (0 = plain decoding)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    seed: int = 0
    stop_tokens: frozenset[int] = frozenset()
    prefill_step: int = 2048
    profile_every: int = 0  # every n-th cycle synchronise at phase boundaries to time them (0 = never)

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ValueError(f"max tokens must be >= 1, got {self.max_tokens}")
        if self.num_draft < 0:
            raise ValueError(f"number of draft tokens must be >= 0, got {self.num_draft}")
        if self.prefill_step < 1:
            raise ValueError(f"prefill step must be >= 1, got {self.prefill_step}")


@dataclass(frozen=True)
class Step:
    """What one cycle produced. `tokens` are emitted in order; the first `n_accepted` came from the draft."""

    tokens: list[int]
    draft: list[int]
    n_accepted: int


_EMPTY = mx.zeros((0,), dtype=mx.int32)


class Engine:
    def __init__(self, model: nn.Module, drafter: Drafter | None = None):
        self.target = Target(model)
        self.drafter = drafter
        self.stats = SpecStats()
        self.cache: list = []

    # -- the one place where cache bookkeeping happens -------------------------------------------
    def _commit(self, ckpt, verdict: Verdict, hidden) -> list[int]:
        """Roll the target back to the kept inputs; returns tokens to replay before the next pass."""
        kept = self._replay + [self._last] + verdict.tokens[: verdict.n_accepted]
        replay = cache_ops.rollback(self.cache, ckpt, len(kept))
        if self.drafter is not None:
            self.drafter.commit(verdict, hidden)
        return kept[len(kept) - replay :] if replay else []

    def _choose(self, logits, context, draft: Draft, cfg: SamplingConfig, key) -> mx.array:
        logits = process_logits(logits, context, cfg)
        if cfg.greedy:
            return accept_greedy(logits, draft.tokens)
        return accept_sampled(probabilities(logits, cfg), draft.tokens, draft.probs, key)

    def _prefill(self, prompt: list[int], cfg: GenerationConfig, want_hidden: bool):
        """Feed prompt[:-1] in chunks, then the last prompt token alone (as mlx-lm does)."""
        hidden = []
        body = prompt[:-1]
        for i in range(0, len(body), cfg.prefill_step):
            _, h = self.target.forward(mx.array(body[i : i + cfg.prefill_step]), self.cache, want_hidden)
            host.wait([c.state for c in self.cache] + ([h] if want_hidden else []))
            hidden.append(h)
        logits, h = self.target.forward(mx.array(prompt[-1:]), self.cache, want_hidden)
        hidden.append(h)
        return logits, (mx.concatenate(hidden) if want_hidden else None)

    def generate(self, prompt: list[int], config: GenerationConfig | None = None) -> Iterator[Step]:
        """Yield one Step per cycle (the first holds the token sampled after the prompt)."""
        cfg = config or GenerationConfig()
        if not prompt:
            raise ValueError("the prompt is empty")
        vocab = self.target.vocab_size
        if max(prompt) >= vocab or min(prompt) < 0:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        sampling = cfg.sampling
        drafter = self.drafter
        want_hidden = drafter is not None and drafter.needs_hidden
        stats = self.stats = SpecStats(prompt_tokens=len(prompt))
        mx.reset_peak_memory()
        target_key, draft_key = mx.random.split(mx.random.key(cfg.seed))
        window = sampling.repetition_context

        def context(history: list[int], draft: mx.array):
            return mx.concatenate([mx.array(history[-window:]), draft]) if sampling.penalized else None

        # prefill and the first token
        t0 = time.perf_counter()
        self.cache = self.target.make_cache()
        logits, hidden = self._prefill(prompt, cfg, want_hidden)
        target_key, key = mx.random.split(target_key)
        out = self._choose(logits, context(prompt, _EMPTY), Draft(_EMPTY, None), sampling, key)
        first = host.read(out)[1]
        history = prompt + [first]
        self._last, self._replay = first, []
        if drafter is not None:
            drafter.begin(history, hidden[: len(prompt)] if want_hidden else None)
        stats.generated = 1
        stats.prompt_time = time.perf_counter() - t0
        yield Step([first], [], 0)
        if first in cfg.stop_tokens:
            return

        t_decode = time.perf_counter()
        if drafter is None or cfg.num_draft == 0:
            yield from self._plain(cfg, history, target_key, t_decode)
            return
        while stats.generated < cfg.max_tokens:
            t_cycle = time.perf_counter()
            remaining = cfg.max_tokens - stats.generated
            k = min(cfg.num_draft, remaining - 1) if drafter is not None else 0
            limit = drafter.max_draft() if drafter is not None else None
            if limit is not None:
                k = min(k, limit)
            profile = cfg.profile_every > 0 and stats.cycles % cfg.profile_every == 0

            draft_key, dkey = mx.random.split(draft_key)
            draft = drafter.propose(k, sampling, dkey) if k > 0 else Draft(_EMPTY, None, [])
            k = draft.tokens.shape[0]
            host.start(draft.tokens)  # the device drafts while Python builds the verify graph
            if profile:
                t = time.perf_counter()
                host.wait(draft.tokens, *([draft.probs] if draft.probs is not None else []))
                stats.time_draft += time.perf_counter() - t

            inputs = mx.concatenate([mx.array(self._replay + [self._last], dtype=mx.int32), draft.tokens])
            ckpt = cache_ops.checkpoint(self.cache, inputs.shape[0])
            logits, hidden = self.target.forward(inputs, self.cache, want_hidden)
            logits = logits[-(k + 1) :]
            hidden = hidden[-(k + 1) :] if want_hidden else None
            if profile:
                t = time.perf_counter()
                host.wait(logits)
                stats.time_verify += time.perf_counter() - t

            target_key, key = mx.random.split(target_key)
            out = self._choose(logits, context(history, draft.tokens), draft, sampling, key)
            packed = mx.concatenate([out, draft.tokens.astype(mx.int32)])  # drafts ride along for the trace
            t_sync = time.perf_counter()
            values = host.read(packed)  # the cycle's one host synchronisation
            t_back = time.perf_counter()
            if profile:
                stats.time_sample += t_back - t_sync
                stats.profiled_cycles += 1
            n = values[0]
            emitted = values[1 : n + 2]
            verdict = Verdict(k, n, emitted)
            self._replay = self._commit(ckpt, verdict, hidden)
            self._last = emitted[-1]

            emitted = emitted[:remaining]
            for i, tok in enumerate(emitted):
                if tok in cfg.stop_tokens:
                    emitted = emitted[: i + 1]
                    break
            history += emitted
            n = min(n, len(emitted))
            stats.record_cycle(k, n, len(emitted))
            stats.time_host += (t_sync - t_cycle) + (time.perf_counter() - t_back)
            stats.decode_time = time.perf_counter() - t_decode
            stats.peak_memory = mx.get_peak_memory()
            yield Step(emitted, values[k + 2 :], n)
            if emitted[-1] in cfg.stop_tokens:
                return

    def _plain(self, cfg: GenerationConfig, history: list[int], key: mx.array, t_decode: float) -> Iterator[Step]:
        """Plain decoding, pipelined as in mlx-lm: step n+1 is built and started before token n is read.

        Still one host read per cycle. The cache ends one token ahead (the step after the last token).
        """
        sampling, stats = cfg.sampling, self.stats
        width = sampling.repetition_context

        def step(token: mx.array, window: mx.array, key: mx.array):
            logits, _ = self.target.forward(token, self.cache)
            window = mx.concatenate([window, token])[-width:]  # history up to and including `token`
            context = window if sampling.penalized else None
            return self._choose(logits, context, Draft(_EMPTY, None), sampling, key)[1:2], window

        key, sub = mx.random.split(key)
        token, window = step(mx.array(history[-1:]), mx.array(history[:-1][-width:]), sub)
        host.start(token)
        while stats.generated < cfg.max_tokens:
            t_cycle = time.perf_counter()
            current = token
            if stats.generated + 1 < cfg.max_tokens:
                key, sub = mx.random.split(key)
                token, window = step(current, window, sub)
                host.start(token)
            t_sync = time.perf_counter()
            tok = host.read(current)[0]  # the cycle's one host synchronisation
            t_back = time.perf_counter()
            stats.record_cycle(0, 0, 1)
            stats.time_host += (t_sync - t_cycle) + (time.perf_counter() - t_back)
            stats.decode_time = time.perf_counter() - t_decode
            stats.peak_memory = mx.get_peak_memory()
            yield Step([tok], [], 0)
            if tok in cfg.stop_tokens:
                return
