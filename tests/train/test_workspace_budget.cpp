// The device workspace inside the device budget, where no device is needed: the
// CUDA backend's sizes (backend_sizes.h) in the vocab-tiling choice
// (build_for_budget) and in the planner's minimum.
#include <gtest/gtest.h>

#include <string>

#include "backend/backend_sizes.h"
#include "exec/dispatch.h"
#include "model/model.h"
#include "plan/planner.h"
#include "train/trainer.h"
#include "sim/simulator.h"

namespace spillway {
namespace {

uint64_t align_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

uint64_t workspace_of(const BackendSizes& sizes, const Program& program) {
  auto w = program_workspace(sizes, program);
  EXPECT_TRUE(w.ok()) << w.status().to_string();
  return w.ok() ? align_up(w->bytes, sizes.alignment()) : 0;
}

// A narrow model with GPT-2's vocabulary: the LM head is its largest op by far, and
// the 32 MiB cuBLASLt workspace is larger than that op untiled.
TEST(WorkspaceBudget, VocabTilingComparesWithTheBudgetLessTheWorkspace) {
  const BackendSizes& cuda = cuda_backend_sizes();
  const ModelConfig cfg{.layers = 1, .width = 64, .heads = 2, .context = 64, .vocab = 50257};
  const StepShape shape{.B = 1, .T = 64, .accum = 1};
  auto build = [&](bool tile_vocab) {
    StepShape s = shape;
    s.tile_vocab = tile_vocab;
    return build_training_program(cfg, s, cuda.activation_dtype());
  };
  auto untiled = build(false);
  auto tiled = build(true);
  ASSERT_TRUE(untiled.ok() && tiled.ok());
  const size_t a = cuda.alignment();
  const uint64_t untiled_op = minimum_device_budget(*untiled, a), tiled_op = minimum_device_budget(*tiled, a);
  const uint64_t untiled_ws = workspace_of(cuda, *untiled), tiled_ws = workspace_of(cuda, *tiled);
  ASSERT_GE(untiled_ws, uint64_t{32} << 20);
  // A budget, in whole 2 MiB pages, at which the tiled step fits with its workspace
  // and the untiled step's largest op is within half the budget (so comparing with the
  // whole budget would keep it untiled), but not within the budget less its workspace.
  const uint64_t g = cuda.allocation_granularity();
  const uint64_t budget = align_up(std::max(2 * untiled_op, tiled_op + tiled_ws), g);
  ASSERT_LE(untiled_op, budget / 2);
  ASSERT_GT(untiled_op + untiled_ws, budget) << "the untiled step would fit: the test shows nothing";
  PlannerOptions options{.policy = Policy::Planned};
  {
    auto o = backend_planner_options(*untiled, cuda, options);
    ASSERT_TRUE(o.ok());
    auto plan = make_plan(*untiled, Simulator(Machine::h200()), {.device = budget}, *o);
    ASSERT_FALSE(plan.ok()) << "the untiled step plans at " << budget;
  }

  bool was_tiled = false;
  auto program = build_for_budget(build, cuda, budget, &was_tiled);
  ASSERT_TRUE(program.ok()) << program.status().to_string();
  EXPECT_TRUE(was_tiled) << "budget " << budget << ", untiled op " << untiled_op << ", workspace " << untiled_ws;
  auto o = backend_planner_options(*program, cuda, options);
  ASSERT_TRUE(o.ok());
  EXPECT_EQ(o->workspace_bytes, tiled_ws);
  auto plan = make_plan(*program, Simulator(Machine::h200()), {.device = budget}, *o);
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  EXPECT_EQ(plan->workspace_bytes, tiled_ws);

  // With room for the untiled step and its workspace twice over, it stays untiled.
  was_tiled = true;
  auto roomy = build_for_budget(build, cuda, align_up(2 * (untiled_op + untiled_ws), g), &was_tiled);
  ASSERT_TRUE(roomy.ok());
  EXPECT_FALSE(was_tiled);
}

// No device workspace on the CPU: the choice is the one the whole budget gives.
TEST(WorkspaceBudget, CpuHasNoWorkspace) {
  const BackendSizes& cpu = cpu_backend_sizes();
  const ModelConfig cfg{.layers = 1, .width = 128, .heads = 4, .context = 128, .vocab = 50257};
  auto untiled = build_training_program(cfg, {.B = 1, .T = 128, .accum = 1}, cpu.activation_dtype());
  ASSERT_TRUE(untiled.ok());
  EXPECT_EQ(workspace_of(cpu, *untiled), 0u);
  const uint64_t op = minimum_device_budget(*untiled, cpu.alignment());
  for (uint64_t budget : {2 * op, 2 * op - 1}) {
    bool tiled = false;
    auto p = build_for_budget(
        [&](bool t) {
          return build_training_program(cfg, {.B = 1, .T = 128, .accum = 1, .tile_vocab = t}, cpu.activation_dtype());
        },
        cpu, budget, &tiled);
    ASSERT_TRUE(p.ok());
    EXPECT_EQ(tiled, budget < 2 * op) << budget;
  }
}

TEST(WorkspaceBudget, SizesByName) {
  auto cuda = backend_sizes("cuda");
  ASSERT_TRUE(cuda.ok());
  EXPECT_EQ((*cuda)->name(), "cuda");
  EXPECT_EQ((*cuda)->matmul_workspace(64, 256, false, false), size_t{32} << 20);
  auto tpu = backend_sizes("tpu");
  ASSERT_FALSE(tpu.ok());
  EXPECT_NE(tpu.status().to_string().find("tpu"), std::string::npos);
}

// The minimum a refusal states is the device budget the user gave, not the
// workspace, when the workspace alone takes more than that budget.
TEST(WorkspaceBudget, RefusalNamesTheBudgetGivenWhenTheWorkspaceTakesItAll) {
  const ModelConfig cfg{.layers = 1, .width = 32, .heads = 2, .context = 16, .vocab = 256};
  auto program = build_training_program(cfg, {.B = 1, .T = 16, .accum = 1}, DType::BF16);
  ASSERT_TRUE(program.ok());
  auto o = backend_planner_options(*program, cuda_backend_sizes(), {.policy = Policy::Planned});
  ASSERT_TRUE(o.ok());
  auto plan = make_plan(*program, Simulator(Machine::h200()), {.device = uint64_t{8} << 20}, *o);
  ASSERT_FALSE(plan.ok());
  const std::string message = plan.status().to_string();
  EXPECT_NE(message.find("device budget 8.00 MiB is below the minimum"), std::string::npos) << message;
  EXPECT_NE(message.find("32.00 MiB of workspace"), std::string::npos) << message;
}

}  // namespace
}  // namespace spillway

