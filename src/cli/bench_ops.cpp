// `spillway bench ops`: the time of each op of a GPT step on a backend, at one
// model shape (gpt2-124m by default), and matrix-product and attention rates.
//
//   spillway bench ops --backend cuda --B 16 --T 1024 --C 768 --NH 12 --V 50304
//   spillway bench ops --backend cpu --B 1 --T 256 --reps 2
//
// Inputs are pseudo-random (never zeros). Each op runs once untimed (warm-up,
// algorithm choice), then `rounds` times `reps` back to back; a round is timed
// from a synchronize() to a synchronize(), and the median round gives the time.
// Each row says how many times one training step (L layers, one micro-batch, fwd + bwd +
// AdamW) runs it, as the GPT-2 program builds the step, or "part" for the pieces of a
// fused op shown beside it; the last lines estimate the step as the sum of rows times
// their counts.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "backend/backend.h"
#include "cli/command.h"
#include "core/size.h"
#include "optim/adamw.h"

namespace spillway::cli {
namespace {

struct Options {
  std::string backend = "cuda";
  int B = 16, T = 1024, C = 768, NH = 12, V = 50304, L = 12;
  int reps = 10, rounds = 5;
  int threads = 0;
};

class Bench {
 public:
  Bench(Backend& b, const Options& o) : b_(b), o_(o), act_bytes_(dtype_size(b.activation_dtype())) {}
  ~Bench() {
    (void)b_.synchronize();  // nothing to report to on the way out
    for (void* p : allocs_) b_.device_free(p);
  }

  // A device tensor of n activation-dtype (or 4-byte) elements with pseudo-random
  // values of magnitude ~scale.
  Result<void*> tensor(size_t n, bool f32 = false, float scale = 1.0f) {
    const size_t esize = f32 ? 4 : act_bytes_;
    SPILLWAY_ASSIGN_OR_RETURN(void* p, b_.device_alloc(std::max<size_t>(n * esize, 1)));
    allocs_.push_back(p);
    // A 4 MiB random pattern tiled over the tensor.
    const size_t chunk_elems = std::min<size_t>(n, size_t{1} << 20);
    std::vector<uint8_t> pattern(chunk_elems * esize);
    uint64_t z = 0x9e3779b97f4a7c15ull * (allocs_.size() + 1);
    for (size_t i = 0; i < chunk_elems; ++i) {
      z ^= z >> 12;
      z ^= z << 25;
      z ^= z >> 27;
      const float u = static_cast<float>((z * 0x2545f4914f6cdd1dull) >> 40) / 16777216.0f;  // [0, 1)
      const float x = (2.0f * u - 1.0f) * scale;
      if (esize == 4) {
        std::memcpy(&pattern[i * 4], &x, 4);
      } else {
        const uint16_t h = float_to_bf16(x);
        std::memcpy(&pattern[i * 2], &h, 2);
      }
    }
    for (size_t done = 0; done < n; done += chunk_elems) {
      const size_t count = std::min(chunk_elems, n - done);
      SPILLWAY_RETURN_IF_ERROR(b_.upload(static_cast<uint8_t*>(p) + done * esize, pattern.data(), count * esize));
    }
    return p;
  }

  Result<int32_t*> tokens(size_t n) {
    SPILLWAY_ASSIGN_OR_RETURN(void* p, b_.device_alloc(n * 4));
    allocs_.push_back(p);
    std::vector<int32_t> t(n);
    uint64_t z = 88172645463325252ull;
    for (auto& x : t) {
      z ^= z << 13;
      z ^= z >> 7;
      z ^= z << 17;
      x = static_cast<int32_t>(z % static_cast<uint64_t>(o_.V));
    }
    SPILLWAY_RETURN_IF_ERROR(b_.upload(p, t.data(), n * 4));
    return static_cast<int32_t*>(p);
  }

