// The CPU backend's ops against float64 references: every forward against a
// float64 forward, every backward against central differences of a random linear
// functional L = Σ w ⊙ out of that float64 forward. Also the accumulate-vs-overwrite
// conventions of backend/backend.h.
#include <gtest/gtest.h>

#include "support/test_support.h"

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <vector>

#include "backend/backend.h"
#include "backend/cpu/vector_math.h"
#include "optim/adamw.h"

using namespace spillway;

namespace {

using Vec = std::vector<double>;
using Fn = std::function<Vec(const Vec&)>;

using testing_support::random_floats;
using testing_support::random_ints;

Vec to_double(const std::vector<float>& v) { return Vec(v.begin(), v.end()); }

Vec plus(const Vec& a, const Vec& b) {
  Vec r(a.size());
  for (size_t i = 0; i < a.size(); ++i) r[i] = a[i] + b[i];
  return r;
}

// Gradient of L(x) = Σ w ⊙ f(x) by central differences.
Vec finite_difference_gradient(const Fn& f, Vec x, const Vec& w) {
  const double h = 1e-5;
  Vec g(x.size());
  auto L = [&](const Vec& xs) {
    Vec out = f(xs);
    double s = 0;
    for (size_t i = 0; i < out.size(); ++i) s += w[i] * out[i];
    return s;
  };
  for (size_t i = 0; i < x.size(); ++i) {
    const double xi = x[i];
    x[i] = xi + h;
    const double lp = L(x);
    x[i] = xi - h;
    const double lm = L(x);
    x[i] = xi;
    g[i] = (lp - lm) / (2 * h);
  }
  return g;
}

// |got - want| <= rtol |want| + atol_frac max|want| for every element.
void expect_close(const std::vector<float>& got, const Vec& want, const char* what, double rtol = 1e-4,
                  double atol_frac = 1e-5) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double scale = 0;
  for (double w : want) scale = std::max(scale, std::abs(w));
  size_t worst = 0;
  double worst_ratio = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double tol = rtol * std::abs(want[i]) + atol_frac * scale + 1e-30;
    const double ratio = std::abs(static_cast<double>(got[i]) - want[i]) / tol;
    if (!(ratio <= worst_ratio)) {  // also catches NaN
      worst_ratio = ratio;
      worst = i;
    }
  }
  EXPECT_LE(worst_ratio, 1.0) << what << ": element " << worst << " is " << got[worst] << ", want " << want[worst]
                              << " (max |want| " << scale << ")";
}

// Device buffers of one backend, freed at the end of a test.
class Buffers {
 public:
  explicit Buffers(Backend& b) : b_(b) {}
  ~Buffers() {
    for (void* p : owned_) b_.device_free(p);
  }
  template <class T>
  T* make(const std::vector<T>& host) {
    auto r = b_.device_alloc(std::max<size_t>(1, host.size()) * sizeof(T));
    EXPECT_TRUE(r.ok()) << r.status().to_string();
    owned_.push_back(*r);
    EXPECT_TRUE(b_.upload(*r, host.data(), host.size() * sizeof(T)).is_ok());
    return static_cast<T*>(*r);
  }
  template <class T>
  std::vector<T> get(const T* p, size_t n) {
    std::vector<T> v(n);
    EXPECT_TRUE(b_.download(v.data(), p, n * sizeof(T)).is_ok());
    return v;
  }

 private:
  Backend& b_;
  std::vector<void*> owned_;
};

std::unique_ptr<Backend> cpu_backend(int threads) {
  auto r = make_backend("cpu", {.threads = threads});
  EXPECT_TRUE(r.ok()) << r.status().to_string();
  return std::move(r).value();
}

const float kNaN = std::numeric_limits<float>::quiet_NaN();

// ---- float64 references ----

Vec ref_embedding(const std::vector<int32_t>& tokens, const Vec& wte, const Vec& wpe, int B, int T, int C) {
  Vec out(static_cast<size_t>(B) * T * C);
  for (int b = 0; b < B; ++b)
    for (int t = 0; t < T; ++t)
      for (int c = 0; c < C; ++c)
        out[(b * T + t) * C + c] = wte[tokens[b * T + t] * C + c] + wpe[t * C + c];
  return out;
}

// out[N,C]; mean and rstd, when given, receive the statistics.
Vec ref_layernorm(const Vec& x, const Vec& w, const Vec& bias, int N, int C, Vec* mean = nullptr,
                  Vec* rstd = nullptr) {
  Vec out(x.size());
  if (mean) mean->assign(N, 0);
  if (rstd) rstd->assign(N, 0);
  for (int n = 0; n < N; ++n) {
    double m = 0, v = 0;
    for (int c = 0; c < C; ++c) m += x[n * C + c];
    m /= C;
    for (int c = 0; c < C; ++c) v += (x[n * C + c] - m) * (x[n * C + c] - m);
    v /= C;
    const double s = 1.0 / std::sqrt(v + 1e-5);
    for (int c = 0; c < C; ++c) out[n * C + c] = (x[n * C + c] - m) * s * w[c] + bias[c];
    if (mean) (*mean)[n] = m;
    if (rstd) (*rstd)[n] = s;
  }
  return out;
}

// RMSNorm (Llama): out[N,C] = x / sqrt(mean(x²) + eps) * w; rstd, when given, receives
// 1/sqrt(mean(x²) + eps) per row.
Vec ref_rmsnorm(const Vec& x, const Vec& w, int N, int C, double eps, Vec* rstd = nullptr) {
  Vec out(x.size());
  if (rstd) rstd->assign(N, 0);
  for (int n = 0; n < N; ++n) {
    double ms = 0;
    for (int c = 0; c < C; ++c) ms += x[n * C + c] * x[n * C + c];
    const double s = 1.0 / std::sqrt(ms / C + eps);
    for (int c = 0; c < C; ++c) out[n * C + c] = x[n * C + c] * s * w[c];
    if (rstd) (*rstd)[n] = s;
  }
  return out;
}

Vec ref_matmul(const Vec& inp, const Vec& w, const Vec* bias, int N, int C, int OC) {
  Vec out(static_cast<size_t>(N) * OC);
  for (int n = 0; n < N; ++n)
    for (int o = 0; o < OC; ++o) {
      double s = bias ? (*bias)[o] : 0.0;
      for (int c = 0; c < C; ++c) s += inp[n * C + c] * w[o * C + c];
      out[n * OC + o] = s;
    }
  return out;
}

