#include "core/thread_pool.h"

#include <algorithm>
#include <memory>

namespace spillway {

ThreadPool::ThreadPool(int threads) {
  if (threads <= 0) threads = std::max(1u, std::thread::hardware_concurrency());
  for (int i = 1; i < threads; ++i) workers_.emplace_back([this, i] { worker_loop(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& w : workers_) w.join();
}

void ThreadPool::parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& fn, int64_t grain) {
  if (n <= 0) return;
  int64_t parts = std::min<int64_t>(size(), std::max<int64_t>(1, n / std::max<int64_t>(1, grain)));
  if (parts <= 1 || workers_.empty()) {
    fn(0, n);
    return;
  }
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

ThreadPool& global_thread_pool() {
  std::lock_guard<std::mutex> lock(g_pool_mu);
  if (!g_pool) g_pool = std::make_unique<ThreadPool>(g_threads);
  return *g_pool;
}

}  // namespace spillway
