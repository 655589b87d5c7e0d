"""MTP drafters: the target's own multi-token-prediction head(s), one file per family.

    from mlx_engine.drafters.mtp import load_mtp_drafter
    drafter = load_mtp_drafter(model, model_path, config, mtp_weights=None)

Where the head's weights come from, in order: `mtp_weights` (a safetensors file: HF names, or the MLX
head file `convert` writes; or a GGUF file holding llama.cpp's nextn tensors, e.g. GLM-4.x),
`<model_path>/mtp.safetensors` (written by `python -m mlx_engine convert`), else the HF-layout shards in
`model_path`.
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
from ...models.hf import dequantize_fp8, fp8_block, quantize_like, read_weights
from ...models.mtp_tensors import FAMILIES, HEAD_FILE, MTPWeightsError, UnsupportedFamilyError, family_of, \
    head_key_predicate
from ..vocab_subset import SUBSET_KEY, check_subset_ids
from .drafter import MTPDrafter, MTPHead, MTPLayer

__all__ = [
    "MTPDrafter", "MTPHead", "MTPLayer", "MTPWeightsError", "MissingHeadError", "UnsupportedFamilyError",
    "HeadMismatchError", "SUPPORTED", "family_module", "load_head", "load_mtp_drafter", "head_weights_mlx",
    "HEAD_FILE", "HEAD_FORMAT", "HEAD_JSON",
]

HEAD_JSON = "mtp.json"
HEAD_FORMAT = "mlx-engine-mtp-v1"


class MissingHeadError(MTPWeightsError):
    """The checkpoint holds no MTP head weights."""


class HeadMismatchError(MTPWeightsError):
    """The head's tensors do not fit the target (missing, unexpected or wrongly shaped)."""


SUPPORTED = FAMILIES  # model_type -> family file (models/mtp_tensors.py owns the table)


def family_module(config: dict, model_path=None):
    """The drafter file of the config's family (how its head is built and its tensors renamed)."""
    return importlib.import_module(f"{__name__}.{family_of(config, model_path)}")


def _check_head_file(path: Path) -> None:
    """A head file given by the user: it must exist and be complete (named in the error, never blamed on
    the model's family)."""
    from ...models.hf import check_complete

    if not path.is_file():
        raise MissingHeadError(f"MTP weights file {path} does not exist")
    if not _is_gguf(path):
        try:
            check_complete(path)
        except ValueError as e:
            raise MTPWeightsError(f"cannot read MTP weights file: {e}") from None


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
    w = dequantize_fp8(hf_weights, fp8_block(config))
    return fam.to_mlx(w, model, tc)


