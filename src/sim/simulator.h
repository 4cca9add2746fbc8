// Simulator: replays one step's Plan on a Machine and predicts its timeline.
//
//   SimResult r = simulate(program, plan, Machine::h200());
//   std::printf("%.3f s per step, %.3f s stalled\n", r.step_s, r.stall_s);
//   PlanReport report = summarize(program, plan, r);
//   std::cout << format_report(report);        // the table `spillway plan` prints
//   trace_from_simulation(r).write("step.json");  // core/chrome_trace.h: open in Perfetto
//   auto plan = make_plan(program, Simulator(Machine::h200()), budgets, options);  // the planner's cost model
//
// The model (instruction semantics are plan.h's):
// - Resources: device compute, host compute, the host→device and device→host
//   links, and storage reads and writes (one drive, which they share). Each runs its work
//   one item at a time, in issue order.
// - The host thread issues instructions in order. With Machine::host_runs_ahead
//   (CUDA) a device Run is queued and the host moves on; without it (CPU backend)
//   the host runs the op itself, so the next instruction issues at the Run's end.
//   A host op (Place::Host) goes to the host engine (the executor's HostQueue): the
//   host thread queues it and moves on, and host ops run one at a time in issue
//   order. A Fetch of a tensor that a queued host op writes is deferred, as the
//   executor defers it: its copy joins the h2d queue when the host op ends, and the
//   host thread goes on.
// - A device Run starts when compute is free and the copies that fetched its
//   operands have arrived. A host Run starts when the D2H copy or storage read that
//   brings each operand to host has finished.
// - A copy starts no earlier than the end of every device Run issued before it
//   (copy_engine.h's first ordering rule), so an eviction reads what earlier ops
//   wrote and a fetch issued after Run k overlaps only later Runs.
// - Waits that cross engines block the host thread (the executor waits there):
//   Allocate/Fetch into a region from which a D2H copy (Evict, Flush) is still
//   reading; Fetch or Store of a tensor whose host copy is still arriving (D2H or
//   Load); Load or HostAllocate of a tensor whose Store is still writing; Evict or Flush of a
//   tensor whose fetch is still arriving, or whose host buffer a queued host op
//   still uses.
// - Duplex: while both link directions transfer, each runs at its rate times
//   Machine::duplex_factor; alone, at its full rate. Rates change at the instants
//   a copy starts or ends (a fluid model: no per-copy latency, no packet effects).
// - Host ops share the host's memory bandwidth with the copies: alone they run at
//   Machine::host_adam_params_per_s_alone, while both link directions transfer at
//   host_adam_params_per_s (the profile measures it beside copies both ways), and
//   while one direction transfers, halfway between: that direction takes half the
//   bandwidth (the rate changes at those instants, as for duplex).
// - Host ops and device compute side by side: each at its rate times
//   Machine::host_share_while_computing and compute_share_while_host_computes (on
//   the CPU backend both run on the host's cores).
// - Speculative updates (Plan::speculation): each is a host op queued once the
//   instruction it follows has issued, starting when its gradient's host copy has
//   arrived and param's host buffer is no longer read; its Run then commits, taking
//   no time. The step predicted is one whose clipping is inactive (a clipped step
//   redoes the update at its Run).
// - Storage reads and writes each run one request at a time, in issue order: reads
//   at storage_read_bytes_per_s, writes at storage_write_bytes_per_s, each times
//   Machine::storage_duplex_factor while the other kind also runs (the spill
//   engine keeps both in flight on one drive).
// - Memory: persistent tensors (Param, Grad, Master, OptState, Input) start in
//   their home tier, host mirrors in their buffers. Device bytes rise at
//   Allocate/Fetch issue and fall at Release, at a clean Evict, or at the end of a
//   write-back Evict's copy. Host buffers appear at HostAllocate and go at HostRelease
//   (once copies using the buffer ended) or at the end of a freeing Store. Storage
//   extents appear at a tensor's first Store and stay for the step.
//
// Residency (which copies are valid, which tensors hold regions and buffers) is the
// residency machine's (plan/residency.h), stepped as each instruction issues: the
// same definition Plan::validate, the planner and the executor use. The plan should
// have passed Plan::validate; where the machine refuses an instruction, the replay
// stops there and SimResult::plan_error says why.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/chrome_trace.h"
#include "plan/cost_model.h"
#include "plan/plan.h"
#include "program/program.h"
#include "sim/machine.h"

