// The sizes of the CPU and the CUDA backend (backend_sizes.h).
#include "backend/backend_sizes.h"

#include <algorithm>
#include <cstdint>

namespace spillway {

namespace cuda_workspace {

size_t layernorm_backward_scratch_bytes(int N, int C) {
  return 2 * static_cast<size_t>(column_chunks(N).count) * static_cast<size_t>(std::max(C, 0)) * sizeof(float);
}

size_t rmsnorm_backward_scratch_bytes(int N, int C) {
  return static_cast<size_t>(column_chunks(N).count) * static_cast<size_t>(std::max(C, 0)) * sizeof(float);
}

size_t bias_backward_scratch_bytes(int N, int OC) {
  return static_cast<size_t>(column_chunks(N).count) * static_cast<size_t>(std::max(OC, 0)) * sizeof(float);
}

size_t attention_backward_scratch_bytes(int B, int T, int NH) {
  return static_cast<size_t>(std::max(B, 0)) * static_cast<size_t>(std::max(NH, 0)) *
         static_cast<size_t>(std::max(T, 0)) * sizeof(float);
}

size_t squared_norm_scratch_bytes() { return kNormBlocks * sizeof(float); }

size_t embedding_sort_temp_bytes(int N) {
  const size_t n = static_cast<size_t>(std::max(N, 0));
  constexpr size_t kPasses = 4, kDigits = 256, kMinTile = 256, kPortion = size_t{1} << 27;
  const size_t portions = n / kPortion + 1;
  const size_t tiles = (std::min(n, kPortion) + kMinTile - 1) / kMinTile;
  return align(portions * kPasses * kDigits * sizeof(uint64_t))  // bins
         + align(tiles * kDigits * sizeof(int32_t))               // lookback
         + 2 * align(n * sizeof(int32_t))                         // keys and values being sorted
         + align(portions * kPasses * sizeof(int32_t))            // pass counters
         + (kAlign - 1);                                          // aligning the base
}

size_t embedding_backward_scratch_bytes(int N) {
  return 4 * align(static_cast<size_t>(std::max(N, 0)) * sizeof(int32_t)) + embedding_sort_temp_bytes(N);
}

}  // namespace cuda_workspace

namespace {

class CpuSizes final : public BackendSizes {
 public:
  std::string name() const override { return "cpu"; }
  DType activation_dtype() const override { return DType::F32; }
  size_t alignment() const override { return 64; }
  size_t allocation_granularity() const override { return 1; }
  uint64_t host_mapping_device_bytes(uint64_t) const override { return 0; }
  // The CPU kernels keep their small partial sums on the heap of the host they run
  // on, so no op needs device workspace.
  size_t embedding_backward_workspace(int, int) const override { return 0; }
  size_t layernorm_backward_workspace(int, int) const override { return 0; }
  size_t rmsnorm_backward_workspace(int, int) const override { return 0; }
  size_t matmul_workspace(int, int, bool, bool) const override { return 0; }
  size_t attention_backward_workspace(int, int, int) const override { return 0; }
  size_t squared_norm_workspace() const override { return 0; }
};

// Layout of the workspace the CUDA backend is given: scratch (reduction partials,
// sort buffers) from its start; a matrix product puts its cuBLASLt workspace after
// the bias gradient's partials.
class CudaSizes final : public BackendSizes {
 public:
  std::string name() const override { return "cuda"; }
  DType activation_dtype() const override { return DType::BF16; }
  size_t alignment() const override { return 256; }
  // cudaMalloc maps large allocations in 2 MiB pages.
  size_t allocation_granularity() const override { return size_t{2} << 20; }
  uint64_t host_mapping_device_bytes(uint64_t host_bytes) const override {
    if (host_bytes == 0) return 0;
    const uint64_t page = uint64_t{2} << 20;
    const uint64_t entries = (host_bytes + 4095) / 4096 * 8;
    // One page more: an evaluation's own small arena, and host-arena fragmentation.
    return (entries + page - 1) / page * page + page;
  }
  size_t embedding_backward_workspace(int B, int T) const override {
    return cuda_workspace::embedding_backward_scratch_bytes(B * T);
  }
  size_t layernorm_backward_workspace(int N, int C) const override {
    return cuda_workspace::layernorm_backward_scratch_bytes(N, C);
  }
  size_t rmsnorm_backward_workspace(int N, int C) const override {
    return cuda_workspace::rmsnorm_backward_scratch_bytes(N, C);
  }
  size_t matmul_workspace(int N, int OC, bool backward, bool dbias) const override {
    using namespace cuda_workspace;
    return (backward && dbias ? align(bias_backward_scratch_bytes(N, OC)) : 0) + kLtWorkspaceBytes;
  }
  size_t attention_backward_workspace(int B, int T, int NH) const override {
    return cuda_workspace::attention_backward_scratch_bytes(B, T, NH);
  }
  size_t squared_norm_workspace() const override { return cuda_workspace::squared_norm_scratch_bytes(); }
};

}  // namespace

const BackendSizes& cpu_backend_sizes() {
  static const CpuSizes sizes;
  return sizes;
}

const BackendSizes& cuda_backend_sizes() {
  static const CudaSizes sizes;
  return sizes;
}

Result<const BackendSizes*> backend_sizes(const std::string& name) {
  if (name == "cpu") return &cpu_backend_sizes();
  if (name == "cuda") return &cuda_backend_sizes();
  return Status::invalid_argument("unknown backend '" + name + "'; expected cpu or cuda");
}

}  // namespace spillway
