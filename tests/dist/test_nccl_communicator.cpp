// The NCCL communicator (dist/nccl/nccl_communicator.h) with one rank on one GPU: the
// real path of every collective, and the chained reduce in small chunks. Skips without
// a GPU, and is empty in builds without NCCL. Several ranks (one thread per GPU) run
// on a machine with several GPUs and skip otherwise.
#include <gtest/gtest.h>

#ifdef SPILLWAY_HAVE_NCCL

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "backend/backend.h"
#include "dist/nccl/nccl_communicator.h"
#include "support/thread_communicator.h"

using namespace spillway;

TEST(NcclCommunicator, IdsRoundTripThroughHexAndBadTextIsRefused) {
  NcclId id;
  for (size_t i = 0; i < id.size(); ++i) id[i] = static_cast<char>(i * 37);
  auto back = nccl_id_from_hex(nccl_id_to_hex(id));
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  EXPECT_EQ(*back, id);
  EXPECT_FALSE(nccl_id_from_hex("abc").ok());
  std::string bad = nccl_id_to_hex(id);
  bad[7] = 'g';
  auto refused = nccl_id_from_hex(bad);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("character 7"), std::string::npos) << refused.status().to_string();
}

TEST(NcclCommunicator, OneRankCollectives) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  auto backend = make_backend("cuda");
  ASSERT_TRUE(backend.ok()) << backend.status().to_string();
  Backend& b = **backend;
  auto id = nccl_unique_id();
  ASSERT_TRUE(id.ok()) << id.status().to_string();
  auto comm = NcclCommunicator::create(0, 1, *id, 0);
  ASSERT_TRUE(comm.ok()) << comm.status().to_string();
  // Two parts, summed in order: out = (0 + a) + b.
  const size_t n = 1000;
  std::vector<float> parts(2 * n), want(n);
  for (size_t i = 0; i < n; ++i) {
    parts[i] = std::ldexp(1.0f, static_cast<int>(i % 30));
    parts[n + i] = 1.0f + static_cast<float>(i);
    want[i] = (0.0f + parts[i]) + parts[n + i];
  }
  auto in = b.device_alloc(2 * n * 4), out = b.device_alloc(n * 4);
  ASSERT_TRUE(in.ok() && out.ok());
  ASSERT_TRUE(b.upload(*in, parts.data(), 2 * n * 4).is_ok());
  ASSERT_TRUE((*comm)->reduce_in_rank_order({static_cast<float*>(*in), static_cast<float*>(*in) + n}, static_cast<float*>(*out), n, 0).is_ok());
  std::vector<float> got(n);
  ASSERT_TRUE(b.download(got.data(), *out, n * 4).is_ok());
  EXPECT_EQ(std::memcmp(got.data(), want.data(), n * 4), 0);
  ASSERT_TRUE((*comm)->all_gather(*in, *out, 16).is_ok());
  ASSERT_TRUE((*comm)->broadcast(*out, 16, 0).is_ok());
  ASSERT_TRUE(b.download(got.data(), *out, 16).is_ok());
  EXPECT_EQ(std::memcmp(got.data(), parts.data(), 16), 0);
  EXPECT_TRUE((*comm)->barrier().is_ok());
  // bf16: three parts, the first kept as it is (-0 stays -0), each later one added in
  // fp32 and rounded to bf16: ((a + b) rounded) + c, rounded.
  std::vector<uint16_t> h(3 * n), hwant(n);
  auto to_f = [](uint16_t v) {
    const uint32_t u = static_cast<uint32_t>(v) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  };
  auto to_h = [](float f) {  // nearest even (no NaN here)
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  };
  for (size_t i = 0; i < n; ++i) {
    h[i] = to_h(std::ldexp(1.0f, static_cast<int>(i % 20)) + 0.37f * static_cast<float>(i));
    h[n + i] = to_h(1.0f / (1.0f + static_cast<float>(i)));
    h[2 * n + i] = to_h(-0.5f * static_cast<float>(i % 7));
  }
  h[0] = h[n] = h[2 * n] = 0x8000;
  for (size_t i = 0; i < n; ++i) hwant[i] = to_h(to_f(to_h(to_f(h[i]) + to_f(h[n + i]))) + to_f(h[2 * n + i]));
  auto hin = b.device_alloc(3 * n * 2), hout = b.device_alloc(n * 2);
  ASSERT_TRUE(hin.ok() && hout.ok());
  ASSERT_TRUE(b.upload(*hin, h.data(), 3 * n * 2).is_ok());
  const char* base = static_cast<const char*>(*hin);
  ASSERT_TRUE((*comm)->reduce_bf16_in_rank_order({base, base + n * 2, base + 2 * n * 2}, *hout, n, 0).is_ok());
  std::vector<uint16_t> hgot(n);
  ASSERT_TRUE(b.download(hgot.data(), *hout, n * 2).is_ok());
  EXPECT_EQ(hgot, hwant);
  EXPECT_EQ(hgot[0], 0x8000);
  b.device_free(*hin);
  b.device_free(*hout);
  b.device_free(*in);
  b.device_free(*out);
}

