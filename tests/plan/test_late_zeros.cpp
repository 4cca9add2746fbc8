// Gradients zeroed late (PlannerOptions::late_zeros): each gradient's Zero runs just
// before its first backward instead of at the step's start, so a gradient that rests
// off the device is never written back as zeros and fetched again. The plan stays
// valid and the run gives the resident run's losses and weights bit for bit.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "model/model.h"
#include "plan/planner.h"
#include "sim/machine.h"
#include "sim/simulator.h"
#include "support/train_support.h"

using namespace spillway;
using testing_support::GPTCase;
using testing_support::TrainRun;
using testing_support::train_gpt;

namespace {

GPTCase small_model() { return {ModelConfig{2, 64, 2, 32, 64}, StepShape{2, 32, 2}}; }

// Gradients that go to host and come back before their first backward (the round trip
// of zeros): a Fetch of the gradient, or an Evict that writes it back, before the
// first Run of an op other than its Zero that touches it.
int gradients_round_tripped(const Program& program, const Plan& plan) {
  int n = 0;
  for (size_t t = 0; t < program.tensors.size(); ++t) {
    if (program.tensors.info(static_cast<TensorId>(t)).role != Role::Grad) continue;
    for (const Instruction& in : plan.instructions) {
      if (in.kind == InstrKind::Run) {
        const Op& op = program.ops[static_cast<size_t>(in.op)];
        bool touches = false;
        for (const Operand& o : op.operands) touches = touches || o.tensor == static_cast<TensorId>(t);
        if (touches && op.kind != OpKind::Zero) break;  // its first backward: later moves are real ones
        continue;
      }
      if (in.tensor != static_cast<TensorId>(t)) continue;
      if (in.kind == InstrKind::Fetch || (in.kind == InstrKind::Evict && in.write_back)) {
        ++n;
        break;
      }
    }
  }
  return n;
}

}  // namespace

TEST(LateZeros, NoGradientRoundTripAndTheSameBits) {
  const GPTCase model = small_model();
  TrainRun ref = train_gpt(model, {}, {.policy = Policy::Resident}, 3);
  ASSERT_TRUE(ref.status.is_ok()) << ref.status.to_string();
  auto program = build_training_program(model.cfg, model.shape, DType::F32);
  ASSERT_TRUE(program.ok()) << program.status().to_string();
  int round_trips_at_start = 0;
  for (int divisor : {3, 4, 6}) {
    Budgets b;
    b.device = ref.plan.device_bytes / static_cast<uint64_t>(divisor);
    const std::string tag = "budget 1/" + std::to_string(divisor);
    PlannerOptions o{.policy = Policy::Planned, .optimizer_on_host = 1};
    o.device_optimizer_bytes = 0;  // every gradient rests on host
    o.late_zeros = 0;
    auto at_start = make_plan(*program, Simulator(Machine::cpu_dev_box()), b, o);
    ASSERT_TRUE(at_start.ok()) << tag << ": " << at_start.status().to_string();
    round_trips_at_start += gradients_round_tripped(*program, *at_start);
    o.late_zeros = 1;
    auto late = make_plan(*program, Simulator(Machine::cpu_dev_box()), b, o);
    ASSERT_TRUE(late.ok()) << tag << ": " << late.status().to_string();
    EXPECT_TRUE(late->validate(*program, b).is_ok()) << tag;
    EXPECT_NE(late->description.find("zeroed before their backward"), std::string::npos) << late->description;
    EXPECT_EQ(gradients_round_tripped(*program, *late), 0) << tag << ": " << late->description;

    TrainRun r = train_gpt(model, b, o, 3);
    ASSERT_TRUE(r.status.is_ok()) << tag << ": " << r.status.to_string();
    testing_support::expect_same_run(r, ref, "late zeros, " + tag);
  }
  // The budgets exercise what late zeros remove.
  EXPECT_GT(round_trips_at_start, 0) << "no budget wrote a zeroed gradient back at the step's start";
}

// auto (-1) plans both and keeps the one the cost model predicts faster: never slower
// by the cost model than either forced choice.
TEST(LateZeros, AutoKeepsTheFasterPrediction) {
  const GPTCase model = small_model();
  auto program = build_training_program(model.cfg, model.shape, DType::F32);
  ASSERT_TRUE(program.ok());
  auto resident = make_plan(*program, Simulator(Machine::cpu_dev_box()), {}, {.policy = Policy::Resident, .alignment = 64});
  ASSERT_TRUE(resident.ok());
  Budgets b;
  b.device = resident->device_bytes / 4;
  const Simulator sim(Machine::cpu_dev_box());
  auto predicted = [&](int late_zeros) {
    PlannerOptions o{.policy = Policy::Planned, .optimizer_on_host = 1, .alignment = 64};
    o.device_optimizer_bytes = 0;
    o.late_zeros = late_zeros;
    auto plan = make_plan(*program, sim, b, o);
    EXPECT_TRUE(plan.ok()) << plan.status().to_string();
    return plan.ok() ? sim.step_seconds(placed_as_planned(*program, *plan), *plan) : 0.0;
  };
  const double chosen = predicted(-1), start = predicted(0), late = predicted(1);
  EXPECT_LE(chosen, std::min(start, late) * (1 + 1e-9));
}
