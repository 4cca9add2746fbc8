// Measuring this machine for the planner and the simulator (sim/machine.h): what
// `spillway profile` runs in full, and what train and bench train run briefly the
// first time they need this host's measured machine (cli/machine_flag.h, --machine
// measured).
//
//   ProfileSettings s;
//   s.brief = true;                  // seconds: fewer sizes and rounds (first use)
//   s.spill_dir = "/nvme/spill";     // an existing folder: storage is measured there
//   s.table = stderr;                // where the table of figures is printed
//   SPILLWAY_ASSIGN_OR_RETURN(Machine m, measure_machine(backend, s));
//   SPILLWAY_RETURN_IF_ERROR(save_machine(m, *machine_cache_path(host_identity(backend.description()))));
#pragma once

#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "core/status.h"
#include "sim/machine.h"

namespace spillway::cli {

// A sample training step whose ops are timed: `layers` layers of a model preset, B
// sequences of T tokens ("tiny:4x128:4").
struct OpSample {
  std::string model;
  int B = 0, T = 0;
  int layers = 1;  // of the model's; the model's own count for a whole step
  std::string text() const {
    return model + ":" + std::to_string(B) + "x" + std::to_string(T) + (layers != 1 ? ":" + std::to_string(layers) : "");
  }
};

// The offloaded step that calibrates copy_share_while_computing and its device budget.
struct OffloadSample {
  OpSample sample;
  uint64_t budget = 0;  // 0: no calibration
};

struct ProfileSettings {
  // Tiny sizes, for tests: figures far from the machine's steady state. Wins over brief.
  bool quick = false;
  // First use of train or bench train: one copy size, less storage data at two
  // depths, fewer shapes and rounds; seconds instead of about a minute.
  bool brief = false;
  // An existing folder: its capacity is reported, its storage measured with a test
  // file that is removed.
  std::string spill_dir;
  // The sample steps whose ops are timed for each kind's fitted cost; empty: the
  // backend's default (default_op_samples).
  std::vector<OpSample> samples;
  // The offloaded step that calibrates the copy speed while computing; none: the
  // backend's default (default_offload_sample); a budget of 0: no calibration.
  std::optional<OffloadSample> offload;
  // measured_on.notes; empty: how it was measured ("spillway profile --backend cuda").
  std::string notes;
  // Where the table of figures is printed as they are measured.
  std::FILE* table = stdout;
};

// The default samples of a backend and mode (see profile.cpp).
std::vector<OpSample> default_op_samples(bool cuda, const ProfileSettings& s);
OffloadSample default_offload_sample(bool cuda, const ProfileSettings& s);

// Measures copies, storage, host AdamW, device compute, each op kind's cost over the
// sample steps and (where there is an offloaded sample) the copy speed while
// computing, printing each figure to s.table. The machine is named after the host
// and the backend, measured_on says where and when. Errors name what could not be
// measured ("profile: storage at depth 16: ..."); an Interrupted status when SIGINT
// or SIGTERM arrived (InterruptMode::BetweenSteps) between two measurements.
Result<Machine> measure_machine(Backend& backend, const ProfileSettings& s);

// Creates `dir` and the folders above it that are missing (mkdir -p); errors name
// the folder that could not be made.
Status make_dirs(const std::string& dir);

}  // namespace spillway::cli
