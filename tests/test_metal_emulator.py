"""The Metal kernel bodies in metal_kernels/, run on the CPU through the emulator (metal_kernels/emu).

Each kernel is replayed with exactly the launch its MLX wrapper would issue (`launch_spec`) and compared
with its plain-MLX reference; the first part checks the emulator itself (SIMD functions, threadgroup
memory and barriers, non-uniform threadgroups, error detection, half / bfloat16). The CUDA twins (.cu)
run through the same emulator (cuda_emu.h: blocks = threadgroups, warps = SIMD groups, full blocks
launched as MLX's CUDA backend does), so their logic is checked here too; NVRTC compilation is not.
Everything is compiled once per session (one g++ call per kernel, in parallel, cached by source hash).
"""

from __future__ import annotations

import numpy as np
import pytest

import mlx.core as mx
from metal_emu_util import compile_call, emu_kernel, emulated, run
from metal_kernels.emu import EmuError, EmuKernel, compiler_available, precompile
from mlx_engine.kernels import acceptance as A
from mlx_engine.kernels import gdn_step as G

pytestmark = pytest.mark.skipif(not compiler_available(), reason="the Metal emulator needs g++")

F32 = np.float32

# ------------------------------------------------------------------------------------------------
# emulator self-test kernels
# ------------------------------------------------------------------------------------------------

SIMD_SRC = """
  uint i = thread_position_in_grid.x;
  float v = x[i];
  float r[8];
  r[0] = simd_sum(v);
  r[1] = simd_max(v);
  r[2] = simd_min(v);
  r[3] = simd_prefix_exclusive_sum(v);
  r[4] = simd_shuffle_xor(v, ushort(3));
  r[5] = simd_shuffle_down(v, ushort(2));
  r[6] = simd_shuffle_up(v, ushort(1));
  r[7] = simd_broadcast(v, ushort(5));
  for (int j = 0; j < 8; ++j) out[i * 8 + j] = r[j];
"""

TG_SRC = """
  uint tid = thread_position_in_threadgroup.x;
  uint n = threads_per_threadgroup.x;
  threadgroup float buf[256];
  buf[tid] = x[thread_position_in_grid.x];
  {BARRIER}
  out[thread_position_in_grid.x] = buf[(tid + 1) % n];
"""

ATTR_SRC = """
  uint3 g = thread_position_in_grid;
  uint3 l = thread_position_in_threadgroup;
  uint3 tg = threadgroup_position_in_grid;
  uint3 d = threads_per_threadgroup;
  uint idx = (g.z * threads_per_grid.y + g.y) * threads_per_grid.x + g.x;
  auto o = out + idx * 14;
  o[0] = g.x; o[1] = g.y; o[2] = g.z;
  o[3] = l.x; o[4] = l.y; o[5] = l.z;
  o[6] = tg.x; o[7] = tg.y; o[8] = tg.z;
  o[9] = d.x; o[10] = d.y; o[11] = d.z;
  o[12] = thread_index_in_simdgroup;
  o[13] = simdgroup_index_in_threadgroup;
"""

OOB_SRC = """
  uint i = thread_position_in_grid.x;
  out[i] = x[i + 1];
"""

DIVERGENT_SRC = """
  uint lane = thread_index_in_simdgroup;
  float v = x[lane];
  out[lane] = lane < 16 ? simd_sum(v) : simd_max(v);
"""

DEADLOCK_SRC = """
  uint lane = thread_index_in_simdgroup;
  float v = x[lane];
  if (lane < 16) {
    v = simd_sum(v);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[lane] = v;
"""

RETURN_BEFORE_BARRIER_SRC = """
  uint tid = thread_position_in_threadgroup.x;
  if (tid >= 16) return;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[tid] = x[tid];
"""

RETURN_BEFORE_SIMD_SRC = """
  uint lane = thread_index_in_simdgroup;
  if (lane >= 20) return;
  out[lane] = simd_sum(x[lane]);
"""

