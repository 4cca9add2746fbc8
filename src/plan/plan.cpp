#include "plan/plan.h"

#include <algorithm>
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
}  // namespace

// A dry run of the instruction semantics of plan.h over residency flags and byte
// counts: catches every plan bug before the executor touches memory.
Status Plan::validate(const Program& program, const Budgets& budgets) const {
  const size_t n = program.tensors.size();
  if (home.size() != n || home_offset.size() != n)
    return Status::internal("plan: home tables have " + std::to_string(home.size()) + " entries for " +
                            std::to_string(n) + " tensors");
  std::vector<bool> on_device(n, false), on_host(n, false), in_storage(n, false), host_buffer(n, false);
  std::vector<uint64_t> offset(n, 0);
  std::map<uint64_t, std::pair<uint64_t, TensorId>> regions;  // offset -> (end, tensor)
  uint64_t device_used = 0, host_used = 0, storage_used = 0, device_peak = 0, host_peak = 0, storage_peak = 0;
  auto bytes = [&](TensorId t) { return align_up(program.tensors.info(t).bytes(), alignment); };
  auto name = [&](TensorId t) { return program.tensors.info(t).name; };
  auto place = [&](TensorId t, uint64_t off, size_t at) -> Status {
    if (off % alignment) return Status::internal("plan: instruction " + std::to_string(at) + ": offset of " + name(t) + " not aligned");
    uint64_t end = off + bytes(t);
    if (end > budgets.device)
      return Status::internal("plan: instruction " + std::to_string(at) + ": " + name(t) + " placed past the device budget");
    auto it = regions.lower_bound(off);
    if (it != regions.end() && it->first < end)
      return Status::internal("plan: instruction " + std::to_string(at) + ": " + name(t) + " overlaps " + name(it->second.second));
    if (it != regions.begin()) {
      auto prev = std::prev(it);
      if (prev->second.first > off)
        return Status::internal("plan: instruction " + std::to_string(at) + ": " + name(t) + " overlaps " + name(prev->second.second));
    }
    regions[off] = {end, t};
    offset[t] = off;
    device_used += bytes(t);
    device_peak = std::max(device_peak, device_used);
    return Status::ok();
  };
  auto unplace = [&](TensorId t) {
    regions.erase(offset[t]);
    device_used -= bytes(t);
    on_device[t] = false;
  };
  auto host_alloc = [&](TensorId t) {
    if (!host_buffer[t]) {
      host_buffer[t] = true;
      host_used += program.tensors.info(t).bytes();
      host_peak = std::max(host_peak, host_used);
    }
  };
  // Start-of-step state: persistent tensors at home.
  std::vector<bool> storage_extent(n, false);
  for (size_t t = 0; t < n; ++t) {
    if (!program.is_persistent(static_cast<TensorId>(t))) continue;
    switch (home[t]) {
      case Tier::Device:
        SPILLWAY_RETURN_IF_ERROR(place(static_cast<TensorId>(t), home_offset[t], 0));
        on_device[t] = true;
        break;
      case Tier::Host:
        host_alloc(static_cast<TensorId>(t));
        on_host[t] = true;
        break;
      case Tier::Storage:
        in_storage[t] = true;
        break;
    }
    if (home[t] == Tier::Storage) {
      storage_extent[t] = true;
      storage_used += program.tensors.info(t).bytes();
    }
  }
  storage_peak = storage_used;
  std::vector<int> runs(program.ops.size(), 0);
  for (size_t at = 0; at < instructions.size(); ++at) {
    const Instruction& in = instructions[at];
    auto where = "plan: instruction " + std::to_string(at) + " (" + instr_kind_name(in.kind) + ")";
    if (in.kind == InstrKind::Run) {
      if (in.op < 0 || static_cast<size_t>(in.op) >= program.ops.size()) return Status::internal(where + ": bad op index");
      const Op& op = program.ops[in.op];
      const Place place = op_place.size() == program.ops.size() ? op_place[in.op] : op.place;
      if (!in.recompute) runs[in.op]++;
      for (const Operand& o : op.operands) {
        TensorId t = o.tensor;
        if (place == Place::Device) {
          if (o.access == Access::Write ? !regions.count(offset[t]) || regions[offset[t]].second != t
                                        : !on_device[t])
            return Status::internal(where + ": op " + op.name + " needs " + name(t) + " on device");
        } else {
          if (o.access != Access::Write && !on_host[t])
            return Status::internal(where + ": host op " + op.name + " needs " + name(t) + " on host");
          if (o.access == Access::Write) host_alloc(t);
        }
      }
      for (const Operand& o : op.operands) {
        if (o.access == Access::Read) continue;
        TensorId t = o.tensor;
        if (place == Place::Device) {
          on_device[t] = true;
          on_host[t] = false;
        } else {
          if (regions.count(offset[t]) && regions[offset[t]].second == t)
            return Status::internal(where + ": host op " + op.name + " writes " + name(t) +
                                    " while it still holds a device region (release it first)");
          on_host[t] = true;
          on_device[t] = false;
        }
        in_storage[t] = false;
      }
      continue;
    }
    TensorId t = in.tensor;
    if (t < 0 || static_cast<size_t>(t) >= n) return Status::internal(where + ": bad tensor id");
    switch (in.kind) {
      case InstrKind::Allocate:
        SPILLWAY_RETURN_IF_ERROR(place(t, in.offset, at));
        break;
      case InstrKind::Fetch:
        if (!on_host[t]) return Status::internal(where + ": fetch of " + name(t) + " which is not valid on host");
        SPILLWAY_RETURN_IF_ERROR(place(t, in.offset, at));
        on_device[t] = true;
        break;
      case InstrKind::Evict:
        if (!regions.count(offset[t]) || regions[offset[t]].second != t)
          return Status::internal(where + ": evict of " + name(t) + " which has no device region");
        if (in.write_back) {
          if (!on_device[t]) return Status::internal(where + ": write-back of " + name(t) + " which is not valid on device");
          host_alloc(t);
          on_host[t] = true;
        } else if (!on_host[t] && !in_storage[t]) {
          return Status::internal(where + ": evict without write-back of " + name(t) + " whose only copy is on device");
        }
        unplace(t);
        break;
      case InstrKind::Flush:
        if (!on_device[t]) return Status::internal(where + ": flush of " + name(t) + " which is not valid on device");
        host_alloc(t);
        on_host[t] = true;
        break;
      case InstrKind::Release:
        if (!regions.count(offset[t]) || regions[offset[t]].second != t)
          return Status::internal(where + ": release of " + name(t) + " which has no device region");
        unplace(t);
        break;
      case InstrKind::HostAllocate:
        if (host_buffer[t]) return Status::internal(where + ": " + name(t) + " already has a host buffer");
        host_alloc(t);
        break;
      case InstrKind::Load:
        if (!in_storage[t]) return Status::internal(where + ": load of " + name(t) + " which is not in storage");
        host_alloc(t);
        on_host[t] = true;
        break;
      case InstrKind::Store:
        if (!on_host[t]) return Status::internal(where + ": store of " + name(t) + " which is not valid on host");
        if (!storage_extent[t]) {
          storage_extent[t] = true;
          storage_used += program.tensors.info(t).bytes();
          storage_peak = std::max(storage_peak, storage_used);
        }
        in_storage[t] = true;
        if (in.free_host) {
          host_buffer[t] = false;
          on_host[t] = false;
          host_used -= program.tensors.info(t).bytes();
        }
        break;
      case InstrKind::HostRelease:
        if (!host_buffer[t]) return Status::internal(where + ": host release of " + name(t) + " which has no host buffer");
        host_buffer[t] = false;
        on_host[t] = false;
        host_used -= program.tensors.info(t).bytes();
        break;
      case InstrKind::Run: break;
    }
  }
  for (size_t i = 0; i < runs.size(); ++i)
    if (runs[i] != 1)
      return Status::internal("plan: op " + program.ops[i].name + " runs " + std::to_string(runs[i]) + " times in a step");
  for (size_t t = 0; t < n; ++t) {
    bool host_home = program.is_persistent(static_cast<TensorId>(t)) && home[t] == Tier::Host;
    if (host_buffer[t] && !host_home)
      return Status::internal("plan: " + name(static_cast<TensorId>(t)) + " still holds a host buffer at the end of the step");
    if (!program.is_persistent(static_cast<TensorId>(t))) {
      if (on_device[t] && regions.count(offset[t]) && regions[offset[t]].second == static_cast<TensorId>(t))
        return Status::internal("plan: " + name(t) + " still holds a device region at the end of the step");
      continue;
    }
    bool ok = home[t] == Tier::Device ? on_device[t] && offset[t] == home_offset[t]
              : home[t] == Tier::Host ? on_host[t]
                                      : in_storage[t];
    if (!ok) return Status::internal("plan: " + name(t) + " does not end the step valid in its home (" + tier_name(home[t]) + ")");
  }
  if (device_peak > budgets.device)
    return Status::internal("plan: device peak " + format_size(device_peak) + " exceeds the budget " + format_size(budgets.device));
  if (host_peak > budgets.host)
    return Status::internal("plan: host peak " + format_size(host_peak) + " exceeds the budget " + format_size(budgets.host));
  if (storage_peak > 0 && storage_peak > budgets.storage)
    return Status::internal("plan: storage peak " + format_size(storage_peak) + " exceeds the budget " + format_size(budgets.storage));
  return Status::ok();
}

}  // namespace spillway
