"""Fixed-row passes (target_model/fixed_rows.py): every decode and verify pass runs `rows` token rows, the tail
padding it. The pad changes no bit of a real row (against the unpadded batch-invariant model), a verify
pass equals single-token passes bit for bit, the KV cache keeps only the real rows, speculative greedy
output equals the engine's plain output, and the load-time probe moves a plan whose op mixes rows to
the next plan."""

import functools

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import quantize_model

import tiny_models
from mlx_engine import DraftModelDrafter, Engine, GenerationConfig, NgramDrafter
from mlx_engine.target_model import cache as cache_ops
from mlx_engine.target_model.batch_invariant import _QLinear, make_batch_invariant
from mlx_engine.target_model.fixed_rows import PLANS, fixed_rows, fixed_rows_plan, make_fixed_rows, make_invariant, probe
import test_batch_invariance as batch_invariance
from test_batch_invariance import DIMS, VERIFY
from test_greedy_equality import PROMPT

ROWS = 8
TOKENS = VERIFY + VERIFY[::-1]  # 18 tokens fed after the prompt
# (family, bits): dense with an untied / tied quantized head, unquantized, and deepseek_v3 quantized
# (MLA attention and MoE gates run per token, its experts through gather_qmm: real rows only)
CASES = [("llama", 4), ("qwen3", 8), ("llama", 0), ("deepseek_v3", 4)]


def build(family: str, bits: int):
    overrides = dict(DIMS)
    if family == "qwen3":
        overrides["head_dim"] = 16
    if family == "deepseek_v3":
        overrides["moe_intermediate_size"] = 64
    model, cfg = tiny_models.build(family, seed=1, **overrides)
    if bits:
        quantize_model(model, cfg, 64 if bits == 4 else 32, bits)
    return model


@functools.cache
def fixed(family: str, bits: int, plan: str = "kernels"):
    model = build(family, bits)
    chosen = make_fixed_rows(model, rows=ROWS, plan=plan)
    return model, chosen


def passes(model, sizes):
    return batch_invariance.passes(model, sizes, TOKENS)


@pytest.mark.parametrize("family,bits", CASES)
def test_the_pad_changes_no_bit_of_a_real_row_nor_of_the_cache(family, bits):
    """Fixed-row model (kernel linears) against the unpadded batch-invariant model, same weights and passes."""
    model, plan = fixed(family, bits)
    assert plan == "kernels" and fixed_rows(model) == ROWS
    plain = make_batch_invariant(build(family, bits), max_rows=ROWS)
    sizes = [1, 3, ROWS, 2, 1]
    a, ca = passes(model, sizes)
    b, cb = passes(plain, sizes)
    assert np.array_equal(a, b)
    for x, y in zip(ca, cb):
        assert x.offset == y.offset == len(PROMPT) + sum(sizes)
        for u, v in ((x.keys, y.keys), (x.values, y.values)):  # the rows held (past the offset: stale pad rows)
            assert np.array_equal(np.array(u[..., : x.offset, :]), np.array(v[..., : y.offset, :]))


@pytest.mark.parametrize("family,bits", CASES)
def test_verify_pass_equals_single_steps_bit_for_bit(family, bits):
    model, _ = fixed(family, bits)
    for n in (2, 5, ROWS):
        full, _ = passes(model, [n])
        singles, _ = passes(model, [1] * n)
        assert np.array_equal(full, singles), f"{n} rows"


@pytest.mark.parametrize("plan", ["stock", "stock-linears"])
@pytest.mark.parametrize("family,bits", [("llama", 4), ("llama", 0), ("deepseek_v3", 4)])
def test_plans_with_mlx_ops_hold_wherever_the_probe_passes(family, bits, plan):
    """MLX's own ops at the fixed row count: the contract holds, on other lengths and contexts than the
    probe's, wherever the probe passes; where it fails, auto moves on."""
    model, _ = fixed(family, bits, plan)
    if not probe(model, ROWS):  # this device's fixed-shape ops mix rows (on this CPU, with OpenBLAS: "stock")
        assert fixed(family, bits, "auto")[1] != plan  # auto never keeps a plan that fails the probe
        return
    assert not any(isinstance(m, _QLinear) for _, m in model.named_modules())
    for n in (2, 5, ROWS):
        full, _ = passes(model, [n])
        singles, _ = passes(model, [1] * n)
        assert np.array_equal(full, singles), f"{n} rows"


def row_mixing(fn):
    """fn with a trace of the first row (axis -2) added to every row: rows no longer independent."""
    def mixed(*args, **kwargs):
        y = fn(*args, **kwargs)
        return y + 1e-3 * y[..., :1, :]
    return mixed


