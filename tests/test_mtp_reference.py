"""The head's logits against an independent numpy forward computed from the HF tensors (fp32).

What each family compares:
- qwen3_5 (dense), mimo: EVERYTHING in numpy (norms incl. 1 + w, concat order, eh_proj, the full
  decoder block: gated attention / q-k norm / partial RoPE / GQA / SwiGLU, output norm, lm_head).
- qwen3_next, qwen3_5_moe (fused gate_up_proj experts), deepseek_v3, glm4_moe: the head's input (norms, concat order, eh_proj), output norm and
  lm_head in numpy; the decoder block against the target's own mlx-lm layer loaded through mlx-lm's
  sanitize from the same HF tensors (the checkpoint's head block is a copy of that layer), which checks
  expert stacking, MLA kv_b_proj splitting and the 1 + w of the block's norms.
- deepseek_v3 FP8: eh_proj dequantised in numpy from the e4m3 bytes + weight_scale_inv.
"""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from hf_writer import E4M3, ZERO_CENTRED, read_hf, text_cfg
from mlx_engine.drafters.mtp import load_mtp_drafter
from test_mtp_helpers import load_hf, make

L = 6  # slots in one batched head call


def rms(x, w, eps):
    x = x.astype(np.float64)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def rope(x, dims, base=10000.0):
    """Non-traditional RoPE on the first `dims` features; x: [L, heads, d], positions 0..L-1."""
    half = dims // 2
    inv = base ** (-np.arange(half) * 2.0 / dims)
    ang = np.arange(x.shape[0])[:, None] * inv[None]  # [L, half]
    cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]
    x1, x2 = x[..., :half], x[..., half:dims]
    rot = np.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)
    return np.concatenate([rot, x[..., dims:]], -1)


