#include "dist/nccl/nccl_communicator.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <cstring>
#include <string>

namespace spillway {

static_assert(kNcclIdBytes == NCCL_UNIQUE_ID_BYTES, "NcclId must hold an ncclUniqueId");

namespace {

Status nccl_status(ncclResult_t r, const std::string& what) {
  if (r == ncclSuccess) return Status::ok();
  return Status::internal("NCCL " + what + ": " + ncclGetErrorString(r));
}
Status cuda_status(cudaError_t e, const std::string& what) {
  if (e == cudaSuccess) return Status::ok();
  return Status::internal("CUDA " + what + ": " + cudaGetErrorString(e));
}

// out[i] = ((0 + x[0][i]) + x[1][i]) + ... over the `count` arrays of n floats in
// `staging` (rank-major, parts within a rank), in that order.
__global__ void sum_in_order(float* out, const float* staging, size_t n, int count) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    float acc = 0.0f;
    for (int k = 0; k < count; ++k) acc = __fadd_rn(acc, staging[static_cast<size_t>(k) * n + i]);
    out[i] = acc;
  }
}

// out[i] = x[0][i], then out[i] = bf16(float(out[i]) + float(x[k][i])) for k = 1 ..
// count-1, over the `count` arrays of n bf16 in `staging` (the order above): an fp32
// addition rounded to nearest even, as the residual kernel that a bf16 rank's
// AccumulateGradient runs (backend/cuda/kernels.cu).
__global__ void sum_bf16_in_order(__nv_bfloat16* out, const __nv_bfloat16* staging, size_t n, int count) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    __nv_bfloat16 acc = staging[i];
    for (int k = 1; k < count; ++k)
      acc = __float2bfloat16_rn(__fadd_rn(__bfloat162float(acc), __bfloat162float(staging[static_cast<size_t>(k) * n + i])));
    out[i] = acc;
  }
}

}  // namespace

struct NcclCommunicator::State {
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  void* staging = nullptr;   // [world · parts · n] elements on the root of a reduce
  size_t staging_bytes = 0;
  int* token = nullptr;      // [1] for the barrier
};

Result<NcclId> nccl_unique_id() {
  ncclUniqueId u;
  SPILLWAY_RETURN_IF_ERROR(nccl_status(ncclGetUniqueId(&u), "ncclGetUniqueId"));
  NcclId id;
  std::memcpy(id.data(), u.internal, kNcclIdBytes);
  return id;
}

std::string nccl_id_to_hex(const NcclId& id) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (char c : id) {
    const unsigned char b = static_cast<unsigned char>(c);
    out += digits[b >> 4];
    out += digits[b & 15];
  }
  return out;
}

Result<NcclId> nccl_id_from_hex(const std::string& hex) {
  if (hex.size() != 2 * kNcclIdBytes)
    return Status::invalid_argument("NCCL id: " + std::to_string(hex.size()) + " hex digits; expected " +
                                    std::to_string(2 * kNcclIdBytes));
  auto value = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  NcclId id;
  for (size_t i = 0; i < kNcclIdBytes; ++i) {
    const int hi = value(hex[2 * i]), lo = value(hex[2 * i + 1]);
    if (hi < 0 || lo < 0)
      return Status::invalid_argument("NCCL id: character " + std::to_string(hi < 0 ? 2 * i : 2 * i + 1) +
                                      " is not a hex digit");
    id[i] = static_cast<char>(hi * 16 + lo);
  }
  return id;
}

Result<std::unique_ptr<NcclCommunicator>> NcclCommunicator::create(int rank, int world, const NcclId& id,
                                                                   int device) {
  if (world < 1 || rank < 0 || rank >= world)
    return Status::invalid_argument("NCCL: rank " + std::to_string(rank) + " of world size " + std::to_string(world) +
                                    " (need 0 <= rank < world)");
  std::unique_ptr<NcclCommunicator> c(new NcclCommunicator());
  c->s_ = std::make_unique<State>();
  c->rank_ = rank;
  c->world_ = world;
  c->device_ = device;
  SPILLWAY_RETURN_IF_ERROR(cuda_status(cudaSetDevice(device), "cudaSetDevice(" + std::to_string(device) + ")"));
  SPILLWAY_RETURN_IF_ERROR(cuda_status(cudaStreamCreateWithFlags(&c->s_->stream, cudaStreamNonBlocking),
                                       "creating the communicator's stream"));
  SPILLWAY_RETURN_IF_ERROR(cuda_status(cudaMalloc(&c->s_->token, sizeof(int)), "allocating the barrier's token"));
  ncclUniqueId u;
  std::memcpy(u.internal, id.data(), kNcclIdBytes);
  SPILLWAY_RETURN_IF_ERROR(nccl_status(ncclCommInitRank(&c->s_->comm, world, u, rank),
                                       "ncclCommInitRank (rank " + std::to_string(rank) + " of " +
                                           std::to_string(world) + ")"));
  return std::move(c);
}

