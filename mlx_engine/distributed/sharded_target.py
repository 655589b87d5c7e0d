"""The target on one rank: every pass evaluated whole, whatever this rank reads of it.

MLX issues a collective only when something that depends on it is evaluated, so every rank must evaluate
the same collectives in the same order. Rank 0 reads more of a pass than the others (a drafter's hidden
states, say, in a prefill chunk whose logits nobody reads), and a sharded pass ends in collectives only its
output depends on (a pipeline's all_gather of the last stage's output; tensor sharding's all_sum after the
last MLP). So each pass here ties every cache layer of this rank to the pass's final-normed hidden state
(mx.depends, as mlx-lm ties a stage's send to its cache): evaluating the cache, the logits or any hidden
state then evaluates all of the pass's collectives, on every rank alike. The engine's own packets depend
on the latest pass (`last_tie`), so they follow its collectives everywhere.
"""

from __future__ import annotations

import mlx.core as mx

from ..target_model.hidden import FINAL_HIDDEN, HiddenRequest
from ..target_model.model import Target


def tie(caches: list, x: mx.array) -> None:
    """Make every layer's cached arrays depend on x."""
    for c in caches:
        keys = getattr(c, "keys", None)
        if isinstance(keys, mx.array):
            c.keys = mx.depends(keys, x)
        elif isinstance(keys, (tuple, list)):  # a quantized KV cache: (codes, scales, biases)
            c.keys = type(keys)(mx.depends(k, x) for k in keys)
        elif isinstance(getattr(c, "cache", None), list):  # recurrent states (ArraysCache)
            c.cache = [mx.depends(a, x) if isinstance(a, mx.array) else a for a in c.cache]


class ShardedTarget(Target):
    last_tie: mx.array | None = None

    def forward(self, tokens: mx.array, cache: list, request: HiddenRequest | bool | None = None):
        if request is True:
            request = FINAL_HIDDEN
        asked = request
        with_final = FINAL_HIDDEN if request is None else HiddenRequest(request.layers, True)
        logits, hidden = super().forward(tokens, cache, with_final)
        width = hidden.shape[-1] // (len(with_final.layers) + 1)
        final = hidden[..., -width:]
        tie(cache, final)
        self.last_tie = final
        if asked is None:
            return logits, None
        return logits, hidden if asked.final else hidden[..., :-width]


def shard_target(target: Target) -> ShardedTarget:
    """The engine's Target, turned into a ShardedTarget in place (its captures and caches unchanged)."""
    target.__class__ = ShardedTarget
    return target