// out[B,T,C]; lse[B,NH,T] when given. qkv[B,T,(NH+2·KVH)·hs]: query head h reads
// key/value head h / (NH/KVH) (KVH = 0: NH).
Vec ref_attention(const Vec& qkv, int B, int T, int C, int NH, Vec* lse = nullptr, int KVH = 0) {
  const int hs = C / NH;
  if (KVH == 0) KVH = NH;
  const int W = (NH + 2 * KVH) * hs;  // row width of qkv
  const double scale = 1.0 / std::sqrt(static_cast<double>(hs));
  Vec out(static_cast<size_t>(B) * T * C, 0.0);
  if (lse) lse->assign(static_cast<size_t>(B) * NH * T, 0.0);
  Vec s(T);
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < NH; ++h)
      for (int i = 0; i < T; ++i) {
        const int g = h / (NH / KVH);
        const double* q = &qkv[(b * T + i) * W + h * hs];
        double m = -1e300;
        for (int j = 0; j <= i; ++j) {
          const double* k = &qkv[(b * T + j) * W + (NH + g) * hs];
          double d = 0;
          for (int e = 0; e < hs; ++e) d += q[e] * k[e];
          s[j] = d * scale;
          m = std::max(m, s[j]);
        }
        double sum = 0;
        for (int j = 0; j <= i; ++j) sum += std::exp(s[j] - m);
        const double l = m + std::log(sum);
        if (lse) (*lse)[(b * NH + h) * T + i] = l;
        for (int j = 0; j <= i; ++j) {
          const double p = std::exp(s[j] - l);
          const double* v = &qkv[(b * T + j) * W + (NH + KVH + g) * hs];
          for (int e = 0; e < hs; ++e) out[(b * T + i) * C + h * hs + e] += p * v[e];
        }
      }
  return out;
}

double ref_gelu(double x) {
  const double k = std::sqrt(2.0 / M_PI);
  return 0.5 * x * (1.0 + std::tanh(k * (x + 0.044715 * x * x * x)));
}

Vec ref_crossentropy(const Vec& logits, const std::vector<int32_t>& targets, int N, int V) {
  Vec losses(N);
  for (int n = 0; n < N; ++n) {
    double m = -1e300;
    for (int v = 0; v < V; ++v) m = std::max(m, logits[n * V + v]);
    double s = 0;
    for (int v = 0; v < V; ++v) s += std::exp(logits[n * V + v] - m);
    losses[n] = m + std::log(s) - logits[n * V + targets[n]];
  }
  return losses;
}

}  // namespace

TEST(CpuOps, EmbeddingForwardAndBackwardAccumulate) {
  const int B = 2, T = 5, C = 8, V = 11, T_max = 7;
  auto be = cpu_backend(2);
  Buffers buf(*be);
  auto tokens = random_ints(B * T, 1, V);
  tokens[7] = tokens[2];  // a repeated token
  auto wte = random_floats(V * C, 2), wpe = random_floats(T_max * C, 3);
  auto w = random_floats(B * T * C, 4);
  auto dwte0 = random_floats(V * C, 5), dwpe0 = random_floats(T_max * C, 6);
  int32_t* d_tokens = buf.make(tokens);
  float* d_out = buf.make(std::vector<float>(B * T * C, kNaN));
  float* d_wte = buf.make(wte);
  float* d_wpe = buf.make(wpe);
  float* d_w = buf.make(w);
  float* d_dwte = buf.make(dwte0);
  float* d_dwpe = buf.make(dwpe0);

  be->embedding_forward(d_out, d_tokens, d_wte, d_wpe, B, T, C);
  const Vec wte_d = to_double(wte), wpe_d = to_double(wpe);
  expect_close(buf.get(d_out, B * T * C), ref_embedding(tokens, wte_d, wpe_d, B, T, C), "embedding out");

  be->embedding_backward(d_dwte, d_dwpe, d_w, d_tokens, B, T, C);
  const Vec wd = to_double(w);
  Vec g_wte = finite_difference_gradient([&](const Vec& x) { return ref_embedding(tokens, x, wpe_d, B, T, C); },
                                         wte_d, wd);
  Vec g_wpe = finite_difference_gradient([&](const Vec& x) { return ref_embedding(tokens, wte_d, x, B, T, C); },
                                         wpe_d, wd);
  expect_close(buf.get(d_dwte, V * C), plus(to_double(dwte0), g_wte), "dwte (added into)");
  expect_close(buf.get(d_dwpe, T_max * C), plus(to_double(dwpe0), g_wpe), "dwpe (added into)");
}

TEST(CpuOps, LayerNormForwardAndBackwardAccumulate) {
  const int N = 2 * 6, C = 16;
  auto be = cpu_backend(2);
  Buffers buf(*be);
  auto x = random_floats(N * C, 10, -0.7f, 1.6f);
  auto wt = random_floats(C, 11, 0.5f, 1.5f), bias = random_floats(C, 12);
  auto w = random_floats(N * C, 13);
  auto dinp0 = random_floats(N * C, 14), dw0 = random_floats(C, 15), db0 = random_floats(C, 16);
  float* d_x = buf.make(x);
  float* d_wt = buf.make(wt);
  float* d_b = buf.make(bias);
  float* d_out = buf.make(std::vector<float>(N * C, kNaN));
  float* d_mean = buf.make(std::vector<float>(N, kNaN));
  float* d_rstd = buf.make(std::vector<float>(N, kNaN));
  float* d_w = buf.make(w);
  float* d_dinp = buf.make(dinp0);
  float* d_dw = buf.make(dw0);
  float* d_db = buf.make(db0);

  be->layernorm_forward(d_out, d_mean, d_rstd, d_x, d_wt, d_b, N, C);
  const Vec xd = to_double(x), wtd = to_double(wt), bd = to_double(bias), wd = to_double(w);
  Vec mean, rstd;
  Vec out = ref_layernorm(xd, wtd, bd, N, C, &mean, &rstd);
  expect_close(buf.get(d_out, N * C), out, "layernorm out");
  expect_close(buf.get(d_mean, N), mean, "layernorm mean");
  expect_close(buf.get(d_rstd, N), rstd, "layernorm rstd");

  be->layernorm_backward(d_dinp, d_dw, d_db, d_w, d_x, d_wt, d_mean, d_rstd, N, C);
  Vec g_x = finite_difference_gradient([&](const Vec& v) { return ref_layernorm(v, wtd, bd, N, C); }, xd, wd);
  Vec g_w = finite_difference_gradient([&](const Vec& v) { return ref_layernorm(xd, v, bd, N, C); }, wtd, wd);
  Vec g_b = finite_difference_gradient([&](const Vec& v) { return ref_layernorm(xd, wtd, v, N, C); }, bd, wd);
  expect_close(buf.get(d_dinp, N * C), plus(to_double(dinp0), g_x), "layernorm dinp (added into)");
  expect_close(buf.get(d_dw, C), plus(to_double(dw0), g_w), "layernorm dweight (added into)");
  expect_close(buf.get(d_db, C), plus(to_double(db0), g_b), "layernorm dbias (added into)");
}

