// The headline exactness of data parallelism (dist/data_parallel.h) on the CPU
// backend: N in-process ranks (threads, each with its own backend and executor) with
// micro-batch B give, bit for bit, the losses, clip scales and final weights of one
// rank with accumulation N and micro-batch B, rank r reading micro-batch r.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <set>
#include <random>
#include <thread>

#include "backend/backend.h"
#include "dist/data_parallel.h"
#include "exec/executor.h"
#include "model/model.h"
#include "program/op_registry.h"
#include "plan/planner.h"
#include "sim/machine.h"
#include "sim/simulator.h"
#include "support/thread_communicator.h"

using namespace spillway;
using testing_support::ThreadCommunicator;
using testing_support::ThreadGroup;

namespace {

struct Case {
  std::string what;
  ModelConfig cfg;
  int B = 2, T = 16;
  bool tile_vocab = false;
};

struct RunResult {
  Status status;
  std::vector<std::vector<float>> losses;  // [step][micro-batch or rank · B·T] every token's loss
  std::vector<float> clip;                 // [step · 2] clip scale, global norm
  std::map<std::string, std::vector<float>> masters, params;  // by parameter (tile) name, after the last step
  std::vector<std::map<std::string, std::vector<float>>> rank_params;  // [rank] each rank's parameters
};

RunResult failed(const Status& s) {
  RunResult r;
  r.status = s;
  return r;
}

// Step `step`'s micro-batches: the same on every rank (each takes its own).
void batch(const ModelConfig& cfg, int B, int T, int step, int k, std::vector<int32_t>& tokens,
           std::vector<int32_t>& targets) {
  std::mt19937 rng(static_cast<uint32_t>(1000 * step + k));
  tokens.resize(static_cast<size_t>(B * T));
  targets.resize(tokens.size());
  for (auto& x : tokens) x = static_cast<int32_t>(rng() % cfg.vocab);
  for (size_t i = 0; i < tokens.size(); ++i) targets[i] = (tokens[i] * 7 + 3) % cfg.vocab;
}

constexpr uint64_t kSeed = 1234;

std::vector<std::pair<std::string, std::vector<float>>> initial_values(const Program& program, const ModelConfig& cfg) {
  std::vector<std::pair<std::string, std::vector<float>>> out;
  for (const ParamSpec& spec : parameter_specs(cfg)) {
    std::vector<float> v = init_parameter(cfg, spec, kSeed);
    size_t offset = 0;
    for (TensorId t : program.pieces(spec.name)) {
      const size_t n = static_cast<size_t>(program.tensors.info(t).shape.numel());
      out.push_back({program.tensors.info(t).name, std::vector<float>(v.begin() + offset, v.begin() + offset + n)});
      offset += n;
    }
  }
  return out;
}

float lr_of(int step) { return step % 3 == 0 ? 2e-3f : 5e-2f; }

// One rank with accumulation `accum`.
RunResult single_rank(const Case& c, int accum, int steps) {
  RunResult run;
  auto backend = make_backend("cpu", {.threads = 1});
  auto program = build_training_program(c.cfg, {c.B, c.T, accum, c.tile_vocab}, DType::F32);
  if (!program.ok()) return failed(program.status());
  auto plan = make_plan(*program, Simulator(Machine::cpu_dev_box()), {}, {.policy = Policy::Resident, .alignment = 64});
  if (!plan.ok()) return failed(plan.status());
  auto ex = Executor::create(**backend, *program, *plan);
  if (!ex.ok()) return failed(ex.status());
  Executor& e = **ex;
  auto write = [&](const std::string& name, const void* data, size_t bytes) {
    if (run.status.is_ok()) run.status = e.write_tensor(program->tensors.find(name), data, bytes);
  };
  for (auto& [name, v] : initial_values(*program, c.cfg)) {
    write(name, v.data(), v.size() * 4);
    write("master." + name, v.data(), v.size() * 4);
  }
  for (int step = 1; step <= steps && run.status.is_ok(); ++step) {
    for (int k = 0; k < accum; ++k) {
      std::vector<int32_t> tokens, targets;
      batch(c.cfg, c.B, c.T, step, k, tokens, targets);
      write("mb" + std::to_string(k) + ".tokens", tokens.data(), tokens.size() * 4);
      write("mb" + std::to_string(k) + ".targets", targets.data(), targets.size() * 4);
    }
    if (run.status.is_ok()) run.status = e.run_step({.step = step, .lr = lr_of(step)});
    std::vector<float> losses(static_cast<size_t>(accum * c.B * c.T)), clip(2);
    for (int k = 0; k < accum && run.status.is_ok(); ++k)
      run.status = e.read_tensor(program->tensors.find("mb" + std::to_string(k) + ".losses"),
                                 losses.data() + k * c.B * c.T, c.B * c.T * 4);
    if (run.status.is_ok()) run.status = e.read_tensor(program->tensors.find("clip.scale_norm"), clip.data(), 8);
    run.losses.push_back(losses);
    run.clip.insert(run.clip.end(), clip.begin(), clip.end());
  }
  if (!run.status.is_ok()) return run;
  for (auto& [name, v] : initial_values(*program, c.cfg)) {
    std::vector<float> m(v.size()), p(v.size());
    run.status = e.read_tensor(program->tensors.find("master." + name), m.data(), m.size() * 4);
    if (run.status.is_ok()) run.status = e.read_tensor(program->tensors.find(name), p.data(), p.size() * 4);
    if (!run.status.is_ok()) return run;
    run.masters[name] = m;
    run.params[name] = p;
  }
  return run;
}

// Sharded checkpoints in a data-parallel run: load the state from `load_dir` before
// the first step (instead of the initial values), which is step `first_step`; save
// each rank's shard to `save_dir` after the last.
struct Resume {
  int first_step = 1;
  std::string load_dir = {}, save_dir = {};
};

// `world` in-process ranks, rank r reading micro-batch r. `loss_scale_micro_batches`
// is `world` for the exact run (tests pass another value to see the check fail).
// Steps resume.first_step ... resume.first_step + steps - 1.
RunResult data_parallel(const Case& c, int world, int steps, int loss_scale_micro_batches, bool offload = false,
                        int accum = 1, const Resume& resume = {}, int zero_stage = 2) {
  RunResult run;
  auto program = build_training_program(c.cfg, {c.B, c.T, accum, c.tile_vocab}, DType::F32);
  if (!program.ok()) return failed(program.status());
  auto layout = make_data_parallel_layout(*program, world, loss_scale_micro_batches, -1, zero_stage);
  if (!layout.ok()) return failed(layout.status());
  std::vector<Plan> plans;
  for (const Program& mine : layout->rank_programs) {
    auto plan = make_plan(mine, Simulator(Machine::cpu_dev_box()), {}, {.policy = Policy::Resident, .alignment = 64});
    if (!plan.ok()) return failed(plan.status());
    if (offload) {  // the rank's optimizer state (its shard) on host, AdamW there, under half the device memory
      plan = make_plan(mine, Simulator(Machine::cpu_dev_box()), {.device = plan->device_bytes / 2},
                       {.policy = Policy::Planned, .optimizer_on_host = 1, .device_optimizer_bytes = 0,
                        .speculate = 1, .alignment = 64});
      if (!plan.ok()) return failed(plan.status());
      for (size_t i = 0; i < mine.ops.size(); ++i)
        if (mine.ops[i].kind == OpKind::AdamW && plan->op_place[i] != Place::Host)
          return failed(Status::internal("the offloaded plan runs " + mine.ops[i].name + " on the device"));
    }
    plans.push_back(*plan);
  }
  const auto init = initial_values(*program, c.cfg);
  const size_t tokens = static_cast<size_t>(c.B * c.T);
  run.losses.assign(static_cast<size_t>(steps), std::vector<float>(world * accum * tokens));
  run.clip.assign(static_cast<size_t>(2 * steps), 0.0f);
  std::vector<Status> status(static_cast<size_t>(world));
  run.rank_params.resize(static_cast<size_t>(world));
  std::mutex mu;
  ThreadGroup group(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      ThreadCommunicator comm(group, r);
      Status& s = status[static_cast<size_t>(r)];
      auto fail = [&](const Status& e) {
        s = e;
        comm.abort(e.to_string());
      };
      auto backend = make_backend("cpu", {.threads = 1});
      if (!backend.ok()) return fail(backend.status());
      auto rank = DataParallelRank::create(comm, **backend, *layout, plans[static_cast<size_t>(r)]);
      if (!rank.ok()) return fail(rank.status());
      DataParallelRank& dp = **rank;
      if (resume.load_dir.empty()) {
        for (auto& [name, v] : init)
          if (Status e = dp.write_parameter(name, v); !e.is_ok()) return fail(e);
      } else {
        auto saved = dp.load_shards(resume.load_dir);
        if (!saved.ok()) return fail(saved.status());
        if (*saved != resume.first_step - 1)
          return fail(Status::internal("the checkpoint is of step " + std::to_string(*saved)));
      }
      for (int step = resume.first_step; step < resume.first_step + steps; ++step) {
        Status e = Status::ok();
        for (int k = 0; k < accum && e.is_ok(); ++k) {  // micro-batches r·A ... r·A+A-1 of the step
          std::vector<int32_t> tok, tgt;
          batch(c.cfg, c.B, c.T, step, r * accum + k, tok, tgt);
          const std::string mb = "mb" + std::to_string(k) + ".";
          e = dp.write_input(mb + "tokens", tok.data(), tok.size() * 4);
          if (e.is_ok()) e = dp.write_input(mb + "targets", tgt.data(), tgt.size() * 4);
        }
        if (e.is_ok()) e = dp.step({.step = step, .lr = lr_of(step)});
        for (int k = 0; k < accum && e.is_ok(); ++k)
          e = dp.read_output("mb" + std::to_string(k) + ".losses",
                             run.losses[static_cast<size_t>(step - resume.first_step)].data() + (r * accum + k) * tokens,
                             tokens * 4);
        if (!e.is_ok()) return fail(e);
        auto clip = dp.scale_norm();
        if (!clip.ok()) return fail(clip.status());
        if (r == world - 1) std::memcpy(&run.clip[static_cast<size_t>(2 * (step - resume.first_step))], clip->data(), 8);
      }
      if (!resume.save_dir.empty())
        if (Status e = dp.save_shard(resume.save_dir, resume.first_step + steps - 1); !e.is_ok()) return fail(e);
      const auto& params = dp.layout().params;
      for (size_t i = 0; i < params.size(); ++i) {
        const bool owner = layout->partition.owner[i] == r;
        if (zero_stage == 3 && !owner) {  // only the owner holds it
          if (dp.parameter(i).ok()) return fail(Status::internal("rank " + std::to_string(r) + " reads " +
                                                                 params[i].name + ", which it does not own"));
          continue;
        }
        auto p = dp.parameter(i);
        if (!p.ok()) return fail(p.status());
        std::lock_guard<std::mutex> lock(mu);
        if (zero_stage == 3 ? owner : r == world - 1) run.params[params[i].name] = *p;
        run.rank_params[static_cast<size_t>(r)][params[i].name] = *p;
        if (layout->partition.owner[i] == r) {
          auto m = dp.master(i);
          if (!m.ok()) return fail(m.status());
          run.masters[params[i].name] = *m;
        }
      }
    });
  for (auto& t : threads) t.join();
  for (const Status& s : status)
    if (!s.is_ok()) {
      run.status = s;
      break;
    }
  return run;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// How many of the run's values differ in bits from the reference's.
size_t differences(const RunResult& r, const RunResult& ref) {
  size_t d = 0;
  for (size_t s = 0; s < ref.losses.size(); ++s) d += !same_bits(r.losses[s], ref.losses[s]);
  d += !same_bits(r.clip, ref.clip);
  for (auto& [name, v] : ref.masters) d += !r.masters.count(name) || !same_bits(r.masters.at(name), v);
  for (auto& [name, v] : ref.params) d += !r.params.count(name) || !same_bits(r.params.at(name), v);
  return d;
}

std::vector<Case> cases() {
  return {
      {"gpt2 (tied wte: two contributions a micro-batch)", ModelConfig{2, 32, 2, 16, 64}},
      {"llama untied, grouped-query", llama_config(2, 32, 4, 2, 64, 16, 64, /*tied=*/false, 1e-5f, RopeParams{})},
  };
}

constexpr int kSteps = 6;

}  // namespace

