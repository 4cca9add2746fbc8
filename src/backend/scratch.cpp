#include "backend/scratch.h"

#include <algorithm>
#include <cstring>

#include "core/size.h"

namespace spillway {

ScratchBuffers::~ScratchBuffers() {
  if (!buffers_.empty()) (void)backend_.synchronize();  // errors were reported by the timed section
  for (auto [p, on_device] : buffers_) {
    if (on_device) backend_.device_free(p);
    else backend_.host_free(p);
  }
}

Result<void*> ScratchBuffers::device(size_t bytes) {
  bytes = std::max<size_t>(bytes, backend_.alignment());
  auto p = backend_.device_alloc(bytes);
  if (!p) return p.status().with_context("device buffer of " + format_size(bytes));
  buffers_.emplace_back(*p, true);
  backend_.fill_zero(*p, bytes);
  return *p;
}

Result<void*> ScratchBuffers::host(size_t bytes) {
  bytes = std::max<size_t>(bytes, 64);
  auto p = backend_.host_alloc(bytes);
  if (!p) return p.status().with_context("host buffer of " + format_size(bytes));
  buffers_.emplace_back(*p, false);
  std::memset(*p, 0, bytes);
  return *p;
}

}  // namespace spillway
