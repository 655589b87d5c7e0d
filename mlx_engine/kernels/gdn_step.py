"""GatedDeltaNet recurrence over the T tokens of a verify pass, keeping the state after every token.

Shapes (as `mlx_lm.models.gated_delta.gated_delta_ops`): q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv];
g [B, T, Hv] (scalar gate per head) or [B, T, Hv, Dk] (vector gate); beta [B, T, Hv];
state [B, Hv, Dv, Dk] (float32; zeros if None). Hv is a multiple of Hk (grouped heads: value head h
reads key head h // (Hv/Hk)). Returns y [B, T, Hv, Dv] (q's dtype) and states [B, T, Hv, Dv, Dk]
(state's dtype), where states[:, t] is the state after token t, so states[:, -1] is what
gated_delta_ops returns and states[:, n] is the state to keep when a verify accepts n drafts
(no snapshot + replay; anchors "Why verify is expensive" 4).

Per token t, per (b, h), with S the [Dv, Dk] state:
    S     = S * g_t                      (g_t broadcast over Dv, and over Dk for a scalar gate)
    kv    = S k_t                        [Dv]
    delta = (v_t - kv) * beta_t          [Dv]
    S     = S + delta k_t^T
    y_t   = S q_t                        [Dv]
Callers normalise q/k as mlx-lm does (normalize_qk); no scale is applied here.

The fused kernel (metal_kernels/gdn_step.metal, .cu twin) is mlx-lm's generic one-SIMD-group-per-row
kernel with the per-token state stores added and its two Dk reductions written as an explicit xor
butterfly; it needs Dk % 32 == 0 (otherwise the reference runs). Its sums run in another order than
MLX's `.sum`, so it agrees with the reference to float32 rounding, not bit for bit.
"""

from __future__ import annotations


import mlx.core as mx

from . import Launch, Op, build_kernel

NAME = "gdn_step"
INPUT_NAMES = ("q", "k", "v", "g", "beta", "state_in")
OUTPUT_NAMES = ("y", "states")
ROWS_PER_THREADGROUP = 4


def gdn_step_reference(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array | None = None,
) -> tuple[mx.array, mx.array]:
    """Plain-MLX recurrence (the same ops as mlx-lm's _gated_delta_step_ops), stacking every state."""
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    if state is None:
        state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
    if Hv % Hk:
        raise ValueError(f"Hv={Hv} must be a multiple of Hk={Hk}")
    if (rep := Hv // Hk) > 1:
        q = mx.repeat(q, rep, -2)
        k = mx.repeat(k, rep, -2)
    ys, states = [], []
    for t in range(T):
        gt = g[:, t]
        decay = gt[..., None, None] if gt.ndim == 2 else gt[..., None, :]
        kt = k[:, t][..., None, :]  # [B, H, 1, Dk]
        state = state * decay
        kv_mem = (state * kt).sum(axis=-1)  # [B, H, Dv]
        delta = (v[:, t] - kv_mem) * beta[:, t][..., None]
        state = state + kt * delta[..., None]
        y = (state * q[:, t][..., None, :]).sum(axis=-1)
        ys.append(y.astype(q.dtype))
        states.append(state)
    return mx.stack(ys, axis=1), mx.stack(states, axis=1)


def launch_spec(q, k, v, g, beta, state=None) -> Launch:
    B, T, Hk, Dk = k.shape
    Hv, Dv = v.shape[-2:]
    if Dk % 32:
        raise ValueError(f"the kernel needs Dk % 32 == 0, got Dk={Dk}")
    if state is None:
        state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
    return Launch(
        inputs=[q, k, v, g, beta, state],
        template=[
            ("InT", q.dtype),
            ("StT", state.dtype),
            ("Dk", Dk),
            ("Dv", Dv),
            ("Hk", Hk),
            ("Hv", Hv),
            ("GVEC", g.ndim == 4),
        ],
        grid=(32, Dv, B * Hv),
        threadgroup=(32, ROWS_PER_THREADGROUP, 1),
        output_shapes=[(B, T, Hv, Dv), (B, T, Hv, Dv, Dk)],
        output_dtypes=[q.dtype, state.dtype],
    )


def _kernel(backend: str):
    return build_kernel(NAME, INPUT_NAMES, OUTPUT_NAMES, backend)


def _gdn_kernel(backend: str, q, k, v, g, beta, state=None):
    if k.shape[-1] % 32:
        return gdn_step_reference(q, k, v, g, beta, state)
    y, states = _kernel(backend)(**launch_spec(q, k, v, g, beta, state).kwargs())
    return y, states


def gdn_step_metal(q, k, v, g, beta, state=None):
    return _gdn_kernel("metal", q, k, v, g, beta, state)


def gdn_step_cuda(q, k, v, g, beta, state=None):
    return _gdn_kernel("cuda", q, k, v, g, beta, state)


def make_case(B, T, Hk, Hv, Dk, Dv, seed, vector_gate=False, dtype=mx.float32):
    """Random inputs shaped like a Qwen3-Next layer's (normalised q/k, g in (0, 1), beta in (0, 1))."""
    keys = mx.random.split(mx.random.key(seed), 6)
    q = mx.random.normal((B, T, Hk, Dk), key=keys[0])
    k = mx.random.normal((B, T, Hk, Dk), key=keys[1])
    q = (q / mx.linalg.norm(q, axis=-1, keepdims=True) * Dk**-0.5).astype(dtype)
    k = (k / mx.linalg.norm(k, axis=-1, keepdims=True)).astype(dtype)
    v = mx.random.normal((B, T, Hv, Dv), key=keys[2]).astype(dtype)
    gshape = (B, T, Hv, Dk) if vector_gate else (B, T, Hv)
    g = mx.random.uniform(0.5, 1.0, gshape, key=keys[3])
    beta = mx.random.uniform(0.0, 1.0, (B, T, Hv), key=keys[4]).astype(dtype)
    state = mx.random.normal((B, Hv, Dv, Dk), key=keys[5]) * 0.1
    return q, k, v, g, beta, state


def probe_cases() -> list[tuple]:
    return [
        make_case(1, 5, 2, 4, 64, 12, seed=1),
        make_case(2, 3, 1, 2, 32, 6, seed=2, vector_gate=True),
    ]


def probe_check(out, ref, args, fn=None) -> str | None:
    (y, states), (ry, rstates) = out, ref
    if y.shape != ry.shape or states.shape != rstates.shape:
        return f"shapes {y.shape}, {states.shape} != {ry.shape}, {rstates.shape}"
    for name, a, b in (("y", y, ry), ("states", states, rstates)):
        if not mx.allclose(a.astype(mx.float32), b.astype(mx.float32), rtol=1e-4, atol=1e-5).item():
            err = mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item()
            return f"{name}: max abs difference {err:.3g} from the reference"
    return None


OP = Op(
    name=NAME,
    reference=gdn_step_reference,
    impls={"metal": gdn_step_metal, "cuda": gdn_step_cuda},
    probe=probe_cases,
    check=probe_check,
)
