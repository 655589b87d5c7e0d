"""Batch-invariant forward passes: a verify pass of k+1 tokens gives, bit for bit, the logits of k+1
single-token passes (anchors "Why verify is expensive" 1-3, 5; DESIGN "Exact on every device").

    from mlx_engine.target_model.batch_invariant import make_batch_invariant
    model = make_batch_invariant(model)     # in place; returns the model

Why: with stock MLX the rows of an M-row pass are not computed by the same instruction sequence as a
1-row pass (qmv for one row, qmv per row then qmm for more; attention splits keys by launch size; MoE
gathers sort pairs from 64 on; MLA switches from the absorbed to the expanded form for L > 1), so
near-tie argmaxes flip between verify and plain decode. Row-local stock ops (embedding gather,
`mx.fast.rms_norm`, RoPE with an offset, activations, residual adds) are invariant and left alone.

What it installs (parameters are untouched: every patched module keeps its arrays and names; we swap
the instance's class for a subclass, as target.py does), for passes of up to `max_rows` tokens per
sequence: one sequence (the engine's verify passes) or several over a BatchKVCache (the batch engine's
steps; every (sequence, token) row then gets the bits of its sequence's single-token step; see
target_model/invariant_rows.py):

  * `nn.QuantizedLinear` / `nn.QuantizedEmbedding.as_linear` (affine 4/8-bit, group 32/64/128):
    kernels "batch_qmm" (each weight read once for all rows; on the CPU its reference).
  * `QuantizedSwitchLinear` in `SwitchGLU` (MoE experts): kernels "gather_qmm" (each expert read once
    for all rows routed to it), the SwitchGLU without its sorting step.
  * attention: the module-level `scaled_dot_product_attention` mlx-lm's attention layers call is
    wrapped (target_model/invariant_attention.py): kernels "batch_attention" over each sequence's own keys,
    or on a CPU MLX's own attention one query row at a time.
  * `nn.Linear` / tied `nn.Embedding.as_linear` (unquantized): one 1-row matmul per row (the op
    sequence of single-token decode, so equal by construction; the weights are streamed once per row).
  * DeepSeek-V3's MLA attention: decode and verify passes in the absorbed form through kernels
    "batch_attention" with its rope score term (target_model/mla.py; mlx-lm switches to the expanded form
    for L > 1).
  * modules with no invariant kernel, run one token at a time (exactly the decode computation, so
    equal by construction): `SwitchGLU` over unquantized experts, the MLA attention of other families
    (modules with `embed_q` / `unembed_out`; one sequence only: `several_sequences_unsupported`), and
    MoE gates that hold a raw weight matrix (`*Gate` modules such as DeepSeek's MoEGate).

Passes of more rows (prefill) run stock: the contract covers decode and verify. Not covered: quantized
KV caches, attention sinks, non-affine quantization (mxfp4 / nvfp4 / mxfp8), the GatedDeltaNet
recurrence (mlx_engine.target_model.hybrid uses the per-token `gdn_step`, sequential by nature). On a GPU the
kernels use fused multiply-adds where the CPU references round twice: a patched model is batch
invariant on every device, and its logits agree with the CPU's to float rounding.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchGLU

from .. import kernels
from ..kernels.batch_attention import attention_reference as invariant_attention  # noqa: F401  (API)
from ..kernels.batch_attention import tree_sum  # noqa: F401  (API)
from .invariant_attention import wrap_attention_module
from .invariant_rows import MAX_ROWS, active, chunks, concat, covered, each_row, live, padded
from .mla import invariant_mla_call, is_deepseek_mla

# ---------------------------------------------------------------------------------------------------
# the row-splitting and kernel-backed forms of each patched op


def _rows_2d(x: mx.array) -> mx.array:
    return x.reshape(-1, x.shape[-1])


def _per_sequence_rows(x: mx.array) -> int:
    """Tokens per sequence of an activation: L of [B, L, D] (and of [.., L, D]), M of [M, D]."""
    return x.shape[-2] if x.ndim >= 2 else 1


def _qmm(x: mx.array, w, scales, biases, group_size: int, bits: int, max_rows: int) -> mx.array:
    """x @ dequantized(w).T: kernels "batch_qmm" in launches of at most MAX_ROWS rows (each row the bits
    of its 1-row launch) when x has at most max_rows tokens per sequence, else (prefill) stock."""
    x2 = _rows_2d(x)
    if _per_sequence_rows(x) <= max_rows:
        qmm = kernels.get("batch_qmm")
        y = concat([qmm(x2[a:b], w, scales, biases, group_size, bits) for a, b in chunks(x2.shape[0])], axis=0)
    else:  # prefill: outside the contract, the fast stock path
        y = mx.quantized_matmul(x2, w, scales, biases, transpose=True, group_size=group_size, bits=bits)
    return y.reshape(*x.shape[:-1], w.shape[0])


def _matmul_t(x: mx.array, weight: mx.array, max_rows: int, bias=None) -> mx.array:
    """x @ weight.T (+ bias): one 1-row matmul per row when x has at most max_rows tokens per sequence."""
    x2 = _rows_2d(x)
    wt = weight.T
    one = (lambda r: mx.addmm(bias, r, wt)) if bias is not None else (lambda r: r @ wt)
    if _per_sequence_rows(x) <= max_rows:
        y = concat([one(x2[i : i + 1]) for i in range(x2.shape[0])], axis=0)
    else:
        y = one(x2)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def _per_token(call, x: mx.array, *args, **kwargs):
    """`call` on each token of x [B, L, ...] alone (mask None: the queries of a causal verify pass, one
    at a time, are single-token decode steps), outputs concatenated along L."""
    if "mask" in kwargs:
        kwargs["mask"] = None
    elif args:
        args = (None,) + args[1:]
    live_n = live(x)
    out = concat([call(x[:, i : i + 1], *args, **kwargs) for i in range(live_n or x.shape[1])], axis=1)
    return padded(out, x.shape[1]) if live_n else out


def _sliced_args(args: tuple, b: int, i: int) -> tuple:
    """The arguments of sequence b's token i in a [B, L, ...] call (arrays with an L axis are sliced)."""
    return tuple(a[b : b + 1, i : i + 1] if isinstance(a, mx.array) and a.ndim >= 2 else a for a in args)


