#include "text/tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <fcntl.h>
#include <pcre2.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>
#include <functional>
#include <nlohmann/json.hpp>
#include <queue>
#include <unordered_map>

#include "core/input_file.h"
#include "core/thread_pool.h"

namespace spillway {

using json = nlohmann::json;

bool valid_utf8(std::string_view text, size_t* bad_offset) {
  const auto* s = reinterpret_cast<const unsigned char*>(text.data());
  const size_t n = text.size();
  size_t i = 0;
  while (i < n) {
    const unsigned char c = s[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    size_t len;
    uint32_t cp;
    if (c >= 0xC2 && c <= 0xDF) {
      len = 2;
      cp = c & 0x1F;
    } else if (c >= 0xE0 && c <= 0xEF) {
      len = 3;
      cp = c & 0x0F;
    } else if (c >= 0xF0 && c <= 0xF4) {
      len = 4;
      cp = c & 0x07;
    } else {
      break;
    }
    if (i + len > n) break;
    bool ok = true;
    for (size_t k = 1; k < len; ++k) {
      if ((s[i + k] & 0xC0) != 0x80) {
        ok = false;
        break;
      }
      cp = (cp << 6) | (s[i + k] & 0x3F);
    }
    if (!ok) break;
    if ((len == 3 && (cp < 0x800 || (cp >= 0xD800 && cp <= 0xDFFF))) || (len == 4 && (cp < 0x10000 || cp > 0x10FFFF)))
      break;
    i += len;
  }
  if (i < n) {
    if (bad_offset) *bad_offset = i;
    return false;
  }
  return true;
}

namespace {

// Bytes in a UTF-8 character that starts with byte c (1 for a stray byte).
size_t utf8_length(unsigned char c) {
  if (c >= 0xF0) return 4;
  if (c >= 0xE0) return 3;
  if (c >= 0xC0) return 2;
  return 1;
}

// Appends code point cp as UTF-8.
void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

// GPT-2's map of bytes to printable characters: bytes 33..126, 161..172 and
// 174..255 stand for themselves, the other 68 for 256, 257, ... in byte order.
struct ByteChars {
  uint32_t char_of[256];
  int byte_of[512];  // -1: not a byte's character
  ByteChars() {
    std::fill(std::begin(byte_of), std::end(byte_of), -1);
    uint32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool self = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
      char_of[b] = self ? static_cast<uint32_t>(b) : next++;
      byte_of[char_of[b]] = b;
    }
  }
};
const ByteChars& byte_chars() {
  static const ByteChars table;
  return table;
}

// A printable form of text for error messages: at most 40 bytes, quoted.
std::string shown(std::string_view s) {
  std::string q = "'";
  q.append(s.substr(0, 40));
  if (s.size() > 40) q += "...";
  return q + "'";
}

constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

struct Regex {
  pcre2_code* code = nullptr;
  std::string field;  // where it came from, for errors
  Regex() = default;
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;
  ~Regex() { pcre2_code_free(code); }
};

std::string pcre2_message(int code) {
  PCRE2_UCHAR buffer[256];
  if (pcre2_get_error_message(code, buffer, sizeof buffer) < 0) return "PCRE2 error " + std::to_string(code);
  return reinterpret_cast<const char*>(buffer);
}

// `tokenizers` matches with Oniguruma, whose \s is Unicode's White_Space. PCRE2's
// \s (with UCP) also takes U+180E (Mongolian vowel separator, a format character
// since Unicode 6.3). So \s becomes \p{White_Space} and \S \P{White_Space}, in a
// class or not; \Q...\E is copied as it is.
std::string with_oniguruma_spaces(std::string_view p) {
  std::string out;
  for (size_t i = 0; i < p.size(); ++i) {
    const char c = p[i];
    if (c != '\\' || i + 1 == p.size()) {
      out += c;
      continue;
    }
    const char n = p[i + 1];
    if (n == 'Q') {
      const size_t e = p.find("\\E", i + 2);
      const size_t stop = e == std::string_view::npos ? p.size() : e + 2;
      out.append(p.substr(i, stop - i));
      i = stop - 1;
      continue;
    }
    if (n == 's') {
      out += "\\p{White_Space}";
    } else if (n == 'S') {
      out += "\\P{White_Space}";
    } else {
      out += c;
      out += n;
    }
    ++i;
  }
  return out;
}

Result<std::unique_ptr<Regex>> compile_regex(const std::string& given, bool literal, const std::string& field) {
  auto re = std::make_unique<Regex>();
  re->field = field;
  int error = 0;
  PCRE2_SIZE offset = 0;
  // PCRE2_LITERAL admits PCRE2_UTF but not PCRE2_UCP (a literal has no classes).
  const uint32_t options = literal ? (PCRE2_UTF | PCRE2_LITERAL) : (PCRE2_UTF | PCRE2_UCP);
  const std::string pattern = literal ? given : with_oniguruma_spaces(given);
  re->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), options, &error, &offset,
                           nullptr);
  if (!re->code && pattern != given) {  // the error and its offset in the pattern as given
    if (pcre2_code* plain = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(given.data()), given.size(), options, &error,
                                          &offset, nullptr))
      pcre2_code_free(plain);
  }
  if (!re->code)
    return Status::invalid_argument(field + ": the regex " + shown(given) + " does not compile (PCRE2, at offset " +
                                    std::to_string(offset) + "): " + pcre2_message(error));
  // JIT when the platform has it; the interpreter gives the same matches otherwise.
  (void)pcre2_jit_compile(re->code, PCRE2_JIT_COMPLETE);
  return re;
}

// Match state of one thread: PCRE2's match data and a JIT stack of up to 8 MiB.
class Matcher {
 public:
  Matcher() {
    data_ = pcre2_match_data_create(1, nullptr);
    context_ = pcre2_match_context_create(nullptr);
    stack_ = pcre2_jit_stack_create(32 * 1024, 8 * 1024 * 1024, nullptr);
    if (context_ && stack_) pcre2_jit_stack_assign(context_, nullptr, stack_);
  }
  ~Matcher() {
    pcre2_match_data_free(data_);
    pcre2_match_context_free(context_);
    pcre2_jit_stack_free(stack_);
  }
  Matcher(const Matcher&) = delete;
  Matcher& operator=(const Matcher&) = delete;