TEST(CpuOps, LayerNormBackwardOverManyRowBlocks) {
  // 100 rows span several fixed row blocks of the dweight/dbias reduction.
  const int N = 100, C = 24;
  auto be = cpu_backend(3);
  Buffers buf(*be);
  auto x = random_floats(N * C, 20, -1.0f, 2.0f);
  auto wt = random_floats(C, 21, 0.5f, 1.5f), bias = random_floats(C, 22), w = random_floats(N * C, 23);
  float* d_x = buf.make(x);
  float* d_wt = buf.make(wt);
  float* d_b = buf.make(bias);
  float* d_out = buf.make(std::vector<float>(N * C));
  float* d_mean = buf.make(std::vector<float>(N));
  float* d_rstd = buf.make(std::vector<float>(N));
  float* d_w = buf.make(w);
  float* d_dinp = buf.make(std::vector<float>(N * C, 0.0f));
  float* d_dw = buf.make(std::vector<float>(C, 0.0f));
  float* d_db = buf.make(std::vector<float>(C, 0.0f));
  be->layernorm_forward(d_out, d_mean, d_rstd, d_x, d_wt, d_b, N, C);
  be->layernorm_backward(d_dinp, d_dw, d_db, d_w, d_x, d_wt, d_mean, d_rstd, N, C);
  const Vec xd = to_double(x), wtd = to_double(wt), bd = to_double(bias), wd = to_double(w);
  expect_close(buf.get(d_dw, C),
               finite_difference_gradient([&](const Vec& v) { return ref_layernorm(xd, v, bd, N, C); }, wtd, wd),
               "layernorm dweight");
  expect_close(buf.get(d_db, C),
               finite_difference_gradient([&](const Vec& v) { return ref_layernorm(xd, wtd, v, N, C); }, bd, wd),
               "layernorm dbias");
}

// N rows over several fixed row blocks of the dweight reduction (32 rows each), an
// odd C (the vector loops' scalar tails), the accumulate conventions (dinp and dweight
// added into), and an eps large enough to matter.
void check_rmsnorm(int N, int C, float eps, int threads, uint32_t seed) {
  auto be = cpu_backend(threads);
  Buffers buf(*be);
  auto x = random_floats(N * C, seed, -1.3f, 1.7f);
  auto wt = random_floats(C, seed + 1, 0.5f, 1.5f);
  auto w = random_floats(N * C, seed + 2);
  auto dinp0 = random_floats(N * C, seed + 3), dw0 = random_floats(C, seed + 4);
  float* d_x = buf.make(x);
  float* d_wt = buf.make(wt);
  float* d_out = buf.make(std::vector<float>(N * C, kNaN));
  float* d_rstd = buf.make(std::vector<float>(N, kNaN));
  float* d_w = buf.make(w);
  float* d_dinp = buf.make(dinp0);
  float* d_dw = buf.make(dw0);

  be->rmsnorm_forward(d_out, d_rstd, d_x, d_wt, N, C, eps);
  const Vec xd = to_double(x), wtd = to_double(wt), wd = to_double(w);
  Vec rstd;
  expect_close(buf.get(d_out, N * C), ref_rmsnorm(xd, wtd, N, C, eps, &rstd), "rmsnorm out");
  expect_close(buf.get(d_rstd, N), rstd, "rmsnorm rstd");

  be->rmsnorm_backward(d_dinp, d_dw, d_w, d_x, d_wt, d_rstd, N, C);
  Vec g_x = finite_difference_gradient([&](const Vec& v) { return ref_rmsnorm(v, wtd, N, C, eps); }, xd, wd);
  Vec g_w = finite_difference_gradient([&](const Vec& v) { return ref_rmsnorm(xd, v, N, C, eps); }, wtd, wd);
  expect_close(buf.get(d_dinp, N * C), plus(to_double(dinp0), g_x), "rmsnorm dinp (added into)");
  expect_close(buf.get(d_dw, C), plus(to_double(dw0), g_w), "rmsnorm dweight (added into)");
}

TEST(CpuOps, RmsNormForwardAndBackwardAccumulate) { check_rmsnorm(12, 16, 1e-5f, 2, 80); }
TEST(CpuOps, RmsNormOverManyRowBlocksOddWidth) { check_rmsnorm(100, 23, 1e-2f, 3, 90); }

TEST(CpuOps, RmsNormIsTheSameForAnyThreadCount) {
  const int N = 70, C = 40;
  auto x = random_floats(N * C, 100, -2.0f, 2.0f), wt = random_floats(C, 101), g = random_floats(N * C, 102);
  std::vector<std::vector<float>> results;
  for (int threads : {1, 3}) {
    auto be = cpu_backend(threads);
    Buffers buf(*be);
    float* d_x = buf.make(x);
    float* d_wt = buf.make(wt);
    float* d_g = buf.make(g);
    float* d_out = buf.make(std::vector<float>(N * C));
    float* d_rstd = buf.make(std::vector<float>(N));
    float* d_dinp = buf.make(std::vector<float>(N * C, 0.0f));
    float* d_dw = buf.make(std::vector<float>(C, 0.0f));
    be->rmsnorm_forward(d_out, d_rstd, d_x, d_wt, N, C, 1e-6f);
    be->rmsnorm_backward(d_dinp, d_dw, d_g, d_x, d_wt, d_rstd, N, C);
    std::vector<float> all = buf.get(d_out, N * C);
    for (auto part : {buf.get(d_rstd, N), buf.get(d_dinp, N * C), buf.get(d_dw, C)})
      all.insert(all.end(), part.begin(), part.end());
    results.push_back(all);
  }
  ASSERT_EQ(results[0].size(), results[1].size());
  EXPECT_EQ(std::memcmp(results[0].data(), results[1].data(), results[0].size() * sizeof(float)), 0);
}

