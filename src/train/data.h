// Training data: plain text through a byte tokenizer, or llm.c token files; a
// train/validation split; a loader of [B,T] batches of tokens and next-token targets.
//
//   auto data = load_dataset("data/tinyshakespeare.txt", /*vocab=*/256);
//   if (!data) return data.status();
//   auto train = DataLoader::create(data->train, B, T, LoaderMode::Random, /*seed=*/1337);
//   auto val = DataLoader::create(data->val, B, T, LoaderMode::Sequential);
//   std::vector<int32_t> tokens(B * T), targets(B * T);
//   train->next(tokens.data(), targets.data());   // targets[b,t] = the token after tokens[b,t]
//
// llm.c token file: a header of 256 little-endian int32 (magic 20240520, version 1,
// token count at index 2, the rest zero), then `count` uint16 tokens.
// A file whose first int32 is the magic is a token file; any other file is plain
// text, one token per byte, unless its name ends in ".bin" (then the magic is wrong).
// Validation split: a token file "foo_train.bin" pairs with "foo_val.bin" when that
// exists (or the val_path given); otherwise, and for text, the last 10% of the
// tokens are validation and the rest training.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"

namespace spillway {

// ---- byte tokenizer (vocab 256): token = byte value
inline constexpr int kByteVocab = 256;
std::vector<int32_t> byte_encode(std::string_view text);
// Tokens outside 0..255 become '?'.
std::string byte_decode(const int32_t* tokens, size_t n);

// ---- llm.c token files
inline constexpr int32_t kTokenFileMagic = 20240520;
inline constexpr int32_t kTokenFileVersion = 1;
inline constexpr size_t kTokenFileHeaderInts = 256;
Result<std::vector<uint16_t>> read_token_file(const std::string& path);
Status write_token_file(const std::string& path, const std::vector<uint16_t>& tokens);

// A run of tokens to draw windows from.
struct TokenSplit {
  std::string source;                                 // "data/x.txt (last 10%, validation)"
  std::shared_ptr<const std::vector<uint16_t>> tokens;  // [n], shared with loaders
  size_t size() const { return tokens ? tokens->size() : 0; }
};

struct Dataset {
  TokenSplit train;
  TokenSplit val;
  bool text = false;  // byte-tokenized plain text
};

// Loads `path` (text or token file), checks every token < vocab, and splits it.
// val_path, when not empty, is the validation token or text file.
// Errors name the file: missing, empty, wrong magic or version, truncated (the
// header counts more tokens than the file holds), a token ≥ vocab.
Result<Dataset> load_dataset(const std::string& path, int vocab, const std::string& val_path = "");

enum class LoaderMode {
  Random,      // each row starts at a random offset, from (seed, batch index, row)
  Sequential,  // rows take consecutive non-overlapping windows, wrapping at the end
};

class DataLoader {
 public:
  // Needs at least T+1 tokens in the split (the error names its source).
  // Random offsets: r = splitmix64_mix(key + (i·B + b + 1)·0x9E3779B97F4A7C15) with
  // key = splitmix64_mix(seed), offset = (r · (n − T)) >> 64 for batch i, row b.
  static Result<DataLoader> create(const TokenSplit& split, int B, int T, LoaderMode mode, uint64_t seed = 0);

  // Fills tokens[B·T] and targets[B·T] with batch number batch_index(), then
  // advances to the next batch.
  void next(int32_t* tokens, int32_t* targets);
  void seek(int64_t batch) { batch_ = batch; }  // the next call to next() returns this batch
  int64_t batch_index() const { return batch_; }
  // Batches that cover the split about once (at least 1): Sequential ⌊⌊(n−1)/T⌋/B⌋,
  // Random ⌊(n−1)/(B·T)⌋.
  int64_t batches_per_epoch() const;
  int B() const { return B_; }
  int T() const { return T_; }

 private:
  DataLoader() = default;
  int64_t row_start(int64_t batch, int row) const;

  std::shared_ptr<const std::vector<uint16_t>> tokens_;  // [n]
  int B_ = 0, T_ = 0;
  LoaderMode mode_ = LoaderMode::Random;
  uint64_t key_ = 0;
  int64_t batch_ = 0;
};

}  // namespace spillway
