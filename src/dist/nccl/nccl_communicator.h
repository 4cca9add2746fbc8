// NcclCommunicator: the production Communicator (dist/communicator.h), one rank per
// GPU over NCCL (CUDA's or Debian's libnccl). Built with the CUDA backend when nccl.h
// and libnccl are found (SPILLWAY_HAVE_NCCL).
//
//   // Rank 0 makes the id and hands it to the others (a launcher's environment, a file).
//   auto id = nccl_unique_id();                                // rank 0 only
//   std::string text = nccl_id_to_hex(*id);                    // -> SPILLWAY_NCCL_ID=...
//   auto parsed = nccl_id_from_hex(text);                      // on every rank
//   auto comm = NcclCommunicator::create(rank, world, *parsed, /*device=*/local_rank);
//   if (!comm.ok()) die(comm.status());
//   SPILLWAY_RETURN_IF_ERROR((*comm)->reduce_in_rank_order({part0, part1}, sum, n, owner));
//
// Pointers are device memory of `device`. By default every call is synchronous: it
// returns when its work on the communicator's stream has finished (host users: the
// data-parallel trainer's gathers). The Program's collective ops (exec/dispatch.cpp)
// turn on set_enqueue_only: the calls then return once their NCCL calls and add
// kernels are enqueued on stream(), which waits for the compute stream's producers
// with an event, and the compute stream waits for it with an event only before an op
// that touches its tensors (Backend::order_after_stream); the host never waits.
//
// reduce_in_rank_order does not use ncclReduce, whose summation order depends on the
// algorithm NCCL picks (ring, tree) and the topology. It is a chain in rank order,
// pipelined in chunks (kNcclChainChunkBytes, set_chain_chunk_bytes): rank 0 sums its
// own parts (from +0, each addition __fadd_rn: no contraction) and sends the running
// sum to rank 1 (ncclSend/ncclRecv in a group per chunk, on the communicator's
// stream, with the add kernels); rank r adds its parts, in order, to what it received
// and sends it on; the last rank sends the finished sum to the root, or writes it,
// being the root. So the sum is formed in the order the interface promises, and each
// link carries the gradient (n elements) about once whatever the world size. The
// hops overlap: in one group a rank receives chunk c from the previous rank while it
// sends chunk c-1 on, so every link moves a chunk at once; the adds run between the
// groups on the same stream (not overlapped with this rank's own transfers). A root
// that passes a null output still takes its place in the chain, then returns the
// error. Three chunk buffers are allocated at the first call and grown with the chunk
// (outside the executor's device budget).
// reduce_bf16_in_rank_order chains the same way over bf16, each addition in fp32
// rounded to bf16 (__fadd_rn, __float2bfloat16_rn), rank 0 starting from its first part.
#pragma once

#include <array>
#include <memory>
#include <string>

#include "backend/communicator.h"

namespace spillway {

inline constexpr size_t kNcclIdBytes = 128;  // NCCL_UNIQUE_ID_BYTES
using NcclId = std::array<char, kNcclIdBytes>;
// One message of the chained reduce (dist/predict.h costs the chain with the same size).
inline constexpr size_t kNcclChainChunkBytes = size_t{4} << 20;

// A new NCCL unique id (rank 0 calls it once per job).
Result<NcclId> nccl_unique_id();
std::string nccl_id_to_hex(const NcclId& id);
// Errors name what is wrong with the text (length, a non-hex character).
Result<NcclId> nccl_id_from_hex(const std::string& hex);

class NcclCommunicator : public Communicator {
 public:
  // Joins the job `id` as `rank` of `world` on CUDA device `device` (every rank calls
  // it; it blocks until all have joined).
  static Result<std::unique_ptr<NcclCommunicator>> create(int rank, int world, const NcclId& id, int device);
  ~NcclCommunicator() override;

  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  Status reduce_in_rank_order(const std::vector<const float*>& parts, float* out, size_t n, int root) override;
  Status reduce_bf16_in_rank_order(const std::vector<const void*>& parts, void* out, size_t n, int root) override;
  Status all_gather(const void* in, void* out, size_t bytes) override;
  Status broadcast(void* buf, size_t bytes, int root) override;
  Status barrier() override;
  void* stream() const override;
  void set_enqueue_only(bool on) override { enqueue_only_ = on; }
  // The chained reduce's message size (every rank must set the same; at least 4 bytes).
  Status set_chain_chunk_bytes(size_t bytes);

 private:
  NcclCommunicator() = default;
  Status chain_reduce(const std::vector<const void*>& parts, void* out, size_t n, int root, bool bf16,
                      const char* what);
  // The end of a collective: waits for the stream unless enqueue-only.
  Status finish(const std::string& what);
  struct State;
  std::unique_ptr<State> s_;
  int rank_ = 0, world_ = 1, device_ = 0;
  bool enqueue_only_ = false;  // set_enqueue_only
};

}  // namespace spillway
