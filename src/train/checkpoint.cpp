#include "train/checkpoint.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <future>
#include <thread>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/atomic_file.h"
#include "core/checksum.h"
#include "core/input_file.h"
#include "core/size.h"

namespace spillway {

namespace {

namespace fs = std::filesystem;

std::string hex64(uint64_t v) {
  char b[17];
  std::snprintf(b, sizeof b, "%016" PRIx64, v);
  return b;
}

std::string checkpoint_name(int64_t step) {
  char b[32];
  std::snprintf(b, sizeof b, "ckpt-%08lld", static_cast<long long>(step));
  return b;
}

// "ckpt-00000010" → 10; -1 when the name is not a checkpoint's.
int64_t step_of(const std::string& name) {
  if (name.size() < 6 || name.rfind("ckpt-", 0) != 0) return -1;
  int64_t v = 0;
  for (size_t i = 5; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9' || v > (INT64_MAX - 9) / 10) return -1;
    v = v * 10 + (name[i] - '0');
  }
  return v;
}

Status write_all(int fd, const void* data, size_t n, uint64_t offset, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t w = ::pwrite(fd, p, n, static_cast<off_t>(offset));
    if (w < 0) {
      if (errno == EINTR) continue;
      return errno_status("write " + path + " at offset " + std::to_string(offset), errno);
    }
    p += w;
    n -= static_cast<size_t>(w);
    offset += static_cast<uint64_t>(w);
  }
  return Status::ok();
}

// Background threads of checkpoints yield to training's threads (nice +10); advice only.
void lower_thread_priority() { (void)::setpriority(PRIO_PROCESS, static_cast<id_t>(::gettid()), 10); }

// Writes n bytes from a page-aligned buffer at offset 0 in 64 MiB pieces; on a file
// opened with O_DIRECT the last piece is padded to 4 KiB (the buffer extends that
// far) and the file cut back to n bytes.
Status write_whole(int fd, const uint8_t* data, uint64_t n, const std::string& path) {
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0) return errno_status("fcntl " + path, errno);
  const bool direct = (flags & O_DIRECT) != 0;
  constexpr uint64_t kPiece = uint64_t{64} << 20;
  for (uint64_t at = 0; at < n; at += kPiece) {
    uint64_t len = std::min(kPiece, n - at);
    if (direct) len = (len + 4095) / 4096 * 4096;
    SPILLWAY_RETURN_IF_ERROR(write_all(fd, data + at, len, at, path));
  }
  if (direct && n % 4096 != 0 && ::ftruncate(fd, static_cast<off_t>(n)) != 0)
    return errno_status("truncate " + path + " to " + std::to_string(n) + " bytes", errno);
  return Status::ok();
}

Status read_all(int fd, void* data, size_t n, uint64_t offset, const std::string& path) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    ssize_t r = ::pread(fd, p, n, static_cast<off_t>(offset));
    if (r < 0) {
      if (errno == EINTR) continue;
      return errno_status("read " + path + " at offset " + std::to_string(offset), errno);
    }
    if (r == 0) return Status::corrupt(path + ": ends at offset " + std::to_string(offset) + ", before the bytes its manifest lists");
    p += r;
    n -= static_cast<size_t>(r);
    offset += static_cast<uint64_t>(r);
  }
  return Status::ok();
}

Status write_file(const std::string& path, const std::string& text) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return errno_status("create " + path, errno);
  Status s = write_all(fd, text.data(), text.size(), 0, path);
  if (s.is_ok() && ::fsync(fd) != 0) s = errno_status("fsync " + path, errno);
  if (::close(fd) != 0 && s.is_ok()) s = errno_status("close " + path, errno);
  return s;
}

// Removes a folder and what it holds; errors are left out (best effort cleanup).
void remove_tree(const std::string& path) {
  std::error_code ec;
  fs::remove_all(path, ec);
}

}  // namespace

