// Partitioning of the optimizer state by whole tensors (dist/partition.h).
#include <gtest/gtest.h>

#include <algorithm>
#include <random>

#include "dist/partition.h"

using namespace spillway;

TEST(Partition, EveryTensorHasOneOwnerAndTheLoadIsBalancedByBytes) {
  std::mt19937_64 rng(7);
  for (int world : {1, 2, 3, 4, 8}) {
    std::vector<uint64_t> bytes(53);
    for (auto& b : bytes) b = 64 + rng() % 100000;
    bytes[5] = 2'000'000;  // one large tensor (an embedding table)
    auto p = partition_by_bytes(bytes, world);
    ASSERT_TRUE(p.ok()) << p.status().to_string();
    ASSERT_EQ(p->owner.size(), bytes.size());
    std::vector<uint64_t> load(static_cast<size_t>(world), 0);
    for (size_t i = 0; i < bytes.size(); ++i) {
      ASSERT_GE(p->owner[i], 0);
      ASSERT_LT(p->owner[i], world);
      load[static_cast<size_t>(p->owner[i])] += bytes[i];
    }
    EXPECT_EQ(load, p->rank_bytes) << "world " << world;
    // Largest first, each to the lightest rank: the heaviest rank's smallest tensor
    // was placed when that rank was the lightest, so the spread is at most its size
    // (unless the heaviest rank holds a single tensor, which nothing can split).
    const auto heaviest = std::max_element(load.begin(), load.end());
    const uint64_t hi = *heaviest, lo = *std::min_element(load.begin(), load.end());
    const int h = static_cast<int>(heaviest - load.begin());
    uint64_t smallest = UINT64_MAX;
    size_t count = 0;
    for (size_t i = 0; i < bytes.size(); ++i)
      if (p->owner[i] == h) {
        smallest = std::min(smallest, bytes[i]);
        ++count;
      }
    if (count > 1) {
      EXPECT_LE(hi - lo, smallest) << "world " << world;
    }
    if (world == 1) {
      EXPECT_EQ(hi, lo);
    }
    if (world == 8) {
      EXPECT_EQ(load[static_cast<size_t>(p->owner[5])], bytes[5]) << "the large tensor is alone";
    }
    size_t owned = 0;
    for (int r = 0; r < world; ++r) {
      std::vector<size_t> mine = p->owned(r);
      EXPECT_TRUE(std::is_sorted(mine.begin(), mine.end()));
      owned += mine.size();
    }
    EXPECT_EQ(owned, bytes.size());
  }
}

TEST(Partition, IsDeterministicAndBreaksTiesByIndexAndRank) {
  // Equal sizes: tensor i goes to rank i % world (largest first, ties by index, to
  // the lightest rank, ties by rank).
  std::vector<uint64_t> same(10, 256);
  auto p = partition_by_bytes(same, 4);
  ASSERT_TRUE(p.ok());
  for (size_t i = 0; i < same.size(); ++i) EXPECT_EQ(p->owner[i], static_cast<int>(i % 4)) << i;
  // A hand-worked case: sizes 5,1,4,3,3 on 2 ranks. Order 0(5),2(4),3(3),4(3),1(1):
  // 0->r0 (5,0); 2->r1 (5,4); 3->r1 (5,7); 4->r0 (8,7); 1->r1 (8,8).
  auto q = partition_by_bytes({5, 1, 4, 3, 3}, 2);
  ASSERT_TRUE(q.ok());
  EXPECT_EQ(q->owner, (std::vector<int>{0, 1, 1, 1, 0}));
  EXPECT_EQ(q->rank_bytes, (std::vector<uint64_t>{8, 8}));
  auto again = partition_by_bytes({5, 1, 4, 3, 3}, 2);
  EXPECT_EQ(again->owner, q->owner);
}

TEST(Partition, MoreRanksThanTensorsAndBadWorlds) {
  auto p = partition_by_bytes({10, 20}, 4);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->owner, (std::vector<int>{1, 0}));
  EXPECT_TRUE(p->owned(2).empty());
  auto bad = partition_by_bytes({10}, 0);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("world size is 0"), std::string::npos) << bad.status().to_string();
}
