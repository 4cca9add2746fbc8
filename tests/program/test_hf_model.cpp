// Hugging Face model directories (model/hf_model.h): config.json of GPT-2 and Llama in
// both rope forms, single files and shards with an index, every bad input named, and
// save → load round trips through a directory (sharded with a tiny limit).
#include <gtest/gtest.h>

#include <bit>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "model/hf_model.h"
#include "model/safetensors.h"
#include "support/test_support.h"

namespace spillway {
namespace {

using testing_support::names_in;
using testing_support::read_file;
using testing_support::TempDir;
namespace fs = std::filesystem;

const std::string kReference = std::string(SPILLWAY_SOURCE_DIR) + "/tests/data/reference/";

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

constexpr auto llama = llama_config;

// The sizes of tests/data/reference's config.json files (transformers 5.17).
ModelConfig gqa_config() {
  return llama(2, 64, 8, 2, 96, 128, 259, true, 1e-6f,
               RopeParams{.theta = 500000.0f, .llama3 = true, .factor = 8.0f, .low_freq_factor = 1.0f,
                          .high_freq_factor = 4.0f, .original_context = 16});
}
ModelConfig mha_config() { return llama(2, 64, 4, 4, 160, 64, 300, false, 1e-5f, RopeParams{.theta = 10000.0f}); }

nlohmann::json read_json(const std::string& path) { return nlohmann::json::parse(read_file(path)); }
void write_text(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << text;
}
void write_json(const std::string& path, const nlohmann::json& j) { write_text(path, j.dump(2)); }

// A copy of a reference model directory in `d`/name.
std::string copy_reference(const TempDir& d, const std::string& ref, const std::string& name) {
  const std::string dir = d.file(name);
  fs::create_directory(dir);
  for (const auto& e : fs::directory_iterator(kReference + ref)) {
    if (e.path().filename() == "reference.safetensors") continue;
    fs::copy_file(e.path(), dir + "/" + e.path().filename().string());
  }
  return dir;
}

// Bit patterns, so that a NaN compares too.
std::vector<uint32_t> bits(const std::vector<float>& v) {
  std::vector<uint32_t> b(v.size());
  for (size_t i = 0; i < v.size(); ++i) b[i] = std::bit_cast<uint32_t>(v[i]);
  return b;
}

void expect_same_weights(const ModelWeights& a, const ModelWeights& b) {
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [name, v] : a) {
    auto it = b.find(name);
    ASSERT_NE(it, b.end()) << name;
    EXPECT_EQ(bits(v), bits(it->second)) << name;
  }
}

// Distinct values for every parameter (element j of tensor p: a function of both).
ModelWeights numbered_weights(const ModelConfig& c, float salt) {
  ModelWeights w;
  int p = 0;
  for (const ParamSpec& s : parameter_specs(c)) {
    std::vector<float> v(static_cast<size_t>(s.shape.numel()));
    for (size_t j = 0; j < v.size(); ++j) v[j] = salt + static_cast<float>(p) + static_cast<float>(j) * 1e-3f;
    w[s.name] = std::move(v);
    ++p;
  }
  return w;
}

// A raw safetensors file: each tensor's dtype, shape and bytes as given.
struct RawTensor {
  std::string name, dtype;
  std::vector<int64_t> shape;
  std::string bytes;
};
void write_raw_safetensors(const std::string& path, const std::vector<RawTensor>& tensors,
                           const nlohmann::json& metadata = nullptr) {
  nlohmann::ordered_json h = nlohmann::ordered_json::object();
  if (!metadata.is_null()) h["__metadata__"] = metadata;
  uint64_t off = 0;
  std::string data;
  for (const RawTensor& t : tensors) {
    h[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {off, off + t.bytes.size()}}};
    off += t.bytes.size();
    data += t.bytes;
  }
  std::string text = h.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[static_cast<size_t>(i)] = static_cast<char>((text.size() >> (8 * i)) & 0xff);
  write_text(path, out + text + data);
}

