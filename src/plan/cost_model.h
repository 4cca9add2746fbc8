// CostModel: the time questions the planner asks while it plans. The simulator
// answers them for a Machine (sim/simulator.h, class Simulator); the planner never
// sees the machine itself, so the plan module comes before the sim module.
//
//   Simulator sim(Machine::h200());                          // a CostModel
//   auto plan = make_plan(program, sim, budgets, options);    // plan/planner.h
//   double s = sim.op_seconds(program, 17);                   // what the planner asks
//
// A test can plan against a cost model of its own (every query answered by hand).
#pragma once

#include <cstddef>
#include <cstdint>

#include "plan/plan.h"
#include "program/program.h"

namespace spillway {

// The planner plans candidates on several threads at once: op_seconds, copy_seconds,
// duplex_copy_seconds and host_adam_seconds may be called concurrently (they are
// const questions); step_seconds only from the thread that called make_plan.
class CostModel {
 public:
  virtual ~CostModel() = default;
  // Seconds op `op_index` of `program` takes where it runs (device or host).
  virtual double op_seconds(const Program& program, size_t op_index) const = 0;
  // Seconds one copy of `bytes` takes over the link, host→device (h2d) or back, alone.
  virtual double copy_seconds(uint64_t bytes, bool h2d) const = 0;
  // Seconds `bytes` take over the slower link direction while both directions move
  // data at once.
  virtual double duplex_copy_seconds(double bytes) const = 0;
  // Seconds the host optimizer (AdamW) takes for `params` parameters while the
  // copies of a step run beside it.
  virtual double host_adam_seconds(double params) const = 0;
  // The predicted time of one step of `plan` alone (its host work's tail included),
  // `program`'s ops placed as the plan places them (Plan::op_place): what plans are
  // ranked by.
  virtual double step_seconds(const Program& program, const Plan& plan) const = 0;
};

}  // namespace spillway
