#include <gtest/gtest.h>

#include <string>

#include "program/program.h"

using namespace spillway;

namespace {

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// A small valid program: out = gelu(inp · wᵀ + b), then its backward.
struct Small {
  Program p;
  TensorId inp, w, b, dw, db, h, g, dg, dh, dinp;
  static constexpr int64_t N = 6, C = 4, OC = 5;
  Small() {
    inp = p.tensors.add({"inp", DType::F32, {N, C}, Role::Input});
    w = p.tensors.add({"w", DType::F32, {OC, C}, Role::Param});
    b = p.tensors.add({"b", DType::F32, {OC}, Role::Param});
    dw = p.tensors.add({"grad.w", DType::F32, {OC, C}, Role::Grad});
    db = p.tensors.add({"grad.b", DType::F32, {OC}, Role::Grad});
    h = p.tensors.add({"h", DType::F32, {N, OC}, Role::Activation});
    g = p.tensors.add({"g", DType::F32, {N, OC}, Role::Activation});
    dg = p.tensors.add({"dg", DType::F32, {N, OC}, Role::Input});
    dh = p.tensors.add({"dh", DType::F32, {N, OC}, Role::Scratch});
    dinp = p.tensors.add({"dinp", DType::F32, {N, C}, Role::Scratch});
    p.inputs = {inp, dg};
    p.add_op({.kind = OpKind::MatmulForward, .name = "fc.forward",
              .operands = {{h, Access::Write}, {inp, Access::Read}, {w, Access::Read}, {b, Access::Read}},
              .attrs = {.C = C, .OC = OC, .N = N}});
    p.add_op({.kind = OpKind::GeluForward, .name = "gelu.forward",
              .operands = {{g, Access::Write}, {h, Access::Read}},
              .attrs = {.n = N * OC}});
    p.add_op({.kind = OpKind::GeluBackward, .name = "gelu.backward",
              .operands = {{dh, Access::Write}, {h, Access::Read}, {dg, Access::Read}},
              .attrs = {.n = N * OC}, .phase = Phase::Backward});
    p.add_op({.kind = OpKind::MatmulBackward, .name = "fc.backward",
              .operands = {{dinp, Access::Write}, {dw, Access::Update}, {dh, Access::Read}, {inp, Access::Read},
                           {w, Access::Read}, {db, Access::Update}},
              .attrs = {.C = C, .OC = OC, .N = N}, .phase = Phase::Backward});
    p.outputs = {g};
  }
};

}  // namespace

TEST(Program, OpKindNames) {
  EXPECT_STREQ(op_kind_name(OpKind::Zero), "Zero");
  EXPECT_STREQ(op_kind_name(OpKind::MatmulBackward), "MatmulBackward");
  EXPECT_STREQ(op_kind_name(OpKind::CrossEntropyBackward), "CrossEntropyBackward");
  EXPECT_STREQ(op_kind_name(OpKind::AdamW), "AdamW");
}

TEST(Program, ValidProgramPasses) {
  Small s;
  Status st = s.p.validate();
  EXPECT_TRUE(st.is_ok()) << st.to_string();
}

TEST(Program, MatmulWithoutBiasIsValid) {
  Small s;
  s.p.ops[0].operands.pop_back();
  s.p.ops[3].operands.pop_back();
  EXPECT_TRUE(s.p.validate().is_ok());
}

TEST(Program, WrongOperandCountNamesOpAndCounts) {
  Small s;
  s.p.ops[1].operands.push_back({s.inp, Access::Read});
  Status st = s.p.validate();
  ASSERT_FALSE(st.is_ok());
  EXPECT_EQ(st.code(), StatusCode::InvalidArgument);
  EXPECT_TRUE(contains(st.message(), "op 1 'gelu.forward' (GeluForward)")) << st.message();
  EXPECT_TRUE(contains(st.message(), "has 3 operands")) << st.message();
  EXPECT_TRUE(contains(st.message(), "takes 2")) << st.message();

  Small t;
  t.p.ops[0].operands.resize(2);
  st = t.p.validate();
  ASSERT_FALSE(st.is_ok());
  EXPECT_TRUE(contains(st.message(), "takes 3 or 4")) << st.message();
}

