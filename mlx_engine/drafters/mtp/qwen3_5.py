"""Qwen3.5 / 3.6 (dense and MoE): mtp.fc, mtp.pre_fc_norm_{embedding,hidden}, mtp.norm, mtp.layers.0.*.

Block: qwen3_5.DecoderLayer at a full-attention index (gated attention, q/k norm, partial RoPE), dense MLP
or the sparse MoE block. EVERY head norm is zero-centred: stored w, computed 1 + w (mtp-heads.md §4).
"""

from __future__ import annotations

import mlx.nn as nn

from ...models.hf import stack_experts
from ...models.mtp_tensors import QWEN_PREFIXES as PREFIXES, MTPWeightsError
from .common import add_one, has_moe, layer_indices, text_module
from .drafter import MTPHead, MTPLayer

FAMILY = "qwen3_5"



def _strip(k: str) -> str:
    for p in PREFIXES:
        if k.startswith(p):
            return k[len(p):]
    return k


def qwen_to_mlx(hf: dict, tc: dict, family: str) -> dict:
    w = {_strip(k): v for k, v in hf.items()}
    layers = layer_indices(w)
    if layers and layers != [0]:
        raise MTPWeightsError(f"{family}: only one MTP layer is supported, found mtp.layers.{layers}")
    out = {}
    top = {"fc.weight": "eh_proj", "pre_fc_norm_embedding.weight": "enorm",
           "pre_fc_norm_hidden.weight": "hnorm", "norm.weight": "norm"}
    for k, v in w.items():
        if k in top:
            out[f"layers.0.{top[k]}.weight"] = v if top[k] == "eh_proj" else add_one(v)
        elif k.startswith("layers.0."):
            rest = k[len("layers.0."):]
            if v.ndim == 1 and rest.endswith(("layernorm.weight", "q_norm.weight", "k_norm.weight")):
                v = add_one(v)
            out[f"layers.0.block.{rest}"] = v
        elif k in ("embed_tokens.weight", "lm_head.weight"):
            continue
        else:
            raise MTPWeightsError(f"{family}: unexpected MTP tensor mtp.{k}")
    try:
        return stack_experts(out, "layers.0.block.mlp", int(tc.get("num_experts", 0) or 0))
    except KeyError as e:  # one expert of the stack missing: name it as published
        missing = str(e.args[0]).replace("layers.0.block.", "mtp.layers.0.", 1) if e.args else "?"
        raise MTPWeightsError(f"{family}: the MTP head lacks {missing}") from None


def to_mlx(hf: dict, model: nn.Module, tc: dict) -> dict:
    return qwen_to_mlx(hf, tc, FAMILY)


def build(model: nn.Module, tc: dict, keys) -> MTPHead:
    from mlx_lm.models import qwen3_5 as q

    args = text_module(model).args
    block = q.DecoderLayer(args, args.full_attention_interval - 1)
    if has_moe(keys, 0):
        if not args.num_experts:
            raise MTPWeightsError(f"{FAMILY}: the head has experts but the config has num_experts=0")
        block.mlp = q.SparseMoeBlock(args)
    else:
        block.mlp = q.MLP(args.hidden_size, args.intermediate_size)
    return MTPHead(FAMILY, [MTPLayer(args.hidden_size, args.rms_norm_eps, block, "eh")])
