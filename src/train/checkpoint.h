// Checkpoints: the whole training state (parameters, master weights, both Adam
// moments, wherever they rest), the step and the data position, written so that a
// crash at any instant leaves the previous checkpoint whole, and verified before it
// is loaded.
//
//   CheckpointMeta meta{.step = trainer.steps_done(), .data_batch = loader.batch_index(), .config = run_json};
//   SPILLWAY_ASSIGN_OR_RETURN(std::string path, write_checkpoint(trainer, "runs/a", meta, /*keep=*/2));
//   // → runs/a/ckpt-00000010/{state.bin, manifest.json}
//   std::vector<std::string> skipped;                  // "ckpt-00000020: state.bin: ... (xxh3 ...)"
//   SPILLWAY_ASSIGN_OR_RETURN(Checkpoint c, newest_checkpoint("runs/a", &skipped));
//   SPILLWAY_RETURN_IF_ERROR(load_checkpoint(trainer, c));   // state and step restored
//
//   // In the background while training goes on:
//   CheckpointWriter writer("runs/a", /*keep=*/2);
//   SPILLWAY_RETURN_IF_ERROR(writer.begin(trainer, meta));  // drains, copies the state, returns
//   ... more steps; writer.poll() reports a failed write ...
//   SPILLWAY_ASSIGN_OR_RETURN(std::string path, writer.wait());
//
// Layout: ROOT/ckpt-<step, 8 digits>/ holds state.bin (every state tensor's bytes in
// its dtype, back to back) and manifest.json: {"format": "spillway-checkpoint",
// "version": 1, "step", "data_batch", "config" (the caller's: what the run's math
// depends on), "tensors": [{name, dtype, shape, offset, bytes, xxh3}], "files":
// [{name, bytes, xxh3}]} (xxh3 as 16 hex digits).
//
// Writing: into ROOT/.ckpt-<step>.tmp-<pid>, each file fsynced, then the folder,
// renamed into place, then ROOT fsynced; then all but the newest `keep` complete
// checkpoints are removed. On any error (ENOSPC, EIO) the temporary folder is
// removed, the previous checkpoints stay, and the error names the folder and the
// bytes the checkpoint needed. Reading checks the format and version, every file's
// size and checksum and every tensor's range and checksum; an error names the
// checkpoint, the file and what is wrong.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/status.h"
#include "train/trainer.h"

namespace spillway {

inline constexpr int kCheckpointVersion = 1;

struct CheckpointMeta {
  int64_t step = 0;        // steps applied (the run continues with step + 1)
  int64_t data_batch = 0;  // the training loader's next batch
  nlohmann::json config;   // what the run's math depends on (compared on resume by the caller)
};

struct Checkpoint {
  std::string path;        // ROOT/ckpt-00000010
  CheckpointMeta meta;
  uint64_t bytes = 0;      // state.bin's size
  nlohmann::json manifest;
};

// Writes the trainer's state (it drains the pipeline first) as a checkpoint under
// `root` (made if missing), then keeps the newest `keep` (at least 1). Returns its path.
Result<std::string> write_checkpoint(Trainer& trainer, const std::string& root, const CheckpointMeta& meta, int keep);

// How a checkpoint's state.bin was written.
struct CheckpointWriteStats {
  uint64_t bytes = 0;
  double seconds = 0;   // the whole folder: state.bin with its checksums, fsyncs, rename
  bool direct = false;  // state.bin written with O_DIRECT
};

// Writes checkpoints while training goes on. begin() drains the trainer and copies
// the whole state into a host buffer (kept for the next checkpoint): the snapshot
// of one step, taken on all cores. A thread then writes it as write_checkpoint
// does, while the next steps run. One write is in flight at a time: begin() waits
// for the previous one first. The host buffer is made by prepare(); without it, or
// when the copy does not fit beside the run in host memory (Auto), the checkpoint
// is written before begin() returns instead, and sync_reason() says why. Device
// copies are made in begin(); host copies run on the trainer's host engine while
// the next step's device work goes on (Trainer::snapshot_state). Not thread-safe:
// one caller.
class CheckpointWriter {
 public:
  enum class Mode { Auto, Background, Foreground };
  CheckpointWriter(std::string root, int keep, Mode mode = Mode::Auto);
  ~CheckpointWriter();  // waits for the write in flight
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;

