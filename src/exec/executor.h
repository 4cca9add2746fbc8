// Executor: carries out a Plan on a Backend with the copy and storage engines.
//
//   auto ex = Executor::create(backend, program, plan, {.spill_dir = "/nvme/spill"});
//   if (!ex) die(ex.status());
//   (*ex)->write_tensor(tokens_id, tokens.data(), bytes);    // lands in the tensor's home
//   SPILLWAY_RETURN_IF_ERROR((*ex)->run_step({.step = 1, .lr = 6e-4f}));
//   (*ex)->read_tensor(losses_id, losses.data(), bytes);
//   const StepMetrics& m = (*ex)->metrics();                   // bytes per link, stalls, peaks
//
// It walks the plan's instructions, issues copies, storage I/O and host ops (the host
// AdamW, on its own thread: exec/host_queue.h) asynchronously, waits only where an op
// needs data that has not arrived, runs the op, and checks
// the invariants of DESIGN.md as it goes: the device memory is one allocation, made
// at creation, of the plan's arena followed by its workspace (Plan::workspace_bytes,
// handed to the backend before every step; nothing is allocated during a step), and
// no placement leaves it; host and storage stay within their
// budgets; every operand is valid where its op runs. A broken invariant is an
// Internal error naming the op and tensor — never silent wrong numbers.
//
// The step is a loop (DESIGN.md): run_step returns when the step's device work and
// copies are done, while host ops at its end (the optimizer's tail) may still run,
// and the fetches that wait for them go out as they finish. The next run_step's
// forward overlaps them; an op that needs an updated tensor waits for its update
// only. read_tensor and write_tensor settle the tensor they touch first; drain()
// settles everything (before evaluation, saving, the end of a run) and reports an
// error of the work that was still in flight.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "core/status.h"
#include "io/storage_engine.h"
#include "plan/plan.h"
#include "program/program.h"

