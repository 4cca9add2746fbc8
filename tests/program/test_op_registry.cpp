// The op registry (program/op_registry.h) is complete and agrees with validation:
// every OpKind has an entry, Program::validate takes exactly its slots' operand
// counts, refuses a wrong access or dtype in any slot with an error naming the op,
// the kind and the slot, and compute ops count positive flops.
#include <gtest/gtest.h>

#include <cstdint>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "program/op_registry.h"
#include "program/program.h"

using namespace spillway;

namespace {

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

OpKind kind_at(size_t i) { return static_cast<OpKind>(i); }

Op make_op(OpKind k, OpAttrs attrs = {}, std::vector<Operand> operands = {}) {
  Op op;
  op.kind = k;
  op.name = "probe";
  op.attrs = attrs;
  op.operands = std::move(operands);
  return op;
}

// A program with one op of kind k and `count` operands, one distinct one-element
// tensor per operand with its slot's dtype and access (inputs, so reads are valid);
// operands past the slots are f32 Reads. Operand `bad_dtype` gets a dtype its slot
// refuses (f32 for tokens, i32 otherwise).
Program one_op(OpKind k, size_t count, size_t bad_dtype = SIZE_MAX) {
  const OpKindInfo& info = op_info(k);
  Program p;
  Op op = make_op(k);
  for (size_t i = 0; i < count; ++i) {
    DType dtype = DType::F32;
    Access access = Access::Read;
    if (i < info.slots.size()) {
      dtype = info.slots[i].dtype == SlotDType::I32 ? DType::I32 : DType::F32;
      access = info.slots[i].access;
      if (i == bad_dtype) dtype = dtype == DType::I32 ? DType::F32 : DType::I32;
    }
    TensorId t = p.tensors.add({"t" + std::to_string(i), dtype, {1}, Role::Input});
    p.inputs.push_back(t);
    op.operands.push_back({t, access});
  }
  p.add_op(std::move(op));
  return p;
}

// Whether a validation error is about the operands' count, access or dtype (rather
// than the sizes and attrs, which one-element tensors and zero attrs get wrong).
bool about_slots(const Status& s) {
  return !s.is_ok() && (contains(s.message(), " operands; ") || contains(s.message(), "has access") ||
                        contains(s.message(), "has dtype"));
}

}  // namespace

TEST(OpRegistry, EveryKindHasItsEntryInOrder) {
  std::set<std::string> names;
  for (size_t i = 0; i < kOpKindCount; ++i) {
    const OpKindInfo& info = op_info(kind_at(i));
    EXPECT_EQ(static_cast<size_t>(info.kind), i);
    ASSERT_NE(info.name, nullptr);
    EXPECT_STRNE(info.name, "?") << i;
    EXPECT_STREQ(op_kind_name(kind_at(i)), info.name);
    EXPECT_TRUE(names.insert(info.name).second) << info.name << " named twice";
    EXPECT_FALSE(info.slots.empty()) << info.name;
    std::set<std::string> slots;
    for (const OpSlot& s : info.slots) EXPECT_TRUE(slots.insert(s.name).second) << info.name << " slot " << s.name;
    // Only Zero has no attrs to check.
    if (info.kind != OpKind::Zero) {
      EXPECT_NE(info.check, nullptr) << info.name << " has no attrs check";
    }
  }
  // Out of the enum: no entry.
  EXPECT_STREQ(op_kind_name(kind_at(kOpKindCount)), "?");
  EXPECT_EQ(op_slot(OpKind::AdamW, "master"), 1);
  EXPECT_EQ(op_slot(OpKind::AdamW, "nothing"), -1);
}

TEST(OpRegistry, ValidationTakesExactlyTheSlotCounts) {
  for (size_t i = 0; i < kOpKindCount; ++i) {
    const OpKind k = kind_at(i);
    const OpKindInfo& info = op_info(k);
    const size_t lo = op_required_operands(k), hi = info.slots.size();
    SCOPED_TRACE(info.name);
    for (size_t n = lo; n <= hi; ++n) {
      Status st = one_op(k, n).validate();
      EXPECT_FALSE(about_slots(st)) << n << " operands: " << st.message();
    }
    const std::string takes = std::string(info.name) + " takes " +
                              (lo == hi ? std::to_string(lo) : std::to_string(lo) + " or " + std::to_string(hi));
    for (size_t n : {lo - 1, hi + 1}) {
      if (n == static_cast<size_t>(-1)) continue;
      Status st = one_op(k, n).validate();
      ASSERT_FALSE(st.is_ok()) << n << " operands accepted";
      EXPECT_TRUE(contains(st.message(), "op 0 'probe' (" + std::string(info.name) + "): has " + std::to_string(n) +
                                             " operands; " + takes))
          << st.message();
    }
  }
}

