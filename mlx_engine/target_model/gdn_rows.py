"""A GatedDeltaNet layer over the rows of a batch (target_model/batch_recurrent.py's cache): each row's
recurrence stops at its own last real token, and the states a rollback may need are kept.

Row b brings real[b] real tokens in a pass of S positions (its padding after them; none when the row is
idle, or rests in this layer while its chunk crosses others: batch_sequences.idle). With P = the pass's
`verified` positions (the widest verify row's k + 1):

    tokens 0..P-1   kernels.get("gdn_step"): the state after every token, [B, P, Hv, Dv, Dk]
    tokens P..S-1   mlx-lm's gated_delta_update with a padding mask (a masked token leaves the state as it
                    was: mlx-lm's own batched path), from the state after token P-1

and each row's state after the pass is its state after token real[b] - 1: from the second part when
real[b] > P, from the kept states when 0 < real[b] <= P, the state before the pass when real[b] == 0. The
conv state is the last K-1 inputs before position real[b] (gathered per row, as mlx-lm gathers it for its
`lengths`). Real tokens come first in every row, so what the padding computes never reaches them: the
outputs of real positions are the ops of mlx-lm's own call (on the CPU bit for bit; the first part is the
per-token kernel's reference, the same ops as mlx-lm's gated_delta_ops, target_model/hybrid.py).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .. import kernels
from .batch_sequences import idle


def front(layer, inputs):
    """The layer's input projections -> (mixed_qkv [B, S, conv_dim], z [B, S, Hv, Dv], b, a), exactly as
    mlx-lm's __call__ computes them."""
    B, S, _ = inputs.shape
    if hasattr(layer, "in_proj_qkvz"):  # qwen3_next
        q, k, v, z, b, a = layer.fix_query_key_value_ordering(layer.in_proj_qkvz(inputs), layer.in_proj_ba(inputs))
        mixed = mx.concatenate([q.reshape(B, S, -1), k.reshape(B, S, -1), v.reshape(B, S, -1)], axis=-1)
        return mixed, z, b, a
    qkv = layer.in_proj_qkv(inputs)  # qwen3_5
    z = layer.in_proj_z(inputs).reshape(B, S, layer.num_v_heads, layer.head_v_dim)
    return qkv, z, layer.in_proj_b(inputs), layer.in_proj_a(inputs)


def split_qkv(layer, conv_out: mx.array) -> list[mx.array]:
    """The convolution's output [B, S, conv_dim] as q, k [B, S, Hk, Dk] and v [B, S, Hv, Dv], as mlx-lm splits it."""
    B, S, _ = conv_out.shape
    return [
        t.reshape(B, S, h, d)
        for t, h, d in zip(
            mx.split(conv_out, [layer.key_dim, 2 * layer.key_dim], -1),
            [layer.num_k_heads, layer.num_k_heads, layer.num_v_heads],
            [layer.head_k_dim, layer.head_k_dim, layer.head_v_dim],
        )
    ]


def rows_call(layer, inputs: mx.array, cache) -> mx.array:
    """mlx-lm's GatedDeltaNet.__call__ for the rows of a BatchRecurrentCache."""
    from mlx_lm.models.gated_delta import compute_g, gated_delta_update, normalize_qk

    B, S, _ = inputs.shape
    resting = idle()
    real = cache.real if cache.real is not None else [S] * B
    real = [0 if b in resting else min(r, S) for b, r in enumerate(real)]
    P = min(cache.verified, S, max(real, default=0))
    mixed, z, b_in, a_in = front(layer, inputs)
    conv_state, state = cache[0], cache[1]
    if conv_state is None:
        conv_state = mx.zeros((B, layer.conv_kernel_size - 1, layer.conv_dim), dtype=inputs.dtype)
    if state is None:
        state = mx.zeros((B, layer.num_v_heads, layer.head_v_dim, layer.head_k_dim), dtype=mx.float32)
    before = [conv_state, state]
    conv_input = mx.concatenate([conv_state, mixed], axis=1)  # [B, K-1+S, C]
    n_keep = layer.conv_kernel_size - 1
    ends = mx.array(real, dtype=mx.int32)
    conv_after = mx.take_along_axis(conv_input, (ends[:, None] + mx.arange(n_keep))[..., None], axis=1)
    q, k, v = split_qkv(layer, nn.silu(layer.conv1d(conv_input)))
    q, k = normalize_qk(q, k, inv_scale=layer.head_k_dim**-0.5, eps=1e-6)
    outs, per_token, after = [], None, state
    if P:
        beta = mx.sigmoid(b_in[:, :P])
        g = compute_g(layer.A_log, a_in[:, :P], layer.dt_bias)
        out, states = kernels.get("gdn_step")(q[:, :P], k[:, :P], v[:, :P], g, beta, state)
        outs.append(out)
        idx = mx.arange(P)[:, None] + 1 + mx.arange(n_keep)[None, :]  # conv state after token t (lazy gather)
        per_token = [conv_input[:, idx], states]
        after = states[:, -1]
    if P < S:
        mask = mx.arange(S - P)[None, :] < (ends - P)[:, None]
        out, after = gated_delta_update(q[:, P:], k[:, P:], v[:, P:], a_in[:, P:], b_in[:, P:], layer.A_log,
                                        layer.dt_bias, after, mask, use_kernel=not layer.training)
        outs.append(out)
    if P and any(r < P for r in real):  # a row that ended inside the kept states: its state is one of them
        options = mx.concatenate([state[:, None], per_token[1]], axis=1)  # 0: before; t: after token t - 1
        kept = mx.take_along_axis(options, mx.minimum(ends, P).reshape(-1, 1, 1, 1, 1), axis=1)[:, 0]
        after = mx.where((ends > P).reshape(-1, 1, 1, 1), after, kept)
    cache[0], cache[1] = conv_after, after
    cache.record(before, per_token, real, S)
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=1)
    out = layer.norm(out, z)
    return layer.out_proj(out.reshape(B, S, -1))
