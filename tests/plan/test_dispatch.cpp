// exec/dispatch.cpp's table agrees with the op registry: a host call exactly for the
// registry's host ops, and operand counts checked against the registry's slots
// before any backend call, with an error naming the op and its kind.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "exec/dispatch.h"
#include "program/op_registry.h"

using namespace spillway;

namespace {

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

Op probe(OpKind k) {
  Op op;
  op.kind = k;
  op.name = "probe";
  return op;
}

}  // namespace

TEST(Dispatch, HostCallsExactlyForTheRegistrysHostOps) {
  for (size_t i = 0; i < kOpKindCount; ++i) {
    const OpKind k = static_cast<OpKind>(i);
    EXPECT_EQ(has_host_implementation(k), op_info(k).host) << op_kind_name(k);
    if (op_info(k).host) continue;
    Status st = run_host_op(probe(k), {}, DType::F32, OptimizerStep{});
    ASSERT_FALSE(st.is_ok());
    EXPECT_TRUE(contains(st.message(), std::string("op probe (") + op_kind_name(k) + ") has no host implementation"))
        << st.message();
  }
  EXPECT_FALSE(has_host_implementation(static_cast<OpKind>(kOpKindCount)));
}

TEST(Dispatch, OperandCountsComeFromTheRegistry) {
  auto backend = make_backend("cpu", {.threads = 1});
  ASSERT_TRUE(backend.ok()) << backend.status().to_string();
  Program program;
  for (size_t i = 0; i < kOpKindCount; ++i) {
    const OpKind k = static_cast<OpKind>(i);
    const size_t lo = op_required_operands(k), hi = op_info(k).slots.size();
    const std::string expected = std::to_string(lo) + (lo == hi ? "" : ".." + std::to_string(hi));
    for (size_t n : {lo - 1, hi + 1}) {
      if (n == static_cast<size_t>(-1)) continue;
      const std::vector<void*> ptrs(n, nullptr);  // refused before any pointer is used
      Status st = run_device_op(**backend, program, probe(k), ptrs, OptimizerStep{});
      ASSERT_FALSE(st.is_ok()) << op_kind_name(k) << " ran with " << n << " operands";
      EXPECT_TRUE(contains(st.message(), std::string("op probe (") + op_kind_name(k) + "): " + std::to_string(n) +
                                             " operands, expected " + expected))
          << st.message();
      if (op_info(k).host) {
        st = run_host_op(probe(k), ptrs, DType::F32, OptimizerStep{});
        ASSERT_FALSE(st.is_ok());
        EXPECT_TRUE(contains(st.message(), "operands, expected " + expected)) << st.message();
      }
    }
  }
  Status st = run_device_op(**backend, program, probe(static_cast<OpKind>(kOpKindCount)), {}, OptimizerStep{});
  ASSERT_FALSE(st.is_ok());
  EXPECT_TRUE(contains(st.message(), "op probe: unknown kind")) << st.message();
}

namespace {

// Runs `op` on the CPU backend with host vectors as its operands (the CPU backend's
// device memory is host memory) and returns them afterwards.
std::vector<std::vector<float>> run_on_cpu(const Op& op, std::vector<std::vector<float>> operands) {
  auto backend = make_backend("cpu", {.threads = 1});
  EXPECT_TRUE(backend.ok()) << backend.status().to_string();
  std::vector<void*> ptrs;
  for (auto& v : operands) ptrs.push_back(v.data());
  Program program;
  Status st = run_device_op(**backend, program, op, ptrs, OptimizerStep{});
  EXPECT_TRUE(st.is_ok()) << st.to_string();
  return operands;
}

std::vector<float> ramp(size_t n, float step) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = std::sin(static_cast<float>(i) * step);
  return v;
}

}  // namespace

// The Llama ops reach their backend calls with their attrs: KVH = 0 is NH (the same
// bits as KVH = NH), a grouped-query KVH is passed on, RoPE gets D = C/NH and its
// params, SwiGLU gets I = C.
TEST(Dispatch, LlamaOpsPassTheirAttrs) {
  const int B = 1, T = 3, NH = 4, D = 4, C = NH * D;
  Op attn = probe(OpKind::AttentionForward);
  attn.attrs = {.B = B, .T = T, .C = C, .NH = NH};
  const auto mha = run_on_cpu(attn, {std::vector<float>(B * T * C), std::vector<float>(B * NH * T),
                                     ramp(B * T * 3 * C, 0.37f)});
  attn.attrs.KVH = NH;
  EXPECT_EQ(run_on_cpu(attn, mha), mha);
  // Two key/value heads: qkv is [B,T,(NH+4)·D]; the backend call with KVH = 2 gives the same.
  attn.attrs.KVH = 2;
  const std::vector<float> qkv = ramp(B * T * (NH + 4) * D, 0.29f);
  const auto gqa = run_on_cpu(attn, {std::vector<float>(B * T * C), std::vector<float>(B * NH * T), qkv});
  auto backend = make_backend("cpu", {.threads = 1});
  ASSERT_TRUE(backend.ok());
  std::vector<float> out(B * T * C), lse(B * NH * T);
  (*backend)->attention_forward(out.data(), lse.data(), qkv.data(), B, T, C, NH, 2);
  EXPECT_EQ(gqa[0], out);
  EXPECT_EQ(gqa[1], lse);

  Op rope = probe(OpKind::RopeForward);
  const RopeParams params{.theta = 50.0f};
  rope.attrs = {.B = B, .T = T, .C = C, .NH = NH, .KVH = 2, .rope = params};
  const auto rotated = run_on_cpu(rope, {std::vector<float>(qkv.size()), qkv});
  std::vector<float> want(qkv.size());
  (*backend)->rope_forward(want.data(), qkv.data(), B, T, NH, 2, D, params);
  EXPECT_EQ(rotated[0], want);
  rope.kind = OpKind::RopeBackward;
  const auto back = run_on_cpu(rope, {std::vector<float>(qkv.size()), rotated[0]});
  (*backend)->rope_backward(want.data(), rotated[0].data(), B, T, NH, 2, D, params);
  EXPECT_EQ(back[0], want);

  Op swiglu = probe(OpKind::SwiGluForward);
  swiglu.attrs = {.C = 5, .N = 3};
  const std::vector<float> gate_up = ramp(30, 0.41f);
  const auto act = run_on_cpu(swiglu, {std::vector<float>(15), gate_up});
  std::vector<float> act_want(15);
  (*backend)->swiglu_forward(act_want.data(), gate_up.data(), 3, 5);
  EXPECT_EQ(act[0], act_want);
}

