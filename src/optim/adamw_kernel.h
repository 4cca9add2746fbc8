// Internal to optim: the per-element AdamW arithmetic of adamw.h in scalar form,
// shared by the scalar kernel and the scalar tails of the SIMD kernels, and the
// range kernels that adamw_host and adamw_host_into dispatch to.
//
//   AdamWRange r{param, master_in, m_in, v_in, master_out, m_out, v_out, grad, scale_norm[0], hyper};
//   adamw_range_avx512(DType::BF16, r, begin, end, /*stream=*/false);
//
// A range kernel updates elements [begin, end): a vector body, then a scalar tail
// that gives the same bits as the body would. It reads master, m and v only
// through the _in pointers and writes them only through the _out pointers; an
// _out equal to its _in is the in-place update (every element's inputs are read
// before its outputs are stored), otherwise the two must not overlap. `stream`
// asks for non-temporal stores of param, the one output that is always written
// without being read (no read for ownership); the caller passes it only when
// param is aligned to 64 bytes at `begin` (see adamw.cpp). With `stream` and
// r.stream_state (out of place only, all three _out arrays aligned to 64 bytes at
// `begin`), master, m and v go out the same way: out of place their lines are not
// in cache, and an ordinary store would first read each line it overwrites.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "optim/adamw.h"

namespace spillway::optim_detail {

struct AdamWRange {
  void* param;             // [n] param dtype
  const float* master_in;  // [n]
  const float* m_in;       // [n]
  const float* v_in;       // [n]
  float* master_out;       // [n] may equal master_in
  float* m_out;            // [n] may equal m_in
  float* v_out;            // [n] may equal v_in
  const void* grad;        // [n] param dtype
  float scale;         // scale_norm[0]
  AdamWHyper h;
  bool stream_state = false;  // out of place: master, m and v stored non-temporally too (with `stream`)
};

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round to nearest even; a NaN keeps its sign and top payload and is made quiet.
inline uint16_t round_bf16(uint32_t bits) {
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  uint32_t lsb = (bits >> 16) & 1u;
  return static_cast<uint16_t>((bits + 0x7fffu + lsb) >> 16);
}

// One element, in the order of adamw.h. Inlined into the SIMD kernels, where
// std::fma becomes the same fused instruction the vector body uses.
template <bool kBf16>
inline void adamw_element(const AdamWRange& r, size_t i) {
  const AdamWHyper& h = r.h;
  float gin;
  if constexpr (kBf16)
    gin = bits_float(static_cast<uint32_t>(static_cast<const uint16_t*>(r.grad)[i]) << 16);
  else
    gin = static_cast<const float*>(r.grad)[i];
  float g = gin * r.scale;
  float m = std::fma(h.beta1, r.m_in[i], h.one_minus_beta1 * g);
  float v = std::fma(h.beta2, r.v_in[i], (h.one_minus_beta2 * g) * g);
  float mhat = m / h.bias_correction1;
  float vhat = v / h.bias_correction2;
  float upd = mhat / (std::sqrt(vhat) + h.eps);
  float w0 = r.master_in[i];
  float w = std::fma(-h.lr, std::fma(h.weight_decay, w0, upd), w0);
  r.m_out[i] = m;
  r.v_out[i] = v;
  r.master_out[i] = w;
  if constexpr (kBf16)
    static_cast<uint16_t*>(r.param)[i] = round_bf16(float_bits(w));
  else
    static_cast<float*>(r.param)[i] = w;
}

// Software prefetch this far ahead of the element being updated. The loop is
// bound by its divisions, so the core keeps too few iterations in flight to
// cover memory latency with demand misses alone; on a 16-core Xeon this took a
// 1e9-param bf16 update from 4.2 to 4.7 G params/s (the machine's memory ceiling
// for this access pattern). Prefetches never fault, so running past the end of
// an array is harmless; the address is formed as an integer for that reason.
inline constexpr size_t kPrefetchBytes = 2048;

inline void prefetch_ahead(const void* p) {
  __builtin_prefetch(reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(p) + kPrefetchBytes), 0, 3);
}

void adamw_range_scalar(DType dtype, const AdamWRange& r, size_t begin, size_t end, bool stream);
// The skipped step (r.scale not finite, see adamw.h): param = master_in rounded to
// the param dtype; master, m and v untouched in place, copied unchanged to the
// _out arrays out of place. Every SIMD level uses it.
void adamw_range_skip(DType dtype, const AdamWRange& r, size_t begin, size_t end, bool stream);
void adamw_range_avx2(DType dtype, const AdamWRange& r, size_t begin, size_t end, bool stream);
void adamw_range_avx512(DType dtype, const AdamWRange& r, size_t begin, size_t end, bool stream);

}  // namespace spillway::optim_detail
