// Exactness under budgets: every policy and budget gives the resident run's losses
// and final master weights, bit for bit, on the CPU backend (DESIGN.md invariant 1), and stays within its
// budgets (invariant 2).
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "backend/backend.h"
#include "core/size.h"
#include "exec/executor.h"
#include "model/model.h"
#include "plan/planner.h"
#include "sim/machine.h"
#include "sim/simulator.h"
#include "support/fault_support.h"
#include "support/test_support.h"
#include "support/train_support.h"

using namespace spillway;

namespace {

using testing_support::GPTCase;
using testing_support::TempDir;
using testing_support::TrainRun;
using testing_support::expect_same_run;
using testing_support::train_gpt;

GPTCase small_model(int width = 32) { return {ModelConfig{2, width, 2, 16, 64}, StepShape{2, 16, 2}}; }

constexpr int kSteps = 20;

}  // namespace

TEST(Exactness, BudgetedRunsMatchResidentBitForBit) {
  for (int width : {32, 64}) {
    GPTCase s = small_model(width);
    TrainRun ref = train_gpt(s, {}, {.policy = Policy::Resident}, kSteps);
    ASSERT_TRUE(ref.status.is_ok()) << ref.status.to_string();
    const uint64_t peak = ref.plan.device_bytes;
    EXPECT_LT(ref.losses.back(), ref.losses.front());
    struct Case {
      Policy policy;
      bool learned;
    };
    for (Case c : {Case{Policy::Paging, false}, Case{Policy::Paging, true}, Case{Policy::Planned, false},
                   Case{Policy::Auto, false}}) {
      for (int divisor : {2, 4, 10}) {
        Budgets b;
        b.device = peak / divisor;
        std::string what = std::string(policy_name(c.policy)) + (c.learned ? "+learned" : "") + " width " +
                           std::to_string(width) + " budget 1/" + std::to_string(divisor);
        TrainRun r = train_gpt(s, b, {.policy = c.policy, .learned_prefetch = c.learned}, kSteps);
        ASSERT_TRUE(r.status.is_ok()) << what << ": " << r.status.to_string();
        expect_same_run(r, ref, what);
        for (const StepMetrics& m : r.metrics) {
          EXPECT_LE(m.peak_device_bytes, b.device) << what;
          EXPECT_GT(m.h2d_bytes + m.d2h_bytes, 0u) << what << ": a budgeted run moves bytes";
        }
      }
    }
  }
}

// DESIGN step 8: a model whose embedding and LM head do not fit the budget runs them
// in vocab tiles (one op and one tensor per kVocabBlock rows), with the whole-table
// run's losses bit for bit, and a budget the untiled program refuses.
TEST(Exactness, VocabTilesMatchTheWholeTable) {
  GPTCase whole;
  whole.cfg = ModelConfig{2, 32, 2, 16, static_cast<int>(2 * kVocabBlock + 1000)};  // 3 tiles, the last short
  whole.shape = StepShape{2, 16, 2};
  TrainRun ref = train_gpt(whole, {}, {.policy = Policy::Resident}, 10);
  ASSERT_TRUE(ref.status.is_ok()) << ref.status.to_string();
  GPTCase tiled = whole;
  tiled.shape.tile_vocab = true;
  auto program = build_training_program(tiled.cfg, tiled.shape, DType::F32);
  ASSERT_TRUE(program.ok()) << program.status().to_string();
  EXPECT_EQ(program->pieces("transformer.wte.weight").size(), 3u);
  EXPECT_EQ(program->pieces("adam_v.transformer.wte.weight").size(), 3u);
  auto untiled = build_training_program(whole.cfg, whole.shape, DType::F32);
  ASSERT_TRUE(untiled.ok());
  const uint64_t untiled_minimum = minimum_device_budget(*untiled, 64);
  const uint64_t tiled_minimum = minimum_device_budget(*program, 64);
  EXPECT_LT(tiled_minimum, untiled_minimum);

  TrainRun resident_tiled = train_gpt(tiled, {}, {.policy = Policy::Resident}, 10);
  ASSERT_TRUE(resident_tiled.status.is_ok()) << resident_tiled.status.to_string();
  expect_same_run(resident_tiled, ref, "resident, vocab tiles");

  Budgets b;
  b.device = (tiled_minimum + untiled_minimum) / 2;  // between the two minimums
  TrainRun refused = train_gpt(whole, b, {.policy = Policy::Planned}, 1);
  EXPECT_EQ(refused.status.code(), StatusCode::OutOfMemory) << refused.status.to_string();
  TempDir spill;
  for (Policy p : {Policy::Planned, Policy::Paging}) {
    TrainRun r = train_gpt(tiled, b, {.policy = p}, 10);
    ASSERT_TRUE(r.status.is_ok()) << policy_name(p) << ": " << r.status.to_string();
    expect_same_run(r, ref, std::string("vocab tiles, ") + policy_name(p));
    for (const StepMetrics& m : r.metrics) {
      EXPECT_LE(m.peak_device_bytes, b.device);
      EXPECT_GT(m.h2d_bytes, 0u);
    }
  }
  // With storage under a short host budget too.
  Budgets tight = b;
  tight.host = 12 << 20;  // below the state: moments and master weights go to storage
  tight.storage = 256 << 20;
  TrainRun r = train_gpt(tiled, tight, {.policy = Policy::Planned}, 10, {.spill_dir = spill.path()});
  ASSERT_TRUE(r.status.is_ok()) << r.status.to_string();
  expect_same_run(r, ref, "vocab tiles, planned, storage");
  EXPECT_GT(r.metrics.back().storage_read_bytes, 0u);
}

