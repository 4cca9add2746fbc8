#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <vector>

#include "core/size.h"
#include "memory/device_arena.h"
#include "memory/host_pool.h"
#include "memory/range_allocator.h"

using namespace spillway;

namespace {

constexpr uint64_t KiB = 1024, MiB = 1024 * KiB, GiB = 1024 * MiB;

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// A base address for arenas whose memory is never touched.
void* fake_base() { return reinterpret_cast<void*>(uintptr_t{1} << 40); }

}  // namespace

// ---- RangeAllocator ----

TEST(RangeAllocator, BestFitTakesTheSmallestHoleThatHolds) {
  RangeAllocator r(1000, 1);
  // Holes of 100, 50 and 30 bytes, kept apart by 10-byte blocks.
  uint64_t a = *r.allocate(100), b = *r.allocate(10), c = *r.allocate(50), d = *r.allocate(10);
  uint64_t e = *r.allocate(30), f = *r.allocate(10);
  EXPECT_EQ(a, 0u);
  EXPECT_EQ(f, 200u);
  ASSERT_TRUE(r.free(a).is_ok());
  ASSERT_TRUE(r.free(c).is_ok());
  ASSERT_TRUE(r.free(e).is_ok());
  EXPECT_EQ(*r.allocate(40), c);   // the 50 hole, not the 100 hole or the tail
  EXPECT_EQ(*r.allocate(25), e);   // the 30 hole
  EXPECT_EQ(*r.allocate(100), a);  // an exact fit
  EXPECT_EQ(*r.allocate(5), e + 25);  // what is left of the 30 hole
  EXPECT_EQ(r.largest_free_block(), 1000u - 210u);
  ASSERT_TRUE(r.validate().is_ok()) << r.validate().to_string();
  (void)b;
  (void)d;
}

TEST(RangeAllocator, FreesCoalesceInAnyOrder) {
  for (int order = 0; order < 6; ++order) {
    RangeAllocator r(4 * KiB, 64);
    std::vector<uint64_t> blocks = {*r.allocate(1000), *r.allocate(1000), *r.allocate(1000)};
    int perms[6][3] = {{0, 1, 2}, {0, 2, 1}, {1, 0, 2}, {1, 2, 0}, {2, 0, 1}, {2, 1, 0}};
    for (int i : perms[order]) {
      ASSERT_TRUE(r.free(blocks[i]).is_ok());
      ASSERT_TRUE(r.validate().is_ok()) << r.validate().to_string();
    }
    EXPECT_EQ(r.free_block_count(), 1u);
    EXPECT_EQ(r.largest_free_block(), 4 * KiB);
    EXPECT_EQ(r.in_use(), 0u);
    EXPECT_EQ(r.peak(), 3 * 1024u);
  }
}

TEST(RangeAllocator, BlocksAreAlignedAndRounded) {
  RangeAllocator r(64 * KiB, 256);
  for (uint64_t bytes : {1u, 255u, 256u, 257u, 4095u, 0u}) {
    auto off = r.allocate(bytes);
    ASSERT_TRUE(off.ok());
    EXPECT_EQ(*off % 256, 0u);
    EXPECT_EQ(*r.block_bytes(*off), align_up(std::max<uint64_t>(bytes, 1), 256));
  }
  EXPECT_EQ(r.in_use(), 256u + 256 + 256 + 512 + 4096 + 256);
  Status s = r.reserve(100, 10);
  EXPECT_EQ(s.code(), StatusCode::InvalidArgument);
  EXPECT_TRUE(contains(s.message(), "alignment")) << s.message();
  EXPECT_TRUE(r.validate().is_ok());
}

TEST(RangeAllocator, LastBlockEndsAtAnUnalignedCapacity) {
  RangeAllocator r(1000, 64);
  EXPECT_EQ(*r.allocate(960), 0u);
  auto tail = r.allocate(40);
  ASSERT_TRUE(tail.ok());
  EXPECT_EQ(*tail, 960u);
  EXPECT_EQ(r.in_use(), 1000u);
  EXPECT_FALSE(r.allocate(1).ok());
  ASSERT_TRUE(r.free(*tail).is_ok());
  EXPECT_TRUE(r.reserve(960, 40).is_ok());
  EXPECT_TRUE(r.validate().is_ok());
}

