// Trainer: builds, plans and runs the training step of a GPT model on a backend,
// under memory budgets, and evaluates, saves and loads it.
//
//   auto data = load_dataset("data/tinyshakespeare.txt", 256);
//   auto backend = make_backend("cpu");
//   TrainerOptions o;
//   o.model = *model_preset("tiny");
//   o.shape = {.B = 8, .T = 128, .accum = 1};
//   o.schedule = {.peak = 2e-3f, .warmup_steps = 20, .total_steps = 300};
//   o.budgets = {.device = 8 << 20};                      // forces spilling
//   o.planner = {.policy = Policy::Planned};
//   o.machine = machine_for(**backend);
//   auto trainer = Trainer::create(**backend, o);
//   if (!trainer) die(trainer.status());
//   SPILLWAY_RETURN_IF_ERROR((*trainer)->init_parameters());
//   auto loader = DataLoader::create(data->train, 8, 128, LoaderMode::Random, o.seed);
//   auto val = DataLoader::create(data->val, 8, 128, LoaderMode::Sequential);
//   for (int s = 0; s < 300; ++s) {
//     auto r = (*trainer)->step(*loader);          // r->loss, r->grad_norm, r->exec.h2d_bytes
//     std::puts(metrics_json(*r).c_str());
//   }
//   auto v = (*trainer)->evaluate(*val, 20);       // mean validation loss
//   SPILLWAY_RETURN_IF_ERROR((*trainer)->save("tiny.safetensors"));
//
// The loss of a step is the mean of every token's loss over all micro-batches: the
// per-micro-batch `losses` tensors are read back and summed on the host in index
// order (micro-batch 0 first) in double, divided by the token count, and rounded
// to float once. That float is the number two runs compare bit for bit.
//
// Parameters: the master copy (F32) holds the values; the parameter in the step's
// activation dtype is the master converted (F32 copy, or BF16 rounded to nearest
// even). Adam moments start at zero; gradients are zeroed by the step itself.
//
// Bad numbers stop training. The step's clipping op computes the global gradient
// norm before any update; when it is NaN or infinite the step is skipped (see
// optim/adamw.h): no parameter, master weight or Adam moment changes. step() then
// returns an error naming the step ("step 7: the gradient norm is nan ...; the
// parameters, master weights and Adam moments are those after step 6"), and
// steps_done() stays at the last applied step; that state can still be read, saved
// and trained from. A non-finite loss with a finite norm is an error too, but that
// update was applied (its gradients were finite), so the state is the one after the
// step, which steps_done() counts. rejected_step() gives the failed step's numbers.
//
// A step that fails inside the executor (an I/O error, a broken invariant) may leave
// the state half-updated. From then on every call that reads, saves, writes or
// trains the state (read_floats, save, save_gradients, evaluate, step,
// write_parameter, init_parameters, load_parameters) is refused with the step's
// error: a half-updated state is never read or saved. Create a new Trainer.
// Errors before the step starts (bad micro-batches) change nothing.
//
// save() refuses weights that are not finite, naming the tensor.
//
// Evaluation runs a forward-only program (build_forward_program with loss), planned
// once with the same policy, on an executor that exists only during evaluate():
// parameters are copied into it from the training executor. It is carved out of the
// same device budget: it runs in the training arena's idle region (past the device
// homes of the training state, Executor::idle_device_region) when its plan fits
// there (under the resident policy, where the parameters do not fit twice, it
// streams them: planned policy, the same losses), allocating no device memory;
// else in its own allocation of what the budget leaves beyond the training
// executor's memory, returned after.
#pragma once

#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "core/status.h"
#include "exec/executor.h"
#include "model/model.h"
#include "model/hf_model.h"
#include "plan/planner.h"
#include "sim/machine.h"
#include "train/data.h"
#include "train/schedule.h"

