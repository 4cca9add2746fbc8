#include "model/hf_model.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <set>

#include "core/atomic_file.h"
#include "core/input_file.h"
#include "core/interrupt.h"

namespace spillway {

namespace {

constexpr uint64_t kMaxConfigBytes = 16ull << 20;  // a Hugging Face config.json is a few KiB
constexpr uint64_t kMaxIndexBytes = 64ull << 20;   // an index lists one line per tensor
constexpr std::string_view kPrefix = "transformer.";
constexpr const char* kSingleFile = "model.safetensors";
constexpr const char* kIndexFile = "model.safetensors.index.json";
constexpr const char* kConfigFile = "config.json";

std::string shape_text(const std::vector<int64_t>& s) { return Shape(s).to_string(); }

std::string list_names(const std::vector<std::string>& names, size_t max_shown = 10) {
  std::string s;
  for (size_t i = 0; i < names.size() && i < max_shown; ++i) s += (i ? ", " : "") + names[i];
  if (names.size() > max_shown) s += ", and " + std::to_string(names.size() - max_shown) + " more";
  return s;
}

bool ends_with(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

std::string strip_trailing_slashes(std::string p) {
  while (p.size() > 1 && p.back() == '/') p.pop_back();
  return p;
}

std::string join(const std::string& dir, const std::string& name) {
  return dir.empty() || dir.back() == '/' ? dir + name : dir + "/" + name;
}

bool is_directory(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

bool exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

// A whole small file (a config or an index); NotFound when it does not exist.
Result<std::string> read_text_file(const std::string& path, uint64_t limit, const std::string& what) {
  struct stat st {};
  SPILLWAY_ASSIGN_OR_RETURN(const int fd, open_regular_file(path, what, &st));
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  if (static_cast<uint64_t>(st.st_size) > limit)
    return Status::invalid_argument(what + " " + path + ": " + std::to_string(st.st_size) + " bytes, more than the " +
                                    std::to_string(limit) + "-byte limit");
  std::string text(static_cast<size_t>(st.st_size), '\0');
  size_t done = 0;
  while (done < text.size()) {
    ssize_t n = ::pread(fd, text.data() + done, text.size() - done, static_cast<off_t>(done));
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno_status("read " + path, errno);
    }
    if (n == 0) return Status::corrupt(what + " " + path + ": shorter than its size while reading");
    done += static_cast<size_t>(n);
  }
  return text;
}

// The shortest decimal that reads back as `f` (1e-6f → 1e-06, not 9.99999997e-07), as a double.
double float_decimal(float f) {
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof buf - 1, f);
  *r.ptr = '\0';
  return std::strtod(buf, nullptr);
}

std::string number_text(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

// ------------------------------------------------------------------ config.json

// Typed access to a config's keys; every error names the source and the key.
class ConfigKeys {
 public:
  ConfigKeys(const nlohmann::json& j, std::string where, std::string prefix = "")
      : j_(j), where_(std::move(where)), prefix_(std::move(prefix)) {}

  Status bad(const std::string& key, const std::string& what) const {
    return Status::invalid_argument(where_ + ": key \"" + prefix_ + key + "\" " + what);
  }
  bool has(const std::string& key) const { return j_.contains(key) && !j_[key].is_null(); }
  const nlohmann::json& at(const std::string& key) const { return j_[key]; }

  // A positive integer up to kMaxModelDim; nullopt when absent or null.
  Result<std::optional<int>> size(const std::string& key) const {
    if (!has(key)) return std::optional<int>();
    const nlohmann::json& v = j_[key];
    if (!v.is_number_integer())
      return bad(key, "is " + v.dump() + " (" + v.type_name() + "); expected a positive integer");
    if (!v.is_number_unsigned() || v.get<uint64_t>() < 1 || v.get<uint64_t>() > static_cast<uint64_t>(kMaxModelDim))
      return bad(key, "is " + v.dump() + "; expected a positive integer up to 2^24 = " + std::to_string(kMaxModelDim));
    return std::optional<int>(static_cast<int>(v.get<uint64_t>()));
  }
  Result<int> required_size(const std::string& key) const {
    SPILLWAY_ASSIGN_OR_RETURN(std::optional<int> v, size(key));
    if (!v) return Status::invalid_argument(where_ + ": no key \"" + prefix_ + key + "\"; a Llama config needs it");
    return *v;
  }
  // A finite number > 0 (an integer or a float in the JSON); nullopt when absent or null.
  Result<std::optional<double>> positive(const std::string& key) const {
    if (!has(key)) return std::optional<double>();
    const nlohmann::json& v = j_[key];
    if (!v.is_number()) return bad(key, "is " + v.dump() + " (" + v.type_name() + "); expected a positive number");
    const double d = v.get<double>();
    if (!(d > 0) || !std::isfinite(d) || d > 3.0e38) return bad(key, "is " + v.dump() + "; expected a positive number");
    return std::optional<double>(d);
  }
  Result<std::optional<bool>> boolean(const std::string& key) const {
    if (!has(key)) return std::optional<bool>();
    const nlohmann::json& v = j_[key];
    if (!v.is_boolean()) return bad(key, "is " + v.dump() + " (" + v.type_name() + "); expected true or false");
    return std::optional<bool>(v.get<bool>());
  }
  Result<std::optional<std::string>> string(const std::string& key) const {
    if (!has(key)) return std::optional<std::string>();
    const nlohmann::json& v = j_[key];
    if (!v.is_string()) return bad(key, "is " + v.dump() + " (" + v.type_name() + "); expected a string");
    return std::optional<std::string>(v.get<std::string>());
  }

 private:
  const nlohmann::json& j_;
  std::string where_;
  std::string prefix_;
};

// One rope dictionary (rope_parameters or rope_scaling).
struct RopeDict {
  std::string key;                // "rope_parameters", "rope_scaling"
  bool llama3 = false;
  std::optional<double> theta;    // its rope_theta, if it has one
  float factor = 0, low = 0, high = 0;
  int original = 0;
};

Result<RopeDict> parse_rope_dict(const nlohmann::json& j, const std::string& key, const std::string& where) {
  RopeDict d;
  d.key = key;
  if (!j.is_object())
    return Status::invalid_argument(where + ": key \"" + key + "\" is " + j.dump() + "; expected an object or null");
  ConfigKeys k(j, where, key + ".");
  SPILLWAY_ASSIGN_OR_RETURN(std::optional<std::string> rope_type, k.string("rope_type"));
  SPILLWAY_ASSIGN_OR_RETURN(std::optional<std::string> type, k.string("type"));
  if (rope_type && type && *rope_type != *type)
    return k.bad("rope_type", "is \"" + *rope_type + "\" but " + key + ".type is \"" + *type + "\"");
  const std::string t = rope_type ? *rope_type : type ? *type : "default";
  const std::string t_key = key + (rope_type || !type ? ".rope_type" : ".type");
  if (t != "default" && t != "llama3")
    return Status::unsupported(where + ": " + t_key + " is \"" + t +
                               "\"; spillway supports the rope types \"default\" and \"llama3\"");
  SPILLWAY_ASSIGN_OR_RETURN(d.theta, k.positive("rope_theta"));
  SPILLWAY_ASSIGN_OR_RETURN(std::optional<double> partial, k.positive("partial_rotary_factor"));
  if (partial && *partial != 1.0)
    return Status::unsupported(where + ": " + key + ".partial_rotary_factor is " + number_text(*partial) +
                               "; spillway rotates whole heads (1.0)");
  if (t == "llama3") {
    d.llama3 = true;
    auto need = [&](const std::string& name) -> Result<double> {
      SPILLWAY_ASSIGN_OR_RETURN(std::optional<double> v, k.positive(name));
      if (!v) return Status::invalid_argument(where + ": " + key + " of rope_type \"llama3\" has no \"" + name + "\"");
      return *v;
    };
    SPILLWAY_ASSIGN_OR_RETURN(double factor, need("factor"));
    SPILLWAY_ASSIGN_OR_RETURN(double low, need("low_freq_factor"));
    SPILLWAY_ASSIGN_OR_RETURN(double high, need("high_freq_factor"));
    d.factor = static_cast<float>(factor);
    d.low = static_cast<float>(low);
    d.high = static_cast<float>(high);
    SPILLWAY_ASSIGN_OR_RETURN(std::optional<int> original, k.size("original_max_position_embeddings"));
    if (!original)
      return Status::invalid_argument(where + ": " + key +
                                      " of rope_type \"llama3\" has no \"original_max_position_embeddings\"");
    d.original = *original;
  }
  return d;
}

std::string rope_dict_text(const RopeDict& d) {
  if (!d.llama3) return "rope_type default";
  return "rope_type llama3, factor " + number_text(d.factor) + ", low_freq_factor " + number_text(d.low) +
         ", high_freq_factor " + number_text(d.high) + ", original_max_position_embeddings " +
         std::to_string(d.original);
}

// The rope of a Llama config, from either form (both must agree where both speak).
Result<RopeParams> parse_rope(const nlohmann::json& j, const std::string& where) {
  std::vector<RopeDict> dicts;
  for (const char* key : {"rope_scaling", "rope_parameters"}) {  // transformers: rope_scaling wins
    if (!j.contains(key) || j[key].is_null()) continue;
    SPILLWAY_ASSIGN_OR_RETURN(RopeDict d, parse_rope_dict(j[key], key, where));
    dicts.push_back(d);
  }
  if (dicts.size() == 2 && rope_dict_text(dicts[0]) != rope_dict_text(dicts[1]))
    return Status::invalid_argument(where + ": rope_scaling (" + rope_dict_text(dicts[0]) + ") and rope_parameters (" +
                                    rope_dict_text(dicts[1]) + ") disagree; give one");
  ConfigKeys k(j, where);
  SPILLWAY_ASSIGN_OR_RETURN(std::optional<double> top_theta, k.positive("rope_theta"));
  std::optional<double> theta = top_theta;
  std::string theta_from = "rope_theta";
  for (const RopeDict& d : dicts) {
    if (!d.theta) continue;
    if (theta && static_cast<float>(*theta) != static_cast<float>(*d.theta))
      return Status::invalid_argument(where + ": " + d.key + ".rope_theta " + number_text(*d.theta) +
                                      " disagrees with " + theta_from + " " + number_text(*theta));
    theta = d.theta;
    theta_from = d.key + ".rope_theta";
  }
  RopeParams r;
  r.theta = static_cast<float>(theta.value_or(10000.0));  // transformers' default_theta
  if (!dicts.empty() && dicts[0].llama3) {
    r.llama3 = true;
    r.factor = dicts[0].factor;
    r.low_freq_factor = dicts[0].low;
    r.high_freq_factor = dicts[0].high;
    r.original_context = dicts[0].original;
  }
  return r;
}

const std::array<const char*, kStatedSizes> kSizeNames = {"layers", "width",    "heads",       "context",
                                                          "vocab",  "kv_heads", "intermediate"};
const std::array<std::string, kStatedSizes> kLlamaKeys = {
    "num_hidden_layers", "hidden_size",         "num_attention_heads", "max_position_embeddings",
    "vocab_size",        "num_key_value_heads", "intermediate_size"};

Result<HfConfig> parse_gpt2_config(const nlohmann::json& j, const std::string& where, const std::string& source) {
  HfConfig c;
  c.path = source;
  c.arch = Arch::GPT2;
  StatedModelSizes& s = c.stated;
  s.source = source;
  // n_positions is the rows of wpe; n_ctx, its older name, counts only without it.
  s.keys = {"n_layer", "n_embd", "n_head", j.contains("n_positions") ? "n_positions" : "n_ctx", "vocab_size", "", ""};
  ConfigKeys k(j, where);
  for (size_t i = 0; i < 5; ++i) {
    if (!j.contains(s.keys[i])) continue;
    const nlohmann::json& v = j[s.keys[i]];
    if (!v.is_number_integer())
      return k.bad(s.keys[i], "is " + v.dump() + " (" + v.type_name() + "); expected a positive integer");
    SPILLWAY_ASSIGN_OR_RETURN(std::optional<int> size, k.size(s.keys[i]));
    stated_size(s.sizes, i) = *size;
  }
  // What would change the math from spillway's GPT-2 is refused by name, as the Llama
  // keys are (transformers' GPT2Config defaults where absent).
  SPILLWAY_ASSIGN_OR_RETURN(std::optional<std::string> act, k.string("activation_function"));
  if (act && *act != "gelu_new" && *act != "gelu_pytorch_tanh")
    return Status::unsupported(where + ": activation_function is \"" + *act +
                               "\"; a GPT-2 in spillway uses the tanh GELU (\"gelu_new\" or \"gelu_pytorch_tanh\")");
  SPILLWAY_ASSIGN_OR_RETURN(std::optional<double> eps, k.positive("layer_norm_epsilon"));
  // The LayerNorm epsilon of both backends' kernels (kLayerNormEps in backend/cpu).
  constexpr float kGpt2LayerNormEps = 1e-5f;
  if (eps && static_cast<float>(*eps) != kGpt2LayerNormEps)
    return Status::unsupported(where + ": layer_norm_epsilon is " + number_text(*eps) +
                               "; a GPT-2 in spillway uses 1e-05");
  if (j.contains("n_inner") && !j["n_inner"].is_null()) {
    SPILLWAY_ASSIGN_OR_RETURN(std::optional<int> inner, k.size("n_inner"));
    if (s.sizes.width > 0 && *inner != 4 * s.sizes.width)
      return Status::unsupported(where + ": n_inner is " + std::to_string(*inner) +
                                 "; a GPT-2 in spillway has an MLP of 4 × n_embd = " +
                                 std::to_string(4 * s.sizes.width) + " channels (or null)");
  }
  SPILLWAY_ASSIGN_OR_RETURN(std::optional<bool> tied, k.boolean("tie_word_embeddings"));
  if (tied && !*tied)
    return Status::unsupported(where + ": tie_word_embeddings is false; a GPT-2 in spillway ties its LM head to "
                               "wte.weight (an lm_head.weight of its own would be ignored)");
  for (const auto& [key, want] : {std::pair<const char*, bool>{"scale_attn_weights", true},
                                  {"scale_attn_by_inverse_layer_idx", false}}) {
    SPILLWAY_ASSIGN_OR_RETURN(std::optional<bool> v, k.boolean(key));
    if (v && *v != want)
      return Status::unsupported(where + ": " + key + " is " + (*v ? "true" : "false") +
                                 "; a GPT-2 in spillway scales attention scores by 1/sqrt(head size) only");
  }
  c.config = s.sizes;
  return c;
}

Result<HfConfig> parse_llama_config(const nlohmann::json& j, const std::string& where, const std::string& source) {
  HfConfig c;
  c.path = source;
  c.arch = Arch::Llama;
  ConfigKeys k(j, where);
  ModelConfig& m = c.config;
  m.arch = Arch::Llama;
  c.stated.source = source;
  c.stated.keys = kLlamaKeys;
  for (size_t i = 0; i < kStatedSizes; ++i) {
    if (i == 5) continue;  // num_key_value_heads: optional
    SPILLWAY_ASSIGN_OR_RETURN(stated_size(m, i), k.required_size(kLlamaKeys[i]));
  }
  SPILLWAY_ASSIGN_OR_RETURN(std::optional<int> kv, k.size("num_key_value_heads"));
  m.kv_heads = kv.value_or(m.heads);  // transformers: absent means multi-head attention
  SPILLWAY_ASSIGN_OR_RETURN(std::optional<std::string> act, k.string("hidden_act"));
  if (act && *act != "silu")
    return Status::unsupported(where + ": hidden_act is \"" + *act + "\"; a Llama in spillway uses \"silu\" (SwiGLU)");
  for (const char* key : {"attention_bias", "mlp_bias"}) {
    SPILLWAY_ASSIGN_OR_RETURN(std::optional<bool> bias, k.boolean(key));
    if (bias && *bias)
      return Status::unsupported(where + ": " + key + " is true; spillway's Llama has no biases");
  }
  SPILLWAY_ASSIGN_OR_RETURN(std::optional<int> head_dim, k.size("head_dim"));
  if (head_dim && (m.width % m.heads != 0 || *head_dim != m.width / m.heads))
    return Status::unsupported(where + ": head_dim is " + std::to_string(*head_dim) + "; spillway needs hidden_size / "
                               "num_attention_heads = " + std::to_string(m.width) + " / " + std::to_string(m.heads) +
                               (m.width % m.heads == 0 ? " = " + std::to_string(m.width / m.heads) : std::string()));
  SPILLWAY_ASSIGN_OR_RETURN(std::optional<double> eps, k.positive("rms_norm_eps"));
  m.norm_eps = static_cast<float>(eps.value_or(1e-6));  // LlamaConfig's default
  SPILLWAY_ASSIGN_OR_RETURN(std::optional<bool> tied, k.boolean("tie_word_embeddings"));
  m.tied = tied.value_or(false);  // LlamaConfig's default
  SPILLWAY_ASSIGN_OR_RETURN(std::optional<int> tp, k.size("pretraining_tp"));
  (void)tp;  // the same math for any value
  SPILLWAY_ASSIGN_OR_RETURN(m.rope, parse_rope(j, where));
  SPILLWAY_RETURN_IF_ERROR(m.validate().with_context(where));
  c.stated.sizes = m;
  return c;
}

}  // namespace

int& stated_size(ModelConfig& c, size_t i) {
  int* fields[] = {&c.layers, &c.width, &c.heads, &c.context, &c.vocab, &c.kv_heads, &c.intermediate};
  return *fields[i];
}
int stated_size(const ModelConfig& c, size_t i) { return stated_size(const_cast<ModelConfig&>(c), i); }
const char* stated_size_name(size_t i) { return kSizeNames[i]; }

std::string StatedModelSizes::describe(size_t field) const {
  const std::string text = keys[field] + " " + std::to_string(stated_size(sizes, field));
  return source.empty() ? text : text + " (" + source + ")";
}

std::string hf_config_path(const std::string& path) {
  if (is_directory(path)) return join(strip_trailing_slashes(path), kConfigFile);
  return join(parent_directory(path), kConfigFile);
}

Result<HfConfig> parse_hf_config(std::string_view text, const std::string& where, const std::string& source) {
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return Status::corrupt(where + ": not valid JSON");
  if (!j.is_object()) return Status::invalid_argument(where + ": not a JSON object");
  std::string type = "gpt2";  // GPT-2 configs of older transformers have no model_type
  if (j.contains("model_type")) {
    if (!j["model_type"].is_string()) return Status::invalid_argument(where + ": key \"model_type\" is not a string");
    type = j["model_type"].get<std::string>();
  }
  const std::string& src = source.empty() ? where : source;
  if (type == "gpt2") return parse_gpt2_config(j, where, src);
  if (type == "llama") return parse_llama_config(j, where, src);
  return Status::unsupported(where + ": model_type is \"" + type +
                             "\"; spillway loads model_type \"gpt2\" (GPT-2) and \"llama\" (Llama) models");
}

Result<HfConfig> read_hf_config(const std::string& path) {
  SPILLWAY_ASSIGN_OR_RETURN(std::string text, read_text_file(path, kMaxConfigBytes, "config file"));
  return parse_hf_config(text, "config file " + path, path);
}

std::string model_config_json(const ModelConfig& cfg) {
  nlohmann::ordered_json j;
  if (cfg.arch == Arch::GPT2) {
    j["architectures"] = {"GPT2LMHeadModel"};
    j["model_type"] = "gpt2";
    j["activation_function"] = "gelu_new";
    j["n_layer"] = cfg.layers;
    j["n_embd"] = cfg.width;
    j["n_head"] = cfg.heads;
    j["n_positions"] = cfg.context;
    j["n_ctx"] = cfg.context;
    j["n_inner"] = nullptr;
    j["vocab_size"] = cfg.vocab;
    j["layer_norm_epsilon"] = 1e-5;
    j["tie_word_embeddings"] = true;
  } else {
    j["architectures"] = {"LlamaForCausalLM"};
    j["model_type"] = "llama";
    j["hidden_act"] = "silu";
    j["hidden_size"] = cfg.width;
    j["num_hidden_layers"] = cfg.layers;
    j["num_attention_heads"] = cfg.heads;
    j["num_key_value_heads"] = cfg.kv_heads;
    j["head_dim"] = cfg.head_dim();
    j["intermediate_size"] = cfg.intermediate;
    j["max_position_embeddings"] = cfg.context;
    j["vocab_size"] = cfg.vocab;
    j["rms_norm_eps"] = float_decimal(cfg.norm_eps);
    j["attention_bias"] = false;
    j["mlp_bias"] = false;
    j["tie_word_embeddings"] = cfg.tied;
    nlohmann::ordered_json rope;
    rope["rope_type"] = cfg.rope.llama3 ? "llama3" : "default";
    rope["rope_theta"] = float_decimal(cfg.rope.theta);
    nlohmann::ordered_json scaling = nullptr;
    if (cfg.rope.llama3) {
      scaling = nlohmann::ordered_json::object();
      scaling["rope_type"] = "llama3";
      scaling["factor"] = float_decimal(cfg.rope.factor);
      scaling["low_freq_factor"] = float_decimal(cfg.rope.low_freq_factor);
      scaling["high_freq_factor"] = float_decimal(cfg.rope.high_freq_factor);
      scaling["original_max_position_embeddings"] = cfg.rope.original_context;
      for (auto it = scaling.begin(); it != scaling.end(); ++it)
        if (it.key() != "rope_type") rope[it.key()] = it.value();
    }
    j["rope_parameters"] = rope;
    // The older form, for transformers before 5 (which also reads it: rope_scaling,
    // when not null, stands for rope_parameters, and rope_theta fills in its theta).
    j["rope_theta"] = float_decimal(cfg.rope.theta);
    j["rope_scaling"] = scaling;
  }
  j["dtype"] = "float32";
  j["torch_dtype"] = "float32";
  return j.dump(2) + "\n";
}

// ------------------------------------------------------------------ weight files

uint64_t WeightFiles::data_bytes() const {
  uint64_t total = 0;
  for (const SafetensorsReader& f : files_)
    if (!f.entries().empty()) total += f.entries().back().end;
  return total;
}

Result<WeightFiles> WeightFiles::open(const std::string& given) {
  WeightFiles w;
  w.path_ = given;
  struct stat st {};
  if (::stat(given.c_str(), &st) != 0) {
    int err = errno;
    if (err == ENOENT) return Status::not_found("model path " + given + ": no such file or directory");
    return errno_status("stat " + given, err);
  }
  if (!S_ISDIR(st.st_mode)) {
    SPILLWAY_ASSIGN_OR_RETURN(SafetensorsReader f, SafetensorsReader::open(given));
    w.files_.push_back(std::move(f));
  } else {
    w.directory_ = true;
    const std::string dir = strip_trailing_slashes(given);
    const std::string single = join(dir, kSingleFile), index_path = join(dir, kIndexFile);
    if (exists(single)) {  // as transformers: model.safetensors before an index
      SPILLWAY_ASSIGN_OR_RETURN(SafetensorsReader f, SafetensorsReader::open(single));
      w.files_.push_back(std::move(f));
    } else if (!exists(index_path)) {
      return Status::not_found("model directory " + dir + " holds neither " + kSingleFile + " nor " + kIndexFile);
    } else {
      SPILLWAY_ASSIGN_OR_RETURN(std::string text, read_text_file(index_path, kMaxIndexBytes, "index file"));
      const std::string where = "index file " + index_path;
      nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
      if (j.is_discarded()) return Status::corrupt(where + ": not valid JSON");
      if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object())
        return Status::invalid_argument(where + ": expected a JSON object with a \"weight_map\" object");
      std::map<std::string, std::string> shard_of;             // tensor → shard file
      std::map<std::string, std::vector<std::string>> shards;  // shard file → its tensors
      for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
        if (!it.value().is_string())
          return Status::invalid_argument(where + ": weight_map[\"" + it.key() + "\"] is " + it.value().dump() +
                                          "; expected a file name");
        const std::string shard = it.value().get<std::string>();
        if (shard.empty() || shard == "." || shard == ".." || shard.find('/') != std::string::npos)
          return Status::invalid_argument(where + ": weight_map[\"" + it.key() + "\"] is \"" + shard +
                                          "\"; expected the name of a file in " + dir);
        shard_of[it.key()] = shard;
        shards[shard].push_back(it.key());
      }
      if (shards.empty()) return Status::invalid_argument(where + ": weight_map is empty");
      std::map<std::string, std::string> seen_in;  // tensor → the first shard that holds it
      for (const auto& [shard, names] : shards) {
        const std::string path = join(dir, shard);
        auto f = SafetensorsReader::open(path);
        if (!f.ok()) {
          if (f.status().code() == StatusCode::NotFound)
            return Status::not_found("model directory " + dir + ": shard " + shard + " does not exist; " + kIndexFile +
                                     " maps " + std::to_string(names.size()) + " tensor(s) to it (" +
                                     list_names(names, 3) + ")");
          return f.status();
        }
        for (const SafetensorsEntry& e : f->entries()) {
          auto it = shard_of.find(e.name);
          auto before = seen_in.emplace(e.name, shard);
          if (!before.second)
            return Status::invalid_argument("safetensors file " + path + ": tensor '" + e.name +
                                            "' is also in shard " + before.first->second + " (" + kIndexFile +
                                            " maps it to " + (it == shard_of.end() ? "no file" : it->second) + ")");
          if (it == shard_of.end())
            return Status::invalid_argument("safetensors file " + path + ": holds tensor '" + e.name +
                                            "', which " + index_path + " does not list");
          if (it->second != shard)
            return Status::invalid_argument("safetensors file " + path + ": holds tensor '" + e.name + "', which " +
                                            index_path + " maps to " + it->second);
        }
        for (const std::string& name : names)
          if (!f->find(name))
            return Status::not_found("safetensors file " + path + ": lacks tensor '" + name + "', which " +
                                     index_path + " maps to it");
        w.files_.push_back(std::move(*f));
      }
    }
  }
  for (size_t fi = 0; fi < w.files_.size(); ++fi)
    for (size_t ei = 0; ei < w.files_[fi].entries().size(); ++ei) w.tensors_.push_back({fi, ei});
  return w;
}