TEST(DataParallel, RanksEqualOneRankWithAccumulationBitForBit) {
  for (const Case& c : cases()) {
    for (int world : {2, 4}) {
      const std::string what = c.what + ", " + std::to_string(world) + " ranks";
      RunResult ref = single_rank(c, world, kSteps);
      ASSERT_TRUE(ref.status.is_ok()) << what << ": " << ref.status.to_string();
      // Clipping must be active in some steps (and not in others), so that the global
      // norm's order is tested, not just the sum of the gradients.
      int clipped = 0;
      for (int s = 0; s < kSteps; ++s) clipped += ref.clip[static_cast<size_t>(2 * s)] < 1.0f;
      EXPECT_GT(clipped, 0) << what << ": no step clipped; raise the learning rate";
      RunResult dp = data_parallel(c, world, kSteps, world);
      ASSERT_TRUE(dp.status.is_ok()) << what << ": " << dp.status.to_string();
      ASSERT_EQ(dp.masters.size(), ref.masters.size()) << what;
      for (int s = 0; s < kSteps; ++s) {
        EXPECT_TRUE(same_bits(dp.losses[static_cast<size_t>(s)], ref.losses[static_cast<size_t>(s)]))
            << what << ": step " << s + 1 << " losses";
        EXPECT_EQ(std::memcmp(&dp.clip[static_cast<size_t>(2 * s)], &ref.clip[static_cast<size_t>(2 * s)], 8), 0)
            << what << ": step " << s + 1 << " clip scale " << dp.clip[2 * s] << " vs " << ref.clip[2 * s]
            << ", norm " << dp.clip[2 * s + 1] << " vs " << ref.clip[2 * s + 1];
      }
      for (auto& [name, v] : ref.masters) {
        EXPECT_TRUE(same_bits(dp.masters[name], v)) << what << ": master weights of " << name;
        for (int r = 0; r < world; ++r)  // every rank holds the owner's parameter after the broadcast
          EXPECT_TRUE(same_bits(dp.rank_params[static_cast<size_t>(r)][name], ref.params[name]))
              << what << ": parameter " << name << " on rank " << r;
      }
    }
  }
}

