#include "io/fault_storage_engine.h"

#include <cerrno>

namespace spillway {

const char* fault_kind_name(FaultKind kind) {
  switch (kind) {
    case FaultKind::ReadError: return "ReadError";
    case FaultKind::CorruptRead: return "CorruptRead";
    case FaultKind::WriteError: return "WriteError";
    case FaultKind::NoSpace: return "NoSpace";
    case FaultKind::ShortWrite: return "ShortWrite";
    case FaultKind::TornWrite: return "TornWrite";
  }
  return "Unknown";
}

bool fault_applies_to_writes(FaultKind kind) {
  return kind != FaultKind::ReadError && kind != FaultKind::CorruptRead;
}

namespace {
std::string where(std::string_view verb, const std::string& path, uint64_t offset, size_t bytes) {
  return std::string(verb) + " " + path + " at offset " + std::to_string(offset) + " (" +
         std::to_string(bytes) + " bytes)";
}
}  // namespace

FaultStorageEngine::FaultStorageEngine(std::unique_ptr<StorageEngine> inner, FaultOptions options)
    : inner_(std::move(inner)), options_(std::move(options)), rng_(options_.seed) {}

FaultStorageEngine::~FaultStorageEngine() {
  // The inner engine's destructor waits for what is in flight.
}

void FaultStorageEngine::set_options(FaultOptions options) {
  std::lock_guard<std::mutex> lock(mu_);
  options_ = std::move(options);
  rng_.seed(options_.seed);
  reads_ = writes_ = 0;
}

uint64_t FaultStorageEngine::faults_injected() const {
  std::lock_guard<std::mutex> lock(mu_);
  uint64_t n = 0;
  for (auto& [kind, count] : injected_) n += count;
  return n;
}

uint64_t FaultStorageEngine::faults_injected(FaultKind kind) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = injected_.find(kind);
  return it == injected_.end() ? 0 : it->second;
}

const FaultRule* FaultStorageEngine::draw(bool write) {
  uint64_t ordinal = write ? ++writes_ : ++reads_;
  const FaultRule* fired = nullptr;
  for (const FaultRule& rule : options_.rules) {
    if (fault_applies_to_writes(rule.kind) != write) continue;
    // Every rule of the direction draws, fired or not, so that a request's fate
    // depends only on the seed and the requests before it.
    double u = std::uniform_real_distribution<double>(0.0, 1.0)(rng_);
    if (fired == nullptr && ((rule.nth != 0 && ordinal == rule.nth) || u < rule.rate)) fired = &rule;
  }
  if (fired) ++injected_[fired->kind];
  return fired;
}

Result<StorageTicket> FaultStorageEngine::add(Pending pending) {
  uint64_t sequence = next_sequence_++;
  pending_.emplace(sequence, std::move(pending));
  return StorageTicket{sequence};
}

Result<StorageTicket> FaultStorageEngine::submit_read(StorageFile file, uint64_t offset, void* buffer,
                                                      size_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  const FaultRule* fault = draw(false);
  Pending p;
  if (fault && fault->kind == FaultKind::ReadError) {
    p.injected = errno_status(where("read", inner_->path(file), offset, bytes) + " (injected fault)", EIO);
    return add(std::move(p));
  }
  auto t = inner_->submit_read(file, offset, buffer, bytes);
  if (!t) return t.status();
  p.inner = *t;
  if (fault && fault->kind == FaultKind::CorruptRead && bytes > 0)
    p.flip = static_cast<char*>(buffer) + rng_() % bytes;
  return add(std::move(p));
}

Result<StorageTicket> FaultStorageEngine::submit_write(StorageFile file, uint64_t offset,
                                                       const void* buffer, size_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  const FaultRule* fault = draw(true);
  Pending p;
  if (!fault) {
    auto t = inner_->submit_write(file, offset, buffer, bytes);
    if (!t) return t.status();
    p.inner = *t;
    return add(std::move(p));
  }
  std::string path = inner_->path(file);
  switch (fault->kind) {
    case FaultKind::WriteError:
      p.injected = errno_status(where("write", path, offset, bytes) + " (injected fault)", EIO);
      return add(std::move(p));
    case FaultKind::NoSpace:
      p.injected = errno_status(where("write", path, offset, bytes) + " (injected fault)", ENOSPC);
      return add(std::move(p));
    case FaultKind::ShortWrite:
    case FaultKind::TornWrite: {
      // A prefix the inner engine can write: a whole number of its blocks.
      size_t align = inner_->alignment(file);
      size_t landed = bytes == 0 ? 0 : static_cast<size_t>(rng_() % bytes) / align * align;
      if (landed > 0) {
        auto t = inner_->submit_write(file, offset, buffer, landed);
        if (!t) return t.status();
        p.inner = *t;
      }
      if (fault->kind == FaultKind::ShortWrite)
        p.injected = Status::io_error(where("short write:", path, offset, bytes) + ": " +
                                      std::to_string(landed) + " bytes landed, then the device stopped (injected fault)");
      return add(std::move(p));
    }
    case FaultKind::ReadError:
    case FaultKind::CorruptRead:
      break;
  }
  return Status::internal("fault storage engine: a read fault drawn for a write");
}

Status FaultStorageEngine::finish(Pending& p) {
  Status s = inner_->wait(p.inner);
  if (!s.is_ok()) return s;
  if (p.flip) *p.flip = static_cast<char>(*p.flip ^ 0x5a);
  return p.injected;
}

int FaultStorageEngine::poll() {
  std::lock_guard<std::mutex> lock(mu_);
  int n = 0;
  for (auto& [sequence, p] : pending_)
    if (inner_->is_done(p.inner)) ++n;
  return n;
}

bool FaultStorageEngine::is_done(StorageTicket ticket) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = pending_.find(ticket.sequence);
  return it == pending_.end() || inner_->is_done(it->second.inner);
}

Status FaultStorageEngine::wait(StorageTicket ticket) {
  Pending p;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (ticket.sequence >= next_sequence_)
      return Status::invalid_argument("wait: storage ticket " + std::to_string(ticket.sequence) +
                                      " was never issued by this engine");
    auto it = pending_.find(ticket.sequence);
    if (it == pending_.end()) return Status::ok();
    p = std::move(it->second);
    pending_.erase(it);
  }
  return finish(p);
}

Status FaultStorageEngine::wait_all() {
  std::map<uint64_t, Pending> all;
  {
    std::lock_guard<std::mutex> lock(mu_);
    all.swap(pending_);
  }
  Status first;
  size_t others = 0;
  for (auto& [sequence, p] : all) {
    Status s = finish(p);
    if (s.is_ok()) continue;
    if (first.is_ok()) first = s;
    else ++others;
  }
  Status rest = inner_->wait_all();  // anything submitted to the inner engine directly
  if (!rest.is_ok()) {
    if (first.is_ok()) first = rest;
    else ++others;
  }
  if (others > 0)
    first = Status(first.code(), first.message() + " (and " + std::to_string(others) + " more failed requests)");
  return first;
}

}  // namespace spillway
