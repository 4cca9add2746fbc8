#include "train/trainer.h"

#include <algorithm>
#include <limits>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <system_error>
#include <future>

#include "core/interrupt.h"
#include "core/clock.h"
#include "core/size.h"
#include "core/thread_pool.h"
#include "exec/dispatch.h"
#include "model/hf_model.h"
#include "optim/adamw.h"
#include "sim/simulator.h"

namespace spillway {

namespace {

using Clock = std::chrono::steady_clock;

// JSON has no NaN or infinity: a non-finite number is written as null.
void append_number(std::string& out, const char* key, double v, const char* format) {
  char buf[64];
  if (std::isfinite(v)) std::snprintf(buf, sizeof buf, format, v);
  else std::snprintf(buf, sizeof buf, "null");
  out += ",\"";
  out += key;
  out += "\":";
  out += buf;
}

// A number for messages: 1.5, nan, inf, -inf.
std::string number_text(double v) {
  if (std::isnan(v)) return "nan";  // printf may write -nan
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.6g", v);
  return buf;
}

void append_integer(std::string& out, const char* key, uint64_t v) {
  out += ",\"";
  out += key;
  out += "\":";
  out += std::to_string(v);
}

std::string after_step_text(int64_t step) {
  return step == 0 ? "those before step 1" : "those after step " + std::to_string(step);
}

}  // namespace

std::string metrics_json(const StepResult& r) {
  std::string s = "{\"step\":" + std::to_string(r.step);
  append_number(s, "loss", r.loss, "%.9g");
  append_number(s, "lr", r.lr, "%.9g");
  append_number(s, "grad_norm", r.grad_norm, "%.9g");
  append_integer(s, "tokens", static_cast<uint64_t>(r.tokens));
  append_number(s, "step_s", r.step_s, "%.6f");
  append_number(s, "tokens_per_s", r.tokens_per_s, "%.1f");
  append_integer(s, "h2d_bytes", r.exec.h2d_bytes);
  append_integer(s, "d2h_bytes", r.exec.d2h_bytes);
  append_integer(s, "storage_read_bytes", r.exec.storage_read_bytes);
  append_integer(s, "storage_write_bytes", r.exec.storage_write_bytes);
  append_integer(s, "recomputed_ops", static_cast<uint64_t>(std::max(r.exec.recomputed_ops, 0)));
  append_integer(s, "speculated_ops", static_cast<uint64_t>(std::max(r.exec.speculated_ops, 0)));
  append_number(s, "stall_s", r.exec.stall_s, "%.6f");
  append_number(s, "host_wait_s", r.exec.host_wait_s, "%.6f");
  append_integer(s, "peak_device_bytes", r.exec.peak_device_bytes);
  append_integer(s, "peak_host_bytes", r.exec.peak_host_bytes);
  append_integer(s, "peak_storage_bytes", r.exec.peak_storage_bytes);
  if (r.val_loss) append_number(s, "val_loss", *r.val_loss, "%.9g");
  if (!r.applied) s += ",\"skipped\":true";
  s += "}";
  return s;
}

Machine machine_for(const Backend& backend) {
  if (backend.name() == "cuda") {
    Machine m = Machine::h200();
    m.device_bytes = backend.device_capacity();
    return m;
  }
  return Machine::cpu_dev_box();
}

namespace {

// Elements per chunk of a parallel conversion (1 MiB of floats).
constexpr int64_t kConvertChunk = int64_t{1} << 18;

// values[0, count) as bytes of `dtype` into out (count · dtype_size bytes), in fixed
// chunks over the global thread pool: each element is converted on its own, so the
// bytes do not depend on the thread count.
void encode_into(DType dtype, const float* values, size_t count, uint8_t* out) {
  const auto chunks = static_cast<int64_t>((count + kConvertChunk - 1) / kConvertChunk);
  global_thread_pool().parallel_for(chunks, [&](int64_t c0, int64_t c1) {
    const size_t begin = static_cast<size_t>(c0 * kConvertChunk);
    const size_t end = std::min(count, static_cast<size_t>(c1 * kConvertChunk));
    if (dtype == DType::BF16) {
      auto* dst = reinterpret_cast<uint16_t*>(out);
      for (size_t i = begin; i < end; ++i) dst[i] = float_to_bf16(values[i]);
    } else {
      std::memcpy(out + begin * sizeof(float), values + begin, (end - begin) * sizeof(float));
    }
  });
}

// write_named_floats from values[0, count). F32 pieces are written straight from
// `values`; other dtypes are converted into `scratch` (grown as needed, reused by
// the caller across tensors).
Status write_named_floats(Executor& executor, const Program& program, const std::string& name, const float* values,
                          size_t count, std::vector<uint8_t>& scratch) {
  const std::vector<TensorId> pieces = program.pieces(name);
  if (pieces.empty()) return Status::not_found("the program has no tensor '" + name + "'");
  int64_t total = 0;
  for (TensorId id : pieces) total += program.tensors.info(id).shape.numel();
  if (static_cast<int64_t>(count) != total)
    return Status::invalid_argument("tensor " + name + " has " + std::to_string(total) + " elements, got " +
                                    std::to_string(count));
  size_t offset = 0;
  for (TensorId id : pieces) {
    const TensorInfo& info = program.tensors.info(id);
    const size_t n = static_cast<size_t>(info.shape.numel());
    if (info.dtype == DType::F32) {
      SPILLWAY_RETURN_IF_ERROR(executor.write_tensor(id, values + offset, n * sizeof(float)));
    } else {
      const size_t bytes = n * dtype_size(info.dtype);
      if (scratch.size() < bytes) scratch.resize(bytes);
      encode_into(info.dtype, values + offset, n, scratch.data());
      SPILLWAY_RETURN_IF_ERROR(executor.write_tensor(id, scratch.data(), bytes));
    }
    offset += n;
  }
  return Status::ok();
}

}  // namespace

std::vector<uint8_t> encode_values(DType dtype, const std::vector<float>& values) {
  std::vector<uint8_t> out(values.size() * dtype_size(dtype));
  encode_into(dtype, values.data(), values.size(), out.data());
  return out;
}

std::vector<float> decode_values(DType dtype, const void* bytes, size_t count) {
  std::vector<float> out(count);
  if (dtype == DType::BF16) {
    const auto* src = static_cast<const uint16_t*>(bytes);
    for (size_t i = 0; i < count; ++i) out[i] = bf16_to_float(src[i]);
  } else {
    std::memcpy(out.data(), bytes, count * sizeof(float));
  }
  return out;
}

Result<std::unique_ptr<Trainer>> Trainer::create(Backend& backend, const TrainerOptions& options) {
  std::unique_ptr<Trainer> t(new Trainer(backend, options));
  SPILLWAY_RETURN_IF_ERROR(t->setup());
  return t;
}

int64_t Trainer::tokens_per_step() const {
  return int64_t{options_.shape.B} * options_.shape.T * options_.shape.accum;
}

Result<TensorId> Trainer::find(const std::string& name) const {
  TensorId id = program_.tensors.find(name);
  if (id == kNoTensor) return Status::not_found("the training program has no tensor '" + name + "'");
  return id;
}

Status Trainer::setup() {
  const ModelConfig& cfg = options_.model;
  SPILLWAY_RETURN_IF_ERROR(cfg.validate());
  const StepShape& shape = options_.shape;
  if (shape.B <= 0 || shape.T <= 0 || shape.accum <= 0)
    return Status::invalid_argument("batch, context and accumulation steps must be positive (got B=" +
                                    std::to_string(shape.B) + " T=" + std::to_string(shape.T) +
                                    " accum=" + std::to_string(shape.accum) + ")");
  if (shape.T > cfg.context)
    return Status::invalid_argument("context " + std::to_string(shape.T) + " is longer than the model's context " +
                                    std::to_string(cfg.context));
  options_.planner.alignment = backend_.alignment();
  Clock::time_point t = Clock::now();
  bool tiled = false;
  SPILLWAY_ASSIGN_OR_RETURN(program_, build_for_budget(
                                          [&](bool tile_vocab) {
                                            StepShape s = shape;
                                            s.tile_vocab = s.tile_vocab || tile_vocab;
                                            return build_training_program(cfg, s, backend_.activation_dtype(),
                                                                          options_.max_grad_norm,
                                                                          options_.weight_decay);
                                          },
                                          backend_, allocatable_budgets(options_.budgets, backend_).device, &tiled));
  options_.shape.tile_vocab = options_.shape.tile_vocab || tiled;
  setup_times_.build_s = seconds_since(t);
  t = Clock::now();
  {
    // Load every kernel the step (and an evaluation of the step's shape) will launch
    // now, before the budgets are computed: CUDA loads kernel code lazily, and what it
    // loads in the middle of a step would sit beyond --device-budget (issue 9).
    const uint64_t limit = allocatable_budgets(options_.budgets, backend_).device;
    SPILLWAY_RETURN_IF_ERROR(warm_up_kernels(backend_, program_, limit));
    SPILLWAY_ASSIGN_OR_RETURN(Program eval, build_forward_program(cfg, shape.B, shape.T, backend_.activation_dtype(),
                                                                  true, options_.shape.tile_vocab));
    SPILLWAY_RETURN_IF_ERROR(warm_up_kernels(backend_, eval, limit));
  }
  setup_times_.warm_up_s = seconds_since(t);
  t = Clock::now();
  auto plan = options_.planner.policy == Policy::Auto && options_.auto_confirm > 1
                  ? confirm_auto_plan()
                  : plan_for_backend(program_, backend_, options_.machine, options_.budgets, options_.planner);
  if (!plan.ok()) return plan.status().with_context("planning the training step");
  plan_ = std::move(*plan);
  // The run keeps the trials' pinned region even where its plan needs less of it:
  // pinning again costs about 4 s per 10 GiB (12.4 s for gpt-2.7b's 33 GiB on an H100,
  // bench/RESULTS.md, session 40), and the region with any candidate's second buffers
  // was checked against the host budget when it was made.
  if (shared_host_ && plan_.host_arena_bytes() < shared_host_bytes_)
    plan_.description += "; the run keeps the trials' pinned host region of " + format_size(shared_host_bytes_) +
                         " (its plan's arena: " + format_size(plan_.host_arena_bytes()) + ")";
  setup_times_.plan_s = seconds_since(t);
  t = Clock::now();
  ExecutorOptions eo;
  eo.host_budget = options_.budgets.host;
  eo.spill_dir = options_.spill_dir;
  eo.storage_budget = options_.budgets.storage;
  eo.storage_engine_maker = options_.storage_engine_maker;
  eo.external_host = {shared_host_.get(), shared_host_bytes_};
  eo.external_speculation = {shared_speculation_.get(), shared_speculation_bytes_};
  auto executor = Executor::create(backend_, program_, plan_, eo);
  if (!executor.ok()) return executor.status().with_context("creating the training executor");
  executor_ = std::move(*executor);
  setup_times_.allocate_s = seconds_since(t);
  params_ = parameter_specs(cfg);
  for (int k = 0; k < shape.accum; ++k) {
    const std::string mb = "mb" + std::to_string(k) + ".";
    SPILLWAY_ASSIGN_OR_RETURN(TensorId tok, find(mb + "tokens"));
    SPILLWAY_ASSIGN_OR_RETURN(TensorId tgt, find(mb + "targets"));
    SPILLWAY_ASSIGN_OR_RETURN(TensorId los, find(mb + "losses"));
    tokens_.push_back(tok);
    targets_.push_back(tgt);
    losses_.push_back(los);
  }
  SPILLWAY_ASSIGN_OR_RETURN(scale_norm_, find("clip.scale_norm"));
  return Status::ok();
}

Result<Plan> Trainer::confirm_auto_plan() {
  struct Timed {
    Plan plan;
    double measured_s = 0;
    double trial_s = 0;  // the whole trial: its executor, both steps, the drains
  };
  std::vector<Timed> timed;
  // One search ranks the candidates; fewer may fit than asked for.
  const auto search_start = std::chrono::steady_clock::now();
  SPILLWAY_ASSIGN_OR_RETURN(std::vector<Plan> candidates,
                            auto_plans_for_backend(program_, backend_, options_.machine, options_.budgets,
                                                   options_.planner, options_.auto_confirm));
  const double search_s = seconds_since(search_start);
  // One pinning of the largest candidate's host arena serves every trial, and the run
  // when its plan needs all of it (pinning tens of GiB takes seconds each time) — if
  // beside each candidate's second buffers it stays within the host budget.
  uint64_t host_bytes = 4096, most_speculation = 0;
  for (const Plan& plan : candidates) {
    host_bytes = std::max(host_bytes, plan.host_arena_bytes());
    most_speculation = std::max(most_speculation, plan.speculation_bytes);
  }
  double pin_s = 0;
  if (host_bytes <= options_.budgets.host && most_speculation <= options_.budgets.host - host_bytes) {
    const auto pin_start = std::chrono::steady_clock::now();
    SPILLWAY_ASSIGN_OR_RETURN(void* pinned, backend_.host_alloc(host_bytes));
    shared_host_ = std::shared_ptr<void>(pinned, [b = &backend_](void* q) { b->host_free(q); });
    shared_host_bytes_ = host_bytes;
    pin_s = seconds_since(pin_start);
    // The second buffers likewise: the first executor faults their pages in, the rest
    // find them there. Where this allocation fails, each executor tries its own.
    if (most_speculation > 0) {
      const uint64_t spec_bytes = (most_speculation + 4095) / 4096 * 4096;
      if (void* spec = std::aligned_alloc(4096, spec_bytes)) {
        shared_speculation_ = std::shared_ptr<void>(spec, [](void* q) { std::free(q); });
        shared_speculation_bytes_ = spec_bytes;
      }
    }
  }
  for (size_t rank = 0; rank < candidates.size(); ++rank) {
    Plan& plan = candidates[rank];
    ExecutorOptions eo;
    eo.host_budget = options_.budgets.host;
    eo.spill_dir = options_.spill_dir;
    eo.storage_budget = options_.budgets.storage;
    eo.external_host = {shared_host_.get(), shared_host_bytes_};
    eo.external_speculation = {shared_speculation_.get(), shared_speculation_bytes_};
    const std::string what = "timing auto's candidate " + std::to_string(rank + 1);
    const auto trial_start = std::chrono::steady_clock::now();
    auto trial = Executor::create(backend_, program_, plan, eo);
    if (!trial.ok()) return trial.status().with_context(what);
    // Zeroed state (tokens 0, weights 0) does the same work as real values. Step 1
    // first touches every page and buffer; step 2, drained, is the figure.
    SPILLWAY_RETURN_IF_ERROR((*trial)->run_step({.step = 1, .lr = 1e-4f}).with_context(what));
    SPILLWAY_RETURN_IF_ERROR((*trial)->drain().with_context(what));
    const auto start = std::chrono::steady_clock::now();
    SPILLWAY_RETURN_IF_ERROR((*trial)->run_step({.step = 2, .lr = 1e-4f}).with_context(what));
    SPILLWAY_RETURN_IF_ERROR((*trial)->drain().with_context(what));
    const double s = seconds_since(start);
    trial->reset();  // its memory goes back before the next candidate's executor is made
    timed.push_back({std::move(plan), s, seconds_since(trial_start)});
  }
  size_t best = 0;
  for (size_t i = 1; i < timed.size(); ++i)
    if (timed[i].measured_s < timed[best].measured_s) best = i;
  std::string report = "; timed one step each:";
  for (size_t i = 0; i < timed.size(); ++i) {
    char line[160];
    std::snprintf(line, sizeof line, "%s candidate %zu predicted %.3f s, measured %.3f s (trial %.1f s)", i ? "," : "",
                  i + 1, timed[i].plan.predicted_step_s, timed[i].measured_s, timed[i].trial_s);
    report += line;
  }
  char searched[128];
  std::snprintf(searched, sizeof searched, "; search %.1f s", search_s);
  report += searched;
  if (shared_host_) {
    std::snprintf(searched, sizeof searched, "; one pinned host region of %s for the trials in %.1f s",
                  format_size(shared_host_bytes_).c_str(), pin_s);
    report += searched;
  }
  report += "; kept candidate " + std::to_string(best + 1);
  Plan chosen = std::move(timed[best].plan);
  chosen.description += report;
  return chosen;
}

Result<std::vector<float>> read_named_floats(Executor& executor, const Program& program, const std::string& name) {
  const std::vector<TensorId> pieces = program.pieces(name);
  if (pieces.empty()) return Status::not_found("the program has no tensor '" + name + "'");
  std::vector<float> values;
  for (TensorId id : pieces) {
    const TensorInfo& info = program.tensors.info(id);
    if (info.dtype != DType::F32 && info.dtype != DType::BF16)
      return Status::invalid_argument("tensor " + info.name + " is " + dtype_name(info.dtype) + ", not a float tensor");
    std::vector<uint8_t> bytes(info.bytes());
    SPILLWAY_RETURN_IF_ERROR(executor.read_tensor(id, bytes.data(), bytes.size()));
    std::vector<float> part = decode_values(info.dtype, bytes.data(), static_cast<size_t>(info.shape.numel()));
    values.insert(values.end(), part.begin(), part.end());
  }
  return values;
}

Status write_named_floats(Executor& executor, const Program& program, const std::string& name,
                          const std::vector<float>& values) {
  std::vector<uint8_t> scratch;
  return write_named_floats(executor, program, name, values.data(), values.size(), scratch);
}

Budgets allocatable_budgets(const Budgets& budgets, const BackendSizes& sizes, uint64_t fixed_bytes) {
  Budgets b = budgets;
  const uint64_t g = std::max<uint64_t>(1, sizes.allocation_granularity());
  if (b.device != UINT64_MAX) b.device = b.device > fixed_bytes ? (b.device - fixed_bytes) / g * g : 0;
  return b;
}

Budgets allocatable_budgets(const Budgets& budgets, const Backend& backend) {
  return allocatable_budgets(budgets, backend, backend.fixed_device_bytes());
}

uint64_t host_mapping_reserve(const Program& program, const BackendSizes& backend, const Budgets& budgets) {
  if (budgets.device == UINT64_MAX) return 0;
  uint64_t most = 0;
  for (size_t i = 0; i < program.tensors.size(); ++i)
    most += (std::max<uint64_t>(1, program.tensors.info(static_cast<TensorId>(i)).bytes()) + 4095) / 4096 * 4096;
  // Beside the arena: the two pinned staging buffers of checkpoint snapshots.
  return backend.host_mapping_device_bytes(std::min(most, budgets.host) + kSnapshotStagingBytes);
}

Result<PlannerOptions> backend_planner_options(const Program& program, const BackendSizes& backend,
                                               PlannerOptions options) {
  options.alignment = backend.alignment();
  SPILLWAY_ASSIGN_OR_RETURN(WorkspaceNeed workspace, program_workspace(backend, program));
  options.workspace_bytes = workspace.bytes;  // inside the device budget (planner.h)
  options.allocation_granularity = backend.allocation_granularity();
  return options;
}

namespace {

// make_plan (count 0) or make_auto_plans (count >= 1) for `backend`, as plan_for_backend says.
Result<std::vector<Plan>> plans_for_backend(const Program& program, const Backend& backend, const Machine& machine,
                                            const Budgets& budgets, const PlannerOptions& options, int count) {
  SPILLWAY_ASSIGN_OR_RETURN(PlannerOptions o, backend_planner_options(program, backend, options));
  o.reserved_device_bytes = host_mapping_reserve(program, backend, budgets);
  const uint64_t fixed = backend.fixed_device_bytes();
  if (budgets.device != UINT64_MAX) o.outside_budget_bytes = fixed;
  const Simulator cost(machine);
  const Budgets allocatable = allocatable_budgets(budgets, backend);
  Result<std::vector<Plan>> plans = std::vector<Plan>{};
  if (count == 0) {
    auto plan = make_plan(program, cost, allocatable, o);
    if (plan.ok()) plans->push_back(std::move(*plan));
    else plans = plan.status();
  } else {
    plans = make_auto_plans(program, cost, allocatable, o, count);
  }
  if (plans.ok() || fixed == 0 || budgets.device == UINT64_MAX) return plans;
  return plans.status().with_context("the device budget " + format_size(budgets.device) + " less the " +
                                     format_size(fixed) +
                                     " the backend holds itself (streams, library handles): the figures below leave "
                                     "it out; a suggested --device-budget includes it");
}

}  // namespace

Result<Plan> plan_for_backend(const Program& program, const Backend& backend, const Machine& machine,
                              const Budgets& budgets, const PlannerOptions& options) {
  SPILLWAY_ASSIGN_OR_RETURN(std::vector<Plan> plans, plans_for_backend(program, backend, machine, budgets, options, 0));
  return std::move(plans.front());
}

Result<std::vector<Plan>> auto_plans_for_backend(const Program& program, const Backend& backend,
                                                 const Machine& machine, const Budgets& budgets,
                                                 const PlannerOptions& options, int count) {
  return plans_for_backend(program, backend, machine, budgets, options, std::max(1, count));
}

Result<Program> build_for_budget(const std::function<Result<Program>(bool tile_vocab)>& build,
                                 const BackendSizes& backend, uint64_t device_budget, bool* tiled) {
  if (tiled) *tiled = false;
  SPILLWAY_ASSIGN_OR_RETURN(Program untiled, build(false));
  if (device_budget == UINT64_MAX) return untiled;
  // What the arena gets: the budget less the workspace, as make_plan reserves it.
  SPILLWAY_ASSIGN_OR_RETURN(WorkspaceNeed workspace, program_workspace(backend, untiled));
  const uint64_t reserved = (workspace.bytes + backend.alignment() - 1) / backend.alignment() * backend.alignment();
  const uint64_t arena = device_budget > reserved ? device_budget - reserved : 0;
  if (minimum_device_budget(untiled, backend.alignment()) <= arena / 2) return untiled;
  if (tiled) *tiled = true;
  return build(true);
}

Status Trainer::zero_moments(const ParamSpec& p, std::vector<float>& zeros) {
  const auto n = static_cast<size_t>(p.shape.numel());
  if (zeros.size() < n) zeros.assign(n, 0.0f);  // only ever zeros: grown, never written
  std::vector<uint8_t> scratch;                   // moments are F32: written straight from `zeros`
  for (const char* prefix : {"adam_m.", "adam_v."})
    SPILLWAY_RETURN_IF_ERROR(write_named_floats(*executor_, program_, prefix + p.name, zeros.data(), n, scratch));
  return Status::ok();
}

Status Trainer::write_parameter(const std::string& name, const float* values, size_t count,
                                std::vector<uint8_t>& scratch) {
  SPILLWAY_RETURN_IF_ERROR(write_named_floats(*executor_, program_, "master." + name, values, count, scratch));
  return write_named_floats(*executor_, program_, name, values, count, scratch);
}

Status Trainer::write_parameter(const std::string& name, const std::vector<float>& values) {
  SPILLWAY_RETURN_IF_ERROR(usable("write parameter " + name));
  std::vector<uint8_t> scratch;
  return write_parameter(name, values.data(), values.size(), scratch);
}

Status Trainer::init_parameters() {
  SPILLWAY_RETURN_IF_ERROR(usable("initialize the parameters"));
  // Two buffers of the largest parameter's values: parameter i + 1 is generated in
  // parallel (init_parameter_into, on the thread pool, from a thread of its own) while
  // parameter i is written to the master and, converted, to the parameter, so the
  // copies and uploads overlap the generator. The values do not depend on the order
  // (the generator is counter-based).
  size_t largest = 0;
  for (const ParamSpec& p : params_) largest = std::max(largest, static_cast<size_t>(p.shape.numel()));
  std::vector<float> buffers[2] = {std::vector<float>(largest), std::vector<float>(largest)};
  auto generate = [this, &buffers](size_t i) {
    init_parameter_into(options_.model, params_[i], options_.seed, buffers[i % 2].data(), global_thread_pool());
  };
  // Declared after the buffers: on an early return its destructor waits for the
  // generation still running before they go.
  std::future<void> next;
  auto start = [&](size_t i) {
    try {
      next = std::async(std::launch::async, generate, i);
    } catch (const std::system_error&) {  // no thread to be had: generate it here
      generate(i);
      next = {};
    }
  };
  std::vector<uint8_t> scratch;
  std::vector<float> zeros;
  const bool zero = !moments_zero_;
  if (!params_.empty()) start(0);
  for (size_t i = 0; i < params_.size(); ++i) {
    if (next.valid()) next.get();
    if (i + 1 < params_.size()) start(i + 1);
    const ParamSpec& p = params_[i];
    SPILLWAY_RETURN_IF_ERROR(
        write_parameter(p.name, buffers[i % 2].data(), static_cast<size_t>(p.shape.numel()), scratch));
    if (zero) SPILLWAY_RETURN_IF_ERROR(zero_moments(p, zeros));
  }
  moments_zero_ = true;
  return Status::ok();
}

Status Trainer::load_parameters(const std::string& path, const ImportOptions& options) {
  SPILLWAY_RETURN_IF_ERROR(usable("load " + path));
  std::vector<uint8_t> scratch;
  std::vector<float> zeros;
  const bool zero = !moments_zero_;
  SPILLWAY_RETURN_IF_ERROR(import_model(
      path, options_.model,
      [&](const ParamSpec& p, std::vector<float>&& values) -> Status {
        SPILLWAY_RETURN_IF_ERROR(write_parameter(p.name, values.data(), values.size(), scratch));
        return zero ? zero_moments(p, zeros) : Status::ok();
      },
      options));
  moments_zero_ = true;
  return Status::ok();
}

Status Trainer::save(const std::string& path) {
  SPILLWAY_RETURN_IF_ERROR(usable("save " + path));
  SPILLWAY_RETURN_IF_ERROR(drain());
  return export_model(path, options_.model, [&](const ParamSpec& p) -> Result<std::vector<float>> {
    SPILLWAY_ASSIGN_OR_RETURN(std::vector<float> v, read_floats("master." + p.name));
    for (size_t i = 0; i < v.size(); ++i)
      if (!std::isfinite(v[i]))
        return Status::invalid_argument("not saving " + path + ": parameter " + p.name + " holds " +
                                        number_text(v[i]) + " at element " + std::to_string(i) + " (after step " +
                                        std::to_string(step_) + ")");
    return v;
  });
}

Status Trainer::save_gradients(const std::string& path) {
  SPILLWAY_RETURN_IF_ERROR(usable("save the gradients to " + path));
  return export_model(path, options_.model,
                     [&](const ParamSpec& p) -> Result<std::vector<float>> { return read_floats("grad." + p.name); });
}

Result<std::vector<float>> Trainer::read_floats(const std::string& tensor_name) {
  SPILLWAY_RETURN_IF_ERROR(usable("read " + tensor_name));
  return read_named_floats(*executor_, program_, tensor_name);
}

Result<StepResult> Trainer::step(DataLoader& loader) {
  SPILLWAY_RETURN_IF_ERROR(usable("run step " + std::to_string(step_ + 1)));
  const StepShape& shape = options_.shape;
  if (loader.B() != shape.B || loader.T() != shape.T)
    return Status::invalid_argument("the data loader gives [" + std::to_string(loader.B()) + "," +
                                    std::to_string(loader.T()) + "] batches; the step takes [" +
                                    std::to_string(shape.B) + "," + std::to_string(shape.T) + "]");
  std::vector<TokenBatch> batches(static_cast<size_t>(shape.accum));
  for (TokenBatch& b : batches) {
    b.tokens.resize(static_cast<size_t>(shape.B) * shape.T);
    b.targets.resize(b.tokens.size());
    loader.next(b.tokens.data(), b.targets.data());
  }
  return step(batches);
}

std::vector<TensorId> Trainer::state_tensors() const {
  std::vector<TensorId> out;
  for (size_t i = 0; i < program_.tensors.size(); ++i) {
    const Role r = program_.tensors.info(static_cast<TensorId>(i)).role;
    if (r == Role::Master || r == Role::OptState) out.push_back(static_cast<TensorId>(i));
  }
  return out;
}

Status Trainer::restore_parameters_from_masters() {
  SPILLWAY_RETURN_IF_ERROR(usable("restore the parameters"));
  std::vector<uint8_t> scratch;
  for (const ParamSpec& p : params_) {
    SPILLWAY_ASSIGN_OR_RETURN(std::vector<float> master, read_floats("master." + p.name));
    SPILLWAY_RETURN_IF_ERROR(write_named_floats(*executor_, program_, p.name, master.data(), master.size(), scratch));
  }
  return Status::ok();
}

Status Trainer::read_state_tensor(TensorId t, std::vector<uint8_t>& bytes) {
  SPILLWAY_RETURN_IF_ERROR(usable("read the training state"));
  bytes.resize(program_.tensors.info(t).bytes());
  return executor_->read_tensor(t, bytes.data(), bytes.size());
}

uint64_t Trainer::state_bytes() const {
  uint64_t n = 0;
  for (TensorId t : state_tensors()) n += program_.tensors.info(t).bytes();
  return n;
}

Result<SnapshotTimes> Trainer::snapshot_state(const std::vector<TensorId>& tensors, const std::vector<uint8_t*>& dst,
                                              std::shared_ptr<std::promise<Status>> host_copies_done,
                                              const PinnedRange& pinned) {
  if (tensors.size() != dst.size())
    return Status::invalid_argument("snapshot_state: " + std::to_string(tensors.size()) + " tensors but " +
                                    std::to_string(dst.size()) + " destinations");
  SnapshotTimes times;
  auto t0 = std::chrono::steady_clock::now();
  SPILLWAY_RETURN_IF_ERROR(drain());
  times.drain_s = seconds_since(t0);
  t0 = std::chrono::steady_clock::now();
  struct Piece {
    const uint8_t* src;
    uint8_t* dst;
    size_t bytes;
  };
  constexpr size_t kPiece = kSnapshotStagingBytes / 2;
  std::vector<Piece> host_pieces, device_pieces;  // cut into pieces of at most 8 MiB
  struct Direct {  // a device tensor copied straight into the pinned destination
    const uint8_t* src;
    uint8_t* dst;
    size_t bytes;
    TensorId tensor;
  };
  std::vector<Direct> direct;
  std::vector<TensorId> host_tensors;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const size_t n = program_.tensors.info(tensors[i]).bytes();
    SPILLWAY_ASSIGN_OR_RETURN(const void* host, executor_->host_value(tensors[i]));
    SPILLWAY_ASSIGN_OR_RETURN(const void* device, host ? nullptr : executor_->device_value(tensors[i]));
    if (!host && !device) {  // in storage
      SPILLWAY_RETURN_IF_ERROR(executor_->read_tensor(tensors[i], dst[i], n));
      times.storage_bytes += n;
      continue;
    }
    if (host) host_tensors.push_back(tensors[i]);
    if (!host && pinned.contains(dst[i], n) && pinned.chunk > 0) {
      if (n > 0) direct.push_back({static_cast<const uint8_t*>(device), dst[i], n, tensors[i]});
      times.device_bytes += n;
      continue;
    }
    auto& pieces = host ? host_pieces : device_pieces;
    const auto* from = static_cast<const uint8_t*>(host ? host : device);
    for (size_t at = 0; at < n; at += kPiece) pieces.push_back({from + at, dst[i] + at, std::min(kPiece, n - at)});
    (host ? times.host_bytes : times.device_bytes) += n;
  }
  // Device tensors with pinned destinations: copied in the background, neighbours in
  // both memories as one copy, never across a pinned piece; the first copy waits for
  // the compute submitted so far and the rest follow it on the same queue. The next
  // step's writers of each tensor wait for its copy (hold_device_reader).
  if (!direct.empty()) {
    // In the order the next step's ops first write them (its optimizer, mostly), so
    // that each writer finds its tensor's copy done as early as the link allows.
    std::vector<int> first_writer(program_.tensors.size(), std::numeric_limits<int>::max());
    for (size_t i = 0; i < program_.ops.size(); ++i)
      for (const Operand& o : program_.ops[i].operands)
        if (o.access != Access::Read && first_writer[o.tensor] == std::numeric_limits<int>::max())
          first_writer[o.tensor] = static_cast<int>(i);
    std::stable_sort(direct.begin(), direct.end(), [&](const Direct& a, const Direct& b) {
      return first_writer[a.tensor] < first_writer[b.tensor];
    });
    CopyEngine& ce = backend_.copy_engine();
    std::vector<TensorId> batch;
    const uint8_t *src = nullptr, *end_src = nullptr;
    uint8_t *dst_at = nullptr, *end_dst = nullptr;
    bool first = true;
    auto flush = [&]() -> Status {
      if (batch.empty()) return Status::ok();
      CopyTicket last{};
      size_t at = 0;
      const size_t total = static_cast<size_t>(end_dst - dst_at);
      while (at < total) {
        const uint64_t offset = static_cast<uint64_t>(dst_at + at - pinned.base);
        const size_t bytes = std::min<uint64_t>(total - at, pinned.chunk - offset % pinned.chunk);
        SPILLWAY_ASSIGN_OR_RETURN(last, ce.copy(CopyDirection::DeviceToHost, dst_at + at, src + at, bytes, first));
        first = false;
        at += bytes;
      }
      for (TensorId t : batch) SPILLWAY_RETURN_IF_ERROR(executor_->hold_device_reader(t, last));
      times.device_copies = last;
      batch.clear();
      return Status::ok();
    };
    for (const Direct& d : direct) {
      if (batch.empty() || d.src != end_src || d.dst != end_dst) {
        SPILLWAY_RETURN_IF_ERROR(flush());
        src = d.src;
        dst_at = d.dst;
      }
      batch.push_back(d.tensor);
      end_src = d.src + d.bytes;
      end_dst = d.dst + d.bytes;
    }
    SPILLWAY_RETURN_IF_ERROR(flush());
  }
  // Device copies now (the next step's device optimizer changes them), through two
  // pinned staging buffers: piece k+1 is copied down while piece k is spread on all cores.
  if (!device_pieces.empty()) {
    if (!snapshot_staging_[0]) {
      for (auto& buffer : snapshot_staging_) {
        SPILLWAY_ASSIGN_OR_RETURN(void* p, backend_.host_alloc(kPiece));
        buffer = std::shared_ptr<uint8_t>(static_cast<uint8_t*>(p), [b = &backend_](uint8_t* q) { b->host_free(q); });
      }
    }
    CopyEngine& ce = backend_.copy_engine();
    std::optional<CopyTicket> previous;
    for (size_t k = 0; k <= device_pieces.size(); ++k) {
      std::optional<CopyTicket> ticket;
      if (k < device_pieces.size()) {
        const Piece& p = device_pieces[k];
        SPILLWAY_ASSIGN_OR_RETURN(CopyTicket t, ce.copy(CopyDirection::DeviceToHost, snapshot_staging_[k % 2].get(),
                                                        p.src, p.bytes, /*after_compute=*/true));
        ticket = t;
      }
      if (k > 0) {
        SPILLWAY_RETURN_IF_ERROR(ce.wait(*previous));
        const Piece& p = device_pieces[k - 1];
        const uint8_t* staged = snapshot_staging_[(k - 1) % 2].get();
        constexpr size_t kSpread = size_t{1} << 20;
        global_thread_pool().parallel_for(static_cast<int64_t>((p.bytes + kSpread - 1) / kSpread),
                                          [&](int64_t begin, int64_t end) {
                                            const size_t from = static_cast<size_t>(begin) * kSpread;
                                            const size_t to = std::min(p.bytes, static_cast<size_t>(end) * kSpread);
                                            std::memcpy(p.dst + from, staged + from, to - from);
                                          });
      }
      previous = ticket;
    }
  }
  times.device_s = seconds_since(t0);
  // Host copies: a job on the host engine, so that the next step's forward and
  // backward run meanwhile; its host optimizer waits for it (a reader of these).
  auto copy_host = [pieces = std::move(host_pieces), host_copies_done]() -> Status {
    global_thread_pool().parallel_for(static_cast<int64_t>(pieces.size()), [&](int64_t begin, int64_t end) {
      for (int64_t k = begin; k < end; ++k) std::memcpy(pieces[k].dst, pieces[k].src, pieces[k].bytes);
    });
    if (host_copies_done) host_copies_done->set_value(Status::ok());
    return Status::ok();
  };
  if (!host_copies_done) {
    SPILLWAY_RETURN_IF_ERROR(copy_host());
    return times;
  }
  SPILLWAY_RETURN_IF_ERROR(executor_->submit_host_reader(host_tensors, std::move(copy_host)));
  return times;
}