NcclCommunicator::~NcclCommunicator() {
  if (!s_) return;
  cudaSetDevice(device_);
  if (s_->comm != nullptr) ncclCommDestroy(s_->comm);
  if (s_->staging != nullptr) cudaFree(s_->staging);
  if (s_->token != nullptr) cudaFree(s_->token);
  if (s_->stream != nullptr) cudaStreamDestroy(s_->stream);
}

// Every rank's parts (each n elements of elem_bytes) into the root's staging buffer,
// rank-major and parts within a rank (the root's own copied, so its output may be
// one of them); the other ranks send theirs and return. Leaves the root's work
// enqueued on the communicator's stream; *gathered is true on the root.
Status NcclCommunicator::gather_parts(const std::vector<const void*>& parts, size_t elem_bytes, size_t n, int root,
                                      const char* what, bool* gathered) {
  *gathered = false;
  if (root < 0 || root >= world_ || parts.empty())
    return Status::invalid_argument(std::string("NCCL ") + what + ": root " + std::to_string(root) + ", " +
                                    std::to_string(parts.size()) + " parts (world " + std::to_string(world_) + ")");
  SPILLWAY_RETURN_IF_ERROR(cuda_status(cudaSetDevice(device_), "cudaSetDevice"));
  const size_t count = parts.size(), part_bytes = n * elem_bytes, mine = count * part_bytes;
  if (rank_ != root) {
    SPILLWAY_RETURN_IF_ERROR(nccl_status(ncclGroupStart(), "ncclGroupStart"));
    ncclResult_t sent = ncclSuccess;
    for (size_t j = 0; j < count && sent == ncclSuccess; ++j)
      sent = ncclSend(parts[j], part_bytes, ncclChar, root, s_->comm, s_->stream);
    SPILLWAY_RETURN_IF_ERROR(nccl_status(ncclGroupEnd(), "ncclGroupEnd"));
    SPILLWAY_RETURN_IF_ERROR(nccl_status(sent, "ncclSend to rank " + std::to_string(root)));
    return cuda_status(cudaStreamSynchronize(s_->stream),
                       std::string(what) + " (send to rank " + std::to_string(root) + ")");
  }
  const size_t need = static_cast<size_t>(world_) * mine;
  if (need > s_->staging_bytes) {
    if (s_->staging != nullptr) SPILLWAY_RETURN_IF_ERROR(cuda_status(cudaFree(s_->staging), "freeing the staging buffer"));
    s_->staging = nullptr;
    s_->staging_bytes = 0;
    SPILLWAY_RETURN_IF_ERROR(cuda_status(cudaMalloc(&s_->staging, need),
                                         "allocating " + std::to_string(need) + " bytes of reduce staging"));
    s_->staging_bytes = need;
  }
  char* staging = static_cast<char*>(s_->staging);
  for (size_t j = 0; j < count; ++j)
    SPILLWAY_RETURN_IF_ERROR(cuda_status(cudaMemcpyAsync(staging + static_cast<size_t>(rank_) * mine + j * part_bytes,
                                                         parts[j], part_bytes, cudaMemcpyDeviceToDevice, s_->stream),
                                         "copying the root's own parts"));
  SPILLWAY_RETURN_IF_ERROR(nccl_status(ncclGroupStart(), "ncclGroupStart"));
  ncclResult_t posted = ncclSuccess;
  int failed_rank = -1;
  for (int r = 0; r < world_ && posted == ncclSuccess; ++r)
    for (size_t j = 0; j < count && r != rank_ && posted == ncclSuccess; ++j) {
      posted = ncclRecv(staging + static_cast<size_t>(r) * mine + j * part_bytes, part_bytes, ncclChar, r, s_->comm,
                        s_->stream);
      failed_rank = r;
    }
  SPILLWAY_RETURN_IF_ERROR(nccl_status(ncclGroupEnd(), "ncclGroupEnd"));
  SPILLWAY_RETURN_IF_ERROR(nccl_status(posted, "ncclRecv from rank " + std::to_string(failed_rank)));
  *gathered = true;
  return Status::ok();
}

