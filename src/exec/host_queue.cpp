#include "exec/host_queue.h"

namespace spillway {

#include <system_error>

Status HostQueue::start() {
  if (worker_.joinable()) return Status::ok();
  try {
    worker_ = std::thread([this] { run(); });
  } catch (const std::system_error& e) {
    return Status::out_of_memory(std::string("cannot start the host compute thread: ") + e.what() +
                                      " (the process's thread limit, ulimit -u, or /proc/sys/kernel/threads-max)");
  }
  return Status::ok();
}

HostQueue::~HostQueue() {
  if (!worker_.joinable()) return;
  {
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, [&] { return completed_ >= submitted_; });
    stop_ = true;
  }
  work_cv_.notify_all();
  worker_.join();
}

uint64_t HostQueue::submit(std::function<Status()> job) {
  uint64_t ticket;
  if (!worker_.joinable()) {  // not started: run here, in order
    Status s = job();
    std::lock_guard<std::mutex> lock(mu_);
    ticket = ++submitted_;
    ++completed_;
    if (!s.is_ok() && failed_at_ == 0) {
      failed_at_ = ticket;
      failure_ = s;
    }
    return ticket;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(job));
    ticket = ++submitted_;
  }
  work_cv_.notify_one();
  return ticket;
}

bool HostQueue::is_done(uint64_t ticket) {
  std::lock_guard<std::mutex> lock(mu_);
  return completed_ >= ticket;
}

Status HostQueue::wait(uint64_t ticket) {
  std::unique_lock<std::mutex> lock(mu_);
  done_cv_.wait(lock, [&] { return completed_ >= ticket; });
  if (failed_at_ != 0 && failed_at_ <= ticket) return failure_;
  return Status::ok();
}

Status HostQueue::failure() {
  std::lock_guard<std::mutex> lock(mu_);
  return failed_at_ != 0 ? failure_ : Status::ok();
}

Status HostQueue::wait_all() { return wait(last_ticket()); }

uint64_t HostQueue::completed() {
  std::lock_guard<std::mutex> lock(mu_);
  return completed_;
}

uint64_t HostQueue::last_ticket() {
  std::lock_guard<std::mutex> lock(mu_);
  return submitted_;
}

void HostQueue::run() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    work_cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stop_ and nothing left
    std::function<Status()> job = std::move(queue_.front());
    queue_.pop_front();
    const bool skip = failed_at_ != 0;
    lock.unlock();
    Status s = skip ? Status::ok() : job();
    job = nullptr;  // release what the job captured outside the lock
    lock.lock();
    ++completed_;
    if (!s.is_ok() && failed_at_ == 0) {
      failed_at_ = completed_;
      failure_ = s;
    }
    done_cv_.notify_all();
  }
}

}  // namespace spillway
