// Every op of the CUDA backend against the CPU backend (the fp32 reference) on
// random inputs drawn fresh each run: relative error ‖gpu − cpu‖ / ‖cpu‖ under 1e-2
// on bf16 paths; AdamW and clip_scale bit-identical to the host kernels; every op
// gives the same bits twice; vocab tiles of the embedding and column blocks of a
// product against the whole op; the copy engine's ordering rules; errors as Status.
// Skips (GTEST_SKIP) where no GPU is present, as in CI.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iterator>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "backend/backend.h"
#include "optim/adamw.h"
#ifdef SPILLWAY_HAVE_CUDA
#include <cuda_runtime.h>

#include "backend/cuda/cuda_backend.h"
#endif
#include "support/gpu_support.h"
#include "support/test_support.h"

using namespace spillway;

namespace {

using testing_support::gpu_present;
using testing_support::ScopedEnv;

double rel_err(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = static_cast<double>(a[i]) - b[i];
    num += d * d;
    den += static_cast<double>(b[i]) * b[i];
  }
  if (std::isnan(num)) return INFINITY;
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

// A tensor held on both backends: bf16 on the GPU, F32 on the CPU, same values.
struct Pair {
  void* g = nullptr;
  void* c = nullptr;
  size_t n = 0;
  bool f32 = false;  // F32 on both (statistics, losses)
};

class CudaOps : public ::testing::Test {
 protected:
  static constexpr size_t kTestWorkspace = size_t{256} << 20;
  void SetUp() override {
    if (!gpu_present()) GTEST_SKIP() << "no CUDA GPU on this machine";
    auto g = make_backend("cuda");
    ASSERT_TRUE(g.ok()) << g.status().to_string();
    gpu_ = std::move(*g);
    // Ops called directly, outside an executor: the backend holds a workspace.
    ASSERT_TRUE(gpu_->use_own_workspace(kTestWorkspace).ok());
    auto c = make_backend("cpu", {.threads = 4});
    ASSERT_TRUE(c.ok()) << c.status().to_string();
    cpu_ = std::move(*c);
    seed_ = std::random_device{}();
    rng_.seed(seed_);
    std::printf("[ seed     ] %u  (%s)\n", seed_, gpu_->description().c_str());
  }

  // gpu_ made again while the switch `name` is 1: a fused product's epilogue, tested
  // whatever its default. Before any allocation.
  void use_gpu_with_switch_on(const char* name) {
    ASSERT_TRUE(gpu_allocs_.empty()) << "gpu_ replaced after allocations";
    ScopedEnv env(name, "1");
    auto g = make_backend("cuda");
    ASSERT_TRUE(g.ok()) << g.status().to_string();
    gpu_ = std::move(*g);
    ASSERT_TRUE(gpu_->use_own_workspace(kTestWorkspace).ok());
  }

  void TearDown() override {
    if (gpu_) {
      EXPECT_TRUE(gpu_->synchronize().is_ok());
      for (void* p : gpu_allocs_) gpu_->device_free(p);
      for (void* p : cpu_allocs_) cpu_->device_free(p);
      EXPECT_TRUE(gpu_->synchronize().is_ok());
    }
  }

  void* galloc(size_t bytes) {
    auto r = gpu_->device_alloc(bytes);
    EXPECT_TRUE(r.ok()) << r.status().to_string();
    gpu_allocs_.push_back(*r);
    return *r;
  }
  void* calloc_(size_t bytes) {
    auto r = cpu_->device_alloc(bytes);
    EXPECT_TRUE(r.ok()) << r.status().to_string();
    cpu_allocs_.push_back(*r);
    return *r;
  }

  std::vector<float> normal(size_t n, float scale = 1.0f) {
    std::normal_distribution<float> d(0.0f, scale);
    std::vector<float> v(n);
    for (auto& x : v) x = bf16_to_float(float_to_bf16(d(rng_)));  // representable in bf16
    return v;
  }

  // Activation-dtype tensor with the given values on both backends.
  Pair act(const std::vector<float>& v) {
    Pair p{galloc(v.size() * 2), calloc_(v.size() * 4), v.size(), false};
    std::vector<uint16_t> h(v.size());
    for (size_t i = 0; i < v.size(); ++i) h[i] = float_to_bf16(v[i]);
    EXPECT_TRUE(gpu_->upload(p.g, h.data(), h.size() * 2).is_ok());
    EXPECT_TRUE(cpu_->upload(p.c, v.data(), v.size() * 4).is_ok());
    return p;
  }
  Pair act_random(size_t n, float scale = 1.0f) { return act(normal(n, scale)); }
  // A norm's weight near 1 and an output gradient that follows its input (0.5·x + 0.3
  // + noise), so that the backward's row means (of dnorm and dnorm·norm) are far from
  // 0 and a wrong row sum shows in dinp beyond the tolerance.
  Pair norm_weight(size_t C) {
    std::vector<float> w = normal(C, 0.5f);
    for (auto& v : w) v = bf16_to_float(float_to_bf16(v + 1.0f));
    return act(w);
  }
  Pair norm_dout(const std::vector<float>& xs) {
    std::vector<float> d = normal(xs.size(), 0.5f);
    for (size_t i = 0; i < d.size(); ++i) d[i] = bf16_to_float(float_to_bf16(d[i] + 0.5f * xs[i] + 0.3f));
    return act(d);
  }
  // An output that is overwritten: poisoned with NaN so that unwritten elements fail.
  Pair act_poison(size_t n) { return act(std::vector<float>(n, NAN)); }

  Pair f32(const std::vector<float>& v) {
    Pair p{galloc(v.size() * 4), calloc_(v.size() * 4), v.size(), true};
    EXPECT_TRUE(gpu_->upload(p.g, v.data(), v.size() * 4).is_ok());
    EXPECT_TRUE(cpu_->upload(p.c, v.data(), v.size() * 4).is_ok());
    return p;
  }
  Pair f32_poison(size_t n) { return f32(std::vector<float>(n, NAN)); }

  Pair i32(const std::vector<int32_t>& v) {
    Pair p{galloc(v.size() * 4), calloc_(v.size() * 4), v.size(), true};
    EXPECT_TRUE(gpu_->upload(p.g, v.data(), v.size() * 4).is_ok());
    EXPECT_TRUE(cpu_->upload(p.c, v.data(), v.size() * 4).is_ok());
    return p;
  }
  std::vector<int32_t> tokens(size_t n, int V) {
    std::uniform_int_distribution<int32_t> d(0, V - 1);
    std::vector<int32_t> v(n);
    for (auto& x : v) x = d(rng_);
    return v;
  }

  std::vector<float> gpu_values(const Pair& p) {
    EXPECT_TRUE(gpu_->synchronize().is_ok());
    std::vector<float> out(p.n);
    if (p.f32) {
      EXPECT_TRUE(gpu_->download(out.data(), p.g, p.n * 4).is_ok());
    } else {
      std::vector<uint16_t> h(p.n);
      EXPECT_TRUE(gpu_->download(h.data(), p.g, p.n * 2).is_ok());
      for (size_t i = 0; i < p.n; ++i) out[i] = bf16_to_float(h[i]);
    }
    return out;
  }
  std::vector<uint8_t> gpu_bytes(const Pair& p) {
    EXPECT_TRUE(gpu_->synchronize().is_ok());
    std::vector<uint8_t> out(p.n * (p.f32 ? 4 : 2));
    EXPECT_TRUE(gpu_->download(out.data(), p.g, out.size()).is_ok());
    return out;
  }
  std::vector<float> cpu_values(const Pair& p) {
    EXPECT_TRUE(cpu_->synchronize().is_ok());
    std::vector<float> out(p.n);
    EXPECT_TRUE(cpu_->download(out.data(), p.c, p.n * 4).is_ok());
    return out;
  }

  void expect_close(const Pair& p, const char* what, double tol = 1e-2) {
    const double e = rel_err(gpu_values(p), cpu_values(p));
    EXPECT_LT(e, tol) << what << " (seed " << seed_ << ")";
  }

  // Runs `op` twice on the GPU, each time after `reset` restored the inputs, and
  // expects identical bits in every output.
  void expect_deterministic(const std::vector<Pair>& outputs, const std::function<void()>& reset,
                            const std::function<void()>& op, const char* what) {
    std::vector<std::vector<uint8_t>> first;
    reset();
    op();
    for (auto& o : outputs) first.push_back(gpu_bytes(o));
    reset();
    op();
    for (size_t i = 0; i < outputs.size(); ++i)
      EXPECT_TRUE(first[i] == gpu_bytes(outputs[i])) << what << ": output " << i << " differs between runs";
  }

  // Element i of `p` on each backend: a view into a tensor (a vocab tile, a column block).
  static void* gat(const Pair& p, size_t i) { return static_cast<char*>(p.g) + i * (p.f32 ? 4 : 2); }
  static void* cat(const Pair& p, size_t i) { return static_cast<char*>(p.c) + i * 4; }

  // Saves the GPU contents of `p` and returns a function restoring them.
  std::function<void()> saver(const Pair& p) {
    const size_t bytes = p.n * (p.f32 ? 4 : 2);
    void* copy = galloc(bytes);
    gpu_->copy_device(copy, p.g, bytes);
    return [this, copy, p, bytes] { gpu_->copy_device(p.g, copy, bytes); };
  }

