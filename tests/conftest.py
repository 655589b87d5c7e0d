import os
import sys
from pathlib import Path

# fp32 matmuls in full precision on CUDA as on the CPU (MLX runs them on TF32 tensor cores by default,
# ~1e-3 relative error); must be set before mlx is imported
os.environ.setdefault("MLX_ENABLE_TF32", "0")

import tempfile  # noqa: E402

# the prefix cache's disk tier (on by default for `serve`) writes into a folder of this test session's own,
# never the user's cache folder
os.environ.setdefault("MLX_ENGINE_CACHE_DIR", tempfile.mkdtemp(prefix="mlx-engine-test-cache-"))

import pytest  # noqa: E402

import mlx_engine  # noqa: E402,F401  (loads OpenBLAS before mlx)

sys.path.insert(0, str(Path(__file__).parent))

from device import ON_GPU  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """Tests marked cpu_exact assert a bit-exactness that holds for the CPU's arithmetic only (a GPU
    contracts a*b+c into FMAs, reduces in other orders): skipped on a GPU, with the reason."""
    if not ON_GPU:
        return
    skip = pytest.mark.skip(reason="asserts CPU bit-exactness or the CPU's code path; not a property of a GPU")
    for item in items:
        if "cpu_exact" in item.keywords:
            item.add_marker(skip)
