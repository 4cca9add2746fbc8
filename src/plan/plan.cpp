#include "plan/plan.h"

#include <algorithm>
#include <functional>
#include <map>

#include "core/size.h"

namespace spillway {

const char* instr_kind_name(InstrKind k) {
  switch (k) {
    case InstrKind::Run: return "run";
    case InstrKind::Allocate: return "allocate";
    case InstrKind::Fetch: return "fetch";
    case InstrKind::Evict: return "evict";
    case InstrKind::Flush: return "flush";
    case InstrKind::Release: return "release";
    case InstrKind::HostAllocate: return "host-allocate";
    case InstrKind::Load: return "load";
    case InstrKind::Store: return "store";
    case InstrKind::HostRelease: return "host-release";
  }
  return "?";
}

const char* policy_name(Policy p) {
  switch (p) {
    case Policy::Resident: return "resident";
    case Policy::Paging: return "paging";
    case Policy::Planned: return "planned";
    case Policy::Auto: return "auto";
  }
  return "?";
}

Result<Policy> parse_policy(const std::string& name) {
  if (name == "resident") return Policy::Resident;
  if (name == "paging") return Policy::Paging;
  if (name == "planned") return Policy::Planned;
  if (name == "auto") return Policy::Auto;
  return Status::invalid_argument("--policy: unknown policy '" + name +
                                  "'; expected one of resident, paging, planned, auto");
}

namespace {

// Placements in one arena, rounded exactly as the executor's arenas round them
// (RangeAllocator::footprint): a block takes its size rounded up to the alignment,
// cut off at the end of the arena.
class ArenaModel {
 public:
  ArenaModel(const char* what, uint64_t capacity, uint64_t alignment)
      : what_(what), capacity_(capacity), alignment_(alignment) {}

  Status place(TensorId t, const std::string& name, uint64_t offset, uint64_t bytes, const std::string& where,
               const std::function<std::string(TensorId)>& name_of) {
    const uint64_t b = std::max<uint64_t>(bytes, 1);
    if (offset % alignment_)
      return Status::internal(where + ": " + what_ + " offset " + std::to_string(offset) + " of " + name +
                              " is not a multiple of " + std::to_string(alignment_));
    if (offset > capacity_ || b > capacity_ - offset)
      return Status::internal(where + ": " + name + " at " + what_ + " offset " + std::to_string(offset) + " (" +
                              std::to_string(b) + " bytes) ends past the " + what_ + " arena of " +
                              std::to_string(capacity_) + " bytes");
    const uint64_t end = offset + std::min(align_up(b, alignment_), capacity_ - offset);
    auto it = blocks_.lower_bound(offset);
    if (it != blocks_.end() && it->first < end)
      return Status::internal(where + ": " + name + " at " + what_ + " bytes [" + std::to_string(offset) + ", " +
                              std::to_string(end) + ") overlaps " + name_of(it->second.second) + " at [" +
                              std::to_string(it->first) + ", " + std::to_string(it->second.first) + ")");
    if (it != blocks_.begin()) {
      auto prev = std::prev(it);
      if (prev->second.first > offset)
        return Status::internal(where + ": " + name + " at " + what_ + " bytes [" + std::to_string(offset) + ", " +
                                std::to_string(end) + ") overlaps " + name_of(prev->second.second) + " at [" +
                                std::to_string(prev->first) + ", " + std::to_string(prev->second.first) + ")");
    }
    blocks_[offset] = {end, t};
    at_[t] = offset;
    used_ += end - offset;
    peak_ = std::max(peak_, used_);
    return Status::ok();
  }
  bool holds(TensorId t) const { return at_.count(t) > 0; }
  uint64_t offset_of(TensorId t) const { return at_.at(t); }
  void release(TensorId t) {
    auto a = at_.find(t);
    if (a == at_.end()) return;
    auto b = blocks_.find(a->second);
    used_ -= b->second.first - b->first;
    blocks_.erase(b);
    at_.erase(a);
  }
  uint64_t peak() const { return peak_; }

