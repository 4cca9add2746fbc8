// Runs one Program op on a Backend (device ops) or on the host (host ops), given a
// pointer for each operand in the op's operand order.
//
// The calls live in one table in dispatch.cpp, kDeviceOps, one entry per OpKind
// (its device call, its workspace size, its host call if any), checked complete and
// in enum order by static_asserts. It sits here rather than in the op registry
// (program/op_registry.h) because the program module comes before the backend in
// DESIGN.md's flow: the registry says what an op is, this table how a backend runs it.
//
// The collective ops of data-parallel ranks (ReduceGradient, SendGradient,
// AllReduceInRankOrder, BroadcastParam) call the backend's Communicator
// (Backend::set_communicator); without one they are an error naming the op. A
// communicator with a stream (NCCL) only enqueues there, after an event of the compute
// stream, and later ops wait for it on the device only where they touch its tensors
// (Backend::order_after_stream, order_compute_for): no host wait. One without
// (the in-process one) runs after synchronizing the backend. Gradient sums and broadcasts go in the operands' dtype (f32:
// reduce_in_rank_order; bf16: reduce_bf16_in_rank_order), the squared norms in f32.
// AccumulateGradient is the backend's residual_forward with out = a (in place).
//
//   std::vector<void*> ptrs = {out_ptr, inp_ptr};           // GeluForward: (out, inp)
//   SPILLWAY_RETURN_IF_ERROR(run_device_op(backend, program, op, ptrs, step));
//   auto ws = program_workspace(backend, program);          // device workspace to reserve
//   if (ws.ok()) planner_options.workspace_bytes = ws->bytes;
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "program/program.h"

namespace spillway {

// Per-step values the optimizer needs (learning rate and step for bias correction).
struct OptimizerStep {
  int64_t step = 1;
  float lr = 0;
};

// The speculative form of a host AdamW (plan.h, "Speculative updates"): the update
// as if the clip scale were exactly 1, reading master, m and v from `state` and
// writing them to `into` (each a buffer of op.attrs.n floats), param in place; grad
// is read. The same bits as the AdamW op with scale_norm[0] = 1.
Status run_adamw_host_speculative(const Op& op, void* param, const void* grad, const float* const state[3],
                                  float* const into[3], DType param_dtype, const OptimizerStep& step);

Status run_device_op(Backend& backend, const Program& program, const Op& op, const std::vector<void*>& ptrs,
                     const OptimizerStep& step);
// Device workspace (Backend::set_workspace) that run_device_op needs for `op`: the
// most over the backend calls it makes. Internal when the backend cannot size it.
// `backend` is a Backend, or the sizes of a kind of backend without one
// (backend_sizes("cuda")): both give the same figure.
Result<uint64_t> op_workspace_bytes(const BackendSizes& backend, const Program& program, const Op& op);

// The workspace a whole program needs: the most over its ops (the workspace is
// reused by every op), and the op that needs it.
struct WorkspaceNeed {
  uint64_t bytes = 0;
  std::string op;  // name of the op that needs the most ("" when none needs any)
};
Result<WorkspaceNeed> program_workspace(const BackendSizes& backend, const Program& program);

// Runs every distinct device op of `program` once (ops of one kind with the same
// operand shapes count once: each layer's), on zeroed scratch memory allocated and
// freed here, so that the kernels they launch, and cuBLASLt's algorithm for every
// product shape, are loaded before any budget is computed; then the backend
// measures what it holds itself again (Backend::remeasure_fixed_device_bytes). Ops
// whose operands and workspace exceed `limit` bytes are left out (no plan could run
// them). Call it while no device allocation is live. A no-op on the CPU backend.
Status warm_up_kernels(Backend& backend, const Program& program, uint64_t limit);

// Whether run_host_op runs `kind` (AdamW); equals op_info(kind).host (a unit test
// holds them together).
bool has_host_implementation(OpKind kind);
// Host ops: AdamW (with param in `param_dtype`).
Status run_host_op(const Op& op, const std::vector<void*>& ptrs, DType param_dtype, const OptimizerStep& step);

}  // namespace spillway
