#include <gtest/gtest.h>

#include "support/test_support.h"
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>

#include "model/hf_model.h"
#include "model/safetensors.h"

using namespace spillway;

namespace {

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

using spillway::testing_support::TempDir;

// A tensor to put in a hand-made safetensors file: raw little-endian bytes.
struct Raw {
  std::string name, dtype;
  std::vector<int64_t> shape;
  std::string bytes;
};

std::string f32_bytes(const std::vector<float>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * 4);
}

std::string header_for(const std::vector<Raw>& tensors, const nlohmann::json& metadata) {
  nlohmann::ordered_json h = nlohmann::ordered_json::object();
  if (!metadata.is_null()) h["__metadata__"] = metadata;
  uint64_t off = 0;
  for (const Raw& t : tensors) {
    h[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {off, off + t.bytes.size()}}};
    off += t.bytes.size();
  }
  return h.dump();
}

void write_raw_file(const std::string& path, const std::string& header, const std::string& data,
                    uint64_t header_len_override = 0) {
  std::ofstream f(path, std::ios::binary);
  uint64_t len = header_len_override ? header_len_override : header.size();
  f.write(reinterpret_cast<const char*>(&len), 8);
  f.write(header.data(), static_cast<std::streamsize>(header.size()));
  f.write(data.data(), static_cast<std::streamsize>(data.size()));
}

void write_raw(const std::string& path, const std::vector<Raw>& tensors, const nlohmann::json& metadata = {}) {
  std::string data;
  for (const Raw& t : tensors) data += t.bytes;
  write_raw_file(path, header_for(tensors, metadata), data);
}

// A small GPT-2 in the Hugging Face layout: names without "transformer.", Conv1D
// weights [in,out], the attention buffers and a tied lm_head. Values: multiples of
// 1/64 with at most 8 significant bits (exact in F32, BF16 and F16), distinct within
// each tensor of up to 256 elements so that a wrong transpose shows.
ModelConfig micro_config() { return ModelConfig{2, 8, 2, 4, 16}; }

float micro_value(size_t p, size_t j) {
  return static_cast<float>(static_cast<int>((p * 37 + j * 11) % 256) - 128) / 64.0f;
}

std::vector<Raw> hf_checkpoint(const ModelConfig& c, const std::string& dtype) {
  std::vector<Raw> out;
  std::vector<ParamSpec> specs = parameter_specs(c);
  for (size_t p = 0; p < specs.size(); ++p) {
    const ParamSpec& s = specs[p];
    std::vector<int64_t> shape = s.shape.dims;
    if (s.conv1d) std::swap(shape[0], shape[1]);
    size_t n = static_cast<size_t>(s.shape.numel());
    // Our element (o, i) is stored at HF position (i, o).
    std::vector<float> hf(n);
    for (size_t j = 0; j < n; ++j) {
      size_t pos = j;
      if (s.conv1d) {
        size_t o = j / s.shape[1], i = j % s.shape[1];
        pos = i * s.shape[0] + o;
      }
      hf[pos] = micro_value(p, j);
    }
    std::string bytes;
    if (dtype == "F32") {
      bytes = f32_bytes(hf);
    } else if (dtype == "BF16") {
      for (float f : hf) {
        uint16_t b = static_cast<uint16_t>(std::bit_cast<uint32_t>(f) >> 16);
        bytes.append(reinterpret_cast<const char*>(&b), 2);
      }
    } else {  // F16, normal numbers only: values are multiples of 1/64 below 16
      for (float f : hf) {
        uint32_t u = std::bit_cast<uint32_t>(f);
        uint16_t h = 0;
        if (f != 0.0f) {
          int32_t e = static_cast<int32_t>((u >> 23) & 0xff) - 127 + 15;
          h = static_cast<uint16_t>(((u >> 16) & 0x8000) | (e << 10) | ((u >> 13) & 0x3ff));
        }
        bytes.append(reinterpret_cast<const char*>(&h), 2);
      }
    }
    std::string name = s.name.substr(std::string("transformer.").size());
    out.push_back({name, dtype, shape, bytes});
  }
  for (int i = 0; i < c.layers; ++i) {
    std::string h = "h." + std::to_string(i) + ".";
    out.push_back({h + "attn.bias", "F32", {1, 1, c.context, c.context},
                   f32_bytes(std::vector<float>(size_t(c.context) * c.context, 1.0f))});
    out.push_back({h + "attn.masked_bias", "F32", {}, f32_bytes({-1e4f})});
  }
  out.push_back({"lm_head.weight", "F32", {c.vocab, c.width}, f32_bytes(std::vector<float>(size_t(c.vocab) * c.width))});
  return out;
}

