"""Where an MTP head's weights come from.

    resolve(mtp_weights, model_path) -> a local path (hub references fetched) or None
    read_source(model, model_path, config, mtp_weights, dtype) -> Source (weights, layout, ...)

`mtp_weights`, in the forms the CLI, the chat, the server and the bench all take:
- `hub:OWNER/NAME[@REV]`, or a bare `OWNER/NAME` that is no local path: the head of that repository, only
  the shards holding it downloaded, the head kept in the cache (models/hub.py); `hub` alone: the same for
  the model the target was converted from (`base_model` in its README.md or config.json);
- a safetensors file: HF names (a shard of the original checkpoint, or a head taken from one), or the MLX
  head file `convert` / `train-mtp` write; a GGUF file with llama.cpp's nextn tensors (GLM-4.x);
- a folder: an original checkpoint's index and at least the shards that hold the head.
Without it: `<model_path>/mtp.safetensors`, the head tensors in the model's own shards, else a head already
fetched for the model's base model. When the head is nowhere the error says where it looked and, for a
conversion that names its base model, which flag fetches the head.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx

from ...models.hf import check_complete, read_head_shards
from ...models.hub import HubError, HubRef, base_model_of, check_same_model, fetch_head, head_dir, hub_ref
from ...models.mtp_tensors import HEAD_FILE, HEAD_FORMAT, HEAD_JSON, FAMILIES, HeadMismatchError, \
    MissingHeadError, MTPWeightsError, head_key_predicate


@dataclass
class Source:
    weights: dict
    layout: str  # "hf": published names; "mlx": the MTPHead's own names
    quant: dict | None
    where: str
    hf_keys: set = field(default_factory=set)


def resolve(mtp_weights, model_path, config: dict | None = None):
    """A hub reference fetched into the cache (its local file); anything else as given. With the target's
    `config`, a repository of another model is refused before its shards are fetched."""
    try:
        ref = hub_ref(mtp_weights)
        if ref is None:
            return mtp_weights
        if ref.repo is None:
            base = base_model_of(model_path) if model_path is not None and Path(model_path).is_dir() else None
            if base is None:
                raise MissingHeadError(
                    f"--mtp-weights hub: {model_path} names no base model (no base_model in its README.md or "
                    "config.json); name the repository that holds the head: --mtp-weights hub:OWNER/NAME")
            ref = HubRef(base)
        return fetch_head(ref, config)
    except HubError as e:
        raise MTPWeightsError(str(e)) from None


def is_gguf(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def check_head_file(path: Path) -> None:
    """A head file given by the user: it must exist and be complete (named in the error, never blamed on
    the model's family)."""
    if path.is_dir():
        return
    if not path.is_file():
        raise MissingHeadError(f"MTP weights file {path} does not exist")
    if not is_gguf(path):
        try:
            check_complete(path)
        except ValueError as e:
            raise MTPWeightsError(f"cannot read MTP weights file: {e}") from None


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


def _check_source(meta: dict, config: dict, path: Path) -> None:
    """A head taken from a hub repository (models/hub.py) must come from a model shaped like the target."""
    try:
        src = json.loads(meta.get("source_config") or "{}")
    except ValueError:
        return
    check_same_model(src, config, f"{meta.get('source', 'another model')} ({path})")


def read_head_file(path: Path, config: dict, gguf_dtype=mx.float32):
    """(weights, layout "mlx"|"hf", quantization dict|None) of a separate head file.

    A GGUF file is read as HF-named tensors, dequantized to `gguf_dtype`."""
    if is_gguf(path):
        return _read_gguf_head(path, config, gguf_dtype), "hf", None
    try:
        weights, meta = mx.load(str(path), return_metadata=True)
    except Exception as e:
        raise MTPWeightsError(f"cannot read MTP weights file {path}: {e}") from e
    meta = meta or {}
    if meta.get("format") == HEAD_FORMAT or all(k.startswith("layers.") for k in weights):
        fam = meta.get("family")
        if fam and FAMILIES.get(config.get("model_type")) != FAMILIES.get(fam, fam):
            raise HeadMismatchError(
                f"{path} holds a {fam} MTP head but the target is {config.get('model_type')}"
            )
        q = json.loads(meta["quantization"]) if meta.get("quantization") else None
        return weights, "mlx", q
    _check_source(meta, config, path)
    return weights, "hf", None


def trained_head_file(model_path, mtp_weights) -> Path | None:
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
    if not path.is_file() or is_gguf(path):  # a GGUF head is never one trained here
        return None
    try:
        _, meta = mx.load(str(path), return_metadata=True)
    except Exception as e:
        raise MTPWeightsError(f"cannot read MTP weights file {path}: {e}") from e
    return path if is_trained(meta) else None


def _from_folder(folder: Path, config: dict, family: str) -> dict:
    try:
        return read_head_shards(folder, head_key_predicate(config))
    except ValueError as e:
        raise MTPWeightsError(f"{family}: {e}") from None


def _no_head(folder: Path | None, family: str) -> MissingHeadError:
    base = base_model_of(folder) if folder is not None and folder.is_dir() else None
    hint = (f"It was converted from {base}: add --mtp-weights hub:{base} (downloads only the shards that hold "
            "the head)" if base else "Load the original HF checkpoint or pass --mtp-weights PATH|hub:OWNER/NAME")
    return MissingHeadError(
        f"{family}: {folder} has no MTP head weights (no {HEAD_FILE}, no head tensors in the safetensors "
        f"shards; MLX community conversions strip them). {hint}")


def read_source(model_path, config: dict, mtp_weights, gguf_dtype) -> Source:
    """The head's tensors from `mtp_weights` (already resolved), else from beside the model."""
    family = config.get("model_type")
    if mtp_weights is not None:
        path = Path(mtp_weights)
        if path.is_dir():
            weights = _from_folder(path, config, family)
            if not weights:
                raise MissingHeadError(f"{family}: {path} holds no MTP head tensors of this family")
            return Source(weights, "hf", None, str(path), set(weights))
        if not path.is_file():
            raise MissingHeadError(f"{family}: MTP weights file {path} does not exist")
        weights, layout, quant = read_head_file(path, config, gguf_dtype)
        if layout == "hf":
            pred = head_key_predicate(config)
            weights = {k: v for k, v in weights.items() if pred(k)}
            if not weights:
                raise MissingHeadError(f"{family}: {path} holds no MTP head tensors of this family")
        return Source(weights, layout, quant, str(path), set(weights) if layout == "hf" else set())
    folder = Path(model_path) if model_path is not None else None
    if folder is not None and (folder / HEAD_FILE).is_file():
        weights, layout, quant = read_head_file(folder / HEAD_FILE, config)
        return Source(weights, layout, quant, str(folder / HEAD_FILE), set(weights) if layout == "hf" else set())
    weights = _from_folder(folder, config, family) if folder is not None else {}
    if weights:
        return Source(weights, "hf", None, str(folder), set(weights))
    base = base_model_of(folder) if folder is not None and folder.is_dir() else None
    cached = head_dir(HubRef(base)) / HEAD_FILE if base else None
    if cached is not None and cached.is_file():  # fetched before with --mtp-weights hub:BASE
        weights, layout, quant = read_head_file(cached, config, gguf_dtype)
        weights = {k: v for k, v in weights.items() if head_key_predicate(config)(k)} if layout == "hf" else weights
        return Source(weights, layout, quant, str(cached), set(weights) if layout == "hf" else set())
    raise _no_head(folder, family)