// Every tensor of a safetensors file, converted with `to_dtype` ("BF16" truncates the
// F32 values' low bits, which the reference's random values have, so the test sees
// the rounding; "F32" copies).
std::vector<RawTensor> tensors_of(const std::string& path, const std::string& to_dtype) {
  auto f = SafetensorsReader::open(path);
  EXPECT_TRUE(f.ok()) << f.status().to_string();
  std::vector<RawTensor> out;
  for (const SafetensorsEntry& e : f->entries()) {
    auto v = f->read_f32(e);
    RawTensor t{e.name, to_dtype, e.shape, ""};
    for (float x : *v) {
      if (to_dtype == "BF16") {
        const uint16_t h = static_cast<uint16_t>(std::bit_cast<uint32_t>(x) >> 16);
        t.bytes.append(reinterpret_cast<const char*>(&h), 2);
      } else {
        t.bytes.append(reinterpret_cast<const char*>(&x), 4);
      }
    }
    out.push_back(std::move(t));
  }
  return out;
}

std::string error_of(const Result<ModelConfig>& r) { return r.ok() ? "(no error)" : r.status().message(); }

// ------------------------------------------------------------------ loading

TEST(HfModel, LoadsTheReferenceLlamaDirectoriesAndFiles) {
  auto gqa = infer_model_config(kReference + "llama-gqa");
  ASSERT_TRUE(gqa.ok()) << gqa.status().to_string();
  EXPECT_EQ(*gqa, gqa_config()) << gqa->to_string();
  auto gqa_file = infer_model_config(kReference + "llama-gqa/model.safetensors");  // config.json beside it
  ASSERT_TRUE(gqa_file.ok()) << gqa_file.status().to_string();
  EXPECT_EQ(*gqa_file, gqa_config());
  auto sharded = infer_model_config(kReference + "llama-gqa-sharded/");
  ASSERT_TRUE(sharded.ok()) << sharded.status().to_string();
  EXPECT_EQ(*sharded, gqa_config());
  auto mha = infer_model_config(kReference + "llama-mha");
  ASSERT_TRUE(mha.ok()) << mha.status().to_string();
  EXPECT_EQ(*mha, mha_config()) << mha->to_string();

  // The 6 shards hold the single file's tensors, value for value.
  auto a = import_model(kReference + "llama-gqa", *gqa);
  auto b = import_model(kReference + "llama-gqa-sharded", *sharded);
  ASSERT_TRUE(a.ok()) << a.status().to_string();
  ASSERT_TRUE(b.ok()) << b.status().to_string();
  EXPECT_EQ(a->size(), parameter_specs(*gqa).size());
  EXPECT_FALSE(a->count("lm_head.weight"));
  expect_same_weights(*a, *b);
  auto m = import_model(kReference + "llama-mha", *mha);
  ASSERT_TRUE(m.ok()) << m.status().to_string();
  EXPECT_TRUE(m->count("lm_head.weight"));
  EXPECT_NE(bits(m->at("lm_head.weight")), bits(m->at("model.embed_tokens.weight")));

  // The values are the file's, in order, [out,in] as stored (no transposes for Llama).
  auto f = SafetensorsReader::open(kReference + "llama-gqa/model.safetensors");
  ASSERT_TRUE(f.ok());
  const SafetensorsEntry* q = f->find("model.layers.1.self_attn.q_proj.weight");
  ASSERT_NE(q, nullptr);
  EXPECT_EQ(bits(*f->read_f32(*q)), bits(a->at("model.layers.1.self_attn.q_proj.weight")));
}

