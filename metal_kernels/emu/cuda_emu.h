// cuda_emu.h: run the CUDA twins (mx.fast.cuda_kernel bodies) on the same CPU emulator as Metal.
//
// Maps the CUDA built-ins the twins use onto metal_emu's runtime: a block is a threadgroup, a warp is
// a 32-lane SIMD group (consecutive linear thread indices, as on NVIDIA GPUs), __syncthreads is a
// threadgroup barrier and __shfl_*_sync are SIMD shuffles. The harness launches full blocks (grid
// rounded up to a multiple of the block, as MLX's CUDA backend does), declares template arguments as
// constexpr values / type aliases at the top of the body, and rewrites `__shared__ T name[N];` into
// per-block storage. Only full-warp masks (0xffffffff) are modelled; NVRTC specifics (headers, the
// mlx::core::cu namespace, `inf`), independent thread scheduling inside a warp, cooperative groups,
// atomics on shared memory, tensor cores and warp-level matrix ops are not.
#pragma once

#include "metal_emu.h"

namespace metal_emu {
namespace cuda {
inline uint3 thread_idx() { return g_cur->a.thread_position_in_threadgroup; }
inline uint3 block_idx() { return g_cur->a.threadgroup_position_in_grid; }
inline uint3 block_dim() { return g_cur->a.dispatch_threads_per_threadgroup; }
inline uint3 grid_dim() { return g_cur->a.threadgroups_per_grid; }
inline void full_mask(unsigned mask, const char* fn) {
  if (mask != 0xffffffffu) report("%s with a partial mask 0x%08x is not modelled", fn, mask);
}
}  // namespace cuda
}  // namespace metal_emu

typedef half __half;
typedef bfloat16_t __nv_bfloat16;

inline void __syncthreads() { metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup); }
inline void __syncwarp(unsigned mask = 0xffffffffu) {
  metal_emu::cuda::full_mask(mask, "__syncwarp");
  metal::simdgroup_barrier(metal::mem_flags::mem_none);
}
template <class T>
inline T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
  metal_emu::cuda::full_mask(mask, "__shfl_sync");
  if (width != 32) metal_emu::report("__shfl_sync width %d is not modelled", width);
  return metal::simd_shuffle(v, src);
}
template <class T>
inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  metal_emu::cuda::full_mask(mask, "__shfl_xor_sync");
  if (width != 32) metal_emu::report("__shfl_xor_sync width %d is not modelled", width);
  return metal::simd_shuffle_xor(v, lane_mask);
}
template <class T>
inline T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  metal_emu::cuda::full_mask(mask, "__shfl_up_sync");
  if (width != 32) metal_emu::report("__shfl_up_sync width %d is not modelled", width);
  return metal::simd_shuffle_up(v, delta);  // lanes below delta keep their value, as in CUDA
}
template <class T>
inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  metal_emu::cuda::full_mask(mask, "__shfl_down_sync");
  if (width != 32) metal_emu::report("__shfl_down_sync width %d is not modelled", width);
  return metal::simd_shuffle_down(v, delta);  // lanes past the top keep their value, as in CUDA
}
inline float __int_as_float(int x) { return std::bit_cast<float>(x); }
inline int __float_as_int(float x) { return std::bit_cast<int>(x); }
inline unsigned __float_as_uint(float x) { return std::bit_cast<unsigned>(x); }
inline float __uint_as_float(unsigned x) { return std::bit_cast<float>(x); }
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return uint4(a, b, c, d); }
inline float __fadd_rn(float a, float b) { return a + b; }  // compiled with -ffp-contract=off
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline float __fdiv_rn(float a, float b) { return a / b; }

#define threadIdx (metal_emu::cuda::thread_idx())
#define blockIdx (metal_emu::cuda::block_idx())
#define blockDim (metal_emu::cuda::block_dim())
#define gridDim (metal_emu::cuda::grid_dim())
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__
#define __grid_constant__
