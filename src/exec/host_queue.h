// HostQueue: host compute (the host AdamW) as an engine with tickets, as copies and
// storage I/O are. One worker thread runs the jobs in submission order, so a job
// sees everything earlier jobs wrote; the executor submits and moves on.
//
//   HostQueue q;
//   SPILLWAY_RETURN_IF_ERROR(q.start());                  // its worker thread, or why not
//   uint64_t t = q.submit([&] { return run_adamw(...); }); // returns at once
//   ... issue device work ...
//   if (!q.is_done(t)) stall();
//   SPILLWAY_RETURN_IF_ERROR(q.wait(t));                  // t and every earlier job finished
//
// Errors are sticky: once a job fails, later jobs are skipped (they would compute on
// a state the failed job left half updated), and every wait on a ticket at or after
// the failed one returns its error.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

#include "core/status.h"

namespace spillway {

class HostQueue {
 public:
  HostQueue() = default;
  ~HostQueue();  // waits for the jobs submitted
  // Starts the worker thread; an error (the process's thread limit) says so.
  Status start();
  HostQueue(const HostQueue&) = delete;
  HostQueue& operator=(const HostQueue&) = delete;

  // Queues `job`; returns its ticket (1, 2, 3, ...).
  uint64_t submit(std::function<Status()> job);
  // Has job `ticket` (and so every earlier one) finished? Ticket 0 is always done.
  bool is_done(uint64_t ticket);
  // Blocks until job `ticket` finished; its error, or that of an earlier failed job.
  Status wait(uint64_t ticket);
  // Non-blocking: the error of a job that failed so far, or ok.
  Status failure();
  Status wait_all();
  uint64_t last_ticket();
  // Tickets at or below this have finished (one lock, for callers checking many).
  uint64_t completed();

 private:
  void run();
  std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  std::deque<std::function<Status()>> queue_;
  uint64_t submitted_ = 0, completed_ = 0;
  uint64_t failed_at_ = 0;  // ticket of the first failed job (0: none)
  Status failure_;
  bool stop_ = false;
  std::thread worker_;
};

}  // namespace spillway
