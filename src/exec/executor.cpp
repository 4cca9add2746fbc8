#include "exec/executor.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <memory>
#include <chrono>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>

#include "core/clock.h"
#include "core/size.h"
#include "exec/dispatch.h"
#include "exec/host_queue.h"
#include "plan/residency.h"
#include "exec/spill.h"
#include "exec/trace.h"
#include "core/thread_pool.h"
#include "memory/device_arena.h"
#include "memory/host_pool.h"
#include "optim/adamw.h"
#include "program/op_registry.h"

namespace spillway {

namespace {

using Clock = std::chrono::steady_clock;

// A region the caller gives for `need` bytes of `what` (ExecutorOptions::external_host,
// external_speculation): 4096-aligned and large enough, else an error naming it.
Status check_region(const HostRegion& region, uint64_t need, const char* what, const char* name) {
  if (reinterpret_cast<uintptr_t>(region.base) % 4096 != 0)
    return Status::invalid_argument(std::string("executor: the ") + name + " given is not aligned to 4096 bytes");
  if (need > region.bytes)
    return Status::invalid_argument("executor: the plan needs " + format_size(need) + " (" + std::to_string(need) +
                                    " bytes) of " + what + "; the " + name + " given holds " +
                                    format_size(region.bytes));
  return Status::ok();
}

class PlanExecutor final : public Executor {
 public:
  PlanExecutor(Backend& backend, const Program& program, const Plan& plan, const ExecutorOptions& options)
      : b_(backend), p_(program), plan_(plan), opt_(options), residency_(program, plan_, {.track_placement = false}) {
    slots_.resize(program.tensors.size());
  }

  ~PlanExecutor() override {
    (void)host_.wait_all();
    (void)resolve_all_deferred();
    (void)b_.synchronize();
    (void)b_.copy_engine().wait_all();
    if (spill_) (void)spill_->wait_all();
    host_arena_.reset();
    if (host_memory_ && owns_host_) b_.host_free(host_memory_);
    if (owns_spec_) std::free(spec_memory_);
    arena_.reset();
    if (workspace_) b_.set_workspace(nullptr, 0);
    if (arena_memory_ && owns_device_) b_.device_free(arena_memory_);
  }

  Status init() {
    SPILLWAY_RETURN_IF_ERROR(host_.start());
    // Every op's workspace must fit in what the plan reserved inside the budget.
    SPILLWAY_ASSIGN_OR_RETURN(WorkspaceNeed need, program_workspace(b_, p_));
    if (need.bytes > plan_.workspace_bytes)
      return Status::internal("op " + need.op + " needs " + format_size(need.bytes) + " (" +
                                      std::to_string(need.bytes) + " bytes) of device workspace on the " + b_.name() +
                                      " backend, but the plan reserves " + format_size(plan_.workspace_bytes) +
                                      "; plan with PlannerOptions::workspace_bytes = program_workspace(...).bytes");
    // One block: the arena, then the workspace.
    const size_t align = b_.alignment();
    const uint64_t arena_bytes = std::max<uint64_t>(plan_.device_bytes, align);
    workspace_offset_ = align_up(arena_bytes, align);
    device_total_ = workspace_offset_ + plan_.workspace_bytes;
    if (opt_.external_device.base) {
      if (reinterpret_cast<uintptr_t>(opt_.external_device.base) % align != 0)
        return Status::invalid_argument("executor: the device region given is not aligned to " + std::to_string(align) +
                                        " bytes");
      if (device_total_ > opt_.external_device.bytes)
        return Status::invalid_argument("executor: the plan needs " + format_size(device_total_) + " (" +
                                        std::to_string(device_total_) + " bytes: arena " + format_size(arena_bytes) +
                                        ", workspace " + format_size(plan_.workspace_bytes) +
                                        ") of device memory; the region given holds " +
                                        format_size(opt_.external_device.bytes));
      arena_memory_ = opt_.external_device.base;
      owns_device_ = false;
    } else {
      SPILLWAY_ASSIGN_OR_RETURN(arena_memory_, b_.device_alloc(device_total_));
      owns_device_ = true;
    }
    if (plan_.workspace_bytes > 0) workspace_ = static_cast<char*>(arena_memory_) + workspace_offset_;
    arena_ = std::make_unique<DeviceArena>(arena_memory_, arena_bytes, align);
    used_since_sync_.assign(arena_bytes / kUseGranule + 1, 0);
    // A plan that moves nothing between tiers and runs no op on host: no copy or host
    // op of a later step can touch memory behind the compute queue, so a step may end
    // with the device's optimizer updates still running (finish).
    moves_nothing_ = std::none_of(plan_.instructions.begin(), plan_.instructions.end(), [](const Instruction& in) {
      return in.kind == InstrKind::Fetch || in.kind == InstrKind::Evict || in.kind == InstrKind::Flush ||
             in.kind == InstrKind::Load || in.kind == InstrKind::Store;
    }) && std::find(plan_.op_place.begin(), plan_.op_place.end(), Place::Host) == plan_.op_place.end();
    for (size_t i = 0; i < slots_.size(); ++i) {
      auto t = static_cast<TensorId>(i);
      if (p_.is_persistent(t) && plan_.home[i] == Tier::Device)
        home_end_ = std::max<uint64_t>(home_end_, align_up(plan_.home_offset[i] + device_bytes(t), align));
    }
    // The host arena: one pinned allocation holding every host buffer at the offset
    // the plan gave it (4096-aligned: storage I/O uses O_DIRECT).
    const uint64_t host_bytes = plan_.host_arena_bytes();
    if (host_bytes > opt_.host_budget)
      return Status::out_of_memory("the plan needs " + format_size(host_bytes) + " of host memory, above the host budget " +
                                   format_size(opt_.host_budget));
    if (opt_.external_host.base) {
      SPILLWAY_RETURN_IF_ERROR(check_region(opt_.external_host, host_bytes, "host arena", "host region"));
      host_memory_ = opt_.external_host.base;
      owns_host_ = false;
    } else {
      SPILLWAY_ASSIGN_OR_RETURN(host_memory_, b_.host_alloc(host_bytes));
      owns_host_ = true;
    }
    host_arena_ = std::make_unique<DeviceArena>(host_memory_, host_bytes, 4096);
    // Host-homed state starts zeroed: the whole arena, in parallel (tens of GiB for
    // a large model; one thread would take most of the time to the first step).
    parallel_zero(global_thread_pool(), host_memory_, host_bytes);
    bool uses_storage = plan_.storage_bytes > 0;
    if (uses_storage) {
      if (opt_.spill_dir.empty())
        return Status::invalid_argument("this plan spills " + format_size(plan_.storage_bytes) +
                                        " to storage; give --spill-dir DIR");
      uint64_t budget = opt_.storage_budget ? opt_.storage_budget : align_up(plan_.storage_bytes, 1 << 20) * 2;
      SPILLWAY_ASSIGN_OR_RETURN(spill_, SpillStore::open(opt_.spill_dir, budget, opt_.storage_engine,
                                                         opt_.storage_engine_maker));
    }
    // Persistent tensors start at home, zero-filled.
    for (size_t i = 0; i < slots_.size(); ++i) {
      auto t = static_cast<TensorId>(i);
      if (!p_.is_persistent(t)) continue;
      const size_t bytes = p_.tensors.info(t).bytes();
      switch (plan_.home[i]) {
        case Tier::Device: {
          SPILLWAY_RETURN_IF_ERROR(place(t, plan_.home_offset[i]));
          b_.fill_zero(slots_[i].device, bytes);
          break;
        }
        case Tier::Host: {
          SPILLWAY_RETURN_IF_ERROR(place_host(t, plan_.home_host_offset[i]));  // zeroed above
          break;
        }
        case Tier::Storage: {
          std::vector<char> zeros(bytes, 0);
          SPILLWAY_RETURN_IF_ERROR(spill_->write_sync(t, zeros.data(), bytes));
          break;
        }
      }
    }
    // Host mirrors keep their buffers for the whole run (Plan::host_mirror).
    for (size_t i = 0; i < plan_.host_mirror.size() && i < slots_.size(); ++i)
      if (plan_.host_mirror[i]) SPILLWAY_RETURN_IF_ERROR(place_host(static_cast<TensorId>(i), plan_.home_host_offset[i]));
    SPILLWAY_RETURN_IF_ERROR(init_speculation(host_bytes));
    carried_.assign(p_.ops.size(), false);
    for (int32_t op : plan_.carried) {
      if (op < 0 || static_cast<size_t>(op) >= p_.ops.size() || p_.ops[static_cast<size_t>(op)].kind != OpKind::AdamW)
        return Status::internal("executor: carried update of op " + std::to_string(op) + ", not an AdamW of the program");
      carried_[static_cast<size_t>(op)] = true;
    }
    // The residency machine starts where the memory now is: state valid at home.
    SPILLWAY_RETURN_IF_ERROR(residency_.start());
    // Every extent a step will store into is reserved now (the store fallocates it), so
    // a disk too small is found here, before any step, never halfway through one
    // with the training state half updated.
    if (spill_)
      for (const Instruction& in : plan_.instructions)
        if (in.kind == InstrKind::Store)
          SPILLWAY_RETURN_IF_ERROR(spill_->reserve(in.tensor, p_.tensors.info(in.tensor).bytes()));
    return b_.synchronize();
  }

