// Data-parallel training, the whole run: what `spillway train` runs in each rank when
// WORLD_SIZE > 1 (cli/train.cpp gives it an NcclCommunicator), and what the tests run
// in threads with in-process communicators. Library spillway_dist_train (over dist and
// train: it drives a DataParallelRank as the Trainer drives its executor).
//
//   DataParallelTrainingOptions o;
//   o.trainer = trainer_options;          // as for Trainer, shape.accum = A micro-batches a rank
//   o.data = &dataset;
//   o.steps = 300;
//   o.save = "w.safetensors";             // rank 0 writes it
//   o.on_step = [&](const StepResult& r) { ... };   // progress, metrics
//   SPILLWAY_ASSIGN_OR_RETURN(DataParallelTrainingResult r, train_data_parallel(comm, backend, o));
//
// Rank r of N reads, of every step's N·A micro-batches (the train loader's batches
// from the step's first, as one process with --accum N·A draws them), micro-batches
// r·A ... r·A+A-1, and the layout (dist/data_parallel.h) reduces the gradients in the
// order one process accumulates them: N ranks give, bit for bit, the losses and
// weights of one process with accumulation N·A. The step's loss is that process's
// too: every rank gathers every micro-batch's per-token losses and sums them in
// micro-batch order in double (train/trainer.h), so every rank reports the same loss.
// The weights that rank 0 saves are the master weights, as Trainer::save writes them
// (every rank sends rank 0 those it owns): the same bytes. On the CUDA backend (bf16
// activations and gradients) too: the layout reduces bf16 gradients in the order and
// arithmetic of one bf16 process's accumulation (dist/data_parallel.h).
//
// Set-up (planning, loading) and saving end with an agreement among the ranks: when
// one rank fails, every rank returns an error naming it (its message travels with
// it), instead of the others waiting in a collective. Interruption (stop_requested,
// asked on every rank between steps) is agreed the same way: the ranks stop before
// the same step, write a checkpoint when there is a checkpoint folder, and return
// with `stopped` set.
//
// Not supported (the caller refuses the flags): the gradients' save (they live reduced
// on their owners), timing auto's candidates.
//
// Checkpoints: DIR/dp-ckpt-<step, 8 digits>/ holds each rank's shard
// (DataParallelRank::save_shard) and manifest.json, written by rank 0 once every shard
// is: {"format": "spillway-dp-checkpoint", "version", "step", "world", "data_batch"
// (the train loader's next batch), "config" (the caller's run config)}. The ranks
// write into DIR/dp-ckpt-<step>.partial/, which rank 0 renames once the manifest is
// in: a folder without the suffix is whole. A checkpoint loads onto any number of
// ranks (load_shards), with the same global accumulation N·A.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "backend/backend.h"
#include "backend/communicator.h"
#include "core/chrome_trace.h"
#include "core/status.h"
#include "train/data.h"
#include "train/trainer.h"

namespace spillway {

struct DataParallelTrainingOptions {
  // Model, step shape (B, T, accum = this rank's micro-batches A), schedule, weight
  // decay, gradient clip, seed, budgets (each rank's), planner options, machine and
  // spill folder. auto_confirm and storage_engine_maker are not used.
  TrainerOptions trainer;
  const Dataset* data = nullptr;  // train and validation splits (every rank's the same)
  int zero_stage = 2;             // 2: every rank holds the parameters; 3: their owners only (make_data_parallel_layout)
  int steps = 1;                  // the run's last step (the schedule's total)
  int stop_after = 0;             // > 0: end after this step (checkpoint, as if interrupted)
  int eval_every = 0;             // rank 0 evaluates every N steps and after step `steps` (0 = never)
  int eval_batches = 20;
  std::string load;               // start from these weights (import_model), else initialize from the seed
  bool allow_nonfinite = false;   // --load with NaN or Inf
  std::string save;               // rank 0 writes the final weights here (export_model)
  std::string checkpoint_dir;     // "" = no checkpoints
  int checkpoint_every = 0;       // steps between checkpoints (0: only at the end and when stopped)
  int keep = 2;                   // whole checkpoints kept
  std::string resume;             // a checkpoint folder (newest_data_parallel_checkpoint): go on after its step
  nlohmann::json config;          // recorded in every checkpoint's manifest
  Trace* trace = nullptr;         // rank 0: the executor's trace of step `trace_step`
  int trace_step = 0;
  // After every step, on every rank (val_loss is set on rank 0 only).
  std::function<void(const StepResult&)> on_step;
  // Between steps, on every rank: true on any rank stops all of them.
  std::function<bool()> stop_requested;
};

struct DataParallelTrainingResult {
  int64_t steps_done = 0;
  std::optional<StepResult> last;    // the last step run (none when the run resumed at its end)
  std::optional<float> last_val;     // rank 0: the last evaluation
  std::string checkpoint;            // the newest checkpoint written or resumed from ("" if none)
  int checkpoints_written = 0;
  bool stopped = false;              // stop_requested ended the run before step steps_done + 1
  std::string plan;                  // this rank's plan (its description)
  int64_t tokens_per_step = 0;       // B·T·A·N
};

Result<DataParallelTrainingResult> train_data_parallel(Communicator& comm, Backend& backend,
                                                       const DataParallelTrainingOptions& options);

// A whole data-parallel checkpoint (its manifest).
struct DataParallelCheckpoint {
  std::string path;        // DIR/dp-ckpt-<step>
  int64_t step = 0;
  int world = 0;           // the ranks that wrote it
  int64_t data_batch = 0;
  nlohmann::json config;
};
// The newest whole checkpoint under `dir`; each newer folder passed over (no
// manifest: unfinished; a manifest that does not parse) is added to `skipped` as
// "NAME: why". NotFound naming `dir` when there is none.
Result<DataParallelCheckpoint> newest_data_parallel_checkpoint(const std::string& dir,
                                                               std::vector<std::string>* skipped = nullptr);
// One dp-ckpt-* folder as `spillway checkpoint info` lists it.
struct DataParallelCheckpointListing {
  std::string path;      // DIR/dp-ckpt-<step>, or DIR/dp-ckpt-<step>.partial
  int64_t step = 0;      // from the folder's name
  int world = 0;         // the ranks that wrote it (manifest or shards; 0 when neither tells)
  uint64_t bytes = 0;    // every file in the folder together
  bool partial = false;  // a .partial folder: unfinished, never resumed from
  bool manifest_ok = false;  // its manifest reads and is of its step: all --resume checks before loading
  Status status;         // ok when it verifies; else why (a partial one: NotFound, saying it is unfinished)
};
// The dp-ckpt-* folders under `dir`, newest step first (a .partial after the whole
// folder of its step), each verified: its manifest read and well-formed, its step
// the folder's, and its shards as verify_data_parallel_shards checks them (every
// tensor's checksum), of the manifest's world and step. An empty list when `dir` has
// none or does not exist; an error only when `dir` cannot be read.
//
//   for (const auto& c : *list_data_parallel_checkpoints("runs/a"))
//     std::printf("%s %s\n", c.path.c_str(), c.status.is_ok() ? "ok" : c.status.message().c_str());
Result<std::vector<DataParallelCheckpointListing>> list_data_parallel_checkpoints(const std::string& dir);
// True when `dir` holds a data-parallel checkpoint folder (dp-ckpt-*), whole or not.
bool holds_data_parallel_checkpoints(const std::string& dir);

}  // namespace spillway
