"""MTP drafters: the target's own multi-token-prediction head(s), one file per family.

    from mlx_engine.drafters.mtp import load_mtp_drafter
    drafter = load_mtp_drafter(model, model_path, config, mtp_weights=None)

Where the head's weights come from (sources.py): `mtp_weights` (a hub reference `hub:OWNER/NAME`, fetched
once; a safetensors file in HF names or the MLX head file `convert` writes; a GGUF file holding llama.cpp's
nextn tensors, e.g. GLM-4.x; a folder with a checkpoint's head shards), `<model_path>/mtp.safetensors`
(written by `python -m mlx_engine convert`), the HF-layout shards in `model_path`, else a head fetched
before for the model's base model. A head in its published layout is accounted for tensor by tensor
(published.py): a tensor the head does not use is refused by name, a missing one named.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ... import host
from ...models import cast_floats
from ...models.config import text_config
from ...models.hf import dequantize_fp8, fp8_block, quantize_like
from ...models.mtp_tensors import FAMILIES, HEAD_FILE, HEAD_FORMAT, HEAD_JSON, HeadMismatchError, MissingHeadError, \
    MTPWeightsError, UnsupportedFamilyError, family_of
from ..vocab_subset import SUBSET_KEY, check_subset_ids
from . import published, sources
from .drafter import MTPDrafter, MTPHead, MTPLayer

__all__ = [
    "MTPDrafter", "MTPHead", "MTPLayer", "MTPWeightsError", "MissingHeadError", "UnsupportedFamilyError",
    "HeadMismatchError", "SUPPORTED", "family_module", "load_head", "load_mtp_drafter", "head_weights_mlx",
    "HEAD_FILE", "HEAD_FORMAT", "HEAD_JSON",
]

SUPPORTED = FAMILIES  # model_type -> family file (models/mtp_tensors.py owns the table)


def family_module(config: dict, model_path=None):
    """The drafter file of the config's family (how its head is built and its tensors renamed)."""
    return importlib.import_module(f"{__name__}.{family_of(config, model_path)}")


def _float_dtype(model: nn.Module):
    for _, v in tree_flatten(model.parameters()):
        if mx.issubdtype(v.dtype, mx.floating) and v.ndim == 1:  # a norm weight: never quantized
            return v.dtype
    return mx.float32


def head_weights_mlx(model: nn.Module, config: dict, hf_weights: dict) -> dict:
    """HF-named head tensors (as found in the checkpoint) -> the MTPHead's parameter names."""
    fam = family_module(config)
    tc = text_config(config)
    if not hf_weights:
        raise MissingHeadError(f"{config.get('model_type')}: no MTP head weights given")
    unscaled = sorted(k + "_scale_inv" for k, v in hf_weights.items()
                      if v.dtype == mx.uint8 and k + "_scale_inv" not in hf_weights)
    if unscaled:  # FP8 bytes read without their block scales would load as garbage
        raise HeadMismatchError(f"{config.get('model_type')}: FP8 tensors without their block scales: missing "
                                f"{unscaled[:6]}{' ...' if len(unscaled) > 6 else ''}")
    w = dequantize_fp8(hf_weights, fp8_block(config))
    return fam.to_mlx(w, model, tc)


def _check_fit(head: MTPHead, weights: dict, family: str, source: str, name_of=None) -> None:
    """Every parameter filled with the right shape, nothing left over. `name_of(mlx_key)`: the published
    name a missing parameter should have come from (a head read in its HF layout)."""
    want = dict(tree_flatten(head.parameters()))
    missing = sorted(set(want) - set(weights))
    extra = sorted(set(weights) - set(want))
    bad = [f"{k}: file {tuple(weights[k].shape)} vs model {tuple(want[k].shape)}"
           for k in sorted(set(want) & set(weights)) if tuple(want[k].shape) != tuple(weights[k].shape)]
    if missing or extra or bad:
        parts = []
        if missing:
            names = [name_of(k) for k in missing] if name_of else missing
            parts.append(f"missing {names[:6]}{' ...' if len(missing) > 6 else ''}")
        if extra:
            parts.append(f"unexpected {extra[:6]}{' ...' if len(extra) > 6 else ''}")
        if bad:
            parts.append(f"wrong shapes {bad[:6]}{' ...' if len(bad) > 6 else ''}")
        raise HeadMismatchError(f"{family}: the MTP head in {source} does not fit the target: " + "; ".join(parts))