TEST(HfModel, BothRopeFormsGiveTheSameConfig) {
  TempDir d;
  // Llama 3's published form: rope_theta and rope_scaling at the top level.
  const std::string gqa = copy_reference(d, "llama-gqa", "gqa");
  nlohmann::json j = read_json(gqa + "/config.json");
  nlohmann::json rp = j["rope_parameters"];
  j.erase("rope_parameters");
  j["rope_theta"] = rp["rope_theta"];
  rp.erase("rope_theta");
  j["rope_scaling"] = rp;
  write_json(gqa + "/config.json", j);
  auto r = infer_model_config(gqa);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(*r, gqa_config());
  // Older still: "type" for "rope_type", integers for the factors.
  j["rope_scaling"] = {{"type", "llama3"}, {"factor", 8}, {"low_freq_factor", 1}, {"high_freq_factor", 4},
                       {"original_max_position_embeddings", 16}};
  write_json(gqa + "/config.json", j);
  r = infer_model_config(gqa);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(*r, gqa_config());
  // Both forms, agreeing (as export_model writes them).
  j["rope_parameters"] = read_json(kReference + "llama-gqa/config.json")["rope_parameters"];
  write_json(gqa + "/config.json", j);
  r = infer_model_config(gqa);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(*r, gqa_config());

  // The default rope: rope_scaling null, or no rope key at all (theta 10000, transformers' default).
  const std::string mha = copy_reference(d, "llama-mha", "mha");
  nlohmann::json m = read_json(mha + "/config.json");
  m.erase("rope_parameters");
  m["rope_theta"] = 10000;
  m["rope_scaling"] = nullptr;
  write_json(mha + "/config.json", m);
  r = infer_model_config(mha);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(*r, mha_config());
  m.erase("rope_theta");
  m.erase("rope_scaling");
  write_json(mha + "/config.json", m);
  r = infer_model_config(mha);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(*r, mha_config());
  // transformers' defaults: no num_key_value_heads = multi-head, no tie_word_embeddings = untied.
  m.erase("num_key_value_heads");
  m.erase("tie_word_embeddings");
  write_json(mha + "/config.json", m);
  r = infer_model_config(mha);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(*r, mha_config());
}

TEST(HfModel, HalfPrecisionWeightsLoadAsTheirValues) {
  TempDir d;
  const std::string dir = copy_reference(d, "llama-gqa", "bf16");
  write_raw_safetensors(dir + "/model.safetensors", tensors_of(kReference + "llama-gqa/model.safetensors", "BF16"),
                        {{"format", "pt"}});
  auto cfg = infer_model_config(dir);
  ASSERT_TRUE(cfg.ok()) << cfg.status().to_string();
  auto w = import_model(dir, *cfg);
  ASSERT_TRUE(w.ok()) << w.status().to_string();
  auto ref = import_model(kReference + "llama-gqa", gqa_config());
  ASSERT_TRUE(ref.ok());
  for (const auto& [name, v] : *ref) {
    const std::vector<float>& got = w->at(name);
    ASSERT_EQ(got.size(), v.size());
    for (size_t i = 0; i < v.size(); ++i)
      ASSERT_EQ(std::bit_cast<uint32_t>(got[i]), std::bit_cast<uint32_t>(v[i]) & 0xffff0000u) << name << " " << i;
  }
}

// A GPT-2 config whose keys would change the math (another activation, epsilon, MLP
// width, an untied head, other attention scaling) is refused by name: they were
// ignored, and an untied lm_head.weight silently dropped.
TEST(HfModel, Gpt2ConfigsThatChangeTheMathAreRefused) {
  TempDir d;
  const std::string dir = copy_reference(d, "gpt2-4x32", "gpt2");
  const std::string config = dir + "/config.json";
  const nlohmann::json good = read_json(config);
  ASSERT_TRUE(infer_model_config(dir).ok());
  auto expect_error = [&](const std::string& key, const nlohmann::json& value, const std::string& part) {
    nlohmann::json j = good;
    j[key] = value;
    write_json(config, j);
    auto r = infer_model_config(dir);
    ASSERT_FALSE(r.ok()) << j.dump();
    EXPECT_TRUE(contains(r.status().message(), config)) << r.status().message();
    EXPECT_TRUE(contains(r.status().message(), part)) << r.status().message();
  };
  expect_error("activation_function", "relu", "activation_function is \"relu\"");
  expect_error("activation_function", "gelu", "activation_function is \"gelu\"");
  expect_error("layer_norm_epsilon", 1e-6, "layer_norm_epsilon is 1e-06");
  expect_error("layer_norm_epsilon", -1, "layer_norm_epsilon");
  expect_error("n_inner", 999, "n_inner is 999");
  expect_error("tie_word_embeddings", false, "tie_word_embeddings is false");
  expect_error("scale_attn_weights", false, "scale_attn_weights is false");
  expect_error("scale_attn_by_inverse_layer_idx", true, "scale_attn_by_inverse_layer_idx is true");
  for (const auto& [key, value] : {std::pair<std::string, nlohmann::json>{"activation_function", "gelu_pytorch_tanh"},
                                   {"n_inner", 512},
                                   {"layer_norm_epsilon", 1e-5}}) {
    nlohmann::json j = good;
    j[key] = value;
    write_json(config, j);
    EXPECT_TRUE(infer_model_config(dir).ok()) << key << " " << value.dump();
  }
}

