"""Helpers shared by the family files: MLX-side names of the head, DeepSeek-style layer mapping."""

from __future__ import annotations

import re

import mlx.core as mx
import mlx.nn as nn

from ...models.mtp_tensors import MTPWeightsError

# MLX names of one head layer (MTPLayer): layers.{i}.{enorm,hnorm,eh_proj,norm,head}.weight, layers.{i}.block.*


def text_module(model: nn.Module) -> nn.Module:
    """The module with `.args` of the language model (Qwen3.5 wraps it as language_model)."""
    lm = getattr(model, "language_model", None)
    if isinstance(lm, nn.Module) and hasattr(lm, "args"):
        return lm
    return model


def layer_indices(keys, prefix: str = "layers.") -> list[int]:
    pat = re.compile(rf"^{re.escape(prefix)}(\d+)\.")
    return sorted({int(m.group(1)) for k in keys if (m := pat.match(k))})


def has_moe(keys, i: int) -> bool:
    pre = f"layers.{i}.block.mlp."
    return any(k.startswith(pre + "switch_mlp.") for k in keys)


def add_one(v: mx.array) -> mx.array:
    """Zero-centred norm weight w -> 1 + w, kept in float32: in BF16, 1 + w keeps only 8 bits of w
    (transformers computes x * (1 + w.float()))."""
    return v.astype(mx.float32) + 1.0


def deepseek_style(hf: dict, model: nn.Module, first: int, family: str, zero_centred: bool = False,
                   sub_prefix: str = "") -> dict:
    """Map `model.layers.{first+i}.*` (DeepSeek naming: enorm, hnorm, eh_proj, shared_head.norm,
    shared_head.head / .output, embed_tokens, block tensors) to MLX names.

    The block's tensors are renamed to a target layer index and pushed through the TARGET family's own
    sanitize (expert stacking, MLA kv_b_proj split, renames), then renamed back.
    `sub_prefix`: block tensors sit under e.g. "transformer." (Step-3.5 in some exports).
    """
    args = text_module(model).args
    j = args.num_hidden_layers - 1  # a layer index the target's sanitize processes
    out: dict = {}
    idx = sorted({int(k.split(".")[2]) for k in hf if k.startswith("model.layers.")})
    if not idx:
        raise MTPWeightsError(f"{family}: no MTP head tensors (model.layers.{first}.*) found")
    for i, n in enumerate(idx):
        if n != first + i:
            raise MTPWeightsError(f"{family}: MTP layers must be model.layers.{first}..; found {idx}")
        pre = f"model.layers.{n}."
        block = {}
        for k, v in hf.items():
            if not k.startswith(pre):
                continue
            rest = k[len(pre):]
            if rest in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight"):
                name = {"enorm.weight": "enorm", "hnorm.weight": "hnorm", "shared_head.norm.weight": "norm"}[rest]
                out[f"layers.{i}.{name}.weight"] = add_one(v) if zero_centred else v
            elif rest == "eh_proj.weight":
                out[f"layers.{i}.eh_proj.weight"] = v
            elif rest in ("shared_head.head.weight", "embed_tokens.weight"):
                continue  # copies of the target's lm_head / embedding (tied)
            elif rest == "shared_head.output.weight":
                out[f"layers.{i}.head.weight"] = v
            else:
                if sub_prefix and rest.startswith(sub_prefix):
                    rest = rest[len(sub_prefix):]
                block[f"model.layers.{j}.{rest}"] = v
        try:
            sanitized = type(model).sanitize(model, block) if hasattr(model, "sanitize") else block
        except KeyError as e:  # e.g. one expert of the stack missing: name it as published
            missing = str(e.args[0]).replace(f"model.layers.{j}.", pre, 1) if e.args else "?"
            raise MTPWeightsError(f"{family}: the MTP head lacks {missing}") from None
        bpre = f"model.layers.{j}."
        for k, v in sanitized.items():
            if not k.startswith(bpre):
                raise MTPWeightsError(f"{family}: unexpected tensor {k} after the family's sanitize")
            out[f"layers.{i}.block.{k[len(bpre):]}"] = v
    return out