TEST(Exactness, StorageTierMatchesResident) {
  GPTCase s = small_model(32);
  TrainRun ref = train_gpt(s, {}, {.policy = Policy::Resident}, kSteps);
  ASSERT_TRUE(ref.status.is_ok()) << ref.status.to_string();
  TempDir spill;
  const std::string& dir = spill.path();
  for (Policy p : {Policy::Planned, Policy::Paging}) {
    Budgets b;
    b.device = ref.plan.device_bytes / 4;
    b.host = 512 * 1024;  // below the state: part of it goes to storage
    b.storage = 64 << 20;
    TrainRun r = train_gpt(s, b, {.policy = p}, kSteps, {.spill_dir = dir});
    ASSERT_TRUE(r.status.is_ok()) << policy_name(p) << ": " << r.status.to_string();
    expect_same_run(r, ref, std::string("storage ") + policy_name(p));
    EXPECT_GT(r.metrics.back().storage_write_bytes + r.metrics.back().storage_read_bytes, 0u);
    EXPECT_LE(r.metrics.back().peak_host_bytes, b.host);
  }
}

// Storage that cannot hold what the plan spills is found when the executor is made —
// every extent is reserved up front — before any step could leave state half updated.
TEST(Budgets, StorageTooSmallIsFoundBeforeAnyStep) {
  GPTCase s = small_model(32);
  TrainRun ref = train_gpt(s, {}, {.policy = Policy::Resident}, 1);
  ASSERT_TRUE(ref.status.is_ok()) << ref.status.to_string();
  auto backend = make_backend("cpu", {.threads = 2});
  ASSERT_TRUE(backend.ok());
  auto program = build_training_program(s.cfg, s.shape, DType::F32);
  ASSERT_TRUE(program.ok());
  auto extent = [](uint64_t bytes) { return (std::max<uint64_t>(bytes, 1) + 4095) / 4096 * 4096; };
  // A host budget short enough that the step stores activations, not only state.
  for (uint64_t host : {512u << 10, 384u << 10, 320u << 10, 256u << 10, 192u << 10, 160u << 10, 128u << 10}) {
    Budgets b;
    b.device = ref.plan.device_bytes / 4;
    b.host = host;
    b.storage = 64 << 20;
    auto plan = make_plan(*program, Simulator(Machine::cpu_dev_box()), b, {.policy = Policy::Planned, .alignment = 64});
    if (!plan.ok()) continue;
    // Room for the state that lives in storage, not for the activations a step stores.
    uint64_t state = 0, stored = 0;
    std::vector<bool> counted(program->tensors.size(), false);
    for (size_t t = 0; t < program->tensors.size(); ++t)
      if (program->is_persistent(static_cast<TensorId>(t)) && plan->home[t] == Tier::Storage)
        state += extent(program->tensors.info(static_cast<TensorId>(t)).bytes()), counted[t] = true;
    for (const Instruction& in : plan->instructions)
      if (in.kind == InstrKind::Store && !counted[in.tensor])
        stored += extent(program->tensors.info(in.tensor).bytes()), counted[in.tensor] = true;
    if (stored == 0) continue;
    TempDir spill;
    auto created = Executor::create(**backend, *program, *plan,
                                    {.host_budget = b.host, .spill_dir = spill.path(), .storage_budget = state + stored / 2});
    ASSERT_FALSE(created.ok()) << "the executor was made; the disk would have filled during a step";
    EXPECT_NE(created.status().message().find("spill directory"), std::string::npos) << created.status().to_string();
    return;
  }
  FAIL() << "no host budget made the plan store activations";
}

