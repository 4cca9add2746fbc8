// Helpers for the libFuzzer targets of fuzz/ (built with SPILLWAY_FUZZ=ON, run by `make fuzz`).
//
//   extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
//     const std::string& path = fuzz::input_file(data, size, ".bin");  // for parsers that take a path
//     auto r = parse_something(path);
//     fuzz::require(!r.ok() || r->size() <= size, "parsed more than the input holds");
//     return 0;
//   }
//
// A parser under test must return an error for bad input, never crash, hang or read
// out of bounds (ASan and UBSan stop the process on the first fault). require() turns
// a broken promise of the parser into a crash that libFuzzer reports and keeps.
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

namespace spillway::fuzz {

// Stops the process (libFuzzer saves the input) when a property the parser promises fails.
inline void require(bool ok, const char* what) {
  if (ok) return;
  std::fprintf(stderr, "fuzz: property violated: %s\n", what);
  std::abort();
}

// Writes the input to this process's scratch file (in $TMPDIR or /tmp, named with
// the pid and the `suffix` of the first call) and returns its path; the next call
// overwrites it. The file is removed when the process exits normally.
inline const std::string& input_file(const uint8_t* data, size_t size, const char* suffix) {
  struct Scratch {
    std::string path;
    explicit Scratch(const char* suffix) {
      const char* dir = std::getenv("TMPDIR");
      path = std::string(dir && *dir ? dir : "/tmp") + "/spillway-fuzz-" + std::to_string(getpid()) + suffix;
    }
    ~Scratch() { unlink(path.c_str()); }
  };
  static Scratch scratch(suffix);
  const int fd = open(scratch.path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) {
    std::fprintf(stderr, "fuzz: cannot create %s: %s\n", scratch.path.c_str(), std::strerror(errno));
    std::exit(2);
  }
  for (size_t done = 0; done < size;) {
    const ssize_t n = write(fd, data + done, size - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      std::fprintf(stderr, "fuzz: cannot write %s: %s\n", scratch.path.c_str(), std::strerror(errno));
      std::exit(2);
    }
    done += static_cast<size_t>(n);
  }
  if (close(fd) != 0) {
    std::fprintf(stderr, "fuzz: cannot close %s: %s\n", scratch.path.c_str(), std::strerror(errno));
    std::exit(2);
  }
  return scratch.path;
}

}  // namespace spillway::fuzz
