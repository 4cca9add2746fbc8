// The planner. One scheduling engine serves every policy: it walks the program's
// ops in order, keeps a model of which tensor is where (device regions from a
// best-fit RangeAllocator, host buffers, storage copies) and emits the memory
// instructions each op needs. Policies differ only in the knobs:
//
//   knob                 resident   paging            planned
//   homes of state       device     host              device / host / storage, by budget
//   eviction victim      (none)     least recently    furthest next use (Belady)
//   fetch                —          at first touch    as early as memory allows
//   dead tensors         freed      written back      freed, never written back
//   write-only hint      yes        no (persistent)   yes
//   recompute            no         no                when cheaper than the swap (chains too)
//   optimizer            device     device            where its state lives
#include "plan/planner.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <future>
#include <thread>
#include <limits>
#include <optional>
#include <queue>
#include <tuple>
#include <set>
#include <sstream>

#include "core/size.h"
#include "memory/range_allocator.h"
#include "plan/residency.h"
#include "program/op_registry.h"

namespace spillway {

namespace {

constexpr int kNever = std::numeric_limits<int>::max();

// Ops that may run on host, where their state rests (the op registry's host ops:
// AdamW). The planner places them by the tier of their home slot (master weights)
// and leaves them out of the minimum device budget.
bool is_host_op(const Op& op) { return op_info(op.kind).host; }

// The tensor in slot `name` of op ("param", "master", "grad"), or kNoTensor when
// the op's kind has no such slot or the op leaves it off.
TensorId slot_tensor(const Op& op, const char* name) {
  const int i = name == nullptr ? -1 : op_slot(op.kind, name);
  return i >= 0 && static_cast<size_t>(i) < op.operands.size() ? op.operands[static_cast<size_t>(i)].tensor
                                                                : kNoTensor;
}
TensorId home_tensor(const Op& op) { return slot_tensor(op, op_info(op.kind).home); }


struct Config {
  Policy policy = Policy::Resident;
  bool belady = true;          // else LRU
  int prefetch = 0;            // 0: at first touch; 1: one op ahead; -1: as early as memory allows
  bool drop_dead = true;       // free dead tensors without write-back
  bool write_only_hint = true; // Write access needs no fetch, even for persistent tensors
  bool recompute = false;
  // Early write-back: right after an activation's last use before a gap of more
  // than this many ops, start its device→host copy (Flush), so that its later
  // eviction is clean and the region it leaves can be reused at once. 0 = off.
  int flush_gap = 0;
  bool layer_major = false;    // the forward runs layer by layer across micro-batches
  // State resting on host whose remaining uses are all host ops leaves the device
  // right after its last device use (a gradient bound for the host AdamW: its host copy is then final
  // during the backward, where a speculative update can start).
  bool evict_host_bound = false;
  bool optimizer_on_host = false;    // some AdamW runs on host
  int device_optimizer_ops = 0, host_optimizer_ops = 0;  // AdamW ops on each side
  int streamed_optimizer_ops = 0;    // AdamW on device with its state streamed from host
  std::vector<bool> streamed;        // [ops] AdamW ops streamed so (make_config)
  // The streamed AdamW ops run in the next step, each just before the first op that
  // reads its parameter (Plan::carried; DESIGN.md, "The step is a loop").
  bool carried = false;
  // Each gradient's Zero just before its first backward (zeros_late), not at the start.
  bool late_zeros = false;
  bool is_streamed(size_t op) const { return op < streamed.size() && streamed[op]; }
  std::vector<Tier> home;            // [tensors]
  std::vector<uint64_t> home_offset; // [tensors]
  uint64_t pinned_end = 0;           // device homes occupy [0, pinned_end)
};

class Scheduler {
 public:
  Scheduler(const Program& program, const CostModel& cost, const Budgets& budgets, const Config& config,
            size_t alignment)
      : p_(program), cost_(cost), budgets_(budgets), c_(config), align_(alignment),
        device_(budgets.device == UINT64_MAX ? (uint64_t{1} << 52) : budgets.device, alignment, false),
        host_(budgets.host == UINT64_MAX ? (uint64_t{1} << 52) : budgets.host / 4096 * 4096, 4096) {
    const size_t n = p_.tensors.size();
    uses_.resize(n);
    writers_.resize(n);
    overwrites_.resize(n);
    for (size_t i = 0; i < p_.ops.size(); ++i) {
      for (const Operand& o : p_.ops[i].operands) {
        auto& u = uses_[o.tensor];
        if (u.empty() || u.back() != static_cast<int>(i)) {
          u.push_back(static_cast<int>(i));
          overwrites_[o.tensor].push_back(true);
        }
        if (o.access != Access::Write) overwrites_[o.tensor].back() = false;
        if (o.access != Access::Read) writers_[o.tensor].push_back(static_cast<int>(i));
      }
    }
    st_.resize(n);
    persistent_.resize(n);
    for (size_t t = 0; t < n; ++t) persistent_[t] = p_.is_persistent(static_cast<TensorId>(t));
  }

  // The step's plan. An instruction the residency machine refused is reported first,
  // even when scheduling then failed for want of room: it is a planner bug.
  Result<Plan> run() {
    Result<Plan> plan = schedule_step();
    if (!residency_status_.is_ok()) return residency_status_.with_context("planner");
    return plan;
  }

 private:
  Result<Plan> schedule_step() {
    const size_t n = p_.tensors.size();
    uint64_t capacity = device_.capacity();
    if (c_.pinned_end > capacity)
      return Status::out_of_memory(std::string(policy_name(c_.policy)) + ": device budget " + format_size(budgets_.device) +
                                  " cannot hold the " + format_size(c_.pinned_end) + " of state this plan keeps on device" +
                                  (c_.policy == Policy::Resident ? "; choose --policy planned or auto to spill" : ""));
    SPILLWAY_RETURN_IF_ERROR(device_.add_free(c_.pinned_end, capacity - c_.pinned_end));
    max_end_ = c_.pinned_end;
    // Start-of-step state.
    for (size_t t = 0; t < n; ++t) {
      auto id = static_cast<TensorId>(t);
      if (!persistent(id)) continue;
      State& s = st_[t];
      if (c_.home[t] == Tier::Device) {
        s.region = true;
        s.offset = c_.home_offset[t];
        s.device_valid = true;
      } else if (c_.home[t] == Tier::Host) {
        auto off = host_.allocate(host_bytes(id));
        if (!off.ok()) {
          std::string hint = budgets_.storage == 0 ? "; give --spill-dir so that state can live in storage" : "";
          host_short_ = true;
        return Status::out_of_memory("host budget " + format_size(budgets_.host) +
                                     " cannot hold the training state this plan keeps on host (" + name(id) +
                                     " does not fit)" + hint);
        }
        s.host_buffer = true;
        s.host_offset = *off;
        s.host_valid = true;
        home_host_offset_[t] = *off;
        host_end_ = std::max(host_end_, *off + host_bytes(id));
      } else {
        s.storage_valid = true;
        storage_extent_[t] = true;
        storage_used_ += storage_bytes(id);
        if (storage_used_ > storage_capacity_) {
          storage_short_ = true;
          return storage_too_small(id);
        }
      }
    }
    // Host mirrors: a tensor that a host op touches but that does not rest on host
    // (a device-homed parameter the host AdamW writes, the clip scale it reads) keeps
    // one host buffer for the whole run. The step is a loop: the host ops at the end
    // of step k still use those buffers while step k+1 begins, so no early buffer of
    // the next step may reuse their bytes.
    for (const Op& op : p_.ops) {
      if (op.place != Place::Host) continue;
      for (const Operand& o : op.operands) {
        const TensorId t = o.tensor;
        if (mirror_[t] || (persistent(t) && c_.home[t] != Tier::Device)) continue;
        auto off = host_.allocate(host_bytes(t));
        if (!off.ok()) {
          host_short_ = true;
          return Status::out_of_memory("host budget " + format_size(budgets_.host) +
                                       " cannot hold the host copies the optimizer writes (" + name(t) + " does not fit)");
        }
        mirror_[t] = true;
        st_[t].host_buffer = true;
        st_[t].host_offset = *off;
        home_host_offset_[t] = *off;
        host_end_ = std::max(host_end_, *off + host_bytes(t));
      }
    }
    // Every instruction emitted from here on steps the residency machine (the one
    // definition of what it does, plan/residency.h), from the homes set above.
    tables_.home = c_.home;
    tables_.home_offset = c_.home_offset;
    tables_.home_host_offset = home_host_offset_;
    tables_.host_mirror = mirror_;
    tables_.alignment = align_;
    residency_.emplace(p_, tables_,
                       ResidencyMachine::Capacities{.device = capacity, .host = host_.capacity(), .storage = storage_capacity_});
    residency_status_ = residency_->start();
    for (size_t i = 0; i < p_.ops.size(); ++i) SPILLWAY_RETURN_IF_ERROR(schedule_op(static_cast<int>(i)));
    SPILLWAY_RETURN_IF_ERROR(finish_step());
    // A scheduler bug, never the user's: the plan it emitted breaks the instruction
    // semantics (the message names the instruction).
    if (residency_status_.is_ok()) SPILLWAY_RETURN_IF_ERROR(residency_->finish().with_context("planner"));
    Plan plan;
    plan.policy = c_.policy;
    plan.instructions = std::move(out_);
    plan.home = c_.home;
    plan.home_offset = c_.home_offset;
    plan.device_bytes = max_end_;
    plan.host_bytes = std::max(host_end_, host_.peak());
    plan.home_host_offset = home_host_offset_;
    plan.host_mirror = mirror_;
    plan.storage_bytes = storage_used_;
    plan.alignment = align_;
    return plan;
  }

 public:
  int recomputes() const { return recomputes_; }
  // Why run() failed: no host room (more state in storage may help), or no storage room.
  bool host_short() const { return host_short_; }
  bool storage_short() const { return storage_short_; }

 private:
  struct State {
    bool region = false;         // holds a device region
    uint64_t offset = 0;
    bool device_valid = false;   // device region holds the newest value
    bool host_buffer = false;
    uint64_t host_offset = 0;    // of the host buffer in the host arena
    bool host_valid = false;
    bool storage_valid = false;
    bool recompute_pending = false;  // released; recompute_op re-runs before the next use
    int recompute_op = -1;           // the op that wrote the value that was released
    int last_touch = -1;
  };

  uint64_t bytes(TensorId t) const { return p_.tensors.info(t).bytes(); }
  // Storage extents are 4096-aligned blocks (StorageStore), one per tensor, kept all run.
  uint64_t storage_bytes(TensorId t) const { return align_up(std::max<uint64_t>(1, bytes(t)), 4096); }
  bool storage_has_room(TensorId t) const {
    return storage_extent_[t] || storage_used_ + storage_bytes(t) <= storage_capacity_;
  }
  Status storage_too_small(TensorId t) const {
    return Status::out_of_memory("storage budget " + format_size(budgets_.storage) + " is too small: " +
                                 format_size(storage_used_ - (storage_extent_[t] ? storage_bytes(t) : 0)) +
                                 " of spill extents in use, " + name(t) + " needs " + format_size(storage_bytes(t)) +
                                 " more");
  }
  // Host buffers are 4096-aligned blocks (O_DIRECT), so a buffer takes this much.
  uint64_t host_bytes(TensorId t) const { return align_up(std::max<uint64_t>(1, bytes(t)), 4096); }
  uint64_t device_bytes(TensorId t) const { return align_up(std::max<uint64_t>(1, bytes(t)), align_); }
  const std::string& name(TensorId t) const { return p_.tensors.info(t).name; }
  // Program::is_persistent, looked up once per tensor (it searches the outputs; the
  // search calls this in its innermost loops).
  bool persistent(TensorId t) const { return persistent_[t] != 0; }
  bool pinned_home(TensorId t) const { return persistent(t) && c_.home[t] == Tier::Device; }

