// The CUDA backend: bf16 storage, fp32 accumulation, cuBLASLt matrix products,
// deterministic fused kernels, one compute stream and one stream per copy direction.
//
//   if (cuda_device_present()) {
//     auto b = make_cuda_backend({.device = 0});
//     if (!b) die(b.status());
//   }
//
// Built only where nvcc is found (SPILLWAY_HAVE_CUDA); make_backend("cuda") in
// backend.cpp calls these.
#pragma once

#include <memory>

#include "backend/backend.h"

namespace spillway {

Result<std::unique_ptr<Backend>> make_cuda_backend(const BackendOptions& options);
// True when the CUDA runtime finds at least one GPU (never throws, never aborts).
bool cuda_device_present();
// The GPUs the CUDA runtime finds (CUDA_VISIBLE_DEVICES applied); 0 on any error.
int cuda_device_count();

// The optimizer's launches: squared_norm and adamw calls are held back and a run of
// consecutive ones of a kind goes out as a few multi-tensor launches, bit-identical to
// one launch per tensor (SPILLWAY_CUDA_MULTI_TENSOR=0 at the backend's creation turns
// that off). The kernels these calls launched since the backend was made, after
// launching what is held back; InvalidArgument for a backend that is not CUDA.
struct CudaOptimizerLaunches {
  uint64_t squared_norm = 0;
  uint64_t adamw = 0;
};
Result<CudaOptimizerLaunches> cuda_optimizer_launches(Backend& backend);

// Collectives on their own stream (Backend::order_after_stream) that the compute
// stream has not waited for yet: each is waited for before the first op touching its
// tensors (Backend::order_compute_for), or by synchronize, upload, download and the
// copy engine's copies after compute. InvalidArgument for a backend that is not CUDA.
Result<size_t> cuda_pending_collectives(Backend& backend);

}  // namespace spillway
