#include "train/sampler.h"

#include "exec/dispatch.h"

#include <algorithm>
#include <cmath>

#include "core/random.h"
#include "model/hf_model.h"
#include "train/trainer.h"

namespace spillway {

int32_t pick_token(const std::vector<float>& logits, float temperature, double u) {
  if (logits.empty()) return 0;
  size_t best = 0;
  for (size_t i = 1; i < logits.size(); ++i)
    if (logits[i] > logits[best]) best = i;
  if (temperature <= 0) return static_cast<int32_t>(best);
  const double max_logit = logits[best];
  std::vector<double> p(logits.size());
  double total = 0;
  for (size_t i = 0; i < logits.size(); ++i) {
    p[i] = std::exp((static_cast<double>(logits[i]) - max_logit) / temperature);
    total += p[i];
  }
  double target = u * total, acc = 0;
  for (size_t i = 0; i < p.size(); ++i) {
    acc += p[i];
    if (target < acc) return static_cast<int32_t>(i);
  }
  return static_cast<int32_t>(best);
}

Result<std::unique_ptr<Sampler>> Sampler::create(Backend& backend, const ModelConfig& cfg, const SamplerOptions& options) {
  SPILLWAY_RETURN_IF_ERROR(cfg.validate());
  std::unique_ptr<Sampler> s(new Sampler(backend, cfg));
  s->window_ = options.window > 0 ? std::min(options.window, cfg.context) : cfg.context;
  SPILLWAY_ASSIGN_OR_RETURN(s->program_, build_for_budget(
                                             [&](bool tile_vocab) {
                                               return build_forward_program(cfg, 1, s->window_,
                                                                            backend.activation_dtype(), false,
                                                                            tile_vocab);
                                             },
                                             backend, allocatable_budgets(options.budgets, backend).device));
  // Kernel code CUDA would load lazily during the first token: loaded and counted now.
  SPILLWAY_RETURN_IF_ERROR(
      warm_up_kernels(backend, s->program_, allocatable_budgets(options.budgets, backend).device));
  SPILLWAY_ASSIGN_OR_RETURN(s->plan_,
                            plan_for_backend(s->program_, backend, machine_for(backend), options.budgets, options.planner));
  ExecutorOptions eo;
  eo.host_budget = options.budgets.host;
  eo.spill_dir = options.spill_dir;
  eo.storage_budget = options.budgets.storage;
  SPILLWAY_ASSIGN_OR_RETURN(s->executor_, Executor::create(backend, s->program_, s->plan_, eo));
  s->tokens_ = s->program_.tensors.find("mb0.tokens");
  s->logits_ = s->program_.tensors.find("mb0.logits");
  if (s->tokens_ == kNoTensor || s->logits_ == kNoTensor)
    return Status::internal("the forward program lacks mb0.tokens or mb0.logits");
  return s;
}

Status Sampler::set_parameter(const std::string& name, const std::vector<float>& values) {
  return write_named_floats(*executor_, program_, name, values);
}

Status Sampler::load(const std::string& path, const ImportOptions& options) {
  return import_model(
      path, cfg_, [&](const ParamSpec& p, std::vector<float>&& values) { return set_parameter(p.name, values); },
      options);
}

Result<std::vector<float>> Sampler::next_logits(const std::vector<int32_t>& context) {
  if (context.empty()) return Status::invalid_argument("the prompt is empty; give at least one token");
  const size_t len = std::min(context.size(), static_cast<size_t>(window_));
  std::vector<int32_t> row(static_cast<size_t>(window_), 0);
  std::copy(context.end() - static_cast<std::ptrdiff_t>(len), context.end(), row.begin());
  for (int32_t t : row)
    if (t < 0 || t >= cfg_.vocab)
      return Status::invalid_argument("token " + std::to_string(t) + " is outside the model's vocabulary of " +
                                      std::to_string(cfg_.vocab));
  SPILLWAY_RETURN_IF_ERROR(executor_->write_tensor(tokens_, row.data(), row.size() * sizeof(int32_t)));
  SPILLWAY_RETURN_IF_ERROR(executor_->run_step({.step = 1, .lr = 0}));
  const TensorInfo& info = program_.tensors.info(logits_);
  std::vector<uint8_t> bytes(info.bytes());
  SPILLWAY_RETURN_IF_ERROR(executor_->read_tensor(logits_, bytes.data(), bytes.size()));
  const size_t V = static_cast<size_t>(cfg_.vocab), stride = static_cast<size_t>(logits_row_stride(cfg_.vocab));
  return decode_values(info.dtype, bytes.data() + (len - 1) * stride * dtype_size(info.dtype), V);
}

Result<std::vector<int32_t>> Sampler::generate(const std::vector<int32_t>& prompt, int count,
                                               const SampleOptions& options) {
  if (prompt.empty()) return Status::invalid_argument("the prompt is empty; give at least one token");
  if (count < 0) return Status::invalid_argument("cannot generate a negative number of tokens");
  if (options.vocab_limit < 0 || options.vocab_limit > cfg_.vocab)
    return Status::invalid_argument("sampling limited to " + std::to_string(options.vocab_limit) +
                                    " ids, outside the model's vocabulary of " + std::to_string(cfg_.vocab));
  std::vector<int32_t> text = prompt;
  std::vector<int32_t> out;
  uint64_t rng = options.seed;
  for (int i = 0; i < count; ++i) {
    SPILLWAY_ASSIGN_OR_RETURN(std::vector<float> logits, next_logits(text));
    if (options.vocab_limit > 0) logits.resize(static_cast<size_t>(options.vocab_limit));
    const double u = static_cast<double>(splitmix64_next(rng) >> 11) * 0x1.0p-53;
    const int32_t next = pick_token(logits, options.temperature, u);
    text.push_back(next);
    out.push_back(next);
  }
  return out;
}

}  // namespace spillway
