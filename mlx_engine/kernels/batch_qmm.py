"""Small-batch quantized matmul for verify, batch invariant: every row gets bit-for-bit the result it
would get alone.

Shapes: x [M, K] (any leading dims are flattened; M = 1..16 rows per launch, more are split into
launches of 16), w [N, K*bits/32] uint32, scales / biases [N, K/group_size] as returned by
`mx.quantize(W, group_size, bits)` (MLX affine quantization, bits 4 or 8, group size 32/64/128).
Output y [M, N] in x's dtype:  y = x @ dequantize(w, scales, biases).T, with
    dequantize(w)[n, j] = scales[n, j // gs] * q[n, j] + biases[n, j // gs],
    q[n, j] = (w[n, j // (32/bits)] >> (bits * (j % (32/bits)))) & (2**bits - 1).

Why: `mx.quantized_matmul` picks different kernels (and reduction orders) for 1 row and for several,
so a verify pass of k+1 rows can flip near-tie argmaxes against single-token decode and re-reads the
weights per row (anchors: "Why verify is expensive" 1 and 2). Here one SIMD group reads each weight
word once for all M rows, and the reduction order per row is fixed and independent of M:

  * K is cut in chunks of 8 values; chunk c (values 8c..8c+7, group g = 8c // gs) belongs to lane
    c % 32 at step c // 32;
  * per chunk: xs = ((x0+x1)+(x2+x3))+((x4+x5)+(x6+x7)) and dq = the same tree over x_i*q_i,
    v_c = scale_g*dq + bias_g*xs   (= sum_i x_i * (scale_g*q_i + bias_g) regrouped);
  * lane accumulator acc_l = (((0 + v_l) + v_{32+l}) + v_{64+l}) + ...   (steps in order);
  * y = pairwise tree over the 32 lane accumulators in lane order (a shuffle_xor 1,2,4,8,16 butterfly).

`qmm_reference` computes exactly this order with elementwise MLX ops (no reductions whose order MLX
chooses), so it is batch invariant by construction and, on a machine without FMA contraction, bit-equal
to the kernel (the Metal emulator checks this). On a GPU the Metal compiler may contract a*b+c into an
FMA: the kernel stays batch invariant (every row runs the same instructions) but may differ from the
reference in the last bits. The reference materialises [M, tile, K] products: it is the definition of
correct, not a fast CPU path (on CPU use fp32 weights or mx.quantized_matmul).
"""

from __future__ import annotations


import mlx.core as mx

from . import Launch, Op, build_kernel

NAME = "batch_qmm"
INPUT_NAMES = ("x", "w", "scales", "biases")
OUTPUT_NAMES = ("y",)
MAX_ROWS = 16
VALUES_PER_LANE = 8
LANES = 32
STEP = VALUES_PER_LANE * LANES  # values of K one SIMD group covers per step
COLS_PER_SIMDGROUP = 4
SIMDGROUPS = 2
_TILE_ELEMS = 1 << 22  # products materialised at once by the reference


