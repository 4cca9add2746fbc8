// Plan::validate checks what the executor will do with a plan — residency, value
// versions, and the executor's arenas with sizes rounded as the executor rounds them —
// so hand-corrupted plans are refused with a message naming what is wrong, and every
// plan the planner makes for the test models passes.
#include <algorithm>
#include <gtest/gtest.h>

#include "model/model.h"
#include "plan/planner.h"
#include "sim/machine.h"
#include "sim/simulator.h"
#include "core/size.h"

using namespace spillway;

namespace {

Program small_program() {
  auto p = build_training_program(ModelConfig{2, 32, 2, 16, 64}, StepShape{2, 16, 2}, DType::F32);
  EXPECT_TRUE(p.ok()) << p.status().to_string();
  return *p;
}

// A planned plan that keeps the optimizer state on host.
Plan host_state_plan(const Program& program, Budgets* budgets) {
  auto resident = make_plan(program, Simulator(Machine::cpu_dev_box()), {}, {.policy = Policy::Resident, .alignment = 64});
  EXPECT_TRUE(resident.ok()) << resident.status().to_string();
  budgets->device = resident->device_bytes / 4;
  auto plan = make_plan(program, Simulator(Machine::cpu_dev_box()), *budgets, {.policy = Policy::Planned, .alignment = 64});
  EXPECT_TRUE(plan.ok()) << plan.status().to_string();
  return *plan;
}

std::vector<TensorId> host_homed(const Program& program, const Plan& plan) {
  std::vector<TensorId> out;
  for (size_t t = 0; t < program.tensors.size(); ++t)
    if (program.is_persistent(static_cast<TensorId>(t)) && plan.home[t] == Tier::Host) out.push_back(static_cast<TensorId>(t));
  return out;
}


// The small accumulating program the auto tests rank, and half the device bytes its
// resident plan needs (several candidates fit there).
struct AutoCase {
  Program program;
  Budgets budgets;
};
AutoCase auto_case() {
  auto program = build_training_program(ModelConfig{2, 64, 2, 16, 64}, StepShape{2, 16, 2}, DType::F32);
  EXPECT_TRUE(program.ok()) << program.status().to_string();
  if (!program.ok()) return {};
  auto resident = make_plan(*program, Simulator(Machine::cpu_dev_box()), {}, {.policy = Policy::Resident, .alignment = 64});
  EXPECT_TRUE(resident.ok()) << resident.status().to_string();
  if (!resident.ok()) return {};
  Budgets b;
  b.device = resident->device_bytes / 2;
  return {std::move(*program), b};
}

// Policy auto's ranking: candidate k (PlannerOptions::auto_rank) is predicted no faster
// than candidate k-1, each validates, and asking past the last one is an error.
TEST(PlanValidate, AutoCandidatesComeInOrderOfPredictedTime) {
  const AutoCase c = auto_case();
  ASSERT_FALSE(c.program.ops.empty());
  const Program* program = &c.program;
  const Budgets& b = c.budgets;
  double previous = 0;
  int rank = 0;
  for (;; ++rank) {
    PlannerOptions o{.policy = Policy::Auto, .alignment = 64};
    o.auto_rank = rank;
    auto plan = make_plan(*program, Simulator(Machine::cpu_dev_box()), b, o);
    if (!plan.ok()) {
      EXPECT_EQ(plan.status().code(), StatusCode::InvalidArgument) << plan.status().to_string();
      EXPECT_NE(plan.status().to_string().find("plan(s) fit"), std::string::npos) << plan.status().to_string();
      break;
    }
    EXPECT_TRUE(plan->validate(*program, b).is_ok()) << "candidate " << rank + 1;
    EXPECT_GT(plan->predicted_step_s, 0.0);
    EXPECT_GE(plan->predicted_step_s, previous) << "candidate " << rank + 1;
    EXPECT_NE(plan->description.find("candidate " + std::to_string(rank + 1) + " of "), std::string::npos)
        << plan->description;
    previous = plan->predicted_step_s;
  }
  EXPECT_GE(rank, 2);  // more than one candidate fits at half the resident budget
}


bool same_instructions(const Plan& a, const Plan& b) {
  if (a.instructions.size() != b.instructions.size()) return false;
  for (size_t i = 0; i < a.instructions.size(); ++i) {
    const Instruction &x = a.instructions[i], &y = b.instructions[i];
    if (x.kind != y.kind || x.op != y.op || x.tensor != y.tensor || x.offset != y.offset ||
        x.write_back != y.write_back || x.free_host != y.free_host || x.recompute != y.recompute)
      return false;
  }
  return true;
}

// make_auto_plans (one search; the trainer's --auto-confirm) gives, in order, the plans
// make_plan gives for auto_rank 0, 1, 2, ... — instructions, homes, predictions and
// descriptions — starting at options.auto_rank, and fewer when fewer candidates plan.
TEST(PlanValidate, AutoPlansFromOneSearchAreThoseOfEachRank) {
  const AutoCase c = auto_case();
  ASSERT_FALSE(c.program.ops.empty());
  const Program* program = &c.program;
  const Budgets& b = c.budgets;
  const Simulator cost(Machine::cpu_dev_box());
  PlannerOptions o{.policy = Policy::Auto, .alignment = 64, .workspace_bytes = 4096};
  auto all = make_auto_plans(*program, cost, b, o, 1000);
  ASSERT_TRUE(all.ok()) << all.status().to_string();
  ASSERT_GE(all->size(), 3u);
  for (int start : {0, 1}) {
    o.auto_rank = start;
    auto some = make_auto_plans(*program, cost, b, o, 2);
    ASSERT_TRUE(some.ok()) << some.status().to_string();
    ASSERT_EQ(some->size(), 2u);
    for (size_t k = 0; k < some->size(); ++k) {
      PlannerOptions one = o;
      one.auto_rank = start + static_cast<int>(k);
      auto plan = make_plan(*program, cost, b, one);
      ASSERT_TRUE(plan.ok()) << plan.status().to_string();
      const Plan& got = (*some)[k];
      SCOPED_TRACE("candidate " + std::to_string(one.auto_rank + 1));
      EXPECT_TRUE(same_instructions(got, *plan));
      EXPECT_EQ(got.home, plan->home);
      EXPECT_EQ(got.description, plan->description);
      EXPECT_EQ(got.predicted_step_s, plan->predicted_step_s);
      EXPECT_EQ(got.workspace_bytes, plan->workspace_bytes);
      EXPECT_EQ(got.speculation.size(), plan->speculation.size());
      EXPECT_TRUE(same_instructions(got, (*all)[static_cast<size_t>(one.auto_rank)]));
    }
  }
  // The last candidate alone, and asking past it.
  o.auto_rank = static_cast<int>(all->size()) - 1;
  auto last = make_auto_plans(*program, cost, b, o, 4);
  ASSERT_TRUE(last.ok()) << last.status().to_string();
  EXPECT_EQ(last->size(), 1u);
  o.auto_rank = static_cast<int>(all->size());
  EXPECT_FALSE(make_auto_plans(*program, cost, b, o, 1).ok());
  o.auto_rank = 0;
  EXPECT_FALSE(make_auto_plans(*program, cost, b, o, 0).ok());
  o.policy = Policy::Planned;
  auto planned = make_auto_plans(*program, cost, b, o, 2);
  ASSERT_FALSE(planned.ok());
  EXPECT_NE(planned.status().message().find("expected auto"), std::string::npos) << planned.status().to_string();
}

// Planned keeps all the state on device, living on recomputation, when that leaves
// less than half the budget free but the simulator predicts it faster than
// offloading the optimizer; it never picks the slower of the two. (Width 512: at 256
// offloading wins at every budget, the host AdamW running beside the device's and
// the streamed state's.)
TEST(PlanValidate, PlannedKeepsCrowdedStateOnDeviceWhenThatIsFaster) {
  auto program = build_training_program(ModelConfig{4, 512, 4, 256, 512}, StepShape{8, 256, 4}, DType::BF16);
  ASSERT_TRUE(program.ok()) << program.status().to_string();
  const Machine machine = Machine::h200();
  auto resident = make_plan(*program, Simulator(machine), {}, {.policy = Policy::Resident, .alignment = 256});
  ASSERT_TRUE(resident.ok()) << resident.status().to_string();
  uint64_t state = 0;
  for (size_t i = 0; i < program->tensors.size(); ++i) {
    const TensorInfo& t = program->tensors.info(static_cast<TensorId>(i));
    if (t.role == Role::Param || t.role == Role::Grad || t.role == Role::Master || t.role == Role::OptState)
      state += t.bytes();
  }
  auto predicted = [&](const Plan& plan) { return simulate(placed_as_planned(*program, plan), plan, machine).step_s; };
  int crowded = 0, compared = 0;
  for (int percent = 100; percent >= 30; percent -= 5) {
    Budgets b;
    b.device = resident->device_bytes / 100 * static_cast<uint64_t>(percent);
    if (state <= b.device / 2) continue;  // state leaves half: planned keeps it without asking
    // Without speculative updates, which make the offloaded plans of this small model
    // faster than the crowded one at every budget (the choice itself is under test).
    auto planned = make_plan(*program, Simulator(machine), b, {.policy = Policy::Planned, .speculate = 0, .alignment = 256});
    auto offloaded = make_plan(*program, Simulator(machine), b,
                               {.policy = Policy::Planned, .optimizer_on_host = 1, .speculate = 0, .alignment = 256});
    if (!planned.ok() || !offloaded.ok()) continue;
    ++compared;
    EXPECT_TRUE(planned->validate(*program, b).is_ok()) << percent << "%";
    EXPECT_LE(predicted(*planned), predicted(*offloaded) * (1 + 1e-9)) << percent << "%: " << planned->description;
    if (planned->description.find("optimizer on device,") != std::string::npos) ++crowded;
  }
  EXPECT_GT(compared, 3);
  EXPECT_GT(crowded, 0);  // at least one budget where the state on device wins
}

// The planned policy searches the optimizer state kept on device: besides the rule's
// share (half the budget, divided by the micro-batches) it tries larger ones, whose
// activations live on recomputation, and keeps the fastest the simulator predicts. So
// it is never predicted slower than the rule's plan, and at some budget faster.
TEST(PlanValidate, PlannedSearchesTheOptimizerShareKeptOnDevice) {
  auto program = build_training_program(ModelConfig{4, 256, 4, 256, 512}, StepShape{4, 256, 1}, DType::BF16);
  ASSERT_TRUE(program.ok()) << program.status().to_string();
  const Machine machine = Machine::h200();
  auto resident = make_plan(*program, Simulator(machine), {}, {.policy = Policy::Resident, .alignment = 256});
  ASSERT_TRUE(resident.ok()) << resident.status().to_string();
  auto predicted = [&](const Plan& plan) { return simulate(placed_as_planned(*program, plan), plan, machine).step_s; };
  int compared = 0, faster = 0;
  for (int percent = 90; percent >= 30; percent -= 10) {
    Budgets b;
    b.device = resident->device_bytes / 100 * static_cast<uint64_t>(percent);
    auto searched = make_plan(*program, Simulator(machine), b,
                              {.policy = Policy::Planned, .optimizer_on_host = 1, .alignment = 256});
    auto rule = make_plan(*program, Simulator(machine), b,
                          {.policy = Policy::Planned, .optimizer_on_host = 1, .optimizer_share_search = 0, .alignment = 256});
    if (!searched.ok() || !rule.ok()) continue;
    ++compared;
    EXPECT_TRUE(searched->validate(*program, b).is_ok()) << percent << "%";
    EXPECT_LE(predicted(*searched), predicted(*rule) * (1 + 1e-9)) << percent << "%: " << searched->description;
    if (predicted(*searched) < predicted(*rule) * 0.98) ++faster;
  }
  EXPECT_GT(compared, 3);
  EXPECT_GT(faster, 0) << "no budget where a larger share is predicted faster than the rule's";
}

// With the optimizer split between device, streamed and host AdamW, the host ones
// are issued first after the clip scale (in their own order), so the host engine
// starts on them while the device works through the rest; the plan stays valid.
TEST(PlanValidate, HostAdamWIsIssuedBeforeTheDeviceAdamW) {
  auto program = build_training_program(ModelConfig{4, 256, 4, 256, 512}, StepShape{4, 256, 4}, DType::BF16);
  ASSERT_TRUE(program.ok()) << program.status().to_string();
  const Machine machine = Machine::h200();
  auto resident = make_plan(*program, Simulator(machine), {}, {.policy = Policy::Resident, .alignment = 256});
  ASSERT_TRUE(resident.ok()) << resident.status().to_string();
  int split = 0;
  for (int percent = 90; percent >= 50; percent -= 5) {
    Budgets b;
    b.device = resident->device_bytes / 100 * static_cast<uint64_t>(percent);
    auto plan = make_plan(*program, Simulator(machine), b, {.policy = Policy::Planned, .optimizer_on_host = 1, .alignment = 256});
    if (!plan.ok()) continue;
    EXPECT_TRUE(plan->validate(*program, b).is_ok()) << percent << "%";
    int clip = -1, last_host = -1, first_device = -1, previous_host_op = -1;
    for (size_t i = 0; i < plan->instructions.size(); ++i) {
      const Instruction& in = plan->instructions[i];
      if (in.kind != InstrKind::Run || in.recompute) continue;
      const Op& op = program->ops[in.op];
      if (op.kind == OpKind::ClipScale) clip = static_cast<int>(i);
      if (op.kind != OpKind::AdamW) continue;
      // A carried update (Plan::carried) is the last step's, run in this step's forward.
      if (std::find(plan->carried.begin(), plan->carried.end(), in.op) != plan->carried.end()) continue;
      if (plan->op_place[in.op] == Place::Host) {
        last_host = static_cast<int>(i);
        EXPECT_GT(in.op, previous_host_op) << "host AdamW out of program order";
        previous_host_op = in.op;
      } else if (first_device < 0) {
        first_device = static_cast<int>(i);
      }
    }
    if (last_host < 0 || first_device < 0) continue;  // not split at this budget
    ++split;
    EXPECT_LT(clip, last_host) << percent << "%";
    EXPECT_LT(last_host, first_device) << percent << "%: " << plan->description;
  }
  EXPECT_GT(split, 0) << "no budget splits the optimizer between host and device";
}

// Speculative updates (plan.h): the host AdamW ops start in the backward, before the
// clip scale; Plan::validate refuses an entry the plan does not allow, and the
// simulator overlaps them with the backward.
TEST(PlanValidate, SpeculativeUpdatesStartInTheBackwardAndAreChecked) {
  auto program = build_training_program(ModelConfig{4, 256, 4, 256, 512}, StepShape{4, 256, 1}, DType::BF16);
  ASSERT_TRUE(program.ok()) << program.status().to_string();
  const Machine machine = Machine::h200();
  auto resident = make_plan(*program, Simulator(machine), {}, {.policy = Policy::Resident, .alignment = 256});
  ASSERT_TRUE(resident.ok()) << resident.status().to_string();
  Budgets b;
  b.device = resident->device_bytes / 2;
  PlannerOptions o{.policy = Policy::Planned, .optimizer_on_host = 1, .alignment = 256};
  o.device_optimizer_bytes = 0;  // every AdamW on host
  o.speculate = 1;
  auto plan = make_plan(*program, Simulator(machine), b, o);
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  ASSERT_FALSE(plan->speculation.empty()) << plan->description;
  EXPECT_EQ(plan->speculation_bytes, speculation_bytes(*program, plan->speculation));
  int clip = -1;
  for (size_t i = 0; i < plan->instructions.size(); ++i)
    if (plan->instructions[i].kind == InstrKind::Run && program->ops[plan->instructions[i].op].kind == OpKind::ClipScale)
      clip = static_cast<int>(i);
  ASSERT_GE(clip, 0);
  int before_clip = 0;
  for (const Speculation& s : plan->speculation) before_clip += s.after < clip;
  EXPECT_GT(before_clip, static_cast<int>(plan->speculation.size()) / 2)
      << "most speculative updates should start before the clip scale is known";
  ASSERT_TRUE(plan->validate(*program, b).is_ok());

  // Refused: starting before the gradient is final, an op listed twice, wrong bytes.
  Plan early = *plan;
  early.speculation.front().after -= 1;
  Status s = early.validate(*program, b);
  EXPECT_EQ(s.code(), StatusCode::Internal);
  EXPECT_NE(s.message().find("not one the plan allows"), std::string::npos) << s.to_string();
  Plan twice = *plan;
  twice.speculation.push_back(twice.speculation.back());
  twice.speculation_bytes = speculation_bytes(*program, twice.speculation);
  EXPECT_EQ(twice.validate(*program, b).code(), StatusCode::Internal);
  Plan bytes = *plan;
  bytes.speculation_bytes += 4096;
  EXPECT_EQ(bytes.validate(*program, b).code(), StatusCode::Internal);
  Budgets tight = b;
  tight.host = align_up(plan->host_bytes, 4096) + plan->speculation_bytes - 4096;
  EXPECT_EQ(plan->validate(*program, tight).code(), StatusCode::Internal) << "speculation buffers over the host budget";

  // The simulator: every speculation issues, and the step is shorter than the same
  // plan without them (the host AdamW then waits for the clip scale).
  const Program placed = placed_as_planned(*program, *plan);
  SimResult with = simulate(placed, *plan, machine);
  ASSERT_TRUE(with.plan_error.empty()) << with.plan_error;
  EXPECT_EQ(with.speculated_ops, static_cast<int>(plan->speculation.size()));
  Plan without = *plan;
  without.speculation.clear();
  without.speculation_bytes = 0;
  SimResult plain = simulate(placed, without, machine);
  EXPECT_EQ(plain.speculated_ops, 0);
  EXPECT_LT(with.step_s, plain.step_s);
  // A step whose clip scale is not 1 (StepOutcome::Clipped): every speculated Run redoes
  // its update, and with a host slow enough that speculations are still queued when the
  // scale reaches host, those are dropped, as the executor drops them.
  auto count_named = [](const SimResult& r, const std::string& prefix) {
    int n = 0;
    for (const SimEvent& e : r.timeline) n += e.name.starts_with(prefix);
    return n;
  };
  SimResult clipped = simulate(placed, *plan, machine, StepOutcome::Clipped);
  ASSERT_TRUE(clipped.plan_error.empty()) << clipped.plan_error;
  EXPECT_EQ(count_named(clipped, "redo "), static_cast<int>(plan->speculation.size()));
  EXPECT_EQ(count_named(clipped, "commit "), 0);
  EXPECT_EQ(count_named(with, "redo "), 0);
  EXPECT_GT(clipped.host_compute_s, with.host_compute_s);
  EXPECT_GE(clipped.step_s, with.step_s);
  Machine slow_host = machine;
  slow_host.host_adam_params_per_s /= 50;
  slow_host.host_adam_params_per_s_alone /= 50;
  SimResult slow_committed = simulate(placed, *plan, slow_host);
  SimResult slow_clipped = simulate(placed, *plan, slow_host, StepOutcome::Clipped);
  const int dropped = count_named(slow_clipped, "dropped speculate ");
  EXPECT_GT(dropped, 0) << "a host this slow still has speculations queued when the scale arrives";
  EXPECT_EQ(dropped + count_named(slow_clipped, "speculate "), static_cast<int>(plan->speculation.size()));
  // The redo is the in-place update's work; of the speculations, only those started ran.
  EXPECT_LT(slow_clipped.host_compute_s, slow_committed.host_compute_s + plain.host_compute_s * 50);
  // Speculative updates run out of place, at host_adam_out_of_place_share of the
  // in-place speed: host work N + S/share (S: theirs at full speed, N: the rest's).
  auto host_work = [&](double share) {
    Machine m = machine;
    m.host_adam_out_of_place_share = share;
    SimResult r = simulate(placed, *plan, m);
    EXPECT_TRUE(r.plan_error.empty()) << r.plan_error;
    EXPECT_GE(r.step_s, with.step_s - 1e-12) << "share " << share;
    return r.host_compute_s;
  };
  const double h1 = host_work(1.0), h_half = host_work(0.5), h_quarter = host_work(0.25);
  EXPECT_NEAR(h1, with.host_compute_s, 1e-12);
  EXPECT_GT(h_half, h1);
  EXPECT_NEAR(h_quarter - h_half, 2 * (h_half - h1), 1e-9 * h_quarter);

  // Off: no speculation.
  o.speculate = 0;
  auto off = make_plan(*program, Simulator(machine), b, o);
  ASSERT_TRUE(off.ok()) << off.status().to_string();
  EXPECT_TRUE(off->speculation.empty());
  EXPECT_EQ(off->speculation_bytes, 0u);

  // Chosen (-1): the plan the cost model predicts faster. On this machine the updates
  // overlap the backward at no cost, so the speculating plan. Where the host
  // optimizer and device compute slow each other to a tenth side by side (the CPU
  // backend's shared cores, exaggerated), the plan without them, which the same
  // machine predicts faster than the speculating one.
  o.speculate = -1;
  auto chosen = make_plan(*program, Simulator(machine), b, o);
  ASSERT_TRUE(chosen.ok()) << chosen.status().to_string();
  EXPECT_EQ(chosen->speculation.size(), plan->speculation.size());
  Machine crowded = machine;
  crowded.compute_share_while_host_computes = 0.1;
  crowded.host_share_while_computing = 0.1;
  auto crowded_chosen = make_plan(*program, Simulator(crowded), b, o);
  ASSERT_TRUE(crowded_chosen.ok()) << crowded_chosen.status().to_string();
  EXPECT_TRUE(crowded_chosen->speculation.empty());
  o.speculate = 1;
  auto crowded_forced = make_plan(*program, Simulator(crowded), b, o);
  ASSERT_TRUE(crowded_forced.ok()) << crowded_forced.status().to_string();
  ASSERT_FALSE(crowded_forced->speculation.empty());
  EXPECT_LT(simulate(placed_as_planned(*program, *crowded_chosen), *crowded_chosen, crowded).step_s,
            simulate(placed_as_planned(*program, *crowded_forced), *crowded_forced, crowded).step_s);
}

}  // namespace

