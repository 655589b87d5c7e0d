"""The plain-MLX references of the fused kernels (mlx_engine/kernels) and the kernel registry.

The references are the definition of correct: acceptance agrees with mlx_engine.core.verify and is lossless,
the quantized matmul is batch invariant bit for bit and close to mx.quantized_matmul, the GatedDeltaNet
step reproduces mlx-lm's gated_delta_ops and its per-token states.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

import mlx.core as mx

_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:  # a stale editable install may map metal_kernels to an empty namespace
    sys.path.insert(0, _ROOT)

import metal_kernels  # noqa: E402
from mlx_engine import kernels  # noqa: E402
from mlx_engine.core import verify  # noqa: E402
from mlx_engine.kernels import acceptance as A  # noqa: E402
from mlx_engine.kernels import batch_qmm as Q  # noqa: E402
from mlx_engine.kernels import compiled as C  # noqa: E402
from mlx_engine.kernels import gdn_step as G  # noqa: E402

F32 = np.float32


# ------------------------------------------------------------------------------------------------
# acceptance
# ------------------------------------------------------------------------------------------------


def test_accept_reference_greedy_equals_verify():
    rng = np.random.default_rng(0)
    V = 50
    seen_n = set()
    for trial in range(40):
        k = int(rng.integers(0, 7))
        # few distinct values: many ties, which both must break to the lowest index
        logits = mx.array(rng.integers(0, 6, (k + 1, V)).astype(F32))
        best = np.array(mx.argmax(logits, axis=-1))
        draft = best[:k].copy()
        if k and rng.uniform() < 0.7:
            j = int(rng.integers(0, k))
            draft[j] = (draft[j] + 1 + rng.integers(0, V - 1)) % V
        draft = mx.array(draft.astype(np.int32))
        n, nxt = A.accept_reference(logits, draft, None, None, None, True).tolist()
        packed = verify.accept_greedy(logits, draft).tolist()
        assert n == packed[0]
        assert nxt == packed[1 + n]  # verify's emitted tokens: t_0..t_n, t_n the corrected/bonus one
        seen_n.add((k, n))
    assert len({n for _, n in seen_n}) >= 4  # full accepts, partial, none


@pytest.mark.parametrize("with_q", [True, False])
def test_accept_reference_sampled_equals_verify(with_q):
    """Given the same draws, the kernels' reference and verify.py accept the same drafts and emit the same
    corrected (after a rejection) or bonus (after a full accept) token."""
    rng = np.random.default_rng(1)
    V = 30
    ns = []
    for trial in range(40):
        k = int(rng.integers(0, 6))
        p = mx.softmax(mx.array(rng.standard_normal((k + 1, V)).astype(F32)) * 2, axis=-1)
        q = mx.softmax(mx.array(rng.standard_normal((k, V)).astype(F32)) * 2, axis=-1) if k else None
        draft = mx.array(rng.integers(0, V, k).astype(np.int32)) if k else mx.zeros((0,), mx.int32)
        if k:  # drafts likely under p so that some get accepted
            draft = mx.argmax(p[:k] + 0.3 * mx.array(rng.uniform(size=(k, V)).astype(F32)), axis=-1).astype(mx.int32)
        key = mx.random.key(trial)
        u, s = A.uniforms_from_key(key, k)
        n, nxt = A.accept_reference(p, draft, q if with_q else None, u, s, False).tolist()
        packed = verify.accept_sampled(p, draft, q if with_q else None, key).tolist()
        assert n == packed[0]
        assert packed[1 : 1 + n] == draft.tolist()[:n]
        assert 0 <= nxt < V and nxt == packed[1 + n], f"k={k}, n={n}: the corrected/bonus token differs"
        ns.append((k, n))
    assert min(n for _, n in ns) == 0 and max(n for _, n in ns) >= 2
    assert any(0 < n == k for k, n in ns) and any(n < k for k, n in ns)  # bonus and corrected tokens both compared


def _first_token_distribution(p, q, x, N=120):
    """P(first emitted token) for a fixed draft x, integrating u and s over an N x N midpoint grid."""
    g = (mx.arange(N, dtype=mx.float32) + 0.5) / N
    U = mx.repeat(g, N)[:, None]
    S = mx.tile(g, N)
    d = mx.array([x], mx.int32)
    out = mx.vmap(lambda u, s: A.accept_reference(p, d, q, u, s, False), in_axes=(0, 0))(U, S)
    o = np.array(out)
    assert o.shape == (N * N, 2)
    for i in (0, N * N // 3, N * N - 1):  # vmap agrees with plain calls
        assert o[i].tolist() == A.accept_reference(p, d, q, U[i], S[i], False).tolist()
    first = np.where(o[:, 0] >= 1, x, o[:, 1])
    return np.bincount(first, minlength=p.shape[-1]) / len(first)


def test_rejection_sampling_with_inverse_cdf_is_lossless():
    p = mx.array([[0.1, 0.2, 0.3, 0.4, 0.0, 0.0], [0.25, 0.25, 0.1, 0.1, 0.3, 0.0]])
    q = mx.array([[0.4, 0.1, 0.1, 0.2, 0.2, 0.0]])
    want = np.array(p[0])
    # draft sampled from q: mix the fixed-draft distributions with weights q(x)
    mix = sum(float(q[0, x]) * _first_token_distribution(p, q, x) for x in range(6) if float(q[0, x]) > 0)
    np.testing.assert_allclose(mix, want, atol=0.02)
    # deterministic draft (q = one-hot): lossless for ANY draft token, including a zero-probability one
    for x in (3, 0, 5):
        dist = _first_token_distribution(p, None, x)
        np.testing.assert_allclose(dist, want, atol=0.02)
        assert dist[4] == 0 and dist[5] == 0  # never a zero-probability token


def test_inverse_cdf_picks_tokens_in_proportion_and_never_zero_mass():
    row = mx.array([[0.0, 0.5, 0.0, 0.125, 0.25, 0.125, 0.0]])  # dyadic: exact CDF
    N = 64
    s = (mx.arange(N, dtype=mx.float32) + 0.5) / N
    zero = mx.zeros((0,), mx.int32)
    toks = [A.accept_reference(row, zero, None, mx.zeros((0,)), si, False).tolist()[1] for si in s]
    counts = np.bincount(toks, minlength=7) / N
    np.testing.assert_array_equal(counts, np.array(row[0]))
    # s at the extremes
    assert A.accept_reference(row, zero, None, mx.zeros((0,)), 0.0, False).tolist() == [0, 1]
    assert A.accept_reference(row, zero, None, mx.zeros((0,)), 0.9999999, False).tolist() == [0, 5]


def test_accept_reference_empty_residual_falls_back_to_target_row():
    p = mx.array([[0.0, 0.25, 0.75], [0.5, 0.5, 0.0]])
    q = 2.0 * p[:1]  # residual max(0, p - q) == 0 everywhere
    n, nxt = A.accept_reference(p, mx.array([2], mx.int32), q, mx.array([0.9]), 0.1, False).tolist()
    assert n == 0 and nxt == 1  # 0.1 * 1.0 falls in token 1's CDF step of p_0
    assert A.accept_reference(mx.zeros((1, 4)), mx.zeros((0,), mx.int32), None, mx.zeros((0,)), 0.5, False).tolist() == [0, 0]


def test_acceptance_launch_spec():
    p = mx.softmax(mx.random.normal((4, 100), key=mx.random.key(0)), axis=-1)
    d = mx.array([1, 2, 3], mx.int32)
    spec = A.launch_spec(p, d, None, mx.array([0.1, 0.2, 0.3]), 0.5, False, threads=128)
    assert spec.grid == (128, 1, 1) and spec.threadgroup == (128, 1, 1)
    assert dict(spec.template) == {"GREEDY": False, "HAS_Q": False, "TG": 128}
    assert spec.inputs[3].tolist() == pytest.approx([0.1, 0.2, 0.3, 0.5])
    assert spec.output_shapes == [(2,)] and spec.output_dtypes == [mx.int32]
    k0 = A.launch_spec(p[:1], mx.zeros((0,), mx.int32), None, None, None, True)
    assert k0.inputs[1].shape == (1,)  # never a zero-size buffer
    with pytest.raises(ValueError):
        A.launch_spec(p, d, None, None, None, True, threads=100)
    with pytest.raises(ValueError):
        A.launch_spec(p[:3], d, None, None, None, True)


# ------------------------------------------------------------------------------------------------
# batch-invariant quantized matmul
# ------------------------------------------------------------------------------------------------

QMM_CONFIGS = [(bits, gs) for bits in (4, 8) for gs in (32, 64, 128)]


@pytest.mark.cpu_exact
@pytest.mark.parametrize("bits,gs", QMM_CONFIGS)
def test_unpack_matches_mx_dequantize(bits, gs):
    W = mx.random.normal((8, 256), key=mx.random.key(bits * gs))
    w, s, b = mx.quantize(W, group_size=gs, bits=bits)
    q = Q.unpack(w, bits)
    deq = mx.repeat(s, gs, axis=1) * q + mx.repeat(b, gs, axis=1)
    assert mx.array_equal(deq, mx.dequantize(w, s, b, group_size=gs, bits=bits)).item()
    assert q.max().item() <= 2**bits - 1


@pytest.mark.parametrize("bits,gs", QMM_CONFIGS)
def test_qmm_reference_is_batch_invariant_and_close_to_quantized_matmul(bits, gs):
    x, w, s, b, gs, bits = Q.make_case(16, 640, 24, gs, bits, seed=bits + gs)  # K: 2.5 steps of 256
    y = Q.qmm_reference(x, w, s, b, gs, bits)
    for M in (1, 2, 5, 16):
        yM = Q.qmm_reference(x[:M], w, s, b, gs, bits)
        assert mx.array_equal(yM, y[:M]).item()
    for i in range(16):
        assert mx.array_equal(Q.qmm_reference(x[i : i + 1], w, s, b, gs, bits)[0], y[i]).item()
    ref = mx.quantized_matmul(x, w, s, b, transpose=True, group_size=gs, bits=bits)
    assert mx.allclose(y, ref, rtol=1e-5, atol=2e-5).item()


def test_qmm_reference_half_inputs_and_leading_dims():
    x, w, s, b, gs, bits = Q.make_case(6, 256, 10, 64, 4, seed=5, dtype=mx.float16)
    y = Q.qmm_reference(x, w, s, b, gs, bits)
    assert y.dtype == mx.float16 and y.shape == (6, 10)
    ref = mx.quantized_matmul(x.astype(mx.float32), w, s.astype(mx.float32), b.astype(mx.float32), transpose=True, group_size=gs, bits=bits)
    assert mx.allclose(y.astype(mx.float32), ref, rtol=2e-3, atol=2e-3).item()
    y3 = Q.qmm_reference(x.reshape(2, 3, 256), w, s, b, gs, bits)
    assert y3.shape == (2, 3, 10) and mx.array_equal(y3.reshape(6, 10), y).item()


def test_qmm_reference_tiles_do_not_change_bits(monkeypatch):
    x, w, s, b, gs, bits = Q.make_case(3, 512, 20, 32, 4, seed=9)
    whole = Q.qmm_reference(x, w, s, b, gs, bits)
    monkeypatch.setattr(Q, "_TILE_ELEMS", 3 * 512 * 3)  # tiles of 3 columns
    assert mx.array_equal(Q.qmm_reference(x, w, s, b, gs, bits), whole).item()


def test_qmm_launch_spec_and_argument_checks():
    x, w, s, b, gs, bits = Q.make_case(5, 256, 18, 64, 4, seed=1)
    spec = Q.launch_spec(x, w, s, b, gs, bits)
    r, sg = Q.plan(18, 256, 5)
    assert spec.grid == (32, -(-18 // r), 1) and spec.threadgroup == (32, sg, 1)  # R columns per warp
    assert spec.output_shapes == [(5, 18)]
    spec = Q.launch_spec(x, w, s, b, gs, bits, cols=3, warps=2)
    assert spec.grid == (32, 6, 1) and spec.threadgroup == (32, 2, 1) and dict(spec.template)["R"] == 3
    with pytest.raises(ValueError):
        Q.launch_spec(mx.concatenate([x] * 4), w, s, b, gs, bits)  # 20 rows > 16
    with pytest.raises(ValueError):
        Q.qmm_reference(x, w, s, b, gs, 3)
    with pytest.raises(ValueError):
        Q.qmm_reference(x[:, :200], w, s, b, gs, bits)


# ------------------------------------------------------------------------------------------------
# GatedDeltaNet step with per-token states
# ------------------------------------------------------------------------------------------------

GDN_SHAPES = [
    dict(B=1, T=5, Hk=2, Hv=4, Dk=64, Dv=16, vector_gate=False),
    dict(B=2, T=3, Hk=2, Hv=2, Dk=32, Dv=8, vector_gate=True),
    dict(B=1, T=1, Hk=1, Hv=3, Dk=48, Dv=5, vector_gate=False),
]


@pytest.mark.parametrize("shape", GDN_SHAPES, ids=lambda s: f"B{s['B']}T{s['T']}Hk{s['Hk']}Hv{s['Hv']}Dk{s['Dk']}{'vec' if s['vector_gate'] else ''}")
def test_gdn_reference_matches_gated_delta_ops_and_truncations(shape):
    from mlx_lm.models.gated_delta import gated_delta_ops

    s = dict(shape)
    vec = s.pop("vector_gate")
    q, k, v, g, beta, state = G.make_case(**s, seed=3, vector_gate=vec)
    y, states = G.gdn_step_reference(q, k, v, g, beta, state)
    T = q.shape[1]
    assert y.shape == v.shape and states.shape == (s["B"], T, s["Hv"], s["Dv"], s["Dk"])
    ry, rstate = gated_delta_ops(q, k, v, g, beta, state)
    assert mx.allclose(y, ry, rtol=1e-5, atol=1e-6).item()
    assert mx.allclose(states[:, -1], rstate, rtol=1e-5, atol=1e-6).item()
    for t in range(T):
        _, st = gated_delta_ops(q[:, : t + 1], k[:, : t + 1], v[:, : t + 1], g[:, : t + 1], beta[:, : t + 1], state)
        assert mx.allclose(states[:, t], st, rtol=1e-5, atol=1e-6).item()


def test_gdn_reference_default_state_and_launch_spec():
    q, k, v, g, beta, _ = G.make_case(1, 2, 1, 2, 32, 4, seed=0)
    y0, s0 = G.gdn_step_reference(q, k, v, g, beta)
    y1, s1 = G.gdn_step_reference(q, k, v, g, beta, mx.zeros((1, 2, 4, 32)))
    assert mx.array_equal(y0, y1).item() and mx.array_equal(s0, s1).item()
    spec = G.launch_spec(q, k, v, g, beta)
    assert spec.grid == (32, 4, 2) and spec.threadgroup == (32, G.ROWS_PER_THREADGROUP, 1)
    assert spec.output_shapes == [(1, 2, 2, 4), (1, 2, 2, 4, 32)]
    with pytest.raises(ValueError):
        G.launch_spec(*G.make_case(1, 2, 1, 1, 48, 4, seed=0))


# ------------------------------------------------------------------------------------------------
# registry
# ------------------------------------------------------------------------------------------------


@pytest.fixture
def registry(monkeypatch):
    monkeypatch.delenv(kernels.ENV_VAR, raising=False)
    kernels.reset()
    added: list[str] = []
    yield added
    for name in added:
        kernels._OPS.pop(name, None)
    kernels.reset()


def _fake_op(name, impl, registry):
    ref = lambda x: x * 2  # noqa: E731
    op = kernels.Op(
        name,
        ref,
        {"metal": impl},
        probe=lambda: [(mx.arange(4, dtype=mx.float32),)],
        check=lambda out, r, args, fn: None if mx.array_equal(out, r).item() else "differs",
    )
    kernels.register(op)
    registry.append(name)
    return op


@pytest.mark.cpu_exact
def test_registry_uses_references_on_cpu(registry):
    assert set(kernels.ops()) >= {"acceptance", "batch_qmm", "gdn_step"}
    for op in ("acceptance", "batch_qmm", "gdn_step"):
        assert kernels.backend(op) == "reference"
        assert kernels.get(op) is kernels.reference(op)
    assert kernels.describe()["acceptance"] == "reference"
    with pytest.raises(KeyError):
        kernels.get("no_such_op")


def test_registry_env_var(registry, monkeypatch):
    monkeypatch.setenv(kernels.ENV_VAR, "reference")
    kernels.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kernels.backend("acceptance") == "reference"
    monkeypatch.setenv(kernels.ENV_VAR, "metal")  # not available on this machine
    kernels.reset()
    with pytest.warns(UserWarning, match="not available"):
        assert kernels.backend("acceptance") == "reference"
    monkeypatch.setenv(kernels.ENV_VAR, "tpu")
    kernels.reset()
    with pytest.raises(ValueError):
        kernels.get("acceptance")


def test_registry_disables_a_wrong_kernel_with_one_warning(registry, monkeypatch):
    calls = []

    def wrong(x):
        calls.append(1)
        return x * 2 + 1

    op = _fake_op("fake_wrong", wrong, registry)
    monkeypatch.setattr(kernels, "backend_available", lambda name: name in ("metal", "reference"))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert kernels.backend("fake_wrong") == "reference"
        assert kernels.get("fake_wrong") is op.reference
        kernels.get("fake_wrong")
    msgs = [str(x.message) for x in w if "fake_wrong" in str(x.message)]
    assert len(msgs) == 1 and "disabled" in msgs[0]
    assert len(calls) == 1  # probed once


def test_registry_keeps_a_correct_kernel_and_disables_a_crashing_one(registry, monkeypatch):
    good = lambda x: x + x  # noqa: E731

    def crash(x):
        raise RuntimeError("no Metal back-end")

    _fake_op("fake_good", good, registry)
    _fake_op("fake_crash", crash, registry)
    monkeypatch.setattr(kernels, "backend_available", lambda name: name in ("metal", "reference"))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert kernels.backend("fake_good") == "metal" and kernels.get("fake_good") is good
    assert not [x for x in w if "fake_good" in str(x.message)]
    with pytest.warns(UserWarning, match="RuntimeError: no Metal back-end"):
        assert kernels.backend("fake_crash") == "reference"


def test_registry_forced_backend_keeps_a_disagreeing_kernel(registry, monkeypatch):
    wrong = lambda x: x * 3  # noqa: E731
    _fake_op("fake_forced", wrong, registry)
    monkeypatch.setattr(kernels, "backend_available", lambda name: name in ("metal", "reference"))
    monkeypatch.setenv(kernels.ENV_VAR, "metal")
    kernels.reset()
    with pytest.warns(UserWarning, match="kept because"):
        assert kernels.get("fake_forced") is wrong


@pytest.mark.parametrize("name", ["acceptance", "batch_qmm", "gdn_step"])
def test_probes_pass_for_the_reference_itself(name):
    """The probe cases and checks are self-consistent (a kernel equal to the reference passes)."""
    op = kernels._op(name)
    assert op.probe()
    assert kernels._probe(op, op.reference) is None
    # and a perturbed implementation is caught
    def off(*args):
        out = op.reference(*args)
        if isinstance(out, tuple):
            return (out[0] + 1,) + tuple(out[1:])
        return out + 1
    assert kernels._probe(op, off) is not None


# ------------------------------------------------------------------------------------------------
# sources, compile helper, bench
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", metal_kernels.KERNELS)
def test_kernel_sources_exist_for_both_backends(name):
    metal = metal_kernels.source(name)
    cuda = metal_kernels.source(name, "cuda")
    assert metal.strip() and cuda.strip() and metal != cuda
    assert metal_kernels.source(f"{name}.cu") == cuda
    assert "threadIdx" in cuda and "__shfl_xor_sync" in cuda  # CUDA built-ins, not Metal attributes
    assert "thread_index_in_simdgroup" in metal and "simd_shuffle_xor" in metal
    with pytest.raises(FileNotFoundError):
        metal_kernels.source("nope")


def _tiny_llama():
    from mlx_lm.models import llama

    args = llama.ModelArgs(
        model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=100,
        tie_word_embeddings=True,
    )
    mx.random.seed(0)
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


def test_verify_forward_is_uncompiled_for_kv_caches_and_stays_correct():
    from mlx_lm.models.cache import make_prompt_cache

    model = _tiny_llama()
    toks = mx.array([[1, 2, 3, 4, 5, 6, 7, 8]])
    c_ref, c = make_prompt_cache(model), make_prompt_cache(model)
    assert not C.is_compilable(c)
    fwd = C.verify_forward(model, c)
    assert not isinstance(fwd, C.CompiledPerLength)
    for a, b in ((0, 4), (4, 6), (6, 8)):  # successive verify passes advance the cache
        assert mx.array_equal(fwd(toks[:, a:b]), model(toks[:, a:b], cache=c_ref)).item()
    assert [x.offset for x in c] == [8, 8]


def test_compiled_per_length_for_pure_functions():
    f = C.CompiledPerLength(lambda x: mx.softmax(x * 2.0, axis=-1), length_axis=-2)
    for L in (1, 3, 1):
        x = mx.random.normal((L, 10), key=mx.random.key(L))
        assert mx.allclose(f(x), mx.softmax(x * 2.0, axis=-1)).item()
    assert f.lengths == [1, 3]


@pytest.mark.cpu_exact
def test_bench_verify_smoke(capsys):
    from mlx_engine.bench import verify as bench_verify

    rc = bench_verify.main(["--layers", "1", "--hidden", "64", "--vocab", "500", "--max-len", "3", "--prefill", "8", "--trials", "1"])
    out = capsys.readouterr().out
    assert rc == 0
    lines = [ln.split() for ln in out.splitlines()]
    rows = [ln for ln in lines if len(ln) == 3 and ln[0] in ("1", "2", "3")]
    assert [r[0] for r in rows] == ["1", "2", "3"] and rows[0][2] == "1.00"
    assert "only the reference ops run" in out and "n/a" in out


def test_engine_with_the_fused_acceptance_path_equals_plain():
    """The engine's fused-kernel path (used on GPUs), driven here with the registry's reference op,
    gives mlx-lm's greedy output and a sampled run reproducible per seed."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    import tiny_models
    from mlx_engine import DraftModelDrafter, Engine, GenerationConfig, SamplingConfig
    from mlx_engine import kernels as registry
    from test_greedy_equality import PROMPT, noisy_copy, plain, target

    engine = Engine(target("llama"), DraftModelDrafter(noisy_copy("llama"), tiny_models.VOCAB))
    engine._fused_accept = registry.reference("acceptance")
    out = [t for s in engine.generate(PROMPT, GenerationConfig(max_tokens=64, num_draft=3)) for t in s.tokens]
    assert out == plain("llama") and 0 < engine.stats.accepted < engine.stats.drafted
    cfg = GenerationConfig(max_tokens=32, num_draft=3, sampling=SamplingConfig(temperature=1.0), seed=5)
    runs = [[t for s in engine.generate(PROMPT, cfg) for t in s.tokens] for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 32
