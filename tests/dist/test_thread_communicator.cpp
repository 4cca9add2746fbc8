// The in-process communicator (tests/support/thread_communicator.h): its collectives
// give fixed-order results, bit for bit, whatever the threads' timing.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <random>
#include <thread>

#include "support/thread_communicator.h"

using namespace spillway;
using testing_support::ThreadCommunicator;
using testing_support::ThreadGroup;

namespace {

// Runs f(comm) on `world` threads, each with its own communicator.
template <class F>
void on_ranks(int world, F f) {
  ThreadGroup group(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      ThreadCommunicator comm(group, r);
      f(comm);
    });
  for (auto& t : threads) t.join();
}

// Values whose sum depends on the order: large and small magnitudes mixed.
std::vector<float> values(int rank, size_t n, int parts) {
  std::mt19937 rng(100 + rank);
  std::vector<float> v(n * static_cast<size_t>(parts));
  for (auto& x : v) x = std::ldexp(static_cast<float>(rng() % 2000) - 1000.0f, static_cast<int>(rng() % 40) - 20);
  return v;
}

}  // namespace

TEST(ThreadCommunicator, ReduceSumsRanksThenPartsInOrder) {
  const size_t n = 1000;
  for (int world : {1, 2, 3, 4}) {
    for (int parts : {1, 2}) {
      for (int root = 0; root < world; ++root) {
        // The expected sum, formed as one rank accumulates: ranks in order, parts in order.
        std::vector<float> want(n, 0.0f), reversed(n, 0.0f);
        for (int r = 0; r < world; ++r) {
          std::vector<float> v = values(r, n, parts);
          for (int j = 0; j < parts; ++j)
            for (size_t i = 0; i < n; ++i) want[i] += v[static_cast<size_t>(j) * n + i];
        }
        for (int r = world - 1; r >= 0; --r) {
          std::vector<float> v = values(r, n, parts);
          for (int j = 0; j < parts; ++j)
            for (size_t i = 0; i < n; ++i) reversed[i] += v[static_cast<size_t>(j) * n + i];
        }
        if (world > 2) {
          EXPECT_NE(std::memcmp(want.data(), reversed.data(), n * 4), 0) << "the data must see the order";
        }
        on_ranks(world, [&](ThreadCommunicator& comm) {
          std::vector<float> in = values(comm.rank(), n, parts), out(n, -1.0f);
          std::vector<const float*> ptrs;
          for (int j = 0; j < parts; ++j) ptrs.push_back(in.data() + static_cast<size_t>(j) * n);
          // Stagger the ranks so arrival order differs from rank order.
          std::this_thread::sleep_for(std::chrono::milliseconds((world - comm.rank()) * 2));
          Status s = comm.reduce_in_rank_order(ptrs, out.data(), n, root);
          ASSERT_TRUE(s.is_ok()) << s.to_string();
          if (comm.rank() == root)
            EXPECT_EQ(std::memcmp(out.data(), want.data(), n * 4), 0) << "world " << world << " root " << root;
          else
            EXPECT_EQ(out[0], -1.0f) << "only the root's output is written";
        });
      }
    }
  }
}

TEST(ThreadCommunicator, AllGatherAndBroadcastCopyBytes) {
  on_ranks(3, [](ThreadCommunicator& comm) {
    std::vector<int32_t> mine = {comm.rank() * 10, comm.rank() * 10 + 1}, all(6, -1);
    ASSERT_TRUE(comm.all_gather(mine.data(), all.data(), 8).is_ok());
    EXPECT_EQ(all, (std::vector<int32_t>{0, 1, 10, 11, 20, 21}));
    std::vector<float> buf(4, static_cast<float>(comm.rank()));
    ASSERT_TRUE(comm.broadcast(buf.data(), 16, 2).is_ok());
    EXPECT_EQ(buf, std::vector<float>(4, 2.0f));
    EXPECT_TRUE(comm.barrier().is_ok());
  });
}

TEST(ThreadCommunicator, MismatchedSizesAndAbortsAreErrorsOnEveryRank) {
  on_ranks(2, [](ThreadCommunicator& comm) {
    std::vector<float> buf(8, 1.0f);
    Status s = comm.broadcast(buf.data(), comm.rank() == 0 ? 16 : 32, 0);
    EXPECT_FALSE(s.is_ok());
    EXPECT_NE(s.message().find("broadcast: rank"), std::string::npos) << s.to_string();
  });
  on_ranks(2, [](ThreadCommunicator& comm) {
    if (comm.rank() == 1) {
      comm.abort("its step failed");
      return;
    }
    Status s = comm.barrier();  // would wait forever without the abort
    EXPECT_FALSE(s.is_ok());
    EXPECT_NE(s.message().find("rank 1: its step failed"), std::string::npos) << s.to_string();
  });
}

