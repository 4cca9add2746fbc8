// HostPool: the host tier's memory under a host budget. It takes slabs from a
// HostAllocator when it needs them (64 MiB, or the request's size when larger,
// never past the budget) and hands out best-fit blocks of them through one
// RangeAllocator.
//
//   HostPool pool(/*budget=*/8ull << 30);                      // page-locked mmap slabs
//   HostPool pinned(budget, HostAllocator{                      // CUDA: pinned slabs
//       [&](size_t n) { return backend.host_alloc(n); },
//       [&](void* p, size_t) { backend.host_free(p); }}, backend.alignment());
//   SPILLWAY_ASSIGN_OR_RETURN(void* buf, pool.allocate(bytes));
//   SPILLWAY_RETURN_IF_ERROR(pool.free(buf));
//   pool.in_use(); pool.peak(); pool.reserved();                // bytes
//
// Budget: the bytes of all slabs held (reserved()) never exceed the budget, so
// neither do the blocks in them. When no slab holds a request and the budget
// left is too small for a new slab, the pool gives its empty slabs back and tries
// again before it reports OutOfMemory:
// "host pool: cannot allocate 2.00 GiB: 6.10 GiB in use, largest free block 1.90 GiB, budget 8.00 GiB".
// Blocks start at multiples of `alignment` and take their size rounded up to it;
// the allocator's slabs must be aligned to `alignment`. Thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>

#include "core/status.h"
#include "memory/range_allocator.h"

namespace spillway {

// Where a HostPool gets its slabs. free gets the size that alloc was asked for.
struct HostAllocator {
  std::function<Result<void*>(size_t bytes)> alloc;
  std::function<void(void* p, size_t bytes)> free;
};

// Page-aligned anonymous mmap, locked in RAM with mlock where the system allows
// (RLIMIT_MEMLOCK); when mlock fails it says so once on stderr and the memory
// stays pageable.
HostAllocator page_locked_host_allocator();

class HostPool {
 public:
  static constexpr size_t kDefaultSlabBytes = size_t{64} << 20;

  explicit HostPool(size_t budget, HostAllocator allocator = page_locked_host_allocator(),
                    size_t alignment = 64, size_t slab_bytes = kDefaultSlabBytes);
  ~HostPool();  // gives every slab back, whether or not its blocks were freed
  HostPool(const HostPool&) = delete;
  HostPool& operator=(const HostPool&) = delete;

  // OutOfMemory when the budget cannot hold it; the allocator's error when a slab
  // cannot be had.
  Result<void*> allocate(size_t bytes);
  // Frees a block from allocate (nullptr is a no-op).
  Status free(void* p);
  // Gives back the slabs that hold no block.
  void release_empty_slabs();

  size_t budget() const { return budget_; }
  size_t alignment() const { return alignment_; }
  size_t in_use() const;              // bytes of blocks handed out (rounded sizes)
  size_t peak() const;                // highest in_use since construction or reset_peak
  size_t reserved() const;            // bytes of slabs held, <= budget
  size_t largest_free_block() const;  // the largest request that would succeed now
  size_t slab_count() const;
  void reset_peak();

 private:
  struct Slab {
    void* memory = nullptr;      // from allocator_.alloc, `bytes` long
    size_t bytes = 0;            // multiple of alignment_
    uint64_t range_offset = 0;   // where the slab starts among ranges_' offsets
    size_t in_use = 0;           // bytes of blocks in this slab
  };

  Status add_slab(size_t bytes);
  void release_empty_slabs_locked();
  size_t largest_free_block_locked() const;

  size_t budget_;        // bytes
  size_t alignment_;     // bytes; every block starts at a multiple of it
  size_t slab_bytes_;    // size of a new slab, unless a request needs more
  HostAllocator allocator_;
  mutable std::mutex mu_;
  RangeAllocator ranges_;                  // one range per slab, a gap between slabs
  uint64_t next_range_offset_ = 0;         // where the next slab's range starts
  size_t reserved_ = 0;                    // bytes of all slabs
  std::map<uintptr_t, Slab> slabs_;        // keyed by the slab's address
  std::map<uint64_t, uintptr_t> by_range_; // slab range offset → slab address
};

}  // namespace spillway
