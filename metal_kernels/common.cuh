// Helpers shared by the CUDA twins (passed as the `header` of mx.fast.cuda_kernel). Under the CPU
// emulator (metal_kernels/emu, METAL_EMU defined) the same names load element by element through
// the bounds-checked pointers; on a GPU they are single 16-byte loads (the callers keep every such
// address 16-byte aligned: rows of whole 32-value chunks).
#pragma once

#ifdef METAL_EMU
template <class P>
inline uint4 mlxe_ld_u4(P p) {
  return uint4(p[0], p[1], p[2], p[3]);
}
template <class P>
inline void mlxe_ld_f8(P p, float* o) {
  for (int i = 0; i < 8; ++i) o[i] = static_cast<float>(p[i]);
}
#else
__device__ __forceinline__ uint4 mlxe_ld_u4(const uint32_t* p) {
  return *reinterpret_cast<const uint4*>(p);
}
__device__ __forceinline__ void mlxe_ld_f8(const float* p, float* o) {
  const float4 a = *reinterpret_cast<const float4*>(p);
  const float4 b = *reinterpret_cast<const float4*>(p + 4);
  o[0] = a.x; o[1] = a.y; o[2] = a.z; o[3] = a.w;
  o[4] = b.x; o[5] = b.y; o[6] = b.z; o[7] = b.w;
}
__device__ __forceinline__ void mlxe_bf16x2(unsigned u, float* o) {
  o[0] = __uint_as_float(u << 16);
  o[1] = __uint_as_float(u & 0xffff0000u);
}
__device__ __forceinline__ void mlxe_ld_f8(const __nv_bfloat16* p, float* o) {
  const uint4 u = *reinterpret_cast<const uint4*>(p);
  mlxe_bf16x2(u.x, o); mlxe_bf16x2(u.y, o + 2); mlxe_bf16x2(u.z, o + 4); mlxe_bf16x2(u.w, o + 6);
}
__device__ __forceinline__ void mlxe_f16x2(unsigned u, float* o) {
  o[0] = __half2float(__ushort_as_half((unsigned short)(u & 0xffffu)));
  o[1] = __half2float(__ushort_as_half((unsigned short)(u >> 16)));
}
__device__ __forceinline__ void mlxe_ld_f8(const __half* p, float* o) {
  const uint4 u = *reinterpret_cast<const uint4*>(p);
  mlxe_f16x2(u.x, o); mlxe_f16x2(u.y, o + 2); mlxe_f16x2(u.z, o + 4); mlxe_f16x2(u.w, o + 6);
}
#endif