  Status write_tensor(TensorId t, const void* src, size_t bytes) override {
    SPILLWAY_RETURN_IF_ERROR(check_tensor(t, bytes, "write_tensor"));
    if (!p_.is_persistent(t))
      return Status::invalid_argument("write_tensor: " + p_.tensors.info(t).name +
                                      " is not an input or state tensor; only those are set between steps");
    SPILLWAY_RETURN_IF_ERROR(settle(t));
    Slot& s = slots_[t];
    switch (plan_.home[t]) {
      case Tier::Device:
        SPILLWAY_RETURN_IF_ERROR(b_.upload(s.device, src, bytes));
        break;
      case Tier::Host:
        parallel_memcpy(global_thread_pool(), host_ptr(t), src, bytes);
        break;
      case Tier::Storage:
        SPILLWAY_RETURN_IF_ERROR(spill_->write_sync(t, src, bytes));
        break;
    }
    return residency_.write_at_home(t);
  }

  Status read_tensor(TensorId t, void* dst, size_t bytes) override {
    SPILLWAY_RETURN_IF_ERROR(check_tensor(t, bytes, "read_tensor"));
    SPILLWAY_RETURN_IF_ERROR(settle(t, /*for_write=*/false));
    Slot& s = slots_[t];
    if (residency_.valid(t, Tier::Device) && s.device) return b_.download(dst, s.device, bytes);
    if (residency_.valid(t, Tier::Host) && s.host) {
      parallel_memcpy(global_thread_pool(), dst, host_ptr(t), bytes);
      return Status::ok();
    }
    if (residency_.valid(t, Tier::Storage) && spill_) return spill_->read_sync(t, dst, bytes);
    return Status::invalid_argument("read_tensor: " + p_.tensors.info(t).name +
                                    " holds no value between steps (it lives only inside a step)");
  }

  Result<const void*> host_value(TensorId t) override {
    if (t < 0 || static_cast<size_t>(t) >= slots_.size())
      return Status::invalid_argument("host_value: no tensor with id " + std::to_string(t));
    SPILLWAY_RETURN_IF_ERROR(settle(t, /*for_write=*/false));
    const Slot& s = slots_[t];
    if (residency_.valid(t, Tier::Host) && s.host) return static_cast<const void*>(host_ptr(t));
    return static_cast<const void*>(nullptr);
  }

  Result<const void*> device_value(TensorId t) override {
    if (t < 0 || static_cast<size_t>(t) >= slots_.size())
      return Status::invalid_argument("device_value: no tensor with id " + std::to_string(t));
    SPILLWAY_RETURN_IF_ERROR(settle(t, /*for_write=*/false));
    const Slot& s = slots_[t];
    if (residency_.valid(t, Tier::Device) && s.device && !(residency_.valid(t, Tier::Host) && s.host))
      return static_cast<const void*>(s.device);
    return static_cast<const void*>(nullptr);
  }

  Status submit_host_reader(const std::vector<TensorId>& tensors, std::function<Status()> job) override {
    for (TensorId t : tensors)
      if (t < 0 || static_cast<size_t>(t) >= slots_.size())
        return Status::invalid_argument("submit_host_reader: no tensor with id " + std::to_string(t));
    const uint64_t ticket = host_.submit(std::move(job));
    for (TensorId t : tensors) slots_[t].host_job_use = ticket;  // the newest job: FIFO, so it covers earlier ones
    return Status::ok();
  }

  Status hold_device_reader(TensorId t, CopyTicket reader) override {
    if (t < 0 || static_cast<size_t>(t) >= slots_.size())
      return Status::invalid_argument("hold_device_reader: no tensor with id " + std::to_string(t));
    if (reader.direction != CopyDirection::DeviceToHost)
      return Status::invalid_argument("hold_device_reader: " + p_.tensors.info(t).name +
                                      ": expected a device-to-host copy ticket");
    Slot& s = slots_[t];
    if (!s.device || !residency_.valid(t, Tier::Device))
      return Status::invalid_argument("hold_device_reader: " + p_.tensors.info(t).name + " has no valid device copy");
    // Copies of one direction complete in order: the later ticket covers the earlier.
    if (!s.to_host || s.to_host->sequence < reader.sequence) s.to_host = reader;
    return Status::ok();
  }

  Status run_step(const StepContext& ctx) override {
    // A failed step leaves tensors half moved: the state is no longer trustworthy.
    if (!failure_.is_ok())
      return Status(failure_.code(), "a previous step failed, so the training state is not run again: " + failure_.message());
    metrics_ = StepMetrics();
    step_ = OptimizerStep{ctx.step, ctx.lr};
    // Another executor may have used the backend since this one's last step.
    b_.set_workspace(workspace_, workspace_ ? plan_.workspace_bytes : 0);
    arena_->reset_peak();
    host_arena_->reset_peak();
    const uint64_t h2d0 = b_.copy_engine().bytes_copied(CopyDirection::HostToDevice);
    const uint64_t d2h0 = b_.copy_engine().bytes_copied(CopyDirection::DeviceToHost);
    const uint64_t sr0 = spill_ ? spill_->bytes_read() : 0, sw0 = spill_ ? spill_->bytes_written() : 0;
    step_start_ = Clock::now();
    residency_.begin_step();
    next_spec_ = 0;
    for (SpecBuffers& sp : spec_) sp.queued = false;
    decide_speculation();
    step_serial_++;
    Status st = run_instructions();
    metrics_.issue_s = seconds_since(step_start_);
    if (st.is_ok()) st = finish();
    // The carried updates in this step's Runs were the last step's; this step's own
    // are owed now, to the next step or to drain().
    if (st.is_ok()) {
      carried_step_ = step_;
      carried_owed_ = !plan_.carried.empty();
    }
    if (!st.is_ok()) {
      failure_ = st;
      quiesce_after_failure();
      return st;
    }
    metrics_.step_s = seconds_since(step_start_);
    // finish() synchronized the device: every probe of this step has completed.
    {
      auto stalled = b_.take_stall_seconds();
      if (!stalled.ok()) {
        failure_ = stalled.status();
        return failure_;
      }
      metrics_.stall_s = *stalled;
    }
    metrics_.h2d_bytes = b_.copy_engine().bytes_copied(CopyDirection::HostToDevice) - h2d0;
    metrics_.d2h_bytes = b_.copy_engine().bytes_copied(CopyDirection::DeviceToHost) - d2h0;
    if (spill_) {
      metrics_.storage_read_bytes = spill_->bytes_read() - sr0;
      metrics_.storage_write_bytes = spill_->bytes_written() - sw0;
      metrics_.peak_storage_bytes = spill_->peak_bytes();
    }
    metrics_.peak_device_bytes = arena_->peak() + plan_.workspace_bytes;
    metrics_.peak_host_bytes = host_arena_->peak();
    if (trace_) {
      trace_->counter("device bytes", metrics_.step_s, static_cast<double>(arena_->in_use()));
      trace_->counter("host bytes", metrics_.step_s, static_cast<double>(host_arena_->in_use()));
      trace_ = nullptr;
    }
    profile_ = nullptr;
    return Status::ok();
  }

  const StepMetrics& metrics() const override { return metrics_; }
  SpeculationTally speculation_tally() const override {
    return {speculation_commits_.load(std::memory_order_relaxed), speculation_redos_.load(std::memory_order_relaxed),
            speculation_drops_.load(std::memory_order_relaxed)};
  }

