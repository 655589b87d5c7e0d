"""Batch-invariant forward passes: a verify pass of k+1 tokens gives, bit for bit, the logits of k+1
single-token passes (issue 6; anchors "Why verify is expensive" 2).

    from mlx_engine.batch_invariant import make_batch_invariant
    model = make_batch_invariant(model)     # in place; returns the model

Why it is needed: with stock MLX the rows of an M-row pass are not computed by the same instruction
sequence as a 1-row pass, so near-tie argmaxes flip between verify and plain decode. Measured on this
machine (MLX 0.32.4, CPU; tests/test_batch_invariance.py checks the row-local claims and that the stock
quantized model is not invariant end to end):

  * fp32 `x @ W.T` (nn.Linear, tied `Embedding.as_linear`): NOT invariant. 1 row runs a gemv,
    several rows a gemm (OpenBLAS sgemm / MLX's own), which block K differently (rows differ from M = 5 on in our probes).
  * `mx.fast.scaled_dot_product_attention` with L queries + causal mask vs 1 query over the shorter
    cache: NOT invariant (L >= 4..5 differs in our probes; also the key count of each row differs, so any
    SIMD reduction over keys splits its tail differently).
  * `mx.quantized_matmul` (affine 4/8-bit): invariant on the CPU in our probes, but that is an
    implementation accident, not a contract, and on Metal it is NOT (qmv for 1 row, qmm / qmv_wide for
    several: anchors 1-2). We route it through `kernels.get("batch_qmm")`, invariant by construction.
  * Embedding gather, `mx.fast.rms_norm` (one row per reduction, independent of the row count), RoPE
    with an offset, elementwise activations, the residual adds: invariant (row-local, same instruction
    sequence per row). Nothing to patch.

What `make_batch_invariant` installs (parameters are untouched: every patched module keeps its arrays
and names; we swap the instance's class for a subclass, as target.py does):

  * `nn.QuantizedLinear` (affine) -> y = batch_qmm(x2d, w, scales, biases, gs, bits) (+ bias), with x
    reshaped [B, L, K] -> [B*L, K]. On Metal/CUDA that is the fused kernel (any M, launched in 16-row
    groups, every row bit-equal to its 1-row launch; tests/test_metal_emulator.py checks the kernel rows
    bit for bit). On the CPU reference, rows beyond `max_rows` (prefill) use `mx.quantized_matmul`: the
    reference materialises [M, N, K] products and is far too slow for a prompt, and the contract only
    covers verify-sized passes (<= max_rows rows).
  * `nn.QuantizedEmbedding.as_linear` (quantized tied lm_head): the same batch_qmm path.
  * `nn.Linear` (fp32/bf16, unquantized): for <= max_rows rows each row is its own 1-row matmul (the
    op sequence of single-token decode, so equal by construction). Cost: the weights are streamed once
    per row instead of once per pass (test_benchmark_fp32_row_split_cost, 2048x1024 fp32 on this shared
    2-core CPU: 5-9 rows 4.5-8.3 ms vs 1.9-2.2 ms stock, 2-4x; 1 row the same). `nn.Embedding.as_linear` (tied fp32 lm_head) likewise.
  * attention: the module-level `scaled_dot_product_attention` that mlx-lm's attention layers call is
    wrapped; while a patched model runs, attention is computed by `invariant_attention`: scores as a
    fixed pairwise tree over the head dimension, a masked softmax whose sum is a pairwise tree over the
    keys padded with zeros to a power of two (adding exact zeros leaves every partial sum unchanged, so a
    row with N keys and a masked row with N + extra keys give the same bits), and the value sum the same
    way. Unpatched models in the same process keep the stock path (the switch is a context variable set
    by the patched model's __call__).

NOT covered (documented, not patched): MoE `gather_qmm` / `gather_mm` (SwitchGLU: experts routed per
token; qwen3_next, deepseek), MLA's absorbed attention (deepseek_v3), quantized KV caches, the
GatedDeltaNet conv1d + recurrence (see mlx_engine.hybrid: it uses the per-token `gdn_step`, whose rows
are sequential by nature), non-affine quantization modes (mxfp4 / nvfp4 / mxfp8: left on
`mx.quantized_matmul`). On a GPU the Metal compiler may contract a*b+c into an FMA: the patched model
stays batch invariant (every row runs the same instructions) but can differ in the last bits from the
CPU reference.
"""

