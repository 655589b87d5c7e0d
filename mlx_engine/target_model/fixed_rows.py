"""Fixed-row passes: every decode and verify pass of the target runs exactly `rows` token rows, so MLX's
own ops see one shape in every pass and give each row the same bits (issue 12).

    from mlx_engine.target_model.fixed_rows import make_fixed_rows
    plan = make_fixed_rows(model, rows=16)   # in place; "stock", "stock-linears" or "kernels"

A pass of n < rows tokens is fed as those n tokens followed by rows - n copies of the last one (pad
rows); after it every KV cache is cut back to the real rows and the model returns their logits
[B, n, V] (the target cuts its captured hidden states to them too). Causal attention keeps a real row
from seeing a pad row, and row-local ops (embedding, norms, RoPE, activations) give it the same bits
whatever the pad holds. What the rest runs is the plan:

  "stock"          every op MLX's own at `rows` rows: nothing patched but the pad and the cut.
  "stock-linears"  MLX's linears; attention through the batch_attention kernel told how many rows are
                   real (pad rows read no key, their rows are zeros; without a GPU kernel each real row
                   alone through MLX's attention); MoE experts (gather_qmm), MLA attention and raw-weight
                   MoE gates on the real rows only.
  "kernels"        the linears through batch_qmm / row-split matmuls too (target_model/batch_invariant.py).

Why: with stock MLX a verify pass picks its kernels by row count (a quantized matmul runs qmv per row
for a few rows, qmm from more; attention splits keys by launch size), so its rows differ in the last bits
from single-token decode. At one row count the kernels are always the same ones, and a GEMM computes
each output row from its own input row only. Measured on an H100 (bench/results/gpu/h100-padded-qmm.json):
`mx.quantized_matmul` with x padded to 8, 16 or 32 rows gave every row the bits of its 1-row padded call
in 42 of 42 cases (bf16 / fp16, 7 Llama / Qwen-MoE matrices, rows reversed, random neighbours), and its
8- and 16-row call costs what its 1-row call does (17.5 / 17.6 against 18.9 us on 4096 x 4096). That
round padded x before every linear (~19 us a pad) and ran the attention kernel on all 16 rows: 25.3 ms
a 1-token forward. Here the token ids are padded once per pass and pad rows cost no attention.

That fixed-shape ops keep rows independent is a property of the device's kernels, not a contract, so
plan "auto" checks it on the model itself at load (`probe`: a `rows`-token verify pass against `rows`
single-token passes, logits bit for bit) and keeps the first plan that passes ("kernels" holds by
construction). On this CPU with OpenBLAS (as the engine runs) "stock" fails for every tiny test family
(for llama the two plans differ only in attention: MLX's CPU attention is not row independent at a
fixed shape) and "stock-linears" passes for all (llama, qwen3, deepseek_v3 with MLA and MoE; fp32,
4- and 8-bit).

Only for models whose every layer cache is a plain KVCache (trimmable by offset): recurrent layers
(GatedDeltaNet, Mamba) and sliding windows would take the pad rows into their state; for those
`make_fixed_rows` returns "kernels" and installs the batch-invariant kernels without padding. Passes
of more than `rows` tokens (prefill) run unpadded, outside the contract; the engine caps its drafts at
rows - 1.
"""
from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from .. import host, kernels
from .batch_invariant import is_batch_invariant, make_batch_invariant, several_sequences_unsupported
from .cache import make_cache
from .invariant_rows import MAX_ROWS, live_rows

DEFAULT_ROWS = 16  # the verify passes of k <= 15 drafts; MLX's 16-row qmm costs its 1-row qmv (above)


def _plain_kv(caches: list) -> bool:
    return bool(caches) and all(type(c) is KVCache for c in caches)


def _install_padding(model: nn.Module, rows: int) -> None:
    cls = type(model)
    if getattr(cls, "_mlx_engine_fixed_rows", False):
        object.__setattr__(model, "_fixed_rows", rows)
        return

    def __call__(self, inputs, *args, cache=None, **kwargs):
        if args and cache is None:  # model(inputs, cache), as mlx-lm's signature allows
            cache, args = args[0], args[1:]
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


PROBES = ((12, None), (37, None), (23, 2), (29, 5))  # (context, tokens of the verify pass; None: rows)


