"""A tiny Gemma 4 target (mlx-lm's gemma4_text), a tiny Gemma 4 assistant checkpoint written in the
published layout (transformers' Gemma4AssistantForCausalLM names and config), and a numpy forward of the
assistant computed from the checkpoint's tensors alone."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.utils import _get_classes

TARGET_H = 32
WINDOW = 6  # small: a 11-token prompt already wraps the target's rotating window


def target_config(vocab: int) -> dict:
    return dict(
        model_type="gemma4_text", hidden_size=TARGET_H, num_hidden_layers=4, intermediate_size=64,
        num_attention_heads=4, head_dim=8, global_head_dim=16, num_key_value_heads=2, num_kv_shared_layers=2,
        sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"] * 2,
        hidden_size_per_layer_input=0, vocab_size=vocab, vocab_size_per_layer_input=vocab,
        use_double_wide_mlp=False, final_logit_softcapping=30.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
    )


def build_target(vocab: int, seed: int = 1):
    cfg = target_config(vocab)
    model_cls, args_cls = _get_classes(cfg)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(cfg))
    model.eval()
    mx.eval(model.parameters())
    return model


def assistant_config(vocab: int, ordered: bool = False) -> dict:
    cfg = {
        "architectures": ["Gemma4AssistantForCausalLM"], "model_type": "gemma4_assistant",
        "backbone_hidden_size": TARGET_H, "tie_word_embeddings": True, "use_ordered_embeddings": ordered,
        "num_centroids": 4, "centroid_intermediate_top_k": 2,
        "text_config": {
            "model_type": "gemma4_text", "hidden_size": 24, "num_hidden_layers": 2, "intermediate_size": 48,
            "num_attention_heads": 4, "head_dim": 8, "global_head_dim": 16, "num_key_value_heads": 2,
            "num_kv_shared_layers": 2, "sliding_window": WINDOW,
            "layer_types": ["sliding_attention", "full_attention"], "hidden_size_per_layer_input": 0,
            "vocab_size": vocab, "vocab_size_per_layer_input": 0, "use_double_wide_mlp": False,
            "enable_moe_block": False, "rms_norm_eps": 1e-6, "final_logit_softcapping": 30.0,
            "rope_parameters": {
                "full_attention": {"rope_type": "proportional", "rope_theta": 1000000.0, "partial_rotary_factor": 0.25},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        },
    }
    return cfg


def assistant_tensors(cfg: dict, seed: int) -> dict[str, np.ndarray]:
    """Random tensors under the published names (no k/v projections: every layer shares the target's)."""
    rng = np.random.default_rng(seed)
    t = cfg["text_config"]
    H, Hb, V, I = t["hidden_size"], cfg["backbone_hidden_size"], t["vocab_size"], t["intermediate_size"]
    nh = t["num_attention_heads"]

    def lin(o, i, s=1.0):
        return (rng.standard_normal((o, i)) * s / np.sqrt(i)).astype(np.float32)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    w = {
        "model.embed_tokens.weight": rng.standard_normal((V, H)).astype(np.float32),
        "model.norm.weight": norm(H),
        "pre_projection.weight": lin(H, 2 * Hb),
        "post_projection.weight": lin(Hb, H, 3.0),
    }
    for i, lt in enumerate(t["layer_types"]):
        D = t["global_head_dim"] if lt == "full_attention" else t["head_dim"]
        p = f"model.layers.{i}."
        w |= {
            p + "self_attn.q_proj.weight": lin(nh * D, H, 2.0), p + "self_attn.q_norm.weight": norm(D),
            p + "self_attn.o_proj.weight": lin(H, nh * D), p + "mlp.gate_proj.weight": lin(I, H),
            p + "mlp.up_proj.weight": lin(I, H), p + "mlp.down_proj.weight": lin(H, I),
            p + "input_layernorm.weight": norm(H), p + "post_attention_layernorm.weight": norm(H),
            p + "pre_feedforward_layernorm.weight": norm(H), p + "post_feedforward_layernorm.weight": norm(H),
            p + "layer_scalar": np.array([0.9], dtype=np.float32),
        }
    if cfg["use_ordered_embeddings"]:
        w["masked_embedding.centroids.weight"] = lin(cfg["num_centroids"], H, 3.0)
        w["masked_embedding.token_ordering"] = rng.permutation(V).astype(np.int64)
    return w


def echo(tensors: dict, cfg: dict, target_embed: np.ndarray) -> None:
    """Make the assistant lean towards repeating its input token (the tiny targets repeat themselves a lot):
    pre_projection maps the target's scaled embedding of token t onto the assistant's output row of t, and
    the layers' residual branches are damped. Drafts then agree with the target often, not always."""
    Hb = cfg["backbone_hidden_size"]
    E = tensors["model.embed_tokens.weight"]
    A = np.sqrt(Hb) * target_embed  # [V, Hb]
    P = np.zeros_like(tensors["pre_projection.weight"])
    P[:, :Hb] = 3.0 * E.T @ np.linalg.pinv(A.T)
    tensors["pre_projection.weight"] = P.astype(np.float32)
    for k in tensors:
        if k.endswith(("post_attention_layernorm.weight", "post_feedforward_layernorm.weight")):
            tensors[k] = (tensors[k] * 0.05).astype(np.float32)


def write_assistant(path: Path, vocab: int, seed: int = 5, ordered: bool = False,
                    echo_embed: np.ndarray | None = None) -> dict[str, np.ndarray]:
    path.mkdir(parents=True, exist_ok=True)
    cfg = assistant_config(vocab, ordered)
    tensors = assistant_tensors(cfg, seed)
    if echo_embed is not None:
        echo(tensors, cfg, echo_embed)
    (path / "config.json").write_text(json.dumps(cfg))
    mx.save_safetensors(str(path / "model.safetensors"), {k: mx.array(v) for k, v in tensors.items()})
    return tensors


# -- the numpy reference (transformers' Gemma4AssistantForCausalLM forward, one position) -----------------
def _rms(x, w, eps=1e-6):
    y = x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + eps)
    return y * w if w is not None else y


