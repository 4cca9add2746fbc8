// Parameter initialization in parallel: the same bits for every thread count, equal to
// the documented sequential generator (computed here independently), and written by
// the trainer to the master, the parameter and zeroed moments.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "backend/backend.h"
#include "core/thread_pool.h"
#include "model/model.h"
#include "optim/adamw.h"
#include "train/trainer.h"
#include "support/trainer_support.h"
#include "support/test_support.h"

namespace spillway {
namespace {

using testing_support::TempDir;

// The generator as gpt.h documents it, written out again, one element at a time:
//   key = splitmix64_mix(seed ^ fnv1a64(name)), r(c) = splitmix64_mix(key + (c+1)·golden),
//   pair q = j/2: u1 = ((r(2q) >> 11) + 1)·2⁻⁵³, u2 = (r(2q+1) >> 11)·2⁻⁵³,
//   value = float(std · sqrt(-2 ln u1) · (j even ? cos : sin)(2π u2)).
uint64_t mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

float reference_element(const std::string& name, double std_dev, uint64_t seed, uint64_t j) {
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a 64
  for (unsigned char c : name) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  const uint64_t key = mix(seed ^ h);
  const uint64_t q = j / 2;
  const uint64_t r1 = mix(key + (2 * q + 1) * 0x9E3779B97F4A7C15ull);
  const uint64_t r2 = mix(key + (2 * q + 2) * 0x9E3779B97F4A7C15ull);
  const double u1 = static_cast<double>((r1 >> 11) + 1) / 9007199254740992.0;
  const double u2 = static_cast<double>(r2 >> 11) / 9007199254740992.0;
  const double r = std::sqrt(-2.0 * std::log(u1));
  const double angle = 6.283185307179586476925286766559 * u2;
  return static_cast<float>(std_dev * (r * (j % 2 == 0 ? std::cos(angle) : std::sin(angle))));
}

uint32_t bits(float f) { return std::bit_cast<uint32_t>(f); }

// The elements worth checking in a tensor of n: both ends, around every chunk
// boundary a parallel split could use, and a stride through the middle.
std::vector<size_t> probe_elements(size_t n) {
  std::vector<size_t> out;
  for (size_t j : {size_t{0}, size_t{1}, size_t{2}, n / 2, n - 2, n - 1}) out.push_back(j);
  for (size_t b = 1024; b < n; b *= 2)
    for (size_t j : {b - 1, b, b + 1}) out.push_back(j);
  for (size_t j = 7; j < n; j += 9973) out.push_back(j);
  return out;
}

// A matrix of an odd number of elements (the last has no partner in its pair),
// spanning many chunks, and a c_proj weight (std 0.02/sqrt(2·layers)).
TEST(ParallelInit, SameBitsForEveryThreadCountAndEqualToTheDocumentedGenerator) {
  ModelConfig cfg = {.layers = 3, .width = 64, .heads = 2, .context = 64, .vocab = 256};
  const std::vector<ParamSpec> specs = {
      {"transformer.wte.weight", {1001, 257}, -1, true, false, ParamInit::Normal, 0.02},
      {"transformer.h.2.mlp.c_proj.weight", {301, 700}, 2, true, true, ParamInit::Normal, 0.02 / std::sqrt(6.0)},
      {"transformer.wpe.weight", {3, 3}, -1, true, false, ParamInit::Normal, 0.02},
  };
  const std::vector<double> std_devs = {0.02, 0.02 / std::sqrt(6.0), 0.02};
  // parameter_specs states these standard deviations for a 3-layer GPT-2.
  for (const ParamSpec& q : parameter_specs(cfg))
    if (q.name == "transformer.h.2.mlp.c_proj.weight") {
      EXPECT_EQ(q.init_std, std_devs[1]);
    }
  const uint64_t seed = 4242;
  for (size_t s = 0; s < specs.size(); ++s) {
    const ParamSpec& p = specs[s];
    const size_t n = static_cast<size_t>(p.shape.numel());
    std::vector<float> one;
    for (int threads : {1, 2, 3, 8}) {
      auto pool = ThreadPool::create(threads);
      ASSERT_TRUE(pool.ok()) << pool.status().to_string();
      const std::vector<float> v = init_parameter(cfg, p, seed, pool->get());
      ASSERT_EQ(v.size(), n);
      if (threads == 1) {
        one = v;
        for (size_t j : probe_elements(n))
          ASSERT_EQ(bits(v[j]), bits(reference_element(p.name, std_devs[s], seed, j)))
              << p.name << "[" << j << "] " << v[j];
        continue;
      }
      for (size_t j = 0; j < n; ++j)
        ASSERT_EQ(bits(v[j]), bits(one[j])) << p.name << "[" << j << "] with " << threads << " threads";
    }
    // The global pool's result is the same, and so is any range, even one that
    // starts or ends inside a pair.
    EXPECT_EQ(init_parameter(cfg, p, seed), one) << p.name;
    for (auto [begin, end] : {std::pair<size_t, size_t>{0, n}, {1, n}, {3, 8}, {n / 2 + 1, n - 1}, {n - 1, n}}) {
      std::vector<float> part(end - begin, -1.0f);
      init_parameter_range(cfg, p, seed, begin, end, part.data());
      for (size_t j = begin; j < end; ++j)
        ASSERT_EQ(bits(part[j - begin]), bits(one[j])) << p.name << " range [" << begin << "," << end << ") at " << j;
    }
  }
}

// Biases and LayerNorm weights are constants in every chunk.
TEST(ParallelInit, ConstantsFillEveryChunk) {
  ModelConfig cfg = {.layers = 1, .width = 64, .heads = 2, .context = 64, .vocab = 256};
  auto pool = ThreadPool::create(3);
  ASSERT_TRUE(pool.ok());
  const ParamSpec bias = {"transformer.h.0.mlp.c_fc.bias", {200001}, 0, false, false, ParamInit::Zeros};
  const ParamSpec ln = {"transformer.h.0.ln_2.weight", {200001}, 0, false, false, ParamInit::Ones};
  for (const ParamSpec& q : parameter_specs(cfg)) {
    if (q.name == bias.name) {
      EXPECT_EQ(q.init, ParamInit::Zeros);
    }
    if (q.name == ln.name) {
      EXPECT_EQ(q.init, ParamInit::Ones);
    }
  }
  for (float x : init_parameter(cfg, bias, 1, pool->get())) ASSERT_EQ(bits(x), bits(0.0f));
  for (float x : init_parameter(cfg, ln, 1, pool->get())) ASSERT_EQ(x, 1.0f);
}

// BF16 conversion (round to nearest even), spread over the global pool, gives the
// same bytes for every thread count, equal to the rounding done here by hand.
TEST(ParallelInit, Bf16EncodingIsTheSameForEveryThreadCount) {
  const std::vector<float> values = testing_support::random_floats(3 * (size_t{1} << 18) + 5, 11);
  for (int threads : {1, 2, 3, 8}) {
    set_global_thread_count(threads);
    const std::vector<uint8_t> bytes = encode_values(DType::BF16, values);
    ASSERT_EQ(bytes.size(), values.size() * 2);
    for (size_t i = 0; i < values.size(); ++i) {
      const uint32_t b = bits(values[i]);
      const auto want = static_cast<uint16_t>((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
      uint16_t got;
      std::memcpy(&got, bytes.data() + 2 * i, 2);
      ASSERT_EQ(got, want) << "element " << i << " with " << threads << " threads";
    }
    const std::vector<uint8_t> f32 = encode_values(DType::F32, values);
    ASSERT_EQ(std::memcmp(f32.data(), values.data(), f32.size()), 0) << threads << " threads";
  }
  set_global_thread_count(0);
}

std::unique_ptr<Backend> cpu_backend() {
  auto b = make_backend("cpu", {.threads = 2});
  EXPECT_TRUE(b.ok()) << b.status().to_string();
  return std::move(*b);
}

// A vocabulary above kVocabBlock, tiled: wte and its master and moments are two
// pieces each, written from one buffer at an offset.
TrainerOptions tiled_options() {
  TrainerOptions o;
  o.model = {.layers = 2, .width = 16, .heads = 2, .context = 8, .vocab = kVocabBlock + 808};
  o.shape = {.B = 2, .T = 8, .accum = 1, .tile_vocab = true};
  o.schedule = {.peak = 1e-2f, .warmup_steps = 0, .total_steps = 4};
  o.seed = 99;
  o.machine = Machine::cpu_dev_box();
  return o;
}

std::vector<TokenBatch> batches(const ModelConfig& cfg, uint64_t salt) {
  TokenBatch b;
  for (int i = 0; i < 16; ++i) {
    b.tokens.push_back(static_cast<int32_t>(mix(salt + 2 * i) % static_cast<uint64_t>(cfg.vocab)));
    b.targets.push_back(static_cast<int32_t>(mix(salt + 2 * i + 1) % static_cast<uint64_t>(cfg.vocab)));
  }
  return {b};
}

using testing_support::read_state;

void expect_initial_state(Trainer& t, const std::string& what) {
  const TrainerOptions& o = t.options();
  const auto state = read_state(t);
  for (const ParamSpec& p : parameter_specs(o.model)) {
    const std::vector<float> want = init_parameter(o.model, p, o.seed);
    for (const std::string& name : {p.name, "master." + p.name}) {
      const std::vector<float>& got = state.at(name);
      ASSERT_EQ(got.size(), want.size()) << what << " " << name;
      for (size_t j = 0; j < got.size(); ++j) ASSERT_EQ(bits(got[j]), bits(want[j])) << what << " " << name << "[" << j << "]";
    }
    for (const std::string& name : {"adam_m." + p.name, "adam_v." + p.name})
      for (size_t j = 0; j < state.at(name).size(); ++j)
        ASSERT_EQ(bits(state.at(name)[j]), 0u) << what << " " << name << "[" << j << "]";
  }
}

// The trainer writes the generator's values for every thread count; after steps,
// init_parameters and load_parameters zero the moments again, so the next step is a
// fresh trainer's first step, bit for bit.
TEST(ParallelInit, TrainerWritesTheValuesAndZeroesTheMomentsAfterSteps) {
  auto backend = cpu_backend();
  const TrainerOptions o = tiled_options();
  for (int threads : {1, 3}) {
    set_global_thread_count(threads);
    auto t = Trainer::create(*backend, o);
    ASSERT_TRUE(t.ok()) << t.status().to_string();
    ASSERT_EQ((*t)->program().pieces("adam_m.transformer.wte.weight").size(), 2u);
    ASSERT_TRUE((*t)->init_parameters().is_ok());
    expect_initial_state(**t, std::to_string(threads) + " threads, fresh");
  }
  set_global_thread_count(0);

  auto fresh = Trainer::create(*backend, o);
  ASSERT_TRUE(fresh.ok());
  ASSERT_TRUE((*fresh)->init_parameters().is_ok());
  TempDir dir;
  const std::string initial = dir.file("initial.safetensors");
  ASSERT_TRUE((*fresh)->save(initial).is_ok());
  auto first = (*fresh)->step(batches(o.model, 1));
  ASSERT_TRUE(first.ok()) << first.status().to_string();

  auto t = Trainer::create(*backend, o);
  ASSERT_TRUE(t.ok());
  ASSERT_TRUE((*t)->init_parameters().is_ok());
  for (int s = 0; s < 2; ++s) ASSERT_TRUE((*t)->step(batches(o.model, 100 + s)).ok());
  ASSERT_NE(read_state(**t).at("adam_v.transformer.wte.weight"), read_state(**fresh).at("adam_v.transformer.wte.weight"));
  // init_parameters after steps: the initial state again, moments included.
  ASSERT_TRUE((*t)->init_parameters().is_ok());
  expect_initial_state(**t, "init_parameters after 2 steps");
  // load_parameters after steps: the same.
  ASSERT_TRUE((*t)->step(batches(o.model, 200)).ok());
  ASSERT_TRUE((*t)->load_parameters(initial).is_ok());
  expect_initial_state(**t, "load_parameters after a step");

  // A fresh trainer, loaded rather than initialized, takes the same first step.
  auto loaded = Trainer::create(*backend, o);
  ASSERT_TRUE(loaded.ok());
  ASSERT_TRUE((*loaded)->load_parameters(initial).is_ok());
  expect_initial_state(**loaded, "fresh trainer, loaded");
  auto again = (*loaded)->step(batches(o.model, 1));
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(bits(again->loss), bits(first->loss));
  EXPECT_EQ(bits(again->grad_norm), bits(first->grad_norm));
  const auto a = read_state(**loaded), b = read_state(**fresh);
  for (const auto& [name, values] : b)
    for (size_t j = 0; j < values.size(); ++j) ASSERT_EQ(bits(a.at(name)[j]), bits(values[j])) << name << "[" << j << "]";
}

}  // namespace
}  // namespace spillway