Status Trainer::write_state_tensor(TensorId t, const void* bytes, size_t n) {
  SPILLWAY_RETURN_IF_ERROR(usable("write the training state"));
  moments_zero_ = false;
  return executor_->write_tensor(t, bytes, n);
}

void Trainer::restore_steps_done(int64_t step) { step_ = step; }

Status Trainer::drain() {
  SPILLWAY_RETURN_IF_ERROR(usable("finish step " + std::to_string(step_)));
  if (Status s = executor_->drain(); !s.is_ok()) {
    broken_ = s.with_context("step " + std::to_string(step_) + " failed after it returned");
    return broken_;
  }
  return Status::ok();
}

Status Trainer::usable(const std::string& what) const {
  if (broken_.is_ok()) return Status::ok();
  return Status(broken_.code(), "cannot " + what + ": " + broken_.message() +
                                    "; the parameters, master weights and Adam moments may be half-updated, so "
                                    "this trainer refuses to read, save or train them (start again from the "
                                    "last saved weights)");
}

Result<StepResult> Trainer::step(const std::vector<TokenBatch>& micro_batches) {
  SPILLWAY_RETURN_IF_ERROR(usable("run step " + std::to_string(step_ + 1)));
  rejected_.reset();
  auto r = run(micro_batches);
  if (!r.ok()) return r.status().with_context("step " + std::to_string(step_ + 1));
  const bool bad_norm = !std::isfinite(r->grad_norm), bad_loss = !std::isfinite(r->loss_f64);
  if (r->applied) step_ = r->step;
  if (!bad_norm && !bad_loss) return r;
  rejected_ = *r;
  std::string m = "step " + std::to_string(r->step) + ": ";
  if (!r->applied) {
    m += "the gradient norm is " + number_text(r->grad_norm) + " (loss " + number_text(r->loss_f64) +
         "), so the update was not applied: the parameters, master weights and Adam moments are " +
         after_step_text(step_);
  } else {
    // Finite gradients (the norm says so) were applied before the loss could be seen.
    m += "the loss is " + number_text(r->loss_f64) + " while the gradient norm " + number_text(r->grad_norm) +
         " is finite, so the update of step " + std::to_string(r->step) +
         " was applied: the parameters, master weights and Adam moments are " + after_step_text(step_);
  }
  m += " (training diverged at learning rate " + number_text(r->lr) + ")";
  return Status::invalid_argument(m);
}