TEST(OpRegistry, WrongAccessOrDtypeNamesOpKindAndSlot) {
  for (size_t i = 0; i < kOpKindCount; ++i) {
    const OpKind k = kind_at(i);
    const OpKindInfo& info = op_info(k);
    SCOPED_TRACE(info.name);
    for (size_t j = 0; j < info.slots.size(); ++j) {
      const OpSlot& slot = info.slots[j];
      const std::string where =
          "op 0 'probe' (" + std::string(info.name) + "): operand " + std::to_string(j) + " (" + slot.name + ") 't" +
          std::to_string(j) + "'";
      // An access the slot does not allow.
      Program p = one_op(k, info.slots.size());
      const Access wrong = slot.access == Access::Read ? Access::Write : Access::Read;
      p.ops[0].operands[j].access = wrong;
      Status st = p.validate();
      ASSERT_FALSE(st.is_ok()) << slot.name;
      EXPECT_TRUE(contains(st.message(), where + " has access " + access_name(wrong) + "; " + info.name + " needs " +
                                             access_name(slot.access)))
          << st.message();
      // A dtype the slot does not allow: i32 for float slots, f32 for token slots.
      st = one_op(k, info.slots.size(), j).validate();
      ASSERT_FALSE(st.is_ok()) << slot.name;
      EXPECT_TRUE(contains(st.message(), where + " has dtype ")) << st.message();
    }
  }
}

TEST(OpRegistry, ComputeOpsCountPositiveFlops) {
  const OpAttrs attrs{.B = 2, .T = 8, .C = 16, .OC = 5, .NH = 4, .N = 6, .V = 7, .P = 3, .n = 11};
  int compute = 0;
  for (size_t i = 0; i < kOpKindCount; ++i) {
    const Op op = make_op(kind_at(i), attrs);
    const OpKindInfo& info = op_info(op.kind);
    SCOPED_TRACE(info.name);
    if (info.op_class == OpClass::Other) {
      EXPECT_EQ(op_flops(op), 0.0);  // memory-bound: the MFU convention leaves it out
      EXPECT_EQ(op_cost_flops(op), 0.0);
      continue;
    }
    ++compute;
    EXPECT_GT(op_flops(op), 0.0);
    EXPECT_GE(op_cost_flops(op), op_flops(op));
  }
  EXPECT_EQ(compute, 4);  // matmul and attention, forward and backward
  // The figures Program::flops documents.
  EXPECT_DOUBLE_EQ(op_flops(make_op(OpKind::MatmulForward, attrs)), 2.0 * 6 * 16 * 5);
  EXPECT_DOUBLE_EQ(op_flops(make_op(OpKind::MatmulBackward, attrs)), 4.0 * 6 * 16 * 5);
  EXPECT_DOUBLE_EQ(op_flops(make_op(OpKind::AttentionForward, attrs)), 2.0 * 2 * 8 * 8 * 16);
  EXPECT_DOUBLE_EQ(op_flops(make_op(OpKind::AttentionBackward, attrs)), 4.0 * 2 * 8 * 8 * 16);
  EXPECT_DOUBLE_EQ(op_cost_flops(make_op(OpKind::AttentionBackward, attrs)), 5.0 * 2 * 8 * 8 * 16);
}

TEST(OpRegistry, BytesMovedCountUpdatesTwiceAndEmbeddingRows) {
  Program p;
  TensorId out = p.tensors.add({"out", DType::F32, {10}, Role::Activation});
  TensorId a = p.tensors.add({"a", DType::F32, {10}, Role::Input});
  TensorId b = p.tensors.add({"b", DType::BF16, {10}, Role::Input});
  Op residual = make_op(OpKind::ResidualForward, {}, {{out, Access::Write}, {a, Access::Read}, {b, Access::Read}});
  EXPECT_DOUBLE_EQ(op_bytes_moved(p, residual), 40.0 + 40.0 + 20.0);
  Op ce = make_op(OpKind::CrossEntropyBackward, {}, {{out, Access::Write}, {a, Access::Update}, {b, Access::Read}});
  EXPECT_DOUBLE_EQ(op_bytes_moved(p, ce), 40.0 + 2 * 40.0 + 20.0);
  // Embedding: out [B,T,C] once, the selected wte and wpe rows once each, the tokens.
  TensorId act = p.tensors.add({"x", DType::BF16, {1, 2, 3}, Role::Activation});
  Op emb = make_op(OpKind::EmbeddingForward, {.B = 1, .T = 2, .C = 3}, {{act, Access::Write}});
  EXPECT_DOUBLE_EQ(op_bytes_moved(p, emb), 3 * 6 * 2.0 + 4 * 2.0);
}