  // Allocates the host copy of a state of `state_bytes` on a thread now (Auto:
  // when it fits beside the run in available host memory; else checkpoints are
  // written in the foreground and sync_reason() says why). Without it, Auto writes
  // in the foreground (right for a checkpoint only at the end of a run).
  // With `backend`, the copy is also pinned (Backend::pin_host, in pieces of 1 GiB, on
  // that thread), so device-resident state is copied into it by the copy engine while
  // the next step runs, instead of through staging buffers while training waits; a
  // failure to pin only loses that. The backend must outlive the writer.
  void prepare(uint64_t state_bytes, Backend* backend = nullptr);
  // The previous write's error, if it failed; otherwise snapshots and starts.
  Status begin(Trainer& trainer, const CheckpointMeta& meta);
  // Waits for the write in flight: its path, "" when there was none, or its error.
  Result<std::string> wait();
  // A finished write's error, without waiting (ok while one is in flight).
  Status poll();
  bool busy() const;
  // Seconds training waited in the last begin() (drain, snapshot; the whole write
  // when written in the foreground).
  double last_wait_s() const { return wait_s_; }
  // The last background snapshot's parts (zero after a foreground write).
  const SnapshotTimes& last_snapshot() const { return times_; }
  // Why checkpoints are written in the foreground ("" when they are not).
  const std::string& sync_reason() const { return why_sync_; }
  // The last completed background write (after wait() or a begin() that waited).
  CheckpointWriteStats last_write() const {
    std::lock_guard<std::mutex> lock(mu_);
    return write_stats_;
  }
  // The newest checkpoint this writer completed ("" before the first).
  const std::string& last_path() const { return last_path_; }

 private:
  struct HostBuffer {
    struct Free {
      void operator()(uint8_t* p) const;
    };
    std::unique_ptr<uint8_t, Free> data;  // [bytes] the state, tensor after tensor
    uint64_t bytes = 0;
  };
  std::string root_;
  int keep_;
  Mode mode_;
  HostBuffer snapshot_;      // written by preparing_ until it is joined
  // The pinned pieces of snapshot_ (written by preparing_ until it is joined), unpinned
  // by the destructor through pin_backend_.
  PinnedRange pinned_;
  std::vector<void*> pinned_pieces_;
  Backend* pin_backend_ = nullptr;
  bool prepared_ = false;
  Status prepare_error_;     // written by preparing_ until it is joined
  std::thread preparing_;
  std::thread thread_;
  mutable std::mutex mu_;
  bool writing_ = false;                           // guarded by mu_
  std::optional<Result<std::string>> finished_;    // guarded by mu_: the last write's result, until wait()
  CheckpointWriteStats write_stats_;               // guarded by mu_
  double wait_s_ = 0;
  SnapshotTimes times_;
  std::string why_sync_, last_path_;
};

// Parses manifest.json's text (named `where` in errors): the format, version and
// every field's type; nothing is read from disk (fuzz/fuzz_checkpoint_manifest.cpp).
Result<Checkpoint> parse_checkpoint_manifest(std::string_view text, const std::string& where);

// Reads and verifies one checkpoint folder (every byte is checksummed).
Result<Checkpoint> read_checkpoint(const std::string& path);

struct CheckpointListing {
  std::string path;
  int64_t step = 0;
  uint64_t bytes = 0;  // state.bin's size (0 when missing)
  Status status;       // ok, or why it does not verify
};
// The checkpoints under `root`, newest first, each verified. Temporary folders of
// writes that did not finish are not listed.
Result<std::vector<CheckpointListing>> list_checkpoints(const std::string& root);

// The folders under `root` named as checkpoints (ckpt-<step>), newest first, as (step,
// path), whether they verify or not (unlike list_checkpoints, nothing is read).
Result<std::vector<std::pair<int64_t, std::string>>> checkpoint_folders(const std::string& root);

// The newest checkpoint under `root` that verifies; each newer one that did not is
// added to `skipped` as "NAME: why". NotFound when none verifies.
Result<Checkpoint> newest_checkpoint(const std::string& root, std::vector<std::string>* skipped);

// Writes every state tensor of the checkpoint into the trainer (names, dtypes and
// shapes must match its program) and restores its step.
Status load_checkpoint(Trainer& trainer, const Checkpoint& checkpoint);

}  // namespace spillway
