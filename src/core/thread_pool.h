// ThreadPool: a fixed set of workers running deterministic parallel loops.
//
//   ThreadPool pool(4);
//   pool.parallel_for(n_rows, [&](int64_t begin, int64_t end) { ... rows [begin, end) ... });
//
// parallel_for splits [0, n) into the same contiguous chunks for a given n and
// thread count, and each chunk is done by one thread, so any reduction written
// inside a chunk has a fixed order. Results that must not depend on the thread
// count should reduce over fixed-size blocks (see for_blocks).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace spillway {

class ThreadPool {
 public:
  explicit ThreadPool(int threads);  // threads <= 0: hardware concurrency
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return static_cast<int>(workers_.size()) + 1; }
  // Runs fn(begin, end) over `size()` contiguous chunks of [0, n); the calling
  // thread takes one chunk. Chunks shorter than `grain` are merged.
  void parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& fn, int64_t grain = 1);

 private:
  void worker_loop(int index);
  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  const std::function<void(int64_t, int64_t)>* job_ = nullptr;
  std::vector<std::pair<int64_t, int64_t>> chunks_;
  uint64_t generation_ = 0;
  int pending_ = 0;
  bool stop_ = false;
};

// A pool shared by the process's compute (set its size once, before first use).
ThreadPool& global_thread_pool();
void set_global_thread_count(int threads);

}  // namespace spillway
