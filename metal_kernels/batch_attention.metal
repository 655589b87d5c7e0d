// Attention for decode and verify whose every query row is bit-identical to a 1-query launch over the
// same keys. (Body for mx.fast.metal_kernel, ensure_row_contiguous=False; wrapper, reference and the
// order contract: mlx_engine/kernels/batch_attention.py.)
//
// inputs:  q [B, Hq, L, D], k [B, Hk, Nk, D], v [B, Hk, Nk, DV] (T, any strides: cache views),
//          qp [B, Hq, L, DP], kp [B, Hk, Nk, DP] (extra score term, MLA's rope part; unused if DP = 0),
//          scale [1] float32, live [1] int32 (queries i >= live pad a fixed-row pass: zero rows, no key read),
//          lens [B] int32 (the keys of sequence b: its first lens[b] of Nk, a batch cache row's length;
//          0 = all Nk), tree [L] int32 (TREE: bit t of tree[i] set = query i sees key Nk - L + t)
// outputs: o [B, Hq, L, DV] (T)
// template: T, D, DV, DP (multiples of 32; DP may be 0), CAUSAL (query i of sequence b sees keys
//           0..n_b-L+i, n_b its key count), TREE (a token tree's verify pass: query i sees keys
//           0..n_b-L-1 and, of the last L, those whose bits tree[i] sets: its ancestors and itself),
//           SG (SIMD groups per threadgroup), KB (keys per SIMD group and iteration)
// launch:  grid (32*SG, L, B*Hq), threadgroup (32*SG, 1, 1): one threadgroup per (batch, head, query).
//
// Order: SIMD group g takes keys g, g+SG, g+2SG, ... of the n keys the query sees, in increasing order.
// Lane l holds elements [l*D/32, (l+1)*D/32) of q and of each key: the score of key j is a chain of
// fma over the lane's elements (then over its DP elements), a xor butterfly 1..16 over the lanes, times
// scale. Each SIMD group runs the online softmax over its keys in order:
//   m' = max(m, s), c = exp(m - m'), e = exp(s - m'), l = fma(l, c, e), o_d = fma(o_d, c, e * v_d)
// and the SG partial results are merged in group order: M = max m_g, l = sum_g l_g exp(m_g - M),
// o = sum_g o_g exp(m_g - M), out = o / l. Everything depends on the query's own keys and SG only,
// never on L, Nk beyond the query's keys, or the other queries. With TREE the n keys a query sees are
// its visible keys in increasing order (j -> key index kj), so a tree row is its 1-query launch over
// the cache's keys followed by its path's keys, bit for bit.

constexpr int DPL = D / 32;
constexpr int VPL = DV / 32;
constexpr int PPL = DP > 0 ? DP / 32 : 1;
const int L = int(q_shape[2]);
const int Hq = int(q_shape[1]);
const int Hk = int(k_shape[1]);
const int i = int(threadgroup_position_in_grid.y);
const int bh = int(threadgroup_position_in_grid.z);
const int b = bh / Hq;
const int Nk = lens[b] > 0 ? lens[b] : int(k_shape[2]);  // sequence b's keys (0: all of k)
const int h = bh % Hq;
const int hk = h / (Hq / Hk);
const int lane = int(thread_index_in_simdgroup);
const int g = int(simdgroup_index_in_threadgroup);
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

threadgroup float part_m[SG];
threadgroup float part_l[SG];
threadgroup float part_o[SG * DV];

if (i >= live[0]) {  // a pad row of a fixed-row pass: zeros, no key read (every thread of the group returns)
  const int64_t zoff = ((int64_t(b) * Hq + h) * L + i) * DV;
  for (int d = int(thread_index_in_threadgroup); d < DV; d += 32 * SG) {
    out[zoff + d] = static_cast<T>(0.0f);
  }
  return;
}

