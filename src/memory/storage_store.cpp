#include "memory/storage_store.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <optional>
#include <iostream>
#include <random>
#include <sstream>

#include "core/atomic_file.h"
#include "core/checksum.h"
#include "core/process.h"
#include "core/size.h"

namespace spillway {
namespace {

constexpr const char* kRunPrefix = "spillway-";
constexpr const char* kMarkerName = "owner";
constexpr const char* kSpillFileName = "spill-0.bin";
// No budget: extents may lie anywhere below 2^62 bytes.
constexpr uint64_t kUnlimited = uint64_t{1} << 62;

const char* kExpectedDir = "expected an existing directory this process can create files in";

// Parses "pid N" and "start T" lines of a marker.
void read_marker(const std::string& path, int64_t* pid, std::optional<uint64_t>* start) {
  std::ifstream in(path);
  std::string key;
  while (in >> key) {
    if (key == "pid") {
      int64_t v;
      if (in >> v) *pid = v;
    } else if (key == "start") {
      uint64_t v;
      if (in >> v) *start = v;
    }
  }
}

// "spillway-1234-ab12cd34" → 1234, else 0.
int64_t pid_from_name(const std::string& name) {
  size_t at = std::strlen(kRunPrefix);
  int64_t pid = 0;
  size_t digits = 0;
  while (at < name.size() && name[at] >= '0' && name[at] <= '9' && digits < 12) {
    pid = pid * 10 + (name[at] - '0');
    ++at;
    ++digits;
  }
  return (digits > 0 && at < name.size() && name[at] == '-') ? pid : 0;
}

// Disk space taken by the regular files directly inside `dir`; what cannot be
// listed or examined counts as 0 (the figure only informs a warning).
uint64_t disk_usage(const std::string& dir) {
  uint64_t total = 0;
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return 0;
  while (dirent* e = ::readdir(d)) {
    struct stat st;
    std::string p = dir + "/" + e->d_name;
    if (::lstat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode)) total += static_cast<uint64_t>(st.st_blocks) * 512;
  }
  int closed = ::closedir(d);
  return closed == 0 ? total : 0;
}

Status write_whole_file(const std::string& path, const std::string& text) {
  int fd;
  do fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  while (fd < 0 && errno == EINTR);
  if (fd < 0) return errno_status("create " + path, errno);
  size_t done = 0;
  while (done < text.size()) {
    ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      int err = n < 0 ? errno : EIO;
      ::close(fd);
      return errno_status("write " + path, err);
    }
    done += static_cast<size_t>(n);
  }
  if (::close(fd) != 0) return errno_status("close " + path, errno);
  return Status::ok();
}

std::string hex64(uint64_t v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "0x%016" PRIx64, v);
  return buf;
}

}  // namespace

