#include "memory/range_allocator.h"

#include <algorithm>
#include <iterator>

#include "core/size.h"

namespace spillway {

std::string out_of_memory_message(std::string_view who, uint64_t asked, uint64_t in_use,
                                  uint64_t largest_free, uint64_t budget) {
  return std::string(who) + ": cannot allocate " + format_size(asked) + ": " + format_size(in_use) +
         " in use, largest free block " + format_size(largest_free) + ", budget " + format_size(budget);
}

namespace {
std::string range_text(uint64_t offset, uint64_t bytes) {
  return "[" + std::to_string(offset) + ", " + std::to_string(offset + bytes) + ")";
}
}  // namespace

RangeAllocator::RangeAllocator(uint64_t capacity, uint64_t alignment, bool start_free)
    : capacity_(capacity), alignment_(alignment == 0 ? 1 : alignment) {
  if (start_free && capacity_ > 0) insert_free(0, capacity_);
}

uint64_t RangeAllocator::footprint(uint64_t offset, uint64_t bytes) const {
  if (offset >= capacity_) return std::max<uint64_t>(bytes, 1);
  uint64_t room = capacity_ - offset;
  if (bytes > room) return bytes;  // does not fit; callers check
  uint64_t b = std::max<uint64_t>(bytes, 1);
  uint64_t rounded = b + (alignment_ - b % alignment_) % alignment_;  // no overflow: b <= capacity
  if (rounded < b) return room;
  return std::min(rounded, room);
}

uint64_t RangeAllocator::largest_free_block() const {
  return free_by_size_.empty() ? 0 : free_by_size_.rbegin()->first;
}

Result<uint64_t> RangeAllocator::allocate(uint64_t bytes) {
  auto fail = [&]() -> Result<uint64_t> {
    return Status::out_of_memory(
        out_of_memory_message("range allocator", bytes, in_use_, largest_free_block(), capacity_));
  };
  if (bytes > capacity_) return fail();
  uint64_t b = std::max<uint64_t>(bytes, 1);
  uint64_t need = b + (alignment_ - b % alignment_) % alignment_;
  if (need < b) return fail();
  uint64_t offset = 0, take = 0;
  bool found = false;
  // A free block that ends at an unaligned capacity holds a request smaller than
  // its rounded size; it is smaller than any block that holds `need`, so it is the
  // best fit when it holds the request at all.
  if (!free_by_offset_.empty()) {
    auto last = std::prev(free_by_offset_.end());
    if (last->first + last->second == capacity_ && last->second >= b && last->second < need) {
      offset = last->first;
      take = last->second;
      found = true;
    }
  }
  if (!found) {
    auto it = free_by_size_.lower_bound({need, 0});
    if (it == free_by_size_.end()) return fail();
    offset = it->second;
    take = need;
  }
  if (!carve(offset, take)) return Status::internal("range allocator: free index out of step at offset " + std::to_string(offset));
  used_.emplace(offset, take);
  in_use_ += take;
  peak_ = std::max(peak_, in_use_);
  return offset;
}

std::string RangeAllocator::occupied_overlap(uint64_t offset, uint64_t bytes) const {
  auto it = used_.lower_bound(offset + bytes);
  while (it != used_.begin()) {
    --it;
    if (it->first + it->second <= offset) break;
    if (it->first < offset + bytes) return range_text(it->first, it->second);
  }
  return "";
}

Status RangeAllocator::reserve(uint64_t offset, uint64_t bytes) {
  if (offset % alignment_ != 0) {
    return Status::invalid_argument("offset " + std::to_string(offset) + " is not a multiple of the alignment " +
                                    std::to_string(alignment_));
  }
  if (offset > capacity_ || bytes > capacity_ - offset) {
    return Status::invalid_argument("block at offset " + std::to_string(offset) + " of " + std::to_string(bytes) +
                                    " bytes ends at " + std::to_string(offset + bytes) + ", past the capacity " +
                                    std::to_string(capacity_));
  }
  uint64_t take = footprint(offset, bytes);
  if (!carve(offset, take)) {
    std::string other = occupied_overlap(offset, take);
    return Status::invalid_argument("block " + range_text(offset, take) +
                                    (other.empty() ? std::string(" is not free")
                                                   : " overlaps the occupied block " + other));
  }
  used_.emplace(offset, take);
  in_use_ += take;
  peak_ = std::max(peak_, in_use_);
  return Status::ok();
}

Status RangeAllocator::free(uint64_t offset) {
  auto it = used_.find(offset);
  if (it == used_.end()) {
    return Status::invalid_argument("no allocated block starts at offset " + std::to_string(offset));
  }
  uint64_t bytes = it->second;
  used_.erase(it);
  in_use_ -= bytes;
  insert_free(offset, bytes);
  return Status::ok();
}

Status RangeAllocator::add_free(uint64_t offset, uint64_t bytes) {
  if (bytes == 0) return Status::invalid_argument("cannot add an empty range at offset " + std::to_string(offset));
  if (offset > capacity_ || bytes > capacity_ - offset) {
    return Status::invalid_argument("range " + range_text(offset, bytes) + " passes the capacity " +
                                    std::to_string(capacity_));
  }
  uint64_t end = offset + bytes;
  if (offset % alignment_ != 0 || (end % alignment_ != 0 && end != capacity_)) {
    return Status::invalid_argument("range " + range_text(offset, bytes) + " is not aligned to " +
                                    std::to_string(alignment_));
  }
  std::string other = occupied_overlap(offset, bytes);
  if (!other.empty()) {
    return Status::invalid_argument("range " + range_text(offset, bytes) + " overlaps the occupied block " + other);
  }
  auto next = free_by_offset_.lower_bound(offset);
  bool overlaps_free = (next != free_by_offset_.end() && next->first < end) ||
                       (next != free_by_offset_.begin() && std::prev(next)->first + std::prev(next)->second > offset);
  if (overlaps_free) {
    return Status::invalid_argument("range " + range_text(offset, bytes) + " overlaps free space");
  }
  insert_free(offset, bytes);
  return Status::ok();
}

Status RangeAllocator::remove_free(uint64_t offset, uint64_t bytes) {
  if (bytes == 0) return Status::ok();
  if (offset > capacity_ || bytes > capacity_ - offset || !carve(offset, bytes)) {
    return Status::invalid_argument("range " + range_text(offset, bytes) + " is not wholly free");
  }
  return Status::ok();
}

std::optional<uint64_t> RangeAllocator::block_bytes(uint64_t offset) const {
  auto it = used_.find(offset);
  if (it == used_.end()) return std::nullopt;
  return it->second;
}

bool RangeAllocator::carve(uint64_t offset, uint64_t bytes) {
  auto it = free_by_offset_.upper_bound(offset);
  if (it == free_by_offset_.begin()) return false;
  --it;
  uint64_t start = it->first, size = it->second;
  if (offset + bytes > start + size) return false;
  erase_free(it);
  if (offset > start) insert_free(start, offset - start);
  if (offset + bytes < start + size) insert_free(offset + bytes, start + size - (offset + bytes));
  return true;
}

void RangeAllocator::erase_free(std::map<uint64_t, uint64_t>::iterator it) {
  free_by_size_.erase({it->second, it->first});
  free_bytes_ -= it->second;
  free_by_offset_.erase(it);
}

void RangeAllocator::insert_free(uint64_t offset, uint64_t bytes) {
  auto next = free_by_offset_.lower_bound(offset);
  if (next != free_by_offset_.end() && next->first == offset + bytes) {
    bytes += next->second;
    auto after = std::next(next);
    erase_free(next);
    next = after;
  }
  if (next != free_by_offset_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == offset) {
      offset = prev->first;
      bytes += prev->second;
      erase_free(prev);
    }
  }
  free_by_offset_.emplace(offset, bytes);
  free_by_size_.emplace(bytes, offset);
  free_bytes_ += bytes;
}