def _one_row(x: mx.array) -> bool:
    return x.shape[0] == 1 and x.shape[1] == 1


# ---------------------------------------------------------------------------------------------------
# module patches (class swaps; parameters untouched)


def _invariant_quantized(module) -> bool:
    return getattr(module, "mode", "affine") == "affine" and module.bits in (4, 8) and module.group_size in (32, 64, 128)


class _QLinear(nn.QuantizedLinear):
    _mlx_engine_batch_invariant = True

    def __call__(self, x):
        y = _qmm(x, self["weight"], self["scales"], self["biases"], self.group_size, self.bits, self._bi_rows)
        if "bias" in self:
            y = y + self["bias"]
        return y


class _QEmbedding(nn.QuantizedEmbedding):
    _mlx_engine_batch_invariant = True

    def as_linear(self, x):
        return _qmm(x, self["weight"], self["scales"], self["biases"], self.group_size, self.bits, self._bi_rows)


class _Linear(nn.Linear):
    _mlx_engine_batch_invariant = True

    def __call__(self, x):
        return _matmul_t(x, self["weight"], self._bi_rows, self.get("bias") if "bias" in self else None)


class _Embedding(nn.Embedding):
    _mlx_engine_batch_invariant = True

    def as_linear(self, x):
        return _matmul_t(x, self.weight, self._bi_rows)