namespace {

// What a Status-returning check says about a set of weight files: one file is named
// by its path, a sharded directory by its folder.
std::string where_text(const WeightFiles& w) {
  if (w.files().size() == 1) return "safetensors file " + w.files()[0].path();
  return "model directory " + strip_trailing_slashes(w.path());
}

std::vector<int64_t> hf_shape(const ParamSpec& s) {
  std::vector<int64_t> d = s.shape.dims;
  if (s.conv1d) std::reverse(d.begin(), d.end());
  return d;
}

// out[o*in + i] = src[i*out + o]: Hugging Face Conv1D [in,out] ⇄ our [out,in].
std::vector<float> transpose(const std::vector<float>& src, int64_t rows, int64_t cols) {
  std::vector<float> out(src.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) out[static_cast<size_t>(c * rows + r)] = src[static_cast<size_t>(r * cols + c)];
  return out;
}

bool float_dtype(const std::string& d) { return d == "F32" || d == "F16" || d == "BF16"; }

// "element 37 (index [4, 5] of [8, 24])": a flat index in stored order and its coordinates.
std::string element_text(const SafetensorsEntry& e, size_t flat) {
  std::vector<int64_t> idx(e.shape.size());
  size_t rem = flat;
  for (size_t d = e.shape.size(); d-- > 0;) {
    const size_t dim = static_cast<size_t>(e.shape[d]);
    idx[d] = static_cast<int64_t>(rem % dim);
    rem /= dim;
  }
  return "element " + std::to_string(flat) + " (index " + shape_text(idx) + " of " + shape_text(e.shape) + ")";
}

// A block's number from "<prefix><digits>.<rest>": -1 when not of that form (or not a
// plain number below kMaxModelDim), with `rest` set.
struct BlockName {
  bool is_block = false;  // of the form "<prefix><digits>.<rest>"
  int64_t index = -1;     // -1 unless the digits are a plain number below kMaxModelDim
  std::string_view digits, rest;
};

BlockName parse_block_name(std::string_view name, std::string_view prefix) {
  BlockName b;
  if (name.substr(0, prefix.size()) != prefix) return b;
  size_t i = prefix.size();
  while (i < name.size() && name[i] >= '0' && name[i] <= '9') ++i;
  if (i == prefix.size() || i >= name.size() || name[i] != '.') return b;
  b.is_block = true;
  b.digits = name.substr(prefix.size(), i - prefix.size());
  b.rest = name.substr(i + 1);
  if (b.digits.size() > 1 && b.digits[0] == '0') return b;  // "h.01.": not how blocks are named
  int64_t v = 0;
  for (char c : b.digits) {
    v = v * 10 + (c - '0');
    if (v >= kMaxModelDim) return b;  // stops before it could overflow
  }
  b.index = v;
  return b;
}

// ------------------------------------------------------------------ GPT-2

std::string_view strip_prefix(std::string_view name) {
  return name.substr(0, kPrefix.size()) == kPrefix ? name.substr(kPrefix.size()) : name;
}

// The parameters of one block without the "h.{i}." prefix, in ParamSpec order.
const std::vector<std::string>& gpt2_block_tensor_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> n;
    const std::string prefix = "transformer.h.0.";
    for (const ParamSpec& s : parameter_specs(ModelConfig{1, 1, 1, 1, 1}))
      if (s.layer == 0) n.push_back(s.name.substr(prefix.size()));
    return n;
  }();
  return names;
}

