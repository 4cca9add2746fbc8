#include "train/schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace spillway {

float LrSchedule::at(int64_t step) const {
  const double p = peak;
  const double lo = p * min_ratio;
  if (warmup_steps > 0 && step <= warmup_steps) {
    return static_cast<float>(p * static_cast<double>(std::max<int64_t>(step, 1)) /
                              static_cast<double>(warmup_steps));
  }
  const int64_t decay_steps = total_steps - warmup_steps;
  if (decay_steps <= 0) return static_cast<float>(p);  // all warmup: stay at the peak after it
  if (step >= total_steps) return static_cast<float>(lo);
  const double progress = static_cast<double>(step - warmup_steps) / static_cast<double>(decay_steps);
  return static_cast<float>(lo + (p - lo) * 0.5 * (1.0 + std::cos(std::numbers::pi * progress)));
}

}  // namespace spillway
