// 64-bit checksums of byte ranges (xxh3 from libxxhash, inlined).
//
//   uint64_t c = checksum64(buf, bytes);
#pragma once

#include <cstddef>
#include <cstdint>

namespace spillway {
uint64_t checksum64(const void* data, size_t bytes);

// The same checksum over bytes that arrive in pieces:
//   Checksum64Stream c; c.update(a, n); c.update(b, m); c.digest() == checksum64(a‖b).
class Checksum64Stream {
 public:
  Checksum64Stream();
  ~Checksum64Stream();
  Checksum64Stream(const Checksum64Stream&) = delete;
  Checksum64Stream& operator=(const Checksum64Stream&) = delete;
  void update(const void* data, size_t bytes);
  uint64_t digest() const;

 private:
  void* state_;  // XXH3_state_t
};
}
