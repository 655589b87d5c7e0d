"""Metal emulation on the CPU: metal_emu.h plus the harness that compiles and launches kernel bodies."""

from .harness import EmuKernel, EmuError, InputSpec, compiler_available, precompile

__all__ = ["EmuKernel", "EmuError", "InputSpec", "compiler_available", "precompile"]
