"""Metal emulation on the CPU: metal_emu.h (and cuda_emu.h) plus the Python side in three parts:
codegen.py wraps a kernel body in the C++ MLX would generate, build.py compiles and caches it, kernel.py
(`EmuKernel`) is the call; dtypes.py holds the types they share."""

from .build import compiler_available, precompile
from .dtypes import EmuError, InputSpec
from .kernel import EmuKernel

__all__ = ["EmuKernel", "EmuError", "InputSpec", "compiler_available", "precompile"]