def _fill(head: MTPHead, weights: dict, quant: dict | None, family: str, source: str, model: nn.Module, dtype,
          name_of=None) -> None:
    """Quantize the head like its file, check the weights fit, load them, cast floats to `dtype`
    ("auto": the target's float dtype)."""
    if quant:
        quantize_like(head, weights, quant["bits"], quant["group_size"], quant.get("mode", "affine"))
    _check_fit(head, weights, family, source, name_of)
    head.load_weights(list(weights.items()))
    if dtype == "auto":
        dtype = _float_dtype(model)
    if dtype is not None:
        cast_floats(head, dtype)


def _load_trained(model: nn.Module, config: dict, path: Path, dtype) -> MTPHead:
    """A head trained by train-mtp for a target without MTP: block of the target's family, optional
    reduced draft vocabulary (`vocab_subset`)."""
    from . import trained

    try:
        weights, meta = mx.load(str(path), return_metadata=True)
    except Exception as e:
        raise MTPWeightsError(f"cannot read MTP weights file {path}: {e}") from e
    want = meta.get("target")
    if want and want != config.get("model_type"):
        raise HeadMismatchError(f"{path} holds a head trained for {want} but the target is {config.get('model_type')}")
    subset = weights.pop(SUBSET_KEY, None)
    head = trained.build(model, text_config(config))
    q = json.loads(meta["quantization"]) if meta.get("quantization") else None
    _fill(head, weights, q, "trained", str(path), model, dtype)
    if subset is not None:
        try:
            subset = check_subset_ids(subset, int(text_config(config).get("vocab_size", 0) or 0), path)
        except ValueError as e:
            raise HeadMismatchError(str(e)) from None
        head.set_vocab_subset(subset)
    head.eval()
    host.wait(head.parameters())
    return head


def load_head(model: nn.Module, model_path, config: dict, mtp_weights=None, dtype="auto") -> MTPHead:
    """Build the family's head and load its weights (see the module docstring for where from)."""
    mtp_weights = sources.resolve(mtp_weights, model_path, config)
    if mtp_weights is not None:
        sources.check_head_file(Path(mtp_weights))
    elif model_path is not None and Path(model_path).is_file():  # a GGUF: no folder to find a head in,
        from ...models.default import matching_head  # but a head shipped here may match it

        mtp_weights = matching_head(model_path, config)
    trained_file = sources.trained_head_file(model_path, mtp_weights)
    if trained_file is not None:
        return _load_trained(model, config, trained_file, dtype)
    if mtp_weights is not None and config.get("model_type") not in SUPPORTED:
        raise HeadMismatchError(
            f"{mtp_weights} does not fit this {config.get('model_type')} model: a family without native MTP "
            f"heads takes only a head trained by `python -m mlx_engine train-mtp` (metadata family=trained)")
    fam = family_module(config, model_path)
    family, group = config.get("model_type"), family_of(config)
    tc = text_config(config)
    src = sources.read_source(model_path, config, mtp_weights,
                              dtype if isinstance(dtype, mx.Dtype) else _float_dtype(model))
    weights, name_of = src.weights, None
    if src.layout == "hf":
        weights = head_weights_mlx(model, config, weights)
    head = fam.build(model, tc, set(weights))
    if not head.layers:
        raise MissingHeadError(f"{family}: no MTP layers found in {src.where}")
    if src.layout == "hf":
        mlx_keys = [k for k, _ in tree_flatten(head.parameters())]
        published.check_consumed(group, mlx_keys, src.hf_keys, config, tc, src.where)
        name_of = lambda k: published.first_name(group, k, tc)  # noqa: E731
    _fill(head, weights, src.quant, family, src.where, model, dtype, name_of)
    head.eval()
    host.wait(head.parameters())  # load time, not the loop
    return head


def load_mtp_drafter(model: nn.Module, model_path, config: dict, mtp_weights=None, dtype="auto",
                     prefill_step: int = 2048) -> MTPDrafter:
    """The MTP drafter of `model` (an mlx-lm model; config = its config.json dict)."""
    return MTPDrafter(load_head(model, model_path, config, mtp_weights, dtype), model, prefill_step)