  // The first match of `re` in subject at or after `start`: *found false when none.
  // `options` adds PCRE2_ANCHORED and the like. The subject is valid UTF-8.
  Status find(const Regex& re, std::string_view subject, size_t start, uint32_t options, bool* found, size_t* begin,
              size_t* end) {
    if (!data_ || !context_) return Status::out_of_memory("PCRE2 match data could not be allocated");
    const int rc = pcre2_match(re.code, reinterpret_cast<PCRE2_SPTR>(subject.data()), subject.size(), start,
                               options | PCRE2_NO_UTF_CHECK, data_, context_);
    if (rc == PCRE2_ERROR_NOMATCH) {
      *found = false;
      return Status::ok();
    }
    if (rc < 0)
      return Status::internal(re.field + ": matching the regex at offset " + std::to_string(start) + " of a " +
                              std::to_string(subject.size()) + "-byte piece failed: " + pcre2_message(rc));
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(data_);
    if (ov[1] < ov[0])
      return Status::unsupported(re.field + ": the regex ends a match before its start (\\K in a lookahead)");
    *found = true;
    *begin = ov[0];
    *end = ov[1];
    return Status::ok();
  }

 private:
  pcre2_match_data* data_ = nullptr;
  pcre2_match_context* context_ = nullptr;
  pcre2_jit_stack* stack_ = nullptr;
};

// Where a split of `subject` by a regex stands: the next search starts at
// `search`; the text since `prev` is not yet in a piece.
struct SplitState {
  size_t search = 0;
  size_t prev = 0;
  bool done = false;
  bool operator==(const SplitState&) const = default;
};

// One step of an "Isolated" split (`tokenizers`' find_matches): finds the next
// match and emits the gap before it and the match as pieces (empty ones are not
// pieces). An empty match moves the search on by one character.
template <typename Emit>
Status split_step(Matcher& m, const Regex& re, std::string_view subject, SplitState& st, Emit&& emit) {
  if (st.done) return Status::ok();
  bool found = false;
  size_t b = 0, e = 0;
  if (st.search <= subject.size()) SPILLWAY_RETURN_IF_ERROR(m.find(re, subject, st.search, 0, &found, &b, &e));
  if (!found) {
    st.done = true;
    if (st.prev < subject.size()) SPILLWAY_RETURN_IF_ERROR(emit(subject.substr(st.prev)));
    return Status::ok();
  }
  if (b > st.prev) SPILLWAY_RETURN_IF_ERROR(emit(subject.substr(st.prev, b - st.prev)));
  if (e > b) SPILLWAY_RETURN_IF_ERROR(emit(subject.substr(b, e - b)));
  st.prev = e;
  st.search = e > b ? e : (e < subject.size() ? e + utf8_length(static_cast<unsigned char>(subject[e])) : e + 1);
  return Status::ok();
}

struct AddedToken {
  uint32_t id = 0;
  std::string content;
  bool single_word = false, lstrip = false, rstrip = false, normalized = false;
};

// Added tokens of one kind (normalized or not), by first byte, longest first.
struct AddedSet {
  std::vector<std::vector<const AddedToken*>> by_first_byte = std::vector<std::vector<const AddedToken*>>(256);
  bool empty = true;
  void add(const AddedToken* t) {
    auto& bucket = by_first_byte[static_cast<unsigned char>(t->content[0])];
    bucket.push_back(t);
    std::stable_sort(bucket.begin(), bucket.end(),
                     [](const AddedToken* a, const AddedToken* b) { return a->content.size() > b->content.size(); });
    empty = false;
  }
};

struct MergeRule {
  uint32_t rank;
  uint32_t new_id;
};

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};

}  // namespace

struct Tokenizer::Impl {
  std::string name;
  std::unordered_map<std::string, uint32_t, StringHash, std::equal_to<>> vocab;  // BPE vocabulary
  std::unordered_map<std::string, uint32_t, StringHash, std::equal_to<>> added_ids;
  std::vector<std::string> decoded;  // [vocab_size] the bytes of each id
  std::vector<uint8_t> has_id;       // [vocab_size]
  int vocab_size = 0;
  int64_t byte_id[256];                                // the id of each byte's character, -1: none
  std::unordered_map<uint64_t, MergeRule> merges;     // (left id << 32 | right id) → rule
  bool ignore_merges = false;
  int64_t unk_id = -1;
  bool fuse_unk = false;
  std::vector<std::unique_ptr<AddedToken>> added;
  AddedSet added_plain, added_normalized;  // normalized false / true
  std::vector<std::unique_ptr<Regex>> splits;  // Split steps, in order
  bool add_prefix_space = false;
  std::unique_ptr<Regex> byte_level_regex;  // GPT-2's, when ByteLevel's use_regex
  std::unique_ptr<Regex> word_char, space_char;  // \w and \s, anchored (added tokens' options)
};

namespace {

// ---- encoding

// A piece of text cut by the added tokens: an added token's id, or text to
// pre-tokenize.
struct Item {
  size_t begin = 0, end = 0;
  int64_t added_id = -1;
};

struct MergeCandidate {
  uint32_t rank;
  uint32_t pos;
  uint32_t new_id;
};
struct CandidateAfter {  // the smallest rank first, then the leftmost
  bool operator()(const MergeCandidate& a, const MergeCandidate& b) const {
    return a.rank != b.rank ? a.rank > b.rank : a.pos > b.pos;
  }
};

struct Symbol {
  uint32_t id;
  int32_t prev, next;
  uint32_t len;  // bytes; 0 once merged into its left neighbour
};

// One thread's encoder: match state, a cache of pre-tokens seen, scratch space.
class Encoder {
 public:
  Encoder(const Tokenizer::Impl& t, std::string_view text) : t_(t), text_(text) {}

  // The added-token cut of the whole text.
  Status cut_added(std::vector<Item>& items) {
    std::vector<Item> first;
    SPILLWAY_RETURN_IF_ERROR(find_added(t_.added_plain, 0, text_.size(), first));
    for (const Item& it : first) {
      if (it.added_id >= 0 || t_.added_normalized.empty) {
        items.push_back(it);
        continue;
      }
      SPILLWAY_RETURN_IF_ERROR(find_added(t_.added_normalized, it.begin, it.end, items));
    }
    return Status::ok();
  }