def test_the_probe_moves_auto_past_each_plan_whose_op_mixes_rows(monkeypatch):
    """MLX's attention made row-dependent: "stock" fails the probe, "stock-linears" (attention through
    the invariant path) passes. Its quantized matmul too: both fail, "kernels" is kept."""
    from mlx_engine import kernels

    if kernels.backend("batch_attention") != "reference":
        pytest.skip("with a GPU attention kernel auto starts at stock-linears")
    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", row_mixing(mx.fast.scaled_dot_product_attention))
    assert make_fixed_rows(build("llama", 4), rows=ROWS) == "stock-linears"
    monkeypatch.setattr(mx, "quantized_matmul", row_mixing(mx.quantized_matmul))
    model = build("llama", 4)
    assert make_fixed_rows(model, rows=ROWS) == "kernels" == fixed_rows_plan(model)
    monkeypatch.undo()
    assert any(isinstance(m, _QLinear) for _, m in model.named_modules())
    assert probe(model, ROWS)


def test_models_with_recurrent_layers_get_the_kernels_without_padding():
    model = tiny_models.build("qwen3_next", seed=1)[0]
    assert make_fixed_rows(model, rows=ROWS) == "kernels"
    assert fixed_rows(model) is None


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="rows"):
        make_fixed_rows(build("llama", 0), rows=17)
    with pytest.raises(ValueError, match="linears"):
        make_fixed_rows(build("llama", 0), plan="fast")
    with pytest.raises(ValueError, match="mode"):
        make_invariant(build("llama", 0), "sometimes")
    with pytest.raises(ValueError, match="already patched"):
        make_fixed_rows(make_batch_invariant(build("llama", 0)))
    assert PLANS == ("stock", "stock-linears", "kernels")


def test_a_second_engine_over_a_fixed_row_model_keeps_its_plan():
    """Two engines over one model in fixed mode (plain beside n-gram, as the GPU bench builds them): the
    second keeps the first one's patch and plan instead of refusing the model (seen on the H200)."""
    model = build("llama", 4)
    first = Engine(model, batch_invariant="fixed")
    plan = fixed_rows_plan(model)
    second = Engine(model, NgramDrafter(), batch_invariant="fixed")
    assert first.max_rows == second.max_rows == 16 and fixed_rows_plan(model) == plan


@pytest.mark.parametrize("plan", ["kernels", "auto"])
@pytest.mark.parametrize("family,bits", [("llama", 4), ("deepseek_v3", 4)])
def test_speculative_greedy_equals_plain_with_drafts_capped_at_rows_minus_one(family, bits, plan):
    model, _ = fixed(family, bits, plan)

    def run(drafter, k):
        engine = Engine(model, drafter)
        cfg = GenerationConfig(max_tokens=48, num_draft=k)
        return [t for s in engine.generate(PROMPT, cfg) for t in s.tokens], engine

    plain, engine = run(None, 0)
    assert engine.max_rows == ROWS
    noisy = build(family, 0)  # the unquantized parent: agrees with the target often, not always
    for drafter, k in ((NgramDrafter(), 12), (DraftModelDrafter(noisy, tiny_models.VOCAB), 3)):
        tokens, engine = run(drafter, k)
        assert tokens == plain, f"{drafter.name} k={k}"
        assert engine.stats.drafted > 0
        assert len(engine.stats.drafted_at) == (ROWS - 1 if k > ROWS - 1 else k)  # the longest draft


def test_the_gpu_default_can_name_the_fixed_path(monkeypatch):
    """A default of "fixed" gives the engine fixed-row passes and the batch engine the kernels mode (a
    fixed-row pass pads one sequence); off leaves both stock."""
    from mlx_engine.core import invariance_default
    from mlx_engine.core.batch_engine import BatchEngine

    monkeypatch.setattr(invariance_default, "gpu_decoding", lambda: True)
    monkeypatch.setattr(invariance_default, "INVARIANT_BY_DEFAULT_ON_GPU", "fixed")
    assert Engine(build("llama", 0)).max_rows == 16
    model = build("llama", 0)
    batch = BatchEngine(model)
    assert batch.batch_invariant and batch.max_k == 15 and fixed_rows(model) is None
    monkeypatch.setattr(invariance_default, "INVARIANT_BY_DEFAULT_ON_GPU", False)
    engine = Engine(build("llama", 0))
    assert engine.max_rows is None and not engine.batch_invariant
    assert not BatchEngine(build("llama", 0)).batch_invariant


def test_a_positional_cache_is_padded_too(monkeypatch):
    from mlx_lm.models.llama import Model

    model, _ = fixed("llama", 4)
    seen = []
    real = Model.__call__
    monkeypatch.setattr(Model, "__call__", lambda self, x, *a, **kw: seen.append(x.shape[1]) or real(self, x, *a, **kw))
    a, b = cache_ops.make_cache(model), cache_ops.make_cache(model)
    x = mx.array(TOKENS[:3])[None]
    assert np.array_equal(np.array(model(x, a)), np.array(model(x, cache=b)))
    assert seen == [ROWS, ROWS]  # both calls ran padded to the fixed row count
    assert a[0].offset == b[0].offset == 3
