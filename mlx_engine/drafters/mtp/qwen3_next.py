"""Qwen3-Next: same head layout as Qwen3.5 (mtp.fc, mtp.pre_fc_norm_*, mtp.norm, mtp.layers.0.*),
usually with a sparse-MoE block (per-expert HF tensors). Zero-centred norms: 1 + w."""

from __future__ import annotations

import mlx.nn as nn

from ...models.mtp_tensors import MTPWeightsError
from .common import has_moe, text_module
from .drafter import MTPHead, MTPLayer
from .qwen3_5 import qwen_to_mlx

FAMILY = "qwen3_next"



def to_mlx(hf: dict, model: nn.Module, tc: dict) -> dict:
    return qwen_to_mlx(hf, tc, FAMILY)


def build(model: nn.Module, tc: dict, keys) -> MTPHead:
    from mlx_lm.models import qwen3_next as q

    args = text_module(model).args
    block = q.Qwen3NextDecoderLayer(args, args.full_attention_interval - 1)
    if has_moe(keys, 0):
        if not args.num_experts:
            raise MTPWeightsError(f"{FAMILY}: the head has experts but the config has num_experts=0")
        block.mlp = q.Qwen3NextSparseMoeBlock(args)
    else:
        block.mlp = q.Qwen3NextMLP(args.hidden_size, args.intermediate_size)
    return MTPHead(FAMILY, [MTPLayer(args.hidden_size, args.rms_norm_eps, block, "eh")])