// A machine on which the planner recomputes these small models' activations rather
// than swapping them: links of 5 GB/s (the cpu preset's figure before it was
// measured) and ops at the class rates. The measured preset's ops carry a fixed cost
// of tens of microseconds each (its fits), and its copies none, so it swaps tensors
// this small.
namespace {
Machine recompute_friendly_machine() {
  Machine m = Machine::cpu_dev_box();
  m.h2d_bytes_per_s = m.d2h_bytes_per_s = 5e9;
  m.op_fits = {};
  return m;
}
}  // namespace

TEST(Exactness, PlannedRecomputesWhereItChose) {
  GPTCase s = small_model(64);
  TrainRun ref = train_gpt(s, {}, {.policy = Policy::Resident}, 3);
  ASSERT_TRUE(ref.status.is_ok()) << ref.status.to_string();
  Budgets b;
  b.device = ref.plan.device_bytes / 4;
  TrainRun r = train_gpt(s, b, {.policy = Policy::Planned, .recompute = 1}, 3, {}, recompute_friendly_machine());
  ASSERT_TRUE(r.status.is_ok()) << r.status.to_string();
  expect_same_run(r, ref, "planned with recompute");
  int planned_recomputes = 0;
  for (const Instruction& in : r.plan.instructions) planned_recomputes += in.recompute;
  EXPECT_GT(planned_recomputes, 0);
  EXPECT_EQ(r.metrics.back().recomputed_ops, planned_recomputes);
}

TEST(Budgets, BelowMinimumStatesTheMinimum) {
  GPTCase s = small_model(32);
  Budgets b;
  b.device = 4096;
  TrainRun r = train_gpt(s, b, {.policy = Policy::Planned}, 1);
  ASSERT_FALSE(r.status.is_ok());
  EXPECT_EQ(r.status.code(), StatusCode::OutOfMemory);
  EXPECT_NE(r.status.message().find("minimum"), std::string::npos) << r.status.message();
  EXPECT_NE(r.status.message().find("--device-budget"), std::string::npos) << r.status.message();
}

// The suggested --device-budget is the flag's value: it adds what the backend holds
// outside the budgets the planner was given (the caller took it out of the flag).
TEST(Budgets, SuggestedBudgetIncludesWhatTheBackendHoldsOutside) {
  auto program = build_training_program(ModelConfig{2, 32, 2, 16, 64}, StepShape{2, 16, 1}, DType::F32);
  ASSERT_TRUE(program.ok()) << program.status().to_string();
  auto suggested_mib = [&](uint64_t outside) {
    PlannerOptions o{.policy = Policy::Planned, .alignment = 64};
    o.outside_budget_bytes = outside;
    auto plan = make_plan(*program, Simulator(Machine::cpu_dev_box()), {.device = 4096}, o);
    EXPECT_FALSE(plan.ok());
    const std::string m = plan.status().message();
    const size_t at = m.find("give --device-budget ");
    EXPECT_NE(at, std::string::npos) << m;
    if (outside > 0) {
      EXPECT_NE(m.find("the backend holds itself"), std::string::npos) << m;
    }
    return at == std::string::npos ? -1L : std::stol(m.substr(at + 21));
  };
  const long without = suggested_mib(0), with = suggested_mib(uint64_t{6} << 20);
  ASSERT_GT(without, 0);
  EXPECT_EQ(with, without + 6);
}