// "1024" → 1024: a plain decimal number in 1..kMaxModelDim, else nullopt.
std::optional<int> parse_size(std::string_view s) {
  int64_t v = 0;
  if (s.empty() || s.size() > 9 || (s.size() > 1 && s[0] == '0')) return std::nullopt;
  for (char c : s) {
    if (c < '0' || c > '9') return std::nullopt;
    v = v * 10 + (c - '0');
  }
  if (v < 1 || v > kMaxModelDim) return std::nullopt;
  return static_cast<int>(v);
}

// The sizes in a file's __metadata__ (as export_model writes them for GPT-2).
Result<StatedModelSizes> metadata_sizes(const SafetensorsReader& file) {
  StatedModelSizes s;
  s.source = "__metadata__ of " + file.path();
  const auto& meta = file.metadata();
  const bool positions = meta.count("n_positions") > 0;
  s.keys = {"n_layer", "n_embd", "n_head", positions ? "n_positions" : "n_ctx", "vocab_size", "", ""};
  for (size_t i = 0; i < 5; ++i) {
    auto it = meta.find(s.keys[i]);
    if (it == meta.end()) continue;
    std::optional<int> v = parse_size(it->second);
    if (!v)
      return Status::invalid_argument("safetensors file " + file.path() + ": __metadata__ " + s.keys[i] + " '" +
                                      it->second + "' is not a positive integer up to 2^24");
    stated_size(s.sizes, i) = *v;
  }
  return s;
}

