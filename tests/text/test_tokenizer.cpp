// The byte-level BPE tokenizer against the `tokenizers` library's ids
// (tests/data/reference, bench/peers/make_reference_data.py), round trips, the
// parallel encoder, and the errors for what it does not read.
#include <gtest/gtest.h>

#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <variant>
#include <vector>

#include "core/thread_pool.h"
#include "support/test_support.h"
#include "text/tokenizer.h"

using namespace spillway;
using json = nlohmann::json;
using spillway::testing_support::read_file;
using spillway::testing_support::TempDir;

namespace {

const std::string kReference = std::string(SPILLWAY_SOURCE_DIR) + "/tests/data/reference/";

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

json reference_json(const std::string& file) {
  const std::string text = read_file(kReference + file);
  EXPECT_FALSE(text.empty()) << kReference + file;
  return json::parse(text);
}

Tokenizer load_ok(const std::string& path) {
  auto t = Tokenizer::load(path);
  EXPECT_TRUE(t.ok()) << t.status().to_string();
  return std::move(t).value();
}

std::vector<uint32_t> encode_ok(const Tokenizer& t, std::string_view text, ThreadPool* pool = nullptr) {
  auto ids = t.encode(text, pool);
  EXPECT_TRUE(ids.ok()) << ids.status().to_string();
  return ids.ok() ? *ids : std::vector<uint32_t>{};
}

// A tokenizer.json from the GPT-2 reference with `edit` applied.
Result<Tokenizer> edited(const std::function<void(json&)>& edit) {
  json j = reference_json("tok-gpt2/tokenizer.json");
  edit(j);
  return Tokenizer::from_json(j.dump(), "edited.json");
}

void expect_error(const Result<Tokenizer>& t, std::initializer_list<std::string> parts) {
  ASSERT_FALSE(t.ok());
  for (const std::string& p : parts) EXPECT_TRUE(contains(t.status().message(), p)) << t.status().message();
}

}  // namespace

class ReferenceIds : public ::testing::TestWithParam<std::string> {};