SMALL_FLOAT_SRC = """
  uint i = thread_position_in_grid.x;
  half p = a[i] * b[i];
  half s = p + a[i];
  out_h[i] = s;
  out_f[i] = static_cast<float>(a[i]) * static_cast<float>(b[i]);
  bfloat16_t t = c[i] * bfloat16_t(3.0f);
  out_b[i] = t;
  out_u[i] = as_type<uint>(static_cast<float>(c[i]));
"""


ATOMIC_SRC = """
  uint i = thread_position_in_grid.x;
  atomic_fetch_add_explicit(&count[0], 1, memory_order_relaxed);
  atomic_fetch_add_explicit(&count[1 + i % 3], int(x[i]), memory_order_relaxed);
  atomic_fetch_max_explicit(&count[4], int(x[i]), memory_order_relaxed);
"""


def _self_test_kernels() -> dict[str, EmuKernel]:
    k = {
        "simd": EmuKernel("simd", ["x"], ["out"], SIMD_SRC),
        "tg": EmuKernel("tg", ["x"], ["out"], TG_SRC.replace("{BARRIER}", "threadgroup_barrier(mem_flags::mem_threadgroup);")),
        "tg_nobarrier": EmuKernel("tg_nobarrier", ["x"], ["out"], TG_SRC.replace("{BARRIER}", "")),
        "attr": EmuKernel("attr", ["x"], ["out"], ATTR_SRC),
        "oob": EmuKernel("oob", ["x"], ["out"], OOB_SRC),
        "divergent": EmuKernel("divergent", ["x"], ["out"], DIVERGENT_SRC),
        "deadlock": EmuKernel("deadlock", ["x"], ["out"], DEADLOCK_SRC),
        "ret_barrier": EmuKernel("ret_barrier", ["x"], ["out"], RETURN_BEFORE_BARRIER_SRC),
        "ret_simd": EmuKernel("ret_simd", ["x"], ["out"], RETURN_BEFORE_SIMD_SRC),
        "small_float": EmuKernel(
            "small_float", ["a", "b", "c"], ["out_h", "out_f", "out_b", "out_u"], SMALL_FLOAT_SRC
        ),
        "atomic": EmuKernel("atomic", ["x"], ["count"], ATOMIC_SRC, atomic_outputs=True),
        "atomic_os": EmuKernel("atomic_os", ["x"], ["count"], ATOMIC_SRC, atomic_outputs=True, os_threads=True),
    }
    return k


# ------------------------------------------------------------------------------------------------
# kernel cases: built once, small
# ------------------------------------------------------------------------------------------------


def _greedy_cases() -> list[tuple[str, tuple, int]]:
    rng = np.random.default_rng(0)
    V, k = 1000, 4  # V is not a multiple of any threadgroup size used
    logits = mx.array(rng.standard_normal((k + 1, V)).astype(F32))
    best = np.array(mx.argmax(logits, axis=-1))
    ok = mx.array(best[:k].astype(np.int32))
    cases = [
        ("all_accepted", (logits, ok, None, None, None, True), 64),
        ("none_accepted", (logits, mx.array(((best[:k] + 1) % V).astype(np.int32)), None, None, None, True), 64),
        ("mismatch_at_2", (logits, mx.array(np.r_[best[:2], (best[2:k] + 7) % V].astype(np.int32)), None, None, None, True), 96),
        ("k0", (logits[:1], mx.zeros((0,), mx.int32), None, None, None, True), 64),
    ]
    # ties: equal maxima spread over threads and SIMD groups; the lowest index must win
    t = rng.standard_normal((3, V)).astype(F32)
    for row, idx in enumerate([(900, 37, 5), (97, 33), (70, 40, 999)]):
        t[row, list(idx)] = 10.0
    tied = mx.array(t)
    cases.append(("ties", (tied, mx.array([5, 33], mx.int32), None, None, None, True), 64))
    cases.append(("ties_96", (tied, mx.array([5, 33], mx.int32), None, None, None, True), 96))
    # -inf everywhere but a few entries (top-k masked logits), and a row that is entirely -inf
    masked = np.full((2, V), -np.inf, F32)
    masked[0, [3, 500]] = [1.0, 2.0]
    cases.append(("masked_rows", (mx.array(masked), mx.array([500], mx.int32), None, None, None, True), 64))
    cases.append(("all_neg_inf_row", (mx.array(masked[1:]), mx.zeros((0,), mx.int32), None, None, None, True), 64))
    # V smaller than the threadgroup, half-precision logits
    small = mx.array(rng.standard_normal((3, 40)).astype(F32)).astype(mx.float16)
    cases.append(("small_V_fp16", (small, mx.argmax(small[:2], axis=-1).astype(mx.int32), None, None, None, True), 64))
    return cases


