"""Per-layer model state with checkpoint / rollback. All rollback bookkeeping of the engine goes through here.

A verify pass feeds `n_fed` tokens; the acceptance rule keeps the first `n_keep` of them. Layers whose
mlx-lm cache can be trimmed (KVCache, QuantizedKVCache, a RotatingKVCache that has not wrapped) drop the
tail by offset. Layers that cannot (recurrent ArraysCache of GatedDeltaNet / Mamba, wrapped rotating
windows) are snapshotted before the pass; on rollback EVERY layer returns to the checkpoint and the kept
tokens are handed back to be replayed, which the engine folds into the next forward pass (no extra pass).
"""

from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache


def make_cache(model) -> list:
    return make_prompt_cache(model)


def _trimmable(c, n_new: int) -> bool:
    if isinstance(c, RotatingKVCache):
        return c.offset + n_new < c.max_size  # still a linear buffer after this pass
    return c.is_trimmable()


def _copy(v):
    # Arrays are copied because caches update them in place (slice assignment mutates the Python array).
    if isinstance(v, mx.array):
        return mx.array(v)
    if isinstance(v, list):
        return [_copy(x) for x in v]
    if isinstance(v, tuple):
        return tuple(_copy(x) for x in v)
    return v


def _snapshot(c) -> dict:
    return {name: _copy(value) for name, value in vars(c).items()}


def _restore(c, snap: dict) -> None:
    vars(c).update(snap)


@dataclass
class Checkpoint:
    n_new: int  # tokens the pass about to run will feed
    snapshots: list  # per layer: None (trim by offset) or a snapshot of the layer's fields

    @property
    def exact_trim(self) -> bool:
        return all(s is None for s in self.snapshots)


def checkpoint(caches: list, n_new: int) -> Checkpoint:
    """Call before a pass that feeds `n_new` tokens. Snapshots only the layers that cannot trim."""
    return Checkpoint(n_new, [None if _trimmable(c, n_new) else _snapshot(c) for c in caches])


def rollback(caches: list, ckpt: Checkpoint, n_keep: int) -> int:
    """Keep the first `n_keep` of the `ckpt.n_new` tokens fed since `ckpt`.

    Returns how many of those kept tokens must be fed again (0, or n_keep when some layer had to be
    restored to the checkpoint). The caller replays them before its next tokens.
    """
    n_drop = ckpt.n_new - n_keep
    if n_drop == 0:
        return 0
    if ckpt.exact_trim:
        for c in caches:
            c.trim(n_drop)
        return 0
    for c, snap in zip(caches, ckpt.snapshots):
        if snap is None:
            c.trim(ckpt.n_new)
        else:
            _restore(c, snap)
    return n_keep


def cache_length(caches: list) -> int:
    """Tokens held by the first layer that tracks an offset (for stats and checks)."""
    for c in caches:
        if isinstance(c, (KVCache, RotatingKVCache)) or hasattr(c, "offset"):
            return c.offset
    return 0
