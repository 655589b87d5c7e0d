"""Per-layer model state with checkpoint / rollback. All rollback bookkeeping of the engine goes through here.

A verify pass feeds `n_fed` tokens; the acceptance rule keeps the first `n_keep` of them. Layers whose
mlx-lm cache can be trimmed (KVCache, QuantizedKVCache, a RotatingKVCache that has not wrapped) drop the
tail by offset. Layers that cannot (recurrent ArraysCache of GatedDeltaNet / Mamba, wrapped rotating
windows) are snapshotted before the pass; on rollback EVERY layer returns to the checkpoint and the kept
tokens are handed back to be replayed, which the engine folds into the next forward pass (no extra pass).

Per-token states (mlx_engine.target_model.hybrid.enable_per_token_states): a GatedDeltaNet layer patched to keep its
state after every token of a verify pass (`cache.per_token`) is restorable by index. Its checkpoint is
only references to its current arrays (the layer replaces them, never writes into them: no copy); on
rollback it is set to the state after token n_keep-1 (or back to the checkpoint when n_keep == 0). When
every non-trimmable layer is such a layer, trimmable layers just drop the tail and nothing is replayed.
Any other non-trimmable layer (a wrapped rotating window) keeps the snapshot + replay path for the pass.
"""

from dataclasses import dataclass

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache, make_prompt_cache

KV_BITS = (2, 3, 4, 5, 6, 8)
KV_GROUP_SIZES = (32, 64, 128)


def make_cache(model, kv_bits: int | None = None, kv_group_size: int = 64) -> list:
    """The model's per-layer cache; with kv_bits every plain KVCache layer is mlx-lm's QuantizedKVCache
    (keys and values quantized per token in groups of kv_group_size along the head dimension: a token's
    entries do not depend on the others, so trimming and rewriting stay exact). Recurrent and rotating
    layers stay as they are (mlx-lm cannot quantize those)."""
    return quantized(make_prompt_cache(model), kv_bits, kv_group_size)


def quantized(caches: list, kv_bits: int | None, kv_group_size: int = 64) -> list:
    """Fresh caches with every plain KVCache layer replaced by a QuantizedKVCache (kv_bits None: as they are)."""
    if kv_bits is None:
        return caches
    return [QuantizedKVCache(group_size=kv_group_size, bits=kv_bits) if type(c) is KVCache else c for c in caches]


def check_kv_quantization(kv_bits: int | None, kv_group_size: int) -> None:
    if kv_bits is None:
        return
    if kv_bits not in KV_BITS:
        raise ValueError(f"KV cache bits must be one of {', '.join(map(str, KV_BITS))}, got {kv_bits}")
    if kv_group_size not in KV_GROUP_SIZES:
        raise ValueError(f"KV cache group size must be one of {', '.join(map(str, KV_GROUP_SIZES))}, got {kv_group_size}")


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
class _Refs:
    """Checkpoint of a per-token-capable ArraysCache: its arrays by reference."""

    arrays: list


def _per_token_capable(c) -> bool:
    return hasattr(c, "per_token") and getattr(c, "lengths", None) is None


def _checkpoint_layer(c, n_new: int):
    if _trimmable(c, n_new):
        return None
    if _per_token_capable(c):
        c.per_token = None  # only states written by the coming pass count
        return _Refs(list(c.cache))
    return _snapshot(c)


def _restore_layer(c, snap) -> None:
    if isinstance(snap, _Refs):
        c.cache = list(snap.arrays)
        c.per_token = None
    else:
        _restore(c, snap)


def _release(caches: list) -> None:
    for c in caches:
        if getattr(c, "per_token", None) is not None:
            c.per_token = None  # drop the pass's graph


@dataclass
class Checkpoint:
    n_new: int  # tokens the pass about to run will feed
    snapshots: list  # per layer: None (trim by offset) or a snapshot of the layer's fields

    @property
    def exact_trim(self) -> bool:
        return all(s is None for s in self.snapshots)


def checkpoint(caches: list, n_new: int) -> Checkpoint:
    """Call before a pass that feeds `n_new` tokens. Snapshots only the layers that cannot trim."""
    return Checkpoint(n_new, [_checkpoint_layer(c, n_new) for c in caches])


def rollback(caches: list, ckpt: Checkpoint, n_keep: int) -> int:
    """Keep the first `n_keep` of the `ckpt.n_new` tokens fed since `ckpt`.

    Returns how many of those kept tokens must be fed again (0, or n_keep when some layer had to be
    restored to the checkpoint). The caller replays them before its next tokens.
    """
    n_drop = ckpt.n_new - n_keep
    if n_drop == 0:
        _release(caches)
        return 0
    if ckpt.exact_trim:
        for c in caches:
            c.trim(n_drop)
        return 0
    by_index = all(
        snap is None
        or (isinstance(snap, _Refs) and getattr(c, "per_token", None) is not None and c.per_token.n == ckpt.n_new)
        for c, snap in zip(caches, ckpt.snapshots)
    )
    if by_index:
        for c, snap in zip(caches, ckpt.snapshots):
            if snap is None:
                c.trim(n_drop)
            elif n_keep == 0:
                _restore_layer(c, snap)
            else:
                c.cache[0], c.cache[1] = c.per_token.at(n_keep - 1)
                c.per_token = None
        return 0
    for c, snap in zip(caches, ckpt.snapshots):
        if snap is None:
            c.trim(ckpt.n_new)
        else:
            _restore_layer(c, snap)
    _release(caches)
    return n_keep


def cache_length(caches: list) -> int:
    """Tokens held by the first layer that tracks an offset (for stats and checks)."""
    for c in caches:
        if isinstance(c, (KVCache, RotatingKVCache)) or hasattr(c, "offset"):
            return c.offset
    return 0


def kv_bytes(caches: list) -> int:
    """Bytes of what the caches hold (each layer's `state`: keys and values up to its offset, quantized
    parts, recurrent states)."""
    return sum(a.nbytes for c in caches for _, a in tree_flatten(c.state) if isinstance(a, mx.array))
