// ResidencyMachine: the one definition of what each plan instruction does to where a
// tensor's valid copies are (plan.h states the semantics in words). Plan::validate,
// the planner's scheduler, the simulator and the executor all step this machine, so
// the step's loop — every persistent tensor back home at its end — is defined once.
//
//   ResidencyMachine m(program, plan, {.device = arena, .host = host_arena, .storage = budget});
//   SPILLWAY_RETURN_IF_ERROR(m.start());                  // persistent tensors at home
//   for (size_t i = 0; i < plan.instructions.size(); ++i)
//     SPILLWAY_RETURN_IF_ERROR(m.apply(i, plan.instructions[i]));  // checks, then steps
//   SPILLWAY_RETURN_IF_ERROR(m.finish());                 // each op ran once, all home again
//   m.begin_step();                                       // the next step, same plan
//   m.valid(w, Tier::Host);                               // queries between instructions
//
// State per tensor: whether its device, host and storage copies hold the newest value
// (a value version, bumped by every op that writes it), whether it holds a device
// region, a host buffer and a storage extent, and where. With placement tracking on
// (the default), regions and buffers are kept in arena models rounded exactly as the
// executor's arenas round them (RangeAllocator::footprint), so overlaps and budget
// overruns are found; the executor, whose real arenas already check placement, turns
// it off and keeps only the residency and versions (cheap per instruction).
//
// Every error is Status::internal naming the instruction index, its kind, the op or
// tensor and, for recomputes, the value versions involved: a plan bug, never a user
// error.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/status.h"
#include "plan/plan.h"
#include "program/program.h"

namespace spillway {

class ResidencyMachine {
 public:
  struct Capacities {
    uint64_t device = UINT64_MAX;   // device arena bytes
    uint64_t host = UINT64_MAX;     // host arena bytes
    uint64_t storage = UINT64_MAX;  // storage extent bytes (4096-aligned extents)
    bool track_placement = true;    // model the arenas (offsets, overlaps, peaks)
  };

  // `tables` supplies home, home_offset, home_host_offset, host_mirror, op_place and
  // alignment (its instructions are not read). Both references must outlive the machine.
  ResidencyMachine(const Program& program, const Plan& tables, Capacities capacities);

  // Persistent tensors valid at home (device region at home_offset, host buffer at
  // home_host_offset, or a storage extent), host mirrors in their buffers; then
  // begin_step().
  Status start();
  // Per-step counters (runs of each op, value versions) start again; residency stays.
  void begin_step();
  // Checks that `in` (instruction `at` of the step) may run now, then applies it.
  Status apply(size_t at, const Instruction& in);
  // The end of a step: every op ran once; every persistent tensor is valid in its home
  // (at its home offset), nothing else holds a device region or host buffer (host
  // mirrors keep theirs).
  Status finish() const;

  // Between steps: persistent t was given a new value in its home tier.
  Status write_at_home(TensorId t);

  bool valid(TensorId t, Tier tier) const { return state_[static_cast<size_t>(t)].valid[static_cast<int>(tier)]; }
  bool has_region(TensorId t) const { return state_[static_cast<size_t>(t)].region; }
  bool has_host_buffer(TensorId t) const { return state_[static_cast<size_t>(t)].host_buffer; }
  bool has_extent(TensorId t) const { return state_[static_cast<size_t>(t)].extent; }
  uint64_t region_offset(TensorId t) const { return state_[static_cast<size_t>(t)].offset; }
  uint64_t host_offset(TensorId t) const { return state_[static_cast<size_t>(t)].host_offset; }
  // Highest bytes in use so far (placement tracking only), and extents reserved.
  uint64_t device_peak() const { return device_.peak(); }
  uint64_t host_peak() const { return host_.peak(); }
  uint64_t storage_used() const { return storage_used_; }

 private:
  struct TensorState {
    bool valid[kTierCount] = {false, false, false};  // that tier's copy holds the newest value
    bool region = false;                             // holds a device region
    bool host_buffer = false;
    bool extent = false;                             // a storage extent (kept for the run)
    uint64_t offset = 0, host_offset = 0;
  };
  // Blocks of one arena (offset -> end, tensor), rounded as the executor rounds them.
  class Arena {
   public:
    Arena(const char* what, uint64_t capacity, uint64_t alignment, bool track)
        : what_(what), capacity_(capacity), alignment_(alignment), track_(track) {}
    Status place(TensorId t, uint64_t offset, uint64_t bytes, const std::string& where, const ResidencyMachine& m);
    void release(uint64_t offset);
    uint64_t peak() const { return peak_; }

   private:
    const char* what_;
    uint64_t capacity_, alignment_;
    bool track_;
    std::map<uint64_t, std::pair<uint64_t, TensorId>> blocks_;
    uint64_t used_ = 0, peak_ = 0;
  };

  const std::string& name(TensorId t) const { return program_.tensors.info(t).name; }
  uint64_t bytes(TensorId t) const { return program_.tensors.info(t).bytes(); }
  bool mirror(TensorId t) const;
  Place place_of(int op) const;
  Status place_region(TensorId t, uint64_t offset, const std::string& where);
  void drop_region(TensorId t);
  Status place_host(TensorId t, uint64_t offset, const std::string& where);
  void drop_host(TensorId t);
  Status add_extent(TensorId t, const std::string& where);
  Status run(const Instruction& in, const std::string& where);
  bool reads(int op, const Operand& o) const;

  const Program& program_;
  const Plan& tables_;
  Capacities cap_;
  std::vector<TensorState> state_;  // [tensors]
  Arena device_, host_;
  uint64_t storage_used_ = 0;
  // Versions: [tensors] newest version and the op that wrote it; [ops] the versions of
  // each operand before (read) and after (written) its run this step.
  std::vector<uint64_t> version_;
  std::vector<int> written_by_;
  std::vector<std::vector<uint64_t>> read_version_, wrote_version_;
  std::vector<int> runs_;  // [ops] runs this step (recomputes not counted)
  std::vector<bool> skippable_;  // [ops] carried updates (Plan::carried): a step may skip their Run
};

}  // namespace spillway
