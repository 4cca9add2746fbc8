// CpuBackend: heap memory as the device tier, the thread copy engine, and the fp32
// kernels of cpu_kernels.h on a fixed thread pool.
#include "backend/cpu/cpu_backend.h"

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <unordered_map>

#include "backend/cpu/cpu_kernels.h"
#include "core/thread_pool.h"
#include "io/thread_copy_engine.h"

namespace spillway {

namespace {

const BackendSizes& sizes() { return cpu_backend_sizes(); }

size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

float* f(void* p) { return static_cast<float*>(p); }
const float* f(const void* p) { return static_cast<const float*>(p); }

// Aligned allocations of one kind, with their sizes, so that bytes in use can be
// reported and what the user did not free is freed with the backend.
class AllocationTable {
 public:
  ~AllocationTable() {
    for (auto& [p, bytes] : sizes_) std::free(p);
  }
  Result<void*> allocate(size_t bytes, size_t alignment, const char* what) {
    const size_t rounded = round_up(bytes == 0 ? 1 : bytes, alignment);
    void* p = std::aligned_alloc(alignment, rounded);
    if (p == nullptr)
      return Status::out_of_memory(std::string("cpu backend: ") + what + " allocation of " + std::to_string(bytes) +
                                   " bytes failed (" + std::to_string(in_use()) + " bytes in use)");
    std::lock_guard<std::mutex> lock(mu_);
    sizes_[p] = rounded;
    in_use_ += rounded;
    peak_ = std::max(peak_, in_use_);
    return p;
  }
  void release(void* p, const char* what) {
    if (p == nullptr) return;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = sizes_.find(p);
      if (it == sizes_.end()) {
        // Freeing memory this backend did not hand out would corrupt the heap.
        std::fprintf(stderr, "spillway: cpu backend: %s_free of %p, which is not a live %s allocation\n", what, p,
                     what);
        std::abort();
      }
      in_use_ -= it->second;
      sizes_.erase(it);
    }
    std::free(p);
  }
  size_t in_use() const {
    std::lock_guard<std::mutex> lock(mu_);
    return in_use_;
  }
  // The most in_use() was since construction or reset_peak().
  size_t peak() const {
    std::lock_guard<std::mutex> lock(mu_);
    return peak_;
  }
  void reset_peak() {
    std::lock_guard<std::mutex> lock(mu_);
    peak_ = in_use_;
  }

 private:
  mutable std::mutex mu_;
  std::unordered_map<void*, size_t> sizes_;
  size_t in_use_ = 0;  // bytes (rounded sizes)
  size_t peak_ = 0;    // bytes
};

class CpuBackend final : public Backend {
 public:
  CpuBackend(int threads, std::unique_ptr<CopyEngine> copy_engine)
      : pool_(threads), copy_engine_(std::move(copy_engine)) {}
  ~CpuBackend() override { copy_engine_.reset(); }  // finish queued copies before memory goes
  // Ok, or why the thread pool could not start its threads.
  const Status& pool_status() const { return pool_.status(); }

  std::string name() const override { return sizes().name(); }
  std::string description() const override { return "CPU, " + std::to_string(pool_.size()) + " threads"; }
  DType activation_dtype() const override { return sizes().activation_dtype(); }
  size_t alignment() const override { return sizes().alignment(); }

  size_t device_capacity() const override { return SIZE_MAX; }
  size_t device_free_bytes() const override { return SIZE_MAX - device_.in_use(); }
  Result<void*> device_alloc(size_t bytes) override { return device_.allocate(bytes, sizes().alignment(), "device"); }
  void device_free(void* p) override { device_.release(p, "device"); }
  Result<void*> host_alloc(size_t bytes) override {
    return host_.allocate(bytes, static_cast<size_t>(sysconf(_SC_PAGESIZE)), "host");
  }
  void host_free(void* p) override { host_.release(p, "host"); }
  CopyEngine& copy_engine() override { return *copy_engine_; }
  Status synchronize() override { return copy_engine_->wait_all(); }

  Status upload(void* dev, const void* host, size_t bytes) override {
    if (bytes > 0) std::memcpy(dev, host, bytes);
    return Status::ok();
  }
  Status download(void* host, const void* dev, size_t bytes) override {
    if (bytes > 0) std::memcpy(host, dev, bytes);
    return Status::ok();
  }
  void fill_zero(void* dev, size_t bytes) override {
    if (bytes > 0) std::memset(dev, 0, bytes);
  }
  void copy_device(void* dst, const void* src, size_t bytes) override {
    if (bytes > 0 && dst != src) std::memmove(dst, src, bytes);
  }
  size_t device_used_bytes() const override { return device_.in_use(); }
  size_t device_peak_bytes() const override { return device_.peak(); }
  void reset_device_peak() override { device_.reset_peak(); }
  size_t allocation_granularity() const override { return sizes().allocation_granularity(); }
  uint64_t host_mapping_device_bytes(uint64_t host_bytes) const override {
    return sizes().host_mapping_device_bytes(host_bytes);
  }

