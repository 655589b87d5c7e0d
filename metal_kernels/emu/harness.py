"""Compile a Metal kernel body (MLX `mx.fast.metal_kernel` convention) as C++ and run it on the CPU.

`EmuKernel(name, input_names, output_names, source, header)` mirrors `mx.fast.metal_kernel`; calling it
with the same keyword arguments as the MLX kernel (`inputs`, `output_shapes`, `output_dtypes`, `grid`,
`threadgroup`, `template`, `init_value`) returns numpy outputs. The body is wrapped in a C++ function
with the parameters MLX would generate (a bounds-checked pointer per input and output, `<name>_shape`
/ `_strides` / `_ndim` when the body mentions them, a `const T&` for 0-d inputs, the thread-position
attributes the body mentions), compiled with g++ against metal_emu.h into a shared library (cached
by source hash under the temp dir) and launched through ctypes over the grid MLX would dispatch.

Outputs start as poison (NaN / 0x5A5A5A5A) unless `init_value` is given, so unwritten elements show.
`schedule` picks the order fibers run in between synchronisation points ("forward", "reverse",
"random"); running a kernel under several schedules exposes missing barriers.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

EMU_DIR = Path(__file__).resolve().parent
HEADER = EMU_DIR / "metal_emu.h"
CXX = os.environ.get("METAL_EMU_CXX", "g++")
CXXFLAGS = ("-std=c++20", "-O1", "-pthread", "-fPIC", "-shared", "-ffp-contract=off", "-w")

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

_NP_TO_NAME = {
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

# The attributes MLX adds to the signature when the body mentions them (name, Metal type).
ATTRIBUTES = (
    ("dispatch_quadgroups_per_threadgroup", "uint"),
    ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"),
    ("grid_origin", "uint3"),
    ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"),
    ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"),
    ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"),
    ("thread_index_in_quadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"),
    ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"),
    ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"),
    ("threadgroups_per_grid", "uint3"),
    ("threads_per_grid", "uint3"),
    ("threads_per_simdgroup", "uint"),
    ("threads_per_threadgroup", "uint3"),
)
_ATTR_FIELD = {"grid_size": "threads_per_grid"}  # same value, two names

SCHEDULES = {"forward": 0, "reverse": 1, "random": 2}


class EmuError(RuntimeError):
    """The emulated kernel failed: compile error, out-of-bounds access, deadlock, divergence ..."""


@dataclass(frozen=True)
class InputSpec:
    """What the generated signature depends on for one input: its dtype and whether it is 0-d."""

    dtype: str
    scalar: bool = False


def compiler_available() -> bool:
    return shutil.which(CXX) is not None


def _to_numpy(x: Any) -> tuple[np.ndarray, str]:
    """An input as (C-contiguous numpy array, MLX dtype name)."""
    if isinstance(x, np.ndarray):
        name = _NP_TO_NAME.get(x.dtype)
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


def _spec_of(x: Any) -> InputSpec:
    if isinstance(x, InputSpec):
        return x
    arr, name = _to_numpy(x)
    return InputSpec(name, arr.ndim == 0)


def _dtype_name(d: Any) -> str:
    if isinstance(d, str):
        return d
    s = str(d)
    if s.startswith("mlx.core."):
        return s.split(".")[-1]
    name = _NP_TO_NAME.get(np.dtype(d))
    if name is None:
        raise TypeError(f"unsupported dtype {d}")
    return name


def _template_value(v: Any) -> tuple[str, str]:
    """(C++ template parameter kind, value) for one MLX template argument."""
    if isinstance(v, bool):
        return "bool", "true" if v else "false"
    if isinstance(v, (int, np.integer)):
        return "int", str(int(v))
    return "typename", DTYPES[_dtype_name(v)][0]


_COMMENTS = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)


def rewrite_threadgroup(body: str, keyword: str = "threadgroup") -> str:
    """Turn `threadgroup T name[N]...;` declarations (CUDA: `__shared__ T name[N];`) into storage owned
    by the current threadgroup / block (same line count); other uses must be pointer/reference types."""
    kw = re.escape(keyword)
    decl = re.compile(
        rf"(?<![\w]){kw}\s+((?:const\s+)?[A-Za-z_][\w:]*(?:\s*<[^;{{}}()]*?>)?)\s+"
        r"([A-Za-z_]\w*)\s*((?:\[[^\];]+\]\s*)*);"
    )
    word = re.compile(rf"(?<![\w]){kw}(?![\w])")
    pointer = re.compile(rf"(?<![\w]){kw}\s+[^;=(){{}}]*?[*&]")

    def repl(m: re.Match) -> str:
        typ, name, dims = m.group(1), m.group(2), re.sub(r"\s+", "", m.group(3))
        return (
            f"typedef {typ} metal_emu_tg_type_{name}{dims}; "
            f"static const char metal_emu_tg_key_{name} = 0; "
            f"auto& {name} = *static_cast<metal_emu_tg_type_{name}*>("
            f"metal_emu::tg_alloc(&metal_emu_tg_key_{name}, sizeof(metal_emu_tg_type_{name})));"
        )

    out = decl.sub(repl, body)
    code = _COMMENTS.sub(" ", out)
    for m in word.finditer(code):
        if keyword == "__shared__" or not pointer.match(code, m.start()):
            snippet = code[m.start() : m.start() + 60].splitlines()[0]
            raise EmuError(
                f"unsupported use of `{keyword}` (declare `{keyword} T name[N];` without an "
                f"initialiser, or use it in a pointer/reference type): {snippet!r}"
            )
    return out


class _Variant:
    """One instantiation: input specs + output dtypes + template arguments."""

    def __init__(self, kernel: "EmuKernel", specs: Sequence[InputSpec], out_dtypes: Sequence[str], template):
        self.kernel = kernel
        self.specs = tuple(specs)
        self.out_dtypes = tuple(out_dtypes)
        self.template = tuple((n, _template_value(v)) for n, v in (template or ()))
        self.key = (self.specs, self.out_dtypes, self.template)
        h = hashlib.sha256(repr(self.key).encode()).hexdigest()[:16]
        self.symbol = f"emu_launch_{kernel.cname}_{h}"

    def signature_key(self):
        if self.kernel.dialect == "cuda":
            return self.key
        return (self.specs, self.out_dtypes, tuple((n, kind) for n, (kind, _) in self.template))

    # the buffers passed, in order: (what, input index or output index)
    def buffers(self) -> list[tuple[str, int]]:
        k = self.kernel
        bufs: list[tuple[str, int]] = []
        for i, (name, spec) in enumerate(zip(k.input_names, self.specs)):
            bufs.append(("in", i))
            if not spec.scalar or k.dialect == "cuda":
                if f"{name}_shape" in k.source:
                    bufs.append(("shape", i))
                if f"{name}_strides" in k.source:
                    bufs.append(("strides", i))
                if f"{name}_ndim" in k.source:
                    bufs.append(("ndim", i))
        for j in range(len(k.output_names)):
            bufs.append(("out", j))
        return bufs


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
        self.name = name
        self.cname = re.sub(r"\W", "_", name)
        self.input_names = list(input_names)
        self.output_names = list(output_names)
        self.source = source
        self.header = header
        self.ensure_row_contiguous = ensure_row_contiguous
        self.atomic_outputs = atomic_outputs
        self.os_threads = os_threads
        self.dialect = dialect
        # threads per threadgroup this pipeline allows: 1024 on Apple GPUs and NVIDIA, less for a kernel
        # that needs many registers (Metal's maxTotalThreadsPerThreadgroup; CUDA: 65,536 registers per
        # block). A lower value simulates such a device: larger launches fail as they would there.
        self.max_threads = max_threads
        if dialect == "cuda":
            self._body = rewrite_threadgroup(source, "__shared__")
            self._attrs = []  # CUDA bodies read threadIdx / blockIdx / blockDim instead
        else:
            self._body = rewrite_threadgroup(source)
            self._attrs = [(a, t) for a, t in ATTRIBUTES if a in source]
        self._loaded: dict[tuple, tuple[ctypes.CDLL, str]] = {}

    # --- code generation -------------------------------------------------------------------------

    def _ctype(self, dtype: str) -> str:
        if self.dialect == "cuda" and dtype in CUDA_TYPES:
            return CUDA_TYPES[dtype]
        return DTYPES[dtype][0]

    def _function(self, fname: str, v: _Variant) -> str:
        if self.dialect == "cuda":
            return self._function_cuda(fname, v)
        params = []
        for name, spec in zip(self.input_names, v.specs):
            ctype = DTYPES[spec.dtype][0]
            if spec.scalar:
                params.append(f"const {ctype}& {name}")
                continue
            params.append(f"metal_emu::dptr<const {ctype}> {name}")
            if f"{name}_shape" in self.source:
                params.append(f"metal_emu::dptr<const int> {name}_shape")
            if f"{name}_strides" in self.source:
                params.append(f"metal_emu::dptr<const int64_t> {name}_strides")
            if f"{name}_ndim" in self.source:
                params.append(f"const int& {name}_ndim")
        for name, dt in zip(self.output_names, v.out_dtypes):
            ctype = DTYPES[dt][0]
            if self.atomic_outputs:
                ctype = f"metal::atomic<{ctype}>"
            params.append(f"metal_emu::dptr<{ctype}> {name}")
        for attr, typ in self._attrs:
            params.append(f"{typ} {attr}")
        tmpl = ""
        if v.template:
            tmpl = "template <" + ", ".join(f"{kind} {n}" for n, (kind, _) in v.template) + ">\n"
        sep = ",\n    "
        return (
            f"{tmpl}void {fname}(\n    {sep.join(params)}) {{\n"
            f'#line 1 "{self.name}.metal"\n{self._body}\n}}\n'
        )

    def _function_cuda(self, fname: str, v: _Variant) -> str:
        """As mlx/backend/cuda/custom_kernel.cpp: `const T* in`, `Shape in_shape`, `T* out`, then the
        template arguments as constexpr values / type aliases at the top of the body."""
        params = []
        for name, spec in zip(self.input_names, v.specs):
            params.append(f"metal_emu::dptr<const {self._ctype(spec.dtype)}> {name}")
            if f"{name}_shape" in self.source:
                params.append(f"metal_emu::dptr<const int> {name}_shape")
            if f"{name}_strides" in self.source:
                params.append(f"metal_emu::dptr<const int64_t> {name}_strides")
            if f"{name}_ndim" in self.source:
                params.append(f"const int {name}_ndim")
        for name, dt in zip(self.output_names, v.out_dtypes):
            params.append(f"metal_emu::dptr<{self._ctype(dt)}> {name}")
        consts = []
        for n, (kind, val) in v.template:
            if kind == "typename":
                cval = {"float16_t": "__half", "bfloat16_t": "__nv_bfloat16"}.get(val, val)
                consts.append(f"  using {n} = {cval};\n")
            else:
                consts.append(f"  constexpr {kind} {n} = {val};\n")
        sep = ",\n    "
        return (
            f"static void {fname}(\n    {sep.join(params)}) {{\n{''.join(consts)}"
            f'#line 1 "{self.name}.cu"\n{self._body}\n}}\n'
        )

    def _launcher(self, fname: str, v: _Variant) -> str:
        args = []
        for b, (what, i) in enumerate(v.buffers()):
            if what == "in":
                spec = v.specs[i]
                ctype = self._ctype(spec.dtype)
                nm = self.input_names[i]
                if spec.scalar and self.dialect == "metal":
                    args.append(f"*static_cast<const {ctype}*>(b[{b}])")
                else:
                    args.append(
                        f'metal_emu::dptr<const {ctype}>(static_cast<const {ctype}*>(b[{b}]), n[{b}], "{nm}")'
                    )
            elif what == "shape":
                nm = self.input_names[i] + "_shape"
                args.append(f'metal_emu::dptr<const int>(static_cast<const int*>(b[{b}]), n[{b}], "{nm}")')
            elif what == "strides":
                nm = self.input_names[i] + "_strides"
                args.append(
                    f'metal_emu::dptr<const int64_t>(static_cast<const int64_t*>(b[{b}]), n[{b}], "{nm}")'
                )
            elif what == "ndim":
                args.append(f"*static_cast<const int*>(b[{b}])")
            else:
                ctype = self._ctype(v.out_dtypes[i])
                if self.atomic_outputs:
                    ctype = f"metal::atomic<{ctype}>"
                nm = self.output_names[i]
                args.append(f'metal_emu::dptr<{ctype}>(static_cast<{ctype}*>(b[{b}]), n[{b}], "{nm}")')
        for attr, _ in self._attrs:
            args.append(f"A.{_ATTR_FIELD.get(attr, attr)}")
        targs = ""
        if v.template and self.dialect == "metal":
            targs = "<" + ", ".join(val for _, (_, val) in v.template) + ">"
        joined = ",\n        ".join(args)
        tag = v.symbol
        return (
            f"static void {tag}_body(void* ctx, const metal_emu::ThreadAttrs& A) {{\n"
            f"  void** b = static_cast<void**>(static_cast<void**>(ctx)[0]);\n"
            f"  const long long* n = static_cast<const long long*>(static_cast<void**>(ctx)[1]);\n"
            f"  (void)n;\n"
            f"  {fname}{targs}(\n        {joined});\n}}\n"
            f'extern "C" int {tag}(void** b, const long long* n, const long long* grid,\n'
            f"    const long long* tg, int schedule, unsigned long long seed, char* err, int errlen) {{\n"
            f"  void* ctx[2] = {{static_cast<void*>(b), const_cast<long long*>(n)}};\n"
            f"  return metal_emu::launch(grid, tg, schedule, seed, {tag}_body, ctx, err, size_t(errlen));\n}}\n"
        )

    def section(self, variants: Sequence[_Variant]) -> str:
        """This kernel's functions (one per signature) and launchers (one per instantiation)."""
        metal = self.dialect == "metal"
        parts = ["#define device\n#define constant\n#define thread\n#define threadgroup\n"] if metal else []
        if self.header:
            parts.append(f'#line 1 "{self.name}.header"\n{self.header}\n')
        fnames: dict[tuple, str] = {}
        for v in variants:
            sk = v.signature_key()
            if sk not in fnames:
                fname = f"custom_kernel_{self.cname}_{len(fnames)}"
                fnames[sk] = fname
                parts.append(self._function(fname, v))
        if metal:
            parts.append("#undef device\n#undef constant\n#undef thread\n#undef threadgroup\n")
        for v in variants:
            parts.append(self._launcher(fnames[v.signature_key()], v))
        return "".join(parts)

    def translation_unit(self, variants: Sequence[_Variant]) -> str:
        cuda = '#include "cuda_emu.h"\n' if self.dialect == "cuda" else ""
        return '#include "metal_emu.h"\n' + cuda + self.section(variants)

    # --- compile / load ----------------------------------------------------------------------------

    def variant(self, inputs: Sequence[Any], output_dtypes: Sequence[Any], template=None) -> _Variant:
        if len(inputs) != len(self.input_names):
            raise ValueError(f"expected {len(self.input_names)} inputs, got {len(inputs)}")
        if len(output_dtypes) != len(self.output_names):
            raise ValueError(f"expected {len(self.output_names)} output dtypes, got {len(output_dtypes)}")
        return _Variant(self, [_spec_of(x) for x in inputs], [_dtype_name(d) for d in output_dtypes], template)

    def _todo(self, variants: Sequence[_Variant]) -> list[_Variant]:
        return [v for v in dict((v.key, v) for v in variants).values() if v.key not in self._loaded]

    def precompile(self, calls: Iterable[dict]) -> None:
        """Compile many instantiations in one translation unit; `calls` hold the keyword arguments
        `inputs`, `output_dtypes`, `template` (other keys ignored)."""
        precompile([(self, calls)])

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
            x if not self.ensure_row_contiguous and isinstance(x, np.ndarray) else _to_numpy(x)[0]
            for x in inputs
        ]
        keep: list[np.ndarray] = []
        ptrs: list[int] = []
        counts: list[int] = []
        outputs: list[np.ndarray] = []
        for shape, dt in zip(output_shapes, v.out_dtypes):
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
            outputs.append(out)
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
        if rc != 0:
            raise EmuError(f"{self.name}: {err.value.decode(errors='replace')}")
        return outputs


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


