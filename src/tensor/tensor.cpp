#include "tensor/tensor.h"

namespace spillway {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::F32: return 4;
    case DType::BF16: return 2;
    case DType::I32: return 4;
    case DType::U16: return 2;
  }
  return 0;
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "f32";
    case DType::BF16: return "bf16";
    case DType::I32: return "i32";
    case DType::U16: return "u16";
  }
  return "?";
}

int64_t Shape::numel() const {
  int64_t n = 1;
  for (int64_t d : dims) n *= d;
  return n;
}

std::string Shape::to_string() const {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(dims[i]);
  }
  return s + "]";
}

const char* role_name(Role r) {
  switch (r) {
    case Role::Param: return "param";
    case Role::Grad: return "grad";
    case Role::Master: return "master";
    case Role::OptState: return "optstate";
    case Role::Activation: return "activation";
    case Role::Scratch: return "scratch";
    case Role::Input: return "input";
  }
  return "?";
}

const char* tier_name(Tier t) {
  switch (t) {
    case Tier::Device: return "device";
    case Tier::Host: return "host";
    case Tier::Storage: return "storage";
  }
  return "?";
}

Tier Residency::fastest() const {
  for (int i = 0; i < kTierCount; ++i)
    if (valid_in[i]) return static_cast<Tier>(i);
  return Tier::Storage;
}

TensorId TensorTable::add(TensorInfo info) {
  infos_.push_back(std::move(info));
  states_.emplace_back();
  return static_cast<TensorId>(infos_.size() - 1);
}

TensorId TensorTable::find(std::string_view name) const {
  for (size_t i = 0; i < infos_.size(); ++i)
    if (infos_[i].name == name) return static_cast<TensorId>(i);
  return kNoTensor;
}

void TensorTable::mark_written(TensorId id, Tier tier) {
  Residency& r = states_.at(static_cast<size_t>(id));
  r.valid_in = {false, false, false};
  r.valid_in[static_cast<int>(tier)] = true;
  r.dirty = tier != Tier::Storage;
}

void TensorTable::mark_copied(TensorId id, Tier tier) {
  Residency& r = states_.at(static_cast<size_t>(id));
  Tier newest = r.fastest();
  r.valid_in[static_cast<int>(tier)] = true;
  if (static_cast<int>(tier) > static_cast<int>(newest)) r.dirty = false;
}

Status TensorTable::mark_dropped(TensorId id, Tier tier, bool value_is_dead) {
  Residency& r = states_.at(static_cast<size_t>(id));
  int t = static_cast<int>(tier);
  if (!r.valid_in[t]) return Status::ok();
  if (r.pins > 0)
    return Status::internal("tensor " + infos_[id].name + ": dropped from " + tier_name(tier) + " while pinned");
  int copies = r.valid_in[0] + r.valid_in[1] + r.valid_in[2];
  if (copies == 1 && !value_is_dead)
    return Status::internal("tensor " + infos_[id].name + ": dropped its only valid copy (" + tier_name(tier) + ")");
  r.valid_in[t] = false;
  if (!r.anywhere()) r.dirty = false;
  // The remaining copies are in lower tiers than the dropped one only if it was the
  // newest; they hold the same value, so nothing is dirty relative to them.
  bool lower_only = true;
  for (int i = 0; i < t; ++i) lower_only &= !r.valid_in[i];
  if (lower_only) r.dirty = false;
  return Status::ok();
}

Status TensorTable::unpin(TensorId id) {
  Residency& r = states_.at(static_cast<size_t>(id));
  if (r.pins <= 0) return Status::internal("tensor " + infos_[id].name + ": unpinned more often than pinned");
  r.pins--;
  return Status::ok();
}

void TensorTable::reset_residency() {
  for (auto& s : states_) s = Residency();
}

size_t TensorTable::total_bytes() const {
  size_t b = 0;
  for (auto& i : infos_) b += i.bytes();
  return b;
}

size_t TensorTable::bytes_with_role(Role r) const {
  size_t b = 0;
  for (auto& i : infos_)
    if (i.role == r) b += i.bytes();
  return b;
}

}  // namespace spillway
