// `spillway train` under RANK, WORLD_SIZE and LOCAL_RANK, and `spillway launch`, run
// as a user would on this GPU-less machine: every bad variable and every refusal is
// an error naming what is wrong, before anything trains; WORLD_SIZE 1 trains as always.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>

#include "backend/backend.h"
#include "dist/data_parallel_training.h"
#include "model/model.h"
#include "sim/machine.h"
#include "support/cli_support.h"
#include "support/thread_communicator.h"
#include "train/data.h"

namespace {

using spillway::testing_support::CliRun;

// The binary with `vars` set in its environment (and unset again after).
CliRun run_with(const std::map<std::string, std::string>& vars, const std::string& args) {
  for (const auto& [k, v] : vars) ::setenv(k.c_str(), v.c_str(), 1);
  CliRun r = spillway::testing_support::run_cli(args);
  for (const auto& [k, v] : vars) ::unsetenv(k.c_str());
  return r;
}

const std::map<std::string, std::string> kRank1Of2 = {{"WORLD_SIZE", "2"}, {"RANK", "1"}, {"LOCAL_RANK", "1"}};

}  // namespace

TEST(TrainUnderWorldSize, TheCpuBackendIsRefusedClearly) {
  CliRun r = run_with(kRank1Of2, "train --backend cpu --steps 1");
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_NE(r.output.find("WORLD_SIZE=2 (data-parallel training, rank 1): --backend cpu has no transport between "
                          "processes"),
            std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("spillway train:"), std::string::npos) << "nothing started: " << r.output;
}

TEST(TrainUnderWorldSize, BadVariablesAreNamed) {
  struct Bad {
    std::map<std::string, std::string> vars;
    std::string expected;
  };
  for (const Bad& b : std::vector<Bad>{
           {{{"WORLD_SIZE", "abc"}}, "WORLD_SIZE='abc': expected the number of ranks"},
           {{{"WORLD_SIZE", "2"}, {"RANK", "2"}, {"LOCAL_RANK", "0"}}, "RANK=2: expected a whole number from 0 to 1"},
           {{{"WORLD_SIZE", "2"}, {"RANK", "1"}}, "WORLD_SIZE=2 but LOCAL_RANK is not set"},
           {{{"WORLD_SIZE", "2"}, {"LOCAL_RANK", "0"}}, "WORLD_SIZE=2 but RANK is not set"},
           {{{"RANK", "1"}}, "RANK=1 but WORLD_SIZE is not set"},
       }) {
    CliRun r = run_with(b.vars, "train --steps 1 --backend cpu");
    EXPECT_EQ(r.code, 1) << r.output;
    EXPECT_NE(r.output.find(b.expected), std::string::npos) << "expected '" << b.expected << "' in: " << r.output;
  }
}

// Flags the data-parallel path does not support are named (before the backend or NCCL).
TEST(TrainUnderWorldSize, UnsupportedFlagsAreNamed) {
  struct Case {
    std::string flags, expected;
  };
  for (const Case& c : std::vector<Case>{
           {"--save-grads g.safetensors", "--save-grads is not supported"},
           {"--trace-predicted p.json", "--trace-predicted is not supported"},
           {"--policy auto", "--policy auto with --auto-confirm 2 is not supported"},
       }) {
    CliRun r = run_with(kRank1Of2, "train --backend cuda --steps 1 " + c.flags);
    EXPECT_EQ(r.code, 1) << r.output;
    EXPECT_NE(r.output.find(c.expected), std::string::npos) << "expected '" << c.expected << "' in: " << r.output;
  }
}

// WORLD_SIZE 1 (RANK 0) is one process, as without the variables.
TEST(TrainUnderWorldSize, WorldSizeOneTrainsAsAlways) {
  CliRun r = run_with({{"WORLD_SIZE", "1"}, {"RANK", "0"}, {"LOCAL_RANK", "0"}},
                      "train --backend cpu --steps 2 --batch 2 --context 16 --eval-every 0 --quiet");
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("final train loss"), std::string::npos) << r.output;
}

// One process does not read a data-parallel checkpoint; the error says how to go on.
TEST(TrainUnderWorldSize, OneProcessRefusesADataParallelCheckpoint) {
  const std::string dir = testing::TempDir() + "/launch_cli_dp_ckpt";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir + "/dp-ckpt-00000003");
  CliRun r = spillway::testing_support::run_cli("train --backend cpu --resume " + dir);
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_NE(r.output.find("holds data-parallel checkpoints (dp-ckpt-*"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("spillway launch --gpus N train --resume"), std::string::npos) << r.output;
}

TEST(LaunchCli, BadCommandLinesAreRefused) {
  for (const auto& [args, expected] : std::vector<std::pair<std::string, std::string>>{
           {"launch --gpus 2 sample --load w", "expected `train ARGS...` after --gpus N, got 'sample'"},
           {"launch --gpus 2", "expected `train ARGS...` after --gpus N, got nothing"},
           {"launch --gpus 0 train", "--gpus: expected at least 1 rank, got 0"},
           {"launch train", "--gpus is required"},
           {"launch --gpus 2 --grace -1 train", "--grace: expected 0 to 3600 seconds"},
           // More ranks than GPUs (or no NCCL): refused before any process starts.
           {"launch --gpus 99999 train --model tiny", "no rank was started"},
       }) {
    CliRun r = spillway::testing_support::run_cli(args);
    EXPECT_EQ(r.code, 1) << args << ": " << r.output;
    EXPECT_NE(r.output.find(expected), std::string::npos) << args << ": expected '" << expected << "' in: " << r.output;
  }
}

