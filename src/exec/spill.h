// SpillStore: the executor's view of the storage tier — one checksummed extent per
// tensor in a StorageStore, allocated at first write and reused every step.
//
//   SPILLWAY_ASSIGN_OR_RETURN(auto spill, SpillStore::open("/nvme/spill", budget, "auto"));
//   SPILLWAY_ASSIGN_OR_RETURN(SpillTicket w, spill->write(t, host_buf, bytes));  // host_buf 4096-aligned
//   SPILLWAY_RETURN_IF_ERROR(spill->wait(w));
#pragma once

#include <memory>
#include <string>
#include <unordered_map>

#include "memory/storage_store.h"
#include "tensor/tensor.h"

namespace spillway {

using SpillTicket = StorageStore::Ticket;

class SpillStore {
 public:
  // The storage engine of kind `engine` ("uring", "threads", "auto") comes from
  // `make_engine` when given (tests inject faults so), else from make_storage_engine.
  static Result<std::unique_ptr<SpillStore>> open(const std::string& dir, uint64_t budget, const std::string& engine,
                                                  const StorageEngineMaker& make_engine = {});
  Result<SpillTicket> write(TensorId t, const void* src, size_t bytes);
  Result<SpillTicket> read(TensorId t, void* dst, size_t bytes);
  Status wait(SpillTicket ticket) { return store_->wait(ticket); }
  Status wait_all() { return store_->wait_all(); }
  // Through an aligned bounce buffer: any source or destination.
  Status write_sync(TensorId t, const void* src, size_t bytes);
  Status read_sync(TensorId t, void* dst, size_t bytes);
  // Reserves t's extent (space on disk included) now rather than at its first write.
  Status reserve(TensorId t, size_t bytes) { return extent(t, bytes).status(); }
  uint64_t bytes_read() const { return store_->bytes_read(); }
  uint64_t bytes_written() const { return store_->bytes_written(); }
  uint64_t peak_bytes() const { return store_->peak_bytes(); }
  uint64_t bytes_in_use() const { return store_->bytes_in_use(); }

 private:
  Result<Extent> extent(TensorId t, size_t bytes);
  std::unique_ptr<StorageStore> store_;
  std::unordered_map<TensorId, Extent> extents_;
};

}  // namespace spillway
