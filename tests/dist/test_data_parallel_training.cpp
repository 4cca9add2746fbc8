// The data-parallel training driver (dist/data_parallel_training.h), as `spillway
// train` runs it in each rank, here with N in-process ranks (threads, each with its
// own CPU backend and a ThreadCommunicator), against the single-process path that
// `spillway train` runs (a Trainer stepping through the train loader, evaluating on
// the validation loader, saving its weights): with accumulation N·A there, N ranks of
// A micro-batches give the same losses, validation losses and saved file, bit for
// bit; also when resumed from a sharded checkpoint onto another number of ranks.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <mutex>
#include <optional>
#include <thread>

#include "backend/backend.h"
#include "dist/data_parallel_training.h"
#include "sim/machine.h"
#include "support/thread_communicator.h"
#include "train/data.h"
#include "train/trainer.h"

using namespace spillway;
using testing_support::ThreadCommunicator;
using testing_support::ThreadGroup;

namespace {

constexpr int kSteps = 6, kEvalEvery = 3;

const Dataset& corpus() {
  static const Dataset d = [] {
    auto loaded = load_dataset(std::string(SPILLWAY_SOURCE_DIR) + "/data/tinyshakespeare.txt", 256);
    EXPECT_TRUE(loaded.ok()) << loaded.status().to_string();
    return loaded.ok() ? std::move(*loaded) : Dataset{};
  }();
  return d;
}

// A small model whose learning rate makes clipping act in some steps, not all.
TrainerOptions options(const ModelConfig& cfg, int accum) {
  TrainerOptions o;
  o.model = cfg;
  o.shape = {.B = 2, .T = 16, .accum = accum};
  o.schedule = {.peak = 3e-2f, .warmup_steps = 2, .total_steps = kSteps};
  o.max_grad_norm = 1.0f;
  o.seed = 4321;
  o.planner = {.policy = Policy::Resident};
  o.machine = Machine::cpu_dev_box();
  o.auto_confirm = 0;
  return o;
}

ModelConfig gpt2() { return ModelConfig{2, 32, 2, 16, 256}; }
ModelConfig llama() { return llama_config(2, 32, 4, 2, 64, 16, 256, /*tied=*/false, 1e-5f, RopeParams{}); }

std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in.good()) << path;
  return std::string(std::istreambuf_iterator<char>(in), {});
}

struct Losses {
  std::vector<float> train;  // [step]
  std::vector<float> val;    // [evaluation]
  std::vector<float> norm;   // [step] gradient norm before clipping
};

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// What `spillway train` does in one process: `accum` micro-batches a step drawn from
// the train loader, evaluation every kEvalEvery steps and after the last, then save.
Losses single_process(const ModelConfig& cfg, int accum, const std::string& save) {
  Losses out;
  auto backend = make_backend("cpu", {.threads = 1});
  EXPECT_TRUE(backend.ok());
  const TrainerOptions o = options(cfg, accum);
  auto trainer = Trainer::create(**backend, o);
  EXPECT_TRUE(trainer.ok()) << trainer.status().to_string();
  if (!trainer.ok()) return out;
  EXPECT_TRUE((*trainer)->init_parameters().is_ok());
  auto train = DataLoader::create(corpus().train, o.shape.B, o.shape.T, LoaderMode::Random, o.seed);
  auto val = DataLoader::create(corpus().val, o.shape.B, o.shape.T, LoaderMode::Sequential);
  EXPECT_TRUE(train.ok() && val.ok());
  for (int s = 1; s <= kSteps; ++s) {
    auto r = (*trainer)->step(*train);
    EXPECT_TRUE(r.ok()) << r.status().to_string();
    if (!r.ok()) return out;
    out.train.push_back(r->loss);
    out.norm.push_back(r->grad_norm);
    if (s % kEvalEvery == 0 || s == kSteps) {
      val->seek(0);
      auto v = (*trainer)->evaluate(*val, 2);
      EXPECT_TRUE(v.ok()) << v.status().to_string();
      out.val.push_back(v.ok() ? *v : -1.0f);
    }
  }
  EXPECT_TRUE((*trainer)->drain().is_ok());
  Status saved = (*trainer)->save(save);
  EXPECT_TRUE(saved.is_ok()) << saved.to_string();
  return out;
}

struct RankRun {
  Status status;
  Losses losses;
  DataParallelTrainingResult result;
};

