"""The prefix cache's radix tree against a brute-force reference, and its memory budget."""

import mlx.core as mx
from mlx.utils import tree_flatten
import numpy as np
import pytest

from mlx_engine.target_model.prefix_cache import PrefixCache


def prefix_code(tokens: list[int]) -> list[float]:
    """A value per position that is a function of the tokens up to it (as a real KV entry is)."""
    out, h = [], 7
    for t in tokens:
        h = (h * 31 + t + 1) % 1_000_003
        out.append(float(h))
    return out


def states(tokens: list[int], layers: int = 2, quantized: bool = False):
    """Per-layer states in a KV cache's layout, the token axis at -2; quantized: (data, scales, biases)."""
    code = mx.array(prefix_code(tokens))[None, None, :, None]
    out = []
    for layer in range(layers):
        k = mx.broadcast_to(code + layer, (1, 2, len(tokens), 4))
        v = mx.broadcast_to(-code - layer, (1, 2, len(tokens), 3))
        if quantized:
            k = (k.astype(mx.uint32), k[..., :1], k[..., :1] * 2)
            v = (v.astype(mx.uint32), v[..., :1], v[..., :1] * 2)
        out.append((k, v))
    return out


def lcp(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@pytest.mark.parametrize("quantized", [False, True])
def test_lookups_match_a_brute_force_reference(quantized):
    rng = np.random.default_rng(0)
    cache = PrefixCache(budget_bytes=1 << 40, with_hidden=True, min_tokens=1)
    stored: list[list[int]] = []
    bases = [rng.integers(0, 5, 40).tolist() for _ in range(3)]  # few symbols: many shared prefixes and splits
    for step in range(60):
        base = bases[rng.integers(0, 3)]
        seq = base[: rng.integers(1, 40)] + rng.integers(0, 5, rng.integers(0, 12)).tolist()
        if rng.random() < 0.5:
            hidden = mx.array(prefix_code(seq))[:, None]
            new = cache.insert(seq, states(seq, quantized=quantized), hidden)
            assert new == len(seq) - max([lcp(seq, s) for s in stored], default=0)
            stored.append(seq)
        expect = max([lcp(seq, s) for s in stored], default=0)
        assert cache.match(seq) == expect
        hit = cache.lookup(seq)
        assert hit.n == expect
        if expect:
            want = states(seq[:expect], quantized=quantized)
            for got_layer, want_layer in zip(hit.layers, want):
                for g, w in zip(tree_flatten(got_layer), tree_flatten(want_layer)):
                    assert g[1].shape == w[1].shape and mx.array_equal(g[1], w[1])
            assert mx.array_equal(hit.hidden[:, 0], mx.array(prefix_code(seq[:expect])))
    # the tree stores each token position once however many prompts share it
    assert cache.tokens == len({tuple(s[: i + 1]) for s in stored for i in range(len(s))})


def test_budget_evicts_least_recently_used_leaves():
    one = sum(a.nbytes for layer in states([1] * 10) for a in layer)  # bytes of 10 positions
    cache = PrefixCache(budget_bytes=3 * one, min_tokens=1)
    a, b, c, d = ([i] * 10 for i in range(4))
    for seq in (a, b, c):
        cache.insert(seq, states(seq))
    assert cache.nbytes == 3 * one
    cache.lookup(a)  # a is now the most recently used
    cache.insert(d, states(d))
    assert cache.nbytes <= cache.budget
    assert cache.match(a) == 10 and cache.match(d) == 10 and cache.match(b) == 0 and cache.match(c) == 10
    assert cache.evicted_tokens == 10
    # a prompt over the whole budget is not kept, and nothing else is lost for it
    big = [9] * 40
    cache.insert(big, states(big))
    assert cache.nbytes <= cache.budget and cache.match(big) == 0


def test_short_hits_and_missing_hidden():
    cache = PrefixCache(budget_bytes=1 << 30, with_hidden=True, min_tokens=16)
    seq = list(range(20))
    with pytest.raises(ValueError, match="hidden"):
        cache.insert(seq, states(seq))
    cache.insert(seq, states(seq), mx.zeros((20, 3)))
    assert cache.lookup(seq[:15]).n == 0  # shorter than min_tokens: not worth a copy
    assert cache.lookup(seq[:16] + [99]).n == 16
