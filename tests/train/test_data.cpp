#include <gtest/gtest.h>

#include "support/test_support.h"
#include <stdlib.h>
#include <sys/stat.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>

#include "train/data.h"

using namespace spillway;

namespace {

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

using spillway::testing_support::TempDir;
using spillway::testing_support::read_file;

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// A token file by hand: header ints then raw uint16 tokens.
std::string token_file_bytes(int32_t magic, int32_t version, int32_t count, const std::vector<uint16_t>& tokens) {
  std::vector<int32_t> h(256, 0);
  h[0] = magic;
  h[1] = version;
  h[2] = count;
  std::string s(reinterpret_cast<const char*>(h.data()), h.size() * 4);
  s.append(reinterpret_cast<const char*>(tokens.data()), tokens.size() * 2);
  return s;
}

std::vector<uint16_t> ramp(size_t n, uint16_t start = 0) {
  std::vector<uint16_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint16_t>(start + i);
  return v;
}

TokenSplit split_of(std::vector<uint16_t> v) {
  return {"test split", std::make_shared<const std::vector<uint16_t>>(std::move(v))};
}

}  // namespace

TEST(ByteTokenizer, RoundTrip) {
  std::string text = "Hello, \xc3\xa9t\xc3\xa9!\n\x01\xff";
  std::vector<int32_t> t = byte_encode(text);
  ASSERT_EQ(t.size(), text.size());
  EXPECT_EQ(t[0], 'H');
  EXPECT_EQ(t.back(), 255);
  EXPECT_EQ(byte_decode(t.data(), t.size()), text);
  std::vector<int32_t> odd = {65, 300, -1, 66};
  EXPECT_EQ(byte_decode(odd.data(), odd.size()), "A??B");
}

TEST(TokenFile, WriteReadRoundTripAndLayout) {
  TempDir d;
  std::string path = d.file("t.bin");
  std::vector<uint16_t> tokens = {0, 1, 50256, 65535, 7};
  ASSERT_TRUE(write_token_file(path, tokens).is_ok());
  std::string bytes = read_file(path);
  ASSERT_EQ(bytes, token_file_bytes(20240520, 1, 5, tokens));
  auto back = read_token_file(path);
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  EXPECT_EQ(*back, std::vector<uint32_t>(tokens.begin(), tokens.end()));
}

// llm.c's Llama 3 layout: version 2, uint32 tokens, for vocabularies above 65536.
TEST(TokenFile, Version2HoldsThirtyTwoBitTokens) {
  TempDir d;
  const std::string path = d.file("llama_train.bin");
  const std::vector<uint32_t> tokens = {0, 1, 65535, 65536, 128000, 128255, 7};
  ASSERT_TRUE(write_token_file(path, tokens.data(), tokens.size(), 128256).is_ok());
  std::vector<int32_t> h(256, 0);
  h[0] = 20240520;
  h[1] = 2;
  h[2] = 7;
  std::string expected(reinterpret_cast<const char*>(h.data()), h.size() * 4);
  expected.append(reinterpret_cast<const char*>(tokens.data()), tokens.size() * 4);
  ASSERT_EQ(read_file(path), expected);
  auto back = read_token_file(path);
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  EXPECT_EQ(*back, tokens);

  // Loaded in place, 32 bits a token, into batches.
  auto r = load_dataset(path, 128256);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_FALSE(r->text);
  EXPECT_EQ(r->train.tokens.bytes_per_token(), 4);
  ASSERT_EQ(r->train.size() + r->val.size(), 7u);
  EXPECT_EQ(r->train.tokens[4], 128000u);
  auto loader = DataLoader::create(r->train, 1, 5, LoaderMode::Sequential);
  ASSERT_TRUE(loader.ok()) << loader.status().to_string();
  std::vector<int32_t> tok(5), tgt(5);
  loader->next(tok.data(), tgt.data());
  EXPECT_EQ(tok, (std::vector<int32_t>{0, 1, 65535, 65536, 128000}));
  EXPECT_EQ(tgt, (std::vector<int32_t>{1, 65535, 65536, 128000, 128255}));

  // A token at or above the model's vocabulary: the id, its position, the size.
  r = load_dataset(path, 128000);
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(contains(r.status().message(), "token 128000 at position 4")) << r.status().message();
  EXPECT_TRUE(contains(r.status().message(), "vocabulary size 128000")) << r.status().message();

  // The writer picks version 1 when the vocabulary fits 16 bits, and refuses a token
  // outside the vocabulary.
  const std::vector<uint32_t> small = {3, 50256, 9};
  ASSERT_TRUE(write_token_file(path, small.data(), small.size(), 50257).is_ok());
  EXPECT_EQ(read_file(path), token_file_bytes(20240520, 1, 3, {3, 50256, 9}));
  Status s = write_token_file(path, tokens.data(), tokens.size(), 65536);
  ASSERT_FALSE(s.is_ok());
  EXPECT_TRUE(contains(s.message(), "token 65536 at position 3 is not below the vocabulary size 65536")) << s.message();
  EXPECT_EQ(read_file(path), token_file_bytes(20240520, 1, 3, {3, 50256, 9}));  // untouched

  // A version 2 file whose body is sized for 16-bit tokens: truncated.
  write_bytes(path, token_file_bytes(20240520, 2, 4, {1, 2, 3, 4}));
  r = load_dataset(path, 128256);
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(contains(r.status().message(), "the header counts 4 tokens but the file holds 2")) << r.status().message();
}

