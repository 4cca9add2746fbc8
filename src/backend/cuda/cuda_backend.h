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

}  // namespace spillway
