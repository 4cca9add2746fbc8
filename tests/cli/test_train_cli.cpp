// `spillway train`, `sample`, `info` and `bench train`, run as a user would: the
// built binary, its exit code and what it prints.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "backend/backend.h"

namespace {

struct CliRun {
  int code = -1;
  std::string output;  // stdout and stderr together
};

CliRun run(const std::string& args) {
  // The bundled corpus, wherever the build folder is.
  ::setenv("SPILLWAY_DATA", SPILLWAY_SOURCE_DIR "/data", 0);
  const std::string cmd = std::string(SPILLWAY_BINARY) + " " + args + " 2>&1";
  CliRun r;
  FILE* p = ::popen(cmd.c_str(), "r");
  if (!p) {
    ADD_FAILURE() << "popen failed for " << cmd;
    return r;
  }
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) r.output.append(buf, n);
  const int status = ::pclose(p);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

std::string temp_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() / ("spillway_test_cli_" + name)).string();
}

// A model small enough that a step takes milliseconds.
const std::string kSmall = "--layers 1 --width 32 --heads 2 --model-context 32 --context 32 --batch 2 --backend cpu --threads 2";

void expect_rejected(const std::string& args, const std::vector<std::string>& needles) {
  CliRun r = run(args);
  EXPECT_EQ(r.code, 1) << args << "\n" << r.output;
  EXPECT_NE(r.output.find("spillway: error:"), std::string::npos) << r.output;
  for (const std::string& needle : needles)
    EXPECT_NE(r.output.find(needle), std::string::npos) << "'" << needle << "' not in: " << r.output;
}

TEST(TrainCli, MissingDataFile) {
  expect_rejected("train --steps 1 --data /nonexistent/corpus.txt " + kSmall, {"--data", "/nonexistent/corpus.txt"});
}

TEST(TrainCli, EmptyDataFile) {
  const std::string path = temp_path("empty.txt");
  { std::ofstream f(path); }
  expect_rejected("train --steps 1 --data " + path + " " + kSmall, {"--data", path, "empty"});
  std::filesystem::remove(path);
}

TEST(TrainCli, ContextLongerThanTheModels) {
  expect_rejected("train --steps 1 --model tiny --context 256 --backend cpu", {"--context 256", "128"});
}

TEST(TrainCli, UnparseableSize) {
  expect_rejected("train --steps 1 --device-budget '12 parsecs' " + kSmall, {"--device-budget", "12 parsecs"});
}

TEST(TrainCli, ZeroBudget) {
  expect_rejected("train --steps 1 --host-budget 0 " + kSmall, {"--host-budget", "0 bytes"});
  expect_rejected("train --steps 1 --device-budget 0 " + kSmall, {"--device-budget"});
}

TEST(TrainCli, UnknownPolicy) {
  expect_rejected("train --steps 1 --policy magic " + kSmall, {"--policy", "magic"});
}

TEST(TrainCli, UnknownModel) {
  expect_rejected("train --steps 1 --model gpt-5", {"--model", "gpt-5", "tiny"});
}

TEST(TrainCli, CudaWhenUnavailable) {
  if (spillway::cuda_available()) GTEST_SKIP() << "a GPU is present";
  expect_rejected("train --steps 1 --layers 1 --width 32 --heads 2 --model-context 32 --backend cuda",
                  {"--backend cuda", "cpu"});
}

TEST(TrainCli, BudgetBelowTheLargestOp) {
  expect_rejected("train --steps 1 --policy planned --device-budget 1KiB " + kSmall, {"device budget", "1.00 KiB"});
}

TEST(TrainCli, MetricsFileHasOneLinePerStepWithEveryKey) {
  const std::string path = temp_path("metrics.jsonl");
  CliRun r = run("train --steps 3 --eval-every 3 --eval-batches 2 --quiet --metrics " + path + " " + kSmall);
  ASSERT_EQ(r.code, 0) << r.output;
  std::ifstream in(path);
  std::string line;
  std::vector<nlohmann::json> lines;
  while (std::getline(in, line)) lines.push_back(nlohmann::json::parse(line));
  ASSERT_EQ(lines.size(), 3u);
  for (size_t i = 0; i < lines.size(); ++i) {
    const auto& j = lines[i];
    for (const char* key : {"step", "loss", "lr", "grad_norm", "tokens", "step_s", "tokens_per_s", "h2d_bytes",
                            "d2h_bytes", "storage_read_bytes", "storage_write_bytes", "recomputed_ops", "stall_s",
                            "peak_device_bytes", "peak_host_bytes", "peak_storage_bytes"})
      EXPECT_TRUE(j.contains(key)) << key << " missing from line " << i + 1;
    EXPECT_EQ(j["step"].get<int>(), static_cast<int>(i + 1));
    EXPECT_EQ(j["tokens"].get<int>(), 2 * 32);
    EXPECT_GT(j["loss"].get<double>(), 0.0);
  }
  EXPECT_FALSE(lines[0].contains("val_loss"));
  EXPECT_TRUE(lines[2].contains("val_loss"));
  EXPECT_NE(r.output.find("final train loss"), std::string::npos) << r.output;
  std::filesystem::remove(path);
}