TEST(HfModel, BadConfigsNameTheFileTheKeyAndTheValue) {
  TempDir d;
  const std::string dir = copy_reference(d, "llama-gqa", "gqa");
  const std::string config = dir + "/config.json";
  const nlohmann::json good = read_json(config);
  auto expect_error = [&](const nlohmann::json& j, const std::vector<std::string>& parts) {
    write_json(config, j);
    auto r = infer_model_config(dir);
    ASSERT_FALSE(r.ok()) << j.dump();
    for (const std::string& part : parts) EXPECT_TRUE(contains(r.status().message(), part)) << r.status().message();
  };
  auto with = [&](const std::string& key, const nlohmann::json& value) {
    nlohmann::json j = good;
    j[key] = value;
    return j;
  };
  auto without = [&](const std::string& key) {
    nlohmann::json j = good;
    j.erase(key);
    return j;
  };
  auto rope_with = [&](const std::string& key, const nlohmann::json& value) {
    nlohmann::json j = good;
    j["rope_parameters"][key] = value;
    return j;
  };
  expect_error(with("model_type", "mistral"), {config, "model_type is \"mistral\""});
  expect_error(rope_with("rope_type", "yarn"), {config, "rope_parameters.rope_type is \"yarn\""});
  expect_error(with("rope_scaling", {{"type", "linear"}, {"factor", 2.0}}), {config, "rope_scaling.type is \"linear\""});
  expect_error(with("hidden_act", "gelu"), {config, "hidden_act is \"gelu\""});
  expect_error(with("attention_bias", true), {config, "attention_bias is true"});
  expect_error(with("mlp_bias", true), {config, "mlp_bias is true"});
  expect_error(with("head_dim", 16), {config, "head_dim is 16", "64 / 8 = 8"});
  expect_error(without("hidden_size"), {config, "no key \"hidden_size\""});
  expect_error(without("vocab_size"), {config, "no key \"vocab_size\""});
  expect_error(with("num_key_value_heads", "2"), {config, "\"num_key_value_heads\" is \"2\" (string)"});
  expect_error(with("num_key_value_heads", 3), {config, "not divisible by kv_heads 3"});
  expect_error(with("intermediate_size", 0), {config, "\"intermediate_size\" is 0"});
  expect_error(with("rms_norm_eps", -1), {config, "\"rms_norm_eps\" is -1"});
  expect_error(with("tie_word_embeddings", 1), {config, "\"tie_word_embeddings\" is 1"});
  {
    nlohmann::json j = good;
    j["rope_parameters"].erase("factor");
    expect_error(j, {config, "rope_parameters of rope_type \"llama3\" has no \"factor\""});
  }
  expect_error(rope_with("partial_rotary_factor", 0.5), {config, "partial_rotary_factor is 0.5"});
  expect_error(with("rope_theta", 10000), {config, "rope_parameters.rope_theta 500000 disagrees with rope_theta 10000"});
  expect_error(with("rope_scaling", {{"rope_type", "llama3"}, {"factor", 32.0}, {"low_freq_factor", 1.0},
                                     {"high_freq_factor", 4.0}, {"original_max_position_embeddings", 16}}),
               {config, "rope_scaling (rope_type llama3, factor 32", "disagree"});
  // A config that contradicts the weights names the tensor, expected and got.
  expect_error(with("intermediate_size", 128),
               {dir + "/model.safetensors", "model.layers.0.mlp.gate_proj.weight", "has shape [96, 64]; expected [128, 64]"});
  expect_error(with("vocab_size", 300), {"model.embed_tokens.weight", "has shape [259, 64]; expected [300, 64]"});
  expect_error(with("num_hidden_layers", 3), {"the config has 3 layers, the weights 2", "model.layers.2"});
  expect_error(with("tie_word_embeddings", false), {"missing 1 tensor(s)", "lm_head.weight", "tie_word_embeddings false"});

  // Flags must agree with the config: both named.
  write_json(config, good);
  StatedModelSizes flags;
  flags.sizes.kv_heads = 4;
  flags.keys = {"--layers", "--width", "--heads", "--model-context", "--vocab", "--kv-heads", "--intermediate"};
  auto r = infer_model_config(dir, flags);
  EXPECT_TRUE(contains(error_of(r), "--kv-heads 4 disagrees with num_key_value_heads 2 (" + config + ")")) << error_of(r);
  flags.sizes.kv_heads = 2;
  flags.sizes.heads = 8;
  EXPECT_TRUE(infer_model_config(dir, flags).ok());

  // Llama weights with no config.json: an error asking for it, not a guess.
  fs::remove(config);
  r = infer_model_config(dir);
  EXPECT_TRUE(contains(error_of(r), "there is no " + config)) << error_of(r);
  EXPECT_TRUE(contains(error_of(r), "put the model's config.json there")) << error_of(r);
  // A directory with no weights.
  const std::string empty = d.file("empty");
  fs::create_directory(empty);
  r = infer_model_config(empty);
  EXPECT_TRUE(contains(error_of(r), "holds neither model.safetensors nor model.safetensors.index.json")) << error_of(r);
  r = infer_model_config(d.file("nope"));
  EXPECT_TRUE(contains(error_of(r), d.file("nope") + ": no such file")) << error_of(r);
}