Result<StepResult> Trainer::run(const std::vector<TokenBatch>& micro_batches) {
  const auto t0 = Clock::now();
  const StepShape& shape = options_.shape;
  const size_t n = static_cast<size_t>(shape.B) * shape.T;
  if (micro_batches.size() != static_cast<size_t>(shape.accum))
    return Status::invalid_argument("a step takes " + std::to_string(shape.accum) + " micro-batches, got " +
                                    std::to_string(micro_batches.size()));
  for (size_t k = 0; k < micro_batches.size(); ++k) {
    const TokenBatch& b = micro_batches[k];
    if (b.tokens.size() != n || b.targets.size() != n)
      return Status::invalid_argument("micro-batch " + std::to_string(k) + " has " + std::to_string(b.tokens.size()) +
                                      " tokens and " + std::to_string(b.targets.size()) + " targets; expected " +
                                      std::to_string(n) + " of each");
    SPILLWAY_RETURN_IF_ERROR(executor_->write_tensor(tokens_[k], b.tokens.data(), n * sizeof(int32_t)));
    SPILLWAY_RETURN_IF_ERROR(executor_->write_tensor(targets_[k], b.targets.data(), n * sizeof(int32_t)));
  }
  StepResult r;
  r.step = step_ + 1;
  r.lr = options_.schedule.at(r.step);
  // From here on an error may leave the state half-updated (or its outcome unknown).
  auto fail = [&](const Status& s) {
    broken_ = s.with_context("step " + std::to_string(r.step) + " failed");
    return s;
  };
  moments_zero_ = false;  // the step writes the moments (even one that fails halfway)
  if (Status s = executor_->run_step({.step = r.step, .lr = r.lr}); !s.is_ok()) return fail(s);
  r.exec = executor_->metrics();

  std::vector<float> losses(n);
  double sum = 0;
  for (TensorId id : losses_) {
    if (Status s = executor_->read_tensor(id, losses.data(), n * sizeof(float)); !s.is_ok()) return fail(s);
    for (float l : losses) sum += l;
  }
  r.tokens = tokens_per_step();
  r.loss_f64 = sum / static_cast<double>(r.tokens);
  r.loss = static_cast<float>(r.loss_f64);
  float scale_norm[2] = {0, 0};
  if (Status s = executor_->read_tensor(scale_norm_, scale_norm, sizeof scale_norm); !s.is_ok()) return fail(s);
  r.grad_norm = scale_norm[1];
  // What the AdamW kernels did: a non-finite scale means they changed nothing.
  r.applied = !adamw_step_skipped(scale_norm);
  r.step_s = std::chrono::duration<double>(Clock::now() - t0).count();
  r.tokens_per_s = r.step_s > 0 ? static_cast<double>(r.tokens) / r.step_s : 0;
  return r;
}

