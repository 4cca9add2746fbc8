// CudaBackend: the Backend of backend.h on one NVIDIA GPU (see cuda_backend.h).
//
// Streams: one compute stream runs every op in submission order; the copy engine
// owns one stream per direction; collectives run on their communicator's stream,
// ordered with the compute stream by events (ComputeQueue: order_stream_after,
// add_pending, wait_for), never by a host wait. Errors: every CUDA and cuBLASLt call is checked;
// an op (which returns void) records the first error, and synchronize() reports it.
#include "backend/cuda/cuda_backend.h"

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <deque>
#include <functional>
#include <iterator>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "backend/cuda/attention.cuh"
#include "backend/cuda/cuda_common.cuh"
#include "backend/cuda/cuda_kernels.cuh"
#include "backend/cuda/matmul.cuh"
#include "backend/cuda/stall_timer.cuh"
#include "core/size.h"
#include "core/thread_pool.h"

namespace spillway {
namespace {

using namespace cuda_detail;
// The workspace's pieces and sizes: one definition, shared with planning tools that
// have no GPU (cuda_backend_sizes, backend_sizes.h).
using namespace cuda_workspace;
const BackendSizes& sizes() { return cuda_backend_sizes(); }

// Uses a dynamically indexed local array, so its launch makes the driver reserve the
// device's local memory; with n = 0 it reads and writes nothing.
__global__ void reserve_local_memory_kernel(float* out, int n) {
  float a[64];
  for (int i = 0; i < 64; ++i) a[i] = static_cast<float>(i) * static_cast<float>(n);
  if (n > 0) out[threadIdx.x % n] = a[(threadIdx.x * 7 + n) % 64];
}

const char* direction_name(CopyDirection d) {
  return d == CopyDirection::HostToDevice ? "host-to-device" : "device-to-host";
}

// ---------------------------------------------------------------- compute queue

// Byte ranges [begin, end) of device memory, merged where they overlap or touch.
class RangeSet {
 public:
  bool overlaps(const void* p, size_t bytes) const {
    const uintptr_t b = reinterpret_cast<uintptr_t>(p), e = b + bytes;
    if (bytes == 0) return false;
    auto it = ranges_.lower_bound(e);  // the first range beginning at or past e
    if (it == ranges_.begin()) return false;
    --it;  // the last range beginning before e; earlier ones end before it begins
    return it->second > b;
  }
  void add(const void* p, size_t bytes) {
    if (bytes == 0) return;
    uintptr_t b = reinterpret_cast<uintptr_t>(p), e = b + bytes;
    auto it = ranges_.upper_bound(b);
    if (it != ranges_.begin() && std::prev(it)->second >= b) {
      --it;
      b = it->first;
      e = std::max(e, it->second);
      it = ranges_.erase(it);
    }
    while (it != ranges_.end() && it->first <= e) {
      e = std::max(e, it->second);
      it = ranges_.erase(it);
    }
    ranges_.emplace(b, e);
  }
  void clear() { ranges_.clear(); }
  void add_all(const RangeSet& other) {
    for (const auto& [b, e] : other.ranges_) add(reinterpret_cast<const void*>(b), e - b);
  }

 private:
  std::map<uintptr_t, uintptr_t> ranges_;  // begin -> end, disjoint, not touching
};

// The compute stream, and the optimizer calls held back so that a run of consecutive
// squared_norm calls, or of consecutive adamw calls, goes out as a few multi-tensor
// launches (launch_squared_norms, launch_adamws: the same bits as one launch per
// tensor) instead of one to three per tensor.
//
// The stream is private to this class and stream() is the only way to it: it first
// launches whatever is held back, so every other use of the compute stream (the
// backend's other ops, its copies, fills and synchronization, the copy engine's fences
// and waits on it) reaches the stream after the calls submitted before it, and no
// path can forget to. A held-back batch is also launched (flush) before a call of the
// other kind, before a call that reads memory a held-back call writes or writes memory
// one reads or writes (so the calls of one batch never depend on each other's order),
// before the workspace changes and before device or pinned memory is freed.
// Thread-safe: the copy engine may fence from other threads.
class ComputeQueue {
 public:
  // A batch is launched once it moves this much memory (read plus written: about a
  // millisecond of an H200's bandwidth), so that a large model's optimizer starts on
  // the GPU while the host is still issuing it: gpt2-124m's AdamW (3.5 GB) is one
  // batch, gpt2-1.5b's (44 GB) eleven. (A host that blocks flushes first anyway: the
  // executor's stall probes and CopyEngine::wait use the stream.)
  static constexpr uint64_t kFlushTrafficBytes = uint64_t{4} << 30;
  // On the optimizer stream, smaller batches (about 0.2 ms of an H100's bandwidth
  // each), so that the next step's forward waits only for the batch that updates
  // the parameters it reads first, not for every update.
  static constexpr uint64_t kOptimizerStreamFlushTrafficBytes = uint64_t{512} << 20;
  // What launches the optimizer calls took (kernels on the stream).
  struct Launches {
    uint64_t squared_norm = 0;
    uint64_t adamw = 0;
  };

  ComputeQueue() = default;
  ~ComputeQueue() { destroy(); }
  ComputeQueue(const ComputeQueue&) = delete;
  ComputeQueue& operator=(const ComputeQueue&) = delete;

  // on_error receives the error of each failed launch; it runs with this queue's lock
  // held, so it must not use the queue.
  // optimizer_stream: the held-back AdamW batches run on a stream of their own (see
  // adamw); needs multi_tensor.
  Status init(int device, bool multi_tensor, bool optimizer_stream, std::function<void(Status)> on_error) {
    device_ = device;
    multi_tensor_ = multi_tensor;
    on_error_ = std::move(on_error);
    int least = 0, greatest = 0;
    SPILLWAY_RETURN_IF_ERROR(
        cuda_status("cudaDeviceGetStreamPriorityRange", cudaDeviceGetStreamPriorityRange(&least, &greatest)));
    const bool own = optimizer_stream && multi_tensor;
    // With the optimizer on its own stream, the compute stream's blocks go to the SMs
    // first and the updates fill what is left.
    SPILLWAY_RETURN_IF_ERROR(cuda_status("cudaStreamCreate (compute)",
                                         cudaStreamCreateWithPriority(&stream_, cudaStreamNonBlocking,
                                                                      own ? greatest : 0)));
    if (own)
      SPILLWAY_RETURN_IF_ERROR(cuda_status(
          "cudaStreamCreate (optimizer)", cudaStreamCreateWithPriority(&optimizer_stream_, cudaStreamNonBlocking, least)));
    return cuda_status("cudaEventCreate (compute fence for other streams)",
                       cudaEventCreateWithFlags(&other_fence_, cudaEventDisableTiming));
  }
  // Launches what is held back, waits for the stream (and the other streams' work it
  // was to wait for) and destroys it (destruction).
  void destroy() {
    std::lock_guard<std::mutex> lock(mu_);
    if (stream_ == nullptr) return;
    flush_locked();
    (void)join_pending_locked();
    (void)cudaStreamSynchronize(stream_);
    (void)cudaStreamDestroy(stream_);
    stream_ = nullptr;
    if (optimizer_stream_ != nullptr) {
      (void)cudaStreamSynchronize(optimizer_stream_);
      (void)cudaStreamDestroy(optimizer_stream_);
      optimizer_stream_ = nullptr;
    }
    for (cudaEvent_t e : event_pool_) (void)cudaEventDestroy(e);
    event_pool_.clear();
    if (other_fence_ != nullptr) (void)cudaEventDestroy(other_fence_);
    other_fence_ = nullptr;
  }

  // ---- work on other streams (collectives: Backend::order_*), ordered by events ----
  // Work enqueued on `other` from now on runs after everything submitted so far
  // (held-back calls launched first): an event on the compute stream that `other`
  // waits for. No host wait.
  Status order_stream_after(cudaStream_t other) {
    std::lock_guard<std::mutex> lock(mu_);
    flush_locked();
    // The optimizer stream's batches count as compute submitted so far (a broadcast of a
    // parameter reads what its update wrote).
    SPILLWAY_RETURN_IF_ERROR(join_pending_locked(Join::Optimizer));
    SPILLWAY_RETURN_IF_ERROR(cuda_status("cudaSetDevice", cudaSetDevice(device_)));
    SPILLWAY_RETURN_IF_ERROR(
        cuda_status("cudaEventRecord (compute, before a collective)", cudaEventRecord(other_fence_, stream_)));
    return cuda_status("cudaStreamWaitEvent (collective after compute)", cudaStreamWaitEvent(other, other_fence_, 0));
  }
  // The work enqueued on `other` so far touches `ranges`: an event recorded on
  // `other` now, pending until compute waits for it (wait_for, join_pending).
  Status add_pending(cudaStream_t other, const std::vector<Backend::DeviceRange>& ranges) {
    std::lock_guard<std::mutex> lock(mu_);
    // Every range counts as written (DeviceRange::write left aside): a collective's
    // buffers may be scratch it writes whatever the op's access says.
    RangeSet touched;
    for (const Backend::DeviceRange& r : ranges) touched.add(r.p, r.bytes);
    RangeSet written = touched;
    return add_pending_locked(other, std::move(touched), std::move(written), /*optimizer=*/false);
  }
  // Compute submitted from now on waits for the latest pending work that conflicts
  // with `ranges` (and so for all earlier work of its stream, which runs in order): work
  // that writes a range, or reads one that `ranges` writes (DeviceRange::write).
  // Held-back calls that conflict with them are launched first.
  Status wait_for(const std::vector<Backend::DeviceRange>& ranges) {
    std::lock_guard<std::mutex> lock(mu_);
    return wait_for_locked(ranges);
  }
  // Which pending work join_pending waits for.
  enum class Join { All, Collectives, Optimizer };
  // Compute submitted from now on waits for the pending work on other streams (all of
  // it before anything that shows device memory outside the compute queue).
  Status join_pending(Join which = Join::All) {
    std::lock_guard<std::mutex> lock(mu_);
    flush_locked();
    return join_pending_locked(which);
  }
  // Pending entries of collectives (order_after_stream), not of the optimizer stream.
  size_t pending_count() {
    std::lock_guard<std::mutex> lock(mu_);
    size_t n = 0;
    for (const Pending& p : pending_) n += p.optimizer ? 0 : 1;
    return n;
  }
  // Whether held-back AdamW batches run on the optimizer stream.
  bool optimizer_stream() const { return optimizer_stream_ != nullptr; }

