"""A decoding row beside a wider prompt chunk attends with its own queries only (target_model/batch_sequences.py
real_widths): its padding does not run attention at the row's depth, and its real positions are unchanged."""

import mlx.core as mx
import numpy as np

from mlx_engine.target_model.batch_sequences import over_sequences, real_widths


def _attend(calls):
    def attend(q, k, v):
        calls.append((q.shape[2], k.shape[2]))
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal" if q.shape[2] > 1 else None)
    return attend


def test_a_row_with_fewer_real_tokens_attends_with_those_queries_over_its_own_keys():
    mx.random.seed(0)
    B, H, L, D, S = 2, 2, 6, 8, 40
    q, k, v = (mx.random.normal((B, H, n, D)) for n in (L, S, S))
    lens = [40, 12]  # row 0 deep (decoding: 2 real tokens of the pass's 6), row 1 a prompt chunk of 6
    full_calls, calls = [], []
    full = over_sequences(_attend(full_calls), lens, (q,), (k, v), D)
    with real_widths({0: 2}):
        got = over_sequences(_attend(calls), lens, (q,), (k, v), D, ragged=True)
    assert full_calls == [(6, 40), (6, 12)]
    assert calls == [(2, 36), (6, 12)]  # row 0: its 2 queries, the last 2 of its first 36 keys
    assert np.allclose(np.array(got[0, :, :2]), np.array(full[0, :, :2]), atol=1e-5)  # real positions unchanged
    assert float(mx.abs(got[0, :, 2:]).max()) == 0.0  # padding: zeros, no attention
    assert mx.array_equal(got[1], full[1])
    with real_widths({0: 6}):  # a row as wide as the pass: untouched
        assert mx.array_equal(over_sequences(_attend([]), lens, (q,), (k, v), D, ragged=True), full)
    with real_widths({0: 2}):  # off where the caller's attention is not causal (invariant passes: their own)
        assert mx.array_equal(over_sequences(_attend([]), lens, (q,), (k, v), D), full)