  // Pre-tokenizes and encodes text [begin, end) with the split steps from `level` on.
  Status encode_text(std::string_view piece, size_t level, std::vector<uint32_t>& out) {
    if (piece.empty()) return Status::ok();
    if (level == t_.splits.size()) return byte_level(piece, out);
    SplitState st;
    while (!st.done)
      SPILLWAY_RETURN_IF_ERROR(split_step(matcher_, *t_.splits[level], piece, st, [&](std::string_view p) {
        return encode_text(p, level + 1, out);
      }));
    return Status::ok();
  }

  // ByteLevel: the prefix space, GPT-2's regex, then BPE.
  Status byte_level(std::string_view piece, std::vector<uint32_t>& out) {
    std::string prefixed;
    if (t_.add_prefix_space && piece[0] != ' ') {
      prefixed.reserve(piece.size() + 1);
      prefixed = " ";
      prefixed.append(piece);
      piece = prefixed;
    }
    if (!t_.byte_level_regex) return bpe(piece, out);
    SplitState st;
    while (!st.done)
      SPILLWAY_RETURN_IF_ERROR(
          split_step(matcher_, *t_.byte_level_regex, piece, st, [&](std::string_view p) { return bpe(p, out); }));
    return Status::ok();
  }

  Matcher& matcher() { return matcher_; }

 private:
  // Offset of `piece` in the text, when it lies in it.
  std::string where(std::string_view piece) const {
    if (piece.data() >= text_.data() && piece.data() <= text_.data() + text_.size())
      return "at byte offset " + std::to_string(piece.data() - text_.data());
    return "in the pre-token " + shown(piece);
  }

  // A pre-token's ids (the same for the same bytes, so they are cached).
  Status bpe(std::string_view piece, std::vector<uint32_t>& out) {
    if (auto hit = cache_.find(piece); hit != cache_.end()) {
      out.insert(out.end(), hit->second.begin(), hit->second.end());
      return Status::ok();
    }
    if (t_.ignore_merges) {
      byte_level_.clear();
      for (unsigned char b : piece) append_utf8(byte_level_, byte_chars().char_of[b]);
      if (auto it = t_.vocab.find(byte_level_); it != t_.vocab.end()) {
        out.push_back(it->second);
        if (piece.size() < 256 && cache_.size() < 200000) cache_.emplace(std::string(piece), std::vector<uint32_t>{it->second});
        return Status::ok();
      }
    }
    symbols_.clear();
    auto add = [&](uint32_t id, uint32_t len) {
      const int32_t n = static_cast<int32_t>(symbols_.size());
      if (n > 0) symbols_.back().next = n;
      symbols_.push_back({id, n - 1, -1, len});
    };
    // Unknown characters: `tokenizers`' unk handling (fused or not); without an
    // unk_token the library drops the character, which is an error here.
    int64_t unk_len = -1;
    for (size_t i = 0; i < piece.size(); ++i) {
      const unsigned char b = static_cast<unsigned char>(piece[i]);
      const int64_t id = t_.byte_id[b];
      if (id >= 0) {
        if (unk_len >= 0) add(static_cast<uint32_t>(t_.unk_id), static_cast<uint32_t>(unk_len));
        unk_len = -1;
        add(static_cast<uint32_t>(id), 1);
        continue;
      }
      if (t_.unk_id < 0) {
        std::string ch;
        append_utf8(ch, byte_chars().char_of[b]);
        char hex[8];
        std::snprintf(hex, sizeof hex, "0x%02X", b);
        return Status::invalid_argument("tokenizer " + t_.name + ": the byte " + hex + " " + where(piece.substr(i)) +
                                        " has no token (its byte-level character '" + ch +
                                        "' is not in model.vocab) and model.unk_token is null");
      }
      if (unk_len >= 0 && t_.fuse_unk) {
        unk_len += 1;
      } else {
        if (unk_len >= 0) add(static_cast<uint32_t>(t_.unk_id), static_cast<uint32_t>(unk_len));
        unk_len = 1;
      }
    }
    if (unk_len >= 0) add(static_cast<uint32_t>(t_.unk_id), static_cast<uint32_t>(unk_len));
    merge_all();
    const size_t first = out.size();
    for (const Symbol& s : symbols_)
      if (s.len != 0) out.push_back(s.id);
    if (piece.size() < 256 && cache_.size() < 200000)
      cache_.emplace(std::string(piece), std::vector<uint32_t>(out.begin() + first, out.end()));
    return Status::ok();
  }

  const MergeRule* rule(uint32_t a, uint32_t b) const {
    auto it = t_.merges.find((static_cast<uint64_t>(a) << 32) | b);
    return it == t_.merges.end() ? nullptr : &it->second;
  }

  // `tokenizers`' Word::merge_all without dropout: the lowest-ranked pair first
  // (the leftmost among equals), re-checked when taken.
  void merge_all() {
    queue_ = {};
    for (size_t i = 0; i + 1 < symbols_.size(); ++i)
      if (const MergeRule* r = rule(symbols_[i].id, symbols_[i + 1].id))
        queue_.push({r->rank, static_cast<uint32_t>(i), r->new_id});
    while (!queue_.empty()) {
      const MergeCandidate top = queue_.top();
      queue_.pop();
      Symbol& cur = symbols_[top.pos];
      if (cur.len == 0 || cur.next == -1) continue;
      const int32_t next_pos = cur.next;
      const Symbol right = symbols_[next_pos];
      const MergeRule* r = rule(cur.id, right.id);
      if (!r || r->new_id != top.new_id) continue;
      cur.id = top.new_id;
      cur.len += right.len;
      cur.next = right.next;
      symbols_[next_pos].len = 0;
      if (right.next > -1 && static_cast<size_t>(right.next) < symbols_.size()) symbols_[right.next].prev = top.pos;
      if (cur.prev >= 0)
        if (const MergeRule* p = rule(symbols_[cur.prev].id, cur.id))
          queue_.push({p->rank, static_cast<uint32_t>(cur.prev), p->new_id});
      if (cur.next >= 0 && static_cast<size_t>(cur.next) < symbols_.size())
        if (const MergeRule* n = rule(cur.id, symbols_[cur.next].id)) queue_.push({n->rank, top.pos, n->new_id});
    }
  }