// The backend's workspace comes out of the device budget: the arena is planned
// within the rest, arena and workspace are one allocation made before any step,
// peak_device_bytes counts both, and the losses do not change. The minimum the
// planner states includes the workspace.
TEST(Budgets, WorkspaceIsPlannedInsideTheDeviceBudget) {
  GPTCase s = small_model(32);
  TrainRun ref = train_gpt(s, {}, {.policy = Policy::Resident}, 3);
  ASSERT_TRUE(ref.status.is_ok()) << ref.status.to_string();
  constexpr uint64_t kWorkspace = 48 << 10;
  Budgets b;
  b.device = ref.plan.device_bytes / 2 / 64 * 64;
  TrainRun r = train_gpt(s, b, {.policy = Policy::Planned, .workspace_bytes = kWorkspace}, 3);
  ASSERT_TRUE(r.status.is_ok()) << r.status.to_string();
  EXPECT_EQ(r.plan.workspace_bytes, kWorkspace);
  EXPECT_LE(r.plan.device_bytes, b.device - kWorkspace);
  expect_same_run(r, ref, "workspace reserved");
  for (const StepMetrics& m : r.metrics) {
    EXPECT_LE(m.peak_device_bytes, b.device);
    EXPECT_GT(m.peak_device_bytes, kWorkspace);
  }
  EXPECT_LE(r.backend_device_peak, b.device);  // everything the backend handed out
  EXPECT_GE(r.backend_device_peak, r.metrics[0].peak_device_bytes);

  auto program = build_training_program(s.cfg, s.shape, DType::F32);
  ASSERT_TRUE(program.ok());
  const uint64_t minimum = minimum_device_budget(*program, 64, kWorkspace);
  EXPECT_EQ(minimum, minimum_device_budget(*program, 64) + kWorkspace);
  Budgets tight;
  tight.device = minimum - 64;
  TrainRun below = train_gpt(s, tight, {.policy = Policy::Planned, .workspace_bytes = kWorkspace}, 1);
  ASSERT_FALSE(below.status.is_ok());
  EXPECT_EQ(below.status.code(), StatusCode::OutOfMemory);
  EXPECT_NE(below.status.message().find("minimum " + format_size(minimum)), std::string::npos) << below.status.message();
  EXPECT_NE(below.status.message().find(format_size(kWorkspace) + " of workspace"), std::string::npos)
      << below.status.message();
}

namespace {
// Two runs of `s` one after another with `shared` (a region given to each executor in
// turn, filled with NaNs before the first), each with `own`'s losses and master weights;
// then `too_small` and `misaligned` refused with `small_text` and `misaligned_text`.
void expect_region_shared_in_turn(const GPTCase& s, const Budgets& b, const PlannerOptions& o,
                                  const ExecutorOptions& shared, const TrainRun& own,
                                  const ExecutorOptions& too_small, const std::string& small_text,
                                  const ExecutorOptions& misaligned, const std::string& misaligned_text) {
  for (int turn = 1; turn <= 2; ++turn) {
    TrainRun r = train_gpt(s, b, o, 4, shared);
    ASSERT_TRUE(r.status.is_ok()) << "turn " << turn << ": " << r.status.to_string();
    testing_support::expect_same_losses(r.losses, own.losses, "turn " + std::to_string(turn));
    EXPECT_TRUE(r.weights == own.weights) << "turn " << turn << ": the master weights differ";
  }
  TrainRun refused = train_gpt(s, b, o, 1, too_small);
  ASSERT_FALSE(refused.status.is_ok());
  EXPECT_EQ(refused.status.code(), StatusCode::InvalidArgument);
  EXPECT_NE(refused.status.message().find(small_text), std::string::npos) << refused.status.message();
  TrainRun crooked = train_gpt(s, b, o, 1, misaligned);
  ASSERT_FALSE(crooked.status.is_ok());
  EXPECT_NE(crooked.status.message().find(misaligned_text), std::string::npos) << crooked.status.message();
}
}  // namespace

// Executors given one pinned host region in turn (ExecutorOptions::external_host, as
// auto's timed candidates and the run share one) give the bits of executors that pin
// their own: each zeroes what its arena uses, whatever the region held (here NaNs,
// then the last run's state). A region too small or misaligned is refused.
TEST(Budgets, ExecutorsShareOneHostRegionInTurn) {
  GPTCase s = small_model(32);
  TrainRun resident = train_gpt(s, {}, {.policy = Policy::Resident}, 1);
  ASSERT_TRUE(resident.status.is_ok()) << resident.status.to_string();
  Budgets b;
  b.device = resident.plan.device_bytes / 2;
  const PlannerOptions planned{.policy = Policy::Planned};
  TrainRun own = train_gpt(s, b, planned, 4);
  ASSERT_TRUE(own.status.is_ok()) << own.status.to_string();
  const uint64_t need = own.plan.host_arena_bytes();
  ASSERT_GT(own.plan.host_bytes, 0u) << "nothing rests on host: the test shares nothing";
  auto backend = make_backend("cpu", {.threads = 1});
  ASSERT_TRUE(backend.ok());
  const uint64_t bytes = need + 8192;
  auto region = (*backend)->host_alloc(bytes);
  ASSERT_TRUE(region.ok()) << region.status().to_string();
  std::memset(*region, 0xff, bytes);  // NaN in every float
  ExecutorOptions shared, small, misaligned;
  shared.external_host = {*region, bytes};
  small.external_host = {*region, need - 4096};
  misaligned.external_host = {static_cast<char*>(*region) + 64, bytes - 64};
  expect_region_shared_in_turn(s, b, planned, shared, own, small, "host region given holds", misaligned,
                               "not aligned to 4096");
  (*backend)->host_free(*region);
}

