// `spillway train`, `sample`, `info` and `bench train`, run as a user would: the
// built binary, its exit code and what it prints.
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <regex>
#include <sstream>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "backend/backend.h"
#include "backend/backend_sizes.h"
#include "core/size.h"
#include "exec/dispatch.h"
#include "model/model.h"
#include "model/safetensors.h"
#include "support/cli_support.h"
#include "support/test_support.h"

extern char** environ;

namespace {

using spillway::testing_support::read_file;

using spillway::testing_support::CliRun;
CliRun run(const std::string& args) { return spillway::testing_support::run_cli(args); }

// Starts the binary in the background, stdout and stderr into `log`; its pid.
pid_t start(const std::string& args, const std::string& log) {
  ::setenv("SPILLWAY_DATA", SPILLWAY_SOURCE_DIR "/data", 0);
  const std::string cmd = "exec " + std::string(SPILLWAY_BINARY) + " " + args + " >" + log + " 2>&1";
  const char* argv[] = {"/bin/sh", "-c", cmd.c_str(), nullptr};
  pid_t pid = -1;
  if (::posix_spawn(&pid, "/bin/sh", nullptr, nullptr, const_cast<char**>(argv), environ) != 0) return -1;
  return pid;
}

// Its exit code once it ends (-signo if a signal killed it); killed and -1 after `seconds`.
int wait_exit(pid_t pid, int seconds) {
  for (int i = 0; i < seconds * 100; ++i) {
    int status = 0;
    if (::waitpid(pid, &status, WNOHANG) == pid) return WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ::kill(pid, SIGKILL);
  int status = 0;
  ::waitpid(pid, &status, 0);
  return -1;
}

size_t count_lines(const std::string& path) {
  std::ifstream in(path);
  size_t n = 0;
  std::string line;
  while (std::getline(in, line)) ++n;
  return n;
}

// The entries of `dir` whose name starts with "spillway-".
std::vector<std::string> spill_entries(const std::string& dir) {
  std::vector<std::string> found;
  for (const auto& e : std::filesystem::directory_iterator(dir))
    if (e.path().filename().string().rfind("spillway-", 0) == 0) found.push_back(e.path().string());
  return found;
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

// A size or rate flag given as 0 is refused by name: it used to mean "left out" and
// silently gave the preset's value.
TEST(TrainCli, ZeroForASizeOrTheLearningRateIsRefusedNotTakenAsTheDefault) {
  for (const std::string flag : {"--layers", "--width", "--heads", "--vocab", "--model-context", "--context", "--lr"})
    expect_rejected("train --model tiny --steps 1 --batch 2 --eval-every 0 --backend cpu " + flag + " 0",
                    {flag + ": expected a finite number above 0, got '0'"});
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

// --zero-stage takes 2 or 3, and 3 only for data-parallel ranks.
TEST(TrainCli, ZeroStage) {
  expect_rejected("train --steps 1 --zero-stage 4 " + kSmall, {"--zero-stage", "expected 2", "got 4"});
  expect_rejected("train --steps 1 --zero-stage 3 " + kSmall, {"--zero-stage 3", "data-parallel", "one process"});
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
                  {"--load", weights, "--layers 3 disagrees with the weights: 1 block(s)"});
  std::filesystem::remove(resident);
  std::filesystem::remove(spilled);
  std::filesystem::remove(weights);
}

// Budgets under which kSmall keeps part of its state (208 KiB) in the spill directory.
const std::string kSpills = "--policy planned --device-budget 400KiB --host-budget 400KiB";

// Starts a long spilling run and waits until it has taken a step (its metrics file
// has a line) and its spill directory exists; then sends `signals`, one after the
// other, and returns the exit code.
int interrupt_training(const std::string& spill_dir, const std::string& model_args, const std::vector<int>& signals,
                       std::string* log_text) {
  std::filesystem::remove_all(spill_dir);
  std::filesystem::create_directories(spill_dir);
  const std::string metrics = spill_dir + ".jsonl", log = spill_dir + ".log";
  std::filesystem::remove(metrics);
  pid_t pid =
      start("train --steps 1000000 --eval-every 0 --spill-dir " + spill_dir + " --metrics " + metrics + " " + model_args,
            log);
  EXPECT_GT(pid, 0);
  if (pid <= 0) return -1;
  bool stepping = false;
  for (int i = 0; i < 6000 && !stepping; ++i) {
    stepping = count_lines(metrics) >= 1;
    if (!stepping) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_TRUE(stepping) << read_file(log);
  EXPECT_EQ(spill_entries(spill_dir).size(), 1u) << "the run does not spill: " << read_file(log);
  for (size_t i = 0; i < signals.size(); ++i) {
    // Signals of one kind do not queue: the next goes once the watcher took this one.
    if (i > 0)
      for (int t = 0; t < 1000 && read_file(log).find("received: stopping") == std::string::npos; ++t)
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
    ::kill(pid, signals[i]);
  }
  const int code = wait_exit(pid, 60);
  *log_text = read_file(log);
  std::filesystem::remove(metrics);
  std::filesystem::remove(log);
  return code;
}

TEST(TrainCli, SigtermStopsBetweenStepsAndRemovesTheSpillDirectory) {
  const std::string dir = temp_path("sigterm_spill");
  std::string log;
  const int code = interrupt_training(dir, kSpills + " " + kSmall, {SIGTERM}, &log);
  EXPECT_EQ(code, 128 + SIGTERM) << log;
  EXPECT_NE(log.find("interrupted by SIGTERM before step"), std::string::npos) << log;
  EXPECT_NE(log.find("spill directory is removed"), std::string::npos) << log;
  EXPECT_TRUE(spill_entries(dir).empty()) << log;
  std::filesystem::remove_all(dir);
}

TEST(TrainCli, SecondSigintStopsAtOnceAndStillRemovesTheSpillDirectory) {
  const std::string dir = temp_path("sigint_spill");
  std::string log;
  // Steps of about 1.2 s (23 MiB spilled): both signals arrive within one step.
  const int code = interrupt_training(dir,
                                      "--model tiny --batch 4 --accum 8 --device-budget 3501369 --host-budget 8MiB "
                                      "--policy planned --backend cpu --threads 2",
                                      {SIGINT, SIGINT}, &log);
  EXPECT_EQ(code, 128 + SIGINT) << log;
  EXPECT_NE(log.find("stopped at once; removed " + dir + "/spillway-"), std::string::npos) << log;
  EXPECT_TRUE(spill_entries(dir).empty()) << log;
  std::filesystem::remove_all(dir);
}

// Pids above 2^22 (the kernel's largest pid_max) name no process.
const std::string kDeadPid = std::to_string((1 << 22) + 11);

// Bytes no file system compresses, so that the space they take is their size.
std::string incompressible(size_t n) {
  std::string text(n, '\0');
  uint64_t x = 88172645463325252ull;
  for (char& c : text) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    c = static_cast<char>(x);
  }
  return text;
}

TEST(CleanCli, RemovesOnlyTheLeftoversOfDeadRunsAndSaysHowMuch) {
  const std::string dir = temp_path("clean");
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir + "/spillway-" + kDeadPid + "-deadbeef");
  std::ofstream(dir + "/spillway-" + kDeadPid + "-deadbeef/owner") << "spillway spill directory\npid " << kDeadPid << "\n";
  std::ofstream(dir + "/spillway-" + kDeadPid + "-deadbeef/spill-0.bin") << incompressible(300000);
  const std::string live_spill = dir + "/spillway-" + std::to_string(::getpid()) + "-cafe0000";
  std::filesystem::create_directories(live_spill);
  std::ofstream(live_spill + "/spill-0.bin") << "in use";
  const std::string dead_temp = dir + "/w.safetensors.tmp-" + kDeadPid + "-0a1b2c3d";
  const std::string live_temp = dir + "/w.safetensors.tmp-" + std::to_string(::getpid()) + "-0a1b2c3d";
  std::ofstream(dead_temp) << incompressible(200000);
  std::ofstream(live_temp) << "being written";
  std::ofstream(dir + "/w.safetensors") << "weights";

  CliRun dry = run("clean " + dir + " --dry-run");
  ASSERT_EQ(dry.code, 0) << dry.output;
  EXPECT_NE(dry.output.find("would remove " + dir + "/spillway-" + kDeadPid + "-deadbeef (spill directory of pid " +
                            kDeadPid),
            std::string::npos)
      << dry.output;
  EXPECT_NE(dry.output.find("would remove " + dead_temp + " (temporary file of pid " + kDeadPid), std::string::npos)
      << dry.output;
  EXPECT_NE(dry.output.find("would free"), std::string::npos) << dry.output;
  EXPECT_TRUE(std::filesystem::exists(dead_temp));
  EXPECT_EQ(spill_entries(dir).size(), 2u);

  CliRun clean = run("clean " + dir);
  ASSERT_EQ(clean.code, 0) << clean.output;
  EXPECT_NE(clean.output.find("removed " + dead_temp), std::string::npos) << clean.output;
  // 300000 + 200000 bytes of data, plus the marker's block.
  const size_t freed = clean.output.find("freed ");
  ASSERT_NE(freed, std::string::npos) << clean.output;
  const double kib = std::stod(clean.output.substr(freed + 6));
  EXPECT_GE(kib, 488.0) << clean.output;
  EXPECT_LE(kib, 520.0) << clean.output;
  EXPECT_NE(clean.output.find("KiB in " + dir), std::string::npos) << clean.output;
  EXPECT_FALSE(std::filesystem::exists(dead_temp));
  EXPECT_EQ(spill_entries(dir), std::vector<std::string>{live_spill});
  EXPECT_TRUE(std::filesystem::exists(live_spill + "/spill-0.bin"));
  EXPECT_TRUE(std::filesystem::exists(live_temp));
  EXPECT_TRUE(std::filesystem::exists(dir + "/w.safetensors"));

  CliRun again = run("clean " + dir);
  EXPECT_EQ(again.code, 0) << again.output;
  EXPECT_NE(again.output.find("nothing to clean"), std::string::npos) << again.output;
  expect_rejected("clean " + dir + "/missing", {dir + "/missing"});
  std::filesystem::remove_all(dir);
}

// A model directory save killed before its rename leaves DIR.tmp-<pid>-<random>/:
// clean lists it with the bytes in it and removes it; a live writer's stays.
TEST(CleanCli, RemovesTheTemporaryFolderOfAKilledDirectorySave) {
  const std::string dir = temp_path("clean_folder");
  std::filesystem::remove_all(dir);
  const std::string dead = dir + "/llama.tmp-" + kDeadPid + "-0a1b2c3d";
  const std::string live = dir + "/llama.tmp-" + std::to_string(::getpid()) + "-0a1b2c3d";
  std::filesystem::create_directories(dead);
  std::filesystem::create_directories(live);
  std::ofstream(dead + "/model-00001-of-00002.safetensors") << incompressible(200000);
  std::ofstream(dead + "/model-00002-of-00002.safetensors.tmp-" + kDeadPid + "-11112222") << incompressible(100000);
  std::ofstream(live + "/model.safetensors") << "being written";
  CliRun dry = run("clean " + dir + " --dry-run");
  ASSERT_EQ(dry.code, 0) << dry.output;
  EXPECT_NE(dry.output.find("would remove " + dead + " (temporary folder of pid " + kDeadPid), std::string::npos)
      << dry.output;
  EXPECT_EQ(dry.output.find(live), std::string::npos) << dry.output;
  CliRun clean = run("clean " + dir);
  ASSERT_EQ(clean.code, 0) << clean.output;
  const size_t freed = clean.output.find("freed ");
  ASSERT_NE(freed, std::string::npos) << clean.output;
  EXPECT_GE(std::stod(clean.output.substr(freed + 6)), 290.0) << clean.output;
  EXPECT_FALSE(std::filesystem::exists(dead));
  EXPECT_TRUE(std::filesystem::exists(live + "/model.safetensors"));
  std::filesystem::remove_all(dir);
}

TEST(TrainCli, ReportsTemporaryFilesOfKilledSavesBesideTheSaveFile) {
  const std::string dir = temp_path("stale_save");
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::string stale = dir + "/w.safetensors.tmp-" + kDeadPid + "-0a1b2c3d";
  std::ofstream(stale) << std::string(100000, 'y');
  CliRun r = run("train --steps 1 --eval-every 0 --quiet --save " + dir + "/w.safetensors " + kSmall);
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("1 temporary file of unfinished saves (pid " + kDeadPid + ")"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("`spillway clean " + dir + "`"), std::string::npos) << r.output;
  EXPECT_TRUE(std::filesystem::exists(stale));  // reported, not removed
  // The save itself leaves only its file.
  size_t temps = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir))
    temps += e.path().filename().string().find(".tmp-") != std::string::npos;
  EXPECT_EQ(temps, 1u);
  EXPECT_TRUE(std::filesystem::exists(dir + "/w.safetensors"));
  std::filesystem::remove_all(dir);
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
  for (const char* needle : {"tokens/s", "step time", "executor waits"})
    EXPECT_NE(r.output.find(needle), std::string::npos) << needle << " not in: " << r.output;
}

