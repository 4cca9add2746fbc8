// StallTimer: the CUDA backend's stall probes (Backend::begin_stall_probe). Each probe
// is a pair of timing events recorded on the compute stream before and after a point
// where compute may wait for data; the device time between the two is the time the GPU
// sat idle there (the stream reaches the first event when its earlier work is done, and
// the second when the wait is over and the host has issued again).
//
//   StallTimer t;                       // one per backend, used by one thread at a time
//   uint64_t id = t.begin(stream, &err);
//   ... cudaStreamWaitEvent(stream, copy_done) or the host blocks ...
//   t.end(id, stream, &err);
//   double s = t.take(&err);            // seconds of the probes completed so far
#pragma once

#include <cuda_runtime.h>

#include <deque>
#include <mutex>
#include <vector>

#include "backend/cuda/cuda_common.cuh"

namespace spillway::cuda_detail {

class StallTimer {
 public:
  StallTimer() = default;
  StallTimer(const StallTimer&) = delete;
  StallTimer& operator=(const StallTimer&) = delete;
  ~StallTimer() {
    for (Probe& p : probes_) {
      (void)cudaEventDestroy(p.begin);
      (void)cudaEventDestroy(p.end);
    }
    for (cudaEvent_t e : pool_) (void)cudaEventDestroy(e);
  }

  // Records the probe's first event on `stream`; returns its id (0 when an event could
  // not be made or recorded: *error holds why, and end() ignores id 0).
  uint64_t begin(cudaStream_t stream, Status* error) {
    std::lock_guard<std::mutex> lock(mu_);
    cudaEvent_t b = nullptr, e = nullptr;
    if (!take_event(&b, error) || !take_event(&e, error)) {
      if (b) pool_.push_back(b);
      return 0;
    }
    if (!record(b, stream, "cudaEventRecord (stall probe begin)", error)) {
      pool_.push_back(b);
      pool_.push_back(e);
      return 0;
    }
    probes_.push_back({next_, b, e, false});
    return next_++;
  }

  void end(uint64_t id, cudaStream_t stream, Status* error) {
    if (id == 0) return;
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = probes_.rbegin(); it != probes_.rend(); ++it) {
      if (it->id != id) continue;
      if (!it->ended) it->ended = record(it->end, stream, "cudaEventRecord (stall probe end)", error);
      return;
    }
  }

  // Seconds between the events of every ended probe whose end event has completed,
  // oldest first; stops at the first that has not (the stream completes them in
  // order). A probe whose end could not be recorded counts nothing.
  double take(Status* error) {
    std::lock_guard<std::mutex> lock(mu_);
    double total = 0;
    while (!probes_.empty()) {
      Probe& p = probes_.front();
      if (p.ended) {
        cudaError_t q = cudaEventQuery(p.end);
        if (q == cudaErrorNotReady) {
          (void)cudaGetLastError();  // "not ready" is no error of a later launch
          break;
        }
        float ms = 0;
        if (q == cudaSuccess) q = cudaEventElapsedTime(&ms, p.begin, p.end);
        if (q != cudaSuccess && error->is_ok()) static_cast<void>(*error = cuda_status("stall probe", q));
        if (q == cudaSuccess && ms > 0) total += static_cast<double>(ms) * 1e-3;
      }
      pool_.push_back(p.begin);
      pool_.push_back(p.end);
      probes_.pop_front();
    }
    return total;
  }

 private:
  struct Probe {
    uint64_t id;
    cudaEvent_t begin, end;
    bool ended;
  };

  bool take_event(cudaEvent_t* e, Status* error) {
    if (!pool_.empty()) {
      *e = pool_.back();
      pool_.pop_back();
      return true;
    }
    cudaError_t r = cudaEventCreate(e);  // with timing: these events are for elapsed times
    if (r == cudaSuccess) return true;
    *e = nullptr;
    if (error->is_ok()) static_cast<void>(*error = cuda_status("cudaEventCreate (stall probe)", r));
    return false;
  }

  static bool record(cudaEvent_t e, cudaStream_t stream, const char* what, Status* error) {
    cudaError_t r = cudaEventRecord(e, stream);
    if (r == cudaSuccess) return true;
    if (error->is_ok()) static_cast<void>(*error = cuda_status(what, r));
    return false;
  }

  std::mutex mu_;
  std::deque<Probe> probes_;  // begun, oldest first
  std::vector<cudaEvent_t> pool_;
  uint64_t next_ = 1;
};

}  // namespace spillway::cuda_detail