  Status drain() override {
    if (!failure_.is_ok()) return failure_;
    if (carried_owed_) SPILLWAY_RETURN_IF_ERROR(run_epilogue());
    Status s = host_.wait_all();
    if (s.is_ok()) s = resolve_all_deferred();
    if (s.is_ok()) s = b_.copy_engine().wait_all();
    if (s.is_ok()) s = b_.synchronize();
    if (!s.is_ok()) {
      failure_ = s.with_context("the optimizer's host work of the last step failed");
      return failure_;
    }
    host_busy_.clear();
    h2d_sources_.clear();
    for (auto& sl : slots_) {
      sl.to_device.reset();
      sl.last_h2d.reset();
      sl.host_job_write = sl.host_job_use = 0;
    }
    return Status::ok();
  }

  DeviceRegion idle_device_region() const override {
    // After a failed step, tensors may still hold regions anywhere in the arena.
    if (!failure_.is_ok()) return {};
    // The workspace after the arena is idle too: ops use it only inside a step.
    const uint64_t end = device_total_;
    if (home_end_ >= end) return {};
    return {static_cast<char*>(arena_memory_) + home_end_, end - home_end_};
  }
  uint64_t device_bytes() const override { return device_total_; }
  void trace_next_step(Trace* trace) override { trace_ = trace; }
  void profile_next_step(StepProfile* profile) override {
    profile_ = profile;
    if (profile_) profile_->ops.clear();
  }

 private:
  // A speculative update (Plan::speculation). `cur` holds the committed master, m and v
  // (a commit swaps it with `next`); both are changed only by jobs on the host engine,
  // and read by the executor's thread after waiting for them.
  struct SpecBuffers {
    int32_t op = -1, after = -1;
    TensorId param = kNoTensor, grad = kNoTensor;
    std::array<float*, 3> cur{}, next{};  // master, m, v: [attrs.n] F32 each
    bool queued = false;                  // its speculation was queued this step
    // Set by that speculation's job once it has computed the update (not when dropped);
    // its Run commits only then, so a dropped one is redone whatever the scale.
    std::shared_ptr<std::atomic<bool>> computed;
  };
  // AdamW's operand slots (program/op_registry.h).
  const int adamw_param_ = op_slot(OpKind::AdamW, "param"), adamw_grad_ = op_slot(OpKind::AdamW, "grad");
  const int adamw_scale_ = op_slot(OpKind::AdamW, "scale_norm");
  const int adamw_state_[3] = {op_slot(OpKind::AdamW, "master"), op_slot(OpKind::AdamW, "m"),
                               op_slot(OpKind::AdamW, "v")};
  struct Slot {
    void* device = nullptr;  // base + offset while the tensor holds a device region
    uint64_t offset = 0;
    void* host = nullptr;    // host buffer, when it has one
    std::optional<CopyTicket> to_device;     // H2D into `device` in flight
    std::optional<CopyTicket> to_host;       // D2H into `host` (or out of `device`: hold_device_reader) in flight
    std::optional<SpillTicket> from_storage; // storage → `host` in flight
    std::optional<SpillTicket> to_storage;   // `host` → storage in flight
    uint64_t host_offset = 0;
    // Host ops queued on the host engine (HostQueue tickets; 0 = none): the last one
    // writing `host`, and the last one reading or writing it.
    uint64_t host_job_write = 0, host_job_use = 0;
    // A fetch into `device` that waits for host op `deferred_after` (which writes the
    // source) before it is issued; the executor goes on meanwhile. Its source is
    // `deferred_src` (the host buffer may be released before the copy is issued).
    uint64_t deferred_after = 0;
    const void* deferred_src = nullptr;
    std::optional<CopyTicket> last_h2d;      // the newest H2D copy into `device`
  };
  // A device range whose last occupant still has a copy in flight that reads or
  // writes it; the range is not reused before the copy is done.
  struct BusyRange {
    uint64_t begin, end;
    CopyTicket ticket;
  };

  Status check_tensor(TensorId t, size_t bytes, const char* what) const {
    if (t < 0 || static_cast<size_t>(t) >= slots_.size())
      return Status::invalid_argument(std::string(what) + ": no tensor with id " + std::to_string(t));
    if (bytes != p_.tensors.info(t).bytes())
      return Status::invalid_argument(std::string(what) + ": " + p_.tensors.info(t).name + " has " +
                                      std::to_string(p_.tensors.info(t).bytes()) + " bytes, got " + std::to_string(bytes));
    return Status::ok();
  }

  size_t device_bytes(TensorId t) const { return std::max<size_t>(1, p_.tensors.info(t).bytes()); }

  double now_s() const { return seconds_since(step_start_); }

  // Memory per tier over time, for the trace.
  void count_memory() {
    if (!trace_) return;
    double t = now_s();
    trace_->counter("device bytes", t, static_cast<double>(arena_->in_use()));
    trace_->counter("host bytes", t, static_cast<double>(host_arena_->in_use()));
    if (spill_) trace_->counter("storage bytes", t, static_cast<double>(spill_->bytes_in_use()));
  }

  // The executor's waits. Each is timed twice: host_wait_s is the host's wall time
  // blocked; a stall probe around it (Backend::begin_stall_probe) measures how long
  // the device's compute sat idle meanwhile, which run_step sums into stall_s. The
  // trace shows the wait as a slice (every one with `trace_all`, else those longer
  // than a microsecond).
  template <class Wait>
  Status timed(const char* why, TensorId id, bool trace_all, Wait&& wait) {
    auto t0 = Clock::now();
    const Backend::StallProbe probe = b_.begin_stall_probe();
    Status s = wait();
    b_.end_stall_probe(probe);
    double d = seconds_since(t0);
    metrics_.host_wait_s += d;
    if (trace_ && (trace_all || d > 1e-6))
      trace_->slice("stall", std::string(why) + " " + p_.tensors.info(id).name, now_s() - d, now_s());
    return s;
  }
  Status timed_wait_copy(CopyTicket t, const char* why, TensorId id) {
    if (b_.copy_engine().is_done(t)) return b_.copy_engine().wait(t);
    return timed(why, id, true, [&] { return b_.copy_engine().wait(t); });
  }
  // Device compute submitted from now on runs after copy t (a stream wait on CUDA; the
  // host blocks where compute runs on it).
  Status timed_order_after_copy(CopyTicket t, const char* why, TensorId id) {
    return timed(why, id, false, [&] { return b_.copy_engine().order_compute_after(t); });
  }
  Status timed_wait_spill(SpillTicket t, const char* why, TensorId id) {
    return timed(why, id, false, [&] { return spill_->wait(t); });
  }

  // Waits for host op `job` (0: none). Fetches deferred behind host ops go out as
  // their ops finish, also while this waits.
  Status timed_wait_host(uint64_t job, const char* why, TensorId id) {
    if (job == 0) return Status::ok();
    if (host_.is_done(job)) {
      SPILLWAY_RETURN_IF_ERROR(issue_ready_fetches());
      return host_.wait(job);
    }
    auto t0 = Clock::now();
    const Backend::StallProbe probe = b_.begin_stall_probe();
    for (;;) {
      uint64_t next = job;  // the earliest host op a deferred fetch waits for, if earlier
      for (TensorId d : deferred_) next = std::min(next, slots_[d].deferred_after);
      Status s = host_.wait(next);
      if (!s.is_ok()) {
        b_.end_stall_probe(probe);
        return s;
      }
      Status issued = issue_ready_fetches();
      if (!issued.is_ok()) {
        b_.end_stall_probe(probe);
        return issued;
      }
      if (next == job) break;
    }
    b_.end_stall_probe(probe);
    double d = seconds_since(t0);
    metrics_.host_wait_s += d;
    if (trace_) trace_->slice("stall", std::string(why) + " " + p_.tensors.info(id).name, now_s() - d, now_s());
    return Status::ok();
  }