// bench ops prints each op with how many times a step runs it ("xN", or "part" for a
// piece of a fused op shown beside it), and its step estimate is the sum of the rows
// times their counts: the fused ops the program runs are summed, their parts are not.
TEST(BenchOpsCli, StepEstimateSumsTheOpsTheProgramRuns) {
  const int L = 3;
  CliRun r = run("bench ops --backend cpu --threads 2 --B 1 --T 16 --C 32 --NH 2 --V 96 --L " + std::to_string(L) +
                 " --reps 1 --rounds 1");
  ASSERT_EQ(r.code, 0) << r.output;
  std::istringstream lines(r.output);
  std::string line;
  std::map<std::string, std::string> count;  // row name -> "xN" or "part"
  double sum_ms = 0, estimate_ms = -1;
  int summed_rows = 0;
  while (std::getline(lines, line)) {
    std::smatch m;
    if (std::regex_search(line, m, std::regex(R"(^step estimate \(\d+ params\)\s+([0-9.]+) ms)"))) {
      estimate_ms = std::stod(m[1]);
    } else if (std::regex_search(line, m, std::regex(R"(^(.+?)\s+([0-9.]+) ms\s+(x\d+|part)\b)"))) {
      count[m[1]] = m[3];
      if (m[3] != "part") {
        sum_ms += std::stod(m[2]) * std::stoi(m[3].str().substr(1));
        ++summed_rows;
      }
    }
  }
  ASSERT_GE(estimate_ms, 0) << r.output;
  // Each row is printed to 0.001 ms; the estimate sums unrounded times.
  EXPECT_NEAR(estimate_ms, sum_ms, 0.0005 * (summed_rows * (2 * L + 1)) + 0.0005) << r.output;
  const std::string per_layer = "x" + std::to_string(L);
  for (const auto& [name, want] : std::vector<std::pair<std::string, std::string>>{
           {"fc fwd + gelu, one op", per_layer},
           {"fc proj bwd dinp + dgelu, one op", per_layer},
           {"fc proj bwd weights, one op", per_layer},
           {"attn proj fwd + residual, one op", per_layer},
           {"fc proj fwd + residual, one op", per_layer},
           {"matmul fwd qkv", per_layer},
           {"matmul bwd fc", per_layer},
           {"layernorm fwd", "x" + std::to_string(2 * L + 1)},
           {"matmul fwd lm head", "x1"},
           {"adamw (all params)", "x1"},
           {"matmul fwd fc", "part"},
           {"gelu fwd", "part"},
           {"residual", "part"},
           {"matmul bwd fc proj", "part"}})
    EXPECT_EQ(count[name], want) << name << " in: " << r.output;
}

// bench ops refuses a shape it cannot run, naming the flag and its value.
TEST(BenchOpsCli, BadShapesAreRefusedByName) {
  expect_rejected("bench ops --backend cpu --L 0", {"--L is 0", "positive"});
  expect_rejected("bench ops --backend cpu --B -1", {"--B is -1"});
  expect_rejected("bench ops --backend cpu --C 7 --NH 2", {"--C 7", "multiple of --NH 2"});
  expect_rejected("bench ops --backend cpu --reps 0", {"--reps"});
}

// bench train reports the device memory the process used (printed and as JSON), and
// a budgeted run's peak, workspace included, stays within --device-budget.
TEST(BenchTrainCli, ReportsDeviceMemoryUsedWithinTheBudget) {
  const std::string json = temp_path("bench_memory.json");
  auto read_json = [](const std::string& path) {
    std::ifstream in(path);
    return nlohmann::json::parse(in);
  };
  CliRun free_run = run("bench train --steps 2 --json " + json + " " + kSmall);
  ASSERT_EQ(free_run.code, 0) << free_run.output;
  EXPECT_NE(free_run.output.find("device used"), std::string::npos) << free_run.output;
  const nlohmann::json a = read_json(json);
  EXPECT_TRUE(a["device_budget_bytes"].is_null());
  // The time to the first step, and its parts: setup (build, plan, allocate) and init.
  EXPECT_NE(free_run.output.find("first step    after"), std::string::npos) << free_run.output;
  const double first = a["time_to_first_step_s"].get<double>(), setup = a["setup_s"].get<double>(),
               init = a["init_s"].get<double>();
  EXPECT_GT(setup, 0.0);
  EXPECT_GT(init, 0.0);
  EXPECT_GE(first + 1e-5, setup + init);  // each printed to the microsecond
  // The setup's parts, in order, within it: program, kernel load, plan, executor.
  double parts = 0;
  for (const char* k : {"setup_build_s", "setup_kernel_load_s", "setup_plan_s", "setup_executor_s"}) {
    ASSERT_TRUE(a.contains(k)) << k;
    EXPECT_GE(a[k].get<double>(), 0.0) << k;
    parts += a[k].get<double>();
  }
  EXPECT_GT(a["setup_plan_s"].get<double>(), 0.0);
  EXPECT_GT(a["setup_executor_s"].get<double>(), 0.0);
  EXPECT_LE(parts, setup + 4e-6);
  EXPECT_NE(free_run.output.find("(program "), std::string::npos) << free_run.output;
  EXPECT_NE(free_run.output.find("executor and its memory"), std::string::npos) << free_run.output;
  // The simulator's prediction for the same plan, beside the measurement.
  EXPECT_NE(free_run.output.find("predicted     "), std::string::npos) << free_run.output;
  EXPECT_NE(free_run.output.find("on machine cpu-dev-box"), std::string::npos) << free_run.output;
  EXPECT_GT(a["predicted_step_s"].get<double>(), 0.0);
  const uint64_t used = a["device_used_peak_bytes"].get<uint64_t>();
  EXPECT_GE(used, a["peak_device_bytes"].get<uint64_t>());
  EXPECT_GE(used, a["device_used_bytes"].get<uint64_t>());
  const uint64_t budget = used / 2 / 64 * 64;
  CliRun tight = run("bench train --steps 2 --policy planned --device-budget " + std::to_string(budget) + " --json " +
                     json + " " + kSmall);
  ASSERT_EQ(tight.code, 0) << tight.output;
  const nlohmann::json b = read_json(json);
  EXPECT_EQ(b["device_budget_bytes"].get<uint64_t>(), budget);
  EXPECT_LE(b["device_used_peak_bytes"].get<uint64_t>(), budget);
  EXPECT_GT(b["device_used_peak_bytes"].get<uint64_t>(), 0u);
  std::filesystem::remove(json);
}