// L, the number of transformer blocks, after checking that the blocks are exactly
// h.0 … h.{L-1} and that each has all 12 parameters. The work is bounded by the
// number of tensors, whatever the names say.
Result<int> gpt2_block_count(const WeightFiles& w) {
  auto fail = [&](const std::string& what) { return Status::invalid_argument(where_text(w) + ": " + what); };
  std::map<int64_t, std::set<std::string_view>> blocks;  // index → the parameter names it has
  for (const WeightFiles::Tensor& t : w.tensors()) {
    const SafetensorsEntry& e = w.entry(t);
    BlockName b = parse_block_name(strip_prefix(e.name), "h.");
    if (!b.is_block) continue;
    if (b.index < 0)
      return fail("tensor '" + e.name + "': block number " + std::string(b.digits) +
                  " is not a plain number below 2^24 = " + std::to_string(kMaxModelDim));
    blocks[b.index].insert(b.rest);
  }
  if (blocks.empty()) return fail("no transformer blocks (h.0.*)");
  const int64_t count = static_cast<int64_t>(blocks.size());
  const int64_t last = blocks.rbegin()->first;
  if (last != count - 1) {
    int64_t first_missing = 0;
    for (const auto& [i, names] : blocks) {
      if (i != first_missing) break;
      ++first_missing;
    }
    std::vector<std::string> found;
    for (const auto& [i, names] : blocks) found.push_back("h." + std::to_string(i));
    return fail("transformer blocks must be h.0 … h.{L-1} with none missing; the file has " +
                std::to_string(count) + " block(s) (" + list_names(found, 5) + ") and no h." +
                std::to_string(first_missing));
  }
  for (const auto& [i, names] : blocks) {
    std::vector<std::string> missing;
    for (const std::string& n : gpt2_block_tensor_names())
      if (!names.count(n)) missing.push_back("h." + std::to_string(i) + "." + n);
    if (!missing.empty())
      return fail("block h." + std::to_string(i) + " is incomplete: it lacks " + std::to_string(missing.size()) +
                  " of its 12 parameters: " + list_names(missing));
  }
  return static_cast<int>(count);
}

