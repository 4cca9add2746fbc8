// Flags shared by `spillway train`, `spillway sample` and `spillway bench train`:
// the model's sizes, the backend, the memory budgets and the planner policy, and
// the bundled corpus (built into the binary).
//
//   auto model = std::make_shared<ModelFlags>();
//   auto memory = std::make_shared<MemoryFlags>();
//   add_model_flags(app, *model);
//   add_memory_flags(app, *memory);
//   ... after parsing:
//   auto cfg = resolve_model(*model);                  // preset + explicit sizes
//   auto backend = open_backend(memory->backend, memory->threads);
//   auto mem = resolve_memory(*memory, **backend);     // Budgets, PlannerOptions, spill dir
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "backend/backend.h"
#include "core/status.h"
#include "model/hf_model.h"
#include "model/model.h"
#include "plan/planner.h"
#include "train/data.h"

namespace spillway::cli {

// A CLI11 check for flags whose value must be a number above 0 when given (left out,
// they mean a default; 0 is refused, not taken for "left out").
//   app.add_option("--layers", f.layers, "...")->check(positive_number());
const CLI::Validator& positive_number();

// The model: a preset (--model), sizes that override it, or, with --arch llama and no
// Llama preset, a Llama from explicit sizes, every one of them required:
//   --model llama-3.2-1b [--layers 4 ...]
//   --arch llama --layers 4 --width 256 --heads 8 --kv-heads 2 --intermediate 512
//       --model-context 256 --vocab 256 --rope-theta 500000 [--rope-scaling llama3:8:1:4:64]
//       [--norm-eps 1e-5] [--untied]
struct ModelFlags {
  std::string model = "tiny";
  bool model_given = false;  // --model was on the command line
  std::string arch;          // --arch: "", "gpt2" or "llama"
  int layers = 0, width = 0, heads = 0, model_context = 0, vocab = 0;  // 0 = the preset's
  int kv_heads = 0, intermediate = 0;                                   // Llama; 0 = the preset's
  double rope_theta = 0;       // Llama; 0 = the preset's
  std::string rope_scaling;    // Llama: "none" or "llama3:FACTOR:LOW:HIGH:ORIGINAL_CONTEXT"; "" = the preset's
  double norm_eps = 0;         // Llama RMSNorm epsilon; 0 = the preset's (explicit: 1e-5)
  bool untied = false;         // Llama: an LM head of its own
  bool explicit_sizes() const {
    return layers || width || heads || model_context || vocab || kv_heads || intermediate;
  }
};
void add_model_flags(CLI::App& app, ModelFlags& f);
// The preset named by --model (or `base`, when given) with any explicit sizes
// applied, or an explicit Llama (--arch llama), validated. Missing sizes of an
// explicit Llama are an error naming each flag; Llama flags on a GPT-2 are an error.
Result<ModelConfig> resolve_model(const ModelFlags& f, const ModelConfig* base = nullptr);
// The model saved at `path` (a .safetensors file or a Hugging Face model directory,
// model/hf_model.h). The size flags settle what the files do not say (GPT-2's heads)
// and must agree with what they do; --model (with the size flags), --arch,
// --rope-theta, --rope-scaling, --norm-eps and --untied, when given, must agree with
// the loaded model. Errors name both sides.
Result<ModelConfig> resolve_loaded_model(const ModelFlags& f, const std::string& path);
// The model's name for messages: the preset, or "llama" for an explicit --arch llama.
std::string model_name(const ModelFlags& f);
// "llama3:32:1:4:8192" or "none" into `rope` (theta untouched); errors name --rope-scaling.
Status parse_rope_scaling(const std::string& text, RopeParams& rope);
// The --rope-scaling text of `rope` ("none", or "llama3:8:1:4:8192" with every float exact).
std::string rope_scaling_text(const RopeParams& rope);

struct MemoryFlags {
  std::string backend = "auto";
  int threads = 0;
  std::string device_budget, host_budget, storage_budget, spill_dir;
  std::string policy = "planned";
  std::string prefetch = "none";
  std::string order = "auto";  // planned/auto: micro-batch, layer, or auto (planned: micro-batch)
  std::string device_optimizer = "auto";
  std::string speculate = "auto";         // --speculate auto|on|off
  std::string carry_updates = "auto";     // --carry-updates auto|on|off
  std::string zero_grads = "late";        // --zero-grads auto|start|late
  std::string stream_optimizer = "on";    // --stream-optimizer on|off  // --device-optimizer: optimizer state kept on device when offloading
  int auto_confirm = 2;                   // --auto-confirm N: auto times its best N candidates (TrainerOptions)
};
void add_memory_flags(CLI::App& app, MemoryFlags& f);

struct ResolvedMemory {
  Budgets budgets;
  PlannerOptions planner;
  std::string spill_dir;
  int auto_confirm = 2;
};
// --policy, --prefetch and --order as PlannerOptions (alignment left to the caller).
// --speculate: auto (-1: where the cost model predicts it faster), on (1), off (0)
// as PlannerOptions::speculate.
Result<int> parse_speculate(const std::string& value);
// --carry-updates: auto (-1), on (1), off (0) as PlannerOptions::carry_updates.
Result<int> parse_carry_updates(const std::string& value);
// --zero-grads: auto (-1), start (0), late (1) as PlannerOptions::late_zeros.
Result<int> parse_zero_grads(const std::string& value);
Result<PlannerOptions> resolve_planner_options(const std::string& policy, const std::string& prefetch,
                                               const std::string& order);

// Defaults: device = the backend's capacity (unlimited on the CPU), host = 80% of
// MemAvailable, storage = only with --spill-dir (90% of its file system's free
// space unless --storage-budget). Errors name the flag.
Result<ResolvedMemory> resolve_memory(const MemoryFlags& f, const Backend& backend);

// Bounded work from flags, checked before any program is built (by train, bench
// train, plan and simulate):
// - the training state, num_parameters × (2·act + 12) bytes (weights in the
//   activation dtype, their gradients, fp32 master weights and two fp32 Adam
//   moments), plus the micro-batch inputs, accum·B·T·8 bytes (int32 tokens and
//   targets, persistent for the step), must fit device + host + storage budgets;
// - the step's program has at most kMaxStepOps ops (accum × the ops of a
//   micro-batch, plus the optimizer's), counted without building it.
// Errors state the bytes or ops needed, the budgets given, and name the flags.
// `cfg` has passed ModelConfig::validate().
inline constexpr int64_t kMaxStepOps = 150'000;  // gpt2-1.5b (896 ops a micro-batch) at --accum 167
Status check_step_is_bounded(const ModelConfig& cfg, const StepShape& shape, DType act, const Budgets& budgets);
// The ops of the step's program (the vocab-tiled form, the larger), from programs of
// one and two layers and micro-batches: exact, since the count is linear in each.
Result<int64_t> count_step_ops(const ModelConfig& cfg, const StepShape& shape, DType act);

// make_backend with the flag's name in the error; `device`: the CUDA device (a
// data-parallel rank's LOCAL_RANK).
Result<std::unique_ptr<Backend>> open_backend(const std::string& name, int threads, int device = 0);

// MemAvailable from /proc/meminfo, and 80% of it (the default host budget).
Result<uint64_t> available_host_memory();
Result<uint64_t> default_host_budget();

// The data of `spillway train` without --data: $SPILLWAY_DATA (a file, or a folder
// holding tinyshakespeare.txt) when set, else the copy of data/tinyshakespeare.txt
// built into the binary. `name` is set to what was loaded, for the banner.
Result<Dataset> load_default_data(int vocab, std::string* name);
// The bytes of data/tinyshakespeare.txt as built into the binary, and their SHA-256.
std::string_view bundled_corpus();
const char* bundled_corpus_sha256();

// "12.3k" style counts for messages.
std::string format_count(double n);

}  // namespace spillway::cli
