// Simulator: a discrete-event replay of one step (the model is described in simulator.h).
//
// Each instruction becomes at most one task on one of six servers (device compute,
// host compute, h2d link, d2h link, storage reads, storage writes), queued in issue
// order. A task starts
// when it reaches the head of its server's queue and the tasks it depends on have
// ended; compute tasks last their op's seconds, link and storage tasks move bytes
// at a rate that, for the two link directions, drops to rate × duplex_factor while
// the other direction is also moving bytes, by copy_share_while_computing while
// device compute runs and by copy_share_while_host_computes while a host op runs
// (and, for device compute, to rate × compute_share_while_copying while either link
// moves bytes; device compute and host ops slow each other by
// compute_share_while_host_computes and host_share_while_computing). The host thread is one more actor: it
// issues instructions at the current time until an instruction must wait (on a
// cross-engine dependency, on a host op, or on a device Run when the host does not
// run ahead), and resumes when what it waits for has ended.
#include "sim/simulator.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <deque>
#include <limits>
#include <sstream>

#include "core/size.h"
#include "plan/residency.h"
#include "program/op_registry.h"

namespace spillway {

const char* sim_resource_name(SimResource r) {
  switch (r) {
    case SimResource::Compute: return "compute";
    case SimResource::Host: return "host";
    case SimResource::H2D: return "h2d";
    case SimResource::D2H: return "d2h";
    case SimResource::StorageRead: return "storage read";
    case SimResource::StorageWrite: return "storage write";
  }
  return "unknown";
}

namespace {

enum Server { kCompute = 0, kHost = 1, kH2D = 2, kD2H = 3, kStorageRead = 4, kStorageWrite = 5, kServerCount = 6 };

bool is_persistent(Role r) {
  return r == Role::Param || r == Role::Grad || r == Role::Master || r == Role::OptState || r == Role::Input;
}

struct Task {
  int server = kCompute;
  SimResource resource = SimResource::Compute;
  double work = 0;       // seconds (compute, host) or bytes (links, storage)
  double rate = 1;       // work per second at full speed
  double remaining = 0;
  std::vector<int> deps;
  double issue = 0;
  double start = -1, end = -1;
  bool done = false;
  // A deferred copy (a fetch of what a host op writes): it joins its server's queue
  // only once its dependencies have ended, as the executor issues it then.
  bool deferred = false;
  // Device compute stall bookkeeping: host-thread data waits since the previous
  // device Run was issued (they may have delayed this Run's issue).
  double host_wait_before = 0;
  std::string name;
  int32_t op = -1;
  TensorId tensor = kNoTensor;
  uint64_t bytes = 0;
  bool recompute = false;
  bool speculative = false;  // a speculative host AdamW (dropped in a clipped step once the scale is on host)
};

// A change of bytes in use in one tier, at `time` or, when `after` names tasks,
// at the end of the last of them if later.
struct MemChange {
  int tier = 0;
  int64_t delta = 0;
  double time = 0;
  std::vector<int> after;
};

// Timing state of one tensor; where its copies are is the residency machine's.
struct TensorState {
  int fetch_task = -1;        // H2D copy bringing the device copy
  int host_arrival = -1;      // D2H copy, storage read or host op making the host copy valid
  std::vector<int> host_users;  // tasks reading or writing the host buffer
  int host_op_use = -1;       // the last host op reading or writing the host buffer
  int store_task = -1;        // storage write in progress
};

// A device region whose write-back copy has not finished; nothing may reuse it before.
struct PendingRegion {
  uint64_t begin = 0, end = 0;
  int task = -1;
};

class Sim {
 public:
  // passes: steps replayed back to back (2 for simulate_loop_step), each issued from
  // the instant the one before returns.
  Sim(const Program& program, const Plan& plan, const Machine& machine, int passes = 1,
      StepOutcome outcome = StepOutcome::Committed)
      : program_(program),
        plan_(plan),
        machine_(machine),
        passes_(std::max(1, passes)),
        tensors_(program.tensors.size()),
        residency_(program, plan, {.track_placement = false}) {
    clipped_ = outcome == StepOutcome::Clipped;
    speculated_.assign(program.ops.size(), false);
    scale_tensor_ = clip_scale_tensor(program);
  }

  SimResult run() {
    if (Status st = residency_.start(); !st.is_ok()) {
      result_.plan_error = st.message();
      return finish();
    }
    place_home_tensors();
    const size_t n = plan_.instructions.size();
    for (int pass = 0; pass < passes_; ++pass) {
      if (pass > 0) {
        // The next step: the host thread issues it from the instant this one returned;
        // the host ops (and the fetches they defer) still under way go on.
        if (Status st = residency_.finish(); !st.is_ok()) {
          result_.plan_error = "after the step: " + st.message();
          break;
        }
        residency_.begin_step();
        pc_ = 0;
        next_spec_ = 0;
        speculated_.assign(program_.ops.size(), false);
        scale_copy_task_ = -1;
        pass_first_task_ = tasks_.size();
        device_side_open_ = 0;
      }
      run_pass(n, pass + 1 == passes_);
      if (!result_.plan_error.empty()) break;
    }
    return finish();
  }