Result<std::vector<std::pair<int64_t, std::string>>> checkpoint_folders(const std::string& root) {
  std::vector<std::pair<int64_t, std::string>> out;
  std::error_code ec;
  fs::directory_iterator it(root, ec);
  if (ec) return Status::io_error("list the checkpoint folder " + root + ": " + ec.message());
  for (const fs::directory_entry& e : it) {
    const std::string name = e.path().filename().string();
    const int64_t step = step_of(name);
    if (step < 0 || !e.is_directory(ec)) continue;
    out.emplace_back(step, e.path().string());
  }
  std::sort(out.begin(), out.end(), [](auto& a, auto& b) { return a.first > b.first; });
  return out;
}

namespace {

// Integer fields: JSON integers only (a float such as 1e30 would be undefined
// behaviour to convert), within [lo, hi]; throws type_error like json::at does.
int64_t int_field(const nlohmann::json& j, const char* key, int64_t lo = INT64_MIN, int64_t hi = INT64_MAX) {
  const nlohmann::json& v = j.at(key);
  if (!v.is_number_integer() || (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)))
    throw nlohmann::json::type_error::create(302, std::string("\"") + key + "\" is not an integer", &v);
  const int64_t x = v.get<int64_t>();
  if (x < lo || x > hi) throw nlohmann::json::type_error::create(302, std::string("\"") + key + "\" is out of range", &v);
  return x;
}
uint64_t size_field(const nlohmann::json& j, const char* key) {
  return static_cast<uint64_t>(int_field(j, key, 0, INT64_MAX));
}
std::vector<int64_t> dims_field(const nlohmann::json& j, const char* key) {
  const nlohmann::json& v = j.at(key);
  if (!v.is_array()) throw nlohmann::json::type_error::create(302, std::string("\"") + key + "\" is not an array", &v);
  std::vector<int64_t> out;
  for (const nlohmann::json& d : v) {
    if (!d.is_number_integer()) throw nlohmann::json::type_error::create(302, std::string("\"") + key + "\" holds a non-integer", &d);
    out.push_back(d.get<int64_t>());
  }
  return out;
}

uint64_t parse_hex64(const std::string& s, bool* ok) {
  *ok = s.size() == 16;
  uint64_t v = 0;
  for (char c : s) {
    int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
    if (d < 0) *ok = false;
    v = v * 16 + static_cast<uint64_t>(d < 0 ? 0 : d);
  }
  return v;
}

}  // namespace

