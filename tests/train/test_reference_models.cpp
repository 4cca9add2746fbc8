// Spillway against transformers: the first step's loss and every gradient of small
// random models saved by transformers (tests/data/reference, made on the device
// machine by bench/peers/make_reference_data.py). Each reference.safetensors holds
// tokens [B,T+1] I32 (inputs are [:, :T], targets [:, 1:]), loss [1] (the mean
// cross-entropy over the B·T positions) and grad.<name> for every parameter, from
// GPT2LMHeadModel / LlamaForCausalLM in float32 on the CPU.
//
// Models: gpt2-4x32 (4 heads of 32), llama-mha (4 heads, untied LM head, default
// rope), llama-gqa (8 heads sharing 2 key/value heads, llama3 rope scaling, tied).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "model/model.h"
#include "model/safetensors.h"
#include "sim/machine.h"
#include "train/trainer.h"

namespace spillway {
namespace {

const std::string kReference = std::string(SPILLWAY_SOURCE_DIR) + "/tests/data/reference/";

struct Case {
  const char* dir;
  ModelConfig cfg;
};

constexpr auto llama = llama_config;

// The sizes of each model's config.json.
std::vector<Case> cases() {
  return {
      {"gpt2-4x32", ModelConfig{2, 128, 4, 32, 257}},
      {"llama-mha", llama(2, 64, 4, 4, 160, 64, 300, false, 1e-5f, RopeParams{.theta = 10000.0f})},
      {"llama-gqa", llama(2, 64, 8, 2, 96, 128, 259, true, 1e-6f,
                          RopeParams{.theta = 500000.0f, .llama3 = true, .factor = 8.0f, .low_freq_factor = 1.0f,
                                     .high_freq_factor = 4.0f, .original_context = 16})},
  };
}

// An I32 tensor's values (SafetensorsReader reads floats only): the data buffer starts
// after the 8-byte header length and the header.
std::vector<int32_t> read_i32(const std::string& path, const SafetensorsEntry& e) {
  std::ifstream f(path, std::ios::binary);
  uint64_t header = 0;
  f.read(reinterpret_cast<char*>(&header), 8);
  std::vector<int32_t> v(static_cast<size_t>((e.end - e.begin) / 4));
  f.seekg(static_cast<std::streamoff>(8 + header + e.begin));
  f.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(v.size() * 4));
  EXPECT_TRUE(f.good()) << path;
  return v;
}

// The CPU backend computes in F32: the loss within 1e-5 relative, each gradient within
// 1e-4 of its largest element. The CUDA backend computes in BF16 (activations, and
// the weights the step reads): a bf16 rounding is 2^-8 relative, and a few dozen of
// them compound through two blocks, so the loss within 1e-2 relative and each
// gradient within 5e-2 of its largest element.
void check_against_transformers(const Case& c, const std::string& backend_name) {
  const std::string dir = kReference + c.dir + "/";
  auto ref = SafetensorsReader::open(dir + "reference.safetensors");
  ASSERT_TRUE(ref.ok()) << ref.status().to_string();
  const SafetensorsEntry* tokens_entry = ref->find("tokens");
  ASSERT_NE(tokens_entry, nullptr);
  ASSERT_EQ(tokens_entry->shape.size(), 2u);
  const int B = static_cast<int>(tokens_entry->shape[0]), T = static_cast<int>(tokens_entry->shape[1]) - 1;
  ASSERT_EQ(tokens_entry->dtype, "I32");
  const std::vector<int32_t> ids = read_i32(dir + "reference.safetensors", *tokens_entry);
  ASSERT_EQ(ids.size(), static_cast<size_t>(B) * (T + 1));
  TokenBatch batch;
  for (int b = 0; b < B; ++b)
    for (int t = 0; t < T; ++t) {
      batch.tokens.push_back(ids[static_cast<size_t>(b) * (T + 1) + t]);
      batch.targets.push_back(ids[static_cast<size_t>(b) * (T + 1) + t + 1]);
    }

  const bool cpu = backend_name == "cpu";
  const double loss_tolerance = cpu ? 1e-5 : 1e-2, grad_tolerance = cpu ? 1e-4 : 5e-2;
  auto backend = make_backend(backend_name, {.threads = 2});
  ASSERT_TRUE(backend.ok()) << backend.status().to_string();
  TrainerOptions o;
  o.model = c.cfg;
  o.shape = {.B = B, .T = T, .accum = 1};
  o.schedule = {.peak = 1e-3f, .warmup_steps = 0, .total_steps = 1};
  o.machine = Machine::cpu_dev_box();
  auto trainer = Trainer::create(**backend, o);
  ASSERT_TRUE(trainer.ok()) << trainer.status().to_string();
  if (c.cfg.arch == Arch::GPT2) {
    ASSERT_TRUE((*trainer)->load_parameters(dir + "model.safetensors").ok());
  } else {
    // transformers' nn.Linear layout is ours: the values go in by name.
    auto weights = SafetensorsReader::open(dir + "model.safetensors");
    ASSERT_TRUE(weights.ok()) << weights.status().to_string();
    for (const ParamSpec& p : parameter_specs(c.cfg)) {
      const SafetensorsEntry* e = weights->find(p.name);
      ASSERT_NE(e, nullptr) << p.name;
      auto v = weights->read_f32(*e);
      ASSERT_TRUE(v.ok()) << v.status().to_string();
      ASSERT_TRUE((*trainer)->write_parameter(p.name, *v).ok()) << p.name;
    }
  }
  auto r = (*trainer)->step(std::vector<TokenBatch>{batch});
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  auto loss = ref->read_f32(*ref->find("loss"));
  ASSERT_TRUE(loss.ok());
  EXPECT_NEAR(r->loss, (*loss)[0], loss_tolerance * std::fabs((*loss)[0])) << c.dir << " on " << backend_name;
  double worst_relative = 0;

  for (const ParamSpec& p : parameter_specs(c.cfg)) {
    const SafetensorsEntry* e = ref->find("grad." + p.name);
    ASSERT_NE(e, nullptr) << p.name;
    auto want = ref->read_f32(*e);
    ASSERT_TRUE(want.ok());
    std::vector<float> expect = *want;
    if (p.conv1d) {  // stored [in,out]; ours [out,in]
      const int64_t out = p.shape.dims[0], in = p.shape.dims[1];
      for (int64_t i = 0; i < in; ++i)
        for (int64_t o2 = 0; o2 < out; ++o2) expect[o2 * in + i] = (*want)[i * out + o2];
    }
    auto got = (*trainer)->read_floats("grad." + p.name);
    ASSERT_TRUE(got.ok()) << got.status().to_string();
    ASSERT_EQ(got->size(), expect.size()) << p.name;
    float scale = 0;
    for (float x : expect) scale = std::max(scale, std::fabs(x));
    double worst = 0;
    size_t at = 0;
    for (size_t i = 0; i < expect.size(); ++i) {
      const double d = std::fabs(static_cast<double>((*got)[i]) - expect[i]);
      if (d > worst) worst = d, at = i;
    }
    worst_relative = std::max(worst_relative, worst / (scale + 1e-30));
    EXPECT_LE(worst, grad_tolerance * scale + 1e-9) << c.dir << " on " << backend_name << " grad." << p.name << " element " << at << ": "
                                          << (*got)[at] << " vs transformers " << expect[at] << " (largest |grad| "
                                          << scale << ")";
  }
  std::printf("%s on %s: loss %.7f vs transformers %.7f; largest gradient difference %.2e of the largest element\n",
              c.dir, backend_name.c_str(), r->loss, (*loss)[0], worst_relative);
}

class ReferenceModel : public ::testing::TestWithParam<Case> {};

TEST_P(ReferenceModel, FirstStepLossAndEveryGradientMatchTransformers) { check_against_transformers(GetParam(), "cpu"); }

TEST_P(ReferenceModel, CudaBf16MatchesTransformersWithinBf16Tolerance) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  check_against_transformers(GetParam(), "cuda");
}

INSTANTIATE_TEST_SUITE_P(Transformers, ReferenceModel, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<Case>& i) {
                           std::string n = i.param.dir;
                           std::replace(n.begin(), n.end(), '-', '_');
                           return n;
                         });

}  // namespace
}  // namespace spillway
