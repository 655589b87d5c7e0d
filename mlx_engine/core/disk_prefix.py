"""The prefix tree's disk tier for an engine: the fingerprint of what produces its entries (the target's
weights, the cache's form, the drafter whose state rides along: target_model/fingerprint.py) and the tier in
its folder (target_model/disk_tier.py). One call both engines share."""

from __future__ import annotations

from pathlib import Path

from ..target_model.disk_tier import DiskTier
from ..target_model.fingerprint import fingerprint
from .memory import _modules


def disk_tier_for(model, drafter, kv_bits: int | None, kv_group_size: int, folder: str, budget_bytes: int,
                  checkpoints: bool = False) -> DiskTier:
    dtype = next((str(a.dtype) for _, a in _first_float(model)), "")
    name = getattr(drafter, "name", None) if drafter is not None else None
    fp = fingerprint(model, dtype, kv_bits, kv_group_size, name, tuple(_modules(drafter)) if drafter else ())
    manifest = {"model": type(model).__module__.rsplit(".", 1)[-1], "drafter": name, "kv_bits": kv_bits,
                "kv_group_size": kv_group_size, "dtype": dtype}
    return DiskTier(Path(folder), fp, budget_bytes, checkpoints=checkpoints, manifest=manifest)


def _first_float(model):
    """(name, array) of the model's first floating-point parameter: the dtype its activations take."""
    from mlx.utils import tree_flatten
    import mlx.core as mx

    for name, a in tree_flatten(model.parameters()):
        if mx.issubdtype(a.dtype, mx.floating):
            yield name, a
            return