TEST(Program, IdOutOfRange) {
  Small s;
  s.p.ops[1].operands[1].tensor = 99;
  Status st = s.p.validate();
  ASSERT_FALSE(st.is_ok());
  EXPECT_TRUE(contains(st.message(), "'gelu.forward'")) << st.message();
  EXPECT_TRUE(contains(st.message(), "operand 1 (inp)")) << st.message();
  EXPECT_TRUE(contains(st.message(), "tensor id 99 is out of range")) << st.message();

  Small t;
  t.p.ops[1].operands[1].tensor = kNoTensor;
  EXPECT_FALSE(t.p.validate().is_ok());

  Small u;
  u.p.outputs.push_back(1234);
  st = u.p.validate();
  ASSERT_FALSE(st.is_ok());
  EXPECT_TRUE(contains(st.message(), "outputs[1]")) << st.message();
}

TEST(Program, ReadBeforeWriteNamesOperandAndTensor) {
  Small s;
  std::swap(s.p.ops[0], s.p.ops[1]);  // gelu reads h before the matmul writes it
  Status st = s.p.validate();
  ASSERT_FALSE(st.is_ok());
  EXPECT_TRUE(contains(st.message(), "op 0 'gelu.forward'")) << st.message();
  EXPECT_TRUE(contains(st.message(), "operand 1 (inp) 'h'")) << st.message();
  EXPECT_TRUE(contains(st.message(), "read before any earlier op writes it")) << st.message();
}

TEST(Program, UpdateOfUnwrittenActivationIsRejectedButGradIsPersistent) {
  Small s;
  // Grads persist across steps: updating them without a Zero first is allowed.
  EXPECT_TRUE(s.p.validate().is_ok());
  // An activation updated before anything wrote it is not.
  TensorId logits = s.p.tensors.add({"logits", DType::F32, {2, 3}, Role::Activation});
  TensorId losses = s.p.tensors.add({"losses", DType::F32, {2}, Role::Activation});
  TensorId targets = s.p.tensors.add({"targets", DType::I32, {2}, Role::Input});
  s.p.add_op({.kind = OpKind::CrossEntropyBackward, .name = "ce",
              .operands = {{losses, Access::Write}, {logits, Access::Update}, {targets, Access::Read}},
              .attrs = {.N = 2, .V = 3, .scale = 0.5f}});
  Status st = s.p.validate();
  ASSERT_FALSE(st.is_ok());
  EXPECT_TRUE(contains(st.message(), "operand 1 (logits) 'logits' is updated before")) << st.message();
}

TEST(Program, WrongAccessAndDtype) {
  Small s;
  s.p.ops[0].operands[1].access = Access::Update;
  Status st = s.p.validate();
  ASSERT_FALSE(st.is_ok());
  EXPECT_TRUE(contains(st.message(), "operand 1 (inp) 'inp' has access Update; MatmulForward needs Read"))
      << st.message();
  // A column block of out after the first may Update it (vocab tiles), but only once written.
  s = Small();
  s.p.ops[0].operands[0].access = Access::Update;
  st = s.p.validate();
  ASSERT_FALSE(st.is_ok());
  EXPECT_TRUE(contains(st.message(), "operand 0 (out) 'h' is updated before any earlier op writes it")) << st.message();

  Program p;
  TensorId qkv = p.tensors.add({"qkv", DType::BF16, {1, 2, 12}, Role::Input});
  TensorId out = p.tensors.add({"out", DType::BF16, {1, 2, 4}, Role::Activation});
  TensorId lse = p.tensors.add({"lse", DType::BF16, {1, 2, 2}, Role::Activation});
  p.add_op({.kind = OpKind::AttentionForward, .name = "attn",
            .operands = {{out, Access::Write}, {lse, Access::Write}, {qkv, Access::Read}},
            .attrs = {.B = 1, .T = 2, .C = 4, .NH = 2}});
  st = p.validate();
  ASSERT_FALSE(st.is_ok());
  EXPECT_TRUE(contains(st.message(), "operand 1 (lse) 'lse' has dtype bf16; expected f32")) << st.message();

  Program q;
  TensorId tok = q.tensors.add({"tokens", DType::F32, {1, 2}, Role::Input});
  TensorId wte = q.tensors.add({"wte", DType::F32, {5, 4}, Role::Param});
  TensorId wpe = q.tensors.add({"wpe", DType::F32, {2, 4}, Role::Param});
  TensorId enc = q.tensors.add({"enc", DType::F32, {1, 2, 4}, Role::Activation});
  q.add_op({.kind = OpKind::EmbeddingForward, .name = "emb",
            .operands = {{enc, Access::Write}, {tok, Access::Read}, {wte, Access::Read}, {wpe, Access::Read}},
            .attrs = {.B = 1, .T = 2, .C = 4}});
  st = q.validate();
  ASSERT_FALSE(st.is_ok());
  EXPECT_TRUE(contains(st.message(), "(tokens) 'tokens' has dtype f32; expected i32")) << st.message();
}

