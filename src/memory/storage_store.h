// StorageStore: the storage tier. Tensors spilled to a file under a spill directory
// that the user names, each in its own extent, checksummed.
//
//   StorageStoreOptions o;
//   o.dir = "/nvme/spill";          // must exist and be writable
//   o.budget_bytes = 64ull << 30;   // the storage budget (0: none)
//   SPILLWAY_ASSIGN_OR_RETURN(auto store, StorageStore::create(o));
//   // → /nvme/spill/spillway-<pid>-<random>/{owner, spill-0.bin}
//   SPILLWAY_ASSIGN_OR_RETURN(Extent e, store->allocate(bytes));
//   SPILLWAY_ASSIGN_OR_RETURN(StorageStore::Ticket w, store->write(e, host_src));
//   SPILLWAY_RETURN_IF_ERROR(store->wait(w));      // the extent now holds host_src's bytes
//   SPILLWAY_ASSIGN_OR_RETURN(StorageStore::Ticket r, store->read(e, host_dst));
//   SPILLWAY_RETURN_IF_ERROR(store->wait(r));      // checksum verified, else Corrupt
//   SPILLWAY_RETURN_IF_ERROR(store->free(e));      // the extent's space is reused
//   store.reset();                                 // removes the run's directory
//   // (and if SIGINT/SIGTERM ends the process at once, core/interrupt.h removes it)
//
// Rules:
// - host buffers are aligned to kStorageAlignment (4096): the file is read and
//   written with O_DIRECT, which moves memory pages straight to the drive. HostPool
//   blocks and AlignedBuffer are; anything else is an InvalidArgument saying so.
//   The byte count of an extent may be anything (1, 4097, ...): exactly that many
//   bytes are read into host_dst and written from host_src;
// - host_src stays unchanged, and host_dst unread, until wait() collected the request;
// - one request at a time per extent: a read, write or free of an extent with a
//   request in flight is an InvalidArgument;
// - every extent is checksummed (xxh3) when written and verified when read back: a
//   mismatch is Corrupt, naming the file, offset and both checksums;
// - extents are independent: a failed write spoils only its own extent, which then
//   reads as an error (never as stale or partial data) until written again;
// - the extents' footprints (sizes rounded up to 4096) never pass the budget, and
//   neither does the spill file: its extents all lie below the budget;
// - at create, spillway-* directories and AtomicFile temporaries (*.tmp-<pid>-*) left
//   in DIR by runs that are gone (their pid is not alive) are reported on stderr with
//   their size and "remove them with `spillway clean DIR`"; they are never reused or
//   removed here: that is the user's call (find_all_leftovers, remove_leftover_spill_dir);
// - when the budget or the disk is short, the error says how much leftovers take.
//
// Thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/atomic_file.h"
#include "core/interrupt.h"
#include "core/status.h"
#include "io/storage_engine.h"
#include "memory/range_allocator.h"

namespace spillway {

struct StorageStoreOptions {
  std::string dir;                  // spill directory: exists, writable
  uint64_t budget_bytes = 0;        // storage budget; 0 = no limit
  std::string engine = "auto";      // make_storage_engine kind, when none is handed in
  StorageEngineOptions engine_options;
  bool warn_leftovers = true;       // report leftovers on stderr
};

// Where one tensor's bytes live in the spill file.
struct Extent {
  uint64_t id = 0;      // unique within a store; 0 = no extent
  uint64_t offset = 0;  // in the spill file, a multiple of 4096
  uint64_t bytes = 0;   // reads and writes move exactly this many bytes
};

// A spill directory left by a run that is no longer alive.
struct LeftoverSpill {
  std::string path;
  int64_t pid = 0;
  uint64_t bytes = 0;  // disk space its files take
};

// Everything runs that are gone left in a folder: spill directories and
// AtomicFile temporaries (core/atomic_file.h).
struct Leftovers {
  std::vector<LeftoverSpill> spill_dirs;
  std::vector<StaleTempFile> temp_files;
  bool empty() const { return spill_dirs.empty() && temp_files.empty(); }
  uint64_t bytes() const;  // disk space they take
  // "2 spill directories (pids 12, 34) and 1 temporary file of unfinished saves (pid 56), 26.0 MiB in all"
  std::string describe() const;
};
Result<Leftovers> find_all_leftovers(const std::string& dir);
// "DIR holds leftovers of runs that are gone: <describe>; ... `spillway clean DIR`"
std::string leftovers_warning(const std::string& dir, const Leftovers& leftovers);
// The disk space leftovers take in `dir`; 0 when there are none or it cannot be listed.
uint64_t leftover_bytes(const std::string& dir);
// "; leftovers of runs that are gone take 26.0 MiB of it (...): remove them with
// `spillway clean DIR`", or "" when there are none: for errors about a full disk or
// a storage budget too small.
std::string leftovers_note(const std::string& dir);
// Removes the regular files directly in a leftover spill directory, then the
// directory (an error naming what could not be removed).
Status remove_leftover_spill_dir(const LeftoverSpill& leftover);

class StorageStore {
 public:
  struct Ticket {
    uint64_t sequence = 0;  // 0: no request
  };