// Executors given one region for their speculative updates' second buffers in turn
// (ExecutorOptions::external_speculation, as auto's timed candidates and the run share
// one) give the bits of executors that allocate their own, whatever the region held
// (here NaNs, then the last run's buffers, live state among them after commits). A
// region too small or misaligned is refused.
TEST(Budgets, ExecutorsShareOneSpeculationRegionInTurn) {
  GPTCase s = small_model(32);
  TrainRun resident = train_gpt(s, {}, {.policy = Policy::Resident}, 1);
  ASSERT_TRUE(resident.status.is_ok()) << resident.status.to_string();
  Budgets b;
  b.device = resident.plan.device_bytes / 4;
  PlannerOptions planned{.policy = Policy::Planned};
  planned.optimizer_on_host = 1;
  planned.speculate = 1;
  TrainRun own = train_gpt(s, b, planned, 4);
  ASSERT_TRUE(own.status.is_ok()) << own.status.to_string();
  ASSERT_GT(own.plan.speculation_bytes, 0u) << "nothing speculated: the test shares nothing";
  const uint64_t need = (own.plan.speculation_bytes + 4095) / 4096 * 4096;
  const uint64_t bytes = need + 8192;
  void* region = std::aligned_alloc(4096, bytes);
  ASSERT_NE(region, nullptr);
  std::memset(region, 0xff, bytes);  // NaN in every float
  ExecutorOptions shared, small, misaligned;
  shared.external_speculation = {region, bytes};
  small.external_speculation = {region, need - 4096};
  misaligned.external_speculation = {static_cast<char*>(region) + 64, bytes - 64};
  expect_region_shared_in_turn(s, b, planned, shared, own, small,
                               "of speculative updates' second buffers; the speculation region given holds",
                               misaligned, "speculation region given is not aligned to 4096");
  std::free(region);
}

// An executor given another's idle device region allocates no device memory, and
// refuses a region too small for its plan.
TEST(Budgets, ExecutorInAnotherExecutorsIdleRegion) {
  auto backend = make_backend("cpu", {.threads = 2});
  ASSERT_TRUE(backend.ok());
  GPTCase s = small_model(32);
  auto program = build_training_program(s.cfg, s.shape, DType::F32);
  ASSERT_TRUE(program.ok());
  // With a workspace reserved (the CPU backend's ops need none; a plan may still
  // reserve one), as a CUDA plan has.
  constexpr uint64_t kWorkspace = 48 << 10;
  PlannerOptions with_workspace{.policy = Policy::Resident, .alignment = 64};
  with_workspace.workspace_bytes = kWorkspace;
  auto plan = make_plan(*program, Simulator(Machine::cpu_dev_box()), {}, with_workspace);
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  auto outer = Executor::create(**backend, *program, *plan);
  ASSERT_TRUE(outer.ok()) << outer.status().to_string();
  const DeviceRegion idle = (*outer)->idle_device_region();
  ASSERT_NE(idle.base, nullptr);
  // Between steps only the persistent tensors' device homes are occupied: the idle
  // region is the arena past them and the workspace after the arena (an evaluation
  // in it needs a workspace of its own).
  uint64_t homes = 0;
  for (size_t t = 0; t < program->tensors.size(); ++t)
    if (program->is_persistent(static_cast<TensorId>(t)) && plan->home[t] == Tier::Device)
      homes += (std::max<uint64_t>(1, program->tensors.info(static_cast<TensorId>(t)).bytes()) + 63) / 64 * 64;
  EXPECT_EQ(idle.bytes, (std::max<uint64_t>(plan->device_bytes, 64) + 63) / 64 * 64 + kWorkspace - homes);
  EXPECT_EQ(idle.bytes + homes, (*outer)->device_bytes());

  auto forward = build_forward_program(s.cfg, s.shape.B, s.shape.T, DType::F32, true);
  ASSERT_TRUE(forward.ok());
  Budgets inner_budget;
  inner_budget.device = idle.bytes / 64 * 64;
  auto inner_plan = make_plan(*forward, Simulator(Machine::cpu_dev_box()), inner_budget, {.policy = Policy::Planned, .alignment = 64});
  ASSERT_TRUE(inner_plan.ok()) << inner_plan.status().to_string();
  const size_t before = (*backend)->device_used_bytes();
  {
    ExecutorOptions inside;
    inside.external_device = idle;
    auto inner = Executor::create(**backend, *forward, *inner_plan, inside);
    ASSERT_TRUE(inner.ok()) << inner.status().to_string();
    EXPECT_EQ((*backend)->device_used_bytes(), before);
    ASSERT_TRUE((*inner)->run_step({}).is_ok());
    EXPECT_EQ((*backend)->device_used_bytes(), before);
  }
  ASSERT_TRUE((*outer)->run_step({.step = 1, .lr = 1e-3f}).is_ok());
  ExecutorOptions small;
  small.external_device = {idle.base, inner_plan->device_bytes / 2};
  auto refused = Executor::create(**backend, *forward, *inner_plan, small);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::InvalidArgument);
  EXPECT_NE(refused.status().message().find("region given"), std::string::npos) << refused.status().message();
}

