// Backend: the device tier's memory, its copies, and the compute ops of a GPT or Llama step.
//
//   auto backend = make_backend("cpu", {.threads = 2});       // or "cuda"
//   if (!backend) die(backend.status());
//   Backend& b = **backend;
//   auto dev = b.device_alloc(1 << 20);                       // device memory
//   b.matmul_forward(out, inp, weight, bias, N, C, OC);       // device pointers
//   SPILLWAY_RETURN_IF_ERROR(b.synchronize());
//
// Every op takes device pointers and shapes, and runs in submission order on the
// backend's compute queue (the host thread on CPU, the compute stream on CUDA).
// Tensors of "activation dtype" (act) are F32 on the CPU backend and BF16 on CUDA:
// parameters, gradients, activations, logits. Statistics (LayerNorm mean/rstd,
// attention log-sum-exp), losses and optimizer state are always F32; tokens I32.
//
// Accumulation conventions (an op "adds into" a buffer with +=, else overwrites):
// - every weight/bias gradient is added into (gradient accumulation over
//   micro-batches; the trainer zeroes gradients at the start of a step);
// - layernorm_backward adds into dinp (the residual stream's gradient);
// - all other outputs are overwritten.
//
// Determinism: the same inputs give the same output bits on every run, whatever
// the pointers' addresses (all tensors are aligned to alignment()).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend_sizes.h"
#include "core/status.h"
#include "io/copy_engine.h"
#include "optim/adamw.h"
#include "tensor/rope.h"
#include "tensor/tensor.h"

namespace spillway {

struct BackendOptions {
  int threads = 0;  // CPU worker threads; 0 = all cores
  int device = 0;   // CUDA device ordinal
};

class Communicator;  // backend/communicator.h

// name(), activation_dtype(), alignment(), allocation_granularity() and the
// workspace each op needs come from BackendSizes (backend_sizes.h).
class Backend : public BackendSizes {
 public:
  // The other ranks of a data-parallel job, for the Program's collective ops
  // (exec/dispatch.cpp); null (the default) for one rank alone, where they are errors.
  // Not owned: it must outlive the ops run on this backend.
  void set_communicator(Communicator* c) { communicator_ = c; }
  Communicator* communicator() const { return communicator_; }

  // vocab_rows of an embedding op that covers every token.
  static constexpr int kAllRows = 0x7fffffff;

  virtual ~Backend() = default;
  virtual std::string description() const = 0;  // "NVIDIA H200, 139.8 GiB" / "CPU, 2 threads"

  // ---- memory of the device tier ----
  virtual size_t device_capacity() const = 0;   // total device memory (SIZE_MAX on CPU)
  virtual size_t device_free_bytes() const = 0;
  virtual Result<void*> device_alloc(size_t bytes) = 0;
  virtual void device_free(void* p) = 0;
  // Host memory that the copy engine can move at full speed (pinned on CUDA).
  virtual Result<void*> host_alloc(size_t bytes) = 0;
  virtual void host_free(void* p) = 0;
  // Makes `bytes` of host memory the caller allocated (page-aligned) movable at full
  // speed by the copy engine (CUDA: cudaHostRegister), until unpin_host(p). Nothing to
  // do on CPU. May be called from another thread than the one running ops.
  //   SPILLWAY_RETURN_IF_ERROR(b.pin_host(buffer, bytes));  ...  b.unpin_host(buffer);
  virtual Status pin_host(void* p, size_t bytes) {
    (void)p;
    (void)bytes;
    return Status::ok();
  }
  virtual void unpin_host(void* p) { (void)p; }
  virtual CopyEngine& copy_engine() = 0;
  // Blocks until all submitted compute and copies finished; reports async errors.
  virtual Status synchronize() = 0;
  // As synchronize(), except for the optimizer's updates where the backend runs them
  // on a stream of their own (optimizer_on_own_stream(): CUDA,
  // SPILLWAY_CUDA_OPTIMIZER_STREAM): those go on, and what comes later waits for them on
  // the device only where it touches their memory (order_compute_for; upload and
  // download, where they touch the range copied), or for all of them (synchronize, a
  // collective's stream, the copy engine's copies after compute). Collectives on their
  // own stream are waited for, as by synchronize(). The executor ends a step that moves
  // nothing with it, so that the next step's forward overlaps the updates (DESIGN.md,
  // "The step is a loop"). Default: synchronize().
  virtual Status synchronize_compute() { return synchronize(); }
  // True where adamw calls run on a stream of their own: every op then says what it
  // touches (order_compute_for) before it runs.
  virtual bool optimizer_on_own_stream() const { return false; }
  // Synchronous helpers for set-up and tests (not for the hot path).
  virtual Status upload(void* dev, const void* host, size_t bytes) = 0;
  virtual Status download(void* host, const void* dev, size_t bytes) = 0;
  virtual void fill_zero(void* dev, size_t bytes) = 0;
  virtual void copy_device(void* dst, const void* src, size_t bytes) = 0;
  // Device memory this process holds beyond the CUDA context: on CUDA, the device's
  // used bytes (cudaMemGetInfo) now minus right after the context was created, before
  // the backend allocated anything; on CPU, the bytes device_alloc holds.
  virtual size_t device_used_bytes() const = 0;
  // The most device_used_bytes() was, sampled after every device allocation, since
  // the backend was created or since reset_device_peak().
  virtual size_t device_peak_bytes() const = 0;
  virtual void reset_device_peak() = 0;
  // Device memory the backend itself holds beyond the context, outside every
  // allocation it was asked for, measured once when it was made: streams, library
  // handles and the local-memory (stack) reservation of its kernels (about 266 MiB on
  // an H200). Budgets leave it out (allocatable_budgets), so that device_used_bytes()
  // stays within --device-budget. 0 on CPU.
  virtual size_t fixed_device_bytes() const { return 0; }
  // Measures fixed_device_bytes() again, for device memory the backend took since it
  // was made that no allocation accounts for: kernel code loaded lazily at a kernel's
  // first launch (warm_up_kernels runs every kernel a program needs once, before the
  // budgets are computed, so that this code is counted and never lands beyond the
  // budget in the middle of a step). Call it while no device allocation is live.
  virtual void remeasure_fixed_device_bytes() {}