TEST(Dataset, FromTokensChecksTheVocabularyAndSplits) {
  std::vector<uint32_t> tokens(100);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<uint32_t>(100000 + i);
  auto r = dataset_from_tokens(tokens, "corpus.txt (tokenized)", 128256);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->train.size(), 90u);
  EXPECT_EQ(r->val.size(), 10u);
  EXPECT_EQ(r->val.tokens[0], 100090u);
  EXPECT_TRUE(contains(r->val.source, "corpus.txt")) << r->val.source;
  r = dataset_from_tokens(tokens, "corpus.txt (tokenized)", 100050);
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(contains(r.status().message(), "corpus.txt (tokenized): token 100050 at position 50")) << r.status().message();
  EXPECT_TRUE(contains(r.status().message(), "vocabulary size 100050")) << r.status().message();
  // A 16-bit vocabulary is held in 16 bits.
  r = dataset_from_tokens({1, 2, 3, 4, 5, 6, 7, 8, 9, 10}, "small", 600);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->train.tokens.bytes_per_token(), 2);
  EXPECT_EQ(r->train.tokens[8], 9u);
  EXPECT_FALSE(dataset_from_tokens({}, "nothing", 600).ok());
}

TEST(TokenFile, BadFilesNameTheFileAndProblem) {
  TempDir d;
  std::string path = d.file("bad.bin");
  auto expect = [&](const std::string& part, StatusCode code) {
    auto r = load_dataset(path, 65536);
    ASSERT_FALSE(r.ok()) << part;
    EXPECT_EQ(r.status().code(), code) << r.status().to_string();
    EXPECT_TRUE(contains(r.status().message(), path)) << r.status().message();
    EXPECT_TRUE(contains(r.status().message(), part)) << r.status().message();
  };
  auto missing = load_dataset(d.file("absent.bin"), 256);
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::NotFound);
  EXPECT_TRUE(contains(missing.status().message(), "absent.bin")) << missing.status().message();

  write_bytes(path, "");
  expect("empty", StatusCode::InvalidArgument);

  write_bytes(path, token_file_bytes(12345, 1, 3, {1, 2, 3}));
  expect("wrong magic 12345", StatusCode::Corrupt);

  write_bytes(path, token_file_bytes(20240520, 3, 3, {1, 2, 3}));
  expect("version 3, expected 1 (uint16 tokens) or 2 (uint32 tokens)", StatusCode::Corrupt);

  write_bytes(path, token_file_bytes(20240520, 1, 10, {1, 2, 3}));
  expect("the header counts 10 tokens but the file holds 3", StatusCode::Corrupt);

  write_bytes(path, token_file_bytes(20240520, 1, 3, {1, 2, 3}).substr(0, 100));
  expect("truncated header", StatusCode::Corrupt);

  write_bytes(path, token_file_bytes(20240520, 1, 0, {}));
  expect("no tokens", StatusCode::InvalidArgument);

  write_bytes(path, token_file_bytes(20240520, 1, 4, {1, 2, 300, 3}));
  auto r = load_dataset(path, 256);
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(contains(r.status().message(), path)) << r.status().message();
  EXPECT_TRUE(contains(r.status().message(), "token 300 at position 2")) << r.status().message();
  EXPECT_TRUE(contains(r.status().message(), "vocabulary size 256")) << r.status().message();

  // A text file with a byte above a small vocabulary.
  std::string txt = d.file("t.txt");
  write_bytes(txt, "abc\x90");
  r = load_dataset(txt, 128);
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(contains(r.status().message(), "byte 144 at position 3")) << r.status().message();
}

