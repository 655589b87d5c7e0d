"""Is STOCK MLX batch invariant on this device? A report printed by `python -m mlx_engine.bench verify`.

A (k+1)-token verify pass over a KV cache is compared bit for bit with k+1 single-token passes over the same
cache, on a small random llama, in float32 and 4-bit quantized, without mlx_engine.target_model.batch_invariant's
patch. Whether they agree is a property of the device and the MLX build (reduction order of few-row
matmuls and attention), not of this code, so it is reported here rather than asserted in the test suite:
the tests assert what the patch guarantees (tests/test_batch_invariance.py).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

PROMPT = [3, 17, 42, 9, 128, 77, 5, 200, 17, 42, 9]
VERIFY = [5, 99, 12, 250, 7, 8, 33, 1, 64]


def _model(bits: int | None):
    from .verify import build_default_model

    model = build_default_model(layers=2, hidden=192, vocab=256, seed=1)
    if bits:
        nn.quantize(model, group_size=64 if bits == 4 else 32, bits=bits)
    mx.eval(model.parameters())
    return model


def differing_lengths(model, max_len: int = len(VERIFY)) -> list[int]:
    """The verify lengths n (2..max_len) whose n-token pass differs from n single-token passes."""
    from mlx_lm.models.cache import make_prompt_cache

    out = []
    for n in range(2, max_len + 1):
        a, b = make_prompt_cache(model), make_prompt_cache(model)
        model(mx.array(PROMPT)[None], cache=a)
        model(mx.array(PROMPT)[None], cache=b)
        full = np.array(model(mx.array(VERIFY[:n])[None], cache=a)[0])
        singles = np.array(mx.concatenate([model(mx.array([t])[None], cache=b)[0] for t in VERIFY[:n]]))
        if not np.array_equal(full, singles):
            out.append(n)
    return out


def report() -> list[str]:
    """One line per weight format: stock MLX's verify pass against single passes on this device."""
    lines = []
    for label, bits in (("float32", None), ("4-bit", 4)):
        diffs = differing_lengths(_model(bits))
        verdict = ("batch invariant (every k+1 = 2..9 equals single passes bit for bit)" if not diffs else
                   f"NOT batch invariant (k+1 = {', '.join(map(str, diffs))} differ from single passes)")
        lines.append(f"stock MLX, {label}, {mx.default_device()}: {verdict}")
    return lines


def main() -> int:
    print("\nbatch invariance of stock MLX (no patch) on this device, small random llama:")
    for line in report():
        print(f"  {line}")
    return 0