Status Trainer::plan_evaluation(int B, int T) {
  eval_B_ = eval_T_ = 0;
  if (T > options_.model.context)
    return Status::invalid_argument("evaluation context " + std::to_string(T) + " is longer than the model's context " +
                                    std::to_string(options_.model.context));
  SPILLWAY_ASSIGN_OR_RETURN(eval_program_, build_forward_program(options_.model, B, T, backend_.activation_dtype(),
                                                                true, options_.shape.tile_vocab));
  SPILLWAY_ASSIGN_OR_RETURN(PlannerOptions planner, backend_planner_options(eval_program_, backend_, options_.planner));
  eval_budgets_ = options_.budgets;
  // Evaluation is carved out of the same device budget as training. First choice:
  // the training arena's idle region (everything past the device homes of the
  // training state), so that evaluation allocates no device memory at all.
  const DeviceRegion idle = executor_->idle_device_region();
  const uint64_t align = backend_.alignment();
  eval_budgets_.device = idle.bytes / align * align;
  auto plan_inside = [&](Policy policy) -> Result<Plan> {
    if (eval_budgets_.device == 0) return Status::out_of_memory("the training arena has no idle region");
    PlannerOptions p = planner;
    p.policy = policy;
    return make_plan(eval_program_, Simulator(options_.machine), eval_budgets_, p);
  };
  Result<Plan> inside = plan_inside(planner.policy);
  // A resident run's idle region holds its activations, not a second copy of the
  // parameters: there, evaluation streams them (planned policy; the same losses).
  if (!inside.ok() && planner.policy == Policy::Resident) {
    Result<Plan> planned = plan_inside(Policy::Planned);
    if (planned.ok()) inside = std::move(planned);
  }
  eval_inside_ = inside.ok();
  if (inside.ok()) {
    eval_plan_ = std::move(*inside);
  } else {
    // Else its own allocation, in what the device budget leaves beyond all the
    // training executor holds (and what the device has free).
    const uint64_t training = executor_->device_bytes();
    const uint64_t budget = options_.budgets.device;
    eval_budgets_.device = budget == UINT64_MAX ? UINT64_MAX : (budget > training ? budget - training : 0);
    const size_t free_bytes = backend_.device_free_bytes();
    if (free_bytes != SIZE_MAX) eval_budgets_.device = std::min<uint64_t>(eval_budgets_.device, free_bytes);
    auto beside = plan_for_backend(eval_program_, backend_, options_.machine, eval_budgets_, planner);
    eval_budgets_ = allocatable_budgets(eval_budgets_, backend_);
    if (!beside)
      return Status(beside.status().code(),
                    "planning the evaluation program: it fits neither in the " + format_size(idle.bytes) +
                        " of the training arena that are idle between steps (" + inside.status().message() +
                        ") nor in the " + format_size(eval_budgets_.device) + " that the device budget leaves beyond the " +
                        format_size(training) + " training holds (" + beside.status().message() + ")");
    eval_plan_ = std::move(*beside);
  }
  eval_B_ = B;
  eval_T_ = T;
  return Status::ok();
}