  // The step calls' returns (return_s of each pass).
  const std::vector<double>& returns() const { return returns_; }
  // The most time one server (compute, host, a link, storage) was busy with the last
  // pass's tasks: steps back to back can come no faster.
  double busiest_server_s() const {
    double busy[kServerCount] = {};
    for (size_t i = pass_first_task_; i < tasks_.size(); ++i) {
      const Task& t = tasks_[i];
      if (t.start >= 0 && t.end >= t.start) busy[t.server] += t.end - t.start;
    }
    return *std::max_element(busy, busy + kServerCount);
  }

 private:
  // Issues the instructions and runs the servers until the step call returns (every
  // instruction issued, the host thread not blocked, and every compute, copy and
  // storage task of this pass ended, but for deferred copies: the executor's
  // finish() waits for the device and the copy and storage engines, not for host ops
  // or the fetches queued behind them) or, for the last pass, until every task ended.
  void run_pass(size_t n, bool last) {
    bool returned = false;
    while (true) {
      // Settle the present instant: the host issues until it must wait, and every
      // server whose next task is ready starts it; repeat while either moves.
      bool moved = true;
      while (moved) {
        moved = false;
        while (pc_ < n && !host_blocked() && result_.plan_error.empty()) {
          // Issued: the residency machine (plan/residency.h) steps; what the
          // instruction did to residency is read from it.
          if (issue(plan_.instructions[pc_])) {
            if (Status st = residency_.apply(pc_, plan_.instructions[pc_]); !st.is_ok()) result_.plan_error = st.message();
            while (next_spec_ < plan_.speculation.size() &&
                   plan_.speculation[next_spec_].after == static_cast<int32_t>(pc_))
              issue_speculation(plan_.speculation[next_spec_++]);
            ++pc_;
          } else if (wait_tasks_.empty()) {
            // Not issued, yet nothing to wait for: the replay cannot go on.
            result_.plan_error = "instruction " + std::to_string(pc_) + " could not be issued and waits for nothing";
          }
          moved = true;
        }
        if (start_ready_tasks()) moved = true;
      }
      if (!returned && pc_ == n && !host_blocked() && device_side_done()) {
        returned = true;
        returns_.push_back(now_);
        if (!last) return;
      }
      int running = 0;
      double next = std::numeric_limits<double>::infinity();
      for (int s = 0; s < kServerCount; ++s) {
        if (running_[s] < 0) continue;
        ++running;
        const Task& t = tasks_[running_[s]];
        next = std::min(next, now_ + t.remaining / current_rate(s));
      }
      if (running == 0) {
        if (!host_blocked()) break;  // every instruction issued and every task ended
        // The host waits for a task that can never start, which a well-formed plan
        // cannot produce (a task depends only on tasks issued before it); release
        // the host rather than loop forever.
        wait_tasks_.clear();
        continue;
      }
      advance_to(next);
    }
    if (!returned) returns_.push_back(now_);
  }

  bool device_side_done() const { return device_side_open_ == 0; }
  // What a step call waits for before it returns: a device-side task of this pass.
  bool holds_return(int id) const {
    const Task& t = tasks_[id];
    return static_cast<size_t>(id) >= pass_first_task_ && t.server != kHost && !t.deferred;
  }

  // ---- host thread ----
  bool host_blocked() {
    if (wait_tasks_.empty()) return false;
    for (int t : wait_tasks_)
      if (!tasks_[t].done) return true;
    // The wait is over.
    if (wait_is_data_) {
      const double waited = now_ - wait_start_;
      if (waited > 0) {
        result_.host_stall_s += waited;
        host_wait_accum_ += waited;
        SimEvent e;
        e.resource = SimResource::Host;
        e.name = "wait " + wait_name_;
        e.start_s = wait_start_;
        e.end_s = now_;
        e.tensor = wait_tensor_;
        result_.timeline.push_back(std::move(e));
      }
    }
    wait_tasks_.clear();
    return false;
  }

  void block_on(std::vector<int> tasks, bool data, TensorId t = kNoTensor) {
    wait_tasks_ = std::move(tasks);
    wait_is_data_ = data;
    wait_start_ = now_;
    wait_tensor_ = t;
    wait_name_ = t == kNoTensor ? "" : program_.tensors.info(t).name;
  }

  bool pending(int task) const { return task >= 0 && !tasks_[task].done; }

  bool valid_tensor(TensorId t) const { return t >= 0 && static_cast<size_t>(t) < tensors_.size(); }

  uint64_t bytes_of(TensorId t) const { return program_.tensors.info(t).bytes(); }

  int add_task(Task t) {
    t.issue = now_;
    t.remaining = t.work;
    tasks_.push_back(std::move(t));
    const int id = static_cast<int>(tasks_.size()) - 1;
    if (holds_return(id)) ++device_side_open_;
    if (tasks_[id].deferred) deferred_.push_back(id);
    else queue_[tasks_[id].server].push_back(id);
    return id;
  }

  // Deferred copies whose dependencies have ended join their queues, in issue order.
  bool enqueue_ready_deferred() {
    bool any = false;
    for (auto it = deferred_.begin(); it != deferred_.end();) {
      bool ready = true;
      for (int d : tasks_[*it].deps) ready = ready && tasks_[d].done;
      if (!ready) {
        ++it;
        continue;
      }
      queue_[tasks_[*it].server].push_back(*it);
      it = deferred_.erase(it);
      any = true;
    }
    return any;
  }

  bool is_host_op(int task) const { return task >= 0 && tasks_[task].server == kHost; }

  void mem(int tier, int64_t delta, std::vector<int> after = {}) {
    changes_.push_back({tier, delta, now_, std::move(after)});
  }