TEST(CpuOps, MatmulForwardAndBackwardWithBias) {
  const int N = 10, C = 16, OC = 12;
  auto be = cpu_backend(2);
  Buffers buf(*be);
  auto inp = random_floats(N * C, 30), wt = random_floats(OC * C, 31), bias = random_floats(OC, 32);
  auto w = random_floats(N * OC, 33);
  auto dw0 = random_floats(OC * C, 34), db0 = random_floats(OC, 35);
  float* d_inp = buf.make(inp);
  float* d_wt = buf.make(wt);
  float* d_bias = buf.make(bias);
  float* d_out = buf.make(std::vector<float>(N * OC, kNaN));
  float* d_w = buf.make(w);
  float* d_dinp = buf.make(std::vector<float>(N * C, kNaN));  // overwritten: NaN must not survive
  float* d_dw = buf.make(dw0);
  float* d_db = buf.make(db0);

  be->matmul_forward(d_out, d_inp, d_wt, d_bias, N, C, OC);
  const Vec id = to_double(inp), wtd = to_double(wt), bd = to_double(bias), wd = to_double(w);
  expect_close(buf.get(d_out, N * OC), ref_matmul(id, wtd, &bd, N, C, OC), "matmul out");

  be->matmul_backward(d_dinp, d_dw, d_db, d_w, d_inp, d_wt, N, C, OC);
  Vec g_i = finite_difference_gradient([&](const Vec& v) { return ref_matmul(v, wtd, &bd, N, C, OC); }, id, wd);
  Vec g_w = finite_difference_gradient([&](const Vec& v) { return ref_matmul(id, v, &bd, N, C, OC); }, wtd, wd);
  Vec g_b = finite_difference_gradient([&](const Vec& v) { return ref_matmul(id, wtd, &v, N, C, OC); }, bd, wd);
  expect_close(buf.get(d_dinp, N * C), g_i, "matmul dinp (overwritten)");
  expect_close(buf.get(d_dw, OC * C), plus(to_double(dw0), g_w), "matmul dweight (added into)");
  expect_close(buf.get(d_db, OC), plus(to_double(db0), g_b), "matmul dbias (added into)");
}

TEST(CpuOps, MatmulWithoutBias) {
  const int N = 70, C = 9, OC = 5;  // 70 rows: several blocks of the bias reduction elsewhere
  auto be = cpu_backend(2);
  Buffers buf(*be);
  auto inp = random_floats(N * C, 40), wt = random_floats(OC * C, 41), w = random_floats(N * OC, 42);
  float* d_inp = buf.make(inp);
  float* d_wt = buf.make(wt);
  float* d_out = buf.make(std::vector<float>(N * OC, kNaN));
  float* d_w = buf.make(w);
  float* d_dinp = buf.make(std::vector<float>(N * C, kNaN));
  float* d_dw = buf.make(std::vector<float>(OC * C, 0.0f));
  be->matmul_forward(d_out, d_inp, d_wt, nullptr, N, C, OC);
  be->matmul_backward(d_dinp, d_dw, nullptr, d_w, d_inp, d_wt, N, C, OC);
  const Vec id = to_double(inp), wtd = to_double(wt), wd = to_double(w);
  expect_close(buf.get(d_out, N * OC), ref_matmul(id, wtd, nullptr, N, C, OC), "matmul out, no bias");
  expect_close(buf.get(d_dinp, N * C),
               finite_difference_gradient([&](const Vec& v) { return ref_matmul(v, wtd, nullptr, N, C, OC); }, id,
                                          wd),
               "matmul dinp, no bias");
  expect_close(buf.get(d_dw, OC * C),
               finite_difference_gradient([&](const Vec& v) { return ref_matmul(id, v, nullptr, N, C, OC); }, wtd,
                                          wd),
               "matmul dweight, no bias");
}

TEST(CpuOps, MatmulDbiasOverManyRowBlocks) {
  const int N = 100, C = 3, OC = 20;
  auto be = cpu_backend(3);
  Buffers buf(*be);
  auto inp = random_floats(N * C, 43), wt = random_floats(OC * C, 44), w = random_floats(N * OC, 45);
  float* d_inp = buf.make(inp);
  float* d_wt = buf.make(wt);
  float* d_w = buf.make(w);
  float* d_dinp = buf.make(std::vector<float>(N * C));
  float* d_dw = buf.make(std::vector<float>(OC * C, 0.0f));
  float* d_db = buf.make(std::vector<float>(OC, 0.0f));
  be->matmul_backward(d_dinp, d_dw, d_db, d_w, d_inp, d_wt, N, C, OC);
  Vec want(OC, 0.0);
  for (int n = 0; n < N; ++n)
    for (int o = 0; o < OC; ++o) want[o] += w[n * OC + o];
  expect_close(buf.get(d_db, OC), want, "matmul dbias");
}

TEST(CpuOps, MatmulAcrossTiles) {
  // Several output tiles in every product; checked against float64 products.
  const int N = 300, C = 20, OC = 290;
  auto be = cpu_backend(3);
  Buffers buf(*be);
  auto inp = random_floats(N * C, 46), wt = random_floats(OC * C, 47), bias = random_floats(OC, 48);
  auto dout = random_floats(N * OC, 49), dw0 = random_floats(OC * C, 50);
  float* d_inp = buf.make(inp);
  float* d_wt = buf.make(wt);
  float* d_bias = buf.make(bias);
  float* d_out = buf.make(std::vector<float>(N * OC, kNaN));
  float* d_dout = buf.make(dout);
  float* d_dinp = buf.make(std::vector<float>(N * C, kNaN));
  float* d_dw = buf.make(dw0);
  be->matmul_forward(d_out, d_inp, d_wt, d_bias, N, C, OC);
  be->matmul_backward(d_dinp, d_dw, nullptr, d_dout, d_inp, d_wt, N, C, OC);
  const Vec id = to_double(inp), wtd = to_double(wt), bd = to_double(bias), gd = to_double(dout);
  expect_close(buf.get(d_out, N * OC), ref_matmul(id, wtd, &bd, N, C, OC), "tiled matmul out");
  Vec dinp(N * C, 0.0), dw = to_double(dw0);
  for (int n = 0; n < N; ++n)
    for (int o = 0; o < OC; ++o)
      for (int c = 0; c < C; ++c) {
        dinp[n * C + c] += gd[n * OC + o] * wtd[o * C + c];
        dw[o * C + c] += gd[n * OC + o] * id[n * C + c];
      }
  expect_close(buf.get(d_dinp, N * C), dinp, "tiled matmul dinp");
  expect_close(buf.get(d_dw, OC * C), dw, "tiled matmul dweight");
}