namespace {

// "Device" memory the host must not touch: a buffer's address with bit 52 set (not a
// valid address: dereferencing it faults), reached only through `fake_copy`, as the
// CUDA test's ranks reach device memory only through cudaMemcpy.
constexpr uintptr_t kFakeBit = uintptr_t{1} << 52;
void* fake(void* p) { return reinterpret_cast<void*>(reinterpret_cast<uintptr_t>(p) | kFakeBit); }
const void* fake(const void* p) { return reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(p) | kFakeBit); }
std::atomic<int> fake_copies{0};
Status fake_copy(void* dst, const void* src, size_t bytes) {
  auto real = [](const void* p) { return reinterpret_cast<void*>(reinterpret_cast<uintptr_t>(p) & ~kFakeBit); };
  ++fake_copies;
  std::memcpy(real(dst), real(src), bytes);
  return Status::ok();
}

}  // namespace

// With a copy function, every collective reaches the ranks' buffers through it alone
// (the reductions stage the parts in host memory and add there): the results are the
// host ones.
TEST(ThreadCommunicator, EveryCollectiveGoesThroughTheCopyFunction) {
  const int world = 3;
  const size_t n = 257;
  ThreadGroup group(world);
  std::vector<std::vector<float>> f(world), fsum(world, std::vector<float>(n, -1.0f));
  std::vector<std::vector<uint16_t>> h(world), hsum(world, std::vector<uint16_t>(n, 0));
  std::vector<std::vector<char>> gathered(world, std::vector<char>(world * 8)), bcast(world, std::vector<char>(8));
  for (int r = 0; r < world; ++r) {
    f[r] = values(r, n, 2);
    h[r].resize(2 * n);
    for (size_t i = 0; i < 2 * n; ++i) h[r][i] = testing_support::float_to_bf16_bits(f[r][i]);
    for (int k = 0; k < 8; ++k) bcast[r][k] = static_cast<char>(10 * r + k);
  }
  std::vector<Status> status(world);
  fake_copies = 0;
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      ThreadCommunicator comm(group, r, fake_copy);
      const float* fp = static_cast<const float*>(fake(static_cast<const void*>(f[r].data())));
      Status s = comm.reduce_in_rank_order({fp, fp + n}, r == 2 ? static_cast<float*>(fake(static_cast<void*>(fsum[r].data()))) : nullptr, n, 2);
      const char* hp = static_cast<const char*>(fake(static_cast<const void*>(h[r].data())));
      if (s.is_ok()) s = comm.reduce_bf16_in_rank_order({hp, hp + 2 * n}, r == 1 ? fake(static_cast<void*>(hsum[r].data())) : nullptr, n, 1);
      if (s.is_ok()) s = comm.all_gather(fake(static_cast<const void*>(bcast[r].data())), fake(static_cast<void*>(gathered[r].data())), 8);
      if (s.is_ok()) s = comm.broadcast(fake(static_cast<void*>(bcast[r].data())), 8, 0);
      status[r] = s;
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < world; ++r) ASSERT_TRUE(status[r].is_ok()) << status[r].to_string();
  EXPECT_GT(fake_copies.load(), 0);
  for (size_t i = 0; i < n; ++i) {
    float want = 0.0f;
    uint16_t hwant = h[0][i];
    for (int r = 0; r < world; ++r)
      for (int j = 0; j < 2; ++j) {
        want += f[r][j * n + i];
        if (r > 0 || j > 0)
          hwant = testing_support::float_to_bf16_bits(testing_support::bf16_bits_to_float(hwant) +
                                                      testing_support::bf16_bits_to_float(h[r][j * n + i]));
      }
    ASSERT_EQ(std::memcmp(&fsum[2][i], &want, 4), 0) << i;
    ASSERT_EQ(hsum[1][i], hwant) << i;
  }
  for (int r = 0; r < world; ++r) {
    for (int q = 0; q < world; ++q)
      for (int k = 0; k < 8; ++k) EXPECT_EQ(gathered[r][q * 8 + k], static_cast<char>(10 * q + k));
    for (int k = 0; k < 8; ++k) EXPECT_EQ(bcast[r][k], static_cast<char>(k)) << "rank " << r;
  }
}

