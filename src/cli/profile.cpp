// `spillway profile`: measures this machine for the planner and the simulator and
// writes it as a machine file (sim/machine.h), by default into the cache that
// `spillway train` and `bench train` read on CUDA (cli/machine_flag.h). The measuring
// is measure_machine (cli/profile.h), which train and bench train also run, briefly,
// when that cache has no machine for this host yet.
//
//   spillway profile --backend cuda --spill-dir /nvme/spill [--out machine.json] [--quick]
//
// Each measurement runs a bounded amount of work (a few seconds on the H200; --quick:
// tiny sizes for tests) through the code the executor uses: the backend's copy
// engine from its pinned host memory, the StorageEngine with O_DIRECT, the host AdamW
// over the global thread pool, the backend's matmul and elementwise ops
// (sim/profiler.h, shared with `bench io` and `bench adam`), and every op of a sample
// training step timed in the step (Executor::profile_next_step), at several shapes, for
// each kind's own fitted cost (Machine::op_fits):
//
//   spillway profile --backend cpu --spill-dir /tmp --op-sample gpt2-124m:2x256 --op-sample tiny:8x128:4
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "cli/command.h"
#include "cli/machine_flag.h"
#include "cli/profile.h"
#include "cli/train_flags.h"
#include "core/atomic_file.h"
#include "core/clock.h"
#include "core/interrupt.h"
#include "core/size.h"
#include "core/thread_pool.h"
#include "core/random.h"
#include "model/model.h"
#include "program/op_registry.h"
#include "plan/plan.h"
#include "sim/profiler.h"
#include "sim/simulator.h"
#include "train/trainer.h"