TEST(Dataset, TextIsByteTokenizedAndSplitNinetyTen) {
  TempDir d;
  std::string path = d.file("story.txt");
  std::string text;
  for (int i = 0; i < 100; ++i) text += static_cast<char>('a' + i % 26);
  write_bytes(path, text);
  auto r = load_dataset(path, 256);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_TRUE(r->text);
  ASSERT_EQ(r->train.size(), 90u);
  ASSERT_EQ(r->val.size(), 10u);
  EXPECT_EQ(r->train.tokens[0], 'a');
  EXPECT_EQ(r->val.tokens[0], static_cast<uint16_t>(text[90]));
  EXPECT_TRUE(contains(r->val.source, "validation")) << r->val.source;
  EXPECT_TRUE(contains(r->val.source, path)) << r->val.source;

  // A text file named *.txt that happens to be short and binary-looking is still text.
  write_bytes(path, std::string("\x00\x01\x02", 3));
  r = load_dataset(path, 256);
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(r->text);
}

TEST(Dataset, TokenFilesPairTrainWithValOrSplit) {
  TempDir d;
  std::string train = d.file("shakespeare_train.bin"), val = d.file("shakespeare_val.bin");
  ASSERT_TRUE(write_token_file(train, ramp(1000)).is_ok());
  auto r = load_dataset(train, 50257);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_FALSE(r->text);
  EXPECT_EQ(r->train.size(), 900u);  // no val file yet: last 10%
  EXPECT_EQ(r->val.size(), 100u);
  EXPECT_EQ(r->val.tokens[0], 900);

  ASSERT_TRUE(write_token_file(val, ramp(50, 7)).is_ok());
  r = load_dataset(train, 50257);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->train.size(), 1000u);
  EXPECT_EQ(r->val.size(), 50u);
  EXPECT_EQ(r->val.tokens[0], 7);
  EXPECT_EQ(r->val.source, val);

  // An explicit validation file wins; it may be text.
  std::string other = d.file("other.txt");
  write_bytes(other, "xyz");
  r = load_dataset(train, 50257, other);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->val.size(), 3u);
  EXPECT_EQ(r->val.tokens[0], 'x');

  // A token file detected by its magic, whatever its name.
  std::string odd = d.file("tokens.dat");
  ASSERT_TRUE(write_token_file(odd, ramp(20)).is_ok());
  r = load_dataset(odd, 256);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_FALSE(r->text);
  EXPECT_EQ(r->train.size(), 18u);

  auto bad_val = load_dataset(train, 50257, d.file("missing_val.bin"));
  ASSERT_FALSE(bad_val.ok());
  EXPECT_TRUE(contains(bad_val.status().message(), "missing_val.bin")) << bad_val.status().message();
}

TEST(DataLoader, TooShortForOneSequence) {
  TempDir d;
  std::string path = d.file("short.txt");
  write_bytes(path, std::string(40, 'q'));
  auto data = load_dataset(path, 256);
  ASSERT_TRUE(data.ok());
  ASSERT_TRUE(DataLoader::create(data->train, 2, 35, LoaderMode::Random, 1).ok());  // 36 tokens: T+1
  auto r = DataLoader::create(data->train, 2, 36, LoaderMode::Random, 1);
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(contains(r.status().message(), path)) << r.status().message();
  EXPECT_TRUE(contains(r.status().message(), "has 36 tokens")) << r.status().message();
  EXPECT_TRUE(contains(r.status().message(), "T+1 = 37")) << r.status().message();
  r = DataLoader::create(data->val, 1, 4, LoaderMode::Sequential);  // validation: 4 tokens
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(contains(r.status().message(), "validation")) << r.status().message();
}

