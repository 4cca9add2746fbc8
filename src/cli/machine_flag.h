// The machine model a command plans with: --machine FILE|PRESET, or on CUDA without
// it, the measured machine that `spillway profile` cached for this host.
//
//   auto m = training_machine(flag, backend);    // train, bench train
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

// The machine for train and bench train: --machine FILE|PRESET when given; on CUDA
// without it, the cached measured machine of this host when there is one, else the
// h200 preset with one line on stderr saying so and how to make one; on the CPU
// backend without it, the cpu preset. On CUDA the device size is the backend's.
// Never profiles (that would change the timings of the run).
Result<Machine> training_machine(const std::string& flag, const Backend& backend);

}  // namespace spillway::cli