// Every text's ids equal the library's, and decoding gives the text back.
TEST_P(ReferenceIds, MatchTheLibraryAndRoundTrip) {
  const std::string name = GetParam();
  const json cases = reference_json("tokenizer-cases.json");
  const Tokenizer tok = load_ok(kReference + "tok-" + name);  // the directory
  EXPECT_EQ(tok.vocab_size(), cases[name + "_vocab"].get<int>());
  const auto& texts = cases["texts"];
  ASSERT_EQ(texts.size(), cases[name].size());
  ASSERT_GE(texts.size(), 10u);
  for (size_t i = 0; i < texts.size(); ++i) {
    const std::string text = texts[i].get<std::string>();
    const std::vector<uint32_t> expected = cases[name][i].get<std::vector<uint32_t>>();
    const std::vector<uint32_t> ids = encode_ok(tok, text);
    EXPECT_EQ(ids, expected) << name << " text " << i << ": " << text;
    auto back = tok.decode(ids);
    ASSERT_TRUE(back.ok()) << back.status().to_string();
    EXPECT_EQ(*back, text) << name << " text " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Tokenizer, ReferenceIds, ::testing::Values("gpt2", "llama3"));

TEST(Tokenizer, MergesAsStringsGiveTheSameIds) {
  const json cases = reference_json("tokenizer-cases.json");
  auto legacy = edited([](json& j) {
    json merges = json::array();
    for (const auto& m : j["model"]["merges"]) merges.push_back(m[0].get<std::string>() + " " + m[1].get<std::string>());
    j["model"]["merges"] = merges;
  });
  ASSERT_TRUE(legacy.ok()) << legacy.status().to_string();
  for (size_t i = 0; i < cases["texts"].size(); ++i)
    EXPECT_EQ(encode_ok(*legacy, cases["texts"][i].get<std::string>()), cases["gpt2"][i].get<std::vector<uint32_t>>());
}

// Added tokens are cut out of the text first, whatever the regex would do.
TEST(Tokenizer, SpecialTokensInTheText) {
  const Tokenizer tok = load_ok(kReference + "tok-llama3/tokenizer.json");
  ASSERT_EQ(tok.token_id("<|endoftext|>"), 0);
  std::vector<uint32_t> expected = encode_ok(tok, "the end.");
  expected.push_back(0);
  const std::vector<uint32_t> next = encode_ok(tok, "Next");
  expected.insert(expected.end(), next.begin(), next.end());
  const std::string text = "the end.<|endoftext|>Next";
  EXPECT_EQ(encode_ok(tok, text), expected);
  auto back = tok.decode(expected);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(*back, text);
  // Not a token when cut short.
  for (uint32_t id : encode_ok(tok, "<|endoftext|")) EXPECT_NE(id, 0u);
}

// A small hand-made vocabulary: merges a+b → ab, ab+c → abc, plus "bc" that no
// merge makes; ignore_merges takes a whole pre-token from the vocabulary.
TEST(Tokenizer, IgnoreMergesTakesWholeWordsFromTheVocabulary) {
  json j = reference_json("tok-gpt2/tokenizer.json");
  // The GPT-2 reference vocabulary: <|endoftext|>, then every byte's character (ids 1..256).
  json vocab = json::object();
  const json& full = j["model"]["vocab"];
  uint32_t next = 0;
  for (auto it = full.begin(); it != full.end(); ++it)
    if (it.value().get<uint32_t>() <= 256) {
      vocab[it.key()] = it.value();
      next = std::max(next, it.value().get<uint32_t>() + 1);
    }
  vocab["ab"] = next;
  vocab["abc"] = next + 1;
  vocab["bc"] = next + 2;
  j["model"]["vocab"] = vocab;
  j["model"]["merges"] = json::array({json::array({"a", "b"}), json::array({"ab", "c"})});
  auto merged = Tokenizer::from_json(j.dump(), "small.json");
  ASSERT_TRUE(merged.ok()) << merged.status().to_string();
  EXPECT_EQ(encode_ok(*merged, "abc"), (std::vector<uint32_t>{next + 1}));
  EXPECT_EQ(encode_ok(*merged, "bc"), (std::vector<uint32_t>{vocab["b"].get<uint32_t>(), vocab["c"].get<uint32_t>()}));
  j["model"]["ignore_merges"] = true;
  auto ignoring = Tokenizer::from_json(j.dump(), "small.json");
  ASSERT_TRUE(ignoring.ok()) << ignoring.status().to_string();
  EXPECT_EQ(encode_ok(*ignoring, "bc"), (std::vector<uint32_t>{next + 2}));
  EXPECT_EQ(encode_ok(*ignoring, "abc"), (std::vector<uint32_t>{next + 1}));
  EXPECT_EQ(encode_ok(*ignoring, "abcb"), (std::vector<uint32_t>{next + 1, vocab["b"].get<uint32_t>()}));
}

// Long texts are cut into chunks encoded at once; the ids are those of one pass,
// also where a chunk boundary falls inside a pre-token or a special token.
TEST(Tokenizer, ParallelEncodingGivesTheSameIds) {
  std::string corpus = read_file(std::string(SPILLWAY_SOURCE_DIR) + "/data/tinyshakespeare.txt");
  ASSERT_GT(corpus.size(), 1000000u);
  corpus.resize(600000);
  // Long runs without a cut: spaces, digits, letters, emoji, and special tokens.
  std::string text = corpus;
  text += std::string(70000, ' ') + "x" + std::string(70000, '7') + "\n" + std::string(250000, 'q');
  for (int i = 0; i < 3000; ++i) text += "\xF0\x9F\x98\x80 caf\xC3\xA9<|endoftext|>";
  text += corpus.substr(0, 200000);
  auto pool = ThreadPool::create(4);
  ASSERT_TRUE(pool.ok()) << pool.status().to_string();
  for (const char* name : {"gpt2", "llama3"}) {
    const Tokenizer tok = load_ok(kReference + "tok-" + name);
    const std::vector<uint32_t> serial = encode_ok(tok, text);
    const std::vector<uint32_t> parallel = encode_ok(tok, text, pool->get());
    EXPECT_EQ(serial.size(), parallel.size()) << name;
    EXPECT_TRUE(serial == parallel) << name;
    auto back = tok.decode(parallel);
    ASSERT_TRUE(back.ok());
    EXPECT_TRUE(*back == text) << name;
  }
}

TEST(Tokenizer, DecodeRefusesIdsOutsideTheVocabulary) {
  const Tokenizer tok = load_ok(kReference + "tok-gpt2/tokenizer.json");
  const std::vector<uint32_t> ids = {5, 600, 7};
  auto r = tok.decode(ids);
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(contains(r.status().message(), "token id 600 at position 1")) << r.status().message();
  EXPECT_TRUE(contains(r.status().message(), "size 600")) << r.status().message();
}

TEST(Tokenizer, InvalidUtf8IsAnErrorWithItsOffset) {
  const Tokenizer tok = load_ok(kReference + "tok-gpt2/tokenizer.json");
  auto r = tok.encode("abc\xC3(def");
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(contains(r.status().message(), "not valid UTF-8 at byte offset 3")) << r.status().message();
  size_t bad = 0;
  EXPECT_FALSE(valid_utf8("\xED\xA0\x80", &bad));  // a surrogate
  EXPECT_FALSE(valid_utf8("\xC0\x80", &bad));      // overlong
  EXPECT_TRUE(valid_utf8("\xF0\x9F\x98\x80 \xC3\xA9", &bad));
}

TEST(Tokenizer, UnsupportedComponentsNameTheFieldAndType) {
  expect_error(edited([](json& j) { j["model"]["type"] = "WordPiece"; }), {"model.type", "WordPiece", "BPE"});
  expect_error(edited([](json& j) { j["model"]["type"] = "Unigram"; }), {"model.type", "Unigram"});
  expect_error(edited([](json& j) { j["normalizer"] = {{"type", "NFC"}}; }), {"normalizer.type", "NFC"});
  expect_error(edited([](json& j) { j["pre_tokenizer"] = {{"type", "Whitespace"}}; }), {"pre_tokenizer.type", "Whitespace"});
  expect_error(edited([](json& j) {
                 j["pre_tokenizer"] = {{"type", "Sequence"},
                                       {"pretokenizers", json::array({{{"type", "Digits"}}, j["pre_tokenizer"]})}};
               }),
               {"pre_tokenizer.pretokenizers[0].type", "Digits"});
  expect_error(edited([](json& j) {
                 j["pre_tokenizer"] = {
                     {"type", "Sequence"},
                     {"pretokenizers", json::array({{{"type", "Split"},
                                                     {"pattern", {{"Regex", "\\s+"}}},
                                                     {"behavior", "Removed"},
                                                     {"invert", false}},
                                                    j["pre_tokenizer"]})}};
               }),
               {"pre_tokenizer.pretokenizers[0].behavior", "Removed", "Isolated"});
  expect_error(edited([](json& j) {
                 j["pre_tokenizer"] = {{"type", "Sequence"},
                                       {"pretokenizers", json::array({{{"type", "Split"},
                                                                       {"pattern", {{"Regex", "(\\p{L}"}}},
                                                                       {"behavior", "Isolated"}},
                                                                      j["pre_tokenizer"]})}};
               }),
               {"pre_tokenizer.pretokenizers[0].pattern.Regex", "does not compile"});
  expect_error(edited([](json& j) { j["decoder"] = {{"type", "WordPiece"}}; }), {"decoder.type", "WordPiece"});
  expect_error(edited([](json& j) { j["decoder"] = nullptr; }), {"decoder", "null", "ByteLevel"});
  expect_error(edited([](json& j) { j["model"]["byte_fallback"] = true; }), {"model.byte_fallback"});
  expect_error(edited([](json& j) { j["model"]["continuing_subword_prefix"] = "##"; }),
               {"model.continuing_subword_prefix", "##"});
  expect_error(edited([](json& j) { j["model"]["dropout"] = 0.1; }), {"model.dropout"});
  expect_error(edited([](json& j) { j["model"]["merges"][3] = json::array({"zz", "qq"}); }),
               {"model.merges[3]", "\"zz\" is not in model.vocab"});
  expect_error(edited([](json& j) { j["model"]["merges"][2] = "a b c"; }), {"model.merges[2]"});
  // An id far above the count of tokens (found by fuzz_tokenizer: a table of 2^30 entries).
  expect_error(edited([](json& j) { j["added_tokens"][0]["id"] = 1 << 30; }),
               {"\"<|endoftext|>\" has the id 1073741824", "few gaps"});
  expect_error(edited([](json& j) { j["model"]["vocab"]["!"] = 0; }), {"the id 0 to two tokens"});
  auto missing = Tokenizer::load(kReference + "no-such-dir");
  ASSERT_FALSE(missing.ok());
  EXPECT_TRUE(contains(missing.status().message(), "no-such-dir")) << missing.status().message();
  TempDir d;
  auto empty_dir = Tokenizer::load(d.path());
  ASSERT_FALSE(empty_dir.ok());
  EXPECT_TRUE(contains(empty_dir.status().message(), "holds no tokenizer.json")) << empty_dir.status().message();
  auto not_json = Tokenizer::from_json("{\"model\": ", "broken.json");
  ASSERT_FALSE(not_json.ok());
  EXPECT_TRUE(contains(not_json.status().message(), "broken.json")) << not_json.status().message();
}

// A byte with no token: an error naming it (the library drops it), or unk_token.
TEST(Tokenizer, ByteWithoutATokenIsAnErrorOrUnk) {
  // '\xC2\xA9' ('©') is byte 0xA9's character; 'é' is the bytes C3 A9.
  auto without = edited([](json& j) { j["model"]["vocab"].erase("\xC2\xA9"); });
  ASSERT_TRUE(without.ok()) << without.status().to_string();
  auto r = without->encode("ab\xC3\xA9");
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(contains(r.status().message(), "byte 0xA9 at byte offset 3")) << r.status().message();
  EXPECT_TRUE(contains(r.status().message(), "unk_token")) << r.status().message();
  auto with_unk = edited([](json& j) {
    j["model"]["vocab"].erase("\xC2\xA9");
    j["model"]["unk_token"] = "<|endoftext|>";
  });
  ASSERT_TRUE(with_unk.ok()) << with_unk.status().to_string();
  const std::vector<uint32_t> ids = encode_ok(*with_unk, "\xC3\xA9");  // bytes C3 A9: a known byte then unk
  ASSERT_EQ(ids.size(), 2u);
  EXPECT_EQ(ids[1], 0u);
}

// Added tokens' options, as in the `tokenizers` library's own tests
// (added_vocabulary.rs: options_use_cases, test_single_word_is_unicode_correct):
// lstrip and rstrip take the spaces around the token into it; a single_word token
// beside a word character (a letter, or a combining mark) is not cut out.
TEST(Tokenizer, AddedTokenOptionsAsTheLibrary) {
  const Tokenizer base = load_ok(kReference + "tok-gpt2/tokenizer.json");
  auto with = edited([](json& j) {
    auto add = [&](int id, const char* content, bool special, bool lstrip, bool rstrip, bool single_word) {
      j["added_tokens"].push_back({{"id", id}, {"content", content}, {"special", special}, {"normalized", !special},
                                   {"lstrip", lstrip}, {"rstrip", rstrip}, {"single_word", single_word}});
    };
    add(600, "my", false, true, true, false);
    add(601, "name", false, false, false, false);
    add(602, "ony", false, false, false, true);
    add(603, "[CLS]", true, false, false, false);
    add(604, "[SEP]", true, false, false, false);
    add(605, "<mask>", false, false, false, true);
  });
  ASSERT_TRUE(with.ok()) << with.status().to_string();
  EXPECT_EQ(with->vocab_size(), 606);
  auto join = [&](std::initializer_list<std::variant<uint32_t, std::string>> parts) {
    std::vector<uint32_t> ids;
    for (const auto& p : parts) {
      if (std::holds_alternative<uint32_t>(p)) {
        ids.push_back(std::get<uint32_t>(p));
      } else {
        const std::vector<uint32_t> more = encode_ok(base, std::get<std::string>(p));
        ids.insert(ids.end(), more.begin(), more.end());
      }
    }
    return ids;
  };
  // "[CLS]", " my " (my, with both spaces), "name", " is anthony " ("ony" inside a word), "[SEP]".
  // Then "<mask>" beside "a" or "ony" stays text, but the "ony" after it is a word of its own.
  EXPECT_EQ(encode_ok(*with, "[CLS] my name is anthony [SEP]"),
            join({603u, 600u, 601u, std::string(" is anthony "), 604u}));
  EXPECT_EQ(encode_ok(*with, "<mask> my name <mask> a<mask> <mask>ony <mask>"),
            join({605u, 600u, 601u, std::string(" "), 605u, std::string(" a<mask> <mask>"), 602u, std::string(" "), 605u}));
  // Punctuation and a dash are not word characters; a combining mark (U+0330) is.
  EXPECT_EQ(encode_ok(*with, "<mask>, <mask>- \xE2\x97\x8C\xCC\xB0<mask>"),
            join({605u, std::string(", "), 605u, std::string("- \xE2\x97\x8C\xCC\xB0<mask>")}));
}

// U+180E (Mongolian vowel separator) is no white space to `tokenizers`' regexes
// (Oniguruma's \s is Unicode White_Space) but is to PCRE2's \s. With GPT-2's regex,
// " \u180E" is one pre-token, so a merge of "Ġ" (space) and "á" (byte E1, the
// separator's first) applies; were it a space, " " and "\u180E" would be two.
TEST(Tokenizer, WhiteSpaceIsUnicodesAsInTheLibrary) {
  auto tok = edited([](json& j) {
    j["model"]["vocab"]["\xC4\xA0\xC3\xA1"] = 600;  // "Ġá"
    j["model"]["merges"].push_back(json::array({"\xC4\xA0", "\xC3\xA1"}));
  });
  ASSERT_TRUE(tok.ok()) << tok.status().to_string();
  const std::vector<uint32_t> joined = encode_ok(*tok, " \xE1\xA0\x8E");
  ASSERT_FALSE(joined.empty());
  EXPECT_EQ(joined[0], 600u);
  std::vector<uint32_t> expected;
  for (const char* piece : {"a", " \xE1\xA0\x8E", "b"}) {
    const std::vector<uint32_t> ids = encode_ok(*tok, piece);
    expected.insert(expected.end(), ids.begin(), ids.end());
  }
  EXPECT_EQ(encode_ok(*tok, "a \xE1\xA0\x8E" "b"), expected);
  // NEL (U+0085) is white space to both: "a", " ", "\u0085", "b" (no "Ġ" + "Â" pre-token).
  std::vector<uint32_t> nel;
  for (const char* piece : {"a", " ", "\xC2\x85", "b"}) {
    const std::vector<uint32_t> ids = encode_ok(*tok, piece);
    nel.insert(nel.end(), ids.begin(), ids.end());
  }
  EXPECT_EQ(encode_ok(*tok, "a \xC2\x85" "b"), nel);
}