  // Issues the H2D copy of a fetch whose source is ready.
  Status issue_fetch(TensorId t, const void* src) {
    Slot& s = slots_[t];
    // Stream-ordered reuse: the copy waits for compute only when an op since the last
    // synchronization used its region (an earlier occupant); a tensor fetched back
    // into its home after a host update waits for nothing the next step queued.
    bool after_compute = false;
    for (uint64_t g = s.offset / kUseGranule; g <= (s.offset + device_bytes(t) - 1) / kUseGranule && !after_compute; ++g)
      after_compute = g >= used_since_sync_.size() || used_since_sync_[g];
    SPILLWAY_ASSIGN_OR_RETURN(CopyTicket k, b_.copy_engine().copy(CopyDirection::HostToDevice, s.device, src,
                                                                  p_.tensors.info(t).bytes(), after_compute));
    s.to_device = k;
    s.last_h2d = k;
    h2d_sources_.emplace_back(k, t);
    if (trace_) open_slices_.push_back({k, "h2d", p_.tensors.info(t).name, now_s(), p_.tensors.info(t).bytes()});
    return Status::ok();
  }
  Status issue_deferred(TensorId t) {
    Slot& s = slots_[t];
    SPILLWAY_RETURN_IF_ERROR(host_.wait(s.deferred_after));
    const void* src = s.deferred_src;
    s.deferred_after = 0;
    s.deferred_src = nullptr;
    std::erase(deferred_, t);
    return issue_fetch(t, src);
  }
  Status issue_ready_fetches() {
    if (deferred_.empty()) return Status::ok();
    const uint64_t done = host_.completed();  // one lock for the whole list (checked before every instruction)
    for (size_t i = 0; i < deferred_.size();) {
      TensorId t = deferred_[i];
      if (slots_[t].deferred_after <= done) SPILLWAY_RETURN_IF_ERROR(issue_deferred(t));
      else ++i;
    }
    return Status::ok();
  }
  // t's deferred fetch, if any, is issued now (waiting for its host op).
  Status resolve_deferred(TensorId t) {
    if (slots_[t].deferred_after == 0) return Status::ok();
    SPILLWAY_RETURN_IF_ERROR(timed_wait_host(slots_[t].deferred_after, "wait host op", t));
    if (slots_[t].deferred_after != 0) SPILLWAY_RETURN_IF_ERROR(issue_deferred(t));
    return Status::ok();
  }
  void cancel_deferred(TensorId t) {
    slots_[t].deferred_after = 0;
    slots_[t].deferred_src = nullptr;
    std::erase(deferred_, t);
  }
  Status resolve_all_deferred() {
    while (!deferred_.empty()) SPILLWAY_RETURN_IF_ERROR(resolve_deferred(deferred_.front()));
    return Status::ok();
  }
  // Everything in flight that involves t has finished: its value may be read or set
  // directly (between steps).
  // Reading waits for what writes t; writing also for what reads it (host ops that
  // read t may still run: the step's scale is read by every host AdamW).
  Status settle(TensorId t, bool for_write = true) {
    // Training state read or written between steps is the state after the last step:
    // the updates it still owes run first (inputs and outputs need not wait).
    if (carried_owed_ && p_.tensors.info(t).role != Role::Input &&
        std::find(p_.outputs.begin(), p_.outputs.end(), t) == p_.outputs.end()) {
      SPILLWAY_RETURN_IF_ERROR(host_.wait_all());
      SPILLWAY_RETURN_IF_ERROR(run_epilogue());
    }
    SPILLWAY_RETURN_IF_ERROR(resolve_deferred(t));
    Slot& s = slots_[t];
    if (s.to_device) {
      SPILLWAY_RETURN_IF_ERROR(b_.copy_engine().wait(*s.to_device));
      s.to_device.reset();
    }
    if (for_write && s.to_host && s.device) {  // a copy out of the device region (hold_device_reader)
      SPILLWAY_RETURN_IF_ERROR(b_.copy_engine().wait(*s.to_host));
      s.to_host.reset();
    }
    return for_write ? host_ready_for_write(t) : host_ready_for_read(t);
  }

  Status place(TensorId t, uint64_t offset) {
    const uint64_t end = offset + device_bytes(t);
    for (auto it = busy_.begin(); it != busy_.end();) {
      if (it->begin < end && offset < it->end) {
        SPILLWAY_RETURN_IF_ERROR(timed_wait_copy(it->ticket, "reuse", t));
        it = busy_.erase(it);
      } else {
        ++it;
      }
    }
    auto ptr = arena_->place(offset, device_bytes(t));
    if (!ptr.ok())
      return ptr.status().with_context("placing " + p_.tensors.info(t).name + " (" + format_size(device_bytes(t)) + ")");
    slots_[t].device = *ptr;
    slots_[t].offset = offset;
    count_memory();
    return Status::ok();
  }

  Status unplace(TensorId t, std::optional<CopyTicket> pending) {
    Slot& s = slots_[t];
    if (!s.device) return Status::internal("executor: " + p_.tensors.info(t).name + " has no device region to free");
    if (s.to_device) {
      pending = pending ? pending : s.to_device;
      s.to_device.reset();
    }
    if (pending) busy_.push_back({s.offset, s.offset + device_bytes(t), *pending});
    if (s.to_host && (!pending || pending->sequence != s.to_host->sequence ||
                      pending->direction != CopyDirection::DeviceToHost))
      busy_.push_back({s.offset, s.offset + device_bytes(t), *s.to_host});  // a flush still reads it
    SPILLWAY_RETURN_IF_ERROR(arena_->release_placed(s.offset, device_bytes(t)));
    s.device = nullptr;
    count_memory();
    return Status::ok();
  }

  size_t host_buffer_bytes(TensorId t) const { return align_up(std::max<size_t>(1, p_.tensors.info(t).bytes()), 4096); }

  Status place_host(TensorId t, uint64_t offset) {
    const uint64_t end = offset + host_buffer_bytes(t);
    for (size_t i = 0; i < host_busy_.size();) {
      if (host_busy_[i].begin < end && offset < host_busy_[i].end) {  // the last occupant is still read
        HostBusyRange r = host_busy_[i];
        host_busy_.erase(host_busy_.begin() + static_cast<long>(i));
        if (r.store) SPILLWAY_RETURN_IF_ERROR(timed_wait_spill(*r.store, "host reuse", t));
        SPILLWAY_RETURN_IF_ERROR(timed_wait_host(r.host_job, "host reuse", t));
        if (r.fetch_of != kNoTensor) {
          SPILLWAY_RETURN_IF_ERROR(resolve_deferred(r.fetch_of));
          if (slots_[r.fetch_of].last_h2d)
            SPILLWAY_RETURN_IF_ERROR(timed_wait_copy(*slots_[r.fetch_of].last_h2d, "host reuse", t));
        }
        i = 0;  // the list may have changed
      } else {
        ++i;
      }
    }
    auto ptr = host_arena_->place(offset, host_buffer_bytes(t));
    if (!ptr.ok()) return ptr.status().with_context("host buffer for " + p_.tensors.info(t).name);
    slots_[t].host = *ptr;
    slots_[t].host_offset = offset;
    count_memory();
    return Status::ok();
  }

  // The host buffer of t is about to be read (copied out or used by a host op):
  // data coming into it must have arrived.
  Status host_ready_for_read(TensorId t) {
    SPILLWAY_RETURN_IF_ERROR(host_data_arrived(t));
    return timed_wait_host(slots_[t].host_job_write, "wait host op", t);
  }
  // Copies and loads into t's host buffer have completed (host ops writing it aside).
  Status host_data_arrived(TensorId t) {
    Slot& s = slots_[t];
    if (s.to_host) {
      SPILLWAY_RETURN_IF_ERROR(timed_wait_copy(*s.to_host, "wait d2h", t));
      s.to_host.reset();
    }
    if (s.from_storage) {
      SPILLWAY_RETURN_IF_ERROR(timed_wait_spill(*s.from_storage, "wait load", t));
      s.from_storage.reset();
    }
    return Status::ok();
  }
  // The host buffer of t is about to be overwritten or freed: nothing may still read it.
  Status host_ready_for_write(TensorId t) {
    SPILLWAY_RETURN_IF_ERROR(host_ready_for_read(t));
    SPILLWAY_RETURN_IF_ERROR(resolve_deferred(t));  // a deferred fetch reads the buffer
    SPILLWAY_RETURN_IF_ERROR(timed_wait_host(slots_[t].host_job_use, "wait host op", t));
    Slot& s = slots_[t];
    if (s.to_storage) {
      SPILLWAY_RETURN_IF_ERROR(timed_wait_spill(*s.to_storage, "wait store", t));
      s.to_storage.reset();
    }
    // An H2D copy out of this buffer may still be running.
    for (const CopyTicket& k : take_h2d_readers(t)) SPILLWAY_RETURN_IF_ERROR(timed_wait_copy(k, "wait h2d", t));
    return Status::ok();
  }

