"""GLM-4.5 / 4.6 / 4.7 (glm4_moe): DeepSeek naming at model.layers.{num_hidden_layers}; block =
glm4_moe.DecoderLayer (GQA with qkv bias, optional qk-norm, partial RoPE, sigmoid MoE + shared expert)."""

from __future__ import annotations

import mlx.nn as nn

from .common import deepseek_style, layer_indices, text_module
from .drafter import MTPHead, MTPLayer

FAMILY = "glm4_moe"


def to_mlx(hf: dict, model: nn.Module, tc: dict) -> dict:
    return deepseek_style(hf, model, int(tc["num_hidden_layers"]), FAMILY)


def build(model: nn.Module, tc: dict, keys) -> MTPHead:
    from mlx_lm.models.glm4_moe import DecoderLayer

    args = text_module(model).args
    n = args.num_hidden_layers
    layers = [MTPLayer(args.hidden_size, args.rms_norm_eps, DecoderLayer(args, n + i), "eh")
              for i in layer_indices(keys)]
    return MTPHead(FAMILY, layers)