def _flags(os_threads: bool) -> list[str]:
    return [*CXXFLAGS, *(["-DMETAL_EMU_OS_THREADS=1"] if os_threads else [])]


_pch_lock = threading.Lock()


def _pch_dir(os_threads: bool) -> Path | None:
    """A directory holding metal_emu.h.gch (built once per header version and flag set), or None."""
    flags = [f for f in _flags(os_threads) if f != "-shared"]
    digest = hashlib.sha256(HEADER.read_bytes() + " ".join([CXX, *flags]).encode()).hexdigest()[:24]
    d = _cache_dir() / f"pch_{digest}"
    gch = d / "metal_emu.h.gch"
    with _pch_lock:
        if gch.exists():
            return d
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f"metal_emu.{os.getpid()}.{threading.get_ident()}.gch"
        r = subprocess.run(
            [CXX, *flags, "-x", "c++-header", str(HEADER), "-o", str(tmp)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        if r.returncode != 0:
            tmp.unlink(missing_ok=True)
            return None  # compile without it; errors will show in the real compile
        os.replace(tmp, gch)
        return d


class _CompileJob:
    """One translation unit holding the instantiations of one or more kernels."""

    def __init__(self, items: list[tuple[EmuKernel, list[_Variant]]], os_threads: bool):
        self.items = items
        self.os_threads = os_threads
        cuda = '#include "cuda_emu.h"\n' if any(k.dialect == "cuda" for k, _ in items) else ""
        self.tu = '#include "metal_emu.h"\n' + cuda + "".join(k.section(vs) for k, vs in items)
        self.names = ", ".join(k.name for k, _ in items)
        flags = _flags(os_threads)
        digest = hashlib.sha256()
        digest.update(HEADER.read_bytes())
        digest.update((EMU_DIR / "cuda_emu.h").read_bytes())
        digest.update(self.tu.encode())
        digest.update(" ".join([CXX, *flags]).encode())
        self.dir = _cache_dir() / digest.hexdigest()[:24]
        self.lib = self.dir / "kernel.so"
        self.flags = flags
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        if self.lib.exists():
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "kernel.cpp").write_text(self.tu)
        # unique temp output so that concurrent sessions never load a half-written library
        self.tmp = self.dir / f"kernel.{os.getpid()}.{threading.get_ident()}.so"
        pch = _pch_dir(self.os_threads)
        includes = ([f"-I{pch}"] if pch else []) + [f"-I{EMU_DIR}"]
        cmd = [CXX, *self.flags, *includes, "-o", str(self.tmp), str(self.dir / "kernel.cpp")]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def finish(self) -> None:
        if self.proc is not None:
            out, _ = self.proc.communicate()
            if self.proc.returncode != 0:
                raise EmuError(
                    f"g++ failed for {self.names} ({self.dir / 'kernel.cpp'}):\n{out[-6000:]}"
                )
            os.replace(self.tmp, self.lib)
        lib = ctypes.CDLL(str(self.lib))
        for kernel, variants in self.items:
            self._bind(lib, kernel, variants)

    @staticmethod
    def _bind(lib, kernel: EmuKernel, variants: list[_Variant]) -> None:
        for v in variants:
            fn = getattr(lib, v.symbol)
            fn.restype = ctypes.c_int
            fn.argtypes = [
                ctypes.POINTER(ctypes.c_void_p),
                ctypes.POINTER(ctypes.c_longlong),
                ctypes.POINTER(ctypes.c_longlong),
                ctypes.POINTER(ctypes.c_longlong),
                ctypes.c_int,
                ctypes.c_ulonglong,
                ctypes.c_char_p,
                ctypes.c_int,
            ]
            kernel._loaded[v.key] = (lib, v.symbol)


def _cache_dir() -> Path:
    d = os.environ.get("METAL_EMU_CACHE")
    if d:
        return Path(d)
    return Path(tempfile.gettempdir()) / f"metal_emu_cache_{os.getuid()}"


def precompile(jobs: Iterable[tuple[EmuKernel, Iterable[dict]]], parallel: int | None = None) -> None:
    """Compile the instantiations of several kernels: bundled into at most `parallel` (default: the
    CPU count) translation units per thread model, balanced by instantiation count, compiled in
    parallel. Kernels with a `header` get a unit of their own (headers may clash)."""
    width = parallel or max(1, os.cpu_count() or 1)
    groups: dict[bool, list[tuple[EmuKernel, list[_Variant]]]] = {}
    for kernel, calls in jobs:
        todo = kernel._todo([kernel.variant(c["inputs"], c["output_dtypes"], c.get("template")) for c in calls])
        if todo:
            groups.setdefault(kernel.os_threads, []).append((kernel, todo))
    pending: list[_CompileJob] = []
    for os_threads, items in groups.items():
        solo = [it for it in items if it[0].header]
        rest = sorted((it for it in items if not it[0].header), key=lambda it: -len(it[1]))
        buckets: list[list] = [[] for _ in range(min(width, len(rest)))]
        loads = [0] * len(buckets)
        for it in rest:  # largest first into the lightest bucket
            i = loads.index(min(loads))
            buckets[i].append(it)
            loads[i] += 2 + len(it[1])
        for bucket in [[it] for it in solo] + [b for b in buckets if b]:
            pending.append(_CompileJob(bucket, os_threads))
    running: list[_CompileJob] = []
    for job in pending:
        job.start()
        running.append(job)
        if len(running) >= width:
            running.pop(0).finish()
    for job in running:
        job.finish()
