"""The prefill chunk sizer (core/chunk_sizer.py) against a modelled step cost t(n) = base + n * c: it settles
where the step fits the budget, never more than doubles, takes at least one token, and follows c as it
grows with the context. And the batch engine's per-sequence attention (target_model/sequence_attention.py)."""

import mlx.core as mx
import pytest

from mlx_engine.core.chunk_sizer import ChunkSizer


def run(sizer, budget, base, per_token, steps=30):
    sizes = []
    for i in range(steps):
        n = sizer.size(budget, base)
        c = per_token(i) if callable(per_token) else per_token
        sizer.observe(n, base + n * c, True)
        sizes.append(n)
    return sizes


def test_settles_where_the_step_fits_the_budget():
    sizes = run(ChunkSizer(first=4, largest=512), budget=0.15, base=0.07, per_token=0.005)
    assert sizes[:4] == [4, 8, 11, 11]  # doubling at most, then (0.85 * 0.15 - 0.07) / 0.005 = 11.5
    assert all(0.07 + n * 0.005 <= 0.15 for n in sizes)


def test_follows_a_growing_per_token_cost_down_to_one_token():
    cost = lambda i: 0.001 * 1.1 ** i  # noqa: E731  (the context grows: 10% more per token each chunk)
    sizes = run(ChunkSizer(first=8, largest=512), budget=0.15, base=0.07, per_token=cost, steps=60)
    assert sizes[:4] == [8, 16, 32, 47] and sizes[-1] == 1 and sizes[3:] == sorted(sizes[3:], reverse=True)
    assert all(0.07 + n * cost(i) <= 0.15 * 1.1 for i, n in enumerate(sizes) if n > 1)  # the margin absorbs drift


def test_no_budget_takes_the_largest_and_a_free_chunk_doubles():
    s = ChunkSizer(first=16, largest=64)
    assert s.size(None) == 64
    assert run(s, budget=1.0, base=0.0, per_token=0.0, steps=4) == [16, 32, 64, 64]


def test_each_sequence_attends_over_its_own_keys_and_idle_rows_are_zeros():
    from mlx_engine.target_model.batch_cache import BatchKVCache
    from mlx_engine.target_model.batch_sequences import idle_rows
    from mlx_engine.target_model.sequence_attention import per_sequence

    def sdpa(q, k, v, cache, scale, mask):
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)

    mx.random.seed(0)
    cache = BatchKVCache()
    for n in (5, 12):
        cache.add_row(mx.random.normal((1, 2, n, 8)), mx.random.normal((1, 2, n, 8)))
    q = mx.random.normal((2, 4, 3, 8))
    k, v = cache.update_and_fetch(mx.random.normal((2, 2, 3, 8)), mx.random.normal((2, 2, 3, 8)))
    out = per_sequence(sdpa, q, k, v, cache, 0.5)
    for b, n in enumerate(cache.lens):  # 8 and 15 keys: the row's own, the last 3 its queries'
        alone = mx.fast.scaled_dot_product_attention(q[b : b + 1], k[b : b + 1, :, :n], v[b : b + 1, :, :n],
                                                     scale=0.5, mask="causal")
        assert mx.array_equal(out[b : b + 1], alone)
    with idle_rows([0]):
        out = per_sequence(sdpa, q, k, v, cache, 0.5)
    assert not mx.any(out[0]).item() and mx.any(out[1]).item()


def test_a_chunk_cut_short_by_its_prompt_s_end_does_not_shrink_the_next():
    """The last chunk of a prompt is its remainder (2 tokens here, sized 16): the next prompt's chunk grows
    from the 16 it was given, not from the 2 the prompt had left."""
    s = ChunkSizer(first=16, largest=64)
    assert s.size(1.0) == 16
    s.observe(2, 0.002, True)  # the prompt's last 2 tokens, at 1 ms a token
    assert s.size(1.0) == 32  # doubling from 16 (from 2 it was 4)
