#include "sim/profiler.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <string>
#include <utility>

#include "core/size.h"
#include "exec/dispatch.h"
#include "optim/adamw.h"

namespace spillway {

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Device and host buffers of one measurement, freed (after the backend finished
// with them) when it goes out of scope.
class Buffers {
 public:
  explicit Buffers(Backend& backend) : backend_(backend) {}
  Buffers(const Buffers&) = delete;
  Buffers& operator=(const Buffers&) = delete;
  ~Buffers() {
    if (!buffers_.empty()) (void)backend_.synchronize();  // errors were reported by the timed section
    for (auto [p, on_device] : buffers_) {
      if (on_device) backend_.device_free(p);
      else backend_.host_free(p);
    }
  }
  // Zero-filled.
  Result<void*> device(size_t bytes) {
    bytes = std::max<size_t>(bytes, backend_.alignment());
    auto p = backend_.device_alloc(bytes);
    if (!p) return p.status().with_context("device buffer of " + format_size(bytes));
    buffers_.emplace_back(*p, true);
    backend_.fill_zero(*p, bytes);
    return *p;
  }
  Result<void*> host(size_t bytes) {
    bytes = std::max<size_t>(bytes, 64);
    auto p = backend_.host_alloc(bytes);
    if (!p) return p.status().with_context("host buffer of " + format_size(bytes));
    buffers_.emplace_back(*p, false);
    std::memset(*p, 0, bytes);
    return *p;
  }

 private:
  Backend& backend_;
  std::vector<std::pair<void*, bool>> buffers_;
};

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
  Buffers buffers(backend);
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

namespace {
// The backend's own workspace while ops run outside an executor; freed after.
class OwnWorkspace {
 public:
  explicit OwnWorkspace(Backend& b) : b_(b) {}
  ~OwnWorkspace() { (void)b_.use_own_workspace(0); }
  Status use(uint64_t bytes) { return b_.use_own_workspace(bytes); }

 private:
  Backend& b_;
};
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

Result<Machine> measure_machine(Backend& backend, Machine m) {
  const bool gpu = backend.name() == "cuda";
  const size_t act = dtype_size(backend.activation_dtype());
  constexpr int kRepeats = 3;

  // ---- copy engine: each direction alone, then both at once ----
  {
    constexpr size_t kCopyBytes = size_t{64} << 20;
    Buffers buffers(backend);
    SPILLWAY_ASSIGN_OR_RETURN(void* host_up, buffers.host(kCopyBytes));
    SPILLWAY_ASSIGN_OR_RETURN(void* host_down, buffers.host(kCopyBytes));
    SPILLWAY_ASSIGN_OR_RETURN(void* dev_up, buffers.device(kCopyBytes));
    SPILLWAY_ASSIGN_OR_RETURN(void* dev_down, buffers.device(kCopyBytes));
    SPILLWAY_RETURN_IF_ERROR(backend.synchronize());
    CopyEngine& ce = backend.copy_engine();
    auto time_copies = [&](bool up, bool down, int repeats) -> Result<double> {
      const double t0 = now_s();
      for (int r = 0; r < repeats; ++r) {
        if (up) {
          auto t = ce.copy(CopyDirection::HostToDevice, dev_up, host_up, kCopyBytes);
          if (!t) return t.status();
        }
        if (down) {
          auto t = ce.copy(CopyDirection::DeviceToHost, host_down, dev_down, kCopyBytes);
          if (!t) return t.status();
        }
      }
      SPILLWAY_RETURN_IF_ERROR(ce.wait_all());
      return now_s() - t0;
    };
    SPILLWAY_ASSIGN_OR_RETURN(double warm, time_copies(true, true, 1));
    (void)warm;
    SPILLWAY_ASSIGN_OR_RETURN(double up_s, time_copies(true, false, kRepeats));
    SPILLWAY_ASSIGN_OR_RETURN(double down_s, time_copies(false, true, kRepeats));
    SPILLWAY_ASSIGN_OR_RETURN(double both_s, time_copies(true, true, kRepeats));
    const double moved = static_cast<double>(kCopyBytes) * kRepeats;
    if (up_s > 0 && down_s > 0 && both_s > 0) {
      m.h2d_bytes_per_s = moved / up_s;
      m.d2h_bytes_per_s = moved / down_s;
      const double both_rate = moved / both_s;  // each direction's rate while both ran
      const double share = 0.5 * (both_rate / m.h2d_bytes_per_s + both_rate / m.d2h_bytes_per_s);
      m.duplex_factor = std::clamp(share, 0.05, 1.0);
    }
  }

  // ---- device matrix products and memory-bound ops ----
  {
    const int S = gpu ? 8192 : 512;
    const size_t mat = static_cast<size_t>(S) * S * act;
    Buffers buffers(backend);
    SPILLWAY_ASSIGN_OR_RETURN(void* out, buffers.device(mat));
    SPILLWAY_ASSIGN_OR_RETURN(void* inp, buffers.device(mat));
    SPILLWAY_ASSIGN_OR_RETURN(void* w, buffers.device(mat));
    OwnWorkspace workspace(backend);
    SPILLWAY_RETURN_IF_ERROR(workspace.use(backend.matmul_workspace(S, S, false, false)));
    backend.matmul_forward(out, inp, w, nullptr, S, S, S);
    SPILLWAY_RETURN_IF_ERROR(backend.synchronize());
    double t0 = now_s();
    for (int r = 0; r < kRepeats; ++r) backend.matmul_forward(out, inp, w, nullptr, S, S, S);
    SPILLWAY_RETURN_IF_ERROR(backend.synchronize());
    double s = now_s() - t0;
    if (s > 0) m.matmul_flops_per_s = 2.0 * S * S * S * kRepeats / s;

    // The same products while host⇄device copies run: on the CPU backend the copy
    // threads share the cores and the memory bus with compute.
    if (s > 0) {
      constexpr size_t kCopyBytes = size_t{64} << 20;
      SPILLWAY_ASSIGN_OR_RETURN(void* host_buf, buffers.host(kCopyBytes));
      SPILLWAY_ASSIGN_OR_RETURN(void* dev_buf, buffers.device(kCopyBytes));
      CopyEngine& ce = backend.copy_engine();
      const int copies = 2 + static_cast<int>(s * m.h2d_bytes_per_s / kCopyBytes);
      for (int c = 0; c < copies; ++c) {
        auto t = ce.copy(CopyDirection::HostToDevice, dev_buf, host_buf, kCopyBytes);
        if (!t) return t.status();
      }
      t0 = now_s();
      for (int r = 0; r < kRepeats; ++r) backend.matmul_forward(out, inp, w, nullptr, S, S, S);
      SPILLWAY_RETURN_IF_ERROR(backend.synchronize());
      const double with_copies = now_s() - t0;
      SPILLWAY_RETURN_IF_ERROR(ce.wait_all());
      if (with_copies > 0) m.compute_share_while_copying = std::clamp(s / with_copies, 0.05, 1.0);
    }

    // Memory-bound rate: out = a + b touches three arrays.
    const size_t n = gpu ? (size_t{128} << 20) : (size_t{4} << 20);
    SPILLWAY_ASSIGN_OR_RETURN(void* a, buffers.device(n * act));
    SPILLWAY_ASSIGN_OR_RETURN(void* b, buffers.device(n * act));
    SPILLWAY_ASSIGN_OR_RETURN(void* c, buffers.device(n * act));
    backend.residual_forward(c, a, b, n);
    SPILLWAY_RETURN_IF_ERROR(backend.synchronize());
    t0 = now_s();
    for (int r = 0; r < kRepeats; ++r) backend.residual_forward(c, a, b, n);
    SPILLWAY_RETURN_IF_ERROR(backend.synchronize());
    s = now_s() - t0;
    if (s > 0) m.device_bytes_per_s = 3.0 * static_cast<double>(n * act) * kRepeats / s;

    // Fixed cost per op: many tiny ops back to back.
    constexpr int kTiny = 200;
    t0 = now_s();
    for (int r = 0; r < kTiny; ++r) backend.residual_forward(c, a, b, 64);
    SPILLWAY_RETURN_IF_ERROR(backend.synchronize());
    s = now_s() - t0;
    if (s > 0) m.op_launch_s = s / kTiny;
  }

  // ---- host AdamW ----
  {
    const size_t n = gpu ? (size_t{32} << 20) : (size_t{4} << 20);
    const DType param_dtype = backend.activation_dtype();
    Buffers buffers(backend);
    SPILLWAY_ASSIGN_OR_RETURN(void* param, buffers.host(n * act));
    SPILLWAY_ASSIGN_OR_RETURN(void* master, buffers.host(n * 4));
    SPILLWAY_ASSIGN_OR_RETURN(void* mom, buffers.host(n * 4));
    SPILLWAY_ASSIGN_OR_RETURN(void* var, buffers.host(n * 4));
    SPILLWAY_ASSIGN_OR_RETURN(void* grad, buffers.host(n * act));
    const float scale_norm[2] = {1.0f, 0.0f};
    const AdamWHyper h = adamw_hyper(1e-4f, 1, 0.1f);
    auto run = [&] {
      adamw_host(param_dtype, param, static_cast<float*>(master), static_cast<float*>(mom), static_cast<float*>(var),
                 grad, scale_norm, n, h);
    };
    run();
    const double t0 = now_s();
    for (int r = 0; r < kRepeats; ++r) run();
    const double s = now_s() - t0;
    if (s > 0) m.host_adam_params_per_s = static_cast<double>(n) * kRepeats / s;
  }

  const size_t capacity = backend.device_capacity();
  if (capacity != SIZE_MAX) m.device_bytes = capacity;
  m.host_runs_ahead = gpu;
  m.name = backend.description();
  m.measured_op_seconds.clear();
  return m;
}

}  // namespace spillway
