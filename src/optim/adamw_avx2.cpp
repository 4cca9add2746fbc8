// AdamW range kernel with AVX2 and FMA (8 floats a vector), compiled for that
// target only in the functions below; adamw.cpp calls it when the CPU has both.
#include <immintrin.h>

#include "optim/adamw_kernel.h"

namespace spillway::optim_detail {
namespace {

#define SPILLWAY_AVX2 __attribute__((target("avx2,fma")))

template <bool kBf16, bool kStream, bool kStreamState = false>
SPILLWAY_AVX2 void run(const AdamWRange& r, size_t i, size_t end) {
  const AdamWHyper& h = r.h;
  const __m256 scale = _mm256_set1_ps(r.scale);
  const __m256 beta1 = _mm256_set1_ps(h.beta1);
  const __m256 beta2 = _mm256_set1_ps(h.beta2);
  const __m256 omb1 = _mm256_set1_ps(h.one_minus_beta1);
  const __m256 omb2 = _mm256_set1_ps(h.one_minus_beta2);
  const __m256 bc1 = _mm256_set1_ps(h.bias_correction1);
  const __m256 bc2 = _mm256_set1_ps(h.bias_correction2);
  const __m256 eps = _mm256_set1_ps(h.eps);
  const __m256 neg_lr = _mm256_set1_ps(-h.lr);
  const __m256 wd = _mm256_set1_ps(h.weight_decay);
  const __m256i one = _mm256_set1_epi32(1);
  const __m256i round_bias = _mm256_set1_epi32(0x7fff);
  const __m256i quiet = _mm256_set1_epi32(0x0040);
  for (; i + 8 <= end; i += 8) {
    prefetch_ahead(r.m_in + i);
    prefetch_ahead(r.v_in + i);
    prefetch_ahead(r.master_in + i);
    prefetch_ahead(static_cast<const char*>(r.grad) + i * (kBf16 ? 2 : 4));
    __m256 g;
    if constexpr (kBf16) {
      __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(r.grad) + i));
      g = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
    } else {
      g = _mm256_loadu_ps(static_cast<const float*>(r.grad) + i);
    }
    g = _mm256_mul_ps(g, scale);
    __m256 m = _mm256_fmadd_ps(beta1, _mm256_loadu_ps(r.m_in + i), _mm256_mul_ps(omb1, g));
    __m256 v = _mm256_fmadd_ps(beta2, _mm256_loadu_ps(r.v_in + i), _mm256_mul_ps(_mm256_mul_ps(omb2, g), g));
    __m256 mhat = _mm256_div_ps(m, bc1);
    __m256 vhat = _mm256_div_ps(v, bc2);
    __m256 upd = _mm256_div_ps(mhat, _mm256_add_ps(_mm256_sqrt_ps(vhat), eps));
    __m256 w0 = _mm256_loadu_ps(r.master_in + i);
    __m256 w = _mm256_fmadd_ps(neg_lr, _mm256_fmadd_ps(wd, w0, upd), w0);
    if constexpr (kStreamState) {
      _mm256_stream_ps(r.m_out + i, m);
      _mm256_stream_ps(r.v_out + i, v);
      _mm256_stream_ps(r.master_out + i, w);
    } else {
      _mm256_storeu_ps(r.m_out + i, m);
      _mm256_storeu_ps(r.v_out + i, v);
      _mm256_storeu_ps(r.master_out + i, w);
    }
    if constexpr (kBf16) {
      // Round to nearest even: bits + 0x7fff + lsb, keep the top half; NaN: quieted top half.
      __m256i bits = _mm256_castps_si256(w);
      __m256i top = _mm256_srli_epi32(bits, 16);
      __m256i rounded = _mm256_srli_epi32(
          _mm256_add_epi32(_mm256_add_epi32(bits, round_bias), _mm256_and_si256(top, one)), 16);
      __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(w, w, _CMP_UNORD_Q));
      rounded = _mm256_blendv_epi8(rounded, _mm256_or_si256(top, quiet), nan);
      // Every lane is in [0, 0xffff], so the unsigned-saturating pack keeps it; the
      // pack works per 128-bit half, the permute brings both halves' words together.
      __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(rounded, rounded), 0x08);
      __m128i out = _mm256_castsi256_si128(packed);
      auto* dst = reinterpret_cast<__m128i*>(static_cast<uint16_t*>(r.param) + i);
      if constexpr (kStream)
        _mm_stream_si128(dst, out);
      else
        _mm_storeu_si128(dst, out);
    } else {
      float* dst = static_cast<float*>(r.param) + i;
      if constexpr (kStream)
        _mm256_stream_ps(dst, w);
      else
        _mm256_storeu_ps(dst, w);
    }
  }
  for (; i < end; ++i) adamw_element<kBf16>(r, i);
  if constexpr (kStream) _mm_sfence();
}

}  // namespace

SPILLWAY_AVX2 void adamw_range_avx2(DType dtype, const AdamWRange& r, size_t begin, size_t end, bool stream) {
  if (dtype == DType::BF16) {
    if (stream && r.stream_state)
      run<true, true, true>(r, begin, end);
    else if (stream)
      run<true, true>(r, begin, end);
    else
      run<true, false>(r, begin, end);
  } else {
    if (stream && r.stream_state)
      run<false, true, true>(r, begin, end);
    else if (stream)
      run<false, true>(r, begin, end);
    else
      run<false, false>(r, begin, end);
  }
}

}  // namespace spillway::optim_detail