TEST(OpRegistry, HostOpsNameTheirStateSlots) {
  int host = 0;
  for (size_t i = 0; i < kOpKindCount; ++i) {
    const OpKindInfo& info = op_info(kind_at(i));
    if (!info.host) {
      EXPECT_EQ(info.home, nullptr) << info.name;
      for (const OpSlot& s : info.slots) EXPECT_FALSE(s.state) << info.name << " " << s.name;
      continue;
    }
    ++host;
    // The planner places a host op by its home slot and streams it by param and grad.
    for (const char* name : {info.home, "param", "grad"}) {
      const int slot = op_slot(info.kind, name);
      ASSERT_GE(slot, 0) << info.name << " has no slot " << name;
      EXPECT_TRUE(info.slots[static_cast<size_t>(slot)].state) << info.name << " " << name;
    }
  }
  EXPECT_EQ(host, 1);  // AdamW
}

// A kind added through its registry entry alone (RMSNorm, the first of the Llama
// ops): validation knows its slots and sizes and refuses a missing eps.
TEST(OpRegistry, RmsNormValidatesFromItsEntry) {
  const int64_t N = 6, C = 8;
  Program p;
  TensorId x = p.tensors.add({"x", DType::BF16, {N, C}, Role::Input});
  TensorId w = p.tensors.add({"w", DType::BF16, {C}, Role::Param});
  TensorId dw = p.tensors.add({"dw", DType::BF16, {C}, Role::Grad});
  TensorId out = p.tensors.add({"out", DType::BF16, {N, C}, Role::Activation});
  TensorId rstd = p.tensors.add({"rstd", DType::F32, {N}, Role::Activation});
  TensorId dout = p.tensors.add({"dout", DType::BF16, {N, C}, Role::Input});
  TensorId dx = p.tensors.add({"dx", DType::BF16, {N, C}, Role::Scratch});
  p.inputs = {x, dout};
  p.add_op(make_op(OpKind::Zero, {}, {{dx, Access::Write}}));
  p.add_op(make_op(OpKind::RmsNormForward, {.C = C, .N = N, .scale = 1e-5f},
                   {{out, Access::Write}, {rstd, Access::Write}, {x, Access::Read}, {w, Access::Read}}));
  p.add_op(make_op(OpKind::RmsNormBackward, {.C = C, .N = N},
                   {{dx, Access::Update}, {dw, Access::Update}, {dout, Access::Read}, {x, Access::Read},
                    {w, Access::Read}, {rstd, Access::Read}}));
  p.outputs = {out};
  ASSERT_TRUE(p.validate().is_ok()) << p.validate().to_string();
  EXPECT_EQ(op_flops(p.ops[1]), 0.0);  // memory-bound
  EXPECT_DOUBLE_EQ(op_bytes_moved(p, p.ops[2]), 2.0 * 96 + 2.0 * 16 + 96 + 96 + 16 + 24);

  Program q = p;
  q.ops[1].attrs.scale = 0;
  Status st = q.validate();
  ASSERT_FALSE(st.is_ok());
  EXPECT_TRUE(contains(st.message(), "op 1 'probe' (RmsNormForward): attrs.scale (eps) is 0")) << st.message();
  q = p;
  q.tensors = TensorTable();
  for (const TensorInfo& t : p.tensors.infos())
    q.tensors.add(t.name == "rstd" ? TensorInfo{"rstd", DType::F32, {N + 1}, Role::Activation} : t);
  st = q.validate();
  ASSERT_FALSE(st.is_ok());
  EXPECT_TRUE(contains(st.message(), "operand 1 (rstd) 'rstd' has 7 elements; expected N = 6")) << st.message();
}
