// rope_inv_freq (tensor/rope.h), in double as transformers' formulas read.
#include "tensor/rope.h"

#include <cmath>

namespace spillway {

float rope_inv_freq(const RopeParams& r, int D, int i) {
  const double inv = 1.0 / std::pow(static_cast<double>(r.theta), static_cast<double>(2 * i) / D);
  if (!r.llama3) return static_cast<float>(inv);
  const double pi = 3.14159265358979323846;
  const double context = r.original_context;
  const double low_wl = context / r.low_freq_factor, high_wl = context / r.high_freq_factor;
  const double wavelen = 2 * pi / inv;
  if (wavelen > low_wl) return static_cast<float>(inv / r.factor);
  if (wavelen < high_wl) return static_cast<float>(inv);
  const double smooth = (context / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor);
  return static_cast<float>((1 - smooth) * inv / r.factor + smooth * inv);
}

}  // namespace spillway
