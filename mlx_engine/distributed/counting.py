"""Collectives counted as they are put into the graph, by kind.

mlx-lm's sharded models call `mx.distributed.all_sum` / `send` / `recv_like` / `all_gather` by attribute
each time a pass is built, so wrapping those attributes counts every collective the model issues per pass
on this rank (the model's own) beside the engine's (the decision, the plain tokens, the first token, the
jobs and stop flags of the server, named by `engine()` around its own calls). Counting is per process and
costs a dict increment per collective; `snapshot()` / `since()` give the counts of a stretch of work.
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager

import mlx.core as mx

COLLECTIVES = ("all_sum", "all_gather", "all_max", "all_min", "sum_scatter", "send", "recv", "recv_like")

counts: Counter = Counter()  # "model" (the model's own), and the engine's kinds: "decision", "token", ...
_engine_kind: list[str] = []  # the kind of the engine call in progress (empty: the model's)


def _wrap(name: str, fn):
    def counted(*args, **kwargs):
        counts[_engine_kind[-1] if _engine_kind else "model"] += 1
        return fn(*args, **kwargs)

    counted.__wrapped__ = fn
    counted.__name__ = name
    return counted


def install() -> None:
    """Wrap MLX's collectives once per process (idempotent)."""
    for name in COLLECTIVES:
        fn = getattr(mx.distributed, name, None)
        if fn is not None and not hasattr(fn, "__wrapped__"):
            setattr(mx.distributed, name, _wrap(name, fn))


@contextmanager
def engine(kind: str):
    """Collectives issued inside are the engine's own, of this kind."""
    _engine_kind.append(kind)
    try:
        yield
    finally:
        _engine_kind.pop()


def snapshot() -> Counter:
    return Counter(counts)


def since(before: Counter) -> dict[str, int]:
    """Counts issued after `before` (a snapshot), by kind."""
    return {k: v - before.get(k, 0) for k, v in counts.items() if v - before.get(k, 0)}
