// `spillway clean DIR`: removes what runs that are gone left in DIR — spill
// directories (DIR/spillway-<pid>-*) and temporary files of unfinished saves
// (*.tmp-<pid>-*, files, and the folders of model directory saves) — and never those
// of a process that is alive.
//
//   spillway clean /nvme/spill --dry-run    # lists them and their size
//   spillway clean /nvme/spill              # removes them, prints the bytes freed
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <memory>

#include "cli/command.h"
#include "core/atomic_file.h"
#include "core/size.h"
#include "memory/storage_store.h"

namespace spillway::cli {
namespace {

struct CleanFlags {
  std::string dir;
  bool dry_run = false;
};

int run_clean(const CleanFlags& f) {
  auto found = find_all_leftovers(f.dir);
  if (!found) return fail(found.status().with_context("spillway clean"));
  if (found->empty()) {
    std::printf("nothing to clean in %s: no leftovers of runs that are gone\n", f.dir.c_str());
    return 0;
  }
  const char* verb = f.dry_run ? "would remove" : "removed";
  uint64_t freed = 0;
  int failures = 0;
  auto report = [&](const std::string& path, const char* what, int64_t pid, uint64_t bytes, const Status& s) {
    if (!s.is_ok()) {
      std::fprintf(stderr, "spillway: error: cannot remove %s: %s\n", path.c_str(), s.message().c_str());
      ++failures;
      return;
    }
    std::printf("%s %s (%s of pid %lld, %s)\n", verb, path.c_str(), what, static_cast<long long>(pid),
                format_size(bytes).c_str());
    freed += bytes;
  };
  for (const LeftoverSpill& l : found->spill_dirs)
    report(l.path, "spill directory", l.pid, l.bytes, f.dry_run ? Status::ok() : remove_leftover_spill_dir(l));
  for (const StaleTempFile& t : found->temp_files)
    report(t.path, t.folder ? "temporary folder" : "temporary file", t.pid, t.bytes,
           f.dry_run ? Status::ok() : remove_stale_temp(t));
  if (f.dry_run)
    std::printf("would free %s in %s; run without --dry-run to remove them\n", format_size(freed).c_str(), f.dir.c_str());
  else
    std::printf("freed %s in %s\n", format_size(freed).c_str(), f.dir.c_str());
  std::fflush(stdout);
  return failures == 0 ? 0 : 1;
}

CommandRegistration clean_command(
    "clean", "remove spill directories and unfinished save files left by runs that are gone",
    [](CLI::App& app) -> CommandRun {
      auto f = std::make_shared<CleanFlags>();
      app.add_option("DIR", f->dir, "spill directory (--spill-dir) or the folder of a --save file")->required();
      app.add_flag("--dry-run", f->dry_run, "list what would be removed and its size; remove nothing");
      return [f]() -> int { return run_clean(*f); };
    });

}  // namespace
}  // namespace spillway::cli
