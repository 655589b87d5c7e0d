"""What the emulator passes to a kernel: MLX dtype names and their C++ / numpy types, inputs as numpy
arrays, template arguments as C++ template parameters, and the emulator's error."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

# MLX dtype name -> (Metal type name in the generated signature, numpy storage dtype)
DTYPES: dict[str, tuple[str, Any]] = {
    "float32": ("float", np.float32),
    "float16": ("float16_t", np.float16),
    "bfloat16": ("bfloat16_t", np.uint16),
    "int64": ("int64_t", np.int64),
    "int32": ("int32_t", np.int32),
    "int16": ("int16_t", np.int16),
    "int8": ("int8_t", np.int8),
    "uint64": ("uint64_t", np.uint64),
    "uint32": ("uint32_t", np.uint32),
    "uint16": ("uint16_t", np.uint16),
    "uint8": ("uint8_t", np.uint8),
    "bool": ("bool", np.bool_),
}
CUDA_TYPES = {"float16": "__half", "bfloat16": "__nv_bfloat16"}  # others as in DTYPES

NP_TO_NAME = {
    np.dtype(np.float32): "float32",
    np.dtype(np.float16): "float16",
    np.dtype(np.int64): "int64",
    np.dtype(np.int32): "int32",
    np.dtype(np.int16): "int16",
    np.dtype(np.int8): "int8",
    np.dtype(np.uint64): "uint64",
    np.dtype(np.uint32): "uint32",
    np.dtype(np.uint16): "uint16",
    np.dtype(np.uint8): "uint8",
    np.dtype(np.bool_): "bool",
}


class EmuError(RuntimeError):
    """The emulated kernel failed: compile error, out-of-bounds access, deadlock, divergence ..."""


@dataclass(frozen=True)
class InputSpec:
    """What the generated signature depends on for one input: its dtype and whether it is 0-d."""

    dtype: str
    scalar: bool = False


def to_numpy(x: Any) -> tuple[np.ndarray, str]:
    """An input as (C-contiguous numpy array, MLX dtype name)."""
    if isinstance(x, np.ndarray):
        name = NP_TO_NAME.get(x.dtype)
        if name is None:
            raise TypeError(f"unsupported numpy dtype {x.dtype}")
        return np.ascontiguousarray(x), name
    if isinstance(x, bool):
        return np.array(x, np.bool_), "bool"
    if isinstance(x, int):
        return np.array(x, np.int32), "int32"
    if isinstance(x, float):
        return np.array(x, np.float32), "float32"
    try:
        import mlx.core as mx
    except ImportError:  # pragma: no cover
        mx = None
    if mx is not None and isinstance(x, mx.array):
        name = str(x.dtype).split(".")[-1]
        if name == "bfloat16":
            return np.ascontiguousarray(np.array(x.view(mx.uint16))), name
        return np.ascontiguousarray(np.array(x)), name
    raise TypeError(f"unsupported input type {type(x)}")


def spec_of(x: Any) -> InputSpec:
    if isinstance(x, InputSpec):
        return x
    arr, name = to_numpy(x)
    return InputSpec(name, arr.ndim == 0)


def dtype_name(d: Any) -> str:
    if isinstance(d, str):
        return d
    s = str(d)
    if s.startswith("mlx.core."):
        return s.split(".")[-1]
    name = NP_TO_NAME.get(np.dtype(d))
    if name is None:
        raise TypeError(f"unsupported dtype {d}")
    return name


def template_value(v: Any) -> tuple[str, str]:
    """(C++ template parameter kind, value) for one MLX template argument."""
    if isinstance(v, bool):
        return "bool", "true" if v else "false"
    if isinstance(v, (int, np.integer)):
        return "int", str(int(v))
    return "typename", DTYPES[dtype_name(v)][0]
