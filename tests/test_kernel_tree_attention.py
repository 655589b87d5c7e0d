"""The batch-invariant attention kernel over a token tree's verify pass (`tree`: which of the pass's rows
each query sees), Metal body and CUDA twin on the CPU emulator, and the reference.

A tree row must be bit for bit the single decode step at its position: a 1-query launch over the cache's
keys followed by its path's keys (its ancestors, then itself), which is what the row would see had the
path been decoded token by token. Keys of other branches are never read (NaN there would show).
"""

from __future__ import annotations

import random

import numpy as np
import pytest

import mlx.core as mx
from metal_emu_util import compile_call, emu_kernel
from metal_kernels.emu import compiler_available, precompile
from mlx_engine.drafters.tree_draft import host_ancestors
from mlx_engine.kernels import batch_attention as A
from test_kernel_attention import DIALECTS, launch, views

pytestmark = pytest.mark.skipif(not compiler_available(), reason="the Metal emulator needs g++")

CASES = {
    "gqa": dict(B=1, Hq=4, Hk=2, L=7, N=45, D=64),
    "mla": dict(B=1, Hq=2, Hk=1, L=5, N=13, D=64, DV=64, DP=32),
}
PARENTS = {"gqa": [-1, -1, 0, 1, 0, 3], "mla": [-1, 0, -1, 2]}  # the tree's nodes (rows 1..L-1; row 0 the root)


def bits_of(parents) -> list[int]:
    return A.tree_bits(host_ancestors(parents))


@pytest.fixture(scope="module")
def kernels():
    ks = {d: emu_kernel(A, dialect=d) for d in DIALECTS}
    calls = []
    for name, c in CASES.items():
        case = A.make_case(**c)
        calls.append(compile_call(A.launch_spec(*case, tree=bits_of(PARENTS[name]))))
        calls.append(compile_call(A.launch_spec(*case)))  # the 1-query launches (causal, no tree)
    precompile([(ks[d], calls) for d in DIALECTS])
    return ks


def path_keys(args, bits: int):
    """The keys (and values, rope keys) a query with tree bits `bits` sees, gathered in order, contiguous."""
    q, k, v, scale, causal, qp, kp = args
    L, N = q.shape[2], k.shape[2]
    idx = list(range(N - L)) + [N - L + t for t in range(L) if (bits >> t) & 1]
    take = lambda a: None if a is None else np.ascontiguousarray(np.asarray(a)[:, :, idx])  # noqa: E731
    return take(k), take(v), take(kp)


