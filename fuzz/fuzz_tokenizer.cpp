// libFuzzer target: the tokenizer (src/text) on hostile text and hostile tokenizer.json.
// The first byte picks what the rest is:
//   even: text for the GPT-2 and Llama 3 reference tokenizers (tests/data/reference);
//   odd:  a tokenizer.json, then (after a NUL byte, if any) text for it.
// Properties: encode fails exactly on invalid UTF-8; every id is below vocab_size();
// decode(encode(text)) == text (both reference tokenizers hold every byte).
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

#include "fuzz_support.h"
#include "text/tokenizer.h"

using namespace spillway;

namespace {

const Tokenizer& reference(const char* name) {
  static const Tokenizer gpt2 = Tokenizer::load(SPILLWAY_SOURCE_DIR "/tests/data/reference/tok-gpt2").value();
  static const Tokenizer llama3 = Tokenizer::load(SPILLWAY_SOURCE_DIR "/tests/data/reference/tok-llama3").value();
  return std::strcmp(name, "gpt2") == 0 ? gpt2 : llama3;
}

void check_round_trip(const Tokenizer& tok, std::string_view text, bool must_hold_every_byte) {
  auto ids = tok.encode(text);
  size_t bad = 0;
  const bool valid = valid_utf8(text, &bad);
  if (!ids.ok()) {
    fuzz::require(!valid || !must_hold_every_byte, "encode refused valid UTF-8");
    return;
  }
  fuzz::require(valid, "encode accepted invalid UTF-8");
  for (uint32_t id : *ids) fuzz::require(id < static_cast<uint32_t>(tok.vocab_size()), "an id at or above vocab_size()");
  auto back = tok.decode(*ids);
  fuzz::require(back.ok(), "decode refused encode's ids");
  if (must_hold_every_byte) fuzz::require(*back == text, "decode(encode(text)) != text");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string_view rest(reinterpret_cast<const char*>(data) + 1, size - 1);
  if ((data[0] & 1) == 0) {
    check_round_trip(reference("gpt2"), rest, true);
    check_round_trip(reference("llama3"), rest, true);
    return 0;
  }
  const size_t nul = rest.find('\0');
  const std::string_view json = rest.substr(0, nul);
  auto tok = Tokenizer::from_json(json, "fuzz input");
  if (tok.ok() && nul != std::string_view::npos) check_round_trip(*tok, rest.substr(nul + 1), false);
  return 0;
}
