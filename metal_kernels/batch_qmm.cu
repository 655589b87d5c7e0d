// CUDA twin of batch_qmm.metal (body for mx.fast.cuda_kernel). Same inputs/outputs/template
// constants (T, M, BITS, GS, R) and launch: grid (32, ceil(N/R), 1), threadgroup (32, SG, 1) ->
// blocks of (32, SG) threads; a warp is one threadIdx.y row and owns R output columns. The
// reduction order is the one documented in batch_qmm.metal (explicit trees, explicit butterfly,
// __fmul_rn/__fadd_rn so that nvcc never contracts into FMA), hence batch invariant.

constexpr int VPT = 8;
constexpr int WPL = VPT * BITS / 32;
constexpr int PER_WORD = 32 / BITS;
constexpr int STEP = 32 * VPT;
constexpr unsigned MASK = (1u << BITS) - 1u;
constexpr unsigned FULL = 0xffffffffu;
const int K = int(x_shape[1]);
const int N = int(w_shape[0]);
const int n_groups = K / GS;
const int wrow = K / PER_WORD;
const int lane = int(threadIdx.x);
const int n0 = int(blockIdx.y * blockDim.y + threadIdx.y) * R;
if (n0 >= N) {
  return;  // whole warp (same threadIdx.y) leaves together; no block-level barrier below
}

float acc[M][R];
#pragma unroll
for (int m = 0; m < M; ++m) {
#pragma unroll
  for (int r = 0; r < R; ++r) {
    acc[m][r] = 0.0f;
  }
}

for (int k0 = lane * VPT; k0 < K; k0 += STEP) {
  const int g = k0 / GS;
  float q[R][VPT];
  float sc[R];
  float bi[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int n = min(n0 + r, N - 1);
    auto wp = w + size_t(n) * size_t(wrow) + size_t(k0 / PER_WORD);
#pragma unroll
    for (int wi = 0; wi < WPL; ++wi) {
      const unsigned word = wp[wi];
#pragma unroll
      for (int i = 0; i < PER_WORD; ++i) {
        q[r][wi * PER_WORD + i] = float((word >> (unsigned(i) * BITS)) & MASK);
      }
    }
    sc[r] = static_cast<float>(scales[size_t(n) * size_t(n_groups) + size_t(g)]);
    bi[r] = static_cast<float>(biases[size_t(n) * size_t(n_groups) + size_t(g)]);
  }
#pragma unroll
  for (int m = 0; m < M; ++m) {
    auto xr = x + size_t(m) * size_t(K) + size_t(k0);
    float xv[VPT];
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      xv[i] = static_cast<float>(xr[i]);
    }
    const float xs = __fadd_rn(__fadd_rn(__fadd_rn(xv[0], xv[1]), __fadd_rn(xv[2], xv[3])),
                               __fadd_rn(__fadd_rn(xv[4], xv[5]), __fadd_rn(xv[6], xv[7])));
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float p[VPT];
#pragma unroll
      for (int i = 0; i < VPT; ++i) {
        p[i] = __fmul_rn(xv[i], q[r][i]);
      }
      const float dq = __fadd_rn(__fadd_rn(__fadd_rn(p[0], p[1]), __fadd_rn(p[2], p[3])),
                                 __fadd_rn(__fadd_rn(p[4], p[5]), __fadd_rn(p[6], p[7])));
      const float a = __fmul_rn(sc[r], dq);
      const float b = __fmul_rn(bi[r], xs);
      acc[m][r] = __fadd_rn(acc[m][r], __fadd_rn(a, b));
    }
  }
}

#pragma unroll
for (int r = 0; r < R; ++r) {
#pragma unroll
  for (int m = 0; m < M; ++m) {
    float v = acc[m][r];
    v = __fadd_rn(v, __shfl_xor_sync(FULL, v, 1));
    v = __fadd_rn(v, __shfl_xor_sync(FULL, v, 2));
    v = __fadd_rn(v, __shfl_xor_sync(FULL, v, 4));
    v = __fadd_rn(v, __shfl_xor_sync(FULL, v, 8));
    v = __fadd_rn(v, __shfl_xor_sync(FULL, v, 16));
    if (lane == (m * R + r) % 32 && n0 + r < N) {
      y[size_t(m) * size_t(N) + size_t(n0 + r)] = static_cast<T>(v);
    }
  }
}
