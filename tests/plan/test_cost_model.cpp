// The planner asks a CostModel (plan/cost_model.h) for every time it weighs; the
// simulator of a Machine is one. A cost model of the test's own steers the planner,
// which it could not if the planner consulted a machine or the simulator itself.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>

#include "model/model.h"
#include "plan/cost_model.h"
#include "plan/planner.h"
#include "sim/machine.h"
#include "sim/simulator.h"

using namespace spillway;

namespace {

Program small_program() {
  auto p = build_training_program(ModelConfig{2, 64, 2, 16, 64}, StepShape{2, 16, 2}, DType::F32);
  EXPECT_TRUE(p.ok()) << p.status().to_string();
  return *p;
}

// The simulator's answers, except that a step's predicted time is negated: the plan
// the simulator ranks slowest comes first. Counts the step-time questions.
class Reversed final : public CostModel {
 public:
  explicit Reversed(const Machine& m) : sim_(m) {}
  double op_seconds(const Program& p, size_t op) const override { return sim_.op_seconds(p, op); }
  double copy_seconds(uint64_t bytes, bool h2d) const override { return sim_.copy_seconds(bytes, h2d); }
  double duplex_copy_seconds(double bytes) const override { return sim_.duplex_copy_seconds(bytes); }
  double host_adam_seconds(double params) const override { return sim_.host_adam_seconds(params); }
  double step_seconds(const Program& p, const Plan& plan) const override {
    ++steps_asked;
    return -sim_.step_seconds(p, plan);
  }
  mutable int steps_asked = 0;

 private:
  Simulator sim_;
};

}  // namespace

TEST(CostModel, SimulatorAnswersAsItsMachine) {
  const Program program = small_program();
  const Machine m = Machine::cpu_dev_box();
  const Simulator sim(m);
  for (size_t i = 0; i < program.ops.size(); ++i) EXPECT_EQ(sim.op_seconds(program, i), m.op_seconds(program, i));
  EXPECT_EQ(sim.copy_seconds(1 << 20, true), m.copy_seconds(1 << 20, true));
  EXPECT_EQ(sim.copy_seconds(1 << 20, false), m.copy_seconds(1 << 20, false));
  EXPECT_EQ(sim.host_adam_seconds(1e6), 1e6 / m.host_adam_params_per_s);
  EXPECT_EQ(sim.duplex_copy_seconds(12.0),
            12.0 / (std::min(m.h2d_bytes_per_s, m.d2h_bytes_per_s) * m.duplex_factor));
  auto plan = make_plan(program, sim, {}, {.policy = Policy::Resident, .alignment = 64});
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  EXPECT_EQ(sim.step_seconds(program, *plan), simulate(program, *plan, m).step_s);
  // A resident step leaves nothing running: back to back it takes as long as alone.
  EXPECT_NEAR(simulate_loop_step(program, *plan, m), simulate(program, *plan, m).step_s, 1e-12);
}

// Policy auto ranks by the cost model's step time: under the reversed model its
// first candidate is the simulator's last, and its predicted time is the model's.
TEST(CostModel, AutoRanksByTheGivenCostModel) {
  const Program program = small_program();
  const Machine m = Machine::cpu_dev_box();
  auto resident = make_plan(program, Simulator(m), {}, {.policy = Policy::Resident, .alignment = 64});
  ASSERT_TRUE(resident.ok()) << resident.status().to_string();
  const Budgets b{.device = resident->device_bytes / 2};
  // The optimizer share and speculation are fixed: the share search and the choice of
  // speculative updates inside a candidate follow the cost model too, which would give
  // the two models different candidates.
  const PlannerOptions base{.policy = Policy::Auto, .optimizer_share_search = 0, .speculate = 1, .alignment = 64};
  int candidates = 0;
  for (;; ++candidates) {
    PlannerOptions o = base;
    o.auto_rank = candidates;
    if (!make_plan(program, Simulator(m), b, o).ok()) break;
  }
  ASSERT_GE(candidates, 2) << "the test needs candidates to rank";
  PlannerOptions last = base;
  last.auto_rank = candidates - 1;
  auto slowest = make_plan(program, Simulator(m), b, last);
  ASSERT_TRUE(slowest.ok()) << slowest.status().to_string();
  auto fastest = make_plan(program, Simulator(m), b, base);
  ASSERT_TRUE(fastest.ok()) << fastest.status().to_string();
  ASSERT_LT(fastest->predicted_step_s, slowest->predicted_step_s) << "the test needs candidates of different times";

  Reversed reversed(m);
  auto first = make_plan(program, reversed, b, base);
  ASSERT_TRUE(first.ok()) << first.status().to_string();
  EXPECT_EQ(reversed.steps_asked, candidates);
  EXPECT_EQ(first->predicted_step_s, -slowest->predicted_step_s);
}
