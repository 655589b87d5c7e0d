"""Whether decoding is batch invariant when the caller does not say: one rule for both engines.

The batch-invariant path becomes the default decode path on GPUs once it is as fast as stock decoding
there. Measured on an H100 (issue 12: Llama-3-8B-shaped, 4-bit, bf16): its 1-token forward took 11.0 ms
against stock's 7.6 (attention and the small projections slower than MLX's), so plain decoding ran at
76 tok/s against stock's 124 (docs/kernels.md). Until then it is opt-in: Engine(batch_invariant=True or
"fixed"), BatchEngine(batch_invariant=True), --batch-invariant. The fixed-row path is not measured on a
GPU yet; "fixed" in INVARIANT_BY_DEFAULT_ON_GPU would pick it (the batch engine then runs the kernels
mode: a fixed-row pass pads one sequence).
"""

from __future__ import annotations

from .. import kernels

INVARIANT_BY_DEFAULT_ON_GPU: bool | str = False  # False, True ("kernels") or "fixed"


def gpu_decoding() -> bool:
    """True where decode steps run on a GPU (Metal or CUDA): there stock verify rows are not bit-equal to
    single-token rows (on the CPU they are for fp32 weights in practice, not by contract)."""
    return kernels.auto_backend() != "reference"


def default_invariance(several_sequences: bool = False) -> bool | str:
    """The batch-invariance mode that `batch_invariant=None` means: INVARIANT_BY_DEFAULT_ON_GPU on a GPU,
    else off. For several sequences (the batch engine) any invariant mode is the kernels mode."""
    mode = INVARIANT_BY_DEFAULT_ON_GPU if gpu_decoding() else False
    return bool(mode) if several_sequences else mode
