"""Load GGUF files (llama.cpp's format) into mlx-lm model classes.

Architectures: ``llama`` -> ``mlx_lm.models.llama``; ``gemma3`` -> ``mlx_lm.models.gemma3_text``.

Tensor names, GGUF -> HF / mlx-lm (``N`` is the layer):
    token_embd -> model.embed_tokens     output_norm -> model.norm     output -> lm_head (absent: tied)
    blk.N.attn_norm -> model.layers.N.input_layernorm
    blk.N.attn_{q,k,v} -> self_attn.{q,k,v}_proj          blk.N.attn_output -> self_attn.o_proj
    blk.N.ffn_{gate,up,down} -> mlp.{gate,up,down}_proj
    blk.N.ffn_norm -> post_attention_layernorm (llama), pre_feedforward_layernorm (gemma3)
    gemma3 only: post_attention_norm -> post_attention_layernorm, post_ffw_norm -> post_feedforward_layernorm,
                 attn_{q,k}_norm -> self_attn.{q,k}_norm
    blk.N.nextn.* (MTP layers, GLM / DeepSeek): see ``read_gguf_mtp_tensors``.

Value changes:
    llama: llama.cpp permutes the rows of Q and K (for its interleaved RoPE); undone here for mlx-lm's rotate-half RoPE.
    gemma3: llama.cpp stores every RMSNorm weight as 1 + w while mlx-lm computes x * (1 + w): 1 is subtracted.
    llama 3.x: the ``rope_freqs`` tensor (per-dimension frequency factors) becomes HF's "llama3" rope_scaling when
        Meta's defaults reproduce it, else a FactorRoPE on every layer (which the config cannot express).

Tensor types:
    F32, F16 as stored; BF16 -> bfloat16.
    Q4_0, Q4_1, Q8_0 -> MLX affine quantization with group size 32 (weight uint32, scales, biases, all exact):
        Q4_0 bias = -8 d, Q8_0 bias = -128 d, Q4_1 bias = m.
    Everything else (K-quants Q2_K..Q6_K, Q5_0, Q5_1, IQ*) -> ``gguf.quants.dequantize`` -> float16.
    With ``dtype`` every tensor is dequantized and cast to ``dtype`` (the CPU path uses float32).

``mx.load`` decodes F32, F16, Q4_0, Q4_1 and Q8_0 correctly and is used when a file holds only those types.
Otherwise the tensors are decoded here with numpy: mx.load turns BF16 into float16 (large values overflow),
decodes Q4_K wrongly without an error, and fails on the whole file when it meets Q3_K, Q5_K, Q5_0 or Q5_1.
The header is parsed here too: ``gguf.GGUFReader`` needs ~16 s for a 262k-token vocabulary.
"""

from __future__ import annotations

import importlib
import struct
import warnings
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT, GGUFValueType as VT, TokenType
from gguf.quants import dequantize as gguf_dequantize

if TYPE_CHECKING:
    from mlx_lm.tokenizer_utils import TokenizerWrapper

GROUP_SIZE = 32
_FLOAT_TYPES = {QT.F32: np.float32, QT.F16: np.float16}
_MLX_QUANT_BITS = {QT.Q4_0: 4, QT.Q4_1: 4, QT.Q8_0: 8}
_MX_LOAD_TYPES = {*_FLOAT_TYPES, *_MLX_QUANT_BITS}

# ---------------------------------------------------------------------------------------------------------------
# File parsing


@dataclass
class GGUFTensor:
    qtype: QT
    shape: tuple[int, ...]  # numpy order: (rows, ..., columns)
    raw: np.ndarray  # F32/F16: the values; other types: uint8 blocks, shape (rows, ..., bytes per row)


@dataclass
class GGUFFile:
    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensor]

    @property
    def arch(self) -> str | None:
        return self.metadata.get("general.architecture")

    def key(self, name: str, default: Any = None) -> Any:
        """Architecture-scoped metadata: key("block_count") reads "<arch>.block_count"."""
        return self.metadata.get(f"{self.arch}.{name}", default)


_SCALAR_FORMATS = {
    VT.UINT8: "<B", VT.INT8: "<b", VT.UINT16: "<H", VT.INT16: "<h", VT.UINT32: "<I", VT.INT32: "<i",
    VT.FLOAT32: "<f", VT.BOOL: "<?", VT.UINT64: "<Q", VT.INT64: "<q", VT.FLOAT64: "<d",
}  # fmt: skip


