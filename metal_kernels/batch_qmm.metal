// Small-batch affine-quantized matmul y = x @ dequantize(w).T with a fixed reduction order per row.
// (Body for mx.fast.metal_kernel; wrapper, reference and the order contract:
// mlx_engine/kernels/batch_qmm.py.)
//
// inputs:  x [M, K] (T), w [N, K*BITS/32] uint32, scales [N, K/GS], biases [N, K/GS]
// outputs: y [M, N] (T)
// template: T, M (rows, 1..16), BITS (4 or 8), GS (group size 32/64/128), R (columns per SIMD group)
// launch:  grid (32, ceil(N/R), 1), threadgroup (32, SG, 1): one SIMD group per R output columns.
//
// Each SIMD group reads every weight word of its R columns once and applies it to all M rows.
// Lane l owns the 8-value chunks c = l, l+32, l+64, ... of K; per row and column:
//   xs = ((x0+x1)+(x2+x3))+((x4+x5)+(x6+x7)),  dq = the same tree over x_i*q_i,
//   acc_l += scale_g*dq + bias_g*xs   (chunks in increasing order),
// then a shuffle_xor butterfly 1,2,4,8,16 (a pairwise tree in lane order). Nothing depends on M, so
// row i of an M-row launch is bit-for-bit the 1-row result.

constexpr int VPT = 8;                 // values per lane and step
constexpr int WPL = VPT * BITS / 32;   // packed words per lane and step (1 or 2)
constexpr int PER_WORD = 32 / BITS;
constexpr int STEP = 32 * VPT;
constexpr uint MASK = (1u << BITS) - 1u;
const int K = int(x_shape[1]);
const int N = int(w_shape[0]);
const int n_groups = K / GS;
const int wrow = K / PER_WORD;
const uint lane = thread_index_in_simdgroup;
const int n0 = int(thread_position_in_grid.y) * R;
if (n0 >= N) {
  return;  // the whole SIMD group (one grid row) leaves together
}

float acc[M][R];
for (int m = 0; m < M; ++m) {
  for (int r = 0; r < R; ++r) {
    acc[m][r] = 0.0f;
  }
}

for (int k0 = int(lane) * VPT; k0 < K; k0 += STEP) {
  const int g = k0 / GS;
  float q[R][VPT];
  float sc[R];
  float bi[R];
  for (int r = 0; r < R; ++r) {
    const int n = min(n0 + r, N - 1);  // columns past N compute garbage that is never stored
    auto wp = w + size_t(n) * size_t(wrow) + size_t(k0 / PER_WORD);
    for (int wi = 0; wi < WPL; ++wi) {
      const uint word = wp[wi];
      for (int i = 0; i < PER_WORD; ++i) {
        q[r][wi * PER_WORD + i] = float((word >> (uint(i) * BITS)) & MASK);
      }
    }
    sc[r] = static_cast<float>(scales[size_t(n) * size_t(n_groups) + size_t(g)]);
    bi[r] = static_cast<float>(biases[size_t(n) * size_t(n_groups) + size_t(g)]);
  }
  for (int m = 0; m < M; ++m) {
    auto xr = x + size_t(m) * size_t(K) + size_t(k0);
    float xv[VPT];
    for (int i = 0; i < VPT; ++i) {
      xv[i] = static_cast<float>(xr[i]);
    }
    const float xs = ((xv[0] + xv[1]) + (xv[2] + xv[3])) + ((xv[4] + xv[5]) + (xv[6] + xv[7]));
    for (int r = 0; r < R; ++r) {
      float p[VPT];
      for (int i = 0; i < VPT; ++i) {
        p[i] = xv[i] * q[r][i];
      }
      const float dq = ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]));
      const float a = sc[r] * dq;
      const float b = bi[r] * xs;
      acc[m][r] = acc[m][r] + (a + b);
    }
  }
}

for (int r = 0; r < R; ++r) {
  for (int m = 0; m < M; ++m) {
    float v = acc[m][r];
    v = v + simd_shuffle_xor(v, ushort(1));
    v = v + simd_shuffle_xor(v, ushort(2));
    v = v + simd_shuffle_xor(v, ushort(4));
    v = v + simd_shuffle_xor(v, ushort(8));
    v = v + simd_shuffle_xor(v, ushort(16));
    if (lane == uint((m * R + r) % 32) && n0 + r < N) {
      y[size_t(m) * size_t(N) + size_t(n0 + r)] = static_cast<T>(v);
    }
  }
}