from __future__ import annotations

import contextvars
import sys

import mlx.core as mx
import mlx.nn as nn

from . import kernels

MAX_ROWS = 16  # rows per pass covered by the contract (verify passes are k+1 <= 16)

_active: contextvars.ContextVar[bool] = contextvars.ContextVar("mlx_engine_batch_invariant", default=False)


# ---------------------------------------------------------------------------------------------------
# fixed-order reductions


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def tree_sum(t: mx.array) -> mx.array:
    """Sum over the last axis as a pairwise tree, the axis zero-padded to a power of two.

    Extra zero padding leaves the result unchanged bit for bit (x + 0 == x), so summing n values, or
    the same n values followed by zeros, gives the same bits whatever the padded length."""
    n = t.shape[-1]
    p = _next_pow2(n)
    if p != n:
        t = mx.pad(t, [(0, 0)] * (t.ndim - 1) + [(0, p - n)])
    while t.shape[-1] > 1:
        t = t[..., 0::2] + t[..., 1::2]
    return t[..., 0]


def invariant_attention(queries, keys, values, scale: float, mask=None, sinks=None) -> mx.array:
    """Attention with the same op sequence for every query row, whatever L and the key count.

    queries [B, Hq, L, D], keys / values [B, Hk, N, D(v)]; mask None | "causal" | bool [.., L, N]
    (True = attend) | additive float. The causal mask aligns the L queries with the last L keys."""
    if sinks is not None:
        raise NotImplementedError("attention sinks are not supported on the batch-invariant path")
    B, Hq, L, D = queries.shape
    Hk, N = keys.shape[1], keys.shape[2]
    if Hq != Hk:
        rep = Hq // Hk
        keys = mx.repeat(keys, rep, axis=1)
        values = mx.repeat(values, rep, axis=1)
    dtype = queries.dtype
    q = queries.astype(mx.float32)
    k = keys.astype(mx.float32)
    v = values.astype(mx.float32)
    scores = tree_sum(q[:, :, :, None, :] * k[:, :, None, :, :]) * scale  # [B, H, L, N]
    allowed = None
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unknown mask {mask!r}")
        allowed = mx.arange(N)[None, :] <= (mx.arange(L) + (N - L))[:, None]
    elif mask is not None:
        if mask.dtype == mx.bool_:
            allowed = mask
        else:
            scores = scores + mask.astype(mx.float32)
    if allowed is not None:
        scores = mx.where(allowed, scores, -mx.inf)
    m = mx.max(scores, axis=-1, keepdims=True)  # max is exact in any order
    e = mx.exp(scores - m)  # masked keys: exp(-inf) = +0, and they add nothing to the trees below
    denom = tree_sum(e)[..., None]  # [B, H, L, 1]
    out = tree_sum((e[..., None] * v[:, :, None, :, :]).swapaxes(-1, -2))  # [B, H, L, Dv]
    return (out / denom).astype(dtype)


# ---------------------------------------------------------------------------------------------------
# module patches (class swaps; parameters untouched)


def _rows_2d(x: mx.array) -> mx.array:
    return x.reshape(-1, x.shape[-1])


def _qmm(x: mx.array, w, scales, biases, group_size: int, bits: int, max_rows: int) -> mx.array:
    x2 = _rows_2d(x)
    if x2.shape[0] <= max_rows or kernels.backend("batch_qmm") != "reference":
        y = kernels.get("batch_qmm")(x2, w, scales, biases, group_size, bits)
    else:  # prompt-sized pass on the CPU reference: outside the contract, use the fast path
        y = mx.quantized_matmul(x2, w, scales, biases, transpose=True, group_size=group_size, bits=bits)
    return y.reshape(*x.shape[:-1], w.shape[0])