TEST(BenchTrainCli, ProfileSplitsOneStep) {
  CliRun r = run("bench train --steps 2 --profile " + kSmall);
  ASSERT_EQ(r.code, 0) << r.output;
  for (const char* needle : {"time split", "sum of ops", "slowest", "host issue"})
    EXPECT_NE(r.output.find(needle), std::string::npos) << needle << " not in: " << r.output;
  // The milliseconds after a row's label ("  matmul   0.21 ms ...").
  auto ms = [&](const std::string& label) {
    const size_t at = r.output.find("\n  " + label + " ");
    if (at == std::string::npos) {
      ADD_FAILURE() << label << " not in: " << r.output;
      return -1.0;
    }
    return std::stod(r.output.substr(at + 3 + label.size()));
  };
  // Three figures the program computes apart: the four parts of the split (ops by
  // kind), the sum over every op timed, and the profiled step on the trainer's clock.
  // The parts must add up to the sum (an op left out of the split, or counted twice,
  // shows here), and the sum must fit in the whole step that contained the ops (an
  // op timed twice, or a time in the wrong unit, shows here). Rows are rounded to 0.01 ms.
  double parts = 0;
  for (const char* part : {"matmul", "attention", "other kernels", "optimizer"}) parts += ms(part);
  const double sum = ms("sum of ops"), whole = ms("whole step");
  EXPECT_NEAR(parts, sum, 0.03) << r.output;
  EXPECT_GT(sum, 0) << r.output;
  EXPECT_LE(sum, whole + 0.01) << r.output;
  // Every op the plan runs was timed, once.
  const size_t timed_at = r.output.find(" ops timed, the plan runs ");
  ASSERT_NE(timed_at, std::string::npos) << r.output;
  const size_t timed_start = r.output.rfind(' ', timed_at - 1) + 1;
  const int timed = std::stoi(r.output.substr(timed_start));
  const int plan_runs = std::stoi(r.output.substr(timed_at + std::string(" ops timed, the plan runs ").size()));
  EXPECT_GT(plan_runs, 10) << r.output;
  EXPECT_EQ(timed, plan_runs) << r.output;
}

TEST(PlanCli, TilesTheVocabularyWhenTheBudgetCallsForIt) {
  CliRun r = run("plan --model gpt2-124m --machine cpu --batch 1 --context 128 --device-budget 100MiB");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("vocab tiles of 8192 rows"), std::string::npos) << r.output;
  expect_rejected("plan --model gpt2-124m --machine cpu --batch 1 --context 128 --device-budget 60MiB",
                  {"minimum", "lm_head.backward#0", "--device-budget"});
}

// plan and simulate reserve the device workspace of the backend --backend names, as
// train does, and say how much; the minimum budget they state includes it. The CUDA
// backend's figure needs no GPU (backend_sizes.h), so this runs everywhere.
// The flags of speculative updates, of where gradients are zeroed and of clipping name
// what they expect.
TEST(TrainCli, SpeculateAndGradClipFlagsAreChecked) {
  expect_rejected("train --model tiny --steps 1 --speculate maybe", {"--speculate", "auto, on or off", "maybe"});
  expect_rejected("plan --model tiny --batch 4 --speculate 1", {"--speculate", "auto, on or off"});
  expect_rejected("train --model tiny --steps 1 --zero-grads early", {"--zero-grads", "auto, start or late", "early"});
  expect_rejected("plan --model tiny --batch 4 --zero-grads on", {"--zero-grads", "auto, start or late"});
  expect_rejected("bench train --model tiny --batch 2 --context 64 --steps 2 --grad-clip -1",
                  {"--grad-clip", ">= 0", "0 = no clipping"});
}

// bench train splits its timed steps by what their speculative updates became, from
// each step's own counters and norm: without clipping every step commits; with a
// limit below every norm the first step clips and no later step speculates.
TEST(TrainCli, BenchTrainSplitsStepsBySpeculationOutcome) {
  const std::string base =
      "bench train --backend cpu --machine cpu --model tiny --batch 2 --context 64 --steps 7 --policy planned "
      "--device-budget 2MiB --device-optimizer 0 --speculate on --grad-clip ";
  // The run at `clip` prints the split `counts` ("C timed steps with committed
  // speculative updates, 0 with them redone (clipping active) and N without") and the
  // line of its one regime.
  auto expect_split = [&](const std::string& clip, const std::string& counts, const std::string& regime) {
    CliRun r = run(base + clip);
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_NE(r.output.find("for " + counts), std::string::npos) << r.output;
    EXPECT_NE(r.output.find(regime), std::string::npos) << r.output;
  };
  expect_split("0", "6 timed steps with committed speculative updates, 0 with them redone (clipping active) and 0 without",
               "6 steps with committed speculation:");
  expect_split("0.5",
               "0 timed steps with committed speculative updates, 0 with them redone (clipping active) and 6 without",
               "6 steps without speculation (the step after a clipped one):");
}

// The losses of a --metrics file, step by step, and the first step's gradient norm.
std::vector<double> metric_losses(const std::string& path, double* first_norm = nullptr) {
  std::ifstream in(path);
  std::string line;
  std::vector<double> losses;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line);
    if (first_norm && losses.empty()) *first_norm = j["grad_norm"].get<double>();
    losses.push_back(j["loss"].get<double>());
  }
  return losses;
}

// --grad-clip 0 trains without clipping: the same bits as a bound no step reaches, and
// other bits than a bound below the first step's norm (there the update is scaled).
TEST(TrainCli, GradClipBoundsTheUpdateAndZeroTurnsItOff) {
  const std::string off = temp_path("clip_off.jsonl"), high = temp_path("clip_high.jsonl"),
                    low = temp_path("clip_low.jsonl");
  const std::string base = "train --steps 3 --eval-every 0 --quiet --lr 0.01 --warmup 0 " + kSmall;
  CliRun a = run(base + " --grad-clip 0 --metrics " + off);
  ASSERT_EQ(a.code, 0) << a.output;
  CliRun b = run(base + " --grad-clip 1e300 --metrics " + high);  // beyond float: no bound
  ASSERT_EQ(b.code, 0) << b.output;
  double norm = 0;
  const std::vector<double> unclipped = metric_losses(off, &norm);
  ASSERT_EQ(unclipped.size(), 3u);
  EXPECT_EQ(metric_losses(high), unclipped);
  ASSERT_GT(norm, 0);
  char bound[64];
  std::snprintf(bound, sizeof bound, "%.6g", norm / 4);
  CliRun c = run(base + " --grad-clip " + bound + " --metrics " + low);
  ASSERT_EQ(c.code, 0) << c.output;
  const std::vector<double> clipped = metric_losses(low);
  ASSERT_EQ(clipped.size(), 3u);
  EXPECT_EQ(clipped[0], unclipped[0]);  // the first loss comes before any update
  EXPECT_NE(clipped[1], unclipped[1]) << "a bound of " << bound << " below the first norm " << norm;
  for (const char* bad : {"-1", "nan", "inf", "lots"})
    expect_rejected("train --steps 1 --grad-clip " + std::string(bad) + " " + kSmall, {"--grad-clip"});
  for (const std::string& p : {off, high, low}) std::filesystem::remove(p);
}

// The complete ("X") slices of a trace file, as track -> count.
std::map<std::string, int> trace_slices(const std::string& path) {
  std::ifstream in(path);
  std::map<std::string, int> count;
  const auto j = nlohmann::json::parse(in);
  for (const auto& e : j.at("traceEvents"))
    if (e.at("ph") == "X") count[e.at("cat").get<std::string>()]++;
  return count;
}

