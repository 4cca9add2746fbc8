// Internal to the CUDA backend: launchers of the fused, deterministic kernels of a
// GPT step (everything but matrix products and attention). Every launcher enqueues
// on `stream` and returns the launch error (cudaSuccess when it was enqueued).
// No kernel uses atomics: every reduction runs in a fixed order, so the same
// inputs give the same bits on every run.
//
//   size_t need = cuda_workspace::layernorm_backward_scratch_bytes(N, C);  // caller owns scratch
//   cudaError_t e = launch_layernorm_backward(dinp, dw, db, dout, inp, w, mean, rstd,
//                                             N, C, scratch, stream);
#pragma once

#include <cstddef>
#include <cstdint>

#include "backend/backend_sizes.h"
#include "backend/cuda/cuda_common.cuh"
#include "optim/adamw.h"

namespace spillway::cuda_detail {

// out[b,t,:] = wte[tokens[b,t] - vocab_begin] + wpe[t] where tokens[b,t] is in
// [vocab_begin, vocab_begin + vocab_rows); other rows of out are not written.
// wte[vocab_rows,C] (a tile of the table; vocab_rows may be INT_MAX: every token),
// wpe[T_max,C] or null (no position table: out = wte row alone), tokens[B,T].
cudaError_t launch_embedding_forward(bf16* out, const int32_t* tokens, const bf16* wte, const bf16* wpe,
                                     int B, int T, int C, int vocab_begin, int vocab_rows,
                                     cudaStream_t stream);

// Scratch for launch_embedding_backward: cuda_workspace::embedding_backward_scratch_bytes(N),
// the (row, position) pairs before and after sorting, then CUB's temporary storage.
// What CUB itself asks for that storage with N pairs (on this device), to check the
// bound cuda_workspace::embedding_sort_temp_bytes against; fails only if CUB cannot size it.
cudaError_t embedding_sort_temp_query(int N, size_t* bytes);
// dwte[row,C] += Σ over the positions whose token is vocab_begin + row of dout (in
// position order), for the tokens in [vocab_begin, vocab_begin + vocab_rows) only;
// dwpe[T_max,C] += Σ_b dout[b,t] (b in order) unless dwpe is null. dout[B,T,C],
// tokens[B,T].
cudaError_t launch_embedding_backward(bf16* dwte, bf16* dwpe, const bf16* dout, const int32_t* tokens,
                                      int B, int T, int C, int vocab_begin, int vocab_rows, void* scratch,
                                      size_t scratch_bytes, cudaStream_t stream);

// out[N,C] = (inp - mean) * rstd * weight + bias; mean[N], rstd[N] (F32, may be null).
cudaError_t launch_layernorm_forward(bf16* out, float* mean, float* rstd, const bf16* inp,
                                     const bf16* weight, const bf16* bias, int N, int C,
                                     cudaStream_t stream);

// scratch: cuda_workspace::layernorm_backward_scratch_bytes(N, C).
// dinp[N,C] += ..., dweight[C] += ..., dbias[C] += ...; dout[N,C], inp[N,C],
// weight[C], mean[N], rstd[N].
cudaError_t launch_layernorm_backward(bf16* dinp, bf16* dweight, bf16* dbias, const bf16* dout,
                                      const bf16* inp, const bf16* weight, const float* mean,
                                      const float* rstd, int N, int C, void* scratch,
                                      cudaStream_t stream);

// out[N,C] = inp * rstd * weight; rstd[N] = 1/sqrt(mean(inp²) + eps) (F32, may be null).
cudaError_t launch_rmsnorm_forward(bf16* out, float* rstd, const bf16* inp, const bf16* weight, int N, int C,
                                   float eps, cudaStream_t stream);
// scratch: cuda_workspace::rmsnorm_backward_scratch_bytes(N, C).
// dinp[N,C] += ..., dweight[C] += ... (chunks of rows in order); dout[N,C], inp[N,C],
// weight[C], rstd[N].
cudaError_t launch_rmsnorm_backward(bf16* dinp, bf16* dweight, const bf16* dout, const bf16* inp,
                                    const bf16* weight, const float* rstd, int N, int C, void* scratch,
                                    cudaStream_t stream);

// scratch: cuda_workspace::bias_backward_scratch_bytes(N, OC).
// dbias[OC] += Σ_n dout[n, :]; dout[N,OC] with rows ld_dout ≥ OC elements apart.
cudaError_t launch_bias_backward(bf16* dbias, const bf16* dout, int N, int OC, int ld_dout, void* scratch,
                                 cudaStream_t stream);

// out[n] = gelu(inp[n]) (tanh approximation); dinp[n] = gelu'(inp[n]) * dout[n].
cudaError_t launch_gelu_forward(bf16* out, const bf16* inp, size_t n, cudaStream_t stream);
cudaError_t launch_gelu_backward(bf16* dinp, const bf16* inp, const bf16* dout, size_t n,
                                 cudaStream_t stream);
// out[n] = a[n] + b[n]
cudaError_t launch_residual_forward(bf16* out, const bf16* a, const bf16* b, size_t n,
                                    cudaStream_t stream);

// Largest head size launch_rope takes (its frequencies travel as a kernel argument).
constexpr int kMaxRopeHeadDim = 256;
// RoPE on a qkv-layout tensor inp/out[B,T,(NH+2·KVH)·D] (tensor/rope.h): pair (i, i+D/2)
// of each q and k head turned by float(t)·inv_freq[i] (sign = -1: the transpose, for
// gradients), v heads copied. inv_freq[D/2] from rope_inv_freq on the host; D even,
// at most kMaxRopeHeadDim. One thread per (row, 8 pairs) (D % 16 == 0 and 16-byte
// aligned pointers) or per (row, pair): it computes its cos/sin once for every head.
cudaError_t launch_rope(bf16* out, const bf16* inp, int B, int T, int NH, int KVH, int D, const float* inv_freq,
                        float sign, cudaStream_t stream);

// SwiGLU: inp[N,2I] = [gate | up]; out[N,I] = silu(gate)·up, fp32 math, rounded once.
cudaError_t launch_swiglu_forward(bf16* out, const bf16* inp, int64_t N, int I, cudaStream_t stream);
// dinp[N,2I] = [dout·up·silu'(gate) | dout·silu(gate)] (overwritten); dout[N,I].
cudaError_t launch_swiglu_backward(bf16* dinp, const bf16* inp, const bf16* dout, int64_t N, int I,
                                   cudaStream_t stream);

// losses[N] = -log softmax(logits[N,V])[targets[N]], rows of logits ld ≥ V apart. With
// `backward`, logits[:, :V] is overwritten with (softmax - onehot) * dlogits_scale
// (else only read).
cudaError_t launch_crossentropy(float* losses, bf16* logits, const int32_t* targets, int N, int V, int ld,
                                bool backward, float dlogits_scale, cudaStream_t stream);

// scratch: cuda_workspace::squared_norm_scratch_bytes().
// out_sq[0] = Σ grad[i]²; grad[n]. Two passes: squared_norm_partials(n) partial sums
// (each block's share, grid-stride), then one block adds them and the tail. Adds the
// number of kernels it launched to *launches (when not null).
cudaError_t launch_squared_norm(float* out_sq, const bf16* grad, size_t n, void* scratch,
                                cudaStream_t stream, uint64_t* launches = nullptr);
// The partial sums (F32, in scratch) launch_squared_norm takes for n elements: 1 to
// cuda_workspace::kNormBlocks.
unsigned squared_norm_partials(size_t n);

// One squared_norm call of a multi-tensor batch: out_sq[0] = Σ grad[i]², grad[n].
struct SquaredNormCall {
  float* out_sq;     // [1] F32
  const bf16* grad;  // [n]
  size_t n;
};
// calls[count] in a few launches, each out_sq the same bits launch_squared_norm gives
// for that call alone (the same partials, each summed by the same tree in the same
// order): per group of calls, one launch of every call's partial sums, then one of
// every call's finish. A group holds at most kMultiNormTensors calls and as many as
// their partials fit in scratch[scratch_bytes] (at least
// cuda_workspace::squared_norm_scratch_bytes(), so that any one call fits). The calls
// must be independent: no out_sq inside another call's grad or out_sq (the caller
// checks; launch order between calls is not kept). Adds its launches to *launches.
constexpr int kMultiNormTensors = 512;
cudaError_t launch_squared_norms(const SquaredNormCall* calls, size_t count, void* scratch, size_t scratch_bytes,
                                 cudaStream_t stream, uint64_t* launches = nullptr);

// scale_norm[2] from sq[P], exactly as clip_scale_host.
cudaError_t launch_clip_scale(float* scale_norm, const float* sq, int P, float max_norm,
                              cudaStream_t stream);

// The AdamW update of optim/adamw.h, bit for bit. param[n], grad[n] bf16; master[n],
// m[n], v[n] F32; scale_norm[2]. Adds the number of kernels it launched (0 to 2) to
// *launches (when not null).
cudaError_t launch_adamw(bf16* param, float* master, float* m, float* v, const bf16* grad,
                         const float* scale_norm, size_t n, const AdamWHyper& hyper,
                         cudaStream_t stream, uint64_t* launches = nullptr);

// One adamw call of a multi-tensor batch, the arguments of launch_adamw.
struct AdamWCall {
  bf16* param;              // [n]
  float* master;            // [n] F32
  float* m;                 // [n] F32
  float* v;                 // [n] F32
  const bf16* grad;         // [n]
  const float* scale_norm;  // [2] F32, from clip_scale
  size_t n;
  AdamWHyper hyper;
};
// calls[count] in a few launches, every element the same bits as launch_adamw gives
// (the same per-element arithmetic, adamw_one): one launch per group of at most
// kMultiAdamWTensors calls with at most kMultiAdamWHypers distinct hyperparameters
// other than the weight decay (compared bit for bit; each call has its own decay).
// The calls must be independent: none writes memory another reads or writes (the
// caller checks; launch order between calls is not kept). Adds its launches to
// *launches.
constexpr int kMultiAdamWTensors = 384;
constexpr int kMultiAdamWHypers = 8;
cudaError_t launch_adamws(const AdamWCall* calls, size_t count, cudaStream_t stream, uint64_t* launches = nullptr);

}  // namespace spillway::cuda_detail
