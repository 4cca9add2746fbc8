#include "core/checksum.h"

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace spillway {
uint64_t checksum64(const void* data, size_t bytes) { return XXH3_64bits(data, bytes); }
}  // namespace spillway
