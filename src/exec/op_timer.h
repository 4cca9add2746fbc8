// Op timer: measures the time of each op of a Program on a backend, through the
// same dispatch the executor uses (exec/dispatch.h), for Machine::measured_op_seconds
// (sim/machine.h).
//
//   auto seconds = profile_ops(backend, program, /*repeats=*/3);
//   if (!seconds) die(seconds.status());           // names the op that could not run
//   machine.measured_op_seconds = *seconds;        // Machine::op_seconds uses them
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

namespace spillway {

// Seconds per op index ([program.ops]): the mean of `repeats` runs after one warm-up.
Result<std::vector<double>> profile_ops(Backend& backend, const Program& program, int repeats);

}  // namespace spillway
