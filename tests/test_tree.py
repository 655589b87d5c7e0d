"""Token-tree verification (core/tree_verify.py, target_model/tree_cache.py): a tree pass scores every node as a
pass over the cache + its own path would, greedy tree output == plain greedy for every family whose cache
compacts (random, wide and chain trees), the compacted cache equal to a fresh prefill of the kept tokens,
batch-invariant tree rows bit for bit the decode steps along their paths, and the fallback to chains
(recurrent caches, fixed-row passes, batch-invariant MLA, a repetition penalty) saying why."""

from __future__ import annotations

import itertools

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, QuantizedKVCache

import tiny_models
from mlx_engine import Engine, GenerationConfig
from mlx_engine.drafters.tree_draft import host_ancestors, host_depths, walk
from mlx_engine.kernels import batch_attention as A
from mlx_engine.sampling import SamplingConfig
from mlx_engine.target_model import tree_cache
from mlx_engine.target_model.model import Target
from reference import mlx_lm_greedy
from test_greedy_equality import PROMPT, target
from test_kv_quant import model as wide_model
from tree_util import RandomTreeDrafter

FAMILIES = ("llama", "qwen3", "deepseek_v3")


def generate(engine, n=48, k=4, temp=0.0, seed=0, paths=None):
    cfg = GenerationConfig(max_tokens=n, num_draft=k, sampling=SamplingConfig(temperature=temp), seed=seed)
    out = []
    for step in engine.generate(PROMPT, cfg):
        out += step.tokens
        if paths is not None and step.draft:
            paths.append((engine.drafter.trees[-1].parents, list(engine.trees.last_path)))
    return out


def branched(paths) -> bool:
    """Some cycle kept a node that is not the first child of its parent (the tree's width mattered)."""
    for parents, path in paths:
        for node in path:
            if parents.index(parents[node]) != node:
                return True
    return False


@pytest.mark.parametrize("shape", ["random", "wide", "chain"])
@pytest.mark.parametrize("family", FAMILIES)
def test_tree_greedy_equals_plain(family, shape):
    model = target(family)
    ref = mlx_lm_greedy(model, PROMPT, 48)
    for k in (1, 3, 8):
        engine = Engine(model, RandomTreeDrafter(model, tiny_models.VOCAB, seed=k, shape=shape))
        paths = []
        assert generate(engine, k=k, paths=paths) == ref, f"k={k}"
        assert engine.trees.off is None and engine.stats.accepted > 0
        if shape == "random" and k == 8:
            assert branched(paths), "no cycle kept a later sibling"
        if shape == "chain":
            assert all(path == list(range(len(path))) for _, path in paths)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_row_of_a_tree_pass_is_the_pass_over_its_own_path(family):
    """Row r's logits equal the last row of a plain pass over prompt + the tokens on r's path (float error:
    the passes have other shapes); rows sharing a depth sit at one position, siblings do not see each other."""
    model = target(family)
    t = Target(model)
    parents = [-1, -1, 0, 0, 2, 1, 4, -1]
    tokens = [5, 9, 17, 42, 8, 200, 3, 5]  # the last node repeats the first's token under the root
    root = PROMPT[-1]
    cache = t.make_cache()
    t.forward(mx.array(PROMPT[:-1]), cache)
    with tree_cache.tree_pass(cache, mx.array(host_ancestors(parents)), mx.array(host_depths(parents))):
        logits, _ = t.forward(mx.array([root] + tokens), cache)
    for r in range(len(tokens) + 1):
        path, q = [], r - 1
        while q >= 0:
            path.append(tokens[q])
            q = parents[q]
        want = model(mx.array(PROMPT + path[::-1])[None])[0, -1]
        np.testing.assert_allclose(np.array(logits[r]), np.array(want), rtol=1e-4, atol=1e-4, err_msg=f"row {r}")


