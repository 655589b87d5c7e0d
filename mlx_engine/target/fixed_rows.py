"""Fixed-row passes: every decode and verify pass of the target runs exactly `rows` token rows, so MLX's
own matmuls see one shape and give each row the same bits in every pass (issue 12).

    from mlx_engine.target.fixed_rows import make_fixed_rows
    mode = make_fixed_rows(model, rows=16)   # in place; "stock" or "kernels" (what the linears run)

A pass of n <= rows tokens is fed as those n tokens followed by rows - n copies of the last one (pad
rows). Row-local ops (embedding, norms, RoPE, activations) give a real row the same bits whatever the
pad holds. Attention is the batch_attention kernel (target/batch_invariant.py's wrapper) told how many
rows are real: pad rows read no key and are zeros, and a real row sees only the keys before it. MoE
experts (gather_qmm) and per-token modules (MLA attention, raw MoE gates) run the real rows only. After
the pass each KV cache is cut back to the real rows, so callers see a pass of n tokens: logits [B, n, V].

Why: with stock MLX the matmul of a verify pass picks its kernel by row count (qmv per row for a few
rows, qmm from more), so its rows differ in the last bits from single-token decode. At one fixed row
count the kernel is always the same one, and a GEMM computes each output row from its own input row
only. Measured on an H100 (bench/results/gpu/h100-padded-qmm.json): `mx.quantized_matmul` with x padded
to 8, 16 or 32 rows gave every row the bits of its 1-row padded call in 42 of 42 cases (bf16 / fp16,
7 Llama / Qwen-MoE matrices, rows reversed, random neighbours), and MLX's 8- and 16-row qmm costs what
its 1-row qmv does (17.5 / 17.6 against 18.9 us on 4096 x 4096). One pad of the token ids per pass
replaces the pad before every linear that was measured too slow (25.3 ms a 1-token forward).

That rows are independent in a fixed-shape matmul is a property of the device's kernels, not a
contract, so `linears="auto"` checks it on the model itself at load (`probe`): a `rows`-token verify
pass must give the logits of `rows` single-token passes bit for bit. If it does not, the linears go
through the batch_qmm kernels (invariant by construction) and the pad is kept for the rest.

Only for models whose every layer cache is a plain KVCache (trimmable by offset): recurrent layers
(GatedDeltaNet, Mamba) and sliding windows would take the pad rows into their state; for those
`make_fixed_rows` returns "kernels" and installs the batch-invariant kernels without padding. Passes
of more than `rows` tokens (prefill) run stock, outside the contract; the engine caps its drafts at
rows - 1.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from .. import host
from .batch_invariant import is_batch_invariant, live_rows, make_batch_invariant
from .cache import make_cache

DEFAULT_ROWS = 16  # the verify passes of k <= 15 drafts; MLX's 16-row qmm costs its 1-row qmv (above)


def _plain_kv(caches: list) -> bool:
    return bool(caches) and all(type(c) is KVCache for c in caches)


def _install_padding(model: nn.Module, rows: int) -> None:
    cls = type(model)
    if getattr(cls, "_mlx_engine_fixed_rows", False):
        object.__setattr__(model, "_fixed_rows", rows)
        return

    def __call__(self, inputs, *args, cache=None, **kwargs):
        n = inputs.shape[1] if inputs.ndim == 2 else rows
        R = self._fixed_rows
        if inputs.ndim != 2 or inputs.shape[0] != 1 or not 0 < n < R or not _plain_kv(cache or []) or args or kwargs:
            return cls.__call__(self, inputs, *args, cache=cache, **kwargs)
        before = [c.offset for c in cache]
        padded = mx.pad(inputs, [(0, 0), (0, R - n)], mode="edge")  # pad rows: the last token again
        token = live_rows.set(n)
        try:
            out = cls.__call__(self, padded, cache=cache)
        finally:
            live_rows.reset(token)
        for c, b in zip(cache, before):
            if c.offset > b + n:  # per-token modules wrote only the real rows
                c.trim(c.offset - (b + n))
        return out[:, :n]

    model.__class__ = type(cls.__name__, (cls,), {"__call__": __call__, "_mlx_engine_fixed_rows": True})
    object.__setattr__(model, "_fixed_rows", rows)


def fixed_rows(model: nn.Module) -> int | None:
    """The row count of a model patched by make_fixed_rows, else None."""
    return getattr(model, "_fixed_rows", None) if getattr(type(model), "_mlx_engine_fixed_rows", False) else None


def probe(model: nn.Module, rows: int, context: int = 12, seed: int = 0) -> bool:
    """Whether a `rows`-token pass over a cache of `context` tokens gives, bit for bit, the logits of
    `rows` single-token passes (each padded to `rows`): the property fixed-row decoding rests on."""
    vocab = int(getattr(getattr(model, "args", None), "vocab_size", 0) or 256)
    toks = mx.random.randint(0, vocab, (1, context + rows), key=mx.random.key(seed))
    a, b = make_cache(model), make_cache(model)
    host.wait(model(toks[:, :context], cache=a), model(toks[:, :context], cache=b))
    verify = model(toks[:, context:], cache=a)[0]
    singles = mx.concatenate([model(toks[:, context + i : context + i + 1], cache=b)[0] for i in range(rows)])
    return bool(host.read(mx.array_equal(verify, singles)))


def make_fixed_rows(model: nn.Module, rows: int = DEFAULT_ROWS, linears: str = "auto") -> str:
    """Patch `model` in place for fixed-row passes (module docstring). Returns what its linears run:
    "stock" (MLX's matmuls at `rows` rows) or "kernels" (batch_qmm, row-split nn.Linear).

    linears: "auto" (stock if `probe` passes on this device, else kernels), "stock" or "kernels"."""
    if linears not in ("auto", "stock", "kernels"):
        raise ValueError(f"linears must be auto, stock or kernels, not {linears!r}")
    if not 1 <= rows <= 16:
        raise ValueError(f"rows must be 1..16 (the batch-invariant kernels' bound), not {rows}")
    if is_batch_invariant(model) and fixed_rows(model) is None:
        raise ValueError("the model is already patched by make_batch_invariant without fixed rows")
    if not _plain_kv(make_cache(model)):
        make_batch_invariant(model, max_rows=rows)
        return "kernels"
    stock = linears != "kernels"
    make_batch_invariant(model, max_rows=rows, linear=not stock, quantized=not stock)
    _install_padding(model, rows)
    if linears == "auto" and not probe(model, rows):
        stock = False
        make_batch_invariant(model, max_rows=rows)  # now the linears too
    object.__setattr__(model, "_fixed_rows_linears", "stock" if stock else "kernels")
    return "stock" if stock else "kernels"


def make_invariant(model: nn.Module, mode) -> int | None:
    """Apply a batch-invariance mode: False / None / "off" (leave as is), True / "kernels"
    (make_batch_invariant), "fixed" (make_fixed_rows, linears "auto"). Returns the model's fixed row
    count (also when it was patched before), or None."""
    if mode in (True, "kernels"):
        make_batch_invariant(model)
    elif mode == "fixed":
        make_fixed_rows(model)
    elif mode not in (None, False, "off"):
        raise ValueError(f"batch-invariant mode must be off, kernels or fixed, not {mode!r}")
    return fixed_rows(model)
