// AdamW range kernel with AVX-512 (16 floats a vector), compiled for that target
// only in the functions below; adamw.cpp calls it when the CPU has AVX-512.
// GCC 12's AVX-512 intrinsics read an intentionally undefined vector
// (_mm512_undefined_*), which -Wmaybe-uninitialized reports (GCC bug 105593).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include "optim/adamw_kernel.h"

namespace spillway::optim_detail {
namespace {

#define SPILLWAY_AVX512 __attribute__((target("avx512f,avx512bw")))

template <bool kBf16, bool kStream, bool kStreamState = false>
SPILLWAY_AVX512 void run(const AdamWRange& r, size_t i, size_t end) {
  const AdamWHyper& h = r.h;
  const __m512 scale = _mm512_set1_ps(r.scale);
  const __m512 beta1 = _mm512_set1_ps(h.beta1);
  const __m512 beta2 = _mm512_set1_ps(h.beta2);
  const __m512 omb1 = _mm512_set1_ps(h.one_minus_beta1);
  const __m512 omb2 = _mm512_set1_ps(h.one_minus_beta2);
  const __m512 bc1 = _mm512_set1_ps(h.bias_correction1);
  const __m512 bc2 = _mm512_set1_ps(h.bias_correction2);
  const __m512 eps = _mm512_set1_ps(h.eps);
  const __m512 neg_lr = _mm512_set1_ps(-h.lr);
  const __m512 wd = _mm512_set1_ps(h.weight_decay);
  const __m512i one = _mm512_set1_epi32(1);
  const __m512i round_bias = _mm512_set1_epi32(0x7fff);
  const __m512i quiet = _mm512_set1_epi32(0x0040);
  for (; i + 16 <= end; i += 16) {
    prefetch_ahead(r.m_in + i);
    prefetch_ahead(r.v_in + i);
    prefetch_ahead(r.master_in + i);
    prefetch_ahead(static_cast<const char*>(r.grad) + i * (kBf16 ? 2 : 4));
    __m512 g;
    if constexpr (kBf16) {
      __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(r.grad) + i));
      g = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
    } else {
      g = _mm512_loadu_ps(static_cast<const float*>(r.grad) + i);
    }
    g = _mm512_mul_ps(g, scale);
    __m512 m = _mm512_fmadd_ps(beta1, _mm512_loadu_ps(r.m_in + i), _mm512_mul_ps(omb1, g));
    __m512 v = _mm512_fmadd_ps(beta2, _mm512_loadu_ps(r.v_in + i), _mm512_mul_ps(_mm512_mul_ps(omb2, g), g));
    __m512 mhat = _mm512_div_ps(m, bc1);
    __m512 vhat = _mm512_div_ps(v, bc2);
    __m512 upd = _mm512_div_ps(mhat, _mm512_add_ps(_mm512_sqrt_ps(vhat), eps));
    __m512 w0 = _mm512_loadu_ps(r.master_in + i);
    __m512 w = _mm512_fmadd_ps(neg_lr, _mm512_fmadd_ps(wd, w0, upd), w0);
    if constexpr (kStreamState) {
      _mm512_stream_ps(r.m_out + i, m);
      _mm512_stream_ps(r.v_out + i, v);
      _mm512_stream_ps(r.master_out + i, w);
    } else {
      _mm512_storeu_ps(r.m_out + i, m);
      _mm512_storeu_ps(r.v_out + i, v);
      _mm512_storeu_ps(r.master_out + i, w);
    }
    if constexpr (kBf16) {
      // Round to nearest even: bits + 0x7fff + lsb, keep the top half; NaN: quieted top half.
      __m512i bits = _mm512_castps_si512(w);
      __m512i top = _mm512_srli_epi32(bits, 16);
      __m512i rounded = _mm512_srli_epi32(
          _mm512_add_epi32(_mm512_add_epi32(bits, round_bias), _mm512_and_si512(top, one)), 16);
      __mmask16 nan = _mm512_cmp_ps_mask(w, w, _CMP_UNORD_Q);
      rounded = _mm512_mask_blend_epi32(nan, rounded, _mm512_or_si512(top, quiet));
      __m256i out = _mm512_cvtepi32_epi16(rounded);
      auto* dst = reinterpret_cast<__m256i*>(static_cast<uint16_t*>(r.param) + i);
      if constexpr (kStream)
        _mm256_stream_si256(dst, out);
      else
        _mm256_storeu_si256(dst, out);
    } else {
      float* dst = static_cast<float*>(r.param) + i;
      if constexpr (kStream)
        _mm512_stream_ps(dst, w);
      else
        _mm512_storeu_ps(dst, w);
    }
  }
  for (; i < end; ++i) adamw_element<kBf16>(r, i);
  if constexpr (kStream) _mm_sfence();
}

}  // namespace

SPILLWAY_AVX512 void adamw_range_avx512(DType dtype, const AdamWRange& r, size_t begin, size_t end, bool stream) {
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