def _is_gguf(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


# GGUF general.architecture -> the model_types whose MTP head it can hold
_GGUF_ARCHS = {"glm4moe": {"glm4_moe"}}


def _read_gguf_head(path: Path, config: dict, dtype) -> dict:
    """HF-named head tensors of a GGUF file with llama.cpp's nextn (MTP) layers, dequantized to `dtype`."""
    from ...models.gguf import read_gguf, read_gguf_mtp_tensors

    family = config.get("model_type")
    try:
        g = read_gguf(path)
        weights = read_gguf_mtp_tensors(g, dtype, skip_copies=True)
    except Exception as e:
        raise MTPWeightsError(f"cannot read MTP weights file {path}: {e}") from e
    if g.arch in _GGUF_ARCHS and family not in _GGUF_ARCHS[g.arch]:
        raise HeadMismatchError(f"{path} is a GGUF of architecture {g.arch} but the target is {family}")
    if not weights:
        raise MissingHeadError(
            f"{family}: {path} holds no MTP (nextn) tensors: --mtp-weights takes a GGUF only with llama.cpp's "
            f"nextn layer (blk.N.nextn.*, N >= the target's layer count)"
        )
    unknown = sorted(k for k in weights if k.startswith("blk."))
    if unknown:
        raise HeadMismatchError(f"{family}: {path} has MTP layer tensors with no known equivalent: {unknown[:6]}")
    return weights


def _read_head_file(path: Path, config: dict, gguf_dtype=mx.float32):
    """(weights, layout "mlx"|"hf", quantization dict|None) of a separate head file.

    A GGUF file is read as HF-named tensors, dequantized to `gguf_dtype`."""
    if _is_gguf(path):
        return _read_gguf_head(path, config, gguf_dtype), "hf", None
    try:
        weights, meta = mx.load(str(path), return_metadata=True)
    except Exception as e:
        raise MTPWeightsError(f"cannot read MTP weights file {path}: {e}") from e
    meta = meta or {}
    if meta.get("format") == HEAD_FORMAT or all(k.startswith("layers.") for k in weights):
        fam = meta.get("family")
        if fam and SUPPORTED.get(config.get("model_type")) != SUPPORTED.get(fam, fam):
            raise HeadMismatchError(
                f"{path} holds a {fam} MTP head but the target is {config.get('model_type')}"
            )
        q = json.loads(meta["quantization"]) if meta.get("quantization") else None
        return weights, "mlx", q
    return weights, "hf", None


def _check_fit(head: MTPHead, weights: dict, family: str, source: str) -> None:
    want = dict(tree_flatten(head.parameters()))
    missing = sorted(set(want) - set(weights))
    extra = sorted(set(weights) - set(want))
    bad = [f"{k}: file {tuple(weights[k].shape)} vs model {tuple(want[k].shape)}"
           for k in sorted(set(want) & set(weights)) if tuple(want[k].shape) != tuple(weights[k].shape)]
    if missing or extra or bad:
        parts = []
        if missing:
            parts.append(f"missing {missing[:6]}{' ...' if len(missing) > 6 else ''}")
        if extra:
            parts.append(f"unexpected {extra[:6]}{' ...' if len(extra) > 6 else ''}")
        if bad:
            parts.append(f"wrong shapes {bad[:6]}{' ...' if len(bad) > 6 else ''}")
        raise HeadMismatchError(f"{family}: the MTP head in {source} does not fit the target: " + "; ".join(parts))


def _trained_head_file(model_path, mtp_weights) -> Path | None:
    """The head file if it holds a head trained here (metadata family "trained"), else None."""
    from .trained import is_trained

    if mtp_weights is not None:
        path = Path(mtp_weights)
    elif model_path is not None:
        path = Path(model_path) / HEAD_FILE
        try:  # mtp.json next to the model says so without opening the weights
            if json.loads((Path(model_path) / HEAD_JSON).read_text()).get("family") == "trained":
                return path if path.is_file() else None
        except (OSError, ValueError):
            pass
    else:
        return None
    if not path.is_file() or _is_gguf(path):  # a GGUF head is never one trained here
        return None
    try:
        _, meta = mx.load(str(path), return_metadata=True)
    except Exception as e:
        raise MTPWeightsError(f"cannot read MTP weights file {path}: {e}") from e
    return path if is_trained(meta) else None


def _fill(head: MTPHead, weights: dict, quant: dict | None, family: str, source: str, model: nn.Module, dtype) -> None:
    """Quantize the head like its file, check the weights fit, load them, cast floats to `dtype`
    ("auto": the target's float dtype)."""
    if quant:
        quantize_like(head, weights, quant["bits"], quant["group_size"], quant.get("mode", "affine"))
    _check_fit(head, weights, family, source)
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
    if mtp_weights is not None:
        _check_head_file(Path(mtp_weights))
    elif model_path is not None and Path(model_path).is_file():  # a GGUF: no folder to find a head in,
        from ...models.default import matching_head  # but a head shipped here may match it

        mtp_weights = matching_head(model_path, config)
    trained_file = _trained_head_file(model_path, mtp_weights)
    if trained_file is not None:
        return _load_trained(model, config, trained_file, dtype)
    if mtp_weights is not None and config.get("model_type") not in SUPPORTED:
        raise HeadMismatchError(
            f"{mtp_weights} does not fit this {config.get('model_type')} model: a family without native MTP "
            f"heads takes only a head trained by `python -m mlx_engine train-mtp` (metadata family=trained)")
    fam = family_module(config, model_path)
    family = config.get("model_type")
    tc = text_config(config)
    quant = None
    if mtp_weights is not None:
        path = Path(mtp_weights)
        if not path.is_file():
            raise MissingHeadError(f"{family}: MTP weights file {path} does not exist")
        gguf_dtype = dtype if isinstance(dtype, mx.Dtype) else _float_dtype(model)
        weights, layout, quant = _read_head_file(path, config, gguf_dtype)
        if layout == "hf":
            pred = head_key_predicate(config)
            weights = {k: v for k, v in weights.items() if pred(k)}
            if not weights:
                raise MissingHeadError(f"{family}: {path} holds no MTP head tensors of this family")
        source = str(path)
    else:
        folder = Path(model_path) if model_path is not None else None
        if folder is not None and (folder / HEAD_FILE).is_file():
            weights, layout, quant = _read_head_file(folder / HEAD_FILE, config)
            source = str(folder / HEAD_FILE)
        else:
            weights = read_weights(folder, head_key_predicate(config)) if folder is not None else {}
            layout, source = "hf", str(folder)
            if not weights:
                raise MissingHeadError(
                    f"{family}: {folder} has no MTP head weights (no {HEAD_FILE}, no head tensors in the "
                    f"safetensors shards; MLX community conversions strip them). Load the original HF "
                    f"checkpoint or pass --mtp-weights PATH"
                )
    if layout == "hf":
        weights = head_weights_mlx(model, config, weights)
    head = fam.build(model, tc, set(weights))
    if not head.layers:
        raise MissingHeadError(f"{family}: no MTP layers found in {source}")
    _fill(head, weights, quant, family, source, model, dtype)
    head.eval()
    host.wait(head.parameters())  # load time, not the loop
    return head


def load_mtp_drafter(model: nn.Module, model_path, config: dict, mtp_weights=None, dtype="auto",
                     prefill_step: int = 2048) -> MTPDrafter:
    """The MTP drafter of `model` (an mlx-lm model; config = its config.json dict)."""
    return MTPDrafter(load_head(model, model_path, config, mtp_weights, dtype), model, prefill_step)