 private:
  Status add_pending_locked(cudaStream_t other, RangeSet touched, RangeSet written, bool optimizer) {
    SPILLWAY_RETURN_IF_ERROR(cuda_status("cudaSetDevice", cudaSetDevice(device_)));
    cudaEvent_t ev = nullptr;
    if (!event_pool_.empty()) {
      ev = event_pool_.back();
      event_pool_.pop_back();
    } else {
      SPILLWAY_RETURN_IF_ERROR(cuda_status("cudaEventCreate (collective done)",
                                           cudaEventCreateWithFlags(&ev, cudaEventDisableTiming)));
    }
    cudaError_t e = cudaEventRecord(ev, other);
    if (e != cudaSuccess) {
      event_pool_.push_back(ev);
      return cuda_status(optimizer ? "cudaEventRecord (optimizer batch done)" : "cudaEventRecord (collective done)", e);
    }
    pending_ranges_.add_all(touched);
    pending_writes_.add_all(written);
    pending_.push_back(Pending{other, ev, std::move(touched), std::move(written), optimizer});
    return Status::ok();
  }

  static bool conflicts(const RangeSet& touched, const RangeSet& written, const Backend::DeviceRange& r) {
    return written.overlaps(r.p, r.bytes) || (r.write && touched.overlaps(r.p, r.bytes));
  }

  Status wait_for_locked(const std::vector<Backend::DeviceRange>& ranges) {
    // A held-back batch that conflicts goes out first (on its stream: then pending).
    if (kind_ != Kind::None)
      for (const Backend::DeviceRange& r : ranges)
        if (conflicts(reads_, writes_, r)) {
          flush_locked();
          break;
        }
    if (pending_.empty()) return Status::ok();
    // Most ops touch none of it: one look-up per range in the unions decides.
    bool any = false;
    for (const Backend::DeviceRange& r : ranges) any = any || conflicts(pending_ranges_, pending_writes_, r);
    if (!any) return Status::ok();
    size_t hit = pending_.size();
    for (size_t i = pending_.size(); i-- > 0 && hit == pending_.size();)
      for (const Backend::DeviceRange& r : ranges)
        if (conflicts(pending_[i].ranges, pending_[i].writes, r)) {
          hit = i;
          break;
        }
    if (hit == pending_.size()) return Status::ok();
    flush_locked();  // held-back calls submitted before go out before the wait
    SPILLWAY_RETURN_IF_ERROR(cuda_status("cudaSetDevice", cudaSetDevice(device_)));
    const cudaStream_t other = pending_[hit].stream;
    SPILLWAY_RETURN_IF_ERROR(cuda_status("cudaStreamWaitEvent (compute after a collective)",
                                         cudaStreamWaitEvent(stream_, pending_[hit].event, 0)));
    // Waited for: this and every earlier entry of the same stream. (An event can be
    // recorded again at once: a wait uses the record made before it.)
    std::deque<Pending> rest;
    pending_ranges_.clear();
    pending_writes_.clear();
    for (size_t i = 0; i < pending_.size(); ++i) {
      if (i <= hit && pending_[i].stream == other) {
        event_pool_.push_back(pending_[i].event);
      } else {
        pending_ranges_.add_all(pending_[i].ranges);
        pending_writes_.add_all(pending_[i].writes);
        rest.push_back(std::move(pending_[i]));
      }
    }
    pending_ = std::move(rest);
    return Status::ok();
  }

 public:
  bool multi_tensor() const { return multi_tensor_; }

  // The compute stream, after launching every held-back call: the one way to it.
  cudaStream_t stream() {
    std::lock_guard<std::mutex> lock(mu_);
    flush_locked();
    return stream_;
  }
  // Launches every held-back call now.
  void flush() { (void)stream(); }

  // out_sq[0] = Σ grad[n]² (launch_squared_norm). scratch[scratch_bytes]: the
  // workspace, at least squared_norm_scratch_bytes(); a batch uses it whole.
  void squared_norm(const SquaredNormCall& c, void* scratch, size_t scratch_bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    const size_t grad_bytes = c.n * sizeof(bf16);
    if (!multi_tensor_) {
      flush_locked();
      report(launch_squared_norm(c.out_sq, c.grad, c.n, scratch, stream_, &launches_.squared_norm), "squared_norm");
      return;
    }
    if (kind_ != Kind::SquaredNorm || scratch != norm_scratch_ || scratch_bytes != norm_scratch_bytes_ ||
        writes_.overlaps(c.grad, grad_bytes) || writes_.overlaps(c.out_sq, sizeof(float)) ||
        reads_.overlaps(c.out_sq, sizeof(float)))
      flush_locked();
    kind_ = Kind::SquaredNorm;
    norm_scratch_ = scratch;
    norm_scratch_bytes_ = scratch_bytes;
    norms_.push_back(c);
    reads_.add(c.grad, grad_bytes);
    writes_.add(c.out_sq, sizeof(float));
    traffic_ += grad_bytes;
    if (traffic_ >= kFlushTrafficBytes) flush_locked();
  }

  // One AdamW update (launch_adamw).
  void adamw(const AdamWCall& c) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!multi_tensor_) {
      flush_locked();
      report(launch_adamw(c.param, c.master, c.m, c.v, c.grad, c.scale_norm, c.n, c.hyper, stream_,
                          &launches_.adamw),
             "adamw");
      return;
    }
    if (c.n == 0) return;  // nothing to update, nothing launched
    const size_t f32 = c.n * sizeof(float), b16 = c.n * sizeof(bf16);
    const std::pair<const void*, size_t> writes[] = {{c.param, b16}, {c.master, f32}, {c.m, f32}, {c.v, f32}};
    const std::pair<const void*, size_t> reads[] = {{c.grad, b16}, {c.scale_norm, 2 * sizeof(float)}};
    bool conflict = kind_ != Kind::AdamW;
    for (const auto& [p, bytes] : writes)
      conflict = conflict || writes_.overlaps(p, bytes) || reads_.overlaps(p, bytes);
    for (const auto& [p, bytes] : reads) conflict = conflict || writes_.overlaps(p, bytes);
    if (conflict) flush_locked();
    kind_ = Kind::AdamW;
    adamws_.push_back(c);
    for (const auto& [p, bytes] : writes) writes_.add(p, bytes);
    for (const auto& [p, bytes] : reads) reads_.add(p, bytes);
    traffic_ += c.n * (2 * sizeof(bf16) + 6 * sizeof(float));
    if (traffic_ >= (optimizer_stream_ != nullptr ? kOptimizerStreamFlushTrafficBytes : kFlushTrafficBytes))
      flush_locked();
  }

  // The kernels launched so far, after launching what is held back.
  Launches launches() {
    std::lock_guard<std::mutex> lock(mu_);
    flush_locked();
    return launches_;
  }

 private:
  enum class Kind { None, SquaredNorm, AdamW };
  // Work enqueued on another stream that compute has not waited for yet.
  struct Pending {
    cudaStream_t stream;  // where it runs
    cudaEvent_t event;    // recorded there after it
    RangeSet ranges;      // the device memory it reads or writes
    RangeSet writes;      // the part it writes
    bool optimizer;       // an AdamW batch on the optimizer stream (else a collective)
  };

  Status join_pending_locked(Join which = Join::All) {
    if (pending_.empty()) return Status::ok();
    cudaError_t e = cudaSetDevice(device_);
    std::deque<Pending> rest;
    pending_ranges_.clear();
    pending_writes_.clear();
    for (Pending& p : pending_) {
      if ((p.optimizer && which == Join::Collectives) || (!p.optimizer && which == Join::Optimizer)) {
        pending_ranges_.add_all(p.ranges);
        pending_writes_.add_all(p.writes);
        rest.push_back(std::move(p));
        continue;
      }
      if (e == cudaSuccess) e = cudaStreamWaitEvent(stream_, p.event, 0);
      event_pool_.push_back(p.event);
    }
    pending_ = std::move(rest);
    return cuda_status("cudaStreamWaitEvent (compute after the work pending on other streams)", e);
  }

  void report(cudaError_t e, const char* what) {
    if (e != cudaSuccess && on_error_) on_error_(cuda_status(what, e));
  }

  // The held-back AdamW batch on the optimizer stream, after everything submitted to
  // the compute stream so far (the gradients' and the clip scale's producers, and the
  // ops that read the old parameters), pending until compute waits for it where it
  // touches the batch's memory (wait_for_locked), or for all of it (join_pending).
  cudaError_t launch_adamws_on_optimizer_stream_locked() {
    cudaError_t e = cudaEventRecord(other_fence_, stream_);
    if (e == cudaSuccess) e = cudaStreamWaitEvent(optimizer_stream_, other_fence_, 0);
    if (e == cudaSuccess) e = launch_adamws(adamws_.data(), adamws_.size(), optimizer_stream_, &launches_.adamw);
    if (e != cudaSuccess) {
      // Compute waits for whatever went out before the error.
      (void)cudaEventRecord(other_fence_, optimizer_stream_);
      (void)cudaStreamWaitEvent(stream_, other_fence_, 0);
      return e;
    }
    RangeSet touched = reads_;
    touched.add_all(writes_);
    const Status pending = add_pending_locked(optimizer_stream_, std::move(touched), writes_, /*optimizer=*/true);
    if (!pending.is_ok()) {
      // Not tracked: the compute stream waits for the optimizer stream here.
      if (on_error_) on_error_(pending);
      (void)cudaEventRecord(other_fence_, optimizer_stream_);
      (void)cudaStreamWaitEvent(stream_, other_fence_, 0);
    }
    return cudaSuccess;
  }