namespace spillway {

struct TrainerOptions {
  ModelConfig model;
  StepShape shape{.B = 8, .T = 128, .accum = 1};
  LrSchedule schedule;           // peak learning rate, warmup, total steps
  float weight_decay = 0.1f;
  float max_grad_norm = 1.0f;
  uint64_t seed = 1337;          // parameter initialization
  Budgets budgets;
  PlannerOptions planner;
  Machine machine;
  std::string spill_dir;         // needed when the plan uses storage
  // Policy auto: the best this-many candidates of the simulator's ranking are each
  // timed for one step (after a warm-up step, on a throwaway executor with zeroed
  // state, so the run itself is untouched) and the fastest measured is kept; the
  // plan's description reports every candidate's predicted and measured step time.
  // 0 or 1: the simulator's best, untimed.
  int auto_confirm = 2;
  // Tests: the training executor's storage engine maker (ExecutorOptions), which
  // injects storage faults.
  StorageEngineMaker storage_engine_maker;
};

// One micro-batch: tokens and next-token targets, [B·T] each.
struct TokenBatch {
  std::vector<int32_t> tokens;
  std::vector<int32_t> targets;
};

struct StepResult {
  int64_t step = 0;          // 1-based
  float loss = 0;            // mean training loss (see the header comment)
  double loss_f64 = 0;       // the same mean before rounding to float
  float lr = 0;
  float grad_norm = 0;       // global gradient norm before clipping
  int64_t tokens = 0;        // tokens of this step (B·T·accum)
  double step_s = 0;         // wall time of the whole step, inputs and read-back included
  double tokens_per_s = 0;
  StepMetrics exec;          // the executor's counters of this step
  std::optional<float> val_loss;  // set by the caller on evaluation steps
  bool applied = true;       // false: the update was skipped (non-finite gradient norm)
};

// One JSON object (no newline) with step, loss (%.9g: enough digits to round-trip
// the float), lr, grad_norm, tokens, step_s, tokens_per_s, h2d_bytes, d2h_bytes,
// storage_read_bytes, storage_write_bytes, recomputed_ops, speculated_ops, stall_s,
// peak_device_bytes, peak_host_bytes, peak_storage_bytes, val_loss when set, and
// "skipped":true when the update was not applied. JSON has no NaN or infinity: a
// non-finite number is written as null, so every line parses.
std::string metrics_json(const StepResult& r);

// The planner's cost model for a backend: Machine::h200() figures for CUDA (device
// memory set to the backend's capacity), Machine::cpu_dev_box() for the CPU.
Machine machine_for(const Backend& backend);

// Values as bytes of `dtype` (F32: copied; BF16: rounded to nearest even), and back.
std::vector<uint8_t> encode_values(DType dtype, const std::vector<float>& values);
std::vector<float> decode_values(DType dtype, const void* bytes, size_t count);

// A tensor of `program` by name, as floats, through its executor: the tensor itself or
// the concatenation of its row tiles (Program::pieces), each converted from/to its dtype.
Result<std::vector<float>> read_named_floats(Executor& executor, const Program& program, const std::string& name);
Status write_named_floats(Executor& executor, const Program& program, const std::string& name,
                          const std::vector<float>& values);

// The budgets a plan for `backend` is made with: the device budget less what the
// backend holds itself (Backend::fixed_device_bytes), rounded down to the backend's
// allocation granularity (the driver rounds the one allocation of
// arena and workspace up to it, and the rounded size must stay within the budget).
Budgets allocatable_budgets(const Budgets& budgets, const Backend& backend);
// Device memory to reserve for the GPU's mapping of the executor's pinned host arena
// (BackendSizes::host_mapping_device_bytes): the arena holds at most every tensor of
// the program once (4096-aligned), or the host budget, whichever is smaller. 0 without
// a device budget. plan_for_backend plans the arena within the budget less this.
uint64_t host_mapping_reserve(const Program& program, const BackendSizes& backend, const Budgets& budgets);
// The same for a kind of backend (BackendSizes) holding `fixed_bytes` itself; tools
// that plan without a device (`spillway plan`) pass 0, as they cannot measure it.
Budgets allocatable_budgets(const Budgets& budgets, const BackendSizes& sizes, uint64_t fixed_bytes);

// `options` for planning `program` on `backend`: its alignment, and the workspace the
// program's ops need (program_workspace) reserved inside the device budget.
Result<PlannerOptions> backend_planner_options(const Program& program, const BackendSizes& backend,
                                               PlannerOptions options);

// make_plan for `backend`: backend_planner_options within allocatable_budgets(budgets).
// An error says how much of the budget the backend holds itself, where it holds any.
Result<Plan> plan_for_backend(const Program& program, const Backend& backend, const Machine& machine,
                              const Budgets& budgets, const PlannerOptions& options);
// make_auto_plans for `backend` likewise: auto's best `count` candidates (fewer when
// fewer plan), from one search.
Result<std::vector<Plan>> auto_plans_for_backend(const Program& program, const Backend& backend,
                                                 const Machine& machine, const Budgets& budgets,
                                                 const PlannerOptions& options, int count);

// A GPT program for a device budget: build(false), or when that program's largest op
// (planner minimum_device_budget) takes more than half of what the arena gets — the
// allocatable `device_budget` (allocatable_budgets) less the workspace the program
// needs on `backend` (program_workspace, reserved by make_plan first) — build(true),
// the same step in vocab tiles (StepShape::tile_vocab). Tiled or not, the losses are
// the same bits. *tiled (if given) says which was built.
Result<Program> build_for_budget(const std::function<Result<Program>(bool tile_vocab)>& build,
                                 const BackendSizes& backend, uint64_t device_budget, bool* tiled = nullptr);

// Pinned host memory a trainer holds beside its arena: two staging buffers through
// which checkpoint snapshots copy device-resident state (host_mapping_reserve counts it).
inline constexpr uint64_t kSnapshotStagingBytes = uint64_t{16} << 20;

// Where a checkpoint's snapshot spent its time (Trainer::snapshot_state).
struct SnapshotTimes {
  double drain_s = 0;      // waiting for the last step's work in flight
  double device_s = 0;     // device copies (and storage reads) made, or issued, before returning
  uint64_t device_bytes = 0, host_bytes = 0, storage_bytes = 0;
  // Device copies still in flight when snapshot_state returned (copies into pinned
  // destinations): done when this device→host ticket is; wait for it before reading
  // the destination. The next step's ops that write those tensors wait for them.
  std::optional<CopyTicket> device_copies;
};

// Destinations of a snapshot that the copy engine can fill directly (pinned with
// Backend::pin_host in pieces of `chunk` bytes from `base`; a copy never crosses a
// piece).
struct PinnedRange {
  const uint8_t* base = nullptr;
  uint64_t bytes = 0;
  uint64_t chunk = 0;
  bool contains(const uint8_t* p, uint64_t n) const {
    return base != nullptr && p >= base && n <= bytes && static_cast<uint64_t>(p - base) <= bytes - n;
  }
};

// Where Trainer::create spent its time (seconds of wall time, in that order).
struct SetupTimes {
  double build_s = 0;     // building the training program (tiling the vocabulary if the budget asks)
  double warm_up_s = 0;   // loading the kernels the step and an evaluation launch
  double plan_s = 0;      // planning (with --policy auto, also timing the candidates it confirms)
  double allocate_s = 0;  // creating the executor: device arena, pinned host arena, spill files
};

class Trainer {
 public:
  // Builds the training program for options.model and options.shape in the
  // backend's activation dtype, plans it and creates its executor. Parameters are
  // zero until init_parameters() or load_parameters().
  static Result<std::unique_ptr<Trainer>> create(Backend& backend, const TrainerOptions& options);