namespace {

// One state tensor as the checkpoint writes it.
struct StateEntry {
  std::string name;
  DType dtype;
  std::vector<int64_t> dims;
  uint64_t bytes = 0;
};

std::vector<StateEntry> state_entries(const Trainer& trainer, const std::vector<TensorId>& tensors) {
  std::vector<StateEntry> out;
  for (TensorId t : tensors) {
    const TensorInfo& info = trainer.program().tensors.info(t);
    out.push_back({info.name, info.dtype, info.shape.dims, info.bytes()});
  }
  return out;
}

// ROOT made if missing, temporary folders of writers that are gone (killed while
// writing) removed, and this writer's temporary folder made; returns its path.
Result<std::string> make_temp_folder(const std::string& root, const std::string& name) {
  std::error_code ec;
  fs::create_directories(root, ec);
  if (ec) return Status::io_error("--checkpoint-dir " + root + ": cannot create it: " + ec.message());
  const std::string temp = (fs::path(root) / ("." + name + ".tmp-" + std::to_string(::getpid()))).string();
  remove_tree(temp);
  for (const fs::directory_entry& e : fs::directory_iterator(root, ec)) {
    const std::string n = e.path().filename().string();
    const size_t at = n.rfind(".tmp-");
    if (n.rfind(".ckpt-", 0) != 0 || at == std::string::npos) continue;
    const long long pid = std::atoll(n.c_str() + at + 5);
    if (pid > 0 && ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) remove_tree(e.path().string());
  }
  if (::mkdir(temp.c_str(), 0755) != 0) return errno_status("create the checkpoint folder " + temp, errno);
  return temp;
}

// Writes state.bin and manifest.json into `temp`, renames it to ROOT/ckpt-<step>,
// fsyncs ROOT and keeps the newest `keep`. `bytes_of(i, scratch)` returns tensor
// i's bytes (pointing into `scratch` or elsewhere). On an error the temporary
// folder is removed and the error names the checkpoint and the bytes it needed.
Result<std::string> write_folder(const std::string& root, const std::string& temp, const CheckpointMeta& meta, int keep,
                                 const std::vector<StateEntry>& entries,
                                 const std::function<Result<const uint8_t*>(size_t, std::vector<uint8_t>&)>& bytes_of,
                                 const uint8_t* contiguous = nullptr, uint64_t contiguous_bytes = 0,
                                 CheckpointWriteStats* stats = nullptr) {
  const auto started = std::chrono::steady_clock::now();
  const std::string final_path = (fs::path(root) / checkpoint_name(meta.step)).string();
  uint64_t total = 0;
  for (const StateEntry& e : entries) total += e.bytes;
  auto fail = [&](const Status& s) {
    remove_tree(temp);
    return s.with_context("writing checkpoint " + final_path + " (" + format_size(total) + " of state; " +
                          "the previous checkpoints are kept)");
  };
  nlohmann::json manifest;
  manifest["format"] = "spillway-checkpoint";
  manifest["version"] = kCheckpointVersion;
  manifest["step"] = meta.step;
  manifest["data_batch"] = meta.data_batch;
  manifest["config"] = meta.config;
  nlohmann::json list = nlohmann::json::array();
  const std::string state_path = temp + "/state.bin";
  // A snapshot (state.bin's bytes in one page-aligned buffer) is written with
  // O_DIRECT where the file system takes it: no copy through the page cache.
  const bool direct = contiguous != nullptr && reinterpret_cast<uintptr_t>(contiguous) % 4096 == 0;
  int fd = direct ? ::open(state_path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_DIRECT, 0644) : -1;
  if (fd < 0) fd = ::open(state_path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return fail(errno_status("create " + state_path, errno));
  Status s;
  const int fl = ::fcntl(fd, F_GETFL);
  if (stats) stats->direct = fl >= 0 && (fl & O_DIRECT) != 0;
  // A snapshot is written by a second thread while this one checksums it.
  Status io;
  std::thread io_thread;
  if (contiguous != nullptr)
    io_thread = std::thread([&] {
      lower_thread_priority();
      io = write_whole(fd, contiguous, contiguous_bytes, state_path);
    });
  Checksum64Stream file_sum;
  std::vector<uint8_t> scratch;
  uint64_t offset = 0;
  for (size_t i = 0; i < entries.size() && s.is_ok(); ++i) {
    const StateEntry& e = entries[i];
    auto data = bytes_of(i, scratch);
    if (!data.ok()) {
      s = data.status();
      break;
    }
    if (contiguous == nullptr) s = write_all(fd, *data, e.bytes, offset, state_path);
    if (!s.is_ok()) break;
    file_sum.update(*data, e.bytes);
    list.push_back({{"name", e.name},
                    {"dtype", dtype_name(e.dtype)},
                    {"shape", e.dims},
                    {"offset", offset},
                    {"bytes", e.bytes},
                    {"xxh3", hex64(checksum64(*data, e.bytes))}});
    offset += e.bytes;
  }
  if (io_thread.joinable()) io_thread.join();
  if (s.is_ok()) s = io;
  if (s.is_ok() && ::fsync(fd) != 0) s = errno_status("fsync " + state_path, errno);
  if (::close(fd) != 0 && s.is_ok()) s = errno_status("close " + state_path, errno);
  if (!s.is_ok()) return fail(s);
  if (stats) {
    stats->bytes = offset;
    stats->seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  }
  manifest["tensors"] = list;
  manifest["files"] = nlohmann::json::array({{{"name", "state.bin"}, {"bytes", offset}, {"xxh3", hex64(file_sum.digest())}}});
  if (Status w = write_file(temp + "/manifest.json", manifest.dump(1) + "\n"); !w.is_ok()) return fail(w);
  if (Status d = fsync_directory(temp); !d.is_ok()) return fail(d);
  std::error_code ec;
  if (fs::exists(final_path, ec)) remove_tree(final_path);  // the same step again (--stop-after, then the end)
  if (::rename(temp.c_str(), final_path.c_str()) != 0) return fail(errno_status("rename " + temp + " to " + final_path, errno));
  if (Status d = fsync_directory(root); !d.is_ok()) return d.with_context("after writing checkpoint " + final_path);
  // Keep the newest `keep` complete checkpoints up to this one, this one among them.
  // Folders of later steps are left alone: they are no older than this one (a run
  // resumed past a newer checkpoint that did not verify, say), and this run did not
  // write them.
  SPILLWAY_ASSIGN_OR_RETURN(auto folders, checkpoint_folders(root));
  const int64_t written_step = step_of(fs::path(final_path).filename().string());
  int kept = 0;
  for (auto& [step, path] : folders) {
    if (step > written_step) continue;
    if (kept < std::max(1, keep)) {
      ++kept;
      continue;
    }
    remove_tree(path);
  }
  return final_path;
}

// MemAvailable from /proc/meminfo in bytes; 0 when it cannot be read.
uint64_t available_host_memory() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  uint64_t kb = 0;
  std::string unit;
  while (in >> key >> kb >> unit)
    if (key == "MemAvailable:") return kb * 1024;
  return 0;
}

}  // namespace