def _check(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int):
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    if group_size not in (32, 64, 128):
        raise ValueError(f"group_size must be 32, 64 or 128, got {group_size}")
    K = x.shape[-1]
    N = w.shape[0]
    if K % group_size:
        raise ValueError(f"K={K} is not a multiple of group_size={group_size}")
    if w.shape != (N, K * bits // 32) or w.dtype != mx.uint32:
        raise ValueError(f"w must be uint32 [N, K*bits/32] = [{N}, {K * bits // 32}], got {w.dtype} {w.shape}")
    if scales.shape != (N, K // group_size) or biases.shape != scales.shape:
        raise ValueError(f"scales/biases must be [{N}, {K // group_size}], got {scales.shape}, {biases.shape}")


def unpack(w: mx.array, bits: int) -> mx.array:
    """uint32 [N, K*bits/32] -> the integer codes q as float32 [N, K]."""
    per = 32 // bits
    shifts = mx.arange(per, dtype=mx.uint32) * bits
    q = (w[..., None] >> shifts) & ((1 << bits) - 1)
    return q.reshape(w.shape[0], -1).astype(mx.float32)


def _pairwise(t: mx.array) -> mx.array:
    """Pairwise tree over the last axis (a power of two): ((t0+t1)+(t2+t3))+... as elementwise adds."""
    while t.shape[-1] > 1:
        t = t[..., 0::2] + t[..., 1::2]
    return t[..., 0]


def qmm_reference(
    x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int = 64, bits: int = 4
) -> mx.array:
    """y = x @ dequantize(w).T in the fixed order of the module docstring. [..., K] -> [..., N]."""
    _check(x, w, scales, biases, group_size, bits)
    lead = x.shape[:-1]
    K = x.shape[-1]
    N = w.shape[0]
    xf = x.reshape(-1, K).astype(mx.float32)
    M = xf.shape[0]
    Kp = -(-K // STEP) * STEP
    C = Kp // VALUES_PER_LANE  # chunks
    S = Kp // STEP  # steps
    q = unpack(w, bits)
    if Kp != K:
        xf = mx.pad(xf, [(0, 0), (0, Kp - K)])
        q = mx.pad(q, [(0, 0), (0, Kp - K)])
    group_of_chunk = mx.minimum(mx.arange(C) * VALUES_PER_LANE // group_size, K // group_size - 1)
    sc = mx.take(scales.astype(mx.float32), group_of_chunk, axis=1)  # [N, C]
    bi = mx.take(biases.astype(mx.float32), group_of_chunk, axis=1)
    xs = _pairwise(xf.reshape(M, C, VALUES_PER_LANE))  # [M, C]

    tile = max(1, min(N, _TILE_ELEMS // max(1, M * Kp)))
    outs = []
    for n0 in range(0, N, tile):
        n1 = min(N, n0 + tile)
        prods = xf[:, None, :] * q[None, n0:n1, :]  # [M, t, Kp]
        dq = _pairwise(prods.reshape(M, n1 - n0, C, VALUES_PER_LANE))  # [M, t, C]
        v = sc[None, n0:n1] * dq + bi[None, n0:n1] * xs[:, None, :]  # [M, t, C]
        v = v.reshape(M, n1 - n0, S, LANES)
        acc = mx.zeros((M, n1 - n0, LANES), mx.float32)
        for s in range(S):
            acc = acc + v[:, :, s, :]
        outs.append(_pairwise(acc))  # [M, t]
    y = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=1)
    return y.astype(x.dtype).reshape(*lead, N)


def launch_spec(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array,
    group_size: int = 64,
    bits: int = 4,
    cols_per_simdgroup: int = COLS_PER_SIMDGROUP,
    simdgroups: int = SIMDGROUPS,
) -> Launch:
    """One launch for x [M, K] with 1 <= M <= 16."""
    _check(x, w, scales, biases, group_size, bits)
    if x.ndim != 2 or not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"x must be [M, K] with 1 <= M <= {MAX_ROWS}, got {x.shape}")
    M = x.shape[0]
    N = w.shape[0]
    blocks = -(-N // cols_per_simdgroup)
    return Launch(
        inputs=[x, w, scales, biases],
        template=[
            ("T", x.dtype),
            ("M", M),
            ("BITS", bits),
            ("GS", group_size),
            ("R", cols_per_simdgroup),
        ],
        grid=(LANES, blocks, 1),
        threadgroup=(LANES, simdgroups, 1),
        output_shapes=[(M, N)],
        output_dtypes=[x.dtype],
    )


def _kernel(backend: str):
    return build_kernel(NAME, INPUT_NAMES, OUTPUT_NAMES, backend)


def _qmm_kernel(backend: str, x, w, scales, biases, group_size: int = 64, bits: int = 4) -> mx.array:
    lead = x.shape[:-1]
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    outs = []
    for m0 in range(0, x2.shape[0], MAX_ROWS):  # rows are independent: splitting keeps every bit
        spec = launch_spec(x2[m0 : m0 + MAX_ROWS], w, scales, biases, group_size, bits)
        outs.append(_kernel(backend)(**spec.kwargs())[0])
    y = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)
    return y.reshape(*lead, w.shape[0])


def qmm_metal(x, w, scales, biases, group_size: int = 64, bits: int = 4) -> mx.array:
    return _qmm_kernel("metal", x, w, scales, biases, group_size, bits)


def qmm_cuda(x, w, scales, biases, group_size: int = 64, bits: int = 4) -> mx.array:
    return _qmm_kernel("cuda", x, w, scales, biases, group_size, bits)


def make_case(M: int, K: int, N: int, group_size: int, bits: int, seed: int, dtype=mx.float32):
    """Random (x, w, scales, biases, group_size, bits) for tests and probes."""
    kx, kw = mx.random.split(mx.random.key(seed))
    W = mx.random.normal((N, K), key=kw).astype(dtype) * 0.05
    w, scales, biases = mx.quantize(W, group_size=group_size, bits=bits)
    x = mx.random.normal((M, K), key=kx).astype(dtype)
    return x, w, scales, biases, group_size, bits


def probe_cases() -> list[tuple]:
    return [
        make_case(5, 512, 40, 64, 4, seed=1),
        make_case(3, 320, 12, 32, 8, seed=2),
        make_case(16, 256, 9, 128, 4, seed=3),
    ]


def probe_check(out: mx.array, ref: mx.array, args: tuple, fn=None) -> str | None:
    """Close to the reference, and batch invariant bit for bit (each row alone == row of the batch)."""
    if out.shape != ref.shape:
        return f"shape {out.shape} != {ref.shape}"
    if not mx.allclose(out.astype(mx.float32), ref.astype(mx.float32), rtol=1e-4, atol=1e-4).item():
        err = mx.abs(out.astype(mx.float32) - ref.astype(mx.float32)).max().item()
        return f"max abs difference {err:.3g} from the reference"
    x, w, scales, biases, gs, bits = args
    if fn is None:
        return None
    for i in (0, x.shape[0] - 1):
        alone = fn(x[i : i + 1], w, scales, biases, gs, bits)
        if not mx.array_equal(alone[0], out[i]).item():
            return f"row {i} alone differs from row {i} of the batch (not batch invariant)"
    return None


OP = Op(
    name=NAME,
    reference=qmm_reference,
    impls={"metal": qmm_metal, "cuda": qmm_cuda},
    probe=probe_cases,
    check=probe_check,
)
