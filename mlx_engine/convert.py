"""`convert`: a model to an MLX folder that KEEPS its MTP head (mlx-lm's converter drops it).

    convert(src, mlx_path, quantize=False, q_bits=4, q_group_size=64, mtp_bits=None, mtp_from=None)
    add_head(mlx_path, mtp_from, mtp_bits=None)   # a head for an existing MLX conversion

`src` is a Hugging Face layout folder, an MLX folder (the embedded default's included) or a hub id. The
target is written as mlx-lm writes it (model*.safetensors, config.json, tokenizer files;
quantized with q_bits / q_group_size when asked); the head, wherever load_head finds it (the HF shards
named in the index, FP8 dequantised, experts stacked, zero-centred norms shifted; an mtp.safetensors beside
the model, trained here or converted before; `mtp_from`: another checkpoint, file or `hub:OWNER/NAME`), is
written as `mtp.safetensors` in MLX names with its metadata (family, quantization, a trained head's target
and draft vocabulary) inside the file and repeated in `mtp.json`. The head is quantized to `mtp_bits`
(default: 8 when the target is quantized, float otherwise; 0 keeps it float: 4-bit heads lose acceptance).
A source named by a hub id is written down as the copy's `base_model` (README.md), where `--mtp-weights hub`
finds it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .drafters.mtp import HEAD_FILE, HEAD_FORMAT, HEAD_JSON, MissingHeadError, UnsupportedFamilyError, load_head
from .drafters.vocab_subset import SUBSET_KEY
from .models.hf import check_complete, weight_files
from .models.mtp_tensors import FAMILIES

BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)


class ConvertError(ValueError):
    """Bad input to convert, found before any work (reported as one `error:` line, exit status 2)."""


def _writable(path: Path) -> bool:
    p = path
    while not p.exists():
        p = p.parent
    return p.is_dir() and os.access(p, os.W_OK)


def _config(folder: Path) -> dict:
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except FileNotFoundError:
        raise ConvertError(f"{folder} has no config.json: not a model folder") from None
    except (OSError, ValueError) as e:
        raise ConvertError(f"{folder}/config.json is not readable JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ConvertError(f"{folder}/config.json is not a JSON object")
    return cfg


def check_source(src: Path, quantize: bool) -> dict:
    """A local source folder that can be converted: its config, checked before any work."""
    if src.is_file():
        raise ConvertError(f"{src} is a file: convert takes a model folder or hub id (a .gguf loads as it is: "
                           "--model FILE.gguf; the embedded default converts from its folder: omit --hf-path)")
    cfg = _config(src)
    from mlx_lm.utils import _get_classes

    try:
        _get_classes(cfg)
    except ValueError as e:
        raise ConvertError(f"{src}: {e}") from None
    files = weight_files(src)
    if not files:
        raise ConvertError(f"{src} holds no model*.safetensors weights")
    for f in files:
        if not f.is_file():
            raise ConvertError(f"{src} lacks {f.name} (named in its model.safetensors.index.json)")
        try:
            check_complete(f)
        except ValueError as e:
            raise ConvertError(str(e)) from None
    if quantize and cfg.get("quantization"):
        raise ConvertError(f"{src} is already quantized ({cfg['quantization'].get('bits')}-bit): "
                           "convert it without -q, or from the original checkpoint")
    return cfg


def check_options(mlx_path: Path, q_bits: int, q_group_size: int, mtp_bits: int | None, new: bool = True) -> None:
    if q_bits not in BITS:
        raise ConvertError(f"--q-bits must be one of {', '.join(map(str, BITS))}, got {q_bits}")
    if q_group_size not in GROUP_SIZES:
        raise ConvertError(f"--q-group-size must be one of {', '.join(map(str, GROUP_SIZES))}, got {q_group_size}")
    if mtp_bits is not None and mtp_bits not in (0, *BITS):
        raise ConvertError(f"--mtp-bits must be 0 (float) or one of {', '.join(map(str, BITS))}, got {mtp_bits}")
    if new and mlx_path.exists():
        raise ConvertError(f"cannot convert into {mlx_path}: it already exists")
    if not _writable(mlx_path):
        raise ConvertError(f"cannot write {mlx_path}: its folder is not writable")


def _quantization(head) -> dict | None:
    for _, m in head.named_modules():
        if isinstance(m, nn.QuantizedLinear):
            return {"bits": m.bits, "group_size": m.group_size, "mode": getattr(m, "mode", "affine")}
    return None


def write_head(head, config: dict, out: Path, bits: int | None, group_size: int) -> dict:
    """Write `head` (any MTPHead, native or trained) as OUT/mtp.safetensors + mtp.json, quantized to `bits`."""
    quant = _quantization(head)  # a head quantized in its file keeps its quantization
    if bits and quant is None:
        nn.quantize(head, group_size=group_size, bits=bits,
                    class_predicate=lambda p, m: hasattr(m, "to_quantized") and not isinstance(m, nn.Embedding)
                    and m.weight.shape[-1] % group_size == 0)
        quant = {"bits": bits, "group_size": group_size, "mode": "affine"}
    arrays = dict(tree_flatten(head.parameters()))
    trained = head.family == "trained"
    meta = {"format": HEAD_FORMAT, "family": "trained" if trained else config.get("model_type"),
            "num_layers": len(head.layers), "quantization": json.dumps(quant) if quant else ""}
    if trained:
        meta["target"] = config.get("model_type")
    if head.vocab_subset is not None:
        arrays[SUBSET_KEY] = head.vocab_subset
        meta["vocab_subset"] = int(head.vocab_subset.shape[0])
    mx.save_safetensors(str(out / HEAD_FILE), arrays, metadata={k: str(v) for k, v in meta.items()})
    info = {**meta, "quantization": quant, "layout": "mlx (MTPHead parameter names)", "tensors": len(arrays)}
    (out / HEAD_JSON).write_text(json.dumps(info, indent=2))
    return info


def find_head(model, src: Path, config: dict, mtp_from, require: bool):
    """The head to keep (load_head's search, or `mtp_from`), or None for a model that has none to keep."""
    try:
        return load_head(model, src, config, mtp_weights=mtp_from, dtype="auto")
    except UnsupportedFamilyError:
        if mtp_from is not None:
            raise
        return None  # a llama, gemma, ... with no head beside it: nothing to keep
    except MissingHeadError:
        if mtp_from is not None:
            raise
        if require and config.get("model_type") in FAMILIES:
            raise MissingHeadError(
                f"{config.get('model_type')}: {src} holds no MTP head weights to keep (MLX conversions strip them): "
                "take the head from the original checkpoint with --mtp-from REPO_OR_PATH (hub:OWNER/NAME fetches "
                "only the shards that hold it), or convert without one: --allow-missing-head") from None
        return None


def _write_card(out: Path, base: str | None) -> None:
    tags = "library_name: mlx\npipeline_tag: text-generation\ntags:\n- mlx\n- mtp\n"
    (out / "README.md").write_text(f"---\n{f'base_model: {base}' + chr(10) if base else ''}{tags}---\n")


def _load(src: Path):
    """(model, tokenizer, config) of a model folder, lazily, in the checkpoint's dtypes."""
    from mlx_lm.utils import load_tokenizer

    from .models.hf import load_model

    model, config, _ = load_model(src, lazy=True)
    return model, load_tokenizer(src, eos_token_ids=config.get("eos_token_id")), config


def convert(src, mlx_path, quantize: bool = False, q_bits: int = 4, q_group_size: int = 64,
            mtp_bits: int | None = None, dtype: str | None = None, require_head: bool = True, mtp_from=None,
            base_model: str | None = None) -> Path:
    """Convert `src` (a local model folder) to MLX at `mlx_path`, keeping its MTP head. Returns mlx_path.

    require_head: raise MissingHeadError when the family has a native head but neither the checkpoint nor
    `mtp_from` holds one (False: convert it anyway, without mtp.safetensors)."""
    from mlx_lm.utils import quantize_model, save_config, save_model

    src, mlx_path = Path(src), Path(mlx_path)
    check_options(mlx_path, q_bits, q_group_size, mtp_bits)
    check_source(src, quantize)
    model, tokenizer, config = _load(src)
    qc = config.get("quantization_config") or {}
    if qc.get("quant_method") == "fp8":  # dequantised on load (target and head alike)
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
    head = find_head(model, src, config, mtp_from, require_head)
    bits = (8 if quantize else 0) if mtp_bits is None else mtp_bits
    mlx_path.mkdir(parents=True)
    try:
        if head is not None:
            write_head(head, config, mlx_path, bits or None, q_group_size)
        if quantize:
            model, config = quantize_model(model, config, q_group_size, q_bits)
        save_model(mlx_path, model, donate_model=False)
        save_config(config, mlx_path / "config.json")
        tokenizer.save_pretrained(str(mlx_path))
        if (src / "generation_config.json").is_file():
            shutil.copy(src / "generation_config.json", mlx_path / "generation_config.json")
        _write_card(mlx_path, base_model)
    except BaseException:  # an error or Ctrl-C: no half-written model left behind
        shutil.rmtree(mlx_path, ignore_errors=True)
        raise
    return mlx_path


def add_head(mlx_path, mtp_from, mtp_bits: int | None = None, q_group_size: int | None = None) -> dict:
    """Write the head of `mtp_from` (a checkpoint folder, head file or hub reference) into an existing MLX
    folder, quantized like the target unless `mtp_bits` says otherwise. Returns the head's description."""
    from .models.hf import load_model

    mlx_path = Path(mlx_path)
    if not mlx_path.is_dir():
        raise ConvertError(f"--mlx-path {mlx_path} is not a model folder (with --mtp-from and no --hf-path, "
                           "convert adds a head to an existing MLX conversion)")
    config = _config(mlx_path)
    if (mlx_path / HEAD_FILE).exists():
        raise ConvertError(f"{mlx_path} already has an MTP head ({HEAD_FILE}); remove it to replace it")
    q = config.get("quantization") or {}
    check_options(mlx_path / HEAD_FILE, q.get("bits", 4), q_group_size or q.get("group_size", 64), mtp_bits, new=False)
    model, config, _ = load_model(mlx_path, lazy=True)
    head = load_head(model, mlx_path, config, mtp_weights=mtp_from, dtype="auto")
    bits = (8 if q else 0) if mtp_bits is None else mtp_bits
    try:
        return write_head(head, config, mlx_path, bits or None, q_group_size or q.get("group_size", 64))
    except BaseException:
        for f in (HEAD_FILE, HEAD_JSON):
            (mlx_path / f).unlink(missing_ok=True)
        raise


__all__ = ["convert", "add_head", "check_source", "check_options", "write_head", "ConvertError"]
