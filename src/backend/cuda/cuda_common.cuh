// Internal to the CUDA backend: error text, bf16 vector loads, warp reductions.
//
//   cudaError_t e = launch_something(...);            // every launcher returns the
//   if (e != cudaSuccess) record(cuda_status("x", e)); // launch error, never aborts
//
//   Bf16x8 v = load8(ptr + i);                         // 16-byte load of 8 bf16
//   float s = warp_sum(partial);                       // fixed butterfly order
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "core/status.h"

namespace spillway::cuda_detail {

using bf16 = __nv_bfloat16;

// "cudaMalloc: out of memory (cudaErrorMemoryAllocation)"
inline std::string cuda_error_text(const char* what, cudaError_t e) {
  return std::string(what) + ": " + cudaGetErrorString(e) + " (" + cudaGetErrorName(e) + ")";
}

// Also clears the runtime's per-thread last error, so that a failed call (say an
// allocation) is not reported again by the next launch's cudaGetLastError().
inline Status cuda_status(const char* what, cudaError_t e) {
  if (e == cudaSuccess) return Status::ok();
  (void)cudaGetLastError();
  if (e == cudaErrorMemoryAllocation) return Status::out_of_memory(cuda_error_text(what, e));
  if (e == cudaErrorInvalidValue) return Status::invalid_argument(cuda_error_text(what, e));
  return Status::internal(cuda_error_text(what, e));
}

inline unsigned ceil_div(size_t a, size_t b) { return static_cast<unsigned>((a + b - 1) / b); }

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// Eight bf16 in one 16-byte word.
struct alignas(16) Bf16x8 {
  __nv_bfloat162 h[4];
};

__device__ __forceinline__ Bf16x8 load8(const bf16* p) {
  Bf16x8 v;
  *reinterpret_cast<uint4*>(&v) = *reinterpret_cast<const uint4*>(p);
  return v;
}

__device__ __forceinline__ void store8(bf16* p, const Bf16x8& v) {
  *reinterpret_cast<uint4*>(p) = *reinterpret_cast<const uint4*>(&v);
}

__device__ __forceinline__ void unpack8(const Bf16x8& v, float (&f)[8]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 t = __bfloat1622float2(v.h[i]);
    f[2 * i] = t.x;
    f[2 * i + 1] = t.y;
  }
}

__device__ __forceinline__ Bf16x8 pack8(const float (&f)[8]) {
  Bf16x8 v;
#pragma unroll
  for (int i = 0; i < 4; ++i) v.h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
  return v;
}

// Sum over the 32 lanes of a warp, the same butterfly order on every call.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over a block of blockDim.x threads (a multiple of 32, at most 1024); every
// thread gets the result. `shared` holds 32 floats. Fixed order: warps, then lanes.
__device__ __forceinline__ float block_sum(float v, float* shared) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();  // `shared` may still be read by an earlier call
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = lane < warps ? shared[lane] : 0.0f;
  return warp_sum(v);
}

__device__ __forceinline__ float block_max(float v, float* shared) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = lane < warps ? shared[lane] : -INFINITY;
  return warp_max(v);
}

}  // namespace spillway::cuda_detail