TEST(RangeAllocator, ReserveRejectsOverlapAndOutOfBounds) {
  RangeAllocator r(4096, 64);
  ASSERT_TRUE(r.reserve(1024, 512).is_ok());
  Status overlap = r.reserve(1280, 512);
  EXPECT_EQ(overlap.code(), StatusCode::InvalidArgument);
  EXPECT_TRUE(contains(overlap.message(), "[1024, 1536)")) << overlap.message();
  Status past = r.reserve(4032, 128);
  EXPECT_EQ(past.code(), StatusCode::InvalidArgument);
  EXPECT_TRUE(contains(past.message(), "capacity")) << past.message();
  EXPECT_FALSE(r.reserve(UINT64_MAX - 63, 128).is_ok());
  // The best fit never returns a reserved block.
  for (int i = 0; i < 7; ++i) {
    auto off = r.allocate(512);
    ASSERT_TRUE(off.ok());
    EXPECT_NE(*off, 1024u);
  }
  EXPECT_FALSE(r.allocate(64).ok());
  EXPECT_EQ(r.free(4000).code(), StatusCode::InvalidArgument);
}

TEST(RangeAllocator, AddedRangesWithAGapNeverMerge) {
  RangeAllocator r(1 << 20, 64, /*start_free=*/false);
  EXPECT_FALSE(r.allocate(1).ok());
  ASSERT_TRUE(r.add_free(0, 1024).is_ok());
  ASSERT_TRUE(r.add_free(1088, 1024).is_ok());
  EXPECT_FALSE(r.add_free(512, 64).is_ok());  // already free
  EXPECT_EQ(r.free_bytes(), 2048u);
  EXPECT_FALSE(r.allocate(1500).ok());
  uint64_t a = *r.allocate(1024);
  EXPECT_EQ(a, 0u);
  EXPECT_FALSE(r.remove_free(0, 1024).is_ok());  // occupied
  EXPECT_TRUE(r.remove_free(1088, 1024).is_ok());
  EXPECT_EQ(r.free_bytes(), 0u);
  EXPECT_TRUE(r.validate().is_ok());
}

// Random allocate / reserve / free sequences: the allocator's invariants hold after
// every step, live blocks never overlap nor pass capacity, and best fit succeeds
// exactly when some free block holds the request.
TEST(RangeAllocator, RandomSequencesKeepInvariants) {
  std::mt19937_64 rng(20240611);
  for (uint64_t capacity : {uint64_t{1} << 16, uint64_t{100003}}) {
    RangeAllocator r(capacity, 64);
    std::map<uint64_t, uint64_t> live;  // offset → footprint
    int refused = 0, reserved = 0;
    for (int step = 0; step < 20000; ++step) {
      int op = static_cast<int>(rng() % 10);
      if (op < 5) {
        uint64_t bytes = rng() % 3000;
        uint64_t need = std::min(align_up(std::max<uint64_t>(bytes, 1), 64), capacity);
        uint64_t largest = r.largest_free_block();
        auto off = r.allocate(bytes);
        if (need <= largest) {
          ASSERT_TRUE(off.ok()) << "step " << step;
        }
        if (!off.ok()) {
          ASSERT_EQ(off.status().code(), StatusCode::OutOfMemory);
          ++refused;
          continue;
        }
        live[*off] = *r.block_bytes(*off);
      } else if (op < 7) {
        uint64_t offset = (rng() % (capacity / 64 + 2)) * 64;
        uint64_t bytes = rng() % 2000;
        if (r.reserve(offset, bytes).is_ok()) {
          live[offset] = *r.block_bytes(offset);
          ++reserved;
        }
      } else if (!live.empty()) {
        auto it = live.begin();
        std::advance(it, static_cast<long>(rng() % live.size()));
        ASSERT_TRUE(r.free(it->first).is_ok());
        live.erase(it);
      }
      ASSERT_TRUE(r.validate().is_ok()) << r.validate().to_string();
      uint64_t sum = 0, end = 0;
      for (const auto& [offset, bytes] : live) {
        ASSERT_GE(offset, end) << "overlapping blocks at step " << step;
        end = offset + bytes;
        sum += bytes;
      }
      ASSERT_LE(end, capacity);
      ASSERT_EQ(sum, r.in_use());
      ASSERT_LE(r.peak(), capacity);
    }
    EXPECT_GT(refused, 0);  // the sequence does reach a full allocator
    EXPECT_GT(reserved, 0);
  }
}

