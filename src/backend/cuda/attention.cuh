// Internal to the CUDA backend: fused causal self-attention, flash style (no T×T
// matrix in device memory), deterministic (no atomics).
//
//   cudaError_t e = launch_attention_forward(out, lse, qkv, B, T, C, NH, KVH, stream);
//   size_t need = cuda_workspace::attention_backward_scratch_bytes(B, T, NH);
//   e = launch_attention_backward(dqkv, dout, qkv, out, lse, B, T, C, NH, KVH, scratch, stream);
//
// Head dims that are multiples of 16 up to 128 run on tensor cores (mma.sync bf16,
// fp32 accumulation; head dims 64, 80 and 128 on Hopper with wgmma, forward and
// backward, attention_sm90a.cu); other head dims up to 256 run on a simple
// warp-per-row kernel. The backward pass recomputes P from q, k and lse, with
// D = rowsum(dO∘O);
// one kernel is parallel over key blocks (dK, dV), a second over query blocks (dQ).
// Grouped-query attention (KVH < NH key/value heads): the dK/dV kernel's block for a
// key/value head runs its NH/KVH query heads one after the other, summing in
// registers (fixed order, no atomics); with KVH = NH it is plain multi-head attention.
#pragma once

#include "backend/backend_sizes.h"
#include "backend/cuda/cuda_common.cuh"

namespace spillway::cuda_detail {

// Largest head dim the attention kernels take.
constexpr int kMaxHeadDim = 256;

// True when head dim `hd` (with these pointers) takes the tensor-core kernels.
bool attention_uses_tensor_cores(int hd, const void* qkv);

// Which kernels run where both could: kAuto takes the Hopper (wgmma) kernels, forward
// and backward, for head dims 64, 80 and 128 on a compute capability 9.0 device, kMma
// the mma.sync kernels everywhere (SPILLWAY_CUDA_ATTENTION=mma, for comparing the two).
enum class AttentionKernel { kAuto, kMma };

// out[B,T,C], lse[B,NH,T] (F32, natural log), qkv[B,T,(NH+2·KVH)·D], D = C/NH (NH
// query heads, KVH key heads, KVH value heads; NH % KVH == 0). `sm90`: the device
// is compute capability 9.0 (H100, H200).
cudaError_t launch_attention_forward(bf16* out, float* lse, const bf16* qkv, int B, int T, int C, int NH,
                                     int KVH, cudaStream_t stream, bool sm90 = false,
                                     AttentionKernel kernel = AttentionKernel::kAuto);

// The Hopper kernels (attention_sm90a.cu): head dims 64, 80 and 128
// (attention_wgmma_takes), 16-byte aligned qkv and out; same arguments as
// launch_attention_forward. attention_wgmma_built() is false where that file was not
// built for sm_90a.
bool attention_wgmma_built();
bool attention_wgmma_takes(int hd);
cudaError_t launch_attention_forward_wgmma(bf16* out, float* lse, const bf16* qkv, int B, int T, int C, int NH,
                                           int KVH, cudaStream_t stream);
// Its backward (dK/dV, then dQ) from D[B,NH,T] = rowsum(dout ∘ out), computed first.
cudaError_t launch_attention_backward_wgmma(bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse,
                                            const float* D, int B, int T, int C, int NH, int KVH,
                                            cudaStream_t stream);

// scratch: cuda_workspace::attention_backward_scratch_bytes(B, T, NH) (D, [B,NH,T] F32).
// dqkv[B,T,(NH+2·KVH)·D] (overwritten) from dout[B,T,C], qkv, out[B,T,C], lse[B,NH,T].
cudaError_t launch_attention_backward(bf16* dqkv, const bf16* dout, const bf16* qkv, const bf16* out,
                                      const float* lse, int B, int T, int C, int NH, int KVH, void* scratch,
                                      cudaStream_t stream, bool sm90 = false,
                                      AttentionKernel kernel = AttentionKernel::kAuto);

}  // namespace spillway::cuda_detail
