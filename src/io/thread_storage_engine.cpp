// The thread-pool storage engine: queue_depth worker threads, each taking one
// chunk at a time from a shared FIFO and moving it with pread/pwrite. It runs
// wherever POSIX does; the io_uring engine is faster where the kernel allows it.
#include <unistd.h>

#include <cerrno>
#include <condition_variable>
#include <deque>
#include <system_error>
#include <thread>

#include "io/storage_engine.h"

namespace spillway {
namespace {

class ThreadStorageEngine final : public ChunkedStorageEngine {
 public:
  explicit ThreadStorageEngine(const StorageEngineOptions& options) : ChunkedStorageEngine(options) {}

  ~ThreadStorageEngine() override {
    wait_for_idle();
    {
      std::lock_guard<std::mutex> lock(mutex());
      stopping_ = true;
    }
    work_cv_.notify_all();
    for (auto& t : workers_) t.join();
  }

  // Starts the workers; a failure to start one is reported, never thrown.
  Status start() {
    try {
      for (int i = 0; i < options().queue_depth; ++i) workers_.emplace_back([this] { work(); });
    } catch (const std::system_error& e) {
      size_t started = workers_.size();
      {
        std::lock_guard<std::mutex> lock(mutex());
        stopping_ = true;
      }
      work_cv_.notify_all();
      for (auto& t : workers_) t.join();
      workers_.clear();
      return Status::internal("thread storage engine: cannot start worker thread " +
                              std::to_string(started) + ": " + e.what());
    }
    return Status::ok();
  }

  std::string name() const override { return "threads"; }

 protected:
  void start_chunks(const std::vector<Chunk*>& chunks) override {
    queue_.insert(queue_.end(), chunks.begin(), chunks.end());
    if (chunks.size() == 1) work_cv_.notify_one();
    else work_cv_.notify_all();
  }

 private:
  static int64_t move_once(const Chunk& c) {
    ssize_t n = c.write ? ::pwrite(c.fd, c.buffer + c.done, c.bytes - c.done, static_cast<off_t>(c.offset + c.done))
                        : ::pread(c.fd, c.buffer + c.done, c.bytes - c.done, static_cast<off_t>(c.offset + c.done));
    return n < 0 ? -static_cast<int64_t>(errno) : static_cast<int64_t>(n);
  }

  void work() {
    std::unique_lock<std::mutex> lock(mutex());
    for (;;) {
      work_cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and nothing left
      Chunk* c = queue_.front();
      queue_.pop_front();
      lock.unlock();
      while (record_result(*c, move_once(*c))) {
      }
      lock.lock();
      finish_chunk(c);
    }
  }

  std::condition_variable work_cv_;
  std::deque<Chunk*> queue_;  // guarded by mutex()
  bool stopping_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace

Result<std::unique_ptr<StorageEngine>> make_thread_storage_engine(const StorageEngineOptions& options) {
  SPILLWAY_RETURN_IF_ERROR(validate_storage_engine_options(options));
  auto engine = std::make_unique<ThreadStorageEngine>(options);
  SPILLWAY_RETURN_IF_ERROR(engine->start());
  return std::unique_ptr<StorageEngine>(std::move(engine));
}

}  // namespace spillway