// ---- DeviceArena ----

TEST(DeviceArena, OutOfMemoryMessageStatesTheFourNumbers) {
  DeviceArena arena(fake_base(), 24 * GiB, 256);
  ASSERT_TRUE(arena.place(0, 22 * GiB).ok());
  ASSERT_TRUE(arena.place(22 * GiB + 512 * MiB, 1 * GiB).ok());
  auto r = arena.allocate(1536 * MiB);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::OutOfMemory);
  EXPECT_EQ(r.status().message(),
            "device arena: cannot allocate 1.50 GiB: 23.00 GiB in use, largest free block 512.00 MiB, "
            "budget 24.00 GiB");
  // The same four numbers for any request that does not fit.
  uint64_t asked = 700 * MiB + 3;
  auto again = arena.allocate(asked);
  ASSERT_FALSE(again.ok());
  for (uint64_t n : {asked, uint64_t{23} * GiB, uint64_t{512} * MiB, uint64_t{24} * GiB}) {
    EXPECT_TRUE(contains(again.status().message(), format_size(n))) << again.status().message();
  }
}

TEST(DeviceArena, PlacementsAreCheckedAndNeverHandedOut) {
  std::vector<unsigned char> memory(64 * KiB + 64);
  void* base = memory.data() + (64 - reinterpret_cast<uintptr_t>(memory.data()) % 64) % 64;
  DeviceArena arena(base, 64 * KiB, 64);
  auto w = arena.place(4096, 8192);
  ASSERT_TRUE(w.ok()) << w.status().to_string();
  EXPECT_EQ(*w, static_cast<char*>(base) + 4096);

  auto past = arena.place(60 * KiB, 8 * KiB);
  ASSERT_FALSE(past.ok());
  EXPECT_EQ(past.status().code(), StatusCode::InvalidArgument);
  EXPECT_TRUE(contains(past.status().message(), "past the budget")) << past.status().message();
  EXPECT_FALSE(arena.place(64 * KiB, 1).ok());
  EXPECT_FALSE(arena.place(SIZE_MAX - 10, 100).ok());
  auto unaligned = arena.place(100, 64);
  ASSERT_FALSE(unaligned.ok());
  EXPECT_TRUE(contains(unaligned.status().message(), "alignment")) << unaligned.status().message();
  auto overlap = arena.place(8192, 64);
  ASSERT_FALSE(overlap.ok());
  EXPECT_TRUE(contains(overlap.status().message(), "overlaps")) << overlap.status().message();

  // Unplanned blocks fill everything but the placement.
  std::vector<void*> blocks;
  for (;;) {
    auto p = arena.allocate(1024);
    if (!p) break;
    auto off = static_cast<char*>(*p) - static_cast<char*>(base);
    EXPECT_TRUE(off + 1024 <= 4096 || off >= 4096 + 8192) << "offset " << off;
    blocks.push_back(*p);
  }
  EXPECT_EQ(blocks.size(), (64 - 8) * KiB / 1024);
  EXPECT_EQ(arena.in_use(), 64 * KiB);
  EXPECT_EQ(arena.free(*w).code(), StatusCode::InvalidArgument);  // planned: use release_placed
  EXPECT_EQ(arena.release_placed(4096, 100).code(), StatusCode::InvalidArgument);
  EXPECT_TRUE(arena.release_placed(4096, 8192).is_ok());
  EXPECT_EQ(arena.release_placed(4096, 8192).code(), StatusCode::InvalidArgument);
  for (void* p : blocks) ASSERT_TRUE(arena.free(p).is_ok());
  EXPECT_EQ(arena.in_use(), 0u);
  EXPECT_EQ(arena.peak(), 64 * KiB);
  arena.reset_peak();
  EXPECT_EQ(arena.peak(), 0u);
  EXPECT_EQ(arena.largest_free_block(), 64 * KiB);
  EXPECT_TRUE(arena.free(nullptr).is_ok());
  int outside = 0;
  EXPECT_EQ(arena.free(&outside).code(), StatusCode::InvalidArgument);
}

