// The fp32 kernels of the CPU backend, as free functions over a ThreadPool.
//
//   ThreadPool pool(4);
//   cpu::layernorm_forward(pool, out, mean, rstd, inp, weight, bias, N, C);
//   cpu::attention_forward(pool, out, lse, qkv, B, T, C, NH, /*KVH=*/NH);
//
// Every kernel is deterministic: work is split into pieces whose size depends only
// on the shapes (never on the thread count), each output element is computed by one
// thread, and every reduction has a fixed order (see vector_math.h), so the output
// bits are the same for any thread count and any (64-aligned) buffer addresses.
// Matrix products (matmul and the blocks of attention) are OpenBLAS sgemm calls,
// run single-threaded on fixed tiles of the output by the pool's threads; an sgemm
// call gives the same bits for the same arguments, so the split does not show.
//
// Accumulation conventions are those of backend/backend.h: weight and bias
// gradients and layernorm's dinp are added into; everything else is overwritten.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/thread_pool.h"
#include "tensor/rope.h"

namespace spillway::cpu {

inline constexpr float kLayerNormEps = 1e-5f;

// Sets OpenBLAS (a process-wide setting) to run each call on the calling thread;
// every kernel that calls sgemm does this first.
void use_single_threaded_blas();

// out[b,t] = wte[tokens[b,t] - vocab_begin] + wpe[t] where the token is in
// [vocab_begin, vocab_begin + vocab_rows), other rows of out untouched; tokens[B,T];
// wte[vocab_rows,C] (a vocab tile or the whole table); wpe[T_max,C] or null (then
// out = wte[...] alone); out[B,T,C].
void embedding_forward(ThreadPool& pool, float* out, const int32_t* tokens, const float* wte,
                       const float* wpe, int B, int T, int C, int vocab_begin, int vocab_rows);
// dwte[v - vocab_begin] += Σ over (b,t) with tokens[b,t] = v in range of dout[b,t];
// dwpe[T_max,C] += Σ_b dout[b,t] unless dwpe is null. dout[B,T,C]; tokens[B,T]. Each
// thread owns a channel range; each row's sum is formed from zero in token order and
// added in once (as every gradient kernel here: accumulation over micro-batches then
// equals their gradients summed in order, which data-parallel ranks rely on).
void embedding_backward(ThreadPool& pool, float* dwte, float* dwpe, const float* dout,
                        const int32_t* tokens, int B, int T, int C, int vocab_begin, int vocab_rows);

// out[N,C] = (inp - mean) * rstd * weight + bias; mean[N], rstd[N] saved; inp[N,C];
// weight[C]; bias[C]. rstd = 1 / sqrt(variance + 1e-5), variance with divisor C.
void layernorm_forward(ThreadPool& pool, float* out, float* mean, float* rstd, const float* inp,
                       const float* weight, const float* bias, int N, int C);
// dinp[N,C] += ...; dweight[C] += ...; dbias[C] += ...; dout[N,C]; inp[N,C]; weight[C];
// mean[N], rstd[N] from the forward.
void layernorm_backward(ThreadPool& pool, float* dinp, float* dweight, float* dbias, const float* dout,
                        const float* inp, const float* weight, const float* mean, const float* rstd,
                        int N, int C);

// RMSNorm (Llama): out[N,C] = inp * rstd * weight; rstd[N] = 1 / sqrt(mean(inp²) + eps)
// saved; inp[N,C]; weight[C].
void rmsnorm_forward(ThreadPool& pool, float* out, float* rstd, const float* inp, const float* weight, int N, int C,
                     float eps);
// dinp[N,C] += rstd * (dnorm - norm * mean(dnorm * norm)) with norm = inp * rstd and
// dnorm = dout * weight; dweight[C] += Σ_n dout * norm (rows in fixed blocks, in
// order). dout[N,C]; inp[N,C]; weight[C]; rstd[N] from the forward.
void rmsnorm_backward(ThreadPool& pool, float* dinp, float* dweight, const float* dout, const float* inp,
                      const float* weight, const float* rstd, int N, int C);

// out[N,OC] = inp[N,C] · weight[OC,C]ᵀ + bias[OC] (bias may be null); rows of out are
// ld_out ≥ OC floats apart.
void matmul_forward(ThreadPool& pool, float* out, const float* inp, const float* weight,
                    const float* bias, int N, int C, int OC, int ld_out);
// dinp[N,C] = dout[N,OC] · weight[OC,C] (added into dinp when accumulate_dinp);
// dweight[OC,C] += doutᵀ · inp[N,C]; dbias[OC] += Σ_n dout (when dbias is not null).
// Rows of dout are ld_dout ≥ OC floats apart. dinp null: no input gradient; dweight
// null: no parameter gradients (dbias must be null too).
void matmul_backward(ThreadPool& pool, float* dinp, float* dweight, float* dbias, const float* dout,
                     const float* inp, const float* weight, int N, int C, int OC, int ld_dout,
                     bool accumulate_dinp);

// Causal self-attention, scale 1/sqrt(D), D = C/NH. qkv[B,T,(NH+2·KVH)·D]: NH query
// heads, KVH key heads, KVH value heads; query head h uses key/value head h/(NH/KVH).
// out[B,T,C]; lse[B,NH,T] = log Σ_j exp(score) of each query row.
void attention_forward(ThreadPool& pool, float* out, float* lse, const float* qkv, int B, int T,
                       int C, int NH, int KVH);
// dqkv[B,T,(NH+2·KVH)·D] (overwritten) from dout[B,T,C], qkv, out[B,T,C], lse[B,NH,T].
// Probabilities are recomputed from q, k and lse; one thread owns each (b, key/value
// head) and adds its group's query heads into dK and dV in head order.
void attention_backward(ThreadPool& pool, float* dqkv, const float* dout, const float* qkv,
                        const float* out, const float* lse, int B, int T, int C, int NH, int KVH);

// Rotary embeddings (tensor/rope.h) of the q and k heads of inp[B,T,(NH+2·KVH)·D] into
// out (same layout; v heads copied). sign = +1: the forward rotation; −1: its
// transpose (the backward, on gradients). cos and sin of float(t)·inv_freq in fp32.
void rope(ThreadPool& pool, float* out, const float* inp, int B, int T, int NH, int KVH, int D,
          const RopeParams& rope, float sign);

// SwiGLU: inp[N,2I] = [gate | up]; out[N,I] = silu(gate)·up, silu(x) = x/(1+exp(−x)).
void swiglu_forward(ThreadPool& pool, float* out, const float* inp, int64_t N, int I);
// dinp[N,2I] = [dout·up·silu'(gate) | dout·silu(gate)] (overwritten); dout[N,I].
void swiglu_backward(ThreadPool& pool, float* dinp, const float* inp, const float* dout, int64_t N, int I);

// out[n] = gelu(inp[n]), tanh approximation, written as x · σ(2u) with
// u = √(2/π)(x + 0.044715 x³) (the same function as 0.5 x (1 + tanh u)).
void gelu_forward(ThreadPool& pool, float* out, const float* inp, size_t n);
// dinp[n] = gelu'(inp[n]) · dout[n] (overwritten).
void gelu_backward(ThreadPool& pool, float* dinp, const float* inp, const float* dout, size_t n);
// out[n] = a[n] + b[n].
void residual_forward(ThreadPool& pool, float* out, const float* a, const float* b, size_t n);

// losses[N] = -log softmax(logits[N,V])[targets[N]] (max-subtracted softmax).
// Rows of logits are ld ≥ V floats apart.
void crossentropy_forward(ThreadPool& pool, float* losses, const float* logits, const int32_t* targets,
                          int N, int V, int ld);
// losses[N] as above; logits[N,V] is overwritten with (softmax - onehot(targets)) · dloss_scale.
void crossentropy_backward(ThreadPool& pool, float* losses, float* logits, const int32_t* targets,
                           int N, int V, int ld, float dloss_scale);

// out_sq[0] = Σ grad[n]²: squares summed in double within fixed blocks of 65536
// elements, block sums added in block order, rounded once to F32.
void squared_norm(ThreadPool& pool, float* out_sq, const float* grad, size_t n);

}  // namespace spillway::cpu