  // The next op after `after` that needs t's current value; kNever when the value
  // is dead: no later use, or (for tensors that live only inside the step) the next
  // use overwrites it entirely, as with per-layer scratch reused by every micro-batch.
  int next_use(TensorId t, int after) const {
    const auto& u = uses_[t];
    auto it = std::upper_bound(u.begin(), u.end(), after);
    if (it == u.end()) return kNever;
    if (!persistent(t) && overwrites_[t][it - u.begin()]) return kNever;
    return *it;
  }

  // Whether an op after `after` runs on device and uses t.
  bool used_on_device_after(TensorId t, int after) const {
    const auto& u = uses_[t];
    for (auto it = std::upper_bound(u.begin(), u.end(), after); it != u.end(); ++it)
      if (p_.ops[static_cast<size_t>(*it)].place == Place::Device) return true;
    return false;
  }

  void emit(InstrKind kind, TensorId t, uint64_t offset = 0, bool write_back = true, bool free_host = false) {
    Instruction in;
    in.kind = kind;
    in.tensor = t;
    in.offset = offset;
    in.write_back = write_back;
    in.free_host = free_host;
    push(in);
  }

  // Appends `in` to the plan and steps the residency machine with it (the first
  // refusal is kept and reported when the step is scheduled).
  void push(const Instruction& in) {
    out_.push_back(in);
    if (residency_ && residency_status_.is_ok()) residency_status_ = residency_->apply(out_.size() - 1, in);
  }

  // ---- host tier ----
  // Frees one host buffer (the one needed furthest ahead), storing it first when it
  // is the only copy of a live value. False when none can go.
  Result<bool> free_one_host_buffer(int now) {
    TensorId best = kNoTensor;
    int best_use = -1;
    for (size_t t = 0; t < st_.size(); ++t) {
      auto id = static_cast<TensorId>(t);
      const State& s = st_[t];
      if (!s.host_buffer || locked_.count(id) || mirror_[t]) continue;
      if (persistent(id) && c_.home[t] == Tier::Host) continue;  // lives there
      bool dead = !persistent(id) && next_use(id, now) == kNever;
      bool only_copy = s.host_valid && !s.storage_valid && !(s.region && s.device_valid);
      if (only_copy && !dead && !storage_has_room(id)) {
        if (budgets_.storage != 0) storage_short_ = true;
        continue;
      }
      int use = dead ? kNever : next_use(id, now);
      if (use > best_use) {
        best_use = use;
        best = id;
      }
    }
    if (best == kNoTensor) return false;
    State& s = st_[best];
    bool dead = !persistent(best) && next_use(best, now) == kNever;
    bool only_copy = s.host_valid && !s.storage_valid && !(s.region && s.device_valid);
    if (only_copy && !dead) {
      store(best);
      emit(InstrKind::Store, best, 0, true, /*free_host=*/true);
    } else {
      emit(InstrKind::HostRelease, best);
    }
    SPILLWAY_RETURN_IF_ERROR(release_host(best));
    return true;
  }

  Status release_host(TensorId t) {
    State& s = st_[t];
    s.host_buffer = false;
    s.host_valid = false;
    return host_.free(s.host_offset);
  }

  void store(TensorId t) {
    if (!storage_extent_[t]) {
      storage_extent_[t] = true;
      storage_used_ += storage_bytes(t);
    }
    st_[t].storage_valid = true;
  }

  // A host buffer for t at a static offset, if one fits now.
  bool try_host_buffer(TensorId t) {
    auto off = host_.allocate(host_bytes(t));
    if (!off.ok()) return false;
    State& s = st_[t];
    s.host_buffer = true;
    s.host_offset = *off;
    host_end_ = std::max(host_end_, *off + host_bytes(t));
    emit(InstrKind::HostAllocate, t, *off);
    return true;
  }

  // A host buffer for t at a static offset, freeing others (furthest need first)
  // until one fits.
  Status ensure_host_buffer(TensorId t, int now) {
    if (st_[t].host_buffer) return Status::ok();
    while (!try_host_buffer(t)) {
      SPILLWAY_ASSIGN_OR_RETURN(bool freed, free_one_host_buffer(now));
      if (!freed) {
        host_short_ = true;
        std::string hint = budgets_.storage == 0
                               ? "; give --spill-dir (and a storage budget) so that state can spill to storage"
                               : "";
        return Status::out_of_memory("host budget " + format_size(budgets_.host) + " is too small: " +
                                     format_size(host_.in_use()) + " in use, largest free block " +
                                     format_size(host_.largest_free_block()) + ", " + name(t) + " needs " +
                                     format_size(host_bytes(t)) + hint);
      }
    }
    return Status::ok();
  }

  // Makes t valid on host (Load from storage when needed).
  Status ensure_host_valid(TensorId t, int now) {
    State& s = st_[t];
    if (s.host_valid) return Status::ok();
    if (s.region && s.device_valid) {
      SPILLWAY_RETURN_IF_ERROR(ensure_host_buffer(t, now));
      emit(InstrKind::Flush, t);
      s.host_valid = true;
      return Status::ok();
    }
    if (!s.storage_valid)
      return Status::internal("planner: " + name(t) + " has no valid copy when op " + std::to_string(now) + " needs it");
    SPILLWAY_RETURN_IF_ERROR(ensure_host_buffer(t, now));
    emit(InstrKind::Load, t);
    s.host_valid = true;
    return Status::ok();
  }

  // ---- device tier ----
  // Frees t's device region, writing it back first when that is the only newest copy.
  Status evict(TensorId t, int now) {
    State& s = st_[t];
    bool dead = !persistent(t) && next_use(t, now) == kNever;
    if (!s.device_valid || (dead && c_.drop_dead)) {
      emit(InstrKind::Release, t);
    } else if (s.host_valid || s.storage_valid) {
      emit(InstrKind::Evict, t, 0, /*write_back=*/false);
    } else if (int prod = c_.recompute ? recompute_source(t, now) : -1; prod >= 0) {
      emit(InstrKind::Release, t);
      s.recompute_pending = true;
      s.recompute_op = prod;
    } else {
      SPILLWAY_RETURN_IF_ERROR(ensure_host_buffer(t, now));
      emit(InstrKind::Evict, t, 0, /*write_back=*/true);
      s.host_valid = true;
    }
    SPILLWAY_RETURN_IF_ERROR(device_.free(s.offset));
    s.region = false;
    s.device_valid = false;
    return Status::ok();
  }

  // The last op at or before `at` that writes t (Write or Update), or -1.
  int last_writer(TensorId t, int at) const {
    const auto& w = writers_[t];
    auto it = std::upper_bound(w.begin(), w.end(), at);
    return it == w.begin() ? -1 : *(it - 1);
  }
  // Whether some op in (after, before) writes t.
  bool written_between(TensorId t, int after, int before) const {
    return last_writer(t, before - 1) > after;
  }

  // Capuchin's choice for one activation being evicted after op `now`: drop it and
  // re-run the op that wrote its current value right before the next use, when that
  // costs less time than writing it out and reading it back. Returns that op, or -1.
  // The re-run must reproduce the value exactly (Plan::validate checks the same
  // rule with value versions): the op wrote all of t (Write, not Update: tiled
  // logits, written by one LM-head tile and added to by the others, then turned into
  // gradients in place, never qualify), it updates nothing in place, nothing writes
  // any of its outputs or inputs between its run and the next use, and its inputs
  // are still held then.
  int recompute_source(TensorId t, int now) const {
    Role r = p_.tensors.info(t).role;
    if (r != Role::Activation) return -1;
    int use = next_use(t, now);
    if (use == kNever) return -1;
    int prod = last_writer(t, now);
    if (prod < 0) return -1;
    const Op& op = p_.ops[prod];
    if (op.phase != Phase::Forward) return -1;
    // A collective re-run on one rank alone would wait for ranks that never call it.
    if (op_is_collective(op.kind)) return -1;
    for (const Operand& o : op.operands) {
      if (o.access == Access::Update) return -1;  // a re-run would apply the update twice
      if (o.tensor == t && o.access != Access::Write) return -1;
      if (written_between(o.tensor, prod, use)) return -1;
      if (o.access == Access::Write) {
        if (persistent(o.tensor)) return -1;
        continue;
      }
      if (persistent(o.tensor)) continue;
      // A transient input must still hold its value at `use`: needed again at or after
      // `use` (so it is kept, on device, on host, or released to be recomputed itself:
      // ensure_on_device then re-runs its producer first, a chain, as checkpointing a
      // layer re-runs the layer's forward). Its own recomputation was checked, when it
      // was released, up to its next use, which is at or after `use`.
      if (next_use(o.tensor, use - 1) == kNever) return -1;
    }
    // The producer re-runs right before the consumer, after the producers of its inputs
    // that are released for recomputation too (a chain): what the chain holds must fit
    // at once, and its re-runs must take less time than writing t out and reading it back.
    const uint64_t room = device_.capacity() - c_.pinned_end;
    const ChainSet chain = recompute_working_set(use, prod, t, prod);
    if (chain.bytes > room || !(chain.seconds < swap_seconds(t))) return -1;
    // Releasing t also lengthens the chains of the values already released whose
    // re-runs read it: each of those must still fit and pay.
    for (TensorId u : released_reading(t)) {
      const ChainSet longer = recompute_working_set(next_use(u, now - 1), st_[u].recompute_op, t, prod);
      if (longer.bytes > room || !(longer.seconds < swap_seconds(u))) return -1;
    }
    return prod;
  }

  // Writing t out and reading it back: what a recompute saves.
  double swap_seconds(TensorId t) const {
    return cost_.copy_seconds(bytes(t), false) + cost_.copy_seconds(bytes(t), true);
  }

  // What a recompute holds on device at once (at most), and the time of its re-runs.
  struct ChainSet {
    uint64_t bytes = 0;
    double seconds = 0;
  };
  // Op `use` needs a value that op `prod` re-makes: use's operands and prod's are held,
  // and where prod reads a value itself released for recomputation, that value's
  // producer re-runs first with its operands held too (ensure_on_device, recompute), and
  // so on down the chain. Bytes: every operand of the chain's ops and of `use`, an upper
  // bound (the re-runs for two inputs of one op hold their operands one after the
  // other); seconds: every re-run of the chain, each once. `extra` counts as released,
  // to be re-made by `extra_prod` (the choice evict is weighing).
  ChainSet recompute_working_set(int use, int prod, TensorId extra, int extra_prod) const {
    std::set<TensorId> held;
    for (const Operand& o : p_.ops[use].operands) held.insert(o.tensor);
    ChainSet chain;
    std::set<int> rerun;
    std::vector<int> todo{prod};
    while (!todo.empty()) {
      const int q = todo.back();
      todo.pop_back();
      if (!rerun.insert(q).second) continue;
      chain.seconds += cost_.op_seconds(p_, static_cast<size_t>(q));
      for (const Operand& o : p_.ops[q].operands) {
        held.insert(o.tensor);
        if (o.access != Access::Read) continue;
        if (o.tensor == extra) {
          todo.push_back(extra_prod);
        } else if (st_[o.tensor].recompute_pending) {
          todo.push_back(st_[o.tensor].recompute_op);
        }
      }
    }
    for (TensorId t : held)
      if (!pinned_home(t)) chain.bytes += device_bytes(t);
    return chain;
  }
  // The values released for recomputation whose re-run reads t, directly or through
  // other released values' re-runs.
  std::vector<TensorId> released_reading(TensorId t) const {
    std::set<TensorId> reached{t};
    std::vector<TensorId> out;
    for (bool grew = true; grew;) {
      grew = false;
      for (size_t i = 0; i < st_.size(); ++i) {
        const auto u = static_cast<TensorId>(i);
        if (!st_[i].recompute_pending || reached.count(u)) continue;
        for (const Operand& o : p_.ops[st_[i].recompute_op].operands) {
          if (o.access != Access::Read || !reached.count(o.tensor)) continue;
          reached.insert(u);
          out.push_back(u);
          grew = true;
          break;
        }
      }
    }
    return out;
  }