  // Median milliseconds of one call of `op`.
  Result<double> time(const std::function<void()>& op) {
    op();
    SPILLWAY_RETURN_IF_ERROR(b_.synchronize());
    std::vector<double> ms;
    for (int r = 0; r < o_.rounds; ++r) {
      SPILLWAY_RETURN_IF_ERROR(b_.synchronize());
      auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < o_.reps; ++i) op();
      SPILLWAY_RETURN_IF_ERROR(b_.synchronize());
      auto t1 = std::chrono::steady_clock::now();
      ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count() / o_.reps);
    }
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2];
  }

  // Prints one row: name, ms, how many times a step runs it (`per_step`; 0: a part of a
  // fused op, not summed), and the rate when flops > 0 (and bytes > 0). Adds
  // ms × per_step to the step estimate.
  Status row(const std::string& name, double flops, double bytes, const std::function<void()>& op, int per_step) {
    SPILLWAY_ASSIGN_OR_RETURN(double ms, time(op));
    std::printf("%-34s %10.3f ms  %6s", name.c_str(), ms, per_step > 0 ? ("x" + std::to_string(per_step)).c_str() : "part");
    if (flops > 0) std::printf("  %8.1f TFLOP/s", flops / (ms * 1e-3) / 1e12);
    if (bytes > 0) std::printf("  %8.1f GB/s", bytes / (ms * 1e-3) / 1e9);
    std::printf("\n");
    std::fflush(stdout);
    step_ms_ += ms * per_step;
    return Status::ok();
  }
  double step_ms() const { return step_ms_; }  // the rows' sum, each times its count

 private:
  Backend& b_;
  const Options& o_;
  size_t act_bytes_;
  std::vector<void*> allocs_;
  double step_ms_ = 0;
};