  void flush_locked() {
    if (kind_ == Kind::None) return;
    cudaError_t e = cudaSetDevice(device_);
    if (e == cudaSuccess) {
      if (kind_ == Kind::SquaredNorm)
        e = launch_squared_norms(norms_.data(), norms_.size(), norm_scratch_, norm_scratch_bytes_, stream_,
                                 &launches_.squared_norm);
      else if (optimizer_stream_ == nullptr)
        e = launch_adamws(adamws_.data(), adamws_.size(), stream_, &launches_.adamw);
      else
        e = launch_adamws_on_optimizer_stream_locked();
    }
    if (e != cudaSuccess && on_error_) {
      const size_t calls = kind_ == Kind::SquaredNorm ? norms_.size() : adamws_.size();
      on_error_(cuda_status(kind_ == Kind::SquaredNorm ? "squared_norm" : "adamw", e)
                    .with_context("multi-tensor launch of " + std::to_string(calls) + " calls"));
    }
    kind_ = Kind::None;
    norms_.clear();
    adamws_.clear();
    reads_.clear();
    writes_.clear();
    traffic_ = 0;
  }

  int device_ = 0;
  bool multi_tensor_ = true;
  std::function<void(Status)> on_error_;
  std::mutex mu_;
  cudaStream_t stream_ = nullptr;
  Kind kind_ = Kind::None;               // what is held back (one kind at a time)
  std::vector<SquaredNormCall> norms_;   // held back, in submission order
  std::vector<AdamWCall> adamws_;
  void* norm_scratch_ = nullptr;         // the workspace the held-back norms use
  size_t norm_scratch_bytes_ = 0;
  RangeSet reads_, writes_;              // memory the held-back calls read, write
  uint64_t traffic_ = 0;                 // bytes they read and write
  Launches launches_;
  cudaEvent_t other_fence_ = nullptr;    // recorded on the compute stream for order_stream_after
  std::deque<Pending> pending_;          // other streams' work not yet waited for, in order
  RangeSet pending_ranges_;              // the union of their ranges
  RangeSet pending_writes_;              // the union of their writes
  cudaStream_t optimizer_stream_ = nullptr;  // the AdamW batches' stream, if they have one
  std::vector<cudaEvent_t> event_pool_;  // events of retired entries, to record again
};

// An on/off switch of the environment, for comparing two ways of running the same
// ops: "1" on (`on` says what that does), "0" off (`off`), unset `unset`; any other
// value is an error naming the variable.
Result<bool> switch_from_environment(const char* name, bool unset, const char* on, const char* off) {
  const char* v = std::getenv(name);
  if (v == nullptr) return unset;
  if (std::string(v) == "1") return true;
  if (std::string(v) == "0") return false;
  return Status::invalid_argument(std::string(name) + " is '" + v + "'; expected 1 (" + on +
                                  (unset ? ", the default" : "") + ") or 0 (" + off + (unset ? "" : ", the default") +
                                  ")");
}

// SPILLWAY_CUDA_MULTI_TENSOR: multi-tensor optimizer launches (the default), or one
// launch (or two) per tensor as before.
Result<bool> multi_tensor_from_environment() {
  return switch_from_environment("SPILLWAY_CUDA_MULTI_TENSOR", true, "multi-tensor optimizer launches",
                                 "one launch per tensor");
}

// SPILLWAY_CUDA_OPTIMIZER_STREAM: with =1, the multi-tensor AdamW batches on a stream of
// their own, of the lowest priority, that later ops wait for on the device only where
// they touch what a batch reads or writes, so that where the step leaves them running
// (Backend::synchronize_compute) the next step's forward overlaps them; unset or =0
// (the default until a GPU has run its tests and timed it), on the compute stream, in
// order.
Result<bool> optimizer_stream_from_environment() {
  return switch_from_environment("SPILLWAY_CUDA_OPTIMIZER_STREAM", false,
                                 "AdamW batches on a stream of their own, overlapping later ops",
                                 "AdamW batches on the compute stream");
}

// SPILLWAY_CUDA_GELU_EPILOGUE: a product and its GELU (MatmulGeluForward,
// MatmulGeluBackward) as one cuBLASLt product with a GELU_AUX_BIAS or DGELU epilogue
// (the default, measured on an H100: bench/RESULTS.md), or with =0 as a product and a
// GELU kernel (Backend's default implementation).
Result<bool> gelu_epilogue_from_environment() {
  return switch_from_environment("SPILLWAY_CUDA_GELU_EPILOGUE", true, "the GELU in the product's cuBLASLt epilogue",
                                 "a product, then a GELU kernel");
}

// SPILLWAY_CUDA_RESIDUAL_EPILOGUE: a product and the residual add after it
// (MatmulResidualForward) as one cuBLASLt product with beta = 1 and the residual as C
// (the default), or with =0 as a product and a residual kernel (Backend's default
// implementation). On by default since an H100 measured GPT-2 124M 1.6% faster with it
// and the bias epilogue than without them (bench/RESULTS.md, session 38).
Result<bool> residual_epilogue_from_environment() {
  return switch_from_environment("SPILLWAY_CUDA_RESIDUAL_EPILOGUE", true,
                                 "the residual added in the product's cuBLASLt call, beta = 1",
                                 "a product, then a residual kernel");
}

// SPILLWAY_CUDA_BIAS_EPILOGUE: a bias' gradient summed in its weight product's cuBLASLt
// BGRADB epilogue, from the dout the product reads anyway (the default), or with =0 by
// a column-sum kernel over dout. Where cuBLASLt has no algorithm for the epilogue the
// column-sum kernel runs anyway. On by default since session 38 (see above).
Result<bool> bias_epilogue_from_environment() {
  return switch_from_environment("SPILLWAY_CUDA_BIAS_EPILOGUE", true,
                                 "the bias gradient in the weight product's cuBLASLt BGRADB epilogue",
                                 "a column-sum kernel over the output gradient");
}

// SPILLWAY_CUDA_PINNED_REGISTER: unset or =1 (the default), a pinned host allocation of
// 1 GiB or more is anonymous memory advised to transparent huge pages, its pages faulted
// in on the thread pool's threads at once, then pinned with cudaHostRegister; =0,
// cudaHostAlloc, which faults and pins every page on the calling thread. On an H100
// (bench/RESULTS.md, session 42) gpt-2.7b's 33.4 GiB region under auto took 2.2 s
// against 14.1 s, and the first step came after 28.2 s against 38.6 s.
Result<bool> pinned_register_from_environment() {
  return switch_from_environment("SPILLWAY_CUDA_PINNED_REGISTER", true,
                                 "large pinned regions faulted in by parallel threads, then cudaHostRegister",
                                 "cudaHostAlloc");
}

// Writes one byte of every 4 KiB page of [p, p + bytes) on the thread pool, a 2 MiB
// tile (one huge page) at a time, so that the kernel faults the pages in (and zeroes
// them) on every core at once.
void fault_in_parallel(void* p, size_t bytes) {
  constexpr size_t kPage = 4096, kTile = size_t{2} << 20;
  volatile unsigned char* b = static_cast<unsigned char*>(p);
  global_thread_pool().parallel_tiles(static_cast<int64_t>((bytes + kTile - 1) / kTile), [&](int64_t t0, int64_t t1) {
    const size_t end = std::min(bytes, static_cast<size_t>(t1) * kTile);
    for (size_t at = static_cast<size_t>(t0) * kTile; at < end; at += kPage) b[at] = 0;
  });
}

// SPILLWAY_CUDA_ATTENTION: unset or "auto", the Hopper (wgmma) attention kernels where
// they apply (head dims 64, 80, 128 on compute capability 9.0); "mma", the mma.sync
// kernels everywhere, for comparing the two.
Result<AttentionKernel> attention_kernel_from_environment() {
  const char* v = std::getenv("SPILLWAY_CUDA_ATTENTION");
  const std::string s = v == nullptr ? "auto" : v;
  if (s == "auto") return AttentionKernel::kAuto;
  if (s == "mma") return AttentionKernel::kMma;
  return Status::invalid_argument("SPILLWAY_CUDA_ATTENTION is '" + s +
                                  "'; expected auto (the Hopper wgmma kernels where they apply, the default) or mma "
                                  "(the mma.sync kernels everywhere)");
}

// SPILLWAY_CUDA_SCHEDULE: how a host thread waits for the GPU (cudaSetDeviceFlags),
// set before the context exists: unset or "auto", CUDA's default (spin while there are
// fewer active contexts than cores); "spin"; "yield" (spin, yielding the core);
// "blocking" (sleep on a synchronization primitive: a waiting thread leaves its core
// to the host optimizer's threads, at the cost of a wake-up per wait).
Result<unsigned> schedule_flags_from_environment() {
  const char* v = std::getenv("SPILLWAY_CUDA_SCHEDULE");
  const std::string s = v == nullptr ? "auto" : v;
  if (s == "auto") return unsigned{cudaDeviceScheduleAuto};
  if (s == "spin") return unsigned{cudaDeviceScheduleSpin};
  if (s == "yield") return unsigned{cudaDeviceScheduleYield};
  if (s == "blocking") return unsigned{cudaDeviceScheduleBlockingSync};
  return Status::invalid_argument("SPILLWAY_CUDA_SCHEDULE is '" + s +
                                  "'; expected auto (CUDA's default), spin, yield or blocking");
}

