"""Rollback is exact: after rejected drafts every cache equals the cache of plain decoding over the kept tokens."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

import tiny_models
from mlx_engine.target_model import cache as cache_ops
from mlx_engine import DraftModelDrafter, Engine, GenerationConfig
from test_greedy_equality import PROMPT, noisy_copy, target


def layer_arrays(c) -> list[np.ndarray]:
    """The meaningful content of one layer's cache."""
    if isinstance(c, (KVCache, RotatingKVCache)):
        n = min(c.offset, c.keys.shape[2])
        return [np.array(c.keys[..., :n, :]), np.array(c.values[..., :n, :])]
    if isinstance(c, ArraysCache):
        return [np.array(a) for a in c.cache]
    raise TypeError(type(c))


def plain_cache(model, tokens):
    """mlx-lm's way: the whole prefix but one in a batch, then one token at a time."""
    cache = cache_ops.make_cache(model)
    model(mx.array(tokens[:1])[None], cache=cache)
    for t in tokens[1:]:
        model(mx.array([t])[None], cache=cache)
    mx.eval([c.state for c in cache])
    return cache


# weight noise that makes each family's draft agree with its target only part of the time
NOISE = {"llama": 0.01, "qwen3": 0.06, "deepseek_v3": 0.01, "qwen3_next": 0.01}


@pytest.mark.parametrize("family", tiny_models.FAMILIES)
def test_cache_after_partial_accepts_equals_plain(family):
    model = target(family)
    drafter = DraftModelDrafter(noisy_copy(family, NOISE[family]), tiny_models.VOCAB)
    engine = Engine(model, drafter)
    out = [t for s in engine.generate(PROMPT, GenerationConfig(max_tokens=40, num_draft=4)) for t in s.tokens]
    stats = engine.stats
    assert 0 < stats.accepted < stats.drafted, "the test needs partial acceptance"
    fed = (PROMPT + out[:-1])[: len(PROMPT) + len(out) - 1 - len(engine._replay)]
    ref = plain_cache(model, fed)
    for layer, (ours, theirs) in enumerate(zip(engine.cache, ref)):
        assert type(ours) is type(theirs)
        if isinstance(ours, KVCache):
            assert ours.offset == theirs.offset == len(fed)
        for a, b in zip(layer_arrays(ours), layer_arrays(theirs)):
            assert a.shape == b.shape, f"layer {layer}"
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=f"layer {layer}")
    # the draft model's cache is rolled back the same way
    dfed = (PROMPT + out[:-1])[: len(PROMPT) + len(out) - 1 - len(drafter.pending)]
    dref = plain_cache(drafter.model, dfed)
    for ours, theirs in zip(drafter.cache, dref):
        for a, b in zip(layer_arrays(ours), layer_arrays(theirs)):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def _prefilled(family, caches=None, model=None):
    model = model or target(family)
    cache = caches or cache_ops.make_cache(model)
    model(mx.array(PROMPT)[None], cache=cache)
    mx.eval([c.state for c in cache])
    return model, cache


def test_trim_path_keeps_prefix_bit_exact():
    model, cache = _prefilled("llama")
    before = [layer_arrays(c) for c in cache]
    ckpt = cache_ops.checkpoint(cache, 5)
    model(mx.array([1, 2, 3, 4, 5])[None], cache=cache)
    after = [layer_arrays(c) for c in cache]
    assert cache_ops.rollback(cache, ckpt, 2) == 0
    for c, b, a in zip(cache, before, after):
        assert c.offset == len(PROMPT) + 2
        kept = layer_arrays(c)
        for x, y in zip(kept, a):
            np.testing.assert_array_equal(x, y[..., : len(PROMPT) + 2, :])
        for x, y in zip(kept, b):
            np.testing.assert_array_equal(x[..., : len(PROMPT), :], y)


def test_snapshot_path_restores_recurrent_state_bit_exact():
    """Without per-token states (a model no Target has patched, see hybrid.py) recurrent layers are
    snapshotted, restored bit-exact, and the kept tokens handed back for replay."""
    model, cache = _prefilled("qwen3_next", model=tiny_models.build("qwen3_next", seed=1)[0])
    before = [layer_arrays(c) for c in cache]
    ckpt = cache_ops.checkpoint(cache, 5)
    assert not ckpt.exact_trim
    model(mx.array([1, 2, 3, 4, 5])[None], cache=cache)
    assert cache_ops.rollback(cache, ckpt, 2) == 2  # two kept tokens to replay
    for c, b in zip(cache, before):
        for x, y in zip(layer_arrays(c), b):
            np.testing.assert_array_equal(x, y)


def test_full_accept_needs_no_rollback():
    model, cache = _prefilled("qwen3_next")
    ckpt = cache_ops.checkpoint(cache, 3)
    model(mx.array([1, 2, 3])[None], cache=cache)
    after = [layer_arrays(c) for c in cache]
    assert cache_ops.rollback(cache, ckpt, 3) == 0
    for c, a in zip(cache, after):
        for x, y in zip(layer_arrays(c), a):
            np.testing.assert_array_equal(x, y)


def test_wrapped_rotating_window_is_snapshotted_and_restored():
    window = 8
    model, cache = _prefilled("llama", [RotatingKVCache(max_size=window) for _ in range(2)])  # 11 > 8: wrapped
    for t in (4, 5):  # single-token steps write in place: the case that needs a copy, not a reference
        model(mx.array([t])[None], cache=cache)
    before = [layer_arrays(c) + [c.offset, c._idx] for c in cache]
    ckpt = cache_ops.checkpoint(cache, 1)
    assert not ckpt.exact_trim
    model(mx.array([9])[None], cache=cache)
    assert cache_ops.rollback(cache, ckpt, 0) == 0
    for c, b in zip(cache, before):
        assert [c.offset, c._idx] == b[2:]
        for x, y in zip(layer_arrays(c), b[:2]):
            np.testing.assert_array_equal(x, y)