// The chained reduce at 2, 3 and 4 ranks, every root, chunks that do not divide n (one
// chunk, a few, many, one element each): f32 and bf16 sums equal the sequential ones
// bit for bit, the root's output may be its first part, and the links carried what a
// chain carries: n elements from each rank to the next and from the last to the root
// (none when the root is last), nothing else, so no link carries more as ranks are
// added. The data mixes magnitudes and signed zeros, so any other order shows.
TEST(ThreadCommunicator, ChainedReduceMatchesTheSequentialSumAtEveryChunking) {
  const size_t n = 103;
  const int parts = 3;
  for (int world : {2, 3, 4}) {
    // Every rank's parts, f32 and their bf16 roundings; element 5 is -0 in every part.
    std::vector<std::vector<float>> f(world);
    std::vector<std::vector<uint16_t>> h(world);
    for (int r = 0; r < world; ++r) {
      f[r] = values(r, n, parts);
      h[r].resize(f[r].size());
      for (size_t i = 0; i < f[r].size(); ++i) h[r][i] = testing_support::float_to_bf16_bits(f[r][i]);
    }
    for (int r = 0; r < world; ++r)
      for (int j = 0; j < parts; ++j) {
        f[r][j * n + 5] = -0.0f;
        h[r][j * n + 5] = 0x8000;
      }
    // The sequential sums, as one rank accumulates: ranks in order, parts in order.
    std::vector<float> want(n, 0.0f);
    std::vector<uint16_t> hwant(h[0].begin(), h[0].begin() + static_cast<long>(n));
    for (int r = 0; r < world; ++r)
      for (int j = 0; j < parts; ++j)
        for (size_t i = 0; i < n; ++i) {
          want[i] += f[r][j * n + i];
          if (r > 0 || j > 0)
            hwant[i] = testing_support::float_to_bf16_bits(testing_support::bf16_bits_to_float(hwant[i]) +
                                                           testing_support::bf16_bits_to_float(h[r][j * n + i]));
        }
    EXPECT_EQ(std::signbit(want[5]), false) << "f32 starts from +0";
    EXPECT_EQ(hwant[5], 0x8000) << "bf16 starts from the first part: -0 + -0 + ... stays -0";
    for (size_t chunk : {size_t{1}, size_t{7}, size_t{50}, size_t{1000}}) {
      for (int root = 0; root < world; ++root) {
        ThreadGroup group(world, chunk);
        std::vector<std::vector<float>> fout(world, std::vector<float>(n, -1.0f));
        std::vector<std::vector<uint16_t>> hin = h;  // the root's copy is overwritten (out = parts[0])
        std::vector<Status> status(world);
        std::vector<std::thread> threads;
        for (int r = 0; r < world; ++r)
          threads.emplace_back([&, r] {
            ThreadCommunicator comm(group, r);
            std::this_thread::sleep_for(std::chrono::microseconds((world - r) * 300));
            const float* fp = f[r].data();
            Status s = comm.reduce_in_rank_order({fp, fp + n, fp + 2 * n}, r == root ? fout[r].data() : nullptr, n, root);
            const uint16_t* hp = hin[r].data();
            if (s.is_ok())
              s = comm.reduce_bf16_in_rank_order({hp, hp + n, hp + 2 * n}, r == root ? hin[r].data() : nullptr, n, root);
            status[r] = s;
          });
        for (auto& t : threads) t.join();
        const std::string where = "world " + std::to_string(world) + " chunk " + std::to_string(chunk) + " root " +
                                  std::to_string(root);
        for (int r = 0; r < world; ++r) ASSERT_TRUE(status[r].is_ok()) << where << ": " << status[r].to_string();
        EXPECT_EQ(std::memcmp(fout[root].data(), want.data(), n * 4), 0) << where;
        EXPECT_EQ(std::memcmp(hin[root].data(), hwant.data(), n * 2), 0) << where;
        for (int r = 0; r < world; ++r) {
          if (r != root) {
            EXPECT_EQ(fout[r][0], -1.0f) << where << ": only the root's output is written";
          }
          for (int q = 0; q < world; ++q) {
            const bool chained = q == r + 1 || (r == world - 1 && q == root && root != world - 1);
            EXPECT_EQ(group.bytes_sent(r, q), chained ? n * (4 + 2) : 0) << where << ": link " << r << " -> " << q;
          }
        }
      }
    }
  }
}

// A rank that fails inside a chained reduce (here the root, without an output) aborts
// the group: the ranks waiting for its chunks get an error instead of waiting forever.
TEST(ThreadCommunicator, AFailureInsideTheChainReachesEveryRank) {
  ThreadGroup group(3, 4);
  std::vector<Status> status(3);
  std::vector<std::thread> threads;
  for (int r = 0; r < 3; ++r)
    threads.emplace_back([&, r] {
      ThreadCommunicator comm(group, r);
      std::vector<float> in(10, 1.0f);
      status[r] = comm.reduce_in_rank_order({in.data()}, nullptr, 10, 1);
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < 3; ++r) EXPECT_FALSE(status[r].is_ok()) << r;
  EXPECT_NE(status[1].message().find("the root's output is null"), std::string::npos) << status[1].to_string();
  EXPECT_NE(status[2].message().find("rank 1: reduce: the root's output is null"), std::string::npos)
      << status[2].to_string();
}
