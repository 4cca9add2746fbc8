#include "cli/train_flags.h"

#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <tuple>
#include <optional>
#include <sstream>
#include <vector>

#include "core/size.h"
#include "core/thread_pool.h"
#include "memory/storage_store.h"

namespace spillway::cli {

const CLI::Validator& positive_number() {
  static const CLI::Validator v(
      [](std::string& text) -> std::string {
        char* end = nullptr;
        const double x = std::strtod(text.c_str(), &end);
        if (end == text.c_str() || *end != '\0' || !(x > 0) || !std::isfinite(x))
          return "expected a finite number above 0, got '" + text + "' (leave the flag out for its default)";
        return {};
      },
      "");
  return v;
}

// Size flags left out mean "the preset's"; given, they must be positive (0 is refused,
// not taken as "left out").
void add_model_flags(CLI::App& app, ModelFlags& f) {
  std::string presets;
  for (const std::string& name : model_preset_names()) presets += (presets.empty() ? "" : ", ") + name;
  app.add_option_function<std::string>(
      "--model",
      [&f](const std::string& v) {
        f.model = v;
        f.model_given = true;
      },
      "model preset: " + presets + " (default: " + f.model + ")");
  app.add_option("--arch", f.arch,
                 "gpt2 or llama; --arch llama without a Llama --model builds a Llama from explicit sizes (--layers "
                 "--width --heads --kv-heads --intermediate --model-context --vocab --rope-theta, all required)");
  app.add_option("--layers", f.layers, "transformer blocks (overrides the preset)")->check(positive_number());
  app.add_option("--width", f.width, "channels (overrides the preset)")->check(positive_number());
  app.add_option("--heads", f.heads, "attention heads (overrides the preset)")->check(positive_number());
  app.add_option("--model-context", f.model_context, "the model's maximum sequence length (overrides the preset)")->check(positive_number());
  app.add_option("--vocab", f.vocab, "vocabulary size (overrides the preset)")->check(positive_number());
  app.add_option("--kv-heads", f.kv_heads, "Llama: key/value heads, dividing --heads (overrides the preset)")->check(positive_number());
  app.add_option("--intermediate", f.intermediate, "Llama: SwiGLU MLP channels (overrides the preset)")->check(positive_number());
  app.add_option("--rope-theta", f.rope_theta, "Llama: rope_theta (overrides the preset)")->check(positive_number());
  app.add_option("--rope-scaling", f.rope_scaling,
                 "Llama: none, or llama3:FACTOR:LOW_FREQ_FACTOR:HIGH_FREQ_FACTOR:ORIGINAL_CONTEXT as Llama 3's "
                 "rope_scaling, e.g. llama3:32:1:4:8192 (overrides the preset)");
  app.add_option("--norm-eps", f.norm_eps, "Llama: RMSNorm epsilon (overrides the preset; explicit Llama: 1e-5)")->check(positive_number());
  app.add_flag("--untied", f.untied, "Llama: an LM head of its own instead of the embedding table (lm_head.weight)");
}

Status parse_rope_scaling(const std::string& text, RopeParams& rope) {
  if (text == "none") {
    rope.llama3 = false;
    rope.factor = rope.low_freq_factor = rope.high_freq_factor = 0;
    rope.original_context = 0;
    return Status::ok();
  }
  auto bad = [&](const std::string& why) {
    return Status::invalid_argument("--rope-scaling " + text + ": " + why +
                                    "; expected none or llama3:FACTOR:LOW_FREQ_FACTOR:HIGH_FREQ_FACTOR:"
                                    "ORIGINAL_CONTEXT, e.g. llama3:32:1:4:8192");
  };
  std::vector<std::string> parts;
  size_t start = 0;
  for (;;) {
    size_t colon = text.find(':', start);
    parts.push_back(text.substr(start, colon == std::string::npos ? std::string::npos : colon - start));
    if (colon == std::string::npos) break;
    start = colon + 1;
  }
  if (parts[0] != "llama3") return bad("the rope type is '" + parts[0] + "'");
  if (parts.size() != 5) return bad(std::to_string(parts.size() - 1) + " numbers after llama3, not 4");
  float v[3];
  for (int i = 0; i < 3; ++i) {
    char* end = nullptr;
    errno = 0;
    v[i] = std::strtof(parts[static_cast<size_t>(i) + 1].c_str(), &end);
    if (parts[static_cast<size_t>(i) + 1].empty() || *end != '\0' || errno != 0 || !(v[i] > 0) || !std::isfinite(v[i]))
      return bad("'" + parts[static_cast<size_t>(i) + 1] + "' is not a positive number");
  }
  char* end = nullptr;
  errno = 0;
  const long orig = std::strtol(parts[4].c_str(), &end, 10);
  if (parts[4].empty() || *end != '\0' || errno != 0 || orig < 1 || orig > kMaxModelDim)
    return bad("'" + parts[4] + "' is not a context length (a positive integer)");
  rope.llama3 = true;
  rope.factor = v[0];
  rope.low_freq_factor = v[1];
  rope.high_freq_factor = v[2];
  rope.original_context = static_cast<int>(orig);
  return Status::ok();
}

std::string model_name(const ModelFlags& f) {
  if (f.arch == "llama" && !f.model_given && !(model_preset(f.model).ok() && model_preset(f.model)->arch == Arch::Llama))
    return "llama";
  return f.model;
}

std::string rope_scaling_text(const RopeParams& rope) {
  if (!rope.llama3) return "none";
  char buf[128];
  std::snprintf(buf, sizeof buf, "llama3:%.9g:%.9g:%.9g:%d", rope.factor, rope.low_freq_factor, rope.high_freq_factor,
                rope.original_context);
  return buf;
}

namespace {

// --arch as an Arch, or nullopt when not given.
Result<std::optional<Arch>> parse_arch(const std::string& arch) {
  if (arch.empty()) return std::optional<Arch>();
  if (arch == "gpt2") return std::optional<Arch>(Arch::GPT2);
  if (arch == "llama") return std::optional<Arch>(Arch::Llama);
  return Status::invalid_argument("--arch: expected gpt2 or llama, got '" + arch + "'");
}

// The Llama-only flags that were given.
std::vector<std::string> llama_flags_given(const ModelFlags& f) {
  std::vector<std::string> given;
  if (f.kv_heads) given.push_back("--kv-heads");
  if (f.intermediate) given.push_back("--intermediate");
  if (f.rope_theta != 0) given.push_back("--rope-theta");
  if (!f.rope_scaling.empty()) given.push_back("--rope-scaling");
  if (f.norm_eps != 0) given.push_back("--norm-eps");
  if (f.untied) given.push_back("--untied");
  return given;
}

std::string joined(const std::vector<std::string>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + v[i];
  return s;
}

}  // namespace

Result<ModelConfig> resolve_model(const ModelFlags& f, const ModelConfig* base) {
  SPILLWAY_ASSIGN_OR_RETURN(std::optional<Arch> arch, parse_arch(f.arch));
  ModelConfig cfg;
  if (base) {
    cfg = *base;
  } else if (arch == Arch::Llama && (!f.model_given || (model_preset(f.model).ok() &&
                                                         model_preset(f.model)->arch != Arch::Llama))) {
    if (f.model_given)
      return Status::invalid_argument("--arch llama and --model " + f.model + " (a GPT-2 preset) disagree");
    // A Llama from explicit sizes: nothing is guessed.
    std::vector<std::string> missing;
    auto need = [&](bool given, const char* flag) {
      if (!given) missing.push_back(flag);
    };
    need(f.layers, "--layers");
    need(f.width, "--width");
    need(f.heads, "--heads");
    need(f.kv_heads, "--kv-heads");
    need(f.intermediate, "--intermediate");
    need(f.model_context, "--model-context");
    need(f.vocab, "--vocab");
    need(f.rope_theta != 0, "--rope-theta");
    if (!missing.empty())
      return Status::invalid_argument("--arch llama without a Llama --model preset builds the model from its sizes; "
                                      "give " + joined(missing) + " (or --model llama-tiny, llama-3.2-1b, ...)");
    cfg.arch = Arch::Llama;
    cfg.tied = true;
    cfg.norm_eps = 1e-5f;
  } else {
    auto preset = model_preset(f.model);
    if (!preset.ok()) return preset.status().with_context("--model");
    cfg = *preset;
    if (arch && *arch != cfg.arch)
      return Status::invalid_argument(std::string("--arch ") + arch_name(*arch) + " and --model " + f.model +
                                      " (a " + arch_name(cfg.arch) + " preset) disagree");
  }
  if (cfg.arch == Arch::GPT2) {
    const std::vector<std::string> llama_only = llama_flags_given(f);
    if (!llama_only.empty())
      return Status::invalid_argument(joined(llama_only) + ": for Llama models (--arch llama or a llama preset); "
                                      "the model is a GPT-2 (" + f.model + ")");
  }
  auto apply = [](int value, int& field, const char* flag) -> Status {
    if (value < 0) return Status::invalid_argument(std::string(flag) + " must be positive, got " + std::to_string(value));
    if (value > 0) field = value;
    return Status::ok();
  };
  SPILLWAY_RETURN_IF_ERROR(apply(f.layers, cfg.layers, "--layers"));
  SPILLWAY_RETURN_IF_ERROR(apply(f.width, cfg.width, "--width"));
  SPILLWAY_RETURN_IF_ERROR(apply(f.heads, cfg.heads, "--heads"));
  SPILLWAY_RETURN_IF_ERROR(apply(f.model_context, cfg.context, "--model-context"));
  SPILLWAY_RETURN_IF_ERROR(apply(f.vocab, cfg.vocab, "--vocab"));
  SPILLWAY_RETURN_IF_ERROR(apply(f.kv_heads, cfg.kv_heads, "--kv-heads"));
  SPILLWAY_RETURN_IF_ERROR(apply(f.intermediate, cfg.intermediate, "--intermediate"));
  if (f.rope_theta != 0) {
    if (!(f.rope_theta > 0) || !std::isfinite(f.rope_theta))
      return Status::invalid_argument("--rope-theta must be a positive number, got " + std::to_string(f.rope_theta));
    cfg.rope.theta = static_cast<float>(f.rope_theta);
  }
  if (!f.rope_scaling.empty()) SPILLWAY_RETURN_IF_ERROR(parse_rope_scaling(f.rope_scaling, cfg.rope));
  if (f.norm_eps != 0) {
    if (!(f.norm_eps > 0) || !std::isfinite(f.norm_eps))
      return Status::invalid_argument("--norm-eps must be a positive number, got " + std::to_string(f.norm_eps));
    cfg.norm_eps = static_cast<float>(f.norm_eps);
  }
  if (f.untied) cfg.tied = false;
  Status s = cfg.validate();
  if (!s.is_ok()) return s.with_context("model " + cfg.to_string());
  return cfg;
}

Result<ModelConfig> resolve_loaded_model(const ModelFlags& f, const std::string& path) {
  SPILLWAY_ASSIGN_OR_RETURN(std::optional<Arch> arch, parse_arch(f.arch));
  StatedModelSizes flags;
  flags.sizes = {f.layers, f.width, f.heads, f.model_context, f.vocab};
  flags.sizes.kv_heads = f.kv_heads;
  flags.sizes.intermediate = f.intermediate;
  flags.keys = {"--layers", "--width", "--heads", "--model-context", "--vocab", "--kv-heads", "--intermediate"};
  auto loaded = infer_model_config(path, flags);
  if (!loaded.ok()) return loaded.status().with_context("--load");
  const ModelConfig& cfg = *loaded;
  const std::string what = "the model in " + path + " (" + cfg.to_string() + ")";
  if (f.model_given) {  // a preset named beside --load must be the loaded model
    auto preset = model_preset(f.model);
    if (!preset.ok()) return preset.status().with_context("--model");
    ModelConfig sized = *preset;  // the size flags were compared with the files already
    for (size_t i = 0; i < kStatedSizes; ++i)
      if (stated_size(flags.sizes, i) != 0) stated_size(sized, i) = stated_size(flags.sizes, i);
    if (!(sized == cfg))
      return Status::invalid_argument("--model " + f.model + " (" + preset->to_string() + ") disagrees with " + what +
                                      "; leave --model out to train the loaded model");
  }
  if (arch && *arch != cfg.arch)
    return Status::invalid_argument(std::string("--arch ") + arch_name(*arch) + " disagrees with " + what);
  if (cfg.arch == Arch::GPT2) {
    const std::vector<std::string> llama_only = llama_flags_given(f);
    if (!llama_only.empty())
      return Status::invalid_argument(joined(llama_only) + ": for Llama models; --load " + path + " is a GPT-2");
    return cfg;
  }
  if (f.rope_theta != 0 && static_cast<float>(f.rope_theta) != cfg.rope.theta)
    return Status::invalid_argument("--rope-theta " + std::to_string(f.rope_theta) + " disagrees with " + what);
  if (!f.rope_scaling.empty()) {
    RopeParams r = cfg.rope;
    SPILLWAY_RETURN_IF_ERROR(parse_rope_scaling(f.rope_scaling, r));
    if (!(r == cfg.rope))
      return Status::invalid_argument("--rope-scaling " + f.rope_scaling + " disagrees with " + what);
  }
  if (f.norm_eps != 0 && static_cast<float>(f.norm_eps) != cfg.norm_eps)
    return Status::invalid_argument("--norm-eps " + std::to_string(f.norm_eps) + " disagrees with " + what);
  if (f.untied && cfg.tied)
    return Status::invalid_argument("--untied disagrees with " + what + ": its config ties the LM head to the embedding");
  return cfg;
}

void add_memory_flags(CLI::App& app, MemoryFlags& f) {
  app.add_option("--backend", f.backend, "cpu, cuda or auto (cuda when a GPU is present)")->capture_default_str();
  app.add_option("--threads", f.threads,
                 "host compute threads: the CPU backend's ops and the host AdamW (0 = all cores; on CUDA all but one, "
                 "which the executor issues GPU work from)");
  app.add_option("--device-budget", f.device_budget,
                 "device bytes the step may use, e.g. 512MiB (default: the device's memory; unlimited on cpu)");
  app.add_option("--host-budget", f.host_budget, "host bytes for tensors (default: 80% of available RAM)");
  app.add_option("--storage-budget", f.storage_budget,
                 "bytes of spill files (default with --spill-dir: 90% of its free space)");
  app.add_option("--spill-dir", f.spill_dir, "folder for spill files (enables the storage tier)");
  app.add_option("--policy", f.policy, "resident, paging, planned or auto")->capture_default_str();
  app.add_option("--prefetch", f.prefetch, "paging policy: none or learned")->capture_default_str();
  app.add_option("--order", f.order,
                 "forward order with --accum: micro-batch, layer (each layer for every micro-batch, so "
                 "streamed parameters cross the link once), or auto (the auto policy tries both)")
      ->capture_default_str();
  app.add_option("--stream-optimizer", f.stream_optimizer,
                 "planned/auto, when the optimizer state is offloaded: on = some AdamW runs on device with its "
                 "state fetched from host and written back, so the link and the host share the update; off")
      ->capture_default_str();
  app.add_option("--speculate", f.speculate,
                 "planned/auto, with the AdamW of some parameters on host: on = start each one as soon as its "
                 "gradient reaches host, as if clipping were inactive, into second buffers of master and moments "
                 "(host memory), kept when the clip scale is 1 and redone otherwise (the same bits either way); off; "
                 "auto = where the machine model predicts the step faster with them")
      ->capture_default_str();
  app.add_option("--carry-updates", f.carry_updates,
                 "planned/auto, with AdamW streamed through the device: on = stream the last parameters' state "
                 "and run their updates in the next step, each just before its layer's forward (the step as a "
                 "loop; the same bits); off; auto = where the machine model predicts the step faster")
      ->capture_default_str();
  app.add_option("--zero-grads", f.zero_grads,
                 "planned/auto: where each gradient is zeroed; start = all at the step's start; late = just before "
                 "its first backward (a gradient kept off the device then gets its region there, with no round "
                 "trip of zeros over the link; the default, measured faster for gpt-2.7b and gpt-4b); auto = whichever "
                 "the machine model predicts faster (the same bits either way)")
      ->capture_default_str();
  app.add_option("--device-optimizer", f.device_optimizer,
                 "planned/auto, when the optimizer state is offloaded: bytes of it kept on device for the "
                 "first parameters (their AdamW runs there), e.g. 4GiB; auto = the fastest the simulator predicts "
                 "among the rule's share and larger ones (whose activations live on recomputation); rule = what "
                 "leaves half the device budget free, divided by --accum; 0 = all on host (and nothing streamed)")
      ->capture_default_str();
  app.add_option("--auto-confirm", f.auto_confirm,
                 "policy auto: time one step of each of the simulator's best N plans (on zeroed state, before the "
                 "run) and keep the fastest; 0 or 1 = the simulator's best, untimed")
      ->capture_default_str();
}

Result<uint64_t> available_host_memory() {
  std::ifstream in("/proc/meminfo");
  if (!in) return errno_status("open /proc/meminfo", errno);
  std::string line;
  while (std::getline(in, line)) {
    unsigned long long kib = 0;
    if (std::sscanf(line.c_str(), "MemAvailable: %llu kB", &kib) == 1) return kib * 1024ull;
  }
  return Status::not_found("/proc/meminfo has no MemAvailable line; give --host-budget");
}

Result<uint64_t> default_host_budget() {
  SPILLWAY_ASSIGN_OR_RETURN(uint64_t available, available_host_memory());
  return available / 10 * 8;
}

Result<int> parse_carry_updates(const std::string& value) {
  if (value == "auto") return -1;
  if (value == "on") return 1;
  if (value == "off") return 0;
  return Status::invalid_argument("--carry-updates: expected auto, on or off, got '" + value + "'");
}

Result<int> parse_zero_grads(const std::string& value) {
  if (value == "auto") return -1;
  if (value == "start") return 0;
  if (value == "late") return 1;
  return Status::invalid_argument("--zero-grads: expected auto, start or late, got '" + value + "'");
}

Result<int> parse_speculate(const std::string& value) {
  if (value == "auto") return -1;
  if (value == "on") return 1;
  if (value == "off") return 0;
  return Status::invalid_argument("--speculate: expected auto, on or off, got '" + value + "'");
}

Result<PlannerOptions> resolve_planner_options(const std::string& policy, const std::string& prefetch,
                                               const std::string& order) {
  PlannerOptions o;
  SPILLWAY_ASSIGN_OR_RETURN(o.policy, parse_policy(policy));  // its message names --policy
  if (order == "layer") o.layer_major = 1;
  else if (order == "micro-batch") o.layer_major = 0;
  else if (order != "auto")
    return Status::invalid_argument("--order: expected micro-batch, layer or auto, got '" + order + "'");
  if (prefetch == "learned") o.learned_prefetch = true;
  else if (prefetch != "none")
    return Status::invalid_argument("--prefetch: expected none or learned, got '" + prefetch + "'");
  return o;
}

Result<ResolvedMemory> resolve_memory(const MemoryFlags& f, const Backend& backend) {
  ResolvedMemory r;
  SPILLWAY_ASSIGN_OR_RETURN(r.planner, resolve_planner_options(f.policy, f.prefetch, f.order));
  r.planner.alignment = backend.alignment();
  if (f.stream_optimizer == "off") r.planner.stream_optimizer = 0;
  else if (f.stream_optimizer != "on")
    return Status::invalid_argument("--stream-optimizer: expected on or off, got '" + f.stream_optimizer + "'");
  SPILLWAY_ASSIGN_OR_RETURN(r.planner.speculate, parse_speculate(f.speculate));
  SPILLWAY_ASSIGN_OR_RETURN(r.planner.carry_updates, parse_carry_updates(f.carry_updates));
  SPILLWAY_ASSIGN_OR_RETURN(r.planner.late_zeros, parse_zero_grads(f.zero_grads));
  // Flags of one policy given with another would be ignored: refused by name instead.
  const bool offloading = f.policy == "planned" || f.policy == "auto";
  if (f.prefetch != "none" && f.policy != "paging")
    return Status::invalid_argument("--prefetch " + f.prefetch + " applies to --policy paging; this run's is " +
                                    f.policy);
  for (const auto& [flag, value, unset] :
       {std::tuple<const char*, const std::string&, const char*>{"--device-optimizer", f.device_optimizer, "auto"},
        {"--speculate", f.speculate, "auto"},
        {"--carry-updates", f.carry_updates, "auto"},
        {"--stream-optimizer", f.stream_optimizer, "on"}})
    if (!offloading && value != unset)
      return Status::invalid_argument(std::string(flag) + " " + value + " applies to --policy planned or auto; this run's is " +
                                      f.policy);
  if (f.auto_confirm != 2 && f.policy != "auto")
    return Status::invalid_argument("--auto-confirm " + std::to_string(f.auto_confirm) +
                                    " applies to --policy auto (the candidates it times); this run's is " + f.policy);
  if (f.auto_confirm < 0 || f.auto_confirm > 8)
    return Status::invalid_argument("--auto-confirm: expected 0 to 8 candidates to time, got " +
                                    std::to_string(f.auto_confirm));
  r.auto_confirm = f.auto_confirm;
  if (f.device_optimizer == "rule") {
    r.planner.optimizer_share_search = 0;  // the half-budget rule's share, no search
  } else if (f.device_optimizer != "auto") {
    SPILLWAY_ASSIGN_OR_RETURN(uint64_t bytes, parse_size(f.device_optimizer, "--device-optimizer"));
    r.planner.device_optimizer_bytes = static_cast<int64_t>(bytes);
  }

  if (!f.device_budget.empty()) {
    SPILLWAY_ASSIGN_OR_RETURN(r.budgets.device, parse_budget(f.device_budget, "--device-budget"));
  } else {
    const size_t capacity = backend.device_capacity();
    r.budgets.device = capacity == SIZE_MAX ? UINT64_MAX : capacity;
  }
  if (!f.host_budget.empty()) {
    SPILLWAY_ASSIGN_OR_RETURN(r.budgets.host, parse_budget(f.host_budget, "--host-budget"));
  } else {
    SPILLWAY_ASSIGN_OR_RETURN(r.budgets.host, default_host_budget());
  }
  if (!f.storage_budget.empty() && f.spill_dir.empty())
    return Status::invalid_argument("--storage-budget needs --spill-dir (the folder for the spill files)");
  if (!f.spill_dir.empty()) {
    struct stat st {};
    if (::stat(f.spill_dir.c_str(), &st) != 0)
      return errno_status("--spill-dir " + f.spill_dir, errno);
    if (!S_ISDIR(st.st_mode)) return Status::invalid_argument("--spill-dir " + f.spill_dir + " is not a folder");
    r.spill_dir = f.spill_dir;
    if (!f.storage_budget.empty()) {
      SPILLWAY_ASSIGN_OR_RETURN(r.budgets.storage, parse_budget(f.storage_budget, "--storage-budget"));
    } else {
      struct statvfs vfs {};
      if (::statvfs(f.spill_dir.c_str(), &vfs) != 0) return errno_status("statvfs --spill-dir " + f.spill_dir, errno);
      const uint64_t free_bytes = static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize;
      r.budgets.storage = free_bytes / 10 * 9;
      if (r.budgets.storage == 0)
        return Status::no_space("--spill-dir " + f.spill_dir + " has no free space for spill files" +
                                leftovers_note(f.spill_dir));
    }
  }
  return r;
}

Result<int64_t> count_step_ops(const ModelConfig& cfg, const StepShape& shape, DType act) {
  int64_t ops[2][2];  // [layers - 1][accum - 1]
  for (int l = 1; l <= 2; ++l)
    for (int a = 1; a <= 2; ++a) {
      ModelConfig small = cfg;
      small.layers = l;
      StepShape s = shape;
      s.accum = a;
      s.tile_vocab = true;
      SPILLWAY_ASSIGN_OR_RETURN(Program p, build_training_program(small, s, act));
      ops[l - 1][a - 1] = static_cast<int64_t>(p.ops.size());
    }
  // ops(L, A) = c + L·l + A·m + L·A·k, fitted exactly by the four corners.
  using Wide = __int128;
  const Wide L = cfg.layers - 1, A = shape.accum - 1;
  const Wide per_layer = ops[1][0] - ops[0][0], per_micro_batch = ops[0][1] - ops[0][0];
  const Wide per_both = ops[1][1] - ops[1][0] - ops[0][1] + ops[0][0];
  const Wide total = ops[0][0] + L * per_layer + A * per_micro_batch + L * A * per_both;
  return total > INT64_MAX ? INT64_MAX : static_cast<int64_t>(total);
}

Status check_step_is_bounded(const ModelConfig& cfg, const StepShape& shape, DType act, const Budgets& budgets) {
  using Wide = unsigned __int128;
  auto size_text = [](Wide bytes) {
    return bytes > UINT64_MAX ? std::string("more than 16 EiB") : format_size(static_cast<uint64_t>(bytes));
  };
  auto budget_text = [](uint64_t bytes) { return bytes == UINT64_MAX ? std::string("unlimited") : format_size(bytes); };
  const std::string step = "--accum " + std::to_string(shape.accum) + " × --batch " + std::to_string(shape.B) +
                           " × --context " + std::to_string(shape.T);

  const Wide params = static_cast<Wide>(cfg.num_parameters());
  const Wide per_param = 2 * static_cast<Wide>(dtype_size(act)) + 12;
  const Wide state = params * per_param;
  const Wide inputs = static_cast<Wide>(shape.accum) * static_cast<Wide>(shape.B) * static_cast<Wide>(shape.T) * 8;
  const bool unlimited = budgets.device == UINT64_MAX || budgets.host == UINT64_MAX;
  const Wide total = static_cast<Wide>(budgets.device) + budgets.host + budgets.storage;
  if (!unlimited && state + inputs > total)
    return Status::out_of_memory(
        "the step cannot fit the budgets: the training state of " + cfg.to_string() + " needs " + size_text(state) +
        " (" + std::to_string(cfg.num_parameters()) + " parameters × " + std::to_string(static_cast<int>(per_param)) +
        " bytes: weights and gradients in " + dtype_name(act) + ", fp32 master weights and two fp32 Adam moments)" +
        " and the micro-batch inputs " + size_text(inputs) + " (" + step + " × 8 bytes of tokens and targets), " +
        size_text(state + inputs) + " in all, but --device-budget " + budget_text(budgets.device) +
        " + --host-budget " + budget_text(budgets.host) + " + --storage-budget " +
        (budgets.storage ? format_size(budgets.storage) : std::string("none (no --spill-dir)")) + " hold " +
        size_text(total) + "; raise the budgets, or make the model (--model, --layers, --width, --vocab) or the step (" +
        "--accum, --batch, --context) smaller");

  SPILLWAY_ASSIGN_OR_RETURN(int64_t ops, count_step_ops(cfg, shape, act));
  if (ops > kMaxStepOps)
    return Status::invalid_argument("the step's program would have " + std::to_string(ops) + " ops (" +
                                    std::to_string(cfg.layers) + " layers (--layers) × --accum " +
                                    std::to_string(shape.accum) + " micro-batches, and the optimizer's), more than " +
                                    std::to_string(kMaxStepOps) + " that spillway builds; use fewer --layers or a "
                                    "smaller --accum (a larger --batch gives the same tokens per step with fewer ops)");
  return Status::ok();
}

Result<std::unique_ptr<Backend>> open_backend(const std::string& name, int threads, int device) {
  SPILLWAY_RETURN_IF_ERROR(check_thread_count(threads, "--threads"));
  auto b = make_backend(name, {.threads = threads, .device = device});
  if (!b.ok()) return b.status().with_context("--backend " + name + (device ? " (device " + std::to_string(device) + ")" : ""));
  // The host AdamW runs on the process-wide pool: --threads, or with 0 every core
  // (on CUDA less the one the executor's thread issues GPU work from).
  SPILLWAY_RETURN_IF_ERROR(start_global_thread_pool(host_compute_threads(threads, (*b)->name() == "cuda"))
                               .with_context("--threads " + std::to_string(threads)));
  return b;
}

namespace {

bool is_dir(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

}  // namespace

Result<Dataset> load_default_data(int vocab, std::string* name) {
  const std::string file = "tinyshakespeare.txt";
  if (const char* env = std::getenv("SPILLWAY_DATA"); env && *env) {
    std::string e = env;
    *name = is_dir(e) ? e + "/" + file : e;
    auto d = load_dataset(*name, vocab);
    if (!d.ok()) return d.status().with_context("SPILLWAY_DATA=" + e);
    return d;
  }
  *name = "bundled " + file + " (built into the binary)";
  return load_dataset_from_memory(bundled_corpus(), "bundled " + file, vocab);
}

std::string format_count(double n) {
  char buf[32];
  if (n >= 1e9) std::snprintf(buf, sizeof buf, "%.2fG", n / 1e9);
  else if (n >= 1e6) std::snprintf(buf, sizeof buf, "%.2fM", n / 1e6);
  else if (n >= 1e4) std::snprintf(buf, sizeof buf, "%.1fk", n / 1e3);
  else std::snprintf(buf, sizeof buf, "%.0f", n);
  return buf;
}

}  // namespace spillway::cli
