// `spillway sample`: text from a checkpoint, read and printed as bytes (vocab 256)
// or through a Hugging Face tokenizer (--tokenizer).
//
//   spillway sample --load build/tiny.safetensors --prompt "ROMEO:" --tokens 200 --temperature 0.8 --context 64
//   spillway sample --load run.safetensors --tokenizer models/llama-3.2-1b --prompt "Once" --tokens 50
//
// --context should be the context the model was trained with: positions beyond it
// have untrained position embeddings.
#include <cmath>
#include <cstdio>
#include <iostream>
#include <memory>

#include <optional>

#include "cli/command.h"
#include "cli/text_data.h"
#include "cli/train_flags.h"
#include "model/hf_model.h"
#include "train/data.h"
#include "train/sampler.h"

namespace spillway::cli {
namespace {

struct SampleFlags {
  std::string load;
  std::string tokenizer;                 // --tokenizer: encodes the prompt and decodes the sample
  int heads = 0;                         // when neither config.json nor the file's metadata says
  bool allow_nonfinite_weights = false;  // accept NaN and Inf in the weights
  std::string prompt = "\n";
  int tokens = 200;
  int context = 0;  // tokens the model sees per prediction; 0 = its context
  float temperature = 0.8f;
  uint64_t seed = 1337;
  std::string backend = "auto";
  int threads = 0;
};

Status run_sample(const SampleFlags& f) {
  if (f.tokens < 0) return Status::invalid_argument("--tokens must be 0 or more, got " + std::to_string(f.tokens));
  if (!(f.temperature >= 0) || !std::isfinite(f.temperature))
    return Status::invalid_argument("--temperature must be 0 (greedy) or more, got " + std::to_string(f.temperature));
  if (f.prompt.empty()) return Status::invalid_argument("--prompt is empty; give at least one character");
  // A .safetensors file or a model directory (model/hf_model.h); GPT-2 heads from
  // config.json, the __metadata__ or --heads.
  StatedModelSizes flags;
  flags.sizes.heads = f.heads;
  flags.keys = {"--layers", "--width", "--heads", "--model-context", "--vocab", "--kv-heads", "--intermediate"};
  auto cfg = infer_model_config(f.load, flags);
  if (!cfg.ok()) return cfg.status().with_context("--load");
  std::optional<Tokenizer> tok;
  if (!f.tokenizer.empty()) {
    SPILLWAY_ASSIGN_OR_RETURN(tok, load_tokenizer_for_model(f.tokenizer, cfg->vocab, /*vocab_flag=*/false));
  } else if (cfg->vocab != kByteVocab) {
    return Status::unsupported("--load " + f.load + ": the model's vocabulary has " + std::to_string(cfg->vocab) +
                               " tokens; without --tokenizer, sample reads the prompt with the byte tokenizer, so it "
                               "needs a vocab " + std::to_string(kByteVocab) + " model (give --tokenizer PATH)");
  }
  std::vector<int32_t> prompt;
  if (tok) {
    auto ids = tok->encode(f.prompt);
    if (!ids.ok()) return ids.status().with_context("--prompt");
    if (ids->empty()) return Status::invalid_argument("--prompt encodes to no tokens");
    prompt.assign(ids->begin(), ids->end());
  } else {
    prompt = byte_encode(f.prompt);
  }
  SPILLWAY_ASSIGN_OR_RETURN(std::unique_ptr<Backend> backend, open_backend(f.backend, f.threads));
  if (f.context < 0 || f.context > cfg->context)
    return Status::invalid_argument("--context " + std::to_string(f.context) + " must be between 1 and the model's context " +
                                    std::to_string(cfg->context));
  const size_t limit = static_cast<size_t>(f.context ? f.context : cfg->context);
  const int window = static_cast<int>(std::min<size_t>(limit, prompt.size() + static_cast<size_t>(f.tokens)));
  SamplerOptions options;
  options.window = window;
  SPILLWAY_ASSIGN_OR_RETURN(std::unique_ptr<Sampler> sampler, Sampler::create(*backend, *cfg, options));
  SPILLWAY_RETURN_IF_ERROR(sampler->load(f.load, {.allow_nonfinite = f.allow_nonfinite_weights}).with_context("--load"));
  SPILLWAY_ASSIGN_OR_RETURN(std::vector<int32_t> out,
                            sampler->generate(prompt, f.tokens,
                                              {.temperature = f.temperature,
                                               .seed = f.seed,
                                               .vocab_limit = tok ? tok->vocab_size() : 0}));
  std::string text;
  if (tok) {
    const std::vector<uint32_t> ids(out.begin(), out.end());  // the sampler's ids are below the model's vocabulary
    auto decoded = tok->decode(ids);
    if (!decoded.ok()) return decoded.status().with_context("--tokenizer: the sample");
    text = std::move(*decoded);
  } else {
    text = byte_decode(out.data(), out.size());
  }
  std::cout << f.prompt << text << "\n";
  std::cout.flush();
  if (!std::cout) return Status::io_error("writing the sample to standard output failed");
  return Status::ok();
}

CommandRegistration sample_command("sample", "generate text from trained weights (bytes, or through --tokenizer)", [](CLI::App& app) -> CommandRun {
  auto f = std::make_shared<SampleFlags>();
  app.add_option("--load", f->load, "weights to sample from: a .safetensors file or a Hugging Face model directory")->required();
  app.add_option("--tokenizer", f->tokenizer,
                 "a Hugging Face tokenizer.json (or a directory holding one) for the prompt and the sample "
                 "(default: bytes, for a vocab 256 model)");
  app.add_option("--heads", f->heads,
                 "attention heads, when neither config.json beside the weights nor their __metadata__ says");
  app.add_flag("--allow-nonfinite-weights", f->allow_nonfinite_weights,
               "load weights with NaN or Inf values (refused by default)");
  app.add_option("--prompt", f->prompt, "text to continue");
  app.add_option("--tokens", f->tokens, "tokens to generate (bytes without --tokenizer)")->capture_default_str();
  app.add_option("--context", f->context,
                 "tokens the model sees per prediction (default: its context; use the training --context)");
  app.add_option("--temperature", f->temperature, "softmax temperature; 0 = always the likeliest token")->capture_default_str();
  app.add_option("--seed", f->seed, "random seed of the sampling")->capture_default_str();
  app.add_option("--backend", f->backend, "cpu, cuda or auto")->capture_default_str();
  app.add_option("--threads", f->threads, "CPU backend threads (0 = all cores)");
  return [f]() -> int {
    Status s = run_sample(*f);
    return s.is_ok() ? 0 : fail(s);
  };
});

}  // namespace
}  // namespace spillway::cli