Status NcclCommunicator::reduce_in_rank_order(const std::vector<const float*>& parts, float* out, size_t n,
                                              int root) {
  bool gathered = false;
  SPILLWAY_RETURN_IF_ERROR(gather_parts(std::vector<const void*>(parts.begin(), parts.end()), sizeof(float), n, root,
                                        "reduce", &gathered));
  if (!gathered) return Status::ok();
  if (out == nullptr) return Status::invalid_argument("NCCL reduce: the root's output is null");
  if (n > 0) {
    const int threads = 256;
    const int blocks = static_cast<int>(std::min<size_t>((n + threads - 1) / threads, 65535));
    sum_in_order<<<blocks, threads, 0, s_->stream>>>(out, static_cast<const float*>(s_->staging), n,
                                                     static_cast<int>(world_ * parts.size()));
    SPILLWAY_RETURN_IF_ERROR(cuda_status(cudaGetLastError(), "launching the in-order sum"));
  }
  return cuda_status(cudaStreamSynchronize(s_->stream), "reduce (in-order sum)");
}

Status NcclCommunicator::reduce_bf16_in_rank_order(const std::vector<const void*>& parts, void* out, size_t n,
                                                   int root) {
  bool gathered = false;
  SPILLWAY_RETURN_IF_ERROR(gather_parts(parts, sizeof(__nv_bfloat16), n, root, "bf16 reduce", &gathered));
  if (!gathered) return Status::ok();
  if (out == nullptr) return Status::invalid_argument("NCCL bf16 reduce: the root's output is null");
  if (n > 0) {
    const int threads = 256;
    const int blocks = static_cast<int>(std::min<size_t>((n + threads - 1) / threads, 65535));
    sum_bf16_in_order<<<blocks, threads, 0, s_->stream>>>(static_cast<__nv_bfloat16*>(out),
                                                          static_cast<const __nv_bfloat16*>(s_->staging), n,
                                                          static_cast<int>(world_ * parts.size()));
    SPILLWAY_RETURN_IF_ERROR(cuda_status(cudaGetLastError(), "launching the in-order bf16 sum"));
  }
  return cuda_status(cudaStreamSynchronize(s_->stream), "bf16 reduce (in-order sum)");
}

Status NcclCommunicator::all_gather(const void* in, void* out, size_t bytes) {
  SPILLWAY_RETURN_IF_ERROR(cuda_status(cudaSetDevice(device_), "cudaSetDevice"));
  SPILLWAY_RETURN_IF_ERROR(
      nccl_status(ncclAllGather(in, out, bytes, ncclChar, s_->comm, s_->stream), "ncclAllGather"));
  return cuda_status(cudaStreamSynchronize(s_->stream), "all_gather");
}

Status NcclCommunicator::broadcast(void* buf, size_t bytes, int root) {
  SPILLWAY_RETURN_IF_ERROR(cuda_status(cudaSetDevice(device_), "cudaSetDevice"));
  SPILLWAY_RETURN_IF_ERROR(
      nccl_status(ncclBroadcast(buf, buf, bytes, ncclChar, root, s_->comm, s_->stream), "ncclBroadcast"));
  return cuda_status(cudaStreamSynchronize(s_->stream), "broadcast");
}

Status NcclCommunicator::barrier() {
  SPILLWAY_RETURN_IF_ERROR(cuda_status(cudaSetDevice(device_), "cudaSetDevice"));
  SPILLWAY_RETURN_IF_ERROR(
      nccl_status(ncclAllReduce(s_->token, s_->token, 1, ncclInt32, ncclSum, s_->comm, s_->stream), "barrier"));
  return cuda_status(cudaStreamSynchronize(s_->stream), "barrier");
}

}  // namespace spillway
