// The in-process communicator (tests/support/thread_communicator.h): its collectives
// give fixed-order results, bit for bit, whatever the threads' timing.
#include <gtest/gtest.h>

#include <chrono>
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
