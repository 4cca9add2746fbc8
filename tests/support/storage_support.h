// Helpers shared by the storage tests.
//
//   AlignedBuffer b = random_buffer(4097, /*seed=*/3);   // 4096-aligned, random bytes
#pragma once

#include <gtest/gtest.h>

#include <random>

#include "io/storage_engine.h"

namespace spillway {

inline AlignedBuffer random_buffer(size_t bytes, uint64_t seed) {
  auto b = AlignedBuffer::allocate(bytes);
  EXPECT_TRUE(b.ok()) << b.status().to_string();
  std::mt19937_64 rng(seed);
  for (size_t i = 0; i < bytes; ++i) b->data()[i] = static_cast<char>(rng());
  return std::move(*b);
}

}  // namespace spillway
