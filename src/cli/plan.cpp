// `spillway plan`: where every class of tensor goes for a model under budgets, the
// peaks of each tier, the bytes each link moves per step and the predicted step
// time — without training. `spillway simulate` is the same command, named for its
// what-if use: describe a machine that does not exist (--machine FILE|PRESET, then
// --h2d-gbps, --storage-gbps, --nvme-count, --gpu-memory, --host-memory, budgets)
// and ask how a model would train there:
//
//   spillway simulate --machine machine.json --model gpt2-1.5b --device-budget 24GiB
//   spillway simulate --machine h200 --model llama-3.1-8b --sweep storage-gbps=1.7,3.4,7 --chart s.svg
//   spillway simulate --machine h200 --model gpt2-1.5b --device-budget 24GiB --largest
//
// --sweep prints one row per value (step, tokens/s, where the time goes, which
// resource binds); --chart draws tokens/s against the swept value as an SVG;
// --largest searches the most layers of the model's family and width that plan
// within the budgets and names the budget that stops one more layer. Plans are made for
// the backend --backend names (default: the machine's), with the device workspace
// that backend's ops need reserved inside the device budget, as `spillway train` does;
// no device is needed (backend_sizes.h).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>
#include <tuple>
#include <vector>

#include "backend/backend_sizes.h"
#include "cli/command.h"
#include "cli/train_flags.h"
#include "core/size.h"
#include "dist/predict.h"
#include "exec/dispatch.h"
#include "exec/trace.h"
#include "model/model.h"
#include "plan/planner.h"
#include "train/trainer.h"
#include "sim/simulator.h"

