// RangeAllocator: best-fit allocation of aligned blocks of offsets in [0, capacity),
// with coalescing frees. It hands out numbers, not memory: DeviceArena maps the
// offsets onto its one device allocation, HostPool onto its slabs.
//
//   RangeAllocator r(/*capacity=*/1 << 20, /*alignment=*/64);
//   auto a = r.allocate(1000);              // offset 0, a block of 1024 bytes
//   if (!a) return a.status();
//   SPILLWAY_RETURN_IF_ERROR(r.reserve(4096, 512));  // a block at a chosen offset
//   SPILLWAY_RETURN_IF_ERROR(r.free(*a));    // coalesces with free neighbours
//   r.in_use();   // 512
//   r.peak();     // 1536
//
// Block rules:
// - every block starts at a multiple of `alignment`; its size (its footprint) is
//   the request rounded up to `alignment` (0 bytes counts as 1), except that a
//   block never reaches past `capacity`, so when capacity is not a multiple of
//   the alignment the last block ends exactly at capacity;
// - allocate() takes the smallest free block that holds the footprint (the lowest
//   offset among equals), and carves the block from its low end;
// - a free block is never adjacent to another free block (frees coalesce).
//
// A RangeAllocator made with start_free = false owns no free space until
// add_free() gives it some; HostPool gives it one range per slab, with a gap
// between slabs so that blocks never span two slabs.
//
// Not thread-safe: the owner locks.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <utility>

#include "core/status.h"

namespace spillway {

// The out-of-memory message every tier uses:
// "device arena: cannot allocate 1.50 GiB: 22.10 GiB in use, largest free block 0.90 GiB, budget 24.00 GiB"
std::string out_of_memory_message(std::string_view who, uint64_t asked, uint64_t in_use,
                                  uint64_t largest_free, uint64_t budget);

class RangeAllocator {
 public:
  // alignment 0 counts as 1.
  RangeAllocator(uint64_t capacity, uint64_t alignment, bool start_free = true);

  // Best fit; OutOfMemory when no free block holds the footprint.
  Result<uint64_t> allocate(uint64_t bytes);
  // Marks the block [offset, offset + footprint) occupied. InvalidArgument when the
  // offset is not aligned, the block passes capacity, or any of it is not free.
  Status reserve(uint64_t offset, uint64_t bytes);
  // Frees the block that starts at `offset` (from allocate or reserve).
  Status free(uint64_t offset);

  // Makes [offset, offset + bytes) free; it must be aligned (its end aligned or
  // equal to capacity) and hold no free or occupied block yet.
  Status add_free(uint64_t offset, uint64_t bytes);
  // Takes [offset, offset + bytes) out of the free space; all of it must be free.
  Status remove_free(uint64_t offset, uint64_t bytes);

  // The footprint of the occupied block starting at `offset`; nullopt if none does.
  std::optional<uint64_t> block_bytes(uint64_t offset) const;
  // The footprint a request of `bytes` at `offset` would take.
  uint64_t footprint(uint64_t offset, uint64_t bytes) const;

  uint64_t capacity() const { return capacity_; }
  uint64_t alignment() const { return alignment_; }
  uint64_t in_use() const { return in_use_; }          // footprints of occupied blocks
  uint64_t peak() const { return peak_; }              // highest in_use since reset_peak
  uint64_t free_bytes() const { return free_bytes_; }  // sum of free blocks
  uint64_t largest_free_block() const;
  size_t block_count() const { return used_.size(); }
  size_t free_block_count() const { return free_by_offset_.size(); }
  void reset_peak() { peak_ = in_use_; }

  // Checks every internal invariant (for tests): free blocks sorted, disjoint,
  // never adjacent, aligned; both free indexes agree; no free block overlaps an
  // occupied one; the byte counts add up.
  Status validate() const;

 private:
  // Removes [offset, offset + bytes) from the free block that contains it.
  bool carve(uint64_t offset, uint64_t bytes);
  // Inserts a free block and merges it with free neighbours.
  void insert_free(uint64_t offset, uint64_t bytes);
  void erase_free(std::map<uint64_t, uint64_t>::iterator it);
  // "[4096, 8192)" or, when none overlaps, an empty string.
  std::string occupied_overlap(uint64_t offset, uint64_t bytes) const;

  uint64_t capacity_;   // offsets live in [0, capacity_)
  uint64_t alignment_;  // every block starts at a multiple of it
  std::map<uint64_t, uint64_t> free_by_offset_;            // offset → bytes, free blocks
  std::set<std::pair<uint64_t, uint64_t>> free_by_size_;   // (bytes, offset), same blocks
  std::map<uint64_t, uint64_t> used_;                      // offset → footprint, occupied blocks
  uint64_t in_use_ = 0;
  uint64_t peak_ = 0;
  uint64_t free_bytes_ = 0;
};

}  // namespace spillway