namespace {

using testing_support::bf16_bits_to_float;
using testing_support::float_to_bf16_bits;

// Rank r's `parts` parts of n floats (rank-major: part j at j·n), magnitudes mixed so
// that the order of the additions shows; element 3 of every part is -0.
std::vector<float> rank_parts(int rank, size_t n, int parts) {
  std::mt19937 rng(7 + rank);
  std::vector<float> v(n * static_cast<size_t>(parts));
  for (auto& x : v) x = std::ldexp(static_cast<float>(rng() % 2000) - 1000.0f, static_cast<int>(rng() % 40) - 20);
  for (int j = 0; j < parts; ++j) v[static_cast<size_t>(j) * n + 3] = -0.0f;
  return v;
}
std::vector<uint16_t> to_bf16(const std::vector<float>& v) {
  std::vector<uint16_t> h(v.size());
  for (size_t i = 0; i < v.size(); ++i) h[i] = float_to_bf16_bits(v[i]);
  return h;
}
// The sums one rank forms: ranks in order, parts in order (f32 from +0; bf16 from the
// first part, each addition rounded).
void sequential(const std::vector<std::vector<float>>& f, size_t n, int parts, std::vector<float>* want,
                std::vector<uint16_t>* hwant) {
  want->assign(n, 0.0f);
  hwant->assign(n, 0);
  for (size_t r = 0; r < f.size(); ++r) {
    const std::vector<uint16_t> h = to_bf16(f[r]);
    for (int j = 0; j < parts; ++j)
      for (size_t i = 0; i < n; ++i) {
        (*want)[i] += f[r][static_cast<size_t>(j) * n + i];
        const uint16_t x = h[static_cast<size_t>(j) * n + i];
        (*hwant)[i] = r == 0 && j == 0 ? x : float_to_bf16_bits(bf16_bits_to_float((*hwant)[i]) + bf16_bits_to_float(x));
      }
  }
}

}  // namespace

