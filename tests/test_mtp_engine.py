"""Greedy speculative decoding with the MTP drafter is token-for-token mlx-lm's greedy decoding."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_engine import Engine, GenerationConfig, SamplingConfig
from mlx_engine.drafters.mtp import load_head, load_mtp_drafter
from mlx_engine.target_model.model import Target
from test_mtp_helpers import PROMPT, OracleMTP, engine_model, generate, load_hf, make
from reference import mlx_lm_greedy

FAMILIES = ["qwen3_5", "deepseek_v3", pytest.param("qwen3_next", marks=pytest.mark.slow), "glm4_moe", "mimo",
            pytest.param("qwen3_5_moe", marks=pytest.mark.slow)]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_mlx_lm(tmp_path_factory, family):
    folder = make(tmp_path_factory, family)
    model, config = load_hf(folder)
    ref = mlx_lm_greedy(model, PROMPT, 64)
    for k in (1, 2, 3):
        drafter = load_mtp_drafter(model, folder, config)
        assert generate(model, drafter, k) == ref, f"{family} k={k}"


@pytest.mark.parametrize("family", ["qwen3_5", "deepseek_v3"])
def test_oracle_head_accepts_everything_and_stays_exact(tmp_path_factory, family):
    """Drafts forced to be right: every cycle accepts all k, output still equals mlx-lm's."""
    folder = make(tmp_path_factory, family)
    model, config = load_hf(folder)
    ref = mlx_lm_greedy(model, PROMPT, 64)
    for k in (1, 3):
        drafter = OracleMTP(load_head(model, folder, config), model)
        engine = Engine(engine_model(model), drafter)
        out = []
        for step in engine.generate(PROMPT, GenerationConfig(max_tokens=64, num_draft=k)):
            out += step.tokens
        assert out == ref
        stats = engine.stats
        assert stats.cycles > 0 and stats.drafted > 0
        assert stats.accepted == stats.drafted, (stats.accepted, stats.drafted)


def test_sampling_runs_and_returns_probs(tmp_path_factory):
    folder = make(tmp_path_factory, "qwen3_5")
    model, config = load_hf(folder)
    drafter = load_mtp_drafter(model, folder, config)
    cfg = GenerationConfig(max_tokens=24, num_draft=2, sampling=SamplingConfig(temperature=0.8, top_p=0.9), seed=3)
    out = [t for s in Engine(engine_model(model), drafter).generate(PROMPT, cfg) for t in s.tokens]
    assert len(out) == 24
    drafter2 = load_mtp_drafter(model, folder, config)
    out2 = [t for s in Engine(engine_model(model), drafter2).generate(PROMPT, cfg) for t in s.tokens]
    assert out == out2  # seeded


@pytest.mark.parametrize("family", ["qwen3_5", "deepseek_v3"])
def test_accepted_slots_are_reevaluated_with_target_hidden(tmp_path_factory, family):
    """After cycles that accept drafts, the head's cache equals a fresh one-batch prefill over the same
    tokens and the target's hidden states (no draft-time approximation left, vLLM #14649)."""
    folder = make(tmp_path_factory, family)
    model, config = load_hf(folder)
    drafter = OracleMTP(load_head(model, folder, config), model)
    engine = Engine(engine_model(model), drafter)
    gen = engine.generate(PROMPT, GenerationConfig(max_tokens=64, num_draft=3))
    for _ in range(4):  # the first token, then 3 cycles of 3 accepted drafts + 1 bonus
        next(gen)
    assert engine.stats.accepted >= 3
    drafter.flush()
    history = drafter.history
    n = len(history) - 1  # tokens the target has fed
    target = Target(engine_model(model))
    _, hidden = target.forward(mx.array(history[:-1]), target.make_cache(), True)
    fresh = load_mtp_drafter(model, folder, config)
    fresh.begin(history, hidden)
    fresh.flush()
    got, want = drafter.cache[0], fresh.cache[0]
    assert got.offset == want.offset == n
    for a, b in ((got.keys, want.keys), (got.values, want.values)):
        np.testing.assert_allclose(np.array(a[..., :n, :]), np.array(b[..., :n, :]), rtol=1e-4, atol=1e-4)


def test_head_cache_length_tracks_committed_tokens(tmp_path_factory):
    folder = make(tmp_path_factory, "mimo")
    model, config = load_hf(folder)
    drafter = load_mtp_drafter(model, folder, config)
    gen = Engine(model, drafter).generate(PROMPT, GenerationConfig(max_tokens=40, num_draft=3))
    for _ in gen:
        drafter.flush()
        assert drafter.cache[0].offset == len(drafter.history) - 1