// `world` ranks in threads, each with accumulation `accum`; `tweak(rank, options)`
// adjusts a rank's options (save, checkpoints, resume, a stop request).
std::vector<RankRun> data_parallel(const ModelConfig& cfg, int world, int accum,
                                   const std::function<void(int, DataParallelTrainingOptions&)>& tweak = {}) {
  ThreadGroup group(world);
  std::vector<RankRun> runs(static_cast<size_t>(world));
  std::atomic<int> finished{0};
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      RankRun& run = runs[static_cast<size_t>(r)];
      ThreadCommunicator comm(group, r);
      auto backend = make_backend("cpu", {.threads = 1});
      if (!backend.ok()) {
        run.status = backend.status();
        ++finished;
        comm.abort(run.status.message());
        return;
      }
      DataParallelTrainingOptions o;
      o.trainer = options(cfg, accum);
      o.data = &corpus();
      o.steps = kSteps;
      o.eval_every = kEvalEvery;
      o.eval_batches = 2;
      o.on_step = [&](const StepResult& s) {
        run.losses.train.push_back(s.loss);
        run.losses.norm.push_back(s.grad_norm);
        if (s.val_loss) run.losses.val.push_back(*s.val_loss);
      };
      if (tweak) tweak(r, o);
      auto result = train_data_parallel(comm, **backend, o);
      ++finished;
      if (!result.ok()) {
        run.status = result.status();
        // Errors the ranks agreed on end every rank at once; any other leaves the
        // others waiting in a collective, which the group's abort ends.
        const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(2);
        while (finished < world && std::chrono::steady_clock::now() < until)
          std::this_thread::sleep_for(std::chrono::milliseconds(5));
        if (finished < world) comm.abort(run.status.message());
        return;
      }
      run.result = *result;
    });
  for (auto& t : threads) t.join();
  return runs;
}

std::string temp(const std::string& name) {
  const std::string path = testing::TempDir() + "/dp_training_" + name;
  std::filesystem::remove_all(path);
  return path;
}

struct Ranks {
  int world, accum;
};

}  // namespace

// 2 and 4 ranks of 1 micro-batch, 2 ranks of 2, GPT-2 (tied embedding) and Llama
// (untied, grouped-query), against one process with 2, 4 and 4.
TEST(DataParallelTraining, RanksEqualOneProcessWithTheirMicroBatchesBitForBit) {
  ASSERT_GT(corpus().train.size(), 0u);
  for (const auto& [name, cfg] : {std::pair<std::string, ModelConfig>{"gpt2", gpt2()}, {"llama", llama()}}) {
    for (Ranks shape : {Ranks{2, 1}, Ranks{4, 1}, Ranks{2, 2}}) {
      if (name == "llama" && shape.world == 4) continue;  // (time: the gpt2 case covers 4 ranks)
      const std::string what = name + ", " + std::to_string(shape.world) + " ranks of " +
                               std::to_string(shape.accum) + " micro-batches";
      SCOPED_TRACE(what);
      const std::string one = temp(name + "_one.safetensors"), many = temp(name + "_many.safetensors");
      const Losses ref = single_process(cfg, shape.world * shape.accum, one);
      ASSERT_EQ(ref.train.size(), static_cast<size_t>(kSteps));
      int clipped = 0;
      for (float n : ref.norm) clipped += n > 1.0f;
      EXPECT_GT(clipped, 0) << "no step clipped: the global norm's reduction is not tested";
      const auto runs = data_parallel(cfg, shape.world, shape.accum, [&](int r, DataParallelTrainingOptions& o) {
        if (r == 0) o.save = many;
      });
      for (int r = 0; r < shape.world; ++r) {
        const RankRun& run = runs[static_cast<size_t>(r)];
        ASSERT_TRUE(run.status.is_ok()) << "rank " << r << ": " << run.status.to_string();
        EXPECT_TRUE(same_bits(run.losses.train, ref.train)) << "rank " << r << "'s step losses";
        EXPECT_TRUE(same_bits(run.losses.norm, ref.norm)) << "rank " << r << "'s gradient norms";
        EXPECT_EQ(run.result.steps_done, kSteps);
        EXPECT_EQ(run.result.tokens_per_step, 2 * 16 * shape.world * shape.accum);
      }
      EXPECT_TRUE(same_bits(runs[0].losses.val, ref.val)) << "validation losses";
      EXPECT_EQ(runs[0].losses.val.size(), 2u);
      EXPECT_TRUE(runs[1].losses.val.empty()) << "only rank 0 evaluates";
      EXPECT_TRUE(file_bytes(many) == file_bytes(one)) << "the saved weights differ from one process's";
    }
  }
}

