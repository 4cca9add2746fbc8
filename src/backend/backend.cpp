// make_backend: picks the CPU or the CUDA backend by name.
#include "backend/backend.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>

#include "backend/cpu/cpu_backend.h"
#ifdef SPILLWAY_HAVE_CUDA
#include "backend/cuda/cuda_backend.h"
#endif

namespace spillway {

// Kernel code is loaded lazily (CUDA's default). EAGER loading was tried so that
// code would count as part of the context, but it loads all of cuBLASLt's kernels
// when its handle is made: 338 MiB of device memory on the H200 for kernels a run
// never uses (cudaMemGetInfo, 2026-12-03).

// Host-timed stall probes (the CPU backend, where compute runs on the host thread).
namespace {
double steady_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
}  // namespace

Backend::StallProbe Backend::begin_stall_probe() { return StallProbe{0, steady_seconds()}; }

void Backend::end_stall_probe(StallProbe probe) { host_stall_s_ += std::max(0.0, steady_seconds() - probe.start); }

Result<double> Backend::take_stall_seconds() {
  const double s = host_stall_s_;
  host_stall_s_ = 0;
  return s;
}

// The CPU backend's ops complete on the host before they return: a stream that runs
// after the host waited for them (synchronize) runs after them.
Status Backend::order_stream_after_compute(void* stream) {
  (void)stream;
  return synchronize();
}

Status Backend::order_after_stream(void* stream, const std::vector<DeviceRange>& ranges) {
  (void)ranges;
  if (stream == nullptr) return Status::ok();
  return Status::unsupported("the " + name() +
                             " backend has no streams: it cannot order its compute after work on a stream; "
                             "use a communicator whose calls complete before they return");
}

bool cuda_available() {
#ifdef SPILLWAY_HAVE_CUDA
  return cuda_device_present();
#else
  return false;
#endif
}

int cuda_gpu_count() {
#ifdef SPILLWAY_HAVE_CUDA
  return cuda_device_count();
#else
  return 0;
#endif
}

Result<std::unique_ptr<Backend>> make_backend(const std::string& name, const BackendOptions& options) {
  if (name == "cpu") return make_cpu_backend(options);
  if (name == "cuda") {
#ifdef SPILLWAY_HAVE_CUDA
    if (!cuda_device_present())
      return Status::unsupported("backend 'cuda': the CUDA runtime finds no GPU on this machine; use --backend cpu");
    return make_cuda_backend(options);
#else
    return Status::unsupported(
        "this spillway was built without CUDA (nvcc not found at build time); use --backend cpu");
#endif
  }
  if (name == "auto") {
#ifdef SPILLWAY_HAVE_CUDA
    if (cuda_device_present()) return make_cuda_backend(options);
#endif
    return make_cpu_backend(options);
  }
  return Status::invalid_argument("unknown backend '" + name + "': expected cpu, cuda or auto");
}

}  // namespace spillway
