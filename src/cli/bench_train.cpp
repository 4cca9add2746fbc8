// `spillway bench train`: throughput of whole training steps of a model under
// budgets, on random tokens (no data file needed).
//
//   spillway bench train --model gpt2-124m --batch 8 --steps 5 --backend cuda
//   spillway bench train --model tiny --device-budget 8MiB --policy planned
//
// The first step warms up and is not timed; the timed steps run from the start of
// step 2 until the last step's optimizer has finished (Trainer::drain). MFU =
// Program::flops() / step time / the GPU's dense bf16 peak from its data sheet
// (data_sheet_bf16_peak: 989 TFLOP/s for the H100 SXM and the H200) on CUDA; on the
// CPU the achieved GFLOP/s is printed instead. "executor waits" is
// host time the executor spent waiting (for copies, host ops, regions to reuse):
// the GPU may still be busy with work queued before the wait. "device used" is the process's device memory beyond the CUDA
// context (Backend::device_used_bytes, from cudaMemGetInfo) after the steps, and its
// peak sampled at every allocation: what --device-budget bounds. --json FILE writes
// the figures as one JSON object.
//
// "first step after" is the time from the command's start to the first step's start
// (time_to_first_step_s in the JSON): opening the backend, then setup_s (building,
// planning, and creating the executor, which allocates and zero-fills the training
// state; its parts setup_build_s, setup_kernel_load_s, setup_plan_s and
// setup_executor_s, Trainer::setup_times), then init_s (initializing the parameters).
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <optional>
#include <cmath>
#include <cstdio>
#include <limits>
#include <cstring>
#include <memory>
#include <string>

#include "cli/command.h"
#include "cli/machine_flag.h"
#include "cli/train_flags.h"
#include "core/clock.h"
#include "core/interrupt.h"
#include "core/random.h"
#include "core/size.h"
#include "program/op_registry.h"
#include "sim/simulator.h"
#include "train/checkpoint.h"
#include "train/trainer.h"