// Two ranks of two micro-batches each equal one rank of four (rank r reads micro-
// batches 2r and 2r+1); every micro-batch's contributions travel as parts of their own.
TEST(DataParallel, RanksWithAccumulationEqualOneRankWithAllTheMicroBatches) {
  const Case c = cases()[0];
  RunResult ref = single_rank(c, 4, kSteps);
  ASSERT_TRUE(ref.status.is_ok()) << ref.status.to_string();
  RunResult dp = data_parallel(c, 2, kSteps, 4, false, /*accum=*/2);
  ASSERT_TRUE(dp.status.is_ok()) << dp.status.to_string();
  EXPECT_EQ(differences(dp, ref), 0u);
  EXPECT_EQ(dp.masters.size(), ref.masters.size());
}

// Vocab tiles (wte in kVocabBlock-row tensors, one LM-head and embedding op each):
// every tile's gradient has its two parts.
TEST(DataParallel, VocabTilesEqualOneRank) {
  Case c{"gpt2 vocab tiles", ModelConfig{2, 32, 2, 16, static_cast<int>(kVocabBlock + 500)}};
  c.tile_vocab = true;
  RunResult ref = single_rank(c, 2, 3);
  ASSERT_TRUE(ref.status.is_ok()) << ref.status.to_string();
  ASSERT_EQ(ref.masters.count("transformer.wte.weight#1"), 1u);
  RunResult dp = data_parallel(c, 2, 3, 2);
  ASSERT_TRUE(dp.status.is_ok()) << dp.status.to_string();
  EXPECT_EQ(differences(dp, ref), 0u);
}

