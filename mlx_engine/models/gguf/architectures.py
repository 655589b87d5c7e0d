"""What differs per architecture: GGUF -> HF tensor names, and the HF config each architecture's
metadata describes (llama, gemma3)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
import numpy as np

from .file import GGUFFile
from .tensors import QArray, Tensor

_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

_LLAMA_BLOCK = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

_GEMMA3_BLOCK = {
    **_LLAMA_BLOCK,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}

# MTP blocks (GLM-4.x, DeepSeek): the block's own tensors plus the nextn head. Experts are kept stacked
# under mlx-lm's names (mlp.switch_mlp.*), as mlx-lm's sanitize() would produce them.
_MTP_BLOCK = {
    **_LLAMA_BLOCK,
    "post_attention_norm": "post_attention_layernorm",  # GLM-4.x's pre-FFN norm
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
    "ffn_up_exps": "mlp.switch_mlp.up_proj",
    "ffn_down_exps": "mlp.switch_mlp.down_proj",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
    "nextn.eh_proj": "eh_proj",
    "nextn.enorm": "enorm",
    "nextn.hnorm": "hnorm",
    "nextn.shared_head_norm": "shared_head.norm",
    "nextn.shared_head_head": "shared_head.head",
    "nextn.embed_tokens": "embed_tokens",
}
_MTP_FULL_NAMES = {"exp_probs_b.bias": "mlp.gate.e_score_correction_bias"}


def _split_name(name: str) -> tuple[int | None, str, str]:
    """'blk.3.nextn.enorm.weight' -> (3, 'nextn.enorm', 'weight'); 'output.weight' -> (None, 'output', 'weight')."""
    parts = name.split(".")
    if parts[0] == "blk":
        return int(parts[1]), ".".join(parts[2:-1]), parts[-1]
    return None, ".".join(parts[:-1]), parts[-1]


def _layer_of(name: str) -> int | None:
    return _split_name(name)[0]


def hf_name(name: str, block_names: dict[str, str], full_names: dict[str, str] | None = None) -> str | None:
    """GGUF tensor name -> HF/mlx-lm name, None when unknown."""
    layer, stem, suffix = _split_name(name)
    if layer is None:
        hf = _GLOBAL_NAMES.get(stem)
        return hf and f"{hf}.{suffix}"
    if full_names and (full := full_names.get(f"{stem}.{suffix}")):
        return f"model.layers.{layer}.{full}"
    hf = block_names.get(stem)
    return hf and f"model.layers.{layer}.{hf}.{suffix}"


def _unpermute(a: mx.array, n_head: int) -> mx.array:
    """Inverse of convert_hf_to_gguf's LlamaModel.permute (rows (head, 2, d/2) -> (head, d/2, 2))."""
    return a.reshape(n_head, a.shape[0] // n_head // 2, 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)


def _map_rows(a: Tensor, fn: Callable[[mx.array], mx.array]) -> Tensor:
    return a.map_rows(fn) if isinstance(a, QArray) else fn(a)


def _flatten(name: str, a: Tensor) -> dict[str, mx.array]:
    if not isinstance(a, QArray):
        return {name: a}
    stem = name.removesuffix(".weight")
    return {f"{stem}.weight": a.weight, f"{stem}.scales": a.scales, f"{stem}.biases": a.biases}


def _rope_scaling(g: GGUFFile) -> dict | None:
    kind = g.key("rope.scaling.type")
    if kind in (None, "none"):
        return None
    factor = float(g.key("rope.scaling.factor", 1.0))
    if kind == "linear":
        return {"type": "linear", "factor": factor}
    if kind == "yarn":
        scaling = {"type": "yarn", "factor": factor}
        for gguf_key, hf_key in [
            ("rope.scaling.original_context_length", "original_max_position_embeddings"),
            ("rope.scaling.yarn_beta_fast", "beta_fast"),
            ("rope.scaling.yarn_beta_slow", "beta_slow"),
        ]:
            if (value := g.key(gguf_key)) is not None:
                scaling[hf_key] = value
        return scaling
    raise ValueError(f"unsupported rope scaling type {kind!r} in {g.path}")


def _common_config(g: GGUFFile) -> dict:
    hidden, n_heads = int(g.key("embedding_length")), int(g.key("attention.head_count"))
    return {
        "hidden_size": hidden,
        "num_hidden_layers": int(g.key("block_count")) - int(g.key("nextn_predict_layers", 0)),
        "intermediate_size": int(g.key("feed_forward_length")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(g.key("attention.head_count_kv", n_heads)),
        "head_dim": int(g.key("attention.key_length", hidden // n_heads)),
        "rms_norm_eps": float(g.key("attention.layer_norm_rms_epsilon", 1e-5)),
        "vocab_size": g.tensors["token_embd.weight"].shape[0],
        "max_position_embeddings": int(g.key("context_length", 4096)),
        "rope_theta": float(g.key("rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(g),
        "tie_word_embeddings": "output.weight" not in g.tensors,
    }


def _llama_config(g: GGUFFile) -> dict:
    return {
        "model_type": "llama",
        **_common_config(g),
        "attention_bias": "blk.0.attn_q.bias" in g.tensors,
        "mlp_bias": "blk.0.ffn_up.bias" in g.tensors,
    }


def _sliding_window_pattern(g: GGUFFile) -> int:
    """llama.cpp hard-codes 6 for gemma3; newer files may store an int or one bool per layer (True = sliding)."""
    pattern = g.key("attention.sliding_window_pattern", 6)
    if np.ndim(pattern) == 0:
        return int(pattern)
    flags = [bool(f) for f in pattern]
    period = flags.index(False) + 1 if False in flags else len(flags) + 1
    if flags != [(i + 1) % period != 0 for i in range(len(flags))]:
        raise ValueError(f"sliding window layers {flags} are not periodic: mlx-lm gemma3 cannot run them")
    return period


def _gemma3_config(g: GGUFFile) -> dict:
    config = {"model_type": "gemma3_text", **_common_config(g)}
    # llama.cpp's attention scale: 1/sqrt(head_dim), except Gemma-3-27B (62 layers): 1/sqrt(hidden / heads).
    scalar = config["head_dim"]
    if config["num_hidden_layers"] == 62:
        scalar = config["hidden_size"] // config["num_attention_heads"]
    config.update(
        rms_norm_eps=float(g.key("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(g.key("rope.freq_base", 1_000_000.0)),
        rope_local_base_freq=float(g.key("rope.freq_base_swa", 10_000.0)),
        query_pre_attn_scalar=scalar,
        sliding_window=int(g.key("attention.sliding_window", 512)),
        sliding_window_pattern=_sliding_window_pattern(g),
    )
    return config


@dataclass(frozen=True)
class _Arch:
    model_type: str  # the mlx_lm.models module
    block_names: dict[str, str]
    config: Callable[[GGUFFile], dict]
    permute_qk: bool  # llama.cpp permuted Q/K rows
    norm_shift: float  # llama.cpp stored norm weights + norm_shift


_ARCHS = {
    "llama": _Arch("llama", _LLAMA_BLOCK, _llama_config, permute_qk=True, norm_shift=0.0),
    "gemma3": _Arch("gemma3_text", _GEMMA3_BLOCK, _gemma3_config, permute_qk=False, norm_shift=1.0),
}