  // Whether the character ending at `end` (before it) / starting at `begin` is
  // a \w character, within text [lo, hi).
  Status word_before(size_t lo, size_t end, bool* yes) {
    *yes = false;
    if (end <= lo) return Status::ok();
    size_t c = end - 1;
    while (c > lo && (static_cast<unsigned char>(text_[c]) & 0xC0) == 0x80) --c;
    size_t b, e;
    return matcher_.find(*t_.word_char, text_.substr(lo, end - lo), c - lo, PCRE2_ANCHORED, yes, &b, &e);
  }
  Status class_at(const Regex& re, size_t begin, size_t hi, bool* yes) {
    *yes = false;
    if (begin >= hi) return Status::ok();
    size_t b, e;
    return matcher_.find(re, text_.substr(0, hi), begin, PCRE2_ANCHORED, yes, &b, &e);
  }

  // `tokenizers`' AddedVocabulary::find_matches on text [lo, hi): leftmost-longest
  // non-overlapping matches, then the single_word, lstrip and rstrip options.
  Status find_added(const AddedSet& set, size_t lo, size_t hi, std::vector<Item>& items) {
    size_t start_offset = lo;
    size_t pos = lo;
    while (!set.empty && pos < hi) {
      const AddedToken* match = nullptr;
      size_t at = pos;
      for (; at < hi; ++at) {
        for (const AddedToken* t : set.by_first_byte[static_cast<unsigned char>(text_[at])]) {
          if (t->content.size() <= hi - at && text_.compare(at, t->content.size(), t->content) == 0) {
            match = t;
            break;
          }
        }
        if (match) break;
      }
      if (!match) break;
      size_t start = at, stop = at + match->content.size();
      pos = stop;
      if (match->single_word) {
        bool before = false, after = false;
        SPILLWAY_RETURN_IF_ERROR(word_before(lo, start, &before));
        SPILLWAY_RETURN_IF_ERROR(class_at(*t_.word_char, stop, hi, &after));
        if (before || after) continue;
      }
      if (match->lstrip) {
        size_t s = start;
        while (s > lo) {
          size_t c = s - 1;
          while (c > lo && (static_cast<unsigned char>(text_[c]) & 0xC0) == 0x80) --c;
          bool space = false;
          SPILLWAY_RETURN_IF_ERROR(class_at(*t_.space_char, c, start, &space));
          if (!space) break;
          s = c;
        }
        start = std::max(s, start_offset);
      }
      if (match->rstrip) {
        while (stop < hi) {
          bool space = false;
          SPILLWAY_RETURN_IF_ERROR(class_at(*t_.space_char, stop, hi, &space));
          if (!space) break;
          stop += utf8_length(static_cast<unsigned char>(text_[stop]));
        }
      }
      if (start_offset < start) items.push_back({start_offset, start, -1});
      items.push_back({start, stop, match->id});
      start_offset = stop;
      pos = stop;
    }
    if (start_offset < hi || (lo == hi && items.empty())) items.push_back({start_offset, hi, -1});
    return Status::ok();
  }

  const Tokenizer::Impl& t_;
  std::string_view text_;
  Matcher matcher_;
  std::unordered_map<std::string, std::vector<uint32_t>, StringHash, std::equal_to<>> cache_;
  std::vector<Symbol> symbols_;
  std::string byte_level_;  // scratch: a pre-token's byte-level characters
  std::priority_queue<MergeCandidate, std::vector<MergeCandidate>, CandidateAfter> queue_;
};

// ---- parallel encoding of one long piece of text
//
// The first regex of the pre-tokenizer (the "top" split) cuts a long text into
// pieces whose ids depend on the piece alone. Its matches follow one another: each
// search starts where the last match ended (SplitState). Every search sees the
// whole text (lookbehind and anchors see what they would), so two runs that reach
// the same SplitState go on alike. A chunk is encoded from a guessed start state;
// the run from the text's start, carried over the chunk boundary one step at a
// time, takes the chunk's ids from the first state both share. That is at once
// in practice (the guess is right whenever a piece starts at the chunk boundary).

struct ChunkRun {
  size_t end = 0;  // the chunk stops once its search reaches this offset
  std::vector<uint32_t> ids;
  struct Mark {
    SplitState state;
    size_t ids;  // ids emitted before the state
  };
  std::vector<Mark> marks;  // the first states, in order
  SplitState final_state;
  Status status;
};

constexpr size_t kMarksPerChunk = 4096;

}  // namespace

// ---- loading

namespace {

Status unsupported_field(const std::string& name, const std::string& field, const std::string& value,
                         const std::string& supported) {
  return Status::unsupported("tokenizer " + name + ": " + field + " is " + value + "; supported: " + supported);
}

std::string json_value(const json& j) {
  if (j.is_string()) return "\"" + j.get<std::string>() + "\"";
  std::string s = j.dump();
  if (s.size() > 80) s = s.substr(0, 80) + "...";
  return s;
}

// The "type" of a component object, or an error naming the field.
Result<std::string> type_of(const std::string& name, const json& j, const std::string& field) {
  if (!j.is_object()) return Status::invalid_argument("tokenizer " + name + ": " + field + " is " + json_value(j) +
                                                      ", expected an object with a \"type\"");
  auto it = j.find("type");
  if (it == j.end() || !it->is_string())
    return Status::invalid_argument("tokenizer " + name + ": " + field + " has no \"type\" string");
  return it->get<std::string>();
}

Result<bool> bool_field(const std::string& name, const json& j, const std::string& field, const char* key,
                        bool fallback) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return fallback;
  if (!it->is_boolean())
    return Status::invalid_argument("tokenizer " + name + ": " + field + "." + key + " is " + json_value(*it) +
                                    ", expected true or false");
  return it->get<bool>();
}

Result<uint32_t> id_value(const std::string& name, const json& j, const std::string& field) {
  if (!j.is_number_integer() || j.get<int64_t>() < 0 || j.get<int64_t>() > INT32_MAX - 1)
    return Status::invalid_argument("tokenizer " + name + ": " + field + " is " + json_value(j) +
                                    ", expected a token id from 0 to " + std::to_string(INT32_MAX - 1));
  return static_cast<uint32_t>(j.get<int64_t>());
}