TEST(DataLoader, RandomIsDeterministicFromSeedAndTargetsAreNextTokens) {
  const int B = 4, T = 16;
  TokenSplit s = split_of(ramp(5000, 3));
  auto a = DataLoader::create(s, B, T, LoaderMode::Random, 42);
  auto b = DataLoader::create(s, B, T, LoaderMode::Random, 42);
  auto c = DataLoader::create(s, B, T, LoaderMode::Random, 43);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  std::vector<int32_t> ta(B * T), ya(B * T), tb(B * T), yb(B * T), tc(B * T), yc(B * T);
  std::vector<std::vector<int32_t>> history;
  int differs = 0;
  std::set<int32_t> starts;
  for (int i = 0; i < 20; ++i) {
    a->next(ta.data(), ya.data());
    b->next(tb.data(), yb.data());
    c->next(tc.data(), yc.data());
    EXPECT_EQ(ta, tb);
    EXPECT_EQ(ya, yb);
    differs += ta != tc;
    history.push_back(ta);
    for (int r = 0; r < B; ++r) {
      starts.insert(ta[r * T]);
      for (int t = 0; t < T; ++t) {
        // ramp data: each row is consecutive, and the target is the next token.
        EXPECT_EQ(ta[r * T + t], ta[r * T] + t);
        EXPECT_EQ(ya[r * T + t], ta[r * T + t] + 1);
      }
      EXPECT_GE(ta[r * T], 3);
      EXPECT_LE(ta[r * T] + T, 3 + 4999);  // last target within the data
    }
  }
  EXPECT_EQ(differs, 20);
  EXPECT_GT(starts.size(), 70u);  // 80 random offsets out of 4984, nearly all distinct
  EXPECT_EQ(a->batch_index(), 20);
  // seek: the batch sequence depends only on the batch number.
  a->seek(7);
  a->next(ta.data(), ya.data());
  EXPECT_EQ(ta, history[7]);
  EXPECT_EQ(a->batches_per_epoch(), 4999 / (B * T));
}

TEST(DataLoader, SequentialCoversWindowsInOrderAndWraps) {
  const int B = 2, T = 4;
  TokenSplit s = split_of(ramp(23));  // (23-1)/4 = 5 windows: starts 0, 4, 8, 12, 16
  auto l = DataLoader::create(s, B, T, LoaderMode::Sequential);
  ASSERT_TRUE(l.ok());
  EXPECT_EQ(l->batches_per_epoch(), 2);
  std::vector<int32_t> tok(B * T), tgt(B * T);
  std::vector<int32_t> starts;
  for (int i = 0; i < 4; ++i) {
    l->next(tok.data(), tgt.data());
    for (int r = 0; r < B; ++r) {
      starts.push_back(tok[r * T]);
      for (int t = 0; t < T; ++t) EXPECT_EQ(tgt[r * T + t], tok[r * T + t] + 1);
    }
  }
  EXPECT_EQ(starts, (std::vector<int32_t>{0, 4, 8, 12, 16, 0, 4, 8}));
  l->seek(0);
  l->next(tok.data(), tgt.data());
  EXPECT_EQ(tok[0], 0);
}

// ---- hostile data inputs (issue 9): regular files only, mapped, sizes checked

TEST(Dataset, OnlyRegularFilesAreRead) {
  TempDir d;
  auto expect_refused = [](const std::string& path, const std::string& kind) {
    auto r = load_dataset(path, 256);
    ASSERT_FALSE(r.ok()) << path;
    EXPECT_EQ(r.status().code(), StatusCode::InvalidArgument) << r.status().to_string();
    EXPECT_TRUE(contains(r.status().message(), path + " is " + kind)) << r.status().message();
    EXPECT_TRUE(contains(r.status().message(), "regular file")) << r.status().message();
  };
  expect_refused("/dev/zero", "a character device");  // was read without end
  expect_refused(d.path(), "a directory");
  const std::string fifo = d.file("pipe");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  expect_refused(fifo, "a named pipe");  // and opening it does not wait for a writer
  // A symbolic link to a device is the device.
  const std::string link = d.file("zero.txt");
  std::filesystem::create_symlink("/dev/zero", link);
  expect_refused(link, "a character device");
  // The validation file too.
  const std::string train = d.file("t_train.bin");
  ASSERT_TRUE(write_token_file(train, ramp(100)).is_ok());
  auto r = load_dataset(train, 256, "/dev/zero");
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(contains(r.status().message(), "validation file /dev/zero is a character device")) << r.status().message();
}

