"""HF layout -> MLX folder that KEEPS the MTP head (mlx-lm's converter drops it).

    convert(hf_path, mlx_path, quantize=False, q_bits=4, q_group_size=64, mtp_bits=8)

Writes the target exactly as mlx-lm would (model*.safetensors, config.json, tokenizer files; quantized
with q_bits / q_group_size when asked) plus `mtp.safetensors`: the head in MLX names (zero-centred norms
already shifted, experts stacked, FP8 dequantised), quantized to `mtp_bits` when the target is quantized
(None / 0 keeps it float: 4-bit heads collapse acceptance), with its metadata (family, quantization)
inside the file and repeated in `mtp.json`. `load_mtp_drafter` finds it next to the model.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from .drafters.mtp import HEAD_FILE, HEAD_FORMAT, HEAD_JSON, MissingHeadError, family_module, head_weights_mlx
from .drafters.mtp import _check_fit  # noqa: F401  (same checks as at load time)
from .models.config import text_config
from .models.hf import load_model
from .models.mtp_tensors import head_predicate


def _write_head(model, config: dict, hf_head: dict, out: Path, bits: int | None, group_size: int) -> dict:
    import mlx.nn as nn

    fam = family_module(config)
    weights = head_weights_mlx(model, config, hf_head)
    head = fam.build(model, text_config(config), set(weights))
    _check_fit(head, weights, config.get("model_type"), "the checkpoint")
    head.load_weights(list(weights.items()))
    quant = None
    if bits:
        nn.quantize(head, group_size=group_size, bits=bits,
                    class_predicate=lambda p, m: hasattr(m, "to_quantized") and not isinstance(m, nn.Embedding)
                    and m.weight.shape[-1] % group_size == 0)
        quant = {"bits": bits, "group_size": group_size, "mode": "affine"}
    arrays = dict(tree_flatten(head.parameters()))
    meta = {"format": HEAD_FORMAT, "family": config.get("model_type"), "num_layers": len(head.layers),
            "quantization": json.dumps(quant) if quant else ""}
    mx.save_safetensors(str(out / HEAD_FILE), arrays, metadata={k: str(v) for k, v in meta.items()})
    info = {**meta, "quantization": quant, "layout": "mlx (MTPHead parameter names)",
            "tensors": len(arrays)}
    (out / HEAD_JSON).write_text(json.dumps(info, indent=2))
    return info


def convert(hf_path, mlx_path, quantize: bool = False, q_bits: int = 4, q_group_size: int = 64,
            mtp_bits: int | None = 8, dtype: str | None = None, require_head: bool = True) -> Path:
    """Convert an HF-layout folder to MLX, keeping the MTP head as mtp.safetensors. Returns mlx_path.

    require_head: raise MissingHeadError when the family has a known head but the checkpoint holds
    none (set False to convert such a model anyway, without mtp.safetensors).
    """
    from mlx_lm.utils import load_tokenizer, quantize_model, save

    hf_path, mlx_path = Path(hf_path), Path(mlx_path)
    if mlx_path.exists():
        raise ValueError(f"cannot convert into {mlx_path}: it already exists")
    if not (hf_path / "config.json").exists():
        raise ValueError(f"{hf_path} has no config.json: not a model folder")
    model, config, hf_head = load_model(hf_path, lazy=True)
    has_family = head_predicate(config) is not None
    if require_head and has_family and not hf_head:
        raise MissingHeadError(f"{config.get('model_type')}: {hf_path} holds no MTP head weights to keep")
    tokenizer = load_tokenizer(hf_path, eos_token_ids=config.get("eos_token_id"))
    qc = config.get("quantization_config") or {}
    if qc.get("quant_method") == "fp8":  # the family's sanitize dequantised the target; so do we the head
        config.pop("quantization_config", None)
        if isinstance(config.get("text_config"), dict):
            config["text_config"].pop("quantization_config", None)
    if dtype is not None:
        from mlx.utils import tree_map_with_path

        dt = getattr(mx, dtype)
        cast_pred = getattr(model, "cast_predicate", lambda _: True)
        model.update(tree_map_with_path(
            lambda k, v: v.astype(dt) if cast_pred(k) and mx.issubdtype(v.dtype, mx.floating) else v,
            model.parameters()))
    # the head first: its mapping may call the family's sanitize, which expects the float model
    mlx_path.mkdir(parents=True)
    try:
        if hf_head:
            _write_head(model, config, hf_head, mlx_path, mtp_bits if quantize else None, q_group_size)
        if quantize:
            model, config = quantize_model(model, config, q_group_size, q_bits)
        save(mlx_path, hf_path, model, tokenizer, config, donate_model=False)
    except Exception:
        shutil.rmtree(mlx_path, ignore_errors=True)
        raise
    return mlx_path