Status read_model(Tokenizer::Impl& t, const json& model) {
  const std::string& n = t.name;
  SPILLWAY_ASSIGN_OR_RETURN(std::string type, type_of(n, model, "model"));
  if (type != "BPE")
    return unsupported_field(n, "model.type", json_value(type), "\"BPE\" (byte-level BPE; not WordPiece, Unigram or WordLevel)");
  auto null_or = [&](const char* key, auto&& ok) -> Status {
    auto it = model.find(key);
    if (it == model.end() || it->is_null() || ok(*it)) return Status::ok();
    return unsupported_field(n, std::string("model.") + key, json_value(*it), "null");
  };
  SPILLWAY_RETURN_IF_ERROR(null_or("dropout", [](const json& v) { return v.is_number() && v.get<double>() == 0.0; }));
  SPILLWAY_RETURN_IF_ERROR(
      null_or("continuing_subword_prefix", [](const json& v) { return v.is_string() && v.get<std::string>().empty(); }));
  SPILLWAY_RETURN_IF_ERROR(
      null_or("end_of_word_suffix", [](const json& v) { return v.is_string() && v.get<std::string>().empty(); }));
  SPILLWAY_ASSIGN_OR_RETURN(bool byte_fallback, bool_field(n, model, "model", "byte_fallback", false));
  if (byte_fallback) return unsupported_field(n, "model.byte_fallback", "true", "false");
  SPILLWAY_ASSIGN_OR_RETURN(t.ignore_merges, bool_field(n, model, "model", "ignore_merges", false));
  SPILLWAY_ASSIGN_OR_RETURN(t.fuse_unk, bool_field(n, model, "model", "fuse_unk", false));

  auto vocab = model.find("vocab");
  if (vocab == model.end() || !vocab->is_object())
    return Status::invalid_argument("tokenizer " + n + ": model.vocab is missing or not an object {token: id}");
  for (auto it = vocab->begin(); it != vocab->end(); ++it) {
    SPILLWAY_ASSIGN_OR_RETURN(uint32_t id, id_value(n, it.value(), "model.vocab[" + json_value(it.key()) + "]"));
    t.vocab[it.key()] = id;
  }
  if (t.vocab.empty()) return Status::invalid_argument("tokenizer " + n + ": model.vocab is empty");

  auto unk = model.find("unk_token");
  if (unk != model.end() && !unk->is_null()) {
    if (!unk->is_string())
      return Status::invalid_argument("tokenizer " + n + ": model.unk_token is " + json_value(*unk) + ", expected a string");
    auto it = t.vocab.find(unk->get<std::string>());
    if (it == t.vocab.end())
      return Status::invalid_argument("tokenizer " + n + ": model.unk_token " + json_value(*unk) +
                                      " is not in model.vocab");
    t.unk_id = it->second;
  }

  auto merges = model.find("merges");
  if (merges == model.end() || !merges->is_array())
    return Status::invalid_argument("tokenizer " + n + ": model.merges is missing or not an array");
  uint32_t rank = 0;
  for (size_t i = 0; i < merges->size(); ++i) {
    const json& m = (*merges)[i];
    const std::string field = "model.merges[" + std::to_string(i) + "]";
    std::string a, b;
    if (m.is_string()) {
      const std::string s = m.get<std::string>();
      if (rank == 0 && s.starts_with("#version")) continue;  // a merges.txt header line, skipped as the library does
      const size_t space = s.find(' ');
      if (space == std::string::npos || s.find(' ', space + 1) != std::string::npos)
        return Status::invalid_argument("tokenizer " + n + ": " + field + " is " + json_value(m) +
                                        ", expected two tokens separated by one space");
      a = s.substr(0, space);
      b = s.substr(space + 1);
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      a = m[0].get<std::string>();
      b = m[1].get<std::string>();
    } else {
      return Status::invalid_argument("tokenizer " + n + ": " + field + " is " + json_value(m) +
                                      ", expected \"a b\" or [\"a\", \"b\"]");
    }
    auto lookup = [&](const std::string& token, uint32_t* id) -> Status {
      auto it = t.vocab.find(token);
      if (it == t.vocab.end())
        return Status::invalid_argument("tokenizer " + n + ": " + field + " " + json_value(m) + ": the token " +
                                        json_value(token) + " is not in model.vocab");
      *id = it->second;
      return Status::ok();
    };
    uint32_t ia, ib, inew;
    SPILLWAY_RETURN_IF_ERROR(lookup(a, &ia));
    SPILLWAY_RETURN_IF_ERROR(lookup(b, &ib));
    SPILLWAY_RETURN_IF_ERROR(lookup(a + b, &inew));
    t.merges[(static_cast<uint64_t>(ia) << 32) | ib] = {rank, inew};  // a later duplicate wins, as in the library
    ++rank;
  }

  for (int b = 0; b < 256; ++b) {
    std::string ch;
    append_utf8(ch, byte_chars().char_of[b]);
    auto it = t.vocab.find(ch);
    t.byte_id[b] = it == t.vocab.end() ? -1 : static_cast<int64_t>(it->second);
  }
  return Status::ok();
}

Status read_added_tokens(Tokenizer::Impl& t, const json& root) {
  auto list = root.find("added_tokens");
  if (list == root.end() || list->is_null()) return Status::ok();
  if (!list->is_array()) return Status::invalid_argument("tokenizer " + t.name + ": added_tokens is not an array");
  for (size_t i = 0; i < list->size(); ++i) {
    const json& a = (*list)[i];
    const std::string field = "added_tokens[" + std::to_string(i) + "]";
    if (!a.is_object() || !a.contains("content") || !a["content"].is_string() || !a.contains("id"))
      return Status::invalid_argument("tokenizer " + t.name + ": " + field + " needs \"id\" and \"content\"");
    auto tok = std::make_unique<AddedToken>();
    SPILLWAY_ASSIGN_OR_RETURN(tok->id, id_value(t.name, a["id"], field + ".id"));
    tok->content = a["content"].get<std::string>();
    SPILLWAY_ASSIGN_OR_RETURN(tok->single_word, bool_field(t.name, a, field, "single_word", false));
    SPILLWAY_ASSIGN_OR_RETURN(tok->lstrip, bool_field(t.name, a, field, "lstrip", false));
    SPILLWAY_ASSIGN_OR_RETURN(tok->rstrip, bool_field(t.name, a, field, "rstrip", false));
    SPILLWAY_ASSIGN_OR_RETURN(bool special, bool_field(t.name, a, field, "special", false));
    SPILLWAY_ASSIGN_OR_RETURN(tok->normalized, bool_field(t.name, a, field, "normalized", !special));
    t.added_ids[tok->content] = tok->id;
    if (!tok->content.empty()) (tok->normalized ? t.added_normalized : t.added_plain).add(tok.get());
    t.added.push_back(std::move(tok));
  }
  return Status::ok();
}

