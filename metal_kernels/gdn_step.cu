// CUDA twin of gdn_step.metal (body for mx.fast.cuda_kernel). Same inputs/outputs/template
// constants (InT, StT, Dk, Dv, Hk, Hv, GVEC) and launch: grid (32, Dv, B*Hv), threadgroup (32, 4, 1)
// -> blocks of (32, 4, 1); a warp is one threadIdx.y row and owns one (b, hv, dv) state row.
// Same per-lane element order and explicit xor butterfly as the Metal body.

constexpr int n_per_t = Dk / 32;
const int T = int(v_shape[1]);
constexpr unsigned FULL = 0xffffffffu;
const unsigned n = blockIdx.z * blockDim.z + threadIdx.z;
const unsigned b_idx = n / Hv;
const unsigned hv_idx = n % Hv;
const unsigned hk_idx = hv_idx / (Hv / Hk);
const unsigned dk_idx = threadIdx.x;
const unsigned dv_idx = blockIdx.y * blockDim.y + threadIdx.y;
if (dv_idx >= unsigned(Dv)) {
  return;  // whole warp; no block-level barrier in this kernel
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
    const unsigned s_idx = n_per_t * dk_idx + i;
    const float gi = GVEC ? static_cast<float>(g_[s_idx]) : static_cast<float>(g_[hv_idx]);
    state[i] = state[i] * gi;
    kv_mem += state[i] * static_cast<float>(k_[s_idx]);
  }
  kv_mem += __shfl_xor_sync(FULL, kv_mem, 1);
  kv_mem += __shfl_xor_sync(FULL, kv_mem, 2);
  kv_mem += __shfl_xor_sync(FULL, kv_mem, 4);
  kv_mem += __shfl_xor_sync(FULL, kv_mem, 8);
  kv_mem += __shfl_xor_sync(FULL, kv_mem, 16);

  const float delta = (static_cast<float>(v_[dv_idx]) - kv_mem) * static_cast<float>(beta_[hv_idx]);

  float out = 0.0f;
  for (int i = 0; i < n_per_t; ++i) {
    const unsigned s_idx = n_per_t * dk_idx + i;
    state[i] = state[i] + static_cast<float>(k_[s_idx]) * delta;
    out += state[i] * static_cast<float>(q_[s_idx]);
    o_state[s_idx] = static_cast<StT>(state[i]);
  }
  out += __shfl_xor_sync(FULL, out, 1);
  out += __shfl_xor_sync(FULL, out, 2);
  out += __shfl_xor_sync(FULL, out, 4);
  out += __shfl_xor_sync(FULL, out, 8);
  out += __shfl_xor_sync(FULL, out, 16);
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
