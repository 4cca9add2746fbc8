// `spillway tokenize`: a text file through a Hugging Face tokenizer into an llm.c
// token file; and the tokenized data of `spillway train --tokenizer`.
//
//   spillway tokenize --tokenizer models/llama-3.2-1b --input corpus.txt --output corpus_train.bin
//
// The file is version 1 (uint16 tokens) when the tokenizer's vocabulary fits 16
// bits, else version 2 (uint32, llm.c's Llama 3 layout). The text is encoded on
// every core (--threads), giving the ids of one pass.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <sys/stat.h>

#include "cli/command.h"
#include "cli/output_paths.h"
#include "cli/text_data.h"
#include "cli/train_flags.h"
#include "core/size.h"
#include "core/thread_pool.h"

namespace spillway::cli {

Result<Tokenizer> load_tokenizer_for_model(const std::string& path, int model_vocab, bool vocab_flag) {
  auto tok = Tokenizer::load(path);
  if (!tok.ok()) return tok.status().with_context("--tokenizer");
  if (tok->vocab_size() > model_vocab)
    return Status::invalid_argument(
        "--tokenizer " + tok->name() + " has a vocabulary of " + std::to_string(tok->vocab_size()) +
        " tokens, more than the model's " + std::to_string(model_vocab) + "; " +
        (vocab_flag ? "give --vocab " + std::to_string(tok->vocab_size()) + " or more (or a model made for this tokenizer)"
                    : std::string("give the tokenizer the model was trained with")));
  return tok;
}

namespace {

bool is_dir(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

Result<std::vector<uint32_t>> encode_on_threads(const Tokenizer& tok, std::string_view text, int threads,
                                                const std::string& what) {
  SPILLWAY_RETURN_IF_ERROR(check_thread_count(threads, "--threads"));
  SPILLWAY_ASSIGN_OR_RETURN(std::unique_ptr<ThreadPool> pool, ThreadPool::create(threads));
  auto ids = tok.encode(text, pool.get());
  if (!ids.ok()) return ids.status().with_context(what);
  return ids;
}

}  // namespace

Result<Dataset> load_tokenized_data(const std::string& tokenizer_path, const std::string& data_path, int model_vocab,
                                    int threads, std::string* name) {
  SPILLWAY_ASSIGN_OR_RETURN(Tokenizer tok, load_tokenizer_for_model(tokenizer_path, model_vocab));
  std::string path = data_path;
  std::string context = "--data";
  if (path.empty()) {
    if (const char* env = std::getenv("SPILLWAY_DATA"); env && *env) {
      path = is_dir(env) ? std::string(env) + "/tinyshakespeare.txt" : std::string(env);
      context = std::string("SPILLWAY_DATA=") + env;
    }
  }
  if (path.empty()) {
    const std::string bundled = "bundled tinyshakespeare.txt";
    SPILLWAY_ASSIGN_OR_RETURN(std::vector<uint32_t> ids, encode_on_threads(tok, bundled_corpus(), threads, bundled));
    *name = bundled + " (built into the binary), tokenized by " + tok.name();
    return dataset_from_tokens(ids, bundled + " (tokenized)", model_vocab);
  }
  auto mapped = map_data_file(path, "data file");
  if (!mapped.ok()) return mapped.status().with_context(context);
  if (is_token_file(mapped->bytes)) {  // tokens already: only their ids are checked
    *name = path;
    auto d = load_dataset(path, model_vocab);
    if (!d.ok()) return d.status().with_context(context);
    return d;
  }
  SPILLWAY_ASSIGN_OR_RETURN(std::vector<uint32_t> ids,
                            encode_on_threads(tok, mapped->bytes, threads, context + " " + path));
  *name = path + ", tokenized by " + tok.name();
  auto d = dataset_from_tokens(ids, path + " (tokenized)", model_vocab);
  if (!d.ok()) return d.status().with_context(context);
  return d;
}

namespace {

struct TokenizeFlags {
  std::string tokenizer, input, output;
  int threads = 0;
};

Status run_tokenize(const TokenizeFlags& f) {
  SPILLWAY_RETURN_IF_ERROR(check_thread_count(f.threads, "--threads"));
  auto tok = Tokenizer::load(f.tokenizer);
  if (!tok.ok()) return tok.status().with_context("--tokenizer");
  SPILLWAY_RETURN_IF_ERROR(
      check_output_paths({{"--input", f.input}, {"--tokenizer", f.tokenizer}}, {{"--output", f.output}}));
  auto input = map_data_file(f.input, "input file");
  if (!input.ok()) return input.status().with_context("--input");
  if (is_token_file(input->bytes))
    return Status::invalid_argument("--input " + f.input + " is already an llm.c token file (it starts with the magic " +
                                    std::to_string(kTokenFileMagic) + "); expected text");
  SPILLWAY_ASSIGN_OR_RETURN(std::unique_ptr<ThreadPool> pool, ThreadPool::create(f.threads));
  const auto t0 = std::chrono::steady_clock::now();
  auto ids = tok->encode(input->bytes, pool.get());
  if (!ids.ok()) return ids.status().with_context("--input " + f.input);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const int64_t vocab = tok->vocab_size();
  SPILLWAY_RETURN_IF_ERROR(write_token_file(f.output, ids->data(), ids->size(), vocab).with_context("--output"));
  const bool wide = vocab > kTokenFile16Vocab;
  std::printf("%s: %zu tokens from %s (%s) by %s (vocabulary %lld), version %d (%s tokens); encoded in %.2f s "
              "(%.1f MB/s) on %d threads\n",
              f.output.c_str(), ids->size(), f.input.c_str(), format_size(input->bytes.size()).c_str(),
              tok->name().c_str(), static_cast<long long>(vocab), wide ? kTokenFileVersion32 : kTokenFileVersion,
              wide ? "uint32" : "uint16", seconds, static_cast<double>(input->bytes.size()) / 1e6 / std::max(seconds, 1e-9),
              pool->size());
  std::fflush(stdout);
  if (std::ferror(stdout)) return Status::io_error("writing the summary to standard output failed");
  return Status::ok();
}

CommandRegistration tokenize_command(
    "tokenize", "encode a text file with a Hugging Face tokenizer.json into an llm.c token file",
    [](CLI::App& app) -> CommandRun {
      auto f = std::make_shared<TokenizeFlags>();
      app.add_option("--tokenizer", f->tokenizer, "a tokenizer.json (byte-level BPE), or a directory holding one")
          ->required();
      app.add_option("--input,--in", f->input, "the text file (UTF-8)")->required();
      app.add_option("--output,--out", f->output,
                     "the token file to write (version 1, uint16 tokens, for a vocabulary of at most 65536; else "
                     "version 2, uint32)")
          ->required();
      app.add_option("--threads", f->threads, "threads encoding the text (0 = all cores)")->capture_default_str();
      return [f]() -> int {
        Status s = run_tokenize(*f);
        return s.is_ok() ? 0 : fail(s);
      };
    });

}  // namespace
}  // namespace spillway::cli