class _Cursor:
    def __init__(self, buf: np.ndarray):
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        text = self.buf[self.pos : self.pos + n].tobytes().decode("utf-8", errors="replace")
        self.pos += n
        return text

    def value(self, vtype: int) -> Any:
        if vtype == VT.STRING:
            return self.string()
        if vtype != VT.ARRAY:
            return self.unpack(_SCALAR_FORMATS[vtype])
        etype, n = self.unpack("<I"), self.unpack("<Q")
        if etype in (VT.STRING, VT.ARRAY):
            return [self.value(etype) for _ in range(n)]
        dtype = np.dtype(_SCALAR_FORMATS[etype])
        values = self.buf[self.pos : self.pos + n * dtype.itemsize].view(dtype).copy()
        self.pos += n * dtype.itemsize
        return values


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse a GGUF file's metadata and tensor table; tensor data stay memory-mapped."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    buf = np.memmap(path, dtype=np.uint8, mode="r")
    if buf[:4].tobytes() != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file")
    cur = _Cursor(buf)
    cur.pos = 4
    try:
        version = cur.unpack("<I")
        if version not in (2, 3):
            raise ValueError(f"{path}: unsupported GGUF version {version} (v1 and big-endian files are not supported)")
        n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
        metadata = {}
        for _ in range(n_kv):
            key = cur.string()
            metadata[key] = cur.value(cur.unpack("<I"))
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            dims = [cur.unpack("<Q") for _ in range(cur.unpack("<I"))]
            qtype, offset = QT(cur.unpack("<I")), cur.unpack("<Q")
            infos.append((name, tuple(reversed(dims)), qtype, offset))
    except (struct.error, KeyError, IndexError) as e:
        raise ValueError(f"{path} is truncated or corrupt: its header is cut off or unreadable "
                         f"(the file has {buf.size} bytes)") from None
    alignment = int(metadata.get("general.alignment", 32))
    data_start = -(-cur.pos // alignment) * alignment
    need = max((data_start + off + _nbytes(shape, qt) for _, shape, qt, off in infos), default=data_start)
    if need > buf.size:
        raise ValueError(f"{path} is truncated: its tensors need {need} bytes, the file has {buf.size} "
                         f"(an incomplete download or copy?)")
    tensors = {name: _tensor(buf, data_start + off, shape, qt) for name, shape, qt, off in infos}
    return GGUFFile(path, metadata, tensors)


def _nbytes(shape: tuple[int, ...], qtype: QT) -> int:
    rows = int(np.prod(shape[:-1], dtype=np.int64))
    if qtype in _FLOAT_TYPES:
        return rows * shape[-1] * np.dtype(_FLOAT_TYPES[qtype]).itemsize
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    return rows * (shape[-1] // block * block_bytes)


def _tensor(buf: np.ndarray, start: int, shape: tuple[int, ...], qtype: QT) -> GGUFTensor:
    rows = int(np.prod(shape[:-1], dtype=np.int64))
    if qtype in _FLOAT_TYPES:
        dtype = np.dtype(_FLOAT_TYPES[qtype])
        raw = buf[start : start + rows * shape[-1] * dtype.itemsize].view(dtype).reshape(shape)
    else:
        block, block_bytes = GGML_QUANT_SIZES[qtype]
        row_bytes = shape[-1] // block * block_bytes
        raw = buf[start : start + rows * row_bytes].reshape(*shape[:-1], row_bytes)
    return GGUFTensor(qtype, shape, raw)


# ---------------------------------------------------------------------------------------------------------------
# Tensor decoding


class QArray(NamedTuple):
    """An MLX affine-quantized matrix (group size 32): w = scales * q + biases."""

    weight: mx.array
    scales: mx.array
    biases: mx.array
    bits: int

    def dequantize(self, dtype: mx.Dtype) -> mx.array:
        scales, biases = self.scales.astype(mx.float32), self.biases.astype(mx.float32)
        w = mx.dequantize(self.weight, scales, biases, group_size=GROUP_SIZE, bits=self.bits)
        return w.astype(dtype)

    def map_rows(self, fn: Callable[[mx.array], mx.array]) -> QArray:
        return QArray(fn(self.weight), fn(self.scales), fn(self.biases), self.bits)


Tensor = mx.array | QArray


def _repack(t: GGUFTensor) -> QArray:
    """Q4_0 / Q4_1 / Q8_0 blocks -> MLX affine quantization, bit-exact."""
    blocks = t.raw.reshape(*t.raw.shape[:-1], -1, GGML_QUANT_SIZES[t.qtype][1])  # (..., groups, block bytes)

    def f16(offset: int) -> np.ndarray:
        return blocks[..., offset : offset + 2].copy().view(np.float16)[..., 0]

    d = f16(0)
    if t.qtype == QT.Q8_0:
        q, biases = blocks[..., 2:] ^ 0x80, -128 * d  # int8 -> uint8 offset by 128
    else:
        nibbles = blocks[..., 4:] if t.qtype == QT.Q4_1 else blocks[..., 2:]
        values = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1)  # ggml: low nibbles first
        q = values[..., 0::2] | (values[..., 1::2] << 4)  # MLX: element i at bits 4 * (i % 8)
        biases = f16(2) if t.qtype == QT.Q4_1 else -8 * d
    weight = np.ascontiguousarray(q).reshape(*t.shape[:-1], -1).view(np.uint32)
    return QArray(mx.array(weight), mx.array(d), mx.array(biases), _MLX_QUANT_BITS[t.qtype])


def _decode(t: GGUFTensor, dtype: mx.Dtype | None) -> Tensor:
    """One tensor: a QArray for Q4_0/Q4_1/Q8_0 when dtype is None, else a float array."""
    if t.qtype in _FLOAT_TYPES:
        a = mx.array(t.raw)
    elif t.qtype == QT.BF16:
        a = mx.array(t.raw.view(np.uint16)).view(mx.bfloat16)
    elif t.qtype in _MLX_QUANT_BITS:
        a = _repack(t)
    else:
        a = mx.array(gguf_dequantize(t.raw, t.qtype)).astype(dtype or mx.float16)
    return _cast(a, dtype)


def _cast(a: Tensor, dtype: mx.Dtype | None) -> Tensor:
    if dtype is None:
        return a
    return a.dequantize(dtype) if isinstance(a, QArray) else a.astype(dtype)


def _decode_with_mx_load(path: Path, names: list[str], qtypes: dict[str, QT], dtype: mx.Dtype | None) -> dict:
    loaded = mx.load(str(path))
    out = {}
    for name in names:
        if (bits := _MLX_QUANT_BITS.get(qtypes[name])) is not None:
            stem = name.removesuffix(".weight")
            out[name] = QArray(loaded[name], loaded[f"{stem}.scales"], loaded[f"{stem}.biases"], bits)
        else:
            out[name] = loaded[name]
    return {name: _cast(a, dtype) for name, a in out.items()}


def load_tensors(g: GGUFFile, names: list[str], dtype: mx.Dtype | None, use_mx_load: bool | None = None) -> dict:
    """Decode the named tensors (GGUF names). use_mx_load=None: when every tensor in the file allows it."""
    qtypes = {name: t.qtype for name, t in g.tensors.items()}
    if use_mx_load is None:
        use_mx_load = all(q in _MX_LOAD_TYPES for q in qtypes.values())
    if use_mx_load:
        return _decode_with_mx_load(g.path, names, qtypes, dtype)
    return {name: _decode(g.tensors[name], dtype) for name in names}


# ---------------------------------------------------------------------------------------------------------------
# Names

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


# ---------------------------------------------------------------------------------------------------------------
# Config


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


# ---------------------------------------------------------------------------------------------------------------
# Model


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


# ---------------------------------------------------------------------------------------------------------------
# MTP heads


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


# ---------------------------------------------------------------------------------------------------------------
# Tokenizer

_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_TAIL = r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_LLAMA3_REGEX = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}" + _LLAMA3_TAIL
_QWEN2_REGEX = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}" + _LLAMA3_TAIL
# tokenizer.ggml.pre -> the regexes llama.cpp splits with, in order (llama-vocab.cpp).
_PRE_REGEXES = {
    "default": [_GPT2_REGEX],
    "gpt-2": [_GPT2_REGEX],
    **{pre: [r"\p{N}", _GPT2_REGEX] for pre in ("smollm", "starcoder", "refact", "command-r", "codeshell")},
    **{pre: [_LLAMA3_REGEX] for pre in ("llama-bpe", "llama3", "smaug-bpe", "falcon3", "pixtral")},
    **{pre: [_QWEN2_REGEX] for pre in ("qwen2", "deepseek-r1-qwen", "megrez")},
}


