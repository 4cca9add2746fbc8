#include "exec/spill.h"

#include <cstring>

namespace spillway {

Result<std::unique_ptr<SpillStore>> SpillStore::open(const std::string& dir, uint64_t budget, const std::string& engine,
                                                     const StorageEngineMaker& make_engine) {
  StorageStoreOptions o;
  o.dir = dir;
  o.budget_bytes = budget;
  o.engine = engine;
  std::unique_ptr<StorageEngine> made;  // null: StorageStore::create makes o.engine
  if (make_engine) {
    SPILLWAY_ASSIGN_OR_RETURN(made, make_engine(engine));
  }
  SPILLWAY_ASSIGN_OR_RETURN(auto store, StorageStore::create(o, std::move(made)));
  auto s = std::unique_ptr<SpillStore>(new SpillStore());
  s->store_ = std::move(store);
  return s;
}

Result<Extent> SpillStore::extent(TensorId t, size_t bytes) {
  auto it = extents_.find(t);
  if (it != extents_.end()) return it->second;
  SPILLWAY_ASSIGN_OR_RETURN(Extent e, store_->allocate(bytes));
  extents_[t] = e;
  return e;
}

Result<SpillTicket> SpillStore::write(TensorId t, const void* src, size_t bytes) {
  SPILLWAY_ASSIGN_OR_RETURN(Extent e, extent(t, bytes));
  return store_->write(e, src);
}

Result<SpillTicket> SpillStore::read(TensorId t, void* dst, size_t bytes) {
  auto it = extents_.find(t);
  if (it == extents_.end()) return Status::internal("storage: tensor " + std::to_string(t) + " was never written");
  return store_->read(it->second, dst);
}

Status SpillStore::write_sync(TensorId t, const void* src, size_t bytes) {
  SPILLWAY_ASSIGN_OR_RETURN(AlignedBuffer buf, AlignedBuffer::allocate(bytes ? bytes : 1));
  std::memcpy(buf.data(), src, bytes);
  SPILLWAY_ASSIGN_OR_RETURN(SpillTicket k, write(t, buf.data(), bytes));
  return store_->wait(k);
}

Status SpillStore::read_sync(TensorId t, void* dst, size_t bytes) {
  SPILLWAY_ASSIGN_OR_RETURN(AlignedBuffer buf, AlignedBuffer::allocate(bytes ? bytes : 1));
  SPILLWAY_ASSIGN_OR_RETURN(SpillTicket k, read(t, buf.data(), bytes));
  SPILLWAY_RETURN_IF_ERROR(store_->wait(k));
  std::memcpy(dst, buf.data(), bytes);
  return Status::ok();
}

}  // namespace spillway