@pytest.mark.parametrize("dialect", DIALECTS)
@pytest.mark.parametrize("name", CASES)
def test_tree_rows_are_bit_identical_to_single_steps_over_their_paths(kernels, dialect, name):
    kern = kernels[dialect]
    args = views(A.make_case(**CASES[name], seed=13))
    q, k, v, scale, causal, qp, kp = args
    bits = bits_of(PARENTS[name])
    out = launch(kern, args, tree=bits)
    assert not np.isnan(out.astype(np.float32)).any()  # nothing read past the view
    for i, b in enumerate(bits):
        kk, vv, kpp = path_keys(args, b)
        one = (q[:, :, i : i + 1], kk, vv, scale, True, None if qp is None else qp[:, :, i : i + 1], kpp)
        np.testing.assert_array_equal(launch(kern, one)[:, :, 0], out[:, :, i], err_msg=f"row {i}")
    ref = A.attention_reference(q, mx.array(k), mx.array(v), scale, True, qp, None if kp is None else mx.array(kp),
                                tree=bits)
    np.testing.assert_allclose(out, np.array(ref), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dialect", DIALECTS)
def test_keys_of_other_branches_are_never_read(kernels, dialect):
    """For the last row, every tree row off its path is NaN: its bits do not change."""
    args = views(A.make_case(**CASES["gqa"], seed=14))
    q, k, v, scale, causal, qp, kp = args
    bits = bits_of(PARENTS["gqa"])
    full = launch(kernels[dialect], args, tree=bits)
    L, N = q.shape[2], k.shape[2]
    kn, vn = k.copy(), v.copy()
    off = [N - L + t for t in range(L) if not (bits[-1] >> t) & 1]
    kn[:, :, off], vn[:, :, off] = np.nan, np.nan
    out = launch(kernels[dialect], (q, kn, vn, scale, causal, qp, kp), tree=bits)
    np.testing.assert_array_equal(out[:, :, -1], full[:, :, -1])


def test_the_reference_rows_are_single_query_references_over_their_paths():
    """Bit for bit by construction (each row over its gathered keys), for random trees, batch rows of other
    lengths (lens) and fixed-row pad queries (live)."""
    rng = random.Random(0)
    for trial in range(6):
        L = rng.randrange(2, 9)
        parents = [rng.randrange(-1, i) for i in range(L - 1)]
        bits = bits_of(parents)
        q, k, v, scale, _, qp, kp = A.make_case(2, 4, 2, L, 30, 32, DP=rng.choice([0, 32]), seed=trial)
        lens = [30, rng.randrange(L, 30)]
        live = rng.randrange(1, L + 1)
        out = A.attention_reference(q, k, v, scale, True, qp, kp, lens=lens, live=live, tree=bits)
        for b, nk in enumerate(lens):
            for i in range(L):
                if i >= live:
                    assert (np.array(out[b, :, i]) == 0).all()
                    continue
                idx = mx.array(list(range(nk - L)) + [nk - L + t for t in range(L) if (bits[i] >> t) & 1])
                one = A.attention_reference(q[b : b + 1, :, i : i + 1], mx.take(k[b : b + 1], idx, axis=2),
                                            mx.take(v[b : b + 1], idx, axis=2), scale, True,
                                            None if qp is None else qp[b : b + 1, :, i : i + 1],
                                            None if kp is None else mx.take(kp[b : b + 1], idx, axis=2))
                assert mx.array_equal(one[0, :, 0], out[b, :, i]).item(), (trial, b, i)


def test_a_tree_row_that_sees_a_later_row_is_refused():
    q, k, v, scale, causal, qp, kp = A.make_case(**CASES["gqa"])
    with pytest.raises(ValueError, match="only earlier rows"):
        A.launch_spec(q, k, v, scale, True, tree=[1, 0b111, 0b101, 0b1001, 0b10001, 0b100001, 0b1000001])  # row 1 sees row 2
    with pytest.raises(ValueError, match="must see itself"):
        A.launch_spec(q, k, v, scale, True, tree=[1, 1, 0b101, 0b1001, 0b10001, 0b100001, 0b1000001])
    with pytest.raises(ValueError, match="tree rows"):
        A.launch_spec(q, k, v, scale, True, tree=[1, 3])


@pytest.mark.slow  # ~100 emulated launches
def test_a_model_s_tree_rows_through_the_emulated_kernel_are_its_decode_steps(monkeypatch):
    """A batch-invariant model whose attention runs the emulated Metal kernel (as on a Mac): every row of a
    tree pass (one kernel launch told the tree) is bit for bit the decode steps along its path (each a
    1-query launch)."""
    from metal_emu_util import emulated
    from mlx_engine import Engine
    from mlx_engine import kernels as registry
    from mlx_engine.drafters.tree_draft import host_depths
    from mlx_engine.target_model import tree_cache
    from mlx_engine.target_model.model import Target
    import tiny_models
    from test_kv_quant import WIDE

    launched = emulated(emu_kernel(A, dialect="metal"), A.launch_spec)
    trees = []

    def kernel(*args, **kw):
        trees.append(kw.get("tree"))
        return launched(*args, **kw)

    get, backend = registry.get, registry.backend
    monkeypatch.setattr(registry, "backend", lambda name: "metal" if name == "batch_attention" else backend(name))
    monkeypatch.setattr(registry, "get", lambda name: kernel if name == "batch_attention" else get(name))
    model = tiny_models.build("llama", seed=1, **WIDE)[0]  # head dim 32: the kernel's shapes
    Engine(model, batch_invariant=True)
    t = Target(model)
    tree_cache.install(model)
    assert tree_cache.install_invariant(model) is None
    prompt, parents, tokens = [3, 17, 42, 9, 128, 77], [-1, -1, 0, 2], [5, 9, 17, 42]
    anc = host_ancestors(parents)
    cache = t.make_cache()
    t.forward(mx.array(prompt[:-1]), cache)
    with tree_cache.tree_pass(cache, mx.array(anc), mx.array(host_depths(parents)), A.tree_bits(anc)):
        logits, _ = t.forward(mx.array([prompt[-1]] + tokens), cache)
    assert trees.count(A.tree_bits(anc)) == len(model.model.layers)  # one launch per layer, told the tree
    for r in range(len(tokens) + 1):
        path, q = [], r - 1
        while q >= 0:
            path.append(tokens[q])
            q = parents[q]
        steps = t.make_cache()
        t.forward(mx.array(prompt[:-1]), steps)
        for tok in [prompt[-1]] + path[::-1]:
            last, _ = t.forward(mx.array([tok]), steps)
        assert mx.array_equal(last[-1], logits[r]).item(), f"row {r}"