def _vocab(tokens: list[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)
    return vocab


def _bpe_model(meta: dict, tokens: list[str]):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_REGEXES:
        warnings.warn(f"unknown GGUF pre-tokenizer {pre!r}: using GPT-2's split")
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in _PRE_REGEXES.get(pre, [_GPT2_REGEX])]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok = Tokenizer(models.BPE(_vocab(tokens), merges, ignore_merges=pre in ("llama-bpe", "llama3")))
    tok.pre_tokenizer = pre_tokenizers.Sequence([*splits, byte_level])
    tok.decoder = decoders.ByteLevel()
    return tok


def _spm_merges(tokens: list[str], scores: list[float], types: list[int], vocab: dict[str, int]) -> list:
    """llama.cpp's SentencePiece BPE merges the adjacent pair whose concatenation is the highest-scoring
    token: the same as BPE with one merge per (left, right) split of each token, ranked by that token's score."""
    ranked = []
    for token, score, kind in zip(tokens, scores, types):
        if kind != TokenType.NORMAL:
            continue
        for i in range(1, len(token)):
            left, right = vocab.get(token[:i]), vocab.get(token[i:])
            if left is not None and right is not None:
                ranked.append((-score, left, right))
    ranked.sort()
    return [(tokens[left], tokens[right]) for _, left, right in ranked]


