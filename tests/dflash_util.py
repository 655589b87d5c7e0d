"""A tiny DFlash checkpoint in z-lab's published layout (DFlashDraftModel: a Qwen3 config with block_size and
dflash_config {target_layer_ids, mask_token_id}; tensors fc, hidden_norm, layers.i.*, norm) and a numpy
forward of the block computed from the checkpoint's tensors and the target's embedding / output matrices
alone (z-lab dflash/model.py: DFlashDraftModel.forward + compute_logits, its _attention_mask)."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np


def dflash_config(hidden: int, vocab: int, layer_ids=(0, 1), mask_token_id: int = 0, block_size: int = 6,
                  layer_types=("full_attention", "full_attention"), sliding_window: int | None = None,
                  is_causal=None) -> dict:
    cfg = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": hidden,
        "num_hidden_layers": len(layer_types), "intermediate_size": 2 * hidden, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 8, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "max_position_embeddings": 4096, "vocab_size": vocab, "attention_bias": False,
        "layer_types": list(layer_types), "sliding_window": sliding_window, "block_size": block_size,
        "num_target_layers": 2,
        "dflash_config": {"target_layer_ids": list(layer_ids), "mask_token_id": mask_token_id},
    }
    if is_causal is not None:
        cfg["is_causal"] = is_causal
    return cfg


def dflash_tensors(cfg: dict, seed: int) -> dict[str, np.ndarray]:
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
        w |= {
            p + "self_attn.q_proj.weight": lin(nh * D, H, 2.0), p + "self_attn.k_proj.weight": lin(nkv * D, H, 2.0),
            p + "self_attn.v_proj.weight": lin(nkv * D, H), p + "self_attn.o_proj.weight": lin(H, nh * D),
            p + "self_attn.q_norm.weight": norm(D), p + "self_attn.k_norm.weight": norm(D),
            p + "mlp.gate_proj.weight": lin(I, H), p + "mlp.up_proj.weight": lin(I, H),
            p + "mlp.down_proj.weight": lin(H, I),
            p + "input_layernorm.weight": norm(H), p + "post_attention_layernorm.weight": norm(H),
        }
    return w


def write_dflash(path: Path, hidden: int, vocab: int, seed: int = 7, **kw) -> tuple[dict, dict]:
    """Write config.json + model.safetensors; -> (config, tensors)."""
    path.mkdir(parents=True, exist_ok=True)
    cfg = dflash_config(hidden, vocab, **kw)
    w = dflash_tensors(cfg, seed)
    (path / "config.json").write_text(json.dumps(cfg))
    mx.save_safetensors(str(path / "model.safetensors"), {k: mx.array(v) for k, v in w.items()})
    return cfg, w


def config(vocab: int, hidden: int, ids=(0, 2), block_size: int = 5, mask_token_id: int | None = None,
           sliding: bool = False) -> dict:
    """The same config by the other call shape the CLI / trainer tests use (mask token: the last id)."""
    kw = dict(layer_types=("sliding_attention", "full_attention"), sliding_window=4) if sliding else {}
    return dflash_config(hidden, vocab, layer_ids=ids, block_size=block_size,
                         mask_token_id=vocab - 1 if mask_token_id is None else mask_token_id, **kw)


def write(path: Path, cfg: dict, seed: int = 3) -> dict[str, np.ndarray]:
    """Write a given config + random tensors; -> tensors."""
    path.mkdir(parents=True, exist_ok=True)
    w = dflash_tensors(cfg, seed)
    (path / "config.json").write_text(json.dumps(cfg))
    mx.save_safetensors(str(path / "model.safetensors"), {k: mx.array(v) for k, v in w.items()})
    return w


# -- the numpy reference ---------------------------------------------------------------------------------
def _rms(x, w, eps=1e-6):
    return x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + eps) * w


def _rope(x, pos, theta):
    """NEOX halves (transformers' rotate_half); x [n, heads, D], pos [n]."""
    D = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, D, 2) / D)
    ang = pos[:, None, None] * inv
    c, s = np.cos(ang), np.sin(ang)
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def _mask(n_q, n_k, causal, window):
    q = n_k - n_q + np.arange(n_q)[:, None]
    k = np.arange(n_k)[None]
    vis = np.ones((n_q, n_k), bool)
    if causal:
        vis &= k <= q
    if window is not None:
        vis &= q - k < window
        if not causal:
            vis &= k - q < window
    return vis


def reference_block(w: dict, cfg: dict, features: np.ndarray, block: list[int], embed: np.ndarray,
                    head: np.ndarray) -> np.ndarray:
    """features [P, n_ids * H]: the target layer outputs of every token before the block (positions 0..P-1);
    block [B] token ids at positions P..P+B-1; embed [V, H] the target's input embedding, head [V, H] its
    output layer. -> draft logits [B - 1, V] (rows 1..B-1 of the block)."""
    H, D, theta = cfg["hidden_size"], cfg["head_dim"], cfg["rope_theta"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    P, B = features.shape[0], len(block)
    ctx = _rms(features @ w["fc.weight"].T, w["hidden_norm.weight"])
    h = embed[block].astype(np.float64)
    pos = np.arange(P + B)
    for i, lt in enumerate(cfg["layer_types"]):
        p = f"layers.{i}."
        causal = (lt == "sliding_attention") if cfg.get("is_causal") is None else bool(cfg["is_causal"])
        window = cfg["sliding_window"] if lt == "sliding_attention" else None
        x = _rms(h, w[p + "input_layernorm.weight"])
        both = np.concatenate([ctx, x])
        q = _rms((x @ w[p + "self_attn.q_proj.weight"].T).reshape(B, nh, D), w[p + "self_attn.q_norm.weight"])
        k = _rms((both @ w[p + "self_attn.k_proj.weight"].T).reshape(P + B, nkv, D), w[p + "self_attn.k_norm.weight"])
        v = (both @ w[p + "self_attn.v_proj.weight"].T).reshape(P + B, nkv, D)
        q, k = _rope(q, pos[P:], theta), _rope(k, pos, theta)
        vis = _mask(B, P + B, causal, window)
        out = np.zeros((B, nh, D))
        for j in range(nh):
            s = q[:, j] @ k[:, j // (nh // nkv)].T / np.sqrt(D)
            s = np.where(vis, s, -np.inf)
            a = np.exp(s - s.max(-1, keepdims=True))
            out[:, j] = (a / a.sum(-1, keepdims=True)) @ v[:, j // (nh // nkv)]
        h = h + out.reshape(B, -1) @ w[p + "self_attn.o_proj.weight"].T
        m = _rms(h, w[p + "post_attention_layernorm.weight"])
        g = m @ w[p + "mlp.gate_proj.weight"].T
        h = h + ((g / (1 + np.exp(-g))) * (m @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    y = _rms(h, w["norm.weight"])
    return y[1:] @ head.T
