// CUDA twin of batch_attention.metal (body for mx.fast.cuda_kernel, ensure_row_contiguous=False;
// header common.cuh). Same inputs, outputs, template constants (T, D, DV, DP, CAUSAL, TREE, SG, KB), launch
// (grid (32*SG, L, B*Hq), threadgroup (32*SG, 1, 1): one block per (batch, head, query)) and the same
// arithmetic in the same order: per-lane fma chains for the scores, a xor butterfly 1..16, the
// online softmax of each warp over its keys g, g+SG, ... in order, and the warps merged in order.
// Explicit __fmaf_rn / __fadd_rn / __fmul_rn everywhere: NVRTC cannot contract or reorder, so each
// query row is bit-for-bit its 1-query launch.

constexpr int DPL = D / 32;
constexpr int VPL = DV / 32;
constexpr int PPL = DP > 0 ? DP / 32 : 1;
constexpr unsigned FULL = 0xffffffffu;
const float NEG_INF = __int_as_float(0xff800000);
const int L = int(q_shape[2]);
const int Hq = int(q_shape[1]);
const int Hk = int(k_shape[1]);
const int i = int(blockIdx.y);
const int bh = int(blockIdx.z);
const int b = bh / Hq;
const int Nk = lens[b] > 0 ? lens[b] : int(k_shape[2]);  // sequence b's keys (0: all of k)
const int h = bh % Hq;
const int hk = h / (Hq / Hk);
const int tid = int(threadIdx.x);
const int lane = tid & 31;
const int g = tid >> 5;
int n = CAUSAL ? Nk - L + i + 1 : Nk;
int tail[16];  // TREE: the key index of each visible key among the last L (at most 16 queries)
if (TREE) {
  const unsigned bits = unsigned(tree[i]);
  int cnt = 0;
  for (int t = 0; t < L; ++t) {
    if ((bits >> t) & 1u) {
      tail[cnt++] = Nk - L + t;
    }
  }
  n = Nk - L + cnt;
}
const float sc = scale[0];

__shared__ float part_m[SG];
__shared__ float part_l[SG];
__shared__ float part_o[SG * DV];

if (i >= live[0]) {  // a pad row of a fixed-row pass: zeros, no key read (every thread of the group returns)
  const int64_t zoff = ((int64_t(b) * Hq + h) * L + i) * DV;
  for (int d = tid; d < DV; d += 32 * SG) {
    out[zoff + d] = static_cast<T>(0.0f);
  }
  return;
}

const int64_t qoff = b * q_strides[0] + h * q_strides[1] + i * q_strides[2];
const int64_t koff = b * k_strides[0] + hk * k_strides[1];
const int64_t voff = b * v_strides[0] + hk * v_strides[1];
float qv[DPL];
#pragma unroll
for (int t = 0; t < DPL; ++t) {
  qv[t] = static_cast<float>(q[qoff + (lane * DPL + t) * q_strides[3]]);
}
float qpv[PPL];
int64_t kpoff = 0;
if (DP > 0) {
  const int64_t qpoff = b * qp_strides[0] + h * qp_strides[1] + i * qp_strides[2];
  kpoff = b * kp_strides[0] + hk * kp_strides[1];
#pragma unroll
  for (int t = 0; t < PPL; ++t) {
    qpv[t] = static_cast<float>(qp[qpoff + (lane * PPL + t) * qp_strides[3]]);
  }
}

float m = NEG_INF;
float l = 0.0f;
float o[VPL];
#pragma unroll
for (int t = 0; t < VPL; ++t) {
  o[t] = 0.0f;
}

for (int j0 = g; j0 < n; j0 += SG * KB) {
  float s[KB];
#pragma unroll
  for (int kb = 0; kb < KB; ++kb) {
    const int jv = min(j0 + kb * SG, n - 1);  // past n: recomputed, never used
    const int j = (TREE && jv >= Nk - L) ? tail[jv - (Nk - L)] : jv;  // the visible key's index
    float p = 0.0f;
#pragma unroll
    for (int t = 0; t < DPL; ++t) {
      p = __fmaf_rn(qv[t], static_cast<float>(k[koff + j * k_strides[2] + (lane * DPL + t) * k_strides[3]]), p);
    }
    if (DP > 0) {
#pragma unroll
      for (int t = 0; t < PPL; ++t) {
        p = __fmaf_rn(qpv[t], static_cast<float>(kp[kpoff + j * kp_strides[2] + (lane * PPL + t) * kp_strides[3]]), p);
      }
    }
    s[kb] = p;
  }
#pragma unroll
  for (int kb = 0; kb < KB; ++kb) {
    s[kb] = __fadd_rn(s[kb], __shfl_xor_sync(FULL, s[kb], 1));
    s[kb] = __fadd_rn(s[kb], __shfl_xor_sync(FULL, s[kb], 2));
    s[kb] = __fadd_rn(s[kb], __shfl_xor_sync(FULL, s[kb], 4));
    s[kb] = __fadd_rn(s[kb], __shfl_xor_sync(FULL, s[kb], 8));
    s[kb] = __fadd_rn(s[kb], __shfl_xor_sync(FULL, s[kb], 16));
  }
#pragma unroll
  for (int kb = 0; kb < KB; ++kb) {
    const int jv = j0 + kb * SG;
    if (jv < n) {
      const int j = (TREE && jv >= Nk - L) ? tail[jv - (Nk - L)] : jv;
      const float sj = __fmul_rn(s[kb], sc);
      const float mn = fmaxf(m, sj);
      const float c = expf(__fadd_rn(m, -mn));
      const float e = expf(__fadd_rn(sj, -mn));
      l = __fmaf_rn(l, c, e);
#pragma unroll
      for (int t = 0; t < VPL; ++t) {
        const float vv = static_cast<float>(v[voff + j * v_strides[2] + (lane * VPL + t) * v_strides[3]]);
        o[t] = __fmaf_rn(o[t], c, __fmul_rn(e, vv));
      }
      m = mn;
    }
  }
}

if (lane == 0) {
  part_m[g] = m;
  part_l[g] = l;
}
#pragma unroll
for (int t = 0; t < VPL; ++t) {
  part_o[g * DV + lane * VPL + t] = o[t];
}
__syncthreads();

float mx_ = part_m[0];
for (int w = 1; w < SG; ++w) {
  mx_ = fmaxf(mx_, part_m[w]);
}
float lsum = 0.0f;
for (int w = 0; w < SG; ++w) {
  lsum = __fmaf_rn(part_l[w], expf(__fadd_rn(part_m[w], -mx_)), lsum);
}
const int64_t ooff = ((int64_t(b) * Hq + h) * L + i) * DV;
for (int d = tid; d < DV; d += 32 * SG) {
  float acc = 0.0f;
  for (int w = 0; w < SG; ++w) {
    acc = __fmaf_rn(part_o[w * DV + d], expf(__fadd_rn(part_m[w], -mx_)), acc);
  }
  out[ooff + d] = static_cast<T>(__fdiv_rn(acc, lsum));
}