  TensorId choose_victim(int now, int need_before) {
    TensorId best = kNoTensor;
    long best_score = std::numeric_limits<long>::min();
    for (size_t t = 0; t < st_.size(); ++t) {
      auto id = static_cast<TensorId>(t);
      const State& s = st_[t];
      if (!s.region || pinned_home(id) || locked_.count(id)) continue;
      long score;
      if (c_.belady) {
        int use = next_use(id, now - 1);
        if (use <= need_before) continue;  // needed no later than what we make room for
        bool dead = !persistent(id) && use == kNever;
        score = dead ? std::numeric_limits<long>::max() : 2L * use + ((s.device_valid && !s.host_valid) ? 0 : 1);
      } else {
        score = -static_cast<long>(s.last_touch);
      }
      if (score > best_score) {
        best_score = score;
        best = id;
      }
    }
    return best;
  }

  // A device region for t; evicts by the policy's rule when full. need_before: only
  // tensors next used after this op index may be evicted (prefetch), or -1.
  Result<uint64_t> allocate(TensorId t, int now, int need_before, bool may_fail) {
    uint64_t size = device_bytes(t);
    for (;;) {
      auto r = device_.allocate(size);
      if (r.ok()) {
        max_end_ = std::max(max_end_, *r + size);
        return r;
      }
      if (c_.policy == Policy::Resident && !may_fail)
        return Status::out_of_memory("resident: the step needs more than the device budget " +
                                     format_size(budgets_.device) + " (no room for " + name(t) + ", " +
                                     format_size(size) + "); choose --policy planned or auto to spill");
      TensorId victim = choose_victim(now, need_before);
      if (victim == kNoTensor) {
        if (may_fail) return Status::out_of_memory("no room");
        return Status::out_of_memory("device budget " + format_size(budgets_.device) + " cannot hold the operands of op " +
                                     p_.ops[now].name + " (" + name(t) + " needs " + format_size(size) + ", " +
                                     format_size(device_.in_use() + c_.pinned_end) + " in use, largest free block " +
                                     format_size(device_.largest_free_block()) + ")");
      }
      SPILLWAY_RETURN_IF_ERROR(evict(victim, now));
    }
  }

  Status recompute(TensorId t, int now) {
    int prod = st_[t].recompute_op;
    const Op& op = p_.ops[prod];
    std::vector<TensorId> added;
    for (const Operand& o : op.operands) {
      if (locked_.insert(o.tensor).second) added.push_back(o.tensor);
    }
    for (const Operand& o : op.operands) SPILLWAY_RETURN_IF_ERROR(ensure_on_device(o.tensor, o.access == Access::Write, now));
    Instruction in;
    in.kind = InstrKind::Run;
    in.op = prod;
    in.recompute = true;
    push(in);
    recomputes_++;
    for (const Operand& o : op.operands) {
      if (o.access == Access::Read) continue;
      State& s = st_[o.tensor];
      s.device_valid = true;
      s.recompute_pending = false;
      // Recomputed values are the same bits, but the executor's residency table marks
      // only the device copy valid after a write; the planner follows it.
      s.host_valid = false;
      s.storage_valid = false;
    }
    for (TensorId a : added) locked_.erase(a);
    return Status::ok();
  }

  Status ensure_on_device(TensorId t, bool write_only, int now) {
    State& s = st_[t];
    s.last_touch = now;
    if (s.region) {
      if (s.device_valid || write_only) return Status::ok();
      // A recompute that ran short of room after allocating t's region (the op's
      // operands are then placed again) left t to be recomputed into it.
      if (s.recompute_pending) return recompute(t, now);
      return Status::internal("planner: " + name(t) + " read on device before it was written");
    }
    if (s.recompute_pending && !write_only) return recompute(t, now);
    bool need_data = !write_only || (!c_.write_only_hint && persistent(t) && (s.host_valid || s.storage_valid));
    if (need_data) SPILLWAY_RETURN_IF_ERROR(ensure_host_valid(t, now));
    SPILLWAY_ASSIGN_OR_RETURN(uint64_t off, allocate(t, now, now, false));
    s.region = true;
    s.offset = off;
    if (need_data) {
      emit(InstrKind::Fetch, t, off);
      s.device_valid = true;
    } else {
      emit(InstrKind::Allocate, t, off);
      s.device_valid = false;
    }
    return Status::ok();
  }

  // Issues fetches for the coming ops' operands, in order of need, while memory allows.
  void prefetch(int now) {
    if (c_.prefetch == 0) return;
    int horizon = c_.prefetch > 0 ? c_.prefetch : 64;
    // What op `now` writes is about to change: a copy fetched now would hold the old
    // value (a host op's output, released from the device for it).
    auto written_now = [&](TensorId t) {
      for (const Operand& o : p_.ops[now].operands)
        if (o.tensor == t && o.access != Access::Read) return true;
      return false;
    };
    // What an op before j in the window overwrites whole (a gradient's Zero before its
    // first backward) needs no fetch for the ops after it: they read the new value.
    std::vector<TensorId> overwritten;
    for (int j = now + 1; j < static_cast<int>(p_.ops.size()) && j <= now + horizon; ++j) {
      const Op& op = p_.ops[j];
      if (op.place != Place::Device) continue;
      for (const Operand& o : op.operands) {
        TensorId t = o.tensor;
        State& s = st_[t];
        if (s.region || s.recompute_pending || written_now(t)) continue;
        if (std::find(overwritten.begin(), overwritten.end(), t) != overwritten.end()) continue;
        if (o.access == Access::Write && c_.write_only_hint) {
          bool read_too = false;
          for (const Operand& q : op.operands) read_too = read_too || (q.tensor == t && q.access != Access::Write);
          if (!read_too) overwritten.push_back(t);
          continue;
        }
        if (!s.host_valid) continue;  // storage reads are issued at need (they also take host room)
        // Locked while its region is found: making room may write other tensors back,
        // and their host buffers must not come from storing away t's, the fetch's source.
        const bool lock = locked_.insert(t).second;
        auto off = allocate(t, now, j, /*may_fail=*/true);
        if (lock) locked_.erase(t);
        if (!off.ok()) return;  // memory is full of tensors needed sooner: stop
        s.region = true;
        s.offset = *off;
        s.device_valid = true;
        s.last_touch = now;
        emit(InstrKind::Fetch, t, *off);
      }
    }
  }

  Status place_operands(const Op& op, int i, bool largest_first) {
    std::vector<Operand> order = op.operands;
    if (largest_first)
      std::stable_sort(order.begin(), order.end(),
                       [&](const Operand& a, const Operand& b) { return device_bytes(a.tensor) > device_bytes(b.tensor); });
    for (const Operand& o : order) {
      bool write_only = o.access == Access::Write;
      // An operand read and written by one op counts as read.
      for (const Operand& q : op.operands)
        if (q.tensor == o.tensor && q.access != Access::Write) write_only = false;
      SPILLWAY_RETURN_IF_ERROR(ensure_on_device(o.tensor, write_only, i));
    }
    return Status::ok();
  }

  Status schedule_op(int i) {
    const Op& op = p_.ops[i];
    locked_.clear();
    for (const Operand& o : op.operands) locked_.insert(o.tensor);
    if (op.place == Place::Device) {
      Status placed = place_operands(op, i, false);
      if (!placed.is_ok() && placed.code() == StatusCode::OutOfMemory) {
        // The op's own operands are scattered: move them out and place them again,
        // largest first, into the space that is now contiguous.
        for (const Operand& o : op.operands) {
          State& s = st_[o.tensor];
          if (s.region && !pinned_home(o.tensor)) SPILLWAY_RETURN_IF_ERROR(evict(o.tensor, i - 1));
        }
        placed = place_operands(op, i, true);
      }
      SPILLWAY_RETURN_IF_ERROR(placed);
    } else {
      for (const Operand& o : op.operands) {
        TensorId t = o.tensor;
        State& s = st_[t];
        if (o.access != Access::Write) SPILLWAY_RETURN_IF_ERROR(ensure_host_valid(t, i));
        else SPILLWAY_RETURN_IF_ERROR(ensure_host_buffer(t, i));
        if (o.access != Access::Read && s.region) {
          emit(InstrKind::Release, t);
          if (!pinned_home(t)) SPILLWAY_RETURN_IF_ERROR(device_.free(s.offset));
          s.region = false;
          s.device_valid = false;
        }
      }
    }
    prefetch(i);
    Instruction in;
    in.kind = InstrKind::Run;
    in.op = i;
    push(in);
    // State after the op.
    for (const Operand& o : op.operands) {
      if (o.access == Access::Read) continue;
      State& s = st_[o.tensor];
      if (op.place == Place::Device) {
        s.device_valid = true;
        s.host_valid = false;
      } else {
        s.host_valid = true;
        s.device_valid = false;
      }
      s.storage_valid = false;
      s.recompute_pending = false;
    }
    // A device-homed tensor written on host goes back to its home region.
    if (op.place == Place::Host) {
      for (const Operand& o : op.operands) {
        TensorId t = o.tensor;
        if (o.access == Access::Read || !pinned_home(t)) continue;
        State& s = st_[t];
        emit(InstrKind::Fetch, t, c_.home_offset[t]);
        s.region = true;
        s.offset = c_.home_offset[t];
        s.device_valid = true;
      }
    }
    locked_.clear();
    // Last uses: dead tensors are freed; state homed elsewhere goes home.
    if (c_.drop_dead) {
      for (const Operand& o : op.operands) {
        TensorId t = o.tensor;
        State& s = st_[t];
        if (next_use(t, i) != kNever) continue;
        if (!persistent(t)) {
          if (s.region) {
            emit(InstrKind::Release, t);
            SPILLWAY_RETURN_IF_ERROR(device_.free(s.offset));
            s.region = false;
            s.device_valid = false;
          }
          if (s.host_buffer && !mirror_[t]) {
            emit(InstrKind::HostRelease, t);
            SPILLWAY_RETURN_IF_ERROR(release_host(t));
          }
        } else if (s.region && !pinned_home(t)) {
          SPILLWAY_RETURN_IF_ERROR(evict(t, i));
        }
      }
    }
    if (c_.evict_host_bound && op.place == Place::Device) {
      for (const Operand& o : op.operands) {
        TensorId t = o.tensor;
        // Only state that rests on host: its buffer is there all step (others would
        // need one for longer).
        if (!st_[t].region || !persistent(t) || c_.home[t] != Tier::Host || next_use(t, i) == kNever ||
            used_on_device_after(t, i))
          continue;
        SPILLWAY_RETURN_IF_ERROR(evict(t, i));
      }
    }
    if (c_.flush_gap > 0 && op.place == Place::Device) {
      for (const Operand& o : op.operands) {
        TensorId t = o.tensor;
        State& s = st_[t];
        if (persistent(t) || !s.region || !s.device_valid || s.host_valid) continue;
        int use = next_use(t, i);
        if (use == kNever || use - i <= c_.flush_gap) continue;
        // No host room to spare: the copy waits for the eviction, if any comes.
        if (!s.host_buffer && !try_host_buffer(t)) continue;
        emit(InstrKind::Flush, t);
        s.host_valid = true;
      }
    }
    return Status::ok();
  }