namespace spillway {
namespace {

// Pinning host memory takes device memory for the GPU's mapping of it (measured on the
// H200: 18399694848 pinned bytes took 35651584 device bytes); plans on CUDA reserve it
// for the most the host arena could hold, and none on the CPU.
TEST(HostMapping, CudaReservesTheMappingOfThePinnedArenaAndTheCpuNone) {
  const BackendSizes& cuda = cuda_backend_sizes();
  const BackendSizes& cpu = cpu_backend_sizes();
  EXPECT_GE(cuda.host_mapping_device_bytes(18399694848ull), 35651584ull);
  EXPECT_LE(cuda.host_mapping_device_bytes(18399694848ull), 35651584ull + (uint64_t{4} << 20));
  EXPECT_EQ(cuda.host_mapping_device_bytes(0), 0u);
  EXPECT_EQ(cpu.host_mapping_device_bytes(18399694848ull), 0u);
  EXPECT_EQ(cuda.host_mapping_device_bytes(1) % cuda.allocation_granularity(), 0u);
  ModelConfig cfg{.layers = 2, .width = 64, .heads = 2, .context = 32, .vocab = 512};
  auto program = build_training_program(cfg, {.B = 2, .T = 32, .accum = 1}, DType::BF16);
  ASSERT_TRUE(program.ok());
  uint64_t total = 0;
  for (size_t i = 0; i < program->tensors.size(); ++i)
    total += (std::max<uint64_t>(1, program->tensors.info(static_cast<TensorId>(i)).bytes()) + 4095) / 4096 * 4096;
  Budgets b{.device = uint64_t{1} << 30, .host = uint64_t{1} << 40};
  EXPECT_EQ(host_mapping_reserve(*program, cuda, b), cuda.host_mapping_device_bytes(total));
  b.host = 4096;  // a host budget below the program's tensors bounds the arena
  EXPECT_EQ(host_mapping_reserve(*program, cuda, b), cuda.host_mapping_device_bytes(4096));
  b.device = UINT64_MAX;  // no device budget: nothing to reserve
  EXPECT_EQ(host_mapping_reserve(*program, cuda, b), 0u);
  EXPECT_EQ(host_mapping_reserve(*program, cpu, {.device = uint64_t{1} << 30}), 0u);
}

}  // namespace
}  // namespace spillway
