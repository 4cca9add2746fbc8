// FaultStorageEngine: a StorageEngine for tests that fails requests the ways disks
// fail, reproducibly (a seeded generator), on top of a real engine.
//
//   FaultOptions faults;
//   faults.seed = 7;
//   faults.rules.push_back({FaultKind::NoSpace, 0.0, 3});    // the 3rd write: ENOSPC
//   faults.rules.push_back({FaultKind::TornWrite, 0.1});     // 10% of writes torn
//   auto inner = make_storage_engine("threads");
//   if (!inner) return inner.status();
//   auto engine = std::make_unique<FaultStorageEngine>(std::move(*inner), faults);
//   ... use it like any StorageEngine (or hand it to StorageStore::create) ...
//   engine->faults_injected();   // how many requests it spoiled
//
// Faults surface where real ones do: at wait() (or wait_all()), never at submit.
// Messages end in "(injected fault)" so that a test log tells them from real ones.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "io/storage_engine.h"

namespace spillway {

enum class FaultKind : uint8_t {
  ReadError,    // a read fails with EIO; nothing is read
  CorruptRead,  // a read reports success, but one byte it delivered is flipped
  WriteError,   // a write fails with EIO; nothing is written
  NoSpace,      // a write fails with ENOSPC; nothing is written
  ShortWrite,   // the first part of a write lands, then it fails (IoError "short write")
  TornWrite,    // the first part of a write lands, and success is reported: the rest
                // of the range keeps its old bytes (a lost write the disk lies about)
};
const char* fault_kind_name(FaultKind kind);
// ReadError and CorruptRead apply to reads, the others to writes.
bool fault_applies_to_writes(FaultKind kind);

// A rule fires on a request it applies to when the request is the rule's `nth`
// (1-based, counting only requests of the rule's direction: reads or writes), or
// with probability `rate`. The first rule that fires on a request decides it.
struct FaultRule {
  FaultKind kind = FaultKind::WriteError;
  double rate = 0.0;  // 0 to 1
  uint64_t nth = 0;   // 0: off
};

struct FaultOptions {
  uint64_t seed = 1;
  std::vector<FaultRule> rules;
};

class FaultStorageEngine final : public StorageEngine {
 public:
  FaultStorageEngine(std::unique_ptr<StorageEngine> inner, FaultOptions options);
  ~FaultStorageEngine() override;

  // Replaces the rules, reseeds the generator and restarts the read/write counts.
  void set_options(FaultOptions options);
  uint64_t faults_injected() const;
  uint64_t faults_injected(FaultKind kind) const;
  StorageEngine& inner() { return *inner_; }

  std::string name() const override { return "fault(" + inner_->name() + ")"; }
  int queue_depth() const override { return inner_->queue_depth(); }
  Result<StorageFile> open(const std::string& path, OpenMode mode) override { return inner_->open(path, mode); }
  Status close(StorageFile file) override { return inner_->close(file); }
  size_t alignment(StorageFile file) const override { return inner_->alignment(file); }
  bool is_direct(StorageFile file) const override { return inner_->is_direct(file); }
  std::string path(StorageFile file) const override { return inner_->path(file); }
  Status reserve(StorageFile file, uint64_t offset, uint64_t bytes) override {
    return inner_->reserve(file, offset, bytes);
  }
  Result<StorageTicket> submit_read(StorageFile file, uint64_t offset, void* buffer, size_t bytes) override;
  Result<StorageTicket> submit_write(StorageFile file, uint64_t offset, const void* buffer,
                                     size_t bytes) override;
  int poll() override;
  bool is_done(StorageTicket ticket) override;
  Status wait(StorageTicket ticket) override;
  Status wait_all() override;
  // The inner engine's counts (a torn write counts the part that landed).
  uint64_t bytes_read() const override { return inner_->bytes_read(); }
  uint64_t bytes_written() const override { return inner_->bytes_written(); }

 private:
  struct Pending {
    StorageTicket inner;      // sequence 0 when nothing reached the inner engine
    Status injected;          // reported once the inner request succeeded
    char* flip = nullptr;     // CorruptRead: the byte to spoil after the read
  };
  // The fault for the next request of a direction, if any. mu_ held.
  const FaultRule* draw(bool write);
  Result<StorageTicket> add(Pending pending);  // mu_ held
  Status finish(Pending& pending);             // mu_ not held

  std::unique_ptr<StorageEngine> inner_;
  mutable std::mutex mu_;
  FaultOptions options_;
  std::mt19937_64 rng_;
  uint64_t reads_ = 0, writes_ = 0;
  std::map<FaultKind, uint64_t> injected_;
  std::map<uint64_t, Pending> pending_;
  uint64_t next_sequence_ = 1;
};

}  // namespace spillway