const int64_t qoff = b * q_strides[0] + h * q_strides[1] + i * q_strides[2];
const int64_t koff = b * k_strides[0] + hk * k_strides[1];
const int64_t voff = b * v_strides[0] + hk * v_strides[1];
float qv[DPL];
for (int t = 0; t < DPL; ++t) {
  qv[t] = static_cast<float>(q[qoff + (lane * DPL + t) * q_strides[3]]);
}
float qpv[PPL];
int64_t kpoff = 0;
if (DP > 0) {
  const int64_t qpoff = b * qp_strides[0] + h * qp_strides[1] + i * qp_strides[2];
  kpoff = b * kp_strides[0] + hk * kp_strides[1];
  for (int t = 0; t < PPL; ++t) {
    qpv[t] = static_cast<float>(qp[qpoff + (lane * PPL + t) * qp_strides[3]]);
  }
}

float m = -INFINITY;
float l = 0.0f;
float o[VPL];
for (int t = 0; t < VPL; ++t) {
  o[t] = 0.0f;
}

for (int j0 = g; j0 < n; j0 += SG * KB) {
  float s[KB];
  for (int kb = 0; kb < KB; ++kb) {
    const int jv = min(j0 + kb * SG, n - 1);  // past n: recomputed, never used
    const int j = (TREE && jv >= Nk - L) ? tail[jv - (Nk - L)] : jv;  // the visible key's index
    float p = 0.0f;
    for (int t = 0; t < DPL; ++t) {
      p = fma(qv[t], static_cast<float>(k[koff + j * k_strides[2] + (lane * DPL + t) * k_strides[3]]), p);
    }
    if (DP > 0) {
      for (int t = 0; t < PPL; ++t) {
        p = fma(qpv[t], static_cast<float>(kp[kpoff + j * kp_strides[2] + (lane * PPL + t) * kp_strides[3]]), p);
      }
    }
    s[kb] = p;
  }
  for (int kb = 0; kb < KB; ++kb) {
    s[kb] = s[kb] + simd_shuffle_xor(s[kb], ushort(1));
    s[kb] = s[kb] + simd_shuffle_xor(s[kb], ushort(2));
    s[kb] = s[kb] + simd_shuffle_xor(s[kb], ushort(4));
    s[kb] = s[kb] + simd_shuffle_xor(s[kb], ushort(8));
    s[kb] = s[kb] + simd_shuffle_xor(s[kb], ushort(16));
  }
  for (int kb = 0; kb < KB; ++kb) {
    const int jv = j0 + kb * SG;
    if (jv < n) {
      const int j = (TREE && jv >= Nk - L) ? tail[jv - (Nk - L)] : jv;
      const float sj = s[kb] * sc;
      const float mn = max(m, sj);
      const float c = exp(m - mn);
      const float e = exp(sj - mn);
      l = fma(l, c, e);
      for (int t = 0; t < VPL; ++t) {
        const float vv = static_cast<float>(v[voff + j * v_strides[2] + (lane * VPL + t) * v_strides[3]]);
        o[t] = fma(o[t], c, e * vv);
      }
      m = mn;
    }
  }
}

if (lane == 0) {
  part_m[g] = m;
  part_l[g] = l;
}
for (int t = 0; t < VPL; ++t) {
  part_o[g * DV + lane * VPL + t] = o[t];
}
threadgroup_barrier(mem_flags::mem_threadgroup);

float mx_ = part_m[0];
for (int w = 1; w < SG; ++w) {
  mx_ = max(mx_, part_m[w]);
}
float lsum = 0.0f;
for (int w = 0; w < SG; ++w) {
  lsum = fma(part_l[w], exp(part_m[w] - mx_), lsum);
}
const int64_t ooff = ((int64_t(b) * Hq + h) * L + i) * DV;
for (int d = int(thread_index_in_threadgroup); d < DV; d += 32 * SG) {
  float acc = 0.0f;
  for (int w = 0; w < SG; ++w) {
    acc = fma(part_o[w * DV + d], exp(part_m[w] - mx_), acc);
  }
  out[ooff + d] = static_cast<T>(acc / lsum);
}
