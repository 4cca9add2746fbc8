// Small vector helpers for the CPU kernels: a branch-free exp on 4-float vectors,
// elementwise maps, and row reductions with a fixed order, so a result never depends
// on how a loop was vectorized, on pointer addresses, or on the thread count.
// Written with GCC vector types so that they vectorize at -O2 (whose cost model
// leaves plain loops of unknown length scalar).
//
//   float m = row_max(x, n);                    // exact
//   float s = exp_shift_sum<true>(e, x, m, n);  // e[j] = exp(x[j] - m); s = Σ e (16 lanes)
//   float d = lane_dot(a, b, n);                // Σ a·b in 16 lanes
//   float y = exp_scalar(0.5f);                 // same bits as one lane of exp4
//   map2(out, a, b, n, [](auto x, auto y) { return x * y + 1.0f; });  // float or f32x4
//
// Fixed order: sums go into 16 lanes, element j into lane j % 16, each lane summed
// in index order from 0; the lanes are then added in lane order 0..15.
// The compile uses -ffp-contract=off, so no a*b+c here is ever fused.
#pragma once

#include <cstdint>
#include <cstring>

namespace spillway::cpu {

typedef float f32x4 __attribute__((vector_size(16)));
typedef int32_t i32x4 __attribute__((vector_size(16)));

inline constexpr int kLanes = 16;

inline f32x4 load4(const float* p) {
  f32x4 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store4(float* p, f32x4 v) { std::memcpy(p, &v, sizeof v); }
inline f32x4 splat4(float x) { return f32x4{x, x, x, x}; }

// exp(x) per lane: Cephes expf (range reduction by ln 2 in two parts, degree-5
// polynomial), max relative error about 2 ulp. Inputs are clamped to [-87.3, 88]
// (so exp of a very negative number is about 1.2e-38, never 0); NaN stays NaN.
inline f32x4 exp4(f32x4 x) {
  const f32x4 lo = splat4(-87.33654f), hi = splat4(88.0f);
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const f32x4 magic = splat4(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  f32x4 r = x * splat4(1.44269504088896341f) + magic;
  f32x4 n = r - magic;
  i32x4 ni = (i32x4)r - (i32x4)magic;
  f32x4 f = x - n * splat4(0.693359375f);
  f = f - n * splat4(-2.12194440e-4f);
  f32x4 p = splat4(1.9875691500e-4f);
  p = p * f + splat4(1.3981999507e-3f);
  p = p * f + splat4(8.3334519073e-3f);
  p = p * f + splat4(4.1665795894e-2f);
  p = p * f + splat4(1.6666665459e-1f);
  p = p * f + splat4(5.0000001201e-1f);
  p = p * (f * f) + f + splat4(1.0f);
  i32x4 e = (ni + 127) << 23;
  return p * (f32x4)e;
}

inline float exp_scalar(float x) { return exp4(splat4(x))[0]; }

// max over x[0, n), n >= 1 (exact: the order of a max does not matter).
inline float row_max(const float* x, int64_t n) {
  f32x4 m = splat4(x[0]);
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    f32x4 v = load4(x + i);
    m = v > m ? v : m;
  }
  float r = m[0];
  for (int l = 1; l < 4; ++l) r = m[l] > r ? m[l] : r;
  for (; i < n; ++i) r = x[i] > r ? x[i] : r;
  return r;
}

// Adds the 16 lanes of acc in lane order.
inline float lane_total(const f32x4 acc[4]) {
  float s = 0.0f;
  for (int k = 0; k < 4; ++k)
    for (int l = 0; l < 4; ++l) s += acc[k][l];
  return s;
}

// Σ x[j] over [0, n) in 16 lanes.
inline float lane_sum(const float* x, int64_t n) {
  f32x4 acc[4] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int k = 0; k < 4; ++k) acc[k] += load4(x + i + 4 * k);
  for (int l = 0; i < n; ++i, ++l) acc[l / 4][l % 4] += x[i];
  return lane_total(acc);
}

// Σ a[j]·b[j] over [0, n) in 16 lanes.
inline float lane_dot(const float* a, const float* b, int64_t n) {
  f32x4 acc[4] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int k = 0; k < 4; ++k) acc[k] += load4(a + i + 4 * k) * load4(b + i + 4 * k);
  for (int l = 0; i < n; ++i, ++l) acc[l / 4][l % 4] += a[i] * b[i];
  return lane_total(acc);
}

// Σ (x[j] - shift)² over [0, n) in 16 lanes.
inline float lane_sum_sq_dev(const float* x, float shift, int64_t n) {
  f32x4 acc[4] = {};
  const f32x4 s = splat4(shift);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int k = 0; k < 4; ++k) {
      f32x4 d = load4(x + i + 4 * k) - s;
      acc[k] += d * d;
    }
  for (int l = 0; i < n; ++i, ++l) {
    float d = x[i] - shift;
    acc[l / 4][l % 4] += d * d;
  }
  return lane_total(acc);
}

// Σ e over [0, n) in 16 lanes, where e[j] = exp(x[j] - shift); e is also written
// when kStore (e may equal x).
template <bool kStore>
inline float exp_shift_sum(float* e, const float* x, float shift, int64_t n) {
  f32x4 acc[4] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int k = 0; k < 4; ++k) {
      f32x4 v = exp4(load4(x + i + 4 * k) - shift);
      if constexpr (kStore) store4(e + i + 4 * k, v);
      acc[k] += v;
    }
  for (int l = 0; i < n; ++i, ++l) {
    float v = exp_scalar(x[i] - shift);
    if constexpr (kStore) e[i] = v;
    acc[l / 4][l % 4] += v;
  }
  return lane_total(acc);
}

inline float exp_any(float x) { return exp_scalar(x); }
inline f32x4 exp_any(f32x4 x) { return exp4(x); }

// out[i] = f(a[i], ...) on 4-wide vectors, then on the scalar tail. f is generic over
// float and f32x4; lane-wise arithmetic gives the same bits either way, so an
// element's value does not depend on where the tail starts. out may equal an input.
template <class F>
inline void map1(float* out, const float* a, int64_t n, F f) {
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) store4(out + i, f(load4(a + i)));
  for (; i < n; ++i) out[i] = f(a[i]);
}

template <class F>
inline void map2(float* out, const float* a, const float* b, int64_t n, F f) {
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) store4(out + i, f(load4(a + i), load4(b + i)));
  for (; i < n; ++i) out[i] = f(a[i], b[i]);
}

template <class F>
inline void map3(float* out, const float* a, const float* b, const float* c, int64_t n, F f) {
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) store4(out + i, f(load4(a + i), load4(b + i), load4(c + i)));
  for (; i < n; ++i) out[i] = f(a[i], b[i], c[i]);
}

// acc[i] += x[i]
inline void add_into(float* acc, const float* x, int64_t n) {
  map2(acc, acc, x, n, [](auto a, auto b) { return a + b; });
}

// acc[i] += a * x[i]
inline void axpy_into(float* acc, float a, const float* x, int64_t n) {
  map2(acc, acc, x, n, [a](auto y, auto xv) { return y + a * xv; });
}

}  // namespace spillway::cpu
