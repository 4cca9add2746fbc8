// `spillway checkpoint info DIR`: the checkpoints in DIR (--checkpoint-dir), newest
// first, with their step, size and whether they verify (every file's checksum). A
// data-parallel run's checkpoints (dp-ckpt-<step>/: a manifest and a shard per rank)
// are listed beside single-process ones, with their world size; they verify when the
// manifest is whole and every tensor of every shard matches its checksum
// (verify_data_parallel_shards, load_shards' own checks). A .partial folder is a
// checkpoint whose writing did not finish: listed as incomplete, never resumed.
//
//   spillway checkpoint info runs/a
//   ckpt-00000020  step 20  1.52 MiB  ok
//   dp-ckpt-00000015.partial  step 15  0.51 MiB  incomplete, the run stopped while writing it (...); not resumable
//   dp-ckpt-00000010  step 10  2 ranks  1.53 MiB  ok
//   ckpt-00000010  step 10  1.52 MiB  Corrupt: .../state.bin: checksum ..., the manifest says ...
//
// Exit code 0 whatever the checkpoints' state (the listing is the answer); 1 when DIR
// cannot be read.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "cli/command.h"
#include "core/size.h"
#include "dist/data_parallel_training.h"
#include "train/checkpoint.h"

namespace spillway::cli {
namespace {

struct CheckpointInfoFlags {
  std::string dir;
};

struct Row {
  int64_t step = 0;
  std::string line;
  bool ok = false;
  bool data_parallel_damaged = false;  // its manifest verifies, its shards do not: --resume takes it and fails
};

std::string verdict(const Status& s) {
  return s.is_ok() ? "ok" : std::string(status_code_name(s.code())) + ": " + s.message();
}

int run_checkpoint_info(const CheckpointInfoFlags& f) {
  auto list = list_checkpoints(f.dir);
  if (!list.ok()) return fail(list.status().with_context("spillway checkpoint info"));
  auto dp = list_data_parallel_checkpoints(f.dir);
  if (!dp.ok()) return fail(dp.status().with_context("spillway checkpoint info"));
  std::vector<Row> rows;
  for (const CheckpointListing& c : *list) {
    const std::string name = std::filesystem::path(c.path).filename().string();
    rows.push_back({c.step,
                    name + "  step " + std::to_string(c.step) + "  " + format_size(c.bytes) + "  " + verdict(c.status),
                    c.status.is_ok(), false});
  }
  for (const DataParallelCheckpointListing& c : *dp) {
    const std::string name = std::filesystem::path(c.path).filename().string();
    std::string line = name + "  step " + std::to_string(c.step) + "  ";
    if (c.world > 0) line += std::to_string(c.world) + (c.world == 1 ? " rank  " : " ranks  ");
    line += format_size(c.bytes) + "  ";
    line += c.partial ? "incomplete, " + c.status.message() : verdict(c.status);
    rows.push_back({c.step, std::move(line), c.status.is_ok(),
                    !c.status.is_ok() && c.manifest_ok});
  }
  if (rows.empty()) {
    std::printf("no checkpoints in %s\n", f.dir.c_str());
    return 0;
  }
  // Newest first; within a step, the order of the listings (single-process first).
  std::stable_sort(rows.begin(), rows.end(), [](const Row& a, const Row& b) { return a.step > b.step; });
  int bad = 0, damaged = 0;
  for (const Row& r : rows) {
    std::printf("%s\n", r.line.c_str());
    bad += !r.ok;
    damaged += r.data_parallel_damaged;
  }
  if (bad > 0)
    std::printf("%d of %zu do not verify; --resume skips them%s\n", bad, rows.size(),
                damaged > 0 ? " (except a data-parallel one with a manifest: its shards are checked as it loads, "
                              "and a damaged one stops the run; remove it to resume from an older one)"
                            : "");
  // None verifies: nothing to resume from, which a script checking the folder must see.
  if (bad == static_cast<int>(rows.size())) {
    std::fprintf(stderr, "spillway: error: no checkpoint in %s verifies: --resume %s would fail\n", f.dir.c_str(),
                 f.dir.c_str());
    return 1;
  }
  return 0;
}

CommandRegistration checkpoint_info_command(
    "checkpoint info",
    "list the checkpoints in a --checkpoint-dir (single-process and data-parallel), with step, size and verification",
    [](CLI::App& app) -> CommandRun {
      auto f = std::make_shared<CheckpointInfoFlags>();
      app.add_option("DIR", f->dir, "the --checkpoint-dir of a run")->required();
      return [f]() -> int { return run_checkpoint_info(*f); };
    });

}  // namespace
}  // namespace spillway::cli
