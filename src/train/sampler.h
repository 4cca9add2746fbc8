// Sampler: text generation from a GPT model with a forward-only program.
//
//   auto backend = make_backend("cpu");
//   auto cfg = infer_model_config("build/tiny.safetensors");
//   auto s = Sampler::create(**backend, *cfg, {.window = 128});
//   if (!s) die(s.status());
//   SPILLWAY_RETURN_IF_ERROR((*s)->load("build/tiny.safetensors"));
//   auto out = (*s)->generate(byte_encode("ROMEO:"), 200, {.temperature = 0.8f, .seed = 1});
//   std::cout << byte_decode(out->data(), out->size());      // the new tokens only
//
// One forward program of [1, window] tokens is planned once. For each new token the
// last `window` tokens of the text so far are placed at the start of the row (the
// rest padded with token 0, which causal attention never lets the earlier positions
// see), the whole window is recomputed, and the logits of the last real position
// give the next-token distribution: softmax(logits / temperature), computed in
// double, sampled with a seeded splitmix64 generator. Temperature 0 takes the
// argmax (the lowest index among ties).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "core/status.h"
#include "exec/executor.h"
#include "model/model.h"
#include "model/hf_model.h"
#include "plan/planner.h"
#include "sim/machine.h"

namespace spillway {

struct SamplerOptions {
  int window = 0;          // tokens per forward pass; 0 = the model's context
  Budgets budgets;
  PlannerOptions planner;  // resident by default
  std::string spill_dir;
};

struct SampleOptions {
  float temperature = 1.0f;  // 0 = greedy
  uint64_t seed = 1337;
  // Draw only ids below this (a tokenizer's vocabulary, where the model's is padded
  // past it: GPT-2's 50257 ids in 50304 rows); 0 = the model's whole vocabulary.
  int vocab_limit = 0;
};

class Sampler {
 public:
  static Result<std::unique_ptr<Sampler>> create(Backend& backend, const ModelConfig& cfg,
                                                 const SamplerOptions& options = {});
  // Parameters from a safetensors checkpoint of this config (non-finite values
  // refused unless options.allow_nonfinite).
  Status load(const std::string& path, const ImportOptions& options = {});
  // Sets one parameter (ParamSpec name) from F32 values.
  Status set_parameter(const std::string& name, const std::vector<float>& values);
  // Generates `count` tokens after `prompt` (which must not be empty); returns the
  // new tokens only.
  Result<std::vector<int32_t>> generate(const std::vector<int32_t>& prompt, int count, const SampleOptions& options);
  // The next-token logits after `context` (its last `window` tokens), [vocab].
  Result<std::vector<float>> next_logits(const std::vector<int32_t>& context);

  int window() const { return window_; }

 private:
  Sampler(Backend& backend, const ModelConfig& cfg) : backend_(backend), cfg_(cfg) {}

  Backend& backend_;
  ModelConfig cfg_;
  int window_ = 0;
  Program program_;
  Plan plan_;
  std::unique_ptr<Executor> executor_;
  TensorId tokens_ = kNoTensor, logits_ = kNoTensor;
};

// Picks a token from logits: argmax when temperature is 0, else a draw from
// softmax(logits / temperature) using the uniform number u in [0, 1).
int32_t pick_token(const std::vector<float>& logits, float temperature, double u);

}  // namespace spillway