Result<std::string> write_checkpoint(Trainer& trainer, const std::string& root, const CheckpointMeta& meta, int keep) {
  SPILLWAY_RETURN_IF_ERROR(trainer.drain());
  SPILLWAY_ASSIGN_OR_RETURN(std::string temp, make_temp_folder(root, checkpoint_name(meta.step)));
  const std::vector<TensorId> tensors = trainer.state_tensors();
  return write_folder(root, temp, meta, keep, state_entries(trainer, tensors),
                      [&](size_t i, std::vector<uint8_t>& scratch) -> Result<const uint8_t*> {
                        SPILLWAY_RETURN_IF_ERROR(trainer.read_state_tensor(tensors[i], scratch));
                        return static_cast<const uint8_t*>(scratch.data());
                      });
}

// ---- CheckpointWriter ----

void CheckpointWriter::HostBuffer::Free::operator()(uint8_t* p) const { std::free(p); }

CheckpointWriter::CheckpointWriter(std::string root, int keep, Mode mode) : root_(std::move(root)), keep_(keep), mode_(mode) {}

CheckpointWriter::~CheckpointWriter() {
  if (preparing_.joinable()) preparing_.join();
  (void)wait();
  if (pin_backend_)
    for (void* p : pinned_pieces_) pin_backend_->unpin_host(p);
}

bool CheckpointWriter::busy() const {
  std::lock_guard<std::mutex> lock(mu_);
  return writing_;
}

Status CheckpointWriter::poll() {
  std::lock_guard<std::mutex> lock(mu_);
  if (writing_ || !finished_) return Status::ok();
  return finished_->ok() ? Status::ok() : finished_->status();
}

Result<std::string> CheckpointWriter::wait() {
  if (thread_.joinable()) thread_.join();
  std::lock_guard<std::mutex> lock(mu_);
  if (!finished_) return std::string();
  Result<std::string> r = std::move(*finished_);
  finished_.reset();
  if (r.ok()) last_path_ = *r;
  return r;
}