Result<std::vector<LeftoverSpill>> StorageStore::find_leftovers(const std::string& dir) {
  std::vector<LeftoverSpill> found;
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return errno_status("spill directory " + dir + ": cannot list it", errno);
  for (;;) {
    errno = 0;  // readdir returns null both at the end and on error
    dirent* e = ::readdir(d);
    if (e == nullptr) break;
    std::string name = e->d_name;
    if (name.rfind(kRunPrefix, 0) != 0) continue;
    std::string path = dir + "/" + name;
    struct stat st;
    if (::lstat(path.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) continue;
    int64_t pid = 0;
    std::optional<uint64_t> start;
    read_marker(path + "/" + kMarkerName, &pid, &start);
    if (pid == 0) pid = pid_from_name(name);
    if (pid == 0) continue;  // not one of ours
    if (process_alive(pid, start)) continue;
    found.push_back({path, pid, disk_usage(path)});
  }
  int err = errno;
  if (::closedir(d) != 0 && err == 0) return errno_status("spill directory " + dir + ": closedir", errno);
  if (err != 0) return errno_status("spill directory " + dir + ": readdir", err);
  return found;
}

uint64_t Leftovers::bytes() const {
  uint64_t total = 0;
  for (const LeftoverSpill& l : spill_dirs) total += l.bytes;
  for (const StaleTempFile& t : temp_files) total += t.bytes;
  return total;
}

std::string Leftovers::describe() const {
  auto pids = [](const auto& items) {
    std::string text;
    for (size_t i = 0; i < items.size() && i < 5; ++i) text += (i == 0 ? "" : ", ") + std::to_string(items[i].pid);
    if (items.size() > 5) text += ", ...";
    return text;
  };
  std::string text;
  if (!spill_dirs.empty())
    text += std::to_string(spill_dirs.size()) + (spill_dirs.size() == 1 ? " spill directory" : " spill directories") +
            " (pid" + (spill_dirs.size() == 1 ? " " : "s ") + pids(spill_dirs) + ")";
  if (!temp_files.empty())
    text += (text.empty() ? "" : " and ") + std::to_string(temp_files.size()) +
            (temp_files.size() == 1 ? " temporary file" : " temporary files") + " of unfinished saves (pid" +
            (temp_files.size() == 1 ? " " : "s ") + pids(temp_files) + ")";
  return text + ", " + format_size(bytes()) + " in all";
}

Result<Leftovers> find_all_leftovers(const std::string& dir) {
  Leftovers found;
  SPILLWAY_ASSIGN_OR_RETURN(found.spill_dirs, StorageStore::find_leftovers(dir));
  auto temps = find_stale_temp_files(dir);
  if (!temps) return temps.status().with_context("spill directory " + dir);
  found.temp_files = std::move(*temps);
  return found;
}

std::string leftovers_warning(const std::string& dir, const Leftovers& leftovers) {
  return dir + " holds leftovers of runs that are gone: " + leftovers.describe() +
         "; they are never reused: remove them with `spillway clean " + dir + "`";
}

uint64_t leftover_bytes(const std::string& dir) {
  auto found = find_all_leftovers(dir);
  return found ? found->bytes() : 0;
}

std::string leftovers_note(const std::string& dir) {
  auto found = find_all_leftovers(dir);
  if (!found || found->empty()) return "";
  return "; leftovers of runs that are gone take " + format_size(found->bytes()) + " of it (" + found->describe() +
         "): remove them with `spillway clean " + dir + "`";
}

Status remove_leftover_spill_dir(const LeftoverSpill& leftover) {
  // Only what a run makes there (regular files: the marker and spill files), then the
  // folder itself; anything else stays, and rmdir says so.
  DIR* d = ::opendir(leftover.path.c_str());
  if (d == nullptr) return errno_status("list " + leftover.path, errno);
  Status first;
  for (;;) {
    errno = 0;
    dirent* e = ::readdir(d);
    if (e == nullptr) {
      if (errno != 0 && first.is_ok()) first = errno_status("readdir " + leftover.path, errno);
      break;
    }
    std::string path = leftover.path + "/" + e->d_name;
    struct stat st;
    if (::lstat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) continue;
    if (::unlink(path.c_str()) != 0 && errno != ENOENT && first.is_ok()) first = errno_status("remove " + path, errno);
  }
  ::closedir(d);
  SPILLWAY_RETURN_IF_ERROR(first);
  if (::rmdir(leftover.path.c_str()) != 0 && errno != ENOENT) return errno_status("remove folder " + leftover.path, errno);
  return Status::ok();
}

StorageStore::StorageStore(const StorageStoreOptions& options, uint64_t capacity)
    : dir_(options.dir), budget_(options.budget_bytes), allocator_(capacity, kStorageAlignment) {}

Result<std::unique_ptr<StorageStore>> StorageStore::create(const StorageStoreOptions& options,
                                                           std::unique_ptr<StorageEngine> engine) {
  const std::string& dir = options.dir;
  if (dir.empty()) return Status::invalid_argument(std::string("spill directory: none given (") + kExpectedDir + ")");
  struct stat st;
  if (::stat(dir.c_str(), &st) != 0) {
    int err = errno;
    std::string m = "spill directory " + dir + " " +
                    (err == ENOENT ? std::string("does not exist") : std::string("cannot be examined: ") + std::strerror(err)) +
                    " (" + kExpectedDir + ")";
    return err == ENOENT ? Status::not_found(m) : Status::io_error(m);
  }
  if (!S_ISDIR(st.st_mode))
    return Status::invalid_argument("spill directory " + dir + " is not a directory (" + kExpectedDir + ")");

  uint64_t capacity = kUnlimited;
  if (options.budget_bytes != 0) {
    capacity = options.budget_bytes / kStorageAlignment * kStorageAlignment;
    if (capacity == 0)
      return Status::invalid_argument("storage budget of " + std::to_string(options.budget_bytes) +
                                      " bytes is smaller than one 4 KiB block");
  }

  auto leftovers = find_all_leftovers(dir);
  if (!leftovers) return leftovers.status();
  if (options.warn_leftovers && !leftovers->empty())
    std::cerr << "spillway: warning: " << leftovers_warning(dir, *leftovers) << "\n";

  std::unique_ptr<StorageStore> store(new StorageStore(options, capacity));
  store->leftovers_ = std::move(leftovers->spill_dirs);

  // DIR/spillway-<pid>-<random>: the pid lets a later run tell whether we are alive.
  // run_dir_ is set only once the directory exists: the destructor removes it, and
  // must never name (or warn about) one that was not made.
  std::random_device random;
  int err = EEXIST;
  std::string run_dir;
  for (int attempt = 0; attempt < 16 && err == EEXIST; ++attempt) {
    char suffix[16];
    std::snprintf(suffix, sizeof suffix, "%08x", static_cast<unsigned>(random()));
    run_dir = dir + "/" + kRunPrefix + std::to_string(::getpid()) + "-" + suffix;
    err = ::mkdir(run_dir.c_str(), 0755) == 0 ? 0 : errno;
  }
  if (err != 0) {
    const std::string what = "cannot create a run directory in it";
    if (err == EACCES || err == EPERM || err == EROFS)
      return Status::io_error("spill directory " + dir + " is not writable (" + kExpectedDir + "): " + what +
                              ": " + std::strerror(err));
    return errno_status("spill directory " + dir + ": " + what, err);
  }
  store->run_dir_ = run_dir;
  store->remove_on_interrupt_ = RemoveOnInterrupt(store->run_dir_);
  store->marker_path_ = store->run_dir_ + "/" + kMarkerName;
  store->file_path_ = store->run_dir_ + "/" + kSpillFileName;
  // From here on the destructor removes whatever was made.
  std::string marker = "spillway spill directory\npid " + std::to_string(::getpid()) + "\n";
  if (auto start = process_start_ticks(::getpid())) marker += "start " + std::to_string(*start) + "\n";
  Status s = write_whole_file(store->marker_path_, marker);
  if (!s.is_ok()) {
    return s.code() == StatusCode::NoSpace ? s.with_context("spill directory " + dir + " is full")
                                           : s.with_context("spill directory " + dir);
  }

  if (!engine) {
    auto made = make_storage_engine(options.engine, options.engine_options);
    if (!made) return made.status();
    engine = std::move(*made);
  }
  store->engine_ = std::move(engine);
  auto file = store->engine_->open(store->file_path_, OpenMode::Create);
  if (!file) return file.status().with_context("spill directory " + dir);
  store->file_ = *file;
  return store;
}

StorageStore::~StorageStore() {
  if (engine_) {
    Status s = wait_all();
    (void)s;  // the requests' owners are gone; nothing to report them to
    if (file_.valid()) {
      Status c = engine_->close(file_);
      if (!c.is_ok()) std::cerr << "spillway: warning: " << c.message() << "\n";
    }
    engine_.reset();
  }
  remove_files();
}

void StorageStore::remove_files() {
  auto remove = [](const std::string& path) {
    if (!path.empty() && ::unlink(path.c_str()) != 0 && errno != ENOENT)
      std::cerr << "spillway: warning: " << errno_status("remove " + path, errno).message() << "\n";
  };
  remove(file_path_);
  remove(marker_path_);
  if (!run_dir_.empty() && ::rmdir(run_dir_.c_str()) != 0 && errno != ENOENT)
    std::cerr << "spillway: warning: " << errno_status("remove " + run_dir_, errno).message() << "\n";
}

std::string StorageStore::describe(const Extent& e) const {
  return "extent #" + std::to_string(e.id) + " at offset " + std::to_string(e.offset) + " (" +
         std::to_string(e.bytes) + " bytes) of spill file " + file_path_;
}

Status StorageStore::full_disk(const Status& cause, uint64_t asked) const {
  std::string budget = budget_ == 0 ? "no storage budget" : "storage budget " + format_size(budget_);
  return Status::no_space("spill directory " + dir_ + " is full: expected room for " + format_size(asked) +
                          " more (" + budget + ", " + format_size(allocator_.in_use()) +
                          " of extents in use): " + cause.message() + leftovers_note(dir_));
}

Result<StorageStore::ExtentState*> StorageStore::find(const Extent& extent, const char* what) {
  auto it = extents_.find(extent.offset);
  if (extent.id == 0 || it == extents_.end() || it->second.id != extent.id || it->second.bytes != extent.bytes)
    return Status::invalid_argument(std::string(what) + ": " + describe(extent) +
                                    " is not a live extent of this store (freed, or never allocated here)");
  if (it->second.busy != 0)
    return Status::invalid_argument(std::string(what) + ": " + describe(extent) +
                                    " has a request in flight; wait for it first");
  return &it->second;
}

Result<Extent> StorageStore::allocate(uint64_t bytes) {
  if (bytes > kUnlimited)
    return Status::invalid_argument("storage store: an extent of " + std::to_string(bytes) + " bytes is too large");
  std::lock_guard<std::mutex> lock(mu_);
  auto offset = allocator_.allocate(bytes);
  uint64_t asked = align_up(bytes == 0 ? 1 : bytes, kStorageAlignment);
  if (!offset) {
    uint64_t budget = budget_ == 0 ? allocator_.capacity() : budget_;
    return Status::out_of_memory(out_of_memory_message("storage budget (spill directory " + dir_ + ")",
                                                       asked, allocator_.in_use(),
                                                       allocator_.largest_free_block(), budget) +
                                 leftovers_note(dir_));
  }
  uint64_t end = *offset + allocator_.block_bytes(*offset).value_or(asked);
  if (end > reserved_end_) {
    Status s = engine_->reserve(file_, reserved_end_, end - reserved_end_);
    if (!s.is_ok()) {
      Status undo = allocator_.free(*offset);
      (void)undo;  // just allocated: cannot fail
      if (s.code() == StatusCode::NoSpace) return full_disk(s, end - reserved_end_);
      return s.with_context("spill directory " + dir_);
    }
    reserved_end_ = end;
  }
  uint64_t id = next_extent_id_++;
  ExtentState& e = extents_[*offset];
  e = ExtentState();
  e.id = id;
  e.bytes = bytes;
  return Extent{id, *offset, bytes};
}

Status StorageStore::free(const Extent& extent) {
  std::lock_guard<std::mutex> lock(mu_);
  auto e = find(extent, "free");
  if (!e) return e.status();
  SPILLWAY_RETURN_IF_ERROR(allocator_.free(extent.offset));
  extents_.erase(extent.offset);
  return Status::ok();
}

namespace {
Status check_host_buffer(const void* p, const char* what, const std::string& extent) {
  if (reinterpret_cast<uintptr_t>(p) % kStorageAlignment == 0) return Status::ok();
  char addr[32];
  std::snprintf(addr, sizeof addr, "%p", p);
  return Status::invalid_argument(std::string(what) + ": " + extent + ": host buffer " + addr +
                                  " is not aligned to 4096 bytes; the storage tier uses O_DIRECT, which"
                                  " needs 4096-aligned host buffers (HostPool blocks, AlignedBuffer)");
}
}  // namespace

Result<StorageStore::Ticket> StorageStore::write(const Extent& extent, const void* host_src) {
  SPILLWAY_RETURN_IF_ERROR(check_host_buffer(host_src, "write", describe(extent)));
  if (host_src == nullptr && extent.bytes > 0)
    return Status::invalid_argument("write: " + describe(extent) + ": null host buffer");
  uint64_t sum = checksum64(host_src, extent.bytes);  // before the lock: it reads every byte
  std::lock_guard<std::mutex> lock(mu_);
  auto e = find(extent, "write");
  if (!e) return e.status();
  auto t = engine_->submit_write(file_, extent.offset, host_src, extent.bytes);
  if (!t) return t.status();
  uint64_t sequence = next_sequence_++;
  (*e)->busy = sequence;
  (*e)->content = Content::Writing;  // the old bytes are being overwritten
  ops_[sequence] = Op{true, extent.offset, extent.id, extent.bytes, *t, sum, nullptr};
  return Ticket{sequence};
}

Result<StorageStore::Ticket> StorageStore::read(const Extent& extent, void* host_dst) {
  SPILLWAY_RETURN_IF_ERROR(check_host_buffer(host_dst, "read", describe(extent)));
  if (host_dst == nullptr && extent.bytes > 0)
    return Status::invalid_argument("read: " + describe(extent) + ": null host buffer");
  std::lock_guard<std::mutex> lock(mu_);
  auto e = find(extent, "read");
  if (!e) return e.status();
  if ((*e)->content == Content::Empty)
    return Status::invalid_argument("read: " + describe(extent) + " was never written");
  if ((*e)->content == Content::Failed)
    return Status::io_error("read: " + describe(extent) +
                            " holds no valid data: its last write failed: " + (*e)->failure.message());
  auto t = engine_->submit_read(file_, extent.offset, host_dst, extent.bytes);
  if (!t) return t.status();
  uint64_t sequence = next_sequence_++;
  (*e)->busy = sequence;
  ops_[sequence] = Op{false, extent.offset, extent.id, extent.bytes, *t, 0, host_dst};
  return Ticket{sequence};
}

Status StorageStore::wait(Ticket ticket) {
  Op op;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (ticket.sequence >= next_sequence_)
      return Status::invalid_argument("wait: storage store ticket " + std::to_string(ticket.sequence) +
                                      " was never issued");
    auto it = ops_.find(ticket.sequence);
    if (it == ops_.end()) return Status::ok();  // collected before
    op = it->second;
    ops_.erase(it);
  }
  Status s = engine_->wait(op.engine_ticket);
  uint64_t read_sum = (!op.write && s.is_ok()) ? checksum64(op.dst, op.bytes) : 0;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = extents_.find(op.offset);
  if (it == extents_.end() || it->second.id != op.extent_id)
    return Status::internal("storage store: extent #" + std::to_string(op.extent_id) +
                            " vanished while a request was in flight");
  ExtentState& e = it->second;
  e.busy = 0;
  if (op.write) {
    if (!s.is_ok()) {
      e.content = Content::Failed;
      e.failure = s;
      if (s.code() == StatusCode::NoSpace) return full_disk(s, align_up(op.bytes, kStorageAlignment));
      return s;
    }
    e.content = Content::Valid;
    e.checksum = op.checksum;
    bytes_written_ += op.bytes;
    return Status::ok();
  }
  if (!s.is_ok()) return s;
  if (read_sum != e.checksum)
    return Status::corrupt("spill file " + file_path_ + ": extent #" + std::to_string(op.extent_id) +
                           " at offset " + std::to_string(op.offset) + " (" + std::to_string(op.bytes) +
                           " bytes): checksum mismatch: written " + hex64(e.checksum) + ", read back " +
                           hex64(read_sum));
  bytes_read_ += op.bytes;
  return Status::ok();
}

Status StorageStore::wait_all() {
  std::vector<uint64_t> sequences;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [sequence, op] : ops_) sequences.push_back(sequence);
  }
  Status first;
  size_t others = 0;
  for (uint64_t sequence : sequences) {
    Status s = wait(Ticket{sequence});
    if (s.is_ok()) continue;
    if (first.is_ok()) first = s;
    else ++others;
  }
  if (others > 0)
    first = Status(first.code(), first.message() + " (and " + std::to_string(others) + " more failed requests)");
  return first;
}

bool StorageStore::is_done(Ticket ticket) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = ops_.find(ticket.sequence);
  return it == ops_.end() || engine_->is_done(it->second.engine_ticket);
}

uint64_t StorageStore::bytes_in_use() const {
  std::lock_guard<std::mutex> lock(mu_);
  return allocator_.in_use();
}

uint64_t StorageStore::peak_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return allocator_.peak();
}

uint64_t StorageStore::file_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return reserved_end_;
}

uint64_t StorageStore::bytes_written() const {
  std::lock_guard<std::mutex> lock(mu_);
  return bytes_written_;
}

uint64_t StorageStore::bytes_read() const {
  std::lock_guard<std::mutex> lock(mu_);
  return bytes_read_;
}

}  // namespace spillway