// Each rank plans its own program: with its shard of the optimizer state on host (the
// host AdamW) under half the device memory, the bits stay those of one rank.
TEST(DataParallel, RanksWithOffloadedShardsEqualOneRank) {
  const Case c = cases()[0];
  RunResult ref = single_rank(c, 2, kSteps);
  ASSERT_TRUE(ref.status.is_ok()) << ref.status.to_string();
  RunResult dp = data_parallel(c, 2, kSteps, 2, /*offload=*/true);
  ASSERT_TRUE(dp.status.is_ok()) << dp.status.to_string();
  EXPECT_EQ(differences(dp, ref), 0u);
  EXPECT_EQ(dp.masters.size(), ref.masters.size());
}

// ZeRO stage 3: the parameters partitioned too, each gathered from its owner right
// before every op that reads it. The bits stay those of one rank: losses, clip
// scales, masters and parameters (each from its owner), at 2 and 4 ranks, both
// models, with accumulation and with offloaded shards; no rank program holds a
// parameter it does not own, and a sharded checkpoint of stage 3 loads onto stage 2.
TEST(DataParallel, ZeroStage3EqualsOneRankBitForBit) {
  for (const Case& c : cases()) {
    for (int world : {2, 4}) {
      const std::string what = c.what + ", " + std::to_string(world) + " ranks, ZeRO stage 3";
      RunResult ref = single_rank(c, world, kSteps);
      ASSERT_TRUE(ref.status.is_ok()) << what << ": " << ref.status.to_string();
      RunResult dp = data_parallel(c, world, kSteps, world, false, 1, {}, /*zero_stage=*/3);
      ASSERT_TRUE(dp.status.is_ok()) << what << ": " << dp.status.to_string();
      EXPECT_EQ(differences(dp, ref), 0u) << what;
      EXPECT_EQ(dp.params.size(), ref.params.size()) << what;
    }
  }
  const Case c = cases()[0];
  RunResult ref = single_rank(c, 4, kSteps);
  ASSERT_TRUE(ref.status.is_ok()) << ref.status.to_string();
  RunResult accum = data_parallel(c, 2, kSteps, 4, false, /*accum=*/2, {}, 3);
  ASSERT_TRUE(accum.status.is_ok()) << accum.status.to_string();
  EXPECT_EQ(differences(accum, ref), 0u) << "2 ranks of 2 micro-batches";
  RunResult ref2 = single_rank(c, 2, kSteps);
  ASSERT_TRUE(ref2.status.is_ok()) << ref2.status.to_string();
  RunResult offloaded = data_parallel(c, 2, kSteps, 2, /*offload=*/true, 1, {}, 3);
  ASSERT_TRUE(offloaded.status.is_ok()) << offloaded.status.to_string();
  EXPECT_EQ(differences(offloaded, ref2), 0u) << "offloaded shards";

  // Stage 3 saves after step 3; 2 ranks of stage 2 go on from it.
  const std::string root = testing::TempDir() + "/dp_shards_zero3";
  std::filesystem::remove_all(root);
  const RunResult first = data_parallel(c, 2, 3, 4, false, 2, {.save_dir = root}, 3);
  ASSERT_TRUE(first.status.is_ok()) << first.status.to_string();
  RunResult tail = accum;  // the uninterrupted run's steps 4-6
  tail.losses.erase(tail.losses.begin(), tail.losses.begin() + 3);
  tail.clip.erase(tail.clip.begin(), tail.clip.begin() + 6);
  const RunResult rest = data_parallel(c, 2, kSteps - 3, 4, false, 2, {.first_step = 4, .load_dir = root});
  ASSERT_TRUE(rest.status.is_ok()) << rest.status.to_string();
  EXPECT_EQ(differences(rest, tail), 0u) << "stage 3 checkpoint loaded by stage 2";
}

