// `spillway checkpoint info DIR` over a folder with both kinds of checkpoint: a real
// data-parallel run of 2 ranks (threads with ThreadCommunicator, as
// tests/dist/test_data_parallel_training.cpp runs them) writes dp-ckpt-<step>/ folders
// beside a single-process run's ckpt-<step>/ one; then a shard's byte is flipped, a
// shard deleted and a .partial folder left, and the listing names each.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "backend/backend.h"
#include "dist/data_parallel_training.h"
#include "model/safetensors.h"
#include "sim/machine.h"
#include "support/cli_support.h"
#include "support/thread_communicator.h"
#include "train/data.h"

namespace spillway {
namespace {

using testing_support::CliRun;
using testing_support::ThreadCommunicator;
using testing_support::ThreadGroup;

// 2 ranks of 1 micro-batch, 3 steps, a checkpoint after every step (all 3 kept).
Status two_rank_run(const std::string& dir) {
  auto loaded = load_dataset(std::string(SPILLWAY_SOURCE_DIR) + "/data/tinyshakespeare.txt", 256);
  if (!loaded.ok()) return loaded.status();
  const Dataset data = std::move(*loaded);
  ThreadGroup group(2);
  std::vector<Status> status(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r)
    threads.emplace_back([&, r] {
      ThreadCommunicator comm(group, r);
      auto backend = make_backend("cpu", {.threads = 1});
      if (!backend.ok()) {
        status[static_cast<size_t>(r)] = backend.status();
        comm.abort(backend.status().message());
        return;
      }
      DataParallelTrainingOptions o;
      o.trainer.model = ModelConfig{2, 32, 2, 16, 256};
      o.trainer.shape = {.B = 2, .T = 16, .accum = 1};
      o.trainer.schedule = {.peak = 1e-2f, .warmup_steps = 1, .total_steps = 3};
      o.trainer.seed = 7;
      o.trainer.planner = {.policy = Policy::Resident};
      o.trainer.machine = Machine::cpu_dev_box();
      o.data = &data;
      o.steps = 3;
      o.checkpoint_dir = dir;
      o.checkpoint_every = 1;
      o.keep = 3;
      auto result = train_data_parallel(comm, **backend, o);
      if (!result.ok()) {
        status[static_cast<size_t>(r)] = result.status();
        comm.abort(result.status().message());
      }
    });
  for (auto& t : threads) t.join();
  for (const Status& s : status)
    if (!s.is_ok()) return s;
  return Status::ok();
}

// The line of `out` that starts with `name` followed by two spaces ("" when none).
std::string line_of(const std::string& out, const std::string& name) {
  size_t at = 0;
  while (at < out.size()) {
    const size_t end = std::min(out.find('\n', at), out.size());
    if (out.compare(at, name.size() + 2, name + "  ") == 0) return out.substr(at, end - at);
    at = end + 1;
  }
  return "";
}

// Where the line of `name` starts in `out` (npos when none).
size_t position(const std::string& out, const std::string& name) {
  if (out.starts_with(name + "  step")) return 0;
  const size_t at = out.find("\n" + name + "  step");
  return at == std::string::npos ? at : at + 1;
}

TEST(CheckpointInfoCli, ListsDataParallelCheckpointsBesideSingleProcessOnesAndNamesWhatIsDamaged) {
  const auto root = std::filesystem::temp_directory_path() / ("spillway_ckpt_info_dp_" + std::to_string(::getpid()));
  std::filesystem::remove_all(root);
  const std::string d = root.string();
  ASSERT_TRUE(two_rank_run(d).is_ok());
  // A single-process run's checkpoint of step 2 in the same folder.
  CliRun single = testing_support::run_cli(
      "train --backend cpu --threads 1 --layers 1 --width 32 --heads 2 --model-context 32 --context 32 --batch 2 "
      "--steps 2 --eval-every 0 --quiet --checkpoint-dir " + d);
  ASSERT_EQ(single.code, 0) << single.output;

  CliRun info = testing_support::run_cli("checkpoint info " + d);
  ASSERT_EQ(info.code, 0) << info.output;
  // Newest first, both kinds: dp 3, then step 2 (single-process first), dp 1.
  const std::vector<std::string> order = {"dp-ckpt-00000003", "ckpt-00000002", "dp-ckpt-00000002", "dp-ckpt-00000001"};
  for (size_t i = 0; i < order.size(); ++i) {
    ASSERT_NE(position(info.output, order[i]), std::string::npos) << order[i] << "\n" << info.output;
    if (i > 0) {
      EXPECT_LT(position(info.output, order[i - 1]), position(info.output, order[i])) << info.output;
    }
  }
  for (const char* name : {"dp-ckpt-00000003", "dp-ckpt-00000002", "dp-ckpt-00000001"}) {
    const std::string line = line_of(info.output, name);
    EXPECT_NE(line.find("  2 ranks  "), std::string::npos) << line;
    EXPECT_TRUE(line.ends_with("  ok")) << line;
  }
  EXPECT_TRUE(line_of(info.output, "ckpt-00000002").ends_with("  ok")) << info.output;
  EXPECT_EQ(info.output.find("do not verify"), std::string::npos) << info.output;
  // The total is every file of the folder: the manifest and both shards.
  uint64_t total = 0;
  for (const auto& e : std::filesystem::directory_iterator(d + "/dp-ckpt-00000003")) total += e.file_size();
  auto listed = list_data_parallel_checkpoints(d);
  ASSERT_TRUE(listed.ok()) << listed.status().to_string();
  ASSERT_EQ(listed->size(), 3u);
  EXPECT_EQ((*listed)[0].bytes, total);
  EXPECT_EQ((*listed)[0].world, 2);
  EXPECT_EQ((*listed)[0].step, 3);

  // One byte of shard 1 of step 3 flipped: the last byte of its data, inside the
  // tensor stored last.
  const std::string shard = d + "/dp-ckpt-00000003/shard-1-of-2.safetensors";
  std::string last_tensor;
  {
    auto r = SafetensorsReader::open(shard);
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    uint64_t end = 0;
    for (const SafetensorsEntry& e : r->entries())
      if (e.end > end) end = e.end, last_tensor = e.name;
    ASSERT_FALSE(last_tensor.empty());
    std::fstream f(shard, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(-1, std::ios::end);
    char b = 0;
    f.read(&b, 1);
    b = static_cast<char>(b ^ 0x01);
    f.seekp(-1, std::ios::end);
    f.write(&b, 1);
    ASSERT_TRUE(f.good());
  }
  // Shard 0 of step 2 deleted; an unfinished folder of step 4 (its shards, no manifest).
  ASSERT_TRUE(std::filesystem::remove(d + "/dp-ckpt-00000002/shard-0-of-2.safetensors"));
  std::filesystem::copy(d + "/dp-ckpt-00000001", d + "/dp-ckpt-00000004.partial");
  ASSERT_TRUE(std::filesystem::remove(d + "/dp-ckpt-00000004.partial/manifest.json"));

  info = testing_support::run_cli("checkpoint info " + d);
  EXPECT_EQ(info.code, 0) << info.output;  // as for a corrupt single-process checkpoint
  std::printf("%s", info.output.c_str());
  const std::string partial = line_of(info.output, "dp-ckpt-00000004.partial");
  EXPECT_EQ(info.output.find("dp-ckpt-00000004.partial  step 4  "), 0u) << "newest first:\n" << info.output;
  EXPECT_NE(partial.find("incomplete"), std::string::npos) << partial;
  EXPECT_NE(partial.find("not resumable"), std::string::npos) << partial;
  const std::string flipped = line_of(info.output, "dp-ckpt-00000003");
  EXPECT_NE(flipped.find("  Corrupt: "), std::string::npos) << flipped;
  EXPECT_NE(flipped.find("shard-1-of-2.safetensors: " + last_tensor + " does not match its checksum"),
            std::string::npos)
      << flipped;
  const std::string missing = line_of(info.output, "dp-ckpt-00000002");
  EXPECT_NE(missing.find("lacks shard-0-of-2.safetensors"), std::string::npos) << missing;
  EXPECT_TRUE(line_of(info.output, "dp-ckpt-00000001").ends_with("  ok")) << info.output;
  EXPECT_TRUE(line_of(info.output, "ckpt-00000002").ends_with("  ok")) << info.output;
  EXPECT_NE(info.output.find("3 of 5 do not verify"), std::string::npos) << info.output;
  EXPECT_NE(info.output.find("a damaged one stops the run"), std::string::npos) << info.output;

  // A folder that cannot be listed is an error naming it.
  CliRun none = testing_support::run_cli("checkpoint info " + d + "/absent");
  EXPECT_NE(none.code, 0);
  EXPECT_NE(none.output.find(d + "/absent"), std::string::npos) << none.output;
  std::filesystem::remove_all(root);
}

// A folder none of whose checkpoints verifies exits with 1 (nothing to resume from);
// one with at least one that verifies exits with 0, listing the rest.
TEST(CheckpointInfoCli, ExitsWithOneWhenNoCheckpointVerifies) {
  const auto root = std::filesystem::temp_directory_path() / ("spillway_info_none_" + std::to_string(::getpid()));
  std::filesystem::remove_all(root);
  std::filesystem::create_directories(root / "ckpt-00000003");  // no manifest: incomplete
  CliRun info = testing_support::run_cli("checkpoint info " + root.string());
  EXPECT_EQ(info.code, 1) << info.output;
  EXPECT_NE(info.output.find("1 of 1 do not verify"), std::string::npos) << info.output;
  EXPECT_NE(info.output.find("no checkpoint in " + root.string() + " verifies"), std::string::npos) << info.output;
  std::filesystem::remove_all(root);
}

}  // namespace
}  // namespace spillway
