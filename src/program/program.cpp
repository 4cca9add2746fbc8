#include "program/program.h"

#include <algorithm>
#include <string>
#include <vector>

#include "program/op_registry.h"

namespace spillway {

namespace {

bool persists_across_steps(Role r) {
  return r == Role::Param || r == Role::Grad || r == Role::Master || r == Role::OptState ||
         r == Role::Input;
}

}  // namespace

Status Program::validate() const {
  std::vector<bool> written(tensors.size(), false);
  for (size_t i = 0; i < ops.size(); ++i) {
    SPILLWAY_RETURN_IF_ERROR(check_op(*this, i, written));
    for (const Operand& o : ops[i].operands)
      if (o.access != Access::Read) written[o.tensor] = true;
  }
  auto check_ids = [&](const std::vector<TensorId>& ids, const char* what) -> Status {
    for (size_t i = 0; i < ids.size(); ++i)
      if (ids[i] < 0 || static_cast<size_t>(ids[i]) >= tensors.size())
        return Status::invalid_argument(std::string("program ") + what + "[" + std::to_string(i) + "]: tensor id " +
                                        std::to_string(ids[i]) + " is out of range (table has " +
                                        std::to_string(tensors.size()) + " tensors)");
    return Status::ok();
  };
  SPILLWAY_RETURN_IF_ERROR(check_ids(inputs, "inputs"));
  SPILLWAY_RETURN_IF_ERROR(check_ids(outputs, "outputs"));
  for (TensorId id : outputs)
    if (!written[id] && !persists_across_steps(tensors.info(id).role))
      return Status::invalid_argument("program output '" + tensors.info(id).name + "' is never written by any op");
  return Status::ok();
}

bool Program::is_persistent(TensorId t) const {
  Role r = tensors.info(t).role;
  if (r == Role::Param || r == Role::Grad || r == Role::Master || r == Role::OptState || r == Role::Input) return true;
  return std::find(outputs.begin(), outputs.end(), t) != outputs.end();
}

std::string tile_name(const std::string& name, int64_t j) { return name + "#" + std::to_string(j); }

std::vector<int64_t> find_pieces(const std::string& name, const std::function<int64_t(const std::string&)>& find) {
  if (const int64_t whole = find(name); whole >= 0) return {whole};
  std::vector<int64_t> out;
  for (int64_t j = 0;; ++j) {
    const int64_t t = find(tile_name(name, j));
    if (t < 0) break;
    out.push_back(t);
  }
  return out;
}

std::vector<TensorId> Program::pieces(const std::string& name) const {
  std::vector<TensorId> out;
  for (int64_t t : find_pieces(name, [&](const std::string& n) -> int64_t {
         const TensorId id = tensors.find(n);
         return id == kNoTensor ? -1 : static_cast<int64_t>(id);
       }))
    out.push_back(static_cast<TensorId>(t));
  return out;
}

// FLOP counts, the usual MFU convention: only matrix products count (LayerNorm,
// GELU, softmax, cross-entropy and AdamW are memory-bound and left out); each
// kind's formula is its registry entry's `flops`.
double Program::flops() const {
  double total = 0;
  for (const Op& op : ops) total += op_flops(op);
  return total;
}

}  // namespace spillway