  Status finish_step() {
    const int end = static_cast<int>(p_.ops.size());
    for (size_t t = 0; t < st_.size(); ++t) {
      auto id = static_cast<TensorId>(t);
      State& s = st_[t];
      if (!persistent(id)) {
        if (s.region) {
          emit(InstrKind::Release, id);
          SPILLWAY_RETURN_IF_ERROR(device_.free(s.offset));
          s.region = false;
        }
        if (s.host_buffer && !mirror_[t]) {
          emit(InstrKind::HostRelease, id);
          SPILLWAY_RETURN_IF_ERROR(release_host(id));
        }
        continue;
      }
      if (pinned_home(id)) {
        if (s.host_buffer && !mirror_[t]) {  // a host copy made for a host op; the device holds it
          emit(InstrKind::HostRelease, id);
          SPILLWAY_RETURN_IF_ERROR(release_host(id));
        }
        continue;
      }
      if (s.region) {
        if (s.device_valid && !s.host_valid && !s.storage_valid) {
          SPILLWAY_RETURN_IF_ERROR(ensure_host_buffer(id, end));
          emit(InstrKind::Evict, id, 0, true);
          s.host_valid = true;
        } else {
          emit(InstrKind::Release, id);
        }
        SPILLWAY_RETURN_IF_ERROR(device_.free(s.offset));
        s.region = false;
        s.device_valid = false;
      }
      if (c_.home[t] == Tier::Host) {
        if (!s.host_valid) {
          SPILLWAY_RETURN_IF_ERROR(ensure_host_valid(id, end));
        }
      } else if (c_.home[t] == Tier::Storage) {
        if (!s.storage_valid) {
          if (!s.host_valid) return Status::internal("planner: " + name(id) + " lost its value at the end of the step");
          store(id);
          emit(InstrKind::Store, id, 0, true, /*free_host=*/true);
          SPILLWAY_RETURN_IF_ERROR(release_host(id));
        } else if (s.host_buffer) {
          emit(InstrKind::HostRelease, id);
          SPILLWAY_RETURN_IF_ERROR(release_host(id));
        }
      }
    }
    return Status::ok();
  }

