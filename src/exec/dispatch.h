// Runs one Program op on a Backend (device ops) or on the host (host ops), given a
// pointer for each operand in the op's operand order.
//
//   std::vector<void*> ptrs = {out_ptr, inp_ptr};           // GeluForward: (out, inp)
//   SPILLWAY_RETURN_IF_ERROR(run_device_op(backend, program, op, ptrs, step));
#pragma once

#include <vector>

#include "backend/backend.h"
#include "program/program.h"

namespace spillway {

// Per-step values the optimizer needs (learning rate and step for bias correction).
struct OptimizerStep {
  int64_t step = 1;
  float lr = 0;
};

Status run_device_op(Backend& backend, const Program& program, const Op& op, const std::vector<void*>& ptrs,
                     const OptimizerStep& step);
// Host ops: AdamW (with param in `param_dtype`).
Status run_host_op(const Op& op, const std::vector<void*>& ptrs, DType param_dtype, const OptimizerStep& step);

}  // namespace spillway