TEST(DeviceArena, MisalignedBaseIsRejected) {
  DeviceArena arena(static_cast<char*>(fake_base()) + 8, 1 * MiB, 256);
  auto p = arena.allocate(16);
  ASSERT_FALSE(p.ok());
  EXPECT_TRUE(contains(p.status().message(), "not aligned")) << p.status().message();
  EXPECT_FALSE(arena.place(0, 16).ok());
}

// Random place / allocate / free: in-use and peak never pass the budget, and every
// pointer lies inside the arena, aligned.
TEST(DeviceArena, BudgetHoldsUnderRandomUse) {
  std::mt19937_64 rng(7);
  const size_t budget = 10 * MiB + 4000;  // not a multiple of the alignment
  DeviceArena arena(fake_base(), budget, 256);
  std::vector<void*> allocated;
  std::vector<std::pair<size_t, size_t>> placed;
  char* base = static_cast<char*>(fake_base());
  for (int step = 0; step < 20000; ++step) {
    int op = static_cast<int>(rng() % 8);
    if (op < 3) {
      auto p = arena.allocate(rng() % (256 * KiB));
      if (p) {
        ASSERT_EQ(reinterpret_cast<uintptr_t>(*p) % 256, 0u);
        ASSERT_TRUE(arena.contains(*p));
        allocated.push_back(*p);
      } else {
        ASSERT_EQ(p.status().code(), StatusCode::OutOfMemory);
      }
    } else if (op < 5) {
      size_t offset = (rng() % (budget / 256 + 4)) * 256, bytes = rng() % (128 * KiB);
      auto p = arena.place(offset, bytes);
      if (p) {
        ASSERT_EQ(*p, base + offset);
        placed.emplace_back(offset, bytes);
      }
    } else if (op < 7 && !allocated.empty()) {
      size_t i = rng() % allocated.size();
      ASSERT_TRUE(arena.free(allocated[i]).is_ok());
      allocated.erase(allocated.begin() + static_cast<long>(i));
    } else if (!placed.empty()) {
      size_t i = rng() % placed.size();
      ASSERT_TRUE(arena.release_placed(placed[i].first, placed[i].second).is_ok());
      placed.erase(placed.begin() + static_cast<long>(i));
    }
    ASSERT_LE(arena.in_use(), budget);
    ASSERT_LE(arena.peak(), budget);
  }
}

// ---- HostPool ----

namespace {

// A host allocator over aligned_alloc that counts the bytes it holds.
struct CountingAllocator {
  size_t live = 0, most = 0, calls = 0;
  bool fail = false;
  HostAllocator get() {
    return HostAllocator{
        [this](size_t bytes) -> Result<void*> {
          ++calls;
          if (fail) return Status::out_of_memory("test allocator refuses");
          void* p = std::aligned_alloc(4096, align_up(bytes, 4096));
          if (p == nullptr) return Status::out_of_memory("aligned_alloc failed");
          live += bytes;
          most = std::max(most, live);
          return p;
        },
        [this](void* p, size_t bytes) {
          live -= bytes;
          std::free(p);
        }};
  }
};

}  // namespace