namespace spillway::cli {
namespace {

struct BenchTrainFlags {
  ModelFlags model;
  MemoryFlags memory;
  std::string machine;  // --machine FILE|PRESET ("": the cached measured machine on CUDA, else the preset)
  int steps = 5, batch = 8, context = 0, accum = 1;
  uint64_t seed = 1337;
  double grad_clip = 1.0;  // --grad-clip: max global gradient norm (0 = no clipping)
  bool profile = false;
  std::string json;  // file for the JSON summary ("" = none)
  std::string checkpoint_dir;  // --checkpoint-dir: checkpoints every --checkpoint-every steps, timed with the steps
  int checkpoint_every = 0;
};

// The time split of one profiled step: matrix products, attention, other kernels of
// the forward and backward, and the optimizer phase (norms, clipping, AdamW, on
// device or host), then the slowest ops. Beside it, two figures measured apart from
// the split: the sum of every op's time, and the profiled step on the wall clock
// with the number of ops timed against the plan's Run instructions.
void print_profile(const Program& program, const Plan& plan, const StepProfile& profile, double step_s,
                   double profiled_step_s) {
  double split[4] = {0, 0, 0, 0};
  const char* names[4] = {"matmul", "attention", "other kernels", "optimizer"};
  for (const OpTime& t : profile.ops) {
    const Op& op = program.ops[static_cast<size_t>(t.op)];
    int k = 2;
    if (op.phase == Phase::Optimizer) k = 3;
    else if (op_info(op.kind).op_class == OpClass::Matmul) k = 0;
    else if (op_info(op.kind).op_class == OpClass::Attention) k = 1;
    split[k] += t.seconds;
  }
  const double split_total = split[0] + split[1] + split[2] + split[3];
  double total = 0;
  for (const OpTime& t : profile.ops) total += t.seconds;
  size_t plan_runs = 0;
  for (const Instruction& in : plan.instructions) plan_runs += in.kind == InstrKind::Run;
  std::printf("time split    one step, each op timed alone (synchronized before and after)\n");
  for (int k = 0; k < 4; ++k)
    std::printf("  %-13s %9.2f ms  %5.1f%%\n", names[k], 1e3 * split[k],
                split_total > 0 ? 100.0 * split[k] / split_total : 0.0);
  std::printf("  %-13s %9.2f ms  (the unprofiled step: %.2f ms; the difference is launch gaps and waits)\n", "sum of ops",
              1e3 * total, 1e3 * step_s);
  std::printf("  %-13s %9.2f ms  (the profiled step on the wall clock; %zu ops timed, the plan runs %zu)\n",
              "whole step", 1e3 * profiled_step_s, profile.ops.size(), plan_runs);
  std::vector<OpTime> slowest = profile.ops;
  std::sort(slowest.begin(), slowest.end(), [](const OpTime& a, const OpTime& b) { return a.seconds > b.seconds; });
  if (slowest.size() > 8) slowest.resize(8);
  for (const OpTime& t : slowest)
    std::printf("  slowest       %9.3f ms  %s%s\n", 1e3 * t.seconds, t.recompute ? "recompute " : "",
                program.ops[static_cast<size_t>(t.op)].name.c_str());
}

Status run_bench(const BenchTrainFlags& f) {
  const auto start = std::chrono::steady_clock::now();
  // SIGINT/SIGTERM: stop between steps; the spill directory goes with the trainer.
  SPILLWAY_RETURN_IF_ERROR(install_interrupt_handlers(InterruptMode::BetweenSteps));
  if (f.steps < 2) return Status::invalid_argument("--steps must be at least 2 (the first step warms up), got " +
                                                   std::to_string(f.steps));
  if (f.batch < 1) return Status::invalid_argument("--batch must be at least 1, got " + std::to_string(f.batch));
  if (f.accum < 1) return Status::invalid_argument("--accum must be at least 1, got " + std::to_string(f.accum));
  if ((f.checkpoint_every > 0) != !f.checkpoint_dir.empty())
    return Status::invalid_argument("--checkpoint-dir and --checkpoint-every go together (give both or neither)");
  if (f.checkpoint_every < 0)
    return Status::invalid_argument("--checkpoint-every must be positive, got " + std::to_string(f.checkpoint_every));
  if (f.context < 0) return Status::invalid_argument("--context must be positive, got " + std::to_string(f.context));
  SPILLWAY_ASSIGN_OR_RETURN(ModelConfig cfg, resolve_model(f.model));
  const int T = f.context ? f.context : cfg.context;
  if (T > cfg.context)
    return Status::invalid_argument("--context " + std::to_string(T) + " is longer than the model's context " +
                                    std::to_string(cfg.context));
  SPILLWAY_ASSIGN_OR_RETURN(std::unique_ptr<Backend> backend, open_backend(f.memory.backend, f.memory.threads));
  SPILLWAY_ASSIGN_OR_RETURN(ResolvedMemory mem, resolve_memory(f.memory, *backend));
  SPILLWAY_RETURN_IF_ERROR(check_step_is_bounded(cfg, {.B = f.batch, .T = T, .accum = f.accum},
                                                 backend->activation_dtype(), mem.budgets));
  TrainerOptions o;
  o.model = cfg;
  o.shape = {.B = f.batch, .T = T, .accum = f.accum};
  o.schedule = {.peak = 6e-4f, .warmup_steps = 0, .total_steps = f.steps};
  o.seed = f.seed;
  if (!(f.grad_clip >= 0) || !std::isfinite(f.grad_clip))
    return Status::invalid_argument("--grad-clip: expected a finite number >= 0 (0 = no clipping), got " +
                                    std::to_string(f.grad_clip));
  // 0, or a bound beyond float's range: no step can reach it.
  o.max_grad_norm = f.grad_clip == 0 || f.grad_clip > std::numeric_limits<float>::max()
                        ? std::numeric_limits<float>::infinity()
                        : static_cast<float>(f.grad_clip);
  o.budgets = mem.budgets;
  o.planner = mem.planner;
  o.auto_confirm = mem.auto_confirm;
  SPILLWAY_ASSIGN_OR_RETURN(o.machine, training_machine(f.machine, *backend, mem.spill_dir));
  o.spill_dir = mem.spill_dir;
  const auto setup_start = std::chrono::steady_clock::now();
  SPILLWAY_ASSIGN_OR_RETURN(std::unique_ptr<Trainer> trainer, Trainer::create(*backend, o));
  const double setup_s = seconds_since(setup_start);
  const auto init_start = std::chrono::steady_clock::now();
  SPILLWAY_RETURN_IF_ERROR(trainer->init_parameters());
  const double init_s = seconds_since(init_start);
  const double first_step_s = seconds_since(start);
  std::printf("bench train: %s (%s parameters) on %s, batch %dx%d, accum %d\nplan: %s\n", cfg.to_string().c_str(),
              format_count(static_cast<double>(cfg.num_parameters())).c_str(), backend->description().c_str(), f.batch,
              T, f.accum, trainer->plan().description.c_str());
  const SetupTimes& st = trainer->setup_times();
  std::printf("first step    after %.2f s: build, plan and allocate %.2f s (program %.2f s, kernel load %.2f s, "
              "plan %.2f s, executor and its memory %.2f s), parameter init %.2f s\n",
              first_step_s, setup_s, st.build_s, st.warm_up_s, st.plan_s, st.allocate_s, init_s);
  std::fflush(stdout);

  uint64_t rng = f.seed;
  const size_t n = static_cast<size_t>(f.batch) * T;
  std::vector<TokenBatch> batches(static_cast<size_t>(f.accum));
  double timed_s = 0, stall_s = 0, host_wait_s = 0, issue_s = 0, steps_own_s = 0;
  std::chrono::steady_clock::time_point timed_start = std::chrono::steady_clock::now();
  StepMetrics last;
  StepProfile profile;
  std::optional<CheckpointWriter> writer;
  if (!f.checkpoint_dir.empty()) {
    writer.emplace(f.checkpoint_dir, 1);
    writer->prepare(trainer->state_bytes(), &trainer->backend());
  }  // keep 1: the disk holds two at most (the kept one and the one being written)
  int checkpoints = 0;
  double checkpoint_wait_s = 0, tail_write_s = 0;
  // Timed steps by what their speculative updates became (a plan with Plan::speculation):
  // committed (the clip scale 1), redone (clipping active), or none started (the
  // step after a clipped one); their own times (trainer->step), summed.
  int speculated_steps = 0, clipped_steps = 0;
  double speculated_own_s = 0, clipped_own_s = 0;
  double profiled_step_s = 0;
  const int last_step = f.steps + (f.profile ? 1 : 0);
  for (int s = 1; s <= last_step; ++s) {
    if (interrupted()) return interrupted_status("before step " + std::to_string(s) + " of " + std::to_string(last_step));
    const bool profiled = s > f.steps;
    if (profiled) trainer->profile_next_step(&profile);
    // The timed steps run from the start of step 2 to the end of the last one's
    // optimizer (its host tail overlaps nothing after it: drained).
    if (s == 2) timed_start = std::chrono::steady_clock::now();
    for (TokenBatch& b : batches) {
      b.tokens.resize(n);
      b.targets.resize(n);
      for (size_t i = 0; i < n; ++i) {
        b.tokens[i] = static_cast<int32_t>(splitmix64_next(rng) % static_cast<uint64_t>(cfg.vocab));
        b.targets[i] = static_cast<int32_t>(splitmix64_next(rng) % static_cast<uint64_t>(cfg.vocab));
      }
    }
    auto r = trainer->step(batches);
    if (!r.ok()) return r.status().with_context("step " + std::to_string(s));
    std::printf("step %d: %.4f s, loss %.4f%s\n", s, r->step_s, r->loss,
                s == 1 ? " (warm-up, not timed)" : profiled ? " (profiled, not timed)" : "");
    std::fflush(stdout);
    if (profiled) {
      profiled_step_s = r->step_s;
      break;
    }
    if (s > 1) {
      // A step that speculated with the clip scale 1 ran the plan as planned; one that
      // speculated and clipped redid its updates; any other did not speculate (the
      // step after a clipped one). Read from the step's own counters and norm.
      if (r->exec.speculated_ops > 0) {
        const bool clipped = !(r->grad_norm <= o.max_grad_norm);
        (clipped ? clipped_steps : speculated_steps)++;
        (clipped ? clipped_own_s : speculated_own_s) += r->step_s;
      }
      steps_own_s += r->step_s;
      stall_s += r->exec.stall_s;
      host_wait_s += r->exec.host_wait_s;
      issue_s += r->exec.issue_s;
    }
    last = r->exec;
    if (writer && s < f.steps && s % f.checkpoint_every == 0) {
      SPILLWAY_RETURN_IF_ERROR(writer->begin(*trainer, {.step = s, .data_batch = s, .config = {{"bench", "train"}}})
                                   .with_context("--checkpoint-dir " + f.checkpoint_dir));
      ++checkpoints;
      if (s > 1) checkpoint_wait_s += writer->last_wait_s();
      const SnapshotTimes& st = writer->last_snapshot();
      std::printf("checkpoint of step %d: training waited %.3f s (drain %.3f s, %s device copies %s %.3f s; %s host "
                  "copies queued behind the next step's device work, %s read from storage)\n",
                  s, writer->last_wait_s(), st.drain_s, format_size(st.device_bytes).c_str(),
                  st.device_copies ? "issued into pinned memory (the next step's writers of them wait) in"
                                   : "staged in",
                  st.device_s, format_size(st.host_bytes).c_str(), format_size(st.storage_bytes).c_str());
    }
    if (s == f.steps) {
      SPILLWAY_RETURN_IF_ERROR(trainer->drain().with_context("step " + std::to_string(s)));
      const auto steps_end = std::chrono::steady_clock::now();
      // The write in flight counts: the timed steps end when the last checkpoint is on disk.
      if (writer) SPILLWAY_RETURN_IF_ERROR(writer->wait().status().with_context("--checkpoint-dir " + f.checkpoint_dir));
      timed_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - timed_start).count();
      tail_write_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - steps_end).count();
    }
  }
  const int timed = f.steps - 1;
  const double step_s = timed_s / timed;
  const double tokens = static_cast<double>(trainer->tokens_per_step());
  const double flops = trainer->program().flops();
  std::printf("tokens/s      %s\n", format_count(tokens / step_s).c_str());
  std::printf("step time     %.4f s (mean of %d steps)\n", step_s, timed);
  // What the simulator predicts for this plan on the machine the planner used, beside
  // the measurement (issue 13: predictions within 10%).
  // A plan with speculative updates is predicted for the steps as they ran: those whose
  // updates were committed as planned, the others without speculation.
  double predicted_s = 0;
  const double own_mean_s = steps_own_s / timed;  // the step calls' mean
  {
    const Program placed = placed_as_planned(trainer->program(), trainer->plan());
    // Steps back to back (simulate_loop_step), as the own steps below run them.
    const bool speculates = !trainer->plan().speculation.empty();
    const int unspeculated_steps = speculates ? timed - speculated_steps - clipped_steps : 0;
    const double as_planned = speculates && speculated_steps == 0
                                  ? 0
                                  : simulate_loop_step(placed, trainer->plan(), o.machine);
    const double clipped =
        clipped_steps > 0 ? simulate_loop_step(placed, trainer->plan(), o.machine, StepOutcome::Clipped) : 0;
    const double unspeculated =
        unspeculated_steps > 0 ? simulate_loop_step(placed, without_speculation(trainer->plan()), o.machine) : 0;
    predicted_s = speculates ? (speculated_steps * as_planned + clipped_steps * clipped +
                                unspeculated_steps * unspeculated) / timed
                             : as_planned;
    std::printf("predicted     %.4f s per step by the simulator on machine %s, steps back to back (%+.1f%% from the "
                "own steps)%s\n",
                predicted_s, o.machine.name.c_str(), own_mean_s > 0 ? 100.0 * (predicted_s / own_mean_s - 1) : 0.0,
                speculates ? (" for " + std::to_string(speculated_steps) + " timed steps with committed speculative "
                              "updates, " + std::to_string(clipped_steps) + " with them redone (clipping active) and " +
                              std::to_string(unspeculated_steps) + " without (the step after a clipped one)")
                                 .c_str()
                           : "");
  }
  // The steps' own times (each trainer->step call; a step's host optimizer tail is
  // waited for by the next one) leave out the last step's drain, which a run pays
  // once: the rate of a long run. Split by regime where the plan speculates, each
  // beside its own prediction.
  std::printf("own steps     %.4f s per step, %s tokens/s (the step calls alone; the drain of the last step's "
              "host optimizer, %.4f s, is paid once per run)\n",
              own_mean_s, format_count(tokens * timed / steps_own_s).c_str(),
              std::max(0.0, timed_s - steps_own_s - checkpoint_wait_s - tail_write_s));
  if (!trainer->plan().speculation.empty()) {
    const Program placed = placed_as_planned(trainer->program(), trainer->plan());
    const int others = timed - speculated_steps - clipped_steps;
    auto regime = [&](const char* what, int count, double own_s, const Plan& plan, StepOutcome outcome) {
      if (count == 0) return;
      const double mean = own_s / count, predicted = simulate_loop_step(placed, plan, o.machine, outcome);
      std::printf("  %d %s: %.4f s each, predicted %.4f s (%+.1f%%)\n", count, what, mean, predicted,
                  100.0 * (predicted / mean - 1));
    };
    regime(speculated_steps == 1 ? "step with committed speculation" : "steps with committed speculation",
           speculated_steps, speculated_own_s, trainer->plan(), StepOutcome::Committed);
    regime(clipped_steps == 1 ? "step with speculation redone (clipping active)"
                              : "steps with speculation redone (clipping active)",
           clipped_steps, clipped_own_s, trainer->plan(), StepOutcome::Clipped);
    regime(others == 1 ? "step without speculation (the step after a clipped one)"
                       : "steps without speculation (the step after a clipped one)",
           others, steps_own_s - speculated_own_s - clipped_own_s, without_speculation(trainer->plan()),
           StepOutcome::Committed);
  }
  if (writer)
    std::printf("checkpoints   %d of %s (every %d steps, written in the %s), training waited %.2f s for their "
                "snapshots (%.1f%% of the timed steps); the last write ended %.2f s after the last step (counted)\n",
                checkpoints, format_size(trainer->state_bytes()).c_str(), f.checkpoint_every,
                writer->sync_reason().empty() ? "background" : "foreground", checkpoint_wait_s,
                timed_s > 0 ? 100.0 * checkpoint_wait_s / timed_s : 0.0, tail_write_s);
  if (writer)
    std::printf("steady state  %.4f s per step: the steps' own times and the snapshot waits, without the last "
                "write's tail past the last step (a run that ends during a write pays that once)\n",
                (steps_own_s + checkpoint_wait_s) / timed);
  if (writer && writer->last_write().bytes > 0) {
    const CheckpointWriteStats w = writer->last_write();
    std::printf("last write    %s in %.2f s (%.2f GB/s%s), checksummed meanwhile\n", format_size(w.bytes).c_str(),
                w.seconds, w.seconds > 0 ? static_cast<double>(w.bytes) / w.seconds / 1e9 : 0.0,
                w.direct ? ", O_DIRECT" : ", through the page cache: the file system refused O_DIRECT");
  }
  if (backend->name() == "cuda")
    std::printf("GPU stalled   %.1f%% of the step (the compute stream idle, waiting for copies, host ops or storage; "
                "timed on the GPU by CUDA events)\n",
                timed_s > 0 ? 100.0 * stall_s / timed_s : 0.0);
  else
    std::printf("compute stalled %.1f%% of the step (waiting for copies, host ops or storage; compute runs on the "
                "executor's thread)\n",
                timed_s > 0 ? 100.0 * stall_s / timed_s : 0.0);
  std::printf("executor waits %.1f%% of the step (host time blocked on copies, host ops and regions; the GPU "
              "may be busy meanwhile)\n",
              timed_s > 0 ? 100.0 * host_wait_s / timed_s : 0.0);
  std::printf("host issue    %.4f s of the step (issuing every instruction; the rest waits for the device)\n",
              issue_s / timed);
  if (backend->name() == "cuda") {
    // MFU against the GPU's dense bf16 peak from its data sheet (none claimed for a
    // GPU not in the table), with the matrix-product rate of the planner's machine
    // model (measured by `spillway profile`) beside it.
    const DataSheetPeak peak = data_sheet_bf16_peak(backend->description());
    const double achieved = flops / step_s, matmul = o.machine.matmul_flops_per_s;
    if (peak.flops_per_s > 0)
      std::printf("MFU           %.1f%% (%.1f TFLOP/s of the %.0f dense bf16 peak on the %s data sheet; %.0f%% of the "
                  "%.0f TFLOP/s machine %s gives matrix products)\n",
                  100.0 * achieved / peak.flops_per_s, achieved / 1e12, peak.flops_per_s / 1e12, peak.part.c_str(),
                  matmul > 0 ? 100.0 * achieved / matmul : 0.0, matmul / 1e12, o.machine.name.c_str());
    else
      std::printf("achieved      %.1f TFLOP/s (no MFU: no data-sheet bf16 peak known for this GPU; %.0f%% of the %.0f "
                  "TFLOP/s machine %s gives matrix products)\n",
                  achieved / 1e12, matmul > 0 ? 100.0 * achieved / matmul : 0.0, matmul / 1e12, o.machine.name.c_str());
  }
  else
    std::printf("achieved      %.1f GFLOP/s (matrix products; no MFU on the CPU backend)\n", flops / step_s / 1e9);
  std::printf("per step      %s host->device, %s device->host, %s storage read, %s storage write, %d recomputed ops\n",
              format_size(last.h2d_bytes).c_str(), format_size(last.d2h_bytes).c_str(),
              format_size(last.storage_read_bytes).c_str(), format_size(last.storage_write_bytes).c_str(),
              last.recomputed_ops);
  if (!trainer->plan().speculation.empty()) {
    const SpeculationTally tally = trainer->executor().speculation_tally();
    std::printf("speculation   %zu host AdamW ops may start before the clip scale (%s of second buffers); over the "
                "run %llu committed, %llu redone (clipping active; %llu of them dropped before they ran, the scale "
                "known)\n",
                trainer->plan().speculation.size(), format_size(trainer->plan().speculation_bytes).c_str(),
                static_cast<unsigned long long>(tally.committed), static_cast<unsigned long long>(tally.redone),
                static_cast<unsigned long long>(tally.dropped));
  }
  std::printf("peaks         device %s, host %s, storage %s\n", format_size(last.peak_device_bytes).c_str(),
              format_size(last.peak_host_bytes).c_str(), format_size(last.peak_storage_bytes).c_str());
  const uint64_t used = backend->device_used_bytes(), used_peak = backend->device_peak_bytes();
  const uint64_t budget = o.budgets.device;
  std::printf("device used   %s now, %s at the peak (beyond the %s; budget %s)\n", format_size(used).c_str(),
              format_size(used_peak).c_str(), backend->name() == "cuda" ? "CUDA context, cudaMemGetInfo" : "backend",
              budget == UINT64_MAX ? "unlimited" : format_size(budget).c_str());
  if (!f.json.empty()) {
    std::FILE* out = std::fopen(f.json.c_str(), "w");
    if (!out) return Status::io_error("--json " + f.json + ": cannot open for writing: " + std::strerror(errno));
    const int n = std::fprintf(out,
        "{\"backend\":\"%s\",\"tokens_per_s\":%.1f,\"step_s\":%.6f,\"peak_device_bytes\":%llu,"
        "\"device_used_bytes\":%llu,\"device_used_peak_bytes\":%llu,\"device_budget_bytes\":%s,"
        "\"time_to_first_step_s\":%.6f,\"setup_s\":%.6f,\"setup_build_s\":%.6f,\"setup_kernel_load_s\":%.6f,"
        "\"setup_plan_s\":%.6f,\"setup_executor_s\":%.6f,\"init_s\":%.6f,\"checkpoints\":%d,\"checkpoint_wait_s\":%.6f,"
        "\"predicted_step_s\":%.6f,\"stall_share\":%.6f,\"host_wait_share\":%.6f,\"steady_state_step_s\":%.6f}\n",
        backend->name().c_str(), tokens / step_s, step_s, static_cast<unsigned long long>(last.peak_device_bytes),
        static_cast<unsigned long long>(used), static_cast<unsigned long long>(used_peak),
        budget == UINT64_MAX ? "null" : std::to_string(budget).c_str(), first_step_s, setup_s, st.build_s,
        st.warm_up_s, st.plan_s, st.allocate_s, init_s, checkpoints,
        checkpoint_wait_s, predicted_s, timed_s > 0 ? stall_s / timed_s : 0.0, timed_s > 0 ? host_wait_s / timed_s : 0.0,
        (steps_own_s + checkpoint_wait_s) / timed);
    const bool closed = std::fclose(out) == 0;
    if (n < 0 || !closed) return Status::io_error("--json " + f.json + ": write failed: " + std::strerror(errno));
  }
  if (f.profile) print_profile(trainer->program(), trainer->plan(), profile, step_s, profiled_step_s);
  return Status::ok();
}