  // The last device Run issued, if it has not ended: copies issued now start after it.
  std::vector<int> after_compute() const {
    if (pending(last_compute_)) return {last_compute_};
    return {};
  }

  // A task that moves all of `tensor`'s bytes on `server` at `rate`, after `deps`.
  int add_transfer(Server server, SimResource resource, double rate, TensorId tensor, std::vector<int> deps,
                   bool deferred = false) {
    Task t;
    t.deferred = deferred;
    t.server = server;
    t.resource = resource;
    t.work = static_cast<double>(bytes_of(tensor));
    t.rate = rate;
    t.deps = std::move(deps);
    t.name = program_.tensors.info(tensor).name;
    t.tensor = tensor;
    t.bytes = bytes_of(tensor);
    return add_task(std::move(t));
  }

  // Starts the D2H copy of t (after every device Run issued so far) into its host
  // buffer, which appears now if t had none; t's device region may not be reused
  // before the copy ends. Returns the copy's task.
  int copy_to_host(TensorId tensor) {
    TensorState& s = tensors_[tensor];
    const uint64_t bytes = bytes_of(tensor);
    const int id = add_transfer(kD2H, SimResource::D2H, machine_.d2h_bytes_per_s, tensor, after_compute());
    if (tensor == scale_tensor_) scale_copy_task_ = id;
    s.host_arrival = id;
    s.host_users.push_back(id);
    const uint64_t offset = residency_.region_offset(tensor);
    regions_.push_back({offset, offset + bytes, id});
    result_.d2h_bytes += bytes;
    return id;
  }

  // t's host buffer is being freed: its range is reused only once `users` (the copies,
  // host ops and store still touching it) are done. The host arena rounds buffers to
  // 4096 bytes.
  static uint64_t host_footprint(uint64_t bytes) { return align_up(std::max<uint64_t>(bytes, 1), 4096); }
  void free_host_range(TensorId tensor, const std::vector<int>& users) {
    const uint64_t begin = residency_.host_offset(tensor), end = begin + host_footprint(bytes_of(tensor));
    for (int task : users)
      if (pending(task)) host_ranges_.push_back({begin, end, task});
  }

  // A device→host copy of t waits (the host thread blocks) for a fetch of t still
  // arriving and for a queued host op still using t's host buffer.
  bool must_wait_to_copy_out(TensorId t) {
    const TensorState& s = tensors_[t];
    if (!pending(s.fetch_task) && !pending(s.host_op_use)) return false;
    block_on({pending(s.fetch_task) ? s.fetch_task : s.host_op_use}, true, t);
    return true;
  }

  // Issues one instruction at now_. Returns false when the host must first wait
  // (the instruction is issued again once the wait is over).
  bool issue(const Instruction& in) {
    if (in.kind == InstrKind::Run) return issue_run(in);
    if (!valid_tensor(in.tensor)) return true;
    TensorState& s = tensors_[in.tensor];
    const uint64_t bytes = bytes_of(in.tensor);
    switch (in.kind) {
      case InstrKind::Allocate:
      case InstrKind::Fetch: {
        std::vector<int> waits;
        for (const PendingRegion& r : regions_)
          if (pending(r.task) && r.begin < in.offset + bytes && in.offset < r.end) waits.push_back(r.task);
        // A host copy still arriving over a link or from storage blocks the host thread;
        // one a queued host op is still writing defers the copy instead (below).
        if (in.kind == InstrKind::Fetch && pending(s.host_arrival) && !is_host_op(s.host_arrival))
          waits.push_back(s.host_arrival);
        if (!waits.empty()) {
          block_on(std::move(waits), true, in.tensor);
          return false;
        }
        std::erase_if(regions_, [&](const PendingRegion& r) { return !pending(r.task); });
        if (!residency_.has_region(in.tensor)) mem(0, static_cast<int64_t>(bytes));
        s.fetch_task = -1;
        if (in.kind == InstrKind::Fetch) {
          std::vector<int> deps = after_compute();
          const bool deferred = pending(s.host_arrival);  // a host op writes the source
          if (deferred) deps.push_back(s.host_arrival);
          s.fetch_task = add_transfer(kH2D, SimResource::H2D, machine_.h2d_bytes_per_s, in.tensor, std::move(deps),
                                      deferred);
          s.host_users.push_back(s.fetch_task);
          result_.h2d_bytes += bytes;
        }
        return true;
      }
      case InstrKind::Evict: {
        if (!residency_.has_region(in.tensor)) return true;
        if (in.write_back) {
          if (must_wait_to_copy_out(in.tensor)) return false;
          const int id = copy_to_host(in.tensor);
          mem(0, -static_cast<int64_t>(bytes), {id});
        } else {
          mem(0, -static_cast<int64_t>(bytes));
        }
        s.fetch_task = -1;
        return true;
      }
      case InstrKind::Flush: {
        if (!residency_.has_region(in.tensor)) return true;
        if (must_wait_to_copy_out(in.tensor)) return false;
        // The device copy stays; should t later leave and its region be reused,
        // the reuse waits for this copy (copy_to_host marks the region).
        copy_to_host(in.tensor);
        return true;
      }
      case InstrKind::Release:
        if (residency_.has_region(in.tensor)) mem(0, -static_cast<int64_t>(bytes));
        s.fetch_task = -1;
        return true;
      case InstrKind::Load: {
        if (pending(s.store_task)) {
          block_on({s.store_task}, true, in.tensor);
          return false;
        }
        const int id = add_transfer(kStorageRead, SimResource::StorageRead, machine_.storage_read_bytes_per_s, in.tensor, {});
        s.host_arrival = id;
        s.host_users.push_back(id);
        result_.storage_read_bytes += bytes;
        return true;
      }
      case InstrKind::Store: {
        if (pending(s.host_arrival)) {
          block_on({s.host_arrival}, true, in.tensor);
          return false;
        }
        const int id = add_transfer(kStorageWrite, SimResource::StorageWrite, machine_.storage_write_bytes_per_s, in.tensor, {});
        if (!residency_.has_extent(in.tensor)) mem(2, static_cast<int64_t>(bytes));
        s.store_task = id;
        result_.storage_write_bytes += bytes;
        if (in.free_host && residency_.has_host_buffer(in.tensor)) {
          std::vector<int> after = s.host_users;
          after.push_back(id);
          free_host_range(in.tensor, after);
          mem(1, -static_cast<int64_t>(bytes), std::move(after));
          s.host_arrival = -1;
          s.host_users.clear();
        } else {
          s.host_users.push_back(id);
        }
        return true;
      }
      case InstrKind::HostAllocate: {
        // The executor's host arena places the buffer at its planned offset, waiting
        // for what still uses that range: a store reading an earlier occupant (this
        // tensor's own or another's), or a copy or host op its release left running.
        std::vector<int> waits;
        if (pending(s.store_task)) waits.push_back(s.store_task);
        const uint64_t end = in.offset + host_footprint(bytes);
        for (const PendingRegion& r : host_ranges_)
          if (pending(r.task) && r.begin < end && in.offset < r.end) waits.push_back(r.task);
        if (!waits.empty()) {
          block_on(std::move(waits), true, in.tensor);
          return false;
        }
        std::erase_if(host_ranges_, [&](const PendingRegion& r) { return !pending(r.task); });
        if (!residency_.has_host_buffer(in.tensor)) mem(1, static_cast<int64_t>(bytes));
        return true;
      }
      case InstrKind::HostRelease:
        if (residency_.has_host_buffer(in.tensor)) {
          free_host_range(in.tensor, s.host_users);
          mem(1, -static_cast<int64_t>(bytes), s.host_users);
        }
        s.host_arrival = -1;
        s.host_users.clear();
        return true;
      case InstrKind::Run: break;
    }
    return true;
  }

