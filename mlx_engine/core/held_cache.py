"""The target cache a single-sequence Engine keeps between generations, and exactly the tokens it holds.

`tokens` lists the tokens the cache holds, in order (and `hidden` their hidden rows when the drafter reads
them), so the next generation reuses the longest common prefix (a chat's earlier turns) instead of
prefilling it again. A shared prefix tree (target_model/prefix_cache.py) adds prefixes of earlier, other
conversations: a prompt starts from whichever holds more of it. Prefill runs in chunks, each a point
where progress is reported and a stop is honoured; what was fed stays recorded, so a stopped prefill
resumes where it stopped.
"""

from __future__ import annotations

import mlx.core as mx

from .. import host
from ..drafters.base import HiddenRequest
from ..target_model import cache as cache_ops
from ..target_model import prefix_cache as prefix_ops
from ..target_model.prefix_cache import PrefixCache


class HeldCache:
    def __init__(self, target, prefix_cache: PrefixCache | None = None):
        self.target = target
        self.cache: list = []
        self.tokens: list[int] = []  # the tokens the cache holds, in order
        self.hidden: list[mx.array] = []  # their hidden rows (when the drafter reads them)
        self.request: HiddenRequest | None = None  # which hidden states those rows are
        self.prefix_cache = prefix_cache
        self.largest_chunk: int | None = None  # a cap on prefill chunks below cfg.prefill_step (None: none)
        self.prefix_cache_off = None  # why a prefix tree cannot serve this model (None: it can)
        if prefix_cache is not None:
            self.prefix_cache_off = prefix_ops.supported(target.make_cache())
            if self.prefix_cache_off is not None:
                self.prefix_cache = None

    def fed(self, tokens: list[int], hidden) -> None:
        """Record tokens now held by the cache (and their hidden rows, the first len(tokens) of `hidden`)."""
        self.tokens += tokens
        if hidden is not None and tokens:
            self.hidden.append(hidden[: len(tokens)])

    def reusable(self, prompt: list[int], want_hidden: HiddenRequest | None) -> int:
        """Tokens of `prompt` the current cache already holds and can keep (0 = start afresh); the cache is
        trimmed to them."""
        if not self.cache or (want_hidden and len(self.hidden) == 0 and self.tokens):
            return 0
        if cache_ops.cache_length(self.cache) not in (0, len(self.tokens)):  # a pass cut short (Ctrl-C)
            return 0
        if want_hidden and want_hidden != self.request:  # rows of other hidden states
            return 0
        m = 0
        for a, b in zip(prompt[:-1], self.tokens):  # the last prompt token is always fed: it gives logits
            if a != b:
                break
            m += 1
        drop = len(self.tokens) - m
        if m == 0 or (drop and not all(c.is_trimmable() for c in self.cache)):
            return 0
        for c in self.cache:
            if drop:
                c.trim(drop)
        self.tokens = self.tokens[:m]
        if self.hidden:
            self.hidden = [mx.concatenate(self.hidden)[:m]]
        return m

    def _from_tree(self, prompt: list[int], held: int, want_hidden) -> int:
        """Start from the prefix tree's entries when it holds more of the prompt than the cache does."""
        tree = self.prefix_cache
        if tree is None or (want_hidden and not tree.with_hidden) or tree.match(prompt[:-1]) <= held:
            return held
        hit = tree.lookup(prompt[:-1])
        if hit.n <= held:
            return held
        self.cache = self.target.make_cache()
        prefix_ops.fill(self.cache, hit.layers, hit.n)
        self.tokens = list(prompt[: hit.n])
        self.hidden = [hit.hidden] if want_hidden else []  # (a tree's hidden rows unused by this drafter)
        return hit.n

    def prefill(self, prompt: list[int], cfg, want_hidden: HiddenRequest | None):
        """Feed prompt[:-1] in chunks of cfg.prefill_step, then the last prompt token alone (as mlx-lm does),
        after the longest reusable prefix. Between chunks progress goes to cfg.on_prefill and
        cfg.should_stop() may end it: then None. -> (logits, hidden of the prompt, tokens reused) or None."""
        reused = self.reusable(prompt, want_hidden) if cfg.reuse_cache else 0
        if reused == 0:
            self.cache = self.target.make_cache()
            self.tokens, self.hidden = [], []
        if cfg.reuse_cache:
            reused = self._from_tree(prompt, reused, want_hidden)
        self.request = want_hidden
        body = prompt[reused:-1]
        if cfg.on_prefill is not None:
            cfg.on_prefill(0, len(body))
        step = min(cfg.prefill_step, self.largest_chunk or cfg.prefill_step)
        for i in range(0, len(body), step):
            if cfg.should_stop is not None and cfg.should_stop():
                return None
            chunk = body[i : i + step]
            _, h = self.target.forward(mx.array(chunk), self.cache, want_hidden)
            host.wait([c.state for c in self.cache] + ([h] if want_hidden else []))
            self.fed(chunk, h if want_hidden else None)  # what the cache holds, chunk by chunk
            if cfg.on_prefill is not None:
                cfg.on_prefill(i + len(chunk), len(body))
        logits, h = self.target.forward(mx.array(prompt[-1:]), self.cache, want_hidden)
        self.fed(prompt[-1:], h if want_hidden else None)
        hidden = mx.concatenate(self.hidden) if want_hidden else None
        self.hidden = [hidden] if want_hidden else []
        return logits, hidden, reused

    def remember(self) -> None:
        """Store what the cache holds in the prefix tree (after a generation, finished or not)."""
        tree, n = self.prefix_cache, len(self.tokens)
        if tree is None or n == 0 or cache_ops.cache_length(self.cache) != n:
            return
        hidden = None
        if tree.with_hidden:
            if sum(h.shape[0] for h in self.hidden) != n:
                return
            hidden = mx.concatenate(self.hidden) if len(self.hidden) > 1 else self.hidden[0]
        tree.insert(self.tokens, prefix_ops.layer_states(self.cache, n), hidden)
