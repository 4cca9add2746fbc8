// safetensors files, and GPT-2 checkpoints in them with Hugging Face names.
//
//   auto cfg = infer_gpt_config("gpt2/model.safetensors");    // shapes + config.json + __metadata__
//   auto weights = import_gpt2("gpt2/model.safetensors", *cfg); // our names, [out,in], F32
//   const std::vector<float>& wte = weights->at("transformer.wte.weight");   // [V*C]
//   SPILLWAY_RETURN_IF_ERROR(export_gpt2("out.safetensors", *cfg, *weights));
//
//   auto f = SafetensorsReader::open("any.safetensors");      // low level
//   for (const SafetensorsEntry& e : f->entries()) { auto v = f->read_f32(e); ... }
//
// Format: 8-byte little-endian header length n; n bytes of JSON
//   {"__metadata__": {"k": "v", ...}, "name": {"dtype": "F32", "shape": [..],
//    "data_offsets": [begin, end]}, ...}
// then the data buffer; offsets are relative to the buffer's start, row-major,
// little-endian. The header is padded with spaces to a multiple of 8 bytes.
//
// GPT-2 import accepts names with or without the "transformer." prefix, ignores the
// buffers h.{i}.attn.bias / h.{i}.attn.masked_bias and a tied lm_head.weight, takes
// F32, F16 or BF16 (converted to F32) and transposes the Conv1D weights (c_attn,
// attn.c_proj, c_fc, mlp.c_proj), stored [in,out] by Hugging Face, to our [out,in].
// Export writes F32 with "transformer."-prefixed names, Conv1D weights as [in,out],
// and __metadata__ {"format": "pt", "n_layer", "n_embd", "n_head", "n_ctx",
// "vocab_size"}, so transformers' GPT2LMHeadModel and safetensors.torch load it.
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

namespace spillway {

struct SafetensorsEntry {
  std::string name;
  std::string dtype;           // "F32", "F16", "BF16", "I64", ...
  std::vector<int64_t> shape;  // as stored
  uint64_t begin = 0;          // byte offsets into the data buffer, [begin, end)
  uint64_t end = 0;
  int64_t numel() const;
};

class SafetensorsReader {
 public:
  // Reads and checks the header: length within the file, valid JSON, every entry
  // with dtype, shape and data_offsets inside the data buffer and of the size its
  // dtype and shape imply.
  static Result<SafetensorsReader> open(const std::string& path);

  const std::string& path() const { return path_; }
  const std::vector<SafetensorsEntry>& entries() const { return entries_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const SafetensorsEntry* find(std::string_view name) const;  // nullptr when absent
  // The entry's values as F32 (from F32, F16 or BF16), in stored order.
  Result<std::vector<float>> read_f32(const SafetensorsEntry& e) const;

 private:
  std::string path_;
  uint64_t data_start_ = 0;  // file offset of the data buffer
  std::vector<SafetensorsEntry> entries_;
  std::map<std::string, std::string> metadata_;
};

// One tensor to write, F32.
struct SafetensorsTensor {
  std::string name;
  std::vector<int64_t> shape;
  // Produces the values (numel of shape) when the writer reaches this tensor, so
  // that a large model need not be in memory at once.
  std::function<Result<std::vector<float>>()> values;
};

// Writes an F32 safetensors file: to PATH.tmp-<pid>-<random> (core/atomic_file.h),
// fsynced, renamed over PATH, and PATH's folder fsynced. On an error, or a signal
// that ends the process, PATH is left as it was and the temporary file removed.
Status write_safetensors(const std::string& path, const std::vector<SafetensorsTensor>& tensors,
                         const std::map<std::string, std::string>& metadata = {});

// Parameters by our name (ParamSpec::name), F32, our [out,in] layout.
using GPTWeights = std::map<std::string, std::vector<float>>;

// Sizes of a GPT-2 that one source states, 0 where it says nothing, with each size's
// name in that source and the source itself, for messages.
struct StatedModelSizes {
  ModelConfig sizes;                  // 0 = not stated
  std::array<std::string, 5> keys;  // names of layers, width, heads, context, vocab in the source
  std::string source;               // "gpt2/config.json"; empty for command-line flags
  // "n_head 4 (gpt2/config.json)", "--heads 4": field i in ModelConfig order.
  std::string describe(size_t field) const;
};

// The config.json beside a weights file: "gpt2/model.safetensors" → "gpt2/config.json".
std::string hf_config_path(const std::string& weights_path);

// A Hugging Face GPT-2 config.json: n_layer, n_embd, n_head, n_positions (or, without
// it, n_ctx) and vocab_size, each a positive integer up to 2^24 where present. NotFound
// when there is no such file; an error naming the file and key when it is not JSON,
// a key has the wrong type or range, or model_type is not "gpt2". At most 16 MiB.
Result<StatedModelSizes> read_hf_gpt2_config(const std::string& path);

// The GPT-2 in `file`, nothing guessed. Layers, width, context and vocab come from the
// weights' shapes (h.{i} blocks, wte [V,C], wpe [context,C]); heads from config.json
// beside the file, its __metadata__ n_head, or `flags` (--heads). Every size a source
// states must agree with the weights and with the other sources; a disagreement names
// both values and where each came from. Heads stated nowhere: an error asking for
// --heads. Before anything depends on the layer count, with work bounded by the
// number of tensors: the blocks are exactly h.0 … h.{L-1}, each with its 12
// parameters, and the file has the bytes for them; then every tensor's shape and dtype
// are checked against the result (as import_gpt2 does).
Result<ModelConfig> infer_gpt_config(const SafetensorsReader& file, const StatedModelSizes& flags = {});
Result<ModelConfig> infer_gpt_config(const std::string& path, const StatedModelSizes& flags = {});

struct ImportOptions {
  // Load NaN and ±Inf as they are (--allow-nonfinite-weights). By default the first
  // non-finite value is an error naming the tensor and the element.
  bool allow_nonfinite = false;
};

// Reads every parameter of `cfg`, handing each to `sink` as soon as it is read (and
// checked to be finite). Errors name the file and list every missing tensor, or the
// tensor whose shape or dtype is wrong (expected vs got), or the first non-finite
// element; unknown tensors are an error too.
Status import_gpt2(const std::string& path, const ModelConfig& cfg,
                   const std::function<Status(const ParamSpec&, std::vector<float>&&)>& sink,
                   const ImportOptions& options = {});
Result<GPTWeights> import_gpt2(const std::string& path, const ModelConfig& cfg, const ImportOptions& options = {});

// Writes every parameter of `cfg`, asking `source` for each in ParamSpec order.
Status export_gpt2(const std::string& path, const ModelConfig& cfg,
                   const std::function<Result<std::vector<float>>(const ParamSpec&)>& source);
Status export_gpt2(const std::string& path, const ModelConfig& cfg, const GPTWeights& weights);

}  // namespace spillway
