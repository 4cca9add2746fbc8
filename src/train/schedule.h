// Learning-rate schedule: linear warmup, then cosine decay to a tenth of the peak.
//
//   LrSchedule s{.peak = 6e-4f, .warmup_steps = 20, .total_steps = 500};
//   float lr = s.at(1);      // 3e-5: the first warmup step (peak * 1 / 20)
//   s.at(20);                // 6e-4: the peak, at the end of the warmup
//   s.at(500);               // 6e-5: the last step, peak * min_ratio
//
// Steps count from 1. During warmup (step <= warmup_steps) the rate rises linearly
// to the peak: peak * step / warmup_steps. After it, the rate follows half a cosine
// from the peak down to peak * min_ratio, reached at total_steps:
//   progress = (step - warmup_steps) / (total_steps - warmup_steps)
//   lr       = min + (peak - min) * 0.5 * (1 + cos(pi * progress))
// Steps past total_steps keep the minimum. Everything is computed in double and
// rounded to float once, so the same step always gives the same bits.
#pragma once

#include <cstdint>

namespace spillway {

struct LrSchedule {
  float peak = 6e-4f;
  int64_t warmup_steps = 0;
  int64_t total_steps = 1;
  double min_ratio = 0.1;

  float at(int64_t step) const;
};

}  // namespace spillway
