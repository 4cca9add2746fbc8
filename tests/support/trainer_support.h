// Small helpers shared by the trainer-level tests (tests/train): a float's bits, for
// bit-for-bit comparisons, micro-batches of random tokens with learnable targets, and
// a trainer's whole state by tensor name.
//
//   auto mbs = testing_support::learnable_batches(/*accum=*/2, /*B=*/2, /*T=*/16, /*seed=*/101);
//   EXPECT_EQ(testing_support::float_bits(a.loss), testing_support::float_bits(b.loss));
//   EXPECT_EQ(testing_support::read_state(t1), testing_support::read_state(t2));
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "model/model.h"
#include "train/trainer.h"

namespace spillway::testing_support {

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

// `accum` micro-batches of B·T tokens below 64 from an LCG seeded with `seed`; each
// target is (token·7 + 3) mod 64, so the model can learn it.
inline std::vector<TokenBatch> learnable_batches(int accum, int B, int T, uint64_t seed) {
  std::vector<TokenBatch> out(static_cast<size_t>(accum));
  uint64_t s = seed;
  auto next = [&] {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<int32_t>((s >> 33) % 64);
  };
  for (TokenBatch& b : out)
    for (int i = 0; i < B * T; ++i) {
      const int32_t t = next();
      b.tokens.push_back(t);
      b.targets.push_back((t * 7 + 3) % 64);
    }
  return out;
}

// Every parameter, master weight and Adam moment of a trainer, by tensor name.
inline std::map<std::string, std::vector<float>> read_state(Trainer& t) {
  std::map<std::string, std::vector<float>> out;
  for (const ParamSpec& p : parameter_specs(t.options().model))
    for (const std::string& name : {p.name, "master." + p.name, "adam_m." + p.name, "adam_v." + p.name}) {
      auto v = t.read_floats(name);
      EXPECT_TRUE(v.ok()) << name << ": " << v.status().to_string();
      if (v.ok()) out[name] = std::move(*v);
    }
  return out;
}

}  // namespace spillway::testing_support