Status read_byte_level(Tokenizer::Impl& t, const json& j, const std::string& field) {
  SPILLWAY_ASSIGN_OR_RETURN(t.add_prefix_space, bool_field(t.name, j, field, "add_prefix_space", true));
  SPILLWAY_ASSIGN_OR_RETURN(bool use_regex, bool_field(t.name, j, field, "use_regex", true));
  if (use_regex) {
    SPILLWAY_ASSIGN_OR_RETURN(t.byte_level_regex, compile_regex(kGpt2Pattern, false, field + " (GPT-2's regex)"));
  }
  return Status::ok();
}

Status read_split(Tokenizer::Impl& t, const json& j, const std::string& field) {
  auto behavior = j.find("behavior");
  const std::string b = behavior != j.end() && behavior->is_string() ? behavior->get<std::string>() : "";
  // With "Isolated" both the matches and the text between them are pieces, so
  // `invert` changes nothing.
  if (b != "Isolated")
    return unsupported_field(t.name, field + ".behavior", behavior == j.end() ? "missing" : json_value(*behavior),
                             "\"Isolated\"");
  auto pattern = j.find("pattern");
  if (pattern == j.end() || !pattern->is_object() || pattern->size() != 1)
    return Status::invalid_argument("tokenizer " + t.name + ": " + field +
                                    ".pattern is missing; expected {\"Regex\": ...} or {\"String\": ...}");
  const std::string kind = pattern->begin().key();
  if ((kind != "Regex" && kind != "String") || !pattern->begin().value().is_string())
    return unsupported_field(t.name, field + ".pattern", json_value(*pattern), "{\"Regex\": \"...\"} or {\"String\": \"...\"}");
  SPILLWAY_ASSIGN_OR_RETURN(auto re, compile_regex(pattern->begin().value().get<std::string>(), kind == "String",
                                                   field + ".pattern." + kind));
  t.splits.push_back(std::move(re));
  return Status::ok();
}

Status read_pre_tokenizer(Tokenizer::Impl& t, const json& root) {
  const std::string supported = "ByteLevel, or a Sequence of Split (behavior Isolated) steps ending in ByteLevel";
  auto it = root.find("pre_tokenizer");
  if (it == root.end() || it->is_null())
    return unsupported_field(t.name, "pre_tokenizer", "null", supported + " (byte-level BPE needs ByteLevel)");
  SPILLWAY_ASSIGN_OR_RETURN(std::string type, type_of(t.name, *it, "pre_tokenizer"));
  if (type == "ByteLevel") return read_byte_level(t, *it, "pre_tokenizer");
  if (type != "Sequence") return unsupported_field(t.name, "pre_tokenizer.type", json_value(type), supported);
  auto steps = it->find("pretokenizers");
  if (steps == it->end() || !steps->is_array() || steps->empty())
    return Status::invalid_argument("tokenizer " + t.name + ": pre_tokenizer.pretokenizers is missing or empty");
  for (size_t i = 0; i < steps->size(); ++i) {
    const std::string field = "pre_tokenizer.pretokenizers[" + std::to_string(i) + "]";
    SPILLWAY_ASSIGN_OR_RETURN(std::string step, type_of(t.name, (*steps)[i], field));
    const bool last = i + 1 == steps->size();
    if (step == "ByteLevel" && last) {
      SPILLWAY_RETURN_IF_ERROR(read_byte_level(t, (*steps)[i], field));
    } else if (step == "Split" && !last) {
      SPILLWAY_RETURN_IF_ERROR(read_split(t, (*steps)[i], field));
    } else if (step == "ByteLevel" || step == "Split") {
      return unsupported_field(t.name, field + ".type", json_value(step),
                               last ? "ByteLevel as the last step" : "Split before the last step (ByteLevel comes last)");
    } else {
      return unsupported_field(t.name, field + ".type", json_value(step), supported);
    }
  }
  return Status::ok();
}

Status read_components(Tokenizer::Impl& t, const json& root) {
  // normalizer: none.
  if (auto it = root.find("normalizer"); it != root.end() && !it->is_null()) {
    SPILLWAY_ASSIGN_OR_RETURN(std::string type, type_of(t.name, *it, "normalizer"));
    auto list = it->find("normalizers");
    if (!(type == "Sequence" && list != it->end() && list->is_array() && list->empty()))
      return unsupported_field(t.name, "normalizer.type", json_value(type), "null (no normalizer)");
  }
  // decoder: ByteLevel.
  auto dec = root.find("decoder");
  if (dec == root.end() || dec->is_null()) return unsupported_field(t.name, "decoder", "null", "ByteLevel");
  SPILLWAY_ASSIGN_OR_RETURN(std::string dtype, type_of(t.name, *dec, "decoder"));
  if (dtype == "Sequence") {
    auto list = dec->find("decoders");
    if (list == dec->end() || !list->is_array() || list->empty())
      return Status::invalid_argument("tokenizer " + t.name + ": decoder.decoders is missing or empty");
    for (size_t i = 0; i < list->size(); ++i) {
      const std::string field = "decoder.decoders[" + std::to_string(i) + "]";
      SPILLWAY_ASSIGN_OR_RETURN(std::string d, type_of(t.name, (*list)[i], field));
      if (d != "ByteLevel") return unsupported_field(t.name, field + ".type", json_value(d), "ByteLevel");
    }
  } else if (dtype != "ByteLevel") {
    return unsupported_field(t.name, "decoder.type", json_value(dtype), "ByteLevel");
  }
  // post_processor: only adds special tokens around a sequence, which encode() does not do.
  std::function<Status(const json&, const std::string&)> post = [&](const json& p, const std::string& field) -> Status {
    SPILLWAY_ASSIGN_OR_RETURN(std::string type, type_of(t.name, p, field));
    if (type == "ByteLevel" || type == "TemplateProcessing") return Status::ok();
    if (type == "Sequence") {
      auto list = p.find("processors");
      if (list == p.end() || !list->is_array())
        return Status::invalid_argument("tokenizer " + t.name + ": " + field + ".processors is missing");
      for (size_t i = 0; i < list->size(); ++i)
        SPILLWAY_RETURN_IF_ERROR(post((*list)[i], field + ".processors[" + std::to_string(i) + "]"));
      return Status::ok();
    }
    return unsupported_field(t.name, field + ".type", json_value(type), "null, ByteLevel, TemplateProcessing, Sequence");
  };
  if (auto it = root.find("post_processor"); it != root.end() && !it->is_null())
    SPILLWAY_RETURN_IF_ERROR(post(*it, "post_processor"));
  return read_pre_tokenizer(t, root);
}