TEST(Program, ElementCountsMustMatchAttrs) {
  Small s;
  s.p.ops[0].attrs.OC = 3;
  Status st = s.p.validate();
  ASSERT_FALSE(st.is_ok());
  EXPECT_TRUE(contains(st.message(), "operand 0 (out) 'h' has 30 elements; expected N*ld (ld = OC unless given) = 18")) << st.message();

  Small t;
  t.p.ops[1].attrs.n = 0;
  st = t.p.validate();
  ASSERT_FALSE(st.is_ok());
  EXPECT_TRUE(contains(st.message(), "attrs.n is 0; must be positive")) << st.message();

  Program p;
  TensorId qkv = p.tensors.add({"qkv", DType::F32, {1, 2, 12}, Role::Input});
  TensorId out = p.tensors.add({"out", DType::F32, {1, 2, 4}, Role::Activation});
  TensorId lse = p.tensors.add({"lse", DType::F32, {1, 3, 2}, Role::Activation});
  p.add_op({.kind = OpKind::AttentionForward, .name = "attn",
            .operands = {{out, Access::Write}, {lse, Access::Write}, {qkv, Access::Read}},
            .attrs = {.B = 1, .T = 2, .C = 4, .NH = 3}});
  st = p.validate();
  ASSERT_FALSE(st.is_ok());
  EXPECT_TRUE(contains(st.message(), "not divisible by attrs.NH")) << st.message();
}

TEST(Program, SameTensorTwiceInOneOp) {
  Small s;
  s.p.ops[0].operands[3].tensor = s.w;
  Status st = s.p.validate();
  ASSERT_FALSE(st.is_ok());
  EXPECT_TRUE(contains(st.message(), "is the same tensor as operand 2")) << st.message();
}

// ClipScale reads one packed squared_norms[P] tensor (what gpt.cpp builds); the
// form with one operand per norm has no kernel behind it and is refused.
TEST(Program, ClipScaleWithOneOperandPerNormIsRefused) {
  Small s;
  TensorId sq0 = s.p.tensors.add({"sqnorm.w", DType::F32, {1}, Role::Scratch});
  TensorId sq1 = s.p.tensors.add({"sqnorm.b", DType::F32, {1}, Role::Scratch});
  TensorId sn = s.p.tensors.add({"clip.scale_norm", DType::F32, {2}, Role::Activation});
  s.p.add_op({.kind = OpKind::SquaredNorm, .name = "sqnorm.w", .operands = {{sq0, Access::Write}, {s.dw, Access::Read}},
              .attrs = {.n = Small::OC * Small::C}, .phase = Phase::Optimizer});
  s.p.add_op({.kind = OpKind::SquaredNorm, .name = "sqnorm.b", .operands = {{sq1, Access::Write}, {s.db, Access::Read}},
              .attrs = {.n = Small::OC}, .phase = Phase::Optimizer});
  OpAttrs clip{.P = 2};
  clip.scale = 1.0f;
  s.p.add_op({.kind = OpKind::ClipScale, .name = "clip",
              .operands = {{sn, Access::Write}, {sq0, Access::Read}, {sq1, Access::Read}}, .attrs = clip,
              .phase = Phase::Optimizer});
  Status st = s.p.validate();
  ASSERT_FALSE(st.is_ok());
  EXPECT_TRUE(contains(st.message(), "'clip' (ClipScale): has 3 operands; ClipScale takes 2")) << st.message();

  // Two operands, but the norms are not one P-element tensor.
  s.p.ops.back().operands.pop_back();
  st = s.p.validate();
  ASSERT_FALSE(st.is_ok());
  EXPECT_TRUE(contains(st.message(), "operand 1 (squared_norms) 'sqnorm.w' has 1 elements; expected P = 2"))
      << st.message();
}

