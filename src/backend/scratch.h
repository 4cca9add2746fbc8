// Scratch memory for running backend calls outside an executor (the profiler's
// measurements, exec/op_timer.h): buffers freed together, once the backend is done
// with them, and the backend's own workspace, freed at the end of a scope.
//
//   ScratchBuffers buffers(backend);
//   SPILLWAY_ASSIGN_OR_RETURN(void* x, buffers.device(1 << 20));  // zero-filled
//   OwnWorkspace workspace(backend);
//   SPILLWAY_RETURN_IF_ERROR(workspace.use(backend.matmul_workspace(N, OC, false, false)));
#pragma once

#include <cstddef>
#include <utility>
#include <vector>

#include "backend/backend.h"
#include "core/status.h"

namespace spillway {

class ScratchBuffers {
 public:
  explicit ScratchBuffers(Backend& backend) : backend_(backend) {}
  ScratchBuffers(const ScratchBuffers&) = delete;
  ScratchBuffers& operator=(const ScratchBuffers&) = delete;
  // Synchronizes the backend (errors were reported by the caller's timed section),
  // then frees every buffer.
  ~ScratchBuffers();
  // Zero-filled device memory of at least `bytes` (and at least the alignment).
  Result<void*> device(size_t bytes);
  // Zero-filled host memory (Backend::host_alloc: pinned on CUDA) of at least `bytes`.
  Result<void*> host(size_t bytes);

 private:
  Backend& backend_;
  std::vector<std::pair<void*, bool>> buffers_;  // pointer, on device
};

// The backend's own workspace (Backend::use_own_workspace) while ops run outside an
// executor; freed at the end of the scope.
class OwnWorkspace {
 public:
  explicit OwnWorkspace(Backend& b) : b_(b) {}
  OwnWorkspace(const OwnWorkspace&) = delete;
  OwnWorkspace& operator=(const OwnWorkspace&) = delete;
  ~OwnWorkspace() { (void)b_.use_own_workspace(0); }
  Status use(uint64_t bytes) { return b_.use_own_workspace(bytes); }

 private:
  Backend& b_;
};

}  // namespace spillway