  const Program& p_;
  const CostModel& cost_;
  const Budgets& budgets_;
  const Config& c_;
  size_t align_;
  RangeAllocator device_;
  RangeAllocator host_;  // host buffers: static offsets in the executor's host arena
  std::vector<std::vector<int>> uses_;  // [tensors] op indices that touch it, ascending
  std::vector<std::vector<bool>> overwrites_;  // [tensors][uses] that op only writes it
  std::vector<char> persistent_;               // [tensors] Program::is_persistent
  std::vector<std::vector<int>> writers_;  // [tensors] op indices that write it (Write or Update), ascending
  std::vector<State> st_;               // [tensors]
  std::vector<bool> storage_extent_ = std::vector<bool>(p_.tensors.size(), false);
  std::set<TensorId> locked_;
  std::vector<Instruction> out_;
  Plan tables_;                               // the homes the residency machine starts from
  std::optional<ResidencyMachine> residency_;  // stepped by every instruction pushed
  Status residency_status_ = Status::ok();
  // Spill extents may take this much: the storage budget in whole 4096-byte blocks.
  const uint64_t storage_capacity_ = budgets_.storage / 4096 * 4096;
  bool host_short_ = false, storage_short_ = false;
  uint64_t max_end_ = 0;
  uint64_t host_end_ = 0, storage_used_ = 0;
  std::vector<uint64_t> home_host_offset_ = std::vector<uint64_t>(p_.tensors.size(), 0);  // [tensors]
  std::vector<bool> mirror_ = std::vector<bool>(p_.tensors.size(), false);  // [tensors] host mirrors (run())
  int recomputes_ = 0;
};

uint64_t op_working_set(const Program& program, const Op& op, size_t alignment) {
  std::set<TensorId> seen;
  uint64_t total = 0;
  for (const Operand& o : op.operands)
    if (seen.insert(o.tensor).second)
      total += align_up(std::max<uint64_t>(1, program.tensors.info(o.tensor).bytes()), alignment);
  return total;
}

// Homes: which persistent tensors stay on device for the whole run, which rest on
// host or storage between uses.
enum class StateClass { Param, Grad, Master, OptState, Other };
StateClass state_class(const Program& p, TensorId t) {
  switch (p.tensors.info(t).role) {
    case Role::Param: return StateClass::Param;
    case Role::Grad: return StateClass::Grad;
    case Role::Master: return StateClass::Master;
    case Role::OptState: return StateClass::OptState;
    default: return StateClass::Other;
  }
}

uint64_t host_footprint(const Program& program, TensorId t) {
  return align_up(std::max<uint64_t>(1, program.tensors.info(t).bytes()), 4096);
}

// Host-homed state beyond `quarters`/4 of the host budget goes to storage, moments
// first, then master weights, then parameters (gradients stay: the optimizer reads
// them every step); the rest of the host budget is for swapped activations and
// transfers. Only as much as the storage budget holds moves. Returns false when
// state that should have moved stayed on host because storage is full.
bool spill_homes_to_storage(const Program& program, const Budgets& budgets, Config& c, int quarters) {
  if (budgets.storage == 0 || budgets.host == UINT64_MAX) return true;
  uint64_t host_bytes = 0;
  std::vector<std::pair<int, TensorId>> movable;  // (spill priority, tensor)
  for (size_t t = 0; t < c.home.size(); ++t) {
    auto id = static_cast<TensorId>(t);
    if (!program.is_persistent(id) || c.home[t] != Tier::Host) continue;
    host_bytes += host_footprint(program, id);
    StateClass k = state_class(program, id);
    if (k == StateClass::OptState) movable.emplace_back(0, id);
    else if (k == StateClass::Master) movable.emplace_back(1, id);
    else if (k == StateClass::Param) movable.emplace_back(2, id);
  }
  const uint64_t limit = budgets.host - budgets.host / 4 * static_cast<uint64_t>(4 - quarters);
  uint64_t storage_left = budgets.storage / 4096 * 4096;
  bool stayed = false;
  std::stable_sort(movable.begin(), movable.end(), [](auto& a, auto& b) { return a.first < b.first; });
  for (auto& [prio, id] : movable) {
    if (host_bytes <= limit) break;
    const uint64_t extent = host_footprint(program, id);  // 4096-aligned, as storage extents are
    if (extent > storage_left) {
      stayed = true;
      continue;
    }
    storage_left -= extent;
    c.home[id] = Tier::Storage;
    host_bytes -= extent;
  }
  return !stayed;
}

void assign_device_offsets(const Program& program, Config& c, size_t alignment) {
  uint64_t off = 0;
  c.home_offset.assign(program.tensors.size(), 0);
  for (size_t t = 0; t < program.tensors.size(); ++t) {
    auto id = static_cast<TensorId>(t);
    if (!program.is_persistent(id) || c.home[t] != Tier::Device) continue;
    c.home_offset[t] = off;
    off += align_up(std::max<uint64_t>(1, program.tensors.info(id).bytes()), alignment);
  }
  c.pinned_end = off;
}

// Where each class rests: device, host, or storage when the host budget is short.
// offload: 0 = all on device; 1 = master+moments (and grads) off device, optimizer
// on host; 2 = parameters off device too. With offload >= 1, the optimizer state of
// the first parameters in program order (the order the next forward needs them)
// stays on device while it fits in `device_optimizer` bytes, and their AdamW runs on
// device: the host updates only the rest, and the next step's forward starts on the
// layers updated on device while the host works on the later ones.
Config make_config(const Program& program, const Budgets& budgets, int offload, size_t alignment,
                   uint64_t device_optimizer = 0, int64_t streamed_params = 0, bool carried = false) {
  (void)budgets;
  Config c;
  const size_t n = program.tensors.size();
  c.home.assign(n, Tier::Device);
  for (size_t t = 0; t < n; ++t) {
    auto id = static_cast<TensorId>(t);
    if (!program.is_persistent(id)) continue;
    StateClass k = state_class(program, id);
    bool off_device = (offload >= 1 && (k == StateClass::Master || k == StateClass::OptState || k == StateClass::Grad)) ||
                      (offload >= 2 && k == StateClass::Param);
    if (off_device) c.home[t] = Tier::Host;
  }
  if (offload >= 1) {
    uint64_t used = 0;
    bool full = false;
    for (const Op& op : program.ops) {
      if (!is_host_op(op) || full) continue;
      // Its state slots (AdamW: param, master, m, v, grad) go to the device together.
      const std::span<const OpSlot> slots = op_info(op.kind).slots;
      uint64_t bytes = 0;
      for (size_t j = 0; j < slots.size() && j < op.operands.size(); ++j)
        if (slots[j].state && c.home[op.operands[j].tensor] != Tier::Device)
          bytes += align_up(std::max<uint64_t>(1, program.tensors.info(op.operands[j].tensor).bytes()), alignment);
      if (used + bytes > device_optimizer) {
        full = true;  // a prefix: the layers the next forward needs first
        continue;
      }
      used += bytes;
      for (size_t j = 0; j < slots.size() && j < op.operands.size(); ++j)
        if (slots[j].state) c.home[op.operands[j].tensor] = Tier::Device;
    }
    // Streamed: the next parameters after the prefix keep master and moments on host
    // but run AdamW on device; the planner fetches the state, and writes it back after
    // the update, over a link with time to spare, while the host updates the rest. The
    // gradient stays on device (no round trip). Carried (Config::carried): the last
    // parameters instead, whose updates then run in the next step just before their
    // forward, their state moving while the layers before them compute.
    c.streamed.assign(program.ops.size(), false);
    int64_t left = streamed_params;
    const size_t n_ops = program.ops.size();
    for (size_t k = 0; k < n_ops && left > 0; ++k) {
      const size_t i = carried ? n_ops - 1 - k : k;
      const Op& op = program.ops[i];
      const TensorId home = home_tensor(op), param = slot_tensor(op, "param"), grad = slot_tensor(op, "grad");
      if (!is_host_op(op) || home == kNoTensor || param == kNoTensor || grad == kNoTensor ||
          c.home[home] == Tier::Device)
        continue;
      const int64_t n = program.tensors.info(param).shape.numel();
      if (n > left) break;  // whole tensors, within the count (a prefix, like the device one)
      c.streamed[i] = true;
      c.home[grad] = Tier::Device;  // the gradient
      left -= n;
    }
  }
  for (size_t i = 0; i < program.ops.size(); ++i) {
    const Op& op = program.ops[i];
    const TensorId home = home_tensor(op);
    if (!is_host_op(op) || home == kNoTensor) continue;
    if (c.home[home] == Tier::Device) c.device_optimizer_ops++;
    else if (c.is_streamed(i)) c.streamed_optimizer_ops++;
    else c.host_optimizer_ops++;
  }
  c.optimizer_on_host = c.host_optimizer_ops > 0;
  c.carried = carried && c.streamed_optimizer_ops > 0;
  assign_device_offsets(program, c, alignment);
  return c;
}

// Each AdamW runs where its master weights rest.
Program with_optimizer_where_state_is(const Program& program, const Config& c) {
  Program p = program;
  for (size_t i = 0; i < p.ops.size(); ++i) {
    Op& op = p.ops[i];
    const TensorId home = home_tensor(op);
    if (is_host_op(op) && home != kNoTensor)
      op.place = c.home[home] == Tier::Device || c.is_streamed(i) ? Place::Device : Place::Host;
  }
  return p;
}

Program with_optimizer_on_host(const Program& program, bool on_host) {
  Program p = program;
  for (Op& op : p.ops)
    if (is_host_op(op)) op.place = on_host ? Place::Host : Place::Device;
  return p;
}

}  // namespace

uint64_t minimum_device_budget(const Program& program, size_t alignment, uint64_t workspace_bytes) {
  uint64_t m = 0;
  // AdamW (a host op) is left out: it can always run on host, where its state lives.
  for (const Op& op : program.ops)
    if (op.place == Place::Device && !is_host_op(op)) m = std::max(m, op_working_set(program, op, alignment));
  // Inputs and outputs stay on device under every policy.
  for (TensorId t : program.inputs) m += align_up(std::max<uint64_t>(1, program.tensors.info(t).bytes()), alignment);
  for (TensorId t : program.outputs) m += align_up(std::max<uint64_t>(1, program.tensors.info(t).bytes()), alignment);
  return m + align_up(workspace_bytes, alignment);
}

namespace {

std::string largest_op_name(const Program& program, size_t alignment) {
  uint64_t m = 0;
  std::string name;
  for (const Op& op : program.ops) {
    uint64_t w = op_working_set(program, op, alignment);
    if (op.place == Place::Device && !is_host_op(op) && w > m) {
      m = w;
      name = op.name;
    }
  }
  return name;
}

// Layer-major order (DESIGN.md planned step 9): with gradient accumulation, each
// layer's forward runs for every micro-batch before the next layer, so a streamed
// parameter crosses the link once per step rather than once per micro-batch. The
// reorder is a topological sort that keeps, for every tensor, the order of the ops
// that write it and of reads against writes: each gradient still accumulates in
// micro-batch order, so the bits are unchanged. (With tied embeddings the LM head
// and the embedding both add into wte's gradient, which keeps the backward in
// micro-batch order; only the forward changes.) Returns new position → op index.
std::vector<int> layer_major_order(const Program& p) {
  const size_t n = p.ops.size();
  std::vector<std::vector<int>> successors(n);
  std::vector<int> pending(n, 0);
  std::vector<int> last_writer(p.tensors.size(), -1);
  std::vector<std::vector<int>> readers(p.tensors.size());  // since the last write
  auto edge = [&](int from, int to) {
    if (from < 0 || from == to) return;
    successors[from].push_back(to);
    pending[to]++;
  };
  for (size_t j = 0; j < n; ++j) {
    const int op = static_cast<int>(j);
    for (const Operand& o : p.ops[j].operands) {
      edge(last_writer[o.tensor], op);
      if (o.access != Access::Read)
        for (int r : readers[o.tensor]) edge(r, op);
    }
    for (const Operand& o : p.ops[j].operands) {
      if (o.access == Access::Read) {
        readers[o.tensor].push_back(op);
      } else {
        last_writer[o.tensor] = op;
        readers[o.tensor].clear();
      }
    }
  }
  // Among ready ops: the forward by (layer, micro-batch), everything else in program order.
  auto key = [&](int i) {
    const Op& op = p.ops[i];
    if (op.phase == Phase::Forward) return std::tuple<int, int, int, int>(0, op.layer, op.micro_batch, i);
    return std::tuple<int, int, int, int>(op.phase == Phase::Backward ? 1 : 2, 0, 0, i);
  };
  auto later = [&](int a, int b) { return key(a) > key(b); };
  std::priority_queue<int, std::vector<int>, decltype(later)> ready(later);
  for (size_t i = 0; i < n; ++i)
    if (pending[i] == 0) ready.push(static_cast<int>(i));
  std::vector<int> order;
  order.reserve(n);
  while (!ready.empty()) {
    int i = ready.top();
    ready.pop();
    order.push_back(i);
    for (int s : successors[i])
      if (--pending[s] == 0) ready.push(s);
  }
  return order;
}

// Whether two ops touch a tensor that one of them writes: their order matters.
bool ops_conflict(const Op& a, const Op& b) {
  for (const Operand& x : a.operands)
    for (const Operand& y : b.operands)
      if (x.tensor == y.tensor && (x.access != Access::Read || y.access != Access::Read)) return true;
  return false;
}

// `order` (position → op index) with each Zero that `hold` picks (by position and op)
// moved down to just before the next op that touches its tensor. Sets *stranded when a
// held Zero's tensor is touched by no later op (that Zero is then left out).
std::vector<int> zeros_to_next_touch(const Program& p, const std::vector<int>& order,
                                     const std::function<bool(size_t, const Op&)>& hold, bool* stranded) {
  std::vector<std::vector<int>> held(p.tensors.size());  // [tensors] Zeros waiting for the next touch
  std::vector<int> out;
  out.reserve(order.size());
  for (size_t j = 0; j < order.size(); ++j) {
    const int i = order[j];
    const Op& op = p.ops[static_cast<size_t>(i)];
    if (op.kind == OpKind::Zero && op.operands.size() == 1 && hold(j, op)) {
      held[static_cast<size_t>(op.operands[0].tensor)].push_back(i);
      continue;
    }
    for (const Operand& o : op.operands) {
      auto& h = held[static_cast<size_t>(o.tensor)];
      out.insert(out.end(), h.begin(), h.end());
      h.clear();
    }
    out.push_back(i);
  }
  *stranded = false;
  for (const auto& h : held) *stranded = *stranded || !h.empty();
  return out;
}

// `order` (position → op index; empty = program order) with each Zero of a gradient
// moved down to just before the next op that touches that gradient (its first
// backward, which adds into it). The program zeroes every gradient at the step's
// start; a gradient that does not rest on device would then hold a region through
// the forward, or be written back as zeros and fetched again for its backward (at
// gpt-2.7b under 24 GiB, 2.5 GiB each way per step). Moved, the Zero only gives it a
// region (write-only) right where the backward needs it. Nothing between reads or
// writes the gradient: the same bits. A Zero whose gradient nothing touches later
// stays where it was.
std::vector<int> zeros_late(const Program& p, std::vector<int> order) {
  if (order.empty()) {
    order.resize(p.ops.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int>(i);
  }
  auto gradient_zero = [&](const Op& op) {
    return op.kind == OpKind::Zero && op.operands.size() == 1 &&
           p.tensors.info(op.operands[0].tensor).role == Role::Grad;
  };
  std::vector<bool> touched_later(p.tensors.size(), false);  // [tensors] by an op after the Zero
  std::vector<bool> keep(order.size(), false);              // [positions] Zeros left in place
  for (size_t j = order.size(); j-- > 0;) {
    const Op& op = p.ops[static_cast<size_t>(order[j])];
    if (gradient_zero(op) && !touched_later[static_cast<size_t>(op.operands[0].tensor)]) keep[j] = true;
    for (const Operand& o : op.operands) touched_later[static_cast<size_t>(o.tensor)] = true;
  }
  bool stranded = false;  // none: a Zero no later op touches is kept in place
  return zeros_to_next_touch(
      p, order, [&](size_t j, const Op& op) { return gradient_zero(op) && !keep[j]; }, &stranded);
}

// `order` (position → op index; empty = program order) with each optimizer op that
// runs on host moved up to just after the last earlier optimizer op it depends on
// (one that writes what it touches or touches what it writes), keeping the host ops
// in their own order. The executor queues host ops on the host engine and goes on,
// so the host AdamW starts as soon as the clip scale is known, beside the device
// AdamW and the fetches of the state streamed through the device — which, later in
// the order, would otherwise hold up its issue while their regions free. The ops
// moved are independent of those they pass: the same bits.
std::vector<int> host_optimizer_first(const Program& p, std::vector<int> order) {
  if (order.empty()) {
    order.resize(p.ops.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int>(i);
  }
  auto conflict = [&](const Op& a, const Op& b) {
    if (a.place == Place::Host && b.place == Place::Host) return true;  // the host engine's order stays
    return ops_conflict(a, b);
  };
  for (size_t i = 0; i < order.size(); ++i) {
    const Op& op = p.ops[order[i]];
    if (op.place != Place::Host || op.phase != Phase::Optimizer) continue;
    size_t j = i;
    while (j > 0) {
      const Op& before = p.ops[order[j - 1]];
      if (before.phase != Phase::Optimizer || conflict(before, op)) break;
      --j;
    }
    std::rotate(order.begin() + static_cast<long>(j), order.begin() + static_cast<long>(i),
                order.begin() + static_cast<long>(i) + 1);
  }
  return order;
}

// Lets the host AdamW ops of `plan` that qualify (find_speculations) start
// speculatively, earliest first, as many as `host_budget` holds the second buffers
// of beside the plan's host arena.
void add_speculation(const Program& program, Plan& plan, uint64_t host_budget) {
  const uint64_t arena = plan.host_arena_bytes();
  if (arena >= host_budget) return;
  uint64_t room = host_budget - arena, bytes = 0;
  for (const Speculation& s : find_speculations(program, plan)) {
    const uint64_t b = speculation_bytes(program, {s});
    if (b > room - bytes) break;
    bytes += b;
    plan.speculation.push_back(s);
  }
  if (plan.speculation.empty()) return;
  plan.speculation_bytes = bytes;
  plan.description += ", speculative update of " + std::to_string(plan.speculation.size()) + " host AdamW ops (" +
                      format_size(bytes) + " of second buffers)";
}

// `order` (position → op index; empty = program order) with the norms of the
// gradients a host AdamW reads moved into the backward: the zeroing of the packed
// norms to the backward's start, and each such SquaredNorm to just after the last op
// that writes its gradient. A norm
// writes only its own element of the packed tensor, so norms pass each other; the
// values and the clip scale keep their bits. A gradient's last device use is then in
// the backward, and one bound for the host AdamW leaves the device there
// (Config::evict_host_bound), so that its update can start speculatively.
std::vector<int> norms_early(const Program& p, std::vector<int> order) {
  if (order.empty()) {
    order.resize(p.ops.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int>(i);
  }
  auto packed_norm = [](const Op& op) {
    return op.kind == OpKind::SquaredNorm && !op.operands.empty() && op.operands[0].access == Access::Update;
  };
  auto conflict = [&](const Op& a, const Op& b) {
    if (packed_norm(a) && packed_norm(b)) return false;  // distinct elements
    return ops_conflict(a, b);
  };
  // Only the norms of gradients a host AdamW reads move: the others stay together at
  // the end, where the CUDA backend launches a run of norms as one.
  std::vector<bool> host_bound(p.tensors.size(), false);
  const int grad_slot = op_slot(OpKind::AdamW, "grad");
  for (const Op& op : p.ops)
    if (op.kind == OpKind::AdamW && op.place == Place::Host && static_cast<int>(op.operands.size()) > grad_slot)
      host_bound[static_cast<size_t>(op.operands[static_cast<size_t>(grad_slot)].tensor)] = true;
  auto movable = [&](const Op& op) {
    if (op.phase != Phase::Optimizer || op.place != Place::Device) return false;
    if (packed_norm(op)) return op.operands.size() > 1 && host_bound[static_cast<size_t>(op.operands[1].tensor)];
    // The zeroing of the packed norms: a Zero whose tensor the norms update.
    if (op.kind != OpKind::Zero || op.operands.size() != 1) return false;
    for (const Op& o : p.ops)
      if (packed_norm(o) && o.operands[0].tensor == op.operands[0].tensor) return true;
    return false;
  };
  for (size_t i = 0; i < order.size(); ++i) {
    const Op& op = p.ops[static_cast<size_t>(order[i])];
    if (!movable(op)) continue;
    size_t j = i;
    while (j > 0) {
      const Op& before = p.ops[static_cast<size_t>(order[j - 1])];
      if (before.phase == Phase::Forward || conflict(before, op)) break;
      --j;
    }
    std::rotate(order.begin() + static_cast<long>(j), order.begin() + static_cast<long>(i),
                order.begin() + static_cast<long>(i) + 1);
  }
  return order;
}

// `order` (position → op index; empty = program order) with each streamed AdamW of
// `c` moved to just before the first op that reads its parameter: the loop body of
// DESIGN.md's "The step is a loop". Such an update then reads the gradient and the
// clip scale the previous step left (both persistent: the gradient rests on device,
// the scale is a program output) and writes the parameter before this step's first
// use of it — the update of step k at the place step k+1 needs it. The executor runs
// it with step k's learning rate and count, skips it in a step no step precedes, and
// runs the ones still owed when it drains (Plan::carried). Returns `order` unchanged
// when c carries nothing; *carried gets the ops moved, in their new order.
std::vector<int> carried_order(const Program& p, const Config& c, std::vector<int> order, std::vector<int32_t>* carried) {
  carried->clear();
  if (!c.carried) return order;
  if (order.empty()) {
    order.resize(p.ops.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int>(i);
  }
  std::vector<int> moved, rest;
  for (int i : order)
    (c.is_streamed(static_cast<size_t>(i)) ? moved : rest).push_back(i);
  // A moved op's gradient may be zeroed at the step's start, before its backward adds
  // into it: such a Zero moves down to just before the next op that touches the
  // gradient, so that the update (which reads it) need not go before it.
  std::vector<bool> moved_grad(p.tensors.size(), false);
  for (int m : moved) {
    const TensorId g = slot_tensor(p.ops[static_cast<size_t>(m)], "grad");
    if (g != kNoTensor) moved_grad[static_cast<size_t>(g)] = true;
  }
  {
    bool stranded = false;
    rest = zeros_to_next_touch(
        p, rest, [&](size_t, const Op& op) { return moved_grad[static_cast<size_t>(op.operands[0].tensor)]; },
        &stranded);
    if (stranded) {  // zeroed and never touched again in the step: not carried
      carried->clear();
      return order;
    }
  }

  // Each moved op goes before the first op of the step that must see its effect or
  // must not yet have changed what it reads: the first that conflicts with it (reads
  // its parameter, or writes its gradient). Every parameter is read in the forward.
  std::vector<std::vector<int>> before(rest.size());
  for (int m : moved) {
    const Op& op = p.ops[static_cast<size_t>(m)];
    size_t at = rest.size();
    for (size_t j = 0; j < rest.size() && at == rest.size(); ++j)
      if (ops_conflict(op, p.ops[static_cast<size_t>(rest[j])])) at = j;
    if (at == rest.size()) {  // nothing in the step touches it: it stays where it was
      carried->clear();
      return order;
    }
    before[at].push_back(m);
  }
  std::vector<int> out;
  out.reserve(order.size());
  for (size_t j = 0; j < rest.size(); ++j) {
    for (int m : before[j]) {
      out.push_back(m);
      carried->push_back(m);
    }
    out.push_back(rest[j]);
  }
  return out;
}

// Schedules `program` in the given op order (position → op index; empty = program
// order); the plan's Run instructions and op_place refer to the program's own
// op indices. Sets *host_short / *storage_short when it fails for want of host or
// storage room.
Result<Plan> schedule_once(const Program& program, const CostModel& cost, const Budgets& budgets, Config& c,
                           size_t alignment, const std::vector<int>& order, bool* host_short, bool* storage_short) {
  Program ordered;
  const Program* run = &program;
  if (!order.empty()) {
    ordered.tensors = program.tensors;
    ordered.inputs = program.inputs;
    ordered.outputs = program.outputs;
    for (int i : order) {
      ordered.ops.push_back(program.ops[i]);
      // A carried update's Run is skipped in a step that no step precedes, so what it
      // writes must hold its value before it runs, as the residency machine checks
      // (ResidencyMachine::reads): the scheduler sees its writes as updates, and
      // fetches a streamed parameter instead of only giving it a region.
      if (c.carried && c.is_streamed(static_cast<size_t>(i)))
        for (Operand& o : ordered.ops.back().operands)
          if (o.access == Access::Write) o.access = Access::Update;
    }
    run = &ordered;
  }
  Scheduler s(*run, cost, budgets, c, alignment);
  auto scheduled = s.run();
  *host_short = s.host_short();
  *storage_short = s.storage_short();
  SPILLWAY_ASSIGN_OR_RETURN(Plan plan, std::move(scheduled));
  if (!order.empty())
    for (Instruction& in : plan.instructions)
      if (in.kind == InstrKind::Run) in.op = order[in.op];
  plan.op_place.clear();
  for (const Op& op : program.ops) plan.op_place.push_back(op.place);
  std::ostringstream d;
  d << policy_name(c.policy) << ": state on device " << format_size(c.pinned_end) << ", optimizer on ";
  if (c.device_optimizer_ops + c.streamed_optimizer_ops > 0 && c.host_optimizer_ops > 0)
    d << "device for " << c.device_optimizer_ops << " of "
      << c.device_optimizer_ops + c.streamed_optimizer_ops + c.host_optimizer_ops << " parameter tensors, streamed through the device for "
      << c.streamed_optimizer_ops << (c.carried ? " (their updates carried into the next step)" : "")
      << ", host for the rest";
  else
    d << (c.optimizer_on_host ? "host" : "device");
  d << ", recompute " << (c.recompute ? "on" : "off")
    << ", early write-back " << (c.flush_gap > 0 ? "on" : "off") << ", "
    << (c.layer_major ? "layer-major" : "micro-batch-major") << " order, "
    << (c.late_zeros ? "gradients zeroed before their backward, " : "")
    << s.recomputes() << " recomputed ops per step";
  plan.description = d.str();
  return plan;
}

// Schedules with the host-homed state of `c` placed between host and storage. With a
// storage tier and a host budget, the state beyond 3/4 of the host budget goes to
// storage; when the step then runs out of host room (too little left for transfers,
// or too fragmented), more goes — beyond 1/2, 1/4, then all of it that can — since a
// larger host budget must never fail where a smaller one plans. When storage is what
// is short, says how much this plan needs.
Result<Plan> schedule(const Program& program, const CostModel& cost, const Budgets& budgets, Config& c,
                      size_t alignment, const std::vector<int>& order = {}) {
  const bool can_spill = budgets.storage != 0 && budgets.host != UINT64_MAX;
  const Config base = c;
  std::vector<Tier> tried;
  Status last = Status::ok();
  bool storage_short = false;
  for (int quarters = 3; quarters >= 0; --quarters) {
    Config k = base;
    if (can_spill && !spill_homes_to_storage(program, budgets, k, quarters)) storage_short = true;
    if (k.home == tried) continue;  // the same homes as the last try
    tried = k.home;
    bool host_short = false, storage_full = false;
    auto plan = schedule_once(program, cost, budgets, k, alignment, order, &host_short, &storage_full);
    if (plan.ok()) {
      c = k;
      return plan;
    }
    if (plan.status().code() == StatusCode::Internal) return plan.status();  // a planner bug: never retried
    storage_short = storage_short || storage_full;
    last = plan.status();
    if (!can_spill || !host_short) break;  // more state in storage would not help
  }
  if (storage_short && last.code() == StatusCode::OutOfMemory) {
    // What this plan needs: the same plan with storage to spare.
    Budgets roomy = budgets;
    roomy.storage = uint64_t{1} << 52;  // never short: no further recursion
    Config k = base;
    auto need = schedule(program, cost, roomy, k, alignment, order);
    if (!need.ok() && need.status().code() == StatusCode::Internal) return need.status();  // a planner bug
    if (need.ok())
      return Status::out_of_memory("storage budget " + format_size(budgets.storage) + " is too small: this plan spills " +
                                   format_size(need->storage_bytes) + " (training state and swapped activations, in " +
                                   "4096-byte extents) under host budget " + format_size(budgets.host) +
                                   "; give --storage-budget " + std::to_string((need->storage_bytes + (1 << 20) - 1) >> 20) +
                                   "MiB or more, or free space in the spill directory (without --storage-budget the "
                                   "budget is 90% of its free space), or a larger --host-budget");
  }
  return last;
}

}  // namespace


// Ops between an activation's last forward use and its next use past which the
// planned policy writes it back early.
constexpr int kFlushGap = 16;

// The micro-batches of a step (1 without accumulation).
int micro_batches(const Program& program) {
  int n = 1;
  for (const Op& op : program.ops) n = std::max(n, op.micro_batch + 1);
  return n;
}

// The config of a candidate at offload `level` with `share` bytes of optimizer state
// kept on device (level >= 1), and part of the rest streamed through the device when
// options allow.
Config offload_config(const Program& program, const CostModel& cost, const Budgets& budgets,
                      const PlannerOptions& options, int level, size_t alignment, uint64_t share) {
  Config c = make_config(program, budgets, level, alignment, share);
  const bool carry = options.carry_updates > 0;
  if (level >= 1 && share > 0 && options.stream_optimizer != 0 && c.host_optimizer_ops > 0) {
    // Split what the prefix leaves between the host and the link so that both take
    // about as long: a streamed parameter moves master and moments both ways (12
    // bytes each way); the host updates one in 1/host_adam_params_per_s.
    int64_t host_params = 0;
    double grad_bytes_per_param = 0;
    for (const Op& op : program.ops) {
      const TensorId home = home_tensor(op), grad = slot_tensor(op, "grad");
      if (!is_host_op(op) || home == kNoTensor || grad == kNoTensor || c.home[home] == Tier::Device) continue;
      const TensorInfo& g = program.tensors.info(grad);
      host_params += g.shape.numel();
      grad_bytes_per_param = static_cast<double>(g.bytes()) / static_cast<double>(std::max<int64_t>(1, g.shape.numel()));
    }
    const double host_s = cost.host_adam_seconds(1.0);
    const double link_s = cost.duplex_copy_seconds(12.0);
    auto streamed = static_cast<int64_t>(static_cast<double>(host_params) * host_s / (host_s + link_s) *
                                         std::clamp(options.stream_fraction, 0.0, 1.0));
    // Streamed gradients stay on device: their bytes come out of the prefix's share
    // (fewer are streamed when the share cannot hold them).
    auto grads = static_cast<uint64_t>(static_cast<double>(streamed) * grad_bytes_per_param);
    if (grads > share) {
      streamed = grad_bytes_per_param > 0 ? static_cast<int64_t>(static_cast<double>(share) / grad_bytes_per_param) : 0;
      grads = share;
    }
    c = make_config(program, budgets, level, alignment, share - grads, streamed, carry);
  }
  return c;
}

// One planned-policy candidate: state offloaded to `level`, with or without
// recomputation, fetches up to `prefetch` ops ahead (-1: as memory allows), with
// `share` bytes of optimizer state kept on device (level >= 1; nullopt: the rule of
// device_optimizer_shares' first entry). With `roomy`, reports whether the state kept
// on device before any optimizer share leaves room to work (and plans nothing when it
// does not).
Result<Plan> plan_offload_level(const Program& program, const CostModel& cost, const Budgets& budgets,
                                const PlannerOptions& options, int level, bool recompute, int prefetch,
                                int flush_gap, bool layer_major, size_t alignment, bool* roomy,
                                bool device_optimizer = true, std::optional<uint64_t> share = std::nullopt);

// The optimizer-state shares worth trying at `level` (bytes kept on device, their AdamW
// running there). The first is the rule: what leaves half the device budget for the
// step's working memory, divided by the micro-batches (with accumulation the device
// memory is worth more to the activations, which run once per micro-batch; measured on
// the H200, gpt2-1.5b at 24 GiB: the half-budget share is best among shares that leave
// the activations room). The others fill more of what the state leaves beside the
// largest op's room — up to all of it, the activations then living mostly on
// recomputation — which the cost model decides (gpt2-1.5b at 24 GiB, accum 1: the
// simulator predicts 31.1k tokens/s with 22.7 GiB of state on device against 17.9k
// with the rule's 11.8 GiB). With options.device_optimizer_bytes set, only that one;
// with options.optimizer_share_search = 0, only the rule's.
std::vector<uint64_t> device_optimizer_shares(const Program& program, const Budgets& budgets,
                                              const PlannerOptions& options, int level, size_t alignment) {
  if (level < 1 || budgets.device == UINT64_MAX) return {0};
  const Config base = make_config(program, budgets, level, alignment);
  const uint64_t room = minimum_device_budget(program, alignment);
  const uint64_t spare = budgets.device > base.pinned_end + room ? budgets.device - base.pinned_end - room : 0;
  if (options.device_optimizer_bytes >= 0) return {std::min(static_cast<uint64_t>(options.device_optimizer_bytes), spare)};
  if (base.pinned_end >= budgets.device / 2) return {0};
  const uint64_t rule = std::min(spare, (budgets.device / 2 - base.pinned_end) / static_cast<uint64_t>(micro_batches(program)));
  std::vector<uint64_t> shares = {rule};
  if (options.optimizer_share_search == 0) return shares;
  for (int eighths : {2, 4, 6, 7, 8}) {
    const uint64_t s = spare / 8 * static_cast<uint64_t>(eighths);
    if (std::find(shares.begin(), shares.end(), s) == shares.end()) shares.push_back(s);
  }
  return shares;
}

Result<Plan> plan_offload_level(const Program& program, const CostModel& cost, const Budgets& budgets,
                                const PlannerOptions& options, int level, bool recompute, int prefetch,
                                int flush_gap, bool layer_major, size_t alignment, bool* roomy,
                                bool device_optimizer, std::optional<uint64_t> share) {
  if (options.late_zeros < 0) {
    // Both places of the gradients' Zeros; the faster the cost model predicts.
    PlannerOptions at_start = options, late = options;
    at_start.late_zeros = 0;
    late.late_zeros = 1;
    auto first = plan_offload_level(program, cost, budgets, at_start, level, recompute, prefetch, flush_gap,
                                    layer_major, alignment, roomy, device_optimizer, share);
    if (!first.ok() && (first.status().code() == StatusCode::Internal || (roomy && !*roomy))) return first;
    auto second = plan_offload_level(program, cost, budgets, late, level, recompute, prefetch, flush_gap, layer_major,
                                     alignment, nullptr, device_optimizer, share);
    if (!second.ok()) {
      if (second.status().code() == StatusCode::Internal) return second.status();
      return first;
    }
    if (!first.ok()) return second;
    const double a = cost.step_seconds(placed_as_planned(program, *first), *first);
    const double b = cost.step_seconds(placed_as_planned(program, *second), *second);
    return b < a ? std::move(second) : std::move(first);
  }
  const Config base = make_config(program, budgets, level, alignment);
  if (roomy && base.pinned_end > budgets.device / 2) {
    *roomy = false;
    return Status::out_of_memory("state kept on device takes more than half the budget");
  }
  Config c = base;
  if (level >= 1 && device_optimizer && budgets.device != UINT64_MAX) {
    const uint64_t bytes = share ? *share : device_optimizer_shares(program, budgets, options, level, alignment).front();
    if (bytes > 0) c = offload_config(program, cost, budgets, options, level, alignment, bytes);
  }
  c.policy = options.policy;
  c.belady = true;
  c.prefetch = prefetch;
  c.drop_dead = true;
  c.write_only_hint = true;
  c.recompute = recompute;
  c.flush_gap = flush_gap;
  const uint64_t minimum = minimum_device_budget(program, alignment);
  uint64_t free_after_state = c.pinned_end < budgets.device ? budgets.device - c.pinned_end : 0;
  if (free_after_state < minimum) {
    if (roomy) *roomy = false;
    return Status::out_of_memory("device budget " + format_size(budgets.device) + " leaves " +
                                 format_size(free_after_state) + " after the state kept on device; the largest op needs " +
                                 format_size(minimum));
  }
  Program candidate = with_optimizer_where_state_is(program, c);
  c.layer_major = layer_major;
  std::vector<int> order;
  if (layer_major) {
    order = layer_major_order(candidate);
    if (order.size() != candidate.ops.size()) return Status::internal("planner: the program's ops have a dependency cycle");
  }
  if (c.host_optimizer_ops > 0 && c.device_optimizer_ops + c.streamed_optimizer_ops > 0)
    order = host_optimizer_first(candidate, std::move(order));
  if (options.late_zeros > 0) {
    order = zeros_late(candidate, std::move(order));
    c.late_zeros = true;
  }
  std::vector<int32_t> carried;
  order = carried_order(candidate, c, std::move(order), &carried);
  if (c.carried && carried.empty()) return Status::out_of_memory("no streamed update can be carried");
  auto with_carried = [&carried](Result<Plan> plan) {
    if (plan.ok()) plan->carried = carried;
    return plan;
  };
  if (c.host_optimizer_ops > 0) {
    // Norms in the backward and gradients home early, so that updates can start
    // there; should that order not fit (host memory fragments differently), the usual
    // one is planned. Without speculation the early order can still be faster (the
    // gradients' copies to host overlap the backward instead of queueing after it).
    Config early = c;
    early.evict_host_bound = true;
    auto plan = with_carried(schedule(candidate, cost, budgets, early, alignment, norms_early(candidate, order)));
    if (plan.ok()) {
      if (options.speculate != 0) add_speculation(candidate, *plan, budgets.host);
      if (options.speculate > 0) return plan;
      // Chosen by the cost model: the updates overlap the backward, but they run beside
      // it (on the CPU backend, on the same cores) and need the gradients home early;
      // the usual order without them may be faster.
      auto usual = with_carried(schedule(candidate, cost, budgets, c, alignment, order));
      if (!usual.ok()) {
        if (usual.status().code() == StatusCode::Internal) return usual.status();
        return plan;
      }
      const double early_s = cost.step_seconds(placed_as_planned(program, *plan), *plan);
      return cost.step_seconds(placed_as_planned(program, *usual), *usual) < early_s ? usual : plan;
    }
    const StatusCode code = plan.status().code();
    if (code == StatusCode::Internal || (options.speculate != 0 && code != StatusCode::OutOfMemory)) return plan;
  }
  auto plan = with_carried(schedule(candidate, cost, budgets, c, alignment, order));
  if (plan.ok() && options.speculate != 0) add_speculation(candidate, *plan, budgets.host);
  return plan;
}

// plan_offload_level over every share of device_optimizer_shares, planned in parallel
// (each is independent; the cost model is only read), keeping the one the cost model
// predicts fastest (ties: the earlier share). `roomy` as plan_offload_level's. Fails
// with the first share's error when none plans.
Result<Plan> plan_offload_level_best_share(const Program& program, const CostModel& cost, const Budgets& budgets,
                                           const PlannerOptions& options, int level, bool recompute, int prefetch,
                                           int flush_gap, bool layer_major, size_t alignment, bool* roomy) {
  const std::vector<uint64_t> shares = device_optimizer_shares(program, budgets, options, level, alignment);
  if (shares.size() == 1)
    return plan_offload_level(program, cost, budgets, options, level, recompute, prefetch, flush_gap, layer_major,
                              alignment, roomy, true, shares.front());
  if (roomy && make_config(program, budgets, level, alignment).pinned_end > budgets.device / 2) {
    *roomy = false;
    return Status::out_of_memory("state kept on device takes more than half the budget");
  }
  // The rule balances host and link time, but the host's share can overlap the
  // backward (speculative updates) or the link be busy with activations, so streaming
  // less through the device can be faster: 1/2, 1/4 and none of it are tried too,
  // with speculation or without (without, at gpt-2.7b under 24 GiB on the H100 file,
  // the rule's share alone was predicted at 12.5k tokens/s, the search's pick 14.0k).
  std::vector<PlannerOptions> variants{options};
  if (options.stream_optimizer != 0)
    for (double fraction : {0.5, 0.25, 0.0}) {
      variants.push_back(options);
      variants.back().stream_fraction = fraction;
      if (fraction == 0.0) variants.back().stream_optimizer = 0;
    }
  // Streamed updates carried into the next step (carry_updates -1: both ways, the
  // cost model choosing; 1: carried only; 0: never).
  if (options.stream_optimizer != 0 && options.carry_updates != 0) {
    // Forced on: the plans that stream nothing (and so carry nothing) are left out.
    if (options.carry_updates > 0 && variants.size() > 1)
      std::erase_if(variants, [](const PlannerOptions& v) { return v.stream_optimizer == 0; });
    const size_t n = variants.size();
    for (size_t i = 0; i < n; ++i) {
      if (variants[i].stream_optimizer == 0) continue;
      if (options.carry_updates > 0) {
        variants[i].carry_updates = 1;
      } else {
        variants.push_back(variants[i]);
        variants.back().carry_updates = 1;
      }
    }
  }
  std::vector<std::future<Result<Plan>>> planned;
  for (const PlannerOptions& o : variants)
    for (uint64_t share : shares)
      planned.push_back(std::async(std::launch::async, [&, share] {
        return plan_offload_level(program, cost, budgets, o, level, recompute, prefetch, flush_gap, layer_major,
                                  alignment, nullptr, true, share);
      }));
  std::optional<Plan> best;
  double best_s = 0;
  Status first = Status::ok();
  for (size_t i = 0; i < planned.size(); ++i) {
    Result<Plan> plan = planned[i].get();
    if (!plan.ok()) {
      if (plan.status().code() == StatusCode::Internal) return plan.status();  // a planner bug: never skipped
      if (i == 0) first = plan.status();
      continue;
    }
    const double s = cost.step_seconds(placed_as_planned(program, *plan), *plan);
    if (!best || s < best_s) {
      best = std::move(*plan);
      best_s = s;
    }
  }
  if (best) return std::move(*best);
  return first.is_ok() ? Status::out_of_memory("no optimizer share plans at this level") : first;
}

// Plans against a copy of the program whose AdamW ops sit where the plan wants
// them; Plan::op_place records the choice.
// `budgets.device` is the arena's budget: the device budget `given_device` less
// `workspace` (0 when the workspace alone takes more).
// `more` (auto only): the candidates ranked after the one returned, up to `count` plans
// in all, in ranking order.
Result<Plan> make_plan_impl(const Program& original, const CostModel& cost, const Budgets& budgets,
                            const PlannerOptions& options, size_t alignment, uint64_t workspace,
                            uint64_t given_device, uint64_t reserved, std::vector<Plan>* more, int count) {
  Program program = original;
  uint64_t minimum = minimum_device_budget(program, alignment);
  if (budgets.device < minimum) {
    const uint64_t given = given_device, total = minimum + workspace + reserved;
    const uint64_t g = std::max<uint64_t>(1, options.allocation_granularity);
    const uint64_t suggested = (total + g - 1) / g * g + options.outside_budget_bytes;
    return Status::out_of_memory("device budget " + format_size(given) + " is below the minimum " +
                                 format_size(total) + " that the largest op (" + largest_op_name(program, alignment) +
                                 ") needs (" + format_size(minimum) + " of operands and inputs, " + format_size(workspace) +
                                 " of workspace" +
                                 (reserved > 0 ? ", " + format_size(reserved) + " for the GPU's mapping of pinned host memory"
                                               : std::string()) +
                                 "); give --device-budget " + std::to_string((suggested + (1 << 20) - 1) >> 20) +
                                 "MiB or more" +
                                 (options.outside_budget_bytes > 0
                                      ? " (with the " + format_size(options.outside_budget_bytes) +
                                            " the backend holds itself)"
                                      : std::string()));
  }
  // The host arena is made of 4096-byte blocks (O_DIRECT) and is never smaller than one
  // (Plan::host_arena_bytes), whatever the plan homes there.
  if (budgets.host < 4096)
    return Status::out_of_memory("host budget " + format_size(budgets.host) +
                                 " is below the minimum of 4.00 KiB (the host arena is made of 4096-byte blocks); "
                                 "give --host-budget 4KiB or more");
  switch (options.policy) {
    case Policy::Resident: {
      Config c = make_config(program, budgets, 0, alignment);
      c.policy = Policy::Resident;
      program = with_optimizer_on_host(program, false);
      return schedule(program, cost, budgets, c, alignment);
    }
    case Policy::Paging: {
      Config c;
      c.policy = Policy::Paging;
      c.home.assign(program.tensors.size(), Tier::Host);
      for (TensorId t : program.inputs) c.home[t] = Tier::Device;
      for (TensorId t : program.outputs) c.home[t] = Tier::Device;
      assign_device_offsets(program, c, alignment);
      c.belady = false;
      c.prefetch = options.learned_prefetch ? 1 : 0;
      c.drop_dead = false;
      c.write_only_hint = false;
      c.recompute = false;
      // A pager does not move compute: the optimizer runs on device, unless its
      // working set cannot fit there at all (then on host, as ZeRO-Offload does).
      uint64_t adam = 0;
      for (const Op& op : program.ops)
        if (is_host_op(op)) adam = std::max(adam, op_working_set(program, op, alignment));
      c.optimizer_on_host = c.pinned_end + adam > budgets.device;
      program = with_optimizer_on_host(program, c.optimizer_on_host);
      return schedule(program, cost, budgets, c, alignment);
    }
    case Policy::Planned: {
      // Offload as little as the budget allows: state stays on device while it
      // leaves at least half the budget (and the largest op's working set) free.
      std::vector<int> levels;
      if (options.optimizer_on_host == 1) levels = {1, 2};
      else if (options.optimizer_on_host == 0) levels = {0};
      else levels = {0, 1, 2};
      // Early write-back of every activation saturates the device→host link when
      // only some must leave (the simulator shows it), so planned leaves it off;
      // auto tries both.
      const int flush_gap = 0;
      auto predicted_s = [&](const Plan& plan) {
        return cost.step_seconds(placed_as_planned(program, plan), plan);
      };
      // All state on device although it leaves less than half the budget: the
      // activations then live on recomputation. With accumulation that can beat
      // offloading the optimizer by far (gpt2-1.5b, accum 4, 40 GiB on the H200: 41.3k
      // against 29.4k tokens/s), so the simulator decides between the two.
      std::optional<Plan> crowded;
      Status last = Status::ok();
      for (int level : levels) {
        bool roomy = true;
        auto plan = plan_offload_level_best_share(program, cost, budgets, options, level, options.recompute != 0,
                                                  options.prefetch_distance, flush_gap, options.layer_major == 1,
                                                  alignment, level == levels.back() ? nullptr : &roomy);
        if (!roomy) {
          if (level == 0 && options.recompute != 0 && !crowded) {
            auto all_on_device = plan_offload_level(program, cost, budgets, options, 0, true,
                                                    options.prefetch_distance, flush_gap,
                                                    options.layer_major == 1, alignment, nullptr);
            if (all_on_device.ok()) crowded = std::move(*all_on_device);
            else if (all_on_device.status().code() == StatusCode::Internal) return all_on_device.status();
          }
          continue;
        }
        if (plan.ok()) {
          // One level further (parameters streamed too) can be faster, as when
          // speculative updates hide the host's share of the optimizer in the backward
          // (gpt-2.7b, 24 GiB, accum 1 on the H200 machine model: 15.9k against 17.5k
          // tokens/s predicted): the cost model decides between the two.
          if (level != levels.back()) {
            const int deeper_level = *(std::find(levels.begin(), levels.end(), level) + 1);
            auto deeper = plan_offload_level_best_share(program, cost, budgets, options, deeper_level,
                                                        options.recompute != 0, options.prefetch_distance, flush_gap,
                                                        options.layer_major == 1, alignment, nullptr);
            if (!deeper.ok() && deeper.status().code() == StatusCode::Internal) return deeper.status();
            if (deeper.ok() && predicted_s(*deeper) < predicted_s(*plan)) plan = std::move(deeper);
          }
          if (crowded && predicted_s(*crowded) < predicted_s(*plan)) return std::move(*crowded);
          return plan;
        }
        if (plan.status().code() == StatusCode::Internal) return plan.status();  // a planner bug: never skipped
        last = plan.status();
      }
      if (crowded) return std::move(*crowded);
      if (!last.is_ok()) return last;
      return Status::out_of_memory("device budget " + format_size(budgets.device) +
                                   " cannot hold the state this model keeps on device even with parameters streamed");
    }
    case Policy::Auto: {
      // Elixir-style search: every planned-policy candidate that fits, ranked by the
      // simulator's predicted step time on this machine.
      bool has_accumulation = false;
      for (const Op& op : program.ops) has_accumulation |= op.micro_batch > 0;
      struct Candidate {
        int level;
        bool recompute;
        int flush_gap;
        bool layer_major;
        bool device_optimizer;  // part of the optimizer state stays on device (level >= 1)
      };
      std::vector<Candidate> candidates;
      for (int level : {0, 1, 2})
        for (bool recompute : {false, true})
          for (int flush_gap : {0, kFlushGap})
            for (bool layer_major : {false, true}) {
              if (options.optimizer_on_host == 0 && level > 0) continue;
              if (options.optimizer_on_host == 1 && level == 0) continue;
              if (options.recompute >= 0 && recompute != (options.recompute == 1)) continue;
              if (options.layer_major >= 0 && layer_major != (options.layer_major == 1)) continue;
              if (layer_major && !has_accumulation) continue;
              candidates.push_back({level, recompute, flush_gap, layer_major, false});
              if (level >= 1 && options.device_optimizer_bytes != 0)
                candidates.push_back({level, recompute, flush_gap, layer_major, true});
            }
      // Every candidate that plans, with its predicted step time; the one of rank
      // options.auto_rank in that order (ties keep the enumeration order).
      std::vector<std::pair<double, Plan>> ranked;
      Status last = Status::ok();
      // The candidates are planned in parallel, as many at once as the host has
      // hardware threads (each is independent; the cost model is only read), and taken
      // in enumeration order, so the ranking is the same.
      auto plan_candidate = [&](const Candidate& k) -> Result<std::pair<double, Plan>> {
        // With recomputation, the optimizer share is searched too (shares beyond the
        // rule leave the activations little room but recomputation).
        SPILLWAY_ASSIGN_OR_RETURN(
            Plan plan, k.device_optimizer && k.recompute
                           ? plan_offload_level_best_share(program, cost, budgets, options, k.level, k.recompute,
                                                           options.prefetch_distance, k.flush_gap, k.layer_major,
                                                           alignment, nullptr)
                           : plan_offload_level(program, cost, budgets, options, k.level, k.recompute,
                                                options.prefetch_distance, k.flush_gap, k.layer_major, alignment,
                                                nullptr, k.device_optimizer));
        const double step_s = cost.step_seconds(placed_as_planned(program, plan), plan);
        return std::pair<double, Plan>(step_s, std::move(plan));
      };
      const size_t wave = std::max(1u, std::thread::hardware_concurrency());
      for (size_t begin = 0; begin < candidates.size(); begin += wave) {
        std::vector<std::future<Result<std::pair<double, Plan>>>> planned;
        for (size_t i = begin; i < candidates.size() && i < begin + wave; ++i)
          planned.push_back(std::async(std::launch::async, plan_candidate, candidates[i]));
        for (auto& future : planned) {
          auto candidate = future.get();
          if (!candidate.ok()) {
            if (candidate.status().code() == StatusCode::Internal) return candidate.status();  // a planner bug
            last = candidate.status();
            continue;
          }
          ranked.push_back(std::move(*candidate));
        }
      }
      std::stable_sort(ranked.begin(), ranked.end(),
                       [](const auto& a, const auto& b) { return a.first < b.first; });
      if (options.auto_rank < 0 || (!ranked.empty() && static_cast<size_t>(options.auto_rank) >= ranked.size()))
        return Status::invalid_argument("auto: candidate " + std::to_string(options.auto_rank + 1) +
                                        " asked for, but " + std::to_string(ranked.size()) + " plan(s) fit");
      if (!ranked.empty()) {
        auto annotated = [&](size_t rank) {
          auto& [step_s, plan] = ranked[rank];
          plan.policy = Policy::Auto;
          plan.predicted_step_s = step_s;
          char predicted[128];
          std::snprintf(predicted, sizeof predicted, " (simulator: %.3f s/step, candidate %zu of %zu by predicted time)",
                        step_s, rank + 1, ranked.size());
          plan.description += predicted;
          return std::move(plan);
        };
        const auto first = static_cast<size_t>(options.auto_rank);
        if (more)
          for (size_t rank = first + 1; rank < ranked.size() && rank < first + static_cast<size_t>(count); ++rank)
            more->push_back(annotated(rank));
        return annotated(first);
      }
      return last.is_ok() ? Status::out_of_memory("auto: no candidate plan fits the budgets") : last;
    }
  }
  return Status::internal("planner: unknown policy");
}

namespace {

// make_plan, and with `count` > 1 (auto) the candidates ranked after its plan too.
Result<std::vector<Plan>> make_plans(const Program& program, const CostModel& cost, const Budgets& budgets,
                                     const PlannerOptions& options, int count) {
  const size_t alignment = options.alignment;
  // The workspace comes out of the device budget first; the arena gets the rest.
  const uint64_t workspace = align_up(options.workspace_bytes, alignment);
  const uint64_t reserved = budgets.device == UINT64_MAX ? 0 : options.reserved_device_bytes;
  Budgets arena = budgets;
  if (budgets.device != UINT64_MAX)
    arena.device = budgets.device > workspace + reserved ? budgets.device - workspace - reserved : 0;
  std::vector<Plan> more;
  SPILLWAY_ASSIGN_OR_RETURN(Plan first, make_plan_impl(program, cost, arena, options, alignment, workspace,
                                                       budgets.device, reserved, count > 1 ? &more : nullptr, count));
  std::vector<Plan> plans;
  plans.push_back(std::move(first));
  for (Plan& p : more) plans.push_back(std::move(p));
  for (Plan& plan : plans) {
    plan.workspace_bytes = workspace;
    if (workspace > 0) plan.description += ", workspace " + format_size(workspace);
    SPILLWAY_RETURN_IF_ERROR(plan.validate(program, arena).with_context("planner produced an invalid plan"));
  }
  return plans;
}

}  // namespace

Result<Plan> make_plan(const Program& program, const CostModel& cost, const Budgets& budgets,
                       const PlannerOptions& options) {
  SPILLWAY_ASSIGN_OR_RETURN(std::vector<Plan> plans, make_plans(program, cost, budgets, options, 1));
  return std::move(plans.front());
}

Result<std::vector<Plan>> make_auto_plans(const Program& program, const CostModel& cost, const Budgets& budgets,
                                          const PlannerOptions& options, int count) {
  if (options.policy != Policy::Auto)
    return Status::invalid_argument(std::string("make_auto_plans: policy ") + policy_name(options.policy) +
                                    "; expected auto");
  if (count < 1) return Status::invalid_argument("make_auto_plans: count " + std::to_string(count) + "; expected >= 1");
  return make_plans(program, cost, budgets, options, count);
}

}  // namespace spillway
