// Profiler: measures op times and link bandwidths on the real backend, so that the
// planner and the simulator predict this machine rather than a preset.
//
//   auto backend = make_backend("cuda");
//   Machine m = Machine::h200();
//   auto measured = measure_machine(**backend, m);           // copy, matmul, memory, AdamW rates
//   if (!measured) die(measured.status());
//   m = *measured;
//   auto seconds = profile_ops(**backend, program, /*repeats=*/3);
//   if (!seconds) die(seconds.status());
//   m.measured_op_seconds = *seconds;                        // Machine::op_seconds uses them
//
// profile_ops runs each op alone on operands it allocates for that op (zero-filled;
// performance does not depend on the values), then frees them, so it works for
// models larger than device memory as long as each single op fits. Ops of the same
// kind, place, attributes and operand sizes share one measurement. Host ops (host
// AdamW) run on host buffers. An op with no stand-alone form (a host op other than
// AdamW) gets 0, which Machine::op_seconds replaces by its derived time.
#pragma once

#include <vector>

#include "backend/backend.h"
#include "core/status.h"
#include "program/program.h"
#include "sim/machine.h"

namespace spillway {

// Seconds per op index ([program.ops]): the mean of `repeats` runs after one warm-up.
Result<std::vector<double>> profile_ops(Backend& backend, const Program& program, int repeats);

// `base` with the rates this backend shows in short tests: H2D and D2H bandwidth
// through the copy engine (64 MiB, each direction alone, then both at once for
// duplex_factor), matrix-product flops, memory-bound bytes/s (a residual add), host AdamW
// params/s, device capacity, and whether the host runs ahead (CUDA). Storage rates
// are left as given (they need a spill directory: `spillway bench io`).
Result<Machine> measure_machine(Backend& backend, Machine base);

}  // namespace spillway
