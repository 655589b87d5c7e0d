"""Which batch cache holds a layer of a batch, from the layer's single-sequence mlx-lm cache: the one table
the batch engine reads (as mlx-lm's caches carry their own merge / filter / extract).

    KVCache                  BatchKVCache                   entries per token: sliced, copied, trimmed
    QuantizedKVCache         QuantizedBatchKVCache          the same, each entry quantized
    RotatingKVCache          BatchKVCache(window=W)         a sliding window: every entry kept, each query
                                                            attends its last W keys (sequence_attention.py)
    ArraysCache (GDN)        BatchRecurrentCache            one state per row (batch_recurrent.py)
    CacheList                BatchCacheList                 a batch cache of each part (batch_list.py)

A layer is *positional* when its row state is a run of per-token entries (a prefix of it is the state of a
prefix of the tokens: the prefix tree slices it, another row's prefix can be copied); a recurrent layer is
not (the prefix tree keeps checkpoints of it instead, target_model/prefix_cache.py).

`why_not(cache, model)` says why a model cannot be batched, or None.
"""

from __future__ import annotations

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, QuantizedKVCache, RotatingKVCache

from .batch_cache import BatchKVCache, QuantizedBatchKVCache
from .batch_list import BatchCacheList
from .batch_recurrent import BatchRecurrentCache


def batch_layer(c):
    """An empty batch cache for the layer whose single-sequence cache is `c`."""
    if type(c) is KVCache:
        return BatchKVCache()
    if type(c) is QuantizedKVCache:
        return QuantizedBatchKVCache(c.group_size, c.bits)
    if type(c) is RotatingKVCache:
        return BatchKVCache(window=c.max_size)
    if type(c) is ArraysCache:
        return BatchRecurrentCache(len(c.cache))
    if type(c) is CacheList:
        return BatchCacheList(*(batch_layer(part) for part in c.caches))
    raise ValueError(f"no batch cache for {type(c).__name__}")


def _recurrent_layers(model) -> int:
    """GatedDeltaNet layers patched to run the rows of a batch (target_model/hybrid.py)."""
    return sum(getattr(type(m), "_mlx_engine_per_token", False) for _, m in model.named_modules())


def why_not(cache: list, model) -> str | None:
    """None when every layer of this single-sequence cache has a batch cache, else why not."""
    arrays = 0
    cache = [part for c in cache for part in (c.caches if type(c) is CacheList else (c,))]
    for c in cache:
        if type(c) is RotatingKVCache and c.keep:
            return f"its sliding-window layers keep {c.keep} first tokens (attention sinks), which are not batched"
        if type(c) is ArraysCache:
            arrays += 1
        elif type(c) not in (KVCache, QuantizedKVCache, RotatingKVCache):
            return f"its cache has {type(c).__name__} layers, which are not batched"
    if arrays and arrays != _recurrent_layers(model):
        return ("its recurrent layers are not GatedDeltaNet ones (only qwen3_next / qwen3_5's are batched: "
                "their rows stop at their own tokens and roll back on their own)")
    return None


KIND_NAMES = {KVCache: "kv", QuantizedKVCache: "quantized kv", RotatingKVCache: "sliding window",
              ArraysCache: "recurrent", CacheList: "cache list"}


def count(cache: list) -> dict[str, int]:
    """Layers of each kind in a single-sequence cache ({"kv": 12, "recurrent": 36})."""
    out: dict[str, int] = {}
    for c in cache:
        name = KIND_NAMES.get(type(c), type(c).__name__)
        out[name] = out.get(name, 0) + 1
    return out


def positional(c) -> bool:
    """Whether a layer's row state is per-token entries (a single cache `c` or a batch cache)."""
    if isinstance(c, (CacheList, BatchCacheList)):
        return all(positional(part) for part in c.caches)
    return not isinstance(c, (ArraysCache, BatchRecurrentCache))


def windowed(cache: list) -> bool:
    return any(type(c) is RotatingKVCache or (type(c) is CacheList and windowed(c.caches)) for c in cache)


def single_cache(target) -> list:
    """A single-sequence cache whose every positional layer keeps all its entries (a sliding window's a plain
    KVCache: the batch row keeps them all), for a batch's first chunk fed alone."""
    def whole(c):
        if type(c) is CacheList:
            return CacheList(*(whole(part) for part in c.caches))
        return KVCache() if type(c) is RotatingKVCache else c

    return [whole(c) for c in target.make_cache()]


def row_state(c, n: int):
    """The state a batch row takes from single cache `c` holding n positions: (keys, values) of them
    (quantized: parts), or a recurrent layer's arrays ([1, ...] each; zeros for n == 0)."""
    if isinstance(c, ArraysCache):
        return tuple(mx.zeros_like(a) if n == 0 else a for a in c.cache)
    if isinstance(c, CacheList):
        return tuple(row_state(part, n) for part in c.caches)
    return tree_map(lambda a: a[..., :n, :], (c.keys, c.values))


def join(bc, state, capacity: int, n: int) -> bool:
    """Row `state` (n positions) appended to batch cache bc. -> whether the other rows were copied."""
    if isinstance(bc, BatchRecurrentCache):
        return bc.add_row(state, capacity, n)
    if isinstance(bc, BatchCacheList):
        copied = [join(part, st, capacity, n) for part, st in zip(bc.caches, state)]
        return any(copied)
    return bc.add_row(*state, capacity)


def prefix(bc, i: int, n: int):
    """Row i's state of its first n positions: KV entries sliced; a recurrent state only at its own length."""
    if isinstance(bc, BatchRecurrentCache):
        if n != bc.lens[i]:
            raise ValueError(f"a recurrent row holds its state after {bc.lens[i]} positions, not {n}")
        return bc.row(i)
    if isinstance(bc, BatchCacheList):
        return tuple(prefix(part, i, n) for part in bc.caches)
    return tree_map(lambda a: a[:, :, :n], bc.row(i))


def empty_row(bc):
    """The state of a row holding nothing, shaped like bc's rows."""
    if isinstance(bc, BatchRecurrentCache):
        return bc.empty_row()
    if isinstance(bc, BatchCacheList):
        return tuple(empty_row(part) for part in bc.caches)
    return tree_map(lambda a: mx.zeros((1, a.shape[1], 0, a.shape[3]), a.dtype), bc.row(0))
