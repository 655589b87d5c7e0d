"""The batch-invariant attention kernel, Metal body and CUDA twin, on the CPU emulator.

The contract: each query row of a launch is bit-for-bit a 1-query launch over the keys that query sees
(causal: the first Nk - L + i + 1), whatever the number of queries, whatever lies in the cache past its
keys, and read through the strides of a cache view (the kernels never copy the cache). Values agree
with the reference (and mx.fast.scaled_dot_product_attention) to float rounding.
"""

from __future__ import annotations

import numpy as np
import pytest

import mlx.core as mx
from metal_emu_util import compile_call, emu_kernel, emulated, run
from metal_kernels.emu import compiler_available, precompile
from mlx_engine.kernels import batch_attention as A

pytestmark = pytest.mark.skipif(not compiler_available(), reason="the Metal emulator needs g++")

DIALECTS = ("metal", "cuda")
CASES = {
    "gqa": dict(B=1, Hq=4, Hk=2, L=6, N=45, D=64),
    "mla": dict(B=1, Hq=2, Hk=1, L=3, N=11, D=64, DV=64, DP=32),  # latent keys = values, rope term
    "fp16-batch2": dict(B=2, Hq=2, Hk=2, L=3, N=40, D=32, dtype=mx.float16),
    "first-tokens": dict(B=1, Hq=2, Hk=1, L=5, N=5, D=32),  # the queries are the whole cache
}


def views(args, extra: int = 9):
    """The case's k / v / kp as numpy views of a longer cache buffer (poison past the view): what MLX
    hands a kernel built with ensure_row_contiguous=False for a KV-cache slice."""
    q, k, v, scale, causal, qp, kp = args

    def view(a):
        if a is None:
            return None
        npd = np.float16 if a.dtype == mx.float16 else np.float32
        buf = np.full(a.shape[:2] + (a.shape[2] + extra, a.shape[3]), np.nan, npd)
        buf[:, :, : a.shape[2]] = np.array(a)
        return buf[:, :, : a.shape[2]]

    return q, view(k), view(v), scale, causal, qp, view(kp)


def launch(kernel, args, **kw):
    """Run a case with numpy views standing in for the cache slices."""
    q, k, v, scale, causal, qp, kp = args
    spec = A.launch_spec(q, mx.array(k), mx.array(v), scale, causal, qp, None if kp is None else mx.array(kp), **kw)
    kwargs = spec.kwargs()
    kwargs["inputs"][1:3] = [k, v]
    if kp is not None:
        kwargs["inputs"][4] = kp
    return kernel(**kwargs)[0]


def alone(args, i: int):
    """Query i of a causal case, alone over the keys it sees."""
    q, k, v, scale, causal, qp, kp = args
    n = k.shape[2] - q.shape[2] + i + 1
    return (q[:, :, i : i + 1], k[:, :, :n], v[:, :, :n], scale, causal,
            None if qp is None else qp[:, :, i : i + 1], None if kp is None else kp[:, :, :n])


@pytest.fixture(scope="module")
def kernels():
    ks = {d: emu_kernel(A, dialect=d) for d in DIALECTS}
    calls = [compile_call(A.launch_spec(*A.make_case(**c))) for c in CASES.values()]
    calls.append(compile_call(A.launch_spec(*A.make_case(**CASES["gqa"]), live=LIVE)))
    precompile([(ks[d], calls) for d in DIALECTS])
    return ks


@pytest.mark.parametrize("dialect", DIALECTS)
@pytest.mark.parametrize("name", CASES)
def test_queries_are_bit_identical_to_one_query_launches_over_cache_views(kernels, dialect, name):
    k = kernels[dialect]
    args = views(A.make_case(**CASES[name], seed=3))
    out = launch(k, args)
    assert not np.isnan(out.astype(np.float32)).any()  # nothing read past the view
    for i in range(args[0].shape[2]):
        np.testing.assert_array_equal(launch(k, alone(args, i))[:, :, 0], out[:, :, i], err_msg=f"query {i}")
    q, kk, vv, scale, causal, qp, kp = args
    ref = A.attention_reference(q, mx.array(kk), mx.array(vv), scale, causal, qp, None if kp is None else mx.array(kp))
    tol = 1e-5 if q.dtype == mx.float32 else 2e-3
    np.testing.assert_allclose(out.astype(np.float32), np.array(ref.astype(mx.float32)), rtol=tol, atol=tol)


@pytest.mark.parametrize("dialect", DIALECTS)
def test_keys_per_iteration_do_not_change_any_bit_and_match_stock_attention(kernels, dialect):
    k = kernels[dialect]
    args = views(A.make_case(**CASES["gqa"], seed=5))
    outs = [launch(k, args, keys=kb) for kb in (1, 2, 4)]
    for o in outs[1:]:
        np.testing.assert_array_equal(o, outs[0])
    q, kk, vv, scale = args[:4]
    stock = mx.fast.scaled_dot_product_attention(q, mx.array(kk), mx.array(vv), scale=scale, mask="causal")
    np.testing.assert_allclose(outs[0], np.array(stock), rtol=1e-5, atol=1e-5)


LIVE = 2  # real queries of the "gqa" case's 6 in the fixed-row test


