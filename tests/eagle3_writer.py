"""Tiny EAGLE-3 checkpoints in the published HF layout (SafeAILab/EAGLE, vLLM llama_eagle3) and a numpy
reference of the drafting rule computed from their tensors alone."""

import json
from pathlib import Path

import mlx.core as mx
import numpy as np


def write_eagle3(folder: Path, target_cfg: dict, seed: int = 0, draft_vocab: int | None = None, hidden: int | None = None,
                 own_embed: bool = False, aux_ids=None, heads: int = 4, kv_heads: int = 2, inter: int = 64,
                 scale: float = 0.3) -> dict:
    """Write config.json + model.safetensors; return the tensors (numpy, HF names) and the config."""
    rng = np.random.default_rng(seed)
    th = target_cfg["hidden_size"]
    h = hidden or th
    vocab = target_cfg["vocab_size"]
    dv = draft_vocab or vocab
    hd = h // heads

    def w(*shape):
        return (rng.standard_normal(shape) * scale / np.sqrt(shape[-1])).astype(np.float32)

    def norm():
        return (1.0 + 0.1 * rng.standard_normal(h)).astype(np.float32)

    t = {
        "fc.weight": w(h, 3 * th),
        "midlayer.input_layernorm.weight": norm(),
        "midlayer.hidden_norm.weight": norm(),
        "midlayer.post_attention_layernorm.weight": norm(),
        "midlayer.self_attn.q_proj.weight": w(heads * hd, 2 * h),
        "midlayer.self_attn.k_proj.weight": w(kv_heads * hd, 2 * h),
        "midlayer.self_attn.v_proj.weight": w(kv_heads * hd, 2 * h),
        "midlayer.self_attn.o_proj.weight": w(h, heads * hd),
        "midlayer.mlp.gate_proj.weight": w(inter, h),
        "midlayer.mlp.up_proj.weight": w(inter, h),
        "midlayer.mlp.down_proj.weight": w(h, inter),
        "norm.weight": norm(),
        "lm_head.weight": w(dv, h) * 8,
    }
    if dv != vocab:
        ids = np.sort(rng.choice(vocab, size=dv, replace=False))
        t["d2t"] = (ids - np.arange(dv)).astype(np.int64)
        t2d = np.zeros(vocab, dtype=bool)
        t2d[ids] = True
        t["t2d"] = t2d
    if own_embed or h != th:
        t["embed_tokens.weight"] = rng.standard_normal((vocab, h)).astype(np.float32)
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": h,
        "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "num_hidden_layers": 1, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "vocab_size": vocab,
        "draft_vocab_size": dv, "target_hidden_size": th, "tie_word_embeddings": False,
    }
    if aux_ids is not None:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux_ids)}
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    mx.save_safetensors(str(folder / "model.safetensors"),
                        {k: mx.array(v.astype(np.int32) if v.dtype == np.int64 else v) for k, v in t.items()})
    return {"tensors": t, "config": cfg}


# -- numpy reference --------------------------------------------------------------------------------------

def _rms(x, w, eps=1e-6):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rope(x, theta):  # x [heads, L, hd], positions 0..L-1, rotate-half (non-traditional)
    hd = x.shape[-1]
    inv = theta ** (-np.arange(0, hd, 2) / hd)
    ang = np.arange(x.shape[1])[:, None] * inv[None]
    cos, sin = np.cos(ang), np.sin(ang)
    a, b = x[..., : hd // 2], x[..., hd // 2:]
    return np.concatenate([a * cos - b * sin, a * sin + b * cos], -1)


def layer_ref(ckpt: dict, e: np.ndarray, g: np.ndarray) -> np.ndarray:
    """Pre-norm outputs y [L, H] of the midlayer for slots at positions 0..L-1 (causal)."""
    t, c = ckpt["tensors"], ckpt["config"]
    nh, nkv = c["num_attention_heads"], c["num_key_value_heads"]
    hd = c["hidden_size"] // nh
    x = np.concatenate([_rms(e, t["midlayer.input_layernorm.weight"]), _rms(g, t["midlayer.hidden_norm.weight"])], -1)
    L = x.shape[0]
    q = (x @ t["midlayer.self_attn.q_proj.weight"].T).reshape(L, nh, hd).transpose(1, 0, 2)
    k = (x @ t["midlayer.self_attn.k_proj.weight"].T).reshape(L, nkv, hd).transpose(1, 0, 2)
    v = (x @ t["midlayer.self_attn.v_proj.weight"].T).reshape(L, nkv, hd).transpose(1, 0, 2)
    q, k = _rope(q, c["rope_theta"]), _rope(k, c["rope_theta"])
    rep = nh // nkv
    k, v = np.repeat(k, rep, 0), np.repeat(v, rep, 0)
    s = q @ k.transpose(0, 2, 1) / np.sqrt(hd)
    s = s + np.triu(np.full((L, L), -np.inf), 1)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o = (p @ v).transpose(1, 0, 2).reshape(L, nh * hd) @ t["midlayer.self_attn.o_proj.weight"].T
    h = g + o
    m = _rms(h, t["midlayer.post_attention_layernorm.weight"])
    gate, up = m @ t["midlayer.mlp.gate_proj.weight"].T, m @ t["midlayer.mlp.up_proj.weight"].T
    return h + ((gate / (1 + np.exp(-gate))) * up) @ t["midlayer.mlp.down_proj.weight"].T


def logits_ref(ckpt: dict, y: np.ndarray) -> np.ndarray:
    """Full-vocabulary logits of pre-norm outputs y: -inf off the draft vocabulary."""
    t, c = ckpt["tensors"], ckpt["config"]
    small = _rms(y, t["norm.weight"]) @ t["lm_head.weight"].T
    dv = small.shape[-1]
    ids = np.arange(dv) + (t["d2t"] if "d2t" in t else 0)
    full = np.full((y.shape[0], c["vocab_size"]), -np.inf, dtype=np.float64)
    full[:, ids] = small
    return full


def draft_ref(ckpt: dict, embed: np.ndarray, tokens: list[int], features: np.ndarray, drafts: list[int]) -> np.ndarray:
    """Logits of each draft step: the prompt slots p = 0..n-1 take (Emb(t_{p+1}), fc(features_p)); draft
    step j > 0 chains (Emb(d_j), y of the previous slot). Returns [len(drafts), V]."""
    t = ckpt["tensors"]
    emb = t.get("embed_tokens.weight", embed)
    g = features @ t["fc.weight"].T
    e = emb[np.array(tokens[1:])]
    out = []
    for j in range(len(drafts)):
        y = layer_ref(ckpt, e, g)
        out.append(logits_ref(ckpt, y[-1:])[0])
        e = np.concatenate([e, emb[drafts[j]][None]])
        g = np.concatenate([g, y[-1:]])
    return np.stack(out)
