// `spillway plan`: where every class of tensor goes for a model under budgets, the
// peaks of each tier, the bytes each link moves per step and the predicted step
// time — without training. `spillway simulate` is the same command, named for its
// what-if use: describe a machine that does not exist (--machine, --h2d-gbps,
// --storage-gbps, budgets) and ask how a model would train there. Plans are made for
// the backend --backend names (default: the machine's), with the device workspace
// that backend's ops need reserved inside the device budget, as `spillway train` does;
// no device is needed (backend_sizes.h).
#include <fstream>
#include <iostream>
#include <memory>
#include <tuple>

#include "backend/backend_sizes.h"
#include "cli/command.h"
#include "cli/train_flags.h"
#include "core/size.h"
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
  std::string trace;
  double h2d_gbps = 0, storage_gbps = 0;
};

int run_plan(const PlanFlags& f) {
  auto cfg = resolve_model(f.model);
  if (!cfg.ok()) return fail(cfg.status());
  int T = f.context ? f.context : cfg->context;
  if (T > cfg->context)
    return fail(Status::invalid_argument("--context " + std::to_string(T) + " is longer than the model's context " +
                                         std::to_string(cfg->context)));
  Machine machine;
  if (f.machine == "h200") machine = Machine::h200();
  else if (f.machine == "cpu") machine = Machine::cpu_dev_box();
  else return fail(Status::invalid_argument("--machine: unknown machine '" + f.machine + "'; expected h200 or cpu"));
  if (f.h2d_gbps > 0) machine.h2d_bytes_per_s = machine.d2h_bytes_per_s = f.h2d_gbps * 1e9;
  if (f.storage_gbps > 0) machine.storage_read_bytes_per_s = machine.storage_write_bytes_per_s = f.storage_gbps * 1e9;
  const std::string backend_name = !f.backend.empty() ? f.backend : f.machine == "cpu" ? "cpu" : "cuda";
  auto sizes = backend_sizes(backend_name);
  if (!sizes.ok()) return fail(sizes.status().with_context("--backend"));
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
    if (!b.ok()) return fail(b.status());
    *budget = *b;
  }
  if (f.batch < 1 || f.accum < 1)
    return fail(Status::invalid_argument("--batch and --accum must be at least 1, got " + std::to_string(f.batch) +
                                         " and " + std::to_string(f.accum)));
  if (Status s = check_step_is_bounded(*cfg, {.B = f.batch, .T = T, .accum = f.accum}, act, budgets); !s.is_ok())
    return fail(s);
  auto options = resolve_planner_options(f.policy, f.prefetch, f.order);
  if (!options.ok()) return fail(options.status());
  // As `spillway train` plans (plan_for_backend), except for what a backend holds
  // itself, which only a running one can measure.
  const Budgets allocatable = allocatable_budgets(budgets, backend, 0);
  bool tiled = false;
  auto program = build_for_budget(
      [&](bool tile_vocab) {
        return build_training_program(*cfg, {.B = f.batch, .T = T, .accum = f.accum, .tile_vocab = tile_vocab}, act);
      },
      backend, allocatable.device, &tiled);
  if (!program.ok()) return fail(program.status());
  auto planner = backend_planner_options(*program, backend, *options);
  if (!planner.ok()) return fail(planner.status());
  auto workspace = program_workspace(backend, *program);
  if (!workspace.ok()) return fail(workspace.status());
  // The GPU's mapping of the pinned host arena, reserved as train reserves it.
  planner->reserved_device_bytes = host_mapping_reserve(*program, backend, budgets);
  auto plan = make_plan(*program, machine, allocatable, *planner);
  if (!plan.ok()) {
    Status s = plan.status();
    if (allocatable.device != budgets.device)
      s = s.with_context("--device-budget " + format_size(budgets.device) + " in whole " +
                         format_size(backend.allocation_granularity()) + " pages of the " + backend.name() +
                         " backend's allocations");
    return fail(s.with_context("backend " + backend.name()));
  }
  Program placed = *program;
  for (size_t i = 0; i < placed.ops.size(); ++i) placed.ops[i].place = plan->op_place[i];
  SimResult sim = simulate(placed, *plan, machine);
  PlanReport report = summarize(placed, *plan, sim);
  std::cout << "model " << model_name(f.model) << " (" << cfg->to_string() << "), batch " << f.batch << "×" << T << ", accum "
            << f.accum << ", machine " << machine.name << "\n"
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
  std::cout << "predicted throughput: " << static_cast<int64_t>(tokens / sim.step_s) << " tokens/s\n";
  if (!f.trace.empty()) {
    Status s = trace_from_simulation(sim).write(f.trace);
    if (!s.is_ok()) return fail(s);
    std::cout << "trace of the predicted step: " << f.trace << " (open in https://ui.perfetto.dev)\n";
  }
  return 0;
}

CommandSetup setup = [](CLI::App& app) -> CommandRun {
  auto f = std::make_shared<PlanFlags>();
  f->model.model = "gpt2-124m";
  add_model_flags(app, f->model);
  app.add_option("--batch", f->batch, "sequences per micro-batch");
  app.add_option("--context", f->context, "tokens per sequence (default: the model's)");
  app.add_option("--accum", f->accum, "micro-batches per step");
  app.add_option("--machine", f->machine, "h200 (the lent GPU host) or cpu (this project's CI box)");
  app.add_option("--backend", f->backend,
                 "cpu or cuda: whose dtype, alignment and op workspace to plan with (default: cuda on h200, cpu on "
                 "cpu)");
  app.add_option("--h2d-gbps", f->h2d_gbps, "what if: host⇄device GB/s each way");
  app.add_option("--storage-gbps", f->storage_gbps, "what if: storage GB/s");
  app.add_option("--device-budget", f->device_budget, "device bytes, e.g. 24GiB (default: the machine's)");
  app.add_option("--host-budget", f->host_budget, "host bytes (default: the machine's)");
  app.add_option("--storage-budget", f->storage_budget, "storage bytes (default: none)");
  app.add_option("--policy", f->policy, "resident, paging, planned or auto");
  app.add_option("--prefetch", f->prefetch, "paging: none or learned");
  app.add_option("--order", f->order, "forward order with --accum: micro-batch, layer or auto");
  app.add_option("--trace", f->trace, "write a Perfetto trace of the predicted step");
  return [f]() { return run_plan(*f); };
};
CommandRegistration plan_command("plan", "report where tensors go and the predicted step time, without training", setup);
CommandRegistration simulate_command("simulate", "what if: predict a step on a described machine (same flags as plan)", setup);

}  // namespace
}  // namespace spillway::cli
