"""The few-row quantized matmul (dense and MoE gather forms), Metal body and CUDA twin, on the CPU emulator.

The contract: every row of a launch is bit-for-bit its 1-row launch (for the gather form: each token's
pairs are bit-for-bit its 1-token launch), whatever the row count and the launch's free parameters
(columns per warp, warps per threadgroup); the values agree with the reference to float rounding (the
kernels fuse multiply-adds the reference rounds twice). The two dialects run the same arithmetic, so
their outputs are equal too.
"""

from __future__ import annotations

import numpy as np
import pytest

import mlx.core as mx
from metal_emu_util import compile_call, emu_kernel, emulated, run
from metal_kernels.emu import compiler_available, precompile
from mlx_engine.kernels import batch_qmm as Q
from mlx_engine.kernels import gather_qmm as G

pytestmark = pytest.mark.skipif(not compiler_available(), reason="the Metal emulator needs g++")

DIALECTS = ("metal", "cuda")
K, N = 1280, 18  # K: a tail step (1280 = 1.25 steps of 1024 values); N: a partial column block
CONFIGS = [(4, 32, mx.float32), (4, 64, mx.bfloat16), (4, 128, mx.float16), (8, 32, mx.float16), (8, 64, mx.float32), (8, 128, mx.bfloat16)]
FREE = [(1, 1), (2, 4), (4, 2), (3, 1)]  # (columns per warp, warps per threadgroup)


def f32(y: np.ndarray) -> np.ndarray:
    """Emulator output as float32 (bfloat16 comes back as its uint16 bits)."""
    return (y.astype(np.uint32) << 16).view(np.float32) if y.dtype == np.uint16 else y.astype(np.float32)


def dense_case(bits, gs, dtype, M=16, seed=0):
    return Q.make_case(M, K, N, gs, bits, seed=seed, dtype=dtype)


GATHER_CASES = [
    G.make_gather_case(6, 3, 7, 256, 20, 64, 4, seed=1),
    G.make_gather_case(4, 2, 5, 320, 12, 32, 8, seed=2, per_pair=True),
    G.make_gather_case(16, 4, 9, 256, 8, 64, 4, seed=3, dtype=mx.bfloat16),
]


def _token(args, t: int) -> tuple:
    """Token t of a gather case, alone (a 1-token launch)."""
    x, w, s, b, idx, gs, bits, xdiv, tokens = args
    topk = idx.shape[0] // tokens
    pairs = slice(t * topk, (t + 1) * topk)
    return (x[t : t + 1] if xdiv > 1 else x[pairs], w, s, b, idx[pairs], gs, bits, xdiv, 1), pairs


@pytest.fixture(scope="module")
def kernels():
    ks = {d: emu_kernel(Q, dialect=d) for d in DIALECTS}
    calls = []
    for bits, gs, dtype in CONFIGS:
        x, w, s, b, _, _ = dense_case(bits, gs, dtype)
        calls += [compile_call(Q.launch_spec(x[:1], w, s, b, gs, bits, cols=r)) for r in (1, 2, 3, 4)]
    for args in GATHER_CASES:
        calls.append(compile_call(G.launch_spec(*args)))
    precompile([(ks[d], calls) for d in DIALECTS])
    return ks


@pytest.mark.parametrize("dialect", DIALECTS)
@pytest.mark.parametrize("bits,gs,dtype", CONFIGS)
def test_rows_are_bit_identical_to_one_row_launches_and_close_to_the_reference(kernels, dialect, bits, gs, dtype):
    k = kernels[dialect]
    x, w, s, b, _, _ = dense_case(bits, gs, dtype, seed=bits + gs)
    alone = np.stack([run(k, Q.launch_spec(x[i : i + 1], w, s, b, gs, bits))[0][0] for i in range(16)])
    for M in (2, 3, 5, 8, 11, 16):
        (y,) = run(k, Q.launch_spec(x[:M], w, s, b, gs, bits))
        np.testing.assert_array_equal(y, alone[:M], err_msg=f"M={M}")
    ref = np.array(Q.qmm_reference(x, w, s, b, gs, bits).astype(mx.float32))
    stock = np.array(mx.quantized_matmul(x.astype(mx.float32), w, s.astype(mx.float32), b.astype(mx.float32), True, gs, bits))
    tol = 2e-6 if dtype == mx.float32 else 2e-3  # half outputs: one rounding of the output
    np.testing.assert_allclose(f32(alone), ref, rtol=tol, atol=tol * np.abs(ref).max())
    np.testing.assert_allclose(f32(alone), stock, rtol=10 * tol, atol=10 * tol * np.abs(stock).max())


@pytest.mark.parametrize("dialect", DIALECTS)
def test_columns_per_warp_warps_and_prefetch_do_not_change_any_bit(kernels, dialect):
    k = kernels[dialect]
    x, w, s, b, gs, bits = dense_case(4, 64, mx.float32, M=7)
    outs = [run(k, Q.launch_spec(x, w, s, b, gs, bits, cols=r, warps=sg))[0] for r, sg in FREE]
    outs.append(run(k, Q.launch_spec(x, w, s, b, gs, bits, prefetch=False))[0])
    for y in outs[1:]:
        np.testing.assert_array_equal(y, outs[0])