def keys_values(cache, n):
    out = []
    for c in cache:
        for a in (c.keys, c.values):
            parts = a if isinstance(a, tuple) else (a,)
            out += [np.array(p[..., :n, :]) for p in parts]
    return out


@pytest.mark.parametrize("family, kv_bits", [(f, None) for f in FAMILIES] + [("llama", 8), ("qwen3", 8)])
def test_compacted_cache_equals_a_fresh_prefill_of_the_kept_tokens(family, kv_bits):
    """After tree cycles that kept later siblings (entries moved), every layer's keys and values equal a
    fresh prefill of the tokens the cache holds: to float error (the prefill is one pass of another shape;
    with an 8-bit KV cache, to one quantization step of the entries that rounding moved)."""
    model = target(family) if kv_bits is None else wide_model(family)  # (head dim 32: groups of 32)
    engine = Engine(model, RandomTreeDrafter(model, tiny_models.VOCAB, seed=3, shape="random"), kv_bits=kv_bits,
                    kv_group_size=32)
    gen = engine.generate(PROMPT, GenerationConfig(max_tokens=64, num_draft=6))
    paths = []
    for step in itertools.islice(gen, 12):
        if step.draft:
            paths.append((engine.drafter.trees[-1].parents, list(engine.trees.last_path)))
    assert branched(paths)
    held = engine.held.tokens
    n = engine.cache[0].offset
    assert n == len(held)
    fresh = Target(model, kv_bits, 32).make_cache()
    Target(model).forward(mx.array(held), fresh)
    for got, want in zip(keys_values(engine.cache, n), keys_values(fresh, n)):
        if got.dtype == np.uint32:  # packed 8-bit codes: rounding may move a code by one
            a, b = got.view(np.uint8).astype(int), want.view(np.uint8).astype(int)
            assert np.abs(a - b).max() <= 1 and (a != b).mean() < 0.01
        else:
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    gen.close()


@pytest.mark.parametrize("quantized", [False, True])
def test_compact_moves_the_kept_rows_exactly(quantized):
    """compact(): the kept rows' entries, bit for bit, at start, start + 1, ...; the offset after them."""
    rng = np.random.default_rng(0)
    c = QuantizedKVCache(group_size=32, bits=8) if quantized else KVCache()
    k = mx.array(rng.standard_normal((1, 2, 12, 64)).astype(np.float32))
    c.update_and_fetch(k, k * 2)
    before = keys_values([c], 12)
    tree_cache.compact([c], 5, [0, 2, 3, 6])
    assert c.offset == 9
    for got, old in zip(keys_values([c], 9), before):
        np.testing.assert_array_equal(got[..., :5, :], old[..., :5, :])
        np.testing.assert_array_equal(got[..., 5:9, :], old[..., [5, 7, 8, 11], :])


def test_walk_follows_the_target_s_pick_and_the_first_matching_child():
    parents = [-1, -1, 0, 0, 2, -1]
    tokens = [7, 8, 9, 4, 1, 7]  # the root's children 7, 8, 7: a pick of 7 goes to node 0 (the first)
    assert walk(parents, tokens, [7, 4, 0, 0, 0, 0, 0]) == [1, 4]  # root -> node 0 (7) -> node 3 (4) -> stop
    assert walk(parents, tokens, [8, 0, 5, 0, 0, 0, 0]) == [2]
    assert walk(parents, tokens, [3, 0, 0, 0, 0, 0, 0]) == []
    assert walk(parents, tokens, [7, 9, 0, 1, 0, 0, 0]) == [1, 3, 5]


def test_recurrent_caches_fall_back_to_chains_and_say_so():
    model = target("qwen3_next")
    engine = Engine(model, RandomTreeDrafter(model, tiny_models.VOCAB, seed=1))
    assert "ArraysCache" in engine.trees.off
    assert generate(engine) == mlx_lm_greedy(model, PROMPT, 48)
    assert engine.stats.accepted > 0  # every draft a chain (the drafter's fallback):
    assert all(t.parents == list(range(-1, t.size - 1)) for t in engine.drafter.trees)