// The matched tensor of each ParamSpec of `cfg`, in order; for a tied Llama also the
// stored lm_head.weight, if any (to be compared with the embedding).
struct Matched {
  std::vector<WeightFiles::Tensor> found;
  std::optional<WeightFiles::Tensor> tied_head;
};

// Shapes and dtypes of the matched tensors against the specs.
Status check_shapes(const WeightFiles& w, const std::vector<ParamSpec>& specs, const Matched& m) {
  for (size_t p = 0; p < specs.size(); ++p) {
    const SafetensorsEntry& e = w.entry(m.found[p]);
    const std::string where = "safetensors file " + w.file_of(m.found[p]);
    std::vector<int64_t> want = hf_shape(specs[p]);
    if (e.shape != want)
      return Status::invalid_argument(where + ": tensor '" + e.name + "' has shape " + shape_text(e.shape) +
                                      "; expected " + shape_text(want) +
                                      (specs[p].conv1d ? " (Hugging Face Conv1D layout [in, out])" : ""));
    if (!float_dtype(e.dtype))
      return Status::invalid_argument(where + ": tensor '" + e.name + "' has dtype " + e.dtype +
                                      "; expected F32, F16 or BF16");
  }
  return Status::ok();
}

// Checks that the files hold exactly the parameters of `cfg` (plus the ignored
// buffers and tied lm_head) with their shapes and float dtypes.
Result<Matched> match_gpt2(const WeightFiles& w, const ModelConfig& cfg) {
  const std::string where = where_text(w);
  // Stored tensors by name without the "transformer." prefix.
  std::map<std::string, WeightFiles::Tensor, std::less<>> by_name;
  std::set<int64_t> block_indices;
  for (const WeightFiles::Tensor& t : w.tensors()) {
    std::string_view n = strip_prefix(w.entry(t).name);
    if (n == "lm_head.weight") continue;  // tied to wte
    BlockName b = parse_block_name(n, "h.");
    if (b.is_block && b.index >= 0) block_indices.insert(b.index);
    if (b.is_block && (b.rest == "attn.bias" || b.rest == "attn.masked_bias")) continue;  // buffers
    if (!by_name.emplace(std::string(n), t).second)
      return Status::invalid_argument(where + ": tensor '" + std::string(n) +
                                      "' appears twice (with and without the transformer. prefix)");
  }
  // More blocks asked for than the file has: name the first missing one without
  // listing (or allocating) the parameters of every block of cfg.
  if (static_cast<size_t>(cfg.layers) > block_indices.size()) {
    int first_missing = 0;
    while (block_indices.count(first_missing)) ++first_missing;
    std::vector<std::string> names;
    for (const std::string& n : gpt2_block_tensor_names()) names.push_back("h." + std::to_string(first_missing) + "." + n);
    return Status::not_found(where + ": missing blocks of a GPT-2 with " + cfg.to_string() + ": it has " +
                             std::to_string(cfg.layers) + " blocks, the file " + std::to_string(block_indices.size()) +
                             "; the first missing is h." + std::to_string(first_missing) + ": " + list_names(names));
  }
  std::vector<ParamSpec> specs = parameter_specs(cfg);
  std::vector<std::string> missing;
  Matched m;
  for (const ParamSpec& s : specs) {
    auto it = by_name.find(strip_prefix(s.name));
    if (it == by_name.end()) {
      missing.push_back(std::string(strip_prefix(s.name)));
      m.found.push_back({});
      continue;
    }
    m.found.push_back(it->second);
    by_name.erase(it);
  }
  if (!missing.empty())
    return Status::not_found(where + ": missing " + std::to_string(missing.size()) + " tensor(s) of a GPT-2 with " +
                             cfg.to_string() + ": " + list_names(missing));
  if (!by_name.empty()) {
    std::vector<std::string> extra;
    for (const auto& [n, e] : by_name) extra.push_back(n);
    return Status::invalid_argument(where + ": " + std::to_string(extra.size()) +
                                    " unexpected tensor(s) for a GPT-2 with " + cfg.to_string() + ": " +
                                    list_names(extra));
  }
  SPILLWAY_RETURN_IF_ERROR(check_shapes(w, specs, m));
  return m;
}

