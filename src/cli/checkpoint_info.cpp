// `spillway checkpoint info DIR`: the checkpoints in DIR (--checkpoint-dir), newest
// first, with their step, size and whether they verify (every file's checksum).
//
//   spillway checkpoint info runs/a
//   ckpt-00000020  step 20  1.52 MiB  ok
//   ckpt-00000010  step 10  1.52 MiB  CORRUPT: .../state.bin: checksum ..., the manifest says ...
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>

#include "cli/command.h"
#include "core/size.h"
#include "train/checkpoint.h"

namespace spillway::cli {
namespace {

struct CheckpointInfoFlags {
  std::string dir;
};

int run_checkpoint_info(const CheckpointInfoFlags& f) {
  auto list = list_checkpoints(f.dir);
  if (!list.ok()) return fail(list.status().with_context("spillway checkpoint info"));
  if (list->empty()) {
    std::printf("no checkpoints in %s\n", f.dir.c_str());
    return 0;
  }
  int bad = 0;
  for (const CheckpointListing& c : *list) {
    const std::string name = std::filesystem::path(c.path).filename().string();
    std::printf("%s  step %lld  %s  %s\n", name.c_str(), static_cast<long long>(c.step), format_size(c.bytes).c_str(),
                c.status.is_ok() ? "ok" : (std::string(status_code_name(c.status.code())) + ": " + c.status.message()).c_str());
    bad += !c.status.is_ok();
  }
  if (bad > 0) std::printf("%d of %zu do not verify; --resume skips them\n", bad, list->size());
  return 0;
}

CommandRegistration checkpoint_info_command(
    "checkpoint info", "list the checkpoints in a --checkpoint-dir, with step, size and verification",
    [](CLI::App& app) -> CommandRun {
      auto f = std::make_shared<CheckpointInfoFlags>();
      app.add_option("DIR", f->dir, "the --checkpoint-dir of a run")->required();
      return [f]() -> int { return run_checkpoint_info(*f); };
    });

}  // namespace
}  // namespace spillway::cli