// One rank, chained in chunks that do not divide n, with more parts than one kernel
// adds (9: two launches per chunk) and the output on the first part: the sequential
// sums bit for bit. A chunk under 4 bytes is refused.
TEST(NcclCommunicator, OneRankChainInChunks) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  auto id = nccl_unique_id();
  ASSERT_TRUE(id.ok()) << id.status().to_string();
  auto comm = NcclCommunicator::create(0, 1, *id, 0);
  ASSERT_TRUE(comm.ok()) << comm.status().to_string();
  EXPECT_FALSE((*comm)->set_chain_chunk_bytes(2).is_ok());
  const size_t n = 1001;
  const int parts = 9;
  const std::vector<std::vector<float>> f = {rank_parts(0, n, parts)};
  std::vector<float> want;
  std::vector<uint16_t> hwant;
  sequential(f, n, parts, &want, &hwant);
  const std::vector<uint16_t> h = to_bf16(f[0]);
  float* d = nullptr;
  uint16_t* dh = nullptr;
  ASSERT_EQ(cudaMalloc(&d, f[0].size() * 4), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&dh, h.size() * 2), cudaSuccess);
  for (size_t chunk_bytes : {size_t{28}, size_t{4096}, kNcclChainChunkBytes}) {
    ASSERT_TRUE((*comm)->set_chain_chunk_bytes(chunk_bytes).is_ok());
    ASSERT_EQ(cudaMemcpy(d, f[0].data(), f[0].size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(dh, h.data(), h.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
    std::vector<const float*> fp;
    std::vector<const void*> hp;
    for (int j = 0; j < parts; ++j) {
      fp.push_back(d + static_cast<size_t>(j) * n);
      hp.push_back(dh + static_cast<size_t>(j) * n);
    }
    Status s = (*comm)->reduce_in_rank_order(fp, d, n, 0);
    ASSERT_TRUE(s.is_ok()) << s.to_string();
    s = (*comm)->reduce_bf16_in_rank_order(hp, dh, n, 0);
    ASSERT_TRUE(s.is_ok()) << s.to_string();
    std::vector<float> got(n);
    std::vector<uint16_t> hgot(n);
    ASSERT_EQ(cudaMemcpy(got.data(), d, n * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(hgot.data(), dh, n * 2, cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(std::memcmp(got.data(), want.data(), n * 4), 0) << chunk_bytes;
    EXPECT_EQ(hgot, hwant) << chunk_bytes;
    EXPECT_FALSE(std::signbit(got[3]));
    EXPECT_EQ(hgot[3], 0x8000);
  }
  cudaFree(d);
  cudaFree(dh);
}

// Several GPUs (up to 4, one thread and communicator each): the chained reduce, f32
// and bf16, every root, chunks that do not divide n, equals the sequential sums bit
// for bit on the root, whose output is its first part.
TEST(NcclCommunicator, SeveralRanksChainInRankOrder) {
  int devices = 0;
  if (!cuda_available() || cudaGetDeviceCount(&devices) != cudaSuccess || devices < 2)
    GTEST_SKIP() << "needs 2 GPUs";
  const int world = std::min(devices, 4), parts = 2;
  const size_t n = 3 * (size_t{1} << 20) + 17;  // 12 MiB of f32: several default chunks
  std::vector<std::vector<float>> f;
  for (int r = 0; r < world; ++r) f.push_back(rank_parts(r, n, parts));
  std::vector<float> want;
  std::vector<uint16_t> hwant;
  sequential(f, n, parts, &want, &hwant);
  auto id = nccl_unique_id();
  ASSERT_TRUE(id.ok()) << id.status().to_string();
  std::vector<std::string> failures(static_cast<size_t>(world));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      std::string& failed = failures[static_cast<size_t>(r)];
      auto check = [&](bool ok, const std::string& what) {
        if (!ok && failed.empty()) failed = "rank " + std::to_string(r) + ": " + what;
        return ok;
      };
      auto comm = NcclCommunicator::create(r, world, *id, r);
      if (!check(comm.ok(), comm.ok() ? "" : comm.status().to_string())) return;
      const std::vector<uint16_t> h = to_bf16(f[static_cast<size_t>(r)]);
      float* d = nullptr;
      uint16_t* dh = nullptr;
      if (!check(cudaMalloc(&d, f[static_cast<size_t>(r)].size() * 4) == cudaSuccess &&
                     cudaMalloc(&dh, h.size() * 2) == cudaSuccess,
                 "cudaMalloc"))
        return;
      for (size_t chunk_bytes : {size_t{4096 + 4}, kNcclChainChunkBytes}) {
        for (int root = 0; root < world; ++root) {
          const std::string where = "chunk " + std::to_string(chunk_bytes) + " root " + std::to_string(root);
          check((*comm)->set_chain_chunk_bytes(chunk_bytes).is_ok(), "set_chain_chunk_bytes");
          check(cudaMemcpy(d, f[static_cast<size_t>(r)].data(), n * parts * 4, cudaMemcpyHostToDevice) == cudaSuccess &&
                    cudaMemcpy(dh, h.data(), n * parts * 2, cudaMemcpyHostToDevice) == cudaSuccess,
                "upload");
          Status s = (*comm)->reduce_in_rank_order({d, d + n}, r == root ? d : nullptr, n, root);
          if (!check(s.is_ok(), where + ": " + s.to_string())) return;
          s = (*comm)->reduce_bf16_in_rank_order({dh, dh + n}, r == root ? dh : nullptr, n, root);
          if (!check(s.is_ok(), where + ": " + s.to_string())) return;
          if (r != root) continue;
          std::vector<float> got(n);
          std::vector<uint16_t> hgot(n);
          check(cudaMemcpy(got.data(), d, n * 4, cudaMemcpyDeviceToHost) == cudaSuccess &&
                    cudaMemcpy(hgot.data(), dh, n * 2, cudaMemcpyDeviceToHost) == cudaSuccess,
                "download");
          check(std::memcmp(got.data(), want.data(), n * 4) == 0, where + ": the f32 sum differs");
          check(hgot == hwant, where + ": the bf16 sum differs");
        }
      }
      cudaFree(d);
      cudaFree(dh);
    });
  for (auto& t : threads) t.join();
  for (const std::string& failed : failures) EXPECT_TRUE(failed.empty()) << failed;
}

#endif  // SPILLWAY_HAVE_NCCL
