#include "memory/device_arena.h"

#include <cstdio>
#include <string>

#include "core/size.h"

namespace spillway {

namespace {
constexpr const char* kWho = "device arena";

std::string pointer_text(const void* p) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%p", p);
  return buf;
}
}  // namespace

DeviceArena::DeviceArena(void* base, size_t budget, size_t alignment)
    : base_(base), budget_(budget), ranges_(budget, alignment) {}

size_t DeviceArena::alignment() const { return ranges_.alignment(); }

Status DeviceArena::check_base() const {
  if (base_ == nullptr && budget_ > 0) return Status::invalid_argument("device arena: base pointer is null");
  if (reinterpret_cast<uintptr_t>(base_) % ranges_.alignment() != 0) {
    return Status::invalid_argument("device arena: base " + pointer_text(base_) + " is not aligned to " +
                                    std::to_string(ranges_.alignment()) + " bytes");
  }
  return Status::ok();
}

bool DeviceArena::contains(const void* p) const {
  auto a = reinterpret_cast<uintptr_t>(p), b = reinterpret_cast<uintptr_t>(base_);
  return a >= b && a - b < budget_;
}

Result<void*> DeviceArena::place(size_t offset, size_t bytes) {
  SPILLWAY_RETURN_IF_ERROR(check_base());
  std::lock_guard<std::mutex> lock(mu_);
  if (offset > budget_ || bytes > budget_ - offset) {
    return Status::invalid_argument("device arena: planned tensor at offset " + std::to_string(offset) + " (" +
                                    format_size(bytes) + ") ends at byte " + std::to_string(offset + bytes) +
                                    ", past the budget of " + std::to_string(budget_) + " bytes (" +
                                    format_size(budget_) + ")");
  }
  Status s = ranges_.reserve(offset, bytes);
  if (!s) return s.with_context("device arena: planned tensor at offset " + std::to_string(offset) + " (" +
                                format_size(bytes) + ")");
  placed_.emplace(offset, bytes);
  return static_cast<void*>(static_cast<char*>(base_) + offset);
}

Status DeviceArena::release_placed(size_t offset, size_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = placed_.find(offset);
  if (it == placed_.end()) {
    return Status::invalid_argument("device arena: release of offset " + std::to_string(offset) +
                                    ", where nothing is placed");
  }
  if (it->second != bytes) {
    return Status::invalid_argument("device arena: release of " + std::to_string(bytes) + " bytes at offset " +
                                    std::to_string(offset) + ", but " + std::to_string(it->second) +
                                    " bytes were placed there");
  }
  SPILLWAY_RETURN_IF_ERROR(ranges_.free(offset).with_context(kWho));
  placed_.erase(it);
  return Status::ok();
}

Result<void*> DeviceArena::allocate(size_t bytes) {
  SPILLWAY_RETURN_IF_ERROR(check_base());
  std::lock_guard<std::mutex> lock(mu_);
  auto r = ranges_.allocate(bytes);
  if (!r) {
    return Status::out_of_memory(
        out_of_memory_message(kWho, bytes, ranges_.in_use(), ranges_.largest_free_block(), budget_));
  }
  return static_cast<void*>(static_cast<char*>(base_) + *r);
}

Status DeviceArena::free(void* p) {
  if (p == nullptr) return Status::ok();
  if (!contains(p)) {
    return Status::invalid_argument("device arena: free of " + pointer_text(p) + ", which is outside the arena");
  }
  size_t offset = static_cast<size_t>(static_cast<char*>(p) - static_cast<char*>(base_));
  std::lock_guard<std::mutex> lock(mu_);
  if (placed_.count(offset)) {
    return Status::invalid_argument("device arena: free of the planned tensor at offset " + std::to_string(offset) +
                                    "; end a placement with release_placed");
  }
  if (!ranges_.block_bytes(offset)) {
    return Status::invalid_argument("device arena: free of " + pointer_text(p) + " (offset " +
                                    std::to_string(offset) + "), which is not an allocated block");
  }
  return ranges_.free(offset).with_context(kWho);
}

size_t DeviceArena::in_use() const {
  std::lock_guard<std::mutex> lock(mu_);
  return ranges_.in_use();
}

size_t DeviceArena::peak() const {
  std::lock_guard<std::mutex> lock(mu_);
  return ranges_.peak();
}

size_t DeviceArena::largest_free_block() const {
  std::lock_guard<std::mutex> lock(mu_);
  return ranges_.largest_free_block();
}

void DeviceArena::reset_peak() {
  std::lock_guard<std::mutex> lock(mu_);
  ranges_.reset_peak();
}

}  // namespace spillway
