// BackendSizes: what a kind of backend fixes about memory without a device — its
// alignment, activation dtype, allocation granularity and the device workspace each
// op needs. Every Backend is one (Backend derives from it, and the CPU and CUDA
// backends answer from the objects below), and planning tools that have no device
// (`spillway plan --backend cuda` on a machine without a GPU) use the same objects,
// so the workspace a plan reserves is the one the backend will ask for.
//
//   SPILLWAY_ASSIGN_OR_RETURN(const BackendSizes* sizes, backend_sizes("cuda"));
//   size_t ws = sizes->matmul_workspace(N, OC, /*backward=*/true, /*dbias=*/true);
//   // 32 MiB of cuBLASLt workspace plus the bias gradient's partial sums
//   auto need = program_workspace(*sizes, program);   // exec/dispatch.h
#pragma once

#include <cstddef>
#include <string>

#include "core/status.h"
#include "tensor/tensor.h"

namespace spillway {

class BackendSizes {
 public:
  virtual ~BackendSizes() = default;
  virtual std::string name() const = 0;          // "cpu" or "cuda"
  virtual DType activation_dtype() const = 0;    // F32 on CPU, BF16 on CUDA
  virtual size_t alignment() const = 0;          // 64 on CPU, 256 on CUDA
  // device_alloc's sizes are rounded up to this by the driver (2 MiB on CUDA), so a
  // budget holds whole multiples of it; 1 on CPU (the budget is counted exactly).
  virtual size_t allocation_granularity() const = 0;
  // Device memory that pinning `host_bytes` of host memory (Backend::host_alloc) takes
  // for the GPU's mapping of it: on CUDA 8 bytes per 4 KiB page, in 2 MiB pages, and
  // one page more
  // (measured on the H200: pinning 18399694848 bytes took 35651584 bytes of device
  // memory, 1/516). 0 on CPU.
  virtual uint64_t host_mapping_device_bytes(uint64_t host_bytes) const = 0;

  // Device workspace (Backend::set_workspace) each op needs with these arguments, in
  // bytes (0 = none): reduction partials, sort buffers, the cuBLASLt workspace.
  virtual size_t embedding_backward_workspace(int B, int T) const = 0;
  virtual size_t layernorm_backward_workspace(int N, int C) const = 0;
  virtual size_t rmsnorm_backward_workspace(int N, int C) const = 0;
  // One matmul_forward / matmul_backward call (dbias: a bias gradient is computed).
  virtual size_t matmul_workspace(int N, int OC, bool backward, bool dbias) const = 0;
  virtual size_t attention_backward_workspace(int B, int T, int NH) const = 0;
  virtual size_t squared_norm_workspace() const = 0;
};

// The sizes of the CPU backend (no op needs device workspace) and of the CUDA
// backend (whether or not this build has CUDA, and without a GPU).
const BackendSizes& cpu_backend_sizes();
const BackendSizes& cuda_backend_sizes();
// By backend name ("cpu" or "cuda"); InvalidArgument naming the name otherwise.
Result<const BackendSizes*> backend_sizes(const std::string& name);

// The CUDA backend's workspace, piece by piece: the kernels (backend/cuda) size and
// lay out their scratch with these, and cuda_backend_sizes() adds them up.
namespace cuda_workspace {

// The cuBLASLt workspace of a matrix product. Its size is part of every algorithm
// choice (the heuristic's workspace limit), so it is the same for every product.
constexpr size_t kLtWorkspaceBytes = size_t{32} << 20;
// Pieces of one workspace start at multiples of this.
constexpr size_t kAlign = 256;
inline size_t align(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

// Column sums over N rows run in `count` chunks of `rows` rows, in a fixed order.
struct ColumnChunks {
  int count;  // P
  int rows;   // rows per chunk
};
inline ColumnChunks column_chunks(int N) {
  int p = (N + 31) / 32;
  if (p > 256) p = 256;
  if (p < 1) p = 1;
  return {p, (N + p - 1) / p};
}
// Blocks of the first pass of the squared norm (one partial sum each).
constexpr int kNormBlocks = 256;

// LayerNorm backward: the weight's and the bias's partial column sums [2, P, C] F32.
size_t layernorm_backward_scratch_bytes(int N, int C);
// RMSNorm backward: the weight's partial column sums [P, C] F32.
size_t rmsnorm_backward_scratch_bytes(int N, int C);
// A bias gradient: partial column sums [P, OC] F32.
size_t bias_backward_scratch_bytes(int N, int OC);
// Attention backward: D = rowsum(dout · out) [B, NH, T] F32.
size_t attention_backward_scratch_bytes(int B, int T, int NH);
// Squared norm: [kNormBlocks] F32 partials.
size_t squared_norm_scratch_bytes();
// Embedding backward: the (row, position) pairs before and after sorting (four
// vectors of N int32, each aligned to kAlign), then embedding_sort_temp_bytes(N).
size_t embedding_backward_scratch_bytes(int N);
// What cub::DeviceRadixSort::SortPairs (int32 keys and values, all 32 bits, not
// overwriting its input) may ask for N pairs: an upper bound from CUB's allocation
// layout (onesweep: a key and a value buffer of N each, 4 passes × 256 bins per portion
// of up to 2^27 items, lookback of 256 counters per tile of at least 256 items, pass
// counters; each piece aligned to 256 bytes, plus 255 for the base). The CUDA backend
// checks CUB's own figure against it before every sort (an Internal error if CUB
// ever asks for more).
size_t embedding_sort_temp_bytes(int N);

}  // namespace cuda_workspace

}  // namespace spillway