TEST(HfModel, ShardsThatDoNotMatchTheIndexAreNamed) {
  TempDir d;
  const std::string src = kReference + "llama-gqa-sharded/";
  const std::string index_name = "model.safetensors.index.json";
  const nlohmann::json index = read_json(src + index_name);
  auto fresh = [&](const std::string& name) { return copy_reference(d, "llama-gqa-sharded", name); };
  auto expect_error = [&](const std::string& dir, const std::vector<std::string>& parts) {
    auto r = infer_model_config(dir);
    ASSERT_FALSE(r.ok()) << dir;
    for (const std::string& part : parts) EXPECT_TRUE(contains(r.status().message(), part)) << r.status().message();
    auto w = import_model(dir, gqa_config());
    ASSERT_FALSE(w.ok());
    for (const std::string& part : parts) EXPECT_TRUE(contains(w.status().message(), part)) << w.status().message();
  };
  // A missing shard.
  std::string dir = fresh("missing");
  fs::remove(dir + "/model-00003-of-00006.safetensors");
  expect_error(dir, {"shard model-00003-of-00006.safetensors does not exist", "maps 2 tensor(s) to it",
                     "model.layers.0.mlp.gate_proj.weight"});
  // The index maps a tensor to a shard that lacks it.
  dir = fresh("lacks");
  nlohmann::json j = index;
  j["weight_map"]["model.norm.weight"] = "model-00001-of-00006.safetensors";
  write_json(dir + "/" + index_name, j);
  expect_error(dir, {dir + "/model-00001-of-00006.safetensors", "lacks tensor 'model.norm.weight'"});
  // A shard holds a tensor the index does not list.
  dir = fresh("unlisted");
  j = index;
  j["weight_map"].erase("model.norm.weight");
  write_json(dir + "/" + index_name, j);
  expect_error(dir, {dir + "/model-00006-of-00006.safetensors", "holds tensor 'model.norm.weight'", "does not list"});
  // A tensor in two shards (the index maps it to one).
  dir = fresh("twice");
  {
    std::vector<RawTensor> t = tensors_of(src + "model-00005-of-00006.safetensors", "F32");
    for (const RawTensor& x : tensors_of(src + "model-00006-of-00006.safetensors", "F32"))
      if (x.name == "model.norm.weight") t.push_back(x);
    write_raw_safetensors(dir + "/model-00005-of-00006.safetensors", t, {{"format", "pt"}});
  }
  expect_error(dir, {"model.norm.weight", "model-00005-of-00006.safetensors", "model-00006-of-00006.safetensors"});
  // A shard name that leaves the directory.
  dir = fresh("escape");
  j = index;
  j["weight_map"]["model.norm.weight"] = "../model-00006-of-00006.safetensors";
  write_json(dir + "/" + index_name, j);
  expect_error(dir, {index_name, "\"../model-00006-of-00006.safetensors\"", "expected the name of a file in"});
  // Not JSON.
  dir = fresh("notjson");
  write_text(dir + "/" + index_name, "{\"weight_map\": ");
  expect_error(dir, {dir + "/" + index_name, "not valid JSON"});
  // A wrong shape in one shard names that shard.
  dir = fresh("shape");
  {
    std::vector<RawTensor> t = tensors_of(src + "model-00006-of-00006.safetensors", "F32");
    for (RawTensor& x : t)
      if (x.name == "model.norm.weight") {
        x.shape = {32};
        x.bytes.resize(32 * 4);
      }
    write_raw_safetensors(dir + "/model-00006-of-00006.safetensors", t, {{"format", "pt"}});
  }
  expect_error(dir, {dir + "/model-00006-of-00006.safetensors", "'model.norm.weight' has shape [32]; expected [64]"});
  // A dtype that is not a float.
  dir = fresh("dtype");
  {
    std::vector<RawTensor> t = tensors_of(src + "model-00006-of-00006.safetensors", "F32");
    for (RawTensor& x : t)
      if (x.name == "model.norm.weight") x.dtype = "I32";
    write_raw_safetensors(dir + "/model-00006-of-00006.safetensors", t, {{"format", "pt"}});
  }
  expect_error(dir, {dir + "/model-00006-of-00006.safetensors", "'model.norm.weight' has dtype I32"});
  // An unknown tensor.
  dir = fresh("extra");
  {
    std::vector<RawTensor> t = tensors_of(src + "model-00006-of-00006.safetensors", "F32");
    t.push_back({"model.layers.0.self_attn.q_norm.weight", "F32", {1}, std::string(4, '\0')});
    write_raw_safetensors(dir + "/model-00006-of-00006.safetensors", t, {{"format", "pt"}});
    j = index;
    j["weight_map"]["model.layers.0.self_attn.q_norm.weight"] = "model-00006-of-00006.safetensors";
    write_json(dir + "/" + index_name, j);
  }
  expect_error(dir, {"1 unexpected tensor(s)", "model.layers.0.self_attn.q_norm.weight"});
  // transformers' order: model.safetensors wins over an index.
  dir = fresh("both");
  fs::copy_file(kReference + "llama-gqa/model.safetensors", dir + "/model.safetensors");
  fs::remove(dir + "/model-00001-of-00006.safetensors");
  EXPECT_TRUE(infer_model_config(dir).ok());
}

