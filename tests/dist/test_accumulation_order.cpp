// What exact data parallelism needs from the CPU kernels: a gradient accumulated over
// micro-batches (each backward adding into it) has the bits of the micro-batches'
// gradients formed alone, from zero, and summed in order: ((0 + g0) + g1) + g2.
#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "backend/backend.h"

using namespace spillway;

namespace {

std::vector<float> random_values(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

// ((0 + g[0]) + g[1]) + ... elementwise.
std::vector<float> sum_in_order(const std::vector<std::vector<float>>& g) {
  std::vector<float> acc(g[0].size(), 0.0f);
  for (const auto& x : g)
    for (size_t i = 0; i < acc.size(); ++i) acc[i] += x[i];
  return acc;
}

size_t differing(const std::vector<float>& a, const std::vector<float>& b) {
  size_t d = 0;
  for (size_t i = 0; i < a.size(); ++i) d += std::memcmp(&a[i], &b[i], 4) != 0;
  return d;
}

}  // namespace

TEST(AccumulationOrder, MatmulWeightGradientAddsEachMicroBatchOnce) {
  auto backend = make_backend("cpu", {.threads = 2});
  ASSERT_TRUE(backend.ok());
  Backend& b = **backend;
  // N = 2048 rows: more than one of OpenBLAS's blocks along the summed dimension.
  const int N = 2048, C = 96, OC = 160, K = 3;
  std::vector<float> dinp(static_cast<size_t>(N) * C), weight = random_values(static_cast<size_t>(OC) * C, 1);
  std::vector<float> acc_w(static_cast<size_t>(OC) * C, 0.0f), acc_b(OC, 0.0f);
  std::vector<std::vector<float>> alone_w, alone_b;
  for (int k = 0; k < K; ++k) {
    std::vector<float> dout = random_values(static_cast<size_t>(N) * OC, 10 + k);
    std::vector<float> inp = random_values(static_cast<size_t>(N) * C, 20 + k);
    b.matmul_backward(dinp.data(), acc_w.data(), acc_b.data(), dout.data(), inp.data(), weight.data(), N, C, OC);
    std::vector<float> w(acc_w.size(), 0.0f), bias(OC, 0.0f);
    b.matmul_backward(dinp.data(), w.data(), bias.data(), dout.data(), inp.data(), weight.data(), N, C, OC);
    alone_w.push_back(w);
    alone_b.push_back(bias);
  }
  ASSERT_TRUE(b.synchronize().is_ok());
  EXPECT_EQ(differing(acc_w, sum_in_order(alone_w)), 0u);
  EXPECT_EQ(differing(acc_b, sum_in_order(alone_b)), 0u);
}

TEST(AccumulationOrder, EmbeddingGradientAddsEachRowOncePerMicroBatch) {
  auto backend = make_backend("cpu", {.threads = 2});
  ASSERT_TRUE(backend.ok());
  Backend& b = **backend;
  // Few vocabulary rows, so every row sees many tokens; B = 3 sequences for dwpe.
  const int B = 3, T = 40, C = 48, V = 5, K = 3;
  std::vector<float> acc_te(static_cast<size_t>(V) * C, 0.0f), acc_pe(static_cast<size_t>(T) * C, 0.0f);
  std::vector<std::vector<float>> alone_te, alone_pe;
  std::mt19937 rng(3);
  for (int k = 0; k < K; ++k) {
    std::vector<float> dout = random_values(static_cast<size_t>(B) * T * C, 30 + k);
    std::vector<int32_t> tokens(static_cast<size_t>(B) * T);
    for (auto& t : tokens) t = static_cast<int32_t>(rng() % V);
    b.embedding_backward(acc_te.data(), acc_pe.data(), dout.data(), tokens.data(), B, T, C);
    std::vector<float> te(acc_te.size(), 0.0f), pe(acc_pe.size(), 0.0f);
    b.embedding_backward(te.data(), pe.data(), dout.data(), tokens.data(), B, T, C);
    alone_te.push_back(te);
    alone_pe.push_back(pe);
  }
  ASSERT_TRUE(b.synchronize().is_ok());
  EXPECT_EQ(differing(acc_te, sum_in_order(alone_te)), 0u);
  EXPECT_EQ(differing(acc_pe, sum_in_order(alone_pe)), 0u);
}