// --trace draws a measured step and --trace-predicted the simulator's step of the
// same plan: both have the step's compute and its copies. An unwritable predicted
// trace fails the run before its first step.
TEST(TrainCli, TraceAndPredictedTraceDrawTheSamePlan) {
  const std::string measured = temp_path("measured_trace.json"), predicted = temp_path("predicted_trace.json");
  CliRun r = run("train --steps 2 --eval-every 0 --quiet --policy planned --device-budget 256KiB --trace " + measured +
                 " --trace-predicted " + predicted + " " + kSmall);
  ASSERT_EQ(r.code, 0) << r.output;
  for (const std::string& path : {measured, predicted}) {
    const std::map<std::string, int> slices = trace_slices(path);
    for (const char* track : {"compute", "h2d", "d2h"})
      EXPECT_GT(slices.count(track) ? slices.at(track) : 0, 0) << track << " in " << path;
  }
  const std::string metrics = temp_path("never_metrics.jsonl");
  std::filesystem::remove(metrics);
  expect_rejected("train --steps 2 --eval-every 0 --metrics " + metrics + " --trace-predicted /nonexistent/dir/p.json " +
                      kSmall,
                  {"--trace-predicted", "/nonexistent/dir/p.json"});
  EXPECT_EQ(count_lines(metrics), 0u);
  for (const std::string& p : {measured, predicted, metrics}) std::filesystem::remove(p);
}

TEST(PlanCli, ReservesTheBackendsWorkspaceInsideTheDeviceBudget) {
  const std::string flags = " --model tiny --batch 4 --policy planned";
  auto cfg = spillway::model_preset("tiny");
  ASSERT_TRUE(cfg.ok());
  auto program =
      spillway::build_training_program(*cfg, {.B = 4, .T = cfg->context, .accum = 1}, spillway::DType::BF16);
  ASSERT_TRUE(program.ok());
  auto need = spillway::program_workspace(spillway::cuda_backend_sizes(), *program);
  ASSERT_TRUE(need.ok());
  const uint64_t workspace = (need->bytes + 255) / 256 * 256;
  ASSERT_GE(workspace, uint64_t{32} << 20);
  for (const char* command : {"plan", "simulate"}) {
    CliRun cuda = run(std::string(command) + flags + " --backend cuda --device-budget 64MiB");
    ASSERT_EQ(cuda.code, 0) << cuda.output;
    const std::string stated =
        "backend cuda: workspace " + spillway::format_size(workspace) + " inside the device budget";
    EXPECT_NE(cuda.output.find(stated), std::string::npos) << cuda.output;
    CliRun cpu = run(std::string(command) + flags + " --backend cpu --device-budget 64MiB");
    ASSERT_EQ(cpu.code, 0) << cpu.output;
    EXPECT_NE(cpu.output.find("backend cpu: workspace none"), std::string::npos) << cpu.output;
  }
  // The h200 machine plans for the CUDA backend unless told otherwise.
  CliRun h200 = run("plan" + flags + " --machine h200 --device-budget 64MiB");
  EXPECT_NE(h200.output.find("backend cuda: workspace"), std::string::npos) << h200.output;

  // 8 MiB runs this step on the CPU backend, but not with 32 MiB of it taken by the
  // workspace: the minimum stated is the largest op plus the workspace.
  ASSERT_EQ(run("plan" + flags + " --backend cpu --machine h200 --device-budget 8MiB").code, 0);
  CliRun low = run("plan" + flags + " --backend cuda --device-budget 8MiB");
  EXPECT_NE(low.code, 0) << low.output;
  for (const char* needle : {"backend cuda", "device budget 8.00 MiB is below the minimum", " of workspace"})
    EXPECT_NE(low.output.find(needle), std::string::npos) << needle << " not in: " << low.output;
  const std::string give = "give --device-budget ";
  const size_t at = low.output.find(give);
  ASSERT_NE(at, std::string::npos) << low.output;
  const uint64_t minimum_mib = std::stoull(low.output.substr(at + give.size()));
  EXPECT_GT(minimum_mib << 20, workspace) << low.output;
  EXPECT_EQ(minimum_mib % 2, 0u) << "the CUDA backend allocates in 2 MiB pages: " << low.output;
  // Just below the minimum is refused too, saying the same minimum.
  CliRun below = run("plan" + flags + " --backend cuda --device-budget " + std::to_string(minimum_mib - 1) + "MiB");
  EXPECT_NE(below.code, 0) << below.output;
  EXPECT_NE(below.output.find(give + std::to_string(minimum_mib) + "MiB"), std::string::npos) << below.output;
  EXPECT_NE(below.output.find("in whole 2.00 MiB pages"), std::string::npos) << below.output;
  expect_rejected("plan --model tiny --backend tpu", {"--backend", "tpu", "cpu or cuda"});
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

// Loading weights: nothing guessed, nothing unbounded, no NaN unless asked for.
namespace {

// A GPT-2 in the Hugging Face layout (Conv1D weights [in, out], names without
// "transformer."), as transformers saves it: GPT-2 initial values, `metadata` only as
// given, and `edit` to change a tensor's values (by our name) before writing.
void write_hf_gpt2(const std::string& path, const spillway::ModelConfig& c,
                   const std::map<std::string, std::string>& metadata = {},
                   const std::function<void(const std::string&, std::vector<float>&)>& edit = nullptr) {
  using namespace spillway;
  std::vector<SafetensorsTensor> tensors;
  for (const ParamSpec& s : parameter_specs(c)) {
    SafetensorsTensor t;
    t.name = s.name.substr(std::string("transformer.").size());
    t.shape = s.shape.dims;
    if (s.conv1d) std::swap(t.shape[0], t.shape[1]);
    t.values = [c, s, edit]() -> Result<std::vector<float>> {
      std::vector<float> v = init_parameter(c, s, 1);
      if (edit) edit(s.name, v);
      return v;
    };
    tensors.push_back(std::move(t));
  }
  Status st = write_safetensors(path, tensors, metadata);
  ASSERT_TRUE(st.is_ok()) << st.to_string();
}

// A folder of its own for a checkpoint and its config.json, removed at the end.
struct CheckpointDir {
  explicit CheckpointDir(const std::string& name) : dir(temp_path(name)) {
    std::filesystem::remove_all(dir);
    std::filesystem::create_directories(dir);
  }
  ~CheckpointDir() { std::filesystem::remove_all(dir); }
  std::string file(const std::string& name) const { return dir + "/" + name; }
  std::string dir;
};

const std::string kLoadRun = " --steps 1 --eval-every 0 --context 16 --batch 2 --backend cpu --threads 2";

TEST(LoadCli, HeadsComeFromConfigJsonOrHeadsNeverFromTheWidth) {
  // A transformers GPT-2 with head size 32 (width 128, 4 heads): width/64 would be 2.
  CheckpointDir d("hf_head32");
  const spillway::ModelConfig c{1, 128, 4, 32, 256};
  const std::string weights = d.file("model.safetensors");
  write_hf_gpt2(weights, c);
  const std::string config = d.file("config.json");
  {
    std::ofstream f(config);
    f << nlohmann::json{{"model_type", "gpt2"}, {"n_layer", 1}, {"n_embd", 128}, {"n_head", 4},
                        {"n_positions", 32}, {"n_ctx", 32}, {"vocab_size", 256}}
             .dump(2);
  }
  CliRun r = run("train --load " + weights + kLoadRun);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("layers=1 width=128 heads=4 context=32 vocab=256"), std::string::npos) << r.output;
  // --heads must agree with config.json.
  expect_rejected("train --load " + weights + " --heads 2" + kLoadRun,
                  {"--load", "--heads 2 disagrees with n_head 4 (" + config + ")"});
  r = run("sample --load " + weights + " --prompt 'ab' --tokens 4 --backend cpu --context 16");
  EXPECT_EQ(r.code, 0) << r.output;

  // Without config.json: an error asking for --heads; with --heads 4 it loads.
  std::filesystem::remove(config);
  expect_rejected("train --load " + weights + kLoadRun, {"--load", weights, "no n_head", "pass --heads"});
  expect_rejected("sample --load " + weights + " --prompt 'ab' --tokens 4 --backend cpu --context 16",
                  {"--load", "pass --heads"});
  r = run("train --load " + weights + " --heads 4" + kLoadRun);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("heads=4"), std::string::npos) << r.output;
  r = run("sample --load " + weights + " --heads 4 --prompt 'ab' --tokens 4 --backend cpu --context 16");
  EXPECT_EQ(r.code, 0) << r.output;
  // A config.json that is not JSON is named.
  {
    std::ofstream f(config);
    f << "{\"n_head\": 4,";
  }
  expect_rejected("train --load " + weights + kLoadRun, {"--load", config, "not valid JSON"});
}