  // The H2D copies still reading t's host buffer (to wait for before it is
  // overwritten or freed), no longer tracked once taken.
  std::vector<CopyTicket> take_h2d_readers(TensorId t) {
    std::vector<CopyTicket> readers;
    for (auto& [ticket, id] : h2d_sources_)
      if (id == t) readers.push_back(ticket);
    std::erase_if(h2d_sources_, [t](auto& e) { return e.second == t; });
    return readers;
  }

  // Ends t's host buffer; a store still reading it keeps the range busy.
  Status free_host(TensorId t) {
    Slot& s = slots_[t];
    if (!s.host) return Status::ok();
    const bool job = s.host_job_use != 0 && !host_.is_done(s.host_job_use);
    if (s.to_storage || job || s.deferred_after != 0)
      host_busy_.push_back({s.host_offset, s.host_offset + host_buffer_bytes(t), s.to_storage,
                            job ? s.host_job_use : 0, s.deferred_after != 0 ? t : kNoTensor});
    SPILLWAY_RETURN_IF_ERROR(host_arena_->release_placed(s.host_offset, host_buffer_bytes(t)));
    s.host = nullptr;
    s.host_job_write = s.host_job_use = 0;
    count_memory();
    return Status::ok();
  }

  Status run_instructions() {
    const auto& ins = plan_.instructions;
    for (size_t at = 0; at < ins.size(); ++at) {
      // The residency machine checks the instruction and steps; the executor then
      // carries it out on the memory it describes.
      Status s = residency_.apply(at, ins[at]);
      if (s.is_ok()) s = run_instruction(ins[at]);
      while (s.is_ok() && next_spec_ < spec_.size() && spec_[next_spec_].after == static_cast<int32_t>(at))
        s = queue_speculation(spec_[next_spec_++]);
      if (!s.is_ok()) {
        std::string what = ins[at].kind == InstrKind::Run ? p_.ops[ins[at].op].name
                                                          : p_.tensors.info(ins[at].tensor).name;
        return s.with_context(std::string("step instruction ") + std::to_string(at) + " (" +
                              instr_kind_name(ins[at].kind) + " " + what + ")");
      }
    }
    return Status::ok();
  }

  Status run_instruction(const Instruction& in) {
    CopyEngine& ce = b_.copy_engine();
    const TensorId t = in.tensor;
    SPILLWAY_RETURN_IF_ERROR(issue_ready_fetches());
    // A deferred fetch of t not yet issued: what reads the device copy issues it
    // (waiting for its host op); what drops the device copy unread cancels it.
    if (in.kind != InstrKind::Run && slots_[t].deferred_after != 0) {
      const bool drops = in.kind == InstrKind::Release || (in.kind == InstrKind::Evict && !in.write_back);
      if (drops) cancel_deferred(t);
      else if (in.kind == InstrKind::Fetch || in.kind == InstrKind::Evict || in.kind == InstrKind::Flush)
        SPILLWAY_RETURN_IF_ERROR(resolve_deferred(t));
    }
    switch (in.kind) {
      case InstrKind::Run:
        if (carried_[static_cast<size_t>(in.op)]) {
          // A carried update (Plan::carried): the last step's, with its learning rate
          // and count; none is owed in a step that no step precedes.
          if (!carried_owed_) return Status::ok();
          std::swap(step_, carried_step_);
          Status s = run_op(in.op, in.recompute);
          std::swap(step_, carried_step_);
          return s;
        }
        if (epilogue_) return Status::ok();
        return run_op(in.op, in.recompute);
      case InstrKind::Allocate:
        return place(t, in.offset);
      case InstrKind::Fetch: {
        SPILLWAY_RETURN_IF_ERROR(host_data_arrived(t));
        Slot& s = slots_[t];
        if (!s.host) return Status::internal("fetch of " + p_.tensors.info(t).name + " without a host buffer");
        SPILLWAY_RETURN_IF_ERROR(place(t, in.offset));
        if (s.host_job_write != 0 && !host_.is_done(s.host_job_write)) {
          // The host op writing the source is queued: the copy goes out when it is done,
          // and the executor goes on (the next step's forward overlaps the optimizer).
          s.deferred_after = s.host_job_write;
          s.deferred_src = s.host;
          deferred_.push_back(t);
          return Status::ok();
        }
        return issue_fetch(t, s.host);
      }
      case InstrKind::Evict:
      case InstrKind::Flush: {
        Slot& s = slots_[t];
        std::optional<CopyTicket> out;
        bool copy = in.kind == InstrKind::Flush || in.write_back;
        if (copy) {
          SPILLWAY_RETURN_IF_ERROR(host_ready_for_write(t));
          if (!s.host) return Status::internal("write-back of " + p_.tensors.info(t).name + " without a host buffer");
          if (s.to_device) {  // copies of the two directions are not ordered with each other
            SPILLWAY_RETURN_IF_ERROR(timed_wait_copy(*s.to_device, "wait h2d", t));
            s.to_device.reset();
          }
          SPILLWAY_ASSIGN_OR_RETURN(CopyTicket k, ce.copy(CopyDirection::DeviceToHost, s.host, s.device,
                                                          p_.tensors.info(t).bytes()));
          s.to_host = k;
          out = k;
          if (trace_) open_slices_.push_back({k, "d2h", p_.tensors.info(t).name, now_s(), p_.tensors.info(t).bytes()});
          if (t == scale_tensor_ && !spec_.empty()) {
            std::lock_guard<std::mutex> lock(scale_mu_);
            scale_copy_ = ScaleCopy{step_serial_, k, static_cast<const float*>(s.host)};
            scale_flushed_.store(true, std::memory_order_relaxed);
          }
        }
        if (in.kind == InstrKind::Evict) SPILLWAY_RETURN_IF_ERROR(unplace(t, out));
        return Status::ok();
      }
      case InstrKind::Release:
        return unplace(t, std::nullopt);
      case InstrKind::Load: {
        if (!spill_) return Status::internal("load of " + p_.tensors.info(t).name + " without a storage tier");
        SPILLWAY_RETURN_IF_ERROR(host_ready_for_write(t));
        if (!slots_[t].host) return Status::internal("load of " + p_.tensors.info(t).name + " without a host buffer");
        SPILLWAY_ASSIGN_OR_RETURN(SpillTicket k, spill_->read(t, slots_[t].host, p_.tensors.info(t).bytes()));
        slots_[t].from_storage = k;
        if (trace_) trace_->slice("storage read", p_.tensors.info(t).name, now_s(), now_s());
        return Status::ok();
      }
      case InstrKind::Store: {
        if (!spill_) return Status::internal("store of " + p_.tensors.info(t).name + " without a storage tier");
        SPILLWAY_RETURN_IF_ERROR(host_ready_for_read(t));
        Slot& s = slots_[t];
        if (s.to_storage) {
          SPILLWAY_RETURN_IF_ERROR(timed_wait_spill(*s.to_storage, "wait store", t));
          s.to_storage.reset();
        }
        SPILLWAY_ASSIGN_OR_RETURN(SpillTicket k, spill_->write(t, s.host, p_.tensors.info(t).bytes()));
        s.to_storage = k;
        if (in.free_host) SPILLWAY_RETURN_IF_ERROR(free_host(t));
        if (trace_) trace_->slice("storage write", p_.tensors.info(t).name, now_s(), now_s());
        return Status::ok();
      }
      case InstrKind::HostAllocate:
        return place_host(t, in.offset);
      case InstrKind::HostRelease: {
        // Copies and loads into the buffer must end, and H2D copies reading it; a
        // store, a queued host op or a deferred fetch still reading it keeps the range
        // busy instead (free_host), so that the executor goes on.
        SPILLWAY_RETURN_IF_ERROR(host_data_arrived(t));
        for (const CopyTicket& k : take_h2d_readers(t)) SPILLWAY_RETURN_IF_ERROR(timed_wait_copy(k, "wait h2d", t));
        return free_host(t);
      }
    }
    return Status::internal("unknown instruction");
  }

