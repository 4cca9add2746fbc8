// Plan: what the executor does, in order, during one training step — the ops of the
// Program interleaved with the memory actions that move their tensors between tiers.
//
//   Budgets budgets{.device = 512 << 20, .host = 8ull << 30};
//   auto plan = make_plan(program, Simulator(machine), budgets, {.policy = Policy::Planned});  // planner.h
//   if (!plan) die(plan.status());            // e.g. "device budget 8 MiB is below the minimum 19.2 MiB ..."
//   for (const Instruction& in : plan->instructions) ...
//
// Every policy (resident, paging, planned, auto) produces this one format, and one
// executor carries it out. The same instruction list runs every step: at the end
// of the step every persistent tensor (Param, Grad, Master, OptState, Input) is back
// in its home tier (and at its home offset when that is the device), so the next
// step starts from the same state.
//
// Semantics of each instruction (the executor and the simulator both follow these):
// - Run(op): wait until every operand that was fetched is on device (or, for a Host
//   op, on host), then run the op. Read/Update operands must be valid there; Write
//   operands need only their region. If `recompute` is set, this Run re-executes a
//   forward op to regenerate activations that were released (Capuchin).
// - Allocate(t, offset): t gets device region [offset, offset + bytes(t)); an op
//   will write it (no data moves: DRAGON's write-only hint). Before the region is
//   used, any device→host copy still reading an earlier occupant must complete.
// - Fetch(t, offset): like Allocate, then start the host→device copy of t (t must be
//   valid on host, or have a Load issued earlier).
// - Evict(t): if `write_back`, start the device→host copy of t into its host buffer
//   (allocated on first use); the device region becomes free once that copy is done.
//   Without write_back the region is free at once (t is clean on host already).
// - Flush(t): start the device→host copy of t; the device copy stays valid and keeps
//   its region (for a host op reading a device-homed tensor, or early cleaning).
// - Release(t): free t's device region with no copy (t is dead, or valid elsewhere).
// - HostAllocate(t, offset): t gets host buffer [offset, offset + bytes(t) rounded up
//   to 4096) in the executor's host arena. Before the range is used, any storage write
//   still reading an earlier occupant must complete. Evict, Flush, Load and host ops
//   that write t use this buffer; HostRelease and a freeing Store end it.
// - Load(t): start the storage→host read of t into its host buffer.
// - Store(t): start the host→storage write of t; if `free_host`, its host buffer is
//   freed once the write is done.
// - HostRelease(t): free t's host buffer with no copy (dead, or clean in storage).
//
// Speculative updates (Plan::speculation; DESIGN.md, "Exact optimizer overlap"): a
// host AdamW listed there may also start right after instruction `after`, where its
// gradient's final value has reached host, before the clip scale is known: it
// updates as if the scale were 1, writing param in place and master, m and v into a
// second host buffer each (the speculation buffers, Plan::speculation_bytes). When
// its Run comes and the scale is exactly 1 (clipping inactive, the norm finite), the
// Run commits: the second buffers become master, m and v, and param already holds
// the update — the bits of an update at that Run. Otherwise the Run updates from the
// untouched first buffers as usual (it rewrites param). find_speculations states
// when an op qualifies: nothing between `after` and its Run may read or write the
// host copies it touches, and master, m and v live on host and no other instruction
// names them — so the residency machine sees the same step either way.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "core/size.h"
#include "core/status.h"
#include "program/program.h"
#include "tensor/tensor.h"