namespace {

void check_attention(int B, int T, int C, int NH, uint32_t seed) {
  auto be = cpu_backend(2);
  Buffers buf(*be);
  auto qkv = random_floats(B * T * 3 * C, seed, -1.5f, 1.5f);
  auto w = random_floats(B * T * C, seed + 1);
  float* d_qkv = buf.make(qkv);
  float* d_out = buf.make(std::vector<float>(B * T * C, kNaN));
  float* d_lse = buf.make(std::vector<float>(B * NH * T, kNaN));
  float* d_w = buf.make(w);
  float* d_dqkv = buf.make(std::vector<float>(B * T * 3 * C, kNaN));  // overwritten

  be->attention_forward(d_out, d_lse, d_qkv, B, T, C, NH);
  const Vec qd = to_double(qkv);
  Vec lse;
  Vec out = ref_attention(qd, B, T, C, NH, &lse);
  expect_close(buf.get(d_out, B * T * C), out, "attention out");
  expect_close(buf.get(d_lse, B * NH * T), lse, "attention lse");

  be->attention_backward(d_dqkv, d_w, d_qkv, d_out, d_lse, B, T, C, NH);
  Vec g = finite_difference_gradient([&](const Vec& v) { return ref_attention(v, B, T, C, NH); }, qd,
                                     to_double(w));
  expect_close(buf.get(d_dqkv, B * T * 3 * C), g, "attention dqkv (overwritten)");
}

}  // namespace

TEST(CpuOps, AttentionForwardAndBackward) { check_attention(2, 7, 8, 2, 50); }
TEST(CpuOps, AttentionAcrossQueryBlocks) { check_attention(1, 70, 8, 2, 60); }
TEST(CpuOps, AttentionOddHeadSize) { check_attention(2, 5, 15, 3, 70); }

TEST(CpuOps, GeluForwardAndBackward) {
  const size_t n = 37;
  auto be = cpu_backend(2);
  Buffers buf(*be);
  auto x = random_floats(n, 80, -4.0f, 4.0f);
  x[0] = 0.0f;
  x[1] = -12.0f;
  x[2] = 12.0f;
  auto w = random_floats(n, 81);
  float* d_x = buf.make(x);
  float* d_out = buf.make(std::vector<float>(n, kNaN));
  float* d_w = buf.make(w);
  float* d_dinp = buf.make(std::vector<float>(n, kNaN));  // overwritten
  be->gelu_forward(d_out, d_x, n);
  be->gelu_backward(d_dinp, d_x, d_w, n);
  Vec want(n);
  for (size_t i = 0; i < n; ++i) want[i] = ref_gelu(x[i]);
  expect_close(buf.get(d_out, n), want, "gelu out", 1e-3, 1e-5);
  auto f = [&](const Vec& v) {
    Vec o(v.size());
    for (size_t i = 0; i < v.size(); ++i) o[i] = ref_gelu(v[i]);
    return o;
  };
  expect_close(buf.get(d_dinp, n), finite_difference_gradient(f, to_double(x), to_double(w)), "gelu dinp");
}

TEST(CpuOps, ResidualForward) {
  const size_t n = 37;
  auto be = cpu_backend(2);
  Buffers buf(*be);
  auto a = random_floats(n, 90), b = random_floats(n, 91);
  float* d_a = buf.make(a);
  float* d_b = buf.make(b);
  float* d_out = buf.make(std::vector<float>(n, kNaN));
  be->residual_forward(d_out, d_a, d_b, n);
  auto out = buf.get(d_out, n);
  for (size_t i = 0; i < n; ++i) EXPECT_EQ(out[i], a[i] + b[i]);
}

TEST(CpuOps, CrossEntropyForwardAndBackward) {
  const int N = 6, V = 11;
  const float scale = 1.0f / N;
  auto be = cpu_backend(2);
  Buffers buf(*be);
  auto logits = random_floats(N * V, 100, -3.0f, 3.0f);
  auto targets = random_ints(N, 101, V);
  float* d_logits = buf.make(logits);
  int32_t* d_targets = buf.make(targets);
  float* d_losses = buf.make(std::vector<float>(N, kNaN));
  float* d_losses2 = buf.make(std::vector<float>(N, kNaN));

  be->crossentropy_forward(d_losses, d_logits, d_targets, N, V);
  const Vec ld = to_double(logits);
  expect_close(buf.get(d_losses, N), ref_crossentropy(ld, targets, N, V), "crossentropy losses");

  be->crossentropy_backward(d_losses2, d_logits, d_targets, N, V, scale);
  auto l1 = buf.get(d_losses, N), l2 = buf.get(d_losses2, N);
  EXPECT_EQ(0, std::memcmp(l1.data(), l2.data(), N * sizeof(float))) << "backward's losses differ from forward's";
  auto f = [&](const Vec& v) {
    Vec l = ref_crossentropy(v, targets, N, V);
    for (auto& x : l) x *= scale;
    return l;
  };
  expect_close(buf.get(d_logits, N * V), finite_difference_gradient(f, ld, Vec(N, 1.0)), "dlogits");
}

// A padded row stride (the GPT logits' Vp): the same losses and dlogits as packed rows,
// and the padding columns are neither read nor written.
TEST(CpuOps, CrossEntropyWithRowStride) {
  const int N = 5, V = 13, ld = 16;
  auto be = cpu_backend(2);
  Buffers buf(*be);
  auto packed = random_floats(N * V, 110, -3.0f, 3.0f);
  auto targets = random_ints(N, 111, V);
  std::vector<float> padded(N * ld, 1e30f);  // huge padding would change any sum it entered
  for (int n = 0; n < N; ++n)
    for (int v = 0; v < V; ++v) padded[n * ld + v] = packed[n * V + v];
  float* d_packed = buf.make(packed);
  float* d_padded = buf.make(padded);
  int32_t* d_targets = buf.make(targets);
  float* l_packed = buf.make(std::vector<float>(N, kNaN));
  float* l_padded = buf.make(std::vector<float>(N, kNaN));
  be->crossentropy_backward(l_packed, d_packed, d_targets, N, V, 0.5f);
  be->crossentropy_backward(l_padded, d_padded, d_targets, N, V, ld, 0.5f);
  EXPECT_EQ(buf.get(l_packed, N), buf.get(l_padded, N));
  auto a = buf.get(d_packed, N * V), b = buf.get(d_padded, N * ld);
  for (int n = 0; n < N; ++n) {
    for (int v = 0; v < V; ++v) EXPECT_EQ(a[n * V + v], b[n * ld + v]) << n << "," << v;
    for (int v = V; v < ld; ++v) EXPECT_EQ(b[n * ld + v], 1e30f) << "padding written at " << n << "," << v;
  }
}

