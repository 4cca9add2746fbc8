// `spillway tokenize`, and `train` and `sample` with --tokenizer, run as a user
// would: the built binary, its exit code, what it prints and writes.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "support/cli_support.h"
#include "support/test_support.h"
#include "train/data.h"

namespace {

using json = nlohmann::json;
using spillway::testing_support::read_file;
using spillway::testing_support::TempDir;

const std::string kReference = std::string(SPILLWAY_SOURCE_DIR) + "/tests/data/reference/";

using spillway::testing_support::CliRun;
CliRun run(const std::string& args) { return spillway::testing_support::run_cli(args); }

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

void write_text(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary);
  f << text;
}

json reference_json(const std::string& file) { return json::parse(read_file(kReference + file)); }

}  // namespace

// The ids the `tokenizers` library gives, in an llm.c token file (version 1 for a
// vocabulary of 600).
TEST(TokenizeCli, WritesTheLibrarysIdsAsAVersion1TokenFile) {
  TempDir d;
  const json cases = reference_json("tokenizer-cases.json");
  std::vector<uint32_t> expected;
  std::string text;
  // Texts joined by the special token, which is cut out first: the ids are each
  // text's ids with id 0 between them.
  for (size_t i = 0; i < cases["texts"].size(); ++i) {
    if (i) {
      text += "<|endoftext|>";
      expected.push_back(0);
    }
    text += cases["texts"][i].get<std::string>();
    for (uint32_t id : cases["llama3"][i].get<std::vector<uint32_t>>()) expected.push_back(id);
  }
  write_text(d.file("in.txt"), text);
  CliRun r = run("tokenize --tokenizer " + kReference + "tok-llama3 --input " + d.file("in.txt") + " --output " +
              d.file("out.bin") + " --threads 2");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, std::to_string(expected.size()) + " tokens")) << r.output;
  EXPECT_TRUE(contains(r.output, "version 1 (uint16 tokens)")) << r.output;
  const std::string bytes = read_file(d.file("out.bin"));
  ASSERT_EQ(bytes.size(), 1024 + 2 * expected.size());
  int32_t header[3];
  std::memcpy(header, bytes.data(), sizeof header);
  EXPECT_EQ(header[0], 20240520);
  EXPECT_EQ(header[1], 1);
  auto ids = spillway::read_token_file(d.file("out.bin"));
  ASSERT_TRUE(ids.ok()) << ids.status().to_string();
  EXPECT_EQ(*ids, expected);
}

// A vocabulary above 65536 (the special token moved to id 65600): version 2,
// 32-bit ids; training a model whose vocabulary is smaller names the id.
TEST(TokenizeCli, LargeVocabularyWritesVersion2) {
  TempDir d;
  json tok = reference_json("tok-gpt2/tokenizer.json");
  tok["model"]["vocab"].erase("<|endoftext|>");
  tok["added_tokens"][0]["id"] = 65600;
  write_text(d.file("tokenizer.json"), tok.dump());
  write_text(d.file("in.txt"), std::string(300, 'a') + "<|endoftext|>" + std::string(300, 'b'));
  CliRun r = run("tokenize --tokenizer " + d.path() + " --in " + d.file("in.txt") + " --out " + d.file("big.bin"));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "version 2 (uint32 tokens)")) << r.output;
  auto ids = spillway::read_token_file(d.file("big.bin"));
  ASSERT_TRUE(ids.ok()) << ids.status().to_string();
  const std::string bytes = read_file(d.file("big.bin"));
  ASSERT_EQ(bytes.size(), 1024 + 4 * ids->size());
  size_t special = 0;
  for (size_t i = 0; i < ids->size(); ++i)
    if ((*ids)[i] == 65600) special = i;
  ASSERT_GT(special, 0u);

  r = run("train --data " + d.file("big.bin") + " --vocab 600 --steps 1 --batch 1 --context 8 --eval-every 0");
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_TRUE(contains(r.output, "token 65600 at position " + std::to_string(special))) << r.output;
  EXPECT_TRUE(contains(r.output, "vocabulary size 600")) << r.output;
}

TEST(TokenizeCli, BadInputIsAnErrorNamingIt) {
  TempDir d;
  json tok = reference_json("tok-gpt2/tokenizer.json");
  tok["model"]["type"] = "WordPiece";
  write_text(d.file("wp.json"), tok.dump());
  write_text(d.file("in.txt"), "hello");
  CliRun r = run("tokenize --tokenizer " + d.file("wp.json") + " --input " + d.file("in.txt") + " --output " +
              d.file("o.bin"));
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_TRUE(contains(r.output, "model.type is \"WordPiece\"")) << r.output;
  write_text(d.file("bad.txt"), "ok\xff");
  r = run("tokenize --tokenizer " + kReference + "tok-gpt2 --input " + d.file("bad.txt") + " --output " + d.file("o.bin"));
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_TRUE(contains(r.output, "not valid UTF-8 at byte offset 2")) << r.output;
  r = run("tokenize --tokenizer " + kReference + "tok-gpt2 --input " + d.file("missing.txt") + " --output " +
          d.file("o.bin"));
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_TRUE(contains(r.output, "missing.txt")) << r.output;
  EXPECT_TRUE(read_file(d.file("o.bin")).empty());  // nothing written
}

// train --tokenizer encodes the text; the model's vocabulary must cover the
// tokenizer's; sample reads and prints through it.
TEST(TokenizeCli, TrainAndSampleThroughTheTokenizer) {
  TempDir d;
  const std::string tok = kReference + "tok-llama3";
  const std::string steps = " --steps 2 --batch 2 --context 16 --eval-every 0 --threads 2";
  CliRun r = run("train --tokenizer " + tok + steps);
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_TRUE(contains(r.output, "vocabulary of 600 tokens, more than the model's 256")) << r.output;
  EXPECT_TRUE(contains(r.output, "--vocab 600")) << r.output;

  r = run("train --tokenizer " + tok + " --vocab 600" + steps + " --save " + d.file("m.safetensors"));
  ASSERT_EQ(r.code, 0) << r.output;
  // The bundled corpus: 1,115,394 bytes in 512,072 tokens of this tokenizer, 90% for training.
  EXPECT_TRUE(contains(r.output, "tokenized by")) << r.output;
  EXPECT_TRUE(contains(r.output, "460.9k train, 51.2k val tokens")) << r.output;

  r = run("sample --load " + d.file("m.safetensors") + " --tokenizer " + tok +
          " --prompt 'ROMEO: caf\xC3\xA9' --tokens 12 --context 16");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(r.output.rfind("ROMEO: caf\xC3\xA9", 0), 0u) << r.output;
  EXPECT_GT(r.output.size(), std::string("ROMEO: caf\xC3\xA9\n").size()) << r.output;

  r = run("sample --load " + d.file("m.safetensors") + " --prompt x --tokens 2");
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_TRUE(contains(r.output, "--tokenizer")) << r.output;
}
