"""Batch-invariant MLA attention for DeepSeek-V3 (mlx-lm's DeepseekV3Attention): every decode and verify
pass in the absorbed form, through the batch_attention kernel with its second score term.

mlx-lm runs one token in the absorbed form (queries mapped into the latent space by embed_q, the latent
cache serving as keys and values, unembed_out after) and more tokens in the expanded form (the latent
cache mapped up to per-head keys and values), so a verify row is not computed as its decode step. Here
both run the absorbed form, for passes of up to the model's invariant row bound:

    q_abs = embed_q(q_nope)                                    [B, H, L, r]   (r = kv_lora_rank)
    o     = attention(q_abs, latent, latent, scale, causal, qp=q_pe, kp=k_pe)
          = softmax(scale * (q_abs . latent_j + q_pe . k_pe_j)) latent_j
    out   = o_proj(unembed_out(o))

with the same projections, norms and RoPE as mlx-lm. embed_q / unembed_out are per-head matmuls whose
rows are the L tokens: in the kernels path each row is its own 1-row matmul (the decode step's call);
in a fixed-row pass (target_model/fixed_rows.py) they run at the fixed row count like the other linears, and
the attention skips the pad rows. The attention is kernels "batch_attention" with its second score
term; where it has no GPU kernel (the CPU), each row is mlx-lm's own decode-step call (the q_pe . k_pe
scores as its additive mask over exactly the row's keys): equal to stock decoding by construction, and
5-10x cheaper there than the tree-sum reference (16 heads, r = 512, 512 keys, fp32: 6.2 / 49.5 / 96.8
ms against 28.3 / 434.7 / 926.2 for 1 / 8 / 16 rows on this 2-core CPU). Other MLA families
(glm4_moe_lite, kimi, mistral4, ...) write their attention differently and still run one token at a time
(batch_invariant.py).
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.deepseek_v3 import DeepseekV3Attention

from .invariant_attention import cache_attention
from .invariant_rows import concat


def is_deepseek_mla(module) -> bool:
    return isinstance(module, DeepseekV3Attention)


def _by_rows(fn, t: mx.array, split: bool) -> mx.array:
    """fn over t [B, H, L, d]: one call per (sequence, token) row (each the 1-row call of a decode step)
    when split."""
    B, L = t.shape[0], t.shape[2]
    if not split or B * L == 1:
        return fn(t)
    return concat([concat([fn(t[b : b + 1, :, i : i + 1]) for i in range(L)], axis=2) for b in range(B)], axis=0)


_SDPA = scaled_dot_product_attention  # mlx-lm's, unwrapped: what its decode step calls


def invariant_mla_call(self, x: mx.array, cache, split_rows: bool, live: int | None) -> mx.array:
    """DeepseekV3Attention.__call__ in the absorbed form for any L (causal over the cache)."""
    B, L, _ = x.shape
    if self.q_lora_rank is None:
        q = self.q_proj(x)
    else:
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
    q = q.reshape(B, L, self.num_heads, self.q_head_dim).transpose(0, 2, 1, 3)
    q_nope, q_pe = mx.split(q, [self.qk_nope_head_dim], axis=-1)
    compressed_kv = self.kv_a_proj_with_mqa(x)
    compressed_kv, k_pe = mx.split(compressed_kv, [self.kv_lora_rank], axis=-1)
    k_pe = k_pe.reshape(B, L, 1, self.qk_rope_head_dim).transpose(0, 2, 1, 3)
    latent = self.kv_a_layernorm(compressed_kv)
    offset = cache.offset if cache is not None else 0
    q_pe = self.rope(q_pe, offset)
    k_pe = self.rope(k_pe, offset)
    latent = mx.expand_dims(latent, axis=1)
    if cache is not None:
        latent, k_pe = cache.update_and_fetch(latent, k_pe)
    q_abs = _by_rows(self.embed_q, q_nope, split_rows)
    o = cache_attention(_SDPA, q_abs, latent, latent, self.scale, cache, q_pe, k_pe, live)
    out = _by_rows(self.unembed_out, o, split_rows)
    return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))