  // ---- stall probes: how long the device's compute sat idle waiting for data ----
  // The executor brackets every point where compute may wait (a stream wait on a copy;
  // the host blocked on a copy, a host op or storage, with nothing more to issue) with
  // begin_stall_probe()/end_stall_probe(). On CUDA a probe is a pair of timing events
  // on the compute stream, recorded before and after the wait: the time between them on
  // the device is the time the GPU itself was idle there (zero when it still had earlier
  // work queued). On CPU compute runs on the host thread, so a probe is the host's wall
  // time. take_stall_seconds() returns the seconds of the probes that have completed
  // since its last call, and keeps the rest for a later call (after synchronize(),
  // every probe has completed).
  //
  //   auto p = b.begin_stall_probe();
  //   SPILLWAY_RETURN_IF_ERROR(b.copy_engine().order_compute_after(ticket));
  //   b.end_stall_probe(p);
  //   ...
  //   SPILLWAY_RETURN_IF_ERROR(b.synchronize());
  //   SPILLWAY_ASSIGN_OR_RETURN(double stalled, b.take_stall_seconds());
  struct StallProbe {
    uint64_t id = 0;   // the backend's own handle (CUDA: the probe's index)
    double start = 0;  // host-timed backends: the start, in seconds of a steady clock
  };
  virtual StallProbe begin_stall_probe();
  virtual void end_stall_probe(StallProbe probe);
  virtual Result<double> take_stall_seconds();

  // ---- collectives on a stream of their own (exec/dispatch.cpp) ----
  // A Communicator with a stream (NCCL: Communicator::stream()) runs its collectives
  // there, ordered with the compute queue on the device, as PyTorch's ProcessGroupNCCL
  // does, so that the host never waits and a reduce overlaps the backward after it:
  //
  //   SPILLWAY_RETURN_IF_ERROR(b.order_stream_after_compute(s));  // s waits for the inputs' producers
  //   ... enqueue the collective on s ...
  //   SPILLWAY_RETURN_IF_ERROR(b.order_after_stream(s, {{grad, bytes}, {part, bytes}}));
  //   SPILLWAY_RETURN_IF_ERROR(b.order_compute_for({{grad, bytes}}));  // before an op touching grad
  //
  // A byte range of device memory (`bytes` at `p`).
  struct DeviceRange {
    const void* p = nullptr;
    size_t bytes = 0;
    bool write = true;  // false: only read, so it waits for the work that writes it only
  };
  // Work enqueued on `stream` (a native stream of this device: a cudaStream_t on CUDA)
  // after this call runs after all compute submitted before it, held-back launches
  // included; the host does not wait. Default (CPU): synchronize(), the host waits.
  virtual Status order_stream_after_compute(void* stream);
  // The work enqueued on `stream` so far reads or writes `ranges`. Compute submitted
  // later waits for it on the device only where it touches one of them (which the
  // caller says with order_compute_for before submitting it); whatever shows device
  // memory outside the compute queue waits for all of it: synchronize(), upload(),
  // download(), and the copy engine's copies after compute. Default: a null stream
  // (work that finished before the call returned) needs nothing; any other is an
  // Unsupported error (the CPU backend has no streams).
  virtual Status order_after_stream(void* stream, const std::vector<DeviceRange>& ranges);
  // Compute submitted after this call that touches `ranges` waits (on the device) for
  // the stream work of every earlier order_after_stream, and the optimizer's updates on
  // their own stream, that writes one of them, or reads one that `ranges` writes
  // (DeviceRange::write). Default: nothing is ever pending.
  virtual Status order_compute_for(const std::vector<DeviceRange>& ranges) {
    (void)ranges;
    return Status::ok();
  }