void CheckpointWriter::prepare(uint64_t state_bytes, Backend* backend) {
  if (mode_ == Mode::Foreground || prepared_) return;
  prepared_ = true;
  pin_backend_ = backend;
  const uint64_t available = available_host_memory();
  if (mode_ == Mode::Auto && !(available > 0 && state_bytes + (uint64_t{4} << 30) <= available - available / 8)) {
    why_sync_ = "the state (" + format_size(state_bytes) + ") does not fit beside the run in host memory (" +
                format_size(available) + " available), so checkpoints are written while training waits";
    return;
  }
  // Allocated and touched on a thread now, so that no checkpoint waits for page faults.
  preparing_ = std::thread([this, state_bytes] {
    lower_thread_priority();
    const uint64_t huge = uint64_t{2} << 20, rounded = std::max(huge, (state_bytes + huge - 1) / huge * huge);
    void* p = std::aligned_alloc(huge, rounded);
    if (!p) {
      prepare_error_ = Status::out_of_memory("checkpoint snapshot: cannot allocate " + format_size(rounded) +
                                             " of host memory for a copy of the state");
      return;
    }
    (void)::madvise(p, rounded, MADV_HUGEPAGE);  // fewer page faults; advice only
    auto* bytes = static_cast<volatile uint8_t*>(p);
    for (uint64_t at = 0; at < rounded; at += 4096) bytes[at] = 0;
    snapshot_.data.reset(static_cast<uint8_t*>(p));
    snapshot_.bytes = rounded;
    if (!pin_backend_) return;
    // Pinned in pieces, so that no single call holds the driver for long while the
    // run goes on; the snapshot's copies never cross a piece.
    constexpr uint64_t kPinPiece = uint64_t{1} << 30;
    for (uint64_t at = 0; at < rounded; at += kPinPiece) {
      auto* piece = static_cast<uint8_t*>(p) + at;
      if (!pin_backend_->pin_host(piece, std::min(kPinPiece, rounded - at)).is_ok()) {
        for (void* q : pinned_pieces_) pin_backend_->unpin_host(q);  // staging copies instead
        pinned_pieces_.clear();
        return;
      }
      pinned_pieces_.push_back(piece);
    }
    pinned_ = PinnedRange{static_cast<const uint8_t*>(p), rounded, kPinPiece};
  });
}