  // A speculative host AdamW (plan.h): queued on the host engine once its gradient's
  // host copy has arrived and nothing reads param's host buffer; it writes param
  // there. Its Run later only commits (the step modelled has clipping inactive).
  void issue_speculation(const Speculation& sp) {
    if (sp.op < 0 || static_cast<size_t>(sp.op) >= program_.ops.size()) return;
    const Op& op = program_.ops[static_cast<size_t>(sp.op)];
    const int param_slot = op_slot(OpKind::AdamW, "param"), grad_slot = op_slot(OpKind::AdamW, "grad");
    if (op.kind != OpKind::AdamW || op.place != Place::Host || static_cast<int>(op.operands.size()) <= grad_slot)
      return;
    const TensorId param = op.operands[static_cast<size_t>(param_slot)].tensor;
    const TensorId grad = op.operands[static_cast<size_t>(grad_slot)].tensor;
    if (!valid_tensor(param) || !valid_tensor(grad)) return;
    Task t;
    // Out of place: slower than the in-place update op_seconds times.
    t.work = machine_.op_seconds(program_, static_cast<size_t>(sp.op)) * host_share_while_copying() /
             machine_.host_adam_out_of_place_share;
    t.rate = 1;
    t.name = "speculate " + op.name;
    t.speculative = true;
    t.op = sp.op;
    t.server = kHost;
    t.resource = SimResource::Host;
    if (pending(tensors_[grad].host_arrival)) t.deps.push_back(tensors_[grad].host_arrival);
    for (int u : tensors_[param].host_users)
      if (pending(u) && std::find(t.deps.begin(), t.deps.end(), u) == t.deps.end()) t.deps.push_back(u);
    const int id = add_task(std::move(t));
    for (TensorId x : {param, grad}) {
      tensors_[x].host_users.push_back(id);
      tensors_[x].host_op_use = id;
    }
    tensors_[param].host_arrival = id;
    speculated_[static_cast<size_t>(sp.op)] = true;
    ++result_.speculated_ops;
  }

