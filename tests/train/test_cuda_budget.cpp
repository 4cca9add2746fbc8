// --device-budget on CUDA, kernel code included (issue 9): the process's device
// memory beyond the CUDA context (cudaMemGetInfo) stays within the budget through
// training steps and an evaluation, because every kernel the step launches is loaded
// and counted before the budget is split (warm_up_kernels). Skips without a GPU, as
// in CI; scripts/device-*.sh run it on the H200.
#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "backend/backend.h"
#include "exec/dispatch.h"
#include "model/model.h"
#include "sim/machine.h"
#include "train/data.h"
#include "train/trainer.h"
#ifdef SPILLWAY_HAVE_CUDA
#include "backend/cuda/cuda_backend.h"
#endif
#include "support/gpu_support.h"

namespace spillway {
namespace {

using testing_support::gpu_present;

TEST(CudaBudget, KernelCodeIsLoadedAndCountedBeforeTheStep) {
  if (!gpu_present()) GTEST_SKIP() << "no CUDA GPU on this machine";
  auto backend = make_backend("cuda");
  ASSERT_TRUE(backend.ok()) << backend.status().to_string();
  Backend& b = **backend;
  const size_t fixed_before = b.fixed_device_bytes();
  TrainerOptions o;
  o.model = *model_preset("tiny");
  o.shape = {.B = 4, .T = 64, .accum = 2};
  o.schedule = {.peak = 1e-3f, .warmup_steps = 0, .total_steps = 3};
  o.budgets.device = uint64_t{64} << 20;
  o.planner.policy = Policy::Planned;
  o.machine = machine_for(b);
  auto t = Trainer::create(b, o);
  ASSERT_TRUE(t.ok()) << t.status().to_string();
  EXPECT_GE(b.fixed_device_bytes(), fixed_before);
  ASSERT_TRUE((*t)->init_parameters().is_ok());
  std::vector<uint16_t> stream(4096);
  for (size_t i = 0; i < stream.size(); ++i) stream[i] = static_cast<uint16_t>((i * 7919) % 256);
  TokenSplit split{.source = "test", .tokens = std::make_shared<const std::vector<uint16_t>>(stream)};
  auto loader = DataLoader::create(split, 4, 64, LoaderMode::Sequential);
  ASSERT_TRUE(loader.ok());
  for (int s = 0; s < 3; ++s) {
    auto r = (*t)->step(*loader);
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    EXPECT_LE(b.device_used_bytes(), o.budgets.device) << "after step " << s + 1;
  }
  loader->seek(0);
  auto v = (*t)->evaluate(*loader, 2);
  ASSERT_TRUE(v.ok()) << v.status().to_string();
  EXPECT_LE(b.device_used_bytes(), o.budgets.device) << "after evaluation";
  EXPECT_LE(b.device_peak_bytes(), o.budgets.device) << "at the sampled peak";
}

}  // namespace
}  // namespace spillway
