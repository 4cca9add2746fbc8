// Trains a small GPT through the planner and the executor on the CPU backend, for
// tests that compare a plan's losses with the resident run's.
//
//   TrainRun ref = train_gpt({ModelConfig{2, 32, 2, 16, 64}, StepShape{2, 16, 2}}, {}, {.policy = Policy::Resident}, 5);
//   TrainRun r = train_gpt(model, {.device = ref.plan.device_bytes / 4}, {.policy = Policy::Planned}, 5);
//   expect_same_losses(r.losses, ref.losses, "planned 1/4");
//   expect_same_run(r, ref, "planned 1/4");   // the losses and the final master weights
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "exec/executor.h"
#include "model/model.h"
#include "plan/planner.h"
#include "sim/machine.h"
#include "sim/simulator.h"

namespace spillway::testing_support {

struct GPTCase {
  ModelConfig cfg;
  StepShape shape;
};

struct TrainRun {
  Status status;
  std::vector<float> losses;  // [steps] mean loss of each step
  std::vector<StepMetrics> metrics;
  Plan plan;
  uint64_t backend_device_peak = 0;  // the backend's own count of device bytes allocated, at most
  std::vector<float> weights;        // after the last step: every master.<param> in ParamSpec order
};

// `steps` steps of `model` under `budgets`, parameters from init_parameter(seed 1234),
// random tokens with learnable targets (seed 42). Stops at the first error; after a
// failed step it checks that the executor refuses to run again.
inline TrainRun train_gpt(const GPTCase& model, const Budgets& budgets, const PlannerOptions& options, int steps,
                          const ExecutorOptions& exec_options = {}, const Machine& machine = Machine::cpu_dev_box()) {
  TrainRun r;
  auto backend = make_backend("cpu", {.threads = 2});
  if (!backend.ok()) {
    r.status = backend.status();
    return r;
  }
  auto program = build_training_program(model.cfg, model.shape, (*backend)->activation_dtype());
  if (!program.ok()) {
    r.status = program.status();
    return r;
  }
  PlannerOptions o = options;
  o.alignment = (*backend)->alignment();
  auto plan = make_plan(*program, Simulator(machine), budgets, o);
  if (!plan.ok()) {
    r.status = plan.status();
    return r;
  }
  r.plan = *plan;
  ExecutorOptions eo = exec_options;
  if (budgets.host != UINT64_MAX) eo.host_budget = budgets.host;
  if (budgets.storage != 0 && eo.storage_budget == 0) eo.storage_budget = budgets.storage;
  auto ex = Executor::create(**backend, *program, *plan, eo);
  if (!ex.ok()) {
    r.status = ex.status();
    return r;
  }
  Executor& e = **ex;
  for (const ParamSpec& spec : parameter_specs(model.cfg)) {
    std::vector<float> v = init_parameter(model.cfg, spec, 1234);
    for (std::string name : {spec.name, "master." + spec.name}) {
      const std::vector<TensorId> pieces = program->pieces(name);  // the tensor, or its vocab tiles in row order
      EXPECT_FALSE(pieces.empty()) << name;
      size_t offset = 0;
      for (TensorId t : pieces) {
        const size_t count = static_cast<size_t>(program->tensors.info(t).shape.numel());
        r.status = e.write_tensor(t, v.data() + offset, count * sizeof(float));
        if (!r.status.is_ok()) return r;
        offset += count;
      }
      EXPECT_EQ(offset, v.size()) << name;
    }
  }
  std::mt19937 rng(42);
  for (int step = 1; step <= steps; ++step) {
    for (int k = 0; k < model.shape.accum; ++k) {
      std::vector<int32_t> tokens(model.shape.B * model.shape.T), targets(tokens.size());
      for (auto& x : tokens) x = static_cast<int32_t>(rng() % model.cfg.vocab);
      for (size_t i = 0; i < targets.size(); ++i) targets[i] = (tokens[i] * 7 + 3) % model.cfg.vocab;
      std::string mb = "mb" + std::to_string(k) + ".";
      r.status = e.write_tensor(program->tensors.find(mb + "tokens"), tokens.data(), tokens.size() * 4);
      if (r.status.is_ok())
        r.status = e.write_tensor(program->tensors.find(mb + "targets"), targets.data(), targets.size() * 4);
      if (!r.status.is_ok()) return r;
    }
    r.status = e.run_step({.step = step, .lr = 1e-3f});
    if (!r.status.is_ok()) {
      // The executor refuses to run a state that a failed step left half moved.
      Status again = e.run_step({.step = step, .lr = 1e-3f});
      EXPECT_FALSE(again.is_ok());
      EXPECT_NE(again.message().find("previous step failed"), std::string::npos) << again.to_string();
      return r;
    }
    double sum = 0;
    size_t count = 0;
    for (int k = 0; k < model.shape.accum; ++k) {
      TensorId t = program->tensors.find("mb" + std::to_string(k) + ".losses");
      std::vector<float> l(program->tensors.info(t).shape.numel());
      r.status = e.read_tensor(t, l.data(), l.size() * 4);
      if (!r.status.is_ok()) return r;
      for (float x : l) sum += x;
      count += l.size();
    }
    r.losses.push_back(static_cast<float>(sum / count));
    r.metrics.push_back(e.metrics());
  }
  for (const ParamSpec& spec : parameter_specs(model.cfg))
    for (TensorId t : program->pieces("master." + spec.name)) {
      std::vector<float> v(static_cast<size_t>(program->tensors.info(t).shape.numel()));
      r.status = e.read_tensor(t, v.data(), v.size() * sizeof(float));
      if (!r.status.is_ok()) return r;
      r.weights.insert(r.weights.end(), v.begin(), v.end());
    }
  r.backend_device_peak = (*backend)->device_peak_bytes();
  return r;
}

inline void expect_same_losses(const std::vector<float>& a, const std::vector<float>& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i) {
    uint32_t x, y;
    std::memcpy(&x, &a[i], 4);
    std::memcpy(&y, &b[i], 4);
    EXPECT_EQ(x, y) << what << ": step " << i + 1 << " loss " << a[i] << " vs resident " << b[i];
  }
}

// The losses and the final master weights of `r`, bit for bit those of `ref`.
inline void expect_same_run(const TrainRun& r, const TrainRun& ref, const std::string& what) {
  expect_same_losses(r.losses, ref.losses, what);
  ASSERT_FALSE(ref.weights.empty()) << what << ": the reference run read no weights back";
  ASSERT_EQ(r.weights.size(), ref.weights.size()) << what;
  size_t differing = 0, first = 0;
  for (size_t i = 0; i < r.weights.size(); ++i)
    if (std::memcmp(&r.weights[i], &ref.weights[i], sizeof(float)) != 0 && differing++ == 0) first = i;
  EXPECT_EQ(differing, 0u) << what << ": " << differing << " master weights differ from the resident run's, the first "
                           << "at element " << first;
}

}  // namespace spillway::testing_support
