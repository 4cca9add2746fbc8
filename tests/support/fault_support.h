// Storage faults for training tests: a StorageEngineMaker (io/storage_engine.h) that
// wraps the real engine in a FaultStorageEngine, handed to the executor or trainer
// (production code has no fault switch; it only receives engines).
//
//   ExecutorOptions eo;
//   eo.storage_engine_maker = faulty_storage_engines(/*seed=*/3, /*rate=*/0.01);
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "io/fault_storage_engine.h"
#include "io/storage_engine.h"

namespace spillway {

// Each request fails with probability `rate`, each way a disk fails (EIO on read or
// write, a corrupt read, ENOSPC, a short or torn write), reproducibly for `seed`.
inline StorageEngineMaker faulty_storage_engines(uint64_t seed, double rate) {
  return [seed, rate](const std::string& kind) -> Result<std::unique_ptr<StorageEngine>> {
    SPILLWAY_ASSIGN_OR_RETURN(auto inner, make_storage_engine(kind));
    FaultOptions f;
    f.seed = seed;
    for (FaultKind k : {FaultKind::ReadError, FaultKind::CorruptRead, FaultKind::WriteError, FaultKind::NoSpace,
                        FaultKind::ShortWrite, FaultKind::TornWrite})
      f.rules.push_back({k, rate, 0});
    return std::unique_ptr<StorageEngine>(std::make_unique<FaultStorageEngine>(std::move(inner), f));
  };
}

}  // namespace spillway