Result<ModelConfig> infer_gpt2_config(const WeightFiles& w, const std::optional<HfConfig>& config,
                                      const std::string& config_path, const StatedModelSizes& flags) {
  auto fail = [&](const std::string& what) { return Status::invalid_argument(where_text(w) + ": " + what); };
  for (size_t i = 5; i < kStatedSizes; ++i)
    if (stated_size(flags.sizes, i) != 0)
      return fail(flags.describe(i) + " is for Llama models; this is a GPT-2");
  const SafetensorsEntry* wte = nullptr;
  const SafetensorsEntry* wpe = nullptr;
  for (const WeightFiles::Tensor& t : w.tensors()) {
    const SafetensorsEntry& e = w.entry(t);
    std::string_view n = strip_prefix(e.name);
    if (n == "wte.weight") wte = &e;
    if (n == "wpe.weight") wpe = &e;
  }
  if (!wte) return fail("no tensor wte.weight (or transformer.wte.weight): not a GPT-2 checkpoint");
  if (!wpe) return fail("no tensor wpe.weight (or transformer.wpe.weight): not a GPT-2 checkpoint");
  if (wte->shape.size() != 2) return fail("wte.weight has shape " + shape_text(wte->shape) + "; expected [vocab, width]");
  if (wpe->shape.size() != 2 || wpe->shape[1] != wte->shape[1])
    return fail("wpe.weight has shape " + shape_text(wpe->shape) + "; expected [context, " +
                std::to_string(wte->shape[1]) + "]");
  for (int64_t d : {wte->shape[0], wte->shape[1], wpe->shape[0]})
    if (d < 1 || d > kMaxModelDim)
      return fail("wte.weight " + shape_text(wte->shape) + " and wpe.weight " + shape_text(wpe->shape) +
                  ": each size must be 1 to 2^24 = " + std::to_string(kMaxModelDim));
  SPILLWAY_ASSIGN_OR_RETURN(const int layers, gpt2_block_count(w));

  // Every block needs its bytes in the file, at 2 bytes a value at the least.
  const int64_t C = wte->shape[1];
  const uint64_t data_bytes = w.data_bytes();
  int64_t block_values = 0, min_bytes = 0;
  if (__builtin_mul_overflow(12 * C, C, &block_values) || __builtin_add_overflow(block_values, 13 * C, &block_values) ||
      __builtin_mul_overflow(block_values, int64_t{2} * layers, &min_bytes) ||
      static_cast<uint64_t>(min_bytes) > data_bytes)
    return fail(std::to_string(layers) + " block(s) of width " + std::to_string(C) + " need at least " +
                std::to_string(block_values) + " values each (" +
                (min_bytes > 0 ? std::to_string(min_bytes) + " bytes in all" : std::string("more than 2^63 bytes")) +
                " at 2 bytes a value), but the file's data is " + std::to_string(data_bytes) + " bytes");

  // Sizes from the weights; heads from config.json, __metadata__ or the flags. Every
  // stated size must agree with the weights and with the other sources.
  ModelConfig cfg{layers, static_cast<int>(C), 0, static_cast<int>(wpe->shape[0]), static_cast<int>(wte->shape[0])};
  std::array<std::string, kStatedSizes> chosen = {
      "the weights: " + std::to_string(layers) + " block(s), h.0 … h." + std::to_string(layers - 1),
      "the weights: width " + std::to_string(cfg.width) + " (wte.weight " + shape_text(wte->shape) + ")",
      "",
      "the weights: context " + std::to_string(cfg.context) + " (wpe.weight " + shape_text(wpe->shape) + ")",
      "the weights: vocab " + std::to_string(cfg.vocab) + " (wte.weight " + shape_text(wte->shape) + ")",
      "",
      ""};
  std::vector<StatedModelSizes> sources;
  if (config) sources.push_back(config->stated);
  for (const SafetensorsReader& f : w.files()) {
    SPILLWAY_ASSIGN_OR_RETURN(StatedModelSizes meta, metadata_sizes(f));
    sources.push_back(std::move(meta));
  }
  sources.push_back(flags);
  for (const StatedModelSizes& s : sources) {
    for (size_t i = 0; i < 5; ++i) {
      const int v = stated_size(s.sizes, i);
      if (v == 0) continue;
      if (v < 0) return fail(std::string("model ") + kSizeNames[i] + ": " + s.describe(i) + " must be positive");
      int& field = stated_size(cfg, i);
      if (field == 0) {
        field = v;
        chosen[i] = s.describe(i);
      } else if (field != v) {
        return fail(std::string("model ") + kSizeNames[i] + ": " + s.describe(i) + " disagrees with " + chosen[i]);
      }
    }
  }
  if (cfg.heads == 0)
    return fail("the number of attention heads is stated nowhere: the file's __metadata__ has no n_head, and " +
                (config ? config_path + " has no n_head"
                        : std::string("there is no config.json ") + (w.is_directory() ? "in it (" : "beside it (") +
                              config_path + ")") +
                "; pass --heads (width " + std::to_string(cfg.width) + " = heads x head size)");
  SPILLWAY_RETURN_IF_ERROR(cfg.validate().with_context(where_text(w)));
  SPILLWAY_RETURN_IF_ERROR(match_gpt2(w, cfg).status());
  return cfg;
}

// ------------------------------------------------------------------ Llama

bool looks_like_llama(const WeightFiles& w) {
  for (const WeightFiles::Tensor& t : w.tensors()) {
    const std::string& n = w.entry(t).name;
    if (n == "model.embed_tokens.weight" || n.rfind("model.layers.", 0) == 0) return true;
  }
  return false;
}

Result<Matched> match_llama(const WeightFiles& w, const ModelConfig& cfg) {
  const std::string where = where_text(w);
  std::map<std::string, WeightFiles::Tensor, std::less<>> by_name;
  std::set<int64_t> layer_indices;
  std::optional<WeightFiles::Tensor> head;
  for (const WeightFiles::Tensor& t : w.tensors()) {
    const std::string& n = w.entry(t).name;
    BlockName b = parse_block_name(n, "model.layers.");
    if (b.is_block && b.index >= 0) layer_indices.insert(b.index);
    if (b.is_block && b.rest == "self_attn.rotary_emb.inv_freq") continue;  // a buffer of older checkpoints
    if (cfg.tied && n == "lm_head.weight") {
      head = t;
      continue;
    }
    by_name.emplace(n, t);  // names are unique: one header, or shards checked against the index
  }
  // More layers in the config than the files have: name the first missing one
  // without listing (or allocating) the parameters of every layer.
  if (static_cast<size_t>(cfg.layers) > layer_indices.size()) {
    int first_missing = 0;
    while (layer_indices.count(first_missing)) ++first_missing;
    return Status::not_found(where + ": the config has " + std::to_string(cfg.layers) + " layers, the weights " +
                             std::to_string(layer_indices.size()) + "; the first missing is model.layers." +
                             std::to_string(first_missing) + ".*");
  }
  std::vector<ParamSpec> specs = parameter_specs(cfg);
  std::vector<std::string> missing;
  Matched m;
  for (const ParamSpec& s : specs) {
    auto it = by_name.find(s.name);
    if (it == by_name.end()) {
      missing.push_back(s.name);
      m.found.push_back({});
      continue;
    }
    m.found.push_back(it->second);
    by_name.erase(it);
  }
  if (!missing.empty())
    return Status::not_found(where + ": missing " + std::to_string(missing.size()) + " tensor(s) of a Llama with " +
                             cfg.to_string() + ": " + list_names(missing) +
                             (!cfg.tied && missing.back() == "lm_head.weight"
                                  ? " (the config says tie_word_embeddings false: the LM head is its own tensor)"
                                  : ""));
  if (!by_name.empty()) {
    std::vector<std::string> extra;
    for (const auto& [n, t] : by_name) extra.push_back(n);
    return Status::invalid_argument(where + ": " + std::to_string(extra.size()) +
                                    " unexpected tensor(s) for a Llama with " + cfg.to_string() + ": " +
                                    list_names(extra));
  }
  SPILLWAY_RETURN_IF_ERROR(check_shapes(w, specs, m));
  if (head) {
    const SafetensorsEntry& e = w.entry(*head);
    const std::vector<int64_t> want = {cfg.vocab, cfg.width};
    if (e.shape != want || !float_dtype(e.dtype))
      return Status::invalid_argument("safetensors file " + w.file_of(*head) + ": tensor 'lm_head.weight' has " +
                                      e.dtype + " " + shape_text(e.shape) + "; expected F32, F16 or BF16 " +
                                      shape_text(want) + " (the config ties it to model.embed_tokens.weight)");
    m.tied_head = head;
  }
  return m;
}

// A tied model's stored lm_head.weight must be the embedding, value for value.
Status check_tied_head(const WeightFiles& w, const WeightFiles::Tensor& embed, const WeightFiles::Tensor& head) {
  const SafetensorsEntry& e = w.entry(embed);
  const SafetensorsEntry& h = w.entry(head);
  const uint64_t n = static_cast<uint64_t>(e.numel());
  constexpr uint64_t kChunk = 1u << 20;
  for (uint64_t first = 0; first < n; first += kChunk) {
    SPILLWAY_ASSIGN_OR_RETURN(std::vector<float> a, w.files()[embed.file].read_f32(e, first, kChunk));
    SPILLWAY_ASSIGN_OR_RETURN(std::vector<float> b, w.files()[head.file].read_f32(h, first, kChunk));
    for (size_t i = 0; i < a.size(); ++i)
      if (std::bit_cast<uint32_t>(a[i]) != std::bit_cast<uint32_t>(b[i]))
        return Status::invalid_argument(
            "safetensors file " + w.file_of(head) + ": tensor 'lm_head.weight' " +
            element_text(h, static_cast<size_t>(first + i)) + " is " + number_text(b[i]) +
            " but model.embed_tokens.weight's is " + number_text(a[i]) +
            ", and the config ties them (tie_word_embeddings true): transformers would drop lm_head.weight; "
            "set tie_word_embeddings to false in config.json to train them apart, or remove lm_head.weight");
  }
  return Status::ok();
}

