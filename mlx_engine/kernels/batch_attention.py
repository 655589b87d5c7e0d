"""Attention for decode and verify, batch invariant: every query row is bit-for-bit what a 1-query pass
over the same keys gives, whatever the number of query rows and whatever lies past its keys.

Shapes: q [B, Hq, L, D], k [B, Hk, Nk, D], v [B, Hk, Nk, DV] (Hq a multiple of Hk: grouped-query
attention), optional qp [B, Hq, L, DP] / kp [B, Hk, Nk, DP] whose dot product is added to the score
(MLA's rope part), scale a float. causal: query i (of L) sees keys 0 .. Nk - L + i (the queries are the
last L positions); else every query sees all Nk keys. Output o [B, Hq, L, DV] in q's dtype:
    o[i] = sum_j softmax_j(scale * (q_i . k_j + qp_i . kp_j)) v_j   over the keys query i sees.
live (optional, <= L): only the first `live` queries are real, the rest pad a fixed-row pass
(target_model/fixed_rows.py): their rows are zeros and no key is read for them; a real query sees the same
keys as without `live` (causal: its position counts all L rows), so live changes no bit of its row.
lens (optional, B ints): sequence b has only the first lens[b] of the Nk keys (the rows of a batch cache,
target_model/batch_cache.py); its queries are the last L of those. Every row is then what a launch of that
sequence alone over k[b, :, :lens[b]] gives: one launch serves a batch of sequences of any lengths.
tree (optional, L ints): a token tree's verify pass (core/tree_verify.py): the L queries are the tree's
rows, and query i sees the Nk - L keys before them and, of the last L keys, those whose bits tree[i] sets
(bit t: key Nk - L + t; its ancestors and itself, which come before it). Its visible keys in order are the
keys a plain decode step at its position sees (the cache, then its path), and the row is bit for bit that
step's 1-query launch over them.

Why: stock attention splits the keys of a query over threads in a way that depends on the number of
queries and keys in the launch, so verify rows differ in the last bits from single-token decode.
The kernels (metal_kernels/batch_attention.metal, .cu) fix the order per query (see the .metal file):
SIMD group g of SG takes keys g, g+SG, ... in order with an online softmax; lanes split the head
dimension (fma chains, then a xor butterfly); the SG partials merge in group order. That depends only
on the query's own keys. They read k and v through their strides, so the KV cache is never copied.

`attention_reference` is the CPU definition: scores as a fixed pairwise tree over the head dimension,
a masked softmax whose sums are pairwise trees over the keys zero-padded to a power of two (adding
exact zeros leaves every partial sum unchanged, so a query with n keys gives the same bits in any
launch), built from elementwise MLX ops. It is batch invariant by construction and agrees with the
kernels to float rounding (they order the sums differently).
"""

from __future__ import annotations

import mlx.core as mx

from . import Launch, Op, build_kernel, cached_constant, differs_from_reference

NAME = "batch_attention"
INPUT_NAMES = ("q", "k", "v", "qp", "kp", "scale", "live", "lens", "tree")
OUTPUT_NAMES = ("out",)
CONTIGUOUS = False  # k and v are KV-cache views: read through their strides, never copied
KEYS_PER_ITER = 8  # keys a SIMD group scores at once (independent butterflies in flight; changes no bit)
MAX_ROWS = 16
_PARTIALS_BYTES = 16 * 1024  # threadgroup memory for the SG partial outputs: SG * DV floats


