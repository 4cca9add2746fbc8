// The CPU backend: the reference implementation of every op (fp32, deterministic)
// and the simulated device of CI runs. Its "device" memory is 64-byte-aligned heap
// memory standing in for HBM, reached through the same copy-engine path as a GPU.
//
//   auto b = make_cpu_backend({.threads = 4});
//   if (!b) die(b.status());
//   Backend& cpu = **b;                                   // name() == "cpu"
//   auto dev = cpu.device_alloc(bytes);                   // 64-byte aligned
//   auto host = cpu.host_alloc(bytes);                    // page aligned
//   auto t = cpu.copy_engine().copy(CopyDirection::HostToDevice, *dev, *host, bytes);
//   cpu.layernorm_forward(out, mean, rstd, inp, w, bias, N, C);   // runs now, on its pool
//
// Ops run synchronously on the calling thread and on the backend's own thread pool,
// whose size (BackendOptions::threads; 0 = all cores) is fixed for the backend's life.
// The same inputs give the same bits on every run at any 64-aligned addresses; every
// op except the matrix products also gives the same bits for any thread count.
#pragma once

#include <memory>

#include "backend/backend.h"

namespace spillway {

// options.threads < 0 is an InvalidArgument.
Result<std::unique_ptr<Backend>> make_cpu_backend(const BackendOptions& options);

}  // namespace spillway