TEST(Program, PackedSquaredNormsAreValidToo) {
  Small s;
  TensorId sq = s.p.tensors.add({"sqnorms", DType::F32, {2}, Role::Scratch});
  TensorId sn = s.p.tensors.add({"clip.scale_norm", DType::F32, {2}, Role::Activation});
  s.p.add_op({.kind = OpKind::Zero, .name = "sqnorms.zero", .operands = {{sq, Access::Write}}, .attrs = {}});
  s.p.add_op({.kind = OpKind::SquaredNorm, .name = "sqnorm.w", .operands = {{sq, Access::Update}, {s.dw, Access::Read}},
              .attrs = {.n = Small::OC * Small::C, .index = 0}, .phase = Phase::Optimizer});
  s.p.add_op({.kind = OpKind::SquaredNorm, .name = "sqnorm.b", .operands = {{sq, Access::Update}, {s.db, Access::Read}},
              .attrs = {.n = Small::OC, .index = 1}, .phase = Phase::Optimizer});
  OpAttrs clip{.P = 2};
  clip.scale = 1.0f;
  s.p.add_op({.kind = OpKind::ClipScale, .name = "clip", .operands = {{sn, Access::Write}, {sq, Access::Read}},
              .attrs = clip, .phase = Phase::Optimizer});
  Status st = s.p.validate();
  EXPECT_TRUE(st.is_ok()) << st.to_string();

  s.p.ops[s.p.ops.size() - 2].attrs.index = 2;
  st = s.p.validate();
  ASSERT_FALSE(st.is_ok());
  EXPECT_TRUE(contains(st.message(), "elements [2, 3) are outside out_sq's 2 elements")) << st.message();
}

TEST(Program, OutputNeverWritten) {
  Small s;
  TensorId never = s.p.tensors.add({"never", DType::F32, {1}, Role::Activation});
  s.p.outputs.push_back(never);
  Status st = s.p.validate();
  ASSERT_FALSE(st.is_ok());
  EXPECT_TRUE(contains(st.message(), "'never' is never written")) << st.message();
}

TEST(Program, FlopsCountMatmulsAndCausalAttention) {
  Small s;  // N=6, C=4, OC=5: forward 2·6·4·5 = 240, backward 480
  EXPECT_DOUBLE_EQ(s.p.flops(), 240.0 + 480.0);

  Program p;
  TensorId qkv = p.tensors.add({"qkv", DType::F32, {2, 8, 48}, Role::Input});
  TensorId out = p.tensors.add({"out", DType::F32, {2, 8, 16}, Role::Activation});
  TensorId lse = p.tensors.add({"lse", DType::F32, {2, 4, 8}, Role::Activation});
  TensorId dout = p.tensors.add({"dout", DType::F32, {2, 8, 16}, Role::Input});
  TensorId dqkv = p.tensors.add({"dqkv", DType::F32, {2, 8, 48}, Role::Scratch});
  p.add_op({.kind = OpKind::AttentionForward, .name = "attn.forward",
            .operands = {{out, Access::Write}, {lse, Access::Write}, {qkv, Access::Read}},
            .attrs = {.B = 2, .T = 8, .C = 16, .NH = 4}});
  p.add_op({.kind = OpKind::AttentionBackward, .name = "attn.backward",
            .operands = {{dqkv, Access::Write}, {dout, Access::Read}, {qkv, Access::Read}, {out, Access::Read},
                         {lse, Access::Read}},
            .attrs = {.B = 2, .T = 8, .C = 16, .NH = 4}, .phase = Phase::Backward});
  ASSERT_TRUE(p.validate().is_ok()) << p.validate().to_string();
  // forward 2·B·T²·C = 2·2·64·16 = 4096; backward twice that.
  EXPECT_DOUBLE_EQ(p.flops(), 4096.0 + 8192.0);
}
