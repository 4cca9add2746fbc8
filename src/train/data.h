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
//   auto encoded = dataset_from_tokens(tokenizer->encode(text).value(), "corpus.txt", 128256);
//
// Files are mapped read-only (mmap), never read into a copy: a token file's tokens
// are used where they lie in the mapping (train and validation splits share it); a
// text file's bytes become a vector of tokens. A data file must be a regular file:
// a device (/dev/zero), a pipe, a socket or a directory is an error naming the path
// and what it is. (A mapped file that is truncated while training runs ends the
// process with SIGBUS; do not rewrite a data file during a run.)
//
// llm.c token file: a header of 256 little-endian int32 (magic 20240520, version,
// token count at index 2, the rest zero), then `count` tokens, and nothing after
// them. Version 1 holds uint16 tokens (a vocabulary of at most 65536; the file is
// exactly 1024 + 2·count bytes), version 2 uint32 tokens (llm.c's Llama 3 files;
// 1024 + 4·count bytes). Writers pick version 1 when the vocabulary fits 16 bits.
// A file whose first int32 is the magic is a token file; any other file is plain
// text, one token per byte, unless its name ends in ".bin" (then the magic is wrong).
// Validation split: a token file "foo_train.bin" pairs with "foo_val.bin" when that
// exists (or the val_path given); otherwise, and for text, the last 10% of the
// tokens are validation and the rest training.
#pragma once

#include <cstddef>
#include <cstdint>
#include <iterator>
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
inline constexpr int32_t kTokenFileVersion = 1;    // uint16 tokens
inline constexpr int32_t kTokenFileVersion32 = 2;  // uint32 tokens
inline constexpr size_t kTokenFileHeaderInts = 256;
// The largest vocabulary version 1 holds.
inline constexpr int64_t kTokenFile16Vocab = 65536;
// The tokens of a version 1 or 2 file.
Result<std::vector<uint32_t>> read_token_file(const std::string& path);
// Version 1.
Status write_token_file(const std::string& path, const std::vector<uint16_t>& tokens);
// Version 1 when vocab <= 65536, else version 2; a token at or above vocab is an
// error naming it, its position and the vocabulary size (nothing is written).
Status write_token_file(const std::string& path, const uint32_t* tokens, size_t n, int64_t vocab);

// Read-only tokens, 16 or 32 bits each, and what keeps them alive (a file mapping
// or a vector); copies share them.
class TokenSpan {
 public:
  TokenSpan() = default;
  // Tokens held in a vector (implicit, so a TokenSplit can be made from one).
  TokenSpan(std::shared_ptr<const std::vector<uint16_t>> tokens)
      : owner_(tokens), data_(tokens ? tokens->data() : nullptr), size_(tokens ? tokens->size() : 0), width_(2) {}
  TokenSpan(std::shared_ptr<const std::vector<uint32_t>> tokens)
      : owner_(tokens), data_(tokens ? tokens->data() : nullptr), size_(tokens ? tokens->size() : 0), width_(4) {}
  // `n` tokens at `data`, valid while `owner` lives.
  TokenSpan(std::shared_ptr<const void> owner, const uint16_t* data, size_t n)
      : owner_(std::move(owner)), data_(data), size_(n), width_(2) {}
  TokenSpan(std::shared_ptr<const void> owner, const uint32_t* data, size_t n)
      : owner_(std::move(owner)), data_(data), size_(n), width_(4) {}
  // The first token's bytes; bytes_per_token() (2 or 4) each.
  const void* raw() const { return data_; }
  int bytes_per_token() const { return width_; }
  size_t size() const { return size_; }
  uint32_t operator[](size_t i) const {
    return width_ == 2 ? static_cast<const uint16_t*>(data_)[i] : static_cast<const uint32_t*>(data_)[i];
  }
  // Tokens [offset, offset + n), sharing the owner.
  TokenSpan subspan(size_t offset, size_t n) const {
    TokenSpan s = *this;
    s.data_ = static_cast<const char*>(data_) + offset * width_;
    s.size_ = n;
    return s;
  }

  class Iterator {  // yields uint32_t
   public:
    using iterator_category = std::forward_iterator_tag;
    using value_type = uint32_t;
    using difference_type = std::ptrdiff_t;
    using pointer = void;
    using reference = uint32_t;
    Iterator() = default;
    Iterator(const TokenSpan* span, size_t i) : span_(span), i_(i) {}
    uint32_t operator*() const { return (*span_)[i_]; }
    Iterator& operator++() {
      ++i_;
      return *this;
    }
    Iterator operator++(int) {
      Iterator before = *this;
      ++i_;
      return before;
    }
    bool operator==(const Iterator& o) const { return i_ == o.i_; }

   private:
    const TokenSpan* span_ = nullptr;
    size_t i_ = 0;
  };
  Iterator begin() const { return {this, 0}; }
  Iterator end() const { return {this, size_}; }

 private:
  std::shared_ptr<const void> owner_;
  const void* data_ = nullptr;  // [size_] uint16 or uint32 (width_)
  size_t size_ = 0;
  int width_ = 2;
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
// vocab is 1 to 2^31 - 1.
// val_path, when not empty, is the validation token or text file.
// Errors name the file: missing, not a regular file, empty, wrong magic or
// version, a token count that disagrees with the file's size, a token ≥ vocab.
Result<Dataset> load_dataset(const std::string& path, int vocab, const std::string& val_path = "");

// The same from bytes in memory (text, or the bytes of a token file), named `name`
// in sources and errors; the last 10% are validation. The bytes are copied (into
// tokens), so they need not outlive the call.
Result<Dataset> load_dataset_from_memory(std::string_view bytes, const std::string& name, int vocab);

// A data file's bytes, mapped read-only, with load_dataset's checks (a regular,
// non-empty file; errors name `what` and the path), for text to tokenize.
struct MappedBytes {
  std::shared_ptr<const void> owner;  // keeps the mapping
  std::string_view bytes;
};
Result<MappedBytes> map_data_file(const std::string& path, const std::string& what);
// Whether bytes start with the token-file magic.
bool is_token_file(std::string_view bytes);

// Tokens made elsewhere (a tokenizer's), named `name`: every token must be below
// vocab (the error names the token, its position and the size); the last 10% are
// validation. Held as uint16 when vocab <= 65536.
Result<Dataset> dataset_from_tokens(const std::vector<uint32_t>& tokens, const std::string& name, int vocab);

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

  TokenSpan tokens_;  // [n] uint16 or uint32
  int B_ = 0, T_ = 0;
  LoaderMode mode_ = LoaderMode::Random;
  uint64_t key_ = 0;
  int64_t batch_ = 0;
};

}  // namespace spillway
