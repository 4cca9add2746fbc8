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

TensorId TensorTable::add(TensorInfo info) {
  infos_.push_back(std::move(info));
  return static_cast<TensorId>(infos_.size() - 1);
}

TensorId TensorTable::find(std::string_view name) const {
  for (size_t i = 0; i < infos_.size(); ++i)
    if (infos_[i].name == name) return static_cast<TensorId>(i);
  return kNoTensor;
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