namespace spillway {

class Trace;

// Device memory the executor is given rather than allocating it (base aligned to the
// backend's alignment).
struct DeviceRegion {
  void* base = nullptr;
  uint64_t bytes = 0;
};

// Pinned host memory the executor is given rather than allocating it (from
// Backend::host_alloc, 4096-aligned).
struct HostRegion {
  void* base = nullptr;
  uint64_t bytes = 0;
};

struct ExecutorOptions {
  // When base is set: the arena and workspace live here (another executor's idle
  // region, see Executor::idle_device_region) and the executor allocates no device
  // memory. It must hold the plan's arena rounded up to the alignment plus its workspace.
  DeviceRegion external_device = {};
  // When base is set: the host arena lives here (zeroed by the executor, as its own
  // would be) and the executor pins none, frees none. It must hold the plan's host
  // arena rounded up to 4096 bytes. Executors made one after another for plans of
  // one program (auto's timed candidates, then the run's) share one pinning so.
  HostRegion external_host = {};
  // When base is set: the speculative updates' second buffers (Plan::speculation_bytes)
  // live here, plain host memory 4096-aligned, zeroed by the executor as its own would
  // be, and the executor allocates none, frees none. It must hold speculation_bytes
  // rounded up to 4096. Auto's timed candidates and the run share one so, beside their
  // shared external_host: each executor of its own would fault tens of GiB in again.
  HostRegion external_speculation = {};
  uint64_t host_budget = UINT64_MAX;
  std::string spill_dir;             // required when the plan homes or moves anything to storage
  uint64_t storage_budget = 0;       // 0 = plan.storage_bytes rounded up
  std::string storage_engine = "auto";  // "uring", "threads", "auto"
  // Makes the storage engine of kind storage_engine (empty: make_storage_engine).
  // Tests pass one that wraps it in a FaultStorageEngine (io/fault_storage_engine.h).
  StorageEngineMaker storage_engine_maker = {};
};

struct StepContext {
  int64_t step = 1;   // 1-based, for AdamW's bias correction
  float lr = 0;
};

// Counters of one step (reset by run_step).
struct StepMetrics {
  uint64_t h2d_bytes = 0, d2h_bytes = 0;
  uint64_t storage_read_bytes = 0, storage_write_bytes = 0;
  int recomputed_ops = 0;
  // Host AdamW ops started speculatively this step, before the clip scale was known
  // (Plan::speculation; none after a step whose clipping was active).
  int speculated_ops = 0;
  // Time the device's compute sat idle waiting for data: for a copy, a host op (the
  // host AdamW writing what a fetch reads) or storage. Timed on the device by the
  // backend's stall probes (CUDA: events on the compute stream); on CPU, where compute
  // runs on the executor's thread, its waits.
  double stall_s = 0;
  double host_wait_s = 0;  // wall time the executor's thread was blocked in those waits
  double step_s = 0;
  double issue_s = 0;   // host time to issue every instruction; the rest of step_s waits for the device
  // peak_device_bytes: the arena's peak plus the workspace (all the device memory the
  // step used besides the backend's context).
  uint64_t peak_device_bytes = 0, peak_host_bytes = 0, peak_storage_bytes = 0;
};

// One op of a profiled step: the backend is synchronized before and after it, so
// `seconds` is that op alone (its device work included), not overlapped with others.
struct OpTime {
  int op = 0;  // index into Program::ops
  bool recompute = false;
  double seconds = 0;
};
struct StepProfile {
  std::vector<OpTime> ops;  // in run order
};

// Speculative updates so far: committed (the clip scale was 1: the speculation was
// the update) and redone (it was not: the Run updated from the kept state).
struct SpeculationTally {
  uint64_t committed = 0, redone = 0;
  // Of the redone: speculations that had not started when the step's clip scale,
  // not 1, reached host, and so were dropped instead of computed and thrown away.
  uint64_t dropped = 0;
};

class Executor {
 public:
  static Result<std::unique_ptr<Executor>> create(Backend& backend, const Program& program, const Plan& plan,
                                                  const ExecutorOptions& options = {});
  virtual ~Executor() = default;
  // Sets a tensor's value (bytes(t) bytes, in its dtype) in its home tier.
  virtual Status write_tensor(TensorId t, const void* src, size_t bytes) = 0;
  // Reads a tensor's newest value from wherever it is valid.
  virtual Status read_tensor(TensorId t, void* dst, size_t bytes) = 0;
  // The host copy of a tensor's newest value (bytes(t) bytes, in its dtype), or
  // nullptr when its newest value is not on host (read_tensor reads it then). Valid
  // until the next run_step or write_tensor. Checkpoints copy these in parallel.
  virtual Result<const void*> host_value(TensorId t) = 0;
  // The device copy of a tensor's newest value when it is valid on device and not
  // on host, else nullptr. Valid until the next run_step or write_tensor.
  virtual Result<const void*> device_value(TensorId t) = 0;
  // Queues `job` on the host engine, after the host work queued before it, as a
  // reader of the host copies of `tensors`: later writers of those copies (the next
  // step's host optimizer, a write-back) and reuse of their memory wait for it.
  virtual Status submit_host_reader(const std::vector<TensorId>& tensors, std::function<Status()> job) = 0;
  // A copy out of t's device region (device→host ticket `reader`, submitted after the
  // step's compute) is in flight: ops and write_tensor that write t wait for it first.
  // Between steps, for a tensor whose device_value() is non-null. Checkpoints copy
  // device-resident state this way while the next step runs.
  virtual Status hold_device_reader(TensorId t, CopyTicket reader) = 0;
  virtual Status run_step(const StepContext& ctx) = 0;
  // Waits for the work the last step left in flight (host ops, deferred fetches);
  // its error, if it failed (the state is then half updated, and no step runs again).
  virtual Status drain() = 0;
  virtual const StepMetrics& metrics() const = 0;
  // Counted as the host ops decide, so a step's own may still be missing until drain().
  virtual SpeculationTally speculation_tally() const = 0;
  // The part of this executor's device memory that no tensor occupies between steps:
  // the arena past the device homes of the persistent tensors (the planner places
  // those first, from offset 0), and the workspace after it (used only inside a step). Another executor may run in it between this one's
  // steps (evaluation does), through ExecutorOptions::external_device.
  virtual DeviceRegion idle_device_region() const = 0;
  // Device bytes this executor holds: arena (aligned) plus workspace.
  virtual uint64_t device_bytes() const = 0;
  // Records the next run_step into `trace` (compute, copy and I/O tracks; memory counters).
  virtual void trace_next_step(Trace* trace) = 0;
  // Times every op of the next run_step into `profile` (slower: one synchronization per op).
  virtual void profile_next_step(StepProfile* profile) = 0;
};

}  // namespace spillway