@pytest.fixture(scope="module")
def invariant_llama():
    model = tiny_models.build("llama", seed=1)[0]  # its own copy: the batch-invariant patch stays on a model
    Engine(model, batch_invariant=True)
    return model


def test_batch_invariant_tree_rows_are_bit_identical_to_single_steps(invariant_llama):
    """With the batch-invariant patch, every row of a tree pass equals, bit for bit, the decode steps along
    its own path from the same cache (the kernels' contract, held for trees)."""
    model = invariant_llama
    t = Target(model)
    tree_cache.install(model)
    assert tree_cache.install_invariant(model) is None
    parents = [-1, -1, 0, 0, 2, 1, 4, -1]
    tokens = [5, 9, 17, 42, 8, 200, 3, 5]
    anc = host_ancestors(parents)
    cache = t.make_cache()
    t.forward(mx.array(PROMPT[:-1]), cache)
    with tree_cache.tree_pass(cache, mx.array(anc), mx.array(host_depths(parents)), A.tree_bits(anc)):
        logits, _ = t.forward(mx.array([PROMPT[-1]] + tokens), cache)
    for r in range(len(tokens) + 1):
        path, q = [], r - 1
        while q >= 0:
            path.append(tokens[q])
            q = parents[q]
        steps = t.make_cache()
        t.forward(mx.array(PROMPT[:-1]), steps)
        for tok in [PROMPT[-1]] + path[::-1]:
            last, _ = t.forward(mx.array([tok]), steps)
        assert mx.array_equal(last[-1], logits[r]).item(), f"row {r}"


def test_batch_invariant_engines_verify_trees_and_equal_plain(invariant_llama):
    model = invariant_llama
    engine = Engine(model, RandomTreeDrafter(model, tiny_models.VOCAB, seed=1), batch_invariant=True)
    assert engine.trees.off is None
    plain = [t for s in Engine(model, batch_invariant=True).generate(PROMPT, GenerationConfig(max_tokens=48, num_draft=0))
             for t in s.tokens]
    paths = []
    assert generate(engine, k=6, paths=paths) == plain and branched(paths)


def test_fixed_rows_mla_and_penalties_verify_chains():
    fixed = tiny_models.build("llama", seed=1)[0]
    engine = Engine(fixed, RandomTreeDrafter(fixed, tiny_models.VOCAB, seed=1), batch_invariant="fixed")
    assert "fixed-row" in engine.trees.off
    assert generate(engine) == mlx_lm_greedy(fixed, PROMPT, 48)
    mla = tiny_models.build("deepseek_v3", seed=1)[0]
    assert "MLA" in Engine(mla, RandomTreeDrafter(mla, tiny_models.VOCAB), batch_invariant=True).trees.off
    plain = Engine(target("llama"), RandomTreeDrafter(target("llama"), tiny_models.VOCAB, seed=1))
    assert not plain.trees.wanted(None, SamplingConfig(temperature=0.5, repetition_penalty=1.2))
    assert plain.trees.wanted(None, SamplingConfig(temperature=0.5))


@pytest.mark.parametrize("temp", [0.0, 1.0])
def test_one_host_read_per_tree_cycle(temp):
    from mlx_engine import host

    engine = Engine(target("llama"), RandomTreeDrafter(None, tiny_models.VOCAB, seed=2))
    gen = engine.generate(PROMPT, GenerationConfig(max_tokens=24, num_draft=5, sampling=SamplingConfig(temperature=temp)))
    next(gen)
    before = dict(host.counts)
    cycles = sum(1 for _ in gen)
    assert cycles == engine.stats.cycles > 0 and len(engine.drafter.trees) == cycles - 1  # (the last: plain)
    # (a compaction that moves accepted rows adds one wait, tree_cache.compact; this drafter's trees never move)
    assert host.counts["read"] - before["read"] == cycles and host.counts["wait"] == before["wait"]