 private:
  const char* what_;
  uint64_t capacity_, alignment_;
  std::map<uint64_t, std::pair<uint64_t, TensorId>> blocks_;  // offset -> (end, tensor)
  std::map<TensorId, uint64_t> at_;                           // tensor -> offset
  uint64_t used_ = 0, peak_ = 0;
};

}  // namespace

// A dry run of the instruction semantics of plan.h over residency flags, value
// versions and the executor's arenas: catches every plan bug before the executor
// touches memory.
//
// Value versions: every write of a tensor by an op makes a new version. A device
// copy, host copy or storage copy is valid when it holds the newest version. A
// recompute (Run with `recompute`) re-runs an op to regenerate values it wrote; it
// is legal only when every tensor it writes is still at the version that op wrote
// (nothing wrote it since) and every tensor it reads is at the version it read then.
Status Plan::validate(const Program& program, const Budgets& budgets) const {
  const size_t n = program.tensors.size();
  if (home.size() != n || home_offset.size() != n)
    return Status::internal("plan: home tables have " + std::to_string(home.size()) + " entries for " +
                            std::to_string(n) + " tensors");
  if (alignment == 0 || (alignment & (alignment - 1)) != 0)
    return Status::internal("plan: device alignment " + std::to_string(alignment) + " is not a power of two");
  if (!op_place.empty() && op_place.size() != program.ops.size())
    return Status::internal("plan: op_place has " + std::to_string(op_place.size()) + " entries for " +
                            std::to_string(program.ops.size()) + " ops");
  // The executor's arenas: exactly these sizes, one allocation each.
  const uint64_t device_arena = std::max<uint64_t>(device_bytes, alignment);
  const uint64_t host_arena = std::max<uint64_t>(align_up(host_bytes, 4096), 4096);
  if (device_arena > budgets.device)
    return Status::internal("plan: device arena " + format_size(device_arena) + " exceeds the device budget " +
                            format_size(budgets.device));
  if (host_arena > budgets.host)
    return Status::internal("plan: host arena " + format_size(host_arena) + " exceeds the host budget " +
                            format_size(budgets.host));
  std::vector<bool> on_device(n, false), on_host(n, false), in_storage(n, false);
  auto name = [&](TensorId t) { return program.tensors.info(t).name; };
  auto bytes = [&](TensorId t) { return program.tensors.info(t).bytes(); };
  ArenaModel device("device", device_arena, alignment), host("host", host_arena, 4096);
  auto device_region = [&](TensorId t) { return device.holds(t); };
  // Storage extents: 4096-aligned, one per tensor, kept for the run (StorageStore).
  const uint64_t storage_capacity = budgets.storage / 4096 * 4096;
  std::vector<bool> storage_extent(n, false);
  uint64_t storage_used = 0;
  auto add_extent = [&](TensorId t, const std::string& where) -> Status {
    if (storage_extent[t]) return Status::ok();
    storage_extent[t] = true;
    storage_used += align_up(std::max<uint64_t>(bytes(t), 1), 4096);
    if (storage_used > storage_capacity)
      return Status::internal(where + ": storage extents reach " + format_size(storage_used) + " with " + name(t) +
                              ", past the storage budget " + format_size(budgets.storage));
    return Status::ok();
  };
  // Start-of-step state: persistent tensors at home.
  for (size_t i = 0; i < n; ++i) {
    auto t = static_cast<TensorId>(i);
    if (!program.is_persistent(t)) continue;
    const std::string where = "plan: home of " + name(t);
    switch (home[i]) {
      case Tier::Device:
        SPILLWAY_RETURN_IF_ERROR(device.place(t, name(t), home_offset[i], bytes(t), where, name));
        on_device[i] = true;
        break;
      case Tier::Host:
        if (home_host_offset.size() != n) return Status::internal(where + ": no host offset table");
        SPILLWAY_RETURN_IF_ERROR(host.place(t, name(t), home_host_offset[i], bytes(t), where, name));
        on_host[i] = true;
        break;
      case Tier::Storage:
        SPILLWAY_RETURN_IF_ERROR(add_extent(t, where));
        in_storage[i] = true;
        break;
    }
  }
  auto mirror = [&](size_t i) { return i < host_mirror.size() && host_mirror[i]; };
  for (size_t i = 0; i < n; ++i) {
    if (!mirror(i)) continue;
    auto t = static_cast<TensorId>(i);
    const std::string where = "plan: host mirror of " + name(t);
    if (program.is_persistent(t) && home[i] != Tier::Device)
      return Status::internal(where + ": it rests on " + tier_name(home[i]) + ", not on device");
    if (home_host_offset.size() != n) return Status::internal(where + ": no host offset table");
    SPILLWAY_RETURN_IF_ERROR(host.place(t, name(t), home_host_offset[i], bytes(t), where, name));
  }
  // Versions: [tensors] newest version and the op that wrote it; [ops] the versions
  // of each operand before (read) and after (written) the op's run.
  std::vector<uint64_t> version(n, 0);
  std::vector<int> written_by(n, -1);
  std::vector<std::vector<uint64_t>> read_version(program.ops.size()), wrote_version(program.ops.size());
  auto writer_name = [&](TensorId t) {
    return written_by[t] < 0 ? std::string("before the step") : "by " + program.ops[written_by[t]].name;
  };
  std::vector<int> runs(program.ops.size(), 0);
  for (size_t at = 0; at < instructions.size(); ++at) {
    const Instruction& in = instructions[at];
    auto where = "plan: instruction " + std::to_string(at) + " (" + instr_kind_name(in.kind) + ")";
    if (in.kind == InstrKind::Run) {
      if (in.op < 0 || static_cast<size_t>(in.op) >= program.ops.size()) return Status::internal(where + ": bad op index");
      const Op& op = program.ops[in.op];
      const Place place = op_place.empty() ? op.place : op_place[in.op];
      for (const Operand& o : op.operands) {
        TensorId t = o.tensor;
        if (place == Place::Device) {
          if (o.access == Access::Write ? !device_region(t) : !on_device[t])
            return Status::internal(where + ": op " + op.name + " needs " + name(t) + " on device");
        } else {
          if (!host.holds(t)) return Status::internal(where + ": host op " + op.name + " needs a host buffer for " + name(t));
          if (o.access != Access::Write && !on_host[t])
            return Status::internal(where + ": host op " + op.name + " needs " + name(t) + " on host");
          if (o.access != Access::Read && device_region(t))
            return Status::internal(where + ": host op " + op.name + " writes " + name(t) +
                                    " while it still holds a device region (release it first)");
        }
      }
      if (in.recompute) {
        if (runs[in.op] == 0)
          return Status::internal(where + ": recompute of op " + op.name + " before the op has run in this step");
        for (size_t k = 0; k < op.operands.size(); ++k) {
          const TensorId t = op.operands[k].tensor;
          if (op.operands[k].access != Access::Write && version[t] != read_version[in.op][k])
            return Status::internal(where + ": recompute of op " + op.name + " reads " + name(t) + " at version " +
                                    std::to_string(version[t]) + " (written " + writer_name(t) + "), but " + op.name +
                                    " read version " + std::to_string(read_version[in.op][k]) +
                                    ": the re-run would not reproduce its outputs");
          if (op.operands[k].access != Access::Read && (written_by[t] != in.op || version[t] != wrote_version[in.op][k]))
            return Status::internal(where + ": recompute of op " + op.name + " overwrites " + name(t) + " version " +
                                    std::to_string(version[t]) + " (written " + writer_name(t) + ") with version " +
                                    std::to_string(wrote_version[in.op][k]) + ", the value " + op.name + " wrote");
        }
      } else {
        runs[in.op]++;
        read_version[in.op].assign(op.operands.size(), 0);
        wrote_version[in.op].assign(op.operands.size(), 0);
        for (size_t k = 0; k < op.operands.size(); ++k) read_version[in.op][k] = version[op.operands[k].tensor];
        for (size_t k = 0; k < op.operands.size(); ++k) {
          const TensorId t = op.operands[k].tensor;
          if (op.operands[k].access == Access::Read) continue;
          version[t]++;
          written_by[t] = in.op;
          wrote_version[in.op][k] = version[t];
        }
      }
      // The newest value (the same version again, for a recompute) is where the op ran.
      for (const Operand& o : op.operands) {
        if (o.access == Access::Read) continue;
        TensorId t = o.tensor;
        on_device[t] = place == Place::Device;
        on_host[t] = place == Place::Host;
        in_storage[t] = false;
      }
      continue;
    }
    TensorId t = in.tensor;
    if (t < 0 || static_cast<size_t>(t) >= n) return Status::internal(where + ": bad tensor id");
    switch (in.kind) {
      case InstrKind::Allocate:
        SPILLWAY_RETURN_IF_ERROR(device.place(t, name(t), in.offset, bytes(t), where, name));
        break;
      case InstrKind::Fetch:
        if (!on_host[t]) return Status::internal(where + ": fetch of " + name(t) + " which is not valid on host");
        SPILLWAY_RETURN_IF_ERROR(device.place(t, name(t), in.offset, bytes(t), where, name));
        on_device[t] = true;
        break;
      case InstrKind::Evict:
        if (!device_region(t)) return Status::internal(where + ": evict of " + name(t) + " which has no device region");
        if (in.write_back) {
          if (!on_device[t]) return Status::internal(where + ": write-back of " + name(t) + " which is not valid on device");
          if (!host.holds(t)) return Status::internal(where + ": write-back of " + name(t) + " without a host buffer");
          on_host[t] = true;
        } else if (!on_host[t] && !in_storage[t]) {
          return Status::internal(where + ": evict without write-back of " + name(t) + " whose only copy is on device");
        }
        device.release(t);
        on_device[t] = false;
        break;
      case InstrKind::Flush:
        if (!on_device[t]) return Status::internal(where + ": flush of " + name(t) + " which is not valid on device");
        if (!host.holds(t)) return Status::internal(where + ": flush of " + name(t) + " without a host buffer");
        on_host[t] = true;
        break;
      case InstrKind::Release:
        if (!device_region(t)) return Status::internal(where + ": release of " + name(t) + " which has no device region");
        device.release(t);
        on_device[t] = false;
        break;
      case InstrKind::HostAllocate:
        if (host.holds(t)) return Status::internal(where + ": " + name(t) + " already has a host buffer");
        SPILLWAY_RETURN_IF_ERROR(host.place(t, name(t), in.offset, bytes(t), where, name));
        break;
      case InstrKind::Load:
        if (!in_storage[t]) return Status::internal(where + ": load of " + name(t) + " which is not in storage");
        if (!host.holds(t)) return Status::internal(where + ": load of " + name(t) + " without a host buffer");
        on_host[t] = true;
        break;
      case InstrKind::Store:
        if (!on_host[t]) return Status::internal(where + ": store of " + name(t) + " which is not valid on host");
        SPILLWAY_RETURN_IF_ERROR(add_extent(t, where));
        in_storage[t] = true;
        if (in.free_host) {
          host.release(t);
          on_host[t] = false;
        }
        break;
      case InstrKind::HostRelease:
        if (!host.holds(t)) return Status::internal(where + ": host release of " + name(t) + " which has no host buffer");
        if (mirror(static_cast<size_t>(t))) return Status::internal(where + ": host release of the host mirror of " + name(t));
        host.release(t);
        on_host[t] = false;
        break;
      case InstrKind::Run: break;
    }
  }
  for (size_t i = 0; i < runs.size(); ++i)
    if (runs[i] != 1)
      return Status::internal("plan: op " + program.ops[i].name + " runs " + std::to_string(runs[i]) + " times in a step");
  for (size_t i = 0; i < n; ++i) {
    auto t = static_cast<TensorId>(i);
    const bool persistent = program.is_persistent(t);
    const bool host_home = persistent && home[i] == Tier::Host;
    if (mirror(i)) {
      if (!host.holds(t) || host.offset_of(t) != home_host_offset[i])
        return Status::internal("plan: the host mirror of " + name(t) + " left its buffer during the step");
    } else if (host.holds(t) && !host_home) {
      return Status::internal("plan: " + name(t) + " still holds a host buffer at the end of the step");
    }
    if (host_home && (!host.holds(t) || host.offset_of(t) != home_host_offset[i]))
      return Status::internal("plan: " + name(t) + " does not end the step in its home host buffer");
    if (!persistent) {
      if (device_region(t)) return Status::internal("plan: " + name(t) + " still holds a device region at the end of the step");
      continue;
    }
    bool ok = home[i] == Tier::Device ? on_device[i] && device_region(t) && device.offset_of(t) == home_offset[i]
              : home[i] == Tier::Host ? on_host[i] && !device_region(t)
                                      : in_storage[i] && !device_region(t);
    if (!ok) return Status::internal("plan: " + name(t) + " does not end the step valid in its home (" + tier_name(home[i]) + ")");
  }
  if (device.peak() > budgets.device)
    return Status::internal("plan: device peak " + format_size(device.peak()) + " exceeds the budget " + format_size(budgets.device));
  if (host.peak() > budgets.host)
    return Status::internal("plan: host peak " + format_size(host.peak()) + " exceeds the budget " + format_size(budgets.host));
  return Status::ok();
}

Program placed_as_planned(const Program& program, const Plan& plan) {
  Program placed = program;
  for (size_t i = 0; i < placed.ops.size() && i < plan.op_place.size(); ++i) placed.ops[i].place = plan.op_place[i];
  return placed;
}

}  // namespace spillway
