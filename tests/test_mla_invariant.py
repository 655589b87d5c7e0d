"""DeepSeek-V3's MLA attention on the batch-invariant path (target_model/mla.py): decode and verify passes in the
absorbed form through the batch attention with its rope term. Its output agrees with mlx-lm's (absorbed
for one token, expanded for more) to float rounding, a verify pass equals single steps bit for bit, and
greedy speculative output equals plain output."""

import numpy as np
import pytest
from mlx_lm.models.deepseek_v3 import DeepseekV3Attention
from mlx_lm.utils import quantize_model

import tiny_models
from mlx_engine import DraftModelDrafter, Engine, GenerationConfig
from mlx_engine.target_model.batch_invariant import make_batch_invariant
from test_batch_invariance import passes
from test_greedy_equality import PROMPT

DIMS = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=64)
TOKENS = [5, 99, 12, 250, 7, 8, 33, 1, 64, 3]


def build(bits: int = 0):
    model, cfg = tiny_models.build("deepseek_v3", seed=1, **DIMS)
    if bits:
        quantize_model(model, cfg, 64, bits)
    return model


def logits(model, sizes):
    return passes(model, sizes, TOKENS)[0]


def test_the_attention_modules_take_the_absorbed_path():
    model = make_batch_invariant(build())
    mla = [m for _, m in model.named_modules() if isinstance(m, DeepseekV3Attention)]
    assert mla and all(type(m).__call__ is not DeepseekV3Attention.__call__ for m in mla)
    assert all(m._bi_split for m in mla)


@pytest.mark.parametrize("bits", [0, 4])
def test_absorbed_path_agrees_with_mlx_lm_and_verify_equals_single_steps(bits):
    stock, patched = build(bits), make_batch_invariant(build(bits))
    sizes = [1, 4, 1, 3]
    np.testing.assert_allclose(logits(patched, sizes), logits(stock, sizes), rtol=1e-4, atol=1e-4)
    for n in (2, 5, 10):
        assert np.array_equal(logits(patched, [n]), logits(patched, [1] * n)), f"{n} rows"


def test_greedy_speculative_equals_plain_on_the_absorbed_path():
    model = make_batch_invariant(build(4))

    def run(drafter, k):
        engine = Engine(model, drafter)
        return [t for s in engine.generate(PROMPT, GenerationConfig(max_tokens=40, num_draft=k)) for t in s.tokens], engine

    plain, _ = run(None, 0)
    tokens, engine = run(DraftModelDrafter(build(0), tiny_models.VOCAB), 3)  # the unquantized parent
    assert tokens == plain
    assert 0 < engine.stats.accepted < engine.stats.drafted, "the test needs partial acceptance"


@pytest.mark.parametrize("path", ["kernels", "fixed"])
def test_the_model_path_through_the_emulated_attention_kernel(monkeypatch, path):
    """Dims the kernel takes (multiples of 32), its Metal body on the CPU emulator in the registry's place:
    the absorbed path (and a fixed-row pass, whose pad rows the kernel skips) gives verify == singles bit
    for bit, close to mlx-lm."""
    from metal_emu_util import emu_kernel, emulated
    from metal_kernels.emu import compiler_available

    from mlx_engine import kernels
    from mlx_engine.kernels import batch_attention as A
    from mlx_engine.target_model.fixed_rows import make_fixed_rows

    if not compiler_available():
        pytest.skip("the Metal emulator needs g++")
    monkeypatch.setitem(kernels._resolved, "batch_attention", ("metal", emulated(emu_kernel(A), A.launch_spec)))
    dims = dict(DIMS, num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=32, qk_rope_head_dim=32,
                qk_nope_head_dim=32, v_head_dim=32, q_lora_rank=None)
    stock = tiny_models.build("deepseek_v3", seed=1, **dims)[0]
    model = tiny_models.build("deepseek_v3", seed=1, **dims)[0]
    if path == "kernels":
        make_batch_invariant(model)
    else:
        assert make_fixed_rows(model, rows=4, plan="stock-linears") == "stock-linears"
    calls = []
    real = kernels._resolved["batch_attention"][1]
    monkeypatch.setitem(kernels._resolved, "batch_attention", ("metal", lambda *a, **kw: calls.append(kw) or real(*a, **kw)))
    assert np.array_equal(logits(model, [3]), logits(model, [1] * 3))
    assert {c.get("live") for c in calls} == ({None} if path == "kernels" else {1, 3})  # fixed: real rows told
    np.testing.assert_allclose(logits(model, [3]), logits(stock, [3]), rtol=1e-4, atol=1e-4)


def test_without_a_gpu_kernel_mla_rows_are_mlx_lm_s_decode_step_calls():
    """With the attention op on its reference (no GPU), each absorbed-MLA row runs mlx-lm's own attention
    call of its decode step (the rope scores as its additive mask, over exactly its keys): an fp32 model
    then decodes bit for bit as stock mlx-lm does, and its verify rows equal those steps."""
    from mlx_engine import kernels

    if kernels.backend("batch_attention") != "reference":
        pytest.skip("a GPU attention kernel is in use")
    prompt = PROMPT * 2  # 22 tokens: a prefill beyond the contract's 16 rows, stock in both
    stock, patched = build(), make_batch_invariant(build())
    singles = passes(patched, [1] * 6, TOKENS, prompt)[0]
    assert np.array_equal(singles, passes(stock, [1] * 6, TOKENS, prompt)[0])
    assert np.array_equal(passes(patched, [6], TOKENS, prompt)[0], singles)