Status run_ops(Backend& b, const Options& o) {
  const int B = o.B, T = o.T, C = o.C, NH = o.NH, V = o.V, L = o.L;
  const size_t N = static_cast<size_t>(B) * T;
  const double a = static_cast<double>(dtype_size(b.activation_dtype()));
  std::printf("backend %s: %s\nshape B=%d T=%d C=%d NH=%d V=%d (L=%d for the step estimate); %d rounds x %d reps, median\n\n",
              b.name().c_str(), b.description().c_str(), B, T, C, NH, V, L, o.rounds, o.reps);
  Bench bench(b, o);
  // The ops run outside an executor: the backend holds the workspace the largest needs.
  size_t workspace = std::max({b.matmul_workspace(static_cast<int>(N), std::max(V, 4 * C), true, true),
                               b.attention_backward_workspace(B, T, NH),
                               b.layernorm_backward_workspace(static_cast<int>(N), C),
                               b.embedding_backward_workspace(B, T), b.squared_norm_workspace()});
  if (workspace == SIZE_MAX) return Status::internal("the backend cannot size the workspace of the benchmarked ops");
  SPILLWAY_RETURN_IF_ERROR(b.use_own_workspace(workspace));
  struct Release {
    Backend& b;
    ~Release() { (void)b.use_own_workspace(0); }
  } release{b};
  SPILLWAY_ASSIGN_OR_RETURN(int32_t* tok, bench.tokens(N));
  SPILLWAY_ASSIGN_OR_RETURN(void* x, bench.tensor(N * C));
  SPILLWAY_ASSIGN_OR_RETURN(void* y, bench.tensor(N * C));
  SPILLWAY_ASSIGN_OR_RETURN(void* dx, bench.tensor(N * C));
  SPILLWAY_ASSIGN_OR_RETURN(void* big, bench.tensor(N * 4 * C));
  SPILLWAY_ASSIGN_OR_RETURN(void* big2, bench.tensor(N * 4 * C));
  SPILLWAY_ASSIGN_OR_RETURN(void* qkv, bench.tensor(N * 3 * C));
  SPILLWAY_ASSIGN_OR_RETURN(void* dqkv, bench.tensor(N * 3 * C));
  SPILLWAY_ASSIGN_OR_RETURN(void* stat, bench.tensor(N * NH, true));
  SPILLWAY_ASSIGN_OR_RETURN(void* mean, bench.tensor(N, true));
  SPILLWAY_ASSIGN_OR_RETURN(void* rstd, bench.tensor(N, true));
  SPILLWAY_ASSIGN_OR_RETURN(void* losses, bench.tensor(N, true));
  SPILLWAY_ASSIGN_OR_RETURN(void* logits, bench.tensor(N * static_cast<size_t>(V), false, 4.0f));
  SPILLWAY_ASSIGN_OR_RETURN(void* wte, bench.tensor(static_cast<size_t>(V) * C, false, 0.02f));
  SPILLWAY_ASSIGN_OR_RETURN(void* dwte, bench.tensor(static_cast<size_t>(V) * C, false, 0.02f));
  SPILLWAY_ASSIGN_OR_RETURN(void* wpe, bench.tensor(static_cast<size_t>(T) * C, false, 0.02f));
  SPILLWAY_ASSIGN_OR_RETURN(void* dwpe, bench.tensor(static_cast<size_t>(T) * C, false, 0.02f));
  SPILLWAY_ASSIGN_OR_RETURN(void* w, bench.tensor(static_cast<size_t>(4) * C * C, false, 0.02f));
  SPILLWAY_ASSIGN_OR_RETURN(void* dw, bench.tensor(static_cast<size_t>(4) * C * C, false, 0.02f));
  SPILLWAY_ASSIGN_OR_RETURN(void* bias, bench.tensor(static_cast<size_t>(4) * C, false, 0.02f));
  SPILLWAY_ASSIGN_OR_RETURN(void* dbias, bench.tensor(static_cast<size_t>(4) * C, false, 0.02f));
  SPILLWAY_ASSIGN_OR_RETURN(void* sq, bench.tensor(2, true));

  // How many times one step runs an op: once per layer, or once.
  const int per_layer = L, once = 1, part = 0;
  struct Mm {
    const char* name;
    int C, OC;
    bool bias;
    int fwd, bwd;  // per step: the forward and the backward run as these rows, or parts
  };
  // proj's and fc proj's forwards run with the residual add (MatmulResidualForward),
  // fc's with its GELU (MatmulGeluForward), fc proj's backward as its weight gradients
  // and its input gradient through the GELU (rows below).
  const Mm mms[] = {{"qkv", C, 3 * C, true, per_layer, per_layer},
                    {"attn proj", C, C, true, part, per_layer},
                    {"fc", C, 4 * C, true, part, per_layer},
                    {"fc proj", 4 * C, C, true, part, part},
                    {"lm head", C, V, false, once, once}};
  std::printf("%-34s %10s  %6s\n", "op", "time", "step");
  for (const Mm& m : mms) {
    const double flops = 2.0 * N * m.C * m.OC;
    const void* wt = m.OC == V ? wte : w;
    void* dwt = m.OC == V ? dwte : dw;
    void* out = m.OC == V ? logits : (m.OC == C ? y : big);  // also the dout of the backward
    const void* in = m.C == 4 * C ? big2 : x;
    void* din = m.C == 4 * C ? big : dx;
    SPILLWAY_RETURN_IF_ERROR(bench.row(std::string("matmul fwd ") + m.name, flops, 0,
                                       [&] { b.matmul_forward(out, in, wt, m.bias ? bias : nullptr, N, m.C, m.OC); }, m.fwd));
    SPILLWAY_RETURN_IF_ERROR(bench.row(std::string("matmul bwd ") + m.name, 2 * flops, 0,
                                       [&] { b.matmul_backward(din, dwt, m.bias ? dbias : nullptr, out, in, wt, N, m.C, m.OC); },
                                       m.bwd));
  }
  const double HD = static_cast<double>(C) / NH;
  const double attn_flops = 4.0 * B * NH * HD * T * (T + 1) / 2.0;  // causal QKᵀ and PV
  SPILLWAY_RETURN_IF_ERROR(bench.row("attention fwd", attn_flops, 0,
                                     [&] { b.attention_forward(y, static_cast<float*>(stat), qkv, B, T, C, NH); }, per_layer));
  SPILLWAY_RETURN_IF_ERROR(bench.row("attention bwd (2.5x fwd flops)", 2.5 * attn_flops, 0,
                                     [&] {
                                       b.attention_backward(dqkv, dx, qkv, y, static_cast<float*>(stat), B, T, C, NH);
                                     },
                                     per_layer));
  const double nc = static_cast<double>(N) * C;
  SPILLWAY_RETURN_IF_ERROR(bench.row("layernorm fwd", 0, nc * a * 2, [&] {
    b.layernorm_forward(y, static_cast<float*>(mean), static_cast<float*>(rstd), x, w, bias, N, C);
  }, 2 * per_layer + once));
  SPILLWAY_RETURN_IF_ERROR(bench.row("layernorm bwd", 0, nc * a * 4, [&] {
    b.layernorm_backward(dx, dw, dbias, y, x, w, static_cast<float*>(mean), static_cast<float*>(rstd), N, C);
  }, 2 * per_layer + once));
  SPILLWAY_RETURN_IF_ERROR(bench.row("gelu fwd", 0, 4 * nc * a * 2, [&] { b.gelu_forward(big2, big, N * 4 * C); }, part));
  SPILLWAY_RETURN_IF_ERROR(
      bench.row("gelu bwd", 0, 4 * nc * a * 3, [&] { b.gelu_backward(big2, big, big2, N * 4 * C); }, part));
  SPILLWAY_RETURN_IF_ERROR(bench.row("residual", 0, nc * a * 3, [&] { b.residual_forward(y, x, dx, N * C); }, part));
  // The fused ops GPT-2's program runs in place of the parts above: fc + gelu fwd
  // (MatmulGeluForward), fc proj bwd + gelu bwd (MatmulGeluBackward and
  // MatmulWeightBackward), attn proj and fc proj fwd + residual (MatmulResidualForward).
  // How a backend runs each (one kernel or its parts) is its own choice.
  const double fc_flops = 2.0 * N * C * 4 * C;
  SPILLWAY_RETURN_IF_ERROR(bench.row("fc fwd + gelu, one op", fc_flops, 0, [&] {
    b.matmul_gelu_forward(big2, big, x, w, bias, N, C, 4 * C);
  }, per_layer));
  SPILLWAY_RETURN_IF_ERROR(bench.row("fc proj bwd dinp + dgelu, one op", fc_flops, 0, [&] {
    b.matmul_gelu_backward(big, y, w, big2, N, 4 * C, C);
  }, per_layer));
  SPILLWAY_RETURN_IF_ERROR(bench.row("fc proj bwd weights, one op", fc_flops, 0, [&] {
    b.matmul_weight_backward(dw, dbias, y, big2, N, 4 * C, C);
  }, per_layer));
  SPILLWAY_RETURN_IF_ERROR(bench.row("attn proj fwd + residual, one op", 2.0 * N * C * C, 0, [&] {
    b.matmul_residual_forward(y, x, w, bias, dx, N, C, C);
  }, per_layer));
  SPILLWAY_RETURN_IF_ERROR(bench.row("fc proj fwd + residual, one op", fc_flops, 0, [&] {
    b.matmul_residual_forward(y, big2, w, bias, dx, N, 4 * C, C);
  }, per_layer));
  SPILLWAY_RETURN_IF_ERROR(
      bench.row("embedding fwd", 0, nc * a * 2, [&] { b.embedding_forward(y, tok, wte, wpe, B, T, C); }, once));
  SPILLWAY_RETURN_IF_ERROR(
      bench.row("embedding bwd", 0, nc * a * 3, [&] { b.embedding_backward(dwte, dwpe, dx, tok, B, T, C); }, once));
  const double nv = static_cast<double>(N) * V;
  SPILLWAY_RETURN_IF_ERROR(bench.row("crossentropy fwd", 0, nv * a, [&] {
    b.crossentropy_forward(static_cast<float*>(losses), logits, tok, N, V);
  }, part));
  SPILLWAY_RETURN_IF_ERROR(bench.row("crossentropy fwd+bwd (fused)", 0, nv * a * 3, [&] {
    b.crossentropy_backward(static_cast<float*>(losses), logits, tok, N, V, 1.0f / N);
  }, once));

  // The optimizer over every parameter of the model, as one tensor.
  const size_t P = static_cast<size_t>(V) * C + static_cast<size_t>(T) * C +
                   static_cast<size_t>(L) * (12 * static_cast<size_t>(C) * C + 13 * static_cast<size_t>(C)) + 2 * C;
  SPILLWAY_ASSIGN_OR_RETURN(void* param, bench.tensor(P, false, 0.02f));
  SPILLWAY_ASSIGN_OR_RETURN(void* grad, bench.tensor(P, false, 0.001f));
  SPILLWAY_ASSIGN_OR_RETURN(void* master, bench.tensor(P, true, 0.02f));
  SPILLWAY_ASSIGN_OR_RETURN(void* mom, bench.tensor(P, true, 0.001f));
  SPILLWAY_ASSIGN_OR_RETURN(void* var, bench.tensor(P, true, 0.0f));
  SPILLWAY_ASSIGN_OR_RETURN(void* scale_norm, bench.tensor(2, true, 0.0f));
  const float one[2] = {1.0f, 1.0f};
  SPILLWAY_RETURN_IF_ERROR(b.upload(scale_norm, one, sizeof(one)));
  const double pa = static_cast<double>(P);
  SPILLWAY_RETURN_IF_ERROR(bench.row("squared_norm (all params)", 0, pa * a,
                                     [&] { b.squared_norm(static_cast<float*>(sq), grad, P); }, once));
  const AdamWHyper h = adamw_hyper(6e-4f, 10, 0.1f);
  SPILLWAY_RETURN_IF_ERROR(bench.row("adamw (all params)", 0, pa * (2 * a + 24), [&] {
    b.adamw(param, static_cast<float*>(master), static_cast<float*>(mom), static_cast<float*>(var), grad,
            static_cast<float*>(scale_norm), P, h);
  }, once));

  const double step_ms = bench.step_ms();
  const double step_flops = 6.0 * static_cast<double>(P) * N + L * 3.5 * attn_flops;
  std::printf("step estimate (%zu params)   %10.3f ms  %8.1f TFLOP/s  %8.0f tok/s\n", P, step_ms,
              step_flops / (step_ms * 1e-3) / 1e12, static_cast<double>(N) / (step_ms * 1e-3));
  return b.synchronize();
}

