// Tensors of a training step: what they are (TensorInfo) and where their valid
// copies live (TensorTable).
//
//   TensorTable table;
//   TensorId w = table.add({"h0.attn.qkv.weight", DType::F32, {3 * 768, 768}, Role::Param});
//   table.mark_written(w, Tier::Device);        // newest copy on device, lower tiers stale
//   table.mark_copied(w, Tier::Host);           // host now valid too
//   table.pin(w); ... table.unpin(w);           // running work holds it
//   table.state(w).valid(Tier::Host);           // true
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

// Where the copies of one tensor are. A copy is valid when it holds the newest
// values; `dirty` means the newest copy has not reached any lower tier yet.
struct Residency {
  std::array<bool, kTierCount> valid_in{false, false, false};
  bool dirty = false;
  int pins = 0;
  bool valid(Tier t) const { return valid_in[static_cast<int>(t)]; }
  bool anywhere() const { return valid_in[0] || valid_in[1] || valid_in[2]; }
  // The fastest tier holding a valid copy; only meaningful when anywhere().
  Tier fastest() const;
};

class TensorTable {
 public:
  TensorId add(TensorInfo info);
  size_t size() const { return infos_.size(); }
  const TensorInfo& info(TensorId id) const { return infos_.at(static_cast<size_t>(id)); }
  const std::vector<TensorInfo>& infos() const { return infos_; }
  // kNoTensor when absent.
  TensorId find(std::string_view name) const;

  const Residency& state(TensorId id) const { return states_.at(static_cast<size_t>(id)); }
  // A new value was written in `tier`: it is the only valid copy, and dirty unless
  // it is in storage (the lowest tier).
  void mark_written(TensorId id, Tier tier);
  // The newest value was copied into `tier`. Copying it down clears dirty.
  void mark_copied(TensorId id, Tier tier);
  // The copy in `tier` was freed. Fails when it was the only valid copy of live data.
  Status mark_dropped(TensorId id, Tier tier, bool value_is_dead = false);
  void pin(TensorId id) { states_.at(static_cast<size_t>(id)).pins++; }
  Status unpin(TensorId id);
  void reset_residency();

  size_t total_bytes() const;
  size_t bytes_with_role(Role r) const;

 private:
  std::vector<TensorInfo> infos_;
  std::vector<Residency> states_;
};

}  // namespace spillway
