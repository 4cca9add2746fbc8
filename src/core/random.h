// SplitMix64: the one random-bit generator of the project (parameter init, batch
// offsets, sampling, benchmark tokens), identical on every compiler and machine.
//
//   uint64_t state = seed;
//   uint64_t r = splitmix64_next(state);              // a stream
//   uint64_t h = splitmix64_mix(key + i * kSplitMixGolden);  // counter-based, element i
#pragma once

#include <cstdint>

namespace spillway {

inline constexpr uint64_t kSplitMixGolden = 0x9E3779B97F4A7C15ull;

// The SplitMix64 finalizer: a bijection that scrambles every bit of z.
inline uint64_t splitmix64_mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// The next value of the stream whose state is `state` (advanced by the golden gamma).
inline uint64_t splitmix64_next(uint64_t& state) { return splitmix64_mix(state += kSplitMixGolden); }

}  // namespace spillway
