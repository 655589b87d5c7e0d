"""Kernel sources, read as package data.

One Metal body per kernel (`<name>.metal`: the text passed as `source=` to `mx.fast.metal_kernel`;
MLX generates the signature from the input/output names) and its CUDA twin (`<name>.cu`, the body
for `mx.fast.cuda_kernel`). The Python wrappers live in `mlx_engine/kernels/`; `emu/` holds the
C++ emulation of Metal that tests the `.metal` bodies on machines without a GPU.
"""

from functools import lru_cache
from importlib import resources

KERNELS = ("acceptance", "batch_attention", "batch_qmm", "gdn_step")
_EXT = {"metal": "metal", "cuda": "cu"}
_COMMON_HEADER = {"metal": None, "cuda": "common.cuh"}  # helpers every kernel of a dialect may use


@lru_cache(maxsize=None)
def source(name: str, backend: str = "metal") -> str:
    """The kernel body `name` for `backend` ("metal" -> name.metal, "cuda" -> name.cu).

    `name` may also carry its extension ("acceptance.cu").
    """
    if "." not in name:
        if backend not in _EXT:
            raise ValueError(f"unknown backend {backend!r}; expected one of {sorted(_EXT)}")
        name = f"{name}.{_EXT[backend]}"
    path = resources.files(__package__).joinpath(name)
    if not path.is_file():
        raise FileNotFoundError(f"no kernel source {name!r} in {__package__}")
    return path.read_text(encoding="utf-8")


@lru_cache(maxsize=None)
def header(backend: str = "metal") -> str:
    """The `header=` text for kernels of `backend`: shared helpers (common.cuh for CUDA; "" for Metal)."""
    if backend not in _EXT:
        raise ValueError(f"unknown backend {backend!r}; expected one of {sorted(_EXT)}")
    name = _COMMON_HEADER[backend]
    return resources.files(__package__).joinpath(name).read_text(encoding="utf-8") if name else ""