ModelWeights random_weights(const ModelConfig& c, uint64_t seed) {
  ModelWeights w;
  for (const ParamSpec& s : parameter_specs(c)) {
    ParamSpec as_weight = s;
    as_weight.name = "x.weight";  // every tensor gets random values, biases and LayerNorms too
    std::vector<float> v = init_parameter(c, as_weight, seed + w.size());
    w[s.name] = std::move(v);
  }
  return w;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

}  // namespace

TEST(Safetensors, ExportImportRoundTripIsBitExact) {
  TempDir d;
  ModelConfig c = *model_preset("tiny");
  ModelWeights w = random_weights(c, 7);
  // Special values survive too.
  std::vector<float>& b = w["transformer.ln_f.bias"];
  b[0] = -0.0f;
  b[1] = std::numeric_limits<float>::denorm_min();
  b[2] = std::numeric_limits<float>::infinity();
  b[3] = std::bit_cast<float>(0x7fc01234u);  // a NaN with payload
  std::string path = d.file("tiny.safetensors");
  Status s = export_model(path, c, w);
  ASSERT_TRUE(s.is_ok()) << s.to_string();
  auto back = import_model(path, c, {.allow_nonfinite = true});
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  ASSERT_EQ(back->size(), w.size());
  for (const auto& [name, values] : w) EXPECT_TRUE(same_bits(values, back->at(name))) << name;
  auto cfg = infer_model_config(path);
  ASSERT_TRUE(cfg.ok()) << cfg.status().to_string();
  EXPECT_EQ(*cfg, c);
}

TEST(Safetensors, ExportUsesHuggingFaceNamesAndConv1DLayout) {
  TempDir d;
  ModelConfig c = micro_config();
  ModelWeights w = random_weights(c, 3);
  std::string path = d.file("m.safetensors");
  ASSERT_TRUE(export_model(path, c, w).is_ok());
  auto f = SafetensorsReader::open(path);
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  EXPECT_EQ(f->entries().size(), parameter_specs(c).size());
  EXPECT_EQ(f->metadata().at("n_head"), "2");
  EXPECT_EQ(f->metadata().at("format"), "pt");
  const int64_t C = c.width;
  for (const ParamSpec& s : parameter_specs(c)) {
    const SafetensorsEntry* e = f->find(s.name);
    ASSERT_NE(e, nullptr) << s.name;
    EXPECT_EQ(e->dtype, "F32");
    auto v = f->read_f32(*e);
    ASSERT_TRUE(v.ok());
    const std::vector<float>& ours = w.at(s.name);
    if (!s.conv1d) {
      EXPECT_EQ(e->shape, s.shape.dims) << s.name;
      EXPECT_TRUE(same_bits(*v, ours)) << s.name;
      continue;
    }
    // [in, out] in the file; ours is [out, in].
    int64_t out = s.shape[0], in = s.shape[1];
    EXPECT_EQ(e->shape, (std::vector<int64_t>{in, out})) << s.name;
    for (int64_t o = 0; o < out; ++o)
      for (int64_t i = 0; i < in; ++i) ASSERT_EQ((*v)[i * out + o], ours[o * in + i]) << s.name;
  }
  EXPECT_EQ(f->find("transformer.h.0.attn.c_attn.weight")->shape, (std::vector<int64_t>{C, 3 * C}));
  EXPECT_EQ(f->find("transformer.h.1.mlp.c_proj.weight")->shape, (std::vector<int64_t>{4 * C, C}));
  // Header: 8-byte length, JSON padded to a multiple of 8, data right after.
  std::ifstream in(path, std::ios::binary);
  uint64_t len = 0;
  in.read(reinterpret_cast<char*>(&len), 8);
  EXPECT_EQ(len % 8, 0u);
  std::string header(len, '\0');
  in.read(header.data(), static_cast<std::streamsize>(len));
  auto j = nlohmann::json::parse(header);
  uint64_t total = 0;
  for (auto& [k, v] : j.items())
    if (k != "__metadata__") total += v["data_offsets"][1].get<uint64_t>() - v["data_offsets"][0].get<uint64_t>();
  in.seekg(0, std::ios::end);
  EXPECT_EQ(static_cast<uint64_t>(in.tellg()), 8 + len + total);
  EXPECT_EQ(total, static_cast<uint64_t>(c.num_parameters()) * 4);
}