  // GPT-2 initial values from options.seed (init_parameter); moments zeroed.
  Status init_parameters();
  // Parameters from a safetensors file or a Hugging Face model directory whose config equals options.model
  // (use infer_model_config first); moments zeroed. Importer errors name the file
  // and the missing or mis-shaped tensor, or the first non-finite value (refused
  // unless options.allow_nonfinite).
  Status load_parameters(const std::string& path, const ImportOptions& options = {});
  // Writes the master weights (F32) with Hugging Face names: one .safetensors file, or
  // any other path a model directory (config.json and shards; model/hf_model.h).
  Status save(const std::string& path);
  // Waits for the work the last step left in flight (its host AdamW overlaps the next
  // step's forward; see Executor::drain) and reports its error. evaluate and save
  // drain first; a training loop calls it after its last step.
  Status drain();
  // Writes the gradients of the last step (F32, the same names and layout as
  // save()), e.g. to compare them with another framework's.
  Status save_gradients(const std::string& path);

  // One optimizer step over accum micro-batches drawn from `loader` (its B and T
  // must match the step shape). The step number advances by one.
  Result<StepResult> step(DataLoader& loader);
  // The same with the micro-batches given ([accum], each [B·T]).
  Result<StepResult> step(const std::vector<TokenBatch>& micro_batches);

