"""Hugging Face layout safetensors: shards, FP8 block dequantisation, and the MTP head's tensors.

mlx-lm's loaders drop the MTP weights in `sanitize` (and deepseek_v3's hard-codes `model.layers.61`, so
a checkpoint whose head sits elsewhere does not load at all). Here:

- `read_weights(folder)` reads every shard (via model.safetensors.index.json when present);
- `dequantize_fp8(weights, block)` turns `weight` + `weight_scale_inv` (128x128 blocks) into floats;
- `split_head(weights, config)` separates the head's tensors from the target's;
- `load_model(folder)` is mlx-lm's `load_model` with the head's tensors filtered out BEFORE the family's
  sanitize, so every family's target loads; it also returns the head tensors it set aside.
"""

from __future__ import annotations

import glob
import json
import re
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from .config import text_config
from .mtp_tensors import head_predicate

FP8_BLOCK = 128




def weight_files(folder: Path) -> list[Path]:
    """Shards of an HF-layout folder: those named in model.safetensors.index.json, else model*.safetensors."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / n for n in names]
    return [Path(p) for p in sorted(glob.glob(str(folder / "model*.safetensors")))]


def check_complete(path) -> None:
    """Refuse a truncated or corrupt safetensors file, naming it (MLX's own reader names the tensor, not
    the file): the header's tensor offsets must fit in the file."""
    path = Path(path)
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if size < 8 or n <= 0 or 8 + n > size:
                raise ValueError("its header is cut off")
            header = json.loads(f.read(n))
        need = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        raise ValueError(f"{path} is not a readable safetensors file ({e}): truncated or corrupt?") from None
    if 8 + n + need > size:
        raise ValueError(f"{path} is truncated: its tensors need {8 + n + need} bytes, the file has {size} "
                         f"(an incomplete download or copy?)")


def read_weights(folder: Path, keep=None) -> dict[str, mx.array]:
    """All tensors of the shards (lazily loaded); `keep(name)` selects some."""
    out: dict[str, mx.array] = {}
    for f in weight_files(folder):
        for k, v in mx.load(str(f)).items():
            if keep is None or keep(k):
                out[k] = v
    return out