  // No op needs device workspace (cpu_backend_sizes).
  size_t embedding_backward_workspace(int B, int T) const override {
    return sizes().embedding_backward_workspace(B, T);
  }
  size_t layernorm_backward_workspace(int N, int C) const override {
    return sizes().layernorm_backward_workspace(N, C);
  }
  size_t rmsnorm_backward_workspace(int N, int C) const override {
    return sizes().rmsnorm_backward_workspace(N, C);
  }
  size_t matmul_workspace(int N, int OC, bool backward, bool dbias) const override {
    return sizes().matmul_workspace(N, OC, backward, dbias);
  }
  size_t attention_backward_workspace(int B, int T, int NH) const override {
    return sizes().attention_backward_workspace(B, T, NH);
  }
  size_t squared_norm_workspace() const override { return sizes().squared_norm_workspace(); }
  void set_workspace(void*, size_t) override {}
  Status use_own_workspace(size_t) override { return Status::ok(); }

  using Backend::embedding_backward;
  using Backend::embedding_forward;
  using Backend::matmul_backward;
  using Backend::matmul_forward;
  void embedding_forward(void* out, const int32_t* tokens, const void* wte, const void* wpe, int B, int T, int C,
                         int vocab_begin, int vocab_rows) override {
    std::lock_guard<std::mutex> lock(compute_mu_);
    cpu::embedding_forward(pool_, f(out), tokens, f(wte), f(wpe), B, T, C, vocab_begin, vocab_rows);
  }
  void embedding_backward(void* dwte, void* dwpe, const void* dout, const int32_t* tokens, int B, int T, int C,
                          int vocab_begin, int vocab_rows) override {
    std::lock_guard<std::mutex> lock(compute_mu_);
    cpu::embedding_backward(pool_, f(dwte), f(dwpe), f(dout), tokens, B, T, C, vocab_begin, vocab_rows);
  }
  void layernorm_forward(void* out, float* mean, float* rstd, const void* inp, const void* weight,
                         const void* bias, int N, int C) override {
    std::lock_guard<std::mutex> lock(compute_mu_);
    cpu::layernorm_forward(pool_, f(out), mean, rstd, f(inp), f(weight), f(bias), N, C);
  }
  void layernorm_backward(void* dinp, void* dweight, void* dbias, const void* dout, const void* inp,
                          const void* weight, const float* mean, const float* rstd, int N, int C) override {
    std::lock_guard<std::mutex> lock(compute_mu_);
    cpu::layernorm_backward(pool_, f(dinp), f(dweight), f(dbias), f(dout), f(inp), f(weight), mean, rstd, N, C);
  }
  void rmsnorm_forward(void* out, float* rstd, const void* inp, const void* weight, int N, int C,
                       float eps) override {
    std::lock_guard<std::mutex> lock(compute_mu_);
    cpu::rmsnorm_forward(pool_, f(out), rstd, f(inp), f(weight), N, C, eps);
  }
  void rmsnorm_backward(void* dinp, void* dweight, const void* dout, const void* inp, const void* weight,
                        const float* rstd, int N, int C) override {
    std::lock_guard<std::mutex> lock(compute_mu_);
    cpu::rmsnorm_backward(pool_, f(dinp), f(dweight), f(dout), f(inp), f(weight), rstd, N, C);
  }
  void matmul_forward(void* out, const void* inp, const void* weight, const void* bias, int N, int C, int OC,
                      int ld_out) override {
    std::lock_guard<std::mutex> lock(compute_mu_);
    cpu::matmul_forward(pool_, f(out), f(inp), f(weight), f(bias), N, C, OC, ld_out);
  }
  void matmul_backward(void* dinp, void* dweight, void* dbias, const void* dout, const void* inp,
                       const void* weight, int N, int C, int OC, int ld_dout, bool accumulate_dinp) override {
    std::lock_guard<std::mutex> lock(compute_mu_);
    cpu::matmul_backward(pool_, f(dinp), f(dweight), f(dbias), f(dout), f(inp), f(weight), N, C, OC, ld_dout,
                         accumulate_dinp);
  }
  using Backend::attention_backward;
  using Backend::attention_forward;
  void attention_forward(void* out, float* lse, const void* qkv, int B, int T, int C, int NH, int KVH) override {
    std::lock_guard<std::mutex> lock(compute_mu_);
    cpu::attention_forward(pool_, f(out), lse, f(qkv), B, T, C, NH, KVH);
  }
  void attention_backward(void* dqkv, const void* dout, const void* qkv, const void* out, const float* lse,
                          int B, int T, int C, int NH, int KVH) override {
    std::lock_guard<std::mutex> lock(compute_mu_);
    cpu::attention_backward(pool_, f(dqkv), f(dout), f(qkv), f(out), lse, B, T, C, NH, KVH);
  }
  void rope_forward(void* out, const void* inp, int B, int T, int NH, int KVH, int D,
                    const RopeParams& rope) override {
    std::lock_guard<std::mutex> lock(compute_mu_);
    cpu::rope(pool_, f(out), f(inp), B, T, NH, KVH, D, rope, 1.0f);
  }
  void rope_backward(void* dinp, const void* dout, int B, int T, int NH, int KVH, int D,
                     const RopeParams& rope) override {
    std::lock_guard<std::mutex> lock(compute_mu_);
    cpu::rope(pool_, f(dinp), f(dout), B, T, NH, KVH, D, rope, -1.0f);
  }
  void swiglu_forward(void* out, const void* inp, int64_t N, int I) override {
    std::lock_guard<std::mutex> lock(compute_mu_);
    cpu::swiglu_forward(pool_, f(out), f(inp), N, I);
  }
  void swiglu_backward(void* dinp, const void* inp, const void* dout, int64_t N, int I) override {
    std::lock_guard<std::mutex> lock(compute_mu_);
    cpu::swiglu_backward(pool_, f(dinp), f(inp), f(dout), N, I);
  }
  void gelu_forward(void* out, const void* inp, size_t n) override {
    std::lock_guard<std::mutex> lock(compute_mu_);
    cpu::gelu_forward(pool_, f(out), f(inp), n);
  }
  void gelu_backward(void* dinp, const void* inp, const void* dout, size_t n) override {
    std::lock_guard<std::mutex> lock(compute_mu_);
    cpu::gelu_backward(pool_, f(dinp), f(inp), f(dout), n);
  }
  void residual_forward(void* out, const void* a, const void* b, size_t n) override {
    std::lock_guard<std::mutex> lock(compute_mu_);
    cpu::residual_forward(pool_, f(out), f(a), f(b), n);
  }
  using Backend::crossentropy_backward;
  using Backend::crossentropy_forward;
  void crossentropy_forward(float* losses, const void* logits, const int32_t* targets, int N, int V,
                            int ld) override {
    std::lock_guard<std::mutex> lock(compute_mu_);
    cpu::crossentropy_forward(pool_, losses, f(logits), targets, N, V, ld);
  }
  void crossentropy_backward(float* losses, void* logits_to_dlogits, const int32_t* targets, int N, int V, int ld,
                             float dloss_scale) override {
    std::lock_guard<std::mutex> lock(compute_mu_);
    cpu::crossentropy_backward(pool_, losses, f(logits_to_dlogits), targets, N, V, ld, dloss_scale);
  }
  void squared_norm(float* out_sq, const void* grad, size_t n) override {
    std::lock_guard<std::mutex> lock(compute_mu_);
    cpu::squared_norm(pool_, out_sq, f(grad), n);
  }
  void clip_scale(float* scale_norm, const float* sq, int P, float max_norm) override {
    clip_scale_host(scale_norm, sq, P, max_norm);
  }
  void adamw(void* param, float* master, float* m, float* v, const void* grad, const float* scale_norm, size_t n,
             const AdamWHyper& hyper) override {
    adamw_host(DType::F32, param, master, m, v, grad, scale_norm, n, hyper);
  }

 private:
  // Ops may be called from more than one thread; they run one at a time on the pool.
  std::mutex compute_mu_;
  ThreadPool pool_;
  std::unique_ptr<CopyEngine> copy_engine_;
  AllocationTable device_;
  AllocationTable host_;
};

}  // namespace

Result<std::unique_ptr<Backend>> make_cpu_backend(const BackendOptions& options) {
  if (options.threads < 0)
    return Status::invalid_argument("cpu backend: threads must be >= 0 (0 = all cores), got " +
                                    std::to_string(options.threads));
  std::unique_ptr<CopyEngine> copy_engine = make_thread_copy_engine();
  if (!copy_engine) return Status::internal("cpu backend: the thread copy engine could not be created");
  auto backend = std::make_unique<CpuBackend>(options.threads, std::move(copy_engine));
  SPILLWAY_RETURN_IF_ERROR(backend->pool_status().with_context("cpu backend"));
  return std::unique_ptr<Backend>(std::move(backend));
}

}  // namespace spillway
