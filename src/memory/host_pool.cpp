#include "memory/host_pool.h"

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <string>

#include "core/size.h"

namespace spillway {

namespace {

constexpr const char* kWho = "host pool";

// Offsets of ranges_ run up to here; slabs take fresh ranges, so this bounds the
// bytes of all slabs ever made in one pool (4 EiB).
constexpr uint64_t kRangeSpace = uint64_t{1} << 62;

std::string pointer_text(const void* p) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%p", p);
  return buf;
}

uint64_t align_down(uint64_t x, uint64_t a) { return x / a * a; }

std::atomic<bool> mlock_warned{false};

}  // namespace

HostAllocator page_locked_host_allocator() {
  HostAllocator a;
  a.alloc = [](size_t bytes) -> Result<void*> {
    if (bytes == 0) return Status::invalid_argument("host memory: cannot map 0 bytes");
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      int err = errno;
      Status s = errno_status("host memory: mmap of " + format_size(bytes), err);
      if (err == ENOMEM) return Status::out_of_memory(s.message());
      return s;
    }
    if (mlock(p, bytes) != 0) {
      int err = errno;
      if (!mlock_warned.exchange(true)) {
        std::fprintf(stderr,
                     "spillway: host memory: mlock of %s failed: %s; host memory stays pageable "
                     "(slower copies, may be swapped out). Raise the locked-memory limit (ulimit -l) "
                     "to lock it.\n",
                     format_size(bytes).c_str(), std::strerror(err));
      }
    }
    return p;
  };
  a.free = [](void* p, size_t bytes) {
    if (p == nullptr) return;
    if (munmap(p, bytes) != 0) {
      int err = errno;
      std::fprintf(stderr, "spillway: host memory: munmap of %s at %p failed: %s\n", format_size(bytes).c_str(), p,
                   std::strerror(err));
    }
  };
  return a;
}

HostPool::HostPool(size_t budget, HostAllocator allocator, size_t alignment, size_t slab_bytes)
    : budget_(budget),
      alignment_(alignment == 0 ? 1 : alignment),
      slab_bytes_(slab_bytes == 0 ? kDefaultSlabBytes : slab_bytes),
      allocator_(std::move(allocator)),
      ranges_(kRangeSpace, alignment_, /*start_free=*/false) {}

HostPool::~HostPool() {
  for (auto& [address, slab] : slabs_) allocator_.free(slab.memory, slab.bytes);
}

Status HostPool::add_slab(size_t bytes) {
  if (!allocator_.alloc || !allocator_.free) {
    return Status::invalid_argument("host pool: the host allocator lacks an alloc or a free function");
  }
  // The slab's range is followed by a gap of one alignment unit that is never
  // free, so blocks of neighbouring slabs never coalesce.
  if (next_range_offset_ + bytes + alignment_ > kRangeSpace) {
    return Status::internal("host pool: slab ranges exhausted after " + format_size(next_range_offset_));
  }
  auto r = allocator_.alloc(bytes);
  if (!r) return r.status().with_context(std::string(kWho) + ": getting a slab of " + format_size(bytes));
  void* memory = *r;
  auto address = reinterpret_cast<uintptr_t>(memory);
  if (memory == nullptr || address % alignment_ != 0) {
    allocator_.free(memory, bytes);
    return Status::internal("host pool: the host allocator returned " + pointer_text(memory) +
                            ", which is not aligned to " + std::to_string(alignment_) + " bytes");
  }
  Slab slab{memory, bytes, next_range_offset_, 0};
  Status s = ranges_.add_free(slab.range_offset, bytes);
  if (!s) {
    allocator_.free(memory, bytes);
    return s.with_context(kWho);
  }
  next_range_offset_ += bytes + alignment_;
  reserved_ += bytes;
  by_range_.emplace(slab.range_offset, address);
  slabs_.emplace(address, slab);
  return Status::ok();
}

