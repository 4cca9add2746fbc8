// The residency state machine (plan/residency.h): what each instruction does to where
// a tensor's valid copies are, stepped by hand over a small plan, and what it refuses.
#include <gtest/gtest.h>

#include "plan/residency.h"
#include "sim/machine.h"
#include "sim/simulator.h"

using namespace spillway;

namespace {

// w (a Param at home on host) is fetched for op0: y = gelu(w); y goes to host, the
// op's own region is released; at the end w's device copy is dropped (clean on host).
struct Small {
  Program p;
  TensorId w, y;
  Plan plan;
  Small() {
    w = p.tensors.add({"w", DType::F32, {256}, Role::Param});
    y = p.tensors.add({"y", DType::F32, {256}, Role::Activation});
    p.add_op({.kind = OpKind::GeluForward,
              .name = "op0",
              .operands = {{y, Access::Write}, {w, Access::Read}},
              .attrs = {.n = 256}});
    plan.home = {Tier::Host, Tier::Device};
    plan.home_offset = {0, 0};
    plan.home_host_offset = {0, 0};
    plan.alignment = 256;
    plan.instructions = {{.kind = InstrKind::Fetch, .tensor = w, .offset = 0},
                         {.kind = InstrKind::Allocate, .tensor = y, .offset = 1024},
                         {.kind = InstrKind::Run, .op = 0},
                         {.kind = InstrKind::HostAllocate, .tensor = y, .offset = 4096},
                         {.kind = InstrKind::Evict, .tensor = y, .write_back = true},
                         {.kind = InstrKind::HostRelease, .tensor = y},
                         {.kind = InstrKind::Evict, .tensor = w, .write_back = false}};
  }
};

}  // namespace

TEST(Residency, StepsEachInstructionAndEndsAtHome) {
  Small s;
  ResidencyMachine m(s.p, s.plan, {.device = 1 << 20, .host = 1 << 20, .storage = 0});
  ASSERT_TRUE(m.start().is_ok());
  EXPECT_TRUE(m.valid(s.w, Tier::Host));
  EXPECT_FALSE(m.has_region(s.w));
  for (int step = 0; step < 2; ++step) {  // the same plan twice: the loop closes
    m.begin_step();
    ASSERT_TRUE(m.apply(0, s.plan.instructions[0]).is_ok());  // fetch w
    EXPECT_TRUE(m.valid(s.w, Tier::Device) && m.valid(s.w, Tier::Host));
    EXPECT_EQ(m.region_offset(s.w), 0u);
    ASSERT_TRUE(m.apply(1, s.plan.instructions[1]).is_ok());  // allocate y: a region, no value
    EXPECT_TRUE(m.has_region(s.y));
    EXPECT_FALSE(m.valid(s.y, Tier::Device));
    ASSERT_TRUE(m.apply(2, s.plan.instructions[2]).is_ok());  // run: y valid on device only
    EXPECT_TRUE(m.valid(s.y, Tier::Device));
    EXPECT_FALSE(m.valid(s.y, Tier::Host));
    ASSERT_TRUE(m.apply(3, s.plan.instructions[3]).is_ok());
    ASSERT_TRUE(m.apply(4, s.plan.instructions[4]).is_ok());  // evict y: on host, region gone
    EXPECT_TRUE(m.valid(s.y, Tier::Host));
    EXPECT_FALSE(m.has_region(s.y));
    ASSERT_TRUE(m.apply(5, s.plan.instructions[5]).is_ok());
    EXPECT_FALSE(m.has_host_buffer(s.y));
    ASSERT_TRUE(m.apply(6, s.plan.instructions[6]).is_ok());  // drop w's clean device copy
    EXPECT_FALSE(m.valid(s.w, Tier::Device));
    Status end = m.finish();
    EXPECT_TRUE(end.is_ok()) << end.message();
  }
  EXPECT_EQ(m.device_peak(), 2048u);  // w and y, 1 KiB each
  // Between steps a new value at home: valid there only.
  ASSERT_TRUE(m.write_at_home(s.w).is_ok());
  EXPECT_TRUE(m.valid(s.w, Tier::Host));
}

TEST(Residency, RefusesWhatThePlanCannotDo) {
  Small s;
  auto refused = [&](std::vector<Instruction> ins, const std::string& words) {
    ResidencyMachine m(s.p, s.plan, {.device = 1 << 20, .host = 1 << 20, .storage = 0});
    ASSERT_TRUE(m.start().is_ok());
    Status last = Status::ok();
    for (size_t i = 0; i < ins.size() && last.is_ok(); ++i) last = m.apply(i, ins[i]);
    if (last.is_ok()) last = m.finish();
    ASSERT_FALSE(last.is_ok()) << words;
    EXPECT_NE(last.message().find(words), std::string::npos) << last.message();
  };
  // The op reads w, which was never fetched.
  refused({{.kind = InstrKind::Allocate, .tensor = s.y, .offset = 1024}, {.kind = InstrKind::Run, .op = 0}},
          "op0 needs w on device");
  // Writing y back with no host buffer for it.
  refused({{.kind = InstrKind::Fetch, .tensor = s.w, .offset = 0},
           {.kind = InstrKind::Allocate, .tensor = s.y, .offset = 1024},
           {.kind = InstrKind::Run, .op = 0},
           {.kind = InstrKind::Evict, .tensor = s.y, .write_back = true}},
          "write-back of y without a host buffer");
  // Two regions over one byte.
  refused({{.kind = InstrKind::Fetch, .tensor = s.w, .offset = 0}, {.kind = InstrKind::Allocate, .tensor = s.y, .offset = 512}},
          "overlaps w");
  // The op never runs: the step is not whole.
  refused({}, "op0 runs 0 times");
  // y keeps its region past the end of the step.
  refused({{.kind = InstrKind::Fetch, .tensor = s.w, .offset = 0},
           {.kind = InstrKind::Allocate, .tensor = s.y, .offset = 1024},
           {.kind = InstrKind::Run, .op = 0},
           {.kind = InstrKind::Evict, .tensor = s.w, .write_back = false}},
          "y still holds a device region");
}

// The simulator steps the same machine: it stops where the machine refuses, and says why.
TEST(Residency, TheSimulatorStopsWhereTheMachineRefuses) {
  Small s;
  Machine machine = Machine::h200();
  SimResult ok = simulate(s.p, s.plan, machine);
  EXPECT_EQ(ok.plan_error, "");
  Plan bad = s.plan;
  bad.instructions.erase(bad.instructions.begin() + 3);  // no host buffer for y's write-back
  SimResult r = simulate(s.p, bad, machine);
  EXPECT_NE(r.plan_error.find("instruction 3 (evict): write-back of y without a host buffer"), std::string::npos)
      << r.plan_error;
}
