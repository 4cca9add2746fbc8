// DeviceArena: the device tier's memory, one allocation of exactly the device
// budget. The planner gives each device-resident interval an offset in it
// (place); anything unplanned gets a best-fit block (allocate). Both kinds share
// one RangeAllocator, so allocate never hands out a planned region.
//
//   auto mem = backend.device_alloc(budget);              // the arena does not allocate
//   if (!mem) return mem.status();
//   DeviceArena arena(*mem, budget, backend.alignment());
//   SPILLWAY_ASSIGN_OR_RETURN(void* w, arena.place(/*offset=*/0, w_bytes));   // planned
//   SPILLWAY_ASSIGN_OR_RETURN(void* tmp, arena.allocate(4096));                // unplanned
//   SPILLWAY_RETURN_IF_ERROR(arena.free(tmp));
//   SPILLWAY_RETURN_IF_ERROR(arena.release_placed(0, w_bytes));
//   arena.peak();                                          // bytes, for the budget report
//   backend.device_free(*mem);                             // the caller frees
//
// Every block starts at a multiple of `alignment` from base and takes its size
// rounded up to the alignment (the last block may end at an unaligned budget);
// in_use() and peak() count those rounded sizes, and never exceed the budget.
// The out-of-memory message reads
// "device arena: cannot allocate 1.50 GiB: 22.10 GiB in use, largest free block 0.90 GiB, budget 24.00 GiB".
// Thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>

#include "core/status.h"
#include "memory/range_allocator.h"

namespace spillway {

class DeviceArena {
 public:
  // `base` must be aligned to `alignment` (a misaligned base makes every place and
  // allocate fail with InvalidArgument). alignment 0 counts as 1.
  DeviceArena(void* base, size_t budget, size_t alignment);
  DeviceArena(const DeviceArena&) = delete;
  DeviceArena& operator=(const DeviceArena&) = delete;

  // base + offset for a planned tensor of `bytes`. InvalidArgument when the offset
  // is not aligned, the tensor passes the budget, or it overlaps an occupied block.
  Result<void*> place(size_t offset, size_t bytes);
  // Ends a placement; offset and bytes must be those given to place.
  Status release_placed(size_t offset, size_t bytes);

  // Best fit for unplanned use; OutOfMemory with the message above.
  Result<void*> allocate(size_t bytes);
  // Frees a block from allocate (nullptr is a no-op).
  Status free(void* p);

  void* base() const { return base_; }
  size_t budget() const { return budget_; }
  size_t alignment() const;
  bool contains(const void* p) const;
  size_t in_use() const;              // bytes of placed and allocated blocks
  size_t peak() const;                // highest in_use since construction or reset_peak
  size_t largest_free_block() const;  // bytes
  void reset_peak();

 private:
  Status check_base() const;

  void* base_;     // the device allocation, budget_ bytes
  size_t budget_;  // bytes
  mutable std::mutex mu_;
  RangeAllocator ranges_;               // offsets [0, budget_), both kinds of block
  std::map<size_t, size_t> placed_;     // offset → bytes asked, blocks from place
};

}  // namespace spillway