TEST(Budgets, HostTooSmallWithoutSpillDirNamesIt) {
  GPTCase s = small_model(32);
  TrainRun ref = train_gpt(s, {}, {.policy = Policy::Resident}, 1);
  ASSERT_TRUE(ref.status.is_ok()) << ref.status.to_string();
  Budgets b;
  b.device = ref.plan.device_bytes / 4;
  b.host = 64 * 1024;
  TrainRun r = train_gpt(s, b, {.policy = Policy::Planned}, 1);
  ASSERT_FALSE(r.status.is_ok());
  EXPECT_NE(r.status.message().find("--spill-dir"), std::string::npos) << r.status.message();
}

TEST(Budgets, ResidentThatDoesNotFitSaysSo) {
  GPTCase s = small_model(32);
  TrainRun ref = train_gpt(s, {}, {.policy = Policy::Resident}, 1);
  ASSERT_TRUE(ref.status.is_ok()) << ref.status.to_string();
  Budgets b;
  b.device = ref.plan.device_bytes / 2;
  TrainRun r = train_gpt(s, b, {.policy = Policy::Resident}, 1);
  ASSERT_FALSE(r.status.is_ok());
  EXPECT_NE(r.status.message().find("resident"), std::string::npos) << r.status.message();
}

TEST(Faults, StorageFaultsSurfaceAsErrorsNeverAsOtherLosses) {
  GPTCase s = small_model(32);
  TrainRun ref = train_gpt(s, {}, {.policy = Policy::Resident}, 5);
  ASSERT_TRUE(ref.status.is_ok()) << ref.status.to_string();
  TempDir spill;
  const std::string& dir = spill.path();
  int failures = 0;
  for (uint64_t seed = 1; seed <= 6; ++seed) {
    Budgets b;
    b.device = ref.plan.device_bytes / 4;
    b.host = 512 * 1024;
    b.storage = 64 << 20;
    TrainRun r = train_gpt(s, b, {.policy = Policy::Planned}, 5, {.spill_dir = dir, .storage_engine_maker = faulty_storage_engines(seed, 0.01)});
    // Whatever steps completed have exactly the resident losses.
    for (size_t i = 0; i < r.losses.size(); ++i)
      EXPECT_EQ(r.losses[i], ref.losses[i]) << "seed " << seed << " step " << i + 1;
    if (!r.status.is_ok()) {
      ++failures;
      EXPECT_TRUE(r.status.code() == StatusCode::IoError || r.status.code() == StatusCode::NoSpace ||
                  r.status.code() == StatusCode::Corrupt)
          << r.status.to_string();
    }
  }
  EXPECT_GT(failures, 0) << "the fault injector never fired";
}

TEST(Exactness, LayerMajorOrderMatchesResidentAndRunsLayersAcrossMicroBatches) {
  GPTCase s = small_model(32);
  TrainRun ref = train_gpt(s, {}, {.policy = Policy::Resident}, kSteps);
  ASSERT_TRUE(ref.status.is_ok()) << ref.status.to_string();
  for (int divisor : {1, 4}) {
    Budgets b;
    b.device = ref.plan.device_bytes / divisor;
    TrainRun r = train_gpt(s, b, {.policy = Policy::Planned, .layer_major = 1}, kSteps);
    ASSERT_TRUE(r.status.is_ok()) << r.status.to_string();
    expect_same_run(r, ref, "layer-major, budget 1/" + std::to_string(divisor));
    // Micro-batch 1's first layer runs before micro-batch 0's last layer.
    auto program = build_training_program(s.cfg, s.shape, DType::F32);
    ASSERT_TRUE(program.ok());
    int mb1_first = -1, mb0_last = -1, at = 0;
    for (const Instruction& in : r.plan.instructions) {
      if (in.kind != InstrKind::Run) continue;
      const Op& op = program->ops[in.op];
      if (op.phase == Phase::Forward && op.micro_batch == 1 && op.layer == 0 && mb1_first < 0) mb1_first = at;
      if (op.phase == Phase::Forward && op.micro_batch == 0 && op.layer == s.cfg.layers - 1) mb0_last = at;
      ++at;
    }
    EXPECT_GE(mb1_first, 0);
    EXPECT_LT(mb1_first, mb0_last);
  }
}

