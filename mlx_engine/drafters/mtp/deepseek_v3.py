"""DeepSeek-V3 / V3.1: head at model.layers.{num_hidden_layers + i}: enorm, hnorm, eh_proj [H, 2H],
shared_head.norm, (shared_head.head, embed_tokens: copies of the target's, unused); block = a full
MLA + MoE DeepseekV3DecoderLayer. FP8 tensors are dequantised (weight_scale_inv) before mapping."""

from __future__ import annotations

import mlx.nn as nn

from .common import deepseek_style, layer_indices, text_module
from .drafter import MTPHead, MTPLayer

FAMILY = "deepseek_v3"



def to_mlx(hf: dict, model: nn.Module, tc: dict) -> dict:
    return deepseek_style(hf, model, int(tc["num_hidden_layers"]), FAMILY)


def build(model: nn.Module, tc: dict, keys) -> MTPHead:
    from mlx_lm.models.deepseek_v3 import DeepseekV3DecoderLayer

    args = text_module(model).args
    n = args.num_hidden_layers
    layers = [
        MTPLayer(args.hidden_size, args.rms_norm_eps, DeepseekV3DecoderLayer(args, n + i), "eh")
        for i in layer_indices(keys)
    ]
    return MTPHead(FAMILY, layers)