  bool issue_run(const Instruction& in) {
    if (in.op < 0 || static_cast<size_t>(in.op) >= program_.ops.size()) return true;
    const Op& op = program_.ops[in.op];
    // A device op reading a tensor whose fetch is deferred behind a host op: the host
    // thread waits for that op and then issues the fetch, ahead of the copies issued
    // after this Run (the executor's resolve_deferred).
    if (op.place != Place::Host)
      for (const Operand& o : op.operands) {
        if (!valid_tensor(o.tensor)) continue;
        const int f = tensors_[o.tensor].fetch_task;
        const auto waiting = std::find(deferred_.begin(), deferred_.end(), f);
        if (!pending(f) || waiting == deferred_.end()) continue;
        std::vector<int> host_ops;
        for (int d : tasks_[f].deps)
          if (pending(d)) host_ops.push_back(d);
        if (!host_ops.empty()) {
          block_on(std::move(host_ops), true, o.tensor);
          return false;
        }
        deferred_.erase(waiting);
        queue_[tasks_[f].server].push_back(f);
      }
    Task t;
    t.work = machine_.op_seconds(program_, static_cast<size_t>(in.op));
    if (!in.recompute && speculated_[static_cast<size_t>(in.op)]) {
      if (clipped_) {
        t.name = "redo " + op.name;  // the scale is not 1: the update again, from the first buffers
      } else {
        t.work = 0;  // a commit
        t.name = "commit " + op.name;
      }
    }
    t.rate = 1;
    if (t.name.empty()) t.name = in.recompute ? "recompute " + op.name : op.name;
    t.op = in.op;
    t.recompute = in.recompute;
    if (in.recompute) ++result_.recomputed_ops;
    for (const Operand& o : op.operands) {
      if (!valid_tensor(o.tensor)) continue;
      const TensorState& s = tensors_[o.tensor];
      const int dep = op.place == Place::Host ? s.host_arrival : s.fetch_task;
      if (pending(dep) && std::find(t.deps.begin(), t.deps.end(), dep) == t.deps.end()) t.deps.push_back(dep);
    }
    if (op.place == Place::Host) {
      // op_seconds times host ops at the rate while copies run; alone they run at
      // host_adam_params_per_s_alone (current_rate switches between the two).
      t.work *= host_share_while_copying();
      t.server = kHost;
      t.resource = SimResource::Host;
      const int id = add_task(std::move(t));
      // The host engine runs it; the host thread goes on. What it writes is valid on
      // host once it ends, and its buffers stay in use until then.
      for (const Operand& o : op.operands) {
        if (!valid_tensor(o.tensor)) continue;
        TensorState& s = tensors_[o.tensor];
        s.host_users.push_back(id);
        s.host_op_use = id;
        if (o.access != Access::Read) s.host_arrival = id;
      }
      return true;
    }
    t.server = kCompute;
    t.resource = SimResource::Compute;
    t.host_wait_before = host_wait_accum_;
    host_wait_accum_ = 0;
    const int id = add_task(std::move(t));
    last_compute_ = id;
    if (!machine_.host_runs_ahead) block_on({id}, false);
    return true;
  }

  // ---- servers ----
  double current_rate(int server) const {
    const Task& t = tasks_[running_[server]];
    if (server == kStorageRead || server == kStorageWrite) {
      const bool both = running_[kStorageRead] >= 0 && running_[kStorageWrite] >= 0;
      return both ? t.rate * machine_.storage_duplex_factor : t.rate;
    }
    if (server == kH2D || server == kD2H) {
      double rate = t.rate;
      if ((server == kH2D && running_[kD2H] >= 0) || (server == kD2H && running_[kH2D] >= 0))
        rate *= machine_.duplex_factor;
      if (running_[kCompute] >= 0) rate *= machine_.copy_share_while_computing;
      if (running_[kHost] >= 0) rate *= machine_.copy_share_while_host_computes;
      return rate;
    }
    double rate = t.rate;
    const bool copying = running_[kH2D] >= 0 || running_[kD2H] >= 0;
    if (server == kCompute) {
      if (copying) rate *= machine_.compute_share_while_copying;
      if (running_[kHost] >= 0) rate *= machine_.compute_share_while_host_computes;
    } else if (server == kHost) {
      // The profile measured the host optimizer beside copies both ways at once; one
      // direction takes about half that memory bandwidth from it.
      const int directions = (running_[kH2D] >= 0) + (running_[kD2H] >= 0);
      if (copying) rate *= 1.0 - (1.0 - host_share_while_copying()) * directions / 2.0;
      if (running_[kCompute] >= 0) rate *= machine_.host_share_while_computing;
    }
    return rate;
  }

  // The host optimizer's speed while host⇄device copies run over its speed alone
  // (they share the host's memory bandwidth): 1 when the machine gives no alone rate.
  double host_share_while_copying() const {
    const double alone = machine_.host_adam_params_per_s_alone;
    if (!(alone > 0) || !(machine_.host_adam_params_per_s > 0)) return 1.0;
    return std::min(1.0, machine_.host_adam_params_per_s / alone);
  }

  // Starts the head task of every idle server whose dependencies have ended.
  // Returns whether any task started.
  bool start_ready_tasks() {
    bool any = false;
    bool changed = true;
    while (changed) {
      changed = enqueue_ready_deferred();
      for (int s = 0; s < kServerCount; ++s) {
        if (running_[s] >= 0 || queue_[s].empty()) continue;
        const int id = queue_[s].front();
        Task& t = tasks_[id];
        bool ready = true;
        for (int d : t.deps) ready = ready && tasks_[d].done;
        if (!ready) continue;
        queue_[s].pop_front();
        t.start = now_;
        // A clipped step's speculation that starts after the scale reached host is
        // dropped (the executor's clipping_known_active).
        if (clipped_ && t.speculative && scale_copy_task_ >= 0 && tasks_[scale_copy_task_].done) {
          t.remaining = 0;
          t.name = "dropped " + t.name;
        }
        on_start(t);
        if (t.remaining <= 0 || t.rate <= 0 || !std::isfinite(t.rate)) {
          complete(id);  // nothing to do, or a resource with no rate given: takes no time
        } else {
          running_[s] = id;
        }
        changed = any = true;
      }
    }
    return any;
  }