  // A copy's slice ends when the executor first sees it done (polled before each op).
  struct OpenSlice {
    CopyTicket ticket;
    const char* track;
    std::string name;
    double start_s;
    size_t bytes;
  };
  void close_slices(bool all) {
    if (!trace_) return;
    std::erase_if(open_slices_, [&](const OpenSlice& o) {
      if (!all && !b_.copy_engine().is_done(o.ticket)) return false;
      trace_->slice(o.track, o.name, o.start_s, now_s(), {{"bytes", o.bytes}});
      return true;
    });
  }

  Status run_op(int index, bool recompute) {
    close_slices(false);
    const Op& op = p_.ops[index];
    const Place place = plan_.op_place.empty() ? op.place : plan_.op_place[index];
    ptrs_.clear();
    CopyEngine& ce = b_.copy_engine();
    for (const Operand& o : op.operands) {
      Slot& s = slots_[o.tensor];
      const TensorInfo& info = p_.tensors.info(o.tensor);
      if (place == Place::Device) {
        SPILLWAY_RETURN_IF_ERROR(resolve_deferred(o.tensor));
        if (!s.device) return Status::internal("op " + op.name + ": " + info.name + " has no device region (plan bug)");
        if (s.to_device) {
          // A fetch still in flight: compute waits for it on the device (a stream wait;
          // the probe times the GPU's idle). One already done needs no wait.
          if (!ce.is_done(*s.to_device)) SPILLWAY_RETURN_IF_ERROR(timed_order_after_copy(*s.to_device, "wait h2d", o.tensor));
          s.to_device.reset();
        }
        if (o.access != Access::Read && s.to_host && !ce.is_done(*s.to_host)) {
          // A copy out of this region is still reading it: the op waits for it on the
          // device, the host goes on issuing. to_host stays set: readers of the host
          // copy it fills still wait for it.
          SPILLWAY_RETURN_IF_ERROR(timed_order_after_copy(*s.to_host, "wait d2h", o.tensor));
        }
        ptrs_.push_back(s.device);
      } else {
        if (!s.host) return Status::internal("host op " + op.name + ": " + info.name + " has no host buffer (plan bug)");
        // What the host op must wait for, without holding up the executor: a D2H copy
        // filling the buffer (the host engine waits for it), earlier host ops (the
        // engine runs them in order). A load from storage is waited for here.
        if (s.from_storage) {
          SPILLWAY_RETURN_IF_ERROR(timed_wait_spill(*s.from_storage, "wait load", o.tensor));
          s.from_storage.reset();
        }
        if (s.to_host) host_waits_.push_back(*s.to_host);
        if (o.access != Access::Read) {
          // Nothing may still read the old value: a store, a deferred or running H2D copy.
          if (s.to_storage) {
            SPILLWAY_RETURN_IF_ERROR(timed_wait_spill(*s.to_storage, "wait store", o.tensor));
            s.to_storage.reset();
          }
          SPILLWAY_RETURN_IF_ERROR(resolve_deferred(o.tensor));
          for (const CopyTicket& k : take_h2d_readers(o.tensor)) host_waits_.push_back(k);
        }
        ptrs_.push_back(s.host);
      }
    }
    if (place == Place::Host) return queue_host_op(index, recompute);
    if (profile_) SPILLWAY_RETURN_IF_ERROR(b_.synchronize());
    double t0 = trace_ || profile_ ? now_s() : 0;
    SPILLWAY_RETURN_IF_ERROR(run_device_op(b_, p_, op, ptrs_, step_));
    for (const Operand& o : op.operands) {
      const uint64_t first = slots_[o.tensor].offset / kUseGranule;
      const uint64_t last = (slots_[o.tensor].offset + device_bytes(o.tensor) - 1) / kUseGranule;
      for (uint64_t g = first; g <= last && g < used_since_sync_.size(); ++g) used_since_sync_[g] = 1;
    }
    if (profile_) {
      SPILLWAY_RETURN_IF_ERROR(b_.synchronize());
      profile_->ops.push_back({index, recompute, now_s() - t0});
    }
    if (trace_) trace_->slice("compute", (recompute ? "recompute " : "") + op.name, t0, now_s());
    if (recompute) metrics_.recomputed_ops++;
    return Status::ok();
  }

  // A host op goes to the host engine with the copies it must wait for (ptrs_ and
  // host_waits_ as run_op gathered them); the executor moves on. Later readers of
  // what it writes wait for its ticket (host_job_write); later writers of what it
  // touches, for host_job_use.
  Status queue_host_op(int index, bool recompute) {
    const Op& op = p_.ops[index];
    std::vector<CopyTicket> waits = std::move(host_waits_);
    host_waits_.clear();
    std::vector<void*> ptrs = ptrs_;
    const OptimizerStep step = step_;
    const DType dtype = b_.activation_dtype();
    CopyEngine* ce = &b_.copy_engine();
    const bool traced = trace_ != nullptr;
    const std::string name = (recompute ? "recompute " : "") + op.name;
    const Clock::time_point start = step_start_;
    // A host AdamW that may be speculated: its master, m and v are the committed
    // buffers of its SpecBuffers, read when the job runs (an earlier commit may have
    // swapped them).
    SpecBuffers* spec = !recompute && !spec_of_op_.empty() && spec_of_op_[static_cast<size_t>(index)] >= 0
                            ? &spec_[static_cast<size_t>(spec_of_op_[static_cast<size_t>(index)])]
                            : nullptr;
    const bool speculated = spec && spec->queued;
    std::shared_ptr<std::atomic<bool>> computed = speculated ? spec->computed : nullptr;
    uint64_t job = host_.submit([this, &op, waits = std::move(waits), ptrs = std::move(ptrs), step, dtype, ce, traced,
                                 name, start, spec, speculated, computed]() mutable -> Status {
      for (const CopyTicket& w : waits) SPILLWAY_RETURN_IF_ERROR(ce->wait(w));
      const double t0 = traced ? seconds_since(start) : 0;
      Status s = Status::ok();
      bool committed = false;
      if (spec) {
        // The speculation stands when the scale is exactly 1: it is this update's bits.
        const float scale = static_cast<const float*>(ptrs[static_cast<size_t>(adamw_scale_)])[0];
        if (!scale_flushed_.load(std::memory_order_relaxed)) speculate_next_.store(scale == 1.0f, std::memory_order_relaxed);
        if (speculated && computed && computed->load(std::memory_order_acquire) && scale == 1.0f) {
          std::swap(spec->cur, spec->next);
          committed = true;
          speculation_commits_.fetch_add(1, std::memory_order_relaxed);
        } else {
          for (int i = 0; i < 3; ++i) ptrs[static_cast<size_t>(adamw_state_[i])] = spec->cur[static_cast<size_t>(i)];
          if (speculated) speculation_redos_.fetch_add(1, std::memory_order_relaxed);
        }
      }
      if (!committed) s = run_host_op(op, ptrs, dtype, step).with_context("host op " + op.name);
      if (traced) {
        std::lock_guard<std::mutex> lock(host_slices_mu_);
        host_slices_.push_back({committed ? "commit " + name : name, t0, seconds_since(start)});
      }
      return s;
    });
    for (const Operand& o : op.operands) {
      Slot& s = slots_[o.tensor];
      s.host_job_use = job;
      if (o.access != Access::Read) s.host_job_write = job;
    }
    if (recompute) metrics_.recomputed_ops++;
    // Profiling times each op alone.
    if (profile_) {
      const double t0 = now_s();
      SPILLWAY_RETURN_IF_ERROR(timed_wait_host(job, "host op", op.operands.front().tensor));
      profile_->ops.push_back({index, recompute, now_s() - t0});
    }
    return Status::ok();
  }