// The SPILLWAY_CUDA_SCHEDULE value of flags schedule_flags_from_environment returned.
const char* schedule_name(unsigned flags) {
  switch (flags) {
    case cudaDeviceScheduleSpin: return "spin";
    case cudaDeviceScheduleYield: return "yield";
    case cudaDeviceScheduleBlockingSync: return "blocking";
    default: return "auto";
  }
}

// ---------------------------------------------------------------- copy engine

class CudaCopyEngine final : public CopyEngine {
 public:
  CudaCopyEngine() = default;
  CudaCopyEngine(const CudaCopyEngine&) = delete;
  CudaCopyEngine& operator=(const CudaCopyEngine&) = delete;

  ~CudaCopyEngine() override {
    for (auto& q : queues_) {
      if (q.stream) (void)cudaStreamSynchronize(q.stream);
      for (auto& p : q.pending) (void)cudaEventDestroy(p.event);
      if (q.stream) (void)cudaStreamDestroy(q.stream);
    }
    for (cudaEvent_t e : pool_) (void)cudaEventDestroy(e);
    if (compute_fence_) (void)cudaEventDestroy(compute_fence_);
  }

  // `compute`: the backend's queue, whose stream the fences of copies after compute
  // and the waits of compute after copies go on.
  Status init(int device, ComputeQueue* compute) {
    device_ = device;
    compute_ = compute;
    for (auto& q : queues_)
      SPILLWAY_RETURN_IF_ERROR(cuda_status("cudaStreamCreate (copy)", cudaStreamCreateWithFlags(&q.stream, cudaStreamNonBlocking)));
    return cuda_status("cudaEventCreate", cudaEventCreateWithFlags(&compute_fence_, cudaEventDisableTiming));
  }

  Result<CopyTicket> copy(CopyDirection direction, void* dst, const void* src, size_t bytes,
                          bool after_compute) override {
    std::lock_guard<std::mutex> lock(mu_);
    Queue& q = queue(direction);
    SPILLWAY_RETURN_IF_ERROR(cuda_status("cudaSetDevice", cudaSetDevice(device_)));
    // The copy starts after every op submitted so far (a D2H copy reads their output),
    // unless the caller knows no op in flight touches its memory.
    if (after_compute) {
      // Collectives still pending on their own stream count as compute submitted so far.
      SPILLWAY_RETURN_IF_ERROR(compute_->join_pending());
      SPILLWAY_RETURN_IF_ERROR(
          cuda_status("cudaEventRecord (compute fence)", cudaEventRecord(compute_fence_, compute_->stream())));
      SPILLWAY_RETURN_IF_ERROR(
          cuda_status("cudaStreamWaitEvent (copy after compute)", cudaStreamWaitEvent(q.stream, compute_fence_, 0)));
    }
    if (bytes > 0) {
      const cudaMemcpyKind kind =
          direction == CopyDirection::HostToDevice ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost;
      cudaError_t e = cudaMemcpyAsync(dst, src, bytes, kind, q.stream);
      if (e != cudaSuccess)
        return cuda_status("cudaMemcpyAsync", e)
            .with_context(std::string(direction_name(direction)) + " copy of " + format_size(bytes));
    }
    cudaEvent_t ev = nullptr;
    SPILLWAY_RETURN_IF_ERROR(take_event(&ev));
    cudaError_t e = cudaEventRecord(ev, q.stream);
    if (e != cudaSuccess) {
      pool_.push_back(ev);
      return cuda_status("cudaEventRecord (copy)", e);
    }
    const uint64_t seq = q.next++;
    q.pending.push_back({seq, ev});
    q.bytes.fetch_add(bytes, std::memory_order_relaxed);
    return CopyTicket{direction, seq};
  }

  bool is_done(CopyTicket t) override {
    std::lock_guard<std::mutex> lock(mu_);
    Queue& q = queue(t.direction);
    cudaEvent_t ev = find(q, t.sequence);
    if (ev == nullptr) return true;
    cudaError_t e = cudaEventQuery(ev);
    if (e == cudaErrorNotReady) {
      (void)cudaGetLastError();  // "not ready" is no error of a later launch
      return false;
    }
    if (e != cudaSuccess && q.error.is_ok())
      static_cast<void>(q.error = cuda_status("copy", e).with_context(ticket_text(t)));
    retire_through(q, t.sequence);
    return true;
  }

  Status wait(CopyTicket t) override {
    // The host blocks here: held-back compute goes to the GPU first, to run meanwhile.
    if (compute_ != nullptr) compute_->flush();
    cudaEvent_t ev = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      Queue& q = queue(t.direction);
      SPILLWAY_RETURN_IF_ERROR(take_error(q));
      ev = find(q, t.sequence);
      if (ev == nullptr) return Status::ok();
    }
    // Outside the lock: other threads may submit copies meanwhile. The event is
    // only recycled once retired under the lock, after this wait returns.
    cudaError_t e = cudaEventSynchronize(ev);
    std::lock_guard<std::mutex> lock(mu_);
    Queue& q = queue(t.direction);
    if (e != cudaSuccess) return cuda_status("cudaEventSynchronize", e).with_context(ticket_text(t));
    retire_through(q, t.sequence);
    return take_error(q);
  }

  Status order_compute_after(CopyTicket t) override {
    std::lock_guard<std::mutex> lock(mu_);
    Queue& q = queue(t.direction);
    cudaEvent_t ev = find(q, t.sequence);
    if (ev == nullptr) return Status::ok();
    SPILLWAY_RETURN_IF_ERROR(cuda_status("cudaSetDevice", cudaSetDevice(device_)));
    return cuda_status("cudaStreamWaitEvent (compute after copy)", cudaStreamWaitEvent(compute_->stream(), ev, 0))
        .with_context(ticket_text(t));
  }

  Status wait_all() override {
    std::lock_guard<std::mutex> lock(mu_);
    Status first;
    for (int d = 0; d < 2; ++d) {
      Queue& q = queues_[d];
      cudaError_t e = cudaStreamSynchronize(q.stream);
      if (e != cudaSuccess && first.is_ok())
        static_cast<void>(first = cuda_status("cudaStreamSynchronize", e)
                                      .with_context(std::string(direction_name(static_cast<CopyDirection>(d))) + " copies"));
      if (!q.pending.empty()) retire_through(q, q.pending.back().seq);
      Status qe = take_error(q);
      if (!qe.is_ok() && first.is_ok()) static_cast<void>(first = qe);
    }
    return first;
  }

  uint64_t bytes_copied(CopyDirection d) const override {
    return queues_[static_cast<int>(d)].bytes.load(std::memory_order_relaxed);
  }

 private:
  struct Pending {
    uint64_t seq;
    cudaEvent_t event;
  };
  struct Queue {
    cudaStream_t stream = nullptr;
    uint64_t next = 1;  // sequence of the next copy
    std::deque<Pending> pending;  // submitted, not yet seen complete, in order
    std::atomic<uint64_t> bytes{0};
    Status error;  // first asynchronous error seen by is_done
  };

  Queue& queue(CopyDirection d) { return queues_[static_cast<int>(d)]; }

  static std::string ticket_text(CopyTicket t) {
    return std::string(direction_name(t.direction)) + " copy #" + std::to_string(t.sequence);
  }

  // The event of a pending copy; null when it is known complete (or sequence 0).
  static cudaEvent_t find(Queue& q, uint64_t seq) {
    if (seq == 0 || q.pending.empty() || seq < q.pending.front().seq) return nullptr;
    const uint64_t idx = seq - q.pending.front().seq;
    if (idx >= q.pending.size()) return nullptr;  // a ticket this engine never issued
    return q.pending[idx].event;
  }

  // Copies of one direction complete in order: everything up to seq is done.
  void retire_through(Queue& q, uint64_t seq) {
    while (!q.pending.empty() && q.pending.front().seq <= seq) {
      pool_.push_back(q.pending.front().event);
      q.pending.pop_front();
    }
  }

  static Status take_error(Queue& q) {
    Status s = q.error;
    static_cast<void>(q.error = Status::ok());
    return s;
  }

  Status take_event(cudaEvent_t* ev) {
    if (!pool_.empty()) {
      *ev = pool_.back();
      pool_.pop_back();
      return Status::ok();
    }
    return cuda_status("cudaEventCreate", cudaEventCreateWithFlags(ev, cudaEventDisableTiming));
  }

  int device_ = 0;
  ComputeQueue* compute_ = nullptr;  // the backend's (it outlives this engine's use)
  cudaEvent_t compute_fence_ = nullptr;
  std::mutex mu_;
  Queue queues_[2];
  std::vector<cudaEvent_t> pool_;
};

// ---------------------------------------------------------------- backend

const bf16* cb(const void* p) { return static_cast<const bf16*>(p); }
bf16* mb(void* p) { return static_cast<bf16*>(p); }

class CudaBackend final : public Backend {
 public:
  CudaBackend() = default;
  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  ~CudaBackend() override {
    (void)cudaSetDevice(device_);
    // Launches what is held back (while the workspace is still there), waits for the
    // compute stream and destroys it; copy_ and mm_, destroyed after this body, never
    // touch it again.
    queue_.destroy();
    (void)copy_.wait_all();
    if (own_workspace_) (void)cudaFree(own_workspace_);
  }