TEST(Safetensors, ImportsHuggingFaceLayoutInEveryDtype) {
  TempDir d;
  ModelConfig c = micro_config();
  for (const char* dtype : {"F32", "BF16", "F16"}) {
    std::string path = d.file(std::string("hf_") + dtype + ".safetensors");
    write_raw(path, hf_checkpoint(c, dtype));
    auto w = import_model(path, c);
    ASSERT_TRUE(w.ok()) << dtype << ": " << w.status().to_string();
    std::vector<ParamSpec> specs = parameter_specs(c);
    for (size_t p = 0; p < specs.size(); ++p) {
      const std::vector<float>& v = w->at(specs[p].name);
      ASSERT_EQ(v.size(), static_cast<size_t>(specs[p].shape.numel()));
      for (size_t j = 0; j < v.size(); ++j) ASSERT_EQ(v[j], micro_value(p, j)) << dtype << " " << specs[p].name << " " << j;
    }
    // No n_head in the metadata: heads = width / 64 cannot hold for width 8.
    auto cfg = infer_model_config(path);
    ASSERT_FALSE(cfg.ok());
    EXPECT_TRUE(contains(cfg.status().message(), "n_head")) << cfg.status().message();
  }
  std::string with_heads = d.file("hf_meta.safetensors");
  write_raw(with_heads, hf_checkpoint(c, "F32"), {{"n_head", "2"}});
  auto cfg = infer_model_config(with_heads);
  ASSERT_TRUE(cfg.ok()) << cfg.status().to_string();
  EXPECT_EQ(*cfg, c);
}

TEST(Safetensors, HalfPrecisionConversionIsExact) {
  TempDir d;
  // F16: 1, -2, smallest subnormal 2^-24, largest subnormal, 65504, inf, -0.
  std::vector<uint16_t> h = {0x3c00, 0xc000, 0x0001, 0x03ff, 0x7bff, 0x7c00, 0x8000};
  std::vector<float> want = {1.0f, -2.0f, std::ldexp(1.0f, -24), std::ldexp(1023.0f, -24), 65504.0f,
                             std::numeric_limits<float>::infinity(), -0.0f};
  std::string bytes(reinterpret_cast<const char*>(h.data()), h.size() * 2);
  std::vector<uint16_t> bf = {0x3f80, 0xc040, 0x0001};
  std::string bbytes(reinterpret_cast<const char*>(bf.data()), bf.size() * 2);
  std::string path = d.file("half.safetensors");
  write_raw(path, {{"h", "F16", {7}, bytes}, {"b", "BF16", {3}, bbytes}});
  auto f = SafetensorsReader::open(path);
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  auto v = f->read_f32(*f->find("h"));
  ASSERT_TRUE(v.ok());
  EXPECT_TRUE(same_bits(*v, want));
  auto b = f->read_f32(*f->find("b"));
  ASSERT_TRUE(b.ok());
  EXPECT_EQ((*b)[0], 1.0f);
  EXPECT_EQ((*b)[1], -3.0f);
  EXPECT_EQ(std::bit_cast<uint32_t>((*b)[2]), 0x00010000u);
}

TEST(Safetensors, AcceptsPrefixedAndUnprefixedNamesButNotBoth) {
  TempDir d;
  ModelConfig c = micro_config();
  std::vector<Raw> t = hf_checkpoint(c, "F32");
  for (size_t i = 0; i < t.size(); i += 2) t[i].name = "transformer." + t[i].name;  // a mix
  std::string path = d.file("mixed.safetensors");
  write_raw(path, t);
  EXPECT_TRUE(import_model(path, c).ok());
  t.push_back({"wte.weight", "F32", {c.vocab, c.width}, f32_bytes(std::vector<float>(size_t(c.vocab) * c.width))});
  t[0].name = "transformer.wte.weight";
  write_raw(path, t);
  auto r = import_model(path, c);
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(contains(r.status().message(), "'wte.weight' appears twice")) << r.status().message();
}