  void on_start(const Task& t) {
    if (t.server == kCompute) {
      const double ready = std::max(t.issue, last_compute_end_);
      const double data_wait = t.start - ready;
      const double issue_gap = std::max(0.0, t.issue - last_compute_end_);
      const double stall = std::max(0.0, data_wait) + std::min(issue_gap, t.host_wait_before);
      if (first_compute_) {
        result_.initial_wait_s += stall;
        first_compute_ = false;
      } else {
        result_.stall_s += stall;
      }
      result_.compute_s += t.work;
    } else if (t.server == kHost) {
      // Waiting for data, not for the host op queued before it.
      const double waited = std::max(0.0, t.start - std::max(t.issue, last_host_end_));
      result_.host_stall_s += waited;
      result_.host_compute_s += t.work;
    }
  }

  void complete(int id) {
    Task& t = tasks_[id];
    if (!t.done && holds_return(id)) --device_side_open_;
    t.done = true;
    t.remaining = 0;
    t.end = now_;
    if (t.server == kCompute) last_compute_end_ = now_;
    if (t.server == kHost) last_host_end_ = now_;
    if (running_[t.server] == id) running_[t.server] = -1;
  }

  void advance_to(double next) {
    const double dt = next - now_;
    // Rates are fixed between events: read them all before anything ends.
    double rates[kServerCount] = {};
    for (int s = 0; s < kServerCount; ++s)
      if (running_[s] >= 0) rates[s] = current_rate(s);
    const double tolerance = 1e-12 * std::max(1.0, next);
    const double before = now_;
    now_ = next;
    for (int s = 0; s < kServerCount; ++s) {
      if (running_[s] < 0) continue;
      const int id = running_[s];
      Task& t = tasks_[id];
      const double finish = before + t.remaining / rates[s];
      t.remaining = std::max(0.0, t.remaining - rates[s] * dt);
      if (finish <= next + tolerance) complete(id);
    }
  }

  // ---- start and end of the step ----
  // Bytes in use at the start of the step: persistent tensors at home (the residency
  // machine placed them), and host mirrors, which keep their buffers for the run.
  void place_home_tensors() {
    for (size_t i = 0; i < tensors_.size(); ++i) {
      const auto t = static_cast<TensorId>(i);
      const auto bytes = static_cast<int64_t>(program_.tensors.info(t).bytes());
      if (residency_.has_region(t)) mem(0, bytes);
      if (residency_.has_host_buffer(t)) mem(1, bytes);
      if (residency_.has_extent(t)) mem(2, bytes);
    }
  }

  SimResult finish() {
    double end = now_;
    for (const Task& t : tasks_) {
      end = std::max(end, t.end);
      if (t.start < 0) continue;
      SimEvent e;
      e.resource = t.resource;
      e.name = t.name;
      e.start_s = t.start;
      e.end_s = t.end;
      e.op = t.op;
      e.tensor = t.tensor;
      e.bytes = t.bytes;
      e.recompute = t.recompute;
      result_.timeline.push_back(std::move(e));
    }
    result_.step_s = end;
    std::stable_sort(result_.timeline.begin(), result_.timeline.end(),
                     [](const SimEvent& a, const SimEvent& b) { return a.start_s < b.start_s; });

    for (MemChange& c : changes_)
      for (int t : c.after) c.time = std::max(c.time, tasks_[t].end);
    // Changes at one instant keep their issue order (plan order): a region freed by
    // a copy that ends just as a later Allocate takes it is freed first, and bytes
    // allocated and released at one instant still count toward the peak.
    std::stable_sort(changes_.begin(), changes_.end(),
                     [](const MemChange& a, const MemChange& b) { return a.time < b.time; });
    int64_t in_use[kTierCount] = {0, 0, 0};
    int64_t peak[kTierCount] = {0, 0, 0};
    for (size_t i = 0; i < changes_.size(); ++i) {
      const int tier = changes_[i].tier;
      in_use[tier] += changes_[i].delta;
      peak[tier] = std::max(peak[tier], in_use[tier]);
      const bool last_at_time = i + 1 == changes_.size() || changes_[i + 1].time != changes_[i].time;
      if (!last_at_time) continue;
      MemorySample m;
      m.t_s = changes_[i].time;
      m.device_bytes = static_cast<uint64_t>(std::max<int64_t>(0, in_use[0]));
      m.host_bytes = static_cast<uint64_t>(std::max<int64_t>(0, in_use[1]));
      m.storage_bytes = static_cast<uint64_t>(std::max<int64_t>(0, in_use[2]));
      result_.memory.push_back(m);
    }
    result_.peak_device_bytes = static_cast<uint64_t>(peak[0]);
    result_.peak_host_bytes = static_cast<uint64_t>(peak[1]);
    result_.peak_storage_bytes = static_cast<uint64_t>(peak[2]);
    if (result_.memory.empty() || result_.memory.front().t_s > 0) result_.memory.insert(result_.memory.begin(), MemorySample{});
    return std::move(result_);
  }

