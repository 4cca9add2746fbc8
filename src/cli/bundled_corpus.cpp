// The bundled corpus data/tinyshakespeare.txt, built into the binary with .incbin so
// that `spillway train` finds it from any directory, wherever the binary is.
// CMakeLists.txt passes the file's path as SPILLWAY_CORPUS_FILE, rebuilds this file
// when the corpus changes, and passes its SHA-256 as SPILLWAY_CORPUS_SHA256 (so that
// ccache, which does not see .incbin, never reuses an object with an old corpus).
#include <string_view>

#include "cli/train_flags.h"

#ifndef SPILLWAY_CORPUS_FILE
#error "SPILLWAY_CORPUS_FILE (the path of data/tinyshakespeare.txt) is set by CMakeLists.txt"
#endif

asm(".pushsection .rodata.spillway_corpus, \"a\", @progbits\n"
    ".balign 16\n"
    ".global spillway_corpus_begin\n"
    ".hidden spillway_corpus_begin\n"
    "spillway_corpus_begin:\n"
    ".incbin \"" SPILLWAY_CORPUS_FILE "\"\n"
    ".global spillway_corpus_end\n"
    ".hidden spillway_corpus_end\n"
    "spillway_corpus_end:\n"
    ".popsection\n");

extern "C" const char spillway_corpus_begin[];
extern "C" const char spillway_corpus_end[];

namespace spillway::cli {

std::string_view bundled_corpus() {
  return {spillway_corpus_begin, static_cast<size_t>(spillway_corpus_end - spillway_corpus_begin)};
}

const char* bundled_corpus_sha256() { return SPILLWAY_CORPUS_SHA256; }

}  // namespace spillway::cli
