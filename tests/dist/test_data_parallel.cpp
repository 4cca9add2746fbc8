// The headline exactness of data parallelism (dist/data_parallel.h) on the CPU
// backend: N in-process ranks (threads, each with its own backend and executor) with
// micro-batch B give, bit for bit, the losses, clip scales and final weights of one
// rank with accumulation N and micro-batch B, rank r reading micro-batch r.
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <mutex>
#include <random>
#include <thread>

#include "backend/backend.h"
#include "dist/data_parallel.h"
#include "exec/executor.h"
#include "model/model.h"
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
  auto program = build_training_program(c.cfg, {c.B, c.T, accum}, DType::F32);
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

// `world` in-process ranks, rank r reading micro-batch r. `loss_scale_micro_batches`
// is `world` for the exact run (tests pass another value to see the check fail).
RunResult data_parallel(const Case& c, int world, int steps, int loss_scale_micro_batches) {
  RunResult run;
  auto program = build_training_program(c.cfg, {c.B, c.T, 1}, DType::F32);
  if (!program.ok()) return failed(program.status());
  auto layout = make_data_parallel_layout(*program, world, loss_scale_micro_batches);
  if (!layout.ok()) return failed(layout.status());
  auto plan = make_plan(layout->rank_program, Simulator(Machine::cpu_dev_box()), {}, {.policy = Policy::Resident, .alignment = 64});
  if (!plan.ok()) return failed(plan.status());
  const auto init = initial_values(*program, c.cfg);
  const size_t tokens = static_cast<size_t>(c.B * c.T);
  run.losses.assign(static_cast<size_t>(steps), std::vector<float>(world * tokens));
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
      auto rank = DataParallelRank::create(comm, **backend, *layout, *plan);
      if (!rank.ok()) return fail(rank.status());
      DataParallelRank& dp = **rank;
      for (auto& [name, v] : init)
        if (Status e = dp.write_parameter(name, v); !e.is_ok()) return fail(e);
      for (int step = 1; step <= steps; ++step) {
        std::vector<int32_t> tok, tgt;
        batch(c.cfg, c.B, c.T, step, r, tok, tgt);
        Status e = dp.write_input("mb0.tokens", tok.data(), tok.size() * 4);
        if (e.is_ok()) e = dp.write_input("mb0.targets", tgt.data(), tgt.size() * 4);
        if (e.is_ok()) e = dp.step({.step = step, .lr = lr_of(step)});
        if (e.is_ok())
          e = dp.read_output("mb0.losses", run.losses[static_cast<size_t>(step - 1)].data() + r * tokens, tokens * 4);
        if (!e.is_ok()) return fail(e);
        if (r == world - 1) std::memcpy(&run.clip[static_cast<size_t>(2 * (step - 1))], dp.scale_norm(), 8);
      }
      const auto& params = dp.layout().params;
      for (size_t i = 0; i < params.size(); ++i) {
        auto p = dp.parameter(i);
        if (!p.ok()) return fail(p.status());
        std::lock_guard<std::mutex> lock(mu);
        if (r == world - 1) run.params[params[i].name] = *p;
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

TEST(DataParallel, LayoutSplitsTiedGradientsAndPartitionsWholeTensors) {
  auto program = build_training_program(ModelConfig{2, 32, 2, 16, 64}, {2, 16, 1}, DType::F32);
  ASSERT_TRUE(program.ok());
  auto layout = make_data_parallel_layout(*program, 3, 3);
  ASSERT_TRUE(layout.ok()) << layout.status().to_string();
  const Program& R = layout->rank_program;
  ASSERT_TRUE(R.validate().is_ok());
  for (const Op& op : R.ops) EXPECT_NE(op.phase, Phase::Optimizer) << op.name;
  // No optimizer state on a rank's executor: master weights and moments are the owners'.
  for (const TensorInfo& t : R.tensors.infos()) {
    EXPECT_NE(t.role, Role::Master) << t.name;
    EXPECT_NE(t.role, Role::OptState) << t.name;
  }
  // wte gets the LM head's and the embedding's contributions, each in its own part.
  for (const DataParallelParam& p : layout->params) {
    if (p.name == "transformer.wte.weight") {
      ASSERT_EQ(p.rank_grad_parts.size(), 2u);
      EXPECT_EQ(R.tensors.info(p.rank_grad_parts[1]).name, "grad.part1.transformer.wte.weight");
    } else {
      EXPECT_EQ(p.rank_grad_parts.size(), 1u) << p.name;
    }
  }
  // The loss scale of three ranks' tokens.
  for (const Op& op : R.ops) {
    if (op.kind == OpKind::CrossEntropyBackward) {
      EXPECT_EQ(op.attrs.scale, static_cast<float>(1.0 / (32.0 * 3)));
    }
  }
  EXPECT_EQ(layout->partition.world, 3);
  // More than one micro-batch is refused, naming the op.
  auto two = build_training_program(ModelConfig{2, 32, 2, 16, 64}, {2, 16, 2}, DType::F32);
  auto bad = make_data_parallel_layout(*two, 2, 2);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("micro-batch 1"), std::string::npos) << bad.status().to_string();
}