namespace spillway {

enum class SimResource : uint8_t { Compute, Host, H2D, D2H, StorageRead, StorageWrite };
inline constexpr int kSimResourceCount = 6;
// "compute", "host", "h2d", "d2h", "storage read", "storage write": the trace tracks.
const char* sim_resource_name(SimResource r);

struct SimEvent {
  SimResource resource = SimResource::Compute;
  std::string name;             // op name, tensor name, or "wait <tensor>" for a host wait
  double start_s = 0, end_s = 0;
  int32_t op = -1;              // Run: op index
  TensorId tensor = kNoTensor;  // copies, storage I/O, host waits
  uint64_t bytes = 0;           // copies and storage I/O
  bool recompute = false;       // Run re-executed to regenerate activations
};

struct MemorySample {
  double t_s = 0;
  uint64_t device_bytes = 0, host_bytes = 0, storage_bytes = 0;  // in use from t_s on
};

struct SimResult {
  double step_s = 0;           // from the first issue until every op and copy ended
  // When the step call returns: every instruction issued and the device's compute,
  // copies and storage I/O ended; host ops (and the fetches waiting on them) may run
  // on into the next step, as the executor's finish() lets them.
  double return_s = 0;
  double compute_s = 0;        // device compute busy time
  double host_compute_s = 0;   // host op busy time
  // Device compute idle because data was missing: Runs waiting for their fetches,
  // and Runs issued late because the host thread was blocked on data. The wait
  // before the first device Run is not counted here but in initial_wait_s.
  double stall_s = 0;
  double initial_wait_s = 0;
  double host_stall_s = 0;     // host thread blocked on data (cross-engine waits, host ops' operands)
  uint64_t h2d_bytes = 0, d2h_bytes = 0;
  uint64_t storage_read_bytes = 0, storage_write_bytes = 0;
  // Peaks count every change in issue order, also bytes allocated and freed within
  // one instant (which the samples below, taken at the end of each instant, omit).
  uint64_t peak_device_bytes = 0, peak_host_bytes = 0, peak_storage_bytes = 0;
  int recomputed_ops = 0;
  int speculated_ops = 0;      // host AdamW ops started speculatively (Plan::speculation)
  // The first instruction the residency machine (plan/residency.h) refused, where the
  // replay stopped; empty for a valid plan.
  std::string plan_error;
  std::vector<SimEvent> timeline;     // sorted by start time
  std::vector<MemorySample> memory;   // one sample per instant the bytes change, from t = 0
};

// What the step's clip scale turns out to be, for a plan with speculative updates
// (Plan::speculation): Committed, exactly 1 (each speculation stands, its Run commits);
// Clipped, not 1 (each Run redoes its update, and a speculation that has not started
// when the scale reaches host is dropped, as the executor does). A step after a
// clipped one does not speculate: simulate without_speculation(plan) for it.
enum class StepOutcome : uint8_t { Committed, Clipped };

SimResult simulate(const Program& program, const Plan& plan, const Machine& machine,
                   StepOutcome outcome = StepOutcome::Committed);

// Steps run back to back, as training runs them: two steps replayed, the second
// issued from the instant the first returns (SimResult::return_s) while the first's
// host ops still run; the time from the first return to the second, or the busiest
// server's time in a step (compute, host, a link, storage) when that is longer:
// steps cannot come faster than it works. What bench train's own steps measure; a
// step alone (step_s) also pays the host ops' tail.
double simulate_loop_step(const Program& program, const Plan& plan, const Machine& machine,
                          StepOutcome outcome = StepOutcome::Committed);

// The planner's cost model (plan/cost_model.h) for one Machine: op and copy times
// from the machine's rates, step times from simulate().
class Simulator final : public CostModel {
 public:
  explicit Simulator(Machine machine) : machine_(std::move(machine)) {}
  const Machine& machine() const { return machine_; }
  SimResult run(const Program& program, const Plan& plan) const { return simulate(program, plan, machine_); }

