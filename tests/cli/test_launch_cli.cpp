// `spillway train` under RANK, WORLD_SIZE and LOCAL_RANK, and `spillway launch`, run
// as a user would on this GPU-less machine: every bad variable and every refusal is
// an error naming what is wrong, before anything trains; WORLD_SIZE 1 trains as always.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <map>
#include <string>

#include "support/cli_support.h"

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
       }) {
    CliRun r = spillway::testing_support::run_cli(args);
    EXPECT_EQ(r.code, 1) << args << ": " << r.output;
    EXPECT_NE(r.output.find(expected), std::string::npos) << args << ": expected '" << expected << "' in: " << r.output;
  }
}

// Two ranks of `train --backend cpu`: a build without NCCL refuses before starting
// any; a build with NCCL starts both, each refuses the CPU backend, rank 1's line
// comes prefixed, and the launcher names the rank that failed first.
TEST(LaunchCli, StartsRanksOrSaysWhyNot) {
  CliRun r = spillway::testing_support::run_cli("launch --gpus 2 -- train --backend cpu --steps 1");
  EXPECT_EQ(r.code, 1) << r.output;
  if (r.output.find("built without NCCL") != std::string::npos) {
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