TEST(HfModel, ATiedModelsStoredLmHeadMustBeTheEmbedding) {
  TempDir d;
  const std::string dir = copy_reference(d, "llama-gqa", "tied");
  std::vector<RawTensor> t = tensors_of(kReference + "llama-gqa/model.safetensors", "F32");
  RawTensor head;
  for (const RawTensor& x : t)
    if (x.name == "model.embed_tokens.weight") head = x;
  head.name = "lm_head.weight";
  t.push_back(head);
  write_raw_safetensors(dir + "/model.safetensors", t, {{"format", "pt"}});
  auto cfg = infer_model_config(dir);
  ASSERT_TRUE(cfg.ok()) << cfg.status().to_string();
  auto w = import_model(dir, *cfg);
  ASSERT_TRUE(w.ok()) << w.status().to_string();  // equal: loaded, the head is the embedding
  EXPECT_FALSE(w->count("lm_head.weight"));
  // One element different: refused, naming it.
  t.back().bytes[4 * 1000 + 3] ^= 0x40;
  write_raw_safetensors(dir + "/model.safetensors", t, {{"format", "pt"}});
  w = import_model(dir, *cfg);
  ASSERT_FALSE(w.ok());
  EXPECT_TRUE(contains(w.status().message(), "'lm_head.weight' element 1000")) << w.status().message();
  EXPECT_TRUE(contains(w.status().message(), "tie_word_embeddings")) << w.status().message();
}

