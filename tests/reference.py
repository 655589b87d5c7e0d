"""Reference outputs from mlx-lm itself."""

import mlx.core as mx
from mlx_lm.generate import generate_step


def mlx_lm_greedy(model, prompt: list[int], n: int) -> list[int]:
    """mlx-lm's own plain greedy decoding of n tokens."""
    out = []
    for tok, _ in generate_step(mx.array(prompt), model, max_tokens=n):
        out.append(int(tok))
    return out