Status CheckpointWriter::begin(Trainer& trainer, const CheckpointMeta& meta) {
  // The previous write first: its error is this call's (the run stops on it).
  auto previous = wait();
  if (!previous.ok()) return previous.status();
  const auto t0 = std::chrono::steady_clock::now();
  const std::vector<TensorId> tensors = trainer.state_tensors();
  std::vector<StateEntry> entries = state_entries(trainer, tensors);
  uint64_t total = 0;
  for (const StateEntry& e : entries) total += e.bytes;
  if (mode_ == Mode::Background) prepare(total);
  if (preparing_.joinable()) preparing_.join();
  if (!prepare_error_.is_ok() && why_sync_.empty())
    why_sync_ = prepare_error_.message() + ", so checkpoints are written while training waits";
  // In the background only when prepared: a copy of the whole state in host memory.
  if (!snapshot_.data || snapshot_.bytes < total) {
    auto written = write_checkpoint(trainer, root_, meta, keep_);
    wait_s_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    times_ = SnapshotTimes();
    std::lock_guard<std::mutex> lock(mu_);
    finished_ = std::move(written);
    return finished_->ok() ? Status::ok() : finished_->status();
  }
  SPILLWAY_ASSIGN_OR_RETURN(std::string temp, make_temp_folder(root_, checkpoint_name(meta.step)));
  std::vector<uint8_t*> dst;
  std::vector<uint64_t> offsets;
  uint64_t at = 0;
  for (const StateEntry& e : entries) {
    dst.push_back(snapshot_.data.get() + at);
    offsets.push_back(at);
    at += e.bytes;
  }
  auto host_done = std::make_shared<std::promise<Status>>();
  std::future<Status> host_copied = host_done->get_future();
  auto times = trainer.snapshot_state(tensors, dst, host_done, pinned_);
  if (!times.ok()) {
    remove_tree(temp);
    return times.status().with_context("checkpoint snapshot of step " + std::to_string(meta.step));
  }
  times_ = *times;
  wait_s_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  {
    std::lock_guard<std::mutex> lock(mu_);
    writing_ = true;
  }
  const uint8_t* base = snapshot_.data.get();
  CopyEngine* engine = &trainer.backend().copy_engine();
  const std::optional<CopyTicket> device_copies = times->device_copies;
  thread_ = std::thread([this, temp, meta, total, entries = std::move(entries), offsets = std::move(offsets), base,
                         host_copied = std::move(host_copied), engine, device_copies]() mutable {
    lower_thread_priority();
    Result<std::string> written = std::string();
    CheckpointWriteStats stats;
    Status copied;
    try {
      copied = host_copied.get();
    } catch (const std::future_error&) {
      copied = Status::internal("the host copies of the snapshot did not run: an earlier host job of the step failed");
    }
    // The device copies into the pinned snapshot, issued by snapshot_state.
    if (copied.is_ok() && device_copies)
      copied = engine->wait(*device_copies).with_context("copying the device-resident state out");
    if (!copied.is_ok()) {
      remove_tree(temp);
      written = copied.with_context("checkpoint of step " + std::to_string(meta.step));
    } else {
      written = write_folder(root_, temp, meta, keep_, entries,
                             [&](size_t i, std::vector<uint8_t>&) -> Result<const uint8_t*> { return base + offsets[i]; },
                             base, total, &stats);
    }
    std::lock_guard<std::mutex> lock(mu_);
    if (written.ok()) write_stats_ = stats;
    finished_ = std::move(written);
    writing_ = false;
  });
  return Status::ok();
}

Result<Checkpoint> parse_checkpoint_manifest(std::string_view text, const std::string& manifest_path) {
  Checkpoint c;
  try {
    c.manifest = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    return Status::corrupt(manifest_path + ": not JSON: " + e.what());
  }
  const nlohmann::json& m = c.manifest;
  try {
    if (!m.is_object() || m.value("format", "") != "spillway-checkpoint")
      return Status::corrupt(manifest_path + ": not a spillway checkpoint manifest (\"format\" is not \"spillway-checkpoint\")");
    if (!m.contains("version") || !m["version"].is_number_integer())
      return Status::corrupt(manifest_path + ": no format version");
    const int64_t version = int_field(m, "version");
    if (version != kCheckpointVersion)
      return Status::unsupported(manifest_path + ": format version " + std::to_string(version) +
                                 "; this spillway reads version " + std::to_string(kCheckpointVersion));
    c.meta.step = int_field(m, "step");
    c.meta.data_batch = int_field(m, "data_batch");
    c.meta.config = m.at("config");
    if (c.meta.step < 0 || c.meta.data_batch < 0) return Status::corrupt(manifest_path + ": a negative step or data position");
    for (const nlohmann::json& f : m.at("files")) {
      const std::string name = f.at("name").get<std::string>();
      if (name.find('/') != std::string::npos || name.empty() || name[0] == '.')
        return Status::corrupt(manifest_path + ": file name '" + name + "' is not a plain name");
      (void)size_field(f, "bytes");
      bool ok = false;
      (void)parse_hex64(f.at("xxh3").get<std::string>(), &ok);
      if (!ok) return Status::corrupt(manifest_path + ": the checksum of " + name + " is not 16 hex digits");
    }
    for (const nlohmann::json& t : m.at("tensors")) {
      (void)t.at("name").get<std::string>();
      (void)t.at("dtype").get<std::string>();
      (void)dims_field(t, "shape");
      (void)size_field(t, "offset");
      (void)size_field(t, "bytes");
      bool ok = false;
      (void)parse_hex64(t.at("xxh3").get<std::string>(), &ok);
      if (!ok) return Status::corrupt(manifest_path + ": a tensor's checksum is not 16 hex digits");
    }
  } catch (const nlohmann::json::exception& e) {
    return Status::corrupt(manifest_path + ": a field is missing or of the wrong type: " + e.what());
  }
  return c;
}

