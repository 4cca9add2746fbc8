// AdamW, with one exact arithmetic shared by the host SIMD kernel and every
// device kernel, so that an update gives the same bits wherever it runs.
//
//   AdamWHyper h = adamw_hyper(/*lr=*/6e-4f, /*step=*/1, /*weight_decay=*/0.1f);
//   float scale_norm[2];
//   clip_scale_host(scale_norm, squared_norms, P, 1.0f);
//   adamw_host(DType::F32, param, master, m, v, grad, scale_norm, n, h);
//
// The arithmetic, per element, in F32 with each operation rounded once
// (fma = fused multiply-add, one rounding):
//   g      = float(grad[i]) * scale_norm[0]
//   m      = fma(beta1, m, one_minus_beta1 * g)
//   v      = fma(beta2, v, (one_minus_beta2 * g) * g)
//   mhat   = m / bias_correction1
//   vhat   = v / bias_correction2
//   upd    = mhat / (sqrt(vhat) + eps)
//   master = fma(-lr, fma(weight_decay, master, upd), master)
//   param  = master rounded to the param dtype (round to nearest even for BF16)
// The F32 constants come from adamw_hyper (computed in double, rounded once).
//
// Clipping: clip_scale reads the P per-tensor squared norms, sums them in index
// order in double, norm = sqrt(sum); scale = max_norm / (norm + 1e-6) when
// norm > max_norm, else 1. Outputs {scale, norm} as F32.
//
// A step with a non-finite gradient norm is skipped, not applied: when the norm is
// NaN or infinite, clip_scale writes scale = NaN (and the norm as it is), and every
// AdamW kernel (host scalar and SIMD, device) given a non-finite scale changes
// nothing: master, m and v keep their bits and param is rewritten as master rounded
// to the param dtype — the value it held before the step, since param is always the
// rounded master (param is write-only in the step, so it must be written). A finite
// scale takes the arithmetic above unchanged, so normal runs keep their bits.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "tensor/tensor.h"

namespace spillway {

struct AdamWHyper {
  float lr = 0;
  float beta1 = 0.9f;
  float beta2 = 0.95f;
  float one_minus_beta1 = 0.1f;
  float one_minus_beta2 = 0.05f;
  float eps = 1e-8f;
  float weight_decay = 0;
  float bias_correction1 = 1;  // 1 - beta1^step
  float bias_correction2 = 1;  // 1 - beta2^step
};

// step counts from 1.
AdamWHyper adamw_hyper(float lr, int64_t step, float weight_decay, float beta1 = 0.9f,
                       float beta2 = 0.95f, float eps = 1e-8f);

// Which host kernel adamw_host uses: chosen once at run time from the CPU's features.
enum class SimdLevel { Scalar, Avx2, Avx512 };
SimdLevel adamw_simd_level();
const char* simd_level_name(SimdLevel s);
// Forces a level (tests compare levels); returns false if the CPU lacks it.
bool adamw_force_simd_level(SimdLevel s);

// Host AdamW over n elements; param/grad in `param_dtype` (F32 or BF16).
// Multithreaded over fixed tiles when n is large; the result does not depend on
// the thread count.
void adamw_host(DType param_dtype, void* param, float* master, float* m, float* v, const void* grad,
                const float* scale_norm, size_t n, const AdamWHyper& hyper);

// Out of place: reads master_in, m_in, v_in and writes the updated values to
// master_out, m_out, v_out (each may equal its _in: then it is adamw_host;
// otherwise the two must not overlap); param and grad as in adamw_host. The same
// bits as adamw_host for every SIMD level and thread count. A skipped step
// (non-finite scale) writes param = master_in rounded and copies master_in, m_in,
// v_in to the outputs unchanged.
void adamw_host_into(DType param_dtype, void* param, const float* master_in, const float* m_in, const float* v_in,
                     float* master_out, float* m_out, float* v_out, const void* grad, const float* scale_norm,
                     size_t n, const AdamWHyper& hyper);

// scale_norm[0] = NaN when the norm is not finite: the step is skipped (see above).
void clip_scale_host(float* scale_norm, const float* squared_norms, int P, float max_norm);
// True when scale_norm[0] from clip_scale marks a skipped step (it is not finite).
inline bool adamw_step_skipped(const float* scale_norm) { return !std::isfinite(scale_norm[0]); }

// bf16 helpers (round to nearest even; NaN stays NaN).
uint16_t float_to_bf16(float f);
float bf16_to_float(uint16_t b);

}  // namespace spillway
