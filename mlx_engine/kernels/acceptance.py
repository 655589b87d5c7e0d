"""Fused acceptance: n_accepted and the next token of a verify step in one kernel.

Shapes: target [k+1, V] (processed logits when greedy, probabilities when sampling), draft_tokens [k]
int, draft_probs [k, V] or None (deterministic draft: greedy drafters, n-gram), uniforms [k] float32 in
[0, 1), sample_uniform a float32 scalar in [0, 1). Output: int32 [2] = (n_accepted, next_token); the
emitted tokens are draft_tokens[:n_accepted] followed by next_token.

Greedy (temperature 0):
    a_i = argmax_j target[i, j] (ties -> lowest j, as mx.argmax)
    n = max{m <= k : draft_i == a_i for all i < m},  next = a_n.
Sampling (Leviathan et al. / Chen et al.), with p = target and q = draft_probs (q = one-hot(x) if None):
    accept draft x_i iff u_i * q_i(x_i) < p_i(x_i)   (u_i < p/q without dividing);  n = first rejection
    r = max(0, p_n - q_n) if n < k (p_n with x_n set to 0 for a deterministic draft), r = p_k if n = k;
    if sum(r) == 0: r = p_n
    next = min{j : r_j > 0 and cdf_j > s * sum(r)} with cdf = cumsum(r), s = sample_uniform
           (inverse-CDF sampling; if rounding leaves no such j: the last j with r_j > 0; 0 if r == 0).
This is the math of `mlx_engine.core.verify.accept_greedy` / `accept_sampled`, with the random draws passed
in: given the same uniforms (`uniforms_from_key` is sampling.py's `random_draws`), n_accepted is identical,
and so is the next token but for rounding (both sample it by inverse CDF of `sample_uniform`).

The fused kernel (metal_kernels/acceptance.metal, .cu twin) runs one threadgroup of TG threads: greedy
rows are reduced only up to the first mismatch; sampling needs two passes over one row (chunk sums,
then the chunk holding the crossing). Floating-point sums differ from `mx.cumsum` in order only, so a
sampled token can differ from the reference only when s * sum(r) falls within rounding of a CDF step.
"""

from __future__ import annotations


import mlx.core as mx

from ..sampling import random_draws
from . import Launch, Op, build_kernel, cached_constant

NAME = "acceptance"
INPUT_NAMES = ("target", "draft", "qprobs", "uniforms")
OUTPUT_NAMES = ("out",)
DEFAULT_THREADS = 1024
THREAD_SIZES = (1024, 512, 256, 128)  # tried largest first on a GPU (see kernels.Op.sizes)


def _f32(x) -> mx.array:
    """float32 array without forcing evaluation of a lazy input."""
    return x.astype(mx.float32) if isinstance(x, mx.array) else mx.array(x, mx.float32)


def _accepted_prefix(accept: mx.array) -> mx.array:
    if accept.size == 0:
        return mx.array(0, mx.int32)
    return mx.cumprod(accept.astype(mx.int32)).sum().astype(mx.int32)


def accept_reference(
    logits_or_probs: mx.array,
    draft_tokens: mx.array,
    draft_probs: mx.array | None,
    uniforms: mx.array,
    sample_uniform: mx.array | float,
    greedy: bool,
) -> mx.array:
    """The definition of correct, in plain MLX ops (no host sync). Returns int32 [2] (n, next)."""
    k = draft_tokens.shape[0]
    V = logits_or_probs.shape[-1]
    draft = draft_tokens.astype(mx.int32)
    if greedy:
        best = mx.argmax(logits_or_probs, axis=-1).astype(mx.int32)
        n = _accepted_prefix(draft == best[:k])
        return mx.stack([n, mx.take(best, n)]).astype(mx.int32)

    p = logits_or_probs.astype(mx.float32)
    if k > 0:
        idx = draft[:, None]
        p_draft = mx.take_along_axis(p[:k], idx, axis=-1)[:, 0]
        if draft_probs is None:
            q_draft = mx.ones_like(p_draft)
            residual = mx.put_along_axis(p[:k], idx, mx.array(0.0, mx.float32), axis=-1)
        else:
            q = draft_probs.astype(mx.float32)
            q_draft = mx.take_along_axis(q, idx, axis=-1)[:, 0]
            residual = mx.maximum(p[:k] - q, 0.0)
        n = _accepted_prefix(uniforms.astype(mx.float32) * q_draft < p_draft)
        rows = mx.concatenate([residual, p[k:]], axis=0)
    else:
        n = mx.array(0, mx.int32)
        rows = p
    row = mx.take(rows, n, axis=0)
    row = mx.where(row.sum() > 0, row, mx.take(p, n, axis=0))
    mass = row.sum()
    positive = row > 0
    hit = positive & (mx.cumsum(row) > _f32(sample_uniform) * mass)
    first = mx.argmax(hit)
    last = (V - 1) - mx.argmax(positive[::-1])
    nxt = mx.where(hit.any(), first, mx.where(positive.any(), last, 0))
    return mx.stack([n, nxt.astype(mx.int32)]).astype(mx.int32)


# (uniforms [k], sample_uniform) from a key: exactly the draws `mlx_engine.core.verify.accept_sampled` uses
uniforms_from_key = random_draws