// ------------------------------------------------------------------ saving

// Saves `c` with numbered weights to `path`, loads it back: the same config and bits.
void round_trip(const ModelConfig& c, const std::string& path, const ExportOptions& options = {}) {
  const ModelWeights w = numbered_weights(c, 0.5f);
  Status s = export_model(path, c, w, options);
  ASSERT_TRUE(s.is_ok()) << s.to_string();
  auto back_cfg = infer_model_config(path);
  ASSERT_TRUE(back_cfg.ok()) << back_cfg.status().to_string();
  EXPECT_EQ(*back_cfg, c) << back_cfg->to_string() << " vs " << c.to_string();
  auto back = import_model(path, c);
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  expect_same_weights(w, *back);
}

TEST(HfModel, SaveThenLoadThroughADirectoryIsBitExact) {
  TempDir d;
  auto tiny_llama = model_preset("llama-tiny");
  ASSERT_TRUE(tiny_llama.ok());
  ModelConfig tied = *tiny_llama;
  tied.layers = 2;
  ModelConfig untied = tied;
  untied.tied = false;
  untied.rope = RopeParams{.theta = 10000.0f};
  untied.norm_eps = 1e-6f;
  auto gpt = model_preset("tiny");
  ASSERT_TRUE(gpt.ok());
  gpt->layers = 2;

  for (const ModelConfig& c : {tied, untied, *gpt}) {
    SCOPED_TRACE(c.to_string());
    const std::string name = std::string(arch_name(c.arch)) + (c.tied ? "-tied" : "-untied");
    // One file in a directory.
    const std::string single = d.file(name);
    round_trip(c, single);
    EXPECT_EQ(names_in(single), (std::vector<std::string>{"config.json", "model.safetensors"}));
    nlohmann::json j = read_json(single + "/config.json");
    EXPECT_EQ(j["model_type"], arch_name(c.arch));
    EXPECT_EQ(j["architectures"][0], c.arch == Arch::Llama ? "LlamaForCausalLM" : "GPT2LMHeadModel");
    EXPECT_EQ(j["dtype"], "float32");
    EXPECT_EQ(j["torch_dtype"], "float32");
    if (c.arch == Arch::Llama) {
      EXPECT_EQ(j["tie_word_embeddings"], c.tied);
      EXPECT_EQ(j["rms_norm_eps"].dump(), c.norm_eps == 1e-6f ? "1e-06" : "1e-05");  // the float's shortest decimal
      EXPECT_EQ(j["rope_parameters"]["rope_type"], c.rope.llama3 ? "llama3" : "default");
      EXPECT_EQ(j["rope_scaling"].is_null(), !c.rope.llama3);
    }
    // Shards of at most 40 KB (a tensor larger than that alone), with the index.
    const std::string sharded = d.file(name + "-sharded");
    const uint64_t limit = 40'000;
    round_trip(c, sharded, {.shard_bytes = limit});
    const nlohmann::json index = read_json(sharded + "/model.safetensors.index.json");
    std::set<std::string> shard_files;
    for (auto it = index["weight_map"].begin(); it != index["weight_map"].end(); ++it) shard_files.insert(it.value());
    ASSERT_GT(shard_files.size(), 2u);
    uint64_t total = 0;
    size_t k = 1;
    for (const std::string& f : shard_files) {
      char want[64];
      std::snprintf(want, sizeof want, "model-%05zu-of-%05zu.safetensors", k++, shard_files.size());
      EXPECT_EQ(f, want);
      auto r = SafetensorsReader::open(sharded + "/" + f);
      ASSERT_TRUE(r.ok()) << r.status().to_string();
      uint64_t bytes = 0;
      for (const SafetensorsEntry& e : r->entries()) bytes += e.end - e.begin;
      EXPECT_TRUE(bytes <= limit || r->entries().size() == 1) << f << " " << bytes;
      total += bytes;
    }
    EXPECT_EQ(index["metadata"]["total_size"].get<uint64_t>(), total);
    EXPECT_EQ(total, static_cast<uint64_t>(c.num_parameters()) * 4);
    EXPECT_EQ(index["weight_map"].size(), parameter_specs(c).size());
    // No temporary folder is left beside them.
    for (const std::string& n : names_in(d.path())) EXPECT_FALSE(contains(n, ".tmp-")) << n;
  }
  // A Llama in one .safetensors file carries its config in __metadata__.
  const std::string file = d.file("llama.safetensors");
  round_trip(untied, file);
  auto f = SafetensorsReader::open(file);
  ASSERT_TRUE(f.ok());
  ASSERT_TRUE(f->metadata().count("config"));
  EXPECT_EQ(nlohmann::json::parse(f->metadata().at("config"))["model_type"], "llama");
}