def warps_for(dv: int) -> int:
    """SIMD groups per query: part of the order contract, so a function of the value width only (never of
    L or Nk). 16 where their partials fit in 16 KiB (DV <= 256; Apple GPUs allow 32 KiB of threadgroup
    memory), else 8 (MLA's DV = 512). H100 sweep (scripts/gpu/verify_speed.py, 32/8 heads of 128, bf16):
    16 groups x 8 keys in flight was the best over 512 and 4096 keys and 1, 4, 8 queries (38 us at one
    query over 512 keys against 39-62 for 8 groups; stock 17.5)."""
    return max(8, min(16, _PARTIALS_BYTES // (4 * dv)))


WARPS = warps_for(128)  # the common head size's count, for callers that print it


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


def _expand_heads(t: mx.array, hq: int) -> mx.array:
    return t if t.shape[1] == hq else mx.repeat(t, hq // t.shape[1], axis=1)


def attention_reference(q, k, v, scale: float, causal: bool = True, qp=None, kp=None, mask=None, live=None,
                        lens=None, tree=None) -> mx.array:
    """The batch-invariant attention of the module docstring in elementwise MLX ops.

    mask (optional, instead of `causal`): bool [.., L, Nk] (True = attend), additive float, or the
    strings mlx-lm passes ("causal"; None = every key); masked keys keep their place in the sums, so a
    mask that is not a prefix of the keys is not batch invariant: trees take `tree`. live, lens, tree: see
    the module docstring."""
    if isinstance(mask, str):
        causal, mask = mask == "causal", None
    if tree is not None:  # each row over its visible keys, gathered in order: the definition
        return _tree_rows(q, k, v, scale, qp, kp, lens, live, tree)
    if lens is not None:  # each sequence alone over its own keys (padding is exact, so this is the definition)
        one = lambda t, b, n=None: None if t is None else t[b : b + 1, :, :n]  # noqa: E731
        return mx.concatenate([
            attention_reference(q[b : b + 1], k[b : b + 1, :, :n], v[b : b + 1, :, :n], scale, causal, one(qp, b),
                                one(kp, b, n), None if mask is None else mask[b : b + 1, ..., :n], live)
            for b, n in enumerate(_key_counts(lens, k.shape[2]))], axis=0)
    if live is not None and live < q.shape[2]:
        return _live_rows(attention_reference, q, k, v, scale, causal, qp, kp, mask, live)
    B, Hq, L, D = q.shape
    N = k.shape[2]
    dtype = q.dtype
    f32 = lambda t: t.astype(mx.float32)  # noqa: E731
    kf, vf = f32(_expand_heads(k, Hq)), f32(_expand_heads(v, Hq))
    scores = tree_sum(f32(q)[:, :, :, None, :] * kf[:, :, None, :, :])  # [B, H, L, N]
    if qp is not None:
        kpf = f32(_expand_heads(kp, Hq))
        scores = scores + tree_sum(f32(qp)[:, :, :, None, :] * kpf[:, :, None, :, :])
    scores = scores * scale
    allowed = None
    if causal and mask is None:
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
    out = tree_sum((e[..., None] * vf[:, :, None, :, :]).swapaxes(-1, -2))  # [B, H, L, Dv]
    return (out / denom).astype(dtype)


def _live_rows(fn, q, k, v, scale, causal, qp, kp, mask, live: int) -> mx.array:
    """fn over the first `live` queries (causal: the keys they see; pad keys dropped), zero rows after."""
    L = q.shape[2]
    n = k.shape[2] - (L - live) if causal and mask is None else k.shape[2]
    cut = lambda t, r: None if t is None else t[:, :, :r]  # noqa: E731
    m = mask[..., :live, :n] if isinstance(mask, mx.array) else mask
    out = fn(q[:, :, :live], k[:, :, :n], v[:, :, :n], scale, causal, cut(qp, live), cut(kp, n), m)
    return mx.pad(out, [(0, 0), (0, 0), (0, L - live), (0, 0)])


def tree_bits(ancestors) -> list[int]:
    """The `tree` argument from a tree's [L, L] ancestor matrix (row r sees row c; row 0 the root)."""
    return [sum(1 << c for c, seen in enumerate(row) if seen) for row in ancestors]


def _visible(bits: int, L: int) -> list[int]:
    return [t for t in range(L) if (bits >> t) & 1]


def _tree_rows(q, k, v, scale, qp, kp, lens, live, tree) -> mx.array:
    B, _, L, _ = q.shape
    tree = [int(t) for t in (tree.tolist() if isinstance(tree, mx.array) else tree)]
    counts = _key_counts(lens, k.shape[2]) if lens is not None else [k.shape[2]] * B
    seqs = []
    for b, nk in enumerate(counts):
        rows = []
        for i in range(L):
            if live is not None and i >= live:
                rows.append(mx.zeros(q[b : b + 1, :, i : i + 1, :1].shape[:3] + (v.shape[-1],), q.dtype))
                continue
            idx = mx.array(list(range(nk - L)) + [nk - L + t for t in _visible(tree[i], L)], dtype=mx.int32)
            take = lambda t: None if t is None else mx.take(t[b : b + 1], idx, axis=2)  # noqa: E731
            rows.append(attention_reference(q[b : b + 1, :, i : i + 1], take(k), take(v), scale, True,
                                            None if qp is None else qp[b : b + 1, :, i : i + 1], take(kp)))
        seqs.append(mx.concatenate(rows, axis=2))
    return mx.concatenate(seqs, axis=0)


def _key_counts(lens, nk: int) -> list[int]:
    return [int(n) if int(n) > 0 else nk for n in lens]


def supported(q: mx.array, k: mx.array, v: mx.array, qp=None) -> bool:
    """Shapes the kernels take: head dims multiples of 32, Hq a multiple of Hk, at most 16 queries."""
    dims = [q.shape[-1], v.shape[-1]] + ([qp.shape[-1]] if qp is not None else [])
    return (
        q.ndim == 4
        and all(d % 32 == 0 and d <= 1024 for d in dims)
        and q.shape[1] % k.shape[1] == 0
        and 1 <= q.shape[2] <= MAX_ROWS
        and q.dtype in (mx.float32, mx.float16, mx.bfloat16)
    )


def launch_spec(
    q, k, v, scale: float, causal: bool = True, qp=None, kp=None, warps=None, keys=KEYS_PER_ITER, live=None,
    lens=None, tree=None,
) -> Launch:
    if not supported(q, k, v, qp):
        raise ValueError(f"unsupported attention shapes q {q.shape}, k {k.shape}, v {v.shape}")
    B, Hq, L, D = q.shape
    live = L if live is None else live
    if not 1 <= live <= L:
        raise ValueError(f"live = {live} real queries of {L}")
    if lens is not None and len(lens) != B:
        raise ValueError(f"{len(lens)} key counts for {B} sequences")
    for n in _key_counts(lens, k.shape[2]) if lens is not None else [k.shape[2]]:
        if n > k.shape[2] or (causal and L > n):
            raise ValueError(f"{L} {'causal ' if causal else ''}queries over {n} of {k.shape[2]} keys")
    if tree is not None and not isinstance(tree, mx.array):
        if len(tree) != L:
            raise ValueError(f"{len(tree)} tree rows for {L} queries")
        for i, bits in enumerate(tree):  # a query sees itself and rows before it only (parents come first)
            if not (bits >> i) & 1 or bits >> (i + 1):
                raise ValueError(f"tree row {i} sees {_visible(bits, 32)}: it must see itself and only earlier rows")
    DV = v.shape[-1]
    warps = warps or warps_for(DV)
    dp = 0 if qp is None else qp.shape[-1]
    if qp is None:
        qp = kp = cached_constant(("attention zeros", q.dtype), lambda: mx.zeros((1, 1, 1, 1), q.dtype))
    return Launch(
        inputs=[
            q, k, v, qp, kp, cached_constant(("attention scale", float(scale)), lambda: mx.array([scale], mx.float32)),
            cached_constant(("attention live", live), lambda: mx.array([live], mx.int32)),  # an input: one compile
            cached_constant(("attention all keys", B), lambda: mx.zeros((B,), mx.int32)) if lens is None
            else mx.array(list(lens), mx.int32),
            cached_constant(("attention no tree",), lambda: mx.zeros((1,), mx.int32)) if tree is None
            else (tree.astype(mx.int32) if isinstance(tree, mx.array) else mx.array(list(tree), mx.int32)),
        ],
        template=[
            ("T", q.dtype), ("D", D), ("DV", DV), ("DP", dp), ("CAUSAL", bool(causal) or tree is not None),
            ("TREE", tree is not None), ("SG", warps), ("KB", keys),
        ],
        grid=(32 * warps, L, B * Hq),
        threadgroup=(32 * warps, 1, 1),
        output_shapes=[(B, Hq, L, DV)],
        output_dtypes=[q.dtype],
    )


def _kernel(backend: str):
    return build_kernel(NAME, INPUT_NAMES, OUTPUT_NAMES, backend, contiguous=CONTIGUOUS)


def _attention_kernel(backend: str, q, k, v, scale: float, causal: bool = True, qp=None, kp=None, mask=None, live=None,
                      lens=None, tree=None):
    if mask is not None:
        raise ValueError("the attention kernels take causal, tree or no masks; array masks go to the reference")
    return _kernel(backend)(**launch_spec(q, k, v, scale, causal, qp, kp, live=live, lens=lens, tree=tree).kwargs())[0]


def attention_metal(q, k, v, scale: float, causal: bool = True, qp=None, kp=None, mask=None, live=None,
                    lens=None, tree=None) -> mx.array:
    return _attention_kernel("metal", q, k, v, scale, causal, qp, kp, mask, live, lens, tree)


def attention_cuda(q, k, v, scale: float, causal: bool = True, qp=None, kp=None, mask=None, live=None,
                   lens=None, tree=None) -> mx.array:
    return _attention_kernel("cuda", q, k, v, scale, causal, qp, kp, mask, live, lens, tree)


def make_case(B, Hq, Hk, L, N, D, DV=None, DP=0, seed=0, dtype=mx.float32):
    """Random (q, k, v, scale, causal, qp, kp) for tests and probes (k / v are views of a longer cache)."""
    DV = DV or D
    ks = mx.random.split(mx.random.key(seed), 5)
    q = mx.random.normal((B, Hq, L, D), key=ks[0]).astype(dtype)
    kc = mx.random.normal((B, Hk, N + 7, D), key=ks[1]).astype(dtype)
    vc = mx.random.normal((B, Hk, N + 7, DV), key=ks[2]).astype(dtype)
    qp = kp = None
    if DP:
        qp = mx.random.normal((B, Hq, L, DP), key=ks[3]).astype(dtype)
        kp = mx.random.normal((B, Hk, N + 7, DP), key=ks[4]).astype(dtype)[:, :, :N]
    return q, kc[:, :, :N], vc[:, :, :N], (D + DP) ** -0.5, True, qp, kp


def probe_cases() -> list[tuple]:
    return [
        make_case(1, 4, 2, 5, 37, 64, seed=1),
        make_case(1, 2, 1, 1, 9, 32, 64, DP=32, seed=2),
        make_case(2, 4, 4, 3, 70, 128, seed=3, dtype=mx.bfloat16),
    ]


def _row_alone(fn, args: tuple, i: int):
    """Query i of an L-query causal launch, launched alone over the keys it sees."""
    q, k, v, scale, causal, qp, kp = args
    L, N = q.shape[2], k.shape[2]
    n = N - L + i + 1 if causal else N
    qp_i = qp[:, :, i : i + 1] if qp is not None else None
    kp_i = kp[:, :, :n] if kp is not None else None
    return fn(q[:, :, i : i + 1], k[:, :, :n], v[:, :, :n], scale, causal, qp_i, kp_i)


def probe_check(out: mx.array, ref: mx.array, args: tuple, fn=None) -> str | None:
    """Close to the reference, and each query row bit-for-bit its 1-query launch."""
    problem = differs_from_reference(out, ref)
    if problem:
        return problem
    if fn is None:
        return None
    L = args[0].shape[2]
    for i in (0, L - 1):
        if not mx.array_equal(_row_alone(fn, args, i)[:, :, 0], out[:, :, i]).item():
            return f"query {i} alone differs from query {i} of the launch (not batch invariant)"
    return None


OP = Op(
    name=NAME,
    reference=attention_reference,
    impls={"metal": attention_metal, "cuda": attention_cuda},
    probe=probe_cases,
    check=probe_check,
)
