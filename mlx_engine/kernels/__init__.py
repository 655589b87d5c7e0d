"""Kernel registry: one entry per fused op, each with a reference in plain MLX ops.

    from mlx_engine import kernels
    accept = kernels.get("acceptance")          # callable with the reference's signature
    kernels.backend("acceptance")               # "metal" | "cuda" | "reference"

Selection per op: Metal when `mx.metal.is_available()`, else CUDA when `mx.cuda.is_available()`, else
the reference. `MLX_ENGINE_KERNELS=reference|metal|cuda` forces one (a forced backend that is not
available here falls back to the reference with a warning). On first use on a GPU every kernel runs
its probe cases (small, deterministic) against the reference; a kernel that raises or disagrees is
disabled with one `warnings.warn` and the reference is used instead (when forced, it is kept and only
the warning is given).

Ops (module: reference / fused):
    acceptance  accept_reference(target, draft_tokens, draft_probs, uniforms, sample_uniform, greedy)
                -> int32 [2] (n_accepted, next_token)
    batch_qmm   qmm_reference(x, w, scales, biases, group_size, bits) -> [M, N], batch invariant
    batch_attention  attention_reference(q, k, v, scale, causal, qp, kp) -> [B, Hq, L, DV], batch invariant
    gather_qmm  gather_reference(x, w, scales, biases, idx, group_size, bits, xdiv, tokens) -> [P, N] (MoE)
    gdn_step    gdn_step_reference(q, k, v, g, beta, state) -> (y, states after every token)
"""

from __future__ import annotations

import functools
import importlib
import os
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import mlx.core as mx

ENV_VAR = "MLX_ENGINE_KERNELS"
BACKENDS = ("metal", "cuda", "reference")


@dataclass(frozen=True)
class Launch:
    """The keyword arguments of one `mx.fast.metal_kernel` / `cuda_kernel` call (also what the Metal
    emulator in metal_kernels/emu replays)."""

    inputs: list
    template: list
    grid: tuple
    threadgroup: tuple
    output_shapes: list
    output_dtypes: list

    def kwargs(self) -> dict:
        return dict(
            inputs=self.inputs,
            template=self.template,
            grid=self.grid,
            threadgroup=self.threadgroup,
            output_shapes=self.output_shapes,
            output_dtypes=self.output_dtypes,
        )


@dataclass
class Op:
    """A registered op: its reference, its fused implementations by backend, and its probe.

    `probe()` returns a list of argument tuples; `check(kernel_out, reference_out, args, kernel)`
    returns None when they agree and a short description of the difference otherwise.
    `sizes(backend)` (optional) lists launch-size variants of the backend's kernel, largest first: the
    first that launches on this device and passes the probe is used (a GPU allows fewer threads per
    group than its maximum to a kernel that needs many registers, and says so only at launch)."""

    name: str
    reference: Callable
    impls: dict[str, Callable] = field(default_factory=dict)
    probe: Callable[[], list] = lambda: []
    check: Callable[[Any, Any, tuple, Callable], str | None] = lambda out, ref, args, fn: None
    sizes: Callable[[str], list[Callable]] | None = None

    def candidates(self, backend: str) -> list[Callable]:
        return self.sizes(backend) if self.sizes is not None else [self.impls[backend]]


_OPS: dict[str, Op] = {}
_MODULES = {
    "acceptance": "mlx_engine.kernels.acceptance",
    "batch_qmm": "mlx_engine.kernels.batch_qmm",
    "batch_attention": "mlx_engine.kernels.batch_attention",
    "gather_qmm": "mlx_engine.kernels.gather_qmm",
    "gdn_step": "mlx_engine.kernels.gdn_step",
}
_resolved: dict[str, tuple[str, Callable]] = {}
_lock = threading.RLock()


@functools.lru_cache(maxsize=None)
def build_kernel(name: str, input_names: tuple, output_names: tuple, backend: str, contiguous: bool = True):
    """The `mx.fast.metal_kernel` / `cuda_kernel` of `metal_kernels/<name>.metal|.cu` (built once).
    contiguous=False: inputs are passed as they are (the body indexes them through `<name>_strides`)."""
    from metal_kernels import header, source

    make = mx.fast.metal_kernel if backend == "metal" else mx.fast.cuda_kernel
    return make(
        name=f"mlx_engine_{name}",
        input_names=list(input_names),
        output_names=list(output_names),
        source=source(name, backend),
        header=header(backend),
        ensure_row_contiguous=contiguous,
    )


_constants: dict = {}