def attention(q, k, v, scale):
    """q [L, nq, d], k/v [L, nkv, d], causal, GQA."""
    rep = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, rep, 1), np.repeat(v, rep, 1)
    s = np.einsum("qhd,khd->hqk", q, k) * scale
    s = np.where(np.tril(np.ones((q.shape[0], k.shape[0]), bool))[None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", p, v)


def silu(x):
    return x / (1 + np.exp(-x))


def mlp(x, w, pre):
    return (silu(x @ w[pre + "gate_proj.weight"].T) * (x @ w[pre + "up_proj.weight"].T)) @ w[pre + "down_proj.weight"].T


def qwen3_5_block(x, w, pre, tc):
    eps, nh, nkv, hd = tc["rms_norm_eps"], tc["num_attention_heads"], tc["num_key_value_heads"], tc["head_dim"]
    xn = rms(x, 1 + w[pre + "input_layernorm.weight"], eps)
    qg = (xn @ w[pre + "self_attn.q_proj.weight"].T).reshape(L, nh, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:].reshape(L, nh * hd)
    k = (xn @ w[pre + "self_attn.k_proj.weight"].T).reshape(L, nkv, hd)
    v = (xn @ w[pre + "self_attn.v_proj.weight"].T).reshape(L, nkv, hd)
    q = rms(q, 1 + w[pre + "self_attn.q_norm.weight"], eps)
    k = rms(k, 1 + w[pre + "self_attn.k_norm.weight"], eps)
    dims = int(hd * tc["rope_parameters"]["partial_rotary_factor"])
    q, k = rope(q, dims, tc["rope_parameters"]["rope_theta"]), rope(k, dims, tc["rope_parameters"]["rope_theta"])
    a = attention(q, k, v, hd ** -0.5).reshape(L, nh * hd) * (1 / (1 + np.exp(-gate)))
    h = x + a @ w[pre + "self_attn.o_proj.weight"].T
    return h + mlp(rms(h, 1 + w[pre + "post_attention_layernorm.weight"], eps), w, pre + "mlp.")


def mimo_block(x, w, pre, tc):
    eps, nh, nkv = tc["rms_norm_eps"], tc["num_attention_heads"], tc["num_key_value_heads"]
    hd = tc["hidden_size"] // nh
    xn = rms(x, w[pre + "input_layernorm.weight"], eps)

    def proj(n, heads):
        return (xn @ w[pre + f"self_attn.{n}_proj.weight"].T + w[pre + f"self_attn.{n}_proj.bias"]).reshape(L, heads, hd)

    q, k, v = proj("q", nh), proj("k", nkv), proj("v", nkv)
    q, k = rope(q, hd, tc["rope_theta"]), rope(k, hd, tc["rope_theta"])
    h = x + attention(q, k, v, hd ** -0.5).reshape(L, nh * hd) @ w[pre + "self_attn.o_proj.weight"].T
    return h + mlp(rms(h, w[pre + "post_attention_layernorm.weight"], eps), w, pre + "mlp.")


# family -> (head prefix, names of enorm, hnorm, proj, out norm, block prefix, concat order)
LAYOUT = {
    "qwen3_5": ("mtp.", "pre_fc_norm_embedding", "pre_fc_norm_hidden", "fc", "norm", "layers.0.", "eh"),
    "qwen3_5_moe": ("mtp.", "pre_fc_norm_embedding", "pre_fc_norm_hidden", "fc", "norm", "layers.0.", "eh"),
    "qwen3_next": ("mtp.", "pre_fc_norm_embedding", "pre_fc_norm_hidden", "fc", "norm", "layers.0.", "eh"),
    "deepseek_v3": ("model.layers.2.", "enorm", "hnorm", "eh_proj", "shared_head.norm", "", "eh"),
    "glm4_moe": ("model.layers.2.", "enorm", "hnorm", "eh_proj", "shared_head.norm", "", "eh"),
    "mimo": ("model.mtp_layers.0.", "token_layernorm", "hidden_layernorm", "input_proj", "final_layernorm", "", "he"),
}
FULL_NUMPY = {"qwen3_5": qwen3_5_block, "mimo": mimo_block}


def _weights(folder):
    w = read_hf(folder)
    out = {}
    for k, v in w.items():
        if k.endswith("_scale_inv"):
            continue
        if k + "_scale_inv" in w:
            s = w[k + "_scale_inv"]
            v = E4M3[v] * np.repeat(np.repeat(s, 128, 0), 128, 1)[: v.shape[0], : v.shape[1]]
        out[k] = v.astype(np.float64)
    return out


@pytest.mark.parametrize("family,fp8", [(f, False) for f in LAYOUT] + [("deepseek_v3", True)])
def test_head_logits_match_numpy(tmp_path_factory, family, fp8):
    full = family in FULL_NUMPY
    folder = make(tmp_path_factory, family, block_from_target=not full, fp8=fp8)
    model, config = load_hf(folder)
    drafter = load_mtp_drafter(model, folder, config)
    tc = text_cfg(config)
    eps = tc["rms_norm_eps"]
    w = _weights(folder)
    pre, en, hn, pj, on, bpre, order = LAYOUT[family]
    zc = 1.0 if family in ZERO_CENTRED else 0.0

    rng = np.random.default_rng(0)
    toks = rng.integers(0, tc["vocab_size"], L)
    hid = rng.normal(0, 1, (L, tc["hidden_size"])).astype(np.float32)
    embed_key = "model.language_model.embed_tokens.weight" if family.startswith("qwen3_5") else "model.embed_tokens.weight"
    e = w[embed_key][toks]
    a, b = rms(e, zc + w[pre + en + ".weight"], eps), rms(hid, zc + w[pre + hn + ".weight"], eps)
    x_ref = np.concatenate([a, b] if order == "eh" else [b, a], -1) @ w[pre + pj + ".weight"].T

    layer = drafter.head.layers[0]
    e_mx = drafter.target.embed_tokens(mx.array(toks))
    x = layer.project(e_mx, mx.array(hid))
    np.testing.assert_allclose(np.array(x), x_ref, rtol=1e-4, atol=1e-4)
    if fp8:
        return  # the target's own layers are dequantised to bf16 by mlx-lm: compare the projection only

    if full:
        y_ref = FULL_NUMPY[family](x_ref, w, pre + bpre, tc)
    else:  # the head's block is a copy of the target's last layer (full-attention layer for Qwen3-Next)
        idx = tc["full_attention_interval"] - 1 if family in ("qwen3_next", "qwen3_5_moe") else tc["num_hidden_layers"] - 1
        target_layer = drafter.target.inner.layers[idx]
        y_ref = np.array(target_layer(mx.array(x_ref, dtype=mx.float32)[None], mx.array(np.tril(np.ones((L, L), bool))), None)[0]).astype(np.float64)
    h_ref = rms(y_ref, zc + w[pre + on + ".weight"], eps)
    logits_ref = h_ref @ w["lm_head.weight"].T

    h = layer(e_mx, mx.array(hid), KVCache())
    logits = drafter._logits(0, h, [])
    np.testing.assert_allclose(np.array(h), h_ref, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.array(logits), logits_ref, rtol=1e-4, atol=1e-4)