// The config of the weights: config.json, else (one file) its __metadata__ "config".
Result<std::optional<HfConfig>> find_config(const WeightFiles& w, const std::string& config_path) {
  std::optional<HfConfig> config;
  auto file_config = read_hf_config(config_path);
  if (file_config.ok()) config = std::move(*file_config);
  else if (file_config.status().code() != StatusCode::NotFound) return file_config.status();
  if (w.files().size() == 1) {
    const auto& meta = w.files()[0].metadata();
    auto it = meta.find("config");
    if (it != meta.end()) {
      SPILLWAY_ASSIGN_OR_RETURN(HfConfig inner,
                                parse_hf_config(it->second, "__metadata__ \"config\" of " + w.files()[0].path()));
      if (config && (config->arch != inner.arch || config->config != inner.config))
        return Status::invalid_argument(config->path + " (" + config->config.to_string() + ") and " + inner.path +
                                        " (" + inner.config.to_string() + ") disagree");
      if (!config) config = std::move(inner);
    }
  }
  return config;
}

}  // namespace

Result<ModelConfig> infer_model_config(const std::string& path, const StatedModelSizes& flags) {
  SPILLWAY_ASSIGN_OR_RETURN(WeightFiles w, WeightFiles::open(path));
  const std::string config_path = hf_config_path(path);
  SPILLWAY_ASSIGN_OR_RETURN(std::optional<HfConfig> config, find_config(w, config_path));
  if (!config || config->arch == Arch::GPT2) {
    if (!config && looks_like_llama(w))
      return Status::invalid_argument(where_text(w) + " holds Llama tensors (model.layers.*) but there is no " +
                                      config_path + ": a Llama's sizes, rope and tying come from its config.json; "
                                      "put the model's config.json there");
    return infer_gpt2_config(w, config, config_path, flags);
  }
  ModelConfig cfg = config->config;
  for (size_t i = 0; i < kStatedSizes; ++i) {
    const int v = stated_size(flags.sizes, i);
    if (v == 0) continue;
    if (v != stated_size(cfg, i))
      return Status::invalid_argument(where_text(w) + ": model " + kSizeNames[i] + ": " + flags.describe(i) +
                                      " disagrees with " + config->stated.describe(i));
  }
  SPILLWAY_RETURN_IF_ERROR(match_llama(w, cfg).status());
  return cfg;
}

Status import_model(const std::string& path, const ModelConfig& cfg,
                    const std::function<Status(const ParamSpec&, std::vector<float>&&)>& sink,
                    const ImportOptions& options) {
  SPILLWAY_RETURN_IF_ERROR(cfg.validate());
  SPILLWAY_ASSIGN_OR_RETURN(WeightFiles w, WeightFiles::open(path));
  SPILLWAY_ASSIGN_OR_RETURN(Matched m, cfg.arch == Arch::Llama ? match_llama(w, cfg) : match_gpt2(w, cfg));
  std::vector<ParamSpec> specs = parameter_specs(cfg);
  if (m.tied_head) SPILLWAY_RETURN_IF_ERROR(check_tied_head(w, m.found[0], *m.tied_head));
  for (size_t p = 0; p < specs.size(); ++p) {
    const SafetensorsEntry& e = w.entry(m.found[p]);
    SPILLWAY_ASSIGN_OR_RETURN(std::vector<float> v, w.read_f32(m.found[p]));
    if (!options.allow_nonfinite) {
      // By the bits, so that no compiler flag can fold the test away.
      auto bad = std::find_if(v.begin(), v.end(), [](float x) {
        return (std::bit_cast<uint32_t>(x) & 0x7f800000u) == 0x7f800000u;
      });
      if (bad != v.end()) {
        const uint32_t bits = std::bit_cast<uint32_t>(*bad);
        const char* what = (bits & 0x7fffffu) ? "NaN" : (bits >> 31) ? "-Inf" : "+Inf";
        return Status::invalid_argument("safetensors file " + w.file_of(m.found[p]) + ": tensor '" + e.name + "' " +
                                        element_text(e, static_cast<size_t>(bad - v.begin())) + " is " + what +
                                        "; weights must be finite (--allow-nonfinite-weights loads them anyway)");
      }
    }
    if (specs[p].conv1d) v = transpose(v, specs[p].shape[1], specs[p].shape[0]);
    SPILLWAY_RETURN_IF_ERROR(sink(specs[p], std::move(v)));
  }
  return Status::ok();
}

Result<ModelWeights> import_model(const std::string& path, const ModelConfig& cfg, const ImportOptions& options) {
  ModelWeights w;
  SPILLWAY_RETURN_IF_ERROR(import_model(
      path, cfg,
      [&](const ParamSpec& s, std::vector<float>&& v) {
        w.emplace(s.name, std::move(v));
        return Status::ok();
      },
      options));
  return w;
}

// ------------------------------------------------------------------ export

bool is_model_directory_path(const std::string& path) { return !ends_with(path, ".safetensors"); }

