#include "io/storage_engine.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <set>

#include "core/size.h"

namespace spillway {

void AlignedBuffer::Free::operator()(char* p) const { std::free(p); }

Result<AlignedBuffer> AlignedBuffer::allocate(size_t bytes) {
  size_t rounded = align_up(bytes == 0 ? 1 : bytes, kStorageAlignment);
  if (rounded < bytes) return Status::invalid_argument("aligned buffer of " + std::to_string(bytes) + " bytes: too large");
  void* p = std::aligned_alloc(kStorageAlignment, rounded);
  if (p == nullptr)
    return Status::out_of_memory("aligned host buffer: cannot allocate " + format_size(rounded));
  AlignedBuffer b;
  b.data_.reset(static_cast<char*>(p));
  b.size_ = bytes;
  return b;
}

Status validate_storage_engine_options(const StorageEngineOptions& o) {
  if (o.queue_depth < 1 || o.queue_depth > 1024)
    return Status::invalid_argument("storage engine queue depth " + std::to_string(o.queue_depth) +
                                    ": expected 1 to 1024");
  if (o.chunk_bytes < kStorageAlignment || o.chunk_bytes % kStorageAlignment != 0 ||
      o.chunk_bytes > (size_t{1} << 30))
    return Status::invalid_argument("storage engine chunk size " + std::to_string(o.chunk_bytes) +
                                    " bytes: expected a multiple of 4096 from 4 KiB to 1 GiB");
  return Status::ok();
}

Result<std::unique_ptr<StorageEngine>> make_storage_engine(std::string_view kind,
                                                           const StorageEngineOptions& options) {
  SPILLWAY_RETURN_IF_ERROR(validate_storage_engine_options(options));
  if (kind == "uring") return make_uring_storage_engine(options);
  if (kind == "threads") return make_thread_storage_engine(options);
  if (kind == "auto") {
    auto uring = make_uring_storage_engine(options);
    if (uring) return uring;
    static std::once_flag said;
    std::call_once(said, [&] {
      std::cerr << "spillway: io_uring unavailable (" << uring.status().message()
                << "); using the thread-pool storage engine\n";
    });
    return make_thread_storage_engine(options);
  }
  return Status::invalid_argument("storage engine '" + std::string(kind) +
                                  "': expected uring, threads or auto");
}

// ---- ChunkedStorageEngine ----

struct ChunkedStorageEngine::Request {
  uint64_t sequence = 0;
  bool write = false;
  int32_t file = -1;
  size_t bytes = 0;
  std::vector<Chunk> chunks;  // sized once: Chunk pointers stay valid
  size_t chunks_left = 0;
  bool finished = false;
  Status status;
  // O_DIRECT and a byte count that is not a multiple of the alignment: the last
  // partial block goes through `bounce`; a read copies tail_bytes to tail_dst.
  AlignedBuffer bounce;
  char* tail_dst = nullptr;
  size_t tail_bytes = 0;
};

namespace {

std::string where(std::string_view verb, const std::string& path, uint64_t offset, size_t bytes) {
  return std::string(verb) + " " + path + " at offset " + std::to_string(offset) + " (" +
         std::to_string(bytes) + " bytes)";
}

std::string directory_of(const std::string& path) {
  auto slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

// The O_DIRECT fallback warning, once per directory per process.
void warn_buffered_once(const std::string& path) {
  static std::mutex mu;
  static std::set<std::string> warned;
  std::string dir = directory_of(path);
  std::lock_guard<std::mutex> lock(mu);
  if (!warned.insert(dir).second) return;
  std::cerr << "spillway: warning: the file system of " << dir
            << " refuses O_DIRECT (open returned EINVAL); using buffered I/O through the page"
               " cache there\n";
}

}  // namespace

ChunkedStorageEngine::ChunkedStorageEngine(const StorageEngineOptions& options) : options_(options) {}

ChunkedStorageEngine::~ChunkedStorageEngine() {
  wait_for_idle();
  for (auto& f : files_) {
    if (f && f->fd >= 0 && ::close(f->fd) != 0)
      std::cerr << "spillway: warning: " << errno_status("close " + f->path, errno).message() << "\n";
  }
}

void ChunkedStorageEngine::wait_for_idle() {
  std::unique_lock<std::mutex> lock(mu_);
  finished_cv_.wait(lock, [&] { return unfinished_ == 0; });
}

ChunkedStorageEngine::FileEntry* ChunkedStorageEngine::entry(StorageFile file) const {
  if (file.index < 0 || static_cast<size_t>(file.index) >= files_.size()) return nullptr;
  FileEntry* e = files_[static_cast<size_t>(file.index)].get();
  return (e && e->fd >= 0) ? e : nullptr;
}

Result<StorageFile> ChunkedStorageEngine::open(const std::string& path, OpenMode mode) {
  int flags = O_CLOEXEC;
  switch (mode) {
    case OpenMode::Create: flags |= O_RDWR | O_CREAT | O_TRUNC; break;
    case OpenMode::ReadWrite: flags |= O_RDWR; break;
    case OpenMode::ReadOnly: flags |= O_RDONLY; break;
  }
  bool direct = options_.direct_io;
  int fd = -1;
  if (direct) {
    do fd = ::open(path.c_str(), flags | O_DIRECT, 0644);
    while (fd < 0 && errno == EINTR);
    if (fd < 0 && errno == EINVAL) direct = false;  // the file system refuses O_DIRECT
  }
  if (!direct) {
    do fd = ::open(path.c_str(), flags, 0644);
    while (fd < 0 && errno == EINTR);
    if (fd >= 0 && options_.direct_io) warn_buffered_once(path);
  }
  if (fd < 0) {
    int err = errno;
    if (err == ENOENT) return Status::not_found("open " + path + ": " + std::strerror(err));
    return errno_status("open " + path, err);
  }
  std::lock_guard<std::mutex> lock(mu_);
  auto e = std::make_unique<FileEntry>();
  e->fd = fd;
  e->path = path;
  e->direct = direct;
  files_.push_back(std::move(e));
  return StorageFile{static_cast<int32_t>(files_.size() - 1)};
}

Status ChunkedStorageEngine::close(StorageFile file) {
  std::unique_lock<std::mutex> lock(mu_);
  FileEntry* e = entry(file);
  if (!e) return Status::invalid_argument("close: storage file #" + std::to_string(file.index) + " is not open");
  finished_cv_.wait(lock, [&] { return e->requests_in_flight == 0; });
  int fd = e->fd;
  e->fd = -1;
  if (::close(fd) != 0) return errno_status("close " + e->path, errno);
  return Status::ok();
}

size_t ChunkedStorageEngine::alignment(StorageFile file) const {
  std::lock_guard<std::mutex> lock(mu_);
  FileEntry* e = entry(file);
  return (e && e->direct) ? kStorageAlignment : 1;
}

bool ChunkedStorageEngine::is_direct(StorageFile file) const {
  std::lock_guard<std::mutex> lock(mu_);
  FileEntry* e = entry(file);
  return e && e->direct;
}

std::string ChunkedStorageEngine::path(StorageFile file) const {
  std::lock_guard<std::mutex> lock(mu_);
  FileEntry* e = entry(file);
  return e ? e->path : std::string();
}

Status ChunkedStorageEngine::reserve(StorageFile file, uint64_t offset, uint64_t bytes) {
  int fd;
  std::string path;
  {
    std::lock_guard<std::mutex> lock(mu_);
    FileEntry* e = entry(file);
    if (!e) return Status::invalid_argument("reserve: storage file #" + std::to_string(file.index) + " is not open");
    fd = e->fd;
    path = e->path;
  }
  if (bytes == 0) return Status::ok();
  int rc;
  do rc = ::fallocate(fd, 0, static_cast<off_t>(offset), static_cast<off_t>(bytes));
  while (rc != 0 && errno == EINTR);
  if (rc == 0) return Status::ok();
  int err = errno;
  if (err == EOPNOTSUPP || err == ENOSYS) return Status::ok();  // cannot reserve here; writes will tell
  return errno_status(where("reserve (fallocate)", path, offset, bytes), err);
}

Result<StorageTicket> ChunkedStorageEngine::submit_read(StorageFile file, uint64_t offset,
                                                        void* buffer, size_t bytes) {
  return submit(false, file, offset, static_cast<char*>(buffer), bytes);
}

Result<StorageTicket> ChunkedStorageEngine::submit_write(StorageFile file, uint64_t offset,
                                                         const void* buffer, size_t bytes) {
  // The engine never writes through a write's buffer; the cast only lets one Chunk
  // type serve both directions.
  return submit(true, file, offset, static_cast<char*>(const_cast<void*>(buffer)), bytes);
}

Result<StorageTicket> ChunkedStorageEngine::submit(bool write, StorageFile file, uint64_t offset,
                                                   char* buffer, size_t bytes) {
  const char* verb = write ? "write" : "read";
  std::unique_lock<std::mutex> lock(mu_);
  if (!broken_.is_ok()) return broken_;
  FileEntry* e = entry(file);
  if (!e)
    return Status::invalid_argument(std::string(verb) + ": storage file #" + std::to_string(file.index) +
                                    " is not open");
  if (bytes > 0 && buffer == nullptr)
    return Status::invalid_argument(where(verb, e->path, offset, bytes) + ": null buffer");
  if (offset + bytes < offset || offset + bytes > static_cast<uint64_t>(INT64_MAX))
    return Status::invalid_argument(where(verb, e->path, offset, bytes) + ": past the largest file offset");
  if (e->direct) {
    if (offset % kStorageAlignment != 0)
      return Status::invalid_argument(where(verb, e->path, offset, bytes) +
                                      ": the offset is not a multiple of 4096, which O_DIRECT requires");
    if (reinterpret_cast<uintptr_t>(buffer) % kStorageAlignment != 0) {
      char address[32];
      std::snprintf(address, sizeof address, "%p", static_cast<void*>(buffer));
      return Status::invalid_argument(where(verb, e->path, offset, bytes) + ": the host buffer " + address +
                                      " is not aligned to 4096 bytes, which O_DIRECT requires");
    }
  }

  auto request = std::make_unique<Request>();
  Request& r = *request;
  r.sequence = next_sequence_++;
  r.write = write;
  r.file = file.index;
  r.bytes = bytes;
  size_t body = e->direct ? bytes / kStorageAlignment * kStorageAlignment : bytes;
  size_t tail = bytes - body;
  size_t chunk_bytes = options_.chunk_bytes;
  size_t count = (body + chunk_bytes - 1) / chunk_bytes + (tail > 0 ? 1 : 0);
  r.chunks.resize(count);
  for (size_t i = 0, at = 0; at < body; ++i, at += chunk_bytes) {
    Chunk& c = r.chunks[i];
    c.offset = offset + at;
    c.buffer = buffer + at;
    c.bytes = std::min(chunk_bytes, body - at);
    c.required = c.bytes;
  }
  if (tail > 0) {
    auto bounce = AlignedBuffer::allocate(kStorageAlignment);
    if (!bounce) return bounce.status();
    r.bounce = std::move(*bounce);
    Chunk& c = r.chunks.back();
    c.offset = offset + body;
    c.buffer = r.bounce.data();
    c.bytes = kStorageAlignment;
    if (write) {
      std::memcpy(r.bounce.data(), buffer + body, tail);
      std::memset(r.bounce.data() + tail, 0, kStorageAlignment - tail);
      c.required = kStorageAlignment;
    } else {
      c.required = tail;  // the block may end at end of file after the bytes asked for
      r.tail_dst = buffer + body;
      r.tail_bytes = tail;
    }
  }
  std::vector<Chunk*> started;
  started.reserve(count);
  for (Chunk& c : r.chunks) {
    c.request = &r;
    c.path = &e->path;
    c.fd = e->fd;
    c.write = write;
    c.direct = e->direct;
    started.push_back(&c);
  }
  r.chunks_left = count;
  StorageTicket ticket{r.sequence};
  requests_.emplace(r.sequence, std::move(request));
  if (count == 0) {  // zero bytes: done at once
    r.finished = true;
    ++finished_waiting_;
    return ticket;
  }
  ++unfinished_;
  ++e->requests_in_flight;
  start_chunks(started);
  return ticket;
}

bool ChunkedStorageEngine::record_result(Chunk& c, int64_t result) {
  const char* verb = c.write ? "write" : "read";
  if (result == -EINTR || result == -EAGAIN) return true;
  if (result < 0) {
    c.status = errno_status(where(verb, *c.path, c.offset + c.done, c.bytes - c.done), static_cast<int>(-result));
    return false;
  }
  if (result == 0) {
    if (!c.write && c.done >= c.required) return false;  // end of file after what was asked
    c.status = Status::io_error(
        where(c.write ? "short write:" : "short read:", *c.path, c.offset, c.bytes) + ": " +
        (c.write ? "the write made no progress after " : "end of file after ") + std::to_string(c.done) +
        " bytes");
    return false;
  }
  c.done += static_cast<size_t>(result);
  if (c.done >= c.bytes) return false;
  if (!c.write && c.done >= c.required) return false;
  if (c.direct && c.done % kStorageAlignment != 0) {
    // O_DIRECT can only go on at an aligned offset: a read stopped inside a block
    // at end of file, or the device cut a write short.
    c.status = Status::io_error(where(c.write ? "short write:" : "short read:", *c.path, c.offset, c.bytes) +
                                ": stopped after " + std::to_string(c.done) + " bytes" +
                                (c.write ? "" : " (end of file)"));
    return false;
  }
  return true;
}

void ChunkedStorageEngine::finish_chunk(Chunk* chunk) {
  Request& r = *chunk->request;
  if (!chunk->status.is_ok() && r.status.is_ok()) r.status = chunk->status;
  if (--r.chunks_left > 0) return;
  if (r.status.is_ok()) {
    if (r.tail_dst) std::memcpy(r.tail_dst, r.bounce.data(), r.tail_bytes);
    (r.write ? bytes_written_ : bytes_read_) += r.bytes;
  }
  r.bounce = AlignedBuffer();
  r.finished = true;
  --unfinished_;
  ++finished_waiting_;
  --files_[static_cast<size_t>(r.file)]->requests_in_flight;
  finished_cv_.notify_all();
}

void ChunkedStorageEngine::set_broken(Status status) {
  if (broken_.is_ok()) broken_ = std::move(status);
}

int ChunkedStorageEngine::poll() {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int>(finished_waiting_);
}

bool ChunkedStorageEngine::is_done(StorageTicket ticket) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = requests_.find(ticket.sequence);
  return it == requests_.end() || it->second->finished;
}

Status ChunkedStorageEngine::wait(StorageTicket ticket) {
  std::unique_lock<std::mutex> lock(mu_);
  if (ticket.sequence >= next_sequence_)
    return Status::invalid_argument("wait: storage ticket " + std::to_string(ticket.sequence) +
                                    " was never issued by this engine");
  // Another thread may collect the same ticket meanwhile: look it up afresh.
  finished_cv_.wait(lock, [&] {
    auto it = requests_.find(ticket.sequence);
    return it == requests_.end() || it->second->finished;
  });
  auto it = requests_.find(ticket.sequence);
  if (it == requests_.end()) return Status::ok();  // collected before (or sequence 0)
  Status s = std::move(it->second->status);
  requests_.erase(it);
  --finished_waiting_;
  return s;
}

Status ChunkedStorageEngine::wait_all() {
  std::unique_lock<std::mutex> lock(mu_);
  finished_cv_.wait(lock, [&] { return unfinished_ == 0; });
  Status first;
  size_t others = 0;
  for (auto& [sequence, r] : requests_) {
    if (r->status.is_ok()) continue;
    if (first.is_ok()) first = r->status;
    else ++others;
  }
  requests_.clear();
  finished_waiting_ = 0;
  if (others > 0)
    first = Status(first.code(), first.message() + " (and " + std::to_string(others) + " more failed requests)");
  return first;
}

uint64_t ChunkedStorageEngine::bytes_read() const {
  std::lock_guard<std::mutex> lock(mu_);
  return bytes_read_;
}

uint64_t ChunkedStorageEngine::bytes_written() const {
  std::lock_guard<std::mutex> lock(mu_);
  return bytes_written_;
}

}  // namespace spillway