namespace spillway::cli {
namespace {

struct ProfileFlags {
  std::string backend = "auto";
  int threads = 0;
  std::string spill_dir;
  std::string out;
  bool quick = false;
  // The sample steps whose ops are timed for the per-kind fits, "MODEL:BxT[:L]" each:
  // L layers of a model preset (default 1: its ops have the shapes of every layer), B
  // sequences of T tokens. Empty: the backend's default (see op_samples).
  std::vector<std::string> op_samples;
  // The offloaded step that calibrates copy_share_while_computing, "MODEL:BxT[:L]", and
  // its device budget. Empty: the backend's default (the CPU's; none on CUDA).
  std::string offload_sample;
  std::string offload_budget;
};

// "gpt2-124m:1x128" → {gpt2-124m, 1, 128, 1 layer}; "tiny:4x128:4" → 4 layers.
Result<OpSample> parse_op_sample(const std::string& text, const std::string& flag) {
  const auto bad = [&text, &flag]() {
    return Status::invalid_argument(flag + " '" + text +
                                    "': expected MODEL:BxT or MODEL:BxT:L, a model preset, the sample step's sequences "
                                    "and tokens per sequence, and its layers (default 1): gpt2-124m:1x128, tiny:4x128:4");
  };
  const auto whole = [](const std::string& digits, int* out) {
    if (digits.empty() || digits.size() > 6) return false;
    for (char c : digits)
      if (c < '0' || c > '9') return false;
    *out = std::stoi(digits);
    return *out > 0;
  };
  const size_t colon = text.find(':');
  if (colon == std::string::npos || colon == 0) return bad();
  OpSample s;
  s.model = text.substr(0, colon);
  std::string shape = text.substr(colon + 1);
  if (const size_t second = shape.find(':'); second != std::string::npos) {
    if (!whole(shape.substr(second + 1), &s.layers)) return bad();
    shape = shape.substr(0, second);
  }
  const size_t x = shape.find('x');
  if (x == std::string::npos) return bad();
  if (!whole(shape.substr(0, x), &s.B) || !whole(shape.substr(x + 1), &s.T)) return bad();
  return s;
}

// The sample `text` of `flag`, parsed and checked against its preset.
Result<OpSample> checked_sample(const std::string& text, const std::string& flag) {
  SPILLWAY_ASSIGN_OR_RETURN(OpSample s, parse_op_sample(text, flag));
  auto cfg = model_preset(s.model);
  if (!cfg) return cfg.status().with_context(flag + " " + text);
  if (s.T > cfg->context)
    return Status::invalid_argument(flag + " " + text + ": " + std::to_string(s.T) + " tokens is longer than " + s.model +
                                    "'s context " + std::to_string(cfg->context));
  if (s.layers > cfg->layers)
    return Status::invalid_argument(flag + " " + text + ": " + std::to_string(s.layers) + " layers, " + s.model +
                                    " has " + std::to_string(cfg->layers));
  return s;
}

// The --op-sample steps, checked against their presets; empty without the flag (the
// backend's default, default_op_samples).
Result<std::vector<OpSample>> op_samples(const ProfileFlags& f) {
  std::vector<OpSample> samples;
  for (const std::string& text : f.op_samples) {
    SPILLWAY_ASSIGN_OR_RETURN(OpSample s, checked_sample(text, "--op-sample"));
    samples.push_back(s);
  }
  return samples;
}

// --offload-sample and --offload-budget (both or neither), checked; none without them
// (the backend's default, default_offload_sample).
Result<std::optional<OffloadSample>> offload_sample(const ProfileFlags& f) {
  if (f.offload_sample.empty() != f.offload_budget.empty())
    return Status::invalid_argument("--offload-sample and --offload-budget go together (the step and its device budget)");
  if (f.offload_sample.empty()) return std::optional<OffloadSample>();
  OffloadSample o;
  SPILLWAY_ASSIGN_OR_RETURN(o.sample, checked_sample(f.offload_sample, "--offload-sample"));
  auto budget = parse_size(f.offload_budget);
  if (!budget) return budget.status().with_context("--offload-budget");
  if (*budget == 0) return Status::invalid_argument("--offload-budget: expected a size above 0, got " + f.offload_budget);
  o.budget = *budget;
  return std::optional<OffloadSample>(o);
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

// What one sample step's ops took.
struct SampleTimes {
  std::vector<OpTiming> ops;  // each device op's median over the profiled steps
  double ops_s = 0;           // their sum
  double step_s = 0;          // the median unprofiled step (started to finished), ops and all
};

// A trainer for `steps` steps of the sample (its layers of the preset, initialized
// parameters) under `policy` and a device budget (0: none), and a step's random tokens.
struct SampleRun {
  std::unique_ptr<Trainer> trainer;
  int vocab = 0;
  size_t tokens = 0;  // per step
  uint64_t rng = 1;
  std::vector<TokenBatch> batch = std::vector<TokenBatch>(1);
  // A step of fresh random tokens, finished (drained) when it returns.
  Result<StepResult> step() {
    TokenBatch& b = batch[0];
    b.tokens.resize(tokens);
    b.targets.resize(tokens);
    for (size_t i = 0; i < tokens; ++i) {
      b.tokens[i] = static_cast<int32_t>(splitmix64_next(rng) % static_cast<uint64_t>(vocab));
      b.targets[i] = static_cast<int32_t>(splitmix64_next(rng) % static_cast<uint64_t>(vocab));
    }
    SPILLWAY_ASSIGN_OR_RETURN(StepResult r, trainer->step(batch));
    SPILLWAY_RETURN_IF_ERROR(trainer->drain());
    return r;
  }
};
Result<SampleRun> sample_run(Backend& backend, const OpSample& sample, int steps, const Machine& m, Policy policy,
                             uint64_t device_budget) {
  SPILLWAY_ASSIGN_OR_RETURN(ModelConfig cfg, model_preset(sample.model));
  cfg.layers = sample.layers;
  TrainerOptions o;
  o.model = cfg;
  o.shape = {.B = sample.B, .T = sample.T, .accum = 1};
  o.schedule = {.peak = 1e-4f, .warmup_steps = 0, .total_steps = steps};
  o.planner.policy = policy;
  o.planner.speculate = 0;  // every step the same, whether or not it clips
  if (device_budget > 0) o.budgets.device = device_budget;
  o.machine = m;
  SampleRun run;
  SPILLWAY_ASSIGN_OR_RETURN(run.trainer, Trainer::create(backend, o));
  SPILLWAY_RETURN_IF_ERROR(run.trainer->init_parameters());
  run.vocab = cfg.vocab;
  run.tokens = static_cast<size_t>(sample.B) * sample.T;
  return run;
}

// Runs training steps of the sample (its layers, resident, initialized parameters,
// random tokens) as `spillway train` runs them, times every op of `rounds` more steps
// (Executor::profile_next_step: each op synchronized before and after, in the step's
// order, so it finds its operands where the step leaves them, not warm from a repeat
// of itself), keeps each op's median over the rounds (a typical step: the fastest
// would be optimistic, a mean would follow another process's bursts on a shared
// machine), then times `rounds` whole steps without the profile.
Result<SampleTimes> time_sample_ops(Backend& backend, const OpSample& sample, int rounds, const Machine& m) {
  SPILLWAY_ASSIGN_OR_RETURN(SampleRun run, sample_run(backend, sample, 2 + 2 * rounds, m, Policy::Resident, 0));
  const Program& program = run.trainer->program();
  std::vector<std::vector<double>> rounds_of(program.ops.size());  // [ops][rounds]
  std::vector<double> steps;                                       // unprofiled steps' seconds
  for (int s = 1; s <= 2 + 2 * rounds; ++s) {
    StepProfile profile;
    const bool timed = s > 2 && s <= 2 + rounds;  // two warm-up steps: first touches, the optimizer's first update
    if (timed) run.trainer->profile_next_step(&profile);
    const auto t0 = std::chrono::steady_clock::now();
    SPILLWAY_ASSIGN_OR_RETURN(StepResult r, run.step());
    if (s > 2 + rounds) steps.push_back(seconds_since(t0));
    if (!r.applied)
      return Status::internal("the sample step skipped its update (non-finite gradient norm): AdamW not timed");
    for (const OpTime& t : profile.ops)
      if (t.op >= 0 && static_cast<size_t>(t.op) < rounds_of.size() && !t.recompute)
        rounds_of[static_cast<size_t>(t.op)].push_back(t.seconds);
  }
  std::vector<double> seconds(program.ops.size(), 0.0);
  for (size_t i = 0; i < seconds.size(); ++i) seconds[i] = median(rounds_of[i]);
  SampleTimes out;
  out.ops = op_timings(program, seconds);
  for (const OpTiming& t : out.ops) out.ops_s += t.seconds;
  out.step_s = median(steps);
  return out;
}

// Copies and compute at once, calibrated on a real offloaded step: trains `sample`
// under `budget` (planned, no speculation) as `spillway train` does, and sets
// copy_share_while_computing to the value at which the simulator gives back its
// median step (bisection over [0.05, 1]; the simulator's step grows as copies slow).
// On the CPU backend the copy threads, the host optimizer and compute share two cores
// and one memory bus in ways one probe does not show (a step's copies ran at a third
// of their speed alone, the probe's at four fifths); this one number then carries
// what the simulator does not model of that sharing, which the note printed says.
Status calibrate_copy_share(Backend& backend, const OpSample& sample, uint64_t budget, int rounds, Machine* m,
                            std::FILE* out) {
  SPILLWAY_ASSIGN_OR_RETURN(SampleRun run, sample_run(backend, sample, 2 + rounds, *m, Policy::Planned, budget));
  Trainer* trainer = run.trainer.get();
  std::vector<double> steps;
  for (int s = 1; s <= 2 + rounds; ++s) {
    const auto t0 = std::chrono::steady_clock::now();
    SPILLWAY_RETURN_IF_ERROR(run.step().status());
    if (s > 2) steps.push_back(seconds_since(t0));
  }
  const double measured = median(steps);
  const Program placed = placed_as_planned(trainer->program(), trainer->plan());
  Machine probe = *m;
  auto predicted = [&](double share) {
    probe.copy_share_while_computing = share;
    return simulate(placed, trainer->plan(), probe).step_s;
  };
  const double probed = m->copy_share_while_computing;
  const double at_probe = predicted(probed);
  double lo = 0.05, hi = 1.0;  // predicted(lo) ≥ measured ≥ predicted(hi) once bracketed
  double share = 0;
  if (predicted(hi) >= measured) share = hi;
  else if (predicted(lo) <= measured) share = lo;
  else {
    for (int i = 0; i < 30; ++i) {
      const double mid = (lo + hi) / 2;
      (predicted(mid) >= measured ? lo : hi) = mid;
    }
    share = (lo + hi) / 2;
  }
  m->copy_share_while_computing = share;
  probe.copy_share_while_computing = share;
  const SimResult kept = simulate(placed, trainer->plan(), probe);
  std::fprintf(
      out,
      "\noffloaded step %s under %s (planned, %s host->device and %s device->host a step): %.1f ms measured "
      "(median of %d), %.1f ms predicted with the probe's copy speed while computing %.3f; kept %.3f, which "
      "predicts %.1f ms (it also carries what the simulator leaves out of cores shared by copies, host ops and "
      "compute)\n",
      sample.text().c_str(), format_size(budget).c_str(), format_size(kept.h2d_bytes).c_str(),
      format_size(kept.d2h_bytes).c_str(), measured * 1e3, rounds, at_probe * 1e3, probed, share, kept.step_s * 1e3);
  return Status::ok();
}

// Times the ops of every sample, fits each kind's cost over all of them together
// (fit_op_kinds), and prints the fits with how well they give back each sample's ops
// and its whole step (the step also holds the executor's own work between ops, which
// the fits leave out: within a few percent on the CPU, and noisy as the difference
// of two close times).
Status measure_op_fits(Backend& backend, const std::vector<OpSample>& samples, int rounds, Machine* m,
                       std::FILE* out) {
  std::vector<OpTiming> all;
  std::vector<SampleTimes> times;
  for (const OpSample& sample : samples) {
    auto t = time_sample_ops(backend, sample, rounds, *m);
    if (!t) return t.status().with_context("profile: the ops of " + sample.text() + " (--op-sample)");
    if (m->host_runs_ahead) {
      // The fits cost ops as a step runs them, without the waits of timing each alone.
      if (const double each = take_off_synchronization(&t->ops, t->step_s); each > 0) {
        t->ops_s = 0;
        for (const OpTiming& op : t->ops) t->ops_s += op.seconds;
        std::fprintf(out, "%s: %.2f us of synchronization per op timed alone (its ops summed beyond its step), "
                          "taken off each before fitting: the host runs ahead of this device in a step\n",
                     sample.text().c_str(), each * 1e6);
      }
    }
    all.insert(all.end(), t->ops.begin(), t->ops.end());
    times.push_back(std::move(*t));
  }
  m->op_fits = fit_op_kinds(all, m->op_launch_s);
  std::fprintf(out,
               "\nops of each sample step, each op timed in the step (median of %d steps after 2), "
               "a cost fitted per kind over all samples (kept; the simulator costs each op at fixed + work / rate + "
               "bytes / bytes rate, plus %.2f us per op):\n",
               rounds, m->op_launch_s * 1e6);
  std::fprintf(out, "  %-22s %5s %10s %10s %12s %12s %8s\n", "kind", "ops", "ms", "fixed us", "rate", "bytes GB/s",
               "error");
  for (size_t k = 0; k < kOpKindCount; ++k) {
    const OpKind kind = static_cast<OpKind>(k);
    int count = 0;
    double timed = 0, fitted = 0;
    const OpFit& fit = m->op_fits[k];
    for (const OpTiming& t : all) {
      if (t.kind != kind) continue;
      ++count;
      timed += t.seconds;
      fitted += m->op_launch_s + fit.seconds(t.work, t.bytes);
    }
    if (count == 0) continue;
    const bool flops = op_info(kind).flops != nullptr;
    char rate[32] = "-", bytes[32] = "-";
    if (fit.rate > 0) std::snprintf(rate, sizeof rate, "%.2f %s", fit.rate / (flops ? 1e12 : 1e9), flops ? "TFLOP/s" : "GB/s");
    if (fit.bytes_per_s > 0) std::snprintf(bytes, sizeof bytes, "%.2f", fit.bytes_per_s / 1e9);
    std::fprintf(out, "  %-22s %5d %10.3f %10.2f %12s %12s %+7.1f%%%s\n", op_kind_name(kind), count, timed * 1e3,
                 fit.fixed_s * 1e6, rate, bytes, fit.measured() ? (fitted / timed - 1) * 100 : 0.0,
                 fit.measured() ? "" : " (no time beyond the fixed cost)");
  }
  std::fprintf(out, "  %-22s %10s %10s %10s %8s\n", "sample step", "ops ms", "step ms", "fitted ms", "error");
  for (size_t i = 0; i < samples.size(); ++i) {
    double fitted = 0;
    for (const OpTiming& t : times[i].ops) {
      const OpFit& fit = m->op_fits[static_cast<size_t>(t.kind)];
      fitted += m->op_launch_s + fit.seconds(t.work, t.bytes);
    }
    std::fprintf(out, "  %-22s %10.3f %10.3f %10.3f %+7.1f%%\n", samples[i].text().c_str(), times[i].ops_s * 1e3,
                 times[i].step_s * 1e3, fitted * 1e3, times[i].step_s > 0 ? (fitted / times[i].step_s - 1) * 100 : 0.0);
  }
  return Status::ok();
}

Result<uint64_t> mem_total() {
  std::ifstream in("/proc/meminfo");
  if (!in) return errno_status("open /proc/meminfo", errno);
  std::string line;
  while (std::getline(in, line)) {
    unsigned long long kib = 0;
    if (std::sscanf(line.c_str(), "MemTotal: %llu kB", &kib) == 1) return kib * 1024ull;
  }
  return Status::not_found("/proc/meminfo has no MemTotal line");
}

std::string utc_now() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

}  // namespace

// The default samples: layer and LM-head shapes of the models this backend trains, at
// several token counts, so that each kind's fit sees how its time grows with the rows
// and with the width, and on the CPU whole steps too, whose ops find their data out of
// the caches as a training step does (a one-layer step runs its AdamW a third faster
// per byte than gpt2-124m's twelve). CPU: GPT-2 small and tiny at 128 to 2048 tokens
// (brief: tiny only); CUDA: one layer of GPT-2 1.5B and 124M at 8192 and 16384 tokens
// (brief too: they take seconds on a GPU).
std::vector<OpSample> default_op_samples(bool cuda, const ProfileSettings& s) {
  if (s.quick) return {{"tiny", 2, 64, 1}, {"tiny", 1, 32, 2}};
  if (cuda) return {{"gpt2-1.5b", 8, 1024, 1}, {"gpt2-124m", 16, 1024, 1}};
  if (s.brief) return {{"tiny", 4, 128, 4}, {"tiny", 16, 128, 1}};
  return {{"gpt2-124m", 1, 128, 1}, {"gpt2-124m", 1, 256, 12}, {"gpt2-124m", 1, 512, 1},
          {"tiny", 4, 128, 4}, {"tiny", 16, 128, 1}};
}

// The offloaded step that calibrates the copy speed while computing, and its budget.
// CPU: all 12 layers of gpt2-124m at 1x256 under 400 MiB, which streams every
// parameter, gradient and optimizer state (brief: tiny at 4x128 under 8 MiB; --quick:
// tiny at 2x64:2 under 4 MiB); CUDA: none, the probe stands.
OffloadSample default_offload_sample(bool cuda, const ProfileSettings& s) {
  if (s.quick) return {{"tiny", 2, 64, 2}, 4ull << 20};
  if (cuda) return {};
  if (s.brief) return {{"tiny", 4, 128, 4}, 8ull << 20};
  return {{"gpt2-124m", 1, 256, 12}, 400ull << 20};
}

Status make_dirs(const std::string& dir) {
  for (size_t at = 1; at <= dir.size(); ++at) {
    if (at != dir.size() && dir[at] != '/') continue;
    const std::string part = dir.substr(0, at);
    if (::mkdir(part.c_str(), 0755) != 0 && errno != EEXIST) return errno_status("create folder " + part, errno);
  }
  return Status::ok();
}

Result<Machine> measure_machine(Backend& backend, const ProfileSettings& settings) {
  const bool cuda = backend.name() == "cuda";
  const bool quick = settings.quick;
  const bool brief = settings.brief && !quick;
  std::FILE* out = settings.table;
  const std::vector<OpSample> samples =
      settings.samples.empty() ? default_op_samples(cuda, settings) : settings.samples;
  const OffloadSample offload = settings.offload ? *settings.offload : default_offload_sample(cuda, settings);
  // A signal that only sets the flag (InterruptMode::BetweenSteps, train) stops the
  // profile between two measurements.
  const auto stop_before = [](const std::string& what) {
    return interrupted() ? interrupted_status("while profiling this machine, before " + what + " (nothing written)") : Status::ok();
  };
  struct statvfs fs {};
  if (::statvfs(settings.spill_dir.c_str(), &fs) != 0)
    return errno_status("profile: the storage folder " + settings.spill_dir, errno);
  const HostIdentity id = host_identity(backend.description());

  Machine m;
  m.name = id.host_name + " " + backend.name();
  std::string notes = settings.notes;
  if (notes.empty())
    notes = brief ? "brief profile on first use of train or bench train (--backend " + std::string(backend.name()) +
                        ", --machine measured)"
                  : "spillway profile --backend " + std::string(backend.name()) + (quick ? " --quick" : "");
  m.measured_on = {.date = utc_now(),
                   .host = id.host_name,
                   .cpu = id.cpu(),
                   .gpu = id.gpu,
                   .driver = id.driver,
                   .notes = notes};
  m.host_runs_ahead = cuda;
  std::fprintf(out, "profile: %s; %s; driver %s%s\n", id.gpu.c_str(), id.cpu().c_str(), id.driver.c_str(),
               quick   ? " (--quick: tiny sizes, for tests)"
               : brief ? " (brief: fewer sizes and rounds; `spillway profile` measures in full)"
                       : "");

  // ---- capacities ----
  SPILLWAY_ASSIGN_OR_RETURN(const uint64_t total, mem_total());
  SPILLWAY_ASSIGN_OR_RETURN(const uint64_t available, available_host_memory());
  m.host_bytes = total;
  const size_t capacity = backend.device_capacity();
  // The CPU backend's device tier is host memory: what is available now.
  m.device_bytes = capacity != SIZE_MAX ? capacity : available;
  m.storage_bytes = static_cast<uint64_t>(fs.f_blocks) * fs.f_frsize;
  const uint64_t storage_free = static_cast<uint64_t>(fs.f_bavail) * fs.f_frsize;
  std::fprintf(out, "capacity: device %s%s, host %s (%s available), storage %s (%s free at %s)\n",
               format_size(m.device_bytes).c_str(), cuda ? "" : " (the CPU backend's device is host memory available)",
               format_size(m.host_bytes).c_str(), format_size(available).c_str(), format_size(m.storage_bytes).c_str(),
               format_size(storage_free).c_str(), settings.spill_dir.c_str());

  // ---- host⇄device copies at the sizes plans move ----
  const std::vector<uint64_t> pieces = quick   ? std::vector<uint64_t>{1ull << 20, 4ull << 20}
                                       : brief ? std::vector<uint64_t>{cuda ? (64ull << 20) : (4ull << 20)}
                                               : std::vector<uint64_t>{4ull << 20, 64ull << 20, 256ull << 20};
  const uint64_t copy_total = quick ? (8ull << 20) : cuda ? (1ull << 30) : brief ? (64ull << 20) : (256ull << 20);
  std::fprintf(out,
               "\ncopies (%s, the executor's copy engine and host memory), %s per direction per round, best of 3:\n",
               backend.description().c_str(), format_size(copy_total).c_str());
  std::fprintf(out, "  %10s %10s %10s %10s %8s\n", "piece", "H2D GB/s", "D2H GB/s", "both GB/s", "duplex");
  CopyRates copies;
  for (uint64_t piece : pieces) {
    auto c = measure_copies(backend, piece, std::max(copy_total, piece), 3);
    if (!c) return c.status().with_context("profile: copies of " + format_size(piece));
    std::fprintf(out, "  %10s %10.2f %10.2f %10.2f %8.3f\n", format_size(piece).c_str(), c->h2d / 1e9, c->d2h / 1e9,
                 c->both / 1e9, c->both / (c->h2d + c->d2h));
    copies = *c;  // the largest piece's figures are kept: a layer's tensors are tens to hundreds of MiB
  }
  m.h2d_bytes_per_s = copies.h2d;
  m.d2h_bytes_per_s = copies.d2h;
  m.duplex_factor = std::clamp(copies.both / (copies.h2d + copies.d2h), 0.05, 1.0);

  // ---- storage ----
  SPILLWAY_RETURN_IF_ERROR(stop_before("storage"));
  {
    const std::string path = settings.spill_dir + "/spillway-profile-" + std::to_string(::getpid()) + ".bin";
    RemoveOnInterrupt remove_on_interrupt(path);
    const uint64_t bytes = quick ? (4ull << 20) : brief ? (cuda ? (256ull << 20) : (32ull << 20)) : (1ull << 30);
    const size_t block = size_t{1} << 20;
    const std::vector<int> depths = brief ? std::vector<int>{1, 16} : std::vector<int>{1, 4, 16, 64};
    std::fprintf(out,
                 "\nstorage at %s (the executor's engine, O_DIRECT), %s written then read per depth, %s requests:\n",
                 settings.spill_dir.c_str(), format_size(bytes).c_str(), format_size(block).c_str());
    std::fprintf(out, "  %6s %11s %11s\n", "depth", "write GB/s", "read GB/s");
    double best_write = 0, best_read = 0;
    int best_depth = depths.front();
    for (int depth : depths) {
      auto s = measure_storage("auto", depth, path, bytes, block);
      if (!s) return s.status().with_context("profile: storage at depth " + std::to_string(depth));
      std::fprintf(out, "  %6d %11.2f %11.2f%s\n", depth, s->write / 1e9, s->read / 1e9,
                   s->direct ? "" : "  (buffered: the file system refused O_DIRECT; page-cache figures)");
      if (s->read + s->write > best_read + best_write) best_depth = depth;
      best_write = std::max(best_write, s->write);
      best_read = std::max(best_read, s->read);
    }
    // Spills read some tensors back while writing others: both at once, at the depth
    // that moved the most.
    auto duplex = measure_storage_duplex("auto", best_depth, path, bytes, block,
                                         StorageRates{.write = best_write, .read = best_read});
    if (!duplex) return duplex.status().with_context("profile: storage reads and writes at once");
    m.storage_duplex_factor = *duplex;
    std::fprintf(out, "  reads and writes at once (depth %d): each at %.2f of its speed alone\n", best_depth, *duplex);
    auto latency = measure_storage_latency("auto", path, quick ? 16 : brief ? 128 : 512);
    if (!latency) return latency.status().with_context("profile: storage latency");
    std::fprintf(out, "  latency at depth 1: %.1f us per 4 KiB read\n", *latency * 1e6);
    m.storage_write_bytes_per_s = best_write;
    m.storage_read_bytes_per_s = best_read;
    m.storage_latency_s = *latency;
  }

  // ---- host AdamW, alone and beside copies ----
  // (beside device compute: with the device's compute below)
  const size_t adam_params = quick ? (size_t{1} << 20) : cuda ? (size_t{64} << 20) : (size_t{16} << 20);
  SPILLWAY_RETURN_IF_ERROR(stop_before("the host AdamW"));
  {
    const DType dtype = backend.activation_dtype();
    const size_t n = adam_params;
    const int iters = quick || brief ? 2 : 5;
    auto alone = measure_host_adam(n, dtype, iters, nullptr);
    if (!alone) return alone.status().with_context("profile: host AdamW");
    auto busy = measure_host_adam(n, dtype, iters, &backend);
    if (!busy) return busy.status().with_context("profile: host AdamW while copies run");
    std::fprintf(out,
                 "\nhost AdamW (%s, %d threads, %zu params): %.2f G params/s alone, %.2f while host⇄device copies run "
                 "(kept: plans overlap the optimizer with copies)\n",
                 dtype_name(dtype), global_thread_pool().size(), n, *alone / 1e9, *busy / 1e9);
    m.host_adam_params_per_s_alone = *alone;
    m.host_adam_params_per_s = *busy;
    // Out of place (speculative updates), alone, against in place alone.
    auto into = measure_host_adam(n, dtype, iters, nullptr, /*out_of_place=*/true);
    if (!into) return into.status().with_context("profile: host AdamW out of place");
    m.host_adam_out_of_place_share = std::clamp(*into / *alone, 0.05, 1.0);
    std::fprintf(out, "host AdamW out of place (speculative updates): %.2f G params/s alone, %.3f of in place (kept)\n",
                 *into / 1e9, m.host_adam_out_of_place_share);
    // And the other way: the copies' speed while the optimizer runs, at the piece
    // size whose rates were kept above.
    auto share = measure_copy_share_beside_host_adam(backend, n, dtype, pieces.back(),
                                                     std::max(copy_total, pieces.back()));
    if (!share) return share.status().with_context("profile: copies while the host AdamW runs");
    m.copy_share_while_host_computes = share->both;
    std::fprintf(out,
                 "copies while the host AdamW runs, over their speed alone: both ways at once %.3f (kept); "
                 "host→device alone %.3f, device→host alone %.3f\n",
                 share->both, share->h2d, share->d2h);
  }

  // ---- device compute ----
  SPILLWAY_RETURN_IF_ERROR(stop_before("the device's compute"));
  {
    struct Shape {
      int N, C, OC;
    };
    // The CPU's: in and beyond its caches. CUDA: 8192³ (the compute-while-copying
    // probe), then the layer products of 1.5B-4B models at 8192 tokens (qkv, MLP up,
    // MLP down): what steps run; brief: three of them.
    std::vector<Shape> shapes = {{512, 512, 512}, {1024, 768, 768}};
    if (quick) shapes = {{128, 128, 128}, {256, 128, 64}};
    else if (cuda && brief) shapes = {{8192, 8192, 8192}, {8192, 1600, 4800}, {8192, 2560, 10240}, {8192, 10240, 2560}};
    else if (cuda)
      shapes = {{8192, 8192, 8192}, {8192, 1600, 4800},  {8192, 1600, 6400}, {8192, 6400, 1600},
                {8192, 2560, 10240}, {8192, 10240, 2560}, {8192, 3072, 9216}};
    const int repeats = quick ? 2 : cuda ? (brief ? 10 : 20) : 3;
    std::fprintf(out, "\ndevice (%s):\n", backend.description().c_str());
    double flops = 0, seconds = 0;
    for (const Shape& s : shapes) {
      auto rate = measure_matmul(backend, s.N, s.C, s.OC, repeats);
      if (!rate)
        return rate.status().with_context("profile: matmul " + std::to_string(s.N) + "x" + std::to_string(s.C) + "x" +
                                          std::to_string(s.OC));
      const double work = 2.0 * s.N * s.C * static_cast<double>(s.OC);
      flops += work;
      seconds += work / *rate;
      std::fprintf(out, "  matmul %dx%dx%d: %.2f TFLOP/s\n", s.N, s.C, s.OC, *rate / 1e12);
    }
    m.matmul_flops_per_s = flops / seconds;
    std::fprintf(out, "  matmul, all shapes together: %.2f TFLOP/s (kept)\n", m.matmul_flops_per_s / 1e12);
    // Causal attention forward + backward: head sizes 64 and 128 (GPT-2, Llama) at the
    // sequence lengths plans use.
    struct AttentionShape {
      int B, T, NH, D;
    };
    const std::vector<AttentionShape> attention = quick ? std::vector<AttentionShape>{{1, 64, 2, 16}}
                                                  : cuda ? std::vector<AttentionShape>{{8, 1024, 16, 64},
                                                                                       {8, 1024, 8, 128}}
                                                         : std::vector<AttentionShape>{{2, 256, 4, 32}};
    double attention_flops = 0, attention_seconds = 0;
    for (const AttentionShape& a : attention) {
      auto rate = measure_attention(backend, a.B, a.T, a.NH, a.D, repeats);
      if (!rate)
        return rate.status().with_context("profile: attention B=" + std::to_string(a.B) + " T=" + std::to_string(a.T) +
                                          " NH=" + std::to_string(a.NH) + " D=" + std::to_string(a.D));
      const double work = 7.0 * a.B * static_cast<double>(a.T) * a.T * a.NH * a.D;
      attention_flops += work;
      attention_seconds += work / *rate;
      std::fprintf(out, "  attention fwd+bwd B=%d T=%d %dx%d: %.2f TFLOP/s\n", a.B, a.T, a.NH, a.D, *rate / 1e12);
    }
    m.attention_flops_per_s = attention_flops / attention_seconds;
    std::fprintf(out, "  attention, all shapes together: %.2f TFLOP/s (kept)\n", m.attention_flops_per_s / 1e12);
    // Beyond the caches (brief on the CPU: three arrays of 32 MiB; allocating and
    // touching four times that takes a second there).
    const size_t n = quick ? (size_t{256} << 10) : (size_t{128} << 20) / (cuda ? 1 : brief ? 16 : 4);
    auto bytes = measure_memory_bound(backend, n, quick ? 2 : brief ? 3 : 5);
    if (!bytes) return bytes.status().with_context("profile: memory-bound op");
    m.device_bytes_per_s = *bytes;
    auto launch = measure_op_launch(backend, quick ? 50 : 1000);
    if (!launch) return launch.status().with_context("profile: op launch");
    m.op_launch_s = *launch;
    const Shape& big = shapes.front();
    auto shared = measure_shared_speeds(backend, big.N, repeats, m.h2d_bytes_per_s);
    if (!shared) return shared.status().with_context("profile: compute and copies at once");
    m.compute_share_while_copying = shared->compute_while_copying;
    m.copy_share_while_computing = shared->copy_while_computing;
    std::fprintf(out,
                 "  memory-bound op (residual add): %.1f GB/s; fixed cost per op %.2f us; compute speed while "
                 "copying %.3f of alone, copy speed while computing %.3f of alone\n",
                 *bytes / 1e9, *launch * 1e6, shared->compute_while_copying, shared->copy_while_computing);
    // And beside the host AdamW (on the CPU backend they share the cores; on a GPU
    // the compute loses what its issuing thread does).
    auto side = measure_compute_beside_host_adam(backend, adam_params, backend.activation_dtype(), big.N, repeats);
    if (!side) return side.status().with_context("profile: compute and the host AdamW at once");
    m.compute_share_while_host_computes = side->compute_while_host;
    m.host_share_while_computing = side->host_while_computing;
    std::fprintf(out, "  compute speed while the host AdamW runs %.3f of alone, the host AdamW's while computing %.3f\n",
                 side->compute_while_host, side->host_while_computing);
  }

  SPILLWAY_RETURN_IF_ERROR(stop_before("the ops of the sample steps"));
  SPILLWAY_RETURN_IF_ERROR(measure_op_fits(backend, samples, quick ? 1 : brief ? (cuda ? 3 : 1) : 5, &m, out));
  if (offload.budget > 0) {
    SPILLWAY_RETURN_IF_ERROR(stop_before("the offloaded step"));
    Status s = calibrate_copy_share(backend, offload.sample, offload.budget, quick ? 1 : 3, &m, out);
    if (!s.is_ok())
      return s.with_context("profile: the offloaded step " + offload.sample.text() + " under " +
                            format_size(offload.budget) + " (--offload-sample, --offload-budget)");
  }
  return m;
}

namespace {

int run_profile(const ProfileFlags& f) {
  const auto started = std::chrono::steady_clock::now();
  if (f.spill_dir.empty())
    return fail(Status::invalid_argument(
        "--spill-dir: needed; the folder whose storage plans spill to (a test file is written there and removed)"));
  struct statvfs fs {};
  if (::statvfs(f.spill_dir.c_str(), &fs) != 0) return fail(errno_status("--spill-dir " + f.spill_dir, errno));
  auto backend_made = open_backend(f.backend, f.threads);
  if (!backend_made) return fail(backend_made.status());
  Backend& backend = **backend_made;
  ProfileSettings settings;
  settings.quick = f.quick;
  settings.spill_dir = f.spill_dir;
  auto samples = op_samples(f);  // checked before anything is measured
  if (!samples) return fail(samples.status());
  settings.samples = std::move(*samples);
  auto offload = offload_sample(f);
  if (!offload) return fail(offload.status());
  settings.offload = *offload;
  std::string out = f.out;
  if (out.empty()) {
    auto path = machine_cache_path(host_identity(backend.description()));
    if (!path) return fail(path.status());
    out = *path;
    if (Status s = make_dirs(parent_directory(out)); !s.is_ok()) return fail(s.with_context("--out (default)"));
  }
  // A signal ends the profile at once, removing the storage test file.
  if (Status s = install_interrupt_handlers(InterruptMode::AtOnce); !s.is_ok()) return fail(s);

  auto m = measure_machine(backend, settings);
  if (!m) return fail(m.status());
  if (Status s = save_machine(*m, out); !s.is_ok()) return fail(s.with_context("--out"));
  std::printf("\nmachine written to %s (%.1f s)%s\n", out.c_str(), seconds_since(started),
              f.out.empty() ? "; train and bench train on CUDA use it from this cache" : "");
  return 0;
}

CommandRegistration profile_command(
    "profile", "measure this machine (copies, storage, host AdamW, device) into a machine file", [](CLI::App& app) {
      auto f = std::make_shared<ProfileFlags>();
      app.add_option("--backend", f->backend, "cpu, cuda or auto")->capture_default_str();
      app.add_option("--threads", f->threads, "host threads (0: all cores)")->capture_default_str();
      app.add_option("--spill-dir", f->spill_dir, "folder whose storage is measured (a test file, removed after)");
      app.add_option("--out", f->out,
                     "machine file to write (default: the cache train reads, "
                     "$XDG_CACHE_HOME/spillway/machine-<key>.json or ~/.cache/spillway/...)");
      app.add_flag("--quick", f->quick, "tiny sizes (tests): figures are far from the machine's steady state");
      app.add_option("--op-sample", f->op_samples,
                     "MODEL:BxT[:L], a sample step whose ops are timed for each kind's cost (L layers of the preset, "
                     "default 1; B sequences of T tokens); repeat it for several (default on the CPU: "
                     "gpt2-124m:1x128, gpt2-124m:1x256:12, gpt2-124m:1x512, tiny:4x128:4, tiny:16x128; on CUDA: "
                     "gpt2-1.5b:8x1024, gpt2-124m:16x1024)");
      app.add_option("--offload-sample", f->offload_sample,
                     "MODEL:BxT[:L], an offloaded step that calibrates the copy speed while computing (default on the "
                     "CPU: gpt2-124m:1x256:12; none on CUDA)");
      app.add_option("--offload-budget", f->offload_budget, "its device budget (default on the CPU: 400MiB)");
      return [f]() { return run_profile(*f); };
    });

}  // namespace
}  // namespace spillway::cli
