"""Reference outputs from mlx-lm itself."""

import mlx.core as mx
from mlx_lm.generate import generate_step

from device import as_engine_decodes


def mlx_lm_greedy(model, prompt: list[int], n: int) -> list[int]:
    """mlx-lm's own plain greedy decoding of n tokens (on a GPU through the batch-invariant path the
    engine decodes with there: speculative output must equal the engine's plain output on any device)."""
    as_engine_decodes(model)
    out = []
    for tok, _ in generate_step(mx.array(prompt), model, max_tokens=n):
        out.append(int(tok))
    return out