TEST(HostPool, SlabsAreLazyAndNeverPassTheBudget) {
  CountingAllocator counter;
  {
    HostPool pool(100 * KiB, counter.get(), 64, 64 * KiB);
    EXPECT_EQ(pool.slab_count(), 0u);
    EXPECT_EQ(pool.reserved(), 0u);
    auto a = pool.allocate(1000);
    ASSERT_TRUE(a.ok()) << a.status().to_string();
    EXPECT_EQ(pool.slab_count(), 1u);
    EXPECT_EQ(pool.reserved(), 64 * KiB);
    auto b = pool.allocate(40 * KiB);  // fits the first slab
    ASSERT_TRUE(b.ok());
    EXPECT_EQ(pool.slab_count(), 1u);
    auto c = pool.allocate(34 * KiB);  // needs a second slab, cut to the budget left
    ASSERT_TRUE(c.ok()) << c.status().to_string();
    EXPECT_EQ(pool.slab_count(), 2u);
    EXPECT_EQ(pool.reserved(), 100 * KiB);
    EXPECT_EQ(counter.live, 100 * KiB);
    auto d = pool.allocate(24 * KiB);  // 23 KiB free in the first slab, 2 KiB in the second
    ASSERT_FALSE(d.ok());
    EXPECT_EQ(d.status().code(), StatusCode::OutOfMemory);
    EXPECT_TRUE(contains(d.status().message(), "host pool: cannot allocate 24.00 KiB: 75.00 KiB in use, largest free block 23.00 KiB")) << d.status().message();
    EXPECT_TRUE(contains(d.status().message(), "budget 100.00 KiB")) << d.status().message();
    std::memset(*a, 1, 1000);
    std::memset(*b, 2, 40 * KiB);
    std::memset(*c, 3, 34 * KiB);
    EXPECT_TRUE(pool.free(*a).is_ok());
    EXPECT_TRUE(pool.free(*b).is_ok());
    EXPECT_TRUE(pool.free(*c).is_ok());
    EXPECT_EQ(pool.in_use(), 0u);
  }
  EXPECT_EQ(counter.live, 0u);  // the destructor gave every slab back
  EXPECT_LE(counter.most, 100 * KiB);
}

TEST(HostPool, LargeRequestGetsItsOwnSlab) {
  CountingAllocator counter;
  HostPool pool(1 * MiB, counter.get(), 64, 64 * KiB);
  auto big = pool.allocate(300 * KiB + 5);
  ASSERT_TRUE(big.ok());
  EXPECT_EQ(pool.reserved(), align_up(300 * KiB + 5, 64));
  EXPECT_EQ(pool.in_use(), align_up(300 * KiB + 5, 64));
}

TEST(HostPool, EmptySlabsAreGivenBackUnderPressure) {
  CountingAllocator counter;
  HostPool pool(128 * KiB, counter.get(), 64, 64 * KiB);
  auto a = pool.allocate(60 * KiB), b = pool.allocate(60 * KiB);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(pool.slab_count(), 2u);
  ASSERT_TRUE(pool.free(*a).is_ok());
  ASSERT_TRUE(pool.free(*b).is_ok());
  EXPECT_EQ(pool.largest_free_block(), 128 * KiB);
  auto c = pool.allocate(100 * KiB);  // fits only once both empty slabs are gone
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(pool.slab_count(), 1u);
  EXPECT_LE(counter.live, 128 * KiB);
  ASSERT_TRUE(pool.free(*c).is_ok());
  pool.release_empty_slabs();
  EXPECT_EQ(pool.slab_count(), 0u);
  EXPECT_EQ(counter.live, 0u);
}

