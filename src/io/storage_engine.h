// StorageEngine: asynchronous reads and writes between host memory and files
// (the storage tier ⇄ the host tier), with files opened O_DIRECT.
//
//   auto made = make_storage_engine("auto", {.queue_depth = 32});  // io_uring, else threads
//   if (!made) return made.status();
//   StorageEngine& engine = **made;
//   SPILLWAY_ASSIGN_OR_RETURN(StorageFile f, engine.open("/nvme/spill/a.bin", OpenMode::Create));
//   SPILLWAY_ASSIGN_OR_RETURN(AlignedBuffer buf, AlignedBuffer::allocate(1 << 20));
//   SPILLWAY_ASSIGN_OR_RETURN(StorageTicket w, engine.submit_write(f, 0, buf.data(), 1 << 20));
//   SPILLWAY_RETURN_IF_ERROR(engine.wait(w));
//   SPILLWAY_ASSIGN_OR_RETURN(StorageTicket r, engine.submit_read(f, 0, buf.data(), 1 << 20));
//   ... other work; engine.poll() / engine.is_done(r) look without blocking ...
//   SPILLWAY_RETURN_IF_ERROR(engine.wait(r));
//   SPILLWAY_RETURN_IF_ERROR(engine.close(f));
//
// Request rules (a violation is an InvalidArgument that names it):
// - on a file opened with O_DIRECT (is_direct), the offset and the buffer address
//   are multiples of alignment(file) = kStorageAlignment (4096). The byte count may
//   be anything: a last partial block goes through an aligned bounce buffer — a
//   write fills the rest of that block in the file with zeros, a read delivers only
//   the bytes asked for;
// - on a buffered file (O_DIRECT refused by the file system, see open(), or
//   options.direct_io = false) alignment(file) is 1;
// - the buffer stays valid, and a write's source unchanged, until wait() or
//   wait_all() has collected the request;
// - requests are independent: two in flight on overlapping bytes have no order.
//
// A request larger than options.chunk_bytes is split into chunks that are all
// submitted together. A short transfer is continued where it stopped; a read that
// reaches end of file, or a write that makes no progress, is an error. Errors are
// Status values naming the file, offset, byte count and the system's reason:
// "write /nvme/spill/a.bin at offset 1048576 (1048576 bytes): No space left on device".
//
// Every method is thread-safe. Destroying an engine waits for its requests in flight.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"

namespace spillway {

// The alignment O_DIRECT needs of offsets, sizes and buffers (the largest logical
// block size of the drives we run on).
inline constexpr size_t kStorageAlignment = 4096;

// Host memory aligned to kStorageAlignment, freed when it goes out of scope.
class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  // OutOfMemory when the allocation fails. Sizes are rounded up to the alignment;
  // size() is what was asked for.
  static Result<AlignedBuffer> allocate(size_t bytes);
  char* data() { return data_.get(); }
  const char* data() const { return data_.get(); }
  size_t size() const { return size_; }

 private:
  struct Free {
    void operator()(char* p) const;
  };
  std::unique_ptr<char, Free> data_;
  size_t size_ = 0;
};

enum class OpenMode : uint8_t {
  Create,     // create the file, or truncate it when it exists; read and write
  ReadWrite,  // an existing file; read and write
  ReadOnly,   // an existing file
};

// A file opened by one engine; only meaningful to that engine.
struct StorageFile {
  int32_t index = -1;
  bool valid() const { return index >= 0; }
};

// A submitted request; sequence 0 means "no request" (always done, status Ok).
struct StorageTicket {
  uint64_t sequence = 0;
};

struct StorageEngineOptions {
  // Requests the engine keeps in flight at once: the io_uring engine's ring size,
  // the thread engine's number of worker threads. 1 to 1024.
  int queue_depth = 32;
  // Requests larger than this are split into chunks of this size (a multiple of
  // kStorageAlignment, at most 1 GiB).
  size_t chunk_bytes = size_t{1} << 20;
  // false: never ask for O_DIRECT (every file is buffered).
  bool direct_io = true;
};