// Stage 3's rank programs: each holds only the parameters it owns, and one gather
// per op of the forward and backward that reads a parameter, the same ones in the
// same order on every rank (the owner with its parameter as the source).
TEST(DataParallel, ZeroStage3RankProgramsHoldOnlyTheirShard) {
  const Case c = cases()[0];
  auto program = build_training_program(c.cfg, {c.B, c.T, 1, false}, DType::F32);
  ASSERT_TRUE(program.ok()) << program.status().to_string();
  size_t reads = 0;  // ops of the forward and backward reading a parameter, counted per operand
  std::set<TensorId> param_ids;
  for (const Op& op : program->ops)
    if (op.kind == OpKind::AdamW) param_ids.insert(op.operands[0].tensor);
  for (const Op& op : program->ops)
    if (op.phase != Phase::Optimizer)
      for (const Operand& o : op.operands) reads += param_ids.count(o.tensor);
  ASSERT_GT(reads, 0u);
  auto layout = make_data_parallel_layout(*program, 3, 3, -1, 3);
  ASSERT_TRUE(layout.ok()) << layout.status().to_string();
  EXPECT_EQ(layout->zero_stage, 3);
  std::vector<std::string> order0;
  for (int r = 0; r < 3; ++r) {
    const Program& mine = layout->rank_programs[static_cast<size_t>(r)];
    std::vector<std::string> order;
    for (const Op& op : mine.ops) {
      EXPECT_NE(op.kind, OpKind::BroadcastParam) << "rank " << r << ": " << op.name;
      if (op.kind != OpKind::GatherParam) continue;
      order.push_back(op.name);
      EXPECT_EQ(op.operands.size() == 2, op.attrs.root == r) << "rank " << r << ": " << op.name;
    }
    EXPECT_EQ(order.size(), reads) << "rank " << r;
    // Each copy is read once, after its gather; a gather goes one layer ahead of its
    // reader (to the start of the run of ops before the reader's, same phase and
    // micro-batch), else right before it (the first run of a phase).
    size_t ahead = 0;
    for (size_t g = 0; g < mine.ops.size(); ++g) {
      if (mine.ops[g].kind != OpKind::GatherParam) continue;
      const TensorId copy = mine.ops[g].operands[0].tensor;
      size_t reader = mine.ops.size(), readers = 0;
      for (size_t j = 0; j < mine.ops.size(); ++j)
        for (const Operand& o : mine.ops[j].operands)
          if (o.tensor == copy && j != g) {
            reader = std::min(reader, j);
            ++readers;
          }
      ASSERT_EQ(readers, 1u) << mine.ops[g].name;
      ASSERT_GT(reader, g) << mine.ops[g].name;
      const Op& use = mine.ops[reader];
      EXPECT_EQ(mine.ops[g].phase, use.phase) << mine.ops[g].name;
      EXPECT_EQ(mine.ops[g].micro_batch, use.micro_batch) << mine.ops[g].name;
      bool other_layer_between = false;
      for (size_t j = g + 1; j < reader; ++j) {
        const Op& between = mine.ops[j];
        if (between.kind == OpKind::GatherParam) continue;
        EXPECT_EQ(between.phase, use.phase) << mine.ops[g].name << " reaches back past its phase";
        other_layer_between = other_layer_between || between.layer != use.layer;
      }
      ahead += other_layer_between;
    }
    EXPECT_GT(ahead, reads / 2) << "rank " << r << ": most gathers go a layer ahead";
    if (r == 0) order0 = order;
    EXPECT_EQ(order, order0) << "rank " << r << " gathers in another order";
    for (size_t i = 0; i < layout->params.size(); ++i) {
      const bool holds = mine.tensors.find(layout->params[i].name) != kNoTensor;
      EXPECT_EQ(holds, layout->partition.owner[i] == r) << "rank " << r << ": " << layout->params[i].name;
    }
  }
  EXPECT_FALSE(make_data_parallel_layout(*program, 2, 2, -1, 1).ok()) << "ZeRO stage 1 is not a layout of its own";
}