def launch_spec(
    logits_or_probs: mx.array,
    draft_tokens: mx.array,
    draft_probs: mx.array | None,
    uniforms: mx.array | None,
    sample_uniform: mx.array | float | None,
    greedy: bool,
    threads: int = DEFAULT_THREADS,
) -> Launch:
    if threads % 32 or not 32 <= threads <= 1024:
        raise ValueError(f"threads must be a multiple of 32 in [32, 1024], got {threads}")
    if logits_or_probs.ndim != 2:
        raise ValueError(f"target must be [k+1, V], got {logits_or_probs.shape}")
    k = draft_tokens.shape[0]
    if logits_or_probs.shape[0] != k + 1:
        raise ValueError(f"target has {logits_or_probs.shape[0]} rows for {k} draft tokens")
    draft = draft_tokens.astype(mx.int32)
    if k == 0:
        draft = cached_constant("acceptance no draft", lambda: mx.zeros((1,), mx.int32))
    has_q = draft_probs is not None and not greedy
    qprobs = draft_probs if has_q else cached_constant("acceptance no q", lambda: mx.zeros((1,), mx.float32))
    if greedy:
        u = cached_constant(("acceptance greedy u", k), lambda: mx.zeros((k + 1,), mx.float32))
    else:
        s = _f32(sample_uniform).reshape(1)
        u = mx.concatenate([uniforms.astype(mx.float32).reshape(k), s]) if k else s
    return Launch(
        inputs=[logits_or_probs, draft, qprobs, u],
        template=[("GREEDY", bool(greedy)), ("HAS_Q", bool(has_q)), ("TG", int(threads))],
        grid=(threads, 1, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[(2,)],
        output_dtypes=[mx.int32],
    )


def _kernel(backend: str):
    return build_kernel(NAME, INPUT_NAMES, OUTPUT_NAMES, backend)


def _accept_kernel(backend: str, threads: int):
    def accept(logits_or_probs, draft_tokens, draft_probs, uniforms, sample_uniform, greedy):
        spec = launch_spec(logits_or_probs, draft_tokens, draft_probs, uniforms, sample_uniform, greedy, threads)
        return _kernel(backend)(**spec.kwargs())[0]

    accept.__doc__ = f"Fused acceptance on {backend} (same signature as accept_reference)."
    return accept


def accept_metal(logits_or_probs, draft_tokens, draft_probs, uniforms, sample_uniform, greedy):
    return _accept_kernel("metal", DEFAULT_THREADS)(
        logits_or_probs, draft_tokens, draft_probs, uniforms, sample_uniform, greedy
    )


def accept_cuda(logits_or_probs, draft_tokens, draft_probs, uniforms, sample_uniform, greedy):
    return _accept_kernel("cuda", DEFAULT_THREADS)(
        logits_or_probs, draft_tokens, draft_probs, uniforms, sample_uniform, greedy
    )


def dyadic_probs(V: int, k1: int, seed: int) -> mx.array:
    """[k1, V] rows of multiples of 2**-12 (some exact zeros): every partial sum is exact in float32 in
    any order, so a kernel and the reference must pick exactly the same tokens."""
    j = mx.arange(V, dtype=mx.int32)[None, :]
    r = mx.arange(k1, dtype=mx.int32)[:, None]
    w = (j * 7919 + r * 104729 + seed * 15485863) % 9  # integers 0..8
    return w.astype(mx.float32) * (2.0**-12)


def probe_cases() -> list[tuple]:
    """Small deterministic inputs for the first-use check of a GPU kernel against the reference: the
    two must agree exactly (greedy is exact by nature; sampling uses dyadic probabilities)."""
    V, k = 1000, 3  # V not a multiple of the threadgroup size
    logits = mx.sin(mx.arange((k + 1) * V, dtype=mx.float32) * 0.37).reshape(k + 1, V)
    top = mx.max(logits, axis=-1, keepdims=True)
    tied = mx.where(mx.arange(V)[None, :] == V - 1, top, logits)  # a tie at the last index
    best = mx.argmax(logits, axis=-1).astype(mx.int32)
    draft_ok = best[:k]
    draft_bad = mx.concatenate([best[:1], (best[1:2] + 1) % V, best[2:3]])
    p = dyadic_probs(V, k + 1, 1)
    q = dyadic_probs(V, k, 2)
    d = mx.argmax(p[:k], axis=-1).astype(mx.int32)
    return [
        (tied, draft_ok, None, None, None, True),
        (logits, draft_bad, None, None, None, True),
        (logits[:1], mx.zeros((0,), mx.int32), None, None, None, True),
        (p, d, q, mx.array([0.01, 0.02, 0.99]), mx.array(0.3), False),
        (p, d, None, mx.array([0.001, 0.002, 0.003]), mx.array(0.7), False),
    ]


def probe_check(out: mx.array, ref: mx.array, args: tuple, fn=None) -> str | None:
    got, want = out.tolist(), ref.tolist()
    return None if got == want else f"(n, next) = {got}, reference {want}"


def sizes(backend: str) -> list:
    """The kernel at each threadgroup size, largest first: 1024 threads need at most 64 registers per
    thread on NVIDIA GPUs (65,536 per block) and fit within an Apple pipeline's limit only if it is not
    register-heavy; 256 always launches on CUDA (255 registers is the per-thread maximum)."""
    return [_accept_kernel(backend, t) for t in THREAD_SIZES]


OP = Op(
    name=NAME,
    reference=accept_reference,
    impls={"metal": accept_metal, "cuda": accept_cuda},
    probe=probe_cases,
    check=probe_check,
    sizes=sizes,
)
