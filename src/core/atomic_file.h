// AtomicFile: a file written whole or not at all. The bytes go to a temporary file
// beside the target, which replaces the target only when commit() succeeds.
//
//   SPILLWAY_ASSIGN_OR_RETURN(AtomicFile f, AtomicFile::create("/ckpt/w.safetensors"));
//   // → /ckpt/w.safetensors.tmp-<pid>-<8 hex digits>, made with O_EXCL
//   ... ::pwrite(f.fd(), ...) ...            // errors name f.temp_path()
//   SPILLWAY_RETURN_IF_ERROR(f.commit());    // fsync, close, rename onto the target, fsync the folder
//
// - Destroyed without commit(), or after a failed commit(): the temporary file is
//   removed. If SIGINT/SIGTERM end the process at once, core/interrupt.h removes it.
// - The pid in the name lets a later run tell a dead writer's file from a live
//   one's: find_stale_temp_files() lists those whose process is gone (SIGKILL, a
//   crash), and `spillway clean DIR` removes them.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/interrupt.h"
#include "core/status.h"

namespace spillway {

class AtomicFile {
 public:
  static Result<AtomicFile> create(const std::string& target, mode_t mode = 0644);
  AtomicFile(AtomicFile&& other) noexcept;
  AtomicFile& operator=(AtomicFile&& other) noexcept;
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  ~AtomicFile();

  int fd() const { return fd_; }  // -1 after commit() or abandon()
  const std::string& temp_path() const { return temp_; }
  const std::string& target() const { return target_; }
  // fsync and close the temporary file, rename it onto the target, fsync the
  // target's folder. On an error the temporary file is removed and the target left
  // as it was (unless only the folder's fsync failed: the rename is then done).
  Status commit();
  // Closes and removes the temporary file now.
  void abandon();

 private:
  AtomicFile() = default;
  int fd_ = -1;
  std::string target_, temp_;
  RemoveOnInterrupt remove_on_interrupt_;
};

// fsync of a folder, so that a rename or a new file in it survives a crash.
Status fsync_directory(const std::string& dir);

// Writes `text` to `path` whole or not at all (an AtomicFile written, then committed);
// errors name the temporary file or the target.
Status write_file_atomically(const std::string& path, std::string_view text);

// The folder part of a path: "a/b/c" → "a/b", "c" → ".", "/c" → "/".
std::string parent_directory(const std::string& path);

// "w.safetensors.tmp-123-0a1b2c3d" → 123; 0 when the name is not an AtomicFile's.
int64_t temp_file_pid(std::string_view name);

// An AtomicFile temporary, or a model directory's temporary folder (model/hf_model.h:
// DIR.tmp-<pid>-<random>, regular files only), whose writer is gone (killed, crashed).
struct StaleTempFile {
  std::string path;
  int64_t pid = 0;
  uint64_t bytes = 0;      // disk space it takes (a folder: the files directly in it)
  bool folder = false;     // a temporary folder
};
// The regular files and folders directly in `dir` named like an AtomicFile temporary
// whose pid is not alive. An error naming the folder if it cannot be listed.
Result<std::vector<StaleTempFile>> find_stale_temp_files(const std::string& dir);
// Removes a stale temporary: a file, or a folder's regular files and then the folder
// (rmdir fails, and says so, if it holds anything else).
Status remove_stale_temp(const StaleTempFile& t);

}  // namespace spillway
