// Per-kind op rates (Machine::op_rates, fit_op_rates): a measured kind costs its
// work at its own rate plus the fixed cost per op; an unmeasured kind keeps the class
// rule; fitting rates from timed ops and costing the same ops gives back their times.
// Every figure below is a binary fraction, so the expectations are exact.
#include <gtest/gtest.h>

#include "program/op_registry.h"
#include "sim/machine.h"

namespace spillway {
namespace {

constexpr size_t kGelu = static_cast<size_t>(OpKind::GeluForward);
constexpr size_t kResidual = static_cast<size_t>(OpKind::ResidualForward);
constexpr size_t kMatmulFwd = static_cast<size_t>(OpKind::MatmulForward);
constexpr size_t kMatmulBwd = static_cast<size_t>(OpKind::MatmulBackward);

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

TEST(OpRates, TheWorkOfEachKind) {
  const Program p = sample();
  EXPECT_EQ(op_rate_work(p, p.ops[0]), 8192);   // bytes: no flops
  EXPECT_EQ(op_rate_work(p, p.ops[1]), 12288);
  EXPECT_EQ(op_rate_work(p, p.ops[2]), 1024);   // flops, not its 896 bytes
  EXPECT_EQ(op_rate_work(p, p.ops[3]), 2048);
  EXPECT_EQ(op_bytes_moved(p, p.ops[2]), 896);
  EXPECT_EQ(op_bytes_moved(p, p.ops[3]), 2048);
}

TEST(OpRates, AMeasuredKindTakesItsWorkAtItsRateAndTheOthersKeepTheClassRule) {
  const Program p = sample();
  Machine m = slow_machine();
  // Nothing measured: the class rule, max(flops / class rate, bytes / device rate) + fixed cost.
  EXPECT_EQ(m.op_seconds(p, 0), 8192.0 / 2048 + 0.25);          // 4.25
  EXPECT_EQ(m.op_seconds(p, 1), 12288.0 / 2048 + 0.25);         // 6.25
  EXPECT_EQ(m.op_seconds(p, 2), 1024.0 / 1024 + 0.25);          // compute 1 > memory 0.4375
  EXPECT_EQ(m.op_seconds(p, 3), 2048.0 / 1024 + 0.25);          // compute 2 > memory 1
  EXPECT_EQ(m.op_seconds(p, 5), 1024.0 / 512);                   // host: elements at the host rate
  m.op_rates[kGelu] = 4096;       // bytes/s
  m.op_rates[kMatmulFwd] = 256;   // flop/s, below the class rate
  EXPECT_EQ(m.op_rate(OpKind::GeluForward), 4096);
  EXPECT_EQ(m.op_rate(OpKind::ResidualForward), 0);
  EXPECT_EQ(m.op_seconds(p, 0), 8192.0 / 4096 + 0.25);          // 2.25
  EXPECT_EQ(m.op_seconds(p, 4), 16384.0 / 4096 + 0.25);         // 4.25
  EXPECT_EQ(m.op_seconds(p, 2), 1024.0 / 256 + 0.25);           // 4.25: its bytes no longer count
  EXPECT_EQ(m.op_seconds(p, 1), 12288.0 / 2048 + 0.25);         // unmeasured kinds as before
  EXPECT_EQ(m.op_seconds(p, 3), 2048.0 / 1024 + 0.25);
  EXPECT_EQ(m.op_seconds(p, 5), 1024.0 / 512);                  // host ops: never a kind rate
  // A measured time of the op itself still wins.
  m.measured_op_seconds = {0.5, 0, 0, 0, 0, 0};
  EXPECT_EQ(m.op_seconds(p, 0), 0.5);
  EXPECT_EQ(m.op_seconds(p, 4), 4.25);
}

TEST(OpRates, FittedFromTimedOpsLessTheFixedCost) {
  const Program p = sample();
  // Seconds per op; 0: not timed (the residual); the host op is left out of the fit.
  const std::vector<double> seconds = {2.25, 0, 4.25, 2.25, 6.25, 100};
  const auto rates = fit_op_rates(p, seconds, 0.25);
  // Gelu: (8192 + 16384) bytes over (2 + 6) s; the two ops weigh by their work.
  EXPECT_EQ(rates[kGelu], 3072);
  EXPECT_EQ(rates[kMatmulFwd], 256);    // 1024 flops in 4 s
  EXPECT_EQ(rates[kMatmulBwd], 1024);   // 2048 flops in 2 s
  EXPECT_EQ(rates[kResidual], 0);       // not timed
  for (size_t k = 0; k < kOpKindCount; ++k)
    if (k != kGelu && k != kMatmulFwd && k != kMatmulBwd) {
      EXPECT_EQ(rates[k], 0) << op_kind_name(static_cast<OpKind>(k));
    }
  // Costing the ops with the fitted rates gives back the times of kinds with one op.
  Machine m = slow_machine();
  m.op_rates = rates;
  EXPECT_EQ(m.op_seconds(p, 2), 4.25);
  EXPECT_EQ(m.op_seconds(p, 3), 2.25);
  // and the kind's total time for a kind with several.
  EXPECT_EQ(m.op_seconds(p, 0) + m.op_seconds(p, 4), 2.25 + 6.25);
  // A kind whose times are all fixed cost has no rate (it would be infinite).
  const auto only_fixed = fit_op_rates(p, {0.25, 0, 0, 0, 0.125, 0}, 0.25);
  EXPECT_EQ(only_fixed[kGelu], 0);
  // Seconds for fewer ops than the program has: the rest are not timed.
  const auto short_list = fit_op_rates(p, {2.25}, 0.25);
  EXPECT_EQ(short_list[kGelu], 4096);
  EXPECT_EQ(short_list[kMatmulFwd], 0);
}

}  // namespace
}  // namespace spillway