TEST(HfModel, ASaveReplacesAnEarlierSaveButNoOtherFolder) {
  TempDir d;
  auto c = model_preset("llama-tiny");
  ASSERT_TRUE(c.ok());
  c->layers = 2;
  const std::string dir = d.file("run");
  // First sharded, then one file: the shards and the index of the first are gone.
  ASSERT_TRUE(export_model(dir, *c, numbered_weights(*c, 1.0f), {.shard_bytes = 40'000}).is_ok());
  ASSERT_GT(names_in(dir).size(), 3u);
  const ModelWeights second = numbered_weights(*c, 2.0f);
  Status s = export_model(dir + "/", *c, second);
  ASSERT_TRUE(s.is_ok()) << s.to_string();
  EXPECT_EQ(names_in(dir), (std::vector<std::string>{"config.json", "model.safetensors"}));
  auto back = import_model(dir, *c);
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  expect_same_weights(second, *back);
  EXPECT_EQ(names_in(d.path()), (std::vector<std::string>{"run"}));
  EXPECT_TRUE(check_model_directory_replaceable(dir).is_ok());

  // A folder with something a save does not write (a tokenizer) is left as it was.
  write_text(dir + "/tokenizer.json", "{}");
  EXPECT_FALSE(check_model_directory_replaceable(dir).is_ok());
  s = export_model(dir, *c, numbered_weights(*c, 3.0f));
  ASSERT_FALSE(s.is_ok());
  EXPECT_TRUE(contains(s.message(), "tokenizer.json")) << s.to_string();
  EXPECT_TRUE(contains(s.message(), "save into a new folder")) << s.to_string();
  back = import_model(dir, *c);
  ASSERT_TRUE(back.ok());
  expect_same_weights(second, *back);
  EXPECT_EQ(names_in(d.path()), (std::vector<std::string>{"run"}));  // the temporary folder removed
  // A file where the folder would go.
  write_text(d.file("plain"), "x");
  s = export_model(d.file("plain"), *c, second);
  EXPECT_TRUE(contains(s.message(), "is not a folder")) << s.to_string();
  // A failing source leaves nothing behind.
  s = export_model(d.file("fails"), *c, [](const ParamSpec& p) -> Result<std::vector<float>> {
    return Status::io_error("cannot read " + p.name);
  });
  EXPECT_FALSE(s.is_ok());
  EXPECT_EQ(names_in(d.path()), (std::vector<std::string>{"plain", "run"}));
}

}  // namespace
}  // namespace spillway
