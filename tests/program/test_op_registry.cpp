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

// The collectives, one predicate for the executor and the planner.
TEST(OpRegistry, CollectivesAreTheCommunicatorsOps) {
  for (OpKind k : {OpKind::ReduceGradient, OpKind::SendGradient, OpKind::AllReduceInRankOrder, OpKind::BroadcastParam,
                   OpKind::GatherParam})
    EXPECT_TRUE(op_is_collective(k)) << op_kind_name(k);
  for (OpKind k : {OpKind::MatmulForward, OpKind::AttentionBackward, OpKind::SquaredNorm, OpKind::AdamW})
    EXPECT_FALSE(op_is_collective(k)) << op_kind_name(k);
}

TEST(OpRegistry, ComputeOpsCountPositiveFlops) {
  const OpAttrs attrs{.B = 2, .T = 8, .C = 16, .OC = 5, .NH = 4, .N = 6, .V = 7, .P = 3, .n = 11};
  int compute = 0;
  for (size_t i = 0; i < kOpKindCount; ++i) {
    const Op op = make_op(kind_at(i), attrs);
    const OpKindInfo& info = op_info(op.kind);
    SCOPED_TRACE(info.name);
    if (info.op_class == OpClass::Other || info.op_class == OpClass::Collective) {
      EXPECT_EQ(op_flops(op), 0.0);  // memory- or link-bound: the MFU convention leaves it out
      EXPECT_EQ(op_cost_flops(op), 0.0);
      continue;
    }
    ++compute;
    EXPECT_GT(op_flops(op), 0.0);
    EXPECT_GE(op_cost_flops(op), op_flops(op));
  }
  // matmul and attention, forward and backward; the GELU, weight-only and residual products
  EXPECT_EQ(compute, 8);
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
  TensorId tokens = p.tensors.add({"tokens", DType::I32, {1, 2}, Role::Input});
  TensorId wte = p.tensors.add({"wte", DType::BF16, {5, 3}, Role::Param});
  TensorId wpe = p.tensors.add({"wpe", DType::BF16, {4, 3}, Role::Param});
  Op emb = make_op(OpKind::EmbeddingForward, {.B = 1, .T = 2, .C = 3},
                   {{act, Access::Write}, {tokens, Access::Read}, {wte, Access::Read}, {wpe, Access::Read}});
  EXPECT_DOUBLE_EQ(op_bytes_moved(p, emb), 3 * 6 * 2.0 + 4 * 2.0);
  // Without a position table (Llama): out and the wte rows.
  emb.operands.pop_back();
  EXPECT_DOUBLE_EQ(op_bytes_moved(p, emb), 2 * 6 * 2.0 + 4 * 2.0);
  // The backward: dout read, the dwte rows (and dwpe rows) read and written.
  Op bwd = make_op(OpKind::EmbeddingBackward, {.B = 1, .T = 2, .C = 3},
                   {{wte, Access::Update}, {act, Access::Read}, {tokens, Access::Read}, {wpe, Access::Update}});
  EXPECT_DOUBLE_EQ(op_bytes_moved(p, bwd), 5 * 6 * 2.0 + 4 * 2.0);
  bwd.operands.pop_back();
  EXPECT_DOUBLE_EQ(op_bytes_moved(p, bwd), 3 * 6 * 2.0 + 4 * 2.0);
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

namespace {

// The first error of validating p, "" when it validates.
std::string error_of(const Program& p) {
  Status st = p.validate();
  return st.is_ok() ? "" : st.message();
}

// A program of one forward and one backward op of `fwd`/`bwd` kind over qkv-layout
// tensors [B,T,(NH+2·KVH)·D] with these attrs (RoPE), or of width `qkv_width` when given.
Program rope_program(const OpAttrs& a, int64_t width) {
  Program p;
  TensorId x = p.tensors.add({"x", DType::BF16, {a.B, a.T, width}, Role::Input});
  TensorId y = p.tensors.add({"y", DType::BF16, {a.B, a.T, width}, Role::Activation});
  TensorId dy = p.tensors.add({"dy", DType::BF16, {a.B, a.T, width}, Role::Input});
  TensorId dx = p.tensors.add({"dx", DType::BF16, {a.B, a.T, width}, Role::Activation});
  p.inputs = {x, dy};
  p.add_op(make_op(OpKind::RopeForward, a, {{y, Access::Write}, {x, Access::Read}}));
  p.add_op(make_op(OpKind::RopeBackward, a, {{dx, Access::Write}, {dy, Access::Read}}));
  p.outputs = {y, dx};
  return p;
}

}  // namespace

// RoPE over grouped-query qkv: sizes (NH+2·KVH)·D per row, KVH dividing NH, an even head
// size and sane rope parameters, each refused with the attr named.
TEST(OpRegistry, RopeValidatesHeadsSizesAndParams) {
  const OpAttrs a{.B = 2, .T = 3, .C = 32, .NH = 4, .KVH = 2, .rope = {.theta = 500000.0f}};
  const int64_t D = 8, width = (4 + 2 * 2) * D;
  EXPECT_EQ(error_of(rope_program(a, width)), "");
  EXPECT_EQ(op_flops(rope_program(a, width).ops[0]), 0.0);  // memory-bound
  // KVH = 0 means NH: [q C | k C | v C].
  OpAttrs mha = a;
  mha.KVH = 0;
  EXPECT_EQ(error_of(rope_program(mha, 3 * 32)), "");
  // A wrong width names the slot and the formula.
  std::string e = error_of(rope_program(a, 3 * 32));
  EXPECT_TRUE(contains(e, "op 0 'probe' (RopeForward): operand 0 (out) 'y' has 576 elements; expected "
                          "B*T*(NH+2*KVH)*C/NH = 384"))
      << e;
  OpAttrs bad = a;
  bad.KVH = 3;
  e = error_of(rope_program(bad, width));
  EXPECT_TRUE(contains(e, "(RopeForward): attrs.KVH = 3 does not divide attrs.NH = 4")) << e;
  bad = a;
  bad.C = 20;  // D = 5
  e = error_of(rope_program(bad, (4 + 4) * 5));
  EXPECT_TRUE(contains(e, "(RopeForward): head size C/NH = 5 is odd")) << e;
  bad = a;
  bad.rope.theta = 0;
  e = error_of(rope_program(bad, width));
  EXPECT_TRUE(contains(e, "attrs.rope.theta is 0")) << e;
  bad = a;
  bad.rope = {.theta = 500000.0f, .llama3 = true, .factor = 32, .low_freq_factor = 4, .high_freq_factor = 1,
              .original_context = 8192};
  e = error_of(rope_program(bad, width));
  EXPECT_TRUE(contains(e, "attrs.rope (llama3)") && contains(e, "low_freq_factor < high_freq_factor")) << e;
  bad.rope.low_freq_factor = 1;
  bad.rope.high_freq_factor = 4;
  EXPECT_EQ(error_of(rope_program(bad, width)), "");
  bad.rope.original_context = 0;
  e = error_of(rope_program(bad, width));
  EXPECT_TRUE(contains(e, "original_context 0")) << e;
}

TEST(OpRegistry, SwiGluValidatesGateAndUpHalves) {
  const int64_t N = 6, I = 10;
  Program p;
  TensorId x = p.tensors.add({"x", DType::BF16, {N, 2 * I}, Role::Input});
  TensorId y = p.tensors.add({"y", DType::BF16, {N, I}, Role::Activation});
  TensorId dy = p.tensors.add({"dy", DType::BF16, {N, I}, Role::Input});
  TensorId dx = p.tensors.add({"dx", DType::BF16, {N, 2 * I}, Role::Activation});
  p.inputs = {x, dy};
  p.add_op(make_op(OpKind::SwiGluForward, {.C = I, .N = N}, {{y, Access::Write}, {x, Access::Read}}));
  p.add_op(make_op(OpKind::SwiGluBackward, {.C = I, .N = N},
                   {{dx, Access::Write}, {x, Access::Read}, {dy, Access::Read}}));
  p.outputs = {y, dx};
  EXPECT_EQ(error_of(p), "");
  EXPECT_EQ(op_flops(p.ops[1]), 0.0);
  Program q = p;
  q.ops[0].operands[1].tensor = dy;  // [N,I] where [N,2I] is due
  std::string e = error_of(q);
  EXPECT_TRUE(contains(e, "(SwiGluForward): operand 1 (inp) 'dy' has 60 elements; expected N*2C (gate | up) = 120"))
      << e;
  q = p;
  q.ops[1].operands[0].tensor = y;
  e = error_of(q);
  EXPECT_TRUE(contains(e, "(SwiGluBackward): operand 0 (dinp) 'y' has 60 elements; expected N*2C (gate | up) = 120"))
      << e;
  q = p;
  q.ops[1].attrs.N = 0;
  e = error_of(q);
  EXPECT_TRUE(contains(e, "(SwiGluBackward): attrs.N is 0; must be positive")) << e;
}

// Attention over grouped-query qkv: B*T*(NH+2*KVH)*D elements, KVH dividing NH; the
// flops count the query heads only (the same as multi-head attention of width C).
TEST(OpRegistry, GroupedQueryAttentionSizesAndFlops) {
  const int64_t B = 2, T = 4, NH = 4, KVH = 1, D = 8, C = NH * D;
  const int64_t width = (NH + 2 * KVH) * D;
  Program p;
  TensorId qkv = p.tensors.add({"qkv", DType::BF16, {B, T, width}, Role::Input});
  TensorId out = p.tensors.add({"out", DType::BF16, {B, T, C}, Role::Activation});
  TensorId lse = p.tensors.add({"lse", DType::F32, {B, NH, T}, Role::Activation});
  TensorId dout = p.tensors.add({"dout", DType::BF16, {B, T, C}, Role::Input});
  TensorId dqkv = p.tensors.add({"dqkv", DType::BF16, {B, T, width}, Role::Activation});
  p.inputs = {qkv, dout};
  const OpAttrs a{.B = B, .T = T, .C = C, .NH = NH, .KVH = KVH};
  p.add_op(make_op(OpKind::AttentionForward, a, {{out, Access::Write}, {lse, Access::Write}, {qkv, Access::Read}}));
  p.add_op(make_op(OpKind::AttentionBackward, a,
                   {{dqkv, Access::Write}, {dout, Access::Read}, {qkv, Access::Read}, {out, Access::Read},
                    {lse, Access::Read}}));
  p.outputs = {dqkv};
  EXPECT_EQ(error_of(p), "");
  EXPECT_DOUBLE_EQ(op_flops(p.ops[0]), 2.0 * B * T * T * C);
  EXPECT_DOUBLE_EQ(op_flops(p.ops[1]), 4.0 * B * T * T * C);
  Program q = p;
  q.ops[0].attrs.KVH = 0;  // multi-head: qkv would be B*T*3C
  std::string e = error_of(q);
  EXPECT_TRUE(contains(e, "(AttentionForward): operand 2 (qkv) 'qkv' has 384 elements; expected "
                          "B*T*(NH+2*KVH)*C/NH = 768"))
      << e;
  q = p;
  q.ops[1].attrs.KVH = 3;
  e = error_of(q);
  EXPECT_TRUE(contains(e, "op 1 'probe' (AttentionBackward): attrs.KVH = 3 does not divide attrs.NH = 4")) << e;
  q = p;
  q.ops[1].attrs.KVH = -2;
  e = error_of(q);
  EXPECT_TRUE(contains(e, "attrs.KVH = -2")) << e;
}

// Llama has no position table: EmbeddingForward takes three operands.
TEST(OpRegistry, EmbeddingWithoutPositionTable) {
  Program p;
  TensorId tokens = p.tensors.add({"tokens", DType::I32, {2, 3}, Role::Input});
  TensorId wte = p.tensors.add({"wte", DType::BF16, {7, 4}, Role::Param});
  TensorId out = p.tensors.add({"out", DType::BF16, {2, 3, 4}, Role::Activation});
  p.inputs = {tokens};
  p.add_op(make_op(OpKind::EmbeddingForward, {.B = 2, .T = 3, .C = 4},
                   {{out, Access::Write}, {tokens, Access::Read}, {wte, Access::Read}}));
  p.outputs = {out};
  EXPECT_EQ(error_of(p), "");
  EXPECT_EQ(op_required_operands(OpKind::EmbeddingForward), 3u);
}

// A product with its GELU: pre and out [N,OC] forward; backward dpre and pre [N,C] (the
// product's input side), dout [N,OC]; the parameter gradients apart; whole products
// only; the flops of one product each, priced as the products they stand for.
TEST(OpRegistry, MatmulGeluValidatesWholeProducts) {
  const int64_t N = 4, C = 6, OC = 10, C2 = 3;
  Program p;
  TensorId x = p.tensors.add({"x", DType::BF16, {N, C}, Role::Input});
  TensorId w = p.tensors.add({"w", DType::BF16, {OC, C}, Role::Param});
  TensorId b = p.tensors.add({"b", DType::BF16, {OC}, Role::Param});
  TensorId w2 = p.tensors.add({"w2", DType::BF16, {C2, OC}, Role::Param});
  TensorId dw2 = p.tensors.add({"dw2", DType::BF16, {C2, OC}, Role::Grad});
  TensorId db2 = p.tensors.add({"db2", DType::BF16, {C2}, Role::Grad});
  TensorId out = p.tensors.add({"out", DType::BF16, {N, OC}, Role::Activation});
  TensorId pre = p.tensors.add({"pre", DType::BF16, {N, OC}, Role::Activation});
  TensorId dy = p.tensors.add({"dy", DType::BF16, {N, C2}, Role::Input});
  TensorId dpre = p.tensors.add({"dpre", DType::BF16, {N, OC}, Role::Activation});
  p.inputs = {x, dy};
  p.add_op(make_op(OpKind::MatmulGeluForward, {.C = C, .OC = OC, .N = N},
                   {{out, Access::Write}, {pre, Access::Write}, {x, Access::Read}, {w, Access::Read}, {b, Access::Read}}));
  p.add_op(make_op(OpKind::MatmulWeightBackward, {.C = OC, .OC = C2, .N = N},
                   {{dw2, Access::Update}, {dy, Access::Read}, {out, Access::Read}, {db2, Access::Update}}));
  p.add_op(make_op(OpKind::MatmulGeluBackward, {.C = OC, .OC = C2, .N = N},
                   {{dpre, Access::Write}, {dy, Access::Read}, {w2, Access::Read}, {pre, Access::Read}}));
  p.outputs = {dpre};
  EXPECT_EQ(error_of(p), "");
  EXPECT_DOUBLE_EQ(op_flops(p.ops[0]), 2.0 * N * C * OC);
  EXPECT_DOUBLE_EQ(op_flops(p.ops[1]) + op_flops(p.ops[2]),
                   op_flops(make_op(OpKind::MatmulBackward, {.C = OC, .OC = C2, .N = N})));
  EXPECT_EQ(op_info(OpKind::MatmulGeluForward).priced_as, OpKind::MatmulForward);
  EXPECT_EQ(op_info(OpKind::MatmulGeluBackward).priced_as, OpKind::MatmulBackward);
  EXPECT_EQ(op_info(OpKind::MatmulWeightBackward).priced_as, OpKind::MatmulBackward);
  Program q = p;
  q.ops[0].operands[1].tensor = dy;  // pre [N,C2] where [N,OC] is due
  std::string e = error_of(q);
  EXPECT_TRUE(contains(e, "(MatmulGeluForward): operand 1 (pre) 'dy' has 12 elements; expected N*OC = 40")) << e;
  q = p;
  q.ops[2].operands[3].tensor = x;  // pre [N,C] where the product's input side [N,OC] is due
  e = error_of(q);
  EXPECT_TRUE(contains(e, "(MatmulGeluBackward): operand 3 (pre) 'x' has 24 elements; expected N*C = 40")) << e;
  q = p;
  q.ops[1].operands[3].tensor = b;  // dbias [OC] where [C2] is due
  e = error_of(q);
  EXPECT_TRUE(contains(e, "(MatmulWeightBackward): operand 3 (dbias) 'b' has 10 elements; expected OC = 3")) << e;
  q = p;
  q.ops[0].attrs.block = 5;
  e = error_of(q);
  EXPECT_TRUE(contains(e, "(MatmulGeluForward): attrs ld = 0, begin = 0, block = 5: this product is whole")) << e;
}

// A product with the residual add after it: out and residual [N,OC], inp [N,C], weight
// [OC,C], bias [OC]; whole products only; the flops and bytes of one product, priced
// as a MatmulForward and a ResidualForward.
TEST(OpRegistry, MatmulResidualValidatesWholeProducts) {
  const int64_t N = 4, C = 6, OC = 10;
  Program p;
  TensorId x = p.tensors.add({"x", DType::BF16, {N, C}, Role::Input});
  TensorId w = p.tensors.add({"w", DType::BF16, {OC, C}, Role::Param});
  TensorId b = p.tensors.add({"b", DType::BF16, {OC}, Role::Param});
  TensorId res = p.tensors.add({"res", DType::BF16, {N, OC}, Role::Input});
  TensorId out = p.tensors.add({"out", DType::BF16, {N, OC}, Role::Activation});
  // For the wrong sizes below.
  TensorId wide = p.tensors.add({"wide", DType::BF16, {N, OC}, Role::Input});
  TensorId narrow = p.tensors.add({"narrow", DType::BF16, {N, C}, Role::Input});
  p.inputs = {x, res, wide, narrow};
  p.add_op(make_op(OpKind::MatmulResidualForward, {.C = C, .OC = OC, .N = N},
                   {{out, Access::Write}, {x, Access::Read}, {w, Access::Read}, {res, Access::Read}, {b, Access::Read}}));
  p.outputs = {out};
  EXPECT_EQ(error_of(p), "");
  EXPECT_DOUBLE_EQ(op_flops(p.ops[0]), op_flops(make_op(OpKind::MatmulForward, {.C = C, .OC = OC, .N = N})));
  // out, x, w, res and b once each (bf16).
  EXPECT_DOUBLE_EQ(op_bytes_moved(p, p.ops[0]), 2.0 * (N * OC + N * C + OC * C + N * OC + OC));
  EXPECT_EQ(op_info(OpKind::MatmulResidualForward).priced_as, OpKind::MatmulForward);
  EXPECT_EQ(op_info(OpKind::MatmulResidualForward).priced_with, OpKind::ResidualForward);
  // The residual add's part: residual and product read, out written, as ResidualForward.
  EXPECT_DOUBLE_EQ(op_info(OpKind::MatmulResidualForward).priced_with_bytes(p, p.ops[0]), 3 * 2.0 * N * OC);
  Program q = p;
  q.ops[0].operands.pop_back();  // no bias: valid
  EXPECT_EQ(error_of(q), "");
  q = p;
  q.ops[0].operands[3].tensor = narrow;  // residual [N,C] where [N,OC] is due
  std::string e = error_of(q);
  EXPECT_TRUE(
      contains(e, "(MatmulResidualForward): operand 3 (residual) 'narrow' has 24 elements; expected N*OC = 40"))
      << e;
  q = p;
  q.ops[0].operands[1].tensor = wide;  // inp [N,OC] where [N,C] is due
  e = error_of(q);
  EXPECT_TRUE(contains(e, "(MatmulResidualForward): operand 1 (inp) 'wide' has 40 elements; expected N*C = 24")) << e;
  q = p;
  q.ops[0].operands[4].tensor = wide;  // bias [N,OC] where [OC] is due
  e = error_of(q);
  EXPECT_TRUE(contains(e, "(MatmulResidualForward): operand 4 (bias) 'wide' has 40 elements; expected OC = 10")) << e;
  q = p;
  q.ops[0].operands[3].tensor = out;  // out as its own residual (the backend's default would read the product)
  e = error_of(q);
  EXPECT_TRUE(contains(e, "(MatmulResidualForward): operand 3 (residual) 'out' is the same tensor as operand 0")) << e;
  q = p;
  q.ops[0].attrs.begin = 2;
  e = error_of(q);
  EXPECT_TRUE(contains(e, "(MatmulResidualForward): attrs ld = 0, begin = 2, block = 0: this product is whole")) << e;
}