Result<Checkpoint> read_checkpoint(const std::string& path) {
  const std::string manifest_path = path + "/manifest.json";
  if (Status r = check_regular_file(manifest_path, "checkpoint manifest"); !r.is_ok())
    return r.code() == StatusCode::NotFound ? Status::not_found(manifest_path + ": missing (an incomplete checkpoint)")
                                             : r;
  std::ifstream in(manifest_path);
  if (!in) return Status::not_found(manifest_path + ": missing (an incomplete checkpoint)");
  std::stringstream text;
  text << in.rdbuf();
  SPILLWAY_ASSIGN_OR_RETURN(Checkpoint c, parse_checkpoint_manifest(text.str(), manifest_path));
  c.path = path;
  const nlohmann::json& m = c.manifest;
  try {
    // Every file: its size and checksum.
    for (const nlohmann::json& f : m.at("files")) {
      const std::string name = f.at("name").get<std::string>();
      if (name.find('/') != std::string::npos || name.empty() || name[0] == '.')
        return Status::corrupt(manifest_path + ": file name '" + name + "' is not a plain name");
      const std::string file = path + "/" + name;
      const uint64_t want = size_field(f, "bytes");
      bool ok = false;
      const uint64_t sum = parse_hex64(f.at("xxh3").get<std::string>(), &ok);
      if (!ok) return Status::corrupt(manifest_path + ": the checksum of " + name + " is not 16 hex digits");
      struct stat st {};
      auto opened = open_regular_file(file, "checkpoint file", &st);
      if (!opened.ok()) return opened.status().with_context("the manifest lists it");
      int fd = *opened;
      if (static_cast<uint64_t>(st.st_size) != want) {
        ::close(fd);
        return Status::corrupt(file + ": " + std::to_string(st.st_size) + " bytes, the manifest says " +
                               std::to_string(want) + " (truncated or overwritten)");
      }
      Checksum64Stream stream;
      std::vector<char> buf(size_t{8} << 20);
      uint64_t at = 0;
      Status r;
      while (at < want && r.is_ok()) {
        const size_t n = static_cast<size_t>(std::min<uint64_t>(buf.size(), want - at));
        r = read_all(fd, buf.data(), n, at, file);
        stream.update(buf.data(), n);
        at += n;
      }
      ::close(fd);
      if (!r.is_ok()) return r;
      if (stream.digest() != sum)
        return Status::corrupt(file + ": checksum " + hex64(stream.digest()) + ", the manifest says " + hex64(sum) +
                               " (its bytes changed after it was written)");
      if (name == "state.bin") c.bytes = want;
    }
    // Every tensor inside state.bin.
    for (const nlohmann::json& t : m.at("tensors")) {
      const uint64_t off = size_field(t, "offset"), n = size_field(t, "bytes");
      if (off > c.bytes || n > c.bytes - off)
        return Status::corrupt(manifest_path + ": tensor " + t.at("name").get<std::string>() + " lies past the end of state.bin");
    }
  } catch (const nlohmann::json::exception& e) {
    return Status::corrupt(manifest_path + ": a field is missing or of the wrong type: " + e.what());
  }
  return c;
}

Result<std::vector<CheckpointListing>> list_checkpoints(const std::string& root) {
  SPILLWAY_ASSIGN_OR_RETURN(auto folders, checkpoint_folders(root));
  std::vector<CheckpointListing> out;
  for (auto& [step, path] : folders) {
    CheckpointListing l;
    l.path = path;
    l.step = step;
    auto c = read_checkpoint(path);
    if (c.ok()) {
      l.bytes = c->bytes;
      if (c->meta.step != step)
        l.status = Status::corrupt(path + ": its manifest says step " + std::to_string(c->meta.step));
    } else {
      l.status = c.status();
      std::error_code ec;
      l.bytes = fs::file_size(path + "/state.bin", ec);
      if (ec) l.bytes = 0;
    }
    out.push_back(std::move(l));
  }
  return out;
}