CommandRegistration bench_train_command("bench train", "tokens/s, step time, stalls and MFU of training steps",
                                        [](CLI::App& app) -> CommandRun {
  auto f = std::make_shared<BenchTrainFlags>();
  add_model_flags(app, f->model);
  app.add_flag("--profile", f->profile, "after the timed steps, time each op of one more step alone: the split "
                                        "into matmul, attention, other kernels and optimizer");
  app.add_option("--steps", f->steps, "steps, the first a warm-up")->capture_default_str();
  app.add_option("--batch", f->batch, "sequences per micro-batch")->capture_default_str();
  app.add_option("--context", f->context, "tokens per sequence (default: the model's context)")->check(positive_number());
  app.add_option("--accum", f->accum, "micro-batches per step")->capture_default_str();
  app.add_option("--seed", f->seed, "parameters and random tokens")->capture_default_str();
  app.add_option("--grad-clip", f->grad_clip,
                 "max global gradient norm (0 = no clipping); speculative updates stand only in steps where it "
                 "does not clip")
      ->capture_default_str();
  app.add_option("--checkpoint-dir", f->checkpoint_dir,
                 "also write checkpoints of the whole state here (in the background), timed with the steps");
  app.add_option("--checkpoint-every", f->checkpoint_every, "steps between checkpoints (with --checkpoint-dir)");
  app.add_option("--json", f->json, "also write the figures (tokens/s, step time, device memory used beyond the "
                                     "CUDA context and its peak, the budget) to this file as one JSON object");
  add_memory_flags(app, f->memory);
  app.add_option("--machine", f->machine,
                 "the planner's machine model: h200, cpu, a file from `spillway profile`, or measured: this host's "
                 "measured machine from the cache, profiled briefly (seconds, once per host, GPU and driver) and "
                 "cached when there is none (default on CUDA: measured; on the CPU: cpu)");
  return [f]() -> int {
    Status s = run_bench(*f);
    return s.is_ok() ? 0 : fail(s);
  };
});

}  // namespace
}  // namespace spillway::cli