Status build_tables(Tokenizer::Impl& t) {
  int64_t max_id = -1;
  std::string max_token;
  for (const auto& [token, id] : t.vocab)
    if (id > max_id) max_id = id, max_token = token;
  for (const auto& a : t.added)
    if (a->id > max_id) max_id = a->id, max_token = a->content;
  // Ids run from 0 with few gaps (the tables below have one entry per id): an id far
  // above the count of tokens is refused rather than allocated for.
  const int64_t tokens = static_cast<int64_t>(t.vocab.size() + t.added.size());
  if (max_id >= 2 * tokens + 65536)
    return Status::invalid_argument("tokenizer " + t.name + ": the token " + json_value(max_token) + " has the id " +
                                    std::to_string(max_id) + ", far above the " + std::to_string(tokens) +
                                    " tokens (ids must run from 0 with few gaps: below " +
                                    std::to_string(2 * tokens + 65536) + ")");
  t.vocab_size = static_cast<int>(max_id + 1);
  t.decoded.assign(static_cast<size_t>(t.vocab_size), {});
  t.has_id.assign(static_cast<size_t>(t.vocab_size), 0);
  // The ByteLevel decoder: a token all of whose characters are byte characters is
  // those bytes; any other token (an added token with a space, say) is its text.
  auto decode_token = [](const std::string& token) {
    std::string bytes;
    size_t i = 0;
    while (i < token.size()) {
      const unsigned char c = static_cast<unsigned char>(token[i]);
      const size_t len = utf8_length(c);
      uint32_t cp = len == 1 ? c : (c & (0x7F >> len));
      for (size_t k = 1; k < len && i + k < token.size(); ++k) cp = (cp << 6) | (token[i + k] & 0x3F);
      if (cp >= 512 || byte_chars().byte_of[cp] < 0) return token;
      bytes += static_cast<char>(byte_chars().byte_of[cp]);
      i += len;
    }
    return bytes;
  };
  for (const auto& [token, id] : t.vocab) {
    if (t.has_id[id])
      return Status::invalid_argument("tokenizer " + t.name + ": model.vocab gives the id " + std::to_string(id) +
                                      " to two tokens");
    t.has_id[id] = 1;
    t.decoded[id] = decode_token(token);
  }
  for (const auto& a : t.added) {  // an added token's text wins over the vocabulary's, as in the library
    t.has_id[a->id] = 1;
    t.decoded[a->id] = decode_token(a->content);
  }
  // The classes of the Rust regex crate, which `tokenizers` uses here: \w and \s.
  SPILLWAY_ASSIGN_OR_RETURN(t.word_char, compile_regex(R"([\p{Alphabetic}\p{M}\p{Nd}\p{Pc}\p{Join_Control}])", false,
                                                       "added tokens' single_word"));
  SPILLWAY_ASSIGN_OR_RETURN(t.space_char, compile_regex(R"(\p{White_Space})", false, "added tokens' lstrip/rstrip"));
  return Status::ok();
}

Result<std::string> read_whole_file(const std::string& path) {
  auto opened = open_regular_file(path, "tokenizer");
  if (!opened.ok()) {
    const Status& e = opened.status();
    return e.code() == StatusCode::InvalidArgument ? Status::invalid_argument(e.message() + " (a tokenizer.json)") : e;
  }
  const int fd = *opened;
  std::string data;
  Status s;
  {
    char buffer[1 << 16];
    for (;;) {
      ssize_t n = ::read(fd, buffer, sizeof buffer);
      if (n < 0) {
        if (errno == EINTR) continue;
        s = errno_status("read tokenizer " + path + " at offset " + std::to_string(data.size()), errno);
        break;
      }
      if (n == 0) break;
      data.append(buffer, static_cast<size_t>(n));
    }
  }
  if (::close(fd) != 0 && s.is_ok()) s = errno_status("close tokenizer " + path, errno);
  if (!s.is_ok()) return s;
  return data;
}

}  // namespace

Result<Tokenizer> Tokenizer::from_json(std::string_view text, const std::string& name) {
  json root = json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded()) return Status::invalid_argument("tokenizer " + name + ": not valid JSON");
  if (!root.is_object()) return Status::invalid_argument("tokenizer " + name + ": expected a JSON object");
  auto t = std::make_shared<Impl>();
  t->name = name;
  auto model = root.find("model");
  if (model == root.end()) return Status::invalid_argument("tokenizer " + name + ": has no \"model\"");
  SPILLWAY_RETURN_IF_ERROR(read_model(*t, *model));
  SPILLWAY_RETURN_IF_ERROR(read_added_tokens(*t, root));
  SPILLWAY_RETURN_IF_ERROR(read_components(*t, root));
  SPILLWAY_RETURN_IF_ERROR(build_tables(*t));
  return Tokenizer(std::move(t));
}

Result<Tokenizer> Tokenizer::load(const std::string& path) {
  std::string file = path;
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) {
    file = path + (path.ends_with("/") ? "" : "/") + "tokenizer.json";
    if (::stat(file.c_str(), &st) != 0)
      return Status::not_found("tokenizer: the directory " + path + " holds no tokenizer.json");
  }
  SPILLWAY_ASSIGN_OR_RETURN(std::string data, read_whole_file(file));
  return from_json(data, file);
}

int Tokenizer::vocab_size() const { return impl_->vocab_size; }
const std::string& Tokenizer::name() const { return impl_->name; }

int64_t Tokenizer::token_id(std::string_view token) const {
  if (auto it = impl_->added_ids.find(token); it != impl_->added_ids.end()) return it->second;
  if (auto it = impl_->vocab.find(token); it != impl_->vocab.end()) return it->second;
  return -1;
}

Result<std::string> Tokenizer::decode(const uint32_t* ids, size_t n) const {
  std::string out;
  for (size_t i = 0; i < n; ++i) {
    if (ids[i] >= static_cast<uint32_t>(impl_->vocab_size) || !impl_->has_id[ids[i]])
      return Status::invalid_argument("tokenizer " + impl_->name + ": token id " + std::to_string(ids[i]) +
                                      " at position " + std::to_string(i) + " is not in the vocabulary (size " +
                                      std::to_string(impl_->vocab_size) + ")");
    out += impl_->decoded[ids[i]];
  }
  return out;
}