namespace {

// A small Llama: 4 query heads on 2 key/value heads, SwiGLU, llama3 rope, untied LM
// head unless `tied`.
GPTCase small_llama(bool tied, int vocab = 64, int width = 32, int intermediate = 48) {
  ModelConfig c{2, width, 4, 16, vocab};
  c.arch = Arch::Llama;
  c.kv_heads = 2;
  c.intermediate = intermediate;
  c.tied = tied;
  c.rope = RopeParams{.theta = 500000.0f, .llama3 = true, .factor = 8.0f, .low_freq_factor = 1.0f,
                      .high_freq_factor = 4.0f, .original_context = 8};
  return {c, StepShape{2, 16, 2}};
}

}  // namespace

// The Llama step (RMSNorm, RoPE, GQA, SwiGLU, untied or tied LM head) under every
// policy and budget, with recomputation and with storage, gives the resident run's
// bits.
TEST(Exactness, LlamaBudgetedRunsMatchResidentBitForBit) {
  for (bool tied : {false, true}) {
    GPTCase s = small_llama(tied);
    const std::string model = tied ? "llama tied" : "llama untied";
    TrainRun ref = train_gpt(s, {}, {.policy = Policy::Resident}, kSteps);
    ASSERT_TRUE(ref.status.is_ok()) << ref.status.to_string();
    EXPECT_LT(ref.losses.back(), ref.losses.front());
    const uint64_t peak = ref.plan.device_bytes;
    for (Policy p : {Policy::Paging, Policy::Planned, Policy::Auto}) {
      for (int divisor : {2, 4, 10}) {
        Budgets b;
        b.device = peak / divisor;
        const std::string what = model + " " + policy_name(p) + " budget 1/" + std::to_string(divisor);
        TrainRun r = train_gpt(s, b, {.policy = p}, kSteps);
        ASSERT_TRUE(r.status.is_ok()) << what << ": " << r.status.to_string();
        expect_same_run(r, ref, what);
        for (const StepMetrics& m : r.metrics) EXPECT_LE(m.peak_device_bytes, b.device) << what;
      }
    }
    Budgets b;
    b.device = peak / 4;
    // Wide enough MLP that re-running SwiGLU costs less than a round trip of its output.
    GPTCase wide = small_llama(tied, 64, /*width=*/64, /*intermediate=*/512);
    TrainRun wide_ref = train_gpt(wide, {}, {.policy = Policy::Resident}, kSteps);
    ASSERT_TRUE(wide_ref.status.is_ok()) << wide_ref.status.to_string();
    TrainRun recompute = train_gpt(wide, {.device = wide_ref.plan.device_bytes / 4},
                                   {.policy = Policy::Planned, .recompute = 1}, kSteps);
    ASSERT_TRUE(recompute.status.is_ok()) << recompute.status.to_string();
    expect_same_run(recompute, wide_ref, model + " planned with recompute");
    int planned_recomputes = 0;
    for (const Instruction& in : recompute.plan.instructions) planned_recomputes += in.recompute;
    EXPECT_GT(planned_recomputes, 0) << model;

    TempDir spill;
    Budgets storage = b;
    storage.host = 256 * 1024;  // below the state: part of it goes to storage
    storage.storage = 64 << 20;
    TrainRun stored = train_gpt(s, storage, {.policy = Policy::Planned}, kSteps, {.spill_dir = spill.path()});
    ASSERT_TRUE(stored.status.is_ok()) << stored.status.to_string();
    expect_same_run(stored, ref, model + " planned with storage");
    EXPECT_GT(stored.metrics.back().storage_read_bytes, 0u) << model;
  }
}

// An untied Llama's LM head is tiled like its embedding: both tables in vocab tiles
// give the whole tables' bits.
TEST(Exactness, LlamaVocabTilesMatchTheWholeTables) {
  GPTCase whole = small_llama(/*tied=*/false, static_cast<int>(2 * kVocabBlock + 1000));
  TrainRun ref = train_gpt(whole, {}, {.policy = Policy::Resident}, 5);
  ASSERT_TRUE(ref.status.is_ok()) << ref.status.to_string();
  GPTCase tiled = whole;
  tiled.shape.tile_vocab = true;
  auto program = build_training_program(tiled.cfg, tiled.shape, DType::F32);
  ASSERT_TRUE(program.ok()) << program.status().to_string();
  EXPECT_EQ(program->pieces("model.embed_tokens.weight").size(), 3u);
  EXPECT_EQ(program->pieces("lm_head.weight").size(), 3u);
  EXPECT_EQ(program->pieces("adam_m.lm_head.weight").size(), 3u);
  const uint64_t tiled_minimum = minimum_device_budget(*program, 64);
  Budgets b;
  b.device = tiled_minimum + (tiled_minimum >> 2);
  TrainRun r = train_gpt(tiled, b, {.policy = Policy::Planned}, 5);
  ASSERT_TRUE(r.status.is_ok()) << r.status.to_string();
  expect_same_run(r, ref, "llama vocab tiles, planned");
}