// ZeRO stage 3: each rank holds only the parameters it owns, so every rank takes part
// in an evaluation (the owners send rank 0 theirs) — 2 ranks of 2 and 3 ranks of 1,
// GPT-2 and Llama: the step losses, the validation losses and the saved weights are
// one process's, bit for bit, and only rank 0 reports a validation loss.
TEST(DataParallelTraining, ZeroStage3EvaluatesAsOneProcessDoes) {
  for (const auto& [name, cfg] : {std::pair<std::string, ModelConfig>{"gpt2", gpt2()}, {"llama", llama()}}) {
    for (Ranks shape : {Ranks{2, 2}, Ranks{3, 1}}) {
      SCOPED_TRACE(name + ", " + std::to_string(shape.world) + " ranks of " + std::to_string(shape.accum));
      const std::string one = temp(name + "_z3_one.safetensors"), many = temp(name + "_z3_many.safetensors");
      const Losses ref = single_process(cfg, shape.world * shape.accum, one);
      ASSERT_EQ(ref.val.size(), 2u);
      const auto runs = data_parallel(cfg, shape.world, shape.accum, [&](int r, DataParallelTrainingOptions& o) {
        o.zero_stage = 3;
        if (r == 0) o.save = many;
      });
      for (int r = 0; r < shape.world; ++r) {
        const RankRun& run = runs[static_cast<size_t>(r)];
        ASSERT_TRUE(run.status.is_ok()) << "rank " << r << ": " << run.status.to_string();
        EXPECT_TRUE(same_bits(run.losses.train, ref.train)) << "rank " << r << "'s step losses";
        if (r > 0) {
          EXPECT_TRUE(run.losses.val.empty()) << "rank " << r << " reported a validation loss";
        }
      }
      EXPECT_TRUE(same_bits(runs[0].losses.val, ref.val)) << "validation losses";
      ASSERT_TRUE(runs[0].result.last_val.has_value());
      EXPECT_EQ(*runs[0].result.last_val, ref.val.back());
      EXPECT_TRUE(file_bytes(many) == file_bytes(one)) << "the saved weights differ from one process's";
    }
  }
}

// The comparison can fail: another seed's weights differ in the saved file and the
// losses differ.
TEST(DataParallelTraining, TheComparisonSeesADifference) {
  const std::string one = temp("seen_one.safetensors"), many = temp("seen_many.safetensors");
  const Losses ref = single_process(gpt2(), 2, one);
  const auto runs = data_parallel(gpt2(), 2, 1, [&](int r, DataParallelTrainingOptions& o) {
    o.trainer.seed = 99;  // the parameters' initialization and the batch order
    if (r == 0) o.save = many;
  });
  ASSERT_TRUE(runs[0].status.is_ok()) << runs[0].status.to_string();
  EXPECT_FALSE(same_bits(runs[0].losses.train, ref.train));
  EXPECT_FALSE(file_bytes(many) == file_bytes(one));
}

// A sharded checkpoint goes on with another number of ranks: 2 ranks of 2 micro-
// batches stop after step 3 (rank 1 asks; both stop before step 4 and write the
// checkpoint), then 4 ranks of 1 and 1 rank of 4 each finish the run from it. Every
// step's loss and the saved weights equal one process's uninterrupted run.
TEST(DataParallelTraining, ResumesFromShardsOntoAnotherNumberOfRanks) {
  const std::string one = temp("resume_one.safetensors");
  const Losses ref = single_process(gpt2(), 4, one);
  const std::string dir = temp("resume_ckpt");
  const nlohmann::json config = {{"accum", 4}, {"note", "recorded as given"}};
  int seen_by_rank1 = 0;
  const auto first = data_parallel(gpt2(), 2, 2, [&](int r, DataParallelTrainingOptions& o) {
    o.checkpoint_dir = dir;
    o.checkpoint_every = 2;  // a checkpoint of step 2 too, which --keep 1 then removes
    o.keep = 1;
    o.config = config;
    if (r == 1) {
      auto on_step = o.on_step;
      o.on_step = [&seen_by_rank1, on_step](const StepResult& s) {
        on_step(s);
        ++seen_by_rank1;
      };
      o.stop_requested = [&seen_by_rank1] { return seen_by_rank1 >= 3; };
    }
  });
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(first[static_cast<size_t>(r)].status.is_ok()) << first[static_cast<size_t>(r)].status.to_string();
    EXPECT_TRUE(first[static_cast<size_t>(r)].result.stopped) << "rank " << r;
    EXPECT_EQ(first[static_cast<size_t>(r)].result.steps_done, 3) << "rank " << r;
    EXPECT_EQ(first[static_cast<size_t>(r)].losses.train.size(), 3u) << "rank " << r;
  }
  std::vector<std::string> skipped;
  auto c = newest_data_parallel_checkpoint(dir, &skipped);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_TRUE(skipped.empty());
  EXPECT_EQ(c->step, 3);
  EXPECT_EQ(c->world, 2);
  EXPECT_EQ(c->data_batch, 3 * 4);
  EXPECT_EQ(c->config, config);
  EXPECT_EQ(c->path, dir + "/dp-ckpt-00000003");
  EXPECT_TRUE(std::filesystem::exists(c->path + "/shard-1-of-2.safetensors"));
  EXPECT_FALSE(std::filesystem::exists(dir + "/dp-ckpt-00000002")) << "--keep 1";
  EXPECT_TRUE(holds_data_parallel_checkpoints(dir));

  for (Ranks shape : {Ranks{4, 1}, Ranks{1, 4}}) {
    const std::string what = std::to_string(shape.world) + " ranks of " + std::to_string(shape.accum);
    SCOPED_TRACE(what);
    const std::string many = temp("resume_many.safetensors");
    const auto rest = data_parallel(gpt2(), shape.world, shape.accum, [&](int r, DataParallelTrainingOptions& o) {
      o.resume = c->path;
      if (r == 0) o.save = many;
    });
    ASSERT_TRUE(rest[0].status.is_ok()) << rest[0].status.to_string();
    EXPECT_EQ(rest[0].result.steps_done, kSteps);
    EXPECT_EQ(rest[0].result.checkpoint, c->path);
    EXPECT_TRUE(same_bits(rest[0].losses.train, std::vector<float>(ref.train.begin() + 3, ref.train.end())));
    EXPECT_TRUE(same_bits(rest[0].losses.val, std::vector<float>(ref.val.begin() + 1, ref.val.end())));
    EXPECT_TRUE(file_bytes(many) == file_bytes(one)) << "the saved weights differ from one process's";
  }
}

