#include "exec/op_timer.h"

#include <algorithm>
#include <chrono>
#include <map>
#include <string>

#include "backend/scratch.h"
#include "exec/dispatch.h"

namespace spillway {

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Ops with equal keys take the same time: kind, place, the attributes that size
// the work, and each operand's bytes, dtype and access.
std::string shape_key(const Program& program, const Op& op) {
  const OpAttrs& a = op.attrs;
  std::string key = std::to_string(static_cast<int>(op.kind)) + "/" + std::to_string(static_cast<int>(op.place));
  for (int64_t v : {a.B, a.T, a.C, a.OC, a.NH, a.N, a.V, a.P, a.n}) key += "/" + std::to_string(v);
  for (const Operand& o : op.operands) {
    const TensorInfo& info = program.tensors.info(o.tensor);
    key += "|" + std::to_string(info.bytes()) + ":" + std::to_string(static_cast<int>(info.dtype)) + ":" +
           std::to_string(static_cast<int>(o.access));
  }
  return key;
}

bool has_standalone_form(const Op& op) {
  return op.place != Place::Host || has_host_implementation(op.kind);
}

Result<double> time_op(Backend& backend, const Program& program, const Op& op, int repeats) {
  ScratchBuffers buffers(backend);
  std::map<TensorId, void*> by_tensor;  // an op naming one tensor twice gets one buffer
  std::vector<void*> ptrs;
  for (const Operand& o : op.operands) {
    if (o.tensor < 0 || static_cast<size_t>(o.tensor) >= program.tensors.size())
      return Status::invalid_argument("operand tensor " + std::to_string(o.tensor) + " out of range");
    auto it = by_tensor.find(o.tensor);
    if (it == by_tensor.end()) {
      const size_t bytes = program.tensors.info(o.tensor).bytes();
      SPILLWAY_ASSIGN_OR_RETURN(void* p, op.place == Place::Host ? buffers.host(bytes) : buffers.device(bytes));
      it = by_tensor.emplace(o.tensor, p).first;
    }
    ptrs.push_back(it->second);
  }
  const OptimizerStep step{.step = 1, .lr = 1e-4f};
  const DType param_dtype = op.operands.empty() ? DType::F32 : program.tensors.info(op.operands[0].tensor).dtype;
  auto run_once = [&]() -> Status {
    if (op.place == Place::Host) return run_host_op(op, ptrs, param_dtype, step);
    return run_device_op(backend, program, op, ptrs, step);
  };
  SPILLWAY_RETURN_IF_ERROR(run_once());  // warm-up: caches, lazy initialization, algorithm choice
  SPILLWAY_RETURN_IF_ERROR(backend.synchronize());
  const double t0 = now_s();
  for (int r = 0; r < repeats; ++r) SPILLWAY_RETURN_IF_ERROR(run_once());
  SPILLWAY_RETURN_IF_ERROR(backend.synchronize());
  return (now_s() - t0) / repeats;
}

}  // namespace

Result<std::vector<double>> profile_ops(Backend& backend, const Program& program, int repeats) {
  repeats = std::max(1, repeats);
  OwnWorkspace workspace(backend);
  SPILLWAY_ASSIGN_OR_RETURN(WorkspaceNeed need, program_workspace(backend, program));
  SPILLWAY_RETURN_IF_ERROR(workspace.use(need.bytes));
  std::vector<double> seconds(program.ops.size(), 0.0);
  std::map<std::string, double> measured;
  for (size_t i = 0; i < program.ops.size(); ++i) {
    const Op& op = program.ops[i];
    if (!has_standalone_form(op)) continue;
    const std::string key = shape_key(program, op);
    auto it = measured.find(key);
    if (it == measured.end()) {
      auto s = time_op(backend, program, op, repeats);
      if (!s) return s.status().with_context("profile op " + op.name);
      it = measured.emplace(key, *s).first;
    }
    seconds[i] = it->second;
  }
  return seconds;
}


}  // namespace spillway