// The check above can fail: a wrong loss scale (each rank scaling by 1/(B·T) as a
// lone rank would, so the reduced gradient is N times too large) changes the clip
// norms and the weights, and the comparison sees it.
TEST(DataParallel, TheComparisonSeesAWrongLossScale) {
  const Case c = cases()[0];
  RunResult ref = single_rank(c, 2, 3);
  ASSERT_TRUE(ref.status.is_ok()) << ref.status.to_string();
  RunResult exact = data_parallel(c, 2, 3, 2);
  ASSERT_TRUE(exact.status.is_ok()) << exact.status.to_string();
  EXPECT_EQ(differences(exact, ref), 0u);
  RunResult wrong = data_parallel(c, 2, 3, 1);
  ASSERT_TRUE(wrong.status.is_ok()) << wrong.status.to_string();
  EXPECT_GT(differences(wrong, ref), 0u);
}

// Issue 15: each rank writes its shard of the state, and a checkpoint loads onto
// another number of ranks. 2 ranks of 2 micro-batches save after step 3; 4 ranks of
// 1, 1 rank of 4, and 2 ranks again (offloaded) go on from it: steps 4-6 equal the
// uninterrupted run's (losses, clip scales, final masters and parameters), bit for bit.
TEST(DataParallel, ShardedCheckpointsLoadOntoOtherRankCounts) {
  const Case c = cases().front();
  const std::string root = testing::TempDir() + "/dp_shards";
  std::filesystem::remove_all(root);
  const RunResult whole = data_parallel(c, 2, kSteps, 4, false, 2);
  ASSERT_TRUE(whole.status.is_ok()) << whole.status.to_string();
  const RunResult first = data_parallel(c, 2, 3, 4, false, 2, {.save_dir = root});
  ASSERT_TRUE(first.status.is_ok()) << first.status.to_string();
  ASSERT_TRUE(std::filesystem::exists(root + "/shard-0-of-2.safetensors"));
  ASSERT_TRUE(std::filesystem::exists(root + "/shard-1-of-2.safetensors"));
  RunResult tail = whole;  // the uninterrupted run's steps 4-6
  tail.losses.erase(tail.losses.begin(), tail.losses.begin() + 3);
  tail.clip.erase(tail.clip.begin(), tail.clip.begin() + 6);
  struct Onto {
    int world, accum;
    bool offload;
  };
  for (Onto o : {Onto{4, 1, false}, Onto{1, 4, false}, Onto{2, 2, true}}) {
    const std::string what = std::to_string(o.world) + " ranks of " + std::to_string(o.accum) + " micro-batches" +
                             (o.offload ? ", offloaded" : "");
    const RunResult rest = data_parallel(c, o.world, kSteps - 3, 4, o.offload, o.accum, {.first_step = 4, .load_dir = root});
    ASSERT_TRUE(rest.status.is_ok()) << what << ": " << rest.status.to_string();
    EXPECT_EQ(differences(rest, tail), 0u) << what;
  }
}