  Status init(const BackendOptions& options) {
    device_ = options.device;
    int count = 0;
    SPILLWAY_RETURN_IF_ERROR(cuda_status("cudaGetDeviceCount", cudaGetDeviceCount(&count)));
    if (device_ < 0 || device_ >= count)
      return Status::invalid_argument("CUDA device " + std::to_string(device_) + " does not exist (" +
                                      std::to_string(count) + " found)");
    SPILLWAY_RETURN_IF_ERROR(cuda_status("cudaSetDevice", cudaSetDevice(device_)));
    SPILLWAY_ASSIGN_OR_RETURN(schedule_flags_, schedule_flags_from_environment());
    if (schedule_flags_ != cudaDeviceScheduleAuto) {
      // Fails where this process's context on the device already runs with other flags.
      cudaError_t e = cudaSetDeviceFlags(schedule_flags_);
      if (e != cudaSuccess)
        return cuda_status("cudaSetDeviceFlags (SPILLWAY_CUDA_SCHEDULE)", e)
            .with_context("the device's context was created before with another schedule");
    }
    // The context exists after this (cudaFree(nullptr) creates it); the used bytes now
    // are the baseline of device_used_bytes(): the context and other processes.
    SPILLWAY_RETURN_IF_ERROR(cuda_status("cudaFree (context creation)", cudaFree(nullptr)));
    {
      size_t free0 = 0, total0 = 0;
      SPILLWAY_RETURN_IF_ERROR(cuda_status("cudaMemGetInfo (baseline)", cudaMemGetInfo(&free0, &total0)));
      baseline_used_ = total0 - free0;
    }
    cudaDeviceProp prop{};
    SPILLWAY_RETURN_IF_ERROR(cuda_status("cudaGetDeviceProperties", cudaGetDeviceProperties(&prop, device_)));
    if (prop.major < 8)
      return Status::unsupported(std::string("CUDA device ") + prop.name + " has compute capability " +
                                 std::to_string(prop.major) + "." + std::to_string(prop.minor) +
                                 "; the bf16 kernels need 8.0 or newer");
    size_t free_b = 0;
    SPILLWAY_RETURN_IF_ERROR(cuda_status("cudaMemGetInfo", cudaMemGetInfo(&free_b, &capacity_)));
    gpu_name_ = prop.name;
    sm90_ = prop.major == 9 && prop.minor == 0;
    SPILLWAY_ASSIGN_OR_RETURN(attention_kernel_, attention_kernel_from_environment());
    SPILLWAY_ASSIGN_OR_RETURN(gelu_epilogue_, gelu_epilogue_from_environment());
    SPILLWAY_ASSIGN_OR_RETURN(residual_epilogue_, residual_epilogue_from_environment());
    SPILLWAY_ASSIGN_OR_RETURN(bias_epilogue_, bias_epilogue_from_environment());
    SPILLWAY_ASSIGN_OR_RETURN(pinned_register_, pinned_register_from_environment());
    SPILLWAY_ASSIGN_OR_RETURN(const bool multi_tensor, multi_tensor_from_environment());
    SPILLWAY_ASSIGN_OR_RETURN(const bool optimizer_stream, optimizer_stream_from_environment());
    SPILLWAY_RETURN_IF_ERROR(queue_.init(device_, multi_tensor, optimizer_stream,
                                         [this](Status s) { record(std::move(s), nullptr); }));
    SPILLWAY_RETURN_IF_ERROR(copy_.init(device_, &queue_));
    // No workspace yet: the caller gives one (set_workspace) before running ops.
    SPILLWAY_RETURN_IF_ERROR(mm_.init(nullptr, kLtWorkspaceBytes));
    // The driver reserves local memory (the per-thread stack, for every thread the
    // device can hold) at the first launch of a kernel that uses any: 264 MiB on an
    // H200. Made to happen now, so it is measured with the handles and streams as
    // fixed_device_bytes(), which budgets leave out, not in the middle of a step.
    reserve_local_memory_kernel<<<1, 32, 0, stream()>>>(nullptr, 0);
    SPILLWAY_RETURN_IF_ERROR(cuda_status("local memory reservation", cudaGetLastError()));
    SPILLWAY_RETURN_IF_ERROR(cuda_status("cudaStreamSynchronize (init)", cudaStreamSynchronize(stream())));
    fixed_bytes_ = device_used_bytes();
    sample_peak();
    return Status::ok();
  }

  std::string name() const override { return sizes().name(); }
  std::string description() const override {
    return gpu_name_ + ", " + format_size(capacity_) + " (device " + std::to_string(device_) +
           "; cuBLASLt workspace " + format_size(kLtWorkspaceBytes) + " per product, inside the step's workspace; " +
           (!queue_.multi_tensor()       ? "one optimizer launch per tensor (SPILLWAY_CUDA_MULTI_TENSOR=0)"
            : queue_.optimizer_stream() ? "multi-tensor optimizer launches, AdamW on a stream of its own "
                                          "(SPILLWAY_CUDA_OPTIMIZER_STREAM=1)"
                                        : "multi-tensor optimizer launches, AdamW on the compute stream") +
           (schedule_flags_ == cudaDeviceScheduleAuto ? std::string()
                                                      : std::string("; waits: SPILLWAY_CUDA_SCHEDULE=") +
                                                            schedule_name(schedule_flags_)) +
           (gelu_epilogue_ ? "; GELU in the products' cuBLASLt epilogue"
                           : "; GELU as a kernel after the product (SPILLWAY_CUDA_GELU_EPILOGUE=0)") +
           (residual_epilogue_ ? "; residual adds in the products' cuBLASLt call"
                               : "; residual adds as a kernel after the product (SPILLWAY_CUDA_RESIDUAL_EPILOGUE=0)") +
           (bias_epilogue_ ? "; bias gradients in the weight products' BGRADB epilogue"
                           : "; bias gradients by a column-sum kernel (SPILLWAY_CUDA_BIAS_EPILOGUE=0)") +
           (attention_kernel_ == AttentionKernel::kMma ? "; attention: mma.sync (SPILLWAY_CUDA_ATTENTION=mma)"
            : sm90_ && attention_wgmma_built()         ? "; attention: wgmma at head dims 64, 80, 128"
                                                         " (loads by TMA: the forward's, and the backward's at 64)"
                                                       : "") +
           ")";
  }
  DType activation_dtype() const override { return sizes().activation_dtype(); }
  size_t alignment() const override { return sizes().alignment(); }

  size_t device_capacity() const override { return capacity_; }
  size_t device_free_bytes() const override {
    size_t free_b = 0, total = 0;
    if (cudaSetDevice(device_) != cudaSuccess || cudaMemGetInfo(&free_b, &total) != cudaSuccess) {
      (void)cudaGetLastError();
      return 0;
    }
    return free_b;
  }

  Result<void*> device_alloc(size_t bytes) override {
    SPILLWAY_RETURN_IF_ERROR(cuda_status("cudaSetDevice", cudaSetDevice(device_)));
    void* p = nullptr;
    cudaError_t e = cudaMalloc(&p, bytes);
    if (e != cudaSuccess) {
      size_t free_b = 0, total = 0;
      (void)cudaMemGetInfo(&free_b, &total);
      return cuda_status("cudaMalloc", e)
          .with_context("device allocation of " + format_size(bytes) + " on " + gpu_name_ + " (" +
                        format_size(free_b) + " free of " + format_size(total) + ")");
    }
    sample_peak();
    return p;
  }

  void device_free(void* p) override {
    if (p == nullptr) return;
    queue_.flush();  // a held-back call may use it: launched before cudaFree waits for the device
    check(cudaSetDevice(device_), "cudaSetDevice");
    check(cudaFree(p), "cudaFree");
  }

  Result<void*> host_alloc(size_t bytes) override {
    SPILLWAY_RETURN_IF_ERROR(cuda_status("cudaSetDevice", cudaSetDevice(device_)));
    if (pinned_register_ && bytes >= (size_t{1} << 30)) return host_alloc_registered(bytes);
    void* p = nullptr;
    cudaError_t e = cudaHostAlloc(&p, bytes, cudaHostAllocPortable);
    if (e != cudaSuccess)
      return cuda_status("cudaHostAlloc", e).with_context("pinned host allocation of " + format_size(bytes));
    return p;
  }

  void host_free(void* p) override {
    if (p == nullptr) return;
    queue_.flush();  // as device_free: cudaFreeHost waits for the device
    size_t registered = 0;
    {
      std::lock_guard<std::mutex> lock(registered_mu_);
      if (auto it = registered_.find(p); it != registered_.end()) {
        registered = it->second;
        registered_.erase(it);
      }
    }
    if (registered == 0) {
      check(cudaFreeHost(p), "cudaFreeHost");
      return;
    }
    // cudaHostUnregister waits for the device's work on it, as cudaFreeHost does.
    check(cudaHostUnregister(p), "cudaHostUnregister");
    if (munmap(p, registered) != 0)
      record(errno_status("munmap", errno).with_context("freeing a registered host region of " +
                                                        format_size(registered)),
             nullptr);
  }

  Status pin_host(void* p, size_t bytes) override {
    SPILLWAY_RETURN_IF_ERROR(cuda_status("cudaSetDevice", cudaSetDevice(device_)));
    return cuda_status("cudaHostRegister", cudaHostRegister(p, bytes, cudaHostRegisterDefault))
        .with_context("pinning " + format_size(bytes) + " of host memory");
  }
  void unpin_host(void* p) override {
    if (cudaHostUnregister(p) != cudaSuccess) (void)cudaGetLastError();  // unpinned at exit anyway
  }

  CopyEngine& copy_engine() override { return copy_; }

 private:
  // host_alloc unless SPILLWAY_CUDA_PINNED_REGISTER=0 (see pinned_register_from_environment).
  Result<void*> host_alloc_registered(size_t bytes) {
    constexpr size_t kHuge = size_t{2} << 20;
    const size_t len = (bytes + kHuge - 1) / kHuge * kHuge;
    void* p = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
      return errno_status("mmap", errno).with_context("pinned host allocation of " + format_size(bytes));
    (void)madvise(p, len, MADV_HUGEPAGE);  // advice: without it the pages are 4 KiB, no error
    fault_in_parallel(p, len);
    if (cudaError_t e = cudaHostRegister(p, len, cudaHostRegisterPortable); e != cudaSuccess) {
      (void)munmap(p, len);
      return cuda_status("cudaHostRegister", e).with_context("pinned host allocation of " + format_size(bytes));
    }
    std::lock_guard<std::mutex> lock(registered_mu_);
    registered_[p] = len;
    return p;
  }

