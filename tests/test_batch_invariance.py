"""Batch invariance end to end (issue 6): after make_batch_invariant, the logits of a (k+1)-token verify
pass over a prefilled KV cache equal bit for bit those of k+1 single-token passes, and greedy speculative
decoding equals single-step decoding of the same patched model. The kernel side (the Metal batch_qmm
rows bit for bit) is checked by tests/test_metal_emulator.py."""

import functools
import time

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.utils import quantize_model

import tiny_models
from mlx_engine import DraftModelDrafter, Engine, GenerationConfig
from mlx_engine.target_model import cache as cache_ops
from mlx_engine.target_model.batch_invariant import invariant_attention, make_batch_invariant, tree_sum
from reference import mlx_lm_greedy
from test_greedy_equality import PROMPT

DIMS = dict(hidden_size=64, intermediate_size=128)  # K divisible by the quantization group sizes
VERIFY = [5, 99, 12, 250, 7, 8, 33, 1, 64]


@functools.cache
def quantized(family, bits, patched=True):
    overrides = dict(DIMS, head_dim=16) if family == "qwen3" else DIMS
    model, cfg = tiny_models.build(family, seed=1, **overrides)
    quantize_model(model, cfg, 64 if bits == 4 else 32, bits)
    return make_batch_invariant(model) if patched else model


def passes(model, sizes, tokens=VERIFY, prompt=PROMPT):
    """(logits [sum(sizes), V] as numpy, the cache): passes of the given sizes over `tokens`, in order,
    after `prompt`, on a fresh cache."""
    cache = cache_ops.make_cache(model)
    model(mx.array(prompt)[None], cache=cache)
    out, at = [], 0
    for n in sizes:
        out.append(model(mx.array(tokens[at : at + n])[None], cache=cache)[0])
        at += n
    return np.array(mx.concatenate(out)), cache


def verify_vs_singles(model, n):
    """(logits of one n-token pass, logits of n 1-token passes), each over the prefilled prompt."""
    return passes(model, [n])[0], passes(model, [1] * n)[0]


@pytest.mark.parametrize("family,bits", [("llama", 4), ("llama", 8), ("qwen3", 4)])  # qwen3: tied, quantized lm_head
def test_verify_pass_equals_single_passes_bit_for_bit(family, bits):
    model = quantized(family, bits)
    for n in range(2, 10):
        full, singles = verify_vs_singles(model, n)
        assert np.array_equal(full, singles), f"k+1={n}: max diff {np.abs(full - singles).max()}"


def test_unquantized_model_is_invariant_too():
    model = make_batch_invariant(tiny_models.build("llama", seed=1)[0])
    for n in range(2, 10):
        full, singles = verify_vs_singles(model, n)
        assert np.array_equal(full, singles), f"k+1={n}"


def test_patched_layers_use_the_batch_qmm_op():
    from mlx_engine.target_model.batch_invariant import _QEmbedding, _QLinear

    model = quantized("qwen3", 4)
    kinds = {type(m) for _, m in model.named_modules()}
    assert _QLinear in kinds and _QEmbedding in kinds
    assert not any(type(m) is nn.QuantizedLinear for _, m in model.named_modules())


@pytest.mark.cpu_exact
def test_row_local_stock_ops_are_invariant_and_matmul_sdpa_are_not():
    """The docstring's claims about the stock CPU ops, checked here (rows alone vs rows of a batch)."""
    mx.random.seed(0)
    x = mx.random.normal((9, 64))
    w = mx.ones(64)
    rope = nn.RoPE(16, base=10000.0)
    q = mx.random.normal((1, 4, 9, 16))
    for i in range(9):
        assert mx.array_equal(mx.fast.rms_norm(x[i : i + 1], w, 1e-5), mx.fast.rms_norm(x, w, 1e-5)[i : i + 1]).item()
        assert mx.array_equal(rope(q[:, :, i : i + 1], offset=3 + i), rope(q, offset=3)[:, :, i : i + 1]).item()
    W = mx.random.normal((128, 64))
    stock = any(not mx.array_equal(x[i : i + 1] @ W.T, (x @ W.T)[i : i + 1]).item() for i in range(9))
    print(f"\nstock fp32 matmul batch invariant: {not stock}")


def test_invariant_attention_rows_and_zero_padding():
    mx.random.seed(3)
    N, L = 21, 7
    q = mx.random.normal((1, 4, L, 16))
    k = mx.random.normal((1, 2, N, 16))
    v = mx.random.normal((1, 2, N, 16))
    full = invariant_attention(q, k, v, scale=0.25, mask="causal")
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask="causal")
    assert mx.allclose(full, ref, atol=1e-5).item()
    for i in range(L):
        n = N - L + i + 1
        one = invariant_attention(q[:, :, i : i + 1], k[:, :, :n], v[:, :, :n], scale=0.25)
        assert mx.array_equal(one, full[:, :, i : i + 1]).item(), f"row {i}"
    t = mx.random.normal((3, 13))
    assert mx.array_equal(tree_sum(t), tree_sum(mx.pad(t, [(0, 0), (0, 19)]))).item()


def test_greedy_speculative_equals_single_step_decoding_of_patched_model():
    model = quantized("llama", 4)
    plain = mlx_lm_greedy(model, PROMPT, 64)
    draft = tiny_models.build("llama", seed=1, **DIMS)[0]  # the unquantized parent: a noisy copy of the target
    engine = Engine(model, DraftModelDrafter(draft, tiny_models.VOCAB))
    out = [t for s in engine.generate(PROMPT, GenerationConfig(max_tokens=64, num_draft=4)) for t in s.tokens]
    assert out == plain
    assert 0 < engine.stats.accepted < engine.stats.drafted, "the test needs partial acceptance"


def test_benchmark_fp32_row_split_cost():
    """Not an assertion: the cost of the invariant fp32 Linear (one 1-row matmul per row) vs one matmul."""
    from mlx_engine.target_model.batch_invariant import _matmul_t

    W = mx.random.normal((2048, 1024))
    for M in (1, 5, 9):
        x = mx.random.normal((M, 1024))
        mx.eval(W, x)
        times = {}
        for name, fn in (("stock", lambda: x @ W.T), ("invariant", lambda: _matmul_t(x, W, 16))):
            for _ in range(3):
                mx.eval(fn())
            t = time.perf_counter()
            for _ in range(20):
                mx.eval(fn())
            times[name] = (time.perf_counter() - t) / 20 * 1e3
        print(f"\nM={M}: stock {times['stock']:.3f} ms, invariant {times['invariant']:.3f} ms")


def test_without_a_gpu_kernel_attention_rows_are_the_decode_steps_own_calls():
    """With the attention op on its reference (no GPU), each verify row runs MLX's own 1-query attention over
    exactly its keys, the decode step's call: an fp32 model (row-split linears, 1-row matmuls as stock decode
    runs) then decodes bit for bit as stock does, and its verify rows equal those steps."""
    from mlx_engine import kernels

    if kernels.backend("batch_attention") != "reference":
        pytest.skip("a GPU attention kernel is in use")
    prompt = PROMPT * 2  # 22 tokens: a prefill beyond the contract's 16 rows, stock in both
    stock = tiny_models.build("llama", seed=1)[0]
    patched = make_batch_invariant(tiny_models.build("llama", seed=1)[0])
    singles = passes(patched, [1] * 6, prompt=prompt)[0]
    assert np.array_equal(singles, passes(stock, [1] * 6, prompt=prompt)[0])
    assert np.array_equal(passes(patched, [6], prompt=prompt)[0], singles)