def test_metal_and_cuda_twins_compute_the_same_bits(kernels):
    x, w, s, b, gs, bits = dense_case(8, 32, mx.bfloat16, M=5)
    spec = Q.launch_spec(x, w, s, b, gs, bits)
    np.testing.assert_array_equal(run(kernels["metal"], spec)[0], run(kernels["cuda"], spec)[0])
    args = GATHER_CASES[0]
    spec = G.launch_spec(*args)
    np.testing.assert_array_equal(run(kernels["metal"], spec)[0], run(kernels["cuda"], spec)[0])


@pytest.mark.parametrize("dialect", DIALECTS)
@pytest.mark.parametrize("case", range(len(GATHER_CASES)))
def test_gather_tokens_are_bit_identical_to_one_token_launches(kernels, dialect, case):
    k = kernels[dialect]
    args = GATHER_CASES[case]
    x, w, s, b, idx, gs, bits, xdiv, tokens = args
    (y,) = run(k, G.launch_spec(*args))
    assert len(set(idx.tolist())) < idx.shape[0], "the case must route several tokens to one expert"
    for t in range(tokens):
        alone, pairs = _token(args, t)
        np.testing.assert_array_equal(run(k, G.launch_spec(*alone))[0], y[pairs], err_msg=f"token {t}")
    ref = np.array(G.gather_reference(*args).astype(mx.float32))
    tol = 2e-6 if x.dtype == mx.float32 else 2e-3
    np.testing.assert_allclose(f32(y), ref, rtol=tol, atol=tol * np.abs(ref).max())


@pytest.mark.parametrize("dialect", DIALECTS)
def test_a_gathered_pair_equals_the_dense_kernel_on_its_expert(kernels, dialect):
    k = kernels[dialect]
    x, w, s, b, idx, gs, bits, xdiv, tokens = GATHER_CASES[0]
    (y,) = run(k, G.launch_spec(*GATHER_CASES[0]))
    for p in (0, 4, idx.shape[0] - 1):
        e = int(idx[p].item())
        (yd,) = run(k, Q.launch_spec(x[p // xdiv : p // xdiv + 1], w[e], s[e], b[e], gs, bits))
        np.testing.assert_array_equal(yd[0], y[p])


def test_gather_reference_is_batch_invariant_and_matches_gather_qmm():
    args = GATHER_CASES[0]
    x, w, s, b, idx, gs, bits, xdiv, tokens = args
    y = G.gather_reference(*args)
    for t in range(tokens):
        alone, pairs = _token(args, t)
        assert mx.array_equal(G.gather_reference(*alone), y[pairs]).item()
    topk = idx.shape[0] // tokens
    stock = mx.gather_qmm(x.reshape(tokens, 1, 1, -1), w, s, b, rhs_indices=idx.reshape(tokens, topk), transpose=True, group_size=gs, bits=bits)
    assert mx.allclose(y, stock.reshape(y.shape), rtol=1e-5, atol=1e-5).item()


def test_launch_checks():
    x, w, s, b, gs, bits = dense_case(4, 64, mx.float32, M=3)
    with pytest.raises(ValueError):
        Q.launch_spec(mx.concatenate([x] * 6), w, s, b, gs, bits)  # 18 rows > 16
    with pytest.raises(ValueError):
        Q.launch_spec(x[:, :1000], w, s, b, gs, bits)  # K does not match w
    args = G.make_gather_case(17, 2, 4, 256, 8, 64, 4, seed=5)
    with pytest.raises(ValueError):
        G.launch_spec(*args)  # 17 tokens: an expert could get more rows than a launch holds
    x, w, s, b, idx, gs, bits, xdiv, tokens = GATHER_CASES[0]
    with pytest.raises(ValueError):
        G.launch_spec(x, w, s, b, idx[:-1], gs, bits, xdiv, tokens)  # pairs != rows * xdiv


@pytest.mark.parametrize("dialect", DIALECTS)
def test_the_registry_probes_accept_the_emulated_kernels(kernels, dialect):
    from mlx_engine import kernels as registry

    for name, spec in (("batch_qmm", Q.launch_spec), ("gather_qmm", G.launch_spec)):
        assert registry._probe(registry._op(name), emulated(kernels[dialect], spec)) is None


def test_launches_stay_within_cudas_65535_threadgroups_along_y():
    # A 1-column, 1-warp launch over a 128256-row lm_head asked for 128256 threadgroups along y and failed
    # to launch on an H100 (cuGraphAddKernelNode: invalid argument); launch_spec widens the threadgroup.
    x = mx.zeros((1, 64), mx.bfloat16)
    w = mx.zeros((128256, 8), mx.uint32)
    s = mx.zeros((128256, 1), mx.bfloat16)
    spec = Q.launch_spec(x, w, s, s, 64, 4, cols=1, warps=1)
    assert spec.grid[1] // spec.threadgroup[1] <= 65535
    assert spec.grid[1] * 1 >= 128256  # every column still has a warp


def test_row_bound_is_the_smallest_compiled_bound_that_holds_the_rows():
    assert [Q.row_bound(m) for m in range(1, 17)] == [1, 2, 4, 4] + [8] * 4 + [16] * 8
