// Wall-clock intervals on the steady clock, in seconds.
//
//   const auto t0 = std::chrono::steady_clock::now();
//   run_step();
//   double s = seconds_since(t0);   // 0.2641
#pragma once

#include <chrono>

namespace spillway {

inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace spillway
