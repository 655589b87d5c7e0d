"""The prefix tree's disk tier for an engine: the fingerprint of what produces its entries (the target's
weights, the cache's form, the drafter whose state rides along: target_model/fingerprint.py) and the tier in
its folder (target_model/disk_tier.py). One call both engines share."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ..target_model.disk_tier import DiskTier
from ..target_model.fingerprint import fingerprint
from .memory import _modules


def disk_tier_for(model, drafter, kv_bits: int | None, kv_group_size: int, folder: str, budget_bytes: int | None,
                  checkpoints: bool = False) -> DiskTier:
    """The disk tier for this model and drafter under `folder` (budget None: default_budget)."""
    budget_bytes = default_budget(folder, budget_bytes)
    dtype = next((str(a.dtype) for _, a in _first_float(model)), "")
    name = getattr(drafter, "name", None) if drafter is not None else None
    fp = fingerprint(model, dtype, kv_bits, kv_group_size, name, tuple(_modules(drafter)) if drafter else ())
    manifest = {"model": type(model).__module__.rsplit(".", 1)[-1], "drafter": name, "kv_bits": kv_bits,
                "kv_group_size": kv_group_size, "dtype": dtype}
    return DiskTier(Path(folder), fp, budget_bytes, checkpoints=checkpoints, manifest=manifest)


DEFAULT_DISK_BYTES = 16 << 30


def default_folder() -> Path:
    """Where the disk tier lives unless told: MLX_ENGINE_CACHE_DIR, else the user's cache folder."""
    if os.environ.get("MLX_ENGINE_CACHE_DIR"):
        return Path(os.environ["MLX_ENGINE_CACHE_DIR"]).expanduser()
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser()
    return base / "mlx-engine" / "prefix-cache"


def default_budget(folder: str | Path, asked: int | None) -> int:
    """The disk tier's byte budget: what was asked, else DEFAULT_DISK_BYTES but at most a quarter of the free
    space on the folder's disk now (a new user's disk is not filled by a cache they did not ask for)."""
    if asked is not None:
        return asked
    probe = Path(folder)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        free = shutil.disk_usage(probe).free
    except OSError:
        return DEFAULT_DISK_BYTES
    return min(DEFAULT_DISK_BYTES, free // 4)


def _first_float(model):
    """(name, array) of the model's first floating-point parameter: the dtype its activations take."""
    from mlx.utils import tree_flatten
    import mlx.core as mx

    for name, a in tree_flatten(model.parameters()):
        if mx.issubdtype(a.dtype, mx.floating):
            yield name, a
            return