  // ---- workspace: device memory an op uses besides its operands ----
  // (reduction partials, sort buffers, the cuBLASLt workspace.) The caller allocates
  // it once, inside the device budget, and hands it over with set_workspace before
  // running ops (the executor does this before every step); an op that needs more
  // than it was given records an Internal error naming the op and both sizes, and no
  // op allocates memory. The bytes each op needs: BackendSizes (backend_sizes.h).
  // `bytes` of device memory at `base` (aligned to alignment()), used by every op until
  // the next call; (nullptr, 0) takes it back.
  virtual void set_workspace(void* base, size_t bytes) = 0;
  // For callers that run ops directly (tests, benchmarks): the backend allocates
  // `bytes` of workspace itself (freeing one it allocated before) and uses it; 0
  // frees it. The backend frees it when it is destroyed.
  virtual Status use_own_workspace(size_t bytes) = 0;

  // ---- ops (N = B*T rows) ----
  // out[B,T,C] = wte[tokens[b,t] - vocab_begin] + wpe[t] for the positions whose token
  // is in [vocab_begin, vocab_begin + vocab_rows); other positions are left as they
  // are. wte holds those vocab_rows rows (one vocab tile of the table, or all of it).
  // wpe may be null (no position table, Llama): out = wte[...] alone.
  virtual void embedding_forward(void* out, const int32_t* tokens, const void* wte, const void* wpe,
                                 int B, int T, int C, int vocab_begin, int vocab_rows) = 0;
  void embedding_forward(void* out, const int32_t* tokens, const void* wte, const void* wpe, int B, int T,
                         int C) {
    embedding_forward(out, tokens, wte, wpe, B, T, C, 0, kAllRows);
  }
  // dwte[vocab_rows,C] += dout[b,t] at row tokens[b,t] - vocab_begin, for the tokens in
  // range, each row's additions in token order; dwpe[T_max,C] += Σ_b dout[b,t] unless
  // dwpe is null.
  virtual void embedding_backward(void* dwte, void* dwpe, const void* dout, const int32_t* tokens,
                                  int B, int T, int C, int vocab_begin, int vocab_rows) = 0;
  void embedding_backward(void* dwte, void* dwpe, const void* dout, const int32_t* tokens, int B, int T,
                          int C) {
    embedding_backward(dwte, dwpe, dout, tokens, B, T, C, 0, kAllRows);
  }
  // out[N,C] = (inp - mean) * rstd * weight + bias; mean[N], rstd[N] saved (F32)
  virtual void layernorm_forward(void* out, float* mean, float* rstd, const void* inp,
                                 const void* weight, const void* bias, int N, int C) = 0;
  // dinp[N,C] += ..., dweight[C] += ..., dbias[C] += ...
  virtual void layernorm_backward(void* dinp, void* dweight, void* dbias, const void* dout,
                                  const void* inp, const void* weight, const float* mean,
                                  const float* rstd, int N, int C) = 0;
  // RMSNorm (Llama): out[N,C] = inp * rstd * weight; rstd[N] = 1/sqrt(mean(inp²) + eps)
  // saved (F32)
  virtual void rmsnorm_forward(void* out, float* rstd, const void* inp, const void* weight, int N, int C,
                               float eps) = 0;
  // dinp[N,C] += ..., dweight[C] += ... (rstd from the forward)
  virtual void rmsnorm_backward(void* dinp, void* dweight, const void* dout, const void* inp, const void* weight,
                                const float* rstd, int N, int C) = 0;
  // out[N,OC] = inp[N,C] · weight[OC,C]ᵀ + bias[OC] (bias may be null). Rows of out
  // are ld_out ≥ OC elements apart (out may be a block of columns of a wider matrix).
  virtual void matmul_forward(void* out, const void* inp, const void* weight, const void* bias,
                              int N, int C, int OC, int ld_out) = 0;
  void matmul_forward(void* out, const void* inp, const void* weight, const void* bias, int N, int C,
                      int OC) {
    matmul_forward(out, inp, weight, bias, N, C, OC, OC);
  }
  // dinp[N,C] = dout · weight (added into dinp when accumulate_dinp);
  // dweight[OC,C] += doutᵀ · inp; dbias[OC] += Σ_n dout (if not null). Rows of dout are
  // ld_dout ≥ OC elements apart. dinp null: no input gradient (weight unread); dweight
  // null: no parameter gradients (inp unread, dbias must be null).
  virtual void matmul_backward(void* dinp, void* dweight, void* dbias, const void* dout,
                               const void* inp, const void* weight, int N, int C, int OC, int ld_dout,
                               bool accumulate_dinp) = 0;
  void matmul_backward(void* dinp, void* dweight, void* dbias, const void* dout, const void* inp,
                       const void* weight, int N, int C, int OC) {
    matmul_backward(dinp, dweight, dbias, dout, inp, weight, N, C, OC, OC, false);
  }
  // A product and the GELU after it (GPT-2's fc): pre[N,OC] = inp · weightᵀ + bias (bias
  // may be null), out[N,OC] = gelu(pre), tanh approximation. A backend may compute out
  // from the product before pre is rounded to the activation dtype (the CUDA backend's
  // cuBLASLt epilogue); the default is matmul_forward, then gelu_forward of pre.
  virtual void matmul_gelu_forward(void* out, void* pre, const void* inp, const void* weight, const void* bias,
                                   int N, int C, int OC) {
    matmul_forward(pre, inp, weight, bias, N, C, OC, OC);
    gelu_forward(out, pre, static_cast<size_t>(N) * OC);
  }
  // The input gradient of a product whose input was gelu(pre) [N,C], carried through
  // the GELU: dpre[N,C] = (dout[N,OC] · weight[OC,C]) ∘ gelu'(pre), overwritten. The
  // default: matmul_backward's dinp alone into dpre, then gelu_backward in place.
  virtual void matmul_gelu_backward(void* dpre, const void* dout, const void* weight, const void* pre, int N, int C,
                                    int OC) {
    matmul_backward(dpre, nullptr, nullptr, dout, nullptr, weight, N, C, OC, OC, false);
    gelu_backward(dpre, pre, dpre, static_cast<size_t>(N) * C);
  }
  // A product's parameter gradients alone: matmul_backward without dinp.
  void matmul_weight_backward(void* dweight, void* dbias, const void* dout, const void* inp, int N, int C, int OC) {
    matmul_backward(nullptr, dweight, dbias, dout, inp, nullptr, N, C, OC, OC, false);
  }
  // A product and the residual add after it (a block's proj and fc2): out[N,OC] =
  // residual[N,OC] + (inp · weightᵀ + bias) (bias may be null); out is not residual.
  // A backend may add the residual before the product is rounded to the activation
  // dtype (the CUDA backend's cuBLASLt product with beta = 1); the default is
  // matmul_forward into out, then residual_forward(out, residual, out): the bits of
  // the product and the residual add run apart.
  virtual void matmul_residual_forward(void* out, const void* inp, const void* weight, const void* bias,
                                       const void* residual, int N, int C, int OC) {
    matmul_forward(out, inp, weight, bias, N, C, OC, OC);
    residual_forward(out, residual, out, static_cast<size_t>(N) * OC);
  }
  // Causal self-attention, grouped-query when KVH < NH. qkv[B,T,(NH+2·KVH)·D], D = C/NH,
  // holds NH query heads, then KVH key heads, then KVH value heads, each D wide
  // (KVH = NH: [q C | k C | v C]); query head h attends with key/value head
  // h / (NH/KVH). NH % KVH == 0. out[B,T,C]; lse[B,NH,T] = log-sum-exp of each scaled
  // score row.
  virtual void attention_forward(void* out, float* lse, const void* qkv, int B, int T, int C, int NH,
                                 int KVH) = 0;
  void attention_forward(void* out, float* lse, const void* qkv, int B, int T, int C, int NH) {
    attention_forward(out, lse, qkv, B, T, C, NH, NH);
  }
  // dqkv[B,T,(NH+2·KVH)·D] = gradient (overwritten), from dout[B,T,C], qkv, out and lse
  // of the forward. A key/value head's gradient sums its NH/KVH query heads in head
  // order (no atomics).
  virtual void attention_backward(void* dqkv, const void* dout, const void* qkv, const void* out,
                                  const float* lse, int B, int T, int C, int NH, int KVH) = 0;
  void attention_backward(void* dqkv, const void* dout, const void* qkv, const void* out, const float* lse, int B,
                          int T, int C, int NH) {
    attention_backward(dqkv, dout, qkv, out, lse, B, T, C, NH, NH);
  }
  // Rotary position embeddings (tensor/rope.h) on a qkv-layout tensor
  // inp/out[B,T,(NH+2·KVH)·D]: each q and k head at position t (0..T-1 in each sequence)
  // has pair (i, i+D/2) turned by angle float(t)·rope_inv_freq(rope, D, i), in fp32;
  // the v heads are copied. D even. out is overwritten.
  virtual void rope_forward(void* out, const void* inp, int B, int T, int NH, int KVH, int D,
                            const RopeParams& rope) = 0;
  // The transpose (the inverse rotation): dinp[i] = dout[i]·cos + dout[i+D/2]·sin,
  // dinp[i+D/2] = dout[i+D/2]·cos − dout[i]·sin; v heads copied. dinp is overwritten.
  virtual void rope_backward(void* dinp, const void* dout, int B, int T, int NH, int KVH, int D,
                             const RopeParams& rope) = 0;
  // SwiGLU: inp[N,2I] = [gate | up] per row; out[N,I] = silu(gate)·up with
  // silu(x) = x/(1+exp(−x)), in fp32, rounded once.
  virtual void swiglu_forward(void* out, const void* inp, int64_t N, int I) = 0;
  // dinp[N,2I] = [dout·up·silu'(gate) | dout·silu(gate)] (overwritten); inp, dout[N,I].
  virtual void swiglu_backward(void* dinp, const void* inp, const void* dout, int64_t N, int I) = 0;
  // GELU, tanh approximation: out = 0.5 x (1 + tanh(√(2/π)(x + 0.044715 x³)))
  virtual void gelu_forward(void* out, const void* inp, size_t n) = 0;
  virtual void gelu_backward(void* dinp, const void* inp, const void* dout, size_t n) = 0;
  // out = a + b, element by element; out may be a or b (in place).
  virtual void residual_forward(void* out, const void* a, const void* b, size_t n) = 0;
  // losses[N] = -log softmax(logits[N,V])[targets]; rows of logits are ld ≥ V elements
  // apart (a padded row stride keeps rows aligned; the columns past V are not read).
  virtual void crossentropy_forward(float* losses, const void* logits, const int32_t* targets,
                                    int N, int V, int ld) = 0;
  void crossentropy_forward(float* losses, const void* logits, const int32_t* targets, int N, int V) {
    crossentropy_forward(losses, logits, targets, N, V, V);
  }
  // losses as above, and logits[:, :V] is overwritten with dloss/dlogits =
  // (softmax - onehot) * dloss_scale (dloss_scale = 1/(tokens in the step)).
  virtual void crossentropy_backward(float* losses, void* logits_to_dlogits, const int32_t* targets,
                                     int N, int V, int ld, float dloss_scale) = 0;
  void crossentropy_backward(float* losses, void* logits_to_dlogits, const int32_t* targets, int N, int V,
                             float dloss_scale) {
    crossentropy_backward(losses, logits_to_dlogits, targets, N, V, V, dloss_scale);
  }
  // out_sq[0] = Σ grad[i]² (F32, fixed reduction order)
  virtual void squared_norm(float* out_sq, const void* grad, size_t n) = 0;
  // scale_norm[0] = clip scale, scale_norm[1] = global norm, from sq[P] (see optim/adamw.h)
  virtual void clip_scale(float* scale_norm, const float* sq, int P, float max_norm) = 0;
  // One AdamW update of n elements (optim/adamw.h gives the exact arithmetic).
  // param and grad are act dtype; master, m, v F32; scale_norm from clip_scale.
  virtual void adamw(void* param, float* master, float* m, float* v, const void* grad,
                     const float* scale_norm, size_t n, const AdamWHyper& hyper) = 0;

 private:
  Communicator* communicator_ = nullptr;
  double host_stall_s_ = 0;  // host-timed probes ended since the last take_stall_seconds()
};

// "cpu" or "cuda"; "auto" picks cuda when this build has it and a GPU is present.
// A build without CUDA, or a machine without a GPU, gets a clear error for "cuda".
Result<std::unique_ptr<Backend>> make_backend(const std::string& name, const BackendOptions& options = {});
bool cuda_available();
// The GPUs this build's CUDA runtime finds (0 without CUDA, or without a GPU).
int cuda_gpu_count();

}  // namespace spillway
