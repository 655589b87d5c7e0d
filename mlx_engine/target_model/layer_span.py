"""A batch row that crosses only some decoder layers in a pass: how a prompt token too costly for one step
crosses the model over several steps, its hidden state carried from one to the next.

Deep in a long prompt one token's attention alone can outweigh a whole decoding step (on a 2-core CPU, a
135M model: ~100 ms at 8k keys against a 79 ms step), so even a one-token chunk stalls the streams
decoding beside it. Split by layers instead: in a pass with a span (row r, layers [start, end), n tokens)

  * layer `start` takes row r's first n input positions from `carried` (start 0: the row's own embedded
    tokens, nothing carried),
  * layer end - 1's output of row r (its first n positions) is captured for the next step,
  * in every other layer row r is idle: its attention is skipped (batch_sequences.idle_rows), and the
    entries it writes there are garbage the caller trims (a BatchKVCache keeps lengths per layer, so the
    row may hold n more positions in layers < end than in layers >= end between steps),
  * the outputs of the layers in `keep` (inner layers a drafter reads: EAGLE-3, DFlash) are written to
    `kept` in the pass that crosses them: the caller joins them once the last layer is crossed.

What row r computes inside [start, end) is what it would in a pass over all layers: the same input, the
same keys. Its matmul rows still run in every layer (one more row of a batched pass, not a pass of its
own: the weights are read once for everyone), except in a layer where no row computes (a prompt fed alone,
crossing the others' layers): that layer is skipped, so a chunk sized for a whole second crosses the
model in steps of a fraction of it, the first layers' weights not read again for the last ones.

`install(layers)` swaps each decoder layer's class for a subclass that does the above while `crossing`
is active (parameters and names untouched; outside `crossing` it calls the layer as it is).
"""

from __future__ import annotations

import contextvars
from contextlib import contextmanager
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from .batch_sequences import idle, idle_rows


@dataclass
class Span:
    row: int
    start: int
    end: int
    tokens: int  # real positions of the row (the rest of the pass's width is padding)
    carried: mx.array | None = None  # [tokens, H]: the row's input of layer `start` (None when start == 0)
    captured: mx.array | None = None  # [tokens, H]: its output of layer end - 1, after the pass
    keep: tuple[int, ...] = ()  # layers whose output of the row a drafter reads (EAGLE-3, DFlash features)
    kept: dict | None = None  # layer -> [tokens, H]: those outputs, written as the row crosses each layer


_spans: contextvars.ContextVar[tuple] = contextvars.ContextVar("mlx_engine_layer_spans", default=())


@contextmanager
def crossing(spans: list[Span]):
    token = _spans.set(tuple(spans))
    try:
        yield spans
    finally:
        _spans.reset(token)


def _with_row(x: mx.array, row: int, first: mx.array) -> mx.array:
    """x [B, T, H] with row `row`'s first len(first) positions replaced by `first`."""
    n = first.shape[0]
    new = mx.concatenate([first.astype(x.dtype), x[row, n:]])[None]
    return mx.concatenate([x[:row], new, x[row + 1 :]])


def _spanning(cls: type) -> type:
    """cls, whose __call__ honours `crossing` (the layer's index in the model: _mlx_engine_layer_index)."""

    def __call__(self, x, *args, **kwargs):
        spans = _spans.get()
        if not spans:
            return cls.__call__(self, x, *args, **kwargs)
        i = self._mlx_engine_layer_index
        for s in spans:
            if i == s.start and s.carried is not None:
                x = _with_row(x, s.row, s.carried)
        resting = frozenset(s.row for s in spans if not s.start <= i < s.end)
        cache = kwargs.get("cache", args[1] if len(args) > 1 else None)
        if len(idle() | resting) == x.shape[0] and hasattr(cache, "skip"):
            cache.skip(x.shape[1])  # no row computes here (a prompt alone crossing other layers): skip the layer
            return x
        with idle_rows(resting):
            out = cls.__call__(self, x, *args, **kwargs)
        h = out[0] if isinstance(out, tuple) else out
        for s in spans:
            if i == s.end - 1:
                s.captured = h[s.row, : s.tokens]
            if i in s.keep and s.start <= i < s.end:  # a pass over all layers captures it whole (model.py)
                s.kept[i] = h[s.row, : s.tokens]
        return out

    return type(cls.__name__, (cls,), {"__call__": __call__, "_mlx_engine_layer_span": True})


def install(layers: list[nn.Module]) -> None:
    """Make these decoder layers (in model order) honour `crossing`."""
    made: dict[type, type] = {}
    for index, layer in enumerate(layers):
        object.__setattr__(layer, "_mlx_engine_layer_index", index)
        cls = type(layer)
        if not getattr(cls, "_mlx_engine_layer_span", False):
            if cls not in made:
                made[cls] = _spanning(cls)
            layer.__class__ = made[cls]