def cached_constant(key, make: Callable[[], mx.array]) -> mx.array:
    """A small input made once and evaluated (a kernel's unused dummy input, its scale): a fresh mx.zeros
    per launch would add a fill kernel to every call."""
    with _lock:
        if key not in _constants:
            a = make()
            mx.eval(a)
            _constants[key] = a
        return _constants[key]


def differs_from_reference(out: mx.array, ref: mx.array) -> str | None:
    """None when a kernel's output agrees with its reference to float rounding (float32 outputs 1e-4,
    half outputs 2e-2, relative and absolute), else what differs (for probe checks)."""
    if out.shape != ref.shape:
        return f"shape {out.shape} != {ref.shape}"
    tol = 1e-4 if out.dtype == mx.float32 else 2e-2
    a, b = out.astype(mx.float32), ref.astype(mx.float32)
    if not mx.allclose(a, b, rtol=tol, atol=tol).item():
        return f"max abs difference {mx.abs(a - b).max().item():.3g} from the reference"
    return None


def register(op: Op) -> None:
    """Add (or replace) an op; clears its cached selection."""
    with _lock:
        _OPS[op.name] = op
        _resolved.pop(op.name, None)


def _op(name: str) -> Op:
    with _lock:
        if name not in _OPS and name in _MODULES:
            register(importlib.import_module(_MODULES[name]).OP)
        if name not in _OPS:
            raise KeyError(f"unknown kernel op {name!r}; known: {sorted(set(_OPS) | set(_MODULES))}")
        return _OPS[name]


def ops() -> list[str]:
    return sorted(set(_OPS) | set(_MODULES))


def backend_available(name: str) -> bool:
    if name == "reference":
        return True
    if name == "metal":
        return bool(mx.metal.is_available())
    if name == "cuda":
        return bool(getattr(mx, "cuda", None) is not None and mx.cuda.is_available())
    return False


def forced_backend() -> str | None:
    value = os.environ.get(ENV_VAR, "").strip().lower()
    if not value:
        return None
    if value not in BACKENDS:
        raise ValueError(f"{ENV_VAR}={value!r}: expected one of {', '.join(BACKENDS)}")
    return value


def auto_backend() -> str:
    for name in ("metal", "cuda"):
        if backend_available(name):
            return name
    return "reference"


def _probe(op: Op, fn: Callable) -> str | None:
    try:
        for args in op.probe():
            out = fn(*args)
            ref = op.reference(*args)
            mx.eval(out, ref)
            problem = op.check(out, ref, args, fn)
            if problem:
                return problem
    except Exception as e:  # a kernel that cannot compile or run is as bad as a wrong one
        return f"{type(e).__name__}: {e}"
    return None


def _resolve(name: str) -> tuple[str, Callable]:
    with _lock:
        if name in _resolved:
            return _resolved[name]
        op = _op(name)
        forced = forced_backend()
        want = forced or auto_backend()
        if want != "reference" and (not backend_available(want) or want not in op.impls):
            why = "is not available here" if not backend_available(want) else "has no kernel for this op"
            warnings.warn(f"kernel {name!r}: backend {want!r} {why}; using the reference", stacklevel=3)
            want = "reference"
        fn = op.reference
        if want != "reference":
            problem = None
            for fn in op.candidates(want):  # the first launch size that runs and agrees
                problem = _probe(op, fn)
                if problem is None:
                    break
            if problem is not None:
                if forced:
                    warnings.warn(
                        f"kernel {name!r} on {want} disagrees with its reference on the probe ({problem}); "
                        f"kept because {ENV_VAR}={forced}",
                        stacklevel=3,
                    )
                else:
                    warnings.warn(
                        f"kernel {name!r} on {want} disagrees with its reference on the probe ({problem}); "
                        "disabled, using the reference",
                        stacklevel=3,
                    )
                    want, fn = "reference", op.reference
        _resolved[name] = (want, fn)
        return want, fn


def get(name: str) -> Callable:
    """The implementation of op `name` for this machine (same signature as its reference)."""
    return _resolve(name)[1]


def backend(name: str) -> str:
    """Which backend `get(name)` uses: "metal", "cuda" or "reference"."""
    return _resolve(name)[0]


def reference(name: str) -> Callable:
    return _op(name).reference


def describe() -> dict[str, str]:
    """op -> backend in use, for logs and the bench."""
    return {name: backend(name) for name in ops()}


def reset() -> None:
    """Forget every selection (the next get() re-reads the environment and re-probes)."""
    with _lock:
        _resolved.clear()