class _QSwitchLinear(QuantizedSwitchLinear):
    """Experts through kernels "gather_qmm": x [.., 1 or topk, 1, K] with indices [.., topk]."""

    _mlx_engine_batch_invariant = True

    def __call__(self, x, indices, sorted_indices=False):
        topk = indices.shape[-1]
        tokens = indices.size // topk
        rows = x.size // x.shape[-1]
        per_seq = indices.shape[-2] if indices.ndim >= 2 else tokens
        if not active.get() or sorted_indices or per_seq > self._bi_rows or rows not in (tokens, indices.size):
            return super().__call__(x, indices, sorted_indices)
        xdiv = topk if rows == tokens else 1  # one x row per token, or one per (token, expert) pair
        x2, idx, gather = _rows_2d(x), indices.reshape(-1), kernels.get("gather_qmm")
        y = concat([  # launches of at most MAX_ROWS tokens: each pair the bits of its 1-token launch
            gather(x2[a * topk // xdiv : b * topk // xdiv], self["weight"], self["scales"], self["biases"],
                   idx[a * topk : b * topk], self.group_size, self.bits, xdiv, b - a)
            for a, b in chunks(tokens)], axis=0)
        if "bias" in self:
            y = y + self["bias"][indices.reshape(-1)]
        return y.reshape(*indices.shape, 1, y.shape[-1])


class _SwitchGLU(SwitchGLU):
    """Verify-sized passes: quantized experts unsorted through _QSwitchLinear, others one token at a time."""

    _mlx_engine_batch_invariant = True

    def __call__(self, x, indices):
        per_seq = x.shape[1] if x.ndim >= 3 else indices.size // indices.shape[-1]
        if not active.get() or per_seq > self._bi_rows:
            return super().__call__(x, indices)
        live_n = live(x)
        if live_n:  # pad rows of a fixed-row pass: route none of them (no expert read for them)
            return padded(self(x[:, :live_n], indices[:, :live_n]), x.shape[1])
        projs = (self.gate_proj, self.up_proj, self.down_proj)
        if not all(isinstance(p, _QSwitchLinear) for p in projs):  # one (sequence, token) row at a time
            if x.ndim < 3 or _one_row(x):
                return super().__call__(x, indices)
            return each_row(lambda b, i: super(_SwitchGLU, self).__call__(x[b : b + 1, i : i + 1],
                                                                         indices[b : b + 1, i : i + 1]), x)
        x = mx.expand_dims(x, (-2, -3))
        up = self.up_proj(x, indices)
        gate = self.gate_proj(x, indices)
        return self.down_proj(self.activation(up, gate), indices).squeeze(-2)


def _per_token_class(cls: type) -> type:
    """A subclass of cls whose verify-sized calls run one token at a time."""

    def __call__(self, x, *args, **kwargs):
        # the mask of a verify pass is causal over the cache (string or array): one token at a time
        # with mask None is exactly what single-token decode runs
        if not covered(x, self._bi_rows) or x.shape[1] == 1:
            return cls.__call__(self, x, *args, **kwargs)
        return _per_token(lambda xi, *a, **kw: cls.__call__(self, xi, *a, **kw), x, *args, **kwargs)

    return type(cls.__name__, (cls,), {"__call__": __call__, "_mlx_engine_batch_invariant": True})


def _gate_per_token_class(cls: type) -> type:
    """Raw-weight MoE gates ([B, L, H] -> per-token routing): one token at a time."""

    def __call__(self, x, *args, **kwargs):
        if not covered(x, self._bi_rows) or _one_row(x):
            return cls.__call__(self, x, *args, **kwargs)
        return each_row(lambda b, i: cls.__call__(self, x[b : b + 1, i : i + 1], *_sliced_args(args, b, i), **kwargs),
                        x, live(x))

    return type(cls.__name__, (cls,), {"__call__": __call__, "_mlx_engine_batch_invariant": True})


def _mla_class(cls: type) -> type:
    """DeepSeek-V3's MLA attention: decode and verify passes in the absorbed form (target_model/mla.py)."""

    def __call__(self, x, mask=None, cache=None):
        if not covered(x, self._bi_rows):
            return cls.__call__(self, x, mask, cache)
        return invariant_mla_call(self, x, cache, self._bi_split, live(x))

    return type(cls.__name__, (cls,), {"__call__": __call__, "_mlx_engine_batch_invariant": True})


def _is_mla_attention(m: nn.Module) -> bool:
    return isinstance(getattr(m, "embed_q", None), nn.Module) and isinstance(getattr(m, "unembed_out", None), nn.Module)


def _is_raw_gate(m: nn.Module) -> bool:
    params = m.parameters()
    return (
        type(m).__name__.endswith("Gate")
        and not isinstance(m, (nn.Linear, nn.QuantizedLinear))
        and isinstance(params.get("weight"), mx.array)
        and params["weight"].ndim == 2
    )


_CLASS_CACHE: dict[tuple[type, str], type] = {}


def _swap(module: nn.Module, base: type | None, patched: type, max_rows: int) -> None:
    cls = type(module)
    if getattr(cls, "_mlx_engine_batch_invariant", False):
        object.__setattr__(module, "_bi_rows", max_rows)
        return
    if cls is base or base is None:
        module.__class__ = patched
    else:  # a subclass of the base: keep its own methods, put ours first
        module.__class__ = type(cls.__name__, (patched, cls), {})
    object.__setattr__(module, "_bi_rows", max_rows)  # not a parameter


def _swap_generated(module: nn.Module, make, tag: str, max_rows: int) -> None:
    cls = type(module)
    if not getattr(cls, "_mlx_engine_batch_invariant", False):
        key = (cls, tag)
        if key not in _CLASS_CACHE:
            _CLASS_CACHE[key] = make(cls)
        module.__class__ = _CLASS_CACHE[key]
    object.__setattr__(module, "_bi_rows", max_rows)


def _install_switch(model: nn.Module) -> None:
    cls = type(model)
    if getattr(cls, "_mlx_engine_bi_switch", False):
        return

    def __call__(self, *args, **kwargs):
        token = active.set(True)
        try:
            return cls.__call__(self, *args, **kwargs)
        finally:
            active.reset(token)

    model.__class__ = type(cls.__name__, (cls,), {"__call__": __call__, "_mlx_engine_bi_switch": True})


def make_batch_invariant(model: nn.Module, max_rows: int = MAX_ROWS, linear: bool = True, quantized: bool = True) -> nn.Module:
    """Patch `model` in place (see the module docstring) and return it.

    max_rows: passes of up to this many rows per matmul are covered by the contract.
    linear: also patch unquantized nn.Linear / tied nn.Embedding (row-by-row 1-row matmuls).
    quantized: patch nn.QuantizedLinear / QuantizedEmbedding (batch_qmm); False leaves them stock, for
    target_model/fixed_rows.py, whose passes all have one row count."""
    modules = set()
    for _, m in model.named_modules():
        modules.add(type(m).__module__)
        if isinstance(m, nn.QuantizedLinear) and _invariant_quantized(m):
            if quantized:
                _swap(m, nn.QuantizedLinear, _QLinear, max_rows)
        elif isinstance(m, nn.QuantizedEmbedding) and _invariant_quantized(m):
            if quantized:
                _swap(m, nn.QuantizedEmbedding, _QEmbedding, max_rows)
        elif isinstance(m, QuantizedSwitchLinear) and m.biases is not None and _invariant_quantized(m):
            _swap(m, QuantizedSwitchLinear, _QSwitchLinear, max_rows)
        elif isinstance(m, SwitchGLU):
            _swap(m, SwitchGLU, _SwitchGLU, max_rows)
        elif is_deepseek_mla(m):
            _swap_generated(m, _mla_class, "mla", max_rows)
            object.__setattr__(m, "_bi_split", linear)  # embed_q / unembed_out one row at a time
        elif _is_mla_attention(m):
            _swap_generated(m, _per_token_class, "per_token", max_rows)
        elif _is_raw_gate(m):
            _swap_generated(m, _gate_per_token_class, "gate", max_rows)
        elif linear and type(m) is nn.Linear or isinstance(m, _Linear):
            _swap(m, nn.Linear, _Linear, max_rows)
        elif linear and type(m) is nn.Embedding or isinstance(m, _Embedding):
            _swap(m, nn.Embedding, _Embedding, max_rows)
    for name in modules:
        if name.startswith("mlx_lm.models."):
            wrap_attention_module(name)
    _install_switch(model)
    return model


def is_batch_invariant(model: nn.Module) -> bool:
    """Patched here, or for fixed-row passes (target_model/fixed_rows.py, which may patch nothing here)."""
    cls = type(model)
    return bool(getattr(cls, "_mlx_engine_bi_switch", False) or getattr(cls, "_mlx_engine_fixed_rows", False))


def several_sequences_unsupported(model: nn.Module) -> str | None:
    """Why the patched model's invariant passes cannot hold several sequences (the batch engine), or None:
    attention run one token at a time keeps the whole batch per token and cannot split a BatchKVCache."""
    for name, m in model.named_modules():
        if getattr(type(m), "_mlx_engine_batch_invariant", False) and _is_mla_attention(m) and not is_deepseek_mla(m):
            return f"{type(m).__name__} ({name}) runs one token at a time, one sequence only"
    return None