def _sampled_cases() -> list[tuple[str, tuple, int]]:
    rng = np.random.default_rng(1)
    V, k = 1000, 4
    p = mx.softmax(mx.array(rng.standard_normal((k + 1, V)).astype(F32)) * 3.0, axis=-1)
    q = mx.softmax(mx.array(rng.standard_normal((k, V)).astype(F32)) * 3.0, axis=-1)
    d = mx.argmax(q, axis=-1).astype(mx.int32)
    lo, hi = mx.full((k,), 1e-6), mx.full((k,), 0.999999)
    cases = []
    for i, s in enumerate([0.0, 0.137, 0.5, 0.93]):
        cases.append((f"q_all_accepted_{i}", (p, d, q, lo, mx.array(s), False), 64))
        cases.append((f"q_none_accepted_{i}", (p, d, q, hi, mx.array(s), False), 96))
        cases.append((f"det_all_accepted_{i}", (p, d, None, lo, mx.array(s), False), 64))
    u = mx.array(rng.uniform(size=(16, k)).astype(F32))
    for i in range(16):
        s = mx.array(F32(rng.uniform()))
        cases.append((f"q_random_{i}", (p, d, q, u[i], s, False), 64))
        cases.append((f"det_random_{i}", (p, d, None, u[i], s, False), 96))
    # dyadic probabilities: partial sums exact in any order
    pd, qd = A.dyadic_probs(V, k + 1, 3), A.dyadic_probs(V, k, 4)
    dd = mx.argmax(pd[:k], axis=-1).astype(mx.int32)
    for i, s in enumerate([0.01, 0.5, 0.99]):
        cases.append((f"dyadic_q_{i}", (pd, dd, qd, mx.array([0.5, 0.5, 0.999, 0.1]), mx.array(s), False), 64))
        cases.append((f"dyadic_det_{i}", (pd, dd, None, mx.array([0.001, 0.002, 0.999, 0.1]), mx.array(s), False), 96))
    cases.append(("k0", (p[:1], mx.zeros((0,), mx.int32), None, mx.zeros((0,)), mx.array(0.42), False), 64))
    # empty residual (q = 2p, rejected): the token comes from p_n itself
    cases.append(("empty_residual", (p[:2], d[:1], 2.0 * p[:1], mx.array([0.7]), mx.array(0.3), False), 64))
    # all-zero row: token 0
    cases.append(("zero_row", (mx.zeros((1, 100)), mx.zeros((0,), mx.int32), None, mx.zeros((0,)), mx.array(0.5), False), 64))
    # V smaller than the threadgroup (threads with empty chunks)
    ps = mx.softmax(mx.array(rng.standard_normal((3, 40)).astype(F32)), axis=-1)
    cases.append(("small_V", (ps, mx.array([1, 2], mx.int32), ps[:2][:, ::-1], mx.array([0.3, 0.9]), mx.array(0.6), False), 96))
    return cases


