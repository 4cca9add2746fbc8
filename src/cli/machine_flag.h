// The machine model a command plans with: --machine FILE|PRESET, or `measured` (the
// default on CUDA): this host's measured machine from the cache that `spillway
// profile` writes, profiled briefly and cached on first use when there is none.
//
//   auto m = training_machine(flag, backend, mem.spill_dir);  // train, bench train
//   bool profiled = false;
//   auto measured = measured_machine(backend, spill_dir, &profiled);
//   HostIdentity id = host_identity(backend.description());
//   std::string path = *machine_cache_path(id);  // ~/.cache/spillway/machine-<key>.json
#pragma once

#include <string>

#include "backend/backend.h"
#include "core/status.h"
#include "sim/machine.h"

namespace spillway::cli {

// What identifies a measured machine: the GPU (the backend's description up to " ("), the host
// CPU's model and core count, and the NVIDIA driver's version ("none" without one).
struct HostIdentity {
  std::string gpu, cpu_model, driver, host_name;
  int cores = 0;
  // 16 hex digits: a hash of gpu, cpu_model, cores and driver.
  std::string key() const;
  // "AMD EPYC 9654 96-Core Processor, 16 cores"
  std::string cpu() const;
};
HostIdentity host_identity(const std::string& gpu_description);

// $XDG_CACHE_HOME/spillway (or $HOME/.cache/spillway)/machine-<key>.json; an error
// when neither variable is set.
Result<std::string> machine_cache_path(const HostIdentity& id);

// This host's measured machine: the cached one when machine_cache_path(host_identity(...))
// exists (a file that does not load is an error naming it, to be removed or profiled
// again); else a brief profile now (measure_machine, ProfileSettings::brief: seconds),
// its storage measured in `spill_dir` or, when that is empty, in the cache folder,
// written to the cache atomically and used; *profiled (when given) says which. One line
// on stderr before the profile and one after, with the seconds it took; its table goes
// to stderr. Errors name what could not be measured and suggest a preset.
Result<Machine> measured_machine(Backend& backend, const std::string& spill_dir, bool* profiled = nullptr);

// The machine for train and bench train: --machine h200|cpu|FILE when given;
// `measured`, or on CUDA without --machine, measured_machine; on the CPU backend
// without it, the cpu preset (tests and CI plan deterministically). On CUDA the device
// size is the backend's. The brief profile of first use runs here, before the trainer
// is built: it adds to the time to the first step once per host, GPU and driver, never
// to a step's time (nothing else runs while it measures).
Result<Machine> training_machine(const std::string& flag, Backend& backend, const std::string& spill_dir);

}  // namespace spillway::cli