class StorageEngine {
 public:
  virtual ~StorageEngine() = default;
  // "uring", "threads"; a wrapper names what it wraps: "fault(threads)".
  virtual std::string name() const = 0;
  virtual int queue_depth() const = 0;

  // Opens `path` with O_DIRECT. When the file system refuses O_DIRECT (open fails
  // with EINVAL: tmpfs on older kernels, some FUSE and network file systems), the
  // file is opened buffered instead and a warning naming its directory is printed
  // once per directory; is_direct() then says false. Spilling must work wherever
  // the user points it, and correctness does not depend on O_DIRECT (data read back
  // is checksummed by the StorageStore); only speed and page-cache use do.
  // NotFound for a missing file (or directory); other failures name the errno.
  virtual Result<StorageFile> open(const std::string& path, OpenMode mode) = 0;
  // Waits for the file's requests in flight, then closes it.
  virtual Status close(StorageFile file) = 0;
  virtual size_t alignment(StorageFile file) const = 0;  // 4096 when direct, else 1
  virtual bool is_direct(StorageFile file) const = 0;
  virtual std::string path(StorageFile file) const = 0;
  // Reserves disk blocks for [offset, offset + bytes) (fallocate), so that a full
  // disk is reported here rather than by a later write. Ok without doing anything
  // where the file system cannot reserve. Synchronous.
  virtual Status reserve(StorageFile file, uint64_t offset, uint64_t bytes) = 0;

  virtual Result<StorageTicket> submit_read(StorageFile file, uint64_t offset, void* buffer,
                                            size_t bytes) = 0;
  virtual Result<StorageTicket> submit_write(StorageFile file, uint64_t offset,
                                             const void* buffer, size_t bytes) = 0;
  // Non-blocking: the number of requests that have finished and not yet been
  // collected by wait() or wait_all().
  virtual int poll() = 0;
  // Non-blocking: has request `ticket` finished? (A collected ticket has.)
  virtual bool is_done(StorageTicket ticket) = 0;
  // Blocks until request `ticket` finished, collects it and returns its status.
  // Waiting again on a collected ticket returns Ok.
  virtual Status wait(StorageTicket ticket) = 0;
  // Blocks until every request finished and collects them all. Returns the first
  // error in submission order, with the number of other failed requests.
  virtual Status wait_all() = 0;

  // Bytes moved by requests that succeeded (the bytes asked for, not padding).
  virtual uint64_t bytes_read() const = 0;
  virtual uint64_t bytes_written() const = 0;
};

// kind: "uring", "threads" or "auto". "auto" is io_uring when this build has it and
// the kernel lets this process set up a ring; otherwise it falls back to threads
// and says so once on stderr. "uring" without io_uring is Unsupported.
Result<std::unique_ptr<StorageEngine>> make_storage_engine(std::string_view kind,
                                                           const StorageEngineOptions& options = {});
// What makes the storage engine a spill store uses (ExecutorOptions), given its kind;
// empty: make_storage_engine(kind). Production code never wraps an engine itself:
// tests hand in a maker that wraps the real engine in a FaultStorageEngine
// (io/fault_storage_engine.h), as RocksDB's FaultInjectionTestFS wraps a FileSystem.
using StorageEngineMaker = std::function<Result<std::unique_ptr<StorageEngine>>(const std::string& kind)>;
// The two implementations (uring_storage_engine.cpp, thread_storage_engine.cpp).
Result<std::unique_ptr<StorageEngine>> make_uring_storage_engine(const StorageEngineOptions& options);
Result<std::unique_ptr<StorageEngine>> make_thread_storage_engine(const StorageEngineOptions& options);
// Checks queue depth and chunk size; InvalidArgument naming the bad one.
Status validate_storage_engine_options(const StorageEngineOptions& options);

