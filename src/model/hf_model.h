// Hugging Face models on disk: config.json (GPT-2 and Llama), and the weights in one
// safetensors file or in shards listed by model.safetensors.index.json, read and
// written with Hugging Face's tensor names.
//
//   auto cfg = infer_model_config("models/llama-3.2-1b");        // a directory, or a .safetensors file
//   if (!cfg) return cfg.status();
//   SPILLWAY_RETURN_IF_ERROR(import_model("models/llama-3.2-1b", *cfg,
//       [&](const ParamSpec& p, std::vector<float>&& v) { return upload(p.name, v); }));  // one tensor at a time
//   SPILLWAY_RETURN_IF_ERROR(export_model("out/llama", *cfg, source));   // config.json + model.safetensors
//   SPILLWAY_RETURN_IF_ERROR(export_model("out/w.safetensors", *cfg, source));  // one file
//
// Reading (`--load PATH`):
// - PATH a directory: config.json in it, and model.safetensors, or else
//   model.safetensors.index.json {"weight_map": {tensor: shard file}} with its shards
//   (plain file names in the directory). transformers' order: model.safetensors wins
//   when both are there. Every shard the index names must exist; each must hold
//   exactly the tensors the index maps to it. total_size in the index is not checked
//   (transformers does not read it either).
// - PATH a .safetensors file: config.json beside it when there is one.
// - config.json's model_type picks the architecture: "gpt2" (or no model_type, as
//   older GPT-2 files) or "llama"; anything else is an error naming it.
// - GPT-2: sizes from the weights' shapes, heads from config.json, the file's
//   __metadata__ n_head, or --heads (never guessed); see infer_model_config.
// - Llama: every size from config.json (hidden_size, num_hidden_layers,
//   num_attention_heads, num_key_value_heads (absent: = heads, as transformers),
//   intermediate_size, max_position_embeddings, vocab_size; rms_norm_eps (absent:
//   1e-6, LlamaConfig's default), tie_word_embeddings (absent: false, LlamaConfig's
//   default), hidden_act "silu", attention_bias/mlp_bias false, head_dim =
//   hidden_size/heads where present), or, for a single file without config.json, the
//   same JSON in its __metadata__ "config" (as export_model writes it). Rope in
//   either form: rope_parameters {rope_type "default"|"llama3", rope_theta, factor,
//   low_freq_factor, high_freq_factor, original_max_position_embeddings}, or the
//   older top-level rope_theta (absent: 10000) and rope_scaling ({rope_type or type:
//   "llama3", ...} or null); both forms present must agree. Every tensor's shape is
//   checked against the config. A tied model's lm_head.weight, if stored, must equal
//   model.embed_tokens.weight (compared in chunks when importing): transformers would
//   drop it, so a different one is an error, not silently lost. The buffers
//   model.layers.{i}.self_attn.rotary_emb.inv_freq of older checkpoints are ignored.
// - Tensors F32, F16 or BF16 (converted to F32). Every error names the file.
//
// Writing: a path ending in ".safetensors" is one F32 file (GPT-2: __metadata__
// n_layer, n_embd, n_head, n_ctx, vocab_size; Llama: __metadata__ "config" = the
// config.json text), as before, written atomically. Any other path is a model
// directory, as save_pretrained writes it: config.json (model_type, architectures,
// every size, dtype and torch_dtype "float32"; Llama: rope_parameters, and the same
// rope as top-level rope_theta and rope_scaling for older transformers) and
// model.safetensors, or above ExportOptions::shard_bytes (5 GB) shards
// model-0000k-of-0000n.safetensors, each at most that size unless one tensor is larger,
// and model.safetensors.index.json {"metadata": {"total_size"}, "weight_map"}. The
// directory appears whole: written into DIR.tmp-<pid>-<random>, every file and the
// folder fsynced, then renamed onto DIR (an existing DIR is swapped out atomically
// with renameat2(RENAME_EXCHANGE) and then removed). An existing DIR is replaced only
// when it is empty or holds nothing but what a save writes (config.json,
// model.safetensors, model.safetensors.index.json, model-*-of-*.safetensors): a
// folder with anything else (a tokenizer, a README) is refused, naming what is there.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"
#include "model/model.h"
#include "model/safetensors.h"

