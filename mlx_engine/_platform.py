"""Platform set-up that must happen before `import mlx`.

The Linux CPU wheel of MLX ships a reference (netlib) BLAS: a 2048^3 fp32 matmul runs at ~5 GFLOP/s.
libmlx only imports cblas_sgemm/dgemm/cgemm, so loading OpenBLAS into the global symbol namespace
before libmlx resolves them makes fp32 matmuls ~60x faster. Set MLX_ENGINE_NO_OPENBLAS=1 to skip.
"""

import ctypes
import os
import sys

_CANDIDATES = (
    "libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "libopenblas.so",
)


def preload_openblas() -> str | None:
    """Load OpenBLAS with RTLD_GLOBAL if on Linux and MLX is not imported yet. Returns the library loaded."""
    if not sys.platform.startswith("linux") or os.environ.get("MLX_ENGINE_NO_OPENBLAS"):
        return None
    if "mlx.core" in sys.modules:
        return None  # too late: libmlx already bound its BLAS symbols
    for name in _CANDIDATES:
        try:
            ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
            return name
        except OSError:
            continue
    return None


OPENBLAS = preload_openblas()