TEST(HostPool, BadFreesAndAllocatorErrorsAreStatuses) {
  CountingAllocator counter;
  HostPool pool(1 * MiB, counter.get(), 64, 64 * KiB);
  auto a = pool.allocate(100);
  ASSERT_TRUE(a.ok());
  int outside = 0;
  EXPECT_EQ(pool.free(&outside).code(), StatusCode::InvalidArgument);
  EXPECT_EQ(pool.free(static_cast<char*>(*a) + 64).code(), StatusCode::InvalidArgument);
  EXPECT_TRUE(pool.free(*a).is_ok());
  EXPECT_EQ(pool.free(*a).code(), StatusCode::InvalidArgument);  // double free
  EXPECT_TRUE(pool.free(nullptr).is_ok());
  auto too_big = pool.allocate(2 * MiB);
  ASSERT_FALSE(too_big.ok());
  EXPECT_EQ(too_big.status().code(), StatusCode::OutOfMemory);

  pool.release_empty_slabs();
  counter.fail = true;
  auto refused = pool.allocate(100);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::OutOfMemory);
  EXPECT_TRUE(contains(refused.status().message(), "getting a slab of 64.00 KiB")) << refused.status().message();
  EXPECT_TRUE(contains(refused.status().message(), "test allocator refuses")) << refused.status().message();
}

// Random allocate / free with every block filled with its own byte: blocks never
// overlap (the bytes survive), the slabs held never pass the budget, and a request
// no larger than largest_free_block() always succeeds.
TEST(HostPool, BudgetHoldsUnderRandomUse) {
  std::mt19937_64 rng(12345);
  CountingAllocator counter;
  const size_t budget = 4 * MiB + 1000;
  HostPool pool(budget, counter.get(), 64, 256 * KiB);
  struct Block {
    unsigned char* p;
    size_t bytes;
    unsigned char fill;
  };
  std::vector<Block> blocks;
  int refused = 0;
  for (int step = 0; step < 5000; ++step) {
    if (rng() % 5 < 3) {
      size_t bytes = (rng() % 4 == 0) ? rng() % (600 * KiB) : rng() % (16 * KiB);
      size_t largest = pool.largest_free_block();
      auto p = pool.allocate(bytes);
      if (align_up(std::max<size_t>(bytes, 1), 64) <= largest) {
        ASSERT_TRUE(p.ok()) << "step " << step << ": " << p.status().to_string();
      }
      if (!p) {
        ASSERT_EQ(p.status().code(), StatusCode::OutOfMemory) << p.status().to_string();
        ++refused;
        continue;
      }
      ASSERT_EQ(reinterpret_cast<uintptr_t>(*p) % 64, 0u);
      auto fill = static_cast<unsigned char>(rng());
      std::memset(*p, fill, bytes);
      blocks.push_back({static_cast<unsigned char*>(*p), bytes, fill});
    } else if (!blocks.empty()) {
      size_t i = rng() % blocks.size();
      const Block& b = blocks[i];
      for (size_t k = 0; k < b.bytes; k += 97) ASSERT_EQ(b.p[k], b.fill) << "block overwritten";
      if (b.bytes > 0) {
        ASSERT_EQ(b.p[b.bytes - 1], b.fill);
      }
      ASSERT_TRUE(pool.free(b.p).is_ok());
      blocks.erase(blocks.begin() + static_cast<long>(i));
    }
    ASSERT_LE(counter.live, budget);
    ASSERT_EQ(counter.live, pool.reserved());
    ASSERT_LE(pool.in_use(), pool.reserved());
    ASSERT_LE(pool.peak(), budget);
  }
  EXPECT_GT(refused, 0);
  EXPECT_LE(counter.most, budget);
}

TEST(HostPool, DefaultAllocatorGivesPageAlignedUsableMemory) {
  HostPool pool(8 * MiB);
  auto a = pool.allocate(3 * MiB + 3);
  ASSERT_TRUE(a.ok()) << a.status().to_string();
  std::memset(*a, 0x5a, 3 * MiB + 3);
  auto b = pool.allocate(70 * MiB);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), StatusCode::OutOfMemory);
  EXPECT_TRUE(pool.free(*a).is_ok());
  EXPECT_LE(pool.reserved(), 8 * MiB);
}
