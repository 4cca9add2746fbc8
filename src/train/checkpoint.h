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
#include <string>
#include <string_view>
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

// The newest checkpoint under `root` that verifies; each newer one that did not is
// added to `skipped` as "NAME: why". NotFound when none verifies.
Result<Checkpoint> newest_checkpoint(const std::string& root, std::vector<std::string>* skipped);

// Writes every state tensor of the checkpoint into the trainer (names, dtypes and
// shapes must match its program) and restores its step.
Status load_checkpoint(Trainer& trainer, const Checkpoint& checkpoint);

}  // namespace spillway