  std::unique_ptr<Backend> gpu_, cpu_;
  std::vector<void*> gpu_allocs_, cpu_allocs_;
  unsigned seed_ = 0;
  std::mt19937 rng_;
};

TEST_F(CudaOps, Describes) {
  EXPECT_EQ(gpu_->name(), "cuda");
  EXPECT_EQ(gpu_->activation_dtype(), DType::BF16);
  EXPECT_EQ(gpu_->alignment(), 256u);
  EXPECT_GT(gpu_->device_capacity(), gpu_->device_free_bytes() / 2);
  EXPECT_NE(gpu_->description().find("workspace"), std::string::npos);
}

// An op never allocates: one whose workspace is larger than the one given is an
// Internal error naming the op and both sizes; the same op runs once it fits.
TEST_F(CudaOps, WorkspaceTooSmallIsAnErrorNotAnAllocation) {
  const int B = 4, T = 256, C = 256, NH = 4;
  const size_t need = gpu_->attention_backward_workspace(B, T, NH);
  ASSERT_GT(need, 256u);
  const size_t N = size_t(B) * T;
  void* qkv = galloc(N * 3 * C * 2);
  void* dqkv = galloc(N * 3 * C * 2);
  void* out = galloc(N * C * 2);
  void* dout = galloc(N * C * 2);
  void* lse = galloc(size_t(B) * NH * T * 4);
  ASSERT_TRUE(gpu_->use_own_workspace(need - 256).ok());
  const size_t used = gpu_->device_used_bytes();
  gpu_->attention_backward(dqkv, dout, qkv, out, static_cast<float*>(lse), B, T, C, NH);
  Status s = gpu_->synchronize();
  EXPECT_EQ(s.code(), StatusCode::Internal) << s.to_string();
  EXPECT_NE(s.message().find("attention_backward"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find(std::to_string(need) + " bytes"), std::string::npos) << s.message();
  EXPECT_EQ(gpu_->device_used_bytes(), used);  // nothing was allocated
  ASSERT_TRUE(gpu_->use_own_workspace(need).ok());
  gpu_->attention_backward(dqkv, dout, qkv, out, static_cast<float*>(lse), B, T, C, NH);
  EXPECT_TRUE(gpu_->synchronize().is_ok());
}

TEST_F(CudaOps, Matmul) {
  struct Shape {
    int N, C, OC;
  };
  for (Shape s : {Shape{64, 96, 80}, Shape{40, 48, 24}, Shape{512, 768, 2304}, Shape{300, 256, 1000}}) {
    SCOPED_TRACE("N=" + std::to_string(s.N) + " C=" + std::to_string(s.C) + " OC=" + std::to_string(s.OC));
    Pair inp = act_random(size_t(s.N) * s.C), w = act_random(size_t(s.OC) * s.C, 0.05f), b = act_random(s.OC);
    Pair out = act_poison(size_t(s.N) * s.OC), out_nb = act_poison(size_t(s.N) * s.OC);
    gpu_->matmul_forward(out.g, inp.g, w.g, b.g, s.N, s.C, s.OC);
    cpu_->matmul_forward(out.c, inp.c, w.c, b.c, s.N, s.C, s.OC);
    gpu_->matmul_forward(out_nb.g, inp.g, w.g, nullptr, s.N, s.C, s.OC);
    cpu_->matmul_forward(out_nb.c, inp.c, w.c, nullptr, s.N, s.C, s.OC);
    expect_close(out, "matmul_forward");
    expect_close(out_nb, "matmul_forward without bias");

    Pair dout = act_random(size_t(s.N) * s.OC), dinp = act_poison(size_t(s.N) * s.C);
    Pair dw = act_random(size_t(s.OC) * s.C), db = act_random(s.OC);  // added into
    auto rw = saver(dw), rb = saver(db);
    gpu_->matmul_backward(dinp.g, dw.g, db.g, dout.g, inp.g, w.g, s.N, s.C, s.OC);
    cpu_->matmul_backward(dinp.c, dw.c, db.c, dout.c, inp.c, w.c, s.N, s.C, s.OC);
    expect_close(dinp, "matmul_backward dinp");
    expect_close(dw, "matmul_backward dweight");
    expect_close(db, "matmul_backward dbias");
    expect_deterministic({dinp, dw, db}, [&] { rw(); rb(); },
                         [&] { gpu_->matmul_backward(dinp.g, dw.g, db.g, dout.g, inp.g, w.g, s.N, s.C, s.OC); },
                         "matmul_backward");
  }
}

// The backward's column sums go by row chunks (column_chunks): N 8200 has 256 chunks of
// 33 rows, the last ones empty. Up to 8192 columns (a multiple of 8) the backward runs
// in one pass (norm_backward_onepass_kernel), one warp to a row up to 1024 columns: C
// 768, 264 (a second 256-column slot of one vector per row), 1024, and 64 over N 8200;
// two warps at 1600 (parts of 4 and 3 slots), four at 2560 (3, 3, 3 and 1) and 4096
// (4 each), eight at 4104 (the last part one vector) and 8192. C 100 and 8200 run the
// two passes.
TEST_F(CudaOps, LayerNorm) {
  for (auto [N, C] : {std::pair{64, 768}, std::pair{37, 100}, std::pair{1000, 1600}, std::pair{8200, 64},
                      std::pair{300, 264}, std::pair{2048, 1024}, std::pair{333, 2560}, std::pair{130, 4096},
                      std::pair{97, 4104}, std::pair{70, 8192}, std::pair{50, 8200}}) {
    SCOPED_TRACE("N=" + std::to_string(N) + " C=" + std::to_string(C));
    std::vector<float> xs = normal(size_t(N) * C, 2.0f);
    for (size_t i = 0; i < xs.size(); ++i) xs[i] = bf16_to_float(float_to_bf16(xs[i] + 0.5f));
    Pair inp = act(xs), w = norm_weight(C), b = act_random(C);
    Pair out = act_poison(size_t(N) * C), mean = f32_poison(N), rstd = f32_poison(N);
    gpu_->layernorm_forward(out.g, (float*)mean.g, (float*)rstd.g, inp.g, w.g, b.g, N, C);
    cpu_->layernorm_forward(out.c, (float*)mean.c, (float*)rstd.c, inp.c, w.c, b.c, N, C);
    expect_close(out, "layernorm_forward out");
    expect_close(mean, "layernorm_forward mean", 1e-4);
    expect_close(rstd, "layernorm_forward rstd", 1e-4);

    Pair dout = norm_dout(xs), dinp = act_random(size_t(N) * C);
    Pair dw = act_random(C), db = act_random(C);
    auto r1 = saver(dinp), r2 = saver(dw), r3 = saver(db);
    gpu_->layernorm_backward(dinp.g, dw.g, db.g, dout.g, inp.g, w.g, (float*)mean.g, (float*)rstd.g, N, C);
    cpu_->layernorm_backward(dinp.c, dw.c, db.c, dout.c, inp.c, w.c, (float*)mean.c, (float*)rstd.c, N, C);
    expect_close(dinp, "layernorm_backward dinp");
    expect_close(dw, "layernorm_backward dweight");
    expect_close(db, "layernorm_backward dbias");
    expect_deterministic({dinp, dw, db}, [&] { r1(); r2(); r3(); },
                         [&] {
                           gpu_->layernorm_backward(dinp.g, dw.g, db.g, dout.g, inp.g, w.g, (float*)mean.g,
                                                    (float*)rstd.g, N, C);
                         },
                         "layernorm_backward");
  }
}

// The backward's one pass and two passes as in LayerNorm above (C 100 and 8200: two;
// 2048: two warps to a row, 3072: four, 4104: eight).
TEST_F(CudaOps, RmsNorm) {
  for (auto [N, C] : {std::pair{64, 768}, std::pair{37, 100}, std::pair{1000, 2048}, std::pair{8200, 64},
                      std::pair{300, 264}, std::pair{2048, 1024}, std::pair{129, 3072}, std::pair{97, 4104},
                      std::pair{50, 8200}}) {
    SCOPED_TRACE("N=" + std::to_string(N) + " C=" + std::to_string(C));
    const std::vector<float> xs = normal(size_t(N) * C, 2.0f);
    Pair inp = act(xs), w = norm_weight(C);
    Pair out = act_poison(size_t(N) * C), rstd = f32_poison(N);
    gpu_->rmsnorm_forward(out.g, (float*)rstd.g, inp.g, w.g, N, C, 1e-5f);
    cpu_->rmsnorm_forward(out.c, (float*)rstd.c, inp.c, w.c, N, C, 1e-5f);
    expect_close(out, "rmsnorm_forward out");
    expect_close(rstd, "rmsnorm_forward rstd", 1e-4);

    Pair dout = norm_dout(xs), dinp = act_random(size_t(N) * C), dw = act_random(C);
    auto r1 = saver(dinp), r2 = saver(dw);
    gpu_->rmsnorm_backward(dinp.g, dw.g, dout.g, inp.g, w.g, (float*)rstd.g, N, C);
    cpu_->rmsnorm_backward(dinp.c, dw.c, dout.c, inp.c, w.c, (float*)rstd.c, N, C);
    expect_close(dinp, "rmsnorm_backward dinp");
    expect_close(dw, "rmsnorm_backward dweight");
    expect_deterministic({dinp, dw}, [&] { r1(); r2(); },
                         [&] { gpu_->rmsnorm_backward(dinp.g, dw.g, dout.g, inp.g, w.g, (float*)rstd.g, N, C); },
                         "rmsnorm_backward");
  }
}

TEST_F(CudaOps, Elementwise) {
  for (size_t n : {size_t{8192}, size_t{10007}, size_t{3}}) {
    SCOPED_TRACE("n=" + std::to_string(n));
    Pair x = act_random(n, 2.0f), y = act_random(n), out = act_poison(n), dx = act_poison(n), sum = act_poison(n);
    gpu_->gelu_forward(out.g, x.g, n);
    cpu_->gelu_forward(out.c, x.c, n);
    gpu_->gelu_backward(dx.g, x.g, y.g, n);
    cpu_->gelu_backward(dx.c, x.c, y.c, n);
    gpu_->residual_forward(sum.g, x.g, y.g, n);
    cpu_->residual_forward(sum.c, x.c, y.c, n);
    expect_close(out, "gelu_forward");
    expect_close(dx, "gelu_backward");
    expect_close(sum, "residual_forward");
  }
}

TEST_F(CudaOps, Embedding) {
  struct Shape {
    int B, T, C, V;
  };
  for (Shape s : {Shape{3, 50, 64, 97}, Shape{2, 33, 40, 11}, Shape{4, 256, 768, 50304}}) {
    SCOPED_TRACE("B=" + std::to_string(s.B) + " T=" + std::to_string(s.T) + " C=" + std::to_string(s.C));
    const size_t N = size_t(s.B) * s.T;
    Pair tok = i32(tokens(N, s.V));
    Pair wte = act_random(size_t(s.V) * s.C), wpe = act_random(size_t(s.T) * s.C), out = act_poison(N * s.C);
    gpu_->embedding_forward(out.g, (int32_t*)tok.g, wte.g, wpe.g, s.B, s.T, s.C);
    cpu_->embedding_forward(out.c, (int32_t*)tok.c, wte.c, wpe.c, s.B, s.T, s.C);
    expect_close(out, "embedding_forward");

    Pair dout = act_random(N * s.C), dwte = act_random(size_t(s.V) * s.C), dwpe = act_random(size_t(s.T) * s.C);
    auto r1 = saver(dwte), r2 = saver(dwpe);
    gpu_->embedding_backward(dwte.g, dwpe.g, dout.g, (int32_t*)tok.g, s.B, s.T, s.C);
    cpu_->embedding_backward(dwte.c, dwpe.c, dout.c, (int32_t*)tok.c, s.B, s.T, s.C);
    expect_close(dwte, "embedding_backward dwte");
    expect_close(dwpe, "embedding_backward dwpe");
    expect_deterministic({dwte, dwpe}, [&] { r1(); r2(); },
                         [&] { gpu_->embedding_backward(dwte.g, dwpe.g, dout.g, (int32_t*)tok.g, s.B, s.T, s.C); },
                         "embedding_backward");
  }
}

// The workspace a plan reserves for embedding_backward (cuda_backend_sizes, known
// without a GPU) holds what CUB's sort asks for on this GPU, from one pair to a
// million: the op runs in exactly that workspace (the backend records an error if
// CUB asks for more than the bound).
TEST_F(CudaOps, EmbeddingBackwardRunsInTheWorkspaceThePlanReserves) {
  const int C = 8, V = 50304;
  for (auto [B, T] : std::initializer_list<std::pair<int, int>>{{1, 1}, {1, 64}, {4, 128}, {3, 1000}, {16, 1024},
                                                                 {1024, 1024}}) {
    SCOPED_TRACE("B=" + std::to_string(B) + " T=" + std::to_string(T));
    const size_t need = gpu_->embedding_backward_workspace(B, T);
    EXPECT_EQ(need, cuda_backend_sizes().embedding_backward_workspace(B, T));
    ASSERT_TRUE(gpu_->use_own_workspace(need).ok());
    const size_t N = size_t(B) * T;
    Pair tok = i32(tokens(N, V));
    Pair dout = act_random(N * C), dwte = act_random(size_t(V) * C), dwpe = act_random(size_t(T) * C);
    gpu_->embedding_backward(dwte.g, dwpe.g, dout.g, (int32_t*)tok.g, B, T, C);
    const Status s = gpu_->synchronize();
    EXPECT_TRUE(s.is_ok()) << s.to_string();
  }
}

// The vocabulary split into tiles of rows [begin, begin + rows), each op run once per
// tile (the wpe gradient with the first tile only), gives the whole op's result: the
// same bits as the whole op on the GPU, close to the CPU's whole op. Positions whose
// token is outside a tile are not written, and dwpe is not touched when null.
TEST_F(CudaOps, EmbeddingVocabTiles) {
  struct Shape {
    int B, T, C, V, split;
  };
  // C = 36 takes the scalar kernels; split 500 gives a tile whose rows start 16-byte
  // but not 256-byte aligned.
  for (Shape s : {Shape{3, 50, 64, 1000, 512}, Shape{2, 33, 36, 1000, 500}, Shape{4, 64, 768, 1000, 512}}) {
    SCOPED_TRACE("B=" + std::to_string(s.B) + " T=" + std::to_string(s.T) + " C=" + std::to_string(s.C) +
                 " V=" + std::to_string(s.V) + " split=" + std::to_string(s.split));
    const size_t N = size_t(s.B) * s.T;
    const int tiles[2][2] = {{0, s.split}, {s.split, s.V - s.split}};
    const std::vector<int32_t> tv = tokens(N, s.V);
    Pair tok = i32(tv);
    auto* tg = static_cast<int32_t*>(tok.g);
    auto* tc = static_cast<int32_t*>(tok.c);

    // Forward: the tiles together write every position, with the whole op's bits.
    Pair wte = act_random(size_t(s.V) * s.C), wpe = act_random(size_t(s.T) * s.C);
    Pair whole = act_poison(N * s.C), tiled = act_poison(N * s.C);
    gpu_->embedding_forward(whole.g, tg, wte.g, wpe.g, s.B, s.T, s.C);
    for (const auto& t : tiles)
      gpu_->embedding_forward(tiled.g, tg, gat(wte, size_t(t[0]) * s.C), wpe.g, s.B, s.T, s.C, t[0], t[1]);
    cpu_->embedding_forward(tiled.c, tc, wte.c, wpe.c, s.B, s.T, s.C);  // the reference: the whole op
    expect_close(tiled, "embedding_forward in vocab tiles");
    const std::vector<uint8_t> whole_bytes = gpu_bytes(whole);
    EXPECT_TRUE(gpu_bytes(tiled) == whole_bytes) << "embedding_forward: tiles differ from the whole op";

    // One tile alone writes its tokens' positions and leaves the others as they were.
    Pair part = act_random(N * s.C);
    const std::vector<uint8_t> before = gpu_bytes(part);
    gpu_->embedding_forward(part.g, tg, gat(wte, size_t(s.split) * s.C), wpe.g, s.B, s.T, s.C, s.split,
                            s.V - s.split);
    const std::vector<uint8_t> after = gpu_bytes(part);
    size_t wrong = 0;
    for (size_t n = 0; n < N; ++n) {
      const std::vector<uint8_t>& want = tv[n] >= s.split ? whole_bytes : before;
      wrong += std::memcmp(after.data() + n * s.C * 2, want.data() + n * s.C * 2, size_t(s.C) * 2) != 0;
    }
    EXPECT_EQ(wrong, 0u) << "embedding_forward of one tile: rows written wrongly or outside the tile";
    // A tile that holds no token writes nothing.
    gpu_->embedding_forward(part.g, tg, wte.g, wpe.g, s.B, s.T, s.C, s.V, 8);
    EXPECT_TRUE(gpu_bytes(part) == after) << "embedding_forward of an empty tile wrote";

    // Backward: dwte per tile (rows of the tile only), dwpe with the first tile.
    const std::vector<float> dwte0 = normal(size_t(s.V) * s.C), dwpe0 = normal(size_t(s.T) * s.C);
    Pair dout = act_random(N * s.C);
    Pair dwte = act(dwte0), dwpe = act(dwpe0), dwte_w = act(dwte0), dwpe_w = act(dwpe0);
    auto r1 = saver(dwte), r2 = saver(dwpe);
    auto tiles_backward = [&] {
      for (int k = 0; k < 2; ++k)
        gpu_->embedding_backward(gat(dwte, size_t(tiles[k][0]) * s.C), k == 0 ? dwpe.g : nullptr, dout.g, tg,
                                 s.B, s.T, s.C, tiles[k][0], tiles[k][1]);
    };
    tiles_backward();
    gpu_->embedding_backward(dwte_w.g, dwpe_w.g, dout.g, tg, s.B, s.T, s.C);
    cpu_->embedding_backward(dwte.c, dwpe.c, dout.c, tc, s.B, s.T, s.C);  // the reference: the whole op
    expect_close(dwte, "embedding_backward dwte in vocab tiles");
    expect_close(dwpe, "embedding_backward dwpe in vocab tiles");
    EXPECT_TRUE(gpu_bytes(dwte) == gpu_bytes(dwte_w)) << "embedding_backward: tiles' dwte differs from the whole op";
    EXPECT_TRUE(gpu_bytes(dwpe) == gpu_bytes(dwpe_w)) << "embedding_backward: tiles' dwpe differs from the whole op";
    // A tile that holds no token, without dwpe, changes nothing.
    Pair spare = act_random(size_t(8) * s.C);
    const std::vector<uint8_t> spare_before = gpu_bytes(spare), dwpe_before = gpu_bytes(dwpe);
    gpu_->embedding_backward(spare.g, nullptr, dout.g, tg, s.B, s.T, s.C, s.V, 8);
    EXPECT_TRUE(gpu_bytes(spare) == spare_before) << "embedding_backward of an empty tile wrote";
    EXPECT_TRUE(gpu_bytes(dwpe) == dwpe_before) << "embedding_backward wrote dwpe";
    expect_deterministic({dwte, dwpe}, [&] { r1(); r2(); }, tiles_backward, "embedding_backward in vocab tiles");
  }
}

// A product written as column blocks of a wider output out[N, V] (rows V apart, as
// the logits of vocab tiles): each block's forward writes its columns only; each
// block's backward reads its columns of dout[N, V], the first overwriting dinp and
// the next adding into it, and together they give the whole product's gradients.
TEST_F(CudaOps, MatmulColumnBlocks) {
  struct Shape {
    int N, C, V, split;
    bool bias;
  };
  // split 500: blocks that start 8-byte aligned; V = 1001: rows an odd number of
  // elements apart.
  for (Shape s : {Shape{64, 96, 1000, 512, false}, Shape{300, 256, 1000, 500, true}, Shape{40, 48, 1001, 512, true}}) {
    SCOPED_TRACE("N=" + std::to_string(s.N) + " C=" + std::to_string(s.C) + " V=" + std::to_string(s.V) +
                 " split=" + std::to_string(s.split) + (s.bias ? " bias" : ""));
    const int blocks[2][2] = {{0, s.split}, {s.split, s.V - s.split}};
    const size_t NV = size_t(s.N) * s.V;
    Pair inp = act_random(size_t(s.N) * s.C), w = act_random(size_t(s.V) * s.C, 0.05f), b = act_random(s.V);
    Pair out = act_poison(NV);
    for (const auto& k : blocks)
      gpu_->matmul_forward(gat(out, k[0]), inp.g, gat(w, size_t(k[0]) * s.C), s.bias ? gat(b, k[0]) : nullptr, s.N,
                           s.C, k[1], s.V);
    cpu_->matmul_forward(out.c, inp.c, w.c, s.bias ? b.c : nullptr, s.N, s.C, s.V);  // the whole product
    expect_close(out, "matmul_forward in column blocks");

    // One block alone writes its columns (the same bits as above) and nothing else.
    Pair part = act_random(NV);
    const std::vector<uint8_t> before = gpu_bytes(part), full = gpu_bytes(out);
    gpu_->matmul_forward(gat(part, s.split), inp.g, gat(w, size_t(s.split) * s.C), s.bias ? gat(b, s.split) : nullptr,
                         s.N, s.C, s.V - s.split, s.V);
    const std::vector<uint8_t> after = gpu_bytes(part);
    size_t wrong = 0;
    for (size_t i = 0; i < NV; ++i) {
      const std::vector<uint8_t>& want = int(i % s.V) >= s.split ? full : before;
      wrong += std::memcmp(after.data() + 2 * i, want.data() + 2 * i, 2) != 0;
    }
    EXPECT_EQ(wrong, 0u) << "matmul_forward of one column block: wrong elements or outside the block";

    // Backward by blocks against the CPU's whole backward.
    Pair dout = act_random(NV), dinp = act_poison(size_t(s.N) * s.C);
    Pair dw = act_random(size_t(s.V) * s.C), db = act_random(s.V);  // added into
    auto rw = saver(dw), rb = saver(db);
    auto blocks_backward = [&] {
      for (int k = 0; k < 2; ++k) {
        const int v0 = blocks[k][0];
        gpu_->matmul_backward(dinp.g, gat(dw, size_t(v0) * s.C), gat(db, v0), gat(dout, v0), inp.g,
                              gat(w, size_t(v0) * s.C), s.N, s.C, blocks[k][1], s.V, /*accumulate_dinp=*/k > 0);
      }
    };
    blocks_backward();
    cpu_->matmul_backward(dinp.c, dw.c, db.c, dout.c, inp.c, w.c, s.N, s.C, s.V);
    expect_close(dinp, "matmul_backward dinp in column blocks");
    expect_close(dw, "matmul_backward dweight in column blocks");
    expect_close(db, "matmul_backward dbias in column blocks");
    expect_deterministic({dinp, dw, db}, [&] { rw(); rb(); }, blocks_backward, "matmul_backward in column blocks");

    // dinp added into a gradient that already holds values (as from another branch).
    Pair dinp2 = act_random(size_t(s.N) * s.C), dw2 = act_random(size_t(s.V) * s.C), db2 = act_random(s.V);
    gpu_->matmul_backward(dinp2.g, dw2.g, db2.g, dout.g, inp.g, w.g, s.N, s.C, s.V, s.V, true);
    cpu_->matmul_backward(dinp2.c, dw2.c, db2.c, dout.c, inp.c, w.c, s.N, s.C, s.V, s.V, true);
    expect_close(dinp2, "matmul_backward dinp accumulated");
    expect_close(dw2, "matmul_backward dweight (with dinp accumulated)");
  }
}

TEST_F(CudaOps, MatmulLeadingDimensionBelowOCIsAnError) {
  void* x = galloc(1 << 16);
  gpu_->matmul_forward(x, x, x, nullptr, 4, 8, 16, 8);
  Status s = gpu_->synchronize();
  EXPECT_EQ(s.code(), StatusCode::InvalidArgument) << s.to_string();
  gpu_->matmul_backward(x, x, nullptr, x, x, x, 4, 8, 16, 15, false);
  s = gpu_->synchronize();
  EXPECT_EQ(s.code(), StatusCode::InvalidArgument) << s.to_string();
  EXPECT_TRUE(gpu_->synchronize().is_ok());
}

TEST_F(CudaOps, CrossEntropy) {
  // ld > V: a padded row stride (GPT-2's 50257 logits in rows of 50304), the vector
  // path with a scalar tail; the padding is left as it was on both backends. The
  // backward keeps a row in shared memory when it fits (V up to about 116k on Hopper);
  // Llama 3's 128256 logits do not, and are read twice from global memory.
  for (auto [N, V, ld] : {std::tuple{33, 1000, 1000}, std::tuple{17, 257, 257}, std::tuple{64, 50304, 50304},
                          std::tuple{16, 50257, 50304}, std::tuple{9, 1001, 1008}, std::tuple{3, 128256, 128256}}) {
    SCOPED_TRACE("N=" + std::to_string(N) + " V=" + std::to_string(V) + " ld=" + std::to_string(ld));
    Pair logits = act_random(size_t(N) * ld, 3.0f), tgt = i32(tokens(N, V));
    Pair losses = f32_poison(N), losses2 = f32_poison(N);
    gpu_->crossentropy_forward((float*)losses.g, logits.g, (int32_t*)tgt.g, N, V, ld);
    cpu_->crossentropy_forward((float*)losses.c, logits.c, (int32_t*)tgt.c, N, V, ld);
    expect_close(losses, "crossentropy_forward", 1e-3);
    auto rl = saver(logits);
    const float scale = 1.0f / N;
    gpu_->crossentropy_backward((float*)losses2.g, logits.g, (int32_t*)tgt.g, N, V, ld, scale);
    cpu_->crossentropy_backward((float*)losses2.c, logits.c, (int32_t*)tgt.c, N, V, ld, scale);
    expect_close(losses2, "crossentropy_backward losses", 1e-3);
    expect_close(logits, "crossentropy_backward dlogits");
    expect_deterministic({losses2, logits}, rl,
                         [&] { gpu_->crossentropy_backward((float*)losses2.g, logits.g, (int32_t*)tgt.g, N, V, ld, scale); },
                         "crossentropy_backward");
  }
}

TEST_F(CudaOps, SquaredNormAndClip) {
  const int P = 5;
  std::vector<size_t> sizes = {1, 7, 100003, 3 * 1024 * 1024 + 5, 768};
  Pair sq = f32_poison(P);
  std::vector<Pair> grads;
  for (int i = 0; i < P; ++i) {
    grads.push_back(act_random(sizes[i], 0.01f));
    gpu_->squared_norm((float*)sq.g + i, grads[i].g, sizes[i]);
    cpu_->squared_norm((float*)sq.c + i, grads[i].c, sizes[i]);
  }
  expect_close(sq, "squared_norm", 1e-5);
  expect_deterministic({sq}, [] {}, [&] { gpu_->squared_norm((float*)sq.g + 3, grads[3].g, sizes[3]); },
                       "squared_norm");

  // clip_scale: the same bits as clip_scale_host, clipping and not.
  std::vector<float> sqs(150);
  std::uniform_real_distribution<float> d(0.0f, 0.02f);
  for (auto& x : sqs) x = d(rng_);
  Pair sqp = f32(sqs), sn = f32_poison(2);
  for (float max_norm : {0.5f, 1000.0f}) {
    gpu_->clip_scale((float*)sn.g, (float*)sqp.g, 150, max_norm);
    std::vector<float> got = gpu_values(sn);
    float want[2];
    clip_scale_host(want, sqs.data(), 150, max_norm);
    EXPECT_EQ(std::memcmp(got.data(), want, 8), 0) << "max_norm " << max_norm << ": " << got[0] << " " << got[1]
                                                    << " vs " << want[0] << " " << want[1];
  }
}

TEST_F(CudaOps, AdamWBitIdenticalToHost) {
  for (size_t n : {size_t{100003}, size_t{4096}, size_t{5}}) {
    SCOPED_TRACE("n=" + std::to_string(n));
    std::vector<float> master = normal(n, 0.05f), m = normal(n, 0.01f), v(n);
    std::uniform_real_distribution<float> dv(0.0f, 1e-4f);
    for (auto& x : v) x = dv(rng_);
    for (size_t i = 0; i < n; ++i) master[i] += 1e-3f * static_cast<float>(i % 7);  // not all bf16-exact
    std::vector<uint16_t> param(n), grad(n);
    for (size_t i = 0; i < n; ++i) param[i] = float_to_bf16(master[i]);
    std::vector<float> gvals = normal(n, 0.02f);
    for (size_t i = 0; i < n; ++i) grad[i] = float_to_bf16(gvals[i]);
    const float scale_norm[2] = {0.73f, 1.37f};
    const AdamWHyper h = adamw_hyper(6e-4f, 3, 0.1f);

    void *gp = galloc(n * 2), *gm = galloc(n * 4), *gmm = galloc(n * 4), *gv = galloc(n * 4), *gg = galloc(n * 2),
         *gs = galloc(8);
    ASSERT_TRUE(gpu_->upload(gp, param.data(), n * 2).is_ok());
    ASSERT_TRUE(gpu_->upload(gm, master.data(), n * 4).is_ok());
    ASSERT_TRUE(gpu_->upload(gmm, m.data(), n * 4).is_ok());
    ASSERT_TRUE(gpu_->upload(gv, v.data(), n * 4).is_ok());
    ASSERT_TRUE(gpu_->upload(gg, grad.data(), n * 2).is_ok());
    ASSERT_TRUE(gpu_->upload(gs, scale_norm, 8).is_ok());
    for (int step = 0; step < 2; ++step) {
      gpu_->adamw(gp, (float*)gm, (float*)gmm, (float*)gv, gg, (const float*)gs, n, h);
      adamw_host(DType::BF16, param.data(), master.data(), m.data(), v.data(), grad.data(), scale_norm, n, h);
    }
    ASSERT_TRUE(gpu_->synchronize().is_ok());
    std::vector<uint16_t> p2(n);
    std::vector<float> master2(n), m2(n), v2(n);
    ASSERT_TRUE(gpu_->download(p2.data(), gp, n * 2).is_ok());
    ASSERT_TRUE(gpu_->download(master2.data(), gm, n * 4).is_ok());
    ASSERT_TRUE(gpu_->download(m2.data(), gmm, n * 4).is_ok());
    ASSERT_TRUE(gpu_->download(v2.data(), gv, n * 4).is_ok());
    EXPECT_EQ(std::memcmp(p2.data(), param.data(), n * 2), 0) << "param";
    EXPECT_EQ(std::memcmp(master2.data(), master.data(), n * 4), 0) << "master";
    EXPECT_EQ(std::memcmp(m2.data(), m.data(), n * 4), 0) << "m";
    EXPECT_EQ(std::memcmp(v2.data(), v.data(), n * 4), 0) << "v";

    // Unaligned tensors (odd element offsets) take the scalar kernel: same bits.
    if (n > 8) {
      gpu_->adamw((uint16_t*)gp + 1, (float*)gm + 1, (float*)gmm + 1, (float*)gv + 1, (uint16_t*)gg + 1,
                  (const float*)gs, n - 1, h);
      adamw_host(DType::BF16, param.data() + 1, master.data() + 1, m.data() + 1, v.data() + 1, grad.data() + 1,
                 scale_norm, n - 1, h);
      ASSERT_TRUE(gpu_->synchronize().is_ok());
      ASSERT_TRUE(gpu_->download(master2.data(), gm, n * 4).is_ok());
      ASSERT_TRUE(gpu_->download(p2.data(), gp, n * 2).is_ok());
      EXPECT_EQ(std::memcmp(master2.data(), master.data(), n * 4), 0) << "master (unaligned)";
      EXPECT_EQ(std::memcmp(p2.data(), param.data(), n * 2), 0) << "param (unaligned)";
    }
  }
}

// A non-finite gradient norm: clip_scale marks the step skipped (scale NaN) as the
// host does, and the AdamW kernel then leaves master, m and v bit for bit as they
// were and writes param = rounded master, as the host kernel does.
TEST_F(CudaOps, SkippedStepChangesNothingLikeTheHost) {
  for (float bad : {NAN, INFINITY}) {
    std::vector<float> sqs = {0.5f, bad, 2.0f};
    Pair sqp = f32(sqs), sn = f32_poison(2);
    gpu_->clip_scale((float*)sn.g, (float*)sqp.g, 3, 1.0f);
    std::vector<float> got = gpu_values(sn);
    float want[2];
    clip_scale_host(want, sqs.data(), 3, 1.0f);
    EXPECT_TRUE(std::isnan(got[0]) && std::isnan(want[0])) << got[0] << " vs " << want[0];
    EXPECT_EQ(std::isnan(got[1]), std::isnan(want[1]));
    EXPECT_EQ(std::isinf(got[1]), std::isinf(want[1]));
  }
  for (size_t n : {size_t{100003}, size_t{5}}) {
    SCOPED_TRACE("n=" + std::to_string(n));
    std::vector<float> master = normal(n, 0.05f), m = normal(n, 0.01f), v(n, 1e-5f);
    for (size_t i = 0; i < n; ++i) master[i] += 1e-3f * static_cast<float>(i % 7);
    std::vector<uint16_t> param(n, 0xdead), grad(n, float_to_bf16(NAN));
    const float scale_norm[2] = {NAN, NAN};
    const AdamWHyper h = adamw_hyper(6e-4f, 3, 0.1f);
    void *gp = galloc(n * 2), *gm = galloc(n * 4), *gmm = galloc(n * 4), *gv = galloc(n * 4), *gg = galloc(n * 2),
         *gs = galloc(8);
    ASSERT_TRUE(gpu_->upload(gp, param.data(), n * 2).is_ok());
    ASSERT_TRUE(gpu_->upload(gm, master.data(), n * 4).is_ok());
    ASSERT_TRUE(gpu_->upload(gmm, m.data(), n * 4).is_ok());
    ASSERT_TRUE(gpu_->upload(gv, v.data(), n * 4).is_ok());
    ASSERT_TRUE(gpu_->upload(gg, grad.data(), n * 2).is_ok());
    ASSERT_TRUE(gpu_->upload(gs, scale_norm, 8).is_ok());
    const std::vector<float> master0 = master, m0 = m, v0 = v;
    gpu_->adamw(gp, (float*)gm, (float*)gmm, (float*)gv, gg, (const float*)gs, n, h);
    adamw_host(DType::BF16, param.data(), master.data(), m.data(), v.data(), grad.data(), scale_norm, n, h);
    ASSERT_TRUE(gpu_->synchronize().is_ok());
    std::vector<uint16_t> p2(n);
    std::vector<float> master2(n), m2(n), v2(n);
    ASSERT_TRUE(gpu_->download(p2.data(), gp, n * 2).is_ok());
    ASSERT_TRUE(gpu_->download(master2.data(), gm, n * 4).is_ok());
    ASSERT_TRUE(gpu_->download(m2.data(), gmm, n * 4).is_ok());
    ASSERT_TRUE(gpu_->download(v2.data(), gv, n * 4).is_ok());
    EXPECT_EQ(std::memcmp(master2.data(), master0.data(), n * 4), 0) << "master";
    EXPECT_EQ(std::memcmp(m2.data(), m0.data(), n * 4), 0) << "m";
    EXPECT_EQ(std::memcmp(v2.data(), v0.data(), n * 4), 0) << "v";
    EXPECT_EQ(std::memcmp(master.data(), master0.data(), n * 4), 0) << "host master";
    EXPECT_EQ(std::memcmp(p2.data(), param.data(), n * 2), 0) << "param (device vs host)";
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(p2[i], float_to_bf16(master0[i])) << "param[" << i << "]";
  }
}

TEST_F(CudaOps, Attention) {
  struct Shape {
    int B, T, C, NH;
  };
  // Head dims 32 (tiny), 64, 80, 128 on tensor cores (64: the Hopper forward on
  // compute capability 9.0, T = 200 ending inside a tile); 40 and 24 on the simple kernels.
  for (Shape s : {Shape{2, 100, 128, 4}, Shape{1, 256, 256, 4}, Shape{1, 130, 160, 2}, Shape{2, 70, 256, 2},
                  Shape{2, 33, 120, 3}, Shape{1, 65, 48, 2}, Shape{1, 1024, 768, 12}, Shape{2, 200, 512, 8}}) {
    SCOPED_TRACE("B=" + std::to_string(s.B) + " T=" + std::to_string(s.T) + " C=" + std::to_string(s.C) +
                 " NH=" + std::to_string(s.NH));
    const size_t N = size_t(s.B) * s.T;
    Pair qkv = act_random(N * 3 * s.C), out = act_poison(N * s.C), lse = f32_poison(size_t(s.B) * s.NH * s.T);
    gpu_->attention_forward(out.g, (float*)lse.g, qkv.g, s.B, s.T, s.C, s.NH);
    cpu_->attention_forward(out.c, (float*)lse.c, qkv.c, s.B, s.T, s.C, s.NH);
    expect_close(out, "attention_forward out");
    expect_close(lse, "attention_forward lse", 1e-3);

    // The backward from the GPU's own forward outputs on both sides.
    std::vector<float> out_g = gpu_values(out), lse_g = gpu_values(lse);
    ASSERT_TRUE(cpu_->upload(out.c, out_g.data(), out_g.size() * 4).is_ok());
    ASSERT_TRUE(cpu_->upload(lse.c, lse_g.data(), lse_g.size() * 4).is_ok());
    Pair dout = act_random(N * s.C), dqkv = act_poison(N * 3 * s.C);
    gpu_->attention_backward(dqkv.g, dout.g, qkv.g, out.g, (float*)lse.g, s.B, s.T, s.C, s.NH);
    cpu_->attention_backward(dqkv.c, dout.c, qkv.c, out.c, (float*)lse.c, s.B, s.T, s.C, s.NH);
    std::vector<float> dg = gpu_values(dqkv), dc = cpu_values(dqkv);
    // q, k and v parts separately: each must be right on its own.
    for (int part = 0; part < 3; ++part) {
      std::vector<float> a, b;
      for (size_t n = 0; n < N; ++n)
        for (int c = 0; c < s.C; ++c) {
          a.push_back(dg[n * 3 * s.C + part * s.C + c]);
          b.push_back(dc[n * 3 * s.C + part * s.C + c]);
        }
      EXPECT_LT(rel_err(a, b), 1e-2) << "attention_backward d" << "qkv"[part] << " (seed " << seed_ << ")";
    }
    expect_deterministic({out, lse, dqkv}, [] {},
                         [&] {
                           gpu_->attention_forward(out.g, (float*)lse.g, qkv.g, s.B, s.T, s.C, s.NH);
                           gpu_->attention_backward(dqkv.g, dout.g, qkv.g, out.g, (float*)lse.g, s.B, s.T, s.C,
                                                    s.NH);
                         },
                         "attention");
  }
}

// Grouped-query attention (KVH < NH) against the CPU, each of q, k, v on its own, and
// the same bits twice. Also: its forward and dQ are bit-identical to multi-head
// attention on qkv with each key/value head repeated for its query heads (the same
// products over the same values), and its dK/dV match that run's summed over each group.
TEST_F(CudaOps, GroupedQueryAttention) {
  struct Shape {
    int B, T, C, NH, KVH;
  };
  // Head dims 64 and 128 on tensor cores; 40 and 24 on the simple kernels.
  for (Shape s : {Shape{2, 100, 256, 4, 2}, Shape{1, 130, 512, 4, 1}, Shape{1, 257, 1024, 16, 4},
                  Shape{2, 70, 160, 4, 2}, Shape{1, 65, 96, 4, 1}, Shape{1, 1024, 2048, 32, 8}}) {
    SCOPED_TRACE("B=" + std::to_string(s.B) + " T=" + std::to_string(s.T) + " C=" + std::to_string(s.C) +
                 " NH=" + std::to_string(s.NH) + " KVH=" + std::to_string(s.KVH));
    const size_t N = size_t(s.B) * s.T;
    const int HD = s.C / s.NH, W = (s.NH + 2 * s.KVH) * HD, group = s.NH / s.KVH;
    const std::vector<float> qkv_v = normal(N * W);
    Pair qkv = act(qkv_v), out = act_poison(N * s.C), lse = f32_poison(size_t(s.B) * s.NH * s.T);
    gpu_->attention_forward(out.g, (float*)lse.g, qkv.g, s.B, s.T, s.C, s.NH, s.KVH);
    cpu_->attention_forward(out.c, (float*)lse.c, qkv.c, s.B, s.T, s.C, s.NH, s.KVH);
    expect_close(out, "gqa attention_forward out");
    expect_close(lse, "gqa attention_forward lse", 1e-3);

    std::vector<float> out_g = gpu_values(out), lse_g = gpu_values(lse);
    ASSERT_TRUE(cpu_->upload(out.c, out_g.data(), out_g.size() * 4).is_ok());
    ASSERT_TRUE(cpu_->upload(lse.c, lse_g.data(), lse_g.size() * 4).is_ok());
    Pair dout = act_random(N * s.C), dqkv = act_poison(N * W);
    gpu_->attention_backward(dqkv.g, dout.g, qkv.g, out.g, (float*)lse.g, s.B, s.T, s.C, s.NH, s.KVH);
    cpu_->attention_backward(dqkv.c, dout.c, qkv.c, out.c, (float*)lse.c, s.B, s.T, s.C, s.NH, s.KVH);
    const std::vector<float> dg = gpu_values(dqkv), dc = cpu_values(dqkv);
    const int part_begin[4] = {0, s.NH * HD, (s.NH + s.KVH) * HD, W};
    for (int part = 0; part < 3; ++part) {
      std::vector<float> a, b;
      for (size_t n = 0; n < N; ++n)
        for (int c = part_begin[part]; c < part_begin[part + 1]; ++c) {
          a.push_back(dg[n * W + c]);
          b.push_back(dc[n * W + c]);
        }
      EXPECT_LT(rel_err(a, b), 1e-2) << "gqa attention_backward d" << "qkv"[part] << " (seed " << seed_ << ")";
    }
    expect_deterministic({out, lse, dqkv}, [] {},
                         [&] {
                           gpu_->attention_forward(out.g, (float*)lse.g, qkv.g, s.B, s.T, s.C, s.NH, s.KVH);
                           gpu_->attention_backward(dqkv.g, dout.g, qkv.g, out.g, (float*)lse.g, s.B, s.T, s.C, s.NH,
                                                    s.KVH);
                         },
                         "gqa attention");

    // Multi-head attention on the repeated qkv.
    std::vector<float> rep(N * 3 * s.C);
    for (size_t n = 0; n < N; ++n)
      for (int h = 0; h < s.NH; ++h)
        for (int e = 0; e < HD; ++e) {
          const int g = h / group;
          rep[n * 3 * s.C + h * HD + e] = qkv_v[n * W + h * HD + e];
          rep[n * 3 * s.C + s.C + h * HD + e] = qkv_v[n * W + (s.NH + g) * HD + e];
          rep[n * 3 * s.C + 2 * s.C + h * HD + e] = qkv_v[n * W + (s.NH + s.KVH + g) * HD + e];
        }
    Pair qkv_m = act(rep), out_m = act_poison(N * s.C), lse_m = f32_poison(size_t(s.B) * s.NH * s.T);
    Pair dqkv_m = act_poison(N * 3 * s.C);
    gpu_->attention_forward(out_m.g, (float*)lse_m.g, qkv_m.g, s.B, s.T, s.C, s.NH);
    gpu_->attention_backward(dqkv_m.g, dout.g, qkv_m.g, out_m.g, (float*)lse_m.g, s.B, s.T, s.C, s.NH);
    EXPECT_TRUE(gpu_bytes(out) == gpu_bytes(out_m)) << "gqa out vs repeated multi-head";
    EXPECT_TRUE(gpu_bytes(lse) == gpu_bytes(lse_m)) << "gqa lse vs repeated multi-head";
    const std::vector<float> dm = gpu_values(dqkv_m);
    std::vector<float> dq_g, dq_m, dkv_g, dkv_sum;
    for (size_t n = 0; n < N; ++n) {
      for (int c = 0; c < s.C; ++c) {
        dq_g.push_back(dg[n * W + c]);
        dq_m.push_back(dm[n * 3 * s.C + c]);
      }
      for (int part = 1; part < 3; ++part)
        for (int kv = 0; kv < s.KVH; ++kv)
          for (int e = 0; e < HD; ++e) {
            dkv_g.push_back(dg[n * W + part_begin[part] + kv * HD + e]);
            double sum = 0;
            for (int h = kv * group; h < (kv + 1) * group; ++h) sum += dm[n * 3 * s.C + part * s.C + h * HD + e];
            dkv_sum.push_back(static_cast<float>(sum));
          }
    }
    EXPECT_EQ(dq_g, dq_m) << "gqa dq vs repeated multi-head";
    EXPECT_LT(rel_err(dkv_g, dkv_sum), 1e-2) << "gqa dk, dv vs repeated multi-head group sums (seed " << seed_ << ")";
  }
}

TEST_F(CudaOps, Rope) {
  struct Shape {
    int B, T, NH, KVH, D;
  };
  const RopeParams llama3{.theta = 500000.0f, .llama3 = true, .factor = 32, .low_freq_factor = 1,
                          .high_freq_factor = 4, .original_context = 8192};
  for (const RopeParams& r : {RopeParams{}, llama3}) {
    // D 64 and 128 take the 8-pair kernel; D 10 the one-pair kernel; T 2048 turns by large angles.
    for (Shape s : {Shape{2, 100, 4, 2, 64}, Shape{1, 300, 8, 2, 128}, Shape{2, 33, 3, 3, 10},
                    Shape{1, 2048, 4, 1, 64}}) {
      SCOPED_TRACE("llama3=" + std::to_string(r.llama3) + " B=" + std::to_string(s.B) + " T=" + std::to_string(s.T) +
                   " NH=" + std::to_string(s.NH) + " KVH=" + std::to_string(s.KVH) + " D=" + std::to_string(s.D));
      const int W = (s.NH + 2 * s.KVH) * s.D;
      const size_t n = size_t(s.B) * s.T * W;
      const std::vector<float> x = normal(n, 2.0f);
      Pair inp = act(x), out = act_poison(n);
      gpu_->rope_forward(out.g, inp.g, s.B, s.T, s.NH, s.KVH, s.D, r);
      cpu_->rope_forward(out.c, inp.c, s.B, s.T, s.NH, s.KVH, s.D, r);
      expect_close(out, "rope_forward");
      const std::vector<float> y = gpu_values(out);
      size_t changed = 0;
      for (size_t row = 0; row < n / W; ++row)
        for (int c = 0; c < W; ++c) {
          if (c >= (s.NH + s.KVH) * s.D) ASSERT_EQ(y[row * W + c], x[row * W + c]) << "v heads are copied";
          else changed += y[row * W + c] != x[row * W + c];
        }
      EXPECT_GT(changed, 0u);
      Pair dout = act_random(n), dinp = act_poison(n);
      gpu_->rope_backward(dinp.g, dout.g, s.B, s.T, s.NH, s.KVH, s.D, r);
      cpu_->rope_backward(dinp.c, dout.c, s.B, s.T, s.NH, s.KVH, s.D, r);
      expect_close(dinp, "rope_backward");
      expect_deterministic({out, dinp}, [] {},
                           [&] {
                             gpu_->rope_forward(out.g, inp.g, s.B, s.T, s.NH, s.KVH, s.D, r);
                             gpu_->rope_backward(dinp.g, dout.g, s.B, s.T, s.NH, s.KVH, s.D, r);
                           },
                           "rope");
    }
  }
}

TEST_F(CudaOps, SwiGlu) {
  // I % 8 == 0 takes the 8-wide kernel; the others one column per thread.
  for (auto [N, I] : {std::pair{64, 512}, std::pair{1000, 2048}, std::pair{37, 100}, std::pair{5, 7}}) {
    SCOPED_TRACE("N=" + std::to_string(N) + " I=" + std::to_string(I));
    Pair inp = act_random(size_t(N) * 2 * I, 3.0f), out = act_poison(size_t(N) * I);
    gpu_->swiglu_forward(out.g, inp.g, N, I);
    cpu_->swiglu_forward(out.c, inp.c, N, I);
    expect_close(out, "swiglu_forward");
    Pair dout = act_random(size_t(N) * I), dinp = act_poison(size_t(N) * 2 * I);
    gpu_->swiglu_backward(dinp.g, inp.g, dout.g, N, I);
    cpu_->swiglu_backward(dinp.c, inp.c, dout.c, N, I);
    expect_close(dinp, "swiglu_backward");
    expect_deterministic({out, dinp}, [] {},
                         [&] {
                           gpu_->swiglu_forward(out.g, inp.g, N, I);
                           gpu_->swiglu_backward(dinp.g, inp.g, dout.g, N, I);
                         },
                         "swiglu");
  }
}

// Llama has no position table: out = the wte row, exactly.
TEST_F(CudaOps, EmbeddingWithoutPositionTable) {
  for (auto [B, T, C, V] : {std::tuple{2, 50, 64, 97}, std::tuple{1, 33, 40, 11}}) {
    const size_t N = size_t(B) * T;
    Pair tok = i32(tokens(N, V)), wte = act_random(size_t(V) * C), out = act_poison(N * C);
    gpu_->embedding_forward(out.g, (const int32_t*)tok.g, wte.g, nullptr, B, T, C);
    cpu_->embedding_forward(out.c, (const int32_t*)tok.c, wte.c, nullptr, B, T, C);
    EXPECT_EQ(gpu_values(out), cpu_values(out)) << "C=" << C;
  }
}

TEST_F(CudaOps, CopyEngineOrdering) {
  const size_t n = 1 << 20;
  CopyEngine& ce = gpu_->copy_engine();
  auto h_in = gpu_->host_alloc(n * 2), h_out = gpu_->host_alloc(n * 2);
  ASSERT_TRUE(h_in.ok() && h_out.ok());
  std::vector<float> xs = normal(n);
  auto* in = static_cast<uint16_t*>(*h_in);
  for (size_t i = 0; i < n; ++i) in[i] = float_to_bf16(xs[i]);
  void *a = galloc(n * 2), *b = galloc(n * 2);
  // H2D, then compute ordered after it, then D2H of the compute's output.
  for (int round = 0; round < 3; ++round) {
    auto t1 = ce.copy(CopyDirection::HostToDevice, a, in, n * 2);
    ASSERT_TRUE(t1.ok()) << t1.status().to_string();
    ASSERT_TRUE(ce.order_compute_after(*t1).is_ok());
    gpu_->residual_forward(b, a, a, n);  // b = 2a, exact in bf16
    auto t2 = ce.copy(CopyDirection::DeviceToHost, *h_out, b, n * 2);
    ASSERT_TRUE(t2.ok());
    ASSERT_TRUE(ce.wait(*t2).is_ok());
    EXPECT_TRUE(ce.is_done(*t2));
    EXPECT_TRUE(ce.is_done(*t1));
    const auto* out = static_cast<const uint16_t*>(*h_out);
    size_t bad = 0;
    for (size_t i = 0; i < n; ++i) bad += bf16_to_float(out[i]) != 2.0f * xs[i];
    EXPECT_EQ(bad, 0u) << "round " << round;
    std::memset(*h_out, 0, n * 2);
    gpu_->fill_zero(b, n * 2);
  }
  EXPECT_TRUE(ce.is_done(CopyTicket{}));
  EXPECT_TRUE(ce.wait_all().is_ok());
  EXPECT_EQ(ce.bytes_copied(CopyDirection::HostToDevice), 3 * n * 2);
  EXPECT_EQ(ce.bytes_copied(CopyDirection::DeviceToHost), 3 * n * 2);
  gpu_->host_free(*h_in);
  gpu_->host_free(*h_out);
}

TEST_F(CudaOps, ErrorsAreStatuses) {
  auto huge = gpu_->device_alloc(size_t{1} << 50);
  ASSERT_FALSE(huge.ok());
  EXPECT_EQ(huge.status().code(), StatusCode::OutOfMemory) << huge.status().to_string();
  EXPECT_NE(huge.status().message().find("free"), std::string::npos) << huge.status().to_string();
  EXPECT_TRUE(gpu_->synchronize().is_ok());

  void* x = galloc(4096);
  gpu_->attention_forward(x, static_cast<float*>(x), x, 1, 4, 10, 3);  // C not a multiple of NH
  Status s = gpu_->synchronize();
  EXPECT_EQ(s.code(), StatusCode::InvalidArgument) << s.to_string();
  EXPECT_TRUE(gpu_->synchronize().is_ok());  // reported once
  gpu_->attention_forward(x, static_cast<float*>(x), x, 1, 4, 16, 4, 3);  // KVH not dividing NH
  s = gpu_->synchronize();
  EXPECT_EQ(s.code(), StatusCode::InvalidArgument) << s.to_string();
  EXPECT_NE(s.message().find("KVH=3"), std::string::npos) << s.to_string();
  gpu_->rope_forward(x, x, 1, 2, 2, 2, 5, RopeParams{});  // odd head size
  s = gpu_->synchronize();
  EXPECT_EQ(s.code(), StatusCode::InvalidArgument) << s.to_string();
  EXPECT_TRUE(gpu_->synchronize().is_ok());
}

// ---- the multi-tensor optimizer path (ComputeQueue in cuda_backend.cu) ----
// squared_norm and adamw calls are held back and a run of them goes out as a few
// multi-tensor launches; SPILLWAY_CUDA_MULTI_TENSOR=0 launches per tensor. The two
// must give the same bits, AdamW the host's bits too, and anything that touches the
// compute stream after a held-back run must see its results.

// A switch of the environment set to `value`, which it does not take: making a backend
// is an InvalidArgument error naming the variable, not a silent default.
void expect_switch_refused(const char* name, const char* value) {
  ScopedEnv env(name, value);
  auto b = make_backend("cuda");
  ASSERT_FALSE(b.ok()) << name << "=" << value << " accepted";
  EXPECT_EQ(b.status().code(), StatusCode::InvalidArgument) << b.status().to_string();
  EXPECT_NE(b.status().message().find(name), std::string::npos) << b.status().to_string();
}

// A switch that is on by default: a value other than 0 or 1 is refused by name, a
// backend made with it unset says `on_text` in its description, and one made with it
// at 0 names the variable and 0.
void expect_on_by_default_switch(const char* name, const char* on_text) {
  expect_switch_refused(name, "on");
  {
    ScopedEnv unset(name, nullptr);
    auto b = make_backend("cuda");
    ASSERT_TRUE(b.ok()) << b.status().to_string();
    EXPECT_NE((*b)->description().find(on_text), std::string::npos) << (*b)->description();
    EXPECT_EQ((*b)->description().find(name), std::string::npos) << (*b)->description();
  }
  ScopedEnv env(name, "0");
  auto b = make_backend("cuda");
  ASSERT_TRUE(b.ok()) << b.status().to_string();
  EXPECT_NE((*b)->description().find(std::string(name) + "=0"), std::string::npos) << (*b)->description();
}

struct OptimizerLaunches {
  uint64_t squared_norm = 0, adamw = 0;
};
OptimizerLaunches optimizer_launches(Backend& b) {
#ifdef SPILLWAY_HAVE_CUDA
  auto l = cuda_optimizer_launches(b);
  EXPECT_TRUE(l.ok()) << l.status().to_string();
  if (l.ok()) return {l->squared_norm, l->adamw};
#else
  (void)b;
#endif
  return {};
}

// A CUDA backend made with SPILLWAY_CUDA_MULTI_TENSOR=value, holding `workspace`
// bytes of its own workspace, and the device memory it allocated.
struct OwnedBackend {
  std::unique_ptr<Backend> b;
  std::vector<void*> allocs;
  OwnedBackend(const char* multi_tensor, size_t workspace) {
    ScopedEnv env("SPILLWAY_CUDA_MULTI_TENSOR", multi_tensor);
    auto r = make_backend("cuda");
    EXPECT_TRUE(r.ok()) << r.status().to_string();
    if (!r.ok()) return;
    b = std::move(*r);
    EXPECT_TRUE(b->use_own_workspace(workspace).ok());
  }
  ~OwnedBackend() {
    if (!b) return;
    EXPECT_TRUE(b->synchronize().is_ok());
    for (void* p : allocs) b->device_free(p);
    EXPECT_TRUE(b->synchronize().is_ok());
  }
  void* alloc(size_t bytes) {
    auto r = b->device_alloc(std::max<size_t>(bytes, 1));
    EXPECT_TRUE(r.ok()) << r.status().to_string();
    if (!r.ok()) return nullptr;
    allocs.push_back(*r);
    return *r;
  }
};

// The optimizer tensors of a test: sizes, element shifts (1 = an odd element offset,
// so that the vector paths are not taken) and weight decays.
struct OptTensor {
  size_t n;
  size_t shift;
  float weight_decay;
};

// Host values of every tensor, at offsets into one array per kind: tensor i at
// offset[i] (256-byte aligned plus its shift), so that two backends given the same
// layout see the same alignments.
struct OptState {
  std::vector<OptTensor> tensors;
  std::vector<size_t> offset;  // [tensors] element offset
  size_t total = 0;            // elements of each array
  std::vector<uint16_t> param, grad;      // [total] bf16
  std::vector<float> master, m, v;        // [total]
};

OptState make_opt_state(const std::vector<OptTensor>& tensors, std::mt19937& rng) {
  OptState s;
  s.tensors = tensors;
  for (const OptTensor& t : tensors) {
    s.total = (s.total + 127) / 128 * 128 + t.shift;  // 256 bytes of bf16, 512 of F32
    s.offset.push_back(s.total);
    s.total += t.n;
  }
  s.total += 8;
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_real_distribution<float> ud(0.0f, 1e-4f);
  s.param.resize(s.total);
  s.grad.resize(s.total);
  s.master.resize(s.total);
  s.m.resize(s.total);
  s.v.resize(s.total);
  for (size_t i = 0; i < s.total; ++i) {
    s.master[i] = 0.05f * nd(rng) + 1e-3f * static_cast<float>(i % 7);
    s.param[i] = float_to_bf16(s.master[i]);
    s.grad[i] = float_to_bf16(0.02f * nd(rng));
    s.m[i] = 0.01f * nd(rng);
    s.v[i] = ud(rng);
  }
  return s;
}

// The state on one backend: one allocation per kind, scale_norm[2] and out_sq[count].
struct DeviceOpt {
  uint16_t* param;
  uint16_t* grad;
  float *master, *m, *v, *scale_norm, *out_sq;
  DeviceOpt(OwnedBackend& o, const OptState& s, const float scale_norm_host[2]) {
    param = static_cast<uint16_t*>(o.alloc(s.total * 2));
    grad = static_cast<uint16_t*>(o.alloc(s.total * 2));
    master = static_cast<float*>(o.alloc(s.total * 4));
    m = static_cast<float*>(o.alloc(s.total * 4));
    v = static_cast<float*>(o.alloc(s.total * 4));
    scale_norm = static_cast<float*>(o.alloc(8));
    out_sq = static_cast<float*>(o.alloc(s.tensors.size() * 4));
    Backend& b = *o.b;
    EXPECT_TRUE(b.upload(param, s.param.data(), s.total * 2).is_ok());
    EXPECT_TRUE(b.upload(grad, s.grad.data(), s.total * 2).is_ok());
    EXPECT_TRUE(b.upload(master, s.master.data(), s.total * 4).is_ok());
    EXPECT_TRUE(b.upload(m, s.m.data(), s.total * 4).is_ok());
    EXPECT_TRUE(b.upload(v, s.v.data(), s.total * 4).is_ok());
    EXPECT_TRUE(b.upload(scale_norm, scale_norm_host, 8).is_ok());
    std::vector<float> poison(s.tensors.size(), NAN);
    EXPECT_TRUE(b.upload(out_sq, poison.data(), poison.size() * 4).is_ok());
  }
  void norms(Backend& b, const OptState& s) {
    for (size_t i = 0; i < s.tensors.size(); ++i) b.squared_norm(out_sq + i, grad + s.offset[i], s.tensors[i].n);
  }
  void adamw(Backend& b, const OptState& s, int step) {
    for (size_t i = 0; i < s.tensors.size(); ++i) {
      const size_t o = s.offset[i];
      b.adamw(param + o, master + o, m + o, v + o, grad + o, scale_norm, s.tensors[i].n,
              adamw_hyper(6e-4f, step, s.tensors[i].weight_decay));
    }
  }
  // Everything, downloaded: param and grad bytes, then master, m, v, out_sq.
  std::vector<std::vector<uint8_t>> bytes(Backend& b, const OptState& s) {
    std::vector<std::vector<uint8_t>> out = {std::vector<uint8_t>(s.total * 2), std::vector<uint8_t>(s.total * 4),
                                             std::vector<uint8_t>(s.total * 4), std::vector<uint8_t>(s.total * 4),
                                             std::vector<uint8_t>(s.tensors.size() * 4)};
    EXPECT_TRUE(b.download(out[0].data(), param, out[0].size()).is_ok());
    EXPECT_TRUE(b.download(out[1].data(), master, out[1].size()).is_ok());
    EXPECT_TRUE(b.download(out[2].data(), m, out[2].size()).is_ok());
    EXPECT_TRUE(b.download(out[3].data(), v, out[3].size()).is_ok());
    EXPECT_TRUE(b.download(out[4].data(), out_sq, out[4].size()).is_ok());
    return out;
  }
};

// Mixed sizes: tiny, not multiples of 4 or 8, empty, odd element offsets, a few
// large ones (the largest runs the norm's 256 blocks over several strides), and
// weight decays giving more distinct hyperparameters than one launch takes.
std::vector<OptTensor> mixed_tensors(int count, std::mt19937& rng) {
  const size_t sizes[] = {1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 100, 255, 256, 257, 768, 769, 1000, 2304, 4095,
                          4096, 4097, 8191, 8193, 65537, 100003};
  std::uniform_int_distribution<int> pick(0, static_cast<int>(std::size(sizes)) - 1);
  std::vector<OptTensor> t;
  t.push_back({size_t{10} << 20 | 3, 0, 0.1f});  // large, not a multiple of 8
  t.push_back({0, 0, 0.1f});                     // empty
  t.push_back({3 * 1024 * 1024 + 5, 1, 0.0f});   // large, unaligned
  for (int i = static_cast<int>(t.size()); i < count; ++i)
    t.push_back({sizes[pick(rng)], static_cast<size_t>(i % 5 == 0), i % 3 == 0 ? 0.0f : 0.01f * (i % 13)});
  t.push_back({size_t{20} << 20, 0, 0.1f});  // the largest: 20M elements
  return t;
}

const char* kByteNames[] = {"param", "master", "m", "v", "out_sq"};

// (1) Per tensor (SPILLWAY_CUDA_MULTI_TENSOR=0) against multi-tensor launches, every
// output bit for bit: squared norms, then two AdamW steps (the second step's calls
// update what the first step's wrote, so the queue must launch the first run before
// taking the second). Both with a large workspace and with the smallest one
// (squared_norm_workspace(): each group of norms as large as 256 partials allow).
TEST_F(CudaOps, MultiTensorOptimizerBitIdenticalToPerTensor) {
  const std::vector<OptTensor> tensors = mixed_tensors(700, rng_);  // over one launch's table
  const OptState s = make_opt_state(tensors, rng_);
  const float scale_norm[2] = {0.73f, 1.37f};
  for (size_t workspace : {size_t{64} << 20, gpu_->squared_norm_workspace()}) {
    SCOPED_TRACE("workspace " + std::to_string(workspace));
    OwnedBackend per("0", workspace), multi("1", workspace);
    ASSERT_TRUE(per.b && multi.b);
    EXPECT_NE(per.b->description().find("per tensor"), std::string::npos) << per.b->description();
    EXPECT_NE(multi.b->description().find("multi-tensor"), std::string::npos) << multi.b->description();
    DeviceOpt a(per, s, scale_norm), c(multi, s, scale_norm);
    a.norms(*per.b, s);
    c.norms(*multi.b, s);
    for (int step = 1; step <= 2; ++step) {
      a.adamw(*per.b, s, step);
      c.adamw(*multi.b, s, step);
    }
    ASSERT_TRUE(per.b->synchronize().is_ok());
    ASSERT_TRUE(multi.b->synchronize().is_ok());
    const auto want = a.bytes(*per.b, s), got = c.bytes(*multi.b, s);
    for (size_t k = 0; k < want.size(); ++k) EXPECT_TRUE(want[k] == got[k]) << kByteNames[k] << " differs";
    // Not two equal wrong answers: each norm near its double-precision sum.
    std::vector<float> sq(tensors.size());
    std::memcpy(sq.data(), got[4].data(), sq.size() * 4);
    for (size_t i = 0; i < tensors.size(); ++i) {
      double want_sq = 0;
      for (size_t j = 0; j < tensors[i].n; ++j) {
        const double g = bf16_to_float(s.grad[s.offset[i] + j]);
        want_sq += g * g;
      }
      ASSERT_NEAR(sq[i], want_sq, 1e-4 * want_sq + 1e-30) << "tensor " << i << " n=" << tensors[i].n;
    }
    const OptimizerLaunches lp = optimizer_launches(*per.b), lm = optimizer_launches(*multi.b);
    EXPECT_EQ(lp.squared_norm, 2 * tensors.size());
    EXPECT_GE(lp.adamw, 2 * (tensors.size() - 1));  // one or two per non-empty tensor and step
    std::printf("[ launches ] workspace %zu: squared_norm %llu -> %llu, adamw %llu -> %llu (%zu tensors, 2 steps)\n",
                workspace, (unsigned long long)lp.squared_norm, (unsigned long long)lm.squared_norm,
                (unsigned long long)lp.adamw, (unsigned long long)lm.adamw, tensors.size());
    if (workspace > (size_t{1} << 20)) {
      EXPECT_LE(lm.squared_norm, 8u);
    }
    EXPECT_LE(lm.adamw, 2u * 8u);
    EXPECT_LT(lm.squared_norm, lp.squared_norm / 4);
  }
}

// The launches of a GPT-2-like optimizer: 100 small tensors (one block each) in one
// group: two squared-norm launches and one AdamW launch (two weight decays).
TEST_F(CudaOps, MultiTensorOptimizerLaunchCounts) {
  std::vector<OptTensor> tensors;
  for (int i = 0; i < 100; ++i) tensors.push_back({static_cast<size_t>(768 + 8 * i), 0, i % 2 ? 0.1f : 0.0f});
  const OptState s = make_opt_state(tensors, rng_);
  const float scale_norm[2] = {1.0f, 0.5f};
  OwnedBackend per("0", size_t{1} << 20), multi("1", size_t{1} << 20);
  ASSERT_TRUE(per.b && multi.b);
  DeviceOpt a(per, s, scale_norm), c(multi, s, scale_norm);
  for (auto [o, d] : {std::pair{&per, &a}, std::pair{&multi, &c}}) {
    d->norms(*o->b, s);
    d->adamw(*o->b, s, 1);
    ASSERT_TRUE(o->b->synchronize().is_ok());
  }
  const OptimizerLaunches lp = optimizer_launches(*per.b), lm = optimizer_launches(*multi.b);
  EXPECT_EQ(lp.squared_norm, 200u);
  EXPECT_EQ(lp.adamw, 100u);  // multiples of 4, aligned: one launch each
  EXPECT_EQ(lm.squared_norm, 2u);
  EXPECT_EQ(lm.adamw, 1u);
  EXPECT_TRUE(a.bytes(*per.b, s) == c.bytes(*multi.b, s));
}

// (2) Multi-tensor AdamW against the host AdamW bit for bit, two steps of every
// tensor, one half of the tensors with a finite clip scale and the other half with a
// skipped step (NaN scale) in the same runs, and learning rates giving more distinct
// hyperparameters than one launch takes.
TEST_F(CudaOps, MultiTensorAdamWBitIdenticalToHost) {
  const std::vector<OptTensor> tensors = mixed_tensors(300, rng_);
  OptState s = make_opt_state(tensors, rng_);
  OwnedBackend multi("1", size_t{1} << 20);
  ASSERT_TRUE(multi.b);
  Backend& b = *multi.b;
  const float finite[2] = {0.61f, 1.64f}, skipped[2] = {NAN, INFINITY};
  DeviceOpt d(multi, s, finite);
  auto* skip_sn = static_cast<float*>(multi.alloc(8));
  ASSERT_TRUE(b.upload(skip_sn, skipped, 8).is_ok());
  for (int step = 1; step <= 2; ++step) {
    for (size_t i = 0; i < tensors.size(); ++i) {
      const size_t o = s.offset[i];
      const bool skip = i % 2 == 1;
      const AdamWHyper h = adamw_hyper(6e-4f * static_cast<float>(1 + i % 11), step, tensors[i].weight_decay);
      b.adamw(d.param + o, d.master + o, d.m + o, d.v + o, d.grad + o, skip ? skip_sn : d.scale_norm, tensors[i].n,
              h);
      adamw_host(DType::BF16, s.param.data() + o, s.master.data() + o, s.m.data() + o, s.v.data() + o,
                 s.grad.data() + o, skip ? skipped : finite, tensors[i].n, h);
    }
  }
  // Straight to the downloads: they must see the held-back updates.
  const auto got = d.bytes(b, s);
  EXPECT_EQ(std::memcmp(got[0].data(), s.param.data(), s.total * 2), 0) << "param";
  EXPECT_EQ(std::memcmp(got[1].data(), s.master.data(), s.total * 4), 0) << "master";
  EXPECT_EQ(std::memcmp(got[2].data(), s.m.data(), s.total * 4), 0) << "m";
  EXPECT_EQ(std::memcmp(got[3].data(), s.v.data(), s.total * 4), 0) << "v";
  EXPECT_TRUE(b.synchronize().is_ok());
}

// (3) Whatever comes after a held-back run sees its results: a download, an op, the
// copy engine's copy after compute, clip_scale reading the norms, a workspace change;
// and calls that depend on held-back ones are launched after them (two norms into one
// out_sq, a norm of params a held-back AdamW wrote, a norm of a held-back norm's
// output).
TEST_F(CudaOps, MultiTensorFlushOrdering) {
  std::vector<OptTensor> tensors;
  for (int i = 0; i < 40; ++i) tensors.push_back({static_cast<size_t>(1000 + 37 * i), 0, 0.1f});
  OptState s = make_opt_state(tensors, rng_);
  const float finite[2] = {0.9f, 1.1f};
  OwnedBackend per("0", size_t{1} << 20), multi("1", size_t{1} << 20);
  ASSERT_TRUE(per.b && multi.b);
  Backend& b = *multi.b;
  DeviceOpt ref(per, s, finite), d(multi, s, finite);
  ref.norms(*per.b, s);
  ref.adamw(*per.b, s, 1);
  const auto want = ref.bytes(*per.b, s);
  std::vector<float> want_sq(tensors.size());
  std::memcpy(want_sq.data(), want[4].data(), want_sq.size() * 4);

  // Norms, then clip_scale reads them (no synchronize in between).
  d.norms(b, s);
  float* sn2 = static_cast<float*>(multi.alloc(8));
  b.clip_scale(sn2, d.out_sq, static_cast<int>(tensors.size()), 0.5f);
  float got_sn[2], host_sn[2];
  ASSERT_TRUE(b.download(got_sn, sn2, 8).is_ok());
  clip_scale_host(host_sn, want_sq.data(), static_cast<int>(tensors.size()), 0.5f);
  EXPECT_EQ(std::memcmp(got_sn, host_sn, 8), 0) << got_sn[0] << " " << got_sn[1] << " vs " << host_sn[0] << " "
                                                 << host_sn[1];

  // AdamW, then the copy engine's D2H copy after compute, straight away.
  d.adamw(b, s, 1);
  CopyEngine& ce = b.copy_engine();
  auto host = b.host_alloc(s.total * 4);
  ASSERT_TRUE(host.ok());
  auto t = ce.copy(CopyDirection::DeviceToHost, *host, d.master, s.total * 4);
  ASSERT_TRUE(t.ok()) << t.status().to_string();
  ASSERT_TRUE(ce.wait(*t).is_ok());
  EXPECT_EQ(std::memcmp(*host, want[1].data(), s.total * 4), 0) << "master copied after compute";
  b.host_free(*host);

  // AdamW, then an op reading the updated params: residual_forward(out = p + p).
  const size_t n0 = tensors[0].n;
  void* twice = multi.alloc(n0 * 2);
  d.adamw(b, s, 2);
  ref.adamw(*per.b, s, 2);
  b.residual_forward(twice, d.param + s.offset[0], d.param + s.offset[0], n0);
  std::vector<uint16_t> got_twice(n0), want_p(n0);
  ASSERT_TRUE(b.download(got_twice.data(), twice, n0 * 2).is_ok());
  ASSERT_TRUE(per.b->download(want_p.data(), ref.param + s.offset[0], n0 * 2).is_ok());
  for (size_t j = 0; j < n0; ++j)
    ASSERT_EQ(bf16_to_float(got_twice[j]), 2.0f * bf16_to_float(want_p[j])) << "element " << j;

  // Norms into one out_sq twice (the later call's value stays), and a norm of the
  // master-rounded params that a held-back AdamW writes.
  b.squared_norm(d.out_sq, d.grad + s.offset[1], tensors[1].n);
  b.squared_norm(d.out_sq, d.grad + s.offset[2], tensors[2].n);
  float last = 0;
  ASSERT_TRUE(b.download(&last, d.out_sq, 4).is_ok());
  EXPECT_EQ(std::memcmp(&last, &want_sq[2], 4), 0) << last << " vs " << want_sq[2];
  d.adamw(b, s, 3);
  ref.adamw(*per.b, s, 3);
  b.squared_norm(d.out_sq + 5, d.param + s.offset[5], tensors[5].n);  // reads what adamw wrote
  per.b->squared_norm(ref.out_sq + 5, ref.param + s.offset[5], tensors[5].n);
  // A norm whose input is a held-back norm's output (out_sq[6] read as two bf16).
  for (auto [o, x] : {std::pair{&multi, &d}, std::pair{&per, &ref}}) {
    o->b->squared_norm(x->out_sq + 6, x->grad + s.offset[6], tensors[6].n);
    o->b->squared_norm(x->out_sq + 7, reinterpret_cast<const uint16_t*>(x->out_sq + 6), 2);
  }
  float got5[3] = {0, 0, 0}, want5[3] = {1, 1, 1};
  ASSERT_TRUE(b.download(got5, d.out_sq + 5, 12).is_ok());
  ASSERT_TRUE(per.b->download(want5, ref.out_sq + 5, 12).is_ok());
  EXPECT_EQ(std::memcmp(got5, want5, 12), 0) << got5[0] << " " << got5[1] << " " << got5[2] << " vs " << want5[0]
                                               << " " << want5[1] << " " << want5[2];

  // Norms held back, then the workspace is replaced (the old one freed): they ran first.
  d.norms(b, s);
  ASSERT_TRUE(b.use_own_workspace(size_t{2} << 20).ok());
  std::vector<float> got_sq(tensors.size());
  ASSERT_TRUE(b.download(got_sq.data(), d.out_sq, got_sq.size() * 4).is_ok());
  EXPECT_EQ(std::memcmp(got_sq.data(), want_sq.data(), got_sq.size() * 4), 0) << "norms before a workspace change";
  EXPECT_TRUE(b.synchronize().is_ok());
  EXPECT_TRUE(per.b->synchronize().is_ok());
}

// A value other than 0 or 1 is an error naming the variable, not a silent default.
TEST_F(CudaOps, MultiTensorSwitchIsChecked) { expect_switch_refused("SPILLWAY_CUDA_MULTI_TENSOR", "yes"); }

// ---- AdamW batches on the optimizer stream (SPILLWAY_CUDA_OPTIMIZER_STREAM) ----
// Off by default until a GPU has run these tests and timed it: a value other than 0
// or 1 is refused by name, unset and 0 keep AdamW on the compute stream, 1 names the
// variable and the stream of its own.
TEST_F(CudaOps, OptimizerStreamSwitch) {
  const char* name = "SPILLWAY_CUDA_OPTIMIZER_STREAM";
  expect_switch_refused(name, "on");
  for (const char* value : {static_cast<const char*>(nullptr), "0"}) {
    ScopedEnv env(name, value);
    auto b = make_backend("cuda");
    ASSERT_TRUE(b.ok()) << b.status().to_string();
    EXPECT_FALSE((*b)->optimizer_on_own_stream());
    EXPECT_NE((*b)->description().find("AdamW on the compute stream"), std::string::npos) << (*b)->description();
  }
  ScopedEnv env(name, "1");
  auto b = make_backend("cuda");
  ASSERT_TRUE(b.ok()) << b.status().to_string();
  EXPECT_TRUE((*b)->optimizer_on_own_stream());
  EXPECT_NE((*b)->description().find("AdamW on a stream of its own (SPILLWAY_CUDA_OPTIMIZER_STREAM=1)"),
            std::string::npos)
      << (*b)->description();
}

// SPILLWAY_CUDA_PINNED_REGISTER=1 (the default): a region of 1 GiB and more is mapped, faulted in by
// parallel threads and registered. It starts zeroed, the copy engine moves its first
// and last 8 MiB both ways, and host_free unregisters and unmaps it (two rounds, each
// a fresh region). A small region (cudaHostAlloc's) works beside them. Any other value
// than 0 or 1 is refused.
TEST_F(CudaOps, RegisteredPinnedRegionsCopyBothWays) {
  const char* name = "SPILLWAY_CUDA_PINNED_REGISTER";
  expect_switch_refused(name, "yes");
  ScopedEnv env(name, "1");
  auto b = make_backend("cuda");
  ASSERT_TRUE(b.ok()) << b.status().to_string();
  const size_t bytes = (size_t{1} << 30) + 12345, piece = size_t{8} << 20;
  void* dev = galloc(2 * piece);
  for (int round = 0; round < 2; ++round) {
    auto h = (*b)->host_alloc(bytes);
    ASSERT_TRUE(h.ok()) << h.status().to_string();
    auto* host = static_cast<unsigned char*>(*h);
    for (size_t at : {size_t{0}, bytes / 2, bytes - 1}) ASSERT_EQ(host[at], 0) << "byte " << at << " not zero";
    const size_t tail = bytes - piece;  // the last piece, ending at the region's last byte
    for (size_t i = 0; i < piece; ++i) {
      host[i] = static_cast<unsigned char>(i * 7 + round);
      host[tail + i] = static_cast<unsigned char>(i * 13 + 1);
    }
    CopyEngine& ce = (*b)->copy_engine();
    auto up1 = ce.copy(CopyDirection::HostToDevice, dev, host, piece);
    auto up2 = ce.copy(CopyDirection::HostToDevice, static_cast<char*>(dev) + piece, host + tail, piece);
    ASSERT_TRUE(up1.ok() && up2.ok());
    ASSERT_TRUE(ce.wait_all().is_ok());
    std::memset(host, 0, piece);
    std::memset(host + tail, 0, piece);
    // Swapped on the way back: the first piece lands at the end, the last at the start.
    auto down1 = ce.copy(CopyDirection::DeviceToHost, host + tail, dev, piece);
    auto down2 = ce.copy(CopyDirection::DeviceToHost, host, static_cast<char*>(dev) + piece, piece);
    ASSERT_TRUE(down1.ok() && down2.ok());
    ASSERT_TRUE(ce.wait_all().is_ok());
    size_t bad = 0;
    for (size_t i = 0; i < piece; ++i) {
      bad += host[tail + i] != static_cast<unsigned char>(i * 7 + round);
      bad += host[i] != static_cast<unsigned char>(i * 13 + 1);
    }
    EXPECT_EQ(bad, 0u) << "round " << round;
    (*b)->host_free(*h);
  }
  auto small = (*b)->host_alloc(4096);
  ASSERT_TRUE(small.ok()) << small.status().to_string();
  static_cast<unsigned char*>(*small)[4095] = 1;
  (*b)->host_free(*small);
}

// Updates left running on the optimizer stream (synchronize_compute) are seen by
// every later reader and writer of their memory: (1) a copy of the parameter on the
// compute stream reads the updated values; (2) zeroing the gradient (a write of what
// the update reads) waits for the update to read it; (3) download, of the master
// weights, waits for the update that writes them; (4) work on another stream ordered
// after compute (a collective's, Backend::order_stream_after_compute) waits for them.
// The reference: the same calls on the compute stream, in order. The tensors are large
// (64M elements: milliseconds of updates), so that a missing wait reads stale values.
TEST_F(CudaOps, UpdatesOnTheOptimizerStreamAreSeenByLaterWork) {
  const std::vector<OptTensor> tensors = {{size_t{40} << 20, 0, 0.1f}, {size_t{24} << 20 | 5, 1, 0.0f}};
  const OptState s = make_opt_state(tensors, rng_);
  const float scale_norm[2] = {0.61f, 1.64f};
  std::vector<std::vector<uint8_t>> want, got;
  std::vector<uint8_t> want_copy(s.total * 2), got_copy(s.total * 2), want_side(s.total * 2), got_side(s.total * 2);
  for (const char* own : {"0", "1"}) {
    ScopedEnv env("SPILLWAY_CUDA_OPTIMIZER_STREAM", own);
    OwnedBackend o("1", size_t{64} << 20);
    ASSERT_TRUE(o.b);
    Backend& b = *o.b;
    EXPECT_EQ(b.optimizer_on_own_stream(), std::string(own) == "1") << b.description();
    DeviceOpt d(o, s, scale_norm);
    auto* copy = static_cast<uint16_t*>(o.alloc(s.total * 2));
    ASSERT_TRUE(b.synchronize().is_ok());
    d.adamw(b, s, 1);
    ASSERT_TRUE(b.synchronize_compute().is_ok());  // the updates may still run
#ifdef SPILLWAY_HAVE_CUDA
    {  // (4): a copy of the parameter on a stream of the test's own
      auto* side_copy = static_cast<uint16_t*>(o.alloc(s.total * 2));
      cudaStream_t side = nullptr;
      ASSERT_EQ(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking), cudaSuccess);
      ASSERT_TRUE(b.order_stream_after_compute(side).is_ok());
      ASSERT_EQ(cudaMemcpyAsync(side_copy, d.param, s.total * 2, cudaMemcpyDeviceToDevice, side), cudaSuccess);
      ASSERT_EQ(cudaStreamSynchronize(side), cudaSuccess);
      ASSERT_EQ(cudaStreamDestroy(side), cudaSuccess);
      ASSERT_TRUE(
          b.download((std::string(own) == "1" ? got_side : want_side).data(), side_copy, s.total * 2).is_ok());
    }
#endif
    b.copy_device(copy, d.param, s.total * 2);       // (1)
    b.fill_zero(d.grad, s.total * 2);                 // (2)
    d.adamw(b, s, 2);                                 // a second step, from the zeroed gradient
    std::vector<uint8_t> master(s.total * 4);
    ASSERT_TRUE(b.download(master.data(), d.master, master.size()).is_ok());  // (3), before any synchronize
    auto& out = std::string(own) == "1" ? got : want;
    out = d.bytes(b, s);
    out[4] = master;  // the master weights as the download found them (out_sq is not used)
    ASSERT_TRUE(b.download((std::string(own) == "1" ? got_copy : want_copy).data(), copy, s.total * 2).is_ok());
    ASSERT_TRUE(b.synchronize().is_ok());
  }
  const char* names[] = {"param", "master", "m", "v", "master (downloaded right after the update)"};
  for (size_t k = 0; k < want.size(); ++k) EXPECT_TRUE(want[k] == got[k]) << names[k] << " differs";
  EXPECT_TRUE(want_copy == got_copy) << "the copy of the parameter did not see the first update";
  EXPECT_TRUE(want_side == got_side) << "work on another stream ordered after compute did not see the first update";
  // Not two equal wrong answers: the first update moved the parameter.
  EXPECT_FALSE(want_copy == std::vector<uint8_t>(reinterpret_cast<const uint8_t*>(s.param.data()),
                                                 reinterpret_cast<const uint8_t*>(s.param.data() + s.total)));
}

// The Hopper attention kernels (wgmma, head dims 64, 80, 128; attention_sm90a.cu),
// forward and backward, against the mma.sync kernels (SPILLWAY_CUDA_ATTENTION=mma) on
// the same inputs, element by element: T not a multiple of the 64- or 128-row tiles
// (the TMA forward's boxes then reach past T and read zeros), T = 1, grouped heads. At
// head dims 64 and 128 the forward is the TMA one. The two differ only in rounding (bf16
// P, the exponent instruction). Elsewhere than on compute capability 9.0 both sides run
// the mma.sync kernel, and the test says so.
TEST_F(CudaOps, HopperAttentionAgreesWithMmaKernels) {
  ScopedEnv env("SPILLWAY_CUDA_ATTENTION", "mma");
  auto made = make_backend("cuda");
  ASSERT_TRUE(made.ok()) << made.status().to_string();
  std::unique_ptr<Backend> mma = std::move(*made);
  ASSERT_TRUE(mma->use_own_workspace(kTestWorkspace).ok());
  EXPECT_NE(mma->description().find("SPILLWAY_CUDA_ATTENTION=mma"), std::string::npos) << mma->description();
  if (gpu_->description().find("wgmma") == std::string::npos)
    std::printf("[ note     ] not a compute capability 9.0 device: both sides run the mma.sync kernel\n");
  struct Shape {
    int B, T, C, NH, KVH;
  };
  std::vector<void*> owned;
  for (Shape s : {Shape{2, 200, 512, 8, 8}, Shape{3, 1, 128, 2, 2}, Shape{1, 1024, 768, 12, 12},
                  Shape{2, 129, 256, 4, 4}, Shape{1, 257, 1024, 16, 4}, Shape{2, 64, 256, 4, 1},
                  Shape{2, 200, 640, 8, 8}, Shape{1, 129, 160, 2, 2}, Shape{1, 130, 320, 4, 1},
                  Shape{2, 200, 1024, 8, 8}, Shape{1, 257, 2048, 16, 4}, Shape{1, 1024, 2560, 32, 32}}) {
    SCOPED_TRACE("B=" + std::to_string(s.B) + " T=" + std::to_string(s.T) + " C=" + std::to_string(s.C) +
                 " NH=" + std::to_string(s.NH) + " KVH=" + std::to_string(s.KVH));
    const size_t N = size_t(s.B) * s.T, W = size_t(s.NH + 2 * s.KVH) * (s.C / s.NH);
    const size_t n_lse = size_t(s.B) * s.NH * s.T;
    const std::vector<float> qkv_v = normal(N * W, 2.0f);  // wide scores: the running max moves
    Pair qkv = act(qkv_v), out = act_poison(N * s.C), lse = f32_poison(n_lse);
    gpu_->attention_forward(out.g, (float*)lse.g, qkv.g, s.B, s.T, s.C, s.NH, s.KVH);
    std::vector<uint16_t> h(qkv_v.size());
    for (size_t i = 0; i < h.size(); ++i) h[i] = float_to_bf16(qkv_v[i]);
    auto alloc = [&](size_t bytes) {
      auto r = mma->device_alloc(bytes);
      EXPECT_TRUE(r.ok()) << r.status().to_string();
      owned.push_back(r.ok() ? *r : nullptr);
      return r.ok() ? *r : nullptr;
    };
    void *m_qkv = alloc(h.size() * 2), *m_out = alloc(N * s.C * 2), *m_lse = alloc(n_lse * 4);
    ASSERT_TRUE(m_qkv && m_out && m_lse);
    ASSERT_TRUE(mma->upload(m_qkv, h.data(), h.size() * 2).is_ok());
    mma->attention_forward(m_out, (float*)m_lse, m_qkv, s.B, s.T, s.C, s.NH, s.KVH);
    ASSERT_TRUE(mma->synchronize().is_ok());
    std::vector<uint16_t> mo(N * s.C);
    std::vector<float> ml(n_lse);
    ASSERT_TRUE(mma->download(mo.data(), m_out, mo.size() * 2).is_ok());
    ASSERT_TRUE(mma->download(ml.data(), m_lse, ml.size() * 4).is_ok());
    const std::vector<float> go = gpu_values(out), gl = gpu_values(lse);
    double worst_o = 0, worst_l = 0;
    size_t at_o = 0, at_l = 0;
    for (size_t i = 0; i < go.size(); ++i) {
      const double d = std::isfinite(go[i]) ? std::fabs(go[i] - bf16_to_float(mo[i])) : INFINITY;
      if (!(d <= worst_o)) worst_o = d, at_o = i;
    }
    for (size_t i = 0; i < gl.size(); ++i) {
      const double d = std::isfinite(gl[i]) ? std::fabs(gl[i] - ml[i]) : INFINITY;
      if (!(d <= worst_l)) worst_l = d, at_l = i;
    }
    EXPECT_LE(worst_o, 0.03) << "out[" << at_o << "]: " << go[at_o] << " vs " << bf16_to_float(mo[at_o]);
    EXPECT_LE(worst_l, 2e-3) << "lse[" << at_l << "]: " << gl[at_l] << " vs " << ml[at_l];
    expect_deterministic({out, lse}, [] {},
                         [&] { gpu_->attention_forward(out.g, (float*)lse.g, qkv.g, s.B, s.T, s.C, s.NH, s.KVH); },
                         "attention forward");

    // The backward from the same out and lse (the mma.sync forward's) on both sides.
    ASSERT_TRUE(gpu_->upload(out.g, mo.data(), mo.size() * 2).is_ok());
    ASSERT_TRUE(gpu_->upload(lse.g, ml.data(), ml.size() * 4).is_ok());
    const std::vector<float> dout_v = normal(N * s.C);
    std::vector<uint16_t> dh(dout_v.size());
    for (size_t i = 0; i < dh.size(); ++i) dh[i] = float_to_bf16(dout_v[i]);
    Pair dout = act(dout_v), dqkv = act_poison(N * W);
    void *m_dout = alloc(dh.size() * 2), *m_dqkv = alloc(N * W * 2);
    ASSERT_TRUE(m_dout && m_dqkv);
    ASSERT_TRUE(mma->upload(m_dout, dh.data(), dh.size() * 2).is_ok());
    gpu_->attention_backward(dqkv.g, dout.g, qkv.g, out.g, (float*)lse.g, s.B, s.T, s.C, s.NH, s.KVH);
    mma->attention_backward(m_dqkv, m_dout, m_qkv, m_out, (float*)m_lse, s.B, s.T, s.C, s.NH, s.KVH);
    ASSERT_TRUE(mma->synchronize().is_ok());
    std::vector<uint16_t> md(N * W);
    ASSERT_TRUE(mma->download(md.data(), m_dqkv, md.size() * 2).is_ok());
    const std::vector<float> gd = gpu_values(dqkv);
    // Each of dq, dk, dv: every element within 3% of the mma.sync kernel's value plus
    // 3% of that part's rms (both round P and dS to bf16, with different exponents).
    const int HD = s.C / s.NH;
    const size_t part_begin[4] = {0, size_t(s.NH) * HD, size_t(s.NH + s.KVH) * HD, W};
    for (int part = 0; part < 3; ++part) {
      double sq = 0;
      size_t count = 0;
      for (size_t n = 0; n < N; ++n)
        for (size_t c = part_begin[part]; c < part_begin[part + 1]; ++c, ++count) {
          const double v = bf16_to_float(md[n * W + c]);
          sq += v * v;
        }
      const double rms = std::sqrt(sq / std::max<size_t>(count, 1));
      double worst = 0;
      size_t at = 0;
      for (size_t n = 0; n < N; ++n)
        for (size_t c = part_begin[part]; c < part_begin[part + 1]; ++c) {
          const double want = bf16_to_float(md[n * W + c]), got = gd[n * W + c];
          const double excess = std::isfinite(got) ? std::fabs(got - want) - 0.03 * std::fabs(want) - 0.03 * rms
                                                   : INFINITY;
          if (!(excess <= worst)) worst = excess, at = n * W + c;
        }
      EXPECT_LE(worst, 0.0) << "d" << "qkv"[part] << "[" << at << "]: " << gd[at] << " vs "
                            << bf16_to_float(md[at]) << " (rms " << rms << ")";
    }
    expect_deterministic({dqkv}, [] {},
                         [&] {
                           gpu_->attention_backward(dqkv.g, dout.g, qkv.g, out.g, (float*)lse.g, s.B, s.T, s.C,
                                                    s.NH, s.KVH);
                         },
                         "attention backward");
  }
  ASSERT_TRUE(mma->synchronize().is_ok());
  for (void* p : owned)
    if (p) mma->device_free(p);
  EXPECT_TRUE(mma->synchronize().is_ok());
}

// A value other than auto or mma is an error naming the variable.
TEST_F(CudaOps, AttentionKernelSwitchIsChecked) { expect_switch_refused("SPILLWAY_CUDA_ATTENTION", "wgmma"); }

// A product with its GELU in cuBLASLt's epilogue (MatmulGeluForward, MatmulGeluBackward)
// and a product's parameter gradients alone (MatmulWeightBackward)
// against the CPU backend, and element by element against the same backend's product
// and GELU kernel run apart: they differ only where the epilogue applies the GELU (or
// its derivative) before rounding the product to bf16. Bits repeat run to run.
TEST_F(CudaOps, MatmulWithGeluEpilogue) {
  ASSERT_NO_FATAL_FAILURE(use_gpu_with_switch_on("SPILLWAY_CUDA_GELU_EPILOGUE"));
  struct Shape {
    int N, C, OC;
  };
  // OC 40 and 3072 (GPT-2's 4C), a leading dimension not a multiple of 8 (OC 20: the
  // GELU after the product instead).
  for (Shape s : {Shape{64, 96, 40}, Shape{512, 768, 3072}, Shape{48, 32, 20}}) {
    SCOPED_TRACE("N=" + std::to_string(s.N) + " C=" + std::to_string(s.C) + " OC=" + std::to_string(s.OC));
    const size_t n_out = size_t(s.N) * s.OC;
    Pair inp = act_random(size_t(s.N) * s.C), w = act_random(size_t(s.OC) * s.C, 0.08f), b = act_random(s.OC);
    Pair out = act_poison(n_out), pre = act_poison(n_out), apart = act_poison(n_out), apart_pre = act_poison(n_out);
    gpu_->matmul_gelu_forward(out.g, pre.g, inp.g, w.g, b.g, s.N, s.C, s.OC);
    cpu_->matmul_gelu_forward(out.c, pre.c, inp.c, w.c, b.c, s.N, s.C, s.OC);
    expect_close(out, "matmul_gelu_forward out");
    expect_close(pre, "matmul_gelu_forward pre");
    gpu_->matmul_forward(apart_pre.g, inp.g, w.g, b.g, s.N, s.C, s.OC);
    gpu_->gelu_forward(apart.g, apart_pre.g, n_out);
    const std::vector<float> fo = gpu_values(out), fp = gpu_values(pre), ao = gpu_values(apart),
                             ap = gpu_values(apart_pre);
    double worst_o = 0, worst_p = 0;
    for (size_t i = 0; i < n_out; ++i) {
      // bf16 keeps 8 bits: two roundings apart are within 2^-7 relative, plus a floor.
      const double dp = std::isfinite(fp[i]) ? std::fabs(fp[i] - ap[i]) - std::fabs(ap[i]) / 64 - 1e-2 : INFINITY;
      const double dO = std::isfinite(fo[i]) ? std::fabs(fo[i] - ao[i]) - std::fabs(ao[i]) / 64 - 1e-2 : INFINITY;
      worst_p = std::max(worst_p, dp);
      worst_o = std::max(worst_o, dO);
    }
    EXPECT_LE(worst_p, 0.0) << "pre against the product alone";
    EXPECT_LE(worst_o, 0.0) << "out against the GELU kernel of the product";
    expect_deterministic({out, pre}, [] {},
                         [&] { gpu_->matmul_gelu_forward(out.g, pre.g, inp.g, w.g, b.g, s.N, s.C, s.OC); },
                         "matmul_gelu_forward");

    // The product after it (fc2: OC inputs, C2 outputs): its input gradient through the
    // GELU, and its parameter gradients alone.
    const int C2 = 48;
    Pair w2 = act_random(size_t(C2) * s.OC, 0.08f), dout = act_random(size_t(s.N) * C2);
    Pair dpre = act_poison(n_out), dw = act_random(size_t(C2) * s.OC), db = act_random(C2);
    auto rw = saver(dw), rb = saver(db);
    gpu_->matmul_gelu_backward(dpre.g, dout.g, w2.g, pre.g, s.N, s.OC, C2);
    gpu_->matmul_weight_backward(dw.g, db.g, dout.g, out.g, s.N, s.OC, C2);
    // The CPU side from the GPU's out and pre (bf16 values), so both differentiate at the same point.
    ASSERT_TRUE(cpu_->upload(out.c, fo.data(), n_out * 4).is_ok());
    ASSERT_TRUE(cpu_->upload(pre.c, fp.data(), n_out * 4).is_ok());
    cpu_->matmul_gelu_backward(dpre.c, dout.c, w2.c, pre.c, s.N, s.OC, C2);
    cpu_->matmul_weight_backward(dw.c, db.c, dout.c, out.c, s.N, s.OC, C2);
    expect_close(dpre, "matmul_gelu_backward dpre");
    expect_close(dw, "matmul_weight_backward dweight");
    expect_close(db, "matmul_weight_backward dbias");
    expect_deterministic({dpre}, [] {}, [&] { gpu_->matmul_gelu_backward(dpre.g, dout.g, w2.g, pre.g, s.N, s.OC, C2); },
                         "matmul_gelu_backward");
    expect_deterministic({dw, db}, [&] { rw(); rb(); },
                         [&] { gpu_->matmul_weight_backward(dw.g, db.g, dout.g, out.g, s.N, s.OC, C2); },
                         "matmul_weight_backward");
  }
}

// A value other than 0 or 1 is an error naming the variable; on by default, and 0 is
// described.
TEST_F(CudaOps, GeluEpilogueSwitchIsChecked) {
  expect_on_by_default_switch("SPILLWAY_CUDA_GELU_EPILOGUE", "GELU in the products' cuBLASLt epilogue");
}

// A product with the residual added in the same cuBLASLt call (MatmulResidualForward:
// beta = 1, the residual as C) against the CPU backend, and element by element
// against the same backend's product and residual kernel run apart: they differ only
// in the product's rounding to bf16 before the add. The residual is left as it was;
// bits repeat run to run.
TEST_F(CudaOps, MatmulWithResidualEpilogue) {
  ASSERT_NO_FATAL_FAILURE(use_gpu_with_switch_on("SPILLWAY_CUDA_RESIDUAL_EPILOGUE"));
  struct Shape {
    int N, C, OC;
  };
  // OC 40; GPT-2 124M's proj and fc2 (C 768 and 3072 into 768); a leading dimension
  // not a multiple of 8 (OC 20).
  for (Shape s : {Shape{64, 96, 40}, Shape{512, 768, 768}, Shape{512, 3072, 768}, Shape{48, 32, 20}}) {
    for (bool with_bias : {true, false}) {
      SCOPED_TRACE("N=" + std::to_string(s.N) + " C=" + std::to_string(s.C) + " OC=" + std::to_string(s.OC) +
                   (with_bias ? " with bias" : " without bias"));
      const size_t n_out = size_t(s.N) * s.OC;
      Pair inp = act_random(size_t(s.N) * s.C), w = act_random(size_t(s.OC) * s.C, 0.08f), b = act_random(s.OC);
      const std::vector<float> residual_values = normal(n_out);
      Pair res = act(residual_values), out = act_poison(n_out), apart = act_poison(n_out), prod = act_poison(n_out);
      const Pair* bias = with_bias ? &b : nullptr;
      gpu_->matmul_residual_forward(out.g, inp.g, w.g, bias ? bias->g : nullptr, res.g, s.N, s.C, s.OC);
      cpu_->matmul_residual_forward(out.c, inp.c, w.c, bias ? bias->c : nullptr, res.c, s.N, s.C, s.OC);
      expect_close(out, "matmul_residual_forward");
      EXPECT_EQ(gpu_values(res), residual_values) << "the residual was written";
      gpu_->matmul_forward(prod.g, inp.g, w.g, bias ? bias->g : nullptr, s.N, s.C, s.OC);
      gpu_->residual_forward(apart.g, res.g, prod.g, n_out);
      const std::vector<float> fo = gpu_values(out), ao = gpu_values(apart), pv = gpu_values(prod);
      double worst = 0;
      for (size_t i = 0; i < n_out; ++i) {
        // The product's rounding (2^-8 of it) and the sum's (2^-8 of each result), plus a floor.
        const double d = std::isfinite(fo[i])
                             ? std::fabs(fo[i] - ao[i]) - std::fabs(pv[i]) / 128 - std::fabs(ao[i]) / 64 - 1e-2
                             : INFINITY;
        worst = std::max(worst, d);
      }
      EXPECT_LE(worst, 0.0) << "out against the product and the residual kernel";
      expect_deterministic({out}, [] {}, [&] {
        gpu_->matmul_residual_forward(out.g, inp.g, w.g, bias ? bias->g : nullptr, res.g, s.N, s.C, s.OC);
      }, "matmul_residual_forward");
    }
  }
}

// A bias' gradient summed in the weight product's BGRADB epilogue
// (SPILLWAY_CUDA_BIAS_EPILOGUE=1), through matmul_backward and matmul_weight_backward,
// against the CPU backend; dbias and dweight are added into, dinp is overwritten or
// added into; bits repeat run to run. Where cuBLASLt has no such algorithm (OC 20) the
// column-sum kernel runs instead, the same way every time.
TEST_F(CudaOps, MatmulWithBiasGradientEpilogue) {
  ASSERT_NO_FATAL_FAILURE(use_gpu_with_switch_on("SPILLWAY_CUDA_BIAS_EPILOGUE"));
  struct Shape {
    int N, C, OC;
  };
  // GPT-2 124M's qkv, proj and fc (C 768 into 2304, 768, 3072) and fc2 (3072 into 768);
  // a small one; OC 20 (a leading dimension not a multiple of 8).
  for (Shape s : {Shape{512, 768, 2304}, Shape{512, 768, 768}, Shape{256, 768, 3072}, Shape{256, 3072, 768},
                  Shape{64, 96, 40}, Shape{48, 32, 20}}) {
    SCOPED_TRACE("N=" + std::to_string(s.N) + " C=" + std::to_string(s.C) + " OC=" + std::to_string(s.OC));
    Pair inp = act_random(size_t(s.N) * s.C), w = act_random(size_t(s.OC) * s.C, 0.05f);
    Pair dout = act_random(size_t(s.N) * s.OC), dinp = act_random(size_t(s.N) * s.C);
    Pair dw = act_random(size_t(s.OC) * s.C), db = act_random(s.OC);  // added into
    auto ri = saver(dinp), rw = saver(dw), rb = saver(db);
    gpu_->matmul_backward(dinp.g, dw.g, db.g, dout.g, inp.g, w.g, s.N, s.C, s.OC, s.OC, /*accumulate_dinp=*/true);
    cpu_->matmul_backward(dinp.c, dw.c, db.c, dout.c, inp.c, w.c, s.N, s.C, s.OC, s.OC, true);
    expect_close(dinp, "matmul_backward dinp");
    expect_close(dw, "matmul_backward dweight");
    expect_close(db, "matmul_backward dbias");
    expect_deterministic({dinp, dw, db}, [&] { ri(); rw(); rb(); },
                         [&] {
                           gpu_->matmul_backward(dinp.g, dw.g, db.g, dout.g, inp.g, w.g, s.N, s.C, s.OC, s.OC, true);
                         },
                         "matmul_backward");
    Pair dw2 = act_random(size_t(s.OC) * s.C), db2 = act_random(s.OC);
    auto rw2 = saver(dw2), rb2 = saver(db2);
    gpu_->matmul_weight_backward(dw2.g, db2.g, dout.g, inp.g, s.N, s.C, s.OC);
    cpu_->matmul_weight_backward(dw2.c, db2.c, dout.c, inp.c, s.N, s.C, s.OC);
    expect_close(dw2, "matmul_weight_backward dweight");
    expect_close(db2, "matmul_weight_backward dbias");
    expect_deterministic({dw2, db2}, [&] { rw2(); rb2(); },
                         [&] { gpu_->matmul_weight_backward(dw2.g, db2.g, dout.g, inp.g, s.N, s.C, s.OC); },
                         "matmul_weight_backward");
  }
}

// A value other than 0 or 1 is an error naming the variable; on by default, and 0 is
// described.
TEST_F(CudaOps, BiasEpilogueSwitchIsChecked) {
  expect_on_by_default_switch("SPILLWAY_CUDA_BIAS_EPILOGUE", "bias gradients in the weight products' BGRADB epilogue");
}

// A value other than 0 or 1 is an error naming the variable; on by default, and 0 is
// described.
TEST_F(CudaOps, ResidualEpilogueSwitchIsChecked) {
  expect_on_by_default_switch("SPILLWAY_CUDA_RESIDUAL_EPILOGUE", "residual adds in the products' cuBLASLt call");
}

}  // namespace