ACC_CASES = _greedy_cases() + _sampled_cases()
GDN_CASES = [
    ("gqa", G.make_case(1, 4, 2, 4, 64, 6, seed=11)),
    ("vector_gate", G.make_case(2, 3, 1, 2, 32, 5, seed=12, vector_gate=True)),
    ("single_token", G.make_case(1, 1, 1, 1, 32, 4, seed=13)),
]
@pytest.fixture(scope="module")
def emu():
    selftest = _self_test_kernels()
    acc, gdn = emu_kernel(A), emu_kernel(G)
    acc_cu, gdn_cu = (emu_kernel(m, dialect="cuda") for m in (A, G))
    acc_os = emu_kernel(A, os_threads=True)
    tg_os = EmuKernel("tg_os", ["x"], ["out"], selftest["tg"].source, os_threads=True)

    x32 = np.zeros(4, F32)
    special = ("attr", "small_float", "atomic", "atomic_os")
    jobs = [(k, [dict(inputs=[x32], output_dtypes=[F32])]) for n, k in selftest.items() if n not in special]
    jobs += [(selftest[n], [dict(inputs=[x32], output_dtypes=[np.int32])]) for n in ("atomic", "atomic_os")]
    jobs.append((selftest["attr"], [dict(inputs=[x32], output_dtypes=[np.uint32])]))
    h = np.zeros(4, np.float16)
    jobs.append(
        (
            selftest["small_float"],
            [dict(inputs=[h, h, mx.zeros((4,), mx.bfloat16)], output_dtypes=[np.float16, F32, "bfloat16", np.uint32])],
        )
    )
    acc_calls = [compile_call(A.launch_spec(*args, threads=t)) for _, args, t in ACC_CASES]
    acc_calls += [compile_call(A.launch_spec(*args)) for args in A.probe_cases()]  # default threads
    jobs.append((acc, acc_calls))
    jobs.append((acc_cu, acc_calls))
    acc_os_calls = [compile_call(A.launch_spec(*args, threads=t)) for _, args, t in ACC_CASES if t == 64]
    jobs.append((acc_os, acc_os_calls))
    jobs.append((tg_os, [dict(inputs=[x32], output_dtypes=[F32])]))
    gcalls = [compile_call(G.launch_spec(*args)) for _, args in GDN_CASES]
    gcalls += [compile_call(G.launch_spec(*args)) for args in G.probe_cases()]
    jobs.append((gdn, gcalls))
    jobs.append((gdn_cu, gcalls))
    precompile(jobs)
    return dict(
        selftest, acc=acc, gdn=gdn, acc_cu=acc_cu, gdn_cu=gdn_cu, acc_os=acc_os, tg_os=tg_os
    )


DIALECTS = pytest.mark.parametrize("dialect", ["metal", "cuda"])


def _k(emu, name, dialect):
    return emu[name + ("_cu" if dialect == "cuda" else "")]


# ------------------------------------------------------------------------------------------------
# the emulator itself
# ------------------------------------------------------------------------------------------------


def test_simd_functions_over_full_and_partial_simdgroups(emu):
    n = 48  # SIMD group 0: 32 lanes; SIMD group 1: 16 active lanes
    x = np.random.default_rng(0).integers(-50, 50, n).astype(F32)  # integers: sums are exact
    (out,) = emu["simd"](inputs=[x], output_shapes=[(n, 8)], output_dtypes=[F32], grid=(n, 1, 1), threadgroup=(n, 1, 1))
    for sg, (lo, hi) in enumerate([(0, 32), (32, 48)]):
        v = x[lo:hi]
        m = hi - lo
        for lane in range(m):
            row = out[lo + lane]
            assert row[0] == v.sum() and row[1] == v.max() and row[2] == v.min()
            assert row[3] == v[:lane].sum()
            assert row[4] == v[lane ^ 3]
            if lane + 2 < m:
                assert row[5] == v[lane + 2]
            elif lane + 2 >= 32:
                assert row[5] == v[lane]  # Metal leaves the upper lanes unchanged
            else:
                assert np.isnan(row[5])  # reading an inactive lane: poison
            assert row[6] == (v[lane - 1] if lane >= 1 else v[lane])
            assert row[7] == v[5]


@pytest.mark.parametrize("schedule", ["forward", "reverse", "random"])
def test_threadgroup_memory_and_barrier_under_every_schedule(emu, schedule):
    n = 100  # threadgroups of 40, 40 and a partial 20 (non-uniform dispatch)
    x = np.arange(n, dtype=F32) + 1
    (out,) = emu["tg"](inputs=[x], output_shapes=[(n,)], output_dtypes=[F32], grid=(n, 1, 1), threadgroup=(40, 1, 1), schedule=schedule, seed=7)
    want = np.concatenate([np.roll(x[i : i + 40], -1) for i in range(0, n, 40)])
    np.testing.assert_array_equal(out, want)