TEST(CpuOps, CrossEntropyIsStableForLargeLogits) {
  const int N = 3, V = 1000;
  auto be = cpu_backend(2);
  Buffers buf(*be);
  auto logits = random_floats(N * V, 110, -5.0f, 5.0f);
  for (int v = 0; v < V; ++v) logits[v] += 1000.0f;    // row 0: huge positive
  for (int v = 0; v < V; ++v) logits[V + v] -= 500.0f;  // row 1: very negative
  auto targets = random_ints(N, 111, V);
  float* d_logits = buf.make(logits);
  int32_t* d_targets = buf.make(targets);
  float* d_losses = buf.make(std::vector<float>(N, kNaN));
  be->crossentropy_forward(d_losses, d_logits, d_targets, N, V);
  // The reference gets the logits as rounded to float.
  expect_close(buf.get(d_losses, N), ref_crossentropy(to_double(logits), targets, N, V), "large-logit losses");
  be->crossentropy_backward(d_losses, d_logits, d_targets, N, V, 1.0f);
  auto d = buf.get(d_logits, N * V);
  for (int n = 0; n < N; ++n) {
    double row = 0;
    for (int v = 0; v < V; ++v) {
      ASSERT_TRUE(std::isfinite(d[n * V + v]));
      row += d[n * V + v];
    }
    EXPECT_NEAR(row, 0.0, 1e-5);  // softmax sums to 1, minus the one-hot
  }
}

TEST(CpuOps, SquaredNorm) {
  auto be = cpu_backend(3);
  Buffers buf(*be);
  for (size_t n : {size_t{0}, size_t{5}, size_t{1000}, size_t{3 * 65536 + 123}}) {
    auto g = random_floats(n, 120 + static_cast<uint32_t>(n), -2.0f, 2.0f);
    float* d_g = buf.make(g);
    float* d_sq = buf.make(std::vector<float>(1, kNaN));
    be->squared_norm(d_sq, d_g, n);
    double want = 0;
    for (float x : g) want += static_cast<double>(x) * x;
    EXPECT_NEAR(buf.get(d_sq, 1)[0], want, 1e-6 * want + 1e-30) << "n = " << n;
  }
}

TEST(CpuOps, ClipScaleAndAdamWAreTheHostBits) {
  auto be = cpu_backend(2);
  Buffers buf(*be);
  const size_t n = 1003;
  std::vector<float> sq = {3.0f, 40.0f, 0.5f};
  std::vector<float> sn_host(2);
  clip_scale_host(sn_host.data(), sq.data(), 3, 1.0f);
  float* d_sq = buf.make(sq);
  float* d_sn = buf.make(std::vector<float>(2, kNaN));
  be->clip_scale(d_sn, d_sq, 3, 1.0f);
  auto sn = buf.get(d_sn, 2);
  EXPECT_EQ(0, std::memcmp(sn.data(), sn_host.data(), 2 * sizeof(float)));

  auto param = random_floats(n, 130), grad = random_floats(n, 131), m = random_floats(n, 132, -0.1f, 0.1f);
  auto v = random_floats(n, 133, 0.0f, 0.01f);
  auto master = param;
  const AdamWHyper h = adamw_hyper(6e-4f, 3, 0.1f);
  float* d_param = buf.make(param);
  float* d_master = buf.make(master);
  float* d_m = buf.make(m);
  float* d_v = buf.make(v);
  float* d_grad = buf.make(grad);
  be->adamw(d_param, d_master, d_m, d_v, d_grad, d_sn, n, h);
  adamw_host(DType::F32, param.data(), master.data(), m.data(), v.data(), grad.data(), sn_host.data(), n, h);
  auto same = [&](const float* dev, const std::vector<float>& host, const char* what) {
    auto got = buf.get(dev, n);
    EXPECT_EQ(0, std::memcmp(got.data(), host.data(), n * sizeof(float))) << what;
  };
  same(d_param, param, "param");
  same(d_master, master, "master");
  same(d_m, m, "m");
  same(d_v, v, "v");
}

TEST(CpuOps, ExpApproximation) {
  using namespace spillway::cpu;
  double worst = 0;
  for (int i = 0; i <= 200000; ++i) {
    const float x = -87.0f + 175.0f * static_cast<float>(i) / 200000.0f;
    const double want = std::exp(static_cast<double>(x));
    worst = std::max(worst, std::abs(exp_scalar(x) - want) / want);
  }
  EXPECT_LT(worst, 3e-7);
  EXPECT_EQ(exp_scalar(0.0f), 1.0f);
  EXPECT_TRUE(std::isnan(exp_scalar(kNaN)));
  EXPECT_GE(exp_scalar(-1000.0f), 0.0f);
  EXPECT_LT(exp_scalar(-1000.0f), 1e-37f);
  EXPECT_TRUE(std::isfinite(exp_scalar(1000.0f)));
  // Lanes and the scalar path agree bit for bit.
  f32x4 x = {-3.25f, 0.125f, 7.5f, -60.0f};
  f32x4 y = exp4(x);
  for (int l = 0; l < 4; ++l) EXPECT_EQ(y[l], exp_scalar(x[l]));
}

// ---- Llama ops: RoPE, SwiGLU, grouped-query attention, embedding without positions ----

