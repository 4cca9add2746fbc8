// Internal to the CUDA attention kernels (attention.cu, attention_sm90a.cu): what both
// use: shared-memory addresses, cp.async copies, bf16 packing, and where one head's
// operands sit in the fused layouts.
//
//   cp_async16(smem_addr(tile + i), src, valid);   // 16 bytes, zeros when !valid
//   cp_async_commit();
//   cp_async_wait<0>();
//   double_buffer_step<false>(i + 1 < n, [&] { /* cp_async16 into the other buffer */ });
//   uint32_t two = pack_bf16(lo, hi);
//   const HeadView hv = head_view<HD, kGrouped>(qkv, dout, lse, D, b, h, kvh, T, C, NH, KVH);
//   load(hv.k + t * hv.ld);                        // key row t of key/value head kvh
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

// One step of a double-buffered cp.async loop: when `more`, starts the next stage's
// loads (load_next, which issues cp_async16 into the other buffer) and waits for all
// but that group, else waits for everything; then makes the current stage visible to
// every thread of the block. kAsyncProxy: the tiles are read by wgmma (the async
// proxy) after being written through the generic one, so a proxy fence comes first.
template <bool kAsyncProxy, class LoadNext>
__device__ __forceinline__ void double_buffer_step(bool more, LoadNext&& load_next) {
  if (more) {
    load_next();
    cp_async_commit();
    cp_async_wait<1>();
  } else {
    cp_async_wait<0>();
  }
  if constexpr (kAsyncProxy) asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
}

// Two floats rounded to bf16 (nearest even), `lo` in the low half.
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// One attention head's operands for batch b, query head h and key/value head kvh
// (h / (NH / KVH); with KVH = NH, kvh = h). qkv is [B,T,(NH+2·KVH)·HD] (kGrouped) or
// [B,T,3C] with KVH = NH; dout is [B,T,C]; lse and D are [B,NH,T].
struct HeadView {
  size_t ld;         // elements from one token's qkv row to the next
  const bf16* q;     // [T] rows of HD at stride ld: query head h
  const bf16* k;     // [T] rows of HD at stride ld: key head kvh
  const bf16* v;     // [T] rows of HD at stride ld: value head kvh
  const bf16* dout;  // [T] rows of HD at stride C: the output gradient of head h (nullptr without dout)
  const float* lse;  // [T] of head h; head h + i at +i·T (nullptr without lse)
  const float* D;    // [T] of head h, as lse (nullptr without D)
};

template <int HD, bool kGrouped>
__device__ __forceinline__ HeadView head_view(const bf16* qkv, const bf16* dout, const float* lse, const float* D,
                                              int b, int h, int kvh, int T, int C, int NH, int KVH) {
  HeadView hv;
  hv.ld = kGrouped ? static_cast<size_t>(NH + 2 * KVH) * HD : 3 * static_cast<size_t>(C);
  const bf16* row0 = qkv + static_cast<size_t>(b) * T * hv.ld;
  hv.q = row0 + h * HD;
  hv.k = kGrouped ? row0 + (NH + kvh) * HD : hv.q + C;
  hv.v = kGrouped ? hv.k + KVH * HD : hv.q + 2 * C;
  const size_t head_rows = (static_cast<size_t>(b) * NH + h) * T;
  hv.dout = dout ? dout + static_cast<size_t>(b) * T * C + h * HD : nullptr;
  hv.lse = lse ? lse + head_rows : nullptr;
  hv.D = D ? D + head_rows : nullptr;
  return hv;
}

}  // namespace spillway::cuda_detail::attention_ptx
