// Communicator: the collectives that data-parallel training needs between ranks, with
// results that do not depend on timing or topology, so N ranks give the bits of one.
// A backend holds one (Backend::set_communicator) for the Program's collective ops
// (ReduceGradient, SendGradient, AllReduceInRankOrder, BroadcastParam: exec/dispatch.cpp).
//
//   Communicator& comm = ...;                      // NcclCommunicator (production), or the
//                                                  // in-process one of tests/support
//   // Gradient of one tensor: each rank holds its micro-batch's contributions (parts of
//   // n floats, in program order); the owner gets their sum in rank order.
//   SPILLWAY_RETURN_IF_ERROR(comm.reduce_in_rank_order({part0, part1}, sum_ptr, n, owner));
//   // bf16 gradients (the CUDA backend's): the same order, rounded to bf16 at each add.
//   SPILLWAY_RETURN_IF_ERROR(comm.reduce_bf16_in_rank_order({part0, part1}, sum_ptr, n, owner));
//   SPILLWAY_RETURN_IF_ERROR(comm.all_gather(my_norms, all_norms, P * sizeof(float)));
//   SPILLWAY_RETURN_IF_ERROR(comm.broadcast(param_ptr, bytes, owner));
//
// Pointers are in the memory the communicator works on: device memory for NCCL (the
// backend's device_alloc), host memory for the in-process one (which is the CPU
// backend's device memory). Every rank calls the same collectives in the same order
// with the same sizes and roots; a rank that gives different sizes gets an error where
// the implementation can see it (the in-process one always does).
#pragma once

#include <cstddef>
#include <vector>

#include "core/status.h"

namespace spillway {

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;

  // On `root`: out[i] = the fp32 sum, each addition rounded to fp32, of
  //   acc = +0; for r in 0..world-1: for j in 0..parts-1: acc += parts_r[j][i]
  // where parts_r is rank r's `parts` (each n floats; every rank gives as many). This
  // is the order in which one rank accumulates micro-batches 0, 1, 2, ... (each a list
  // of contributions), so a sum over ranks equals the single rank's accumulation bit
  // for bit. `out` (n floats) is written on root only; others pass nullptr. On root,
  // out may be parts[0]: each element is read on every rank before it is written.
  virtual Status reduce_in_rank_order(const std::vector<const float*>& parts, float* out, size_t n, int root) = 0;
  // The same over bf16 parts (each n bf16, stored as uint16 bits), in bf16: on root,
  //   acc = parts_0[0][i]; for every later part x, in the order above:
  //     acc = bf16(float(acc) + float(x[i]))      (fp32 addition, rounded to nearest even)
  //   out[i] = acc
  // which is what one bf16 rank computes: its first contribution formed in place, each
  // later one in a part of its own and added by AccumulateGradient (the residual
  // kernel: fp32 add, __float2bfloat16_rn). The first part is copied, not added to
  // +0, so a -0 stays -0 as it does on one rank. out may be parts[0] on root.
  virtual Status reduce_bf16_in_rank_order(const std::vector<const void*>& parts, void* out, size_t n,
                                           int root) = 0;
  // On every rank: out = in_0 | in_1 | ... | in_{world-1}, `bytes` from each rank.
  virtual Status all_gather(const void* in, void* out, size_t bytes) = 0;
  // buf (bytes) of root is copied into every other rank's buf.
  virtual Status broadcast(void* buf, size_t bytes, int root) = 0;
  // Returns when every rank has called it (always synchronous, even enqueue-only).
  virtual Status barrier() = 0;

  // ---- stream order (the Program's collective ops on CUDA: exec/dispatch.cpp) ----
  // The native stream the collectives run on (NCCL: its cudaStream_t), or nullptr for a
  // communicator whose calls finish before they return (the in-process one).
  virtual void* stream() const { return nullptr; }
  // With a stream: while on, the collectives (not barrier) return once their work is
  // enqueued on stream(), without the host waiting for it; the caller orders that
  // work with the device's other work (Backend::order_stream_after_compute before,
  // Backend::order_after_stream after). Off (the default), every call returns when its
  // work has finished, which host-side users (gathering host bytes) rely on. A
  // communicator without a stream ignores it.
  //   comm.set_enqueue_only(true);  ... comm.reduce_in_rank_order(...) ...;  comm.set_enqueue_only(false);
  virtual void set_enqueue_only(bool on) { (void)on; }
};

}  // namespace spillway