TEST(Safetensors, MissingTensorsAreNamed) {
  TempDir d;
  ModelConfig c = micro_config();
  std::vector<Raw> t = hf_checkpoint(c, "F32");
  std::erase_if(t, [](const Raw& r) { return r.name == "h.1.ln_2.bias" || r.name == "wpe.weight"; });
  std::string path = d.file("missing.safetensors");
  write_raw(path, t);
  auto r = import_model(path, c);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::NotFound);
  EXPECT_TRUE(contains(r.status().message(), path)) << r.status().message();
  EXPECT_TRUE(contains(r.status().message(), "missing 2 tensor(s)")) << r.status().message();
  EXPECT_TRUE(contains(r.status().message(), "wpe.weight")) << r.status().message();
  EXPECT_TRUE(contains(r.status().message(), "h.1.ln_2.bias")) << r.status().message();

  // A config with more layers than the file: the missing block is named.
  ModelConfig deeper = c;
  deeper.layers = 3;
  write_raw(path, hf_checkpoint(c, "F32"));
  r = import_model(path, deeper);
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(contains(r.status().message(), "h.2.ln_1.weight")) << r.status().message();
  // Fewer: the extra block is named.
  ModelConfig shallower = c;
  shallower.layers = 1;
  r = import_model(path, shallower);
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(contains(r.status().message(), "unexpected tensor(s)")) << r.status().message();
  EXPECT_TRUE(contains(r.status().message(), "h.1.attn.c_attn.bias")) << r.status().message();
}

TEST(Safetensors, WrongShapeOrDtypeIsNamed) {
  TempDir d;
  ModelConfig c = micro_config();
  const int64_t C = c.width;
  std::string path = d.file("bad.safetensors");

  // c_attn stored in our [out,in] layout instead of Conv1D [in,out].
  std::vector<Raw> t = hf_checkpoint(c, "F32");
  for (Raw& r : t)
    if (r.name == "h.0.attn.c_attn.weight") r.shape = {3 * C, C};
  write_raw(path, t);
  auto r = import_model(path, c);
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(contains(r.status().message(), "'h.0.attn.c_attn.weight' has shape [24, 8]; expected [8, 24]"))
      << r.status().message();
  EXPECT_TRUE(contains(r.status().message(), "Conv1D")) << r.status().message();

  t = hf_checkpoint(c, "F32");
  for (Raw& r : t)
    if (r.name == "ln_f.weight") r.dtype = "I32";
  write_raw(path, t);
  r = import_model(path, c);
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(contains(r.status().message(), "'ln_f.weight' has dtype I32; expected F32, F16 or BF16"))
      << r.status().message();
}

TEST(Safetensors, BadHeadersAreRejectedWithTheFileName) {
  TempDir d;
  std::string path = d.file("h.safetensors");
  auto expect_error = [&](const std::string& part) {
    auto r = SafetensorsReader::open(path);
    ASSERT_FALSE(r.ok()) << part;
    EXPECT_EQ(r.status().code(), StatusCode::Corrupt) << r.status().message();
    EXPECT_TRUE(contains(r.status().message(), path)) << r.status().message();
    EXPECT_TRUE(contains(r.status().message(), part)) << r.status().message();
  };
  std::string ok_header = header_for({{"x", "F32", {2}, f32_bytes({1, 2})}}, {});
  write_raw_file(path, ok_header, f32_bytes({1, 2}));
  ASSERT_TRUE(SafetensorsReader::open(path).ok());

  write_raw_file(path, ok_header, f32_bytes({1, 2}), /*header_len_override=*/1000);
  expect_error("header length 1000 runs past the end of the file");

  write_raw_file(path, "{\"x\": {\"dtype\": ", "");
  expect_error("not valid JSON");

  write_raw_file(path, "[1, 2]", "");
  expect_error("not a JSON object");

  write_raw_file(path, R"({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 16]}})", f32_bytes({1, 2}));
  expect_error("data_offsets [0, 16] out of range of the data buffer (8 bytes)");

  write_raw_file(path, R"({"x": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}})", f32_bytes({1, 2}));
  expect_error("need 12");

  write_raw_file(path, R"({"x": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}})", f32_bytes({1, 2}));
  expect_error("out of range");

  write_raw_file(path, R"({"x": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 8]}})", f32_bytes({1, 2}));
  expect_error("unknown dtype 'Q4'");

  write_raw_file(path, R"({"x": {"shape": [2], "data_offsets": [0, 8]}})", f32_bytes({1, 2}));
  expect_error("\"dtype\"");

  {
    std::ofstream f(path, std::ios::binary);
    f.write("abc", 3);
  }
  expect_error("too short");

  auto missing = SafetensorsReader::open(d.file("nope.safetensors"));
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::NotFound);
  EXPECT_TRUE(contains(missing.status().message(), "nope.safetensors")) << missing.status().message();
  EXPECT_FALSE(import_model(d.file("nope.safetensors"), micro_config()).ok());
}

