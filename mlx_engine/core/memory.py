"""The memory budget: model + drafter + KV caches checked against the device's memory (or --max-memory)
at load and at admission, so what will not fit is refused with a clear message instead of swapping.

Default budget: MLX's own memory limit (`mx.get_memory_limit()`: on Apple silicon the GPU's recommended
working set, elsewhere a share of RAM). KV bytes per token are measured, not guessed: one token through a
fresh cache of each kind the engine will use (full precision or quantized), each layer's bytes per
position counted; recurrent states count as a fixed size.
"""

from __future__ import annotations

import re

import mlx.core as mx
from mlx.utils import tree_flatten

from .. import host

_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12, "tb": 1e12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


class MemoryBudgetError(ValueError):
    """What was asked for does not fit the memory budget; the message says how much and what to change."""


def parse_size(text: str, allow_zero: bool = False) -> int:
    """'24GB', '512MiB', '1.5g', '1000000' -> bytes (0 only where allow_zero: a feature turned off)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"expected a size such as 16GB, 512MiB or a number of bytes, got {text!r}")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"a memory budget must be > 0, got {text!r}")
    return int(value)


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def device_memory() -> int:
    """Bytes MLX may use on this device."""
    limit = mx.get_memory_limit()
    if limit > 0:
        return int(limit)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    raise MemoryBudgetError("cannot tell this device's memory: give --max-memory")


def array_bytes(tree, exclude: set[int] = frozenset()) -> int:
    """Bytes of the arrays in a tree of parameters (lazy arrays count by shape; ids in `exclude` skipped)."""
    return sum(a.nbytes for _, a in tree_flatten(tree) if isinstance(a, mx.array) and id(a) not in exclude)


def cache_bytes_per_token(make_cache, forward) -> tuple[int, int]:
    """(bytes per cached position, fixed bytes) of the caches `make_cache()` returns, measured by feeding one
    token: `forward(tokens, cache)` runs the model."""
    cache = make_cache()
    forward(mx.array([0], dtype=mx.int32), cache)
    per_token = fixed = 0
    for c in cache:
        keys = getattr(c, "keys", None)
        if keys is not None and not callable(keys):  # a KV cache: bytes per position along axis -2
            for _, a in tree_flatten((c.keys, c.values)):
                per_token += a.nbytes // a.shape[-2]
        else:  # recurrent state: one size whatever the length
            fixed += sum(a.nbytes for _, a in tree_flatten(getattr(c, "state", [])) if isinstance(a, mx.array))
    return per_token, fixed


class MemoryBudget:
    """Fixed bytes (weights, the prefix tree's budget) + KV bytes per token, against a limit."""

    def __init__(self, limit: int, weights: int, kv_per_token: int, kv_fixed: int = 0, reserved: int = 0,
                 what: str = "the model"):
        self.limit, self.weights, self.kv_per_token = int(limit), int(weights), int(kv_per_token)
        self.kv_fixed, self.reserved, self.what = int(kv_fixed), int(reserved), what

    @property
    def base(self) -> int:
        """Bytes in use before any sequence: weights, reserved (the prefix tree), fixed states."""
        return self.weights + self.reserved + self.kv_fixed

    def check_load(self) -> None:
        if self.base > self.limit:
            raise MemoryBudgetError(
                f"{self.what} needs {gib(self.weights)} of weights" +
                (f" and {gib(self.reserved)} of prefix cache" if self.reserved else "") +
                f", more than the memory budget of {gib(self.limit)} (--max-memory): use a smaller or quantized "
                f"model" + (", or a smaller --prefix-cache" if self.reserved else ""))

    def sequence_bytes(self, tokens: int) -> int:
        return tokens * self.kv_per_token

    def tokens_that_fit(self, in_use: int = 0) -> int:
        """Positions of KV cache the budget still holds beside `in_use` bytes of other sequences."""
        return max(0, (self.limit - self.base - in_use) // max(1, self.kv_per_token))

    def check_sequence(self, tokens: int, in_use: int = 0) -> None:
        """A sequence of `tokens` positions (prompt + max tokens) beside `in_use` bytes of other caches."""
        need = self.sequence_bytes(tokens)
        room = self.limit - self.base - in_use
        if need > room:
            raise MemoryBudgetError(
                f"this request needs {gib(need)} of KV cache for {tokens} tokens; the memory budget "
                f"({gib(self.limit)}) leaves {gib(max(room, 0))} beside {self.what}"
                + (" and the running requests" if in_use else "")
                + f" (at most {self.tokens_that_fit(in_use)} tokens now): send a shorter prompt or fewer max "
                  f"tokens, quantize the KV cache (--kv-bits), or raise --max-memory")


def _modules(drafter) -> list:
    """The drafter's own modules (a head, a draft model, an assistant), a chain's model drafter's included."""
    import mlx.nn as nn

    if hasattr(drafter, "ngram"):  # a chain: the n-gram has no weights; its other member's
        return _modules(drafter.model)
    found = []
    for name in ("head", "model", "assistant"):
        m = getattr(drafter, name, None)
        if isinstance(m, nn.Module):
            found.append(m)
    return found


def plan(model, drafter, target, limit: int | None = None, reserved: int = 0, what: str = "the model") -> MemoryBudget:
    """The budget for `model` (+ `drafter`) decoding through `target` (a Target, whose caches may be
    quantized): weights counted from the parameters (a drafter's tensors shared with the target once),
    KV bytes per token measured on the target's cache, plus the drafter's (a draft model's measured, a
    head's as many target layers as it has)."""
    shared = {id(a) for _, a in tree_flatten(model.parameters())}
    weights = array_bytes(model.parameters())
    for m in _modules(drafter) if drafter is not None else []:
        weights += array_bytes(m.parameters(), shared)
    per_token, fixed = cache_bytes_per_token(target.make_cache, lambda x, c: host.wait(target.forward(x, c)[0]))
    inner = getattr(drafter, "model", drafter) if drafter is not None and hasattr(drafter, "ngram") else drafter
    if inner is not None and getattr(inner, "name", None) == "draft":
        from ..target_model.cache import make_cache

        quant = getattr(inner, "kv_quant", None) or (None,)
        d_tok, d_fixed = cache_bytes_per_token(lambda: make_cache(inner.model, *quant),
                                               lambda x, c: host.wait(inner.model(x[None], cache=c)))
        per_token, fixed = per_token + d_tok, fixed + d_fixed
    elif inner is not None and getattr(inner, "head", None) is not None:
        layers = len(getattr(inner.head, "layers", [])) or 1
        per_token += per_token * layers // max(1, len(target.layers))
    return MemoryBudget(limit or device_memory(), weights, per_token, fixed, reserved, what)