def _matmul_t(x: mx.array, weight: mx.array, max_rows: int, bias=None) -> mx.array:
    """x @ weight.T (+ bias): one 1-row matmul per row up to max_rows rows."""
    x2 = _rows_2d(x)
    M = x2.shape[0]
    wt = weight.T
    one = (lambda r: mx.addmm(bias, r, wt)) if bias is not None else (lambda r: r @ wt)
    if M <= max_rows:
        y = one(x2) if M == 1 else mx.concatenate([one(x2[i : i + 1]) for i in range(M)], axis=0)
    else:
        y = one(x2)
    return y.reshape(*x.shape[:-1], weight.shape[0])


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


def _swap(module: nn.Module, base: type, patched: type, max_rows: int) -> None:
    cls = type(module)
    if getattr(cls, "_mlx_engine_batch_invariant", False):
        object.__setattr__(module, "_bi_rows", max_rows)
        return
    if cls is base:
        module.__class__ = patched
    else:  # a subclass of the base: keep its own methods, put ours first
        module.__class__ = type(cls.__name__, (patched, cls), {})
    object.__setattr__(module, "_bi_rows", max_rows)  # not a parameter


def _wrap_attention_module(modname: str) -> None:
    mod = sys.modules.get(modname)
    if mod is None:
        return
    original = getattr(mod, "scaled_dot_product_attention", None)
    if original is None or getattr(original, "_mlx_engine_batch_invariant", False):
        return

    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None, **kw):
        if _active.get() and not hasattr(cache, "bits") and not kw:
            return invariant_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
        if sinks is not None:
            kw["sinks"] = sinks
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, **kw)

    scaled_dot_product_attention._mlx_engine_batch_invariant = True
    scaled_dot_product_attention.original = original
    mod.scaled_dot_product_attention = scaled_dot_product_attention


def _install_switch(model: nn.Module) -> None:
    cls = type(model)
    if getattr(cls, "_mlx_engine_bi_switch", False):
        return

    def __call__(self, *args, **kwargs):
        token = _active.set(True)
        try:
            return cls.__call__(self, *args, **kwargs)
        finally:
            _active.reset(token)

    model.__class__ = type(cls.__name__, (cls,), {"__call__": __call__, "_mlx_engine_bi_switch": True})


def make_batch_invariant(model: nn.Module, max_rows: int = MAX_ROWS, linear: bool = True) -> nn.Module:
    """Patch `model` in place (see the module docstring) and return it.

    max_rows: passes of up to this many rows per matmul are covered by the contract.
    linear: also patch unquantized nn.Linear / tied nn.Embedding (row-by-row 1-row matmuls)."""
    modules = set()
    for _, m in model.named_modules():
        modules.add(type(m).__module__)
        if isinstance(m, nn.QuantizedLinear) and _invariant_quantized(m):
            _swap(m, nn.QuantizedLinear, _QLinear, max_rows)
        elif isinstance(m, nn.QuantizedEmbedding) and _invariant_quantized(m):
            _swap(m, nn.QuantizedEmbedding, _QEmbedding, max_rows)
        elif linear and type(m) is nn.Linear or isinstance(m, _Linear):
            _swap(m, nn.Linear, _Linear, max_rows)
        elif linear and type(m) is nn.Embedding or isinstance(m, _Embedding):
            _swap(m, nn.Embedding, _Embedding, max_rows)
    for name in modules:
        if name.startswith("mlx_lm.models."):
            _wrap_attention_module(name)
    _install_switch(model)
    return model


def is_batch_invariant(model: nn.Module) -> bool:
    return bool(getattr(type(model), "_mlx_engine_bi_switch", False))