def probe(model: nn.Module, rows: int, seed: int = 0) -> bool:
    """Whether a verify pass over a cache gives, bit for bit, the logits of as many single-token passes
    (each padded to `rows`): the property fixed-row decoding rests on, checked at several contexts and pass
    lengths (PROBES). One case alone was not enough: on one 2-core x86 machine "stock" passed a 12-token
    context with 8 rows and failed others, where the machine of the earlier runs failed them all."""
    vocab = int(getattr(getattr(model, "args", None), "vocab_size", 0) or 256)
    same = []
    for j, (context, n) in enumerate(PROBES):
        n = min(n or rows, rows)
        toks = mx.random.randint(0, vocab, (1, context + n), key=mx.random.key(seed + j))
        a, b = make_cache(model), make_cache(model)
        host.wait(model(toks[:, :context], cache=a), model(toks[:, :context], cache=b))
        verify = model(toks[:, context:], cache=a)[0]
        singles = mx.concatenate([model(toks[:, context + i : context + i + 1], cache=b)[0] for i in range(n)])
        same.append(mx.array_equal(verify, singles))
    return all(host.read(mx.stack(same)))


PLANS = ("stock", "stock-linears", "kernels")  # fewest patches first; each adds to the one before


def _apply(model: nn.Module, plan: str, rows: int) -> None:
    """The patches of `plan` (each plan's are a superset of the one before, so a later plan applied over
    an earlier one is that later plan)."""
    if plan == "stock-linears":  # attention kernel, MoE / MLA / gates on real rows; linears stay MLX's
        make_batch_invariant(model, max_rows=rows, linear=False, quantized=False)
    elif plan == "kernels":
        make_batch_invariant(model, max_rows=rows)


def make_fixed_rows(model: nn.Module, rows: int = DEFAULT_ROWS, plan: str = "auto") -> str:
    """Patch `model` in place for fixed-row passes (module docstring); returns the plan it runs:
    "stock" (every op MLX's own at `rows` rows: only the pad and the cache cut), "stock-linears" (MLX's
    linears; attention through the batch_attention kernel told the real rows, MoE experts, MLA and raw
    gates on the real rows only) or "kernels" (the linears through batch_qmm too).

    plan "auto": the first of PLANS whose `probe` passes on this device ("kernels" holds by
    construction); where batch_attention runs on a GPU, from "stock-linears" (the kernel reads no key for
    a pad row; MLX's attention would run all of them)."""
    if plan not in ("auto",) + PLANS:
        raise ValueError(f"plan must be auto, {', '.join(PLANS)}, not {plan!r}")
    if not 1 <= rows <= 16:
        raise ValueError(f"rows must be 1..16 (the batch-invariant kernels' bound), not {rows}")
    if is_batch_invariant(model):
        raise ValueError("the model is already patched for batch invariance")
    if not _plain_kv(make_cache(model)):
        make_batch_invariant(model, max_rows=rows)
        return "kernels"
    _install_padding(model, rows)
    tries = [plan] if plan != "auto" else list(PLANS[1:] if kernels.backend("batch_attention") != "reference" else PLANS)
    for chosen in tries:
        _apply(model, chosen, rows)
        if chosen == "kernels" or plan != "auto" or probe(model, rows):
            break
    object.__setattr__(model, "_fixed_rows_plan", chosen)
    return chosen


def fixed_rows_plan(model: nn.Module) -> str | None:
    """The plan make_fixed_rows chose for `model`, else None."""
    return getattr(model, "_fixed_rows_plan", None)


def make_invariant(model: nn.Module, mode) -> int | None:
    """Apply a batch-invariance mode: False / None / "off" (leave as is), True / "kernels"
    (make_batch_invariant), "fixed" (make_fixed_rows, plan "auto"). Returns the most tokens a pass may
    hold and stay invariant (k + 1 <= it; also when the model was patched before): its fixed row count,
    the kernels' MAX_ROWS, or None when the model is not batch invariant."""
    if mode in (True, "kernels"):
        make_batch_invariant(model)
    elif mode == "fixed":
        if fixed_rows(model) is None:  # a second engine over the same model keeps its plan
            make_fixed_rows(model)
    elif mode not in (None, False, "off"):
        raise ValueError(f"batch-invariant mode must be off, kernels or fixed, not {mode!r}")
    rows = fixed_rows(model)
    return rows if rows is not None else (MAX_ROWS if is_batch_invariant(model) else None)


def make_invariant_batches(model: nn.Module, mode) -> tuple[int | None, str | None]:
    """make_invariant for passes of several sequences (the batch engine): True / "kernels" patch the model
    (make_batch_invariant covers any number of sequences of up to MAX_ROWS tokens); "fixed" is refused
    (a fixed-row pass pads one sequence). Returns (make_invariant's row bound, why the model cannot run
    invariant passes of several sequences, or None)."""
    padded_model = fixed_rows(model) is not None
    if mode == "fixed" or (padded_model and mode not in (None, False, "off")):
        raise ValueError("fixed-row passes pad one sequence at a time; batched decoding runs the 'kernels' mode")
    if padded_model:  # patched for one sequence at a time: several run stock
        return None, None
    rows = make_invariant(model, mode)
    return rows, several_sequences_unsupported(model) if rows else None