Status RangeAllocator::validate() const {
  auto bad = [](std::string m) { return Status::internal("range allocator: " + m); };
  if (free_by_offset_.size() != free_by_size_.size()) return bad("free indexes differ in size");
  uint64_t free_sum = 0, prev_end = 0;
  bool first = true;
  for (const auto& [offset, bytes] : free_by_offset_) {
    if (bytes == 0) return bad("empty free block at " + std::to_string(offset));
    if (offset % alignment_ != 0) return bad("unaligned free block at " + std::to_string(offset));
    if (offset + bytes > capacity_) return bad("free block " + range_text(offset, bytes) + " passes capacity");
    if (!first && offset <= prev_end) {
      return bad("free block at " + std::to_string(offset) + (offset == prev_end ? " not coalesced" : " overlaps"));
    }
    if (!free_by_size_.count({bytes, offset})) return bad("size index lacks " + range_text(offset, bytes));
    if (!occupied_overlap(offset, bytes).empty()) return bad("free block " + range_text(offset, bytes) + " is occupied");
    free_sum += bytes;
    prev_end = offset + bytes;
    first = false;
  }
  if (free_sum != free_bytes_) return bad("free byte count out of step");
  uint64_t used_sum = 0, used_end = 0;
  for (const auto& [offset, bytes] : used_) {
    if (offset < used_end) return bad("occupied blocks overlap at " + std::to_string(offset));
    if (offset % alignment_ != 0) return bad("unaligned occupied block at " + std::to_string(offset));
    if (offset + bytes > capacity_) return bad("occupied block " + range_text(offset, bytes) + " passes capacity");
    used_sum += bytes;
    used_end = offset + bytes;
  }
  if (used_sum != in_use_) return bad("in-use byte count out of step");
  if (peak_ < in_use_) return bad("peak below in-use");
  return Status::ok();
}

}  // namespace spillway