def test_missing_barrier_is_exposed_by_the_schedules(emu):
    n = 64
    x = np.arange(n, dtype=F32) + 1
    for schedule in ("forward", "reverse"):
        (out,) = emu["tg_nobarrier"](inputs=[x], output_shapes=[(n,)], output_dtypes=[F32], grid=(n, 1, 1), threadgroup=(n, 1, 1), schedule=schedule)
        # threadgroup memory starts as poison: a read before the writer ran shows up as NaN
        assert np.isnan(out).any(), schedule


def test_os_thread_backend_agrees(emu):
    n = 100
    x = np.arange(n, dtype=F32) * 0.5
    (fib,) = emu["tg"](inputs=[x], output_shapes=[(n,)], output_dtypes=[F32], grid=(n, 1, 1), threadgroup=(40, 1, 1))
    (osr,) = emu["tg_os"](inputs=[x], output_shapes=[(n,)], output_dtypes=[F32], grid=(n, 1, 1), threadgroup=(40, 1, 1))
    np.testing.assert_array_equal(fib, osr)


def test_thread_attributes_follow_dispatch_threads(emu):
    grid, tgs = (70, 3, 2), (32, 2, 1)
    total = int(np.prod(grid))
    (out,) = emu["attr"](inputs=[np.zeros(1, F32)], output_shapes=[(total, 14)], output_dtypes=[np.uint32], grid=grid, threadgroup=tgs)
    for z in range(grid[2]):
        for y in range(grid[1]):
            for x in range(grid[0]):
                g = (x // tgs[0], y // tgs[1], z // tgs[2])
                l = (x % tgs[0], y % tgs[1], z % tgs[2])
                d = tuple(min(tgs[i], grid[i] - g[i] * tgs[i]) for i in range(3))  # partial edge groups
                linear = l[0] + l[1] * d[0] + l[2] * d[0] * d[1]
                want = [x, y, z, *l, *g, *d, linear % 32, linear // 32]
                got = out[(z * grid[1] + y) * grid[0] + x]
                assert list(got) == want, (x, y, z)


def test_errors_are_reported(emu):
    x = np.arange(32, dtype=F32)
    call = dict(inputs=[x], output_shapes=[(32,)], output_dtypes=[F32], grid=(32, 1, 1), threadgroup=(32, 1, 1))
    with pytest.raises(EmuError, match="out-of-bounds access to 'x'"):
        emu["oob"](**call)
    with pytest.raises(EmuError, match="divergent"):
        emu["divergent"](**call)
    with pytest.raises(EmuError, match="deadlock"):
        emu["deadlock"](**call)
    with pytest.raises(EmuError, match="threadgroup_barrier"):
        emu["ret_barrier"](**call)
    # returning before a SIMD function is legal: the returned lanes are inactive
    (out,) = emu["ret_simd"](**call)
    assert np.all(out[:20] == x[:20].sum()) and np.isnan(out[20:]).all()


@pytest.mark.parametrize("which", ["atomic", "atomic_os"])
def test_relaxed_atomics(emu, which):
    n = 200  # threadgroups of 64: several groups, OS threads really concurrent in "atomic_os"
    x = (np.arange(n) % 17).astype(F32)
    (out,) = emu[which](inputs=[x], output_shapes=[(5,)], output_dtypes=[np.int32], grid=(n, 1, 1), threadgroup=(64, 1, 1), init_value=0)
    want = [n] + [int(x[np.arange(n) % 3 == r].sum()) for r in range(3)] + [16]
    assert out.tolist() == want


def test_half_and_bfloat16_rounding(emu):
    rng = np.random.default_rng(3)
    a = rng.standard_normal(64).astype(np.float16)
    b = rng.standard_normal(64).astype(np.float16)
    c = mx.array(rng.standard_normal(64).astype(F32)).astype(mx.bfloat16)
    out_h, out_f, out_b, out_u = emu["small_float"](
        inputs=[a, b, c],
        output_shapes=[(64,)] * 4,
        output_dtypes=[np.float16, F32, "bfloat16", np.uint32],
        grid=(64, 1, 1),
        threadgroup=(64, 1, 1),
    )
    np.testing.assert_array_equal(out_h, (a * b) + a)  # numpy rounds every float16 op, as Metal half
    np.testing.assert_array_equal(out_f, a.astype(F32) * b.astype(F32))
    want_b = np.array((c * mx.array(3.0, mx.bfloat16)).view(mx.uint16))
    np.testing.assert_array_equal(out_b, want_b)
    np.testing.assert_array_equal(out_u, np.array(c.astype(mx.float32)).view(np.uint32))


# ------------------------------------------------------------------------------------------------
# fused acceptance
# ------------------------------------------------------------------------------------------------


@DIALECTS
@pytest.mark.parametrize("name,args,threads", ACC_CASES, ids=[c[0] + ("_greedy" if c[1][-1] else "_sampled") for c in ACC_CASES])
def test_acceptance_kernel_matches_reference(emu, dialect, name, args, threads):
    (out,) = run(_k(emu, "acc", dialect), A.launch_spec(*args, threads=threads))
    ref = A.accept_reference(*args).tolist()
    assert out.tolist() == ref


def test_acceptance_edge_cases_hit_what_they_claim():
    by_name = {c[0] + str(c[1][-1]): c[1] for c in ACC_CASES}
    k = 4
    assert A.accept_reference(*by_name["all_acceptedTrue"]).tolist()[0] == k
    assert A.accept_reference(*by_name["none_acceptedTrue"]).tolist()[0] == 0
    assert A.accept_reference(*by_name["mismatch_at_2True"]).tolist()[0] == 2
    # rows: maxima at {900, 37, 5} -> 5, {97, 33} -> 33, {70, 40, 999} -> 40 (lowest index wins)
    assert A.accept_reference(*by_name["tiesTrue"]).tolist() == [2, 40]
    assert A.accept_reference(*by_name["q_all_accepted_0False"]).tolist()[0] == k
    assert A.accept_reference(*by_name["q_none_accepted_0False"]).tolist()[0] == 0
    assert A.accept_reference(*by_name["all_neg_inf_rowTrue"]).tolist() == [0, 0]
    assert A.accept_reference(*by_name["zero_rowFalse"]).tolist() == [0, 0]
    n, tok = A.accept_reference(*by_name["empty_residualFalse"]).tolist()
    assert n == 0 and tok != -1


@DIALECTS
def test_acceptance_kernel_never_samples_a_zero_probability_token_when_chunk_offsets_round(emu, dialect):
    """Chunk offsets come from a SIMD prefix sum whose association differs from the chunk's own running
    sum: here thread 1 ends its chunk at exactly 1.0 while thread 2 starts at 1 + 2**-23. With the
    threshold at 1.0 the first value past it in thread 2 has probability 0 and must be skipped."""
    V, TG = 128, 64  # chunks of 2 values per thread
    row = np.zeros(V, F32)
    row[[0, 1, 2, 3, 5]] = [0.5, 0.5, 2.0**-24, 2.0**-24, 0.25]
    mass = F32(1.25 + 2.0**-23)  # the kernel's sum: ((0.5+0.5) + (2^-24+2^-24)) + 0.25
    s = F32(1.0) / mass
    for _ in range(8):  # the uniform whose float32 product with the mass is exactly 1.0
        if s * mass == F32(1.0):
            break
        s = np.nextafter(s, F32(2.0) if s * mass < 1 else F32(0.0), dtype=F32)
    assert s * mass == F32(1.0)
    args = (mx.array(row[None]), mx.zeros((0,), mx.int32), None, mx.zeros((0,)), mx.array(s), False)
    (out,) = run(_k(emu, "acc", dialect), A.launch_spec(*args, threads=TG))
    assert out.tolist() == [0, 5] and row[out[1]] > 0
    assert row[A.accept_reference(*args).tolist()[1]] > 0  # the reference too (it may pick token 1)


@pytest.mark.parametrize("schedule", ["reverse", "random"])
def test_acceptance_kernel_is_schedule_independent(emu, schedule):
    for name, args, threads in ACC_CASES[::5]:
        (out,) = run(emu["acc"], A.launch_spec(*args, threads=threads), schedule=schedule, seed=5)
        assert out.tolist() == A.accept_reference(*args).tolist(), name


def test_acceptance_kernel_on_os_threads(emu):
    cases = [c for c in ACC_CASES if c[2] == 64][::6]
    for name, args, threads in cases:
        (out,) = run(emu["acc_os"], A.launch_spec(*args, threads=threads))
        assert out.tolist() == A.accept_reference(*args).tolist(), name


# ------------------------------------------------------------------------------------------------
# GatedDeltaNet step with per-token states
# ------------------------------------------------------------------------------------------------


@DIALECTS
@pytest.mark.parametrize("name,args", GDN_CASES, ids=[c[0] for c in GDN_CASES])
def test_gdn_kernel_matches_reference(emu, dialect, name, args):
    y, states = run(_k(emu, "gdn", dialect), G.launch_spec(*args))
    ry, rstates = G.gdn_step_reference(*args)
    np.testing.assert_allclose(y, np.array(ry), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(states, np.array(rstates), rtol=1e-5, atol=1e-6)
    assert not np.isnan(states).any()  # every state element of every token written


@DIALECTS
def test_gdn_kernel_per_token_states_match_truncated_runs(emu, dialect):
    from mlx_lm.models.gated_delta import gated_delta_ops

    q, k, v, g, beta, state = GDN_CASES[0][1]
    _, states = run(_k(emu, "gdn", dialect), G.launch_spec(q, k, v, g, beta, state))
    T = q.shape[1]
    for t in range(T):
        _, st = gated_delta_ops(q[:, : t + 1], k[:, : t + 1], v[:, : t + 1], g[:, : t + 1], beta[:, : t + 1], state)
        np.testing.assert_allclose(states[:, t], np.array(st), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------------
# the registry's first-use probe, with the emulated kernels standing in for the GPU
# ------------------------------------------------------------------------------------------------


@DIALECTS
@pytest.mark.parametrize("name", ["acceptance", "gdn_step"])
def test_registry_probe_accepts_the_emulated_kernels(emu, dialect, name, monkeypatch):
    import warnings

    from mlx_engine import kernels

    short = {"acceptance": "acc", "gdn_step": "gdn"}[name]
    module = {"acceptance": A, "gdn_step": G}[name]
    fn = emulated(_k(emu, short, dialect), module.launch_spec)
    op = kernels._op(name)
    assert kernels._probe(op, fn) is None
    monkeypatch.delenv(kernels.ENV_VAR, raising=False)
    monkeypatch.setattr(kernels, "backend_available", lambda b: b in (dialect, "reference"))
    monkeypatch.setitem(op.impls, dialect, fn)
    monkeypatch.setattr(op, "sizes", None)
    kernels.reset()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert kernels.backend(name) == dialect and kernels.get(name) is fn
    finally:
        kernels.reset()


@DIALECTS
def test_registry_takes_the_largest_threadgroup_the_device_launches(emu, dialect, monkeypatch):
    """A device that allows the acceptance kernel only 256 threads per threadgroup (an NVIDIA GPU does
    when 1024 threads would need more than 64 registers each; an Apple pipeline may report a lower
    maxTotalThreadsPerThreadgroup): 1024 and 512 fail to launch, and the registry settles on 256
    without disabling the kernel or warning."""
    import warnings

    from mlx_engine import kernels

    small = emu_kernel(A, dialect=dialect, max_threads=256)
    with pytest.raises(EmuError, match="exceeds this pipeline's limit"):
        run(small, A.launch_spec(*A.probe_cases()[0], threads=1024))

    def sized(threads):
        return lambda *args: mx.array(run(small, A.launch_spec(*args, threads=threads))[0])

    fns = {t: sized(t) for t in A.THREAD_SIZES}
    op = kernels._op("acceptance")
    monkeypatch.delenv(kernels.ENV_VAR, raising=False)
    monkeypatch.setattr(kernels, "backend_available", lambda b: b in (dialect, "reference"))
    monkeypatch.setattr(op, "sizes", lambda backend: [fns[t] for t in A.THREAD_SIZES])
    kernels.reset()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert kernels.backend("acceptance") == dialect and kernels.get("acceptance") is fns[256]
    finally:
        kernels.reset()