TEST(PlanValidate, TwoHostBuffersSharingBytesAreRefused) {
  const Program program = small_program();
  Budgets budgets;
  Plan plan = host_state_plan(program, &budgets);
  ASSERT_TRUE(plan.validate(program, budgets).is_ok());
  std::vector<TensorId> homed = host_homed(program, plan);
  ASSERT_GE(homed.size(), 2u) << plan.description;
  // Two homes at one offset.
  Plan bad = plan;
  bad.home_host_offset[homed[1]] = bad.home_host_offset[homed[0]];
  Status s = bad.validate(program, budgets);
  ASSERT_FALSE(s.is_ok()) << "two host homes at one offset passed validation";
  EXPECT_NE(s.message().find("overlaps"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find(program.tensors.info(homed[1]).name), std::string::npos) << s.message();
  EXPECT_NE(s.message().find(program.tensors.info(homed[0]).name), std::string::npos) << s.message();
  // One byte of overlap: a buffer placed on the last 4096-byte block of another.
  TensorId big = homed[0];
  for (TensorId t : homed)
    if (program.tensors.info(t).bytes() > program.tensors.info(big).bytes()) big = t;
  ASSERT_GT(program.tensors.info(big).bytes(), 4096u);
  TensorId other = big == homed[0] ? homed[1] : homed[0];
  const uint64_t big_end = plan.home_host_offset[big] + (program.tensors.info(big).bytes() + 4095) / 4096 * 4096;
  bad = plan;
  bad.home_host_offset[other] = big_end - 4096;
  s = bad.validate(program, budgets);
  ASSERT_FALSE(s.is_ok()) << "host buffers sharing a 4096-byte block passed validation";
  EXPECT_NE(s.message().find("overlaps"), std::string::npos) << s.message();
}

TEST(PlanValidate, AHostAllocateOverALiveBufferIsRefused) {
  const Program program = small_program();
  Budgets budgets;
  budgets.host = 512 << 10;  // short: the step swaps activations through host buffers
  budgets.storage = 64 << 20;
  Plan plan = host_state_plan(program, &budgets);
  ASSERT_TRUE(plan.validate(program, budgets).is_ok());
  std::vector<TensorId> homed = host_homed(program, plan);
  ASSERT_FALSE(homed.empty());
  Plan bad = plan;
  bool found = false;
  for (Instruction& in : bad.instructions)
    if (in.kind == InstrKind::HostAllocate) {
      in.offset = plan.home_host_offset[homed[0]];  // on top of a home that is always live
      found = true;
      break;
    }
  ASSERT_TRUE(found) << "the plan allocates no host buffers: " << plan.description;
  Status s = bad.validate(program, budgets);
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find("host-allocate"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("overlaps " + program.tensors.info(homed[0]).name), std::string::npos) << s.message();
}

// The executor makes a host arena of host_bytes rounded up to 4096 and puts each buffer
// in a block of its size rounded up to 4096: a plan whose last buffer ends past that
// arena, or whose arena (rounded) is over the budget, fails there, so it fails here.
TEST(PlanValidate, HostSizesAreRoundedAsTheExecutorRoundsThem) {
  const Program program = small_program();
  Budgets budgets;
  Plan plan = host_state_plan(program, &budgets);
  ASSERT_TRUE(plan.validate(program, budgets).is_ok());
  ASSERT_EQ(plan.host_bytes % 4096, 0u);
  Plan bad = plan;
  bad.host_bytes -= 4096;  // the last block's page is not in the arena
  Status s = bad.validate(program, budgets);
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find("past the host arena"), std::string::npos) << s.message();
  // A budget that holds the buffers' bytes but not their 4096-byte blocks.
  Budgets short_budget = budgets;
  short_budget.host = plan.host_bytes - 1;
  s = plan.validate(program, short_budget);
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find("host budget"), std::string::npos) << s.message();
}

