"""Multi-turn: the next generation keeps the cache of the common prefix and stays lossless."""

import numpy as np
import pytest

import tiny_models
from mlx_engine import DraftModelDrafter, Engine, GenerationConfig
from reference import mlx_lm_greedy
from test_greedy_equality import PROMPT, noisy_copy, target


def generate(engine, prompt, n=24, **kw):
    cfg = GenerationConfig(max_tokens=n, num_draft=3, **kw)
    return [t for s in engine.generate(prompt, cfg) for t in s.tokens]


@pytest.mark.parametrize("family", ["llama", "deepseek_v3", "qwen3_next"])
def test_second_turn_reuses_the_prefix_and_equals_plain(family):
    model = target(family)
    engine = Engine(model, DraftModelDrafter(noisy_copy(family), tiny_models.VOCAB))
    first = generate(engine, PROMPT)
    turn2 = PROMPT + first + [7, 8, 9]
    second = generate(engine, turn2)
    assert second == mlx_lm_greedy(model, turn2, 24)
    held = len(PROMPT) + len(first) - 1 - len(engine._replay) if family == "qwen3_next" else None
    if family != "qwen3_next":  # trimmable caches keep everything both turns share
        assert engine.stats.reused_tokens >= len(PROMPT) + len(first) - 2
    else:  # a recurrent cache is kept only when the new prompt extends exactly what it holds
        assert engine.stats.reused_tokens in (0, held)
    # an unrelated prompt starts afresh
    other = [5, 6, 7, 8]
    assert generate(engine, other) == mlx_lm_greedy(model, other, 24)
    assert engine.stats.reused_tokens == 0


def test_reuse_keeps_cache_tokens_exact():
    engine = Engine(target("llama"), DraftModelDrafter(noisy_copy("llama"), tiny_models.VOCAB))
    out = generate(engine, PROMPT)
    assert engine._cached == (PROMPT + out)[: len(engine._cached)]
    assert engine.cache[0].offset == len(engine._cached)
    assert generate(engine, PROMPT, reuse_cache=False) == out and engine.stats.reused_tokens == 0


def test_mtp_second_turn_with_reused_cache(tmp_path_factory):
    """The MTP drafter restarts from the cached hidden states of the reused prefix: output still exact,
    and the head's cache after the second prefill equals the one a fresh engine builds."""
    from mlx_engine.drafters.mtp import load_head
    from test_mtp_helpers import OracleMTP, load_hf, make

    folder = make(tmp_path_factory, "deepseek_v3")
    model, config = load_hf(folder)
    engine = Engine(model, OracleMTP(load_head(model, folder, config), model))
    first = generate(engine, PROMPT)
    turn2 = PROMPT + first + [7, 8, 9]
    assert generate(engine, turn2) == mlx_lm_greedy(model, turn2, 24)
    assert engine.stats.reused_tokens >= len(PROMPT) + len(first) - 2
    fresh = Engine(model, OracleMTP(load_head(model, folder, config), model))
    for e in (engine, fresh):
        next(e.generate(turn2, GenerationConfig(max_tokens=1)))
        e.drafter.flush()
    assert fresh.stats.reused_tokens == 0 and engine.stats.reused_tokens > 0
    for a, b in zip(engine.drafter.cache, fresh.drafter.cache):
        assert a.offset == b.offset == len(turn2)
        np.testing.assert_allclose(np.array(a.keys[..., : a.offset, :]), np.array(b.keys[..., : b.offset, :]),
                                   rtol=1e-4, atol=1e-5)