  // Speculative updates (plan.h): the second buffers of master, m and v, allocated
  // beside the host arena within the host budget and touched now, so that the first
  // step does not fault them in.
  Status init_speculation(uint64_t host_arena_bytes) {
    if (plan_.speculation.empty()) return Status::ok();
    const uint64_t bytes = plan_.speculation_bytes;
    if (bytes != speculation_bytes(p_, plan_.speculation))
      return Status::internal("executor: the plan's speculation buffers (" + format_size(bytes) +
                              ") do not match its speculative updates");
    if (host_arena_bytes > opt_.host_budget || bytes > opt_.host_budget - host_arena_bytes)
      return Status::out_of_memory("the plan needs " + format_size(host_arena_bytes) + " of host memory and " +
                                   format_size(bytes) + " for speculative updates, above the host budget " +
                                   format_size(opt_.host_budget));
    const uint64_t total = align_up(bytes, 4096);
    if (opt_.external_speculation.base) {
      SPILLWAY_RETURN_IF_ERROR(check_region(opt_.external_speculation, total, "speculative updates' second buffers",
                                            "speculation region"));
      spec_memory_ = opt_.external_speculation.base;
      owns_spec_ = false;
    } else {
      spec_memory_ = std::aligned_alloc(4096, total);
      if (!spec_memory_)
        return Status::out_of_memory("could not allocate " + format_size(total) +
                                     " of host memory for the speculative updates' second buffers");
      owns_spec_ = true;
    }
    parallel_zero(global_thread_pool(), spec_memory_, total);
    char* base = static_cast<char*>(spec_memory_);
    spec_of_op_.assign(p_.ops.size(), -1);
    spec_of_tensor_.assign(p_.tensors.size(), -1);
    spec_which_.assign(p_.tensors.size(), 0);
    char* next = base;
    for (const Speculation& sp : plan_.speculation) {
      if (sp.op < 0 || static_cast<size_t>(sp.op) >= p_.ops.size() || p_.ops[static_cast<size_t>(sp.op)].kind != OpKind::AdamW)
        return Status::internal("executor: speculative update of op " + std::to_string(sp.op) + ", not an AdamW");
      const Op& op = p_.ops[static_cast<size_t>(sp.op)];
      SpecBuffers b;
      b.op = sp.op;
      b.after = sp.after;
      b.param = op.operands[static_cast<size_t>(adamw_param_)].tensor;
      b.grad = op.operands[static_cast<size_t>(adamw_grad_)].tensor;
      for (int i = 0; i < 3; ++i) {
        const TensorId t = op.operands[static_cast<size_t>(adamw_state_[i])].tensor;
        if (!slots_[t].host)
          return Status::internal("executor: " + p_.tensors.info(t).name + " of speculated " + op.name +
                                  " has no host buffer");
        b.cur[static_cast<size_t>(i)] = static_cast<float*>(slots_[t].host);
        b.next[static_cast<size_t>(i)] = reinterpret_cast<float*>(next);
        next += host_buffer_bytes(t);
        spec_of_tensor_[static_cast<size_t>(t)] = static_cast<int32_t>(spec_.size());
        spec_which_[static_cast<size_t>(t)] = static_cast<uint8_t>(i);
      }
      spec_of_op_[static_cast<size_t>(sp.op)] = static_cast<int32_t>(spec_.size());
      spec_.push_back(b);
    }
    if (!spec_.empty()) scale_tensor_ = clip_scale_tensor(p_);
    if (next != base + bytes) return Status::internal("executor: speculation buffers laid out wrongly");
    return Status::ok();
  }

  // The host copy of t: for master, m and v of a speculated AdamW, its committed
  // buffer. Between steps (after settle), or on the host engine.
  void* host_ptr(TensorId t) const {
    if (!spec_of_tensor_.empty() && spec_of_tensor_[static_cast<size_t>(t)] >= 0)
      return spec_[static_cast<size_t>(spec_of_tensor_[static_cast<size_t>(t)])].cur[spec_which_[static_cast<size_t>(t)]];
    return slots_[t].host;
  }

  // At a step's start: it speculates unless the last step's clip scale was not 1 (the
  // work would likely be thrown away). The scale's copy to host ended with that step
  // (finish() waits for copies), so the choice does not depend on how far the host
  // engine has got. Without a copy of the scale to read (the clip on host), the last
  // host AdamW to read a scale sets it instead.
  void decide_speculation() {
    std::lock_guard<std::mutex> lock(scale_mu_);
    if (!scale_copy_ || scale_copy_->serial != step_serial_ || scale_copy_->host == nullptr) return;
    if (!b_.copy_engine().is_done(scale_copy_->ticket)) return;
    speculate_next_.store(scale_copy_->host[0] == 1.0f, std::memory_order_relaxed);
  }

  // Whether step `serial`'s clip scale has reached host (its copy done) and is not
  // exactly 1. Called from host jobs; never blocks.
  bool clipping_known_active(uint64_t serial, CopyEngine* ce) {
    std::lock_guard<std::mutex> lock(scale_mu_);
    if (!scale_copy_ || scale_copy_->serial != serial || scale_copy_->host == nullptr) return false;
    if (!ce->is_done(scale_copy_->ticket)) return false;
    return scale_copy_->host[0] != 1.0f;
  }

  // Queues the speculative update of `sp` (its gradient has just reached host), unless
  // the last clip scale seen was not 1 (clipping active, or a skipped step): then the
  // speculation would likely be thrown away, and its Run updates as usual.
  Status queue_speculation(SpecBuffers& sp) {
    sp.queued = false;
    if (!speculate_next_.load(std::memory_order_relaxed)) return Status::ok();
    const Op& op = p_.ops[static_cast<size_t>(sp.op)];
    Slot& ps = slots_[sp.param];
    Slot& gs = slots_[sp.grad];
    if (!ps.host || !gs.host)
      return Status::internal("speculative update of " + op.name + ": param or gradient has no host buffer (plan bug)");
    std::vector<CopyTicket> waits;
    // The gradient's copy to host, and one into param's host buffer, must land first.
    if (gs.from_storage) {
      SPILLWAY_RETURN_IF_ERROR(timed_wait_spill(*gs.from_storage, "wait load", sp.grad));
      gs.from_storage.reset();
    }
    if (gs.to_host) waits.push_back(*gs.to_host);
    if (ps.to_host) waits.push_back(*ps.to_host);
    // Nothing may still read param's host buffer: a deferred or running H2D copy.
    SPILLWAY_RETURN_IF_ERROR(resolve_deferred(sp.param));
    for (const CopyTicket& k : take_h2d_readers(sp.param)) waits.push_back(k);
    void* param = ps.host;
    const void* grad = gs.host;
    const OptimizerStep step = step_;
    const DType dtype = b_.activation_dtype();
    CopyEngine* ce = &b_.copy_engine();
    const bool traced = trace_ != nullptr;
    const Clock::time_point start = step_start_;
    SpecBuffers* b = &sp;
    const uint64_t serial = step_serial_;
    auto computed = std::make_shared<std::atomic<bool>>(false);
    sp.computed = computed;
    const uint64_t job = host_.submit([this, &op, b, waits = std::move(waits), param, grad, step, dtype, ce, traced,
                                       start, serial, computed]() -> Status {
      // The step's clip scale already on host and not 1: this speculation would be
      // thrown away, and its Run updates from the untouched buffers either way.
      if (clipping_known_active(serial, ce)) {
        speculation_drops_.fetch_add(1, std::memory_order_relaxed);
        return Status::ok();
      }
      for (const CopyTicket& w : waits) SPILLWAY_RETURN_IF_ERROR(ce->wait(w));
      const double t0 = traced ? seconds_since(start) : 0;
      const float* state[3] = {b->cur[0], b->cur[1], b->cur[2]};
      float* into[3] = {b->next[0], b->next[1], b->next[2]};
      Status s = run_adamw_host_speculative(op, param, grad, state, into, dtype, step)
                     .with_context("speculative host op " + op.name);
      if (s.is_ok()) computed->store(true, std::memory_order_release);
      if (traced) {
        std::lock_guard<std::mutex> lock(host_slices_mu_);
        host_slices_.push_back({"speculate " + op.name, t0, seconds_since(start)});
      }
      return s;
    });
    ps.host_job_write = ps.host_job_use = job;
    gs.host_job_use = job;
    sp.queued = true;
    metrics_.speculated_ops++;
    return Status::ok();
  }

  // The end of a step: the device work and the copies issued are done. Host ops
  // still queued (the optimizer's tail) and the fetches deferred behind them carry
  // over into the next step, whose forward overlaps them; drain() ends them where the
  // whole state must be settled.
  // The loop's epilogue: the carried updates still owed, run where the step runs
  // them, by a pass over the step's instructions that runs no other op (the memory
  // instructions move the tensors as in a step, so every tensor ends at home; the
  // values of activations and of gradients written in the step are not used). The
  // last step's metrics stay those of its step.
  Status run_epilogue() {
    const StepMetrics kept = metrics_;
    epilogue_ = true;
    b_.set_workspace(workspace_, workspace_ ? plan_.workspace_bytes : 0);
    residency_.begin_step();
    next_spec_ = spec_.size();  // no speculation: no host op runs
    Status st = run_instructions();
    if (st.is_ok()) st = finish();
    if (st.is_ok()) st = b_.take_stall_seconds().status();
    epilogue_ = false;
    metrics_ = kept;
    carried_owed_ = false;
    if (!st.is_ok()) {
      failure_ = st.with_context("the updates carried from the last step (drain)");
      quiesce_after_failure();
      return failure_;
    }
    return Status::ok();
  }