// ---- for engine implementations ----

// The bookkeeping both engines share: the file table, tickets, splitting requests
// into chunks, bounce buffers for partial last blocks, continuing short transfers,
// error messages and counters. A subclass only moves chunks: start_chunks() hands
// it chunks (with mutex() held); it does the system calls, records each call's
// result with record_result() (no lock needed) and, when that says the chunk is
// complete, hands it back with finish_chunk() (mutex() held). A subclass destructor
// calls wait_for_idle() before stopping its workers.
class ChunkedStorageEngine : public StorageEngine {
 public:
  ~ChunkedStorageEngine() override;
  int queue_depth() const override { return options_.queue_depth; }
  Result<StorageFile> open(const std::string& path, OpenMode mode) override;
  Status close(StorageFile file) override;
  size_t alignment(StorageFile file) const override;
  bool is_direct(StorageFile file) const override;
  std::string path(StorageFile file) const override;
  Status reserve(StorageFile file, uint64_t offset, uint64_t bytes) override;
  Result<StorageTicket> submit_read(StorageFile file, uint64_t offset, void* buffer,
                                    size_t bytes) override;
  Result<StorageTicket> submit_write(StorageFile file, uint64_t offset, const void* buffer,
                                     size_t bytes) override;
  int poll() override;
  bool is_done(StorageTicket ticket) override;
  Status wait(StorageTicket ticket) override;
  Status wait_all() override;
  uint64_t bytes_read() const override;
  uint64_t bytes_written() const override;

 protected:
  struct Request;
  // A piece of one request, moved by one system call (more after a short transfer).
  struct Chunk {
    Request* request = nullptr;
    const std::string* path = nullptr;  // the file's, for error messages
    int fd = -1;
    bool write = false;
    bool direct = false;
    uint64_t offset = 0;  // of the chunk's first byte in the file
    char* buffer = nullptr;
    size_t bytes = 0;     // to move
    size_t required = 0;  // a read may stop at end of file once this many arrived
    size_t done = 0;      // moved so far: the next call starts at offset + done
    Status status;
  };

  explicit ChunkedStorageEngine(const StorageEngineOptions& options);
  // Takes the chunks and starts moving them; mutex() is held.
  virtual void start_chunks(const std::vector<Chunk*>& chunks) = 0;
  // Records one system call's result on `chunk`: bytes moved, or -errno. Returns
  // true when the chunk needs another call (a short transfer, EINTR, EAGAIN).
  static bool record_result(Chunk& chunk, int64_t result);
  // Hands back a chunk whose last call record_result() reported; mutex() is held.
  void finish_chunk(Chunk* chunk);
  // Every later submit fails with `status` (an engine whose ring broke).
  void set_broken(Status status);  // mutex() is held
  // Blocks until no request is in flight.
  void wait_for_idle();
  std::mutex& mutex() { return mu_; }
  const StorageEngineOptions& options() const { return options_; }

 private:
  struct FileEntry {
    int fd = -1;
    std::string path;
    bool direct = false;
    int requests_in_flight = 0;
  };
  Result<StorageTicket> submit(bool write, StorageFile file, uint64_t offset, char* buffer,
                               size_t bytes);
  // The open file behind `file`, or null; mu_ is held.
  FileEntry* entry(StorageFile file) const;

  StorageEngineOptions options_;
  mutable std::mutex mu_;
  std::condition_variable finished_cv_;
  std::vector<std::unique_ptr<FileEntry>> files_;  // by StorageFile::index; never reused
  std::map<uint64_t, std::unique_ptr<Request>> requests_;  // not yet collected
  uint64_t next_sequence_ = 1;
  size_t unfinished_ = 0;       // requests whose chunks are not all back
  size_t finished_waiting_ = 0; // finished and not collected
  uint64_t bytes_read_ = 0;
  uint64_t bytes_written_ = 0;
  Status broken_;
};

}  // namespace spillway