namespace {

// inv_freq of rotation pair i as transformers computes it, written out here apart from
// tensor/rope.cpp: 1/theta^(2i/D); llama3 scales by wavelength band (torch.where form).
double ref_inv_freq(const RopeParams& r, int D, int i) {
  const double inv = 1.0 / std::pow(static_cast<double>(r.theta), 2.0 * i / D);
  if (!r.llama3) return inv;
  const double wavelen = 2 * M_PI / inv;
  const double low_wl = r.original_context / static_cast<double>(r.low_freq_factor);
  const double high_wl = r.original_context / static_cast<double>(r.high_freq_factor);
  const double scaled = wavelen > low_wl ? inv / r.factor : inv;
  if (wavelen < high_wl || wavelen > low_wl) return scaled;
  const double smooth =
      (r.original_context / wavelen - r.low_freq_factor) / (static_cast<double>(r.high_freq_factor) - r.low_freq_factor);
  return (1 - smooth) * scaled / r.factor + smooth * scaled;
}

// RoPE of x[B,T,(NH+2·KVH)·D] in float64: q and k heads turned, v heads copied.
Vec ref_rope(const Vec& x, int B, int T, int NH, int KVH, int D, const RopeParams& r) {
  Vec y = x;
  const int W = (NH + 2 * KVH) * D, half = D / 2;
  for (int n = 0; n < B * T; ++n)
    for (int i = 0; i < half; ++i) {
      const double angle = (n % T) * ref_inv_freq(r, D, i), c = std::cos(angle), s = std::sin(angle);
      for (int h = 0; h < NH + KVH; ++h) {
        const size_t o = static_cast<size_t>(n) * W + h * D + i;
        y[o] = x[o] * c - x[o + half] * s;
        y[o + half] = x[o + half] * c + x[o] * s;
      }
    }
  return y;
}

const RopeParams kLlama32Rope{.theta = 500000.0f, .llama3 = true, .factor = 32, .low_freq_factor = 1,
                              .high_freq_factor = 4, .original_context = 8192};

// Forward against float64, v heads copied exactly, backward against central
// differences, and backward(forward(x)) = x (a rotation's transpose is its inverse).
void check_rope(int B, int T, int NH, int KVH, int D, const RopeParams& r, uint32_t seed) {
  auto be = cpu_backend(2);
  Buffers buf(*be);
  const int W = (NH + 2 * KVH) * D;
  const size_t n = static_cast<size_t>(B) * T * W;
  auto x = random_floats(n, seed, -1.5f, 1.5f);
  auto w = random_floats(n, seed + 1);
  float* d_x = buf.make(x);
  float* d_out = buf.make(std::vector<float>(n, kNaN));
  float* d_w = buf.make(w);
  float* d_dinp = buf.make(std::vector<float>(n, kNaN));  // overwritten
  float* d_back = buf.make(std::vector<float>(n, kNaN));

  be->rope_forward(d_out, d_x, B, T, NH, KVH, D, r);
  const Vec xd = to_double(x);
  const std::vector<float> out = buf.get(d_out, n);
  expect_close(out, ref_rope(xd, B, T, NH, KVH, D, r), "rope out");
  for (size_t row = 0; row < n / W; ++row)
    for (int c = (NH + KVH) * D; c < W; ++c) ASSERT_EQ(out[row * W + c], x[row * W + c]) << "v head copied";

  be->rope_backward(d_dinp, d_w, B, T, NH, KVH, D, r);
  Vec g = finite_difference_gradient([&](const Vec& v) { return ref_rope(v, B, T, NH, KVH, D, r); }, xd,
                                     to_double(w));
  expect_close(buf.get(d_dinp, n), g, "rope dinp (overwritten)");

  be->rope_backward(d_back, d_out, B, T, NH, KVH, D, r);
  expect_close(buf.get(d_back, n), xd, "rope backward(forward(x))", 1e-5, 1e-6);
}

}  // namespace

TEST(CpuOps, RopeInvFreqDefaultAndLlama3Bands) {
  // Default: 1/theta^(2i/D).
  const RopeParams plain{};
  EXPECT_EQ(rope_inv_freq(plain, 8, 0), 1.0f);
  EXPECT_EQ(rope_inv_freq(plain, 8, 1), 0.1f);
  EXPECT_EQ(rope_inv_freq(plain, 8, 3), 0.001f);
  // Llama 3.2 (theta 500000, factor 32, bands at wavelengths 2048 and 8192): with D = 64
  // pairs fall in each band.
  const RopeParams& r = kLlama32Rope;
  const RopeParams unscaled{.theta = r.theta};
  int high = 0, medium = 0, low = 0;
  for (int i = 0; i < 32; ++i) {
    SCOPED_TRACE(i);
    const double base = ref_inv_freq(unscaled, 64, i), want = ref_inv_freq(r, 64, i);
    const float got = rope_inv_freq(r, 64, i);
    EXPECT_LE(std::abs(got - want), 1e-7 * want);
    const double wavelen = 2 * M_PI / base;
    if (wavelen < 2048) {
      EXPECT_EQ(got, static_cast<float>(base));
      ++high;
    } else if (wavelen > 8192) {
      EXPECT_EQ(got, static_cast<float>(base / 32));
      ++low;
    } else {
      EXPECT_GT(got, static_cast<float>(base / 32));
      EXPECT_LT(got, static_cast<float>(base));
      ++medium;
    }
  }
  EXPECT_GT(high, 0);
  EXPECT_GT(medium, 0);
  EXPECT_GT(low, 0);
}

TEST(CpuOps, RopeForwardAndBackward) { check_rope(2, 5, 4, 2, 8, RopeParams{}, 200); }
TEST(CpuOps, RopeMultiHeadAndOddPairCount) { check_rope(1, 7, 3, 3, 6, RopeParams{.theta = 100.0f}, 210); }
TEST(CpuOps, RopeLlama3Scaling) { check_rope(1, 9, 2, 1, 64, kLlama32Rope, 220); }

namespace {

double ref_silu(double x) { return x / (1.0 + std::exp(-x)); }

// out[N,I] = silu(gate)·up from inp[N,2I] = [gate | up], float64.
Vec ref_swiglu(const Vec& inp, int N, int I) {
  Vec out(static_cast<size_t>(N) * I);
  for (int n = 0; n < N; ++n)
    for (int i = 0; i < I; ++i) out[n * I + i] = ref_silu(inp[n * 2 * I + i]) * inp[n * 2 * I + I + i];
  return out;
}

void check_swiglu(int N, int I, uint32_t seed) {
  auto be = cpu_backend(2);
  Buffers buf(*be);
  auto x = random_floats(static_cast<size_t>(N) * 2 * I, seed, -5.0f, 5.0f);
  x[0] = 0.0f;
  x[1] = -30.0f;
  x[2] = 30.0f;
  auto w = random_floats(static_cast<size_t>(N) * I, seed + 1);
  float* d_x = buf.make(x);
  float* d_out = buf.make(std::vector<float>(N * I, kNaN));
  float* d_w = buf.make(w);
  float* d_dinp = buf.make(std::vector<float>(N * 2 * I, kNaN));  // overwritten
  be->swiglu_forward(d_out, d_x, N, I);
  be->swiglu_backward(d_dinp, d_x, d_w, N, I);
  const Vec xd = to_double(x);
  expect_close(buf.get(d_out, N * I), ref_swiglu(xd, N, I), "swiglu out");
  Vec g = finite_difference_gradient([&](const Vec& v) { return ref_swiglu(v, N, I); }, xd, to_double(w));
  expect_close(buf.get(d_dinp, N * 2 * I), g, "swiglu dinp (overwritten)");
}

}  // namespace

TEST(CpuOps, SwiGluForwardAndBackward) { check_swiglu(6, 16, 300); }
TEST(CpuOps, SwiGluOddWidth) { check_swiglu(5, 7, 310); }

