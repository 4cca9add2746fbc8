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

// The parts one kernel adds (a reduce with more runs several kernels, in order).
constexpr int kPartsPerKernel = 8;
struct PartPointers {
  const void* p[kPartsPerKernel];  // each [m] elements of this chunk
  int count;
};

// One rank's step of the chained reduce over a chunk of m floats:
//   dst[i] = (((in ? in[i] : +0) + p[0][i]) + p[1][i]) + ...
// each addition __fadd_rn (no contraction), in part order. dst may be a part or `in`
// (each element is read before it is written, by the same thread).
__global__ void chain_step_f32(float* dst, const float* in, PartPointers parts, size_t m) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < m;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    float acc = in != nullptr ? in[i] : 0.0f;
    for (int k = 0; k < parts.count; ++k) acc = __fadd_rn(acc, static_cast<const float*>(parts.p[k])[i]);
    dst[i] = acc;
  }
}

// The same over bf16: acc = in ? in[i] : p[0][i] (copied, so a -0 stays -0), then
// each later part added in fp32 and rounded to bf16 (__fadd_rn, __float2bfloat16_rn),
// as the residual kernel that a bf16 rank's AccumulateGradient runs
// (backend/cuda/kernels.cu).
__global__ void chain_step_bf16(__nv_bfloat16* dst, const __nv_bfloat16* in, PartPointers parts, size_t m) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < m;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    int k = 0;
    __nv_bfloat16 acc = in != nullptr ? in[i] : static_cast<const __nv_bfloat16*>(parts.p[k++])[i];
    for (; k < parts.count; ++k)
      acc = __float2bfloat16_rn(
          __fadd_rn(__bfloat162float(acc), __bfloat162float(static_cast<const __nv_bfloat16*>(parts.p[k])[i])));
    dst[i] = acc;
  }
}

}  // namespace