 public:
  // Stall probes: timing events on the compute stream (stall_timer.cuh). A failure to
  // record one is recorded like an op's error; the probe then counts nothing.
  StallProbe begin_stall_probe() override {
    Status err;
    const uint64_t id = stall_.begin(stream(), &err);
    record(err, "stall probe");
    return StallProbe{id, 0};
  }
  void end_stall_probe(StallProbe probe) override {
    Status err;
    stall_.end(probe.id, stream(), &err);
    record(err, "stall probe");
  }
  Result<double> take_stall_seconds() override {
    Status err;
    const double s = stall_.take(&err);
    if (!err.is_ok()) return err;
    return s;
  }

  // Collectives on their own stream (backend.h): events between it and the compute
  // stream, kept by the compute queue; the host never waits here.
  Status order_stream_after_compute(void* other) override {
    if (other == nullptr) return synchronize();
    return queue_.order_stream_after(static_cast<cudaStream_t>(other));
  }
  Status order_after_stream(void* other, const std::vector<DeviceRange>& ranges) override {
    if (other == nullptr) return Status::ok();
    return queue_.add_pending(static_cast<cudaStream_t>(other), ranges);
  }
  Status order_compute_for(const std::vector<DeviceRange>& ranges) override { return queue_.wait_for(ranges); }
  bool optimizer_on_own_stream() const override { return queue_.optimizer_stream(); }
  // The compute stream and the copies; the AdamW batches on the optimizer stream go
  // on (backend.h).
  Status synchronize_compute() override { return synchronize_all(ComputeQueue::Join::Collectives); }
  // Entries of order_after_stream that compute has not waited for yet (tests).
  size_t pending_collectives() { return queue_.pending_count(); }

  Status synchronize() override { return synchronize_all(ComputeQueue::Join::All); }