// The checkpoint that a run resumes from and ends at is not written again; an
// unfinished folder (no manifest) is passed over, and a folder that holds no whole
// checkpoint is NotFound naming it.
TEST(DataParallelTraining, UnfinishedCheckpointsArePassedOver) {
  const std::string dir = temp("unfinished");
  const auto first = data_parallel(gpt2(), 2, 1, [&](int, DataParallelTrainingOptions& o) {
    o.checkpoint_dir = dir;
    o.stop_after = 2;
    o.eval_every = 0;
  });
  ASSERT_TRUE(first[0].status.is_ok()) << first[0].status.to_string();
  EXPECT_EQ(first[0].result.checkpoint, dir + "/dp-ckpt-00000002");
  std::filesystem::create_directories(dir + "/dp-ckpt-00000005.partial");
  std::filesystem::create_directories(dir + "/dp-ckpt-00000004");  // no manifest
  std::vector<std::string> skipped;
  auto c = newest_data_parallel_checkpoint(dir, &skipped);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->step, 2);
  ASSERT_EQ(skipped.size(), 2u);
  EXPECT_NE(skipped[0].find("dp-ckpt-00000005.partial: unfinished"), std::string::npos) << skipped[0];
  EXPECT_NE(skipped[1].find("dp-ckpt-00000004: "), std::string::npos) << skipped[1];
  auto none = newest_data_parallel_checkpoint(temp("empty"));
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), StatusCode::NotFound);
  EXPECT_NE(none.status().message().find("dp_training_empty"), std::string::npos) << none.status().to_string();
}

// A rank that fails to set up (here: weights it cannot load) fails every rank, each
// naming it, instead of leaving the others waiting in a collective.
TEST(DataParallelTraining, ARankThatFailsToSetUpFailsEveryRankNamingIt) {
  const auto runs = data_parallel(gpt2(), 3, 1, [&](int r, DataParallelTrainingOptions& o) {
    if (r == 2) o.load = temp("missing.safetensors");
  });
  ASSERT_FALSE(runs[2].status.is_ok());
  EXPECT_NE(runs[2].status.message().find("--load"), std::string::npos) << runs[2].status.to_string();
  for (int r = 0; r < 2; ++r) {
    const Status& s = runs[static_cast<size_t>(r)].status;
    ASSERT_FALSE(s.is_ok()) << "rank " << r;
    EXPECT_NE(s.message().find("rank 2 failed (rank " + std::to_string(r) + " stops too)"), std::string::npos)
        << s.to_string();
    EXPECT_NE(s.message().find("missing.safetensors"), std::string::npos) << s.to_string();
  }
}

// Options out of range are refused before anything is built, naming the values.
TEST(DataParallelTraining, OptionsOutOfRangeAreRefused) {
  const auto runs = data_parallel(gpt2(), 2, 1, [&](int, DataParallelTrainingOptions& o) { o.eval_batches = 0; });
  for (int r = 0; r < 2; ++r) {
    const Status& s = runs[static_cast<size_t>(r)].status;
    ASSERT_FALSE(s.is_ok()) << "rank " << r;
    EXPECT_NE(s.message().find("evaluation every 3 steps over 0 batches"), std::string::npos) << s.to_string();
  }
}