  // After a failed pass: lets in-flight work drain so that no copy writes into freed
  // memory (their own errors are the failure's consequences, not reported again).
  void quiesce_after_failure() {
    (void)host_.wait_all();
    (void)resolve_all_deferred();
    (void)b_.synchronize();
    (void)b_.copy_engine().wait_all();
    if (spill_) (void)spill_->wait_all();
  }

  Status finish() {
    // Where the plan moves nothing, the optimizer's device updates of this step go on
    // past its end (Backend::synchronize_compute): the next step's ops wait for them on
    // the device where they touch their memory, so its forward overlaps them. Reading
    // or writing a tensor between steps waits for them (download, upload), and drain()
    // for all.
    SPILLWAY_RETURN_IF_ERROR(moves_nothing_ ? b_.synchronize_compute() : b_.synchronize());
    std::fill(used_since_sync_.begin(), used_since_sync_.end(), uint8_t{0});
    SPILLWAY_RETURN_IF_ERROR(b_.copy_engine().wait_all());
    SPILLWAY_RETURN_IF_ERROR(host_.failure());
    close_slices(true);
    if (trace_) {
      std::lock_guard<std::mutex> lock(host_slices_mu_);
      for (const HostSlice& h : host_slices_) trace_->slice("host", h.name, h.start_s, h.end_s);
      host_slices_.clear();
    }
    for (auto& s : slots_) {
      s.to_device.reset();
      s.to_host.reset();
    }
    busy_.clear();
    h2d_sources_.clear();
    if (spill_) {
      SPILLWAY_RETURN_IF_ERROR(spill_->wait_all());
      for (auto& s : slots_) {
        s.from_storage.reset();
        s.to_storage.reset();
      }
    }
    // Ranges a queued host op or a deferred fetch still reads stay busy.
    std::erase_if(host_busy_, [&](HostBusyRange& r) {
      r.store.reset();
      return (r.host_job == 0 || host_.is_done(r.host_job)) &&
             (r.fetch_of == kNoTensor || slots_[r.fetch_of].deferred_after == 0);
    });
    // Every op ran once and every persistent tensor is back home (the plan promised it).
    return residency_.finish().with_context("executor: after the step");
  }

  Backend& b_;
  const Program& p_;
  Plan plan_;
  ExecutorOptions opt_;
  ResidencyMachine residency_;   // where each tensor's valid copies are (plan/residency.h)
  std::vector<Slot> slots_;      // [tensors]
  void* arena_memory_ = nullptr; // arena, then workspace: one device allocation (or the region given)
  bool owns_device_ = false;     // arena_memory_ came from device_alloc
  uint64_t workspace_offset_ = 0, device_total_ = 0;  // bytes
  void* workspace_ = nullptr;    // plan_.workspace_bytes at arena_memory_ + workspace_offset_
  uint64_t home_end_ = 0;        // device homes of persistent tensors lie in [0, home_end_)
  std::unique_ptr<DeviceArena> arena_;
  void* host_memory_ = nullptr;  // one pinned allocation of the host arena's bytes
  bool owns_host_ = false;       // host_memory_ is ours to free (not ExecutorOptions::external_host)
  std::unique_ptr<DeviceArena> host_arena_;  // the same planned-offset arena as the device's
  std::unique_ptr<SpillStore> spill_;
  std::vector<BusyRange> busy_;
  std::vector<std::pair<CopyTicket, TensorId>> h2d_sources_;  // H2D copies reading host buffers
  // A released host range that something may still read: a store, a queued host op,
  // or a deferred fetch of `fetch_of` (not yet issued, or its copy still running).
  struct HostBusyRange {
    uint64_t begin, end;
    std::optional<SpillTicket> store;
    uint64_t host_job = 0;
    TensorId fetch_of = kNoTensor;
  };
  std::vector<HostBusyRange> host_busy_;
  std::vector<SpecBuffers> spec_;        // speculative updates, in the plan's order
  std::vector<int32_t> spec_of_op_;       // [ops] index into spec_, or -1
  std::vector<int32_t> spec_of_tensor_;   // [tensors] the spec_ entry whose master, m or v it is, or -1
  std::vector<uint8_t> spec_which_;       // [tensors] 0 master, 1 m, 2 v
  size_t next_spec_ = 0;                  // the next spec_ entry to queue this step
  void* spec_memory_ = nullptr;           // the second buffers (plan_.speculation_bytes)
  bool owns_spec_ = false;                // spec_memory_ is ours to free (not ExecutorOptions::external_speculation)
  std::atomic<bool> speculate_next_{true};  // the last clip scale seen was 1
  std::atomic<uint64_t> speculation_commits_{0}, speculation_redos_{0}, speculation_drops_{0};
  // The clip scale's copy to host in the step numbered `serial` (step_serial_ counts the
  // steps begun): speculations still queued when it lands with a scale other than 1
  // are dropped (clipping_known_active).
  struct ScaleCopy {
    uint64_t serial = 0;
    CopyTicket ticket;
    const float* host = nullptr;  // [1] the scale's host buffer
  };
  TensorId scale_tensor_ = kNoTensor;  // the AdamW ops' scale_norm operand (with speculation)
  uint64_t step_serial_ = 0;
  std::mutex scale_mu_;
  std::optional<ScaleCopy> scale_copy_;
  std::atomic<bool> scale_flushed_{false};  // the scale is copied to host (decide_speculation reads it)
  HostQueue host_;                        // host ops (AdamW) run here, in order
  std::vector<TensorId> deferred_;        // tensors with a deferred fetch, in the order they were deferred
  std::mutex host_slices_mu_;
  struct HostSlice {
    std::string name;
    double start_s, end_s;
  };
  std::vector<HostSlice> host_slices_;    // host ops of a traced step, written by the host engine
  std::vector<void*> ptrs_;
  std::vector<CopyTicket> host_waits_;  // copies the host op being queued waits for
  // [arena bytes / kUseGranule] 1 where an op used a byte of that granule since the
  // last synchronization (conservative: a copy into a marked granule waits for compute).
  static constexpr uint64_t kUseGranule = uint64_t{1} << 20;
  std::vector<uint8_t> used_since_sync_;
  bool moves_nothing_ = false;  // no transfer instruction, no host op (see finish)
  std::vector<OpenSlice> open_slices_;
  StepMetrics metrics_;
  OptimizerStep step_;
  // Carried updates (Plan::carried): [ops] whether an op is one; the step they are
  // owed for (its learning rate and count); whether a step ran since the last drain.
  std::vector<bool> carried_;
  OptimizerStep carried_step_;
  bool carried_owed_ = false;
  bool epilogue_ = false;  // run_epilogue: only carried Runs run
  Clock::time_point step_start_;
  Trace* trace_ = nullptr;
  StepProfile* profile_ = nullptr;
  Status failure_;  // of the step that failed, if one did
};

}  // namespace

Result<std::unique_ptr<Executor>> Executor::create(Backend& backend, const Program& program, const Plan& plan,
                                                   const ExecutorOptions& options) {
  if (plan.home.size() != program.tensors.size())
    return Status::invalid_argument("executor: the plan was made for another program (" +
                                    std::to_string(plan.home.size()) + " tensors, program has " +
                                    std::to_string(program.tensors.size()) + ")");
  if (plan.alignment % backend.alignment() != 0)
    return Status::invalid_argument("executor: the plan aligns device offsets to " + std::to_string(plan.alignment) +
                                    " bytes but the " + backend.name() + " backend needs " +
                                    std::to_string(backend.alignment()));
  auto ex = std::make_unique<PlanExecutor>(backend, program, plan, options);
  SPILLWAY_RETURN_IF_ERROR(ex->init());
  return std::unique_ptr<Executor>(std::move(ex));
}

}  // namespace spillway
