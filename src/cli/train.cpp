// `spillway train`: trains a GPT model on a text or token file under memory
// budgets, with a progress line, per-step JSON metrics, evaluation, checkpoints and
// an optional Perfetto trace of one step.
//
//   spillway train                                     # tiny on the bundled corpus
//   spillway train --device-budget 4MiB --policy planned --metrics m.jsonl --save tiny.safetensors
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <filesystem>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <limits>
#include <memory>
#include <optional>
#include <set>
#include <sstream>
#include <type_traits>

#include "cli/command.h"
#include "cli/machine_flag.h"
#include "cli/output_paths.h"
#include "cli/text_data.h"
#include "cli/train_flags.h"
#include "core/atomic_file.h"
#include "core/interrupt.h"
#include "core/size.h"
#include "dist/data_parallel_training.h"
#include "dist/rank_env.h"
#ifdef SPILLWAY_HAVE_NCCL
#include "dist/nccl/nccl_communicator.h"
#endif
#include "exec/trace.h"
#include "memory/storage_store.h"
#include "model/hf_model.h"
#include "plan/plan.h"
#include "sim/simulator.h"
#include "train/checkpoint.h"
#include "train/data.h"
#include "train/trainer.h"

namespace spillway::cli {
namespace {

struct TrainFlags {
  ModelFlags model;
  MemoryFlags memory;
  std::string machine;  // --machine FILE|PRESET|measured ("": measured on CUDA, the cpu preset on the CPU)
  std::string data;
  std::string tokenizer;  // --tokenizer: a tokenizer.json (or its directory) that encodes --data
  int steps = 300, batch = 8, context = 0, accum = 1;
  float lr = 0;  // 0: 4e-3 for models up to 10M parameters, else 6e-4
  int warmup = 20;
  double grad_clip = 1.0;  // --grad-clip: max global gradient norm (0: no clipping)
  uint64_t seed = 1337;
  int eval_every = 100, eval_batches = 20;
  int zero_stage = 2;  // --zero-stage: data parallel, 2 (parameters on every rank) or 3 (on their owners)
  std::string save, save_grads, load, metrics, trace;
  std::string trace_predicted;  // --trace-predicted: the simulator's step of the plan this run executes
  bool allow_nonfinite_weights = false;  // --load: accept NaN and Inf in the weights
  bool quiet = false;
  std::string checkpoint_dir, resume;    // --checkpoint-dir, --resume
  int checkpoint_every = 0, keep = 2, stop_after = 0;
  std::set<std::string> given;           // the flags given on the command line (--resume compares them)
};

// What a run's math depends on, as a checkpoint records it (--resume refuses a
// given flag that differs, and takes the rest from here).
// With `world` ranks of --accum micro-batches each, the math is one process's with
// world·accum (what "accum" records, so that a checkpoint resumes onto any world size
// that divides it).
nlohmann::json run_config(const ModelConfig& cfg, const TrainFlags& f, int T, float lr, const std::string& data,
                          int world = 1) {
  nlohmann::json model = {{"layers", cfg.layers}, {"width", cfg.width}, {"heads", cfg.heads},
                          {"context", cfg.context}, {"vocab", cfg.vocab}};
  if (cfg.arch == Arch::Llama) {  // what --arch llama needs to build it again on --resume
    model["arch"] = "llama";
    model["kv_heads"] = cfg.kv_heads;
    model["intermediate"] = cfg.intermediate;
    model["rope_theta"] = static_cast<double>(cfg.rope.theta);
    model["rope_scaling"] = rope_scaling_text(cfg.rope);
    model["norm_eps"] = static_cast<double>(cfg.norm_eps);
    model["untied"] = !cfg.tied;
  }
  return {{"model", model},
          {"batch", f.batch}, {"context", T}, {"accum", f.accum * world}, {"lr", lr}, {"warmup", f.warmup},
          {"grad_clip", f.grad_clip}, {"steps", f.steps}, {"seed", f.seed}, {"data", data}, {"tokenizer", f.tokenizer}};
}

// --resume: the run's flags from the checkpoint's config; a flag given on the
// command line that changes the math must agree (the error names each difference).
Status apply_checkpoint_config(const nlohmann::json& c, TrainFlags& f) {
  std::vector<std::string> differ;
  auto take = [&](const char* flag, auto& field, const nlohmann::json& value) {
    using V = std::decay_t<decltype(field)>;
    // The type first: converting a JSON float to an integer out of range is undefined.
    bool fits = false;
    if constexpr (std::is_same_v<V, std::string>) {
      fits = value.is_string();
    } else if constexpr (std::is_floating_point_v<V>) {
      fits = value.is_number();
    } else if constexpr (std::is_unsigned_v<V>) {
      fits = value.is_number_unsigned() || (value.is_number_integer() && value.get<int64_t>() >= 0);
    } else {
      // (JSON text's non-negative integers parse as unsigned.)
      fits = value.is_number_integer() &&
             (value.is_number_unsigned()
                  ? value.get<uint64_t>() <= static_cast<uint64_t>(std::numeric_limits<V>::max())
                  : value.get<int64_t>() >= std::numeric_limits<V>::min() &&
                        value.get<int64_t>() <= std::numeric_limits<V>::max());
    }
    if (!fits) throw nlohmann::json::type_error::create(302, std::string(flag) + ": " + value.dump() + " is not a valid value", &value);
    const V v = value.get<V>();
    if (f.given.count(flag) && field != v) {
      std::ostringstream d;
      d << flag << " " << field << " (the checkpoint's: " << v << ")";
      differ.push_back(d.str());
    }
    field = v;
  };
  try {
    const nlohmann::json& m = c.at("model");
    take("--layers", f.model.layers, m.at("layers"));
    take("--width", f.model.width, m.at("width"));
    take("--heads", f.model.heads, m.at("heads"));
    take("--model-context", f.model.model_context, m.at("context"));
    take("--vocab", f.model.vocab, m.at("vocab"));
    if (m.contains("arch")) {  // a Llama: rebuilt from its sizes with --arch llama
      take("--arch", f.model.arch, m.at("arch"));
      take("--kv-heads", f.model.kv_heads, m.at("kv_heads"));
      take("--intermediate", f.model.intermediate, m.at("intermediate"));
      take("--rope-theta", f.model.rope_theta, m.at("rope_theta"));
      take("--rope-scaling", f.model.rope_scaling, m.at("rope_scaling"));
      take("--norm-eps", f.model.norm_eps, m.at("norm_eps"));
      const bool untied = m.at("untied").get<bool>();
      if (f.given.count("--untied") && f.model.untied != untied) differ.push_back("--untied (the checkpoint's model is tied)");
      f.model.untied = untied;
      f.model.model_given = false;  // the sizes above are the whole model
    }
    take("--batch", f.batch, c.at("batch"));
    take("--context", f.context, c.at("context"));
    take("--accum", f.accum, c.at("accum"));
    take("--lr", f.lr, c.at("lr"));
    take("--warmup", f.warmup, c.at("warmup"));
    // Checkpoints from before --grad-clip existed clipped at 1.
    if (c.contains("grad_clip")) take("--grad-clip", f.grad_clip, c.at("grad_clip"));
    else take("--grad-clip", f.grad_clip, nlohmann::json(1.0));
    take("--steps", f.steps, c.at("steps"));
    take("--seed", f.seed, c.at("seed"));
    take("--data", f.data, c.at("data"));
    if (c.contains("tokenizer")) take("--tokenizer", f.tokenizer, c.at("tokenizer"));
  } catch (const nlohmann::json::exception& e) {
    return Status::corrupt(std::string("the checkpoint's config: ") + e.what());
  }
  if (f.given.count("--model") && !f.given.count("--layers")) {
    // A preset named on the command line must be the checkpoint's model.
    auto preset = model_preset(f.model.model);
    if (preset.ok() && (preset->layers != f.model.layers || preset->width != f.model.width ||
                        preset->heads != f.model.heads || preset->vocab != f.model.vocab))
      differ.push_back("--model " + f.model.model + " (the checkpoint's model is " +
                       std::to_string(f.model.layers) + " layers, width " + std::to_string(f.model.width) + ")");
  }
  if (!differ.empty()) {
    std::string m = "--resume: these flags change the training's math and differ from the checkpoint's: ";
    for (size_t i = 0; i < differ.size(); ++i) m += (i ? "; " : "") + differ[i];
    return Status::invalid_argument(m + " (leave them out to continue the run as it was)");
  }
  return Status::ok();
}

std::string format_duration(double s) {
  if (!std::isfinite(s) || s < 0) s = 0;
  const auto total = static_cast<long long>(s + 0.5);
  char buf[32];
  if (total >= 3600) std::snprintf(buf, sizeof buf, "%lld:%02lld:%02lld", total / 3600, total / 60 % 60, total % 60);
  else std::snprintf(buf, sizeof buf, "%lld:%02lld", total / 60, total % 60);
  return buf;
}

// The progress line on stderr: redrawn in place on a terminal, else one line every
// `interval` steps (and on evaluation steps and the last step).
class Progress {
 public:
  Progress(int steps, bool quiet) : steps_(steps), quiet_(quiet), tty_(::isatty(STDERR_FILENO) == 1) {
    interval_ = std::max(1, steps / 20);
  }
  void update(const StepResult& r, double elapsed_s) {
    if (quiet_) return;
    const bool last = r.step == steps_;
    if (!tty_ && !last && !r.val_loss && r.step != 1 && r.step % interval_ != 0) return;
    const double per_step = elapsed_s / static_cast<double>(r.step);
    char line[256];
    std::snprintf(line, sizeof line, "step %lld/%d  loss %.4f%s  %s tok/s  ETA %s", static_cast<long long>(r.step),
                  steps_, r.loss, val_text(r).c_str(), format_count(r.tokens_per_s).c_str(),
                  format_duration(per_step * static_cast<double>(steps_ - r.step)).c_str());
    // On a terminal the line is redrawn; evaluation results stay on screen.
    if (tty_) std::fprintf(stderr, "\r%-90s%s", line, last || r.val_loss ? "\n" : "");
    else std::fprintf(stderr, "%s\n", line);
    std::fflush(stderr);
  }
  // Ends a redrawn line before other output.
  void interrupt() {
    if (tty_ && !quiet_) std::fprintf(stderr, "\n");
  }

