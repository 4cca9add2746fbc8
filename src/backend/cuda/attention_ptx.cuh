// Internal to the CUDA attention kernels (attention.cu, attention_sm90a.cu): the PTX
// helpers both use: shared-memory addresses, cp.async copies and bf16 packing.
//
//   cp_async16(smem_addr(tile + i), src, valid);   // 16 bytes, zeros when !valid
//   cp_async_commit();
//   cp_async_wait<0>();
//   uint32_t two = pack_bf16(lo, hi);
#pragma once

#include <cstdint>

#include "backend/cuda/cuda_common.cuh"

namespace spillway::cuda_detail::attention_ptx {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// The shared-memory address (state space .shared) of a generic pointer into it.
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes from global `src` to shared address `dst`, asynchronously; zeros when
// !valid (src is then not read).
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Waits until at most N committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Two floats rounded to bf16 (nearest even), `lo` in the low half.
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

}  // namespace spillway::cuda_detail::attention_ptx
