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
//   auto bundled = load_dataset_from_memory(bytes, "bundled tinyshakespeare.txt", 256);
//
// Files are mapped read-only (mmap), never read into a copy: a token file's tokens
// are used where they lie in the mapping (train and validation splits share it); a
// text file's bytes become a vector of tokens. A data file must be a regular file:
// a device (/dev/zero), a pipe, a socket or a directory is an error naming the path
// and what it is. (A mapped file that is truncated while training runs ends the
// process with SIGBUS; do not rewrite a data file during a run.)
//
// llm.c token file: a header of 256 little-endian int32 (magic 20240520, version 1,
// token count at index 2, the rest zero), then `count` uint16 tokens, and nothing
// after them: the file is exactly 1024 + 2·count bytes.
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
#include <utility>
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

// Read-only tokens and what keeps them alive (a file mapping or a vector); copies
// share them.
class TokenSpan {
 public:
  TokenSpan() = default;
  // Tokens held in a vector (implicit, so a TokenSplit can be made from one).
  TokenSpan(std::shared_ptr<const std::vector<uint16_t>> tokens)
      : owner_(tokens), data_(tokens ? tokens->data() : nullptr), size_(tokens ? tokens->size() : 0) {}
  // `n` tokens at `data`, valid while `owner` lives.
  TokenSpan(std::shared_ptr<const void> owner, const uint16_t* data, size_t n)
      : owner_(std::move(owner)), data_(data), size_(n) {}
  const uint16_t* data() const { return data_; }
  size_t size() const { return size_; }
  uint16_t operator[](size_t i) const { return data_[i]; }
  const uint16_t* begin() const { return data_; }
  const uint16_t* end() const { return data_ + size_; }
  // Tokens [offset, offset + n), sharing the owner.
  TokenSpan subspan(size_t offset, size_t n) const { return {owner_, data_ + offset, n}; }

 private:
  std::shared_ptr<const void> owner_;
  const uint16_t* data_ = nullptr;  // [size_]
  size_t size_ = 0;
};

// A run of tokens to draw windows from.
struct TokenSplit {
  std::string source;  // "data/x.txt (last 10%, validation)"
  TokenSpan tokens;    // [n], shared with loaders
  size_t size() const { return tokens.size(); }
};

struct Dataset {
  TokenSplit train;
  TokenSplit val;
  bool text = false;  // byte-tokenized plain text
};

// Loads `path` (text or token file), checks every token < vocab, and splits it.
// val_path, when not empty, is the validation token or text file.
// Errors name the file: missing, not a regular file, empty, wrong magic or
// version, a token count that disagrees with the file's size, a token ≥ vocab.
Result<Dataset> load_dataset(const std::string& path, int vocab, const std::string& val_path = "");

// The same from bytes in memory (text, or the bytes of a token file), named `name`
// in sources and errors; the last 10% are validation. The bytes are copied (into
// tokens), so they need not outlive the call.
Result<Dataset> load_dataset_from_memory(std::string_view bytes, const std::string& name, int vocab);

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

  TokenSpan tokens_;  // [n]
  int B_ = 0, T_ = 0;
  LoaderMode mode_ = LoaderMode::Random;
  uint64_t key_ = 0;
  int64_t batch_ = 0;
};

}  // namespace spillway
