// Fused speculative acceptance: n_accepted and the next token in one threadgroup, one pass.
// (Body for mx.fast.metal_kernel; wrapper and math: mlx_engine/kernels/acceptance.py.)
//
// inputs:  target   [k+1, V]  logits (GREEDY) or probabilities (sampling), any float type
//          draft    [max(k,1)] int32 draft tokens (padded with one entry when k = 0)
//          qprobs   [k, V] draft probabilities (HAS_Q) or a 1-element dummy
//          uniforms [k+1] float32: u_0..u_{k-1} for the accept tests, u_k for the sample
// outputs: out      [2] int32: n_accepted, next token
// template: GREEDY (bool), HAS_Q (bool), TG (threads; a multiple of 32, at most 1024)
// launch:  grid (TG, 1, 1), threadgroup (TG, 1, 1)
//
// Greedy: row i's argmax (ties -> lowest index) is compared with draft i, rows are scanned only up
// to the first mismatch. Sampling: u_i * q_i(x_i) < p_i(x_i) accepts draft i; row n is the residual
// max(0, p_n - q_n) (p_n without x_n for a deterministic draft) or p_k after a full accept; the
// token is the smallest j with r_j > 0 and cdf_j > u_k * sum(r) (cdf over contiguous per-thread
// chunks), falling back to the last j with r_j > 0, and to the plain row p_n when sum(r) == 0.

constexpr int NSG = (TG + 31) / 32;
constexpr int IMAX = 0x7fffffff;
const int K1 = int(target_shape[0]);
const int V = int(target_shape[1]);
const int k = K1 - 1;
const uint tid = thread_position_in_threadgroup.x;
const uint lane = thread_index_in_simdgroup;
const uint sg = simdgroup_index_in_threadgroup;

threadgroup float red_f[32];
threadgroup int red_i[32];
threadgroup int red_j[32];
threadgroup int bcast[2];

if (GREEDY) {
  int n = k;
  int next = 0;
  for (int i = 0; i <= k; ++i) {
    auto row = target + size_t(i) * size_t(V);
    float best = -INFINITY;
    int bi = IMAX;
    for (int j = int(tid); j < V; j += TG) {
      float x = static_cast<float>(row[j]);
      if (x > best || (x == best && j < bi)) {
        best = x;
        bi = j;
      }
    }
    for (ushort o = 16; o > 0; o >>= 1) {
      float ob = simd_shuffle_xor(best, o);
      int oi = simd_shuffle_xor(bi, o);
      if (ob > best || (ob == best && oi < bi)) {
        best = ob;
        bi = oi;
      }
    }
    if (lane == 0) {
      red_f[sg] = best;
      red_i[sg] = bi;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (sg == 0) {
      best = lane < uint(NSG) ? red_f[lane] : -INFINITY;
      bi = lane < uint(NSG) ? red_i[lane] : IMAX;
      for (ushort o = 16; o > 0; o >>= 1) {
        float ob = simd_shuffle_xor(best, o);
        int oi = simd_shuffle_xor(bi, o);
        if (ob > best || (ob == best && oi < bi)) {
          best = ob;
          bi = oi;
        }
      }
      if (lane == 0) {
        bcast[0] = bi == IMAX ? 0 : bi;
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
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
  // acceptance tests: a few scalar loads, done redundantly by every thread (no barrier needed)
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
  const int lo = min(int(tid) * chunk, V);
  const int hi = min(lo + chunk, V);
  auto prow = target + size_t(n) * size_t(V);
  auto qrow = qprobs + (HAS_Q && n < k ? size_t(n) * size_t(V) : size_t(0));
  const int xn = n < k ? draft[n] : -1;
  int next = 0;
  // pass 0: the residual (or p_k after a full accept); pass 1: plain p_n when the residual is empty
  for (int pass = 0; pass < 2; ++pass) {
    const bool resid = pass == 0 && n < k;
    float local = 0.0f;
    int last_pos = -1;
    for (int j = lo; j < hi; ++j) {
      float r = static_cast<float>(prow[j]);
      if (resid) {
        r = HAS_Q ? max(r - static_cast<float>(qrow[j]), 0.0f) : (j == xn ? 0.0f : r);
      }
      local += r;
      if (r > 0.0f) last_pos = j;
    }
    // exclusive scan of the chunk sums: within the SIMD group, then across SIMD groups
    const float excl = simd_prefix_exclusive_sum(local);
    const float sg_total = simd_shuffle(excl + local, ushort(31));
    const int sg_last = simd_max(last_pos);
    if (lane == 0) {
      red_f[sg] = sg_total;
      red_j[sg] = sg_last;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    float offset = 0.0f;
    float mass = 0.0f;
    int last_any = -1;
    for (int s = 0; s < NSG; ++s) {  // same order in every thread: identical mass everywhere
      if (uint(s) < sg) offset += red_f[s];
      mass += red_f[s];
      last_any = max(last_any, red_j[s]);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (!(mass > 0.0f)) {
      if (pass == 0 && n < k) continue;  // empty residual: sample from p_n itself
      next = 0;                          // degenerate all-zero row
      break;
    }
    const float thresh = uniforms[k] * mass;
    float c = offset + excl;
    int cand = IMAX;
    for (int j = lo; j < hi; ++j) {
      float r = static_cast<float>(prow[j]);
      if (resid) {
        r = HAS_Q ? max(r - static_cast<float>(qrow[j]), 0.0f) : (j == xn ? 0.0f : r);
      }
      c += r;
      if (r > 0.0f && c > thresh) {
        cand = j;
        break;
      }
    }
    cand = simd_min(cand);
    if (lane == 0) red_i[sg] = cand;
    threadgroup_barrier(mem_flags::mem_threadgroup);
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