TEST(Safetensors, OverlappingOrGappedDataIsRefused) {
  TempDir d;
  std::string path = d.file("overlap.safetensors");
  auto expect_error = [&](const std::vector<std::string>& parts) {
    auto r = SafetensorsReader::open(path);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::Corrupt) << r.status().message();
    EXPECT_TRUE(contains(r.status().message(), path)) << r.status().message();
    for (const std::string& part : parts) EXPECT_TRUE(contains(r.status().message(), part)) << r.status().message();
  };
  // A whole GPT-2 whose tensors all point at the same bytes (the largest tensor's).
  ModelConfig c = micro_config();
  std::vector<Raw> t = hf_checkpoint(c, "F32");
  nlohmann::ordered_json h = nlohmann::ordered_json::object();
  h["__metadata__"] = {{"n_head", "2"}};
  size_t largest = 0;
  for (const Raw& r : t) {
    h[r.name] = {{"dtype", r.dtype}, {"shape", r.shape}, {"data_offsets", {0, r.bytes.size()}}};
    largest = std::max(largest, r.bytes.size());
  }
  write_raw_file(path, h.dump(), std::string(largest, '\0'));
  expect_error({"overlap", "data_offsets [0, "});
  EXPECT_FALSE(infer_model_config(path).ok());
  EXPECT_FALSE(import_model(path, c).ok());

  // Two tensors on the same bytes: both named, with their ranges.
  const std::string two = f32_bytes({1, 2});
  write_raw_file(path, R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                          "b": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})", two);
  expect_error({"tensors 'a' (data_offsets [0, 8]) and 'b' (data_offsets [0, 8]) overlap"});
  // A partial overlap.
  write_raw_file(path, R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                          "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})", two + two);
  expect_error({"tensors 'a' (data_offsets [0, 8]) and 'b' (data_offsets [4, 12]) overlap"});
  // A gap between tensors, before the first, and bytes after the last.
  write_raw_file(path, R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                          "b": {"dtype": "F32", "shape": [2], "data_offsets": [12, 20]}})", two + two + two);
  expect_error({"bytes [8, 12) of the data buffer belong to no tensor",
                "between tensors 'a' (data_offsets [0, 8]) and 'b' (data_offsets [12, 20])"});
  write_raw_file(path, R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})", two + two);
  expect_error({"bytes [0, 4)", "before the first tensor 'a'"});
  write_raw_file(path, R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})", two + two);
  expect_error({"the data buffer is 16 bytes but the tensors end at byte 8", "'a'"});
  // Out of order in the header but tiling the buffer: fine (order in the header does not matter).
  write_raw_file(path, R"({"b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]},
                          "e": {"dtype": "F32", "shape": [0], "data_offsets": [8, 8]},
                          "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})", two + two);
  auto ok = SafetensorsReader::open(path);
  ASSERT_TRUE(ok.ok()) << ok.status().to_string();
  EXPECT_EQ(ok->entries().size(), 3u);
}

namespace {

// A transformers-style tiny GPT-2: width 128 with 4 heads of size 32, so the head
// count cannot be read off the width; no n_head in the __metadata__.
ModelConfig head32_config() { return ModelConfig{2, 128, 4, 16, 64}; }

void write_text(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary);
  f << text;
}

nlohmann::json hf_config_json(const ModelConfig& c) {
  return {{"model_type", "gpt2"}, {"architectures", {"GPT2LMHeadModel"}}, {"activation_function", "gelu_new"},
          {"n_layer", c.layers}, {"n_embd", c.width}, {"n_head", c.heads}, {"n_positions", c.context},
          {"n_ctx", c.context}, {"vocab_size", c.vocab}, {"n_inner", nullptr}, {"layer_norm_epsilon", 1e-5}};
}

StatedModelSizes flag_sizes(ModelConfig sizes) {
  StatedModelSizes f;
  f.sizes = sizes;
  f.keys = {"--layers", "--width", "--heads", "--model-context", "--vocab"};
  return f;
}

}  // namespace