Result<Checkpoint> newest_checkpoint(const std::string& root, std::vector<std::string>* skipped) {
  SPILLWAY_ASSIGN_OR_RETURN(auto folders, checkpoint_folders(root));
  for (auto& [step, path] : folders) {
    auto c = read_checkpoint(path);
    if (c.ok() && c->meta.step == step) return c;
    const std::string why = c.ok() ? "its manifest says step " + std::to_string(c->meta.step) : c.status().message();
    if (skipped) skipped->push_back(fs::path(path).filename().string() + ": " + why);
  }
  return Status::not_found("no checkpoint in " + root + " verifies" +
                           (folders.empty() ? " (it holds none)" : " (" + std::to_string(folders.size()) + " skipped)"));
}

Status load_checkpoint(Trainer& trainer, const Checkpoint& c) {
  const Program& program = trainer.program();
  const std::vector<TensorId> wanted = trainer.state_tensors();
  std::vector<bool> seen(program.tensors.size(), false);
  const std::string state = c.path + "/state.bin";
  SPILLWAY_ASSIGN_OR_RETURN(const int fd, open_regular_file(state, "checkpoint state"));
  std::vector<uint8_t> bytes;
  Status s;
  try {
    for (const nlohmann::json& t : c.manifest.at("tensors")) {
      const std::string name = t.at("name").get<std::string>();
      const TensorId id = program.tensors.find(name);
      // Checkpoints written before the parameters were left out (they are the rounded
      // master weights) hold them too: checked, then made again from the masters.
      const bool derived = id != kNoTensor && program.tensors.info(id).role == Role::Param;
      if (id == kNoTensor || (!derived && std::find(wanted.begin(), wanted.end(), id) == wanted.end())) {
        s = Status::invalid_argument(c.path + ": tensor " + name + " is not part of this model's training state");
        break;
      }
      const TensorInfo& info = program.tensors.info(id);
      if (t.at("dtype").get<std::string>() != dtype_name(info.dtype) ||
          dims_field(t, "shape") != info.shape.dims || size_field(t, "bytes") != info.bytes()) {
        s = Status::invalid_argument(c.path + ": tensor " + name + " is " + t.at("dtype").get<std::string>() + " " +
                                     t.at("shape").dump() + "; this run's is " + dtype_name(info.dtype) + " " +
                                     nlohmann::json(info.shape.dims).dump());
        break;
      }
      bytes.resize(info.bytes());
      s = read_all(fd, bytes.data(), bytes.size(), size_field(t, "offset"), state);
      if (!s.is_ok()) break;
      bool ok = false;
      const uint64_t sum = parse_hex64(t.at("xxh3").get<std::string>(), &ok);
      if (!ok || checksum64(bytes.data(), bytes.size()) != sum) {
        s = Status::corrupt(state + ": tensor " + name + " does not match its checksum");
        break;
      }
      if (derived) continue;
      s = trainer.write_state_tensor(id, bytes.data(), bytes.size());
      if (!s.is_ok()) break;
      seen[id] = true;
    }
  } catch (const nlohmann::json::exception& e) {
    s = Status::corrupt(c.path + "/manifest.json: " + e.what());
  }
  ::close(fd);
  SPILLWAY_RETURN_IF_ERROR(s);
  for (TensorId t : wanted)
    if (!seen[t]) return Status::invalid_argument(c.path + ": holds no " + program.tensors.info(t).name);
  SPILLWAY_RETURN_IF_ERROR(trainer.restore_parameters_from_masters());
  trainer.restore_steps_done(c.meta.step);
  return Status::ok();
}

}  // namespace spillway