TEST(LoadCli, NonFiniteWeightsAreRefusedUnlessAllowed) {
  CheckpointDir d("nan_weights");
  const spillway::ModelConfig c{1, 32, 2, 32, 256};
  const std::string weights = d.file("nan.safetensors");
  // A NaN in a row of wpe past --context 16, so a run that loads it anyway trains.
  write_hf_gpt2(weights, c, {{"n_head", "2"}}, [](const std::string& name, std::vector<float>& v) {
    if (name == "transformer.wpe.weight") v[20 * 32 + 3] = std::numeric_limits<float>::quiet_NaN();
  });
  expect_rejected("train --load " + weights + kLoadRun,
                  {"--load", weights, "tensor 'wpe.weight' element 643 (index [20, 3] of [32, 32]) is NaN",
                   "--allow-nonfinite-weights"});
  expect_rejected("sample --load " + weights + " --prompt 'ab' --tokens 4 --backend cpu --context 16",
                  {"--load", "'wpe.weight' element 643", "--allow-nonfinite-weights"});
  CliRun r = run("train --load " + weights + " --allow-nonfinite-weights" + kLoadRun);
  EXPECT_EQ(r.code, 0) << r.output;
  r = run("sample --load " + weights + " --allow-nonfinite-weights --prompt 'ab' --tokens 4 --backend cpu --context 16");
  EXPECT_EQ(r.code, 0) << r.output;
}

TEST(LoadCli, AbsurdBlockNumberIsRefusedBeforeAnythingIsBuilt) {
  // 3 MB: one block of width 256, named transformer.h.9999999.*. Taken at its word,
  // the file would describe ten million layers.
  CheckpointDir d("h9999999");
  const spillway::ModelConfig one{1, 256, 4, 32, 256};
  const std::string weights = d.file("huge.safetensors");
  std::vector<spillway::SafetensorsTensor> tensors;
  for (const spillway::ParamSpec& s : spillway::parameter_specs(one)) {
    spillway::SafetensorsTensor t;
    t.name = s.name;
    const std::string block = "transformer.h.0.";
    if (t.name.rfind(block, 0) == 0) t.name = "transformer.h.9999999." + t.name.substr(block.size());
    t.shape = s.shape.dims;
    if (s.conv1d) std::swap(t.shape[0], t.shape[1]);
    t.values = [one, s]() -> spillway::Result<std::vector<float>> { return spillway::init_parameter(one, s, 1); };
    tensors.push_back(std::move(t));
  }
  ASSERT_TRUE(spillway::write_safetensors(weights, tensors, {{"n_head", "4"}}).is_ok());
  EXPECT_GT(std::filesystem::file_size(weights), 3u << 20);
  const auto t0 = std::chrono::steady_clock::now();
  expect_rejected("train --load " + weights + kLoadRun,
                  {"--load", weights, "h.0 … h.{L-1} with none missing", "1 block(s) (h.9999999) and no h.0"});
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(s, 10.0) << "refusing took " << s << " s";
}

// The state a file of `spillway train --save` holds, as raw F32 bits per tensor.
std::map<std::string, std::vector<uint32_t>> saved_bits(const std::string& path) {
  std::map<std::string, std::vector<uint32_t>> out;
  std::ifstream f(path, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  if (bytes.size() < 8) {
    ADD_FAILURE() << path << " is " << bytes.size() << " bytes";
    return out;
  }
  uint64_t header = 0;
  std::memcpy(&header, bytes.data(), 8);
  auto h = nlohmann::json::parse(bytes.substr(8, header));
  for (auto& [name, entry] : h.items()) {
    if (name == "__metadata__") continue;
    EXPECT_EQ(entry["dtype"], "F32") << name;
    const uint64_t begin = entry["data_offsets"][0], end = entry["data_offsets"][1];
    std::vector<uint32_t>& v = out[name];
    v.resize((end - begin) / 4);
    std::memcpy(v.data(), bytes.data() + 8 + header + begin, end - begin);
  }
  return out;
}

// `--lr 1e30` diverges: the run stops with exit code 1 at the step whose numbers are
// not finite, naming it; the metrics stay JSON (null for the bad numbers); --save
// writes the state from before that step, finite and bit for bit the state a run
// that stopped one step earlier saves.
TEST(TrainCli, DivergingRunStopsAtTheStepAndSavesTheLastGoodState) {
  const std::string diverged = temp_path("diverged.safetensors"), good = temp_path("good.safetensors");
  const std::string metrics = temp_path("diverged.jsonl");
  std::filesystem::remove(diverged);
  const std::string args = " --lr 1e30 --warmup 20 --eval-every 0 --seed 5 " + kSmall;  // lr: warmup, any --steps
  CliRun r = run("train --steps 8 --save " + diverged + " --metrics " + metrics + args);
  ASSERT_EQ(r.code, 1) << r.output;
  const size_t at = r.output.find("spillway: error: ");
  ASSERT_NE(at, std::string::npos) << r.output;
  int failed = 0;
  ASSERT_EQ(std::sscanf(r.output.c_str() + at, "spillway: error: InvalidArgument: step %d:", &failed), 1) << r.output;
  ASSERT_GE(failed, 2) << "the first step already diverged: no trained state to compare\n" << r.output;
  const std::string before = "those after step " + std::to_string(failed - 1);
  for (const std::string& needle : {std::string("is nan"), std::string("not applied"), before, "saved them to " + diverged})
    EXPECT_NE(r.output.find(needle), std::string::npos) << "'" << needle << "' not in: " << r.output;
  EXPECT_EQ(r.output.find("final train loss"), std::string::npos) << r.output;

  // One JSON line per step run, the failed one included.
  std::ifstream lines(metrics);
  std::string line;
  int count = 0;
  while (std::getline(lines, line)) {
    ++count;
    nlohmann::json j;
    ASSERT_NO_THROW(j = nlohmann::json::parse(line)) << line;
    EXPECT_EQ(j["step"].get<int>(), count);
    if (count == failed) {
      EXPECT_TRUE(j["grad_norm"].is_null()) << line;
      EXPECT_TRUE(j["skipped"].get<bool>()) << line;
    } else {
      EXPECT_TRUE(j["loss"].is_number()) << line;
    }
  }
  EXPECT_EQ(count, failed);

  CliRun ok = run("train --steps " + std::to_string(failed - 1) + " --save " + good + args);
  ASSERT_EQ(ok.code, 0) << ok.output;
  const auto got = saved_bits(diverged), want = saved_bits(good);
  ASSERT_FALSE(want.empty());
  ASSERT_EQ(got.size(), want.size());
  for (const auto& [name, bits] : want) {
    ASSERT_EQ(got.at(name), bits) << name;
    for (uint32_t u : bits) ASSERT_NE(u & 0x7f800000u, 0x7f800000u) << name << " holds a non-finite value";
  }
  for (const std::string& p : {diverged, good, metrics}) std::filesystem::remove(p);
}

// Issue 9: hostile flags and data get bounded work and clear errors, exit code 1.
// A flag of one policy given with another is refused by name (it was ignored).
TEST(HostileFlags, FlagsOfAnotherPolicyAreRefused) {
  const std::string common = "train --model tiny --steps 1 --batch 2 --context 32 --eval-every 0 --backend cpu ";
  expect_rejected(common + "--prefetch learned", {"--prefetch learned applies to --policy paging", "planned"});
  expect_rejected(common + "--policy resident --speculate on", {"--speculate on applies to --policy planned or auto"});
  expect_rejected(common + "--policy paging --device-optimizer 1MiB", {"--device-optimizer 1MiB applies to"});
  expect_rejected(common + "--auto-confirm 4", {"--auto-confirm 4 applies to --policy auto"});
  expect_rejected(common + "--keep 3", {"--keep 3 needs --checkpoint-dir"});
}

// A word that names no command is an error naming it and the commands there (it was
// "A subcommand is required").
TEST(HostileFlags, UnknownCommandsAreNamedWithTheChoices) {
  expect_rejected("bogus", {"spillway: unknown command 'bogus'", "train", "sample"});
  expect_rejected("checkpoint bogus", {"spillway checkpoint: unknown command 'bogus'", "info"});
  expect_rejected("bench trian", {"spillway bench: unknown command 'trian'", "train", "io"});
}

TEST(HostileFlags, TooManyThreadsIsRefusedNamingTheCap) {
  for (const char* command : {"train --steps 1", "bench train --steps 2"})
    expect_rejected(std::string(command) + " --layers 1 --width 32 --heads 2 --model-context 32 --backend cpu --threads 100000",
                    {"--threads 100000", "4 ×", "hardware threads"});
}

TEST(HostileFlags, OverflowingSizeIsRefused) {
  expect_rejected("train --host-budget 10000000000GB " + kSmall, {"--host-budget", "10000000000GB", "9223372036854775807"});
  expect_rejected("plan --model tiny --storage-budget 99999999999TiB", {"--storage-budget", "99999999999TiB"});
}

TEST(HostileFlags, BadNumbersExitOneNamingTheFlagAndTheForm) {
  expect_rejected("train --steps 99999999999 " + kSmall, {"--steps", "99999999999", "whole number", "2147483647"});
  expect_rejected("train --batch two " + kSmall, {"--batch", "'two'", "whole number"});
  expect_rejected("train --lr fast " + kSmall, {"--lr", "'fast'", "number"});
  expect_rejected("train --lr nan " + kSmall, {"--lr", "finite"});
  expect_rejected("bench train --accum 1e99 " + kSmall, {"--accum", "whole number"});
  expect_rejected("plan --model tiny --h2d-gbps 1e999", {"--h2d-gbps", "finite"});
  expect_rejected("train --no-such-flag 3 " + kSmall, {"--no-such-flag", "spillway train --help"});
  expect_rejected("sample --backend cpu", {"--load", "required"});
  // Leading zeros are decimal, not octal.
  CliRun r = run("plan --model tiny --machine cpu --batch 010 --device-budget 8MiB");
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("batch 10"), std::string::npos) << r.output;
  // Help and version still exit 0.
  for (const char* ok : {"--help", "train --help", "bench train --help", "--version"}) {
    CliRun h = run(ok);
    EXPECT_EQ(h.code, 0) << ok << "\n" << h.output;
  }
}