namespace {

// Grouped-query attention (NH query heads, KVH key/value heads): forward and lse
// against float64 and against multi-head attention on qkv with each key/value head
// repeated for its query heads; the backward against central differences, its dQ
// against the repeated run's, and dK/dV against the repeated run's summed over each
// group.
void check_gqa(int B, int T, int D, int NH, int KVH, uint32_t seed) {
  auto be = cpu_backend(2);
  Buffers buf(*be);
  const int C = NH * D, W = (NH + 2 * KVH) * D, WM = 3 * C, group = NH / KVH;
  const size_t rows = static_cast<size_t>(B) * T;
  auto qkv = random_floats(rows * W, seed, -1.5f, 1.5f);
  auto w = random_floats(rows * C, seed + 1);
  // The repeated multi-head qkv: query heads as they are, key/value head h/group as head h.
  std::vector<float> rep(rows * WM);
  for (size_t r = 0; r < rows; ++r)
    for (int h = 0; h < NH; ++h)
      for (int e = 0; e < D; ++e) {
        const int g = h / group;
        rep[r * WM + h * D + e] = qkv[r * W + h * D + e];
        rep[r * WM + C + h * D + e] = qkv[r * W + (NH + g) * D + e];
        rep[r * WM + 2 * C + h * D + e] = qkv[r * W + (NH + KVH + g) * D + e];
      }
  float* d_qkv = buf.make(qkv);
  float* d_rep = buf.make(rep);
  float* d_w = buf.make(w);
  float* d_out = buf.make(std::vector<float>(rows * C, kNaN));
  float* d_lse = buf.make(std::vector<float>(B * NH * T, kNaN));
  float* d_out_m = buf.make(std::vector<float>(rows * C, kNaN));
  float* d_lse_m = buf.make(std::vector<float>(B * NH * T, kNaN));
  float* d_dqkv = buf.make(std::vector<float>(rows * W, kNaN));  // overwritten
  float* d_drep = buf.make(std::vector<float>(rows * WM, kNaN));

  be->attention_forward(d_out, d_lse, d_qkv, B, T, C, NH, KVH);
  be->attention_forward(d_out_m, d_lse_m, d_rep, B, T, C, NH);
  const Vec qd = to_double(qkv);
  Vec lse;
  expect_close(buf.get(d_out, rows * C), ref_attention(qd, B, T, C, NH, &lse, KVH), "gqa out");
  expect_close(buf.get(d_lse, B * NH * T), lse, "gqa lse");
  expect_close(buf.get(d_out, rows * C), to_double(buf.get(d_out_m, rows * C)), "gqa out vs repeated", 1e-5, 1e-6);
  expect_close(buf.get(d_lse, B * NH * T), to_double(buf.get(d_lse_m, B * NH * T)), "gqa lse vs repeated", 1e-6,
               1e-7);

  be->attention_backward(d_dqkv, d_w, d_qkv, d_out, d_lse, B, T, C, NH, KVH);
  be->attention_backward(d_drep, d_w, d_rep, d_out_m, d_lse_m, B, T, C, NH);
  const std::vector<float> dqkv = buf.get(d_dqkv, rows * W), drep = buf.get(d_drep, rows * WM);
  Vec g = finite_difference_gradient([&](const Vec& v) { return ref_attention(v, B, T, C, NH, nullptr, KVH); }, qd,
                                     to_double(w));
  expect_close(dqkv, g, "gqa dqkv (overwritten)");
  // The repeated run's gradient, key/value heads summed over each group.
  Vec want(rows * W, 0.0);
  for (size_t r = 0; r < rows; ++r)
    for (int h = 0; h < NH; ++h)
      for (int e = 0; e < D; ++e) {
        const int kv = h / group;
        want[r * W + h * D + e] = drep[r * WM + h * D + e];
        want[r * W + (NH + kv) * D + e] += drep[r * WM + C + h * D + e];
        want[r * W + (NH + KVH + kv) * D + e] += drep[r * WM + 2 * C + h * D + e];
      }
  expect_close(dqkv, want, "gqa dqkv vs repeated, group sums", 1e-5, 1e-6);
}

}  // namespace

TEST(CpuOps, GroupedQueryAttentionTwoGroups) { check_gqa(2, 7, 4, 4, 2, 400); }
TEST(CpuOps, GroupedQueryAttentionOneKeyValueHead) { check_gqa(2, 6, 5, 4, 1, 410); }
TEST(CpuOps, GroupedQueryAttentionAcrossQueryBlocks) { check_gqa(1, 70, 4, 4, 1, 420); }

TEST(CpuOps, GroupedQueryAttentionIsTheSameForAnyThreadCount) {
  const int B = 3, T = 80, D = 8, NH = 6, KVH = 2, C = NH * D, W = (NH + 2 * KVH) * D;
  auto qkv = random_floats(B * T * W, 430, -2.0f, 2.0f), g = random_floats(B * T * C, 431);
  std::vector<std::vector<float>> results;
  for (int threads : {1, 3}) {
    auto be = cpu_backend(threads);
    Buffers buf(*be);
    float* d_qkv = buf.make(qkv);
    float* d_g = buf.make(g);
    float* d_out = buf.make(std::vector<float>(B * T * C));
    float* d_lse = buf.make(std::vector<float>(B * NH * T));
    float* d_dqkv = buf.make(std::vector<float>(B * T * W));
    be->attention_forward(d_out, d_lse, d_qkv, B, T, C, NH, KVH);
    be->attention_backward(d_dqkv, d_g, d_qkv, d_out, d_lse, B, T, C, NH, KVH);
    std::vector<float> all = buf.get(d_out, B * T * C);
    for (auto part : {buf.get(d_lse, B * NH * T), buf.get(d_dqkv, B * T * W)})
      all.insert(all.end(), part.begin(), part.end());
    results.push_back(all);
  }
  ASSERT_EQ(results[0].size(), results[1].size());
  EXPECT_EQ(std::memcmp(results[0].data(), results[1].data(), results[0].size() * sizeof(float)), 0);
}

TEST(CpuOps, EmbeddingWithoutPositionTable) {
  const int B = 2, T = 5, C = 8, V = 11;
  auto be = cpu_backend(2);
  Buffers buf(*be);
  auto tokens = random_ints(B * T, 500, V);
  auto wte = random_floats(V * C, 501);
  int32_t* d_tokens = buf.make(tokens);
  float* d_wte = buf.make(wte);
  float* d_out = buf.make(std::vector<float>(B * T * C, kNaN));
  be->embedding_forward(d_out, d_tokens, d_wte, nullptr, B, T, C);
  const std::vector<float> out = buf.get(d_out, B * T * C);
  for (int n = 0; n < B * T; ++n)
    for (int c = 0; c < C; ++c) ASSERT_EQ(out[n * C + c], wte[tokens[n] * C + c]) << n << "," << c;
}
