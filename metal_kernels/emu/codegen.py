"""Code generation: a kernel body (MLX's `mx.fast.metal_kernel` / `cuda_kernel` convention) wrapped in the
C++ function MLX would generate, and a launcher per instantiation that metal_emu.h runs over the grid.

`KernelSource` is what a kernel was declared with (name, input and output names, body, header, dialect);
`Variant` one instantiation of it (input dtypes and ranks, output dtypes, template arguments). The
generated text is what build.py compiles and caches by hash: keep it stable.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from typing import Sequence

from .dtypes import CUDA_TYPES, DTYPES, EmuError, InputSpec, template_value

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
ATTR_FIELD = {"grid_size": "threads_per_grid"}  # same value, two names


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


class Variant:
    """One instantiation: input specs + output dtypes + template arguments."""

    def __init__(self, code: "KernelSource", specs: Sequence[InputSpec], out_dtypes: Sequence[str], template):
        self.code = code
        self.specs = tuple(specs)
        self.out_dtypes = tuple(out_dtypes)
        self.template = tuple((n, template_value(v)) for n, v in (template or ()))
        self.key = (self.specs, self.out_dtypes, self.template)
        h = hashlib.sha256(repr(self.key).encode()).hexdigest()[:16]
        self.symbol = f"emu_launch_{code.cname}_{h}"

    def signature_key(self):
        if self.code.dialect == "cuda":
            return self.key
        return (self.specs, self.out_dtypes, tuple((n, kind) for n, (kind, _) in self.template))

    # the buffers passed, in order: (what, input index or output index)
    def buffers(self) -> list[tuple[str, int]]:
        k = self.code
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


@dataclass(frozen=True)
class KernelSource:
    """A kernel as declared (`mx.fast.metal_kernel(name, input_names, output_names, source, header)`, or
    `cuda_kernel` with dialect "cuda") and the C++ it becomes."""

    name: str
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    source: str
    header: str = ""
    dialect: str = "metal"
    atomic_outputs: bool = False
    cname: str = field(init=False)
    body: str = field(init=False)  # the source with threadgroup / __shared__ declarations rewritten
    attrs: tuple = field(init=False)  # the thread attributes the body mentions (Metal)

    def __post_init__(self):
        cuda = self.dialect == "cuda"
        object.__setattr__(self, "cname", re.sub(r"\W", "_", self.name))
        object.__setattr__(self, "body", rewrite_threadgroup(self.source, "__shared__" if cuda else "threadgroup"))
        # CUDA bodies read threadIdx / blockIdx / blockDim instead of attributes
        object.__setattr__(self, "attrs", () if cuda else tuple((a, t) for a, t in ATTRIBUTES if a in self.source))

    def ctype(self, dtype: str) -> str:
        if self.dialect == "cuda" and dtype in CUDA_TYPES:
            return CUDA_TYPES[dtype]
        return DTYPES[dtype][0]

    def function(self, fname: str, v: Variant) -> str:
        if self.dialect == "cuda":
            return self.function_cuda(fname, v)
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
        for attr, typ in self.attrs:
            params.append(f"{typ} {attr}")
        tmpl = ""
        if v.template:
            tmpl = "template <" + ", ".join(f"{kind} {n}" for n, (kind, _) in v.template) + ">\n"
        sep = ",\n    "
        return (
            f"{tmpl}void {fname}(\n    {sep.join(params)}) {{\n"
            f'#line 1 "{self.name}.metal"\n{self.body}\n}}\n'
        )

    def function_cuda(self, fname: str, v: Variant) -> str:
        """As mlx/backend/cuda/custom_kernel.cpp: `const T* in`, `Shape in_shape`, `T* out`, then the
        template arguments as constexpr values / type aliases at the top of the body."""
        params = []
        for name, spec in zip(self.input_names, v.specs):
            params.append(f"metal_emu::dptr<const {self.ctype(spec.dtype)}> {name}")
            if f"{name}_shape" in self.source:
                params.append(f"metal_emu::dptr<const int> {name}_shape")
            if f"{name}_strides" in self.source:
                params.append(f"metal_emu::dptr<const int64_t> {name}_strides")
            if f"{name}_ndim" in self.source:
                params.append(f"const int {name}_ndim")
        for name, dt in zip(self.output_names, v.out_dtypes):
            params.append(f"metal_emu::dptr<{self.ctype(dt)}> {name}")
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
            f'#line 1 "{self.name}.cu"\n{self.body}\n}}\n'
        )

    def launcher(self, fname: str, v: Variant) -> str:
        args = []
        for b, (what, i) in enumerate(v.buffers()):
            if what == "in":
                spec = v.specs[i]
                ctype = self.ctype(spec.dtype)
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
                ctype = self.ctype(v.out_dtypes[i])
                if self.atomic_outputs:
                    ctype = f"metal::atomic<{ctype}>"
                nm = self.output_names[i]
                args.append(f'metal_emu::dptr<{ctype}>(static_cast<{ctype}*>(b[{b}]), n[{b}], "{nm}")')
        for attr, _ in self.attrs:
            args.append(f"A.{ATTR_FIELD.get(attr, attr)}")
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

    def section(self, variants: Sequence[Variant]) -> str:
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
                parts.append(self.function(fname, v))
        if metal:
            parts.append("#undef device\n#undef constant\n#undef thread\n#undef threadgroup\n")
        for v in variants:
            parts.append(self.launcher(fnames[v.signature_key()], v))
        return "".join(parts)

    def translation_unit(self, variants: Sequence[Variant]) -> str:
        cuda = '#include "cuda_emu.h"\n' if self.dialect == "cuda" else ""
        return '#include "metal_emu.h"\n' + cuda + self.section(variants)