TEST(HostileFlags, NegativeSeedIsRefused) {
  expect_rejected("train --seed -1 " + kSmall, {"--seed", "'-1'", "0 to 18446744073709551615"});
  expect_rejected("bench train --seed -5 " + kSmall, {"--seed", "'-5'"});
  expect_rejected("sample --load x.safetensors --seed -1 --backend cpu", {"--seed", "'-1'"});
}

TEST(HostileData, DevicesAndPipesAreRefused) {
  expect_rejected("train --steps 1 --data /dev/zero " + kSmall, {"--data", "/dev/zero", "character device", "regular file"});
  expect_rejected("train --steps 1 --data /tmp " + kSmall, {"--data", "/tmp is a directory"});
}

TEST(HostileData, BundledCorpusIsFoundFromAnyDirectory) {
  // The binary, copied alone to an empty folder and run from another, with
  // SPILLWAY_DATA unset: the corpus is the copy built into it.
  const std::filesystem::path dir = temp_path("moved");
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir / "bin");
  std::filesystem::create_directories(dir / "cwd");
  std::filesystem::copy_file(SPILLWAY_BINARY, dir / "bin" / "spillway");
  const std::string cmd = "cd " + (dir / "cwd").string() + " && env -u SPILLWAY_DATA " + (dir / "bin" / "spillway").string() +
                          " train --steps 2 --eval-every 0 " + kSmall + " 2>&1";
  FILE* p = ::popen(cmd.c_str(), "r");
  ASSERT_NE(p, nullptr);
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  const int status = ::pclose(p);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << cmd << "\n" << out;
  EXPECT_NE(out.find("bundled tinyshakespeare.txt"), std::string::npos) << out;
  EXPECT_NE(out.find("1.00M train"), std::string::npos) << out;  // 90% of 1115394 bytes
  EXPECT_NE(out.find("final train loss"), std::string::npos) << out;

  // SPILLWAY_DATA still overrides, and a wrong one is an error naming it.
  const std::string bad = "cd " + (dir / "cwd").string() + " && SPILLWAY_DATA=/nonexistent/corpus.txt " +
                          (dir / "bin" / "spillway").string() + " train --steps 1 " + kSmall + " 2>&1";
  p = ::popen(bad.c_str(), "r");
  ASSERT_NE(p, nullptr);
  out.clear();
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  const int bad_status = ::pclose(p);
  EXPECT_TRUE(WIFEXITED(bad_status) && WEXITSTATUS(bad_status) == 1) << out;
  EXPECT_NE(out.find("SPILLWAY_DATA=/nonexistent/corpus.txt"), std::string::npos) << out;
  std::filesystem::remove_all(dir);
}

TEST(HostileFlags, HugeLayersOrAccumAreRefusedBeforeBuilding) {
  // Each of these built programs for ever; now each is refused at once.
  const std::string budgets = " --device-budget 64MiB --host-budget 1GiB";
  for (const char* command : {"train --steps 1", "bench train --steps 2"}) {
    expect_rejected(std::string(command) + " --layers 16000000 --width 32 --heads 2 --model-context 32 --backend cpu" + budgets,
                    {"training state", "GiB", "--device-budget 64.00 MiB", "--host-budget 1.00 GiB", "--layers"});
    expect_rejected(std::string(command) + " " + kSmall + " --accum 1000000000" + budgets,
                    {"micro-batch inputs", "--accum 1000000000", "--host-budget"});
    // Within the budgets (the CPU's device is unlimited), the op count caps it.
    expect_rejected(std::string(command) + " " + kSmall + " --accum 1000000000",
                    {"ops", "--accum 1000000000", "150000", "--layers"});
  }
  expect_rejected("plan --model tiny --machine cpu --accum 1000000000", {"micro-batch inputs", "--accum"});
  expect_rejected("simulate --model tiny --machine cpu --layers 100000 --host-budget 100TB", {"ops", "--layers"});
  expect_rejected("plan --model gpt2-124m --machine h200 --batch 1 --context 64 --accum 1000 --host-budget 1TB",
                  {"ops", "more than 150000"});
}

