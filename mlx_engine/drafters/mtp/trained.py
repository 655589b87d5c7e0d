"""A DeepSeek-style MTP head TRAINED here (`python -m mlx_engine train-mtp`) for a model that ships none.

Layout (MTPLayer, mtp-heads.md §0): enorm, hnorm, eh_proj [H, 2H], ONE decoder block of the target's own
family (built from the class of the target's last layer, e.g. mlx_lm.models.llama.TransformerBlock), output
norm. Embedding and lm_head are the target's (shared, frozen). Order [e, h]; h is the target's final-normed
hidden state.

The head file (MLX layout, format mlx-engine-mtp-v1) says it is trained in its metadata
(`family = "trained"`, `target = <model_type>`) and may carry `vocab_subset` (int32 token ids): the drafter
then scores h' only against those rows of the target's output matrix and puts -inf elsewhere (lossless: the
target still verifies with its full vocabulary; a draft probability of 0 outside the subset is exact for
rejection sampling).
"""

from __future__ import annotations

import mlx.nn as nn

from ...models.mtp_tensors import MTPWeightsError
from .common import text_module
from .drafter import MTPHead, MTPLayer

FAMILY = "trained"


def is_trained(meta: dict | None) -> bool:
    return bool(meta) and meta.get("family") == FAMILY


def _inner(model: nn.Module) -> nn.Module:
    tm = text_module(model)
    inner = getattr(tm, "model", None)
    if inner is None or not hasattr(inner, "layers"):
        raise MTPWeightsError(f"trained head: cannot find the decoder layers of {type(model).__name__}")
    return inner


def make_block(model: nn.Module) -> nn.Module:
    """A fresh decoder block of the target's family (same class and shapes as its last layer)."""
    args = text_module(model).args
    last = _inner(model).layers[-1]
    cls = type(last)
    n = len(_inner(model).layers)
    for make in (lambda: cls(args), lambda: cls(args, n - 1), lambda: cls(args, layer_idx=n - 1)):
        try:
            return make()
        except TypeError:
            continue
    raise MTPWeightsError(f"trained head: cannot build a {cls.__name__} block for {args.model_type}")


def build(model: nn.Module, tc: dict | None = None, keys=None) -> MTPHead:
    args = text_module(model).args
    eps = float(getattr(args, "rms_norm_eps", None) or getattr(args, "layer_norm_epsilon", 1e-6))
    return MTPHead(FAMILY, [MTPLayer(args.hidden_size, eps, make_block(model), "eh")])