// A product with its GELU (MatmulGeluForward; MatmulWeightBackward and
// MatmulGeluBackward) reaches the backend with its operands in slot order: on the CPU
// backend it gives the bits of the product (MatmulBackward) and the GELU run apart,
// with and without the bias.
TEST(Dispatch, MatmulGeluOpsAreTheProductAndItsGelu) {
  const int N = 5, C = 7, OC = 12;
  auto backend = make_backend("cpu", {.threads = 1});
  ASSERT_TRUE(backend.ok());
  Backend& b = **backend;
  const std::vector<float> inp = ramp(N * C, 0.31f), weight = ramp(OC * C, 0.17f), bias = ramp(OC, 0.53f);
  for (bool with_bias : {true, false}) {
    SCOPED_TRACE(with_bias ? "with bias" : "without bias");
    Op fwd = probe(OpKind::MatmulGeluForward);
    fwd.attrs = {.C = C, .OC = OC, .N = N};
    std::vector<std::vector<float>> operands = {std::vector<float>(N * OC), std::vector<float>(N * OC), inp, weight};
    if (with_bias) operands.push_back(bias);
    const auto got = run_on_cpu(fwd, operands);
    std::vector<float> pre(N * OC), out(N * OC);
    b.matmul_forward(pre.data(), inp.data(), weight.data(), with_bias ? bias.data() : nullptr, N, C, OC);
    b.gelu_forward(out.data(), pre.data(), pre.size());
    EXPECT_EQ(got[0], out);
    EXPECT_EQ(got[1], pre);

    // Backward of a product [N,OC] -> [N,C2] whose input is gelu(pre) (fc2, taking
    // the forward's out): its parameter gradients, then its input gradient through the GELU.
    const int C2 = 3;
    const std::vector<float> w2 = ramp(C2 * OC, 0.23f), dout = ramp(N * C2, 0.71f);
    const std::vector<float> dw0 = ramp(C2 * OC, 0.11f), db0 = ramp(C2, 0.19f);
    Op wbwd = probe(OpKind::MatmulWeightBackward);
    wbwd.attrs = {.C = OC, .OC = C2, .N = N};
    std::vector<std::vector<float>> wops = {dw0, dout, out};
    if (with_bias) wops.push_back(db0);
    const auto wgot = run_on_cpu(wbwd, wops);
    Op bwd = probe(OpKind::MatmulGeluBackward);
    bwd.attrs = {.C = OC, .OC = C2, .N = N};
    const auto back = run_on_cpu(bwd, {std::vector<float>(N * OC), dout, w2, pre});
    std::vector<float> dpre(N * OC), dw = dw0, db = db0;
    b.matmul_backward(dpre.data(), dw.data(), with_bias ? db.data() : nullptr, dout.data(), out.data(), w2.data(), N,
                      OC, C2);
    b.gelu_backward(dpre.data(), pre.data(), dpre.data(), dpre.size());
    EXPECT_EQ(back[0], dpre);
    EXPECT_EQ(wgot[0], dw);
    if (with_bias) {
      EXPECT_EQ(wgot[3], db);
    }
    EXPECT_NE(back[0], std::vector<float>(N * OC));
  }
}

// A product with the residual add after it (MatmulResidualForward) reaches the backend
// with its operands in slot order: on the CPU backend it gives the bits of what the
// programs ran before, the product into a scratch tensor, then a ResidualForward op
// (out, residual, scratch), with and without the bias.
TEST(Dispatch, MatmulResidualOpIsTheProductThenTheResidualAdd) {
  const int N = 5, C = 7, OC = 6;
  auto backend = make_backend("cpu", {.threads = 1});
  ASSERT_TRUE(backend.ok());
  const std::vector<float> inp = ramp(N * C, 0.31f), weight = ramp(OC * C, 0.17f), bias = ramp(OC, 0.53f);
  const std::vector<float> residual = ramp(N * OC, 0.43f);
  for (bool with_bias : {true, false}) {
    SCOPED_TRACE(with_bias ? "with bias" : "without bias");
    Op fused = probe(OpKind::MatmulResidualForward);
    fused.attrs = {.C = C, .OC = OC, .N = N};
    std::vector<std::vector<float>> operands = {std::vector<float>(N * OC), inp, weight, residual};
    if (with_bias) operands.push_back(bias);
    const auto got = run_on_cpu(fused, operands);

    std::vector<float> proj(N * OC);
    (*backend)->matmul_forward(proj.data(), inp.data(), weight.data(), with_bias ? bias.data() : nullptr, N, C, OC);
    Op add = probe(OpKind::ResidualForward);
    add.attrs = {.n = N * OC};
    const std::vector<float> want = run_on_cpu(add, {std::vector<float>(N * OC), residual, proj})[0];
    EXPECT_EQ(got[0], want);
    EXPECT_NE(got[0], proj);  // the residual was added
    EXPECT_EQ(got[3], residual);  // and left as it was
  }
}