TEST(TokenFile, CountMustMatchTheFileSize) {
  TempDir d;
  const std::string path = d.file("extra.bin");
  // Two bytes more than the header's 3 tokens: refused, not silently ignored.
  write_bytes(path, token_file_bytes(20240520, 1, 3, {1, 2, 3, 4}));
  auto r = load_dataset(path, 256);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::Corrupt);
  EXPECT_TRUE(contains(r.status().message(), "the header counts 3 tokens (6 bytes) but 8 bytes follow the header"))
      << r.status().message();
  write_bytes(path, token_file_bytes(20240520, 1, 3, {1, 2, 3}) + "x");  // an odd byte
  r = load_dataset(path, 256);
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(contains(r.status().message(), "7 bytes follow the header")) << r.status().message();
  auto t = read_token_file(path);
  ASSERT_FALSE(t.ok());
  // A count near INT32_MAX in a small file: the truncation error, not an allocation.
  write_bytes(path, token_file_bytes(20240520, 1, INT32_MAX, {1, 2, 3}));
  r = load_dataset(path, 256);
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(contains(r.status().message(), "the header counts 2147483647 tokens but the file holds 3"))
      << r.status().message();
}

TEST(Dataset, TokenFilesAreMappedNotCopied) {
  TempDir d;
  const std::string path = d.file("m.bin");
  ASSERT_TRUE(write_token_file(path, ramp(1000, 5)).is_ok());
  auto r = load_dataset(path, 2000);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  // Both splits point into one mapping of the file, after its 1024-byte header.
  EXPECT_EQ(static_cast<const char*>(r->val.tokens.raw()), static_cast<const char*>(r->train.tokens.raw()) + 900 * 2);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(r->train.tokens.raw()) % 4096, 1024u);
  EXPECT_EQ(r->train.tokens[0], 5);
  EXPECT_EQ(r->val.tokens[99], 1004);
  // The mapping outlives the dataset while a loader holds the split.
  auto loader = DataLoader::create(r->val, 1, 8, LoaderMode::Sequential);
  ASSERT_TRUE(loader.ok());
  r = Result<Dataset>(Status::internal("dropped"));
  std::vector<int32_t> tok(8), tgt(8);
  loader->next(tok.data(), tgt.data());
  EXPECT_EQ(tok[0], 905);
  EXPECT_EQ(tgt[7], 913);
}

TEST(Dataset, FromMemoryTextAndTokenBytes) {
  std::string text(200, 'a');
  text[180] = 'z';
  auto r = load_dataset_from_memory(text, "bundled corpus", 256);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_TRUE(r->text);
  EXPECT_EQ(r->train.size(), 180u);
  EXPECT_EQ(r->val.size(), 20u);
  EXPECT_EQ(r->val.tokens[0], 'z');
  EXPECT_TRUE(contains(r->val.source, "bundled corpus")) << r->val.source;
  r = load_dataset_from_memory(token_file_bytes(20240520, 1, 20, ramp(20, 40)), "tokens in memory", 256);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_FALSE(r->text);
  EXPECT_EQ(r->train.size(), 18u);
  EXPECT_EQ(r->val.tokens[1], 59);
  auto empty = load_dataset_from_memory("", "nothing", 256);
  ASSERT_FALSE(empty.ok());
  EXPECT_TRUE(contains(empty.status().message(), "nothing")) << empty.status().message();
  auto big = load_dataset_from_memory("abc\x90", "small vocab", 128);
  ASSERT_FALSE(big.ok());
  EXPECT_TRUE(contains(big.status().message(), "byte 144 at position 3")) << big.status().message();
}
