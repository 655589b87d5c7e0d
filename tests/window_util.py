"""A tiny gemma3-like target with a rotating (sliding-window) KV cache, and an Engine that checks every
verify pass against a fresh forward: the pieces of the rotating-window and replay tests."""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np
from mlx.utils import tree_map
from mlx_lm.utils import _get_classes

from mlx_engine import Engine
from mlx_engine.target_model import cache as cache_ops

WINDOW = 8  # layer 0: RotatingKVCache(max_size=WINDOW); layer 1: KVCache
VOCAB = 64
CONFIG = dict(
    model_type="gemma3_text", hidden_size=32, num_hidden_layers=2, intermediate_size=64, num_attention_heads=4,
    head_dim=8, num_key_value_heads=2, sliding_window=WINDOW, sliding_window_pattern=2, query_pre_attn_scalar=8,
    rms_norm_eps=1e-6, rope_theta=10000.0, rope_local_base_freq=10000.0, vocab_size=VOCAB,
    max_position_embeddings=512,
)


@functools.cache
def build(seed: int = 1, noise: float = 0.0):
    """The target (noise 0) or a noisy copy of it (a draft that agrees often, not always)."""
    model_cls, args_cls = _get_classes(CONFIG)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(CONFIG))
    model.eval()
    if noise:
        mx.random.seed(seed + 100)
        model.update(tree_map(lambda w: w + noise * mx.random.normal(w.shape), model.parameters()))
    mx.eval(model.parameters())
    return model


def fresh_logits(model, tokens: list[int]) -> np.ndarray:
    """Logits [len(tokens), V] of one pass over `tokens` from an empty cache (the sliding mask by position)."""
    return np.array(model(mx.array(tokens)[None], cache=cache_ops.make_cache(model))[0])


class CheckingEngine(Engine):
    """Before every verify pass: the cache holds exactly the committed tokens but the last (`_cached` +
    [`_last`] == the history, nothing left to replay); after it: its logits equal a fresh forward over
    those tokens + the pass's inputs. Counts the passes checked and the tokens replayed."""

    checks = replayed = 0
    atol = 2e-4

    def _verify(self, draft, want_hidden, profile):
        assert self._replay == [], "a verify pass before the replayed tokens were fed"
        assert self._cached + [self._last] == self._history, "the cache's tokens are not the committed ones"
        ckpt, logits, hidden = super()._verify(draft, want_hidden, profile)
        inputs = [self._last] + np.array(draft.tokens).tolist()
        ref = fresh_logits(self.target.model, self._cached + inputs)[-len(inputs):]
        np.testing.assert_allclose(np.array(logits), ref, rtol=1e-4, atol=self.atol,
                                   err_msg=f"verify pass {self.checks} after {len(self._cached)} tokens")
        self.checks += 1
        return ckpt, logits, hidden

    def _commit(self, ckpt, verdict, hidden):
        super()._commit(ckpt, verdict, hidden)
        self.replayed += len(self._replay)


class ScriptedPolicy:
    """A draft-length policy that plays a script of k values (0: a plain stretch of `plain` tokens)."""

    def __init__(self, script, plain: int = 1):
        self.script, self.plain, self.i = list(script), plain, 0

    def next_k(self) -> int:
        k = self.script[self.i % len(self.script)]
        self.i += 1
        return k

    def plain_run(self) -> int:
        return self.plain

    def begin(self, regime=None) -> None:
        self.i = 0

    def observe(self, k, n_accepted, seconds, tokens=1) -> None:
        pass