  const Program& program_;
  const Plan& plan_;
  const Machine& machine_;
  int passes_ = 1;
  size_t pass_first_task_ = 0;  // the first task of the pass being replayed
  int device_side_open_ = 0;     // this pass's device-side tasks not yet ended (holds_return)
  std::vector<double> returns_;  // [passes] when each step call returned
  std::vector<TensorState> tensors_;
  std::vector<Task> tasks_;
  std::deque<int> queue_[kServerCount];
  std::vector<int> deferred_;  // deferred copies not yet in their queue, in issue order
  int running_[kServerCount] = {-1, -1, -1, -1, -1, -1};
  std::vector<PendingRegion> regions_;
  std::vector<PendingRegion> host_ranges_;  // host buffers freed while still in use (HostAllocate waits)
  std::vector<MemChange> changes_;
  double now_ = 0;
  size_t pc_ = 0;
  // host thread wait
  std::vector<int> wait_tasks_;
  bool wait_is_data_ = false;
  double wait_start_ = 0;
  TensorId wait_tensor_ = kNoTensor;
  std::string wait_name_;
  double host_wait_accum_ = 0;
  // device compute
  int last_compute_ = -1;
  double last_compute_end_ = 0;
  bool first_compute_ = true;
  // host engine
  double last_host_end_ = 0;
  size_t next_spec_ = 0;               // the next entry of plan_.speculation to issue
  bool clipped_ = false;               // StepOutcome::Clipped: speculations are redone, late ones dropped
  TensorId scale_tensor_ = kNoTensor;  // the AdamW ops' clip scale
  int scale_copy_task_ = -1;           // this pass's copy of the scale to host
  std::vector<bool> speculated_;       // [ops] its speculative update was issued
  ResidencyMachine residency_;  // where each tensor's copies are (plan/residency.h)
  SimResult result_;
};

}  // namespace

SimResult simulate(const Program& program, const Plan& plan, const Machine& machine, StepOutcome outcome) {
  Sim sim(program, plan, machine, 1, outcome);
  SimResult r = sim.run();
  r.return_s = sim.returns().empty() ? r.step_s : sim.returns().front();
  return r;
}

double simulate_loop_step(const Program& program, const Plan& plan, const Machine& machine, StepOutcome outcome) {
  Sim sim(program, plan, machine, 2, outcome);
  const SimResult r = sim.run();
  const std::vector<double>& at = sim.returns();
  if (!r.plan_error.empty() || at.size() < 2) return r.step_s;
  // Two steps show how much of one step's tail the next hides; a server busier than
  // that in every step would make later steps wait for it.
  return std::max(at[1] - at[0], sim.busiest_server_s());
}

double Simulator::op_seconds(const Program& program, size_t op_index) const {
  return machine_.op_seconds(program, op_index);
}

double Simulator::copy_seconds(uint64_t bytes, bool h2d) const { return machine_.copy_seconds(bytes, h2d); }

double Simulator::duplex_copy_seconds(double bytes) const {
  return bytes / (std::min(machine_.h2d_bytes_per_s, machine_.d2h_bytes_per_s) * machine_.duplex_factor);
}

double Simulator::host_adam_seconds(double params) const { return params / machine_.host_adam_params_per_s; }

// The planner ranks by the step alone, its host tail paid within it: ranked by steps
// back to back, it chose plans with more host AdamW for gpt2-1.5b and gpt-2.7b at
// accum 1, which ran 2-28% slower on the H100 (bench/RESULTS.md, 2026-12-06): their
// steps with clipping active hid less of that tail than the loop predicted.
double Simulator::step_seconds(const Program& program, const Plan& plan) const { return run(program, plan).step_s; }

Trace trace_from_simulation(const SimResult& sim) {
  Trace trace;
  for (const SimEvent& e : sim.timeline) {
    nlohmann::json args = nlohmann::json::object();
    if (e.op >= 0) args["op"] = e.op;
    if (e.tensor != kNoTensor) args["tensor"] = e.tensor;
    if (e.bytes > 0) args["bytes"] = e.bytes;
    if (e.recompute) args["recompute"] = true;
    // The host thread's waits get a track of their own: host ops run beside them.
    const bool wait = e.resource == SimResource::Host && e.name.starts_with("wait ");
    trace.slice(wait ? "executor waits" : sim_resource_name(e.resource), e.name, e.start_s, e.end_s, std::move(args));
  }
  for (const MemorySample& m : sim.memory) {
    trace.counter("device bytes", m.t_s, static_cast<double>(m.device_bytes));
    trace.counter("host bytes", m.t_s, static_cast<double>(m.host_bytes));
    trace.counter("storage bytes", m.t_s, static_cast<double>(m.storage_bytes));
  }
  return trace;
}

// ---- report ----

PlanReport summarize(const Program& program, const Plan& plan, const SimResult& sim) {
  PlanReport r;
  r.policy = plan.policy;
  r.description = plan.description;
  r.instructions = plan.instructions.size();
  const size_t n = program.tensors.size();
  std::vector<int> lowest(n, 0);  // lowest tier each tensor is written to
  std::vector<bool> moved(n, false), recomputed(n, false);
  for (const Instruction& in : plan.instructions) {
    if (in.kind == InstrKind::Run) {
      if (!in.recompute || in.op < 0 || static_cast<size_t>(in.op) >= program.ops.size()) continue;
      for (const Operand& o : program.ops[in.op].operands)
        if (o.access != Access::Read && o.tensor >= 0 && static_cast<size_t>(o.tensor) < n) recomputed[o.tensor] = true;
      continue;
    }
    if (in.tensor < 0 || static_cast<size_t>(in.tensor) >= n) continue;
    switch (in.kind) {
      case InstrKind::Fetch:
      case InstrKind::Flush:
      case InstrKind::Load:
        moved[in.tensor] = true;
        break;
      case InstrKind::Evict:
        if (in.write_back) {
          moved[in.tensor] = true;
          lowest[in.tensor] = std::max(lowest[in.tensor], 1);
        }
        break;
      case InstrKind::Store:
        moved[in.tensor] = true;
        lowest[in.tensor] = 2;
        break;
      default: break;
    }
  }
  std::vector<RoleReport> by_role(static_cast<size_t>(Role::Input) + 1);
  for (size_t i = 0; i < by_role.size(); ++i) by_role[i].role = static_cast<Role>(i);
  for (size_t i = 0; i < n; ++i) {
    const TensorInfo& info = program.tensors.info(static_cast<TensorId>(i));
    RoleReport& rr = by_role[static_cast<size_t>(info.role)];
    const uint64_t bytes = info.bytes();
    const int tier = is_persistent(info.role) && i < plan.home.size() ? static_cast<int>(plan.home[i]) : lowest[i];
    rr.tensors++;
    rr.bytes += bytes;
    rr.count[tier]++;
    rr.tier_bytes[tier] += bytes;
    if (moved[i]) {
      rr.moved++;
      rr.moved_bytes += bytes;
    }
    if (recomputed[i]) {
      rr.recomputed++;
      rr.recomputed_bytes += bytes;
    }
  }
  for (const RoleReport& rr : by_role)
    if (rr.tensors > 0) r.roles.push_back(rr);
  r.peak_device_bytes = sim.peak_device_bytes;
  r.peak_host_bytes = sim.peak_host_bytes;
  r.peak_storage_bytes = sim.peak_storage_bytes;
  r.plan_device_bytes = plan.device_bytes;
  r.plan_host_bytes = plan.host_bytes;
  r.plan_storage_bytes = plan.storage_bytes;
  r.h2d_bytes = sim.h2d_bytes;
  r.d2h_bytes = sim.d2h_bytes;
  r.storage_read_bytes = sim.storage_read_bytes;
  r.storage_write_bytes = sim.storage_write_bytes;
  r.step_s = sim.step_s;
  r.compute_s = sim.compute_s;
  r.host_compute_s = sim.host_compute_s;
  r.stall_s = sim.stall_s;
  r.host_stall_s = sim.host_stall_s;
  r.recomputed_ops = sim.recomputed_ops;
  return r;
}

namespace {

std::string count_and_bytes(int count, uint64_t bytes) {
  if (count == 0) return "-";
  return std::to_string(count) + " " + format_size(bytes);
}

std::string seconds(double s) {
  char buf[32];
  if (s >= 1) std::snprintf(buf, sizeof buf, "%.3f s", s);
  else if (s >= 1e-3) std::snprintf(buf, sizeof buf, "%.3f ms", s * 1e3);
  else std::snprintf(buf, sizeof buf, "%.1f us", s * 1e6);
  return buf;
}

}  // namespace

std::string format_report(const PlanReport& r) {
  std::vector<std::vector<std::string>> rows;
  rows.push_back({"role", "tensors", "bytes", "device", "host", "storage", "moved", "recomputed"});
  for (const RoleReport& rr : r.roles) {
    rows.push_back({role_name(rr.role), std::to_string(rr.tensors), format_size(rr.bytes),
                    count_and_bytes(rr.count[0], rr.tier_bytes[0]), count_and_bytes(rr.count[1], rr.tier_bytes[1]),
                    count_and_bytes(rr.count[2], rr.tier_bytes[2]), count_and_bytes(rr.moved, rr.moved_bytes),
                    count_and_bytes(rr.recomputed, rr.recomputed_bytes)});
  }
  std::vector<size_t> width(rows[0].size(), 0);
  for (const auto& row : rows)
    for (size_t c = 0; c < row.size(); ++c) width[c] = std::max(width[c], row[c].size());
  std::ostringstream out;
  out << "plan: " << policy_name(r.policy) << ", " << r.instructions << " instructions";
  if (!r.description.empty()) out << " (" << r.description << ")";
  out << "\n";
  for (const auto& row : rows) {
    for (size_t c = 0; c < row.size(); ++c) {
      const bool numeric = c == 1 || c == 2;
      const std::string pad(width[c] - row[c].size(), ' ');
      out << (c == 0 ? "" : "  ") << (numeric ? pad + row[c] : row[c] + (c + 1 == row.size() ? "" : pad));
    }
    out << "\n";
  }
  out << "memory peak: device " << format_size(r.peak_device_bytes) << " (plan " << format_size(r.plan_device_bytes)
      << "), host " << format_size(r.peak_host_bytes) << ", storage " << format_size(r.peak_storage_bytes) << "\n";
  out << "per step: h2d " << format_size(r.h2d_bytes) << ", d2h " << format_size(r.d2h_bytes) << ", storage read "
      << format_size(r.storage_read_bytes) << ", storage write " << format_size(r.storage_write_bytes) << "\n";
  if (r.loop_step_s > 0)
    out << "predicted step " << seconds(r.loop_step_s) << " back to back (a step alone " << seconds(r.step_s) << ")";
  else
    out << "predicted step " << seconds(r.step_s);
  out << ": compute " << seconds(r.compute_s) << ", stalls " << seconds(r.stall_s) << ", host ops "
      << seconds(r.host_compute_s) << ", host waits " << seconds(r.host_stall_s);
  if (r.recomputed_ops > 0) out << ", " << r.recomputed_ops << " ops recomputed";
  out << "\n";
  return out.str();
}

}  // namespace spillway
