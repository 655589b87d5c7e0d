// CUDA twin of batch_qmm.metal (body for mx.fast.cuda_kernel, header common.cuh). Same inputs,
// outputs, template constants (T, BITS, GS, R, GATHER, XDIV; MB and PF only shape this body's code),
// launch (grid (32, ceil(N/R), 1 or P), threadgroup (32, SG, 1): a warp is one threadIdx.y row and
// owns R output columns) and the same arithmetic in the same order: per 32-value chunk a chain of fma
// for p and of adds for xs, then acc = acc + fma(scale, p, bias * xs), chunks in order, a xor
// butterfly 1..16. Every operation is an explicit __fmaf_rn / __fadd_rn / __fmul_rn, so NVRTC cannot
// contract or reorder anything and each row of a launch is bit-for-bit its 1-row launch.
//
// Code shape (changes no bit): MB is a compile-time bound on the rows (1, 2, 4, 8 or 16 >= M), so
// every row loop is unrolled with a uniform `m < M` guard and the per-row sums live in registers; a
// chunk is consumed in 4 sub-chunks of 8 values (8*R codes unpacked at a time, applied to every row);
// PF = 1 loads the next chunk's words while the current one is computed. Weights and activations are
// read with 16-byte loads.

constexpr int MAXR = 16;
constexpr int CH = 32;
constexpr int SUB = 8;                 // values per sub-chunk
constexpr int PER_WORD = 32 / BITS;
constexpr int WPC = CH / PER_WORD;     // words per chunk: 4 (4-bit) or 8 (8-bit)
constexpr int V4 = WPC / 4;            // 16-byte loads per chunk and column
constexpr int WPS = SUB / PER_WORD;    // words per sub-chunk: 1 or 2
constexpr unsigned MASK = (1u << BITS) - 1u;
constexpr unsigned FULL = 0xffffffffu;
const int K = int(x_shape[1]);
const int N = int(w_shape[GATHER ? 1 : 0]);
const int C = K / CH;
const int n_groups = K / GS;
const int wrow = K / PER_WORD;
const int lane = int(threadIdx.x);
const int n0 = int(blockIdx.y * blockDim.y + threadIdx.y) * R;
if (n0 >= N) {
  return;  // whole warp (same threadIdx.y) leaves together; no block-level barrier below
}
int M = min(min(int(x_shape[0]), MAXR), MB);  // rows of this launch (gather: pairs of this expert)
int rows[MB];                                 // gather: the pairs, in increasing order
size_t ebase = 0;                             // gather: the expert's first weight row
if (GATHER) {
  const int P = int(idx_shape[0]);
  const int p = int(blockIdx.z);
  const uint32_t e = idx[p];
  M = 0;
  for (int q = 0; q < P; ++q) {  // uniform over the block: every thread reads the same entries
    if (idx[q] == e) {
      if (q < p) {
        return;  // not the first pair of its expert: that pair's block does the work
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
#pragma unroll
for (int m = 0; m < MB; ++m) {
  xoff[m] = size_t(GATHER ? (m < M ? rows[m] / XDIV : 0) : m) * size_t(K);
}
size_t wcol[R];  // first word of each column's weight row
size_t scol[R];  // first scale of each column
#pragma unroll
for (int r = 0; r < R; ++r) {
  const size_t n = ebase + size_t(min(n0 + r, N - 1));  // columns past N: garbage, never stored
  wcol[r] = n * size_t(wrow);
  scol[r] = n * size_t(n_groups);
}

float acc[MB][R];
#pragma unroll
for (int m = 0; m < MB; ++m) {
#pragma unroll
  for (int r = 0; r < R; ++r) {
    acc[m][r] = 0.0f;
  }
}

uint4 wn[R][V4];  // the words of the chunk to compute next
#pragma unroll
for (int r = 0; r < R; ++r) {
#pragma unroll
  for (int j = 0; j < V4; ++j) {
    wn[r][j] = lane < C ? mlxe_ld_u4(w + wcol[r] + size_t(lane) * WPC + j * 4) : make_uint4(0u, 0u, 0u, 0u);
  }
}

for (int c = lane; c < C; c += 32) {
  const int k0 = c * CH;
  const int g = k0 / GS;
  uint4 wc[R][V4];
  float sc[R];
  float bi[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int j = 0; j < V4; ++j) {
      wc[r][j] = wn[r][j];
    }
    sc[r] = static_cast<float>(scales[scol[r] + size_t(g)]);
    bi[r] = static_cast<float>(biases[scol[r] + size_t(g)]);
  }
  if (PF) {
    if (c + 32 < C) {
#pragma unroll
      for (int r = 0; r < R; ++r) {
#pragma unroll
        for (int j = 0; j < V4; ++j) {
          wn[r][j] = mlxe_ld_u4(w + wcol[r] + size_t(c + 32) * WPC + j * 4);
        }
      }
    }
  }
  float p[MB][R];
  float xs[MB];
#pragma unroll
  for (int m = 0; m < MB; ++m) {
    xs[m] = 0.0f;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      p[m][r] = 0.0f;
    }
  }
#pragma unroll
  for (int s = 0; s < CH / SUB; ++s) {
    float q[R][SUB];
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
      for (int jw = 0; jw < WPS; ++jw) {
        const int j = s * WPS + jw;  // word of the chunk (compile-time)
        const uint4 u = wc[r][j / 4];
        const unsigned word = (j % 4 == 0) ? u.x : (j % 4 == 1) ? u.y : (j % 4 == 2) ? u.z : u.w;
#pragma unroll
        for (int i = 0; i < PER_WORD; ++i) {  // exact: 2^23 + q as a float, minus 2^23
          const unsigned code = (word >> (unsigned(i) * BITS)) & MASK;
          q[r][jw * PER_WORD + i] = __fadd_rn(__uint_as_float(0x4B000000u | code), -8388608.0f);
        }
      }
    }
#pragma unroll
    for (int m = 0; m < MB; ++m) {
      if (m < M) {
        float xv[SUB];
        mlxe_ld_f8(x + (xoff[m] + size_t(k0 + s * SUB)), xv);
#pragma unroll
        for (int i = 0; i < SUB; ++i) {
          xs[m] = __fadd_rn(xs[m], xv[i]);
#pragma unroll
          for (int r = 0; r < R; ++r) {
            p[m][r] = __fmaf_rn(xv[i], q[r][i], p[m][r]);
          }
        }
      }
    }
  }
#pragma unroll
  for (int m = 0; m < MB; ++m) {
    if (m < M) {
#pragma unroll
      for (int r = 0; r < R; ++r) {
        acc[m][r] = __fadd_rn(acc[m][r], __fmaf_rn(sc[r], p[m][r], __fmul_rn(bi[r], xs[m])));
      }
    }
  }
  if (!PF) {
    if (c + 32 < C) {
#pragma unroll
      for (int r = 0; r < R; ++r) {
#pragma unroll
        for (int j = 0; j < V4; ++j) {
          wn[r][j] = mlxe_ld_u4(w + wcol[r] + size_t(c + 32) * WPC + j * 4);
        }
      }
    }
  }
}

#pragma unroll
for (int m = 0; m < MB; ++m) {
  if (m < M) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float v = acc[m][r];
      v = __fadd_rn(v, __shfl_xor_sync(FULL, v, 1));
      v = __fadd_rn(v, __shfl_xor_sync(FULL, v, 2));
      v = __fadd_rn(v, __shfl_xor_sync(FULL, v, 4));
      v = __fadd_rn(v, __shfl_xor_sync(FULL, v, 8));
      v = __fadd_rn(v, __shfl_xor_sync(FULL, v, 16));
      if (lane == (m * R + r) % 32 && n0 + r < N) {
        const int row = GATHER ? rows[m] : m;
        y[size_t(row) * size_t(N) + size_t(n0 + r)] = static_cast<T>(v);
      }
    }
  }
}