TEST(Safetensors, HeadsComeFromConfigJsonMetadataOrFlagsNeverGuessed) {
  TempDir d;
  const ModelConfig c = head32_config();
  const std::string path = d.file("model.safetensors");
  const std::string config = d.file("config.json");
  write_raw(path, hf_checkpoint(c, "F32"));

  // No config.json, no n_head: an error asking for --heads (width/64 would give 2).
  auto r = infer_model_config(path);
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(contains(r.status().message(), "--heads")) << r.status().message();
  EXPECT_TRUE(contains(r.status().message(), "no config.json beside it (" + config + ")")) << r.status().message();
  // The flag settles it.
  r = infer_model_config(path, flag_sizes({0, 0, 4, 0, 0}));
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(*r, c);

  // config.json beside the file, as transformers saves it.
  write_text(config, hf_config_json(c).dump(2));
  r = infer_model_config(path);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(*r, c);
  EXPECT_EQ(r->heads, 4);
  auto import = import_model(path, *r);
  EXPECT_TRUE(import.ok()) << import.status().to_string();
  // Flags that agree are fine; one that disagrees names both values and their sources.
  EXPECT_TRUE(infer_model_config(path, flag_sizes({2, 128, 4, 16, 64})).ok());
  r = infer_model_config(path, flag_sizes({0, 0, 2, 0, 0}));
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(contains(r.status().message(), "--heads 2 disagrees with n_head 4 (" + config + ")"))
      << r.status().message();
  r = infer_model_config(path, flag_sizes({3, 0, 0, 0, 0}));
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(contains(r.status().message(), "--layers 3 disagrees with the weights: 2 block(s)")) << r.status().message();

  // config.json without n_head: the error says so.
  nlohmann::json j = hf_config_json(c);
  j.erase("n_head");
  write_text(config, j.dump());
  r = infer_model_config(path);
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(contains(r.status().message(), config + " has no n_head")) << r.status().message();
  EXPECT_TRUE(contains(r.status().message(), "--heads")) << r.status().message();

  // __metadata__ n_head, as export_model writes it, and a config.json that disagrees.
  write_raw(path, hf_checkpoint(c, "F32"), {{"n_head", "4"}});
  r = infer_model_config(path);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->heads, 4);
  j["n_head"] = 8;
  write_text(config, j.dump());
  r = infer_model_config(path);
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(contains(r.status().message(), "n_head 4 (__metadata__ of " + path + ") disagrees with n_head 8 (" +
                                                 config + ")"))
      << r.status().message();
}

TEST(Safetensors, BadConfigJsonIsNamedWithItsKey) {
  TempDir d;
  const ModelConfig c = head32_config();
  const std::string path = d.file("model.safetensors");
  const std::string config = d.file("config.json");
  write_raw(path, hf_checkpoint(c, "F32"));
  auto expect_error = [&](const nlohmann::json& j, const std::vector<std::string>& parts) {
    write_text(config, j.dump());
    auto r = infer_model_config(path);
    ASSERT_FALSE(r.ok()) << j.dump();
    for (const std::string& part : parts) EXPECT_TRUE(contains(r.status().message(), part)) << r.status().message();
  };
  auto with = [&](const std::string& key, const nlohmann::json& value) {
    nlohmann::json j = hf_config_json(c);
    j[key] = value;
    return j;
  };
  expect_error(with("n_head", "4"), {config, "\"n_head\" is \"4\" (string); expected a positive integer"});
  expect_error(with("n_head", 4.0), {config, "\"n_head\"", "(number); expected a positive integer"});
  expect_error(with("n_head", 0), {config, "\"n_head\" is 0; expected a positive integer up to 2^24"});
  expect_error(with("n_embd", -128), {config, "\"n_embd\" is -128"});
  expect_error(with("vocab_size", nullptr), {config, "\"vocab_size\" is null"});
  expect_error(with("model_type", "mistral"), {config, "model_type is \"mistral\""});
  // Contradicting the weights: the key, its value and the weights' value.
  expect_error(with("n_layer", 3), {"n_layer 3 (" + config + ") disagrees with the weights: 2 block(s), h.0 … h.1"});
  expect_error(with("n_embd", 64), {"n_embd 64 (" + config + ") disagrees with the weights: width 128"});
  expect_error(with("vocab_size", 50257), {"vocab_size 50257 (" + config + ") disagrees with the weights: vocab 64"});
  expect_error(with("n_positions", 1024), {"n_positions 1024 (" + config + ") disagrees with the weights: context 16"});
  // n_ctx counts only without n_positions.
  nlohmann::json j = hf_config_json(c);
  j["n_ctx"] = 1024;
  write_text(config, j.dump());
  EXPECT_TRUE(infer_model_config(path).ok());
  j.erase("n_positions");
  expect_error(j, {"n_ctx 1024 (" + config + ") disagrees with the weights: context 16"});
  // Not JSON, or not an object.
  write_text(config, "{\"n_head\": 4,");
  auto r = infer_model_config(path);
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(contains(r.status().message(), config + ": not valid JSON")) << r.status().message();
  expect_error(nlohmann::json::array({1, 2}), {config, "not a JSON object"});
  // A directory named config.json is not a config.
  std::filesystem::remove(config);
  std::filesystem::create_directory(config);
  r = infer_model_config(path);
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(contains(r.status().message(), config)) << r.status().message();
}

