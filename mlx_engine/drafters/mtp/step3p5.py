"""Step-3.5 (step3p5): num_nextn_predict_layers = 3 heads at model.layers.{N..N+2}, each with enorm,
hnorm, eh_proj, shared_head.norm, shared_head.output (its own output projection), and a block whose
tensors may sit under a `.transformer.` sub-prefix. All norms zero-centred (1 + w). Blocks follow the
per-layer config entries N+i (layer_types / partial_rotary_factors / swiglu limits): usually a dense MLP
and sliding attention. Drafting uses the 3 layers round-robin (step % 3).

[unverified] vLLM feeds the un-normed target hidden; the engine hands every drafter the final-normed
one, which is what is used here.
"""

from __future__ import annotations

import mlx.nn as nn

from ...models.mtp_tensors import MTPWeightsError
from .common import add_one, layer_indices, text_module
from .drafter import MTPHead, MTPLayer

FAMILY = "step3p5"
_REMAP = [
    (".moe.gate_proj.", ".mlp.switch_mlp.gate_proj."),
    (".moe.up_proj.", ".mlp.switch_mlp.up_proj."),
    (".moe.down_proj.", ".mlp.switch_mlp.down_proj."),
    (".moe.gate.", ".mlp.gate.gate."),
    (".moe.router_bias", ".mlp.gate.router_bias"),
    (".share_expert.", ".mlp.share_expert."),
]



def to_mlx(hf: dict, model: nn.Module, tc: dict) -> dict:
    n = int(tc["num_hidden_layers"])
    idx = sorted({int(k.split(".")[2]) for k in hf if k.startswith("model.layers.")})
    if not idx or idx != list(range(n, n + len(idx))):
        raise MTPWeightsError(f"{FAMILY}: MTP layers must be model.layers.{n}.. ; found {idx}")
    out = {}
    top = {"enorm.weight": "enorm", "hnorm.weight": "hnorm", "shared_head.norm.weight": "norm"}
    for k, v in hf.items():
        parts = k.split(".")
        i = int(parts[2]) - n
        rest = ".".join(parts[3:])
        if rest in top:
            out[f"layers.{i}.{top[rest]}.weight"] = add_one(v)
        elif rest == "eh_proj.weight":
            out[f"layers.{i}.eh_proj.weight"] = v
        elif rest in ("shared_head.output.weight", "shared_head.head.weight"):
            out[f"layers.{i}.head.weight"] = v
        elif rest == "embed_tokens.weight":
            continue
        else:
            if rest.startswith("transformer."):
                rest = rest[len("transformer."):]
            rest = "." + rest
            for src, dst in _REMAP:
                if src in rest:
                    rest = rest.replace(src, dst)
                    break
            rest = rest[1:]
            if rest.endswith(".weight") and "norm" in rest:
                v = add_one(v)
            out[f"layers.{i}.block.{rest}"] = v
    return out


def build(model: nn.Module, tc: dict, keys) -> MTPHead:
    from mlx_lm.models.step3p5 import Step3p5DecoderLayer

    args = text_module(model).args
    n = args.num_hidden_layers
    layers, windows = [], []
    for i in layer_indices(keys):
        try:
            block = Step3p5DecoderLayer(args, n + i)
        except IndexError as e:
            raise MTPWeightsError(
                f"{FAMILY}: the config's per-layer lists (layer_types, ...) have no entry for MTP layer {n + i}"
            ) from e
        own = args.vocab_size if f"layers.{i}.head.weight" in keys else 0
        layers.append(MTPLayer(args.hidden_size, args.rms_norm_eps, block, "eh", own_head=own))
        windows.append(args.sliding_window if block.is_sliding else None)
    return MTPHead(FAMILY, layers, windows)
