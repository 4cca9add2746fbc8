// The op registry: one entry per OpKind saying everything the rest of Spillway knows
// about that kind of op: its name, its operand slots (name, access, dtype, optional),
// the checks of its attributes and operand sizes, its floating-point operations and
// the bytes it moves. Program::validate, Program::flops, the machine's cost model
// (sim/machine.cpp), the planner, the profiler and bench_train read it; none of them
// spells out a kind.
//
//   const OpKindInfo& info = op_info(OpKind::GeluForward);
//   info.name;                          // "GeluForward"
//   info.slots[0].name;                 // "out", Access::Write; slots[1]: "inp", Access::Read
//   int master = op_slot(OpKind::AdamW, "master");  // 1
//   double f = op_flops(op);            // matrix products only (the MFU convention)
//   double w = op_cost_flops(op);       // what the kernels execute (the cost model)
//   double b = op_bytes_moved(program, op);
//
// Adding a kind of op touches:
//   1. OpKind in program/program.h (the enumerator; kOpKindCount if it goes last);
//   2. its entry in kOpKinds in program/op_registry.cpp: slots, attribute checks,
//      flops, bytes (static_asserts there: one entry per kind, in enum order);
//   3. its backend call in kDeviceOps in exec/dispatch.cpp (the same static_asserts);
//      the registry cannot hold it: the program module comes before the backend in
//      DESIGN.md's flow and must not depend on it;
//   4. the Backend methods (backend/backend.h) and their CPU and CUDA kernels.
// tests/program/test_op_registry.cpp checks every entry against validation.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/status.h"
#include "program/program.h"

namespace spillway {

// What an operand slot holds: the activation dtype (F32 or BF16), always F32, or I32.
enum class SlotDType : uint8_t { Act, F32, I32 };

struct OpSlot {
  const char* name;   // "out", "inp", ...: named in validation errors
  Access access;      // what the op does to it
  SlotDType dtype;
  bool optional = false;    // may be left off (only trailing slots: matmul biases, dwpe)
  bool may_update = false;  // a Write slot that may be Update instead (a tile after the
                            // first adds into it; packed squared norms)
  bool state = false;       // host-capable ops: state that moves with the op (AdamW's
                            // param, master, moments and grad), placed together
};

// How profiles group an op's time (bench_train's split).
// What an op is, for the cost model and the executor: matrix products and attention
// (each timed at its own rate), collectives (run by the backend's Communicator, on its
// own stream where it has one, not by the backend's kernels), everything else.
enum class OpClass : uint8_t { Matmul, Attention, Collective, Other };

class OpCheck;

struct OpKindInfo {
  OpKind kind;
  const char* name;
  std::span<const OpSlot> slots;  // in operand order
  // Checks attrs and the operands' element counts (the slots' count, access and
  // dtype are checked before it is called). nullptr: nothing more to check.
  Status (*check)(const OpCheck& c) = nullptr;
  // Useful floating-point operations, the MFU convention: matrix products only, a
  // multiply-add is 2. nullptr: 0 (memory-bound).
  double (*flops)(const OpAttrs& a) = nullptr;
  // What the kernels execute, for the cost model when it differs from `flops`
  // (attention's backward recomputes P). nullptr: `flops`.
  double (*cost_flops)(const OpAttrs& a) = nullptr;
  // Bytes read and written on the device. nullptr: each distinct operand once for
  // Read or Write, twice for Update.
  double (*bytes)(const Program& program, const Op& op) = nullptr;
  OpClass op_class = OpClass::Other;
  // Has a host implementation (exec/dispatch.cpp's run_host_op): the planner runs it
  // where the tier of its `home` slot is (on host when that rests on host) and leaves
  // it out of the minimum device budget. Host ops process attrs.n elements.
  bool host = false;
  const char* home = nullptr;  // host ops: the slot whose tier decides where it runs
  // Where a machine has no fit of this kind (sim/machine.h: Machine::op_fit; one
  // profiled before the kind existed), the fits of the kinds it stands for price it:
  // priced_as, a product, over this op's flops and bytes; priced_with, an elementwise
  // kind the op also does, over the bytes priced_with_bytes says that kind's own op
  // would move. None: the roofline of the machine's rates.
  std::optional<OpKind> priced_as = std::nullopt;
  std::optional<OpKind> priced_with = std::nullopt;
  double (*priced_with_bytes)(const Program& program, const Op& op) = nullptr;
};

const OpKindInfo& op_info(OpKind k);
// Operands an op of kind k takes: [required, slots.size()].
size_t op_required_operands(OpKind k);
// The index of the slot called `name`, or -1.
int op_slot(OpKind k, std::string_view name);
const char* access_name(Access a);

// A collective (OpClass::Collective): run by the backend's Communicator, called by
// every rank at the same point of its program.
bool op_is_collective(OpKind k);

// The registry's formulas for one op (0 for an out-of-range kind).
double op_flops(const Op& op);
double op_cost_flops(const Op& op);
double op_bytes_moved(const Program& program, const Op& op);

// Checks op `index` of `program` against its kind's slots and attrs: operand count,
// ids in range, no tensor twice, access, dtype, that Read and Update operands were
// written by an earlier op (`written[id]`) or persist across steps, then sizes.
// Errors name the op, its kind, the operand's slot and tensor.
Status check_op(const Program& program, size_t index, const std::vector<bool>& written);

// The context an entry's `check` works in: the op, and helpers that name it in errors.
class OpCheck {
 public:
  OpCheck(const Program& program, size_t index) : p_(program), op_(program.ops[index]), index_(index) {}

  const Program& program() const { return p_; }
  const Op& op() const { return op_; }
  const OpAttrs& attrs() const { return op_.attrs; }
  size_t operands() const { return op_.operands.size(); }
  Access access(size_t i) const { return op_.operands[i].access; }
  int64_t numel(size_t i) const;

  // "op 3 'h0.gelu' (GeluForward): <what>"
  Status fail(const std::string& what) const;
  // "op 3 'h0.gelu' (GeluForward): operand 1 (inp) 'h0.fch' <what>"
  Status fail_operand(size_t i, const std::string& what) const;
  // Every named attribute is positive.
  Status positive(std::initializer_list<std::pair<const char*, int64_t>> attrs) const;
  // Operand i (when present) has exactly `want` elements.
  Status numel_is(size_t i, int64_t want, const char* formula) const;
  // Operand i is a table of rows of `width` elements with at least `min_rows` rows.
  Status rows_of(size_t i, int64_t width, int64_t min_rows, const char* what) const;

 private:
  std::string op_text() const;

  const Program& p_;
  const Op& op_;
  size_t index_;
};

}  // namespace spillway
