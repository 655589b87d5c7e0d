// GatedDeltaNet recurrence over T verify tokens, returning the state after EVERY token.
// (Body for mx.fast.metal_kernel; wrapper, reference and math: mlx_engine/kernels/gdn_step.py.)
//
// inputs:  q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; g [B, T, Hv] (or [B, T, Hv, Dk] when GVEC);
//          beta [B, T, Hv]; state_in [B, Hv, Dv, Dk]
// outputs: y [B, T, Hv, Dv] (InT); states [B, T, Hv, Dv, Dk] (StT): states[:, t] = state after token t
// template: InT, StT, Dk (multiple of 32), Dv, Hk, Hv, GVEC (bool)
// launch:  grid (32, Dv, B*Hv), threadgroup (32, 4, 1): one SIMD group per (b, hv, dv) state row,
//          lane l owns the Dk/32 contiguous state elements [l*Dk/32, (l+1)*Dk/32).
//
// Per token: S = S * g; kv = S k; delta = (v - kv) * beta; S = S + k delta^T; y = S q, the same
// recurrence as mlx_lm.models.gated_delta (its generic kernel, plus the per-token state stores). The
// two dot products over Dk are lane partials in element order followed by an explicit shuffle_xor
// butterfly 1,2,4,8,16 (mlx-lm's "xtree" order), independent of simd_sum's lowering.

constexpr int n_per_t = Dk / 32;
const int T = int(v_shape[1]);
const uint n = thread_position_in_grid.z;
const uint b_idx = n / Hv;
const uint hv_idx = n % Hv;
const uint hk_idx = hv_idx / (Hv / Hk);
const uint dk_idx = thread_index_in_simdgroup;
const uint dv_idx = thread_position_in_grid.y;
if (dv_idx >= uint(Dv)) {
  return;  // whole SIMD group; no threadgroup barrier in this kernel
}

// q, k: [B, T, Hk, Dk]
auto q_ = q + (size_t(b_idx) * T * Hk + hk_idx) * Dk;
auto k_ = k + (size_t(b_idx) * T * Hk + hk_idx) * Dk;
// v, y: [B, T, Hv, Dv]
auto v_ = v + (size_t(b_idx) * T * Hv + hv_idx) * Dv;
auto y_ = y + (size_t(b_idx) * T * Hv + hv_idx) * Dv;
// g: [B, T, Hv] or [B, T, Hv, Dk]; beta: [B, T, Hv]
auto g_ = g + (GVEC ? (size_t(b_idx) * T * Hv + hv_idx) * Dk : size_t(b_idx) * T * Hv);
auto beta_ = beta + size_t(b_idx) * T * Hv;
// state_in: [B, Hv, Dv, Dk]; states: [B, T, Hv, Dv, Dk]
auto i_state = state_in + (size_t(n) * Dv + dv_idx) * Dk;
auto o_state = states + ((size_t(b_idx) * T * Hv + hv_idx) * Dv + dv_idx) * Dk;

float state[n_per_t];
for (int i = 0; i < n_per_t; ++i) {
  state[i] = static_cast<float>(i_state[n_per_t * dk_idx + i]);
}

for (int t = 0; t < T; ++t) {
  float kv_mem = 0.0f;
  for (int i = 0; i < n_per_t; ++i) {
    const uint s_idx = n_per_t * dk_idx + i;
    const float gi = GVEC ? static_cast<float>(g_[s_idx]) : static_cast<float>(g_[hv_idx]);
    state[i] = state[i] * gi;
    kv_mem += state[i] * static_cast<float>(k_[s_idx]);
  }
  kv_mem += simd_shuffle_xor(kv_mem, ushort(1));
  kv_mem += simd_shuffle_xor(kv_mem, ushort(2));
  kv_mem += simd_shuffle_xor(kv_mem, ushort(4));
  kv_mem += simd_shuffle_xor(kv_mem, ushort(8));
  kv_mem += simd_shuffle_xor(kv_mem, ushort(16));

  const float delta = (static_cast<float>(v_[dv_idx]) - kv_mem) * static_cast<float>(beta_[hv_idx]);

  float out = 0.0f;
  for (int i = 0; i < n_per_t; ++i) {
    const uint s_idx = n_per_t * dk_idx + i;
    state[i] = state[i] + static_cast<float>(k_[s_idx]) * delta;
    out += state[i] * static_cast<float>(q_[s_idx]);
    o_state[s_idx] = static_cast<StT>(state[i]);
  }
  out += simd_shuffle_xor(out, ushort(1));
  out += simd_shuffle_xor(out, ushort(2));
  out += simd_shuffle_xor(out, ushort(4));
  out += simd_shuffle_xor(out, ushort(8));
  out += simd_shuffle_xor(out, ushort(16));
  if (dk_idx == 0) {
    y_[dv_idx] = static_cast<InT>(out);
  }

  q_ += Hk * Dk;
  k_ += Hk * Dk;
  v_ += Hv * Dv;
  y_ += Hv * Dv;
  g_ += GVEC ? Hv * Dk : Hv;
  beta_ += Hv;
  o_state += Hv * Dv * Dk;
}
