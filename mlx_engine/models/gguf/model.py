"""A GGUF file -> an mlx-lm model (load_gguf), and the MTP (nextn) layers llama.cpp keeps in it."""

from __future__ import annotations

import importlib
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import mlx.core as mx
import mlx.nn as nn

if TYPE_CHECKING:
    from mlx_lm.tokenizer_utils import TokenizerWrapper

from .architectures import (
    _ARCHS, _MTP_BLOCK, _MTP_FULL_NAMES, _Arch, _flatten, _layer_of, _map_rows, _split_name, _unpermute, hf_name,
)
from .file import GROUP_SIZE, GGUFFile, read_gguf
from .tensors import Tensor, _decode, load_tensors
from .tokenizer import gguf_tokenizer


def _to_hf(tensors: dict[str, Tensor], arch: _Arch, config: dict) -> dict[str, mx.array]:
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    weights, unknown = {}, []
    for name, a in tensors.items():
        hf = hf_name(name, arch.block_names)
        if hf is None:
            unknown.append(name)
            continue
        module, kind = hf.rsplit(".", 2)[-2:]
        if arch.permute_qk and module in heads:
            a = _map_rows(a, partial(_unpermute, n_head=heads[module]))
        if arch.norm_shift and module.endswith("norm") and kind == "weight":
            a = a - arch.norm_shift
        weights.update(_flatten(hf, a))
    if unknown:
        raise ValueError(f"GGUF tensors with no {arch.model_type} equivalent: {unknown[:10]}")
    return weights


def _quantize_like(model: nn.Module, weights: dict[str, mx.array], config: dict) -> None:
    """Make the layers whose weights come quantized nn.QuantizedLinear / QuantizedEmbedding (group size 32)."""
    bits = {}
    for name, scales in weights.items():
        if name.endswith(".scales"):
            path = name.removesuffix(".scales")
            bits[path] = weights[f"{path}.weight"].shape[-1] // scales.shape[-1]  # uint32 words per group of 32
    if not bits:
        return
    nn.quantize(model, class_predicate=lambda path, _: path in bits and {"group_size": GROUP_SIZE, "bits": bits[path]})
    common = max(bits.values(), key=list(bits.values()).count)
    others = {path: {"group_size": GROUP_SIZE, "bits": b} for path, b in bits.items() if b != common}
    config["quantization"] = {"group_size": GROUP_SIZE, "bits": common, **others}


def _build_model(arch: _Arch, config: dict, weights: dict[str, mx.array]) -> nn.Module:
    module = importlib.import_module(f"mlx_lm.models.{arch.model_type}")
    model = module.Model(module.ModelArgs.from_dict(config))
    weights = model.sanitize(weights)
    _quantize_like(model, weights, config)
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    model.eval()
    return model


_ROPE_FREQS = "rope_freqs.weight"


def _base_freqs(dims: int, base: float) -> mx.array:
    return base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)


class FactorRoPE(nn.Module):
    """RoPE with llama.cpp's per-dimension frequency factors (``rope_freqs``), as mlx-lm's Llama3RoPE runs it."""

    def __init__(self, dims: int, base: float, factors: mx.array):
        super().__init__()
        self.dims = dims
        self._freqs = _base_freqs(dims, base) * factors  # "_": not a parameter

    def __call__(self, x: mx.array, offset: int = 0) -> mx.array:
        return mx.fast.rope(x, self.dims, traditional=False, base=None, scale=1.0, offset=offset, freqs=self._freqs)


def _llama3_rope_scaling(factors: mx.array, config: dict) -> dict | None:
    """The HF "llama3" rope_scaling that reproduces llama.cpp's rope_freqs, if Meta's defaults (all Llama 3.x) do."""
    from mlx_lm.models.rope_utils import Llama3RoPE

    scaling = {"rope_type": "llama3", "factor": factors.max().item(), "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip
    dims, base = config["head_dim"], config["rope_theta"]
    implied = Llama3RoPE(dims, base=base, scaling_config=scaling)._freqs / _base_freqs(dims, base)
    return scaling if mx.allclose(implied, factors, rtol=1e-4).item() else None


def load_gguf(path: str | Path, dtype: mx.Dtype | None = None) -> tuple[nn.Module, TokenizerWrapper, dict]:
    """Load a llama or gemma3 GGUF file into the matching mlx-lm model class.

    Returns (model, tokenizer, config): config is the HF-style dict the model was built from (plus
    "quantization" when layers stay quantized), tokenizer an mlx_lm TokenizerWrapper rebuilt from the metadata.
    dtype=None keeps Q4_0/Q4_1/Q8_0 as MLX quantized layers and floats as stored; a dtype dequantizes everything.
    """
    g = read_gguf(path)
    arch = _ARCHS.get(g.arch)
    if arch is None:
        supported = ", ".join(_ARCHS)
        raise ValueError(f"unsupported GGUF architecture {g.arch!r} in {g.path} (supported: {supported})")
    config = arch.config(g)
    rope_factors = _decode(g.tensors[_ROPE_FREQS], mx.float32) if _ROPE_FREQS in g.tensors else None
    if rope_factors is not None and (scaling := _llama3_rope_scaling(rope_factors, config)):
        config["rope_scaling"], rope_factors = scaling, None
    n_layers = config["num_hidden_layers"]
    names = [n for n in g.tensors if n != _ROPE_FREQS and ((layer := _layer_of(n)) is None or layer < n_layers)]
    model = _build_model(arch, config, _to_hf(load_tensors(g, names, dtype), arch, config))
    if rope_factors is not None:  # not expressible in config: a saved copy of this model would lose it
        rope = FactorRoPE(config["head_dim"], config["rope_theta"], rope_factors)
        for layer in model.layers:
            layer.self_attn.rope = rope
    return model, gguf_tokenizer(g.metadata), config


def _first_mtp_layer(g: GGUFFile) -> int | None:
    if n := int(g.key("nextn_predict_layers", 0)):
        return int(g.key("block_count")) - n
    layers = [_layer_of(name) for name in g.tensors if ".nextn." in name]
    return min(layers) if layers else None


_MTP_COPIES = ("nextn.embed_tokens", "nextn.shared_head_head")  # copies of the target's embedding / lm_head


def read_gguf_mtp_tensors(path: str | Path | GGUFFile, dtype: mx.Dtype = mx.float32,
                          skip_copies: bool = False) -> dict[str, mx.array]:
    """The MTP layers' tensors (blocks N >= block_count - nextn_predict_layers), dequantized to dtype.

    Names follow HF DeepSeek/GLM: model.layers.N.{enorm, hnorm, eh_proj, shared_head.norm, shared_head.head,
    embed_tokens, input_layernorm, self_attn.*, post_attention_layernorm, mlp.*}.weight; stacked experts use
    mlx-lm's mlp.switch_mlp.*. Tensors with no known equivalent keep their GGUF name. Empty dict if none.
    skip_copies: leave out nextn.embed_tokens / nextn.shared_head_head (vocabulary-sized copies of the
    target's embedding and output matrix, which the head does not use), without decoding them.
    `path` may be an already parsed GGUFFile.
    """
    g = path if isinstance(path, GGUFFile) else read_gguf(path)
    first = _first_mtp_layer(g)
    if first is None:
        return {}
    names = [n for n in g.tensors if (layer := _layer_of(n)) is not None and layer >= first
             and not (skip_copies and _split_name(n)[1] in _MTP_COPIES)]
    tensors = load_tensors(g, names, dtype, use_mx_load=False)
    return {hf_name(n, _MTP_BLOCK, _MTP_FULL_NAMES) or n: a for n, a in tensors.items()}