namespace {

// Recompute instructions whose op reads what an earlier recompute instruction
// re-made: a chain, as checkpointing a layer re-runs several of its forward ops.
int recompute_chains(const Plan& plan, const Program& program) {
  int chains = 0;
  std::vector<size_t> recent;  // recompute instructions, newest last
  for (size_t i = 0; i < plan.instructions.size(); ++i) {
    const Instruction& in = plan.instructions[i];
    if (in.kind != InstrKind::Run || !in.recompute) continue;
    const Op& op = program.ops[static_cast<size_t>(in.op)];
    bool chained = false;
    for (size_t r : recent) {
      const Op& earlier = program.ops[static_cast<size_t>(plan.instructions[r].op)];
      for (const Operand& a : op.operands)
        for (const Operand& b : earlier.operands)
          chained |= a.access == Access::Read && b.access == Access::Write && a.tensor == b.tensor;
    }
    chains += chained;
    recent.push_back(i);
    if (recent.size() > 4) recent.erase(recent.begin());
  }
  return chains;
}

}  // namespace

// A recomputed op may read a tensor that is itself released for recomputation: the
// planner re-runs that producer first (a chain), and the run keeps the resident bits.
TEST(Exactness, RecomputeChainsMatchResident) {
  int chains = 0;
  const Machine slow_links = recompute_friendly_machine();
  for (GPTCase s : {small_model(64), small_llama(false, 64, 64, 512)}) {
    TrainRun ref = train_gpt(s, {}, {.policy = Policy::Resident}, 5);
    ASSERT_TRUE(ref.status.is_ok()) << ref.status.to_string();
    for (int divisor : {4, 10}) {
      TrainRun r = train_gpt(s, {.device = ref.plan.device_bytes / divisor}, {.policy = Policy::Planned, .recompute = 1},
                             5, {}, slow_links);
      ASSERT_TRUE(r.status.is_ok()) << r.status.to_string();
      expect_same_run(r, ref, "recompute chains, budget 1/" + std::to_string(divisor));
      auto program = build_training_program(s.cfg, s.shape, DType::F32);
      ASSERT_TRUE(program.ok());
      chains += recompute_chains(r.plan, *program);
    }
  }
  EXPECT_GT(chains, 0) << "no recompute read a recomputed tensor";
}

// Stall metrics (issue 10 item 9): stall_s is what the backend's stall probes measure
// around every wait; on CPU, where compute runs on the executor's thread, that is the
// thread's own blocked time, so it equals host_wait_s up to the probes' bookkeeping.
// A resident run has nothing to wait for.
TEST(StallMetrics, ProbesTimeEveryWaitAndAResidentRunHasNone) {
  GPTCase s = small_model(32);
  TrainRun ref = train_gpt(s, {}, {.policy = Policy::Resident}, 2);
  ASSERT_TRUE(ref.status.is_ok()) << ref.status.to_string();
  for (const StepMetrics& m : ref.metrics) {
    EXPECT_EQ(m.stall_s, 0.0);
    EXPECT_EQ(m.host_wait_s, 0.0);
  }
  Budgets b;
  b.device = ref.plan.device_bytes / 10;
  TrainRun r = train_gpt(s, b, {.policy = Policy::Paging}, 3);
  ASSERT_TRUE(r.status.is_ok()) << r.status.to_string();
  double stalled = 0, waited = 0;
  for (const StepMetrics& m : r.metrics) {
    EXPECT_GE(m.stall_s, 0.0);
    EXPECT_LE(m.stall_s, m.step_s);
    EXPECT_NEAR(m.stall_s, m.host_wait_s, 1e-3 + 0.1 * m.host_wait_s);
    stalled += m.stall_s;
    waited += m.host_wait_s;
  }
  EXPECT_GT(waited, 0.0) << "paging at 1/10 of the resident peak waits for its fetches";
  EXPECT_GT(stalled, 0.0);
}