  // Mean loss over `batches` batches from `loader` (read from its current position;
  // seek(0) first for the same batches every time), summed in double in order.
  Result<float> evaluate(DataLoader& loader, int batches);

  // A parameter (by ParamSpec name) or its gradient ("grad." + name), as floats.
  Result<std::vector<float>> read_floats(const std::string& tensor_name);

  // The numbers of the last step() that stopped on a non-finite loss or gradient
  // norm (for its metrics line); empty after a step that succeeded.
  const std::optional<StepResult>& rejected_step() const { return rejected_; }
  // Ok, or why the state cannot be used (a step failed inside the executor).
  Status state_status() const { return broken_; }
  // Sets parameter `name` (ParamSpec name): master = values, param = values in the
  // activation dtype.
  Status write_parameter(const std::string& name, const std::vector<float>& values);

  // Records the next step into `trace` (exec/trace.h).
  void trace_next_step(Trace* trace) { executor_->trace_next_step(trace); }
  // Times each op of the next step on its own (exec/executor.h StepProfile).
  void profile_next_step(StepProfile* profile) { executor_->profile_next_step(profile); }

  const TrainerOptions& options() const { return options_; }
  const Program& program() const { return program_; }
  const Plan& plan() const { return plan_; }
  // Bytes of the pinned host region the run's executor holds its host arena in: the
  // plan's arena, or with policy auto's timed candidates the one region pinned for all
  // of them, which the run keeps (the largest candidate's arena).
  uint64_t host_region_bytes() const { return shared_host_ ? shared_host_bytes_ : plan_.host_arena_bytes(); }
  Executor& executor() { return *executor_; }
  Backend& backend() { return backend_; }
  int64_t steps_done() const { return step_; }
  const SetupTimes& setup_times() const { return setup_times_; }

