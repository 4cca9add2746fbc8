// Whether a CUDA GPU is present, for tests that skip themselves without one (as in CI).
//
//   if (!testing_support::gpu_present()) GTEST_SKIP() << "no CUDA GPU on this machine";
#pragma once

#ifdef SPILLWAY_HAVE_CUDA
#include "backend/cuda/cuda_backend.h"
#endif

namespace spillway::testing_support {

inline bool gpu_present() {
#ifdef SPILLWAY_HAVE_CUDA
  return cuda_device_present();
#else
  return false;
#endif
}

}  // namespace spillway::testing_support
