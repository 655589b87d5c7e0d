"""MiMo-7B: model.mtp_layers.{i}.{token_layernorm, hidden_layernorm, input_proj [H, 2H], input_layernorm,
self_attn.*, post_attention_layernorm, mlp.*, final_layernorm}. Concat order [hidden, embedding]."""

from __future__ import annotations

import mlx.nn as nn

from ...models.mtp_tensors import MIMO_PREFIX as PREFIX, MTPWeightsError
from .common import layer_indices, text_module
from .drafter import MTPHead, MTPLayer

FAMILY = "mimo"

_TOP = {"token_layernorm.weight": "enorm", "hidden_layernorm.weight": "hnorm",
        "input_proj.weight": "eh_proj", "final_layernorm.weight": "norm"}



def to_mlx(hf: dict, model: nn.Module, tc: dict) -> dict:
    out = {}
    for k, v in hf.items():
        rest = k[len(PREFIX):]
        i, _, name = rest.partition(".")
        if not i.isdigit():
            raise MTPWeightsError(f"{FAMILY}: unexpected MTP tensor {k}")
        if name in _TOP:
            out[f"layers.{i}.{_TOP[name]}.weight"] = v
        elif "rotary_emb.inv_freq" in name:
            continue
        else:
            out[f"layers.{i}.block.{name}"] = v
    return out


def build(model: nn.Module, tc: dict, keys) -> MTPHead:
    from mlx_lm.models.mimo import TransformerBlock

    args = text_module(model).args
    layers = [MTPLayer(args.hidden_size, args.rms_norm_eps, TransformerBlock(args), "he")
              for _ in layer_indices(keys)]
    return MTPHead(FAMILY, layers)
