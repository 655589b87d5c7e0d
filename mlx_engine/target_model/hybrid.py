"""Hybrid (GatedDeltaNet) targets roll back to any accepted prefix without a replay pass (issue 6).

    from mlx_engine.target_model.hybrid import enable_per_token_states
    enable_per_token_states(model)   # in place; returns the number of layers patched

The GatedDeltaNet layers of qwen3_next / qwen3_5 targets get their instance class swapped for a
subclass (parameters and names untouched, as target.py's _install_capture). During a pass of
2..`max_tokens` tokens with an ArraysCache and no padding mask, the subclass runs the recurrence with
`kernels.get("gdn_step")` (fused kernel on Metal/CUDA, the plain-MLX reference on CPU), which returns the
recurrent state after EVERY token, and stores on the layer's cache

    cache.per_token = PerTokenStates(n, conv [B, n, K-1, C], ssm [B, n, Hv, Dv, Dk])

lazily (graph nodes: nothing is materialised unless a rollback reads one row). `cache.rollback`
then sets a layer to the state after token n_keep-1 instead of restoring a snapshot and replaying the
kept tokens. Outputs equal the stock layer's: on the CPU the reference runs the very ops of mlx-lm's
`gated_delta_ops` (bit for bit); on a GPU the fused kernel agrees to fp32 rounding. Other passes
(a 1-token decode, prompt chunks, masked batches) run the stock code and leave `per_token = None`, which
makes rollback fall back to snapshot + replay for that pass. A batch's rows (a BatchRecurrentCache)
take target_model/gdn_rows.py: each row stops at its own last real token and rolls back on its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from .. import kernels
from .batch_recurrent import BatchRecurrentCache
from .gdn_rows import front, rows_call, split_qkv

MAX_TOKENS = 32  # longest pass whose per-token states are kept (verify passes; not prompts)


@dataclass
class PerTokenStates:
    n: int  # tokens of the pass
    conv: mx.array  # [B, n, K-1, C]: conv state after each token
    ssm: mx.array  # [B, n, Hv, Dv, Dk]: recurrent state after each token

    def at(self, i: int) -> tuple[mx.array, mx.array]:
        return mx.contiguous(self.conv[:, i]), self.ssm[:, i]


def _gdn_classes() -> tuple[type, ...]:
    out = []
    try:
        from mlx_lm.models.qwen3_next import Qwen3NextGatedDeltaNet

        out.append(Qwen3NextGatedDeltaNet)
    except ImportError:  # pragma: no cover
        pass
    try:
        from mlx_lm.models.qwen3_5 import GatedDeltaNet

        out.append(GatedDeltaNet)
    except ImportError:  # pragma: no cover
        pass
    return tuple(out)


def _per_token_call(self, inputs, mask=None, cache=None):
    """mlx-lm's GatedDeltaNet.__call__ with the recurrence run by gdn_step and every state kept."""
    from mlx_lm.models.gated_delta import compute_g, normalize_qk

    B, S, _ = inputs.shape
    mixed, z, b, a = front(self, inputs)
    conv_state = cache[0]
    if conv_state is None:
        conv_state = mx.zeros((B, self.conv_kernel_size - 1, self.conv_dim), dtype=inputs.dtype)
    conv_input = mx.concatenate([conv_state, mixed], axis=1)  # [B, K-1+S, C]
    n_keep = self.conv_kernel_size - 1
    cache[0] = mx.contiguous(conv_input[:, -n_keep:, :])
    q, k, v = split_qkv(self, nn.silu(self.conv1d(conv_input)))
    state = cache[1]
    q, k = normalize_qk(q, k, inv_scale=self.head_k_dim**-0.5, eps=1e-6)
    beta = mx.sigmoid(b)
    g = compute_g(self.A_log, a, self.dt_bias)
    if state is None:
        state = mx.zeros((B, self.num_v_heads, self.head_v_dim, self.head_k_dim), dtype=mx.float32)
    out, states = kernels.get("gdn_step")(q, k, v, g, beta, state)
    cache[1] = states[:, -1]
    cache.advance(S)
    # conv state after token t = conv_input[:, t+1 : t+K]  (lazy gather; read only on rollback)
    idx = mx.arange(S)[:, None] + 1 + mx.arange(n_keep)[None, :]
    cache.per_token = PerTokenStates(S, conv_input[:, idx], states)
    out = self.norm(out, z)
    return self.out_proj(out.reshape(B, S, -1))


def _install(layer: nn.Module, max_tokens: int) -> bool:
    cls = type(layer)
    if getattr(cls, "_mlx_engine_per_token", False):
        object.__setattr__(layer, "_pt_max", max_tokens)
        return True

    def __call__(self, inputs, mask=None, cache=None):
        if isinstance(cache, BatchRecurrentCache):  # the rows of a batch (continuous batching)
            return rows_call(self, inputs, cache)
        S = inputs.shape[1]
        usable = (
            cache is not None
            and mask is None
            and getattr(cache, "lengths", None) is None
            and getattr(self, "sharding_group", None) is None
            and 2 <= S <= self._pt_max
        )
        if cache is not None:
            cache.per_token = None
        if not usable:
            return cls.__call__(self, inputs, mask, cache)
        return _per_token_call(self, inputs, mask, cache)

    layer.__class__ = type(cls.__name__, (cls,), {"__call__": __call__, "_mlx_engine_per_token": True})
    object.__setattr__(layer, "_pt_max", max_tokens)  # not a parameter
    return True


def enable_per_token_states(model: nn.Module, max_tokens: int = MAX_TOKENS) -> int:
    """Patch every GatedDeltaNet layer of `model` (qwen3_next, qwen3_5 and their VLM wrappers).
    Returns how many layers were patched (0 for a model without them: harmless to call on any target)."""
    classes = _gdn_classes()
    n = 0
    for _, m in model.named_modules():
        if classes and isinstance(m, classes):
            n += _install(m, max_tokens)
    return n


def supports_per_token(c) -> bool:
    """True for a cache object a patched GatedDeltaNet layer writes per-token states to."""
    return hasattr(c, "per_token")
