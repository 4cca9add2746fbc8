// Where this process stands in a data-parallel job, from the environment as torchrun
// and `spillway launch` set it, and the hand-over of a job's id from rank 0 to the
// other ranks of one machine through a file (when no launcher set the id).
//
//   SPILLWAY_ASSIGN_OR_RETURN(RankEnv env, rank_env());     // RANK, WORLD_SIZE, LOCAL_RANK
//   if (env.world > 1) {
//     std::string path = rendezvous_path(env);              // $SPILLWAY_RENDEZVOUS_DIR or /tmp
//     if (env.rank == 0) SPILLWAY_RETURN_IF_ERROR(publish_rendezvous(path, id_text));
//     else SPILLWAY_ASSIGN_OR_RETURN(id_text, await_rendezvous(path, std::chrono::seconds(300)));
//   }
//
// The variables:
// - WORLD_SIZE: unset, empty or 1: one process alone (RANK, if set, must be 0); a whole
//   number >= 2: a job of that many ranks, which needs RANK (0 <= RANK < WORLD_SIZE)
//   and LOCAL_RANK (>= 0 and < WORLD_SIZE: the device of this machine the rank uses).
//   LOCAL_WORLD_SIZE, when set, bounds LOCAL_RANK too.
// - SPILLWAY_NCCL_ID: the job's NCCL id in hex (`spillway launch` sets it).
// - Without it, the rendezvous file: $SPILLWAY_RENDEZVOUS_DIR (default: the system's
//   temporary folder, $TMPDIR or /tmp) / spillway-rendezvous-<MASTER_PORT>-
//   <TORCHELASTIC_RUN_ID>-<WORLD_SIZE>, the parts left out when unset (torchrun sets
//   both, and two jobs on one machine cannot share a MASTER_PORT).
// Errors name the variable, its value and what was expected.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "core/status.h"

namespace spillway {

struct RankEnv {
  int rank = 0;        // RANK
  int world = 1;       // WORLD_SIZE
  int local_rank = 0;  // LOCAL_RANK: this rank's device on its machine
  // Other variables that shape the job (empty when unset).
  std::string nccl_id;         // SPILLWAY_NCCL_ID
  std::string rendezvous_dir;  // SPILLWAY_RENDEZVOUS_DIR
  std::string master_port;     // MASTER_PORT
  std::string run_id;          // TORCHELASTIC_RUN_ID
  bool distributed() const { return world > 1; }
};

// A lookup of one environment variable (nullptr when unset): ::getenv, or a map in tests.
using EnvLookup = std::function<const char*(const char*)>;

Result<RankEnv> rank_env(const EnvLookup& lookup);
Result<RankEnv> rank_env();  // from this process's environment

// The rendezvous file of `env` (see above).
std::string rendezvous_path(const RankEnv& env);

// Rank 0: writes `text` (one line, no newline in it) into `path` atomically (a
// temporary file renamed over it), with this process's pid and start time, so that a
// waiting rank can tell a file that a finished job left behind (its writer is gone)
// from this job's. Replaces an older file.
Status publish_rendezvous(const std::string& path, const std::string& text);
// The other ranks: waits until `path` holds a text whose writer is alive, polling, and
// returns it; an error naming the path and the time waited when `timeout` passes
// first (rank 0 did not start, or writes elsewhere: is SPILLWAY_RENDEZVOUS_DIR the
// same for every rank?). A file whose writer is gone is skipped (waited past).
Result<std::string> await_rendezvous(const std::string& path, std::chrono::milliseconds timeout);
// Rank 0, once every rank has read it: removes the file (missing: ok).
Status remove_rendezvous(const std::string& path);

}  // namespace spillway