// Two ranks of `train --backend cpu`: a build without NCCL, or a machine with fewer
// than 2 GPUs, refuses before starting any; otherwise both start, each refuses the
// CPU backend, rank 1's line comes prefixed, and the launcher names the rank that
// failed first.
TEST(LaunchCli, StartsRanksOrSaysWhyNot) {
  CliRun r = spillway::testing_support::run_cli("launch --gpus 2 -- train --backend cpu --steps 1");
  EXPECT_EQ(r.code, 1) << r.output;
  if (r.output.find("built without NCCL") != std::string::npos ||
      r.output.find("--gpus 2: this machine has") != std::string::npos) {
    EXPECT_NE(r.output.find("no rank was started"), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("[rank 1]"), std::string::npos) << r.output;
    return;
  }
  EXPECT_NE(r.output.find("[rank 1] spillway: error: Unsupported: WORLD_SIZE=2 (data-parallel training, rank 1): "
                          "--backend cpu"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("WORLD_SIZE=2 (data-parallel training, rank 0): --backend cpu"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("spillway launch: rank "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(" exited with status 1"), std::string::npos) << r.output;
}

namespace {

std::string bytes_of(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in.good()) << path;
  return std::string(std::istreambuf_iterator<char>(in), {});
}

}  // namespace

// The claim end to end: `spillway train --accum 4` (one process, the binary) and the
// data-parallel driver of `train` under WORLD_SIZE=2 with --accum 2 (here in two
// threads with in-process communicators, as the CPU has no transport between
// processes), given the options the command derives from the same flags (tiny's
// default learning rate, warmup, clip, seed; the default data), report the same
// losses and validation losses and save the same bytes.
TEST(TrainUnderWorldSize, TheDriverSavesWhatOneProcessOfTheCommandSaves) {
  const std::string dir = testing::TempDir() + "/launch_cli_same_bytes";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const int steps = 4;
  CliRun one = spillway::testing_support::run_cli(
      "train --backend cpu --threads 1 --model tiny --batch 2 --context 32 --accum 4 --steps 4 --eval-every 2 "
      "--eval-batches 2 --quiet --metrics " + dir + "/one.jsonl --save " + dir + "/one.safetensors");
  ASSERT_EQ(one.code, 0) << one.output;
  std::vector<float> losses, val;
  {
    std::ifstream in(dir + "/one.jsonl");
    std::string line;
    while (std::getline(in, line)) {
      const auto j = nlohmann::json::parse(line);
      losses.push_back(static_cast<float>(j.at("loss").get<double>()));  // %.9g: the float exactly
      if (j.contains("val_loss")) val.push_back(static_cast<float>(j.at("val_loss").get<double>()));
    }
  }
  ASSERT_EQ(losses.size(), static_cast<size_t>(steps));
  ASSERT_EQ(val.size(), 2u);

  using namespace spillway;
  auto data = load_dataset(std::string(SPILLWAY_SOURCE_DIR) + "/data/tinyshakespeare.txt", 256);
  ASSERT_TRUE(data.ok()) << data.status().to_string();
  testing_support::ThreadGroup group(2);
  std::vector<Status> status(2);
  std::vector<std::vector<float>> rank_losses(2), rank_val(2);
  std::atomic<int> finished{0};
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r)
    threads.emplace_back([&, r] {
      testing_support::ThreadCommunicator comm(group, r);
      auto backend = make_backend("cpu", {.threads = 1});
      DataParallelTrainingOptions o;
      o.trainer.model = *model_preset("tiny");
      o.trainer.shape = {.B = 2, .T = 32, .accum = 2};
      o.trainer.schedule = {.peak = 4e-3f, .warmup_steps = 20, .total_steps = steps};  // train's defaults for tiny
      o.trainer.seed = 1337;
      o.trainer.planner = {.policy = Policy::Planned};
      o.trainer.machine = Machine::cpu_dev_box();
      o.data = &*data;
      o.steps = steps;
      o.eval_every = 2;
      o.eval_batches = 2;
      if (r == 0) o.save = dir + "/many.safetensors";
      o.on_step = [&, r](const StepResult& s) {
        rank_losses[static_cast<size_t>(r)].push_back(s.loss);
        if (s.val_loss) rank_val[static_cast<size_t>(r)].push_back(*s.val_loss);
      };
      auto run = backend.ok() ? train_data_parallel(comm, **backend, o) : Result<DataParallelTrainingResult>(backend.status());
      ++finished;
      if (!run.ok()) {
        status[static_cast<size_t>(r)] = run.status();
        for (int i = 0; i < 400 && finished < 2; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(5));
        if (finished < 2) comm.abort(run.status().message());
      }
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < 2; ++r) ASSERT_TRUE(status[static_cast<size_t>(r)].is_ok()) << status[static_cast<size_t>(r)].to_string();
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(rank_losses[static_cast<size_t>(r)].size(), losses.size());
    EXPECT_EQ(std::memcmp(rank_losses[static_cast<size_t>(r)].data(), losses.data(), losses.size() * sizeof(float)), 0)
        << "rank " << r << "'s losses";
  }
  ASSERT_EQ(rank_val[0].size(), val.size());
  EXPECT_EQ(std::memcmp(rank_val[0].data(), val.data(), val.size() * sizeof(float)), 0) << "validation losses";
  EXPECT_TRUE(bytes_of(dir + "/many.safetensors") == bytes_of(dir + "/one.safetensors"))
      << "the saved weights differ from the command's";
}