struct NcclCommunicator::State {
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  void* staging = nullptr;   // [3 · chunk_bytes]: the chain's received chunk, the chunk to send, a
                             // chunk to drop (a root without an output); allocated at the first reduce
  size_t staging_bytes = 0;
  size_t chunk_bytes = kNcclChainChunkBytes;  // one message of the chained reduce
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

Status NcclCommunicator::set_chain_chunk_bytes(size_t bytes) {
  if (bytes < sizeof(float))
    return Status::invalid_argument("NCCL chained reduce: a chunk of " + std::to_string(bytes) +
                                    " bytes; expected at least " + std::to_string(sizeof(float)));
  s_->chunk_bytes = bytes;
  return Status::ok();
}

// The chained reduce (see the header): global ticks t = 0 .. C + world - 1 over C
// chunks; at tick t rank r, in one NCCL group, receives chunk t-r from r-1 into
// recv, sends chunk t-r-1 (formed at the previous tick) from `send` to r+1 (the last
// rank: to the root), and, being the root but not the last rank, receives the
// finished chunk t-world from the last rank into its output; then it forms chunk t-r
// (the received running sum plus its parts, or its parts alone on rank 0) into
// `send`, or into the output on a last rank that is the root. Every send at tick t is
// received at tick t by its peer, so each tick's groups match across ranks and the
// links carry one chunk each, all at once: the hops overlap.
Status NcclCommunicator::chain_reduce(const std::vector<const void*>& parts, void* out, size_t n, int root,
                                      bool bf16, const char* what) {
  if (root < 0 || root >= world_ || parts.empty())
    return Status::invalid_argument(std::string("NCCL ") + what + ": root " + std::to_string(root) + ", " +
                                    std::to_string(parts.size()) + " parts (world " + std::to_string(world_) +
                                    "; need a rank and at least one part)");
  SPILLWAY_RETURN_IF_ERROR(cuda_status(cudaSetDevice(device_), "cudaSetDevice(" + std::to_string(device_) + ")"));
  const size_t e = bf16 ? sizeof(__nv_bfloat16) : sizeof(float);
  const size_t chunk = std::max<size_t>(1, s_->chunk_bytes / e);  // elements per message
  const size_t need = 3 * chunk * e;
  if (need > s_->staging_bytes) {
    // (At the first reduce, or after a larger chunk was set: cudaFree and cudaMalloc
    // wait for the device, so enqueued collectives still using the old buffers finish.)
    if (s_->staging != nullptr)
      SPILLWAY_RETURN_IF_ERROR(cuda_status(cudaFree(s_->staging), "freeing the chained reduce's buffers"));
    s_->staging = nullptr;
    s_->staging_bytes = 0;
    SPILLWAY_RETURN_IF_ERROR(cuda_status(cudaMalloc(&s_->staging, need),
                                         "allocating " + std::to_string(need) + " bytes of chained reduce buffers"));
    s_->staging_bytes = need;
  }
  char* recv = static_cast<char*>(s_->staging);
  char* send = recv + chunk * e;
  char* drop = send + chunk * e;
  // A root without an output still takes its place in the chain (the others would
  // wait for it forever), dropping the sum, and then reports the error.
  const bool no_output = rank_ == root && out == nullptr;
  const int last = world_ - 1;
  const size_t chunks = (n + chunk - 1) / chunk;
  auto rows = [&](long long c) { return std::min(chunk, n - static_cast<size_t>(c) * chunk); };
  auto in_range = [&](long long c) { return c >= 0 && c < static_cast<long long>(chunks); };
  auto at = [&](void* base, long long c) { return static_cast<char*>(base) + static_cast<size_t>(c) * chunk * e; };
  const int threads = 256;
  for (long long t = 0; t < static_cast<long long>(chunks) + world_; ++t) {
    const long long from_prev = t - rank_, to_next = t - rank_ - 1, finished = t - world_;
    const bool do_recv = rank_ > 0 && in_range(from_prev);
    const bool do_send = in_range(to_next) && (rank_ < last || root != last);
    const bool do_final = rank_ == root && rank_ != last && in_range(finished);
    if (do_recv || do_send || do_final) {
      SPILLWAY_RETURN_IF_ERROR(nccl_status(ncclGroupStart(), "ncclGroupStart"));
      ncclResult_t r = ncclSuccess;
      std::string failed;
      if (do_recv) {
        r = ncclRecv(recv, rows(from_prev) * e, ncclChar, rank_ - 1, s_->comm, s_->stream);
        failed = "ncclRecv of chunk " + std::to_string(from_prev) + " from rank " + std::to_string(rank_ - 1);
      }
      if (do_send && r == ncclSuccess) {
        const int to = rank_ < last ? rank_ + 1 : root;
        r = ncclSend(send, rows(to_next) * e, ncclChar, to, s_->comm, s_->stream);
        failed = "ncclSend of chunk " + std::to_string(to_next) + " to rank " + std::to_string(to);
      }
      if (do_final && r == ncclSuccess) {
        r = ncclRecv(no_output ? drop : at(out, finished), rows(finished) * e, ncclChar, last, s_->comm, s_->stream);
        failed = "ncclRecv of finished chunk " + std::to_string(finished) + " from rank " + std::to_string(last);
      }
      const ncclResult_t ended = ncclGroupEnd();
      SPILLWAY_RETURN_IF_ERROR(nccl_status(r, std::string(what) + ": " + failed));
      SPILLWAY_RETURN_IF_ERROR(nccl_status(ended, std::string(what) + ": ncclGroupEnd at tick " + std::to_string(t)));
    }
    const long long mine = t - rank_;  // the chunk this rank forms now
    if (!in_range(mine)) continue;
    const size_t m = rows(mine);
    char* dst = rank_ == last && rank_ == root ? (no_output ? send : at(out, mine)) : send;
    const void* in = rank_ > 0 ? recv : nullptr;
    const int blocks = static_cast<int>(std::min<size_t>((m + threads - 1) / threads, 65535));
    for (size_t j = 0; j < parts.size(); j += kPartsPerKernel) {
      PartPointers p{};
      p.count = static_cast<int>(std::min<size_t>(kPartsPerKernel, parts.size() - j));
      for (int k = 0; k < p.count; ++k) p.p[k] = static_cast<const char*>(parts[j + k]) + static_cast<size_t>(mine) * chunk * e;
      if (bf16)
        chain_step_bf16<<<blocks, threads, 0, s_->stream>>>(reinterpret_cast<__nv_bfloat16*>(dst),
                                                            static_cast<const __nv_bfloat16*>(in), p, m);
      else
        chain_step_f32<<<blocks, threads, 0, s_->stream>>>(reinterpret_cast<float*>(dst),
                                                           static_cast<const float*>(in), p, m);
      SPILLWAY_RETURN_IF_ERROR(cuda_status(cudaGetLastError(), std::string(what) + ": launching the add of chunk " +
                                                                   std::to_string(mine)));
      in = dst;  // later parts add to what this launch formed
    }
  }
  SPILLWAY_RETURN_IF_ERROR(finish(std::string(what) + " (chained)"));
  if (no_output) return Status::invalid_argument(std::string("NCCL ") + what + ": the root's output is null");
  return Status::ok();
}

void* NcclCommunicator::stream() const { return s_ ? static_cast<void*>(s_->stream) : nullptr; }

Status NcclCommunicator::finish(const std::string& what) {
  // Enqueue-only: every NCCL call and launch was checked as it was made; what fails
  // on the device later shows at the next synchronization of a stream ordered after it.
  if (enqueue_only_) return Status::ok();
  return cuda_status(cudaStreamSynchronize(s_->stream), what);
}

Status NcclCommunicator::reduce_in_rank_order(const std::vector<const float*>& parts, float* out, size_t n,
                                              int root) {
  return chain_reduce(std::vector<const void*>(parts.begin(), parts.end()), out, n, root, /*bf16=*/false, "reduce");
}

Status NcclCommunicator::reduce_bf16_in_rank_order(const std::vector<const void*>& parts, void* out, size_t n,
                                                   int root) {
  return chain_reduce(parts, out, n, root, /*bf16=*/true, "bf16 reduce");
}

Status NcclCommunicator::all_gather(const void* in, void* out, size_t bytes) {
  SPILLWAY_RETURN_IF_ERROR(cuda_status(cudaSetDevice(device_), "cudaSetDevice"));
  SPILLWAY_RETURN_IF_ERROR(
      nccl_status(ncclAllGather(in, out, bytes, ncclChar, s_->comm, s_->stream), "ncclAllGather"));
  return finish("all_gather");
}

Status NcclCommunicator::broadcast(void* buf, size_t bytes, int root) {
  SPILLWAY_RETURN_IF_ERROR(cuda_status(cudaSetDevice(device_), "cudaSetDevice"));
  SPILLWAY_RETURN_IF_ERROR(
      nccl_status(ncclBroadcast(buf, buf, bytes, ncclChar, root, s_->comm, s_->stream), "ncclBroadcast"));
  return finish("broadcast");
}

Status NcclCommunicator::barrier() {
  SPILLWAY_RETURN_IF_ERROR(cuda_status(cudaSetDevice(device_), "cudaSetDevice"));
  SPILLWAY_RETURN_IF_ERROR(
      nccl_status(ncclAllReduce(s_->token, s_->token, 1, ncclInt32, ncclSum, s_->comm, s_->stream), "barrier"));
  return cuda_status(cudaStreamSynchronize(s_->stream), "barrier");
}

}  // namespace spillway