namespace spillway::cli {
namespace {

struct PlanFlags {
  ModelFlags model;
  int batch = 8, context = 0, accum = 1;
  std::string machine = "h200";
  std::string backend;  // "" = the machine's: cuda on h200, cpu on cpu
  std::string device_budget, host_budget, storage_budget;
  std::string policy = "auto";
  std::string prefetch = "none";
  std::string order = "auto";
  std::string device_optimizer = "auto";  // as train's --device-optimizer
  std::string stream_optimizer = "on";    // as train's --stream-optimizer
  std::string speculate = "auto";         // as train's --speculate
  std::string carry_updates = "auto";     // as train's --carry-updates
  std::string zero_grads = "late";        // as train's --zero-grads
  std::string trace;
  double h2d_gbps = 0, storage_gbps = 0;  // 0: the machine's
  int nvme_count = 0;                      // 0: the machine's storage as it is
  std::string gpu_memory, host_memory;     // "": the machine's
  std::string sweep;                       // KEY=V1,V2,...
  std::string chart;                       // SVG file for --sweep
  bool largest = false;
  int gpus = 1;                 // data-parallel ranks (one GPU each)
  double network_gbps = 0;      // each GPU's link to the others, GB/s one way (needed with --gpus above 1)
  double network_latency_us = 0;
  int zero_stage = 2;           // with --gpus: 2 (parameters on every GPU) or 3 (each GPU only its shard)
  int candidates = 1;           // policy auto: list this many of its best-ranked candidates
};

// The machine of --machine with the what-if edits applied; impossible values are errors.
Result<Machine> edited_machine(const PlanFlags& f) {
  auto loaded = load_machine(f.machine);
  if (!loaded) return loaded.status().with_context("--machine");
  Machine machine = *loaded;
  if (f.h2d_gbps < 0 || !std::isfinite(f.h2d_gbps))
    return Status::invalid_argument("--h2d-gbps: expected GB/s above 0, got " + std::to_string(f.h2d_gbps));
  if (f.storage_gbps < 0 || !std::isfinite(f.storage_gbps))
    return Status::invalid_argument("--storage-gbps: expected GB/s above 0, got " + std::to_string(f.storage_gbps));
  if (f.nvme_count < 0)
    return Status::invalid_argument("--nvme-count: expected 1 or more drives, got " + std::to_string(f.nvme_count));
  if (f.h2d_gbps > 0) machine.h2d_bytes_per_s = machine.d2h_bytes_per_s = f.h2d_gbps * 1e9;
  if (f.storage_gbps > 0) machine.storage_read_bytes_per_s = machine.storage_write_bytes_per_s = f.storage_gbps * 1e9;
  if (f.nvme_count > 0) {  // drives striped: each adds the rate of the one measured (or of --storage-gbps)
    machine.storage_read_bytes_per_s *= f.nvme_count;
    machine.storage_write_bytes_per_s *= f.nvme_count;
    machine.storage_bytes *= static_cast<uint64_t>(f.nvme_count);
  }
  for (auto [text, flag, field] : {std::tuple{&f.gpu_memory, "--gpu-memory", &machine.device_bytes},
                                   std::tuple{&f.host_memory, "--host-memory", &machine.host_bytes}}) {
    if (text->empty()) continue;
    auto b = parse_size(*text, flag);
    if (!b) return b.status();
    if (*b == 0) return Status::invalid_argument(std::string(flag) + ": expected a size above 0, got '" + *text + "'");
    *field = *b;
  }
  return machine;
}

// One predicted step, and where its time goes.
struct Prediction {
  std::string report;            // what `spillway plan` prints
  double step_s = 0, tokens_per_s = 0;
  double compute_s = 0;          // device compute busy
  double exposed_s = 0;          // device compute idle waiting for data (stalls and the initial wait)
  double host_optimizer_s = 0;   // host ops busy
  double h2d_s = 0, d2h_s = 0;   // link busy, each direction
  double storage_s = 0;          // storage busy (reads and writes share the device)
  std::string binds;             // the resource busy longest: "compute", "host optimizer", "h2d", "d2h", "storage"
  double binds_share = 0;        // its busy time over the step
};

Result<Prediction> predict_step(const PlanFlags& f, const ModelConfig& model, const Machine& machine) {
  const ModelConfig* cfg = &model;
  int T = f.context ? f.context : cfg->context;
  if (T > cfg->context)
    return (Status::invalid_argument("--context " + std::to_string(T) + " is longer than the model's context " +
                                         std::to_string(cfg->context)));
  const std::string backend_name = !f.backend.empty() ? f.backend : machine.host_runs_ahead ? "cuda" : "cpu";
  auto sizes = backend_sizes(backend_name);
  if (!sizes.ok()) return sizes.status().with_context("--backend");
  const BackendSizes& backend = **sizes;
  const DType act = backend.activation_dtype();
  Budgets budgets;
  budgets.device = machine.device_bytes ? machine.device_bytes : UINT64_MAX;
  budgets.host = machine.host_bytes ? machine.host_bytes : UINT64_MAX;
  for (auto [text, flag, budget] : {std::tuple{&f.device_budget, "--device-budget", &budgets.device},
                                    std::tuple{&f.host_budget, "--host-budget", &budgets.host},
                                    std::tuple{&f.storage_budget, "--storage-budget", &budgets.storage}}) {
    if (text->empty()) continue;
    auto b = parse_budget(*text, flag);
    if (!b.ok()) return b.status();
    *budget = *b;
  }
  for (auto [given, flag, budget, capacity, what] :
       {std::tuple{!f.device_budget.empty() && !f.gpu_memory.empty(), "--device-budget", budgets.device,
                   machine.device_bytes, "--gpu-memory"},
        std::tuple{!f.host_budget.empty() && !f.host_memory.empty(), "--host-budget", budgets.host, machine.host_bytes,
                   "--host-memory"}})
    if (given && budget > capacity)
      return Status::invalid_argument(std::string(flag) + " " + format_size(budget) + " is more than " + what + " " +
                                      format_size(capacity));
  if (f.batch < 1 || f.accum < 1)
    return (Status::invalid_argument("--batch and --accum must be at least 1, got " + std::to_string(f.batch) +
                                         " and " + std::to_string(f.accum)));
  // One GPU's step first; with --gpus N a model that only N GPUs' shards can hold
  // still gets the data-parallel prediction, with why one GPU cannot run it.
  Status one_gpu = check_step_is_bounded(*cfg, {.B = f.batch, .T = T, .accum = f.accum}, act, budgets);
  if (!one_gpu.is_ok() && f.gpus == 1) return one_gpu;
  auto options = resolve_planner_options(f.policy, f.prefetch, f.order);
  if (!options.ok()) return options.status();
  // As `spillway train` plans (plan_for_backend), except for what a backend holds
  // itself, which only a running one can measure.
  const Budgets allocatable = allocatable_budgets(budgets, backend, 0);
  bool tiled = false;
  auto program = build_for_budget(
      [&](bool tile_vocab) {
        return build_training_program(*cfg, {.B = f.batch, .T = T, .accum = f.accum, .tile_vocab = tile_vocab}, act);
      },
      backend, allocatable.device, &tiled);
  if (!program.ok()) return program.status();
  auto planner = backend_planner_options(*program, backend, *options);
  if (!planner.ok()) return planner.status();
  if (f.device_optimizer == "rule") {
    planner->optimizer_share_search = 0;  // the half-budget rule's share, no search
  } else if (f.device_optimizer != "auto") {
    SPILLWAY_ASSIGN_OR_RETURN(uint64_t bytes, parse_size(f.device_optimizer, "--device-optimizer"));
    planner->device_optimizer_bytes = static_cast<int64_t>(bytes);
  }
  if (f.stream_optimizer == "off") planner->stream_optimizer = 0;
  else if (f.stream_optimizer != "on")
    return Status::invalid_argument("--stream-optimizer: expected on or off, got '" + f.stream_optimizer + "'");
  SPILLWAY_ASSIGN_OR_RETURN(planner->speculate, parse_speculate(f.speculate));
  SPILLWAY_ASSIGN_OR_RETURN(planner->carry_updates, parse_carry_updates(f.carry_updates));
  SPILLWAY_ASSIGN_OR_RETURN(planner->late_zeros, parse_zero_grads(f.zero_grads));
  auto workspace = program_workspace(backend, *program);
  if (!workspace.ok()) return workspace.status();
  // The GPU's mapping of the pinned host arena, reserved as train reserves it.
  planner->reserved_device_bytes = host_mapping_reserve(*program, backend, budgets);
  // Data parallel (dist/predict.h): the busiest rank's program, planned as this one
  // is, plus its collectives over the network that the backward does not hide.
  // one_gpu_tokens: one GPU's predicted tokens/s (0: it cannot run the step).
  auto data_parallel = [&](double one_gpu_tokens) -> Result<std::string> {
    const NetworkLink link{.bytes_per_s = f.network_gbps * 1e9, .latency_s = f.network_latency_us * 1e-6};
    const Simulator cost(machine);
    PlannerOptions rank_options = *planner;
    auto plan_rank = [&](const Program& rank) -> Result<Plan> {
      SPILLWAY_ASSIGN_OR_RETURN(WorkspaceNeed need, program_workspace(backend, rank));
      PlannerOptions o = rank_options;
      o.workspace_bytes = need.bytes;
      o.reserved_device_bytes = host_mapping_reserve(rank, backend, budgets);
      return make_plan(rank, cost, allocatable, o);
    };
    auto dp = predict_data_parallel(*program, f.gpus, f.gpus * f.accum, static_cast<int64_t>(f.batch) * T * f.accum,
                                    cost, plan_rank, link, f.zero_stage);
    if (!dp.ok()) return dp.status().with_context("--gpus " + std::to_string(f.gpus));
    char line[512];
    std::snprintf(line, sizeof line,
                  "data parallel, %d GPUs, ZeRO stage %d (network %.1f GB/s per GPU each way, %.1f us per collective): "
                  "step %.3f s (the busiest rank, %d: compute %.3f s + exposed collectives %.3f s; hidden behind the "
                  "forward and backward %.3f s), %.0f tokens/s, %.0f per GPU",
                  f.gpus, dp->zero_stage, f.network_gbps, f.network_latency_us, dp->step_s, dp->busiest_rank,
                  dp->compute_s, dp->exposed_s, dp->hidden_s, dp->tokens_per_s, dp->tokens_per_s_per_gpu);
    std::string text = line;
    if (one_gpu_tokens > 0) {
      std::snprintf(line, sizeof line, ": %.0f%% of one GPU's %.0f", 100.0 * dp->tokens_per_s_per_gpu / one_gpu_tokens,
                    one_gpu_tokens);
      text += line;
    }
    return text + "\n";
  };
  // The report's first line, also where one GPU cannot run the step.
  const std::string heading = "model " + model_name(f.model) + " (" + cfg->to_string() + "), batch " +
                              std::to_string(f.batch) + "×" + std::to_string(T) + ", accum " + std::to_string(f.accum) +
                              ", machine " + machine.name + "\n";
  // --candidates N (policy auto): the search's best N, the first of them the plan
  // reported below, from one search (make_auto_plans).
  std::vector<Plan> ranked;
  Result<Plan> plan = one_gpu;
  if (one_gpu.is_ok() && planner->policy == Policy::Auto && f.candidates > 1) {
    auto top = make_auto_plans(*program, Simulator(machine), allocatable, *planner, f.candidates);
    if (top.ok()) {
      ranked = std::move(*top);
      plan = ranked.front();
    } else {
      plan = top.status();
    }
  } else if (one_gpu.is_ok()) {
    plan = make_plan(*program, Simulator(machine), allocatable, *planner);
  }
  if (!plan.ok()) {
    Status s = plan.status();
    if (allocatable.device != budgets.device)
      s = s.with_context("--device-budget " + format_size(budgets.device) + " in whole " +
                         format_size(backend.allocation_granularity()) + " pages of the " + backend.name() +
                         " backend's allocations");
    s = s.with_context("backend " + backend.name());
    if (f.gpus == 1) return s;
    SPILLWAY_ASSIGN_OR_RETURN(std::string line, data_parallel(0));
    Prediction p;
    p.report = heading + "one GPU cannot run this step: " + s.to_string() + "\n" + line;
    return p;
  }
  const Program placed = placed_as_planned(*program, *plan);
  SimResult sim = simulate(placed, *plan, machine);
  PlanReport report = summarize(placed, *plan, sim);
  // Training runs steps back to back: the host work one leaves running overlaps the next.
  report.loop_step_s = simulate_loop_step(placed, *plan, machine);
  std::ostringstream out;
  out << heading
            << "budgets: device " << (budgets.device == UINT64_MAX ? "unlimited" : format_size(budgets.device))
            << ", host " << (budgets.host == UINT64_MAX ? "unlimited" : format_size(budgets.host)) << ", storage "
            << (budgets.storage ? format_size(budgets.storage) : "none") << "\n"
            << "backend " << backend.name() << ": workspace "
            << (plan->workspace_bytes ? format_size(plan->workspace_bytes) + " inside the device budget (most: " +
                                            workspace->op + ")"
                                      : std::string("none"))
            << (backend.name() == "cuda" ? "; not counted: what the CUDA backend holds itself (streams, library "
                                           "handles, kernel stacks), which train measures at start and takes out "
                                           "of --device-budget"
                                         : "")
            << "\n"
            << (tiled ? "the embedding and LM head run in vocab tiles of " + std::to_string(kVocabBlock) +
                                       " rows (the untiled ops do not fit half of the budget less the workspace)\n"
                                 : "")
            << "\n"
            << format_report(report);
  const double tokens = static_cast<double>(f.batch) * T * f.accum;
  Prediction p;
  p.step_s = report.loop_step_s;
  p.tokens_per_s = p.step_s > 0 ? tokens / p.step_s : 0;
  p.compute_s = sim.compute_s;
  p.exposed_s = sim.stall_s + sim.initial_wait_s;
  p.host_optimizer_s = sim.host_compute_s;
  for (const SimEvent& e : sim.timeline) {
    const double d = e.end_s - e.start_s;
    if (e.resource == SimResource::H2D) p.h2d_s += d;
    else if (e.resource == SimResource::D2H) p.d2h_s += d;
    else if (e.resource == SimResource::StorageRead || e.resource == SimResource::StorageWrite) p.storage_s += d;
  }
  double most = -1;
  for (auto [busy, name] : {std::pair{p.compute_s, "compute"}, std::pair{p.host_optimizer_s, "host optimizer"},
                            std::pair{p.h2d_s, "h2d"}, std::pair{p.d2h_s, "d2h"}, std::pair{p.storage_s, "storage"}})
    if (busy > most) most = busy, p.binds = name;
  p.binds_share = p.step_s > 0 ? most / p.step_s : 0;
  out << "predicted throughput: " << static_cast<int64_t>(p.tokens_per_s) << " tokens/s";
  if (!plan->speculation.empty()) {
    // The step above has clipping inactive. Where it clips, the updates are redone at
    // their places (those not started when the scale is known are dropped), and the
    // next step does not speculate: the plan without them.
    const double clipped_s = simulate_loop_step(placed, *plan, machine, StepOutcome::Clipped);
    const double after_s = simulate_loop_step(placed, without_speculation(*plan), machine);
    out << " (" << plan->speculation.size() << " host AdamW ops speculated; in steps where clipping is active: "
        << static_cast<int64_t>(clipped_s > 0 ? tokens / clipped_s : 0) << " tokens/s, the step after one: "
        << static_cast<int64_t>(after_s > 0 ? tokens / after_s : 0) << " tokens/s)";
  }
  out << "\n";
  char line[512];
  std::snprintf(line, sizeof line,
                "where the time goes: compute %.3f s, exposed copies %.3f s, host optimizer %.3f s, links h2d %.3f s "
                "d2h %.3f s, storage %.3f s; binds: %s (busy %.0f%% of the step%s)\n",
                p.compute_s, p.exposed_s, p.host_optimizer_s, p.h2d_s, p.d2h_s, p.storage_s, p.binds.c_str(),
                100.0 * p.binds_share,
                p.binds_share < 0.6 ? "; none is busy most of the step: the rest is waiting between them" : "");
  out << line;
  if (ranked.size() > 1) {
    // The ranking's figure is the simulator's step alone (the loop's overlap of one
    // step's host tail with the next is left out), as auto ranks.
    out << "auto's best " << ranked.size() << " candidates, by the simulator's step alone (the ranking):\n";
    for (size_t k = 0; k < ranked.size(); ++k) {
      std::string what = ranked[k].description;
      const size_t cut = what.find(" (simulator: ");
      if (cut != std::string::npos) what.erase(cut, what.find(')', cut) + 1 - cut);
      if (what.rfind("auto: ", 0) == 0) what.erase(0, 6);
      char head[96];
      std::snprintf(head, sizeof head, "  %2zu  %.3f s  %8.0f tokens/s  ", k + 1, ranked[k].predicted_step_s,
                    ranked[k].predicted_step_s > 0 ? tokens / ranked[k].predicted_step_s : 0.0);
      out << head << what << "\n";
    }
  }
  if (f.gpus > 1) {
    SPILLWAY_ASSIGN_OR_RETURN(std::string dp_line, data_parallel(p.tokens_per_s));
    out << dp_line;
  }
  if (!f.trace.empty()) {
    Status s = trace_from_simulation(sim).write(f.trace);
    if (!s.is_ok()) return s;
    out << "trace of the predicted step: " << f.trace << " (open in https://ui.perfetto.dev)\n";
  }
  p.report = out.str();
  return p;
}

// predict_step, with the what-if memory sizes named when they set a budget that failed.
Result<Prediction> predict(const PlanFlags& f, const ModelConfig& model, const Machine& machine) {
  auto p = predict_step(f, model, machine);
  // Rates that a machine file or a what-if flag set beyond reason (an op's fixed cost
  // of 1e308 s, a link of 1e-300 GB/s) give no step time worth printing.
  // (0: no step of one GPU, which a data-parallel prediction reports apart.)
  if (p && !(std::isfinite(p->step_s) && p->step_s < 1e9))
  {
    char step[32];
    std::snprintf(step, sizeof step, "%.3g", p->step_s);
    return Status::invalid_argument("machine " + machine.name + ": its rates give a predicted step of " + step +
                                    " s, which is not a time (check the machine file's rates and the what-if flags)");
  }
  if (p) return p;
  Status s = p.status();
  if (!f.gpu_memory.empty() && f.device_budget.empty())
    s = s.with_context("--gpu-memory " + f.gpu_memory + " (the device budget)");
  if (!f.host_memory.empty() && f.host_budget.empty())
    s = s.with_context("--host-memory " + f.host_memory + " (the host budget)");
  return s;
}

// ---- --sweep, --chart, --largest ----

const char* const kSweepKeys[] = {"h2d-gbps",   "storage-gbps", "nvme-count", "device-budget", "host-budget",
                                  "gpu-memory", "host-memory",  "batch",      "accum"};

bool is_size_key(const std::string& key) {
  return key == "device-budget" || key == "host-budget" || key == "gpu-memory" || key == "host-memory";
}

// `f` with --KEY set to `value`; the x coordinate of the value for the chart (sizes in GiB).
Result<double> apply_sweep_value(PlanFlags& f, const std::string& key, const std::string& value) {
  const std::string flag = "--sweep " + key + "=" + value;
  if (is_size_key(key)) {
    auto bytes = parse_size(value, flag);
    if (!bytes) return bytes.status();
    if (key == "device-budget") f.device_budget = value;
    else if (key == "host-budget") f.host_budget = value;
    else if (key == "gpu-memory") f.gpu_memory = value;
    else f.host_memory = value;
    return static_cast<double>(*bytes) / static_cast<double>(1ull << 30);
  }
  double x = 0;
  size_t used = 0;
  try {
    x = std::stod(value, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != value.size() || !std::isfinite(x) || x <= 0)
    return Status::invalid_argument(flag + ": expected a number above 0");
  const bool whole = key == "nvme-count" || key == "batch" || key == "accum";
  if (whole && (x != std::floor(x) || x > 1e6)) return Status::invalid_argument(flag + ": expected a whole number");
  if (key == "h2d-gbps") f.h2d_gbps = x;
  else if (key == "storage-gbps") f.storage_gbps = x;
  else if (key == "nvme-count") f.nvme_count = static_cast<int>(x);
  else if (key == "batch") f.batch = static_cast<int>(x);
  else f.accum = static_cast<int>(x);
  return x;
}

struct SweepRow {
  std::string value;
  double x = 0;
  bool fits = false;
  Prediction p;
  std::string error;
};

std::string fmt(const char* format, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, format, v);
  return buf;
}

// Tokens/s against the swept value: axes with ticks and labels, a line through the
// points, one <circle class="point"> per value that plans.
std::string sweep_svg(const std::string& key, const std::string& title, const std::vector<SweepRow>& rows) {
  const double W = 640, H = 400, left = 80, right = 24, top = 40, bottom = 56;
  double x0 = 1e300, x1 = -1e300, y1 = 0;
  for (const SweepRow& r : rows) {
    if (!r.fits) continue;
    x0 = std::min(x0, r.x), x1 = std::max(x1, r.x), y1 = std::max(y1, r.p.tokens_per_s);
  }
  if (x0 > x1) x0 = 0, x1 = 1;
  if (x0 == x1) x0 -= 1, x1 += 1;
  if (y1 <= 0) y1 = 1;
  y1 *= 1.1;
  auto px = [&](double x) { return left + (x - x0) / (x1 - x0) * (W - left - right); };
  auto py = [&](double y) { return H - bottom - y / y1 * (H - top - bottom); };
  std::ostringstream o;
  o << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << W << "\" height=\"" << H << "\" viewBox=\"0 0 " << W
    << " " << H << "\" font-family=\"sans-serif\" font-size=\"12\">\n"
    << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
    << "<text x=\"" << W / 2 << "\" y=\"20\" text-anchor=\"middle\" font-size=\"14\">" << title << "</text>\n"
    << "<line x1=\"" << left << "\" y1=\"" << H - bottom << "\" x2=\"" << W - right << "\" y2=\"" << H - bottom
    << "\" stroke=\"black\"/>\n"
    << "<line x1=\"" << left << "\" y1=\"" << top << "\" x2=\"" << left << "\" y2=\"" << H - bottom
    << "\" stroke=\"black\"/>\n";
  for (int i = 0; i <= 4; ++i) {
    const double x = x0 + (x1 - x0) * i / 4, y = y1 * i / 4;
    o << "<line x1=\"" << px(x) << "\" y1=\"" << H - bottom << "\" x2=\"" << px(x) << "\" y2=\"" << H - bottom + 5
      << "\" stroke=\"black\"/><text x=\"" << px(x) << "\" y=\"" << H - bottom + 18 << "\" text-anchor=\"middle\">"
      << fmt("%.4g", x) << "</text>\n"
      << "<line x1=\"" << left - 5 << "\" y1=\"" << py(y) << "\" x2=\"" << left << "\" y2=\"" << py(y)
      << "\" stroke=\"black\"/><text x=\"" << left - 8 << "\" y=\"" << py(y) + 4 << "\" text-anchor=\"end\">"
      << fmt("%.0f", y) << "</text>\n";
  }
  o << "<text x=\"" << (left + W - right) / 2 << "\" y=\"" << H - 12 << "\" text-anchor=\"middle\">" << key
    << (is_size_key(key) ? " (GiB)" : key == "h2d-gbps" || key == "storage-gbps" ? " (GB/s)" : "") << "</text>\n"
    << "<text x=\"16\" y=\"" << (top + H - bottom) / 2 << "\" text-anchor=\"middle\" transform=\"rotate(-90 16 "
    << (top + H - bottom) / 2 << ")\">predicted tokens/s</text>\n";
  std::string points;
  for (const SweepRow& r : rows)
    if (r.fits) points += fmt("%.2f", px(r.x)) + "," + fmt("%.2f", py(r.p.tokens_per_s)) + " ";
  o << "<polyline fill=\"none\" stroke=\"steelblue\" stroke-width=\"2\" points=\"" << points << "\"/>\n";
  for (const SweepRow& r : rows)
    if (r.fits)
      o << "<circle class=\"point\" cx=\"" << fmt("%.2f", px(r.x)) << "\" cy=\"" << fmt("%.2f", py(r.p.tokens_per_s))
        << "\" r=\"4\" fill=\"steelblue\"><title>" << key << " " << r.value << ": " << fmt("%.0f", r.p.tokens_per_s)
        << " tokens/s</title></circle>\n";
  o << "</svg>\n";
  return o.str();
}

int run_sweep(const PlanFlags& f, const ModelConfig& cfg) {
  const size_t eq = f.sweep.find('=');
  const std::string key = f.sweep.substr(0, eq);
  bool known = false;
  for (const char* k : kSweepKeys) known = known || key == k;
  std::string keys;
  for (const char* k : kSweepKeys) keys += std::string(keys.empty() ? "" : ", ") + k;
  if (eq == std::string::npos || !known)
    return fail(Status::invalid_argument("--sweep '" + f.sweep + "': expected KEY=V1,V2,... with KEY one of " + keys));
  std::vector<std::string> values;
  std::stringstream in(f.sweep.substr(eq + 1));
  for (std::string v; std::getline(in, v, ',');)
    if (!v.empty()) values.push_back(v);
  if (values.empty()) return fail(Status::invalid_argument("--sweep " + key + "=: no values"));
  std::vector<SweepRow> rows;
  for (const std::string& v : values) {
    PlanFlags g = f;
    SweepRow row;
    row.value = v;
    auto x = apply_sweep_value(g, key, v);
    if (!x) return fail(x.status());
    row.x = *x;
    auto machine = edited_machine(g);
    if (!machine) return fail(machine.status().with_context("--sweep " + key + "=" + v));
    auto p = predict(g, cfg, *machine);
    if (p) row.fits = true, row.p = *p;
    else row.error = p.status().to_string();
    rows.push_back(row);
  }
  std::printf("model %s (%s), batch %d, accum %d, machine %s; sweep of %s\n", model_name(f.model).c_str(),
              cfg.to_string().c_str(), f.batch, f.accum, f.machine.c_str(), key.c_str());
  std::printf("%-14s %10s %10s %10s %10s %10s %10s  %s\n", key.c_str(), "step s", "tokens/s", "compute s",
              "exposed s", "host opt s", "storage s", "binds (busy)");
  for (const SweepRow& r : rows) {
    if (!r.fits) {
      std::printf("%-14s does not plan: %s\n", r.value.c_str(), r.error.c_str());
      continue;
    }
    std::printf("%-14s %10.3f %10.0f %10.3f %10.3f %10.3f %10.3f  %s %.0f%%\n", r.value.c_str(), r.p.step_s,
                r.p.tokens_per_s, r.p.compute_s, r.p.exposed_s, r.p.host_optimizer_s, r.p.storage_s, r.p.binds.c_str(),
                100.0 * r.p.binds_share);
  }
  if (!f.chart.empty()) {
    const std::string title = model_name(f.model) + ": predicted tokens/s against " + key;
    const std::string svg = sweep_svg(key, title, rows);
    std::ofstream out(f.chart, std::ios::binary | std::ios::trunc);
    if (!out) return fail(errno_status("--chart " + f.chart, errno));
    out << svg;
    out.close();
    if (!out) return fail(Status::io_error("--chart " + f.chart + ": write failed"));
    std::printf("chart: %s\n", f.chart.c_str());
  }
  return 0;
}

// The most layers of the model's family and width that plan within the budgets:
// grows by doubling while it plans, then bisects. Names what stops one more layer.
int run_largest(const PlanFlags& f, const Machine& machine, ModelConfig cfg) {
  auto plans = [&](int layers, std::string* why, Prediction* p) {
    ModelConfig c = cfg;
    c.layers = layers;
    if (Status v = c.validate(); !v.is_ok()) {
      *why = v.to_string();
      return false;
    }
    // Each probe plans a whole step, which near the op cap takes minutes: progress on
    // stderr, one line a probe.
    const auto t0 = std::chrono::steady_clock::now();
    std::fprintf(stderr, "--largest: planning %d layers...", layers);
    std::fflush(stderr);
    auto r = predict(f, c, machine);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::fprintf(stderr, " %s (%.1f s)\n", r ? "plans" : "does not plan", s);
    if (!r) {
      *why = r.status().to_string();
      return false;
    }
    *p = *r;
    return true;
  };
  std::string why;
  Prediction best;
  int lo = 0, hi = 0;  // lo plans (0: none known), hi does not (0: none known)
  Prediction probe;
  if (plans(cfg.layers, &why, &probe)) {
    lo = cfg.layers, best = probe;
    for (int l = std::max(2, cfg.layers * 2);; l = l > kMaxModelDim / 2 ? kMaxModelDim : l * 2) {
      if (!plans(l, &why, &probe)) {
        hi = l;
        break;
      }
      lo = l, best = probe;
      if (l >= kMaxModelDim) break;
    }
  } else {
    hi = cfg.layers;
  }
  std::string stop = why;
  while (hi > 0 && hi - lo > 1) {
    const int mid = lo + (hi - lo) / 2;
    if (plans(mid, &why, &probe)) lo = mid, best = probe;
    else hi = mid, stop = why;
  }
  if (hi > 0 && hi - lo == 1 && lo > 0) plans(hi, &stop, &probe);  // the reason at exactly one more layer
  if (lo == 0)
    return fail(Status::invalid_argument("--largest: not even one layer of width " + std::to_string(cfg.width) +
                                         " plans within the budgets: " + stop));
  ModelConfig c = cfg;
  c.layers = lo;
  std::printf("largest model that fits: %d layers (%s, %.3g B parameters); predicted %.0f tokens/s, step %.3f s, "
              "binds: %s\n",
              lo, c.to_string().c_str(), static_cast<double>(c.num_parameters()) / 1e9, best.tokens_per_s, best.step_s,
              best.binds.c_str());
  if (hi > 0) std::printf("%d layers do not plan: %s\n", hi, stop.c_str());
  else std::printf("(stopped at the most layers a model may have, %d)\n", static_cast<int>(kMaxModelDim));
  return 0;
}

int run_plan(const PlanFlags& f) {
  auto cfg = resolve_model(f.model);
  if (!cfg.ok()) return fail(cfg.status());
  if (f.gpus < 1 || f.gpus > 1000)
    return fail(Status::invalid_argument("--gpus: expected 1 to 1000 GPUs, got " + std::to_string(f.gpus)));
  if (f.gpus > 1 && !(f.network_gbps > 0 && std::isfinite(f.network_gbps)))
    return fail(Status::invalid_argument(
        "--gpus " + std::to_string(f.gpus) + " needs --network-gbps above 0" +
        (f.network_gbps != 0 ? " (got " + std::to_string(f.network_gbps) + ")" : std::string()) +
        ": each GPU's link to the others in GB/s one way (e.g. 450 for NVLink 4, 50 for 400 Gb/s InfiniBand); nothing "
        "is assumed"));
  if (f.network_gbps < 0 || f.network_latency_us < 0 || !std::isfinite(f.network_latency_us))
    return fail(Status::invalid_argument("--network-gbps and --network-latency-us: expected 0 or more"));
  if (f.zero_stage != 2 && f.zero_stage != 3)
    return fail(Status::invalid_argument("--zero-stage: expected 2 (optimizer state and gradients partitioned over "
                                         "the GPUs) or 3 (the parameters too), got " +
                                         std::to_string(f.zero_stage)));
  if (f.zero_stage == 3 && f.gpus < 2)
    return fail(Status::invalid_argument("--zero-stage 3 partitions the parameters over data-parallel GPUs; give "
                                         "--gpus 2 or more"));
  if (f.candidates < 1 || f.candidates > 64)
    return fail(Status::invalid_argument("--candidates: expected 1 to 64, got " + std::to_string(f.candidates)));
  if (f.candidates > 1 && f.policy != "auto")
    return fail(Status::invalid_argument("--candidates " + std::to_string(f.candidates) +
                                         " lists policy auto's ranking; give --policy auto (it is --policy " + f.policy +
                                         ")"));
  if (f.candidates > 1 && (!f.sweep.empty() || f.largest || f.gpus > 1))
    return fail(Status::invalid_argument("--candidates with --sweep, --largest or --gpus: not supported; give one"));
  if (f.gpus > 1 && (!f.sweep.empty() || f.largest))
    return fail(Status::invalid_argument("--gpus with --sweep or --largest: not supported; give one"));
  if (!f.chart.empty() && f.sweep.empty()) return fail(Status::invalid_argument("--chart needs --sweep"));
  if (!f.sweep.empty() && f.largest) return fail(Status::invalid_argument("--sweep and --largest: give one"));
  if (!f.sweep.empty()) return run_sweep(f, *cfg);
  auto machine = edited_machine(f);
  if (!machine) return fail(machine.status());
  if (f.largest) return run_largest(f, *machine, *cfg);
  auto p = predict(f, *cfg, *machine);
  if (!p) return fail(p.status());
  std::cout << p->report;
  return 0;
}

CommandSetup setup = [](CLI::App& app) -> CommandRun {
  auto f = std::make_shared<PlanFlags>();
  f->model.model = "gpt2-124m";
  add_model_flags(app, f->model);
  app.add_option("--batch", f->batch, "sequences per micro-batch");
  app.add_option("--context", f->context, "tokens per sequence (default: the model's)")->check(positive_number());
  app.add_option("--accum", f->accum, "micro-batches per step");
  app.add_option("--machine", f->machine,
                 "h200 (the lent GPU host), cpu (this project's CI box) or a machine file from `spillway profile`");
  app.add_option("--backend", f->backend,
                 "cpu or cuda: whose dtype, alignment and op workspace to plan with (default: cuda on h200, cpu on "
                 "cpu)");
  app.add_option("--h2d-gbps", f->h2d_gbps, "what if: host⇄device GB/s each way");
  app.add_option("--storage-gbps", f->storage_gbps, "what if: storage GB/s (of one drive with --nvme-count)");
  app.add_option("--nvme-count", f->nvme_count, "what if: N drives striped (storage rates and size times N)");
  app.add_option("--gpu-memory", f->gpu_memory, "what if: device memory, e.g. 48GiB (the default device budget)");
  app.add_option("--host-memory", f->host_memory, "what if: host memory, e.g. 512GiB (the default host budget)");
  app.add_option("--sweep", f->sweep,
                 "KEY=V1,V2,...: one row per value; KEY: h2d-gbps, storage-gbps, nvme-count, device-budget, "
                 "host-budget, gpu-memory, host-memory, batch, accum");
  app.add_option("--chart", f->chart, "with --sweep: draw predicted tokens/s against the value (SVG file)");
  app.add_flag("--largest", f->largest,
               "the most layers of this model's family and width that plan within the budgets, and what stops more");
  app.add_option("--device-budget", f->device_budget, "device bytes, e.g. 24GiB (default: the machine's)");
  app.add_option("--host-budget", f->host_budget, "host bytes (default: the machine's)");
  app.add_option("--storage-budget", f->storage_budget, "storage bytes (default: none)");
  app.add_option("--policy", f->policy, "resident, paging, planned or auto");
  app.add_option("--prefetch", f->prefetch, "paging: none or learned");
  app.add_option("--order", f->order, "forward order with --accum: micro-batch, layer or auto");
  app.add_option("--device-optimizer", f->device_optimizer,
                 "planned: bytes of optimizer state kept on device when the optimizer is offloaded, auto or rule "
                 "(as train's)");
  app.add_option("--stream-optimizer", f->stream_optimizer,
                 "planned: on or off, AdamW on device for part of the host-resident state (as train's)");
  app.add_option("--speculate", f->speculate,
                 "planned: auto, on or off, host AdamW started as its gradient arrives, kept when clipping is "
                 "inactive (as train's)");
  app.add_option("--carry-updates", f->carry_updates,
                 "planned: auto, on or off, streamed updates run in the next step before their layer's forward "
                 "(as train's)");
  app.add_option("--zero-grads", f->zero_grads,
                 "planned: auto, start or late, where each gradient is zeroed: at the step's start or just before "
                 "its first backward (as train's)")
      ->capture_default_str();
  app.add_option("--trace", f->trace, "write a Perfetto trace of the predicted step");
  app.add_option("--candidates", f->candidates,
                 "policy auto: also list its N best-ranked candidates (1 to 64), each with the simulator's step and "
                 "its choices, from the one search (what train --auto-confirm N times)")
      ->capture_default_str();
  app.add_option("--gpus", f->gpus,
                 "what if: N data-parallel GPUs (1 to 1000), each with this machine's memory and links, reading "
                 "--batch x --accum sequences a step; state partitioned by whole tensors, gradients reduced in rank "
                 "order (needs --network-gbps)");
  app.add_option("--network-gbps", f->network_gbps, "with --gpus: each GPU's link to the others, GB/s one way");
  app.add_option("--network-latency-us", f->network_latency_us, "with --gpus: microseconds per collective (default 0)");
  app.add_option("--zero-stage", f->zero_stage,
                 "with --gpus: 2 (default; optimizer state and gradients partitioned, every GPU holds the "
                 "parameters) or 3 (each GPU holds only its parameters and gathers the others before each use)");
  return [f]() { return run_plan(*f); };
};
CommandRegistration plan_command("plan", "report where tensors go and the predicted step time, without training", setup);
CommandRegistration simulate_command("simulate", "what if: predict a step on a described machine (same flags as plan)", setup);

}  // namespace
}  // namespace spillway::cli
