// The step as a pipelined loop (issue 10, DESIGN.md "The step is a loop"): host
// AdamW runs on the host engine and overlaps the next step, part of the optimizer
// state may stay on device, and the runs still give the resident run's bits —
// losses, evaluation, and saved weights — under budgets of 1/2, 1/4 and 1/10 of the
// resident peak, with accumulation, with clipping active and inactive, and with
// evaluation and saving in the middle of the run.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "model/model.h"
#include "plan/planner.h"
#include "sim/machine.h"
#include "sim/simulator.h"
#include "support/test_support.h"
#include "support/trainer_support.h"
#include "train/data.h"
#include "train/trainer.h"

namespace spillway {
namespace {

using testing_support::float_bits;
using testing_support::learnable_batches;

struct PipelinedRun {
  std::vector<float> losses, norms;  // [steps]
  float val = 0;                     // evaluation after step 3
  std::string saved_mid, saved_end;  // the --save files' bytes after step 3 and 6
  Plan plan;
  int speculated = 0;                // host AdamW ops started speculatively, all steps
  std::vector<int> speculated_by_step;  // [steps] the same, each step
  SpeculationTally tally;            // after the last step
};

// 3 steps, evaluate, save, 3 steps, save.
PipelinedRun train(Backend& backend, const TrainerOptions& o, const std::string& tag) {
  PipelinedRun run;
  auto t = Trainer::create(backend, o);
  EXPECT_TRUE(t.ok()) << tag << ": " << t.status().to_string();
  if (!t.ok()) return run;
  Trainer& tr = **t;
  run.plan = tr.plan();
  EXPECT_TRUE(tr.init_parameters().is_ok());
  std::vector<uint16_t> stream;
  for (const TokenBatch& b : learnable_batches(1, 4, 16, 99))
    for (int32_t tok : b.tokens) stream.push_back(static_cast<uint16_t>(tok));
  TokenSplit split{.source = "test", .tokens = std::make_shared<const std::vector<uint16_t>>(stream)};
  // The files are this process's and this test's own: ctest runs the tests of this
  // file at once, as separate processes sharing TempDir (a shared name let one test
  // read the other's saved weights).
  const testing::TestInfo* test = testing::UnitTest::GetInstance()->current_test_info();
  const std::string dir = testing::TempDir() + "/pipelined_" + (test ? test->name() : "run") + "_" +
                          std::to_string(::getpid());
  std::filesystem::create_directories(dir);
  for (int s = 1; s <= 6; ++s) {
    auto r = tr.step(learnable_batches(o.shape.accum, o.shape.B, o.shape.T, 100 + s));
    EXPECT_TRUE(r.ok()) << tag << " step " << s << ": " << r.status().to_string();
    if (!r.ok()) return run;
    run.losses.push_back(r->loss);
    run.norms.push_back(r->grad_norm);
    run.speculated += r->exec.speculated_ops;
    run.speculated_by_step.push_back(static_cast<int>(r->exec.speculated_ops));
    const std::string path = dir + "/pipelined_" + std::to_string(s) + ".safetensors";
    if (s == 3) {
      auto loader = DataLoader::create(split, 1, o.shape.T, LoaderMode::Sequential);
      EXPECT_TRUE(loader.ok());
      auto v = tr.evaluate(*loader, 2);
      EXPECT_TRUE(v.ok()) << tag << ": " << v.status().to_string();
      if (v.ok()) run.val = *v;
    }
    if (s == 3 || s == 6) {
      Status saved = tr.save(path);
      EXPECT_TRUE(saved.is_ok()) << tag << ": " << saved.to_string();
      (s == 3 ? run.saved_mid : run.saved_end) = testing_support::read_file(path);
      std::filesystem::remove(path);
    }
  }
  EXPECT_TRUE(tr.drain().is_ok());
  run.tally = tr.executor().speculation_tally();
  std::filesystem::remove_all(dir);
  return run;
}

void expect_same(const PipelinedRun& r, const PipelinedRun& ref, const std::string& tag) {
  ASSERT_EQ(r.losses.size(), ref.losses.size()) << tag;
  for (size_t i = 0; i < r.losses.size(); ++i) {
    EXPECT_EQ(float_bits(r.losses[i]), float_bits(ref.losses[i])) << tag << ": loss of step " << i + 1;
    EXPECT_EQ(float_bits(r.norms[i]), float_bits(ref.norms[i])) << tag << ": gradient norm of step " << i + 1;
  }
  EXPECT_EQ(float_bits(r.val), float_bits(ref.val)) << tag << ": evaluation after step 3";
  EXPECT_FALSE(ref.saved_mid.empty());
  EXPECT_TRUE(r.saved_mid == ref.saved_mid) << tag << ": the weights saved after step 3 differ";
  EXPECT_TRUE(r.saved_end == ref.saved_end) << tag << ": the weights saved after step 6 differ";
}

int adamw_on(const Plan& plan, const Program& program, Place where) {
  int n = 0;
  for (size_t i = 0; i < program.ops.size(); ++i)
    if (program.ops[i].kind == OpKind::AdamW && plan.op_place[i] == where) ++n;
  return n;
}

TEST(PipelinedLoop, HostOptimizerRunsMatchResidentBitForBit) {
  auto backend = make_backend("cpu", {.threads = 2});
  ASSERT_TRUE(backend.ok());
  TrainerOptions o;
  o.model = {.layers = 2, .width = 32, .heads = 2, .context = 16, .vocab = 64};
  o.shape = {.B = 2, .T = 16, .accum = 2};
  o.seed = 7;
  o.machine = Machine::cpu_dev_box();
  struct Clip {
    const char* name;
    float lr, max_norm;
    bool active;
  };
  for (Clip clip : {Clip{"clipping active", 3e-2f, 0.05f, true}, Clip{"clipping inactive", 1e-3f, 1e6f, false}}) {
    TrainerOptions base = o;
    base.schedule = {.peak = clip.lr, .warmup_steps = 0, .total_steps = 6};
    base.max_grad_norm = clip.max_norm;
    PipelinedRun ref = train(**backend, base, "resident");
    ASSERT_EQ(ref.losses.size(), 6u);
    int clipped = 0;
    for (float n : ref.norms) clipped += n > clip.max_norm;
    if (clip.active) {
      EXPECT_GT(clipped, 0) << "the test needs steps where clipping is active";
      EXPECT_GT(ref.norms[0], clip.max_norm) << "the test needs step 1 clipped (its speculations are redone)";
    } else {
      EXPECT_EQ(clipped, 0);
    }
    auto program = build_training_program(o.model, o.shape, DType::F32);
    ASSERT_TRUE(program.ok());
    const uint64_t peak = ref.plan.device_bytes;
    int mixed = 0, host_only = 0, speculating = 0;
    uint64_t dropped = 0;
    for (int divisor : {2, 4, 10}) {
      for (int64_t device_optimizer : {int64_t{-1}, int64_t{0}}) {
        TrainerOptions b = base;
        b.planner.policy = Policy::Planned;
        b.planner.optimizer_on_host = 1;  // the host engine is what is under test
        b.planner.speculate = 1;          // and its speculative updates, whichever the cost model prefers
        b.planner.device_optimizer_bytes = device_optimizer;
        b.budgets.device = peak / divisor;
        const std::string tag = std::string(clip.name) + ", budget 1/" + std::to_string(divisor) +
                                (device_optimizer == 0 ? ", optimizer all on host" : ", optimizer split");
        PipelinedRun r = train(**backend, b, tag);
        expect_same(r, ref, tag);
        ASSERT_EQ(r.plan.op_place.size(), program->ops.size()) << tag;
        const int host = adamw_on(r.plan, *program, Place::Host), device = adamw_on(r.plan, *program, Place::Device);
        EXPECT_GT(host, 0) << tag;
        if (device_optimizer == 0) {
          EXPECT_EQ(device, 0) << tag;
        }
        // Speculative updates: each one queued was committed or redone; with clipping
        // inactive every one stands, with it active (step 1 here) the first are redone.
        EXPECT_EQ(r.tally.committed + r.tally.redone, static_cast<uint64_t>(r.speculated)) << tag;
        // Dropped (not yet started when a scale other than 1 reached host) only where redone.
        EXPECT_LE(r.tally.dropped, r.tally.redone) << tag;
        dropped += r.tally.dropped;
        // A step speculates unless the one before clipped: decided by that step's
        // scale, not by how far the host engine has got (the same in every run).
        if (!r.plan.speculation.empty())
          for (size_t s = 0; s < r.speculated_by_step.size(); ++s) {
            const bool expected = s == 0 || ref.norms[s - 1] <= clip.max_norm;
            EXPECT_EQ(r.speculated_by_step[s] > 0, expected) << tag << ": step " << s + 1 << " (norm before "
                                                             << (s == 0 ? 0.0f : ref.norms[s - 1]) << ")";
          }
        if (!r.plan.speculation.empty()) {
          ++speculating;
          EXPECT_GT(r.speculated, 0) << tag;
          if (clip.active) {
            EXPECT_GT(r.tally.redone, 0u) << tag;
          } else {
            EXPECT_EQ(r.tally.redone, 0u) << tag;
            EXPECT_EQ(r.tally.committed, r.plan.speculation.size() * 6) << tag << ": every step commits";
          }
        }
        mixed += host > 0 && device > 0;
        host_only += device == 0;
      }
    }
    EXPECT_GT(mixed, 0) << clip.name << ": no budget split the optimizer between device and host";
    EXPECT_GT(speculating, 0) << clip.name << ": no plan started a host AdamW speculatively";
    EXPECT_GT(host_only, 0);
    if (!clip.active) {
      EXPECT_EQ(dropped, 0u) << clip.name;
    }
  }
}

// The optimizer state kept on device is a prefix of the parameters in program order
// (the order the next forward needs them), within the bytes allowed.
TEST(PipelinedLoop, DeviceOptimizerStateIsAPrefixWithinItsBytes) {
  ModelConfig cfg{.layers = 4, .width = 64, .heads = 2, .context = 16, .vocab = 256};
  auto program = build_training_program(cfg, {.B = 2, .T = 16, .accum = 1}, DType::F32);
  ASSERT_TRUE(program.ok());
  PlannerOptions o{.policy = Policy::Planned, .optimizer_on_host = 1};
  o.stream_optimizer = 0;  // the device prefix alone (streaming: the next test)
  auto whole = make_plan(*program, Simulator(Machine::cpu_dev_box()), {}, {.policy = Policy::Resident});
  ASSERT_TRUE(whole.ok());
  const Budgets budgets{.device = whole->device_bytes};
  for (int64_t allowed : {int64_t{0}, int64_t{100'000}, int64_t{400'000}}) {
    o.device_optimizer_bytes = allowed;
    auto plan = make_plan(*program, Simulator(Machine::cpu_dev_box()), budgets, o);
    ASSERT_TRUE(plan.ok()) << plan.status().to_string();
    bool seen_host = false;
    uint64_t kept = 0;
    int on_device = 0;
    for (size_t i = 0; i < program->ops.size(); ++i) {
      const Op& op = program->ops[i];
      if (op.kind != OpKind::AdamW) continue;
      if (plan->op_place[i] == Place::Host) {
        seen_host = true;
        continue;
      }
      EXPECT_FALSE(seen_host) << "AdamW " << op.name << " runs on device after one on host";
      ++on_device;
      for (size_t j = 1; j < 5; ++j) {  // master, m, v, grad rest on device with it
        EXPECT_EQ(plan->home[op.operands[j].tensor], Tier::Device) << op.name;
        kept += program->tensors.info(op.operands[j].tensor).bytes();
      }
    }
    EXPECT_LE(kept, static_cast<uint64_t>(allowed));
    if (allowed == 0) {
      EXPECT_EQ(on_device, 0);
    }
    if (allowed >= 400'000) {
      EXPECT_GT(on_device, 0);
    }
    EXPECT_TRUE(seen_host);
  }
}

// Streaming: after the device prefix, some AdamW ops run on device with master and
// moments resting on host (fetched, updated, written back), their gradients on
// device; then the host's. Each class is a contiguous run in program order.
TEST(PipelinedLoop, StreamedOptimizerFollowsThePrefixAndPrecedesTheHost) {
  ModelConfig cfg{.layers = 4, .width = 64, .heads = 2, .context = 16, .vocab = 256};
  auto program = build_training_program(cfg, {.B = 2, .T = 16, .accum = 1}, DType::F32);
  ASSERT_TRUE(program.ok());
  auto whole = make_plan(*program, Simulator(Machine::cpu_dev_box()), {}, {.policy = Policy::Resident});
  ASSERT_TRUE(whole.ok());
  PlannerOptions o{.policy = Policy::Planned, .optimizer_on_host = 1};
  o.device_optimizer_bytes = 600'000;
  o.carry_updates = 0;  // carried updates stream the last parameters instead (the next test)
  auto plan = make_plan(*program, Simulator(Machine::cpu_dev_box()), {.device = whole->device_bytes}, o);
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  int phase = 0;  // 0: resident on device, 1: streamed, 2: host
  int counts[3] = {0, 0, 0};
  for (size_t i = 0; i < program->ops.size(); ++i) {
    const Op& op = program->ops[i];
    if (op.kind != OpKind::AdamW) continue;
    const bool master_on_device = plan->home[op.operands[1].tensor] == Tier::Device;
    const int kind = master_on_device ? 0 : plan->op_place[i] == Place::Device ? 1 : 2;
    EXPECT_GE(kind, phase) << op.name << " is out of order";
    phase = kind;
    counts[kind]++;
    if (kind == 1) {
      EXPECT_EQ(plan->home[op.operands[4].tensor], Tier::Device) << op.name << ": a streamed gradient stays on device";
      EXPECT_EQ(plan->home[op.operands[2].tensor], Tier::Host) << op.name;
    }
  }
  EXPECT_GT(counts[0], 0);
  EXPECT_GT(counts[1], 0) << "nothing streamed";
  EXPECT_GT(counts[2], 0);
  EXPECT_NE(plan->description.find("streamed through the device"), std::string::npos) << plan->description;
}

// Carried updates (DESIGN.md, "The step is a loop"; Plan::carried): the streamed
// AdamW ops of step k run in step k+1, each just before the first op that reads its
// parameter, with step k's gradient, clip scale, learning rate and count; the first
// step skips them and drain() (evaluation, saving, the end) runs those owed. Same
// bits as the resident run: losses, gradient norms, evaluation, and the weights saved
// mid-run and at the end, with the learning rate changing every step (a carried
// update run with the wrong step's rate or count would differ), clipping active and
// not, with accumulation.
TEST(PipelinedLoop, CarriedUpdatesMatchResidentBitForBit) {
  auto backend = make_backend("cpu", {.threads = 2});
  ASSERT_TRUE(backend.ok());
  TrainerOptions o;
  o.model = {.layers = 4, .width = 32, .heads = 2, .context = 16, .vocab = 64};
  o.shape = {.B = 2, .T = 16, .accum = 2};
  o.seed = 11;
  o.machine = Machine::cpu_dev_box();
  auto program = build_training_program(o.model, o.shape, DType::F32);
  ASSERT_TRUE(program.ok());
  int carrying = 0;
  for (float max_norm : {0.05f, 1e6f}) {
    TrainerOptions base = o;
    base.schedule = {.peak = 3e-2f, .warmup_steps = 2, .total_steps = 6};
    base.max_grad_norm = max_norm;
    PipelinedRun ref = train(**backend, base, "resident");
    ASSERT_EQ(ref.losses.size(), 6u);
    for (int divisor : {2, 3, 4}) {
      TrainerOptions b = base;
      b.planner.policy = Policy::Planned;
      b.planner.optimizer_on_host = 1;
      b.planner.carry_updates = 1;
      b.budgets.device = ref.plan.device_bytes / static_cast<uint64_t>(divisor);
      const std::string tag = "max norm " + std::to_string(max_norm) + ", budget 1/" + std::to_string(divisor);
      PipelinedRun r = train(**backend, b, tag);
      expect_same(r, ref, tag);
      if (r.plan.carried.empty()) continue;
      ++carrying;
      EXPECT_NE(r.plan.description.find("carried into the next step"), std::string::npos) << tag;
      // Each carried update runs on device before any op that reads its parameter or
      // writes its gradient in the step, and nothing before it writes what it reads.
      std::vector<int> run_at(program->ops.size(), -1);
      for (size_t i = 0; i < r.plan.instructions.size(); ++i)
        if (r.plan.instructions[i].kind == InstrKind::Run && run_at[r.plan.instructions[i].op] < 0)
          run_at[r.plan.instructions[i].op] = static_cast<int>(i);
      for (int32_t c : r.plan.carried) {
        const Op& adamw = program->ops[static_cast<size_t>(c)];
        ASSERT_EQ(adamw.kind, OpKind::AdamW) << tag;
        EXPECT_EQ(r.plan.op_place[static_cast<size_t>(c)], Place::Device) << tag << ": " << adamw.name;
        const TensorId param = adamw.operands[0].tensor, grad = adamw.operands[4].tensor;
        for (size_t i = 0; i < program->ops.size(); ++i) {
          if (static_cast<int32_t>(i) == c) continue;
          for (const Operand& operand : program->ops[i].operands) {
            const bool reads_param = operand.tensor == param;
            const bool writes_grad = operand.tensor == grad && operand.access != Access::Read;
            if (reads_param || writes_grad) {
              EXPECT_LT(run_at[static_cast<size_t>(c)], run_at[i])
                  << tag << ": " << adamw.name << " runs after " << program->ops[i].name;
            }
          }
        }
      }
    }
  }
  EXPECT_GT(carrying, 0) << "no budget carried an update into the next step";
}

}  // namespace
}  // namespace spillway