  Status upload(void* dev, const void* host, size_t bytes) override {
    SPILLWAY_RETURN_IF_ERROR(cuda_status("cudaSetDevice", cudaSetDevice(device_)));
    // After every collective on its own stream, and the updates that touch the range.
    SPILLWAY_RETURN_IF_ERROR(queue_.join_pending(ComputeQueue::Join::Collectives));
    SPILLWAY_RETURN_IF_ERROR(queue_.wait_for({{dev, bytes, /*write=*/true}}));
    const cudaStream_t s = stream();
    SPILLWAY_RETURN_IF_ERROR(
        cuda_status("cudaMemcpyAsync (upload)", cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice, s)));
    return cuda_status("cudaStreamSynchronize (upload)", cudaStreamSynchronize(s));
  }

  Status download(void* host, const void* dev, size_t bytes) override {
    SPILLWAY_RETURN_IF_ERROR(cuda_status("cudaSetDevice", cudaSetDevice(device_)));
    // After every collective on its own stream, and the updates that write the range.
    SPILLWAY_RETURN_IF_ERROR(queue_.join_pending(ComputeQueue::Join::Collectives));
    SPILLWAY_RETURN_IF_ERROR(queue_.wait_for({{dev, bytes, /*write=*/false}}));
    const cudaStream_t s = stream();
    SPILLWAY_RETURN_IF_ERROR(
        cuda_status("cudaMemcpyAsync (download)", cudaMemcpyAsync(host, dev, bytes, cudaMemcpyDeviceToHost, s)));
    return cuda_status("cudaStreamSynchronize (download)", cudaStreamSynchronize(s));
  }

  void fill_zero(void* dev, size_t bytes) override {
    if (!enter()) return;
    record(queue_.wait_for({{dev, bytes, /*write=*/true}}), "fill_zero");
    check(cudaMemsetAsync(dev, 0, bytes, stream()), "fill_zero");
  }

  void copy_device(void* dst, const void* src, size_t bytes) override {
    if (!enter()) return;
    record(queue_.wait_for({{dst, bytes, /*write=*/true}, {src, bytes, /*write=*/false}}), "copy_device");
    check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream()), "copy_device");
  }

  size_t device_used_bytes() const override {
    size_t free_b = 0, total = 0;
    if (cudaSetDevice(device_) != cudaSuccess || cudaMemGetInfo(&free_b, &total) != cudaSuccess) {
      (void)cudaGetLastError();
      return 0;
    }
    const size_t used = total - free_b;
    return used > baseline_used_ ? used - baseline_used_ : 0;
  }
  size_t device_peak_bytes() const override { return peak_used_.load(); }
  void reset_device_peak() override { peak_used_.store(device_used_bytes()); }
  size_t allocation_granularity() const override { return sizes().allocation_granularity(); }
  uint64_t host_mapping_device_bytes(uint64_t host_bytes) const override {
    return sizes().host_mapping_device_bytes(host_bytes);
  }
  size_t fixed_device_bytes() const override { return fixed_bytes_; }
  void remeasure_fixed_device_bytes() override { fixed_bytes_ = std::max(fixed_bytes_, device_used_bytes()); }

  // ---- workspace. Layout of the given workspace: scratch (reduction partials, sort
  // buffers) from its start; a matrix product puts its cuBLASLt workspace after the
  // bias gradient's partials.
  size_t embedding_backward_workspace(int B, int T) const override {
    return sizes().embedding_backward_workspace(B, T);
  }
  size_t layernorm_backward_workspace(int N, int C) const override {
    return sizes().layernorm_backward_workspace(N, C);
  }
  size_t rmsnorm_backward_workspace(int N, int C) const override {
    return sizes().rmsnorm_backward_workspace(N, C);
  }
  size_t matmul_workspace(int N, int OC, bool backward, bool dbias) const override {
    return sizes().matmul_workspace(N, OC, backward, dbias);
  }
  size_t attention_backward_workspace(int B, int T, int NH) const override {
    return sizes().attention_backward_workspace(B, T, NH);
  }
  size_t squared_norm_workspace() const override { return sizes().squared_norm_workspace(); }
  void set_workspace(void* base, size_t bytes) override {
    queue_.flush();  // held-back squared norms use the workspace they were given
    workspace_ = base;
    workspace_bytes_ = base ? bytes : 0;
  }
  Status use_own_workspace(size_t bytes) override {
    SPILLWAY_RETURN_IF_ERROR(cuda_status("cudaSetDevice", cudaSetDevice(device_)));
    if (own_workspace_) {
      SPILLWAY_RETURN_IF_ERROR(cuda_status("cudaStreamSynchronize", cudaStreamSynchronize(stream())));
      SPILLWAY_RETURN_IF_ERROR(cuda_status("cudaFree (workspace)", cudaFree(own_workspace_)));
      if (workspace_ == own_workspace_) set_workspace(nullptr, 0);
      own_workspace_ = nullptr;
    }
    if (bytes == 0) return Status::ok();
    SPILLWAY_ASSIGN_OR_RETURN(own_workspace_, device_alloc(bytes));
    set_workspace(own_workspace_, bytes);
    return Status::ok();
  }

  // ---- ops

  // The shorter overloads (whole vocabulary, ld = OC, dinp overwritten) of Backend.
  using Backend::embedding_backward;
  using Backend::embedding_forward;
  using Backend::matmul_backward;
  using Backend::matmul_forward;

  void embedding_forward(void* out, const int32_t* tokens, const void* wte, const void* wpe, int B, int T, int C,
                         int vocab_begin, int vocab_rows) override {
    if (!enter()) return;
    check(launch_embedding_forward(mb(out), tokens, cb(wte), cb(wpe), B, T, C, vocab_begin, vocab_rows, stream()),
          "embedding_forward");
  }

  void embedding_backward(void* dwte, void* dwpe, const void* dout, const int32_t* tokens, int B, int T, int C,
                          int vocab_begin, int vocab_rows) override {
    if (!enter()) return;
    // The plan reserved embedding_backward_scratch_bytes, whose sort storage is a
    // bound on what CUB asks for; CUB's own figure must stay within it.
    size_t cub_need = 0;
    if (!check(embedding_sort_temp_query(B * T, &cub_need), "embedding_backward (CUB sizing)")) return;
    if (cub_need > embedding_sort_temp_bytes(B * T)) {
      record(Status::internal("cuda backend: CUB's radix sort asks for " + std::to_string(cub_need) +
                              " bytes of temporary storage for " + std::to_string(B * T) +
                              " pairs, more than the " + std::to_string(embedding_sort_temp_bytes(B * T)) +
                              " bytes cuda_workspace::embedding_sort_temp_bytes reserves (backend_sizes.cpp): "
                              "update that bound for this CUB version or GPU"),
             nullptr);
      return;
    }
    const size_t need = embedding_backward_scratch_bytes(B * T);
    void* s = scratch(need, "embedding_backward");
    if (s == nullptr) return;
    check(launch_embedding_backward(mb(dwte), mb(dwpe), cb(dout), tokens, B, T, C, vocab_begin, vocab_rows, s,
                                    need, stream()),
          "embedding_backward");
  }

  void layernorm_forward(void* out, float* mean, float* rstd, const void* inp, const void* weight,
                         const void* bias, int N, int C) override {
    if (!enter()) return;
    check(launch_layernorm_forward(mb(out), mean, rstd, cb(inp), cb(weight), cb(bias), N, C, stream()),
          "layernorm_forward");
  }

  void layernorm_backward(void* dinp, void* dweight, void* dbias, const void* dout, const void* inp,
                          const void* weight, const float* mean, const float* rstd, int N, int C) override {
    if (!enter()) return;
    void* s = scratch(layernorm_backward_scratch_bytes(N, C), "layernorm_backward");
    if (s == nullptr) return;
    check(launch_layernorm_backward(mb(dinp), mb(dweight), mb(dbias), cb(dout), cb(inp), cb(weight), mean, rstd, N,
                                    C, s, stream()),
          "layernorm_backward");
  }

  void rmsnorm_forward(void* out, float* rstd, const void* inp, const void* weight, int N, int C,
                       float eps) override {
    if (!enter()) return;
    check(launch_rmsnorm_forward(mb(out), rstd, cb(inp), cb(weight), N, C, eps, stream()), "rmsnorm_forward");
  }

  void rmsnorm_backward(void* dinp, void* dweight, const void* dout, const void* inp, const void* weight,
                        const float* rstd, int N, int C) override {
    if (!enter()) return;
    void* s = scratch(rmsnorm_backward_scratch_bytes(N, C), "rmsnorm_backward");
    if (s == nullptr) return;
    check(launch_rmsnorm_backward(mb(dinp), mb(dweight), cb(dout), cb(inp), cb(weight), rstd, N, C, s, stream()),
          "rmsnorm_backward");
  }

  void matmul_forward(void* out, const void* inp, const void* weight, const void* bias, int N, int C, int OC,
                      int ld_out) override {
    if (!enter() || !leading_dim_ok(ld_out, OC, "matmul_forward")) return;
    if (!lt_workspace(0, "matmul_forward")) return;
    record(mm_.forward(stream(), mb(out), cb(inp), cb(weight), cb(bias), N, C, OC, ld_out), "matmul_forward");
  }

  void matmul_backward(void* dinp, void* dweight, void* dbias, const void* dout, const void* inp,
                       const void* weight, int N, int C, int OC, int ld_dout, bool accumulate_dinp) override {
    if (!enter() || !leading_dim_ok(ld_dout, OC, "matmul_backward")) return;
    const size_t bias_bytes = dbias != nullptr ? align(bias_backward_scratch_bytes(N, OC)) : 0;
    if (!lt_workspace(bias_bytes, "matmul_backward")) return;
    void* bias_scratch = nullptr;  // the bias' column sums: partials, or the epilogue's [OC]
    if (dbias != nullptr && (bias_scratch = scratch(bias_backward_scratch_bytes(N, OC), "matmul_backward")) == nullptr)
      return;
    bool fused = false;  // dweight and dbias from one product (the BGRADB epilogue)
    if (dbias != nullptr && bias_epilogue_ && dweight != nullptr) {
      // The bias' column sums into the scratch (bf16 [OC]), then added into dbias.
      bf16* sums = static_cast<bf16*>(bias_scratch);
      Status s = mm_.backward_weight(stream(), mb(dweight), cb(dout), cb(inp), N, C, OC, ld_dout, sums);
      if (s.is_ok()) {
        if (!check(launch_residual_forward(mb(dbias), mb(dbias), sums, static_cast<size_t>(OC), stream()),
                   "matmul_backward (dbias)"))
          return;
        fused = true;
      } else if (s.code() != StatusCode::Unsupported) {
        record(std::move(s), "matmul_backward (dweight, dbias)");
        return;
      }
    }
    if (dbias != nullptr && !fused &&
        !check(launch_bias_backward(mb(dbias), cb(dout), N, OC, ld_dout, bias_scratch, stream()),
               "matmul_backward (dbias)"))
      return;
    if (dweight != nullptr && !fused)
      record(mm_.backward_weight(stream(), mb(dweight), cb(dout), cb(inp), N, C, OC, ld_dout),
             "matmul_backward (dweight)");
    if (dinp != nullptr)
      record(mm_.backward_input(stream(), mb(dinp), cb(dout), cb(weight), N, C, OC, ld_dout, accumulate_dinp),
             "matmul_backward (dinp)");
  }

  // The GELU in the product's epilogue: out = gelu(the fp32 sum) beside pre = the sum
  // rounded; where cuBLASLt has no such algorithm, or with SPILLWAY_CUDA_GELU_EPILOGUE=0,
  // a product and a GELU kernel (Backend's default), the same way every time.
  void matmul_gelu_forward(void* out, void* pre, const void* inp, const void* weight, const void* bias, int N,
                           int C, int OC) override {
    if (!gelu_epilogue_) return Backend::matmul_gelu_forward(out, pre, inp, weight, bias, N, C, OC);
    if (!enter() || !lt_workspace(0, "matmul_gelu_forward")) return;
    Status s = mm_.forward_gelu(stream(), mb(out), mb(pre), cb(inp), cb(weight), cb(bias), N, C, OC);
    if (s.code() == StatusCode::Unsupported) return Backend::matmul_gelu_forward(out, pre, inp, weight, bias, N, C, OC);
    record(std::move(s), "matmul_gelu_forward");
  }

  // dpre through the DGELU epilogue (the same fallbacks as the forward).
  void matmul_gelu_backward(void* dpre, const void* dout, const void* weight, const void* pre, int N, int C,
                            int OC) override {
    if (!gelu_epilogue_) return Backend::matmul_gelu_backward(dpre, dout, weight, pre, N, C, OC);
    if (!enter() || !lt_workspace(0, "matmul_gelu_backward")) return;
    Status s = mm_.backward_input_gelu(stream(), mb(dpre), cb(dout), cb(weight), cb(pre), N, C, OC);
    if (s.code() == StatusCode::Unsupported) return Backend::matmul_gelu_backward(dpre, dout, weight, pre, N, C, OC);
    record(std::move(s), "matmul_gelu_backward");
  }

  // The residual added in the product (beta = 1, C = residual): out = the fp32 sum of
  // the product, its bias and the residual, rounded once; where cuBLASLt refuses the
  // problem, or with SPILLWAY_CUDA_RESIDUAL_EPILOGUE=0, a product and a
  // residual kernel (Backend's default), the same way every time.
  void matmul_residual_forward(void* out, const void* inp, const void* weight, const void* bias,
                               const void* residual, int N, int C, int OC) override {
    if (!residual_epilogue_) return Backend::matmul_residual_forward(out, inp, weight, bias, residual, N, C, OC);
    if (!enter() || !lt_workspace(0, "matmul_residual_forward")) return;
    Status s = mm_.forward_residual(stream(), mb(out), cb(inp), cb(weight), cb(bias), cb(residual), N, C, OC);
    if (s.code() == StatusCode::Unsupported)
      return Backend::matmul_residual_forward(out, inp, weight, bias, residual, N, C, OC);
    record(std::move(s), "matmul_residual_forward");
  }

  using Backend::attention_backward;
  using Backend::attention_forward;
  void attention_forward(void* out, float* lse, const void* qkv, int B, int T, int C, int NH, int KVH) override {
    if (!enter() || !attention_shape_ok(C, NH, KVH, "attention_forward")) return;
    check(launch_attention_forward(mb(out), lse, cb(qkv), B, T, C, NH, KVH, stream(), sm90_, attention_kernel_),
          "attention_forward");
  }

  void attention_backward(void* dqkv, const void* dout, const void* qkv, const void* out, const float* lse,
                          int B, int T, int C, int NH, int KVH) override {
    if (!enter() || !attention_shape_ok(C, NH, KVH, "attention_backward")) return;
    void* s = scratch(attention_backward_scratch_bytes(B, T, NH), "attention_backward");
    if (s == nullptr) return;
    check(launch_attention_backward(mb(dqkv), cb(dout), cb(qkv), cb(out), lse, B, T, C, NH, KVH, s, stream(), sm90_,
                                    attention_kernel_),
          "attention_backward");
  }

  void rope_forward(void* out, const void* inp, int B, int T, int NH, int KVH, int D,
                    const RopeParams& rope) override {
    run_rope(out, inp, B, T, NH, KVH, D, rope, 1.0f, "rope_forward");
  }

  void rope_backward(void* dinp, const void* dout, int B, int T, int NH, int KVH, int D,
                     const RopeParams& rope) override {
    run_rope(dinp, dout, B, T, NH, KVH, D, rope, -1.0f, "rope_backward");
  }

  void swiglu_forward(void* out, const void* inp, int64_t N, int I) override {
    if (!enter()) return;
    check(launch_swiglu_forward(mb(out), cb(inp), N, I, stream()), "swiglu_forward");
  }

  void swiglu_backward(void* dinp, const void* inp, const void* dout, int64_t N, int I) override {
    if (!enter()) return;
    check(launch_swiglu_backward(mb(dinp), cb(inp), cb(dout), N, I, stream()), "swiglu_backward");
  }

  void gelu_forward(void* out, const void* inp, size_t n) override {
    if (!enter()) return;
    check(launch_gelu_forward(mb(out), cb(inp), n, stream()), "gelu_forward");
  }

  void gelu_backward(void* dinp, const void* inp, const void* dout, size_t n) override {
    if (!enter()) return;
    check(launch_gelu_backward(mb(dinp), cb(inp), cb(dout), n, stream()), "gelu_backward");
  }

  void residual_forward(void* out, const void* a, const void* b, size_t n) override {
    if (!enter()) return;
    check(launch_residual_forward(mb(out), cb(a), cb(b), n, stream()), "residual_forward");
  }

  using Backend::crossentropy_backward;
  using Backend::crossentropy_forward;
  void crossentropy_forward(float* losses, const void* logits, const int32_t* targets, int N, int V,
                            int ld) override {
    if (!enter()) return;
    if (ld < V) return record_invalid("crossentropy_forward", ld, V);
    // Read-only: the kernel writes logits only when given a scale.
    check(launch_crossentropy(losses, const_cast<bf16*>(cb(logits)), targets, N, V, ld, false, 0.0f, stream()),
          "crossentropy_forward");
  }

  void crossentropy_backward(float* losses, void* logits_to_dlogits, const int32_t* targets, int N, int V, int ld,
                             float dloss_scale) override {
    if (!enter()) return;
    if (ld < V) return record_invalid("crossentropy_backward", ld, V);
    check(launch_crossentropy(losses, mb(logits_to_dlogits), targets, N, V, ld, true, dloss_scale, stream()),
          "crossentropy_backward");
  }
  void record_invalid(const char* what, int ld, int V) {
    record(Status::invalid_argument(std::string(what) + ": row stride " + std::to_string(ld) +
                                    " is below the row length " + std::to_string(V)),
           what);
  }

  // squared_norm and adamw go to the queue, which holds a run of them back for
  // multi-tensor launches (ComputeQueue).
  void squared_norm(float* out_sq, const void* grad, size_t n) override {
    if (!enter()) return;
    void* s = scratch(squared_norm_scratch_bytes(), "squared_norm");
    if (s == nullptr) return;
    queue_.squared_norm({out_sq, cb(grad), n}, s, workspace_bytes_);
  }

  void clip_scale(float* scale_norm, const float* sq, int P, float max_norm) override {
    if (!enter()) return;
    check(launch_clip_scale(scale_norm, sq, P, max_norm, stream()), "clip_scale");
  }

  void adamw(void* param, float* master, float* m, float* v, const void* grad, const float* scale_norm, size_t n,
             const AdamWHyper& hyper) override {
    if (!enter()) return;
    queue_.adamw({mb(param), master, m, v, cb(grad), scale_norm, n, hyper});
  }

 private:
  // Makes this backend's device current for the calling thread.
  bool enter() { return check(cudaSetDevice(device_), "cudaSetDevice"); }
  // The compute stream, the copies and the pending work `which` says (every collective
  // on its own stream, and with Join::All the AdamW batches on theirs); then the first
  // error recorded since the last call, if any (reported once), else the first error of
  // these waits.
  Status synchronize_all(ComputeQueue::Join which) {
    Status first;
    auto keep = [&](Status s) {
      if (!s.is_ok() && first.is_ok()) static_cast<void>(first = std::move(s));
    };
    keep(cuda_status("cudaSetDevice", cudaSetDevice(device_)));
    keep(queue_.join_pending(which));
    keep(cuda_status("cudaStreamSynchronize (compute)", cudaStreamSynchronize(stream())));
    keep(copy_.wait_all());
    {
      std::lock_guard<std::mutex> lock(err_mu_);
      if (!error_.is_ok()) {
        // The recorded error happened first: report it, then forget it.
        Status recorded = error_;
        static_cast<void>(error_ = Status::ok());
        return recorded;
      }
    }
    return first;
  }
  // The compute stream, after the held-back optimizer calls were launched: every op
  // and copy on it goes through here (ComputeQueue).
  cudaStream_t stream() { return queue_.stream(); }

 public:
  ComputeQueue::Launches optimizer_launches() { return queue_.launches(); }

 private:

  bool check(cudaError_t e, const char* what) {
    if (e == cudaSuccess) return true;
    record(cuda_status(what, e), nullptr);
    return false;
  }

  void record(Status s, const char* what) {
    if (s.is_ok()) return;
    std::lock_guard<std::mutex> lock(err_mu_);
    if (error_.is_ok()) static_cast<void>(error_ = what ? s.with_context(what) : std::move(s));
  }

  bool leading_dim_ok(int ld, int OC, const char* what) {
    if (ld < OC) {
      record(Status::invalid_argument("leading dimension " + std::to_string(ld) + " is below OC=" +
                                      std::to_string(OC)),
             what);
      return false;
    }
    return true;
  }

  bool attention_shape_ok(int C, int NH, int KVH, const char* what) {
    if (NH <= 0 || C % NH != 0) {
      record(Status::invalid_argument("C=" + std::to_string(C) + " is not a multiple of NH=" + std::to_string(NH)),
             what);
      return false;
    }
    if (KVH <= 0 || NH % KVH != 0) {
      record(Status::invalid_argument("KVH=" + std::to_string(KVH) + " key/value heads do not divide NH=" +
                                      std::to_string(NH)),
             what);
      return false;
    }
    if (C / NH > kMaxHeadDim) {
      record(Status::unsupported("head dim " + std::to_string(C / NH) + " is over the CUDA kernels' limit of " +
                                 std::to_string(kMaxHeadDim)),
             what);
      return false;
    }
    return true;
  }

  // RoPE forward (sign 1) or backward (sign -1), frequencies from rope_inv_freq.
  void run_rope(void* out, const void* inp, int B, int T, int NH, int KVH, int D, const RopeParams& rope, float sign,
                const char* what) {
    if (!enter()) return;
    if (NH <= 0 || KVH <= 0 || NH % KVH != 0 || D <= 0 || D % 2 != 0 || D > kMaxRopeHeadDim) {
      record(Status::invalid_argument("NH=" + std::to_string(NH) + ", KVH=" + std::to_string(KVH) + ", D=" +
                                      std::to_string(D) + ": need KVH dividing NH and an even D of at most " +
                                      std::to_string(kMaxRopeHeadDim)),
             what);
      return;
    }
    float inv_freq[kMaxRopeHeadDim / 2];
    for (int i = 0; i < D / 2; ++i) inv_freq[i] = rope_inv_freq(rope, D, i);
    check(launch_rope(mb(out), cb(inp), B, T, NH, KVH, D, inv_freq, sign, stream()), what);
  }

  // Scratch from the start of the workspace the caller gave (ops run in stream
  // order, so one buffer serves them all). Null, with an Internal error recorded,
  // when the workspace is smaller than the op needs: nothing is allocated here.
  void* scratch(size_t bytes, const char* what) {
    if (workspace_ != nullptr && bytes <= workspace_bytes_) return workspace_;
    record(workspace_short(what, bytes), nullptr);
    return nullptr;
  }
  // Points cuBLASLt at the workspace past `offset` bytes of scratch.
  bool lt_workspace(size_t offset, const char* what) {
    if (workspace_ == nullptr || offset + kLtWorkspaceBytes > workspace_bytes_) {
      record(workspace_short(what, offset + kLtWorkspaceBytes), nullptr);
      return false;
    }
    mm_.set_workspace(static_cast<char*>(workspace_) + offset, kLtWorkspaceBytes);
    return true;
  }
  Status workspace_short(const char* what, size_t need) const {
    return Status::internal(std::string("cuda backend: op ") + what + " needs " + format_size(need) + " (" +
                            std::to_string(need) + " bytes) of workspace, but the workspace given holds " +
                            format_size(workspace_bytes_) + " (" + std::to_string(workspace_bytes_) +
                            " bytes); the plan reserved too little (Backend::set_workspace)");
  }
  // Device memory in use, sampled after each allocation: the peak of the process's
  // own allocations (what it frees again is never above a sample taken after it).
  void sample_peak() {
    const size_t used = device_used_bytes();
    size_t seen = peak_used_.load();
    while (used > seen && !peak_used_.compare_exchange_weak(seen, used)) {
    }
  }

  int device_ = 0;
  unsigned schedule_flags_ = cudaDeviceScheduleAuto;  // SPILLWAY_CUDA_SCHEDULE, set at init
  bool sm90_ = false;                                   // compute capability 9.0 (wgmma kernels apply)
  AttentionKernel attention_kernel_ = AttentionKernel::kAuto;  // SPILLWAY_CUDA_ATTENTION, set at init
  bool gelu_epilogue_ = true;                                   // SPILLWAY_CUDA_GELU_EPILOGUE, set at init
  bool pinned_register_ = false;                                // SPILLWAY_CUDA_PINNED_REGISTER, set at init
  std::mutex registered_mu_;
  std::map<void*, size_t> registered_;  // host_alloc_registered's regions and their mapped lengths
  bool residual_epilogue_ = true;                               // SPILLWAY_CUDA_RESIDUAL_EPILOGUE, set at init
  bool bias_epilogue_ = true;                                   // SPILLWAY_CUDA_BIAS_EPILOGUE, set at init
  std::string gpu_name_;
  size_t capacity_ = 0;
  ComputeQueue queue_;                // the compute stream, and the optimizer calls held back
  size_t fixed_bytes_ = 0;            // device_used_bytes() when init() ended (handles, stack)
  size_t baseline_used_ = 0;          // device bytes in use right after context creation
  std::atomic<size_t> peak_used_{0};  // the most device_used_bytes() seen (sampled)
  void* workspace_ = nullptr;         // given by set_workspace: scratch, then cuBLASLt's
  size_t workspace_bytes_ = 0;
  void* own_workspace_ = nullptr;     // from use_own_workspace
  LtMatmul mm_;
  CudaCopyEngine copy_;
  StallTimer stall_;  // the stall probes' events, on the compute stream
  std::mutex err_mu_;
  Status error_;
};

}  // namespace

