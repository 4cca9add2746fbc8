// Host AdamW: hyper-parameters, kernel choice, tiling over threads, clipping and
// bf16 helpers. The per-element arithmetic is in adamw_kernel.h; the SIMD bodies
// in adamw_avx2.cpp and adamw_avx512.cpp.
#include "optim/adamw.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>

#include "core/thread_pool.h"
#include "optim/adamw_kernel.h"

namespace spillway {

using optim_detail::AdamWRange;

namespace {

// beta^step in double by repeated squaring: only IEEE multiplies, so the same
// bits on every machine and library.
double power(double base, int64_t exp) {
  double result = 1.0;
  while (exp > 0) {
    if (exp & 1) result *= base;
    base *= base;
    exp >>= 1;
  }
  return result;
}

// Elements per tile of the threaded loop: a multiple of 64, so that every tile of
// an aligned array starts on a 64-byte line (needed by the streaming stores).
constexpr size_t kTile = size_t{1} << 14;
// Below this many elements one thread does the whole update.
constexpr size_t kParallelMin = size_t{1} << 18;
// At or above this many elements the state cannot stay in cache, so param, which
// is only written, goes out with non-temporal stores: same bits, no read for
// ownership. In place, master, m and v were just read, so their lines are in cache
// already (streaming them measured slower); out of place (adamw_host_into's separate
// outputs, the speculative update) their lines are not, and they are streamed too.
constexpr size_t kStreamMin = size_t{1} << 22;

bool cpu_has(SimdLevel s) {
  switch (s) {
    case SimdLevel::Scalar: return true;
    case SimdLevel::Avx2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case SimdLevel::Avx512: return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  }
  return false;
}

SimdLevel best_level() {
  if (cpu_has(SimdLevel::Avx512)) return SimdLevel::Avx512;
  if (cpu_has(SimdLevel::Avx2)) return SimdLevel::Avx2;
  return SimdLevel::Scalar;
}

std::atomic<SimdLevel>& level_slot() {
  static std::atomic<SimdLevel> level{best_level()};
  return level;
}

using RangeKernel = void (*)(DType, const AdamWRange&, size_t, size_t, bool);

RangeKernel kernel_for(SimdLevel s) {
  switch (s) {
    case SimdLevel::Avx512: return optim_detail::adamw_range_avx512;
    case SimdLevel::Avx2: return optim_detail::adamw_range_avx2;
    case SimdLevel::Scalar: break;
  }
  return optim_detail::adamw_range_scalar;
}

bool aligned64(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 63u) == 0; }

}  // namespace

namespace optim_detail {

void adamw_range_scalar(DType dtype, const AdamWRange& r, size_t begin, size_t end, bool /*stream*/) {
  if (dtype == DType::BF16)
    for (size_t i = begin; i < end; ++i) adamw_element<true>(r, i);
  else
    for (size_t i = begin; i < end; ++i) adamw_element<false>(r, i);
}

void adamw_range_skip(DType dtype, const AdamWRange& r, size_t begin, size_t end, bool /*stream*/) {
  const size_t bytes = (end - begin) * sizeof(float);
  // In place the state is left as it is (not rewritten); out of place it is copied.
  if (r.master_out != r.master_in) std::memcpy(r.master_out + begin, r.master_in + begin, bytes);
  if (r.m_out != r.m_in) std::memcpy(r.m_out + begin, r.m_in + begin, bytes);
  if (r.v_out != r.v_in) std::memcpy(r.v_out + begin, r.v_in + begin, bytes);
  if (dtype == DType::BF16) {
    auto* param = static_cast<uint16_t*>(r.param);
    for (size_t i = begin; i < end; ++i) param[i] = round_bf16(float_bits(r.master_in[i]));
  } else {
    std::memcpy(static_cast<float*>(r.param) + begin, r.master_in + begin, bytes);
  }
}

}  // namespace optim_detail

