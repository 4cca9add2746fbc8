// libFuzzer target: a Hugging Face config.json (parse_hf_config, model/hf_model.h).
// Properties: an accepted Llama config validates, and the config.json that
// export_model writes for it reads back as the same config (sizes, rope, tying and
// epsilon, bit for bit); an accepted GPT-2 config states only sizes in 1..2^24.
#include <cstdint>
#include <string_view>

#include "fuzz_support.h"
#include "model/hf_model.h"

using namespace spillway;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto config = parse_hf_config(text, "config file fuzz.json", "fuzz.json");
  if (!config.ok()) return 0;
  if (config->arch == Arch::GPT2) {
    for (size_t i = 0; i < kStatedSizes; ++i) {
      const int v = stated_size(config->stated.sizes, i);
      fuzz::require(v >= 0 && v <= kMaxModelDim, "a GPT-2 size out of range was accepted");
    }
    return 0;
  }
  fuzz::require(config->config.validate().is_ok(), "an accepted Llama config does not validate");
  auto again = parse_hf_config(model_config_json(config->config), "written", "written");
  fuzz::require(again.ok(), "the config.json written for an accepted config does not read back");
  fuzz::require(again->arch == Arch::Llama && again->config == config->config,
                "the config.json written for an accepted config reads back as another config");
  return 0;
}