 private:
  static std::string val_text(const StepResult& r) {
    if (!r.val_loss) return "";
    char buf[32];
    std::snprintf(buf, sizeof buf, "  val %.4f", *r.val_loss);
    return buf;
  }
  int steps_;
  bool quiet_;
  bool tty_;
  int interval_ = 1;
};

Status check_positive(int value, const char* flag, int minimum = 1) {
  if (value < minimum)
    return Status::invalid_argument(std::string(flag) + " must be at least " + std::to_string(minimum) + ", got " +
                                    std::to_string(value));
  return Status::ok();
}

// A step failed (the message names it). A step stopped on a non-finite loss or
// gradient norm leaves a whole state (trainer.h): its metrics line is written (nulls
// for the bad numbers) and, with --save, that state is saved, as the user asked to
// keep it. A step that failed inside the executor may leave it half-updated: the
// trainer refuses to save it, and nothing is written.
Status stop_after_failed_step(Trainer& trainer, const Status& error, const TrainFlags& f, std::ofstream& metrics) {
  std::string outcome;
  if (trainer.rejected_step() && metrics.is_open()) {
    metrics << metrics_json(*trainer.rejected_step()) << "\n";
    metrics.flush();
    if (!metrics) outcome += "; --metrics: writing " + f.metrics + " failed: " + std::strerror(errno);
  }
  if (!f.save.empty()) {
    Status saved = trainer.save(f.save);
    if (saved.is_ok())
      outcome += "; saved them to " + f.save;
    else if (!trainer.state_status().is_ok())
      outcome += "; nothing was saved to " + f.save;
    else
      outcome += "; --save " + f.save + " failed: " + saved.message();
  }
  if (!f.save_grads.empty()) outcome += "; --save-grads " + f.save_grads + " not written (the step failed)";
  return Status(error.code(), error.message() + outcome);
}

// WORLD_SIZE > 1: what data-parallel training cannot do, refused before anything is
// loaded, each naming its flag. Rank 0 alone writes --save, --metrics and --trace.
Status check_data_parallel_flags(const TrainFlags& f, const RankEnv& env) {
  const std::string job = "WORLD_SIZE=" + std::to_string(env.world) + " (data-parallel training, rank " +
                          std::to_string(env.rank) + ")";
  if (f.memory.backend == "cpu")
    return Status::unsupported(job + ": --backend cpu has no transport between processes; data-parallel training "
                               "runs on CUDA devices over NCCL (--backend cuda). Unset WORLD_SIZE to train in one "
                               "process");
  if (!f.save_grads.empty())
    return Status::unsupported(job + ": --save-grads is not supported: the gradients live reduced on the rank that "
                               "owns each parameter");
  if (!f.trace_predicted.empty())
    return Status::unsupported(job + ": --trace-predicted is not supported (the simulator draws one process's step; "
                               "`spillway simulate --gpus N` predicts a data-parallel one)");
  if (f.memory.policy == "auto" && f.memory.auto_confirm > 1)
    return Status::unsupported(job + ": --policy auto with --auto-confirm " + std::to_string(f.memory.auto_confirm) +
                               " is not supported (timing candidates would run collectives): add --auto-confirm 1 "
                               "for the simulator's best plan");
#ifndef SPILLWAY_HAVE_NCCL
  return Status::unsupported(job + ": this spillway was built without NCCL (nccl.h and libnccl were not found with "
                             "the CUDA toolkit at build time), which data-parallel training needs");
#endif
  return Status::ok();
}

// A data-parallel checkpoint's config for `world` ranks: its "accum" is the whole
// step's micro-batches (world × --accum), which `world` must divide.
Result<nlohmann::json> config_for_world(nlohmann::json config, int world, const std::string& path) {
  if (!config.contains("accum") || !config["accum"].is_number_integer() || config["accum"].get<int64_t>() < 1)
    return Status::corrupt(path + ": the manifest's config has no micro-batch count (accum)");
  const int64_t total = config["accum"].get<int64_t>();
  if (total % world != 0)
    return Status::invalid_argument("--resume " + path + ": its run takes " + std::to_string(total) +
                                    " micro-batches a step (ranks × --accum), which WORLD_SIZE=" +
                                    std::to_string(world) + " does not divide; resume it on a number of ranks that "
                                    "does (each rank then takes --accum " + std::to_string(total) +
                                    " / ranks)");
  config["accum"] = total / world;
  return config;
}

// One rank of a data-parallel run (dist/data_parallel_training.h) over NCCL: the job's
// id from SPILLWAY_NCCL_ID (spillway launch) or, from rank 0, through a rendezvous
// file (torchrun); rank 0 prints and writes what one process would.
Status run_data_parallel(const TrainFlags& f, const RankEnv& env, const TrainerOptions& o, const Dataset& data,
                         const std::string& data_path, const nlohmann::json& config, const std::string& resume,
                         Backend& backend) {
#ifndef SPILLWAY_HAVE_NCCL
  (void)f, (void)env, (void)o, (void)data, (void)data_path, (void)config, (void)resume, (void)backend;
  return Status::unsupported("this spillway was built without NCCL");
#else
  const bool lead = env.rank == 0;
  const std::string me = "rank " + std::to_string(env.rank) + " of " + std::to_string(env.world);
  NcclId id{};
  std::string rendezvous;
  if (!env.nccl_id.empty()) {
    auto parsed = nccl_id_from_hex(env.nccl_id);
    if (!parsed.ok()) return parsed.status().with_context("SPILLWAY_NCCL_ID");
    id = *parsed;
  } else {
    rendezvous = rendezvous_path(env);
    if (lead) {
      SPILLWAY_ASSIGN_OR_RETURN(id, nccl_unique_id());
      SPILLWAY_RETURN_IF_ERROR(publish_rendezvous(rendezvous, nccl_id_to_hex(id)));
    } else {
      SPILLWAY_ASSIGN_OR_RETURN(std::string text, await_rendezvous(rendezvous, std::chrono::seconds(300)));
      auto parsed = nccl_id_from_hex(text);
      if (!parsed.ok()) return parsed.status().with_context("the NCCL id in " + rendezvous);
      id = *parsed;
    }
  }
  auto comm = NcclCommunicator::create(env.rank, env.world, id, env.local_rank);
  if (!comm.ok())
    return comm.status().with_context("joining the NCCL job as " + me + " on CUDA device " +
                                      std::to_string(env.local_rank) + " (LOCAL_RANK)");
  if (lead && !rendezvous.empty()) {  // every rank has joined, so every rank has read it
    if (Status s = remove_rendezvous(rendezvous); !s.is_ok()) std::cerr << "spillway: warning: " << s.message() << "\n";
  }

  std::ofstream metrics;
  if (lead && !f.metrics.empty()) {
    metrics.open(f.metrics, std::ios::out | std::ios::trunc);
    if (!metrics) return errno_status("--metrics: open " + f.metrics, errno);
  }
  const bool quiet = f.quiet || !lead;
  if (!quiet)
    std::cerr << "spillway train: " << o.model.to_string() << " ("
              << format_count(static_cast<double>(o.model.num_parameters())) << " parameters), data parallel: "
              << env.world << " ranks (WORLD_SIZE), this one on " << backend.description() << "\n"
              << "  data " << data_path << ": " << format_count(static_cast<double>(data.train.size())) << " train, "
              << format_count(static_cast<double>(data.val.size())) << " val tokens; batch " << f.batch << "x"
              << o.shape.T << ", accum " << f.accum << " a rank (" << f.accum * env.world << " micro-batches a step), "
              << f.steps << " steps, lr " << o.schedule.peak << "\n"
              << "  budgets (each rank): device "
              << (o.budgets.device == UINT64_MAX ? std::string("unlimited") : format_size(o.budgets.device))
              << ", host " << format_size(o.budgets.host) << ", storage "
              << (o.budgets.storage ? format_size(o.budgets.storage) : std::string("none")) << "; machine "
              << o.machine.name << "\n";

  DataParallelTrainingOptions d;
  d.trainer = o;
  d.data = &data;
  d.steps = f.steps;
  d.stop_after = f.stop_after;
  d.eval_every = f.eval_every;
  d.eval_batches = f.eval_batches;
  d.zero_stage = f.zero_stage;
  d.load = f.load;
  d.allow_nonfinite = f.allow_nonfinite_weights;
  if (lead) d.save = f.save;
  d.checkpoint_dir = f.checkpoint_dir;
  d.checkpoint_every = f.checkpoint_every;
  d.keep = f.keep;
  d.resume = resume;
  d.config = config;
  Trace trace;
  const int trace_step = f.steps >= 2 ? 2 : 1;
  if (lead && !f.trace.empty()) {
    d.trace = &trace;
    d.trace_step = trace_step;
  }
  Progress progress(f.steps, quiet);
  StepMetrics peaks;
  double elapsed = 0, timed_s = 0;
  int64_t timed_tokens = 0;
  Status callback_error;
  const auto loop_start = std::chrono::steady_clock::now();
  d.on_step = [&](const StepResult& r) {
    elapsed += r.step_s;
    if (r.step > 1 || f.steps == 1) {
      timed_s += r.step_s;
      timed_tokens += r.tokens;
    }
    peaks.peak_device_bytes = std::max(peaks.peak_device_bytes, r.exec.peak_device_bytes);
    peaks.peak_host_bytes = std::max(peaks.peak_host_bytes, r.exec.peak_host_bytes);
    peaks.peak_storage_bytes = std::max(peaks.peak_storage_bytes, r.exec.peak_storage_bytes);
    peaks.h2d_bytes += r.exec.h2d_bytes;
    peaks.d2h_bytes += r.exec.d2h_bytes;
    peaks.stall_s += r.exec.stall_s;
    if (!lead) return;
    if (metrics.is_open() && callback_error.is_ok()) {
      metrics << metrics_json(r) << "\n";
      metrics.flush();
      if (!metrics) callback_error = errno_status("--metrics: write " + f.metrics, errno);
    }
    progress.update(r, std::chrono::duration<double>(std::chrono::steady_clock::now() - loop_start).count());
    if (d.trace && r.step == trace_step && callback_error.is_ok())
      callback_error = trace.write(f.trace).with_context("--trace");
  };
  d.stop_requested = [&]() { return interrupted() || !callback_error.is_ok(); };
  if (lead && !resume.empty() && !quiet)
    std::cerr << "spillway train: resuming from " << resume << "\n";

  auto run = train_data_parallel(**comm, backend, d);
  if (!run.ok()) {
    progress.interrupt();
    return run.status().with_context(me);
  }
  if (!callback_error.is_ok()) return callback_error;
  if (run->stopped) {
    progress.interrupt();
    return interrupted_status("before step " + std::to_string(run->steps_done + 1) + " of " + std::to_string(f.steps) +
                              " (every rank stopped there)" +
                              (run->checkpoint.empty() ? ""
                                                       : "; checkpoint " + run->checkpoint +
                                                             " written: continue with --resume " + f.checkpoint_dir) +
                              (f.save.empty() ? "" : "; nothing was saved to " + f.save));
  }
  if (metrics.is_open()) {
    metrics.close();
    if (!metrics) return errno_status("--metrics: close " + f.metrics, errno);
  }
  if (!lead) return Status::ok();
  const int final_step = f.stop_after > 0 ? std::min(f.steps, f.stop_after) : f.steps;
  const double tps = timed_s > 0 ? static_cast<double>(timed_tokens) / timed_s : 0;
  if (run->last) {
    std::printf("final train loss %.4f", run->last->loss);
    if (run->last_val) std::printf(", val loss %.4f", *run->last_val);
    std::printf(" after %d steps (%s tokens, %d ranks)\n", f.steps,
                format_count(static_cast<double>(run->tokens_per_step) * f.steps).c_str(), env.world);
    std::printf("throughput %s tokens/s (all ranks), %.3f s/step; rank 0's compute stalled %.1f%% of it\n",
                format_count(tps).c_str(), timed_s > 0 ? timed_s / std::max(1, f.steps > 1 ? f.steps - 1 : 1) : 0.0,
                elapsed > 0 ? 100.0 * peaks.stall_s / elapsed : 0.0);
    std::printf("rank 0's peaks: device %s, host %s, storage %s; moved %s host->device, %s device->host\n",
                format_size(peaks.peak_device_bytes).c_str(), format_size(peaks.peak_host_bytes).c_str(),
                format_size(peaks.peak_storage_bytes).c_str(), format_size(peaks.h2d_bytes).c_str(),
                format_size(peaks.d2h_bytes).c_str());
  }
  std::printf("rank 0's plan: %s\n", run->plan.c_str());
  if (!f.save.empty()) std::printf("saved %s\n", f.save.c_str());
  if (!run->checkpoint.empty()) {
    std::printf("checkpoint %s (step %lld, sharded over %d ranks)\n", run->checkpoint.c_str(),
                static_cast<long long>(run->steps_done), env.world);
    if (final_step < f.steps)
      std::printf("stopped after step %d of %d (--stop-after): continue with --resume %s\n", final_step, f.steps,
                  f.checkpoint_dir.c_str());
  }
  if (!f.trace.empty()) std::printf("trace of step %d (rank 0): %s (open in https://ui.perfetto.dev)\n", trace_step, f.trace.c_str());
  std::fflush(stdout);
  return Status::ok();
#endif
}

Status run_train(const TrainFlags& given_flags) {
  // SIGINT/SIGTERM: stop between steps; the spill directory goes with the trainer.
  SPILLWAY_RETURN_IF_ERROR(install_interrupt_handlers(InterruptMode::BetweenSteps));
  TrainFlags f = given_flags;
  // RANK, WORLD_SIZE, LOCAL_RANK (torchrun, spillway launch): WORLD_SIZE > 1 trains
  // data-parallel (run_data_parallel); unset or 1 is one process, as always.
  SPILLWAY_ASSIGN_OR_RETURN(const RankEnv env, rank_env());
  if (env.distributed()) SPILLWAY_RETURN_IF_ERROR(check_data_parallel_flags(f, env));
  if (!env.distributed() && f.zero_stage == 3)
    return Status::invalid_argument("--zero-stage 3 partitions the parameters over data-parallel ranks; this is one "
                                    "process (run it under `spillway launch --gpus N` or with WORLD_SIZE > 1)");
  // A new run (no --resume) into a folder that holds another run's checkpoints of its
  // own kind (ckpt-* for one process, dp-ckpt-* for data-parallel ranks) would mix them,
  // and --keep would delete them: refused before anything runs.
  if (f.resume.empty() && !f.checkpoint_dir.empty()) {
    std::error_code ec;
    if (std::filesystem::is_directory(f.checkpoint_dir, ec)) {
      std::string newest;
      if (env.distributed()) {
        if (holds_data_parallel_checkpoints(f.checkpoint_dir)) newest = "data-parallel dp-ckpt-* folders";
      } else {
        auto folders = checkpoint_folders(f.checkpoint_dir);
        if (!folders.ok()) return folders.status().with_context("--checkpoint-dir");
        if (!folders->empty()) newest = "newest: " + folders->front().second;
      }
      if (!newest.empty())
        return Status::invalid_argument("--checkpoint-dir " + f.checkpoint_dir +
                                        " already holds checkpoints of an earlier run (" + newest +
                                        "); continue that run with --resume " + f.checkpoint_dir +
                                        ", or give a new or empty folder (this run's --keep would delete them)");
    }
  }
  std::optional<Checkpoint> resume;
  std::string dp_resume;  // data parallel: the checkpoint folder to go on from
  if (!f.resume.empty()) {
    if (!f.load.empty()) return Status::invalid_argument("--resume and --load: give one (the checkpoint holds the weights)");
    std::vector<std::string> skipped;
    if (env.distributed()) {
      auto c = newest_data_parallel_checkpoint(f.resume, &skipped);
      if (env.rank == 0)
        for (const std::string& s : skipped) std::cerr << "spillway: warning: --resume: skipped " << s << "\n";
      if (!c.ok()) return c.status().with_context("--resume");
      SPILLWAY_ASSIGN_OR_RETURN(nlohmann::json config, config_for_world(c->config, env.world, c->path));
      SPILLWAY_RETURN_IF_ERROR(apply_checkpoint_config(config, f).with_context(c->path));
      dp_resume = c->path;
    } else {
      auto c = newest_checkpoint(f.resume, &skipped);
      if (!c.ok() && holds_data_parallel_checkpoints(f.resume))
        return Status::invalid_argument(
            "--resume " + f.resume + " holds data-parallel checkpoints (dp-ckpt-*: shards of several ranks), which "
            "load onto WORLD_SIZE > 1 only (spillway launch --gpus N train --resume " + f.resume + "); " +
            c.status().message());
      for (const std::string& s : skipped) std::cerr << "spillway: warning: --resume: skipped " << s << "\n";
      if (!c.ok()) return c.status().with_context("--resume");
      SPILLWAY_RETURN_IF_ERROR(apply_checkpoint_config(c->meta.config, f).with_context(c->path));
      resume = std::move(*c);
    }
    if (f.checkpoint_dir.empty()) f.checkpoint_dir = f.resume;
  }
  SPILLWAY_RETURN_IF_ERROR(check_positive(f.checkpoint_every, "--checkpoint-every", 0));
  SPILLWAY_RETURN_IF_ERROR(check_positive(f.keep, "--keep"));
  SPILLWAY_RETURN_IF_ERROR(check_positive(f.stop_after, "--stop-after", 0));
  if ((f.checkpoint_every > 0 || f.stop_after > 0) && f.checkpoint_dir.empty())
    return Status::invalid_argument(std::string(f.checkpoint_every > 0 ? "--checkpoint-every" : "--stop-after") +
                                    " needs --checkpoint-dir DIR (where the checkpoints go)");
  if (f.keep != TrainFlags{}.keep && f.checkpoint_dir.empty())
    return Status::invalid_argument("--keep " + std::to_string(f.keep) +
                                    " needs --checkpoint-dir DIR (the checkpoints it keeps); without one it would be ignored");
  SPILLWAY_RETURN_IF_ERROR(check_positive(f.steps, "--steps"));
  SPILLWAY_RETURN_IF_ERROR(check_positive(f.batch, "--batch"));
  SPILLWAY_RETURN_IF_ERROR(check_positive(f.accum, "--accum"));
  SPILLWAY_RETURN_IF_ERROR(check_positive(f.context, "--context", 0));
  SPILLWAY_RETURN_IF_ERROR(check_positive(f.warmup, "--warmup", 0));
  SPILLWAY_RETURN_IF_ERROR(check_positive(f.eval_every, "--eval-every", 0));
  SPILLWAY_RETURN_IF_ERROR(check_positive(f.eval_batches, "--eval-batches"));
  if (f.zero_stage != 2 && f.zero_stage != 3)
    return Status::invalid_argument("--zero-stage: expected 2 (optimizer state and gradients partitioned over the "
                                    "data-parallel ranks) or 3 (the parameters too), got " +
                                    std::to_string(f.zero_stage));
  if (!(f.grad_clip >= 0) || !std::isfinite(f.grad_clip))
    return Status::invalid_argument("--grad-clip: expected a finite number >= 0 (0 = no clipping), got " +
                                    std::to_string(f.grad_clip));
  if (!(f.lr >= 0) || !std::isfinite(f.lr))
    return Status::invalid_argument("--lr must be a positive number, got " + std::to_string(f.lr));

  // Model: from the checkpoint with --load, else the preset and explicit sizes.
  ModelConfig cfg;
  if (!f.load.empty()) {
    // A .safetensors file or a Hugging Face model directory (model/hf_model.h): GPT-2
    // sizes from the weights' shapes and heads from config.json, the __metadata__ or
    // --heads; a Llama's from config.json. Model flags must agree with what it says.
    SPILLWAY_ASSIGN_OR_RETURN(cfg, resolve_loaded_model(f.model, f.load));
  } else {
    SPILLWAY_ASSIGN_OR_RETURN(cfg, resolve_model(f.model));
  }
  const int T = f.context ? f.context : cfg.context;
  if (T > cfg.context)
    return Status::invalid_argument("--context " + std::to_string(T) + " is longer than the model's context " +
                                    std::to_string(cfg.context) + " (" + cfg.to_string() + ")");

  // Outputs, before anything is read or written: none overwrites an input or another
  // output, and each one's folder exists (they were found missing after the last step).
  {
    const bool machine_file = !f.machine.empty() && f.machine != "h200" && f.machine != "cpu" && f.machine != "measured";
    SPILLWAY_RETURN_IF_ERROR(check_output_paths(
        {{"--data", f.data}, {"--load", f.load}, {"--tokenizer", f.tokenizer}, {"--machine", machine_file ? f.machine : ""}},
        {{"--save", f.save, true, "--load"}, {"--save-grads", f.save_grads}, {"--metrics", f.metrics}, {"--trace", f.trace}}));
    if (!f.checkpoint_dir.empty()) {
      std::error_code ec;
      const std::string& dir = f.checkpoint_dir;
      if (std::filesystem::exists(dir, ec)) {
        if (!std::filesystem::is_directory(dir, ec))
          return Status::invalid_argument("--checkpoint-dir " + dir + " is not a directory");
        if (::access(dir.c_str(), W_OK) != 0) return errno_status("--checkpoint-dir " + dir + ": cannot write into it", errno);
      } else {
        const std::filesystem::path parent = std::filesystem::path(dir).parent_path();
        const std::string folder = parent.empty() ? "." : parent.string();
        if (!std::filesystem::is_directory(folder, ec))
          return Status::invalid_argument("--checkpoint-dir " + dir + ": its parent folder " + folder +
                                          " does not exist (make it first)");
        if (::access(folder.c_str(), W_OK) != 0)
          return errno_status("--checkpoint-dir " + dir + ": cannot make it in " + folder, errno);
      }
    }
  }

  // Data.
  std::string data_path = f.data;
  Result<Dataset> data = Status::internal("no data");
  if (!f.tokenizer.empty()) {
    // Text encoded on every core (cli/text_data.h); the model's vocabulary must cover the tokenizer's.
    data = load_tokenized_data(f.tokenizer, f.data, cfg.vocab, f.memory.threads, &data_path);
    if (!data.ok()) return data.status();
  } else if (data_path.empty()) {
    data = load_default_data(cfg.vocab, &data_path);  // $SPILLWAY_DATA, else the bundled corpus
    if (!data.ok()) return data.status();
  } else {
    data = load_dataset(data_path, cfg.vocab);
    if (!data.ok()) return data.status().with_context("--data");
  }
  auto train_loader = DataLoader::create(data->train, f.batch, T, LoaderMode::Random, f.seed);
  if (!train_loader.ok()) return train_loader.status().with_context("--data");
  auto val_loader = DataLoader::create(data->val, f.batch, T, LoaderMode::Sequential);
  if (!val_loader.ok()) return val_loader.status().with_context("--data (validation split)");

  // Backend and memory.
  SPILLWAY_ASSIGN_OR_RETURN(std::unique_ptr<Backend> backend,
                            open_backend(f.memory.backend, f.memory.threads, env.local_rank));
  if (env.distributed() && backend->name() != "cuda")
    return Status::unsupported("WORLD_SIZE=" + std::to_string(env.world) + ": --backend " + f.memory.backend +
                               " chose the " + backend->name() + " backend; data-parallel training across processes "
                               "runs on CUDA devices over NCCL (--backend cuda)");
  SPILLWAY_ASSIGN_OR_RETURN(ResolvedMemory mem, resolve_memory(f.memory, *backend));
  // --save-grads reads the last step's gradients after it: a step whose updates are
  // carried into the next leaves them to the loop's epilogue, which does not keep them.
  if (!f.save_grads.empty()) mem.planner.carry_updates = 0;
  // --save's folder was checked with the other outputs; a model directory replaces
  // only an earlier save's (model/hf_model.h): known now, as the weights are written
  // only at the end.
  std::string save_path = f.save;  // "out/llama/" is the folder llama in out
  while (save_path.size() > 1 && save_path.back() == '/') save_path.pop_back();
  if (!f.save.empty() && is_model_directory_path(f.save))
    SPILLWAY_RETURN_IF_ERROR(check_model_directory_replaceable(f.save).with_context("--save"));
  // Leftovers of killed saves beside the --save file (the spill directory's are
  // reported when the spill store opens).
  if (const std::string save_dir = f.save.empty() ? "" : parent_directory(save_path);
      !save_dir.empty() && save_dir != mem.spill_dir) {
    auto leftovers = find_all_leftovers(save_dir);
    if (leftovers && !leftovers->empty())
      std::cerr << "spillway: warning: " << leftovers_warning(save_dir, *leftovers) << "\n";
  }
  SPILLWAY_RETURN_IF_ERROR(check_step_is_bounded(cfg, {.B = f.batch, .T = T, .accum = f.accum},
                                                 backend->activation_dtype(), mem.budgets));

  TrainerOptions o;
  o.model = cfg;
  o.shape = {.B = f.batch, .T = T, .accum = f.accum};
  const float lr = f.lr > 0 ? f.lr : (cfg.num_parameters() <= 10'000'000 ? 4e-3f : 6e-4f);
  o.schedule = {.peak = lr, .warmup_steps = f.warmup, .total_steps = f.steps};
  // 0, or a bound beyond float's range: no step can reach it.
  o.max_grad_norm = f.grad_clip == 0 || f.grad_clip > std::numeric_limits<float>::max()
                        ? std::numeric_limits<float>::infinity()
                        : static_cast<float>(f.grad_clip);
  o.seed = f.seed;
  o.budgets = mem.budgets;
  o.planner = mem.planner;
  o.auto_confirm = mem.auto_confirm;
  std::string machine_flag = f.machine;
  if (env.distributed() && machine_flag.empty()) {
    // Not N ranks profiling one machine at once on first use: the measured machine
    // when it is cached, else the h200 preset (`spillway profile` measures it first).
    auto cached = machine_cache_path(host_identity(backend->description()));
    std::error_code ec;
    machine_flag = cached.ok() && std::filesystem::exists(*cached, ec) ? "measured" : "h200";
  }
  SPILLWAY_ASSIGN_OR_RETURN(o.machine, training_machine(machine_flag, *backend, mem.spill_dir));
  o.spill_dir = mem.spill_dir;
  if (env.distributed())
    return run_data_parallel(f, env, o, *data, data_path, run_config(cfg, f, T, lr, f.data, env.world), dp_resume,
                             *backend);
  SPILLWAY_ASSIGN_OR_RETURN(std::unique_ptr<Trainer> trainer, Trainer::create(*backend, o));
  if (!f.trace_predicted.empty()) {
    // Before any step: a path that cannot be written fails the run before it trains.
    const Program placed = placed_as_planned(trainer->program(), trainer->plan());
    const SimResult sim = simulate(placed, trainer->plan(), o.machine);
    SPILLWAY_RETURN_IF_ERROR(trace_from_simulation(sim).write(f.trace_predicted).with_context("--trace-predicted"));
    if (!f.quiet)
      std::cerr << "spillway train: predicted step " << simulate_loop_step(placed, trainer->plan(), o.machine)
                << " s back to back on machine " << o.machine.name << "; a step alone, " << sim.step_s
                << " s, drawn in " << f.trace_predicted << "\n";
  }
  const nlohmann::json config = run_config(cfg, f, T, lr, f.data);
  if (resume) {
    SPILLWAY_RETURN_IF_ERROR(load_checkpoint(*trainer, *resume).with_context("--resume " + resume->path));
    train_loader->seek(resume->meta.data_batch);
    if (!f.quiet)
      std::cerr << "spillway train: resuming from " << resume->path << " after step " << resume->meta.step << "\n";
  } else if (!f.load.empty()) {
    SPILLWAY_RETURN_IF_ERROR(trainer->load_parameters(f.load, {.allow_nonfinite = f.allow_nonfinite_weights}).with_context("--load"));
  } else {
    SPILLWAY_RETURN_IF_ERROR(trainer->init_parameters());
  }

  std::ofstream metrics;
  if (!f.metrics.empty()) {
    metrics.open(f.metrics, std::ios::out | std::ios::trunc);
    if (!metrics) return errno_status("--metrics: open " + f.metrics, errno);
  }

  const auto& plan = trainer->plan();
  if (!f.quiet)
    std::cerr << "spillway train: " << cfg.to_string() << " (" << format_count(static_cast<double>(cfg.num_parameters()))
            << " parameters) on " << backend->description() << "\n"
            << "  data " << data_path << ": " << format_count(static_cast<double>(data->train.size())) << " train, "
            << format_count(static_cast<double>(data->val.size())) << " val tokens; batch " << f.batch << "x" << T
            << ", accum " << f.accum << ", " << f.steps << " steps, lr " << lr << "\n"
            << "  budgets: device "
            << (o.budgets.device == UINT64_MAX ? std::string("unlimited") : format_size(o.budgets.device)) << ", host "
            << format_size(o.budgets.host) << ", storage "
            << (o.budgets.storage ? format_size(o.budgets.storage) : std::string("none")) << "\n"
            << "  plan: " << plan.description << "\n";

  Progress progress(f.steps, f.quiet);
  const int trace_step = f.steps >= 2 ? 2 : 1;  // step 1 warms up
  Trace trace;
  StepResult last;
  std::optional<float> last_val;
  double elapsed = 0, timed_s = 0;
  int64_t timed_tokens = 0;
  StepMetrics peaks;
  const auto loop_start = std::chrono::steady_clock::now();
  const int final_step = f.stop_after > 0 ? std::min(f.steps, f.stop_after) : f.steps;
  // Checkpoints are written in the background (a snapshot in host memory first);
  // the one at the end or on a signal is waited for.
  std::optional<CheckpointWriter> writer;
  if (!f.checkpoint_dir.empty()) writer.emplace(f.checkpoint_dir, f.keep);
  if (writer && f.checkpoint_every > 0 && f.checkpoint_every < final_step)
    writer->prepare(trainer->state_bytes(), &trainer->backend());
  int64_t checkpoint_step = -1;  // the step of the newest checkpoint started
  int checkpoints = 0;
  double checkpoint_wait_s = 0;
  auto start_checkpoint = [&]() -> Status {
    CheckpointMeta meta{.step = trainer->steps_done(), .data_batch = train_loader->batch_index(), .config = config};
    SPILLWAY_RETURN_IF_ERROR(writer->begin(*trainer, meta));
    checkpoint_step = meta.step;
    ++checkpoints;
    checkpoint_wait_s += writer->last_wait_s();
    return Status::ok();
  };
  // The checkpoint of the current step, finished: its path.
  auto checkpoint = [&]() -> Result<std::string> {
    if (checkpoint_step != trainer->steps_done()) {
      SPILLWAY_RETURN_IF_ERROR(writer->wait().status());
      SPILLWAY_RETURN_IF_ERROR(start_checkpoint());
    }
    const auto t0 = std::chrono::steady_clock::now();
    auto written = writer->wait();
    checkpoint_wait_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (written.ok() && written->empty()) return writer->last_path();
    return written;
  };
  const int first = static_cast<int>(trainer->steps_done()) + 1;
  // A signal's stop `when` ("before step 5 of 10"): the checkpoint of the steps done,
  // then the Interrupted status that says where to resume.
  auto stop_interrupted = [&](const std::string& when) -> Status {
    progress.interrupt();
    std::string where;
    if (!f.checkpoint_dir.empty() && trainer->steps_done() > 0) {
      auto written = checkpoint();
      where = written.ok() ? "; checkpoint " + *written + " written: continue with --resume " + f.checkpoint_dir
                           : "; the checkpoint failed: " + written.status().message();
    }
    return interrupted_status(when + where + (mem.spill_dir.empty() ? "" : "; its spill directory is removed") +
                              (f.save.empty() ? "" : "; nothing was saved to " + f.save));
  };
  for (int s = first; s <= final_step; ++s) {
    if (interrupted()) return stop_interrupted("before step " + std::to_string(s) + " of " + std::to_string(f.steps));
    if (!f.trace.empty() && s == trace_step) trainer->trace_next_step(&trace);
    auto r = trainer->step(*train_loader);
    if (!r.ok()) {
      progress.interrupt();
      return stop_after_failed_step(*trainer, r.status(), f, metrics);
    }
    elapsed += r->step_s;
    if (s > 1 || f.steps == 1) {
      timed_s += r->step_s;
      timed_tokens += r->tokens;
    }
    if (f.eval_every > 0 && (s % f.eval_every == 0 || s == f.steps)) {
      val_loader->seek(0);
      auto v = trainer->evaluate(*val_loader, f.eval_batches);
      if (!v.ok() && v.status().code() == StatusCode::Interrupted)
        return stop_interrupted("during the evaluation after step " + std::to_string(s) + " of " +
                                std::to_string(f.steps));
      if (!v.ok()) {
        progress.interrupt();
        return v.status().with_context("evaluation after step " + std::to_string(s));
      }
      r->val_loss = *v;
      last_val = *v;
    }
    peaks.peak_device_bytes = std::max(peaks.peak_device_bytes, r->exec.peak_device_bytes);
    peaks.peak_host_bytes = std::max(peaks.peak_host_bytes, r->exec.peak_host_bytes);
    peaks.peak_storage_bytes = std::max(peaks.peak_storage_bytes, r->exec.peak_storage_bytes);
    peaks.h2d_bytes += r->exec.h2d_bytes;
    peaks.d2h_bytes += r->exec.d2h_bytes;
    peaks.stall_s += r->exec.stall_s;
    if (metrics.is_open()) {
      metrics << metrics_json(*r) << "\n";
      metrics.flush();
      if (!metrics) return errno_status("--metrics: write " + f.metrics, errno);
    }
    progress.update(*r, std::chrono::duration<double>(std::chrono::steady_clock::now() - loop_start).count());
    last = *r;
    if (writer) {
      // A background write that failed stops the run (its folder is removed; the
      // previous checkpoints stay).
      Status c = writer->poll();
      if (c.is_ok() && f.checkpoint_every > 0 && s % f.checkpoint_every == 0 && s < final_step) c = start_checkpoint();
      if (!c.is_ok()) {
        progress.interrupt();
        return c.with_context("--checkpoint-dir " + f.checkpoint_dir + " (checkpoint of step " +
                              std::to_string(checkpoint_step >= 0 ? checkpoint_step : s) + ")");
      }
    }
    if (!f.trace.empty() && s == trace_step) {
      SPILLWAY_RETURN_IF_ERROR(trace.write(f.trace).with_context("--trace"));
    }
  }
  if (metrics.is_open()) {
    metrics.close();
    if (!metrics) return errno_status("--metrics: close " + f.metrics, errno);
  }
  // The last step's optimizer may still run on host (it overlaps the next step).
  if (Status s = trainer->drain(); !s.is_ok()) {
    progress.interrupt();
    return s.with_context("finishing step " + std::to_string(final_step));
  }
  std::string checkpoint_written;
  if (!f.checkpoint_dir.empty() && trainer->steps_done() > 0) {
    auto written = checkpoint();
    if (!written.ok()) return written.status().with_context("--checkpoint-dir after step " + std::to_string(final_step));
    checkpoint_written = *written;
  }
  if (!f.save.empty()) SPILLWAY_RETURN_IF_ERROR(trainer->save(f.save).with_context("--save"));
  if (!f.save_grads.empty())
    SPILLWAY_RETURN_IF_ERROR(trainer->save_gradients(f.save_grads).with_context("--save-grads"));

  const double tps = timed_s > 0 ? static_cast<double>(timed_tokens) / timed_s : 0;
  std::printf("final train loss %.4f", last.loss);
  if (last_val) std::printf(", val loss %.4f", *last_val);
  std::printf(" after %d steps (%s tokens)\n", f.steps,
              format_count(static_cast<double>(trainer->tokens_per_step()) * f.steps).c_str());
  std::printf("throughput %s tokens/s, %.3f s/step; compute stalled %.1f%% of it (waiting for copies, host ops or "
              "storage%s)\n", format_count(tps).c_str(),
              timed_s > 0 ? timed_s / std::max(1, f.steps > 1 ? f.steps - 1 : 1) : 0.0,
              elapsed > 0 ? 100.0 * peaks.stall_s / elapsed : 0.0,
              trainer->backend().name() == "cuda" ? "; timed on the GPU by CUDA events" : "");
  std::printf("peaks: device %s, host %s, storage %s; moved %s host->device, %s device->host\n",
              format_size(peaks.peak_device_bytes).c_str(), format_size(peaks.peak_host_bytes).c_str(),
              format_size(peaks.peak_storage_bytes).c_str(), format_size(peaks.h2d_bytes).c_str(),
              format_size(peaks.d2h_bytes).c_str());
  if (!trainer->plan().speculation.empty()) {
    // Drained, so that the tally has the last step's updates.
    SPILLWAY_RETURN_IF_ERROR(trainer->drain());
    const SpeculationTally tally = trainer->executor().speculation_tally();
    std::printf("speculative updates: %llu committed, %llu redone (%llu of them dropped before they ran)%s\n",
                static_cast<unsigned long long>(tally.committed), static_cast<unsigned long long>(tally.redone),
                static_cast<unsigned long long>(tally.dropped),
                tally.redone > 0 ? " (clipping was active; after such a step the next does not speculate)" : "");
  }
  if (!f.save.empty()) std::printf("saved %s\n", f.save.c_str());
  if (!checkpoint_written.empty()) {
    std::printf("checkpoint %s (step %lld); %d written, training waited %.2f s for them%s%s\n", checkpoint_written.c_str(),
                static_cast<long long>(trainer->steps_done()), checkpoints, checkpoint_wait_s,
                writer->sync_reason().empty() ? "" : ": ", writer->sync_reason().c_str());
    if (final_step < f.steps)
      std::printf("stopped after step %d of %d (--stop-after): continue with --resume %s\n", final_step, f.steps,
                  f.checkpoint_dir.c_str());
  }
  if (!f.trace.empty()) std::printf("trace of step %d: %s (open in https://ui.perfetto.dev)\n", trace_step, f.trace.c_str());
  std::fflush(stdout);
  return Status::ok();
}

CommandRegistration train_command("train", "train a GPT model under memory budgets", [](CLI::App& app) -> CommandRun {
  auto f = std::make_shared<TrainFlags>();
  add_model_flags(app, f->model);
  app.add_option("--data", f->data, "a regular file: text (bytes are tokens) or an llm.c token file (default: $SPILLWAY_DATA, else "
                 "the bundled tinyshakespeare built into the binary)");
  app.add_option("--tokenizer", f->tokenizer,
                 "a Hugging Face tokenizer.json (byte-level BPE) or a directory holding one: --data's text is encoded "
                 "with it on every core (the model's --vocab must cover its vocabulary)");
  app.add_option("--steps", f->steps, "optimizer steps")->capture_default_str();
  app.add_option("--batch", f->batch, "sequences per micro-batch")->capture_default_str();
  app.add_option("--context", f->context, "tokens per sequence (default: the model's context)")->check(positive_number());
  app.add_option("--accum", f->accum, "micro-batches per step (gradient accumulation)")->capture_default_str();
  app.add_option("--lr", f->lr,
                 "peak learning rate, linear warmup then cosine decay to 10% (default: 4e-3 for models of up to "
                 "10M parameters, else 6e-4)")
      ->check(positive_number());
  app.add_option("--warmup", f->warmup, "warmup steps")->capture_default_str();
  app.add_option("--grad-clip", f->grad_clip,
                 "max global gradient norm: gradients are scaled down to it when their norm is above (0 = no "
                 "clipping); speculative updates stand only in steps where it does not clip")
      ->capture_default_str();
  app.add_option("--seed", f->seed, "parameter initialization and batch order")->capture_default_str();
  app.add_option("--eval-every", f->eval_every, "evaluate every N steps and after the last (0 = never)")->capture_default_str();
  app.add_option("--eval-batches", f->eval_batches, "validation batches per evaluation")->capture_default_str();
  app.add_option("--zero-stage", f->zero_stage,
                 "data-parallel ranks: 2, optimizer state and gradients partitioned, every rank holds the parameters; "
                 "3, the parameters partitioned too, each gathered from its owner right before every use")
      ->capture_default_str();
  app.add_option("--save", f->save,
                 "write the trained weights with Hugging Face names: FILE.safetensors (one file), or any other path "
                 "a model directory as save_pretrained writes it (config.json, model.safetensors or 5 GB shards "
                 "with an index), replacing an earlier save there");
  app.add_option("--save-grads", f->save_grads,
                 "write the last step's gradients (safetensors, the same names and layout), to compare with PyTorch");
  app.add_option("--load", f->load,
                 "start from these weights: a Hugging Face model directory (config.json, model.safetensors or "
                 "shards with model.safetensors.index.json) or a .safetensors file (config.json beside it when "
                 "there is one); GPT-2 heads from config.json, the file's __metadata__ or --heads");
  app.add_flag("--allow-nonfinite-weights", f->allow_nonfinite_weights,
               "--load weights with NaN or Inf values (refused by default)");
  app.add_option("--metrics", f->metrics, "write one JSON line per step to this file");
  app.add_option("--trace", f->trace, "write a Perfetto trace of step 2 (step 1 with --steps 1)");
  app.add_option("--trace-predicted", f->trace_predicted,
                 "write the simulator's Perfetto trace of a step of the plan this run executes (on its machine "
                 "model; a step whose speculative updates stand), to lay beside --trace");
  app.add_flag("--quiet", f->quiet, "no banner or progress line on stderr (the summary still goes to stdout)");
  app.add_option("--checkpoint-dir", f->checkpoint_dir,
                 "write checkpoints of the whole training state here (every --checkpoint-every steps, at the end, "
                 "and on SIGINT/SIGTERM); each is verified on --resume");
  app.add_option("--checkpoint-every", f->checkpoint_every, "steps between checkpoints (0 = only at the end)")
      ->capture_default_str();
  app.add_option("--keep", f->keep, "the newest checkpoints kept (older ones are removed)")->capture_default_str();
  app.add_option("--resume", f->resume,
                 "continue from the newest checkpoint in DIR that verifies (the run's configuration comes from it; "
                 "flags that change the math must agree)");
  app.add_option("--stop-after", f->stop_after,
                 "end the run after step N with a checkpoint, as if interrupted (the schedule still runs to --steps)");
  add_memory_flags(app, f->memory);
  app.add_option("--machine", f->machine,
                 "the planner's machine model: h200, cpu, a file from `spillway profile`, or measured: this host's "
                 "measured machine from the cache, profiled briefly (seconds, once per host, GPU and driver) and "
                 "cached when there is none (default on CUDA: measured; on the CPU: cpu)");
  CLI::App* parsed = &app;
  return [f, parsed]() -> int {
    for (const char* flag : {"--model", "--layers", "--width", "--heads", "--model-context", "--vocab", "--batch",
                             "--context", "--accum", "--lr", "--warmup", "--grad-clip", "--steps", "--seed", "--data", "--tokenizer",
                             "--arch", "--kv-heads", "--intermediate", "--rope-theta", "--rope-scaling", "--norm-eps",
                             "--untied"})
      if (parsed->count(flag) > 0) f->given.insert(flag);
    Status s = run_train(*f);
    return s.is_ok() ? 0 : fail(s);
  };
});

}  // namespace
}  // namespace spillway::cli