@pytest.mark.parametrize("dialect", DIALECTS)
def test_pad_queries_of_a_fixed_row_pass_are_zero_and_change_no_real_row(kernels, dialect):
    """live = 2 of 6 queries: rows 0-1 are those of the full launch bit for bit; rows 2-5 are zeros, and the
    keys only pad queries see (the last 4) are never read (NaN there would show in the real rows)."""
    q, kk, vv, scale, causal, qp, kp = args = views(A.make_case(**CASES["gqa"], seed=4))
    full = launch(kernels[dialect], args)
    kn, vn = kk.copy(), vv.copy()
    kn[:, :, -(6 - LIVE) :] = np.nan
    vn[:, :, -(6 - LIVE) :] = np.nan
    out = launch(kernels[dialect], (q, kn, vn, scale, causal, qp, kp), live=LIVE)
    np.testing.assert_array_equal(out[:, :, :LIVE], full[:, :, :LIVE])
    assert (out[:, :, LIVE:] == 0).all()
    ref = A.attention_reference(q, mx.array(kn), mx.array(vn), scale, causal, live=LIVE)
    np.testing.assert_array_equal(np.array(ref[:, :, :LIVE]), np.array(A.attention_reference(q, mx.array(kk), mx.array(vv), scale, causal)[:, :, :LIVE]))
    assert (np.array(ref[:, :, LIVE:]) == 0).all()


LENS = [40, 17, 29]  # key counts of the 3 sequences of the batch test (a batch cache's row lengths)


@pytest.mark.parametrize("dialect", DIALECTS)
@pytest.mark.parametrize("dp", [0, 32])
def test_sequences_of_a_batch_each_see_only_their_own_keys(kernels, dialect, dp):
    """lens = 40, 17, 29 over a 40-key batch cache: each sequence's rows are bit for bit its launch alone
    over its own keys, and nothing past them is read (NaN there would show)."""
    case = dict(B=3, Hq=4, Hk=2, L=3, N=40, D=64, DP=dp)
    q, kk, vv, scale, causal, qp, kp = views(A.make_case(**case, seed=11))
    for b, n in enumerate(LENS):
        for t in (kk, vv) + ((kp,) if kp is not None else ()):
            t[b, :, n:] = np.nan
    out = launch(kernels[dialect], (q, kk, vv, scale, causal, qp, kp), lens=LENS)
    assert not np.isnan(out).any()
    for b, n in enumerate(LENS):
        one = (q[b : b + 1], kk[b : b + 1, :, :n], vv[b : b + 1, :, :n], scale, causal,
               None if qp is None else qp[b : b + 1], None if kp is None else kp[b : b + 1, :, :n])
        np.testing.assert_array_equal(out[b : b + 1], launch(kernels[dialect], one), err_msg=f"sequence {b}")
    ref = A.attention_reference(q, mx.array(kk), mx.array(vv), scale, causal, qp, None if kp is None else mx.array(kp),
                                lens=LENS)
    np.testing.assert_allclose(out, np.array(ref), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError):
        A.launch_spec(q, mx.array(kk), mx.array(vv), scale, causal, lens=LENS[:2])  # a count per sequence
    with pytest.raises(ValueError):
        A.launch_spec(q, mx.array(kk), mx.array(vv), scale, causal, lens=[40, 2, 29])  # 3 causal queries over 2 keys


def test_metal_and_cuda_twins_compute_the_same_bits(kernels):
    args = views(A.make_case(**CASES["mla"], seed=7))
    np.testing.assert_array_equal(launch(kernels["metal"], args), launch(kernels["cuda"], args))


def test_non_causal_queries_see_every_key(kernels):
    q, kk, vv, scale, _, qp, kp = A.make_case(**CASES["gqa"], seed=8)
    args = views((q, kk, vv, scale, False, qp, kp))
    out = launch(kernels["metal"], args)
    ref = A.attention_reference(q, kk, vv, scale, False)
    np.testing.assert_allclose(out, np.array(ref), rtol=1e-5, atol=1e-5)


def test_supported_shapes_and_launch_checks():
    q, k, v, scale, causal, qp, kp = A.make_case(**CASES["gqa"])
    assert A.supported(q, k, v)
    assert not A.supported(q[..., :40], k[..., :40], v)  # head dim not a multiple of 32
    assert not A.supported(mx.zeros((1, 4, 17, 64)), k, v)  # more queries than a verify pass
    with pytest.raises(ValueError):
        A.launch_spec(q, k[:, :, :3], v[:, :, :3], scale, True)  # 6 causal queries over 3 keys
    spec = A.launch_spec(q, k, v, scale, True)
    sg = A.warps_for(v.shape[-1])
    assert spec.grid == (32 * sg, 6, 4) and spec.threadgroup == (32 * sg, 1, 1)
    assert A.warps_for(512) * 512 * 4 <= 16 * 1024  # MLA's partials stay within Apple's threadgroup memory


@pytest.mark.parametrize("dialect", DIALECTS)
def test_the_registry_probe_accepts_the_emulated_kernel(kernels, dialect):
    from mlx_engine import kernels as registry

    assert registry._probe(registry._op("batch_attention"), emulated(kernels[dialect], A.launch_spec)) is None
