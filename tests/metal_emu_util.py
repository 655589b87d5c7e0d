"""Helpers for running the repo's Metal kernel bodies under the CPU emulator (metal_kernels/emu)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

# the repo root first: a stale editable install may map metal_kernels to an empty namespace package
_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from metal_kernels import header, source  # noqa: E402
from metal_kernels.emu import EmuKernel  # noqa: E402


def emu_kernel(module, os_threads: bool = False, dialect: str = "metal", max_threads: int = 1024) -> EmuKernel:
    """The emulated twin of the `mx.fast.metal_kernel` (dialect "metal") or `mx.fast.cuda_kernel`
    (dialect "cuda") that a kernel module in mlx_engine/kernels builds (max_threads: the threads per
    threadgroup the simulated device allows this kernel)."""
    return EmuKernel(
        f"mlx_engine_{module.NAME}" + ("_cu" if dialect == "cuda" else ""),
        list(module.INPUT_NAMES),
        list(module.OUTPUT_NAMES),
        source(module.NAME, dialect),
        header=header(dialect),
        ensure_row_contiguous=getattr(module, "CONTIGUOUS", True),
        os_threads=os_threads,
        dialect=dialect,
        max_threads=max_threads,
    )


def run(kernel: EmuKernel, launch, schedule: str = "forward", seed: int = 0) -> list[np.ndarray]:
    """Replay a `Launch` (the exact kwargs the MLX wrapper would pass) on the emulator."""
    return kernel(**launch.kwargs(), schedule=schedule, seed=seed)


def compile_call(launch) -> dict:
    kw = launch.kwargs()
    return dict(inputs=kw["inputs"], output_dtypes=kw["output_dtypes"], template=kw["template"])


def emulated(kernel: EmuKernel, launch_spec):
    """A GPU implementation for the registry that runs `kernel` on the emulator with the wrapper's
    launch (`launch_spec(*args)`), returning MLX arrays of the launch's output dtypes."""
    import mlx.core as mx

    def fn(*args, **kwargs):
        spec = launch_spec(*args, **kwargs)
        outs = []
        for o, dt in zip(run(kernel, spec), spec.output_dtypes):
            a = mx.array(o)
            outs.append(a.view(mx.bfloat16) if dt == mx.bfloat16 else a)
        return outs[0] if len(outs) == 1 else tuple(outs)

    return fn
