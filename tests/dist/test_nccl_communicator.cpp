// The NCCL communicator (dist/nccl/nccl_communicator.h) with one rank on one GPU: the
// real path of every collective. Skips without a GPU, and is empty in builds without
// NCCL. Several ranks need a machine with several GPUs (not run yet).
#include <gtest/gtest.h>

#ifdef SPILLWAY_HAVE_NCCL

#include <cstring>
#include <vector>

#include "backend/backend.h"
#include "dist/nccl/nccl_communicator.h"

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

#endif  // SPILLWAY_HAVE_NCCL