// A damaged or incomplete sharded checkpoint is refused, naming what is wrong.
TEST(DataParallel, DamagedShardedCheckpointsAreRefused) {
  const Case c = cases().front();
  const std::string root = testing::TempDir() + "/dp_shards_bad";
  std::filesystem::remove_all(root);
  ASSERT_TRUE(data_parallel(c, 2, 1, 2, false, 1, {.save_dir = root}).status.is_ok());
  // One rank of 2 micro-batches reads both shards (its errors are its own).
  auto load = [&](const std::string& dir) { return data_parallel(c, 1, 1, 2, false, 2, {.first_step = 2, .load_dir = dir}); };
  ASSERT_TRUE(load(root).status.is_ok()) << load(root).status.to_string();
  const std::string one = root + "/shard-1-of-2.safetensors";
  // Shard 1 of another checkpoint (saved after step 2).
  const std::string other = testing::TempDir() + "/dp_shards_other";
  std::filesystem::remove_all(other);
  ASSERT_TRUE(data_parallel(c, 2, 2, 2, false, 1, {.save_dir = other}).status.is_ok());
  std::filesystem::copy_file(one, one + ".kept");
  std::filesystem::copy_file(other + "/shard-1-of-2.safetensors", one, std::filesystem::copy_options::overwrite_existing);
  RunResult mixed = load(root);
  EXPECT_FALSE(mixed.status.is_ok());
  EXPECT_NE(mixed.status.message().find("shards of different checkpoints"), std::string::npos)
      << mixed.status.to_string();
  std::filesystem::rename(one + ".kept", one);
  // A flipped byte in the data of shard 1 (its last bytes are a moment's values).
  {
    std::fstream f(one, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(-4, std::ios::end);
    char b = 0;
    f.read(&b, 1);
    b = static_cast<char>(b ^ 0x10);
    f.seekp(-4, std::ios::end);
    f.write(&b, 1);
  }
  RunResult r = load(root);
  EXPECT_FALSE(r.status.is_ok());
  EXPECT_NE(r.status.message().find("checksum"), std::string::npos) << r.status.to_string();
  EXPECT_NE(r.status.message().find("shard-1-of-2"), std::string::npos) << r.status.to_string();
  // A missing shard.
  std::filesystem::remove(one);
  r = load(root);
  EXPECT_FALSE(r.status.is_ok());
  EXPECT_NE(r.status.message().find("lacks shard-1-of-2.safetensors"), std::string::npos) << r.status.to_string();
  // Nothing there.
  r = load(root + "/none");
  EXPECT_FALSE(r.status.is_ok());
}

TEST(DataParallel, LayoutSplitsTiedGradientsAndPartitionsTheOptimizerState) {
  auto program = build_training_program(ModelConfig{2, 32, 2, 16, 64}, {2, 16, 1}, DType::F32);
  ASSERT_TRUE(program.ok());
  const int world = 3;
  auto layout = make_data_parallel_layout(*program, world, world);
  ASSERT_TRUE(layout.ok()) << layout.status().to_string();
  ASSERT_EQ(layout->rank_programs.size(), 3u);
  EXPECT_EQ(layout->partition.world, 3);
  for (const DataParallelParam& p : layout->params)  // wte: the LM head's and the embedding's contributions
    EXPECT_EQ(p.parts, p.name == "transformer.wte.weight" ? 2 : 1) << p.name;
  for (int r = 0; r < world; ++r) {
    const Program& R = layout->rank_programs[static_cast<size_t>(r)];
    SCOPED_TRACE("rank " + std::to_string(r));
    ASSERT_TRUE(R.validate().is_ok());
    EXPECT_NE(R.tensors.find("grad.part1.transformer.wte.weight"), kNoTensor);
    // Each parameter: reduced on its owner, sent by the others, its state only on its
    // owner, broadcast from its owner; the collectives in the same order on every rank.
    std::vector<std::string> collectives;
    for (size_t i = 0; i < layout->params.size(); ++i) {
      const std::string& name = layout->params[i].name;
      const bool mine = layout->partition.owner[i] == r;
      EXPECT_EQ(R.tensors.find("master." + name) != kNoTensor, mine) << name;
      EXPECT_EQ(R.tensors.find("adam_v." + name) != kNoTensor, mine) << name;
      EXPECT_EQ(R.tensors.find("gradsum." + name) != kNoTensor, mine) << name;
    }
    int adamw = 0;
    for (const Op& op : R.ops) {
      if (op.kind == OpKind::AdamW) ++adamw;
      if (op.kind == OpKind::CrossEntropyBackward) {
        EXPECT_EQ(op.attrs.scale, static_cast<float>(1.0 / (32.0 * 3)));
      }
      if (op.kind == OpKind::ReduceGradient || op.kind == OpKind::SendGradient) {
        EXPECT_EQ(op.kind == OpKind::ReduceGradient, op.attrs.root == r) << op.name;
        collectives.push_back("reduce root " + std::to_string(op.attrs.root) + " n " + std::to_string(op.attrs.n));
      }
      if (op.kind == OpKind::AllReduceInRankOrder || op.kind == OpKind::BroadcastParam)
        collectives.push_back(std::string(op_kind_name(op.kind)) + " root " + std::to_string(op.attrs.root));
    }
    EXPECT_EQ(adamw, static_cast<int>(layout->partition.owned(r).size()));
    std::vector<std::string> first;
    for (const Op& op : layout->rank_programs[0].ops) {
      if (op.kind == OpKind::ReduceGradient || op.kind == OpKind::SendGradient)
        first.push_back("reduce root " + std::to_string(op.attrs.root) + " n " + std::to_string(op.attrs.n));
      if (op.kind == OpKind::AllReduceInRankOrder || op.kind == OpKind::BroadcastParam)
        first.push_back(std::string(op_kind_name(op.kind)) + " root " + std::to_string(op.attrs.root));
    }
    EXPECT_EQ(collectives, first);
    EXPECT_EQ(collectives.size(), 2 * layout->params.size() + 1);
  }
  // Two micro-batches a rank: every gradient has a part per micro-batch (wte 4).
  auto two = build_training_program(ModelConfig{2, 32, 2, 16, 64}, {2, 16, 2}, DType::F32);
  auto layout2 = make_data_parallel_layout(*two, 2, 4);
  ASSERT_TRUE(layout2.ok()) << layout2.status().to_string();
  for (const DataParallelParam& p : layout2->params)
    EXPECT_EQ(p.parts, p.name == "transformer.wte.weight" ? 4 : 2) << p.name;
  // Five micro-batches a rank: wte has 10 contributions, more than a reduction takes.
  auto five = build_training_program(ModelConfig{2, 32, 2, 16, 64}, {2, 16, 5}, DType::F32);
  auto many = make_data_parallel_layout(*five, 2, 10);
  ASSERT_FALSE(many.ok());
  EXPECT_NE(many.status().message().find("'transformer.wte.weight' has 10 contributions"), std::string::npos)
      << many.status().to_string();
  auto bad = make_data_parallel_layout(*two, 0, 4);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("world size is 0"), std::string::npos) << bad.status().to_string();
}

// A collective op on a backend without a communicator is an error naming the op.
TEST(DataParallel, CollectivesNeedACommunicator) {
  auto program = build_training_program(ModelConfig{2, 32, 2, 16, 64}, {2, 16, 1}, DType::F32);
  ASSERT_TRUE(program.ok());
  auto layout = make_data_parallel_layout(*program, 1, 1);
  ASSERT_TRUE(layout.ok()) << layout.status().to_string();
  auto plan = make_plan(layout->rank_programs[0], Simulator(Machine::cpu_dev_box()), {},
                        {.policy = Policy::Resident, .alignment = 64});
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  auto backend = make_backend("cpu", {.threads = 1});
  auto ex = Executor::create(**backend, layout->rank_programs[0], *plan);
  ASSERT_TRUE(ex.ok()) << ex.status().to_string();
  Status s = (*ex)->run_step({.step = 1, .lr = 1e-3f});
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find("ReduceGradient): a collective op needs the backend's communicator"), std::string::npos)
      << s.to_string();
}
