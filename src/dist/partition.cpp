#include "dist/partition.h"

#include <algorithm>
#include <numeric>
#include <string>

namespace spillway {

std::vector<size_t> Partition::owned(int rank) const {
  std::vector<size_t> out;
  for (size_t i = 0; i < owner.size(); ++i)
    if (owner[i] == rank) out.push_back(i);
  return out;
}

Result<Partition> partition_by_bytes(const std::vector<uint64_t>& bytes, int world) {
  if (world < 1) return Status::invalid_argument("partition: world size is " + std::to_string(world) + "; need at least 1 rank");
  Partition p;
  p.world = world;
  p.owner.assign(bytes.size(), 0);
  p.rank_bytes.assign(static_cast<size_t>(world), 0);
  std::vector<size_t> order(bytes.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return bytes[a] > bytes[b]; });
  for (size_t i : order) {
    const auto lightest = std::min_element(p.rank_bytes.begin(), p.rank_bytes.end());  // the first of equals
    const int r = static_cast<int>(lightest - p.rank_bytes.begin());
    p.owner[i] = r;
    p.rank_bytes[static_cast<size_t>(r)] += bytes[i];
  }
  return p;
}

}  // namespace spillway
