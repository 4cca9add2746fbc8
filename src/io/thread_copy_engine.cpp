#include "io/thread_copy_engine.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <mutex>
#include <string>
#include <thread>

#include "core/size.h"

namespace spillway {
namespace {

// A copy is done in pieces of this size so that bytes_copied() advances while a
// large copy runs.
constexpr size_t kChunkBytes = size_t{16} << 20;

const char* direction_name(CopyDirection d) {
  return d == CopyDirection::HostToDevice ? "host to device" : "device to host";
}

struct Job {
  uint64_t sequence = 0;
  void* dst = nullptr;
  const void* src = nullptr;
  size_t bytes = 0;
};

// One direction: a FIFO of jobs and the worker that drains it.
struct Lane {
  std::mutex mu;
  std::condition_variable work_cv;  // a job was queued, or stop was set
  std::condition_variable done_cv;  // `completed` advanced
  std::deque<Job> queue;            // jobs not yet started, in submission order
  uint64_t submitted = 0;           // sequence of the newest queued job
  uint64_t completed = 0;           // every job with sequence <= completed is done
  bool stop = false;
  std::atomic<uint64_t> bytes{0};   // bytes moved so far in this direction
  std::thread worker;
};

class ThreadCopyEngine final : public CopyEngine {
 public:
  ThreadCopyEngine() {
    for (auto& lane : lanes_) {
      Lane* l = &lane;
      l->worker = std::thread([l] { run_lane(*l); });
    }
  }

  ~ThreadCopyEngine() override {
    for (auto& lane : lanes_) {
      {
        std::lock_guard<std::mutex> lock(lane.mu);
        lane.stop = true;
      }
      lane.work_cv.notify_all();
    }
    for (auto& lane : lanes_) lane.worker.join();
  }

  // Compute runs on the caller's thread here, so every copy is after it anyway.
  Result<CopyTicket> copy(CopyDirection direction, void* dst, const void* src, size_t bytes,
                          bool /*after_compute*/) override {
    if (static_cast<size_t>(direction) >= lanes_.size()) {
      return Status::invalid_argument("copy engine: unknown copy direction " +
                                      std::to_string(static_cast<int>(direction)));
    }
    if (bytes > 0 && (dst == nullptr || src == nullptr)) {
      return Status::invalid_argument(std::string("copy engine: ") + direction_name(direction) +
                                      " copy of " + format_size(bytes) + " with a null " +
                                      (dst == nullptr ? "destination" : "source"));
    }
    auto d = reinterpret_cast<uintptr_t>(dst);
    auto s = reinterpret_cast<uintptr_t>(src);
    if (bytes > 0 && d < s + bytes && s < d + bytes) {
      return Status::invalid_argument(std::string("copy engine: ") + direction_name(direction) +
                                      " copy of " + format_size(bytes) +
                                      ": source and destination overlap");
    }
    Lane& lane = lanes_[static_cast<size_t>(direction)];
    CopyTicket ticket;
    ticket.direction = direction;
    {
      std::lock_guard<std::mutex> lock(lane.mu);
      ticket.sequence = ++lane.submitted;
      lane.queue.push_back(Job{ticket.sequence, dst, src, bytes});
    }
    lane.work_cv.notify_one();
    return ticket;
  }

  bool is_done(CopyTicket t) override {
    if (t.sequence == 0 || static_cast<size_t>(t.direction) >= lanes_.size()) return true;
    Lane& lane = lanes_[static_cast<size_t>(t.direction)];
    std::lock_guard<std::mutex> lock(lane.mu);
    return lane.completed >= t.sequence;
  }

  Status wait(CopyTicket t) override {
    if (t.sequence == 0) return Status::ok();
    if (static_cast<size_t>(t.direction) >= lanes_.size()) {
      return Status::invalid_argument("copy engine: wait on a ticket of unknown direction " +
                                      std::to_string(static_cast<int>(t.direction)));
    }
    Lane& lane = lanes_[static_cast<size_t>(t.direction)];
    std::unique_lock<std::mutex> lock(lane.mu);
    if (t.sequence > lane.submitted) {
      return Status::invalid_argument(std::string("copy engine: wait on ") + direction_name(t.direction) +
                                      " ticket " + std::to_string(t.sequence) + ", but only " +
                                      std::to_string(lane.submitted) + " copies were submitted");
    }
    lane.done_cv.wait(lock, [&] { return lane.completed >= t.sequence; });
    return Status::ok();
  }

  Status order_compute_after(CopyTicket t) override { return wait(t); }

  Status wait_all() override {
    for (auto& lane : lanes_) {
      std::unique_lock<std::mutex> lock(lane.mu);
      uint64_t last = lane.submitted;
      lane.done_cv.wait(lock, [&] { return lane.completed >= last; });
    }
    return Status::ok();
  }

  uint64_t bytes_copied(CopyDirection d) const override {
    if (static_cast<size_t>(d) >= lanes_.size()) return 0;
    return lanes_[static_cast<size_t>(d)].bytes.load(std::memory_order_relaxed);
  }

 private:
  // Drains the lane's queue in order; on stop, finishes what is queued, then exits.
  static void run_lane(Lane& lane) {
    std::unique_lock<std::mutex> lock(lane.mu);
    for (;;) {
      lane.work_cv.wait(lock, [&] { return lane.stop || !lane.queue.empty(); });
      if (lane.queue.empty()) return;  // stop was set and nothing is left
      Job job = lane.queue.front();
      lane.queue.pop_front();
      lock.unlock();
      auto* dst = static_cast<unsigned char*>(job.dst);
      auto* src = static_cast<const unsigned char*>(job.src);
      for (size_t done = 0; done < job.bytes;) {
        size_t n = std::min(kChunkBytes, job.bytes - done);
        std::memcpy(dst + done, src + done, n);
        done += n;
        lane.bytes.fetch_add(n, std::memory_order_relaxed);
      }
      lock.lock();
      lane.completed = job.sequence;
      lane.done_cv.notify_all();
    }
  }

  std::array<Lane, 2> lanes_;  // indexed by CopyDirection
};

}  // namespace

std::unique_ptr<CopyEngine> make_thread_copy_engine() { return std::make_unique<ThreadCopyEngine>(); }

}  // namespace spillway
