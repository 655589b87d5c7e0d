// Few-row affine-quantized matmul y = x @ dequantize(w).T, every row bit-identical to its 1-row launch,
// dense or over MoE experts. (Body for mx.fast.metal_kernel; wrapper, reference and the order contract:
// mlx_engine/kernels/batch_qmm.py.)
//
// dense  (GATHER false): x [M, K] (T, M <= 16), w [N, K*BITS/32] uint32, scales / biases [N, K/GS] (T)
//          -> y [M, N]
// gather (GATHER true):  x [X, K], w [E, N, K*BITS/32], scales / biases [E, N, K/GS], idx [P] (expert of
//          pair p; pair p reads x row p / XDIV) -> y [P, N]. Threadgroup z = p handles the expert of pair p
//          if p is its first pair, for all pairs routed to it (each expert's weights are read once).
// template: T, BITS (4 or 8), GS (32/64/128), R (output columns per SIMD group), GATHER, XDIV, MB (a
//           compile-time bound >= the rows: 1, 2, 4, 8 or 16), PF (used by the CUDA twin only)
// launch:  grid (32, ceil(N/R), 1 or P), threadgroup (32, SG, 1): one SIMD group per R columns.
//
// Each SIMD group reads every weight word of its R columns once, unpacks a 32-value chunk of codes into
// registers and applies it to every row in turn. Lane l owns the chunks c = l, l+32, l+64, ... of K
// (a chunk lies in one quantization group). Per row m and column n of a chunk:
//   p  = x_0*q_0 + x_1*q_1 + ... + x_31*q_31   (a chain of fma, in order)
//   xs = x_0 + x_1 + ... + x_31                 (in order)
//   acc_l = acc_l + fma(scale_g, p, bias_g * xs)     (chunks in increasing order)
// then a shuffle_xor butterfly 1, 2, 4, 8, 16 over the lanes (a pairwise tree in lane order).
// The row count is a runtime bound (loops unroll to MB with an `m < M` guard, so the per-row sums live
// in registers; a chunk is applied in four 8-value sub-chunks) and nothing of the above depends on it,
// on MB, on R or on the other rows: each row of a launch is bit-for-bit the row of a 1-row launch.

constexpr int MAXR = 16;             // rows per launch (per expert)
constexpr int CH = 32;               // values per lane and step
constexpr int SUB = 8;               // values per sub-chunk
constexpr int PER_WORD = 32 / BITS;  // values per uint32
constexpr int WPC = CH / PER_WORD;   // words per chunk (4 or 8)
constexpr int WPS = SUB / PER_WORD;  // words per sub-chunk (1 or 2)
constexpr uint MASK = (1u << BITS) - 1u;
const int K = int(x_shape[1]);
const int N = int(w_shape[GATHER ? 1 : 0]);
const int C = K / CH;
const int n_groups = K / GS;
const int wrow = K / PER_WORD;
const int lane = int(thread_index_in_simdgroup);
const int n0 = int(thread_position_in_grid.y) * R;
if (n0 >= N) {
  return;  // the whole SIMD group (one grid row) leaves together
}
int M = min(min(int(x_shape[0]), MAXR), MB);  // rows of this launch (gather: pairs routed to this expert)
int rows[MB];                                 // gather: the pairs, in increasing order
size_t ebase = 0;                             // gather: the expert's first weight row
if (GATHER) {
  const int P = int(idx_shape[0]);
  const int p = int(thread_position_in_grid.z);
  const uint e = idx[p];
  M = 0;
  for (int q = 0; q < P; ++q) {  // uniform over the threadgroup: every thread reads the same entries
    if (idx[q] == e) {
      if (q < p) {
        return;  // not the first pair of its expert: that pair's threadgroup does the work
      }
      if (M < MB) {
        rows[M] = q;
      }
      M += 1;
    }
  }
  M = min(M, MB);
  ebase = size_t(e) * size_t(N);
}
size_t xoff[MB];  // first activation of each row
for (int m = 0; m < MB; ++m) {
  xoff[m] = size_t(GATHER ? (m < M ? rows[m] / XDIV : 0) : m) * size_t(K);
}

float acc[MB][R];
for (int m = 0; m < MB; ++m) {
  for (int r = 0; r < R; ++r) {
    acc[m][r] = 0.0f;
  }
}

for (int c = lane; c < C; c += 32) {
  const int k0 = c * CH;
  const int g = k0 / GS;
  size_t wbase[R];
  float sc[R];
  float bi[R];
  for (int r = 0; r < R; ++r) {
    const size_t n = ebase + size_t(min(n0 + r, N - 1));  // columns past N: garbage, never stored
    wbase[r] = n * size_t(wrow) + size_t(c) * WPC;
    sc[r] = static_cast<float>(scales[n * size_t(n_groups) + size_t(g)]);
    bi[r] = static_cast<float>(biases[n * size_t(n_groups) + size_t(g)]);
  }
  float p[MB][R];
  float xs[MB];
  for (int m = 0; m < MB; ++m) {
    xs[m] = 0.0f;
    for (int r = 0; r < R; ++r) {
      p[m][r] = 0.0f;
    }
  }
  for (int s = 0; s < CH / SUB; ++s) {
    float q[R][SUB];
    for (int r = 0; r < R; ++r) {
      for (int jw = 0; jw < WPS; ++jw) {
        const uint word = w[wbase[r] + size_t(s * WPS + jw)];
        for (int i = 0; i < PER_WORD; ++i) {  // exact: 2^23 + q as a float, minus 2^23
          q[r][jw * PER_WORD + i] = as_type<float>(0x4B000000u | ((word >> (uint(i) * BITS)) & MASK)) - 8388608.0f;
        }
      }
    }
    for (int m = 0; m < MB; ++m) {
      if (m < M) {
        const size_t xbase = xoff[m] + size_t(k0 + s * SUB);
        for (int i = 0; i < SUB; ++i) {
          const float xv = static_cast<float>(x[xbase + i]);
          xs[m] = xs[m] + xv;
          for (int r = 0; r < R; ++r) {
            p[m][r] = fma(xv, q[r][i], p[m][r]);
          }
        }
      }
    }
  }
  for (int m = 0; m < MB; ++m) {
    if (m < M) {
      for (int r = 0; r < R; ++r) {
        acc[m][r] = acc[m][r] + fma(sc[r], p[m][r], bi[r] * xs[m]);
      }
    }
  }
}

for (int m = 0; m < MB; ++m) {
  if (m < M) {
    for (int r = 0; r < R; ++r) {
      float v = acc[m][r];
      v = v + simd_shuffle_xor(v, ushort(1));
      v = v + simd_shuffle_xor(v, ushort(2));
      v = v + simd_shuffle_xor(v, ushort(4));
      v = v + simd_shuffle_xor(v, ushort(8));
      v = v + simd_shuffle_xor(v, ushort(16));
      if (lane == (m * R + r) % 32 && n0 + r < N) {
        const int row = GATHER ? rows[m] : m;
        y[size_t(row) * size_t(N) + size_t(n0 + r)] = static_cast<T>(v);
      }
    }
  }
}
