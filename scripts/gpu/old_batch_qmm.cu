// The batch_qmm CUDA body as it was before 2026-11-23 (runtime row loop, accumulators in local memory):
// kept only as the baseline scripts/gpu/verify_speed.py checks the current body against, bit for bit.
// CUDA twin of batch_qmm.metal (body for mx.fast.cuda_kernel, header common.cuh). Same inputs,
// outputs, template constants (T, BITS, GS, R, GATHER, XDIV), launch (grid (32, ceil(N/R), 1 or P),
// threadgroup (32, SG, 1): a warp is one threadIdx.y row and owns R output columns) and the same
// arithmetic in the same order: per 32-value chunk a chain of fma for p and of adds for xs, then
// acc = acc + fma(scale, p, bias * xs), chunks in order, a xor butterfly 1..16. Every operation is an
// explicit __fmaf_rn / __fadd_rn / __fmul_rn, so NVRTC cannot contract or reorder anything and each
// row of a launch is bit-for-bit its 1-row launch. The row loop is not unrolled (the row count is a
// runtime bound: one compiled kernel serves 1 to 16 rows); weights and activations are read with
// 16-byte loads.

constexpr int MAXR = 16;
constexpr int CH = 32;
constexpr int PER_WORD = 32 / BITS;
constexpr int WPC = CH / PER_WORD;     // words per chunk: 4 (4-bit) or 8 (8-bit)
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
int M = min(int(x_shape[0]), MAXR);  // rows of this launch (gather: pairs routed to this expert)
int rows[MAXR];                      // gather: the pairs, in increasing order
size_t ebase = 0;                    // gather: the expert's first weight row
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
      if (M < MAXR) {
        rows[M] = q;
      }
      M += 1;
    }
  }
  M = min(M, MAXR);
  ebase = size_t(e) * size_t(N);
}

float acc[MAXR][R];
#pragma unroll 1
for (int m = 0; m < M; ++m) {
#pragma unroll
  for (int r = 0; r < R; ++r) {
    acc[m][r] = 0.0f;
  }
}

for (int c = lane; c < C; c += 32) {
  const int k0 = c * CH;
  const int g = k0 / GS;
  float q[R][CH];
  float sc[R];
  float bi[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const size_t n = ebase + size_t(min(n0 + r, N - 1));  // columns past N: garbage, never stored
    const size_t wbase = n * size_t(wrow) + size_t(c) * WPC;
#pragma unroll
    for (int j = 0; j < WPC; j += 4) {
      const uint4 u = mlxe_ld_u4(w + wbase + j);
      const unsigned ws[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) {
#pragma unroll
        for (int i = 0; i < PER_WORD; ++i) {  // exact: 2^23 + q as a float, minus 2^23
          const unsigned code = (ws[jj] >> (unsigned(i) * BITS)) & MASK;
          q[r][(j + jj) * PER_WORD + i] = __fadd_rn(__uint_as_float(0x4B000000u | code), -8388608.0f);
        }
      }
    }
    sc[r] = static_cast<float>(scales[n * size_t(n_groups) + size_t(g)]);
    bi[r] = static_cast<float>(biases[n * size_t(n_groups) + size_t(g)]);
  }
#pragma unroll 1
  for (int m = 0; m < M; ++m) {
    const int xr = GATHER ? rows[m] / XDIV : m;
    const size_t xbase = size_t(xr) * size_t(K) + size_t(k0);
    float xs = 0.0f;
    float p[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      p[r] = 0.0f;
    }
#pragma unroll
    for (int s = 0; s < CH / 8; ++s) {
      float xv[8];
      mlxe_ld_f8(x + (xbase + size_t(s * 8)), xv);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        xs = __fadd_rn(xs, xv[i]);
#pragma unroll
        for (int r = 0; r < R; ++r) {
          p[r] = __fmaf_rn(xv[i], q[r][s * 8 + i], p[r]);
        }
      }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
      acc[m][r] = __fadd_rn(acc[m][r], __fmaf_rn(sc[r], p[r], __fmul_rn(bi[r], xs)));
    }
  }
}

#pragma unroll 1
for (int m = 0; m < M; ++m) {
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