def _spm_model(meta: dict, tokens: list[str], types: list[int], add_space_prefix: bool):
    from tokenizers import Tokenizer, decoders, models, normalizers

    vocab = _vocab(tokens)
    scores = np.asarray(meta.get("tokenizer.ggml.scores", np.zeros(len(tokens))), dtype=np.float32).tolist()
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None else None
    merges = _spm_merges(tokens, scores, types, vocab)
    tok = Tokenizer(models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    prefix = [normalizers.Prepend("▁")] if add_space_prefix else []
    tok.normalizer = normalizers.Sequence([*prefix, normalizers.Replace(" ", "▁")])
    strip = [decoders.Strip(" ", 1, 0)] if add_space_prefix else []
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), *strip])
    return tok


def _add_special_tokens(tok, tokens: list[str], types: list[int], spm: bool) -> None:
    """Control tokens become special added tokens; user-defined ones plain added tokens (matched before BPE)."""
    from tokenizers import AddedToken

    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == TokenType.CONTROL]
    )
    tok.add_tokens([AddedToken(t, normalized=spm) for t, k in zip(tokens, types) if k == TokenType.USER_DEFINED])


def _add_bos_eos(tok, meta: dict, tokens: list[str], default_bos: bool) -> None:
    from tokenizers import processors

    added = {}
    for which, default in (("bos", default_bos), ("eos", False)):
        token_id = meta.get(f"tokenizer.ggml.{which}_token_id")
        if token_id is not None and meta.get(f"tokenizer.ggml.add_{which}_token", default):
            added[which] = (tokens[token_id], token_id)
    if not added:
        return
    bos = [added["bos"][0]] if "bos" in added else []
    eos = [added["eos"][0]] if "eos" in added else []
    tok.post_processor = processors.TemplateProcessing(
        single=[*bos, "$A", *eos],
        pair=[*bos, "$A", *eos, *bos, "$B:1", *eos],
        special_tokens=list(added.values()),
    )


def gguf_tokenizer(meta: dict) -> TokenizerWrapper:
    """An mlx_lm TokenizerWrapper rebuilt from GGUF tokenizer metadata ("gpt2" byte-level BPE or "llama" SPM)."""
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, SPMStreamingDetokenizer, TokenizerWrapper
    from transformers import PreTrainedTokenizerFast

    kind = meta.get("tokenizer.ggml.model")
    if "tokenizer.ggml.tokens" not in meta:
        raise ValueError("the GGUF file has no tokenizer (tokenizer.ggml.tokens)")
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = np.asarray(meta.get("tokenizer.ggml.token_type", np.full(len(tokens), TokenType.NORMAL))).tolist()
    add_space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    if kind == "gpt2":
        tok, detokenizer = _bpe_model(meta, tokens), BPEStreamingDetokenizer
    elif kind == "llama":
        tok = _spm_model(meta, tokens, types, add_space_prefix)
        detokenizer = partial(SPMStreamingDetokenizer, trim_space=add_space_prefix)
    else:
        raise ValueError(f"unsupported GGUF tokenizer model {kind!r}")
    _add_special_tokens(tok, tokens, types, spm=kind == "llama")
    _add_bos_eos(tok, meta, tokens, default_bos=kind == "llama")

    def token(which: str) -> str | None:
        token_id = meta.get(f"tokenizer.ggml.{which}_token_id")
        return tokens[token_id] if token_id is not None and token_id < len(tokens) else None

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=token("bos"),
        eos_token=token("eos"),
        unk_token=token("unknown"),
        pad_token=token("padding"),
        chat_template=meta.get("tokenizer.chat_template"),
    )
    end_ids = {meta.get(f"tokenizer.ggml.{which}_token_id") for which in ("eos", "eot", "eom")} - {None}
    return TokenizerWrapper(hf, detokenizer_class=detokenizer, eos_token_ids=sorted(end_ids))
