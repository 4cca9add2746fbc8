// make_backend: picks the CPU or the CUDA backend by name.
#include "backend/backend.h"

#include <cstdlib>

#include "backend/cpu/cpu_backend.h"
#ifdef SPILLWAY_HAVE_CUDA
#include "backend/cuda/cuda_backend.h"
#endif

namespace spillway {

namespace {
// Kernel code loaded at context creation rather than at each kernel's first launch,
// so that it is part of the context that device_used_bytes() leaves out, not device
// memory appearing in the middle of a step. Before the first CUDA call (the driver
// reads it once); a user's own setting wins.
void load_kernels_with_the_context() {
#ifdef SPILLWAY_HAVE_CUDA
  ::setenv("CUDA_MODULE_LOADING", "EAGER", 0);
#endif
}
}  // namespace

bool cuda_available() {
#ifdef SPILLWAY_HAVE_CUDA
  load_kernels_with_the_context();
  return cuda_device_present();
#else
  return false;
#endif
}

Result<std::unique_ptr<Backend>> make_backend(const std::string& name, const BackendOptions& options) {
  if (name == "cpu") return make_cpu_backend(options);
  load_kernels_with_the_context();
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
