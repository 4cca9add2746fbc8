// The io_uring storage engine: one ring of queue_depth entries (plus one for the
// stop signal), filled under the engine's mutex by whichever thread submits, and a
// reaper thread that takes completions, continues short transfers and tops the
// ring up from the pending queue. Chunks beyond the ring's room wait in that queue.
//
// A broken ring (io_uring_submit failing with anything but EINTR/EAGAIN/EBUSY) fails
// every request not yet consumed by the kernel and every later submit, naming the
// cause; nothing is dropped silently.
#include "io/storage_engine.h"

#ifdef SPILLWAY_HAVE_URING

#include <liburing.h>

#include <cerrno>
#include <chrono>
#include <deque>
#include <iostream>
#include <system_error>
#include <thread>

namespace spillway {
namespace {

class UringStorageEngine final : public ChunkedStorageEngine {
 public:
  explicit UringStorageEngine(const StorageEngineOptions& options) : ChunkedStorageEngine(options) {}

  ~UringStorageEngine() override {
    if (!ring_ready_) return;
    wait_for_idle();
    if (reaper_.joinable()) {
      {
        std::lock_guard<std::mutex> lock(mutex());
        stopping_ = true;
        // The NOP wakes the reaper at once; should it not go in, the reaper still
        // sees stopping_ at its next timeout.
        if (io_uring_sqe* sqe = io_uring_get_sqe(&ring_)) {
          io_uring_prep_nop(sqe);
          io_uring_sqe_set_data(sqe, nullptr);
          int rc;
          do rc = io_uring_submit(&ring_);
          while (rc == -EINTR);
        }
      }
      reaper_.join();
    }
    io_uring_queue_exit(&ring_);
  }

  Status start() {
    unsigned entries = static_cast<unsigned>(options().queue_depth) + 1;
    int rc = io_uring_queue_init(entries, &ring_, 0);
    if (rc < 0)
      return Status::unsupported(
          errno_status("io_uring_queue_init(" + std::to_string(entries) + " entries)", -rc).message());
    ring_ready_ = true;
    timeout_works_ = (ring_.features & IORING_FEAT_EXT_ARG) != 0;
    try {
      reaper_ = std::thread([this] { reap(); });
    } catch (const std::system_error& e) {
      return Status::internal(std::string("io_uring storage engine: cannot start the reaper thread: ") + e.what());
    }
    return Status::ok();
  }

  std::string name() const override { return "uring"; }

 protected:
  void start_chunks(const std::vector<Chunk*>& chunks) override {
    pending_.insert(pending_.end(), chunks.begin(), chunks.end());
    pump();
  }

 private:
  // Moves pending chunks into the ring while it has room, then submits. mutex() held.
  void pump() {
    while (!pending_.empty() && in_ring_ < options().queue_depth) {
      io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
      if (sqe == nullptr) break;
      Chunk* c = pending_.front();
      pending_.pop_front();
      unsigned n = static_cast<unsigned>(c->bytes - c->done);
      if (c->write) io_uring_prep_write(sqe, c->fd, c->buffer + c->done, n, c->offset + c->done);
      else io_uring_prep_read(sqe, c->fd, c->buffer + c->done, n, c->offset + c->done);
      io_uring_sqe_set_data(sqe, c);
      ++in_ring_;
      placed_.push_back(c);
    }
    submit_placed();
  }

  // Submits what pump() put in the ring. mutex() held.
  void submit_placed() {
    int idle_retries = 0;
    while (!placed_.empty()) {
      int rc = io_uring_submit(&ring_);
      if (rc > 0) {
        size_t consumed = std::min(placed_.size(), static_cast<size_t>(rc));
        placed_.erase(placed_.begin(), placed_.begin() + static_cast<std::ptrdiff_t>(consumed));
        continue;
      }
      if (rc == -EINTR) continue;
      if (rc == 0 || rc == -EAGAIN || rc == -EBUSY) {
        // The kernel is short of resources. With requests in the kernel the reaper
        // submits again after their completions; with none, retry here briefly.
        if (in_ring_ > static_cast<int>(placed_.size())) return;
        if (++idle_retries <= 1000) {
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
          continue;
        }
      }
      fail_unsubmitted(errno_status("io_uring_submit", rc < 0 ? -rc : EAGAIN));
      return;
    }
  }

  void fail_unsubmitted(const Status& s) {
    set_broken(s);
    // The kernel never consumed these, and nothing will submit them again.
    for (Chunk* c : placed_) {
      --in_ring_;
      c->status = s;
      finish_chunk(c);
    }
    placed_.clear();
    for (Chunk* c : pending_) {
      c->status = s;
      finish_chunk(c);
    }
    pending_.clear();
  }

  void reap() {
    bool said = false;
    for (;;) {
      io_uring_cqe* cqe = nullptr;
      int rc;
      if (timeout_works_) {
        __kernel_timespec timeout{};
        timeout.tv_nsec = 200 * 1000 * 1000;
        rc = io_uring_wait_cqe_timeout(&ring_, &cqe, &timeout);
      } else {
        rc = io_uring_wait_cqe(&ring_, &cqe);
      }
      if (rc < 0) {
        std::lock_guard<std::mutex> lock(mutex());
        if (stopping_ && in_ring_ == 0) return;
        if (rc != -ETIME && rc != -EINTR && rc != -EAGAIN && !said) {
          said = true;
          std::cerr << "spillway: warning: " << errno_status("io_uring_wait_cqe", -rc).message()
                    << "; retrying\n";
        }
        continue;
      }
      std::lock_guard<std::mutex> lock(mutex());
      unsigned head;
      unsigned seen = 0;
      bool stop = false;
      io_uring_for_each_cqe(&ring_, head, cqe) {
        ++seen;
        auto* c = static_cast<Chunk*>(io_uring_cqe_get_data(cqe));
        if (c == nullptr) {
          stop = true;
          continue;
        }
        --in_ring_;
        if (record_result(*c, cqe->res)) pending_.push_front(c);  // continue it next
        else finish_chunk(c);
      }
      io_uring_cq_advance(&ring_, seen);
      pump();
      if (stop || (stopping_ && in_ring_ == 0)) return;
    }
  }

  io_uring ring_{};
  bool ring_ready_ = false;
  bool timeout_works_ = false;
  std::thread reaper_;
  // Guarded by mutex():
  std::deque<Chunk*> pending_;  // waiting for room in the ring
  std::vector<Chunk*> placed_;  // in the ring, not yet consumed by the kernel
  int in_ring_ = 0;             // placed or in the kernel, not completed
  bool stopping_ = false;
};

}  // namespace

Result<std::unique_ptr<StorageEngine>> make_uring_storage_engine(const StorageEngineOptions& options) {
  SPILLWAY_RETURN_IF_ERROR(validate_storage_engine_options(options));
  auto engine = std::make_unique<UringStorageEngine>(options);
  SPILLWAY_RETURN_IF_ERROR(engine->start());
  return std::unique_ptr<StorageEngine>(std::move(engine));
}

}  // namespace spillway

#else  // no liburing at configure time

namespace spillway {
Result<std::unique_ptr<StorageEngine>> make_uring_storage_engine(const StorageEngineOptions& options) {
  return Status::unsupported("this build has no io_uring (liburing was not found when it was configured)");
}
}  // namespace spillway

#endif