namespace spillway {

// Parameters by our name (ParamSpec::name), F32, our [out,in] layout.
using ModelWeights = std::map<std::string, std::vector<float>>;

// The sizes of ModelConfig that sources state, in this order.
inline constexpr size_t kStatedSizes = 7;  // layers, width, heads, context, vocab, kv_heads, intermediate

// Sizes of a model that one source states, 0 where it says nothing, with each size's
// name in that source and the source itself, for messages.
struct StatedModelSizes {
  ModelConfig sizes;                            // 0 = not stated
  std::array<std::string, kStatedSizes> keys;  // names of the sizes in the source, kStatedSizes order
  std::string source;                          // "gpt2/config.json"; empty for command-line flags
  // "n_head 4 (gpt2/config.json)", "--heads 4": field i in kStatedSizes order.
  std::string describe(size_t field) const;
};
// Size i of kStatedSizes order, and its plain name ("layers", ..., "intermediate").
int& stated_size(ModelConfig& c, size_t i);
int stated_size(const ModelConfig& c, size_t i);
const char* stated_size_name(size_t i);

// config.json for weights at `path`: inside it when it is a directory, else beside it
// ("gpt2/model.safetensors" → "gpt2/config.json").
std::string hf_config_path(const std::string& path);

// What a config.json says.
struct HfConfig {
  std::string path;           // for messages
  Arch arch = Arch::GPT2;
  StatedModelSizes stated;    // the sizes it states, under its key names
  ModelConfig config;         // Llama: complete and validated; GPT-2: = stated.sizes
};
// Reads config.json at `path` (at most 16 MiB): NotFound when there is no such file;
// an error naming the file and the key for invalid JSON, a key of the wrong type or
// range, or an unsupported model_type, hidden_act or rope_type (naming the value).
// GPT-2 keys: n_layer, n_embd, n_head, n_positions (or n_ctx), vocab_size, each
// optional. Llama: see the top of this file.
Result<HfConfig> read_hf_config(const std::string& path);
// The same from JSON text; `where` names it in messages ("config file x/config.json"),
// `source` in StatedModelSizes::source and HfConfig::path (default: `where`).
Result<HfConfig> parse_hf_config(std::string_view text, const std::string& where, const std::string& source = "");
// The config.json that export_model writes for `cfg` (pretty-printed, ends in "\n").
std::string model_config_json(const ModelConfig& cfg);

// The tensors of a model's weights: one safetensors file, or the shards an index
// lists (checked against it: a missing shard, a shard lacking a tensor the index maps
// to it, or holding one the index maps elsewhere or not at all, each named).
class WeightFiles {
 public:
  struct Tensor {
    size_t file = 0;   // index into files()
    size_t entry = 0;  // index into files()[file].entries()
  };
  static Result<WeightFiles> open(const std::string& path);

  const std::string& path() const { return path_; }  // as given: a file or a directory
  bool is_directory() const { return directory_; }
  const std::vector<SafetensorsReader>& files() const { return files_; }
  const std::vector<Tensor>& tensors() const { return tensors_; }
  const SafetensorsEntry& entry(const Tensor& t) const { return files_[t.file].entries()[t.entry]; }
  const std::string& file_of(const Tensor& t) const { return files_[t.file].path(); }
  Result<std::vector<float>> read_f32(const Tensor& t) const { return files_[t.file].read_f32(entry(t)); }
  // Bytes of tensor data in all files.
  uint64_t data_bytes() const;

 private:
  std::string path_;
  bool directory_ = false;
  std::vector<SafetensorsReader> files_;
  std::vector<Tensor> tensors_;
};

// The model at `path` (a directory or a .safetensors file, as above), nothing guessed.
// GPT-2: layers, width, context and vocab come from the weights' shapes (h.{i}
// blocks, wte [V,C], wpe [context,C]); heads from config.json, the __metadata__
// n_head of the file(s), or `flags` (--heads). Llama: all from config.json (or the
// file's __metadata__ "config"); without either, an error asking for config.json.
// Every size a source states must agree with the weights and with the other sources;
// a disagreement names both values and where each came from. Before anything depends
// on the layer count, with work bounded by the number of tensors: the blocks are all
// there; then every tensor's shape and dtype are checked (as import_model does).
Result<ModelConfig> infer_model_config(const std::string& path, const StatedModelSizes& flags = {});

struct ImportOptions {
  // Load NaN and ±Inf as they are (--allow-nonfinite-weights). By default the first
  // non-finite value is an error naming the tensor and the element.
  bool allow_nonfinite = false;
};

// Reads every parameter of `cfg`, handing each to `sink` as soon as it is read (and
// checked to be finite), in ParamSpec order, one tensor in memory at a time. Errors
// name the file and list every missing tensor, or the tensor whose shape or dtype is
// wrong (expected vs got), or the first non-finite element; unknown tensors are an
// error too.
Status import_model(const std::string& path, const ModelConfig& cfg,
                    const std::function<Status(const ParamSpec&, std::vector<float>&&)>& sink,
                    const ImportOptions& options = {});
Result<ModelWeights> import_model(const std::string& path, const ModelConfig& cfg, const ImportOptions& options = {});

struct ExportOptions {
  uint64_t shard_bytes = 5'000'000'000;  // a model directory's shard limit (transformers' "5GB")
};
// True when export_model writes `path` as a model directory (it does not end in ".safetensors").
bool is_model_directory_path(const std::string& path);
// Writes every parameter of `cfg`, asking `source` for each in ParamSpec order (one
// tensor in memory at a time), as one file or a model directory (see above).
Status export_model(const std::string& path, const ModelConfig& cfg,
                    const std::function<Result<std::vector<float>>(const ParamSpec&)>& source,
                    const ExportOptions& options = {});
Status export_model(const std::string& path, const ModelConfig& cfg, const ModelWeights& weights,
                    const ExportOptions& options = {});
// OK when export_model may write the model directory `dir`: it does not exist, or is a
// folder that is empty or holds only what a save writes; else an error naming what is there.
Status check_model_directory_replaceable(const std::string& dir);

}  // namespace spillway
