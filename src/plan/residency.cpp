#include "plan/residency.h"

#include <algorithm>

#include "core/size.h"

namespace spillway {

ResidencyMachine::ResidencyMachine(const Program& program, const Plan& tables, Capacities capacities)
    : program_(program),
      tables_(tables),
      cap_(capacities),
      state_(program.tensors.size()),
      device_("device", capacities.device, std::max<uint64_t>(tables.alignment, 1), capacities.track_placement),
      host_("host", capacities.host, 4096, capacities.track_placement),
      skippable_(program.ops.size(), false) {
  for (int32_t op : tables.carried)
    if (op >= 0 && static_cast<size_t>(op) < skippable_.size()) skippable_[static_cast<size_t>(op)] = true;
}

// A carried update's Run is skipped in a step that no step precedes, so what it
// writes must already hold the value it had before the step (the value the skipped
// Run leaves): its Write operands count as read-and-written.
bool ResidencyMachine::reads(int op, const Operand& o) const {
  return o.access != Access::Write || skippable_[static_cast<size_t>(op)];
}

Status ResidencyMachine::Arena::place(TensorId t, uint64_t offset, uint64_t bytes, const std::string& where,
                                      const ResidencyMachine& m) {
  if (!track_) return Status::ok();
  const std::string& name = m.name(t);
  const uint64_t b = std::max<uint64_t>(bytes, 1);
  if (offset % alignment_)
    return Status::internal(where + ": " + what_ + " offset " + std::to_string(offset) + " of " + name +
                            " is not a multiple of " + std::to_string(alignment_));
  if (offset > capacity_ || b > capacity_ - offset)
    return Status::internal(where + ": " + name + " at " + what_ + " offset " + std::to_string(offset) + " (" +
                            std::to_string(b) + " bytes) ends past the " + what_ + " arena of " +
                            std::to_string(capacity_) + " bytes");
  const uint64_t end = offset + std::min(align_up(b, alignment_), capacity_ - offset);
  auto overlap = [&](uint64_t begin, uint64_t block_end, TensorId other) {
    return Status::internal(where + ": " + name + " at " + what_ + " bytes [" + std::to_string(offset) + ", " +
                            std::to_string(end) + ") overlaps " + m.name(other) + " at [" + std::to_string(begin) +
                            ", " + std::to_string(block_end) + ")");
  };
  auto it = blocks_.lower_bound(offset);
  if (it != blocks_.end() && it->first < end) return overlap(it->first, it->second.first, it->second.second);
  if (it != blocks_.begin()) {
    auto prev = std::prev(it);
    if (prev->second.first > offset) return overlap(prev->first, prev->second.first, prev->second.second);
  }
  blocks_[offset] = {end, t};
  used_ += end - offset;
  peak_ = std::max(peak_, used_);
  return Status::ok();
}

void ResidencyMachine::Arena::release(uint64_t offset) {
  if (!track_) return;
  auto b = blocks_.find(offset);
  if (b == blocks_.end()) return;
  used_ -= b->second.first - b->first;
  blocks_.erase(b);
}

bool ResidencyMachine::mirror(TensorId t) const {
  return static_cast<size_t>(t) < tables_.host_mirror.size() && tables_.host_mirror[static_cast<size_t>(t)];
}

Place ResidencyMachine::place_of(int op) const {
  return tables_.op_place.empty() ? program_.ops[static_cast<size_t>(op)].place
                                  : tables_.op_place[static_cast<size_t>(op)];
}

Status ResidencyMachine::place_region(TensorId t, uint64_t offset, const std::string& where) {
  TensorState& s = state_[static_cast<size_t>(t)];
  if (s.region)
    return Status::internal(where + ": " + name(t) + " already holds a device region at " + std::to_string(s.offset));
  SPILLWAY_RETURN_IF_ERROR(device_.place(t, offset, bytes(t), where, *this));
  s.region = true;
  s.offset = offset;
  return Status::ok();
}

void ResidencyMachine::drop_region(TensorId t) {
  TensorState& s = state_[static_cast<size_t>(t)];
  if (s.region) device_.release(s.offset);
  s.region = false;
  s.valid[static_cast<int>(Tier::Device)] = false;
}

Status ResidencyMachine::place_host(TensorId t, uint64_t offset, const std::string& where) {
  TensorState& s = state_[static_cast<size_t>(t)];
  if (s.host_buffer) return Status::internal(where + ": " + name(t) + " already has a host buffer");
  SPILLWAY_RETURN_IF_ERROR(host_.place(t, offset, bytes(t), where, *this));
  s.host_buffer = true;
  s.host_offset = offset;
  return Status::ok();
}

void ResidencyMachine::drop_host(TensorId t) {
  TensorState& s = state_[static_cast<size_t>(t)];
  if (s.host_buffer) host_.release(s.host_offset);
  s.host_buffer = false;
  s.valid[static_cast<int>(Tier::Host)] = false;
}

// Storage extents: 4096-aligned, one per tensor, kept for the run (StorageStore).
Status ResidencyMachine::add_extent(TensorId t, const std::string& where) {
  TensorState& s = state_[static_cast<size_t>(t)];
  if (s.extent) return Status::ok();
  s.extent = true;
  storage_used_ += align_up(std::max<uint64_t>(bytes(t), 1), 4096);
  if (storage_used_ > cap_.storage)
    return Status::internal(where + ": storage extents reach " + format_size(storage_used_) + " with " + name(t) +
                            ", past the storage capacity " + format_size(cap_.storage));
  return Status::ok();
}

Status ResidencyMachine::start() {
  const size_t n = program_.tensors.size();
  if (tables_.home.size() != n || tables_.home_offset.size() != n)
    return Status::internal("plan: home tables have " + std::to_string(tables_.home.size()) + " entries for " +
                            std::to_string(n) + " tensors");
  if (!tables_.op_place.empty() && tables_.op_place.size() != program_.ops.size())
    return Status::internal("plan: op_place has " + std::to_string(tables_.op_place.size()) + " entries for " +
                            std::to_string(program_.ops.size()) + " ops");
  for (size_t i = 0; i < n; ++i) {
    auto t = static_cast<TensorId>(i);
    if (!program_.is_persistent(t)) continue;
    const std::string where = "plan: home of " + name(t);
    switch (tables_.home[i]) {
      case Tier::Device:
        SPILLWAY_RETURN_IF_ERROR(place_region(t, tables_.home_offset[i], where));
        break;
      case Tier::Host:
        if (tables_.home_host_offset.size() != n) return Status::internal(where + ": no host offset table");
        SPILLWAY_RETURN_IF_ERROR(place_host(t, tables_.home_host_offset[i], where));
        break;
      case Tier::Storage:
        SPILLWAY_RETURN_IF_ERROR(add_extent(t, where));
        break;
    }
    state_[i].valid[static_cast<int>(tables_.home[i])] = true;
  }
  for (size_t i = 0; i < n; ++i) {
    auto t = static_cast<TensorId>(i);
    if (!mirror(t)) continue;
    const std::string where = "plan: host mirror of " + name(t);
    if (program_.is_persistent(t) && tables_.home[i] != Tier::Device)
      return Status::internal(where + ": it rests on " + tier_name(tables_.home[i]) + ", not on device");
    if (tables_.home_host_offset.size() != n) return Status::internal(where + ": no host offset table");
    SPILLWAY_RETURN_IF_ERROR(place_host(t, tables_.home_host_offset[i], where));
  }
  begin_step();
  return Status::ok();
}

void ResidencyMachine::begin_step() {
  version_.assign(program_.tensors.size(), 0);
  written_by_.assign(program_.tensors.size(), -1);
  read_version_.assign(program_.ops.size(), {});
  wrote_version_.assign(program_.ops.size(), {});
  runs_.assign(program_.ops.size(), 0);
}

Status ResidencyMachine::write_at_home(TensorId t) {
  if (t < 0 || static_cast<size_t>(t) >= state_.size() || !program_.is_persistent(t))
    return Status::internal("residency: write_at_home of a tensor that does not rest between steps");
  TensorState& s = state_[static_cast<size_t>(t)];
  const Tier home = tables_.home[static_cast<size_t>(t)];
  for (bool& v : s.valid) v = false;
  s.valid[static_cast<int>(home)] = true;
  return Status::ok();
}

// A Run: operands resident where the op runs; recomputes reproduce the versions they
// replace; what the op writes is then valid only where it ran.
Status ResidencyMachine::run(const Instruction& in, const std::string& where) {
  if (in.op < 0 || static_cast<size_t>(in.op) >= program_.ops.size()) return Status::internal(where + ": bad op index");
  const Op& op = program_.ops[static_cast<size_t>(in.op)];
  const Place place = place_of(in.op);
  for (const Operand& o : op.operands) {
    const TensorId t = o.tensor;
    if (t < 0 || static_cast<size_t>(t) >= state_.size())
      return Status::internal(where + ": op " + op.name + " names tensor " + std::to_string(t) + ", which does not exist");
    const TensorState& s = state_[static_cast<size_t>(t)];
    if (place == Place::Device) {
      if (!reads(in.op, o) ? !s.region : !(s.region && s.valid[static_cast<int>(Tier::Device)]))
        return Status::internal(where + ": op " + op.name + " needs " + name(t) + " on device");
    } else {
      if (!s.host_buffer) return Status::internal(where + ": host op " + op.name + " needs a host buffer for " + name(t));
      if (reads(in.op, o) && !s.valid[static_cast<int>(Tier::Host)])
        return Status::internal(where + ": host op " + op.name + " needs " + name(t) + " on host");
      if (o.access != Access::Read && s.region)
        return Status::internal(where + ": host op " + op.name + " writes " + name(t) +
                                " while it still holds a device region (release it first)");
    }
  }
  auto writer_name = [&](TensorId t) {
    const int w = written_by_[static_cast<size_t>(t)];
    return w < 0 ? std::string("before the step") : "by " + program_.ops[static_cast<size_t>(w)].name;
  };
  const auto k_op = static_cast<size_t>(in.op);
  if (in.recompute) {
    if (runs_[k_op] == 0) return Status::internal(where + ": recompute of op " + op.name + " before the op has run in this step");
    for (size_t k = 0; k < op.operands.size(); ++k) {
      const TensorId t = op.operands[k].tensor;
      const auto ti = static_cast<size_t>(t);
      if (op.operands[k].access != Access::Write && version_[ti] != read_version_[k_op][k])
        return Status::internal(where + ": recompute of op " + op.name + " reads " + name(t) + " at version " +
                                std::to_string(version_[ti]) + " (written " + writer_name(t) + "), but " + op.name +
                                " read version " + std::to_string(read_version_[k_op][k]) +
                                ": the re-run would not reproduce its outputs");
      if (op.operands[k].access != Access::Read && (written_by_[ti] != in.op || version_[ti] != wrote_version_[k_op][k]))
        return Status::internal(where + ": recompute of op " + op.name + " overwrites " + name(t) + " version " +
                                std::to_string(version_[ti]) + " (written " + writer_name(t) + ") with version " +
                                std::to_string(wrote_version_[k_op][k]) + ", the value " + op.name + " wrote");
    }
  } else {
    runs_[k_op]++;
    read_version_[k_op].assign(op.operands.size(), 0);
    wrote_version_[k_op].assign(op.operands.size(), 0);
    for (size_t k = 0; k < op.operands.size(); ++k) read_version_[k_op][k] = version_[static_cast<size_t>(op.operands[k].tensor)];
    for (size_t k = 0; k < op.operands.size(); ++k) {
      if (op.operands[k].access == Access::Read) continue;
      const auto ti = static_cast<size_t>(op.operands[k].tensor);
      version_[ti]++;
      written_by_[ti] = in.op;
      wrote_version_[k_op][k] = version_[ti];
    }
  }
  // The newest value (the same version again, for a recompute) is where the op ran.
  for (const Operand& o : op.operands) {
    if (o.access == Access::Read) continue;
    TensorState& s = state_[static_cast<size_t>(o.tensor)];
    s.valid[static_cast<int>(Tier::Device)] = place == Place::Device;
    s.valid[static_cast<int>(Tier::Host)] = place == Place::Host;
    s.valid[static_cast<int>(Tier::Storage)] = false;
  }
  return Status::ok();
}

Status ResidencyMachine::apply(size_t at, const Instruction& in) {
  const std::string where = "plan: instruction " + std::to_string(at) + " (" + instr_kind_name(in.kind) + ")";
  if (in.kind == InstrKind::Run) return run(in, where);
  const TensorId t = in.tensor;
  if (t < 0 || static_cast<size_t>(t) >= state_.size()) return Status::internal(where + ": bad tensor id");
  TensorState& s = state_[static_cast<size_t>(t)];
  bool& on_device = s.valid[static_cast<int>(Tier::Device)];
  bool& on_host = s.valid[static_cast<int>(Tier::Host)];
  bool& in_storage = s.valid[static_cast<int>(Tier::Storage)];
  switch (in.kind) {
    case InstrKind::Allocate:
      SPILLWAY_RETURN_IF_ERROR(place_region(t, in.offset, where));
      on_device = false;  // a region to be written: no value yet
      return Status::ok();
    case InstrKind::Fetch:
      if (!on_host) return Status::internal(where + ": fetch of " + name(t) + " which is not valid on host");
      SPILLWAY_RETURN_IF_ERROR(place_region(t, in.offset, where));
      on_device = true;
      return Status::ok();
    case InstrKind::Evict:
      if (!s.region) return Status::internal(where + ": evict of " + name(t) + " which has no device region");
      if (in.write_back) {
        if (!on_device) return Status::internal(where + ": write-back of " + name(t) + " which is not valid on device");
        if (!s.host_buffer) return Status::internal(where + ": write-back of " + name(t) + " without a host buffer");
        on_host = true;
      } else if (!on_host && !in_storage) {
        return Status::internal(where + ": evict without write-back of " + name(t) + " whose only copy is on device");
      }
      drop_region(t);
      return Status::ok();
    case InstrKind::Flush:
      if (!s.region || !on_device) return Status::internal(where + ": flush of " + name(t) + " which is not valid on device");
      if (!s.host_buffer) return Status::internal(where + ": flush of " + name(t) + " without a host buffer");
      on_host = true;
      return Status::ok();
    case InstrKind::Release:
      if (!s.region) return Status::internal(where + ": release of " + name(t) + " which has no device region");
      drop_region(t);
      return Status::ok();
    case InstrKind::HostAllocate:
      SPILLWAY_RETURN_IF_ERROR(place_host(t, in.offset, where));
      on_host = false;
      return Status::ok();
    case InstrKind::Load:
      if (!in_storage) return Status::internal(where + ": load of " + name(t) + " which is not in storage");
      if (!s.host_buffer) return Status::internal(where + ": load of " + name(t) + " without a host buffer");
      on_host = true;
      return Status::ok();
    case InstrKind::Store:
      if (!s.host_buffer || !on_host) return Status::internal(where + ": store of " + name(t) + " which is not valid on host");
      SPILLWAY_RETURN_IF_ERROR(add_extent(t, where));
      in_storage = true;
      if (in.free_host) drop_host(t);
      return Status::ok();
    case InstrKind::HostRelease:
      if (!s.host_buffer) return Status::internal(where + ": host release of " + name(t) + " which has no host buffer");
      if (mirror(t)) return Status::internal(where + ": host release of the host mirror of " + name(t));
      drop_host(t);
      return Status::ok();
    case InstrKind::Run: break;
  }
  return Status::internal(where + ": unknown instruction kind");
}

Status ResidencyMachine::finish() const {
  for (size_t i = 0; i < runs_.size(); ++i)
    if (runs_[i] != 1)
      return Status::internal("plan: op " + program_.ops[i].name + " runs " + std::to_string(runs_[i]) + " times in a step");
  for (size_t i = 0; i < state_.size(); ++i) {
    auto t = static_cast<TensorId>(i);
    const TensorState& s = state_[i];
    const bool persistent = program_.is_persistent(t);
    const Tier home = persistent ? tables_.home[i] : Tier::Device;
    const bool host_home = persistent && home == Tier::Host;
    if (mirror(t)) {
      if (!s.host_buffer || s.host_offset != tables_.home_host_offset[i])
        return Status::internal("plan: the host mirror of " + name(t) + " left its buffer during the step");
    } else if (s.host_buffer && !host_home) {
      return Status::internal("plan: " + name(t) + " still holds a host buffer at the end of the step");
    }
    if (host_home && (!s.host_buffer || s.host_offset != tables_.home_host_offset[i]))
      return Status::internal("plan: " + name(t) + " does not end the step in its home host buffer");
    if (!persistent) {
      if (s.region) return Status::internal("plan: " + name(t) + " still holds a device region at the end of the step");
      continue;
    }
    const bool ok = home == Tier::Device ? s.valid[0] && s.region && s.offset == tables_.home_offset[i]
                    : home == Tier::Host ? s.valid[1] && !s.region
                                         : s.valid[2] && !s.region;
    if (!ok) return Status::internal("plan: " + name(t) + " does not end the step valid in its home (" + tier_name(home) + ")");
  }
  return Status::ok();
}

}  // namespace spillway