def read_head_shards(folder: Path, keep) -> dict[str, mx.array]:
    """The tensors `keep(name)` selects, read only from the shards that hold them (the index says which):
    a folder may hold just those shards of a checkpoint. A shard the index names but the folder lacks, or
    a truncated one, is named in the error."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if not index.exists():
        return read_weights(folder, keep)
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{index} is not a readable index ({e})") from None
    shards = sorted({f for k, f in weight_map.items() if keep(k)})
    absent = [f for f in shards if not (folder / f).is_file()]
    if absent:
        raise ValueError(f"{folder} lacks the shard(s) holding the MTP head: {', '.join(absent)}")
    out: dict[str, mx.array] = {}
    for f in shards:
        check_complete(folder / f)
        out.update({k: v for k, v in mx.load(str(folder / f)).items() if keep(k)})
    return out


def fp8_block(config: dict) -> tuple[int, int]:
    qc = config.get("quantization_config") or text_config(config).get("quantization_config") or {}
    bs = qc.get("weight_block_size") or [FP8_BLOCK, FP8_BLOCK]
    return int(bs[0]), int(bs[1])


def dequantize_fp8_tensor(weight: mx.array, scale_inv: mx.array, block=(FP8_BLOCK, FP8_BLOCK),
                          dtype=mx.float32) -> mx.array:
    """weight: fp8 e4m3 bytes [m, n] (uint8); scale_inv: [ceil(m/b0), ceil(n/b1)] -> dtype [m, n]."""
    b0, b1 = block
    w = mx.from_fp8(weight, dtype=mx.float32) if weight.dtype == mx.uint8 else weight.astype(mx.float32)
    m, n = w.shape
    pm, pn = (-m) % b0, (-n) % b1
    w = mx.pad(w, ((0, pm), (0, pn))).reshape((m + pm) // b0, b0, (n + pn) // b1, b1)
    w = w * scale_inv.astype(mx.float32)[:, None, :, None]
    return w.reshape(m + pm, n + pn)[:m, :n].astype(dtype)


def dequantize_fp8(weights: dict, block=(FP8_BLOCK, FP8_BLOCK), dtype=mx.float32) -> dict:
    """Replace every `X.weight` that has an `X.weight_scale_inv` by its dequantised value."""
    out = {}
    for k, v in weights.items():
        if k.endswith(".weight_scale_inv"):
            continue
        sk = k + "_scale_inv" if k.endswith(".weight") else None
        if sk is not None and sk in weights:
            out[k] = dequantize_fp8_tensor(v, weights[sk], block, dtype)
        else:
            out[k] = v
    return out


def stack_experts(weights: dict, prefix: str, n_experts: int, dst: str = "switch_mlp") -> dict:
    """Per-expert `{prefix}.experts.{e}.{proj}.{weight|scales|biases}` -> `{prefix}.{dst}.{proj}.*` [E, ...].

    Also splits a fused `{prefix}.experts.gate_up_proj` [E, 2I, H] (+ `experts.down_proj`) (Qwen3.5 MoE).
    """
    w = dict(weights)
    for proj in ("gate_proj", "up_proj", "down_proj"):
        for suffix in ("weight", "scales", "biases"):
            first = f"{prefix}.experts.0.{proj}.{suffix}"
            if first in w:
                parts = [w.pop(f"{prefix}.experts.{e}.{proj}.{suffix}") for e in range(n_experts)]
                w[f"{prefix}.{dst}.{proj}.{suffix}"] = mx.stack(parts)
    fused = f"{prefix}.experts.gate_up_proj"
    if fused in w:
        gu = w.pop(fused)
        mid = gu.shape[-2] // 2
        w[f"{prefix}.{dst}.gate_proj.weight"] = gu[..., :mid, :]
        w[f"{prefix}.{dst}.up_proj.weight"] = gu[..., mid:, :]
        w[f"{prefix}.{dst}.down_proj.weight"] = w.pop(f"{prefix}.experts.down_proj")
    return w


def load_model(folder: Path, lazy: bool = False, strict: bool = True):
    """mlx-lm's load_model for any folder, with the MTP head's tensors set aside before sanitize.

    Returns (model, config, head_weights) -- head_weights in HF names (empty for an MLX folder or a
    model without heads). Drop-in for `mlx_lm.utils.load_model` in mlx_engine.models.load.
    """
    from mlx_lm.utils import _get_classes
    from mlx_lm.utils import load_model as _load_model

    folder = Path(folder)
    stash: dict = {}
    orig: dict = {}

    def get_classes(config):
        model_cls, args_cls = _get_classes(config)
        pred = head_predicate(config)
        fp8 = ((config.get("quantization_config") or {}).get("quant_method") == "fp8"
               or (text_config(config).get("quantization_config") or {}).get("quant_method") == "fp8")
        if pred is None and not fp8:
            return model_cls, args_cls
        orig["cls"] = model_cls

        def sanitize(self, weights):
            kept = {}
            for k, v in weights.items():
                (stash if pred is not None and pred(k) else kept)[k] = v
            kept = _published_forms(kept, config)
            if hasattr(model_cls, "sanitize"):
                return model_cls.sanitize(self, kept)
            return kept

        return type(model_cls.__name__, (model_cls,), {"sanitize": sanitize}), args_cls

    model, config = _load_model(folder, lazy=lazy, strict=strict, get_model_classes=get_classes)
    if "cls" in orig:
        model.__class__ = orig["cls"]
    return model, config, stash


_PER_EXPERT = re.compile(r"^(.*\.mlp)\.experts\.0\.gate_proj\.weight$")
_STACKED_HERE = {"qwen3_5_moe"}  # families whose mlx-lm sanitize reads only fused experts


def _published_forms(weights: dict, config: dict) -> dict:
    """The target's tensors in storage forms mlx-lm's sanitize does not read for every family: FP8 with
    block scales (dequantised here to bf16, for any family), and per-expert experts of a family whose
    sanitize takes only fused ones (Qwen3.5/3.6 MoE FP8 releases)."""
    if any(k.endswith(".weight_scale_inv") for k in weights):
        weights = dequantize_fp8(weights, fp8_block(config), dtype=mx.bfloat16)
    if config.get("model_type") in _STACKED_HERE:
        n = int(text_config(config).get("num_experts") or 0)
        for k in [k for k in weights if _PER_EXPERT.match(k)]:
            weights = stack_experts(weights, _PER_EXPERT.match(k).group(1), n)
    return weights


def quantize_like(module: nn.Module, weights: dict, bits: int, group_size: int, mode: str = "affine") -> None:
    """Quantize the layers of `module` that have `.scales` in `weights` (loading a quantized head)."""

    def pred(path, m):
        return hasattr(m, "to_quantized") and f"{path}.scales" in weights

    nn.quantize(module, group_size=group_size, bits=bits, mode=mode, class_predicate=pred)