Result<std::vector<uint32_t>> Tokenizer::encode(std::string_view text, ThreadPool* pool) const {
  const Impl& t = *impl_;
  size_t bad = 0;
  if (!valid_utf8(text, &bad))
    return Status::invalid_argument("tokenizer " + t.name + ": the text is not valid UTF-8 at byte offset " +
                                    std::to_string(bad));
  Encoder main(t, text);
  std::vector<Item> items;
  SPILLWAY_RETURN_IF_ERROR(main.cut_added(items));

  // The ids in order, as stretches of vectors: what this thread encodes, and the
  // chunks encoded on the pool (each from the state where it joins the run).
  std::deque<std::vector<uint32_t>> held;  // stable addresses
  struct Stretch {
    const std::vector<uint32_t>* ids;
    size_t from;
  };
  std::vector<Stretch> stretches;
  std::vector<uint32_t>* serial = nullptr;  // where this thread's ids go now
  auto serial_out = [&]() -> std::vector<uint32_t>& {
    if (!serial) {
      serial = &held.emplace_back();
      stretches.push_back({serial, 0});
    }
    return *serial;
  };

  // The regex that cuts a text first, and what encodes each of its pieces.
  const Regex* top = nullptr;
  size_t next_level = 0;
  if (!t.splits.empty()) {
    top = t.splits[0].get();
    next_level = 1;
  } else if (t.byte_level_regex && !t.add_prefix_space) {
    top = t.byte_level_regex.get();
  }
  const int threads = pool ? pool->size() : 1;
  constexpr size_t kMinChunk = 64 * 1024;
  for (const Item& it : items) {
    if (it.added_id >= 0) {
      serial_out().push_back(static_cast<uint32_t>(it.added_id));
      continue;
    }
    const std::string_view segment = text.substr(it.begin, it.end - it.begin);
    if (!top || threads <= 1 || segment.size() < 2 * kMinChunk) {
      std::vector<uint32_t>& out = serial_out();
      if (out.empty()) out.reserve(segment.size() / 4 + 16);  // about 4 bytes a token with a large vocabulary
      SPILLWAY_RETURN_IF_ERROR(main.encode_text(segment, 0, out));
      continue;
    }
    // Piece ids of the top split: the next levels, or BPE (ByteLevel's regex on top).
    auto encode_piece = [&](Encoder& e, std::string_view piece, std::vector<uint32_t>& ids) {
      return t.splits.empty() ? e.byte_level(piece, ids) : e.encode_text(piece, next_level, ids);
    };
    const size_t chunk_bytes = std::max(kMinChunk, segment.size() / (static_cast<size_t>(threads) * 4) + 1);
    std::vector<size_t> starts;
    for (size_t c = 0; c < segment.size(); c += chunk_bytes) {
      while (c < segment.size() && (static_cast<unsigned char>(segment[c]) & 0xC0) == 0x80) ++c;
      if (c < segment.size() && (starts.empty() || c > starts.back())) starts.push_back(c);
    }
    std::vector<ChunkRun> runs(starts.size());
    for (size_t k = 0; k < starts.size(); ++k) runs[k].end = k + 1 < starts.size() ? starts[k + 1] : SIZE_MAX;
    pool->parallel_for(static_cast<int64_t>(runs.size()), [&](int64_t begin, int64_t end) {
      Encoder e(t, text);
      for (int64_t k = begin; k < end; ++k) {
        ChunkRun& run = runs[static_cast<size_t>(k)];
        run.ids.reserve(chunk_bytes / 3);
        SplitState st{starts[static_cast<size_t>(k)], starts[static_cast<size_t>(k)], false};
        while (!st.done && st.search < run.end) {
          if (run.marks.size() < kMarksPerChunk) run.marks.push_back({st, run.ids.size()});
          run.status = split_step(e.matcher(), *top, segment, st,
                                  [&](std::string_view p) { return encode_piece(e, p, run.ids); });
          if (!run.status.is_ok()) break;
        }
        run.final_state = st;
      }
    });
    for (const ChunkRun& run : runs) SPILLWAY_RETURN_IF_ERROR(run.status);
    // The run from the segment's start: chunk 0, then each chunk from the first
    // state it shares with the run so far; between them, steps of the run itself.
    auto take = [&](ChunkRun& run, size_t from) {
      stretches.push_back({&held.emplace_back(std::move(run.ids)), from});
      serial = nullptr;
    };
    take(runs[0], 0);
    SplitState st = runs[0].final_state;
    for (size_t k = 1; k < runs.size() && !st.done; ++k) {
      ChunkRun& run = runs[k];
      for (;;) {
        auto mark = std::lower_bound(run.marks.begin(), run.marks.end(), st.search,
                                     [](const ChunkRun::Mark& m, size_t s) { return m.state.search < s; });
        if (mark != run.marks.end() && mark->state == st) {
          take(run, mark->ids);
          st = run.final_state;
          break;
        }
        if (st.done || st.search >= run.end) break;  // this chunk is covered by the run itself
        SPILLWAY_RETURN_IF_ERROR(split_step(main.matcher(), *top, segment, st, [&](std::string_view p) {
          return encode_piece(main, p, serial_out());
        }));
      }
    }
    while (!st.done)  // the last chunk never synchronized: finish the run
      SPILLWAY_RETURN_IF_ERROR(split_step(main.matcher(), *top, segment, st, [&](std::string_view p) {
        return encode_piece(main, p, serial_out());
      }));
  }
  if (stretches.empty()) return std::vector<uint32_t>{};
  if (stretches.size() == 1 && stretches[0].from == 0) return std::move(held.front());
  // One vector: the stretches copied at their offsets, on the pool.
  std::vector<size_t> offsets(stretches.size() + 1, 0);
  for (size_t i = 0; i < stretches.size(); ++i)
    offsets[i + 1] = offsets[i] + (stretches[i].ids->size() - stretches[i].from);
  std::vector<uint32_t> out(offsets.back());
  auto copy = [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const Stretch& s = stretches[static_cast<size_t>(i)];
      std::copy(s.ids->begin() + static_cast<std::ptrdiff_t>(s.from), s.ids->end(),
                out.begin() + static_cast<std::ptrdiff_t>(offsets[static_cast<size_t>(i)]));
    }
  };
  if (pool)
    pool->parallel_for(static_cast<int64_t>(stretches.size()), copy);
  else
    copy(0, static_cast<int64_t>(stretches.size()));
  return out;
}

}  // namespace spillway
