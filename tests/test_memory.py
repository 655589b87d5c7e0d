"""The memory budget: sizes parsed, KV bytes per token measured, and what will not fit refused cleanly."""

import pytest

import tiny_models
from mlx_engine import Engine, GenerationConfig, NgramDrafter
from mlx_engine.core.batch_engine import BatchEngine
from mlx_engine.core.memory import MemoryBudget, MemoryBudgetError, parse_size, plan
from mlx_engine.models import parameter_bytes
from mlx_engine.target_model.model import Target
from test_greedy_equality import PROMPT, target


def test_sizes():
    assert parse_size("16GB") == 16 * 10**9 and parse_size("512MiB") == 512 * 2**20
    assert parse_size("1.5g") == 1_500_000_000 and parse_size("1000") == 1000
    for bad in ("", "12XB", "-3GB", "0", "GB"):
        with pytest.raises(ValueError):
            parse_size(bad)


@pytest.mark.parametrize("bits", [None, 8])
def test_kv_bytes_per_token_measured_from_the_cache_layout(bits):
    wide = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)
    model = tiny_models.build("llama", **wide)[0]
    b = plan(model, None, Target(model, bits, 32), limit=1 << 30)
    values = 2 * 2 * 2 * 32  # layers x (keys, values) x KV heads x head dim
    per_value = 4 if bits is None else (bits / 8 + 2 * 4 / 32)  # fp32, or data + an fp32 scale and bias per 32
    assert b.kv_per_token == values * per_value
    assert b.weights == parameter_bytes(model) and b.kv_fixed == 0


def test_a_draft_models_cache_and_weights_are_counted():
    from mlx_engine import DraftModelDrafter

    model = target("llama")
    alone = plan(model, None, Target(model), limit=1 << 30)
    draft = DraftModelDrafter(tiny_models.build("llama", seed=5)[0], tiny_models.VOCAB)
    both = plan(model, draft, Target(model), limit=1 << 30)
    assert both.weights == 2 * alone.weights and both.kv_per_token == 2 * alone.kv_per_token


def test_engine_refuses_a_request_that_does_not_fit_before_any_work():
    model = target("llama")
    b = plan(model, None, Target(model), limit=1 << 30)
    b.limit = b.base + 30 * b.kv_per_token  # room for 30 positions
    engine = Engine(model, memory=b)
    with pytest.raises(MemoryBudgetError, match="at most 30 tokens"):
        next(engine.generate(PROMPT, GenerationConfig(max_tokens=20)))
    assert engine.cache == []
    assert len([t for s in engine.generate(PROMPT, GenerationConfig(max_tokens=19)) for t in s.tokens]) == 19


def test_weights_over_the_budget_are_refused_at_load():
    b = MemoryBudget(limit=100, weights=120, kv_per_token=1, what="SmolLM2")
    with pytest.raises(MemoryBudgetError, match="SmolLM2 needs 0.00 GiB of weights.*--max-memory"):
        b.check_load()


def test_batch_engine_admits_what_fits_and_refuses_what_never_can():
    model = target("llama")
    b = plan(model, None, Target(model), limit=1 << 30)
    b.limit = b.base + 100 * b.kv_per_token
    engine = BatchEngine(model, NgramDrafter(), memory=b)
    with pytest.raises(MemoryBudgetError):
        engine.add("big", PROMPT, 95)  # 106 positions: never fits
    assert engine.can_admit(len(PROMPT), 39)  # 50 alone
    engine.add("a", PROMPT, 39)
    assert engine.can_admit(len(PROMPT), 39)  # two rows of 50
    assert not engine.can_admit(len(PROMPT), 40)  # two rows of 51: wait for "a" to finish
    while engine.running():
        engine.step()
    assert engine.can_admit(len(PROMPT), 80)