  double op_seconds(const Program& program, size_t op_index) const override;
  double copy_seconds(uint64_t bytes, bool h2d) const override;
  double duplex_copy_seconds(double bytes) const override;
  double host_adam_seconds(double params) const override;
  double step_seconds(const Program& program, const Plan& plan) const override;

 private:
  Machine machine_;
};

// The predicted step as a Chrome trace: a slice per op, copy, storage request and
// host wait on the tracks of sim_resource_name, and counters "device bytes", "host
// bytes" and "storage bytes".
Trace trace_from_simulation(const SimResult& sim);

// Where one class of tensor goes. A persistent tensor's tier is its home; another
// tensor's is the lowest tier the plan writes it to (device if it never leaves).
struct RoleReport {
  Role role = Role::Param;
  int tensors = 0;
  uint64_t bytes = 0;
  std::array<int, kTierCount> count{};           // tensors per tier
  std::array<uint64_t, kTierCount> tier_bytes{};  // their bytes
  int moved = 0;                 // tensors fetched, written back, flushed, stored or loaded in the step
  uint64_t moved_bytes = 0;
  int recomputed = 0;            // tensors regenerated by a recompute Run
  uint64_t recomputed_bytes = 0;
};

struct PlanReport {
  Policy policy = Policy::Resident;
  std::string description;
  std::vector<RoleReport> roles;   // roles the program has, in Role order
  uint64_t peak_device_bytes = 0, peak_host_bytes = 0, peak_storage_bytes = 0;  // simulated
  uint64_t plan_device_bytes = 0, plan_host_bytes = 0, plan_storage_bytes = 0;  // the plan's figures
  uint64_t h2d_bytes = 0, d2h_bytes = 0, storage_read_bytes = 0, storage_write_bytes = 0;
  double step_s = 0, compute_s = 0, host_compute_s = 0, stall_s = 0, host_stall_s = 0;
  double loop_step_s = 0;  // steps back to back (simulate_loop_step); 0: not given
  int recomputed_ops = 0;
  size_t instructions = 0;
};

PlanReport summarize(const Program& program, const Plan& plan, const SimResult& sim);

// A plain-text table for `spillway plan` (tiers: a tensor count and its bytes):
//   plan: planned, 14028 instructions (state on device 2.90 GiB, optimizer on host, ...)
//   role        tensors       bytes  device         host            storage  moved          recomputed
//   param           580    2.90 GiB  580 2.90 GiB   -               -        580 2.90 GiB   -
//   master          580    5.80 GiB  -              580 5.80 GiB    -        -              -
//   activation     1263   39.27 GiB  775 28.28 GiB  488 10.99 GiB   -        488 10.99 GiB  429 10.12 GiB
//   memory peak: device 23.98 GiB (plan 24.00 GiB), host 40.41 GiB, storage 0 B
//   per step: h2d 31.55 GiB, d2h 31.55 GiB, storage read 0 B, storage write 0 B
//   predicted step 1.559 s: compute 261.575 ms, stalls 977.238 ms, host ops 259.602 ms, host waits 1.299 s
//   (with loop_step_s: "predicted step 1.502 s back to back (a step alone 1.559 s: compute ...")
std::string format_report(const PlanReport& report);

}  // namespace spillway