  // ---- the training state, for checkpoints (train/checkpoint.h) ----
  // The tensors that make the state: master weights and both Adam moments (each
  // vocab tile its own), in program order. The parameters are not among them: each
  // is always its master weight rounded to the parameter's dtype (optim/adamw.h), so
  // restore_parameters_from_masters() makes them again, bit for bit, and a
  // checkpoint need not hold them (2 of 14 bytes per parameter in BF16).
  std::vector<TensorId> state_tensors() const;
  // After the master weights were written (write_state_tensor): every parameter
  // becomes its master weight rounded to its dtype, as the optimizer writes it.
  Status restore_parameters_from_masters();
  // Their bytes together (a checkpoint's state.bin).
  uint64_t state_bytes() const;
  // Raw bytes of one (in its dtype), read after the pipeline drained; written where
  // it rests. Refused after a failed step, like every access to the state.
  Status read_state_tensor(TensorId t, std::vector<uint8_t>& bytes);
  Status write_state_tensor(TensorId t, const void* bytes, size_t n);
  // Copies the newest value of each tensor, after draining the pipeline, to dst[i]
  // (bytes(tensors[i]) bytes each): the snapshot of a checkpoint. Device copies are
  // made before it returns (through pinned staging, spread on all cores), storage
  // ones read. Host copies: with `host_copies_done`, a job on the host engine that
  // the next step's host optimizer waits for (so the next step's device work
  // overlaps it), which sets the promise when done (a job skipped after an earlier
  // failure breaks it); without, made before it returns.
  // With `pinned` holding the destinations, device-resident tensors are copied
  // straight into them in the background (SnapshotTimes::device_copies) instead of
  // through the staging buffers before returning.
  Result<SnapshotTimes> snapshot_state(const std::vector<TensorId>& tensors, const std::vector<uint8_t*>& dst,
                                       std::shared_ptr<std::promise<Status>> host_copies_done = nullptr,
                                       const PinnedRange& pinned = {});
  // After write_state_tensor of every state tensor: the run continues after `step`.
  void restore_steps_done(int64_t step);
  int64_t tokens_per_step() const;

 private:
  Trainer(Backend& backend, const TrainerOptions& options) : backend_(backend), options_(options) {}
  Status setup();
  // Policy auto with auto_confirm > 1: the fastest of the timed candidates (above).
  Result<Plan> confirm_auto_plan();
  // Writes zero to p's Adam moments from `zeros` (grown to p's size as needed).
  Status zero_moments(const ParamSpec& p, std::vector<float>& zeros);
  // write_parameter from values[0, count), converting through `scratch`.
  Status write_parameter(const std::string& name, const float* values, size_t count, std::vector<uint8_t>& scratch);
  Result<TensorId> find(const std::string& name) const;
  Status plan_evaluation(int B, int T);
  // Ok, or the refusal to `what` after a step failed inside the executor.
  Status usable(const std::string& what) const;
  Result<StepResult> run(const std::vector<TokenBatch>& micro_batches);

  Backend& backend_;
  TrainerOptions options_;
  Program program_;
  Plan plan_;
  // Policy auto with --auto-confirm: one pinned host region that the timed candidates'
  // executors and then executor_ hold their host arenas in (ExecutorOptions::
  // external_host; freed after executor_, which is declared after it), even where the
  // chosen plan's arena is smaller. Null otherwise, or where the region beside the
  // candidates' second buffers would pass the host budget.
  std::shared_ptr<void> shared_host_;
  uint64_t shared_host_bytes_ = 0;
  // With shared_host_, where a candidate speculates: one region of the largest
  // candidate's second buffers (ExecutorOptions::external_speculation) for the trials
  // and the run, freed after executor_ as shared_host_ is.
  std::shared_ptr<void> shared_speculation_;
  uint64_t shared_speculation_bytes_ = 0;
  std::unique_ptr<Executor> executor_;
  SetupTimes setup_times_;
  std::shared_ptr<uint8_t> snapshot_staging_[2];  // [8 MiB] each, pinned: checkpoint device copies
  std::vector<ParamSpec> params_;
  std::vector<TensorId> tokens_, targets_, losses_;  // [accum]
  TensorId scale_norm_ = kNoTensor;
  int64_t step_ = 0;
  // The Adam moments are all zero: true from creation (the executor zero-fills every
  // persistent tensor) until a step runs, and again after init_parameters() or
  // load_parameters() zeroed them; while true those skip writing zeros again.
  bool moments_zero_ = true;
  Status broken_;                        // the error of a step that failed inside the executor
  std::optional<StepResult> rejected_;   // the last step stopped on bad numbers

  // Evaluation: planned on first use, for one B and T.
  Program eval_program_;
  Plan eval_plan_;
  Budgets eval_budgets_;
  bool eval_inside_ = false;  // the evaluation runs in the training arena's idle region
  int eval_B_ = 0, eval_T_ = 0;
};

}  // namespace spillway
