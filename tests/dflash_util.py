"""A tiny DFlash checkpoint in z-lab's published layout (DFlashDraftModel: Qwen3 config + dflash_config,
fc / hidden_norm / layers.* / norm tensors) and a numpy forward of its drafting rule from those tensors
(z-lab dflash/model.py: context K/V from hidden_norm(fc(target layer features)), the block's own K/V,
the reference's attention mask, norm, the target's output layer)."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np


def config(vocab: int, hidden: int, ids=(0, 2), block_size: int = 5, mask_token_id: int | None = None,
           sliding: bool = False) -> dict:
    cfg = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": hidden,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 12,
        "intermediate_size": 2 * hidden, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "max_position_embeddings": 2048, "vocab_size": vocab, "block_size": block_size,
        "num_target_layers": 4, "tie_word_embeddings": False,
        "dflash_config": {"target_layer_ids": list(ids), "mask_token_id": vocab - 1 if mask_token_id is None
                          else mask_token_id},
    }
    if sliding:
        cfg |= {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4}
    return cfg


def tensors(cfg: dict, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    H, I, D = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    n_ids = len(cfg["dflash_config"]["target_layer_ids"])

    def lin(o, i, s=1.0):
        return (rng.standard_normal((o, i)) * s / np.sqrt(i)).astype(np.float32)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    w = {"fc.weight": lin(H, n_ids * H), "hidden_norm.weight": norm(H), "norm.weight": norm(H)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        w |= {p + "self_attn.q_proj.weight": lin(nh * D, H, 2.0), p + "self_attn.k_proj.weight": lin(nkv * D, H, 2.0),
              p + "self_attn.v_proj.weight": lin(nkv * D, H), p + "self_attn.o_proj.weight": lin(H, nh * D),
              p + "self_attn.q_norm.weight": norm(D), p + "self_attn.k_norm.weight": norm(D),
              p + "mlp.gate_proj.weight": lin(I, H), p + "mlp.up_proj.weight": lin(I, H),
              p + "mlp.down_proj.weight": lin(H, I), p + "input_layernorm.weight": norm(H),
              p + "post_attention_layernorm.weight": norm(H)}
    return w


def write(path: Path, cfg: dict, seed: int = 3) -> dict[str, np.ndarray]:
    path.mkdir(parents=True, exist_ok=True)
    w = tensors(cfg, seed)
    (path / "config.json").write_text(json.dumps(cfg))
    mx.save_safetensors(str(path / "model.safetensors"), {k: mx.array(v) for k, v in w.items()})
    return w


def _rms(x, w, eps=1e-6):
    return x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + eps) * w


def _rope(x, pos, theta):
    """x [n, heads, D] at positions pos [n], NEOX halves."""
    D = x.shape[-1]
    ang = pos[:, None, None] * (1.0 / theta ** (np.arange(0, D, 2) / D))[None, None]
    c, s = np.cos(ang), np.sin(ang)
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def reference_logits(w: dict, cfg: dict, embed: np.ndarray, out: np.ndarray, features: np.ndarray,
                     block: list[int]) -> np.ndarray:
    """features [N, n_ids * H] of context positions 0..N-1; block tokens at N..N+B-1; embed [V, H] (the
    target's raw input embedding), out [V, H] (its output layer). -> logits of block rows 1.. [B-1, V]."""
    H, D = cfg["hidden_size"], cfg["head_dim"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    types = cfg.get("layer_types") or ["full_attention"] * cfg["num_hidden_layers"]
    N, B = features.shape[0], len(block)
    c = _rms(features @ w["fc.weight"].T, w["hidden_norm.weight"])
    h = embed[block].astype(np.float64)
    qpos, kpos = N + np.arange(B), np.arange(N + B)
    for i, lt in enumerate(types):
        p = f"layers.{i}.self_attn."
        x = _rms(h, w[f"layers.{i}.input_layernorm.weight"])
        q = _rope(_rms((x @ w[p + "q_proj.weight"].T).reshape(B, nh, D), w[p + "q_norm.weight"]), qpos, cfg["rope_theta"])
        src = np.concatenate([c, x])
        k = _rope(_rms((src @ w[p + "k_proj.weight"].T).reshape(N + B, nkv, D), w[p + "k_norm.weight"]), kpos,
                  cfg["rope_theta"])
        v = (src @ w[p + "v_proj.weight"].T).reshape(N + B, nkv, D)
        causal = lt == "sliding_attention"
        vis = np.ones((B, N + B), bool)
        if causal:
            vis &= kpos[None] <= qpos[:, None]
        if lt == "sliding_attention":
            vis &= qpos[:, None] - kpos[None] < cfg["sliding_window"]
        o = np.zeros((B, nh, D))
        for j in range(nh):
            s = (k[:, j // (nh // nkv)] @ q[:, j].T).T * D**-0.5  # [B, N+B]
            s = np.where(vis, s, -np.inf)
            a = np.exp(s - s.max(-1, keepdims=True))
            o[:, j] = (a / a.sum(-1, keepdims=True)) @ v[:, j // (nh // nkv)]
        h = h + o.reshape(B, -1) @ w[p + "o_proj.weight"].T
        m = _rms(h, w[f"layers.{i}.post_attention_layernorm.weight"])
        g = m @ w[f"layers.{i}.mlp.gate_proj.weight"].T
        h = h + ((g / (1 + np.exp(-g))) * (m @ w[f"layers.{i}.mlp.up_proj.weight"].T)) @ w[f"layers.{i}.mlp.down_proj.weight"].T
    y = _rms(h, w["norm.weight"])
    return y[1:] @ out.T
