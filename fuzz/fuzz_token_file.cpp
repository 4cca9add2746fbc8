// libFuzzer target: the token-file reader (read_token_file) and the data loading
// around it (load_dataset on a ".bin" file, which must be a token file, and on a
// text file; load_dataset_from_memory), on a file holding the input.
// Properties: an accepted token file holds exactly (size - 1024) / 2 tokens (version
// 1) or (size - 1024) / 4 (version 2), each below the vocabulary; the train and
// validation splits together hold them all.
#include <cstdint>
#include <string_view>

#include "fuzz_support.h"
#include "train/data.h"

using namespace spillway;

namespace {
constexpr int kVocab = 50257;

void check_dataset(const Result<Dataset>& d, size_t expected_tokens) {
  if (!d.ok()) return;
  fuzz::require(d->train.size() + d->val.size() == expected_tokens, "the splits do not hold every token");
  for (const TokenSplit* s : {&d->train, &d->val})
    for (uint32_t t : s->tokens) fuzz::require(t < kVocab, "a token at or above the vocabulary was accepted");
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const size_t header = kTokenFileHeaderInts * 4;
  // The version (int32 at byte 4) sets the token width: 4 bytes for version 2.
  const bool wide = size >= 8 && data[4] == 2 && data[5] == 0 && data[6] == 0 && data[7] == 0;
  const size_t width = wide ? 4 : 2;
  const size_t tokens_in_file = size >= header ? (size - header) / width : 0;
  {
    const std::string& path = fuzz::input_file(data, size, ".bin");
    auto tokens = read_token_file(path);
    if (tokens.ok()) fuzz::require(tokens->size() == tokens_in_file && size == header + width * tokens_in_file,
                                   "read_token_file accepted a file of the wrong size");
    check_dataset(load_dataset(path, kVocab), tokens_in_file);
  }
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  // As text (no ".bin"): a token file if the magic is there, else one token per byte.
  const bool magic = size >= 4 && data[0] == (kTokenFileMagic & 0xff) && data[1] == ((kTokenFileMagic >> 8) & 0xff) &&
                     data[2] == ((kTokenFileMagic >> 16) & 0xff) && data[3] == ((kTokenFileMagic >> 24) & 0xff);
  check_dataset(load_dataset_from_memory(bytes, "fuzz input", kVocab), magic ? tokens_in_file : size);
  return 0;
}
