// Tokenizer: byte-level BPE read from a Hugging Face tokenizer.json (GPT-2, Llama 3),
// giving the same ids as the `tokenizers` library.
//
//   auto tok = Tokenizer::load("models/llama-3.2-1b");         // a tokenizer.json, or a folder holding one
//   if (!tok) return tok.status();
//   auto ids = tok->encode("Hello world");                     // Result<std::vector<uint32_t>>
//   auto text = tok->decode(ids->data(), ids->size());        // Result<std::string>: "Hello world"
//   int vocab = tok->vocab_size();                             // the largest id + 1 (128256 for Llama 3)
//
//   auto pool = ThreadPool::create(0);                         // big texts: every core, the same ids
//   auto many = tok->encode(corpus, pool->get());
//
// What is read (anything else is an error naming the field and the value):
// - model: type "BPE"; vocab {token: id}; merges as "a b" strings or ["a", "b"]
//   pairs (rank = position; a later duplicate replaces an earlier one, as in
//   `tokenizers`); ignore_merges (a pre-token that is itself in the vocabulary is
//   one token); unk_token and fuse_unk; dropout null or 0; byte_fallback false;
//   continuing_subword_prefix and end_of_word_suffix null or "".
// - added_tokens: found in the text before pre-tokenization, leftmost-longest,
//   first those with normalized false and then those with normalized true (there is
//   no normalizer, so both match the raw text); single_word, lstrip and rstrip
//   as in `tokenizers` (its word and space classes: Alphabetic, marks, decimal
//   digits, connector punctuation, Join_Control; White_Space).
// - normalizer: null (or an empty Sequence).
// - pre_tokenizer: ByteLevel (add_prefix_space; use_regex: GPT-2's regex), or a
//   Sequence of Split steps (pattern {"Regex": ...} or {"String": ...}, behavior
//   "Isolated") ending in one ByteLevel, as Llama 3 uses. Regexes are PCRE2 with
//   UTF and Unicode properties (\p{L}, \p{N}, (?i:...), (?!\S)); \s and \S are
//   read as Unicode White_Space, as the library's Oniguruma does.
// - decoder: ByteLevel (or a Sequence of it).
// - post_processor (null, ByteLevel, TemplateProcessing, or a Sequence of them),
//   truncation and padding are read and not applied: encode() is the library's
//   encode(text, add_special_tokens=False), whole.
//
// Differences from `tokenizers`, all errors where the library goes on silently:
// text that is not valid UTF-8 (the library takes only str); a character with no
// token in the vocabulary and no unk_token (the library drops it); an id not in the
// vocabulary on decode. decode() returns the bytes the tokens stand for; the
// library's decode replaces an invalid UTF-8 sequence (a cut multi-byte
// character) with U+FFFD. Unicode tables are PCRE2's (Debian 12: Unicode 14), so
// a character added to Unicode later may be classed differently.
//
// A Tokenizer is cheap to copy (its tables are shared) and safe to use from
// several threads at once.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"

namespace spillway {

class ThreadPool;

class Tokenizer {
 public:
  // `path` is a tokenizer.json, or a directory holding one.
  static Result<Tokenizer> load(const std::string& path);
  // The tokenizer of JSON text; `name` names it in errors.
  static Result<Tokenizer> from_json(std::string_view json, const std::string& name);

  // The ids of `text` (UTF-8). With a pool of more than one thread, long texts are
  // cut into pieces encoded at once; the ids are the same as without.
  Result<std::vector<uint32_t>> encode(std::string_view text, ThreadPool* pool = nullptr) const;
  // The bytes that ids[0..n) stand for; an id with no token is an error.
  Result<std::string> decode(const uint32_t* ids, size_t n) const;
  Result<std::string> decode(const std::vector<uint32_t>& ids) const { return decode(ids.data(), ids.size()); }

  // The largest id (vocabulary or added token) + 1: a model needs at least this many
  // rows of embeddings.
  int vocab_size() const;
  // The file it came from ("dir/tokenizer.json"), or the name given to from_json.
  const std::string& name() const;
  // The id of a token (vocabulary or added), or -1.
  int64_t token_id(std::string_view token) const;

  struct Impl;

 private:
  explicit Tokenizer(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<const Impl> impl_;
};

// True when `text` is valid UTF-8 (no overlong forms, surrogates or values above
// U+10FFFF); otherwise *bad_offset is the offset of the first invalid byte.
bool valid_utf8(std::string_view text, size_t* bad_offset);

}  // namespace spillway
