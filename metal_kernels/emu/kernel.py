"""The call: `EmuKernel`, the emulated counterpart of `mx.fast.metal_kernel` (or `cuda_kernel`), launched on
the CPU with the arguments of the MLX kernel call.

Calling it with `inputs`, `output_shapes`, `output_dtypes`, `grid`, `threadgroup`, `template`, `init_value`
returns numpy outputs: the instantiation is compiled on first use (build.py, cached), the inputs and
outputs are passed as bounds-checked buffers (with the shapes, strides and ranks the body mentions), and
the launcher runs the grid MLX would dispatch. Outputs start as poison (NaN / 0x5A5A5A5A) unless
`init_value` is given, so unwritten elements show. `schedule` picks the order fibers run in between
synchronisation points ("forward", "reverse", "random"); running a kernel under several schedules
exposes missing barriers.
"""

from __future__ import annotations

import ctypes
from typing import Any, Iterable, Sequence

import numpy as np

from .build import precompile
from .codegen import KernelSource, Variant
from .dtypes import DTYPES, EmuError, dtype_name, spec_of, to_numpy

SCHEDULES = {"forward": 0, "reverse": 1, "random": 2}


class EmuKernel:
    """The emulated counterpart of `mx.fast.metal_kernel(name, input_names, output_names, source, header)`."""

    def __init__(
        self,
        name: str,
        input_names: Sequence[str],
        output_names: Sequence[str],
        source: str,
        header: str = "",
        ensure_row_contiguous: bool = True,
        atomic_outputs: bool = False,
        os_threads: bool = False,
        dialect: str = "metal",
        max_threads: int = 1024,
    ):
        if dialect not in ("metal", "cuda"):
            raise ValueError(f"dialect must be 'metal' or 'cuda', got {dialect!r}")
        if not output_names:
            raise ValueError("at least one output")
        self.code = KernelSource(name, tuple(input_names), tuple(output_names), source, header, dialect,
                                 atomic_outputs)
        self.ensure_row_contiguous = ensure_row_contiguous
        self.os_threads = os_threads
        # threads per threadgroup this pipeline allows: 1024 on Apple GPUs and NVIDIA, less for a kernel
        # that needs many registers (Metal's maxTotalThreadsPerThreadgroup; CUDA: 65,536 registers per
        # block). A lower value simulates such a device: larger launches fail as they would there.
        self.max_threads = max_threads
        self._loaded: dict[tuple, tuple[ctypes.CDLL, str]] = {}  # variant key -> (library, launcher symbol)

    # the declaration, as given
    name = property(lambda self: self.code.name)
    cname = property(lambda self: self.code.cname)
    input_names = property(lambda self: list(self.code.input_names))
    output_names = property(lambda self: list(self.code.output_names))
    source = property(lambda self: self.code.source)
    header = property(lambda self: self.code.header)
    dialect = property(lambda self: self.code.dialect)
    atomic_outputs = property(lambda self: self.code.atomic_outputs)

    def section(self, variants: Sequence[Variant]) -> str:
        return self.code.section(variants)

    def translation_unit(self, variants: Sequence[Variant]) -> str:
        return self.code.translation_unit(variants)

    # --- instantiations ----------------------------------------------------------------------------
    def variant(self, inputs: Sequence[Any], output_dtypes: Sequence[Any], template=None) -> Variant:
        if len(inputs) != len(self.code.input_names):
            raise ValueError(f"expected {len(self.code.input_names)} inputs, got {len(inputs)}")
        if len(output_dtypes) != len(self.code.output_names):
            raise ValueError(f"expected {len(self.code.output_names)} output dtypes, got {len(output_dtypes)}")
        return Variant(self.code, [spec_of(x) for x in inputs], [dtype_name(d) for d in output_dtypes], template)

    def _todo(self, variants: Sequence[Variant]) -> list[Variant]:
        return [v for v in dict((v.key, v) for v in variants).values() if v.key not in self._loaded]

    def precompile(self, calls: Iterable[dict]) -> None:
        """Compile many instantiations in one translation unit; `calls` hold the keyword arguments
        `inputs`, `output_dtypes`, `template` (other keys ignored)."""
        precompile([(self, calls)])

    # --- the call ----------------------------------------------------------------------------------
    def __call__(
        self,
        *,
        inputs: Sequence[Any],
        output_shapes: Sequence[Sequence[int]],
        output_dtypes: Sequence[Any],
        grid: Sequence[int],
        threadgroup: Sequence[int],
        template=None,
        init_value: float | None = None,
        schedule: str = "forward",
        seed: int = 0,
        verbose: bool = False,
        stream=None,
    ) -> list[np.ndarray]:
        threads = int(np.prod([int(t) for t in threadgroup]))
        if threads > self.max_threads:
            raise EmuError(
                f"{self.name}: a threadgroup of {threads} threads exceeds this pipeline's limit of "
                f"{self.max_threads} (too many resources requested for launch)"
            )
        v = self.variant(inputs, output_dtypes, template)
        if v.key not in self._loaded:
            precompile([(self, [dict(inputs=inputs, output_dtypes=output_dtypes, template=template)])])
        lib, sym = self._loaded[v.key]
        if verbose:
            print(self.translation_unit([v]))

        # ensure_row_contiguous=False: numpy views keep their strides (what MLX passes for cache views)
        arrays = [
            x if not self.ensure_row_contiguous and isinstance(x, np.ndarray) else to_numpy(x)[0]
            for x in inputs
        ]
        outputs = [_poisoned(shape, dt, init_value) for shape, dt in zip(output_shapes, v.out_dtypes)]
        keep, ptrs, counts = _buffers(v, arrays, outputs)
        nb = len(ptrs)
        c_ptrs = (ctypes.c_void_p * max(nb, 1))(*ptrs)
        c_counts = (ctypes.c_longlong * max(nb, 1))(*counts)
        grid = [int(g) for g in grid]
        if self.dialect == "cuda":  # full blocks: ceil(grid / block) blocks of exactly `threadgroup`
            grid = [-(-g // int(t)) * int(t) for g, t in zip(grid, threadgroup)]
        c_grid = (ctypes.c_longlong * 3)(*grid)
        c_tg = (ctypes.c_longlong * 3)(*[int(t) for t in threadgroup])
        err = ctypes.create_string_buffer(1024)
        fn = getattr(lib, sym)
        rc = fn(c_ptrs, c_counts, c_grid, c_tg, SCHEDULES[schedule], ctypes.c_ulonglong(seed), err, 1024)
        del keep  # the inputs' buffers lived until the launch returned
        if rc != 0:
            raise EmuError(f"{self.name}: {err.value.decode(errors='replace')}")
        return outputs


def _poisoned(shape: Sequence[int], dt: str, init_value: float | None) -> np.ndarray:
    """An output buffer: `init_value` everywhere, else poison (NaN, bfloat16 NaN, 0x5A bytes)."""
    out = np.empty(tuple(shape), DTYPES[dt][1])
    if init_value is not None:
        if dt == "bfloat16":
            out[...] = _bf16_bits(np.float32(init_value))
        else:
            out[...] = init_value
    elif out.dtype.kind == "f":
        out[...] = np.nan
    elif dt == "bfloat16":
        out[...] = 0x7FC0
    elif out.dtype.kind in "iu":
        out.view(np.uint8)[...] = 0x5A
    return out


def _buffers(v: Variant, arrays: list[np.ndarray], outputs: list[np.ndarray]):
    """(arrays to keep alive, pointers, element counts) of the launch's buffers in the variant's order;
    a count bounds what the kernel may touch through that pointer."""
    keep: list[np.ndarray] = []
    ptrs: list[int] = []
    counts: list[int] = []
    for what, i in v.buffers():
        if what == "in":
            a = arrays[i]
            if a.size == 0:
                a = np.zeros(1, a.dtype)  # a valid pointer; the count below stays 0
                keep.append(a)
                ptrs.append(a.ctypes.data)
                counts.append(0)
                continue
            keep.append(a)
            ptrs.append(a.ctypes.data)
            counts.append(_span(a))
        elif what == "shape":
            a = np.array(arrays[i].shape, np.int32)
            keep.append(a)
            ptrs.append(a.ctypes.data)
            counts.append(a.size)
        elif what == "strides":
            a = np.array(_element_strides(arrays[i]), np.int64)
            keep.append(a)
            ptrs.append(a.ctypes.data)
            counts.append(a.size)
        elif what == "ndim":
            a = np.array(arrays[i].ndim, np.int32)
            keep.append(a)
            ptrs.append(a.ctypes.data)
            counts.append(1)
        else:
            a = outputs[i]
            ptrs.append(a.ctypes.data)
            counts.append(a.size)
    return keep, ptrs, counts


def _element_strides(a: np.ndarray) -> list[int]:
    if any(st < 0 or st % a.itemsize for st in a.strides):
        raise ValueError(f"strides {a.strides} are not non-negative multiples of the item size")
    return [st // a.itemsize for st in a.strides]


def _span(a: np.ndarray) -> int:
    """Elements from the first to the last one a (possibly strided) view touches: the bounds check."""
    if a.flags.c_contiguous:
        return a.size
    return 1 + sum((n - 1) * st for n, st in zip(a.shape, _element_strides(a)))


def _bf16_bits(x: np.float32) -> np.uint16:
    u = np.array(x, np.float32).view(np.uint32)
    u = u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))
    return np.uint16(u >> np.uint32(16))