TEST(TrainCli, SpillingRunMatchesResidentLossesAndSamples) {
  const std::string resident = temp_path("resident.jsonl");
  const std::string spilled = temp_path("spilled.jsonl");
  const std::string weights = temp_path("small.safetensors");
  CliRun a = run("train --steps 3 --eval-every 0 --quiet --policy resident --metrics " + resident + " " + kSmall);
  ASSERT_EQ(a.code, 0) << a.output;
  CliRun b = run("train --steps 3 --eval-every 0 --quiet --policy planned --device-budget 256KiB --save " + weights +
              " --metrics " + spilled + " " + kSmall);
  ASSERT_EQ(b.code, 0) << b.output;
  std::ifstream ra(resident), rb(spilled);
  std::string la, lb;
  int lines = 0;
  while (std::getline(ra, la) && std::getline(rb, lb)) {
    auto ja = nlohmann::json::parse(la), jb = nlohmann::json::parse(lb);
    EXPECT_EQ(ja["loss"].get<double>(), jb["loss"].get<double>()) << "step " << ja["step"];
    EXPECT_LE(jb["peak_device_bytes"].get<uint64_t>(), 256u * 1024);
    EXPECT_GT(jb["h2d_bytes"].get<uint64_t>(), 0u);
    ++lines;
  }
  EXPECT_EQ(lines, 3);

  CliRun s = run("sample --load " + weights + " --prompt 'ROMEO:' --tokens 20 --temperature 0 --backend cpu");
  ASSERT_EQ(s.code, 0) << s.output;
  EXPECT_EQ(s.output.rfind("ROMEO:", 0), 0u) << s.output;
  EXPECT_GE(s.output.size(), 6u + 20u);
  CliRun s2 = run("sample --load " + weights + " --prompt 'ROMEO:' --tokens 20 --temperature 0 --backend cpu");
  EXPECT_EQ(s.output, s2.output);

  // Continue training from the checkpoint; sizes that disagree with it are refused.
  CliRun c = run("train --steps 1 --eval-every 0 --quiet --load " + weights +
                 " --layers 1 --width 32 --context 32 --batch 2 --backend cpu --threads 2");
  EXPECT_EQ(c.code, 0) << c.output;
  expect_rejected("train --steps 1 --load " + weights + " --layers 3 --context 32 --backend cpu",
                  {"--load", weights, "layers=3"});
  std::filesystem::remove(resident);
  std::filesystem::remove(spilled);
  std::filesystem::remove(weights);
}

TEST(SampleCli, MissingCheckpoint) {
  expect_rejected("sample --load /nonexistent/w.safetensors --backend cpu", {"--load", "/nonexistent/w.safetensors"});
}

TEST(InfoCli, ListsBackendsAndPresets) {
  CliRun r = run("info");
  ASSERT_EQ(r.code, 0) << r.output;
  for (const char* needle : {"CUDA backend", "io_uring", "cpu", "tiny", "gpt2-124m", "hardware threads"})
    EXPECT_NE(r.output.find(needle), std::string::npos) << needle << " not in: " << r.output;
}

TEST(BenchTrainCli, ReportsThroughput) {
  CliRun r = run("bench train --steps 2 " + kSmall);
  ASSERT_EQ(r.code, 0) << r.output;
  for (const char* needle : {"tokens/s", "step time", "stall share"})
    EXPECT_NE(r.output.find(needle), std::string::npos) << needle << " not in: " << r.output;
}

TEST(BenchTrainCli, ProfileSplitsOneStep) {
  CliRun r = run("bench train --steps 2 --profile " + kSmall);
  ASSERT_EQ(r.code, 0) << r.output;
  for (const char* needle : {"time split", "sum of ops", "slowest", "host issue"})
    EXPECT_NE(r.output.find(needle), std::string::npos) << needle << " not in: " << r.output;
  // The four shares of the split add up to the whole.
  double total = 0;
  for (const char* part : {"matmul", "attention", "other kernels", "optimizer"}) {
    const size_t at = r.output.find("\n  " + std::string(part));
    ASSERT_NE(at, std::string::npos) << part << " not in: " << r.output;
    const size_t line_end = r.output.find('\n', at + 1);
    const std::string line = r.output.substr(at + 1, line_end - at - 1);
    const size_t pct = line.rfind('%');
    ASSERT_NE(pct, std::string::npos) << line;
    const size_t start = line.find_last_of(' ', pct) + 1;
    total += std::stod(line.substr(start, pct - start));
  }
  EXPECT_NEAR(total, 100.0, 0.5) << r.output;
}

TEST(PlanCli, TilesTheVocabularyWhenTheBudgetCallsForIt) {
  CliRun r = run("plan --model gpt2-124m --machine cpu --batch 1 --context 128 --device-budget 100MiB");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("vocab tiles of 8192 rows"), std::string::npos) << r.output;
  expect_rejected("plan --model gpt2-124m --machine cpu --batch 1 --context 128 --device-budget 60MiB",
                  {"minimum", "lm_head.backward#0", "--device-budget"});
}

TEST(PlanCli, ReportsPlacementPeaksLinksAndPredictedStep) {
  for (const char* command : {"plan", "simulate"}) {
    CliRun r = run(std::string(command) + " --model tiny --machine cpu --batch 4 --device-budget 8MiB --policy planned");
    ASSERT_EQ(r.code, 0) << r.output;
    for (const char* needle : {"param", "optstate", "activation", "memory peak", "per step: h2d", "predicted step"})
      EXPECT_NE(r.output.find(needle), std::string::npos) << command << ": " << needle << " not in: " << r.output;
  }
  CliRun what_if = run("simulate --model gpt2-124m --machine h200 --h2d-gbps 5 --device-budget 2GiB");
  ASSERT_EQ(what_if.code, 0) << what_if.output;
  expect_rejected("plan --model tiny --machine tpu", {"--machine", "tpu"});
  expect_rejected("plan --model tiny --machine cpu --device-budget 1KiB --policy planned", {"minimum", "--device-budget"});
  expect_rejected("plan --model tiny --order sideways", {"--order"});
}

}  // namespace
