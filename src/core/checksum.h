// 64-bit checksums of byte ranges (xxh3 from libxxhash, inlined).
//
//   uint64_t c = checksum64(buf, bytes);
#pragma once

#include <cstddef>
#include <cstdint>

namespace spillway {
uint64_t checksum64(const void* data, size_t bytes);
}