// Issue 11: --stop-after writes a checkpoint and --resume continues it with the
// uninterrupted run's losses and weights, bit for bit, here with another budget and
// policy at the resume; flags that change the math are refused by name;
// `checkpoint info` lists the checkpoints.
TEST(CheckpointCli, StopAfterThenResumeMatchesTheUninterruptedRun) {
  const auto dir = std::filesystem::temp_directory_path() / ("spillway_ckpt_cli_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::string d = dir.string();
  auto losses = [](const std::string& path) {
    std::vector<std::string> out;
    std::ifstream in(path);
    std::string line;
    while (std::getline(in, line)) out.push_back(nlohmann::json::parse(line).at("loss").dump());
    return out;
  };
  const std::string common = "train --backend cpu --steps 6 --eval-every 0 --quiet";
  CliRun straight = run(common + " --metrics " + d + "/full.jsonl --save " + d + "/full.safetensors");
  ASSERT_EQ(straight.code, 0) << straight.output;
  CliRun first = run(common + " --checkpoint-dir " + d + "/ck --stop-after 3 --metrics " + d + "/a.jsonl");
  ASSERT_EQ(first.code, 0) << first.output;
  EXPECT_NE(first.output.find("stopped after step 3 of 6"), std::string::npos) << first.output;
  CliRun refused = run("train --backend cpu --resume " + d + "/ck --batch 4 --seed 5");
  EXPECT_EQ(refused.code, 1);
  for (const char* needle : {"--batch 4 (the checkpoint's: 8)", "--seed 5 (the checkpoint's: 1337)"})
    EXPECT_NE(refused.output.find(needle), std::string::npos) << refused.output;
  CliRun second = run("train --backend cpu --resume " + d + "/ck --eval-every 0 --quiet --device-budget 8MiB --policy planned "
                      "--metrics " + d + "/b.jsonl --save " + d + "/resumed.safetensors");
  ASSERT_EQ(second.code, 0) << second.output;
  std::vector<std::string> resumed = losses(d + "/a.jsonl"), tail = losses(d + "/b.jsonl");
  resumed.insert(resumed.end(), tail.begin(), tail.end());
  EXPECT_EQ(resumed, losses(d + "/full.jsonl"));
  EXPECT_EQ(read_file(d + "/resumed.safetensors"), read_file(d + "/full.safetensors"));
  CliRun info = run("checkpoint info " + d + "/ck");
  EXPECT_EQ(info.code, 0) << info.output;
  for (const char* needle : {"ckpt-00000006  step 6", "ckpt-00000003  step 3", "ok"})
    EXPECT_NE(info.output.find(needle), std::string::npos) << info.output;
  std::filesystem::remove_all(dir);
}

// Issue 11's crash test: a run killed with SIGKILL at random moments (during setup,
// steps and checkpoint writes), resumed each time, ends with the uninterrupted run's
// weights bit for bit. SPILLWAY_CRASH_KILLS sets the count (8 here; `make crash-test`
// runs 50).
TEST(CheckpointCli, KilledAtRandomMomentsAndResumedEndsWithTheSameWeights) {
  const char* env = std::getenv("SPILLWAY_CRASH_KILLS");
  const int kills = env ? std::max(1, std::atoi(env)) : 8;
  const auto dir = std::filesystem::temp_directory_path() / ("spillway_crash_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::string d = dir.string();
  const std::string common = "train --backend cpu --steps 60 --batch 4 --context 64 --eval-every 0 --quiet --threads 1";
  CliRun straight = run(common + " --save " + d + "/full.safetensors");
  ASSERT_EQ(straight.code, 0) << straight.output;
  // The newest checkpoint's step (-1: none yet).
  auto newest_step = [&] {
    int64_t best = -1;
    std::error_code ec;
    for (const auto& e : std::filesystem::directory_iterator(d + "/ck", ec)) {
      const std::string n = e.path().filename().string();
      if (n.rfind("ckpt-", 0) == 0) best = std::max<int64_t>(best, std::atoll(n.c_str() + 5));
    }
    return best;
  };
  uint64_t rng = 12345;
  int done_kills = 0, resumed_runs = 0;
  for (int i = 0; i < kills * 3 && done_kills < kills; ++i) {
    const bool resuming = newest_step() >= 0;
    resumed_runs += resuming;
    const std::string args = (resuming ? "train --backend cpu --resume " + d + "/ck --eval-every 0 --quiet --threads 1"
                                       : common + " --checkpoint-dir " + d + "/ck") +
                             " --checkpoint-every 1 --keep 2 --save " + d + "/resumed.safetensors";
    const int64_t before = newest_step();
    pid_t pid = start(args, d + "/log.txt");
    ASSERT_GT(pid, 0);
    rng = rng * 6364136223846793005ull + 1442695040888963407ull;
    if (i % 2 == 0) {
      // Kill during setup or early steps: at a random moment after the start.
      std::this_thread::sleep_for(std::chrono::milliseconds(30 + static_cast<int>((rng >> 33) % 400)));
    } else {
      // Kill after the run made progress (a new checkpoint), a little later: during
      // a step or the next checkpoint's write. However slow the machine, runs resume.
      for (int k = 0; k < 3000 && newest_step() <= before; ++k) std::this_thread::sleep_for(std::chrono::milliseconds(10));
      std::this_thread::sleep_for(std::chrono::milliseconds(static_cast<int>((rng >> 33) % 120)));
    }
    ::kill(pid, SIGKILL);
    int status = 0;
    ::waitpid(pid, &status, 0);
    if (WIFSIGNALED(status)) ++done_kills;                      // killed while it ran
    if (WIFEXITED(status) && WEXITSTATUS(status) == 0) break;  // finished before the kill
    if (WIFEXITED(status)) ADD_FAILURE() << "the run failed: " << read_file(d + "/log.txt");
  }
  // Finish the run (with its checkpoints, as the killed runs had).
  const bool resuming = newest_step() >= 0;
  CliRun last = run((resuming ? "train --backend cpu --resume " + d + "/ck --eval-every 0 --quiet --threads 1"
                              : common + " --checkpoint-dir " + d + "/ck") +
                    " --checkpoint-every 1 --keep 2 --save " + d + "/resumed.safetensors");
  ASSERT_EQ(last.code, 0) << last.output;
  EXPECT_GE(resumed_runs, kills / 2 - 1) << "too few runs resumed: the kills came before any checkpoint";
  std::printf("%d kills with SIGKILL while the run was going\n", done_kills);
  EXPECT_GE(done_kills, (kills + 1) / 2) << "the run finished before most kills: make it longer";
  EXPECT_EQ(read_file(d + "/resumed.safetensors"), read_file(d + "/full.safetensors"))
      << "after " << done_kills << " kills the weights differ from the uninterrupted run's";
  for (const auto& e : std::filesystem::directory_iterator(d + "/ck"))  // no temporary folder of a killed writer stays
    EXPECT_EQ(e.path().filename().string().rfind("ckpt-", 0), 0u) << e.path();
  std::filesystem::remove_all(dir);
}

// SIGINT between steps writes a checkpoint before the run exits (130), and says
// where to resume; the checkpoint verifies.
TEST(CheckpointCli, SigintWritesACheckpointAndSaysWhereToResume) {
  const auto dir = std::filesystem::temp_directory_path() / ("spillway_sigint_ckpt_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::string d = dir.string();
  pid_t pid = start("train --backend cpu --steps 100000 --batch 4 --context 64 --eval-every 0 --threads 1 --checkpoint-dir " +
                        d + "/ck --metrics " + d + "/m.jsonl",
                    d + "/log.txt");
  ASSERT_GT(pid, 0);
  for (int i = 0; i < 600 && count_lines(d + "/m.jsonl") < 3; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  ASSERT_GE(count_lines(d + "/m.jsonl"), 3u) << read_file(d + "/log.txt");
  ::kill(pid, SIGINT);
  EXPECT_EQ(wait_exit(pid, 60), 130) << read_file(d + "/log.txt");
  const std::string log = read_file(d + "/log.txt");
  EXPECT_NE(log.find("continue with --resume " + d + "/ck"), std::string::npos) << log;
  CliRun info = run("checkpoint info " + d + "/ck");
  EXPECT_NE(info.output.find("  ok"), std::string::npos) << info.output;
  std::filesystem::remove_all(dir);
}

// SIGTERM during a long evaluation stops it between batches (it ran to the end of
// 2,000,000 batches before) and writes the checkpoint of the steps done.
TEST(CheckpointCli, SigtermStopsALongEvaluation) {
  const auto dir = std::filesystem::temp_directory_path() / ("spillway_sigterm_eval_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::string d = dir.string();
  pid_t pid = start("train --backend cpu --model tiny --steps 3 --batch 2 --context 32 --threads 1 --eval-every 1 "
                    "--eval-batches 2000000 --checkpoint-dir " + d + "/ck",
                    d + "/log.txt");
  ASSERT_GT(pid, 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(2000));
  ::kill(pid, SIGTERM);
  EXPECT_EQ(wait_exit(pid, 60), 143) << read_file(d + "/log.txt");
  const std::string log = read_file(d + "/log.txt");
  EXPECT_NE(log.find("interrupted by SIGTERM"), std::string::npos) << log;
  if (log.find("during the evaluation after step 1 of 3") != std::string::npos) {
    EXPECT_TRUE(std::filesystem::is_directory(d + "/ck/ckpt-00000001")) << log;
  }
  std::filesystem::remove_all(dir);
}

}  // namespace

namespace spillway {
namespace {

// bench train times checkpoints with the steps (issue 11's overhead figure): they
// are written in the background, verify, and the two flags go together.
TEST(CheckpointCli, BenchTrainWritesCheckpointsAndTimesThem) {
  const auto dir = std::filesystem::temp_directory_path() / ("spillway_bench_ckpt_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  const std::string d = dir.string();
  CliRun r = run("bench train --steps 7 --checkpoint-every 3 --checkpoint-dir " + d + " " + kSmall);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("checkpoints   2 of "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("written in the background"), std::string::npos) << r.output;
  CliRun info = run("checkpoint info " + d);
  EXPECT_NE(info.output.find("ckpt-00000006"), std::string::npos) << info.output;
  EXPECT_EQ(info.output.find("ckpt-00000003"), std::string::npos) << "bench keeps one: " << info.output;
  EXPECT_NE(r.output.find("checkpoint of step 3: training waited"), std::string::npos) << r.output;
  EXPECT_EQ(info.output.find("corrupt"), std::string::npos) << info.output;
  CliRun half = run("bench train --steps 3 --checkpoint-every 2 " + kSmall);
  EXPECT_NE(half.code, 0);
  EXPECT_NE(half.output.find("--checkpoint-dir and --checkpoint-every go together"), std::string::npos) << half.output;
  std::filesystem::remove_all(dir);
}

// An output that is an input or another output is refused before anything is read or
// written (--metrics onto --data truncated the corpus), and so is an output whose
// folder is missing (--save-grads and --checkpoint-dir failed after the last step).
TEST(TrainCli, OutputsThatWouldOverwriteInputsOrEachOtherAreRefusedFirst) {
  CheckpointDir d("outputs_apart");
  const std::string data = d.file("d.txt");
  {
    std::ofstream out(data);
    for (int i = 0; i < 400; ++i) out << "To be, or not to be, that is the question. ";
  }
  const std::string before = read_file(data);
  expect_rejected("train --steps 2 --data " + data + " --metrics " + data + " " + kSmall,
                  {"--metrics " + data + " is the file that --data reads"});
  EXPECT_EQ(read_file(data), before);
  expect_rejected("train --steps 2 --data " + data + " --save " + d.file("w.safetensors") + " --save-grads " +
                      d.file("w.safetensors") + " " + kSmall,
                  {"--save " + d.file("w.safetensors") + " and --save-grads", "are the same file"});
  for (const std::string flag : {"--save-grads", "--trace", "--metrics"}) {
    CliRun r = run("train --steps 2 --data " + data + " " + flag + " /nonexistent-spillway-dir/x " + kSmall);
    EXPECT_NE(r.code, 0);
    EXPECT_NE(r.output.find(flag + " /nonexistent-spillway-dir/x: the folder /nonexistent-spillway-dir does not exist"),
              std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("step 1"), std::string::npos) << "trained before refusing: " << r.output;
  }
  expect_rejected("train --steps 2 --data " + data + " --checkpoint-dir /nonexistent-spillway-dir/ck " + kSmall,
                  {"--checkpoint-dir /nonexistent-spillway-dir/ck: its parent folder /nonexistent-spillway-dir does not exist"});
  expect_rejected("train --steps 2 --data " + data + " --trace " + d.dir + " " + kSmall,
                  {"--trace " + d.dir + " is a directory"});
  CliRun tok = run("tokenize --tokenizer " SPILLWAY_SOURCE_DIR "/tests/data/reference/tok-gpt2 --input " + data +
                   " --output " + data);
  EXPECT_NE(tok.code, 0);
  EXPECT_NE(tok.output.find("--output " + data + " is the file that --input reads"), std::string::npos) << tok.output;
  EXPECT_EQ(read_file(data), before);
}

// A --save into a folder that does not exist is refused before training (it used
// to fail after the last step, losing the run).
TEST(TrainCli, SaveIntoAMissingFolderIsRefusedBeforeTraining) {
  CliRun r = run("train --steps 2 --save /nonexistent-spillway-dir/w.safetensors " + kSmall);
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.output.find("--save /nonexistent-spillway-dir/w.safetensors: the folder /nonexistent-spillway-dir does not exist"),
            std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("step 1"), std::string::npos) << "trained before refusing: " << r.output;
}

// Issue 12: a Llama trained from a preset is saved as a Hugging Face model directory
// (config.json + model.safetensors), loaded again by --load DIR and by sample, and
// replaced by the next save; flags that disagree with its config.json are refused by
// name; an explicit Llama needs every size; a --save folder holding other files is
// refused before training.
TEST(LoadCli, LlamaSavesAndLoadsAModelDirectory) {
  CheckpointDir d("hf_llama_dir");
  const std::string llama = "--model llama-tiny --layers 2 --steps 2 --batch 2 --context 32 --eval-every 0 "
                            "--backend cpu --threads 2 --quiet";
  const std::string dir = d.file("llama");
  CliRun first = run("train " + llama + " --metrics " + d.file("a.jsonl") + " --save " + dir);
  ASSERT_EQ(first.code, 0) << first.output;
  EXPECT_EQ(spillway::testing_support::names_in(dir), (std::vector<std::string>{"config.json", "model.safetensors"}));
  const nlohmann::json config = nlohmann::json::parse(read_file(dir + "/config.json"));
  EXPECT_EQ(config.at("model_type"), "llama");
  EXPECT_EQ(config.at("num_key_value_heads"), 2);
  EXPECT_EQ(config.at("num_hidden_layers"), 2);
  EXPECT_EQ(config.at("rope_parameters").at("rope_type"), "llama3");
  EXPECT_EQ(config.at("tie_word_embeddings"), true);

  // --load DIR trains on from the saved weights (not a fresh start), and saves into
  // the same folder again.
  const std::string again = "train --load " + dir + " --steps 1 --batch 2 --context 32 --eval-every 0 --backend cpu "
                            "--threads 2 --quiet --metrics " + d.file("b.jsonl");
  CliRun second = run(again + " --save " + dir + "/");  // the same folder
  ASSERT_EQ(second.code, 0) << second.output;
  auto first_loss = [](const std::string& path) {
    std::ifstream in(path);
    std::string line;
    std::getline(in, line);
    return nlohmann::json::parse(line).at("loss").get<double>();
  };
  EXPECT_NE(first_loss(d.file("b.jsonl")), first_loss(d.file("a.jsonl")));
  EXPECT_EQ(spillway::testing_support::names_in(d.dir),
            (std::vector<std::string>{"a.jsonl", "b.jsonl", "llama"}));  // no temporary folder left
  CliRun sample = run("sample --load " + dir + " --prompt ROMEO: --tokens 5 --backend cpu --threads 2");
  EXPECT_EQ(sample.code, 0) << sample.output;

  // Flags must agree with config.json; Llama flags are for Llamas.
  expect_rejected(again + " --kv-heads 4", {"--kv-heads 4 disagrees with num_key_value_heads 2 (" + dir + "/config.json)"});
  expect_rejected(again + " --rope-theta 10000", {"--rope-theta 10000", "disagrees with the model in " + dir});
  expect_rejected(again + " --arch gpt2", {"--arch gpt2 disagrees with the model in " + dir});
  expect_rejected(again + " --model llama-3.2-1b", {"--model llama-3.2-1b (", "disagrees with the model in " + dir});
  CliRun same_preset = run(again + " --model llama-tiny --layers 2");
  EXPECT_EQ(same_preset.code, 0) << same_preset.output;
  expect_rejected("train --model tiny --untied --steps 1", {"--untied: for Llama models"});
  // An explicit Llama: every size, nothing guessed.
  expect_rejected("train --arch llama --layers 2 --width 64 --steps 1",
                  {"give --heads, --kv-heads, --intermediate, --model-context, --vocab, --rope-theta"});
  expect_rejected("train --arch llama --model gpt2-124m --steps 1", {"--arch llama and --model gpt2-124m"});
  expect_rejected("train --model llama-tiny --rope-scaling yarn:2 --steps 1", {"--rope-scaling yarn:2"});
  CliRun explicit_llama = run("train --arch llama --layers 1 --width 32 --heads 4 --kv-heads 2 --intermediate 48 "
                              "--model-context 32 --vocab 256 --rope-theta 10000 --rope-scaling llama3:4:1:4:16 "
                              "--untied --steps 1 --batch 2 --context 32 --eval-every 0 --backend cpu --threads 2 "
                              "--quiet --save " + d.file("explicit") + "/");  // a new folder, named with a slash
  ASSERT_EQ(explicit_llama.code, 0) << explicit_llama.output;
  const nlohmann::json e = nlohmann::json::parse(read_file(d.file("explicit") + "/config.json"));
  EXPECT_EQ(e.at("tie_word_embeddings"), false);
  EXPECT_EQ(e.at("intermediate_size"), 48);
  EXPECT_EQ(e.at("rope_scaling").at("factor"), 4.0);

  // A --save folder that holds something else is refused before training.
  { std::ofstream(dir + "/tokenizer.json") << "{}"; }
  expect_rejected("train " + llama + " --save " + dir, {"--save", dir + " holds tokenizer.json"});
}

// A Llama's checkpoint records what --arch llama needs to build it again: --resume
// continues it to the uninterrupted run's weights, bit for bit, and a Llama flag that
// differs is refused by name.
TEST(CheckpointCli, LlamaResumesFromItsCheckpoint) {
  CheckpointDir d("hf_llama_resume");
  const std::string common = "train --model llama-tiny --layers 2 --steps 3 --batch 2 --context 32 --eval-every 0 "
                             "--backend cpu --threads 2 --quiet";
  CliRun straight = run(common + " --save " + d.file("full"));
  ASSERT_EQ(straight.code, 0) << straight.output;
  CliRun first = run(common + " --checkpoint-dir " + d.file("ck") + " --stop-after 1");
  ASSERT_EQ(first.code, 0) << first.output;
  expect_rejected("train --backend cpu --resume " + d.file("ck") + " --kv-heads 4",
                  {"--kv-heads 4 (the checkpoint's: 2)"});
  CliRun second = run("train --backend cpu --threads 2 --quiet --resume " + d.file("ck") + " --save " + d.file("resumed"));
  ASSERT_EQ(second.code, 0) << second.output;
  EXPECT_EQ(read_file(d.file("resumed") + "/model.safetensors"), read_file(d.file("full") + "/model.safetensors"));
  EXPECT_EQ(read_file(d.file("resumed") + "/config.json"), read_file(d.file("full") + "/config.json"));
}

// A new run into a folder that holds another run's checkpoints is refused and leaves
// them; a resumed run keeps its own newest checkpoint under --keep 1 even beside a
// folder of a later step that does not verify (which it leaves alone): before, that
// folder counted as the newest and the run deleted the checkpoint it had just written.
TEST(CheckpointCli, KeepNeverDeletesTheRunsOwnCheckpointNorAnotherRuns) {
  CheckpointDir d("keep_own");
  const std::string common = "train --model tiny --batch 2 --context 32 --eval-every 0 --backend cpu --threads 2 --quiet";
  CliRun first =
      run(common + " --steps 4 --stop-after 2 --checkpoint-every 1 --keep 1 --checkpoint-dir " + d.file("ck"));
  ASSERT_EQ(first.code, 0) << first.output;
  EXPECT_TRUE(std::filesystem::is_directory(d.file("ck/ckpt-00000002")));
  EXPECT_FALSE(std::filesystem::exists(d.file("ck/ckpt-00000001")));
  std::filesystem::create_directories(d.file("ck/ckpt-00000099"));  // a later step's folder, not a checkpoint

  expect_rejected(common + " --steps 3 --checkpoint-dir " + d.file("ck"),
                  {"--checkpoint-dir", "already holds checkpoints", "ckpt-00000099", "--resume"});
  EXPECT_TRUE(std::filesystem::is_directory(d.file("ck/ckpt-00000002")));

  CliRun resumed = run("train --backend cpu --threads 2 --quiet --checkpoint-every 1 --keep 1 --resume " + d.file("ck"));
  ASSERT_EQ(resumed.code, 0) << resumed.output;
  EXPECT_TRUE(std::filesystem::is_directory(d.file("ck/ckpt-00000004"))) << resumed.output;
  EXPECT_FALSE(std::filesystem::exists(d.file("ck/ckpt-00000003")));
  EXPECT_FALSE(std::filesystem::exists(d.file("ck/ckpt-00000002")));
  EXPECT_TRUE(std::filesystem::is_directory(d.file("ck/ckpt-00000099")));
  CliRun again = run("train --backend cpu --threads 2 --quiet --resume " + d.file("ck"));
  EXPECT_EQ(again.code, 0) << again.output;
  EXPECT_NE(again.output.find("ckpt-00000099"), std::string::npos) << "the skipped folder is named: " << again.output;
}

// The reference models saved by transformers load as directories, sharded or not.
TEST(LoadCli, TransformersSavedLlamaDirectoriesLoad) {
  for (const char* ref : {"llama-gqa", "llama-gqa-sharded", "llama-mha"}) {
    CliRun r = run(std::string("train --load " SPILLWAY_SOURCE_DIR "/tests/data/reference/") + ref +
                   " --steps 1 --batch 1 --context 16 --eval-every 0 --backend cpu --threads 2");
    EXPECT_EQ(r.code, 0) << ref << "\n" << r.output;
  }
}

}  // namespace
}  // namespace spillway
