#include "core/thread_pool.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <string>
#include <system_error>

namespace spillway {

namespace {
int hardware_threads() { return static_cast<int>(std::max(1u, std::thread::hardware_concurrency())); }
}  // namespace

int max_thread_count() { return 4 * hardware_threads(); }

Status check_thread_count(int threads, std::string_view what) {
  if (threads < 0)
    return Status::invalid_argument(std::string(what) + " must be 0 (all hardware threads) or more, got " +
                                    std::to_string(threads));
  if (threads > max_thread_count())
    return Status::invalid_argument(std::string(what) + " " + std::to_string(threads) + " is more than " +
                                    std::to_string(max_thread_count()) + " (4 × the " +
                                    std::to_string(hardware_threads()) +
                                    " hardware threads of this machine); give at most that, or 0 for all hardware threads");
  return Status::ok();
}

ThreadPool::ThreadPool(int threads, ThreadStarter start) {
  if (threads <= 0) threads = hardware_threads();
  status_ = check_thread_count(threads, "thread pool: thread count");
  if (!status_.is_ok()) return;
  workers_.reserve(static_cast<size_t>(threads - 1));
  for (int i = 1; i < threads; ++i) {
    std::function<void()> body = [this, i] { worker_loop(i); };
    try {
      workers_.push_back(start ? start(std::move(body)) : std::thread(std::move(body)));
    } catch (const std::system_error& e) {
      status_ = Status::out_of_memory("thread pool: starting thread " + std::to_string(i + 1) + " of " +
                                      std::to_string(threads) + " failed (" + e.what() +
                                      "); the system refuses more threads (see ulimit -u and "
                                      "/proc/sys/kernel/threads-max); ask for fewer threads");
      stop_workers();
      return;
    }
  }
}

ThreadPool::~ThreadPool() { stop_workers(); }

void ThreadPool::stop_workers() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& w : workers_)
    if (w.joinable()) w.join();
  workers_.clear();
}

Result<std::unique_ptr<ThreadPool>> ThreadPool::create(int threads, ThreadStarter start) {
  auto pool = std::make_unique<ThreadPool>(threads, std::move(start));
  if (!pool->status().is_ok()) return pool->status();
  return pool;
}

void ThreadPool::parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& fn, int64_t grain) {
  if (n <= 0) return;
  int64_t parts = std::min<int64_t>(size(), std::max<int64_t>(1, n / std::max<int64_t>(1, grain)));
  if (parts <= 1 || workers_.empty()) {
    fn(0, n);
    return;
  }
  // One loop at a time: callers on other threads (the executor's host queue runs
  // AdamW while the main thread converts weights) take turns.
  std::lock_guard<std::mutex> call(call_mu_);
  std::vector<std::pair<int64_t, int64_t>> chunks;
  for (int64_t p = 0; p < parts; ++p) chunks.emplace_back(n * p / parts, n * (p + 1) / parts);
  {
    std::unique_lock<std::mutex> lock(mu_);
    job_ = &fn;
    chunks_ = chunks;
    pending_ = static_cast<int>(parts) - 1;
    ++generation_;
  }
  cv_.notify_all();
  fn(chunks[0].first, chunks[0].second);
  std::unique_lock<std::mutex> lock(mu_);
  done_cv_.wait(lock, [this] { return pending_ == 0; });
  job_ = nullptr;
}

void ThreadPool::parallel_tiles(int64_t n, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  std::atomic<int64_t> next{0};
  // One part per thread; each takes tiles until none is left.
  parallel_for(std::min<int64_t>(n, size()), [&](int64_t, int64_t) {
    for (int64_t t = next.fetch_add(1, std::memory_order_relaxed); t < n;
         t = next.fetch_add(1, std::memory_order_relaxed))
      fn(t, t + 1);
  });
}

namespace {
constexpr size_t kCopyTile = size_t{4} << 20;
// fn(offset, length) over [0, bytes) in kCopyTile tiles on the pool, or once on the
// calling thread below 4 tiles or with a pool of one thread.
void for_byte_tiles(ThreadPool& pool, size_t bytes, const std::function<void(size_t, size_t)>& fn) {
  if (bytes < 4 * kCopyTile || pool.size() == 1) {
    if (bytes > 0) fn(0, bytes);
    return;
  }
  pool.parallel_tiles(static_cast<int64_t>((bytes + kCopyTile - 1) / kCopyTile), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const size_t at = static_cast<size_t>(t) * kCopyTile;
      fn(at, std::min(kCopyTile, bytes - at));
    }
  });
}
}  // namespace

void parallel_memcpy(ThreadPool& pool, void* dst, const void* src, size_t bytes) {
  auto* d = static_cast<unsigned char*>(dst);
  const auto* s = static_cast<const unsigned char*>(src);
  for_byte_tiles(pool, bytes, [&](size_t at, size_t n) { std::memcpy(d + at, s + at, n); });
}

void parallel_zero(ThreadPool& pool, void* dst, size_t bytes) {
  auto* d = static_cast<unsigned char*>(dst);
  for_byte_tiles(pool, bytes, [&](size_t at, size_t n) { std::memset(d + at, 0, n); });
}

int host_compute_threads(int requested, bool beside_gpu_issue) {
  if (requested != 0) return requested;
  return beside_gpu_issue ? std::max(1, hardware_threads() - 1) : hardware_threads();
}

void ThreadPool::worker_loop(int index) {
  uint64_t seen = 0;
  for (;;) {
    const std::function<void(int64_t, int64_t)>* job;
    std::pair<int64_t, int64_t> chunk{0, 0};
    bool have = false;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      job = job_;
      if (index < static_cast<int>(chunks_.size())) {
        chunk = chunks_[index];
        have = true;
      }
    }
    if (have) {
      (*job)(chunk.first, chunk.second);
      std::lock_guard<std::mutex> lock(mu_);
      if (--pending_ == 0) done_cv_.notify_all();
    }
  }
}

namespace {
int g_threads = 0;
std::unique_ptr<ThreadPool> g_pool;
std::mutex g_pool_mu;
}  // namespace

void set_global_thread_count(int threads) {
  std::lock_guard<std::mutex> lock(g_pool_mu);
  if (g_pool && g_pool->size() == (threads <= 0 ? g_pool->size() : threads)) return;
  g_threads = threads;
  g_pool.reset();
}

Status start_global_thread_pool(int threads) {
  SPILLWAY_RETURN_IF_ERROR(check_thread_count(threads, "thread count"));
  std::lock_guard<std::mutex> lock(g_pool_mu);
  const int wanted = threads > 0 ? threads : hardware_threads();
  if (g_pool && g_pool->status().is_ok() && g_pool->size() == wanted) return Status::ok();
  g_threads = threads;
  g_pool.reset();
  g_pool = std::make_unique<ThreadPool>(threads);
  return g_pool->status();
}

ThreadPool& global_thread_pool() {
  std::lock_guard<std::mutex> lock(g_pool_mu);
  if (!g_pool) g_pool = std::make_unique<ThreadPool>(g_threads);
  return *g_pool;
}

}  // namespace spillway
