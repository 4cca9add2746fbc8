// Which rank owns which tensor's optimizer state (ZeRO's partitioned state, by whole
// tensors): balanced by bytes, the same on every rank.
//
//   auto p = partition_by_bytes({4096, 64, 4096, 1024}, /*world=*/2);
//   if (!p.ok()) return p.status();
//   p->owner[2];           // the rank that updates tensor 2 (reduces its gradient, runs its AdamW)
//   p->owned(1);           // tensor indices rank 1 owns, in tensor order
//   p->rank_bytes[0];      // bytes rank 0 holds
//
// Whole tensors keep the math of one rank: the owner holds the whole reduced gradient,
// computes its squared norm with the same kernel, and runs the same AdamW op on it.
#pragma once

#include <cstdint>
#include <vector>

#include "core/status.h"

namespace spillway {

struct Partition {
  std::vector<int> owner;            // [tensors] owning rank of each tensor
  std::vector<uint64_t> rank_bytes;  // [world] bytes each rank owns
  int world = 0;
  // Indices of the tensors `rank` owns, in increasing order.
  std::vector<size_t> owned(int rank) const;
};

// Largest tensor first (ties: lower index first), each to the rank holding the fewest
// bytes so far (ties: the lower rank). Deterministic: it depends only on the sizes and
// the world size. The heaviest rank exceeds the lightest by at most the largest
// tensor. world < 1 is an error; more ranks than tensors leaves some ranks empty.
Result<Partition> partition_by_bytes(const std::vector<uint64_t>& bytes, int world);

}  // namespace spillway
