"""GGUF tensor types -> MLX arrays: F32/F16/BF16 as floats, Q4_0/Q4_1/Q8_0 repacked exactly as MLX affine
quantization (group 32), everything else dequantized by gguf.quants."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, NamedTuple

import mlx.core as mx
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT
from gguf.quants import dequantize as gguf_dequantize

from .file import _FLOAT_TYPES, GROUP_SIZE, GGUFFile, GGUFTensor

_MLX_QUANT_BITS = {QT.Q4_0: 4, QT.Q4_1: 4, QT.Q8_0: 8}
_MX_LOAD_TYPES = {*_FLOAT_TYPES, *_MLX_QUANT_BITS}


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
