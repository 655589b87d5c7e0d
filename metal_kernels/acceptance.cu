// CUDA twin of acceptance.metal (body for mx.fast.cuda_kernel; same inputs, outputs, template
// constants and launch: grid (TG, 1, 1), threadgroup (TG, 1, 1) -> one block of TG threads).
// MLX declares the template arguments as constexpr (GREEDY, HAS_Q, TG) before this body and passes
// target_shape as a Shape (cuda::std::array<int32_t, 8>).

constexpr int NSG = (TG + 31) / 32;
constexpr unsigned FULL = 0xffffffffu;
constexpr int IMAX = 0x7fffffff;
const float NEG_INF = __int_as_float(0xff800000);
const int K1 = int(target_shape[0]);
const int V = int(target_shape[1]);
const int k = K1 - 1;
const int tid = int(threadIdx.x);
const int lane = tid & 31;
const int sg = tid >> 5;

__shared__ float red_f[32];
__shared__ int red_i[32];
__shared__ int red_j[32];
__shared__ int bcast[2];

if (GREEDY) {
  int n = k;
  int next = 0;
  for (int i = 0; i <= k; ++i) {
    auto row = target + size_t(i) * size_t(V);
    float best = NEG_INF;
    int bi = IMAX;
    for (int j = tid; j < V; j += TG) {
      float x = static_cast<float>(row[j]);
      if (x > best || (x == best && j < bi)) {
        best = x;
        bi = j;
      }
    }
    for (int o = 16; o > 0; o >>= 1) {
      float ob = __shfl_xor_sync(FULL, best, o);
      int oi = __shfl_xor_sync(FULL, bi, o);
      if (ob > best || (ob == best && oi < bi)) {
        best = ob;
        bi = oi;
      }
    }
    if (lane == 0) {
      red_f[sg] = best;
      red_i[sg] = bi;
    }
    __syncthreads();
    if (sg == 0) {
      best = lane < NSG ? red_f[lane] : NEG_INF;
      bi = lane < NSG ? red_i[lane] : IMAX;
      for (int o = 16; o > 0; o >>= 1) {
        float ob = __shfl_xor_sync(FULL, best, o);
        int oi = __shfl_xor_sync(FULL, bi, o);
        if (ob > best || (ob == best && oi < bi)) {
          best = ob;
          bi = oi;
        }
      }
      if (lane == 0) {
        bcast[0] = bi == IMAX ? 0 : bi;
      }
    }
    __syncthreads();
    const int am = bcast[0];
    if (i == k || am != draft[i]) {
      n = i;
      next = am;
      break;
    }
  }
  if (tid == 0) {
    out[0] = n;
    out[1] = next;
  }
} else {
  int n = k;
  for (int i = 0; i < k; ++i) {
    const int x = draft[i];
    const float p = static_cast<float>(target[size_t(i) * size_t(V) + size_t(x)]);
    const float q = HAS_Q ? static_cast<float>(qprobs[size_t(i) * size_t(V) + size_t(x)]) : 1.0f;
    if (!(uniforms[i] * q < p)) {
      n = i;
      break;
    }
  }
  const int chunk = (V + TG - 1) / TG;
  const int lo = min(tid * chunk, V);
  const int hi = min(lo + chunk, V);
  auto prow = target + size_t(n) * size_t(V);
  auto qrow = qprobs + (HAS_Q && n < k ? size_t(n) * size_t(V) : size_t(0));
  const int xn = n < k ? draft[n] : -1;
  int next = 0;
  for (int pass = 0; pass < 2; ++pass) {
    const bool resid = pass == 0 && n < k;
    float local = 0.0f;
    int last_pos = -1;
    for (int j = lo; j < hi; ++j) {
      float r = static_cast<float>(prow[j]);
      if (resid) {
        r = HAS_Q ? fmaxf(r - static_cast<float>(qrow[j]), 0.0f) : (j == xn ? 0.0f : r);
      }
      local += r;
      if (r > 0.0f) last_pos = j;
    }
    // warp-level inclusive scan, exclusive value taken from the lane below (no subtraction)
    float incl = local;
    for (int o = 1; o < 32; o <<= 1) {
      float t = __shfl_up_sync(FULL, incl, o);
      if (lane >= o) incl += t;
    }
    float excl = __shfl_up_sync(FULL, incl, 1);
    if (lane == 0) excl = 0.0f;
    const float sg_total = __shfl_sync(FULL, incl, 31);
    int sg_last = last_pos;
    for (int o = 16; o > 0; o >>= 1) sg_last = max(sg_last, __shfl_xor_sync(FULL, sg_last, o));
    if (lane == 0) {
      red_f[sg] = sg_total;
      red_j[sg] = sg_last;
    }
    __syncthreads();
    float offset = 0.0f;
    float mass = 0.0f;
    int last_any = -1;
    for (int s = 0; s < NSG; ++s) {
      if (s < sg) offset += red_f[s];
      mass += red_f[s];
      last_any = max(last_any, red_j[s]);
    }
    __syncthreads();
    if (!(mass > 0.0f)) {
      if (pass == 0 && n < k) continue;
      next = 0;
      break;
    }
    const float thresh = uniforms[k] * mass;
    float c = offset + excl;
    int cand = IMAX;
    for (int j = lo; j < hi; ++j) {
      float r = static_cast<float>(prow[j]);
      if (resid) {
        r = HAS_Q ? fmaxf(r - static_cast<float>(qrow[j]), 0.0f) : (j == xn ? 0.0f : r);
      }
      c += r;
      if (r > 0.0f && c > thresh) {
        cand = j;
        break;
      }
    }
    for (int o = 16; o > 0; o >>= 1) cand = min(cand, __shfl_xor_sync(FULL, cand, o));
    if (lane == 0) red_i[sg] = cand;
    __syncthreads();
    int best = IMAX;
    for (int s = 0; s < NSG; ++s) best = min(best, red_i[s]);
    next = best == IMAX ? last_any : best;
    break;
  }
  if (tid == 0) {
    out[0] = n;
    out[1] = next;
  }
}
