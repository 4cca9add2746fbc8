// Per-kind op costs (Machine::op_fits, fit_op_kinds): a fitted kind costs a fixed
// time, its work at its rate and (kinds with flops) its bytes at a bytes rate, plus
// the fixed cost per op; an unmeasured kind keeps the class rule; fitting timed ops
// of several shapes gives back the costs they were timed at. Every figure in the
// costing tests is a binary fraction, so those expectations are exact.
#include <gtest/gtest.h>

#include <cmath>

#include "program/op_registry.h"
#include "sim/machine.h"

namespace spillway {
namespace {

constexpr size_t kGelu = static_cast<size_t>(OpKind::GeluForward);
constexpr size_t kMatmulFwd = static_cast<size_t>(OpKind::MatmulForward);
constexpr size_t kMatmulBwd = static_cast<size_t>(OpKind::MatmulBackward);
constexpr size_t kResidual = static_cast<size_t>(OpKind::ResidualForward);

TensorId add(Program& p, const std::string& name, int64_t n, Role role = Role::Activation) {
  return p.tensors.add({name, DType::F32, {n}, role});
}

// op 0: gelu over 1024 floats (reads 4 KiB, writes 4 KiB: 8192 bytes)
// op 1: residual over 1024 floats (12288 bytes)
// op 2: matmul forward N 4, C 8, OC 16: 1024 flops (896 bytes)
// op 3: matmul backward, same shape: 2048 flops; bytes dinp 128 + dweight 2·512 +
//       dout 256 + inp 128 + weight 512 = 2048
// op 4: gelu over 2048 floats (16384 bytes)
// op 5: gelu over 1024 floats on the host (the host optimizer's rule, never a kind rate)
Program sample() {
  Program p;
  const TensorId x = add(p, "x", 1024), y = add(p, "y", 1024), z = add(p, "z", 1024);
  const TensorId inp = add(p, "inp", 32), w = add(p, "w", 128, Role::Param), out = add(p, "out", 64);
  const TensorId dinp = add(p, "dinp", 32), dw = add(p, "dw", 128, Role::Grad), dout = add(p, "dout", 64);
  const TensorId big_in = add(p, "big_in", 2048), big_out = add(p, "big_out", 2048), host_out = add(p, "host_out", 1024);
  p.add_op({.kind = OpKind::GeluForward, .name = "gelu", .operands = {{y, Access::Write}, {x, Access::Read}},
            .attrs = {.n = 1024}});
  p.add_op({.kind = OpKind::ResidualForward, .name = "residual",
            .operands = {{z, Access::Write}, {x, Access::Read}, {y, Access::Read}}, .attrs = {.n = 1024}});
  p.add_op({.kind = OpKind::MatmulForward, .name = "fc",
            .operands = {{out, Access::Write}, {inp, Access::Read}, {w, Access::Read}},
            .attrs = {.C = 8, .OC = 16, .N = 4}});
  p.add_op({.kind = OpKind::MatmulBackward, .name = "fc.backward",
            .operands = {{dinp, Access::Write}, {dw, Access::Update}, {dout, Access::Read}, {inp, Access::Read},
                         {w, Access::Read}},
            .attrs = {.C = 8, .OC = 16, .N = 4}});
  p.add_op({.kind = OpKind::GeluForward, .name = "gelu.big",
            .operands = {{big_out, Access::Write}, {big_in, Access::Read}}, .attrs = {.n = 2048}});
  p.add_op({.kind = OpKind::GeluForward, .name = "gelu.host",
            .operands = {{host_out, Access::Write}, {x, Access::Read}}, .attrs = {.n = 1024}, .place = Place::Host});
  return p;
}

Machine slow_machine() {
  Machine m;
  m.matmul_flops_per_s = 1024;
  m.attention_flops_per_s = 1024;
  m.device_bytes_per_s = 2048;
  m.op_launch_s = 0.25;
  m.host_adam_params_per_s = 512;
  return m;
}

// What ops timed alone sum to beyond their step comes off each evenly, never below 0;
// ops that fit within the step stay as timed.
TEST(OpFits, SynchronizationBeyondTheStepComesOffEachOp) {
  std::vector<OpTiming> ops = {{.seconds = 10e-6}, {.seconds = 1e-3}, {.seconds = 3e-6}, {.seconds = 2e-3}};
  // 3.013 ms timed against a 2.981 ms step: 32 us over, 8 us off each (the 3 us op to 0,
  // whose 5 us short is not taken from the others: the step the fits see ends a
  // little above 2.981 ms).
  const double each = take_off_synchronization(&ops, 2.981e-3);
  EXPECT_NEAR(each, 8e-6, 1e-12);
  EXPECT_NEAR(ops[0].seconds, 2e-6, 1e-12);
  EXPECT_NEAR(ops[1].seconds, 992e-6, 1e-12);
  EXPECT_EQ(ops[2].seconds, 0.0);
  EXPECT_NEAR(ops[3].seconds, 1992e-6, 1e-12);
  std::vector<OpTiming> within = {{.seconds = 1e-3}, {.seconds = 2e-3}};
  EXPECT_EQ(take_off_synchronization(&within, 3.5e-3), 0.0);
  EXPECT_EQ(within[0].seconds, 1e-3);
  EXPECT_EQ(within[1].seconds, 2e-3);
  std::vector<OpTiming> none;
  EXPECT_EQ(take_off_synchronization(&none, 1e-3), 0.0);
  EXPECT_EQ(take_off_synchronization(&within, 0), 0.0);  // no step time: nothing known
}

TEST(OpFits, TheWorkOfEachKind) {
  const Program p = sample();
  EXPECT_EQ(op_rate_work(p, p.ops[0]), 8192);   // bytes: no flops
  EXPECT_EQ(op_rate_work(p, p.ops[1]), 12288);
  EXPECT_EQ(op_rate_work(p, p.ops[2]), 1024);   // flops, not its 896 bytes
  EXPECT_EQ(op_rate_work(p, p.ops[3]), 2048);
  EXPECT_EQ(op_bytes_moved(p, p.ops[2]), 896);
  EXPECT_EQ(op_bytes_moved(p, p.ops[3]), 2048);
}

// A fused kind on a machine without a fit of its own (MatmulGeluForward: a product and
// its GELU) is priced as the product's kind over its flops and bytes plus the GELU's
// kind over the GELU's bytes; with the class rule, the GELU as its own kernel; its own
// fit, once measured, wins.
TEST(OpFits, AFusedKindIsPricedAsTheKindsItStandsFor) {
  Program p;
  // N 4, C 8, OC 16: 1024 flops; out and pre [4,16] F32 (256 bytes each), inp 128,
  // weight 512: 1152 bytes; the GELU's part: pre read, out written, 512 bytes.
  const TensorId inp = add(p, "inp", 32, Role::Input), w = add(p, "w", 128, Role::Param);
  const TensorId out = add(p, "out", 64), pre = add(p, "pre", 64);
  p.inputs = {inp};
  p.add_op({.kind = OpKind::MatmulGeluForward, .name = "fc",
            .operands = {{out, Access::Write}, {pre, Access::Write}, {inp, Access::Read}, {w, Access::Read}},
            .attrs = {.C = 8, .OC = 16, .N = 4}});
  ASSERT_TRUE(p.validate().is_ok()) << p.validate().to_string();
  EXPECT_EQ(op_bytes_moved(p, p.ops[0]), 1152);
  Machine m = slow_machine();
  // The class rule: max(1024 / 1024, 1152 / 2048) + 0.25, and the GELU 512 / 2048 + 0.25.
  EXPECT_EQ(m.op_seconds(p, 0), 1.25 + 0.5);
  m.op_fits[kGelu] = {.rate = 4096};
  m.op_fits[kMatmulFwd] = {.fixed_s = 0.5, .rate = 256, .bytes_per_s = 128};
  // 0.25 + 0.5 + 1024 / 256 + 1152 / 128, then 0.25 + 512 / 4096.
  EXPECT_EQ(m.op_seconds(p, 0), 0.25 + 0.5 + 4 + 9 + 0.25 + 0.125);
  m.op_fits[kGelu] = {};  // the GELU's kind unmeasured: the product alone
  EXPECT_EQ(m.op_seconds(p, 0), 0.25 + 0.5 + 4 + 9);
  m.op_fits[static_cast<size_t>(OpKind::MatmulGeluForward)] = {.fixed_s = 0.125, .rate = 1024};
  EXPECT_EQ(m.op_seconds(p, 0), 0.25 + 0.125 + 1);
}

// The same for a product with the residual add after it (MatmulResidualForward): the
// product's kind over its flops and bytes plus ResidualForward's over the add's bytes.
TEST(OpFits, AProductWithItsResidualIsPricedAsTheProductAndTheAdd) {
  Program p;
  // N 4, C 8, OC 16: 1024 flops; out and residual [4,16] F32 (256 bytes each), inp
  // 128, weight 512: 1152 bytes; the add's part: residual and product read, out
  // written, 768 bytes.
  const TensorId inp = add(p, "inp", 32, Role::Input), w = add(p, "w", 128, Role::Param);
  const TensorId res = add(p, "res", 64, Role::Input), out = add(p, "out", 64);
  p.inputs = {inp, res};
  p.add_op({.kind = OpKind::MatmulResidualForward, .name = "proj",
            .operands = {{out, Access::Write}, {inp, Access::Read}, {w, Access::Read}, {res, Access::Read}},
            .attrs = {.C = 8, .OC = 16, .N = 4}});
  ASSERT_TRUE(p.validate().is_ok()) << p.validate().to_string();
  EXPECT_EQ(op_bytes_moved(p, p.ops[0]), 1152);
  Machine m = slow_machine();
  // The class rule: max(1024 / 1024, 1152 / 2048) + 0.25, and the add 768 / 2048 + 0.25:
  // here what the product (896 bytes) and a ResidualForward cost apart.
  EXPECT_EQ(m.op_seconds(p, 0), 1.25 + 0.625);
  m.op_fits[kResidual] = {.rate = 4096};
  m.op_fits[kMatmulFwd] = {.fixed_s = 0.5, .rate = 256, .bytes_per_s = 128};
  // 0.25 + 0.5 + 1024 / 256 + 1152 / 128, then 0.25 + 768 / 4096.
  EXPECT_EQ(m.op_seconds(p, 0), 0.25 + 0.5 + 4 + 9 + 0.25 + 0.1875);
  m.op_fits[kResidual] = {};  // the add's kind unmeasured: the product alone
  EXPECT_EQ(m.op_seconds(p, 0), 0.25 + 0.5 + 4 + 9);
  m.op_fits[static_cast<size_t>(OpKind::MatmulResidualForward)] = {.fixed_s = 0.125, .rate = 1024};
  EXPECT_EQ(m.op_seconds(p, 0), 0.25 + 0.125 + 1);
}

TEST(OpFits, AFittedKindTakesItsTermsAndTheOthersKeepTheClassRule) {
  const Program p = sample();
  Machine m = slow_machine();
  // Nothing measured: the class rule, max(flops / class rate, bytes / device rate) + fixed cost.
  EXPECT_EQ(m.op_seconds(p, 0), 8192.0 / 2048 + 0.25);          // 4.25
  EXPECT_EQ(m.op_seconds(p, 1), 12288.0 / 2048 + 0.25);         // 6.25
  EXPECT_EQ(m.op_seconds(p, 2), 1024.0 / 1024 + 0.25);          // compute 1 > memory 0.4375
  EXPECT_EQ(m.op_seconds(p, 3), 2048.0 / 1024 + 0.25);          // compute 2 > memory 1
  EXPECT_EQ(m.op_seconds(p, 5), 1024.0 / 512);                   // host: elements at the host rate
  m.op_fits[kGelu] = {.rate = 4096};                             // bytes/s alone
  m.op_fits[kMatmulFwd] = {.fixed_s = 0.5, .rate = 256, .bytes_per_s = 128};
  EXPECT_TRUE(m.op_fit(OpKind::GeluForward).measured());
  EXPECT_FALSE(m.op_fit(OpKind::ResidualForward).measured());
  EXPECT_EQ(m.op_seconds(p, 0), 8192.0 / 4096 + 0.25);          // 2.25
  EXPECT_EQ(m.op_seconds(p, 4), 16384.0 / 4096 + 0.25);         // 4.25
  // 0.25 + 0.5 fixed + 1024 flops / 256 + 896 bytes / 128: the terms add up.
  EXPECT_EQ(m.op_seconds(p, 2), 0.25 + 0.5 + 4 + 7);
  EXPECT_EQ(m.op_seconds(p, 1), 12288.0 / 2048 + 0.25);         // unmeasured kinds as before
  EXPECT_EQ(m.op_seconds(p, 3), 2048.0 / 1024 + 0.25);
  EXPECT_EQ(m.op_seconds(p, 5), 1024.0 / 512);                  // host ops: never a kind fit
  m.op_fits[kGelu] = {.fixed_s = 1};                             // a fixed time alone
  EXPECT_EQ(m.op_seconds(p, 0), 1.25);
  EXPECT_EQ(m.op_seconds(p, 4), 1.25);
  // A measured time of the op itself still wins.
  m.measured_op_seconds = {0.5, 0, 0, 0, 0, 0};
  EXPECT_EQ(m.op_seconds(p, 0), 0.5);
  EXPECT_EQ(m.op_seconds(p, 4), 1.25);
}

TEST(OpFits, TimingsKeepTheTimedDeviceOps) {
  const Program p = sample();
  const std::vector<OpTiming> t = op_timings(p, {2.25, 0, 4.25, 2.25, 6.25, 100});
  ASSERT_EQ(t.size(), 4u);  // the residual was not timed; the host op is left out
  EXPECT_EQ(t[0].kind, OpKind::GeluForward);
  EXPECT_EQ(t[0].work, 8192);
  EXPECT_EQ(t[0].bytes, 8192);
  EXPECT_EQ(t[1].kind, OpKind::MatmulForward);
  EXPECT_EQ(t[1].work, 1024);
  EXPECT_EQ(t[1].bytes, 896);
  EXPECT_EQ(t[1].seconds, 4.25);
  EXPECT_EQ(t[3].kind, OpKind::GeluForward);
  EXPECT_EQ(op_timings(p, {2.25}).size(), 1u);  // fewer seconds than ops: the rest not timed
}

// Timings made from a known cost at several shapes give that cost back.
TEST(OpFits, FittedOverShapesGiveBackTheCostTheyWereTimedAt) {
  const double launch = 1e-5;
  const OpFit product{.fixed_s = 2e-4, .rate = 150e9, .bytes_per_s = 12e9};
  const OpFit gelu{.fixed_s = 3e-5, .rate = 8e9};
  std::vector<OpTiming> timed;
  for (double rows : {128.0, 512.0, 2048.0})
    for (auto [C, OC] : {std::pair{768.0, 2304.0}, std::pair{768.0, 768.0}, std::pair{3072.0, 768.0}}) {
      const double flops = 2 * rows * C * OC, bytes = 4 * (rows * C + C * OC + rows * OC);
      timed.push_back({OpKind::MatmulForward, flops, bytes,
                       launch + product.fixed_s + flops / product.rate + bytes / product.bytes_per_s});
      const double n = rows * OC * 8;
      timed.push_back({OpKind::GeluForward, n, n, launch + gelu.fixed_s + n / gelu.rate});
    }
  const auto fits = fit_op_kinds(timed, launch);
  const OpFit& f = fits[kMatmulFwd];
  EXPECT_NEAR(f.fixed_s, product.fixed_s, product.fixed_s * 1e-6);
  EXPECT_NEAR(f.rate, product.rate, product.rate * 1e-6);
  EXPECT_NEAR(f.bytes_per_s, product.bytes_per_s, product.bytes_per_s * 1e-6);
  EXPECT_NEAR(fits[kGelu].fixed_s, gelu.fixed_s, gelu.fixed_s * 1e-6);
  EXPECT_NEAR(fits[kGelu].rate, gelu.rate, gelu.rate * 1e-6);
  EXPECT_EQ(fits[kGelu].bytes_per_s, 0);  // a kind without flops has no bytes term
  for (size_t k = 0; k < kOpKindCount; ++k)
    if (k != kGelu && k != kMatmulFwd) {
      EXPECT_FALSE(fits[k].measured()) << op_kind_name(static_cast<OpKind>(k));
    }
}

TEST(OpFits, NoTermIsNegativeAndOneOpFitsARate) {
  const double launch = 0.25;
  // Times that fall with the work: the best line has a negative rate term, so the
  // fit keeps the best cost with every term positive (here a fixed time).
  const std::vector<OpTiming> falling = {{OpKind::GeluForward, 1000, 1000, 4.25}, {OpKind::GeluForward, 2000, 2000, 3.25},
                                         {OpKind::GeluForward, 4000, 4000, 2.25}};
  const OpFit f = fit_op_kinds(falling, launch)[kGelu];
  EXPECT_TRUE(f.measured());
  EXPECT_GE(f.fixed_s, 0);
  EXPECT_GE(f.rate, 0);
  EXPECT_GT(f.fixed_s, 0);
  EXPECT_EQ(f.rate, 0);
  // One op: a rate and a fixed time fit it equally; the rate stands (it grows with the work).
  const OpFit one = fit_op_kinds({{OpKind::MatmulBackward, 2048, 2048, 2.25}}, launch)[kMatmulBwd];
  EXPECT_EQ(one.fixed_s, 0);
  EXPECT_NEAR(one.rate, 1024, 1e-9);
  EXPECT_EQ(one.bytes_per_s, 0);
  Machine m = slow_machine();
  m.op_fits[kMatmulBwd] = one;
  const Program p = sample();
  EXPECT_NEAR(m.op_seconds(p, 3), 2.25, 1e-12);
  // A kind whose ops take no time beyond the fixed cost per op is not measured.
  const auto only_fixed = fit_op_kinds({{OpKind::GeluForward, 1000, 1000, 0.25}, {OpKind::GeluForward, 9, 9, 0.125}}, launch);
  EXPECT_FALSE(only_fixed[kGelu].measured());
  EXPECT_FALSE(fit_op_kinds({}, launch)[kGelu].measured());
}

}  // namespace
}  // namespace spillway