  // Checks the directory, reports leftovers, makes DIR/spillway-<pid>-<random>/
  // with an "owner" marker naming this process and the spill file. `engine` may be
  // handed in (tests pass a FaultStorageEngine); else options.engine is made.
  static Result<std::unique_ptr<StorageStore>> create(const StorageStoreOptions& options,
                                                      std::unique_ptr<StorageEngine> engine = nullptr);
  // The spillway-* directories under `dir` whose process is gone.
  static Result<std::vector<LeftoverSpill>> find_leftovers(const std::string& dir);

  // Waits for requests in flight, then removes the spill file, marker and run directory.
  ~StorageStore();
  StorageStore(const StorageStore&) = delete;
  StorageStore& operator=(const StorageStore&) = delete;

  // OutOfMemory naming the budget when the extent does not fit under it; NoSpace
  // naming the directory when the disk cannot hold it (space is reserved here).
  Result<Extent> allocate(uint64_t bytes);
  Status free(const Extent& extent);
  Result<Ticket> write(const Extent& extent, const void* host_src);
  Result<Ticket> read(const Extent& extent, void* host_dst);
  // Collects a request: for a write, the extent holds the data once this is Ok; for
  // a read, the checksum is verified here. Waiting again on a collected ticket is Ok.
  Status wait(Ticket ticket);
  // Collects every request; the first error, with the number of other failures.
  Status wait_all();
  bool is_done(Ticket ticket);

  const std::string& dir() const { return dir_; }            // the user's spill directory
  const std::string& run_dir() const { return run_dir_; }    // DIR/spillway-<pid>-<random>
  const std::string& file_path() const { return file_path_; }
  const std::vector<LeftoverSpill>& leftovers() const { return leftovers_; }
  StorageEngine& engine() { return *engine_; }

  uint64_t budget() const { return budget_; }  // 0 = no limit
  uint64_t bytes_in_use() const;   // footprints of live extents
  uint64_t peak_bytes() const;     // highest bytes_in_use
  uint64_t file_bytes() const;     // the spill file's reserved length
  uint64_t bytes_written() const;  // by successful writes
  uint64_t bytes_read() const;     // by successful, verified reads

 private:
  enum class Content : uint8_t { Empty, Writing, Valid, Failed };
  struct ExtentState {
    uint64_t id = 0;
    uint64_t bytes = 0;
    Content content = Content::Empty;
    uint64_t checksum = 0;
    Status failure;      // of the last write, when Failed
    uint64_t busy = 0;   // the ticket in flight on it, 0 if none
  };
  struct Op {
    bool write = false;
    uint64_t offset = 0;
    uint64_t extent_id = 0;
    size_t bytes = 0;
    StorageTicket engine_ticket;
    uint64_t checksum = 0;  // a write's, computed at submit
    void* dst = nullptr;    // a read's
  };

  StorageStore(const StorageStoreOptions& options, uint64_t capacity);
  Result<ExtentState*> find(const Extent& extent, const char* what);  // mu_ held
  std::string describe(const Extent& extent) const;
  Status full_disk(const Status& cause, uint64_t asked) const;          // mu_ held
  void remove_files();

  std::string dir_, run_dir_, file_path_, marker_path_;
  uint64_t budget_ = 0;
  std::unique_ptr<StorageEngine> engine_;
  StorageFile file_;
  std::vector<LeftoverSpill> leftovers_;
  RemoveOnInterrupt remove_on_interrupt_;  // the run directory, if a signal ends the process at once

  mutable std::mutex mu_;
  RangeAllocator allocator_;
  std::map<uint64_t, ExtentState> extents_;  // by offset
  std::map<uint64_t, Op> ops_;               // by ticket sequence
  uint64_t next_extent_id_ = 1;
  uint64_t next_sequence_ = 1;
  uint64_t reserved_end_ = 0;
  uint64_t bytes_written_ = 0;
  uint64_t bytes_read_ = 0;
};

}  // namespace spillway