def _rope(x, pos, inv_freq):
    """NEOX (rotate halves), x [heads, D]."""
    half = x.shape[-1] // 2
    ang = pos * inv_freq
    c, s = np.cos(ang), np.sin(ang)
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def _inv_freq(rope: dict, D: int) -> np.ndarray:
    theta = rope["rope_theta"]
    if rope.get("rope_type") == "proportional":  # transformers' _compute_proportional_rope_parameters
        angles = int(rope.get("partial_rotary_factor", 1.0) * D // 2)
        rotated = 1.0 / theta ** (np.arange(0, 2 * angles, 2) / D)
        return np.concatenate([rotated, np.zeros(D // 2 - angles)])
    return 1.0 / theta ** (np.arange(0, D, 2) / D)


def _gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def reference_step(w: dict, cfg: dict, x: np.ndarray, kv: dict, pos: int):
    """x [2 Hb] (target embedding * sqrt(Hb), then hidden); kv: type -> (K [Hkv, S, D], V) the layer attends
    (all of it). -> (logits [V], projected state [Hb])."""
    t = cfg["text_config"]
    nh = t["num_attention_heads"]
    h = w["pre_projection.weight"] @ x
    for i, lt in enumerate(t["layer_types"]):
        p = f"model.layers.{i}."
        D = t["global_head_dim"] if lt == "full_attention" else t["head_dim"]
        K, V = kv[lt]
        q = (w[p + "self_attn.q_proj.weight"] @ _rms(h, w[p + "input_layernorm.weight"])).reshape(nh, D)
        q = _rope(_rms(q, w[p + "self_attn.q_norm.weight"]), pos, _inv_freq(t["rope_parameters"][lt], D))
        group = nh // K.shape[0]
        out = []
        for j in range(nh):
            s = K[j // group] @ q[j]  # scale 1.0
            a = np.exp(s - s.max())
            out.append((a / a.sum()) @ V[j // group])
        o = w[p + "self_attn.o_proj.weight"] @ np.concatenate(out)
        h = h + _rms(o, w[p + "post_attention_layernorm.weight"])
        m = _rms(h, w[p + "pre_feedforward_layernorm.weight"])
        m = w[p + "mlp.down_proj.weight"] @ (_gelu_tanh(w[p + "mlp.gate_proj.weight"] @ m) * (w[p + "mlp.up_proj.weight"] @ m))
        h = (h + _rms(m, w[p + "post_feedforward_layernorm.weight"])) * w[p + "layer_scalar"]
    y = _rms(h, w["model.norm.weight"])
    E = w["model.embed_tokens.weight"]
    if cfg["use_ordered_embeddings"]:
        scores = w["masked_embedding.centroids.weight"] @ y
        top = np.argsort(-scores)[: cfg["centroid_intermediate_top_k"]]
        canon = w["masked_embedding.token_ordering"].reshape(cfg["num_centroids"], -1)[top].reshape(-1)
        sel = E[canon] @ y
        logits = np.full(E.shape[0], sel.min() - 1.0)
        logits[canon] = sel
    else:
        logits = E @ y
    return logits, w["post_projection.weight"] @ y
