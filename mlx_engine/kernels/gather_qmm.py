"""MoE expert matmul for decode and verify, batch invariant, each expert's weights read once for all rows
routed to it.

Shapes: x [X, K] (float32 / float16 / bfloat16), w [E, N, K*bits/32] uint32, scales / biases
[E, N, K/group_size] (MLX affine 4/8-bit, as `QuantizedSwitchLinear` holds them), idx [P] the expert of
pair p, which reads x row p // xdiv (xdiv = experts per token when x holds one row per token, 1 when
x holds one row per pair). Output y [P, N]:  y[p] = x[p // xdiv] @ dequantize(w[idx[p]]).T.
Precondition: a token's experts are distinct (as a top-k routing gives), so at most `tokens` <= 16
pairs share an expert (tokens defaults to the rows of x when xdiv > 1, else to P).

Why: `mx.gather_qmm` runs one matrix-vector pass per pair (gather_qmv), so a verify pass of k+1 tokens
reads an expert's weights once per token routed to it, and its row order (it sorts pairs from 64 on)
makes verify rows differ from single-token decode. Here the kernel of batch_qmm.py runs in its gather
form: threadgroup z = p takes the expert of pair p if p is that expert's first pair, reads its weights
once and applies them to every pair routed to it (in increasing order), with exactly the per-row
arithmetic of the dense form. So each pair's row is bit-for-bit what the 1-token (decode) launch gives.

`gather_reference` is batch_qmm's reference order with one weight per pair (the CPU path).
"""

from __future__ import annotations

import mlx.core as mx

from . import Launch, Op, differs_from_reference
from .batch_qmm import LANES, MAX_ROWS, _check, kernel, make_case, plan, reference_core, row_bound, unpack

NAME = "gather_qmm"


def _check_gather(x, w, scales, biases, idx, group_size, bits, xdiv):
    if w.ndim != 3:
        raise ValueError(f"w must be [E, N, K*bits/32], got {w.shape}")
    _check(x, w, scales, biases, group_size, bits)
    if idx.ndim != 1 or x.ndim != 2 or idx.shape[0] != x.shape[0] * xdiv:
        raise ValueError(f"idx [P] with P = rows of x [X, K] * xdiv = {x.shape[0]} * {xdiv}, got {idx.shape}")


def gather_reference(x, w, scales, biases, idx, group_size=64, bits=4, xdiv=1, tokens=None) -> mx.array:
    """y[p] = x[p // xdiv] @ dequantize(w[idx[p]]).T in batch_qmm's order. -> [P, N] in x's dtype."""
    _check_gather(x, w, scales, biases, idx, group_size, bits, xdiv)
    idx = idx.astype(mx.uint32)
    xf = mx.repeat(x.astype(mx.float32), xdiv, axis=0) if xdiv > 1 else x.astype(mx.float32)
    y = reference_core(xf, unpack(w[idx], bits), scales[idx], biases[idx])
    return y.astype(x.dtype)


def launch_spec(x, w, scales, biases, idx, group_size=64, bits=4, xdiv=1, tokens=None) -> Launch:
    _check_gather(x, w, scales, biases, idx, group_size, bits, xdiv)
    tokens = tokens or (x.shape[0] if xdiv > 1 else idx.shape[0])  # bounds the pairs of one expert
    if tokens > MAX_ROWS:
        raise ValueError(f"at most {MAX_ROWS} tokens per launch, got {tokens}")
    N = w.shape[1]
    r, sg = plan(N, x.shape[1], tokens)
    return Launch(
        inputs=[x, w, scales, biases, idx.astype(mx.uint32)],
        template=[
            ("T", x.dtype), ("BITS", bits), ("GS", group_size), ("R", r), ("GATHER", True), ("XDIV", xdiv),
            ("MB", row_bound(tokens)), ("PF", True),
        ],
        grid=(LANES, -(-N // r), idx.shape[0]),
        threadgroup=(LANES, sg, 1),
        output_shapes=[(idx.shape[0], N)],
        output_dtypes=[x.dtype],
    )


def _gather_kernel(backend, x, w, scales, biases, idx, group_size=64, bits=4, xdiv=1, tokens=None) -> mx.array:
    spec = launch_spec(x, w, scales, biases, idx, group_size, bits, xdiv, tokens)
    return kernel(backend)(**spec.kwargs())[0]


def gather_metal(x, w, scales, biases, idx, group_size=64, bits=4, xdiv=1, tokens=None) -> mx.array:
    return _gather_kernel("metal", x, w, scales, biases, idx, group_size, bits, xdiv, tokens)


def gather_cuda(x, w, scales, biases, idx, group_size=64, bits=4, xdiv=1, tokens=None) -> mx.array:
    return _gather_kernel("cuda", x, w, scales, biases, idx, group_size, bits, xdiv, tokens)


def make_gather_case(tokens, topk, E, K, N, group_size, bits, seed, dtype=mx.float32, per_pair=False):
    """Random (x, w, scales, biases, idx, gs, bits, xdiv): distinct experts per token, shared across tokens."""
    x, w, s, b, gs, bits = make_case(tokens * (topk if per_pair else 1), K, N * E, group_size, bits, seed, dtype)
    w, s, b = w.reshape(E, N, -1), s.reshape(E, N, -1), b.reshape(E, N, -1)
    keys = mx.random.split(mx.random.key(seed + 1), tokens)
    # a few popular experts, so rows share experts as real routings do
    pool = max(topk, min(E, topk + tokens))
    idx = mx.concatenate([mx.random.permutation(pool, key=k)[:topk] for k in keys]).astype(mx.uint32)
    return x, w, s, b, idx, gs, bits, 1 if per_pair else topk, tokens


def probe_cases() -> list[tuple]:
    return [
        make_gather_case(5, 2, 6, 256, 24, 64, 4, seed=1),
        make_gather_case(3, 3, 5, 320, 12, 32, 8, seed=2, per_pair=True),
        make_gather_case(4, 2, 4, 256, 40, 64, 4, seed=3, dtype=mx.bfloat16),
    ]


def probe_check(out: mx.array, ref: mx.array, args: tuple, fn=None) -> str | None:
    """Close to the reference, and each token's pairs bit-for-bit what its 1-token launch gives."""
    problem = differs_from_reference(out, ref)
    if problem:
        return problem
    if fn is None:
        return None
    x, w, s, b, idx, gs, bits, xdiv, tokens = args
    topk = idx.shape[0] // tokens
    for t in (0, tokens - 1):
        pairs = slice(t * topk, (t + 1) * topk)
        xt = x[t : t + 1] if xdiv > 1 else x[pairs]
        alone = fn(xt, w, s, b, idx[pairs], gs, bits, xdiv, 1)
        if not mx.array_equal(alone, out[pairs]).item():
            return f"token {t} alone differs from token {t} of the launch (not batch invariant)"
    return None


OP = Op(
    name=NAME,
    reference=gather_reference,
    impls={"metal": gather_metal, "cuda": gather_cuda},
    probe=probe_cases,
    check=probe_check,
)