Result<void*> HostPool::allocate(size_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  auto fail = [&]() -> Result<void*> {
    return Status::out_of_memory(
        out_of_memory_message(kWho, bytes, ranges_.in_use(), largest_free_block_locked(), budget_));
  };
  if (bytes > budget_) return fail();
  uint64_t b = std::max<uint64_t>(bytes, 1);
  uint64_t need = b + (alignment_ - b % alignment_) % alignment_;
  if (need > budget_) return fail();

  auto offset = ranges_.allocate(need);
  if (!offset) {
    if (budget_ - reserved_ < need) release_empty_slabs_locked();
    if (budget_ - reserved_ < need) return fail();
    size_t slab = std::max<size_t>(slab_bytes_, need);
    slab = std::max<size_t>(align_down(std::min<size_t>(slab, budget_ - reserved_), alignment_), need);
    SPILLWAY_RETURN_IF_ERROR(add_slab(slab));
    offset = ranges_.allocate(need);
    if (!offset) return Status::internal("host pool: a new slab of " + format_size(slab) + " did not hold " +
                                         format_size(need));
  }
  auto it = std::prev(by_range_.upper_bound(*offset));
  Slab& slab = slabs_.at(it->second);
  slab.in_use += need;
  return static_cast<void*>(static_cast<char*>(slab.memory) + (*offset - slab.range_offset));
}

Status HostPool::free(void* p) {
  if (p == nullptr) return Status::ok();
  std::lock_guard<std::mutex> lock(mu_);
  auto address = reinterpret_cast<uintptr_t>(p);
  auto it = slabs_.upper_bound(address);
  if (it == slabs_.begin() || address - std::prev(it)->first >= std::prev(it)->second.bytes) {
    return Status::invalid_argument("host pool: free of " + pointer_text(p) + ", which is not in the pool");
  }
  Slab& slab = std::prev(it)->second;
  uint64_t offset = slab.range_offset + (address - std::prev(it)->first);
  auto bytes = ranges_.block_bytes(offset);
  if (!bytes) {
    return Status::invalid_argument("host pool: free of " + pointer_text(p) + ", which is not an allocated block");
  }
  SPILLWAY_RETURN_IF_ERROR(ranges_.free(offset).with_context(kWho));
  slab.in_use -= *bytes;
  return Status::ok();
}

void HostPool::release_empty_slabs() {
  std::lock_guard<std::mutex> lock(mu_);
  release_empty_slabs_locked();
}

void HostPool::release_empty_slabs_locked() {
  for (auto it = slabs_.begin(); it != slabs_.end();) {
    Slab& slab = it->second;
    if (slab.in_use != 0 || !ranges_.remove_free(slab.range_offset, slab.bytes)) {
      ++it;
      continue;
    }
    allocator_.free(slab.memory, slab.bytes);
    reserved_ -= slab.bytes;
    by_range_.erase(slab.range_offset);
    it = slabs_.erase(it);
  }
}

size_t HostPool::largest_free_block_locked() const {
  size_t held_by_busy_slabs = 0;
  for (const auto& [address, slab] : slabs_) {
    if (slab.in_use != 0) held_by_busy_slabs += slab.bytes;
  }
  size_t from_new_slab = align_down(budget_ - held_by_busy_slabs, alignment_);
  return std::max<size_t>(ranges_.largest_free_block(), from_new_slab);
}

size_t HostPool::in_use() const {
  std::lock_guard<std::mutex> lock(mu_);
  return ranges_.in_use();
}

size_t HostPool::peak() const {
  std::lock_guard<std::mutex> lock(mu_);
  return ranges_.peak();
}

size_t HostPool::reserved() const {
  std::lock_guard<std::mutex> lock(mu_);
  return reserved_;
}

size_t HostPool::largest_free_block() const {
  std::lock_guard<std::mutex> lock(mu_);
  return largest_free_block_locked();
}

size_t HostPool::slab_count() const {
  std::lock_guard<std::mutex> lock(mu_);
  return slabs_.size();
}

void HostPool::reset_peak() {
  std::lock_guard<std::mutex> lock(mu_);
  ranges_.reset_peak();
}

}  // namespace spillway