int cuda_device_count() {
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();  // clear the runtime's last-error slot
    return 0;
  }
  return count;
}

bool cuda_device_present() { return cuda_device_count() > 0; }

Result<CudaOptimizerLaunches> cuda_optimizer_launches(Backend& backend) {
  auto* cuda = dynamic_cast<CudaBackend*>(&backend);
  if (cuda == nullptr)
    return Status::invalid_argument("cuda_optimizer_launches: the " + backend.name() + " backend is not CUDA");
  const ComputeQueue::Launches l = cuda->optimizer_launches();
  return CudaOptimizerLaunches{l.squared_norm, l.adamw};
}

Result<size_t> cuda_pending_collectives(Backend& backend) {
  auto* cuda = dynamic_cast<CudaBackend*>(&backend);
  if (cuda == nullptr)
    return Status::invalid_argument("cuda_pending_collectives: the " + backend.name() + " backend is not CUDA");
  return cuda->pending_collectives();
}

Result<std::unique_ptr<Backend>> make_cuda_backend(const BackendOptions& options) {
  auto backend = std::make_unique<CudaBackend>();
  Status s = backend->init(options);
  if (!s.is_ok()) return s.with_context("CUDA backend");
  return std::unique_ptr<Backend>(std::move(backend));
}

}  // namespace spillway