// Every plan the planner makes for the test models — every policy, budgets from
// unlimited down to a tenth of the resident peak, with a short host budget and
// storage or without — passes validation (make_plan checks it; here explicitly too).
TEST(PlanValidate, EveryPlanForTheTestModelsValidates) {
  struct Model {
    ModelConfig cfg;
    StepShape shape;
  };
  const std::vector<Model> models = {
      {ModelConfig{2, 32, 2, 16, 64}, StepShape{2, 16, 2}},
      {ModelConfig{2, 64, 2, 16, 64}, StepShape{2, 16, 2}},
      {ModelConfig{2, 32, 2, 16, static_cast<int>(2 * kVocabBlock + 1000)}, StepShape{2, 16, 2, true}},
      {ModelConfig{4, 128, 4, 128, 256}, StepShape{4, 64, 1}},  // tiny
  };
  int planned = 0;
  for (const Model& m : models) {
    auto program = build_training_program(m.cfg, m.shape, DType::F32);
    ASSERT_TRUE(program.ok()) << program.status().to_string();
    auto resident = make_plan(*program, Simulator(Machine::cpu_dev_box()), {}, {.policy = Policy::Resident, .alignment = 64});
    ASSERT_TRUE(resident.ok()) << resident.status().to_string();
    for (Policy policy : {Policy::Resident, Policy::Paging, Policy::Planned, Policy::Auto})
      for (int divisor : {1, 2, 4, 10})
        for (bool short_host : {false, true})
          for (int recompute : {-1, 1}) {
            Budgets b;
            b.device = resident->device_bytes / divisor;
            if (short_host) {
              b.host = resident->device_bytes / 4;
              b.storage = 1ull << 30;
            }
            auto plan = make_plan(*program, Simulator(Machine::cpu_dev_box()), b,
                                  {.policy = policy, .recompute = recompute, .alignment = 64});
            const std::string what = m.cfg.to_string() + " " + policy_name(policy) + " 1/" + std::to_string(divisor) +
                                     (short_host ? " short host" : "");
            if (!plan.ok()) {
              // Resident under a budget, or a budget below what the model needs: said, not internal.
              EXPECT_EQ(plan.status().code(), StatusCode::OutOfMemory) << what << ": " << plan.status().to_string();
              continue;
            }
            ++planned;
            EXPECT_TRUE(plan->validate(*program, b).is_ok()) << what << ": " << plan->validate(*program, b).to_string();
          }
  }
  EXPECT_GT(planned, 80);
}