namespace spillway {

enum class InstrKind : uint8_t { Run, Allocate, Fetch, Evict, Flush, Release, HostAllocate, Load, Store, HostRelease };
const char* instr_kind_name(InstrKind k);

struct Instruction {
  InstrKind kind = InstrKind::Run;
  int32_t op = -1;              // Run: index into Program::ops
  TensorId tensor = kNoTensor;  // every kind but Run
  uint64_t offset = 0;          // Allocate, Fetch: device offset (aligned); HostAllocate: host offset
  bool write_back = true;       // Evict (Flush always copies)
  bool free_host = false;       // Store
  bool recompute = false;       // Run
};

// A host AdamW that may start before the clip scale is known (see above).
struct Speculation {
  int32_t op = -1;     // the AdamW (index into Program::ops), placed on host
  int32_t after = -1;  // the instruction after which its gradient's final value is on host
};

enum class Policy : uint8_t { Resident, Paging, Planned, Auto };
const char* policy_name(Policy p);
Result<Policy> parse_policy(const std::string& name);

struct Budgets {
  uint64_t device = UINT64_MAX;   // bytes of the device arena
  uint64_t host = UINT64_MAX;     // bytes of host memory for tensors
  uint64_t storage = 0;           // bytes of spill files; 0 = no storage tier
};

struct Plan {
  Policy policy = Policy::Resident;
  std::string description;                  // human summary of the choices made
  double predicted_step_s = 0;              // auto: the cost model's step time for this plan (0: not simulated)
  std::vector<Instruction> instructions;    // one step, in issue order
  std::vector<Tier> home;                   // [tensors] where each persistent tensor rests between steps
  std::vector<uint64_t> home_offset;        // [tensors] device offset, for tensors homed on device
  std::vector<uint64_t> home_host_offset;   // [tensors] host arena offset, for tensors homed on host
                                            // and for host mirrors
  // [tensors] host mirrors: tensors a host op touches that do not rest on host (a
  // device-homed parameter the host AdamW writes, the clip scale it reads). Each keeps
  // its host buffer at home_host_offset for the whole run, valid or not, so that the
  // host ops of one step may still use it while the next step begins (empty: none).
  std::vector<bool> host_mirror;
  std::vector<Place> op_place;              // [ops] where each op runs under this plan (the
                                            // optimizer runs where its state lives)
  uint64_t device_bytes = 0;                // arena bytes the plan uses (≤ budget − workspace_bytes)
  uint64_t workspace_bytes = 0;             // device workspace reserved beside the arena
                                            // (PlannerOptions::workspace_bytes, aligned)
  uint64_t host_bytes = 0;                  // host arena bytes the plan uses (≤ budget)
  // The executor's host arena for this plan, one allocation: host_bytes rounded up to
  // 4096 (storage I/O uses O_DIRECT), at least 4096.
  uint64_t host_arena_bytes() const { return std::max<uint64_t>(align_up(host_bytes, 4096), 4096); }
  uint64_t storage_bytes = 0;               // peak storage bytes (≤ budget)
  // Host AdamW ops that start speculatively (see above), ordered by `after`, and the
  // host bytes of their second buffers (speculation_bytes(); the executor allocates
  // them beside the host arena: host_bytes + speculation_bytes ≤ the host budget).
  std::vector<Speculation> speculation;
  uint64_t speculation_bytes = 0;
  // Carried updates (DESIGN.md, "The step is a loop"): AdamW ops whose Run sits in
  // the forward, before the first op that reads their parameter, and that update
  // with what the previous step left: its gradient, its clip scale, and its learning
  // rate and step count. The executor skips their Runs in a step that no step
  // precedes (the first, and the first after drain), and drain() runs the ones still
  // owed: the loop's prologue and epilogue. [k] op indices, in instruction order.
  std::vector<int32_t> carried;
  size_t alignment = 64;                    // device offsets are multiples of this
  // Checks the plan against the program: every op runs once per step (plus
  // recomputes), operands resident where the op runs, each recompute reproduces the
  // value version it replaces (the op wrote the current version of everything it
  // writes, and what it reads is at the versions it read then), no two live device
  // regions or host buffers share a byte (sizes rounded as the executor's arenas
  // round them), arenas and storage extents within the budgets, persistent tensors
  // end where they started. Errors name the instruction, op, tensor and versions.
  Status validate(const Program& program, const Budgets& budgets) const;
};

// Every host AdamW of `plan` that may run speculatively, with the earliest `after`
// each allows, ordered by `after` (ties: op order). An op qualifies when, under the
// plan: it runs on host (Plan::op_place); its master, m and v rest on host and no
// instruction but its own Run names them; the last instruction before its Run that
// writes its gradient's host copy (a host Run writing the gradient, or an Evict
// with write-back or a Flush of it) comes after the gradient's last device write; and
// from there to the Run nothing writes, loads, allocates or frees the gradient's host
// copy, and nothing reads or writes param's host copy (param keeps its host buffer:
// it rests on host or is a host mirror).
std::vector<Speculation> find_speculations(const Program& program, const Plan& plan);
// The speculation buffers of these ops: master, m and v of each, each rounded up to
// 4096 bytes.
uint64_t speculation_bytes(const Program& program, const std::vector<Speculation>& speculation);
// `plan` as a step that does not speculate runs it (a step after one where clipping
// was active): the same instructions, no speculation entries or buffers.
Plan without_speculation(Plan plan);
// The clip scale the program's AdamW ops read (their scale_norm operand: the tensor
// whose value decides whether a speculation commits), or kNoTensor without AdamW.
TensorId clip_scale_tensor(const Program& program);

// `program` with each op placed where `plan` runs it (Plan::op_place): what the
// simulator and reports read.
//   SimResult r = simulate(placed_as_planned(program, plan), plan, machine);
Program placed_as_planned(const Program& program, const Plan& plan);

}  // namespace spillway
