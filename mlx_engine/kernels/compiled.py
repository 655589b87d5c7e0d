"""One graph per verify length with `mx.compile`: what works and what does not.

Goal: trace the target's verify forward once per draft length (k + 1 tokens) and replay it as one
compiled graph. It cannot be done for a forward that updates mlx-lm caches in place:

  * `mx.compile` traces the Python function once per input shape and afterwards replays only the
    array graph. mlx-lm's KVCache keeps `offset` as a Python int and grows its buffers in Python
    (`update_and_fetch`: `self.offset += n`, slice assignment at `[prev:offset]`, reallocation every
    256 steps). On replay none of that Python runs: the offset stays where the trace left it, the
    new keys/values land at the traced position and attention reads the traced slice. Measured here
    (tiny llama, mlx 0.32): the first compiled call is right, the second differs by 0.75 in the logits
    and every cache offset is stale.
  * Declaring the cache as implicit state (`mx.compile(f, inputs=..., outputs=...)`) does not help:
    `cache.state` returns fresh slices `keys[..., :offset, :]` each call, so the captured arrays are
    not the ones the forward reads ("uncaptured inputs" error), and the offset is still a Python int
    baked into the trace.
  * A compilable verify would need a cache whose position is an array (dynamic `slice_update` at an
    array offset, attention masked to a fixed-capacity buffer). That is a different cache
    implementation, not a wrapper, so `verify_forward` returns the plain forward.

What does compile safely: pure array functions of the verify logits (the sampler chain, acceptance
math). `CompiledPerLength` keeps one compiled function per length for those.
"""

from __future__ import annotations

from typing import Any, Callable

import mlx.core as mx


def is_compilable(cache: Any) -> bool:
    """False for any cache that keeps Python-side state (every mlx-lm cache does)."""
    if cache is None:
        return True
    caches = cache if isinstance(cache, (list, tuple)) else [cache]
    return not any(hasattr(c, "offset") or hasattr(c, "update_and_fetch") for c in caches)


def verify_forward(model: Callable, cache: Any) -> Callable[[mx.array], mx.array]:
    """The forward used for verify passes over `cache`.

    Compiled only when the cache holds no Python state (never for mlx-lm caches, see the module
    docstring); otherwise the plain `model(tokens, cache=cache)`.
    """
    if cache is not None and not is_compilable(cache):
        return lambda tokens: model(tokens, cache=cache)
    if cache is None:
        return CompiledPerLength(lambda tokens: model(tokens))
    return CompiledPerLength(lambda tokens: model(tokens, cache=cache))


class CompiledPerLength:
    """`mx.compile(fn)` kept per sequence length (axis -1 of the first argument, or axis -2 for
    logits-like [.., L, V] inputs when `length_axis=-2`): one traced graph per verify length k + 1.
    Only for pure functions of their array arguments."""

    def __init__(self, fn: Callable, length_axis: int = -1):
        self.fn = fn
        self.length_axis = length_axis
        self._compiled: dict[int, Callable] = {}

    def __call__(self, *args):
        n = args[0].shape[self.length_axis]
        f = self._compiled.get(n)
        if f is None:
            f = self._compiled[n] = mx.compile(self.fn)
        return f(*args)

    @property
    def lengths(self) -> list[int]:
        return sorted(self._compiled)