TEST(Safetensors, BlocksMustBeContiguousAndCompleteBeforeAnythingIsBuilt) {
  TempDir d;
  const ModelConfig c = micro_config();
  const std::string path = d.file("blocks.safetensors");
  const nlohmann::json heads = {{"n_head", "2"}};
  auto renumber = [](std::vector<Raw> t, int from, const std::string& to) {
    const std::string prefix = "h." + std::to_string(from) + ".";
    for (Raw& r : t)
      if (r.name.rfind(prefix, 0) == 0) r.name = "h." + to + "." + r.name.substr(prefix.size());
    return t;
  };
  auto expect_error = [&](const std::vector<std::string>& parts) {
    const auto t0 = std::chrono::steady_clock::now();
    auto r = infer_model_config(path);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    ASSERT_FALSE(r.ok());
    EXPECT_LT(s, 1.0) << "refusing took " << s << " s";
    EXPECT_TRUE(contains(r.status().message(), path)) << r.status().message();
    for (const std::string& part : parts) EXPECT_TRUE(contains(r.status().message(), part)) << r.status().message();
  };
  // One layer, numbered 9999999: refused before 10 million layers are built.
  ModelConfig one = c;
  one.layers = 1;
  write_raw(path, renumber(hf_checkpoint(one, "F32"), 0, "9999999"), heads);
  expect_error({"h.0 … h.{L-1} with none missing", "1 block(s) (h.9999999) and no h.0"});
  // The same with the transformer. prefix.
  std::vector<Raw> t = renumber(hf_checkpoint(one, "F32"), 0, "9999999");
  for (Raw& r : t) r.name = "transformer." + r.name;
  write_raw(path, t, heads);
  expect_error({"1 block(s) (h.9999999) and no h.0"});
  // A gap.
  ModelConfig three = c;
  three.layers = 3;
  write_raw(path, renumber(hf_checkpoint(three, "F32"), 1, "3"), heads);
  expect_error({"3 block(s) (h.0, h.2, h.3) and no h.1"});
  // Block numbers that are not plain numbers below 2^24.
  write_raw(path, renumber(hf_checkpoint(one, "F32"), 0, "99999999999999999999999"), heads);
  expect_error({"block number 99999999999999999999999 is not a plain number below 2^24"});
  write_raw(path, renumber(hf_checkpoint(one, "F32"), 0, "16777216"), heads);
  expect_error({"block number 16777216 is not a plain number below 2^24"});
  write_raw(path, renumber(hf_checkpoint(c, "F32"), 1, "01"), heads);
  expect_error({"tensor 'h.01.ln_1.weight': block number 01 is not a plain number"});
  // An incomplete block.
  t = hf_checkpoint(c, "F32");
  std::erase_if(t, [](const Raw& r) { return r.name == "h.1.mlp.c_fc.bias" || r.name == "h.1.ln_1.weight"; });
  write_raw(path, t, heads);
  expect_error({"block h.1 is incomplete: it lacks 2 of its 12 parameters: h.1.ln_1.weight, h.1.mlp.c_fc.bias"});
  // Complete by name, but the tensors are too small to be blocks of this width.
  t = hf_checkpoint(c, "F32");
  for (Raw& r : t)
    if (r.name.rfind("h.", 0) == 0) {
      r.shape = {1};
      r.bytes = f32_bytes({0.5f});
    }
  write_raw(path, t, heads);
  expect_error({"2 block(s) of width 8 need at least 872 values each (3488 bytes in all at 2 bytes a value)",
                "the file's data is"});
  // import_model asked for far more blocks than the file has: refused without
  // listing every block's parameters.
  write_raw(path, hf_checkpoint(c, "F32"), heads);
  ModelConfig deep = c;
  deep.layers = 1000000;
  const auto t0 = std::chrono::steady_clock::now();
  auto r = import_model(path, deep);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 1.0);
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(contains(r.status().message(), "it has 1000000 blocks, the file 2; the first missing is h.2"))
      << r.status().message();
}

