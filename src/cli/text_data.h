// Training data through a tokenizer (`spillway train --tokenizer`), shared by the
// train command and `spillway tokenize` (src/cli/tokenize.cpp).
//
//   std::string name;
//   auto data = load_tokenized_data("models/llama-3.2-1b", "corpus.txt", /*vocab=*/128256, /*threads=*/0, &name);
//   // corpus.txt's text encoded on every core, 90% / 10% split, ids checked below 128256
#pragma once

#include <string>

#include "core/status.h"
#include "text/tokenizer.h"
#include "train/data.h"

namespace spillway::cli {

// The tokenizer of --tokenizer PATH (a tokenizer.json or a directory holding one),
// whose vocabulary `model_vocab` must cover: the error names both sizes.
// vocab_flag: the command has --vocab, which the error then suggests (sample has not:
// its vocabulary is the loaded model's).
Result<Tokenizer> load_tokenizer_for_model(const std::string& path, int model_vocab, bool vocab_flag = true);

// The dataset of `data_path` through the tokenizer at `tokenizer_path`: a text file
// is encoded (on `threads` threads, 0 = every core) and split 90/10; an llm.c token
// file is read as it is (its ids checked below model_vocab). Without a data_path:
// $SPILLWAY_DATA (a file, or a folder holding tinyshakespeare.txt), else the bundled
// corpus. `name` is set to what was read, for the banner.
Result<Dataset> load_tokenized_data(const std::string& tokenizer_path, const std::string& data_path, int model_vocab,
                                    int threads, std::string* name);

}  // namespace spillway::cli