Result<float> Trainer::evaluate(DataLoader& loader, int batches) {
  SPILLWAY_RETURN_IF_ERROR(usable("evaluate"));
  SPILLWAY_RETURN_IF_ERROR(drain());  // the pipeline's epilogue: the whole state settled
  if (batches <= 0) return Status::invalid_argument("evaluation needs at least one batch, got " + std::to_string(batches));
  if (eval_B_ != loader.B() || eval_T_ != loader.T()) SPILLWAY_RETURN_IF_ERROR(plan_evaluation(loader.B(), loader.T()));
  ExecutorOptions eo;
  eo.host_budget = eval_budgets_.host;
  eo.spill_dir = options_.spill_dir;
  eo.storage_budget = eval_budgets_.storage;
  if (eval_inside_) {
    eo.external_device = executor_->idle_device_region();
    if (eo.external_device.base == nullptr)
      return Status::internal("the training arena has no idle region for the evaluation planned in it");
  }
  auto created = Executor::create(backend_, eval_program_, eval_plan_, eo);
  if (!created) return created.status().with_context("creating the evaluation executor");
  Executor& ex = **created;
  std::vector<uint8_t> buffer;
  for (const ParamSpec& p : params_) {
    // Both programs have the same pieces (the same tile_vocab); copied as bytes.
    const std::vector<TensorId> src = program_.pieces(p.name), dst = eval_program_.pieces(p.name);
    if (src.size() != dst.size() || src.empty())
      return Status::internal("the evaluation program's pieces of parameter " + p.name + " differ from training's");
    for (size_t j = 0; j < src.size(); ++j) {
      buffer.resize(program_.tensors.info(src[j]).bytes());
      SPILLWAY_RETURN_IF_ERROR(executor_->read_tensor(src[j], buffer.data(), buffer.size()));
      SPILLWAY_RETURN_IF_ERROR(ex.write_tensor(dst[j], buffer.data(), buffer.size()));
    }
  }
  const TensorId tokens = eval_program_.tensors.find("mb0.tokens");
  const TensorId targets = eval_program_.tensors.find("mb0.targets");
  const TensorId losses = eval_program_.tensors.find("mb0.losses");
  if (tokens == kNoTensor || targets == kNoTensor || losses == kNoTensor)
    return Status::internal("the evaluation program lacks mb0.tokens, mb0.targets or mb0.losses");
  const size_t n = static_cast<size_t>(loader.B()) * loader.T();
  std::vector<int32_t> tok(n), tgt(n);
  std::vector<float> loss(n);
  double sum = 0;
  for (int i = 0; i < batches; ++i) {
    // SIGINT/SIGTERM (core/interrupt.h) stops an evaluation between its batches.
    if (interrupted())
      return interrupted_status("during the evaluation, after " + std::to_string(i) + " of " +
                                std::to_string(batches) + " batches");
    loader.next(tok.data(), tgt.data());
    SPILLWAY_RETURN_IF_ERROR(ex.write_tensor(tokens, tok.data(), n * sizeof(int32_t)));
    SPILLWAY_RETURN_IF_ERROR(ex.write_tensor(targets, tgt.data(), n * sizeof(int32_t)));
    SPILLWAY_RETURN_IF_ERROR(ex.run_step({.step = 1, .lr = 0}));
    SPILLWAY_RETURN_IF_ERROR(ex.read_tensor(losses, loss.data(), n * sizeof(float)));
    for (float l : loss) sum += l;
  }
  return static_cast<float>(sum / (static_cast<double>(n) * batches));
}

}  // namespace spillway