TEST(Safetensors, NonFiniteWeightsAreRefusedUnlessAllowed) {
  TempDir d;
  const ModelConfig c = micro_config();
  const std::string path = d.file("nan.safetensors");
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  // F32: a NaN in a Conv1D weight, named with its place in the file's [in, out] layout.
  std::vector<Raw> t = hf_checkpoint(c, "F32");
  for (Raw& r : t)
    if (r.name == "h.1.mlp.c_fc.weight") {
      // [8, 32]: element 37 is [1, 5]; a later Inf is not the first.
      std::memcpy(r.bytes.data() + 37 * 4, &nan, 4);
      std::memcpy(r.bytes.data() + 100 * 4, &inf, 4);
    }
  write_raw(path, t);
  auto r = import_model(path, c);
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(contains(r.status().message(), path)) << r.status().message();
  EXPECT_TRUE(contains(r.status().message(),
                       "tensor 'h.1.mlp.c_fc.weight' element 37 (index [1, 5] of [8, 32]) is NaN"))
      << r.status().message();
  EXPECT_TRUE(contains(r.status().message(), "--allow-nonfinite-weights")) << r.status().message();
  auto allowed = import_model(path, c, {.allow_nonfinite = true});
  ASSERT_TRUE(allowed.ok()) << allowed.status().to_string();
  // Ours is [out, in] = [32, 8]: file element (1, 5) is ours (5, 1).
  EXPECT_TRUE(std::isnan(allowed->at("transformer.h.1.mlp.c_fc.weight")[5 * 8 + 1]));
  // The sink is not called for the tensor with the bad value, nor after it.
  std::vector<std::string> sunk;
  Status s = import_model(path, c, [&](const ParamSpec& p, std::vector<float>&&) {
    sunk.push_back(p.name);
    return Status::ok();
  });
  ASSERT_FALSE(s.is_ok());
  EXPECT_EQ(std::count(sunk.begin(), sunk.end(), "transformer.h.1.mlp.c_fc.weight"), 0);
  EXPECT_EQ(std::count(sunk.begin(), sunk.end(), "transformer.ln_f.bias"), 0);
  // BF16 -Inf and F16 +Inf in a 1-D tensor.
  t = hf_checkpoint(c, "BF16");
  for (Raw& r : t)
    if (r.name == "wpe.weight") {
      const uint16_t minus_inf = 0xff80;
      std::memcpy(r.bytes.data() + 2 * 2, &minus_inf, 2);
    }
  write_raw(path, t);
  r = import_model(path, c);
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(contains(r.status().message(), "tensor 'wpe.weight' element 2 (index [0, 2] of [4, 8]) is -Inf"))
      << r.status().message();
  t = hf_checkpoint(c, "F16");
  for (Raw& r : t)
    if (r.name == "ln_f.bias") {
      const uint16_t plus_inf = 0x7c00;
      std::memcpy(r.bytes.data() + 7 * 2, &plus_inf, 2);
    }
  write_raw(path, t);
  r = import_model(path, c);
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(contains(r.status().message(), "tensor 'ln_f.bias' element 7 (index [7] of [8]) is +Inf"))
      << r.status().message();
  EXPECT_TRUE(import_model(path, c, {.allow_nonfinite = true}).ok());
}

TEST(Safetensors, ExportChecksValueCounts) {
  TempDir d;
  ModelConfig c = micro_config();
  ModelWeights w = random_weights(c, 1);
  w["transformer.h.0.ln_1.bias"].pop_back();
  std::string path = d.file("x.safetensors");
  Status s = export_model(path, c, w);
  ASSERT_FALSE(s.is_ok());
  EXPECT_TRUE(contains(s.message(), "transformer.h.0.ln_1.bias")) << s.message();
  EXPECT_TRUE(contains(s.message(), path)) << s.message();
  EXPECT_NE(::access(path.c_str(), F_OK), 0);            // nothing half-written
  EXPECT_NE(::access((path + ".tmp").c_str(), F_OK), 0);
  w.erase("transformer.wpe.weight");
  s = export_model(path, c, w);
  ASSERT_FALSE(s.is_ok());
  EXPECT_TRUE(contains(s.message(), "transformer.wpe.weight")) << s.message();
}
