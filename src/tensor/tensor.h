// Tensors of a training step: what they are (TensorInfo, kept in a TensorTable).
// Where their valid copies are during a step is the residency machine's
// (plan/residency.h), the one definition the planner, Plan::validate, the simulator
// and the executor share.
//
//   TensorTable table;
//   TensorId w = table.add({"h0.attn.qkv.weight", DType::F32, {3 * 768, 768}, Role::Param});
//   table.info(w).bytes();                      // 3 * 768 * 768 * 4
//   table.find("h0.attn.qkv.weight");           // w (kNoTensor when absent)
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"

namespace spillway {

enum class DType : uint8_t { F32, BF16, I32, U16 };
size_t dtype_size(DType t);
const char* dtype_name(DType t);

// Row-major dimensions, outermost first. Shape{} is a scalar.
struct Shape {
  std::vector<int64_t> dims;
  Shape() = default;
  Shape(std::initializer_list<int64_t> d) : dims(d) {}
  explicit Shape(std::vector<int64_t> d) : dims(std::move(d)) {}
  int64_t numel() const;
  size_t rank() const { return dims.size(); }
  int64_t operator[](size_t i) const { return dims[i]; }
  bool operator==(const Shape&) const = default;
  std::string to_string() const;  // "[768, 2304]"
};

enum class Role : uint8_t { Param, Grad, Master, OptState, Activation, Scratch, Input };
const char* role_name(Role r);

// The three tiers, fastest first.
enum class Tier : uint8_t { Device = 0, Host = 1, Storage = 2 };
inline constexpr int kTierCount = 3;
const char* tier_name(Tier t);

using TensorId = int32_t;
inline constexpr TensorId kNoTensor = -1;

struct TensorInfo {
  std::string name;
  DType dtype = DType::F32;
  Shape shape;
  Role role = Role::Activation;
  size_t bytes() const { return static_cast<size_t>(shape.numel()) * dtype_size(dtype); }
};

class TensorTable {
 public:
  TensorId add(TensorInfo info);
  size_t size() const { return infos_.size(); }
  const TensorInfo& info(TensorId id) const { return infos_.at(static_cast<size_t>(id)); }
  const std::vector<TensorInfo>& infos() const { return infos_; }
  // kNoTensor when absent.
  TensorId find(std::string_view name) const;

  size_t total_bytes() const;
  size_t bytes_with_role(Role r) const;

 private:
  std::vector<TensorInfo> infos_;
};

}  // namespace spillway
