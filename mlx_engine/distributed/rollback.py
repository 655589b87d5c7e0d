"""Every rank rolls its own layers back after each verdict (target_model/cache.py), so all must take the same path.

KV layers trim by offset; GatedDeltaNet layers (qwen3_next, qwen3_5) keep per-token states and roll back
by index: neither feeds anything again. A layer that can only snapshot (a sliding window that has wrapped,
a recurrent layer without per-token states) hands its kept tokens back to be replayed in a pass of their
own, which issues the model's collectives. With tensor sharding every rank holds every layer, so all
replay alike. In a pipeline each rank holds other layers: if some ranks may replay and others never do,
the passes would differ, so drafting is refused there (plain decoding never rolls back). At run time
each control packet carries rank 0's replay count and a follower that finds another stops with an error.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, RotatingKVCache

from .group import DistributedError
from .loading import pipeline_stage


def may_replay(caches: list, per_token_layers: int) -> bool:
    """Whether these layers can ever need a replay pass after a rollback."""
    for c in caches:
        if isinstance(c, RotatingKVCache):
            return True
        if isinstance(c, ArraysCache) and per_token_layers > 0:
            continue
        if not c.is_trimmable():
            return True
    return False


def check_rollback_paths(engine, refusal: str | None) -> None:
    """One collective at construction, on every rank: rank 0's drafter refusal (loading.drafter_refusal)
    and each rank's rollback path; every rank raises the same error, or none does."""
    model = engine.target.model  # (Target patched its GatedDeltaNet layers for per-token states)
    per_token = sum(bool(getattr(type(m), "_mlx_engine_per_token", False)) for _, m in model.named_modules())
    mine = int(may_replay(engine.target.make_cache(), per_token))
    leader = [int(refusal is not None), int(engine.drafter is not None)] if engine.leader else [0, 0]
    x = mx.array(leader + [mine], dtype=mx.int32)
    refused, drafting, replaying = mx.distributed.all_sum(x, group=engine.group).tolist()
    if refused:
        raise DistributedError(refusal or "rank 0's drafter cannot run on this sharded target")
    if drafting and pipeline_stage(engine.target.model) is not None and 0 < replaying < engine.size:
        raise DistributedError(
            f"{replaying} of the {engine.size} pipeline stages hold layers that roll back by replaying tokens "
            f"(a sliding window or a recurrent layer without per-token states), the others do not: their passes "
            f"after a rejected draft would differ. Decode this model plainly (--drafter none) or use "
            f"--distributed tensor")