namespace {

// The files a save writes into a model directory, and nothing else.
bool is_saved_file_name(const std::string& n) {
  if (n == kConfigFile || n == kSingleFile || n == kIndexFile) return true;
  // model-00001-of-00006.safetensors
  if (n.size() != std::string("model-00001-of-00006.safetensors").size()) return false;
  if (n.rfind("model-", 0) != 0 || !ends_with(n, ".safetensors") || n.substr(11, 4) != "-of-") return false;
  for (size_t i : {6, 7, 8, 9, 10, 15, 16, 17, 18, 19})
    if (n[i] < '0' || n[i] > '9') return false;
  return true;
}

// The entries of a directory (not . and ..), and whether each is a regular file.
Result<std::vector<std::pair<std::string, bool>>> list_directory(const std::string& dir) {
  std::vector<std::pair<std::string, bool>> out;
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return errno_status("folder " + dir + ": cannot list it", errno);
  for (;;) {
    errno = 0;
    dirent* e = ::readdir(d);
    if (e == nullptr) break;
    if (std::strcmp(e->d_name, ".") == 0 || std::strcmp(e->d_name, "..") == 0) continue;
    struct stat st {};
    const bool regular = ::lstat((dir + "/" + e->d_name).c_str(), &st) == 0 && S_ISREG(st.st_mode);
    out.emplace_back(e->d_name, regular);
  }
  int err = errno;
  ::closedir(d);
  if (err != 0) return errno_status("folder " + dir + ": readdir", err);
  return out;
}

// Removes a directory of plain files (a save's temporary or replaced directory).
Status remove_file_directory(const std::string& dir) {
  SPILLWAY_ASSIGN_OR_RETURN(auto entries, list_directory(dir));
  for (const auto& [name, regular] : entries)
    if (::unlink((dir + "/" + name).c_str()) != 0 && errno != ENOENT)
      return errno_status("remove " + dir + "/" + name, errno);
  if (::rmdir(dir.c_str()) != 0 && errno != ENOENT) return errno_status("remove folder " + dir, errno);
  return Status::ok();
}

// DIR.tmp-<pid>-<8 hex digits>, made with mkdir (which fails if it exists).
Result<std::string> make_temp_directory(const std::string& dir) {
  std::random_device random;
  for (int attempt = 0; attempt < 16; ++attempt) {
    char suffix[16];
    std::snprintf(suffix, sizeof suffix, "%08x", static_cast<unsigned>(random()));
    std::string tmp = dir + ".tmp-" + std::to_string(::getpid()) + "-" + suffix;
    if (::mkdir(tmp.c_str(), 0755) == 0) return tmp;
    if (errno != EEXIST) return errno_status("create temporary folder " + tmp + " for " + dir, errno);
  }
  return Status::io_error("create a temporary folder for " + dir + ": 16 names taken");
}


// Whether `dir` exists (a folder a save may replace); an error when it may not be replaced.
Result<bool> replaceable_directory(const std::string& dir) {
  struct stat st {};
  if (::lstat(dir.c_str(), &st) != 0) {
    if (errno != ENOENT) return errno_status("stat " + dir, errno);
    return false;
  }
  if (!S_ISDIR(st.st_mode))
    return Status::invalid_argument(dir + " exists and is not a folder (a path without .safetensors saves a model "
                                    "directory; end it in .safetensors for one file)");
  SPILLWAY_ASSIGN_OR_RETURN(auto entries, list_directory(dir));
  std::vector<std::string> foreign;
  for (const auto& [name, regular] : entries)
    if (!regular || !is_saved_file_name(name)) foreign.push_back(name);
  if (!foreign.empty())
    return Status::invalid_argument("the folder " + dir + " holds " + list_names(foreign, 5) +
                                    ", which a save does not write; a save replaces only a folder of config.json "
                                    "and model*.safetensors files (an earlier save): save into a new folder");
  return true;
}

// Puts the finished temporary directory `tmp` in the place of `dir`.
Status install_directory(const std::string& tmp, const std::string& dir) {
  SPILLWAY_ASSIGN_OR_RETURN(bool existing, replaceable_directory(dir));
  if (!existing) {
    if (::rename(tmp.c_str(), dir.c_str()) != 0) return errno_status("rename " + tmp + " to " + dir, errno);
    return fsync_directory(parent_directory(dir)).with_context("after renaming onto " + dir);
  }
  // Swap the two directories in one step; the old one is then at `tmp`.
  if (::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, dir.c_str(), RENAME_EXCHANGE) == 0) {
    SPILLWAY_RETURN_IF_ERROR(fsync_directory(parent_directory(dir)).with_context("after replacing " + dir));
    return remove_file_directory(tmp).with_context("the replaced copy of " + dir);
  }
  if (errno != EINVAL && errno != ENOSYS && errno != EOPNOTSUPP)
    return errno_status("exchange " + tmp + " with " + dir, errno);
  // A file system without RENAME_EXCHANGE: move the old one aside, then the new one in.
  SPILLWAY_ASSIGN_OR_RETURN(std::string aside, make_temp_directory(dir));
  if (::rmdir(aside.c_str()) != 0) return errno_status("remove folder " + aside, errno);
  if (::rename(dir.c_str(), aside.c_str()) != 0) return errno_status("rename " + dir + " to " + aside, errno);
  if (::rename(tmp.c_str(), dir.c_str()) != 0) {
    Status s = errno_status("rename " + tmp + " to " + dir, errno);
    (void)::rename(aside.c_str(), dir.c_str());  // put the old one back
    return s;
  }
  SPILLWAY_RETURN_IF_ERROR(fsync_directory(parent_directory(dir)).with_context("after replacing " + dir));
  return remove_file_directory(aside).with_context("the replaced copy of " + dir);
}

std::string shard_name(size_t k, size_t n) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "model-%05zu-of-%05zu.safetensors", k, n);
  return buf;
}

Status export_directory(const std::string& given, const ModelConfig& cfg,
                        const std::vector<SafetensorsTensor>& tensors, const ExportOptions& options) {
  const std::string dir = strip_trailing_slashes(given);
  // Shards in ParamSpec order, each up to the limit (a larger tensor alone).
  std::vector<std::vector<size_t>> shards;
  uint64_t in_shard = 0, total = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    uint64_t bytes = 4;
    for (int64_t d : tensors[i].shape) bytes *= static_cast<uint64_t>(d);
    if (shards.empty() || (in_shard > 0 && in_shard + bytes > options.shard_bytes)) {
      shards.emplace_back();
      in_shard = 0;
    }
    shards.back().push_back(i);
    in_shard += bytes;
    total += bytes;
  }
  SPILLWAY_ASSIGN_OR_RETURN(std::string tmp, make_temp_directory(dir));
  RemoveOnInterrupt guard(tmp);
  auto write_all = [&]() -> Status {
    nlohmann::ordered_json weight_map = nlohmann::ordered_json::object();
    for (size_t k = 0; k < shards.size(); ++k) {
      const std::string name = shards.size() == 1 ? kSingleFile : shard_name(k + 1, shards.size());
      std::vector<SafetensorsTensor> part;
      for (size_t i : shards[k]) {
        part.push_back(tensors[i]);
        weight_map[tensors[i].name] = name;
      }
      SPILLWAY_RETURN_IF_ERROR(write_safetensors(join(tmp, name), part, {{"format", "pt"}}));
    }
    if (shards.size() > 1) {
      nlohmann::ordered_json index;
      index["metadata"] = {{"total_size", total}, {"total_parameters", cfg.num_parameters()}};
      index["weight_map"] = weight_map;
      SPILLWAY_RETURN_IF_ERROR(write_file_atomically(join(tmp, kIndexFile), index.dump(2) + "\n"));
    }
    SPILLWAY_RETURN_IF_ERROR(write_file_atomically(join(tmp, kConfigFile), model_config_json(cfg)));
    SPILLWAY_RETURN_IF_ERROR(fsync_directory(tmp));
    return install_directory(tmp, dir);
  };
  Status s = write_all();
  if (!s.is_ok()) (void)remove_file_directory(tmp);  // best effort; a leftover is named by later runs
  if (!s.is_ok()) return s.with_context("model directory " + dir);
  return Status::ok();
}

}  // namespace

Status check_model_directory_replaceable(const std::string& dir) {
  return replaceable_directory(strip_trailing_slashes(dir)).status().with_context("model directory " +
                                                                                   strip_trailing_slashes(dir));
}

Status export_model(const std::string& path, const ModelConfig& cfg,
                    const std::function<Result<std::vector<float>>(const ParamSpec&)>& source,
                    const ExportOptions& options) {
  SPILLWAY_RETURN_IF_ERROR(cfg.validate());
  std::vector<SafetensorsTensor> tensors;
  for (const ParamSpec& s : parameter_specs(cfg)) {
    SafetensorsTensor t;
    t.name = s.name;
    t.shape = hf_shape(s);
    t.values = [&source, s]() -> Result<std::vector<float>> {
      SPILLWAY_ASSIGN_OR_RETURN(std::vector<float> v, source(s));
      if (static_cast<int64_t>(v.size()) != s.shape.numel())
        return Status::invalid_argument("parameter '" + s.name + "' has " + std::to_string(v.size()) +
                                        " values; shape " + s.shape.to_string() + " needs " +
                                        std::to_string(s.shape.numel()));
      if (s.conv1d) return transpose(v, s.shape[0], s.shape[1]);
      return v;
    };
    tensors.push_back(std::move(t));
  }
  if (is_model_directory_path(path)) return export_directory(path, cfg, tensors, options);
  std::map<std::string, std::string> meta = {{"format", "pt"}};
  if (cfg.arch == Arch::GPT2) {
    meta.insert({{"n_layer", std::to_string(cfg.layers)},
                 {"n_embd", std::to_string(cfg.width)},
                 {"n_head", std::to_string(cfg.heads)},
                 {"n_ctx", std::to_string(cfg.context)},
                 {"vocab_size", std::to_string(cfg.vocab)}});
  } else {
    meta["config"] = model_config_json(cfg);
  }
  return write_safetensors(path, tensors, meta);
}

Status export_model(const std::string& path, const ModelConfig& cfg, const ModelWeights& weights,
                    const ExportOptions& options) {
  return export_model(
      path, cfg,
      [&](const ParamSpec& s) -> Result<std::vector<float>> {
        auto it = weights.find(s.name);
        if (it == weights.end()) return Status::not_found("no values for parameter '" + s.name + "'");
        return it->second;
      },
      options);
}

}  // namespace spillway