int run(const Options& o) {
  for (auto [flag, value] : {std::pair{"--B", o.B}, std::pair{"--T", o.T}, std::pair{"--C", o.C},
                              std::pair{"--NH", o.NH}, std::pair{"--V", o.V}, std::pair{"--L", o.L}})
    if (value < 1)
      return fail(Status::invalid_argument(std::string("bench ops: ") + flag + " is " + std::to_string(value) +
                                           "; expected a positive whole number"));
  if (o.C % o.NH != 0)
    return fail(Status::invalid_argument("bench ops: --C " + std::to_string(o.C) + " is not a multiple of --NH " +
                                         std::to_string(o.NH) + " (each head takes C/NH channels)"));
  if (o.reps < 1 || o.rounds < 1) return fail(Status::invalid_argument("bench ops: --reps and --rounds must be >= 1"));
  auto backend = make_backend(o.backend, {.threads = o.threads});
  if (!backend) return fail(backend.status());
  Status s = run_ops(**backend, o);
  if (!s.is_ok()) return fail(s);
  return 0;
}

CommandRegistration reg("bench ops", "time each op of a GPT step on a backend", [](CLI::App& app) {
  auto o = std::make_shared<Options>();
  app.add_option("--backend", o->backend, "cpu, cuda or auto")->capture_default_str();
  app.add_option("--B", o->B, "batch size")->capture_default_str();
  app.add_option("--T", o->T, "sequence length")->capture_default_str();
  app.add_option("--C", o->C, "model width")->capture_default_str();
  app.add_option("--NH", o->NH, "attention heads")->capture_default_str();
  app.add_option("--V", o->V, "vocabulary size")->capture_default_str();
  app.add_option("--L", o->L, "layers, for the step estimate")->capture_default_str();
  app.add_option("--reps", o->reps, "calls per timed round")->capture_default_str();
  app.add_option("--rounds", o->rounds, "timed rounds (the median is reported)")->capture_default_str();
  app.add_option("--threads", o->threads, "CPU backend threads (0 = all cores)")->capture_default_str();
  return [o]() -> int { return run(*o); };
});

}  // namespace
}  // namespace spillway::cli
