// ThreadPool: a fixed set of workers running deterministic parallel loops.
//
//   auto pool = ThreadPool::create(4);        // error: too many threads, or a thread would not start
//   if (!pool) return pool.status();
//   (*pool)->parallel_for(n_rows, [&](int64_t begin, int64_t end) { ... rows [begin, end) ... });
//
// parallel_for splits [0, n) into the same contiguous chunks for a given n and
// thread count, and each chunk is done by one thread, so any reduction written
// inside a chunk has a fixed order. Results that must not depend on the thread
// count should reduce over fixed-size blocks (see for_blocks).
//
// The constructor never throws: a count above max_thread_count(), or a thread that
// fails to start (std::system_error, e.g. EAGAIN at the process's thread limit),
// leaves a pool of the calling thread alone whose status() says why. Callers that
// construct a pool directly check status().
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string_view>
#include <thread>
#include <vector>

#include "core/status.h"

namespace spillway {

// The most threads a pool may have: 4 × the hardware threads (at least 4).
int max_thread_count();
// An error naming `what` ("--threads") when threads is negative or above
// max_thread_count(); 0 means all hardware threads.
Status check_thread_count(int threads, std::string_view what);

// Starts one worker thread; tests pass one that fails to exercise the error path.
using ThreadStarter = std::function<std::thread(std::function<void()>)>;

class ThreadPool {
 public:
  // threads <= 0: hardware concurrency. `start` defaults to std::thread's constructor.
  explicit ThreadPool(int threads, ThreadStarter start = {});
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  // A pool whose every worker started, or the error.
  static Result<std::unique_ptr<ThreadPool>> create(int threads, ThreadStarter start = {});

  // Ok, or why the pool runs on the calling thread alone.
  const Status& status() const { return status_; }
  int size() const { return static_cast<int>(workers_.size()) + 1; }
  // Runs fn(begin, end) over `size()` contiguous chunks of [0, n); the calling
  // thread takes one chunk. Chunks shorter than `grain` are merged. Calls from
  // several threads run one after another (fn must not call parallel_for itself).
  void parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& fn, int64_t grain = 1);
  // Runs fn(t, t + 1) for every tile t of [0, n), handing the tiles out one by one
  // to the threads as they come free: a thread that the scheduler takes off its
  // core (for the thread issuing GPU work, say) holds up one tile, not a
  // size()-th of the loop. Which thread does which tile varies from call to call,
  // so use it only where fn's result does not depend on that (elementwise updates,
  // fills); reductions belong in parallel_for.
  void parallel_tiles(int64_t n, const std::function<void(int64_t, int64_t)>& fn);

 private:
  void worker_loop(int index);
  void stop_workers();
  std::vector<std::thread> workers_;
  Status status_;
  std::mutex mu_;
  std::mutex call_mu_;  // held by the thread whose parallel_for is running
  std::condition_variable cv_, done_cv_;
  const std::function<void(int64_t, int64_t)>* job_ = nullptr;
  std::vector<std::pair<int64_t, int64_t>> chunks_;
  uint64_t generation_ = 0;
  int pending_ = 0;
  bool stop_ = false;
};

// memcpy(dst, src, bytes) in tiles of 4 MiB handed to the pool's threads
// (parallel_tiles), where bytes is 16 MiB or more: one core copies at a fraction of the
// memory's bandwidth (writing gpt-2.7b's 32 GiB of host-resident master weights and
// moments took seconds before the first step). Smaller copies, and pools of one
// thread, copy on the calling thread. The regions must not overlap.
void parallel_memcpy(ThreadPool& pool, void* dst, const void* src, size_t bytes);
// memset(dst, 0, bytes) the same way: tiles of 4 MiB on the pool's threads from 16 MiB
// up (an executor zeroes tens of GiB of host arena before the first step).
void parallel_zero(ThreadPool& pool, void* dst, size_t bytes);

// A pool shared by the process's compute (set its size once, before first use).
// start_global_thread_pool (re)starts it at once with `threads` workers (0: all
// hardware threads) and returns why it could not; otherwise global_thread_pool()
// starts it on first use (a pool whose threads fail to start then runs on the
// calling thread alone).
ThreadPool& global_thread_pool();
void set_global_thread_count(int threads);
Status start_global_thread_pool(int threads);

// The threads for host compute when `requested` (a --threads value) is 0: every
// hardware thread, less one when `beside_gpu_issue`: on a GPU backend the
// executor's thread issues kernels and copies while the host AdamW runs (during the
// backward, with speculative updates), and a pool as large as the machine would
// leave it waiting for a core while the GPU drains its queue. A requested count
// other than 0 is returned as given.
int host_compute_threads(int requested, bool beside_gpu_issue);

}  // namespace spillway