AdamWHyper adamw_hyper(float lr, int64_t step, float weight_decay, float beta1, float beta2, float eps) {
  AdamWHyper h;
  h.lr = lr;
  h.beta1 = beta1;
  h.beta2 = beta2;
  h.one_minus_beta1 = static_cast<float>(1.0 - static_cast<double>(beta1));
  h.one_minus_beta2 = static_cast<float>(1.0 - static_cast<double>(beta2));
  h.eps = eps;
  h.weight_decay = weight_decay;
  h.bias_correction1 = static_cast<float>(1.0 - power(beta1, step));
  h.bias_correction2 = static_cast<float>(1.0 - power(beta2, step));
  return h;
}

SimdLevel adamw_simd_level() { return level_slot().load(std::memory_order_relaxed); }

const char* simd_level_name(SimdLevel s) {
  switch (s) {
    case SimdLevel::Scalar: return "scalar";
    case SimdLevel::Avx2: return "avx2";
    case SimdLevel::Avx512: return "avx512";
  }
  return "?";
}

bool adamw_force_simd_level(SimdLevel s) {
  if (!cpu_has(s)) return false;
  level_slot().store(s, std::memory_order_relaxed);
  return true;
}

void adamw_host_into(DType param_dtype, void* param, const float* master_in, const float* m_in, const float* v_in,
                     float* master_out, float* m_out, float* v_out, const void* grad, const float* scale_norm,
                     size_t n, const AdamWHyper& hyper) {
  if (n == 0) return;
  AdamWRange r{param, master_in, m_in, v_in, master_out, m_out, v_out, grad, scale_norm[0], hyper};
  // A skipped step (non-finite norm): param = rounded master, the rest untouched.
  const RangeKernel kernel =
      adamw_step_skipped(scale_norm) ? optim_detail::adamw_range_skip : kernel_for(adamw_simd_level());
  const bool stream = n >= kStreamMin && aligned64(param);
  r.stream_state = stream && master_out != master_in && m_out != m_in && v_out != v_in && aligned64(master_out) &&
                   aligned64(m_out) && aligned64(v_out);
  if (n < kParallelMin) {
    kernel(param_dtype, r, 0, n, stream);
    return;
  }
  ThreadPool& pool = global_thread_pool();
  const int64_t tiles = static_cast<int64_t>((n + kTile - 1) / kTile);
  // Tiles handed out as threads come free (elementwise: the bits do not depend on
  // which thread updates which tile): one thread the scheduler preempts holds up a
  // tile, not its share of the tensor.
  pool.parallel_tiles(tiles, [&](int64_t t0, int64_t t1) {
    size_t begin = static_cast<size_t>(t0) * kTile;
    size_t end = std::min(n, static_cast<size_t>(t1) * kTile);
    kernel(param_dtype, r, begin, end, stream);
  });
}

void adamw_host(DType param_dtype, void* param, float* master, float* m, float* v, const void* grad,
                const float* scale_norm, size_t n, const AdamWHyper& hyper) {
  adamw_host_into(param_dtype, param, master, m, v, master, m, v, grad, scale_norm, n, hyper);
}

void clip_scale_host(float* scale_norm, const float* squared_norms, int P, float max_norm) {
  double sum = 0;
  for (int i = 0; i < P; ++i) sum += static_cast<double>(squared_norms[i]);
  double norm = std::sqrt(sum);
  double scale = norm > static_cast<double>(max_norm) ? static_cast<double>(max_norm) / (norm + 1e-6) : 1.0;
  if (!std::isfinite(norm)) scale = std::numeric_limits<double>::quiet_NaN();  // the step is skipped
  scale_norm[0] = static_cast<float>(scale);
  scale_norm[1] = static_cast<float>(norm);
}

uint16_t float_to_bf16(float f) { return optim_detail::round_bf16(optim_detail::float_bits(f)); }

float bf16_to_float(uint16_t b) { return optim_detail::bits_float(static_cast<uint32_t>(b) << 16); }

}  // namespace spillway
