// AdamW host kernels: every SIMD level against a scalar reference written from
// the formula in optim/adamw.h, bit for bit; clipping; bf16 rounding.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <new>
#include <random>
#include <string>
#include <vector>

#include "core/thread_pool.h"
#include "optim/adamw.h"

namespace spillway {
namespace {

uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round to nearest even by comparing distances in double (independent of the
// bit trick in the library). NaN: any quiet NaN with the same sign.
uint16_t reference_bf16(float f) {
  uint32_t u = bits_of(f);
  if (std::isnan(f)) return static_cast<uint16_t>((u >> 16) | 0x40);
  uint32_t lo = u & 0xffff0000u;
  uint32_t hi = lo + 0x10000u;  // next bf16 away from zero (may be inf)
  double x = f, dlo = std::fabs(x - from_bits(lo));
  if (std::isinf(f)) return static_cast<uint16_t>(lo >> 16);
  // The bf16 value just past the largest finite: treat as 2^128 for the distance.
  double hv = (hi & 0x7fffffffu) == 0x7f800000u ? std::copysign(std::ldexp(1.0, 128), x) : from_bits(hi);
  double dhi = std::fabs(hv - x);
  if (dlo < dhi) return static_cast<uint16_t>(lo >> 16);
  if (dhi < dlo) return static_cast<uint16_t>(hi >> 16);
  return static_cast<uint16_t>(((lo >> 16) & 1) ? hi >> 16 : lo >> 16);
}

// 64-byte aligned storage, as Spillway's tensors are, so that large sizes take
// the streaming-store path.
template <typename T>
struct Aligned64 {
  using value_type = T;
  Aligned64() = default;
  template <typename U>
  Aligned64(const Aligned64<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{64})); }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t{64}); }
  bool operator==(const Aligned64&) const { return true; }
};
template <typename T>
using Vec = std::vector<T, Aligned64<T>>;

struct State {
  Vec<float> master, m, v, grad_f32, param_f32;
  Vec<uint16_t> grad_bf16, param_bf16;
};

State make_state(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  State s;
  s.master.resize(n);
  s.m.resize(n);
  s.v.resize(n);
  s.grad_f32.resize(n);
  s.grad_bf16.resize(n);
  s.param_f32.assign(n, 0.0f);
  s.param_bf16.assign(n, 0);
  for (size_t i = 0; i < n; ++i) {
    s.master[i] = 0.02f * normal(rng);
    s.m[i] = 1e-3f * normal(rng);
    s.v[i] = 1e-6f * unit(rng);
    // Gradients over many magnitudes, some exact zeros.
    float g = normal(rng) * std::ldexp(1.0f, static_cast<int>(rng() % 24) - 16);
    if (rng() % 17 == 0) g = 0.0f;
    s.grad_f32[i] = g;
    s.grad_bf16[i] = static_cast<uint16_t>(bits_of(g) >> 16);
  }
  return s;
}

// Straight from the header: each operation rounded once, fma where it says fma.
void reference_step(DType dtype, State& s, float scale, const AdamWHyper& h) {
  for (size_t i = 0; i < s.master.size(); ++i) {
    float gin = dtype == DType::BF16 ? from_bits(static_cast<uint32_t>(s.grad_bf16[i]) << 16) : s.grad_f32[i];
    float g = gin * scale;
    float m = std::fma(h.beta1, s.m[i], h.one_minus_beta1 * g);
    float v = std::fma(h.beta2, s.v[i], (h.one_minus_beta2 * g) * g);
    float mhat = m / h.bias_correction1;
    float vhat = v / h.bias_correction2;
    float upd = mhat / (std::sqrt(vhat) + h.eps);
    float master = std::fma(-h.lr, std::fma(h.weight_decay, s.master[i], upd), s.master[i]);
    s.m[i] = m;
    s.v[i] = v;
    s.master[i] = master;
    if (dtype == DType::BF16)
      s.param_bf16[i] = reference_bf16(master);
    else
      s.param_f32[i] = master;
  }
}

void host_step(DType dtype, State& s, float scale, const AdamWHyper& h, size_t offset = 0) {
  float scale_norm[2] = {scale, 0.0f};
  size_t n = s.master.size() - offset;
  if (dtype == DType::BF16)
    adamw_host(dtype, s.param_bf16.data() + offset, s.master.data() + offset, s.m.data() + offset,
               s.v.data() + offset, s.grad_bf16.data() + offset, scale_norm, n, h);
  else
    adamw_host(dtype, s.param_f32.data() + offset, s.master.data() + offset, s.m.data() + offset,
               s.v.data() + offset, s.grad_f32.data() + offset, scale_norm, n, h);
}

// Bitwise equality of float arrays; NaN matches any NaN (payloads are not part of the contract).
::testing::AssertionResult same_floats(const Vec<float>& a, const Vec<float>& b, const char* what) {
  for (size_t i = 0; i < a.size(); ++i) {
    bool ok = bits_of(a[i]) == bits_of(b[i]) || (std::isnan(a[i]) && std::isnan(b[i]));
    if (!ok)
      return ::testing::AssertionFailure() << what << "[" << i << "]: " << a[i] << " (0x" << std::hex << bits_of(a[i])
                                           << ") vs " << b[i] << " (0x" << bits_of(b[i]) << ")";
  }
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult same_state(DType dtype, const State& got, const State& want) {
  if (auto r = same_floats(got.master, want.master, "master"); !r) return r;
  if (auto r = same_floats(got.m, want.m, "m"); !r) return r;
  if (auto r = same_floats(got.v, want.v, "v"); !r) return r;
  if (dtype == DType::F32) return same_floats(got.param_f32, want.param_f32, "param");
  for (size_t i = 0; i < got.param_bf16.size(); ++i) {
    uint16_t a = got.param_bf16[i], b = want.param_bf16[i];
    bool nan_a = (a & 0x7fff) > 0x7f80, nan_b = (b & 0x7fff) > 0x7f80;
    if (a != b && !(nan_a && nan_b))
      return ::testing::AssertionFailure() << "param[" << i << "]: 0x" << std::hex << a << " vs 0x" << b;
  }
  return ::testing::AssertionSuccess();
}

std::vector<SimdLevel> available_levels() {
  std::vector<SimdLevel> levels;
  SimdLevel original = adamw_simd_level();
  for (SimdLevel s : {SimdLevel::Scalar, SimdLevel::Avx2, SimdLevel::Avx512})
    if (adamw_force_simd_level(s)) levels.push_back(s);
  adamw_force_simd_level(original);
  return levels;
}

class LevelRestore : public ::testing::Test {
 protected:
  void TearDown() override { adamw_force_simd_level(saved_); }
  SimdLevel saved_ = adamw_simd_level();
};

using AdamWHost = LevelRestore;

TEST_F(AdamWHost, EveryLevelMatchesReferenceBitForBit) {
  const std::vector<size_t> sizes = {1, 7, 8, 15, 16, 22, 33, 64, 1000, 1000003};
  for (DType dtype : {DType::F32, DType::BF16}) {
    for (float wd : {0.0f, 0.1f}) {
      for (size_t n : sizes) {
        State want = make_state(n, static_cast<uint32_t>(n * 31 + (wd > 0)));
        std::vector<State> got;
        std::vector<SimdLevel> levels = available_levels();
        for (size_t k = 0; k < levels.size(); ++k) got.push_back(want);
        for (int step = 1; step <= 4; ++step) {
          AdamWHyper h = adamw_hyper(6e-4f, step, wd);
          float scale = step == 3 ? 0.37f : 1.0f;  // one clipped step
          reference_step(dtype, want, scale, h);
          for (size_t k = 0; k < levels.size(); ++k) {
            ASSERT_TRUE(adamw_force_simd_level(levels[k]));
            host_step(dtype, got[k], scale, h);
          }
        }
        for (size_t k = 0; k < levels.size(); ++k)
          EXPECT_TRUE(same_state(dtype, got[k], want))
              << simd_level_name(levels[k]) << " " << dtype_name(dtype) << " n=" << n << " wd=" << wd;
      }
    }
  }
}

TEST_F(AdamWHost, MisalignedPointersAndStreamingSizes) {
  // An offset of one element makes every array unaligned; the large size reaches
  // the streaming-store path when the arrays happen to be aligned.
  for (DType dtype : {DType::F32, DType::BF16}) {
    for (size_t offset : {size_t{0}, size_t{1}, size_t{3}}) {
      size_t n = (size_t{1} << 22) + 29;
      State want = make_state(n, 7 + static_cast<uint32_t>(offset));
      State base = want;
      AdamWHyper h = adamw_hyper(1e-3f, 10, 0.1f);
      State ref_input = want;
      reference_step(dtype, want, 0.8f, h);
      for (SimdLevel s : available_levels()) {
        ASSERT_TRUE(adamw_force_simd_level(s));
        State got = base;
        host_step(dtype, got, 0.8f, h, offset);
        // Elements before the offset are untouched; compare those to the input.
        for (size_t i = 0; i < offset; ++i) {
          got.master[i] = want.master[i] = ref_input.master[i];
          got.m[i] = want.m[i] = ref_input.m[i];
          got.v[i] = want.v[i] = ref_input.v[i];
          got.param_f32[i] = want.param_f32[i] = 0;
          got.param_bf16[i] = want.param_bf16[i] = 0;
        }
        EXPECT_TRUE(same_state(dtype, got, want)) << simd_level_name(s) << " offset " << offset;
      }
    }
  }
}

TEST_F(AdamWHost, ResultDoesNotDependOnThreadCount) {
  const size_t n = 3000017;
  for (DType dtype : {DType::F32, DType::BF16}) {
    State first;
    for (int threads : {1, 2, 3, 5}) {
      set_global_thread_count(threads);
      State s = make_state(n, 99);
      for (int step = 1; step <= 2; ++step) host_step(dtype, s, 1.0f, adamw_hyper(3e-4f, step, 0.1f));
      if (threads == 1)
        first = s;
      else
        EXPECT_TRUE(same_state(dtype, s, first)) << threads << " threads";
    }
    set_global_thread_count(0);
  }
}

TEST_F(AdamWHost, SpecialValuesAgreeAcrossLevels) {
  // inf and NaN gradients, huge and tiny values; NaN payloads are not compared.
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float specials[] = {inf, -inf, nan, 3e38f, -3e38f, 1e-40f, -1e-45f, 0.0f, -0.0f, 65504.0f};
  size_t n = 37;
  State want = make_state(n, 5);
  for (size_t i = 0; i < n; ++i) {
    float g = specials[i % 10];
    want.grad_f32[i] = g;
    want.grad_bf16[i] = static_cast<uint16_t>(bits_of(g) >> 16);
  }
  want.master[3] = 3.3895e38f;  // rounds to bf16 inf
  want.v[4] = 1e-42f;           // denormal state
  for (DType dtype : {DType::F32, DType::BF16}) {
    State ref = want;
    AdamWHyper h = adamw_hyper(1e-2f, 2, 0.1f);
    reference_step(dtype, ref, 1.0f, h);
    for (SimdLevel s : available_levels()) {
      ASSERT_TRUE(adamw_force_simd_level(s));
      State got = want;
      host_step(dtype, got, 1.0f, h);
      EXPECT_TRUE(same_state(dtype, got, ref)) << simd_level_name(s) << " " << dtype_name(dtype);
    }
  }
}

// A skipped step (scale_norm[0] not finite, as clip_scale writes for a non-finite
// norm): every level leaves master, m and v bit for bit as they were and writes
// param = master rounded, whatever the gradients and whatever param held before.
TEST_F(AdamWHost, SkippedStepChangesNothingAtEveryLevel) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  // Sizes across the scalar tails, the vector bodies, the threaded tiles and the
  // streaming stores; offsets 0 and 1 (unaligned).
  const std::vector<size_t> sizes = {1, 22, 1000, (size_t{1} << 18) + 5, (size_t{1} << 22) + 29};
  for (DType dtype : {DType::F32, DType::BF16}) {
    for (size_t n : sizes) {
      const bool large = n > (size_t{1} << 20);  // one case of the streaming size: it is slow to check
      for (size_t offset : {size_t{0}, size_t{1}}) {
        if (large && offset > 0) continue;
        State before = make_state(n + offset, static_cast<uint32_t>(n + offset));
        // NaN and inf gradients in places, as a diverged step has them.
        for (size_t i = 0; i < before.grad_f32.size(); i += 5) {
          before.grad_f32[i] = i % 2 ? nan : inf;
          before.grad_bf16[i] = static_cast<uint16_t>(bits_of(before.grad_f32[i]) >> 16);
        }
        // param holds garbage: in a step it is write-only, so the kernel must write it.
        for (size_t i = 0; i < before.param_f32.size(); ++i) {
          before.param_f32[i] = -1234.5f;
          before.param_bf16[i] = 0xdead;
        }
        State want = before;
        for (size_t i = offset; i < want.master.size(); ++i) {
          want.param_f32[i] = want.master[i];
          want.param_bf16[i] = reference_bf16(want.master[i]);
        }
        for (float scale : {nan, inf, -inf}) {
          if (large && !std::isnan(scale)) continue;
          for (SimdLevel s : available_levels()) {
            ASSERT_TRUE(adamw_force_simd_level(s));
            State got = before;
            host_step(dtype, got, scale, adamw_hyper(1e-3f, 5, 0.1f), offset);
            EXPECT_TRUE(same_state(dtype, got, want))
                << simd_level_name(s) << " " << dtype_name(dtype) << " n=" << n << " offset " << offset
                << " scale " << scale;
            // Bit for bit, NaN payloads too: the state is copied, not recomputed.
            EXPECT_EQ(std::memcmp(got.master.data(), before.master.data(), got.master.size() * 4), 0);
            EXPECT_EQ(std::memcmp(got.m.data(), before.m.data(), got.m.size() * 4), 0);
            EXPECT_EQ(std::memcmp(got.v.data(), before.v.data(), got.v.size() * 4), 0);
          }
        }
      }
    }
  }
}

// A finite scale is an update, even a tiny or huge one: the skip is only for
// non-finite scales, so normal steps keep their bits.
TEST_F(AdamWHost, FiniteScalesAreApplied) {
  for (float scale : {0.0f, 1e-30f, 3e38f}) {
    State want = make_state(40, 3);
    State got = want;
    AdamWHyper h = adamw_hyper(1e-3f, 2, 0.1f);
    reference_step(DType::F32, want, scale, h);
    host_step(DType::F32, got, scale, h);
    EXPECT_TRUE(same_state(DType::F32, got, want)) << "scale " << scale;
  }
}

// adamw_host_into: the out-of-place update. Sizes across the scalar tails, the
// vector bodies and the threaded tiles (adamw.cpp's kParallelMin = 1 << 18).
const std::vector<size_t> kIntoSizes = {1, 17, 1000, (size_t{1} << 18) + 17};

// Bitwise equality, NaN payloads included.
template <typename T>
bool same_bits(const Vec<T>& a, const Vec<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

// Fills an output array with a NaN pattern no update writes, so that an output
// the kernel does not write is seen.
void poison(Vec<float>& a) {
  for (size_t i = 0; i < a.size(); ++i) a[i] = from_bits(0x7fc0beefu ^ static_cast<uint32_t>(i & 0xff));
}

// Every output of an out-of-place step set to values no update writes.
void poison_outputs(State& out) {
  poison(out.master);
  poison(out.m);
  poison(out.v);
  std::fill(out.param_f32.begin(), out.param_f32.end(), -1234.5f);
  std::fill(out.param_bf16.begin(), out.param_bf16.end(), uint16_t{0xdead});
}

// One out-of-place step: reads in.master/m/v, writes out.master/m/v and out's param.
void host_step_into(DType dtype, const State& in, State& out, float scale, const AdamWHyper& h) {
  float scale_norm[2] = {scale, 0.0f};
  size_t n = in.master.size();
  void* param = dtype == DType::BF16 ? static_cast<void*>(out.param_bf16.data()) : out.param_f32.data();
  const void* grad = dtype == DType::BF16 ? static_cast<const void*>(in.grad_bf16.data()) : in.grad_f32.data();
  adamw_host_into(dtype, param, in.master.data(), in.m.data(), in.v.data(), out.master.data(), out.m.data(),
                  out.v.data(), grad, scale_norm, n, h);
}

// out's state and param bit for bit as want's; in's master, m, v as pristine's.
void expect_into(DType dtype, const State& in, const State& out, const State& want, const State& pristine,
                 const std::string& what) {
  EXPECT_TRUE(same_bits(out.master, want.master)) << what << ": master_out";
  EXPECT_TRUE(same_bits(out.m, want.m)) << what << ": m_out";
  EXPECT_TRUE(same_bits(out.v, want.v)) << what << ": v_out";
  if (dtype == DType::BF16)
    EXPECT_TRUE(same_bits(out.param_bf16, want.param_bf16)) << what << ": param";
  else
    EXPECT_TRUE(same_bits(out.param_f32, want.param_f32)) << what << ": param";
  EXPECT_TRUE(same_bits(in.master, pristine.master)) << what << ": master_in changed";
  EXPECT_TRUE(same_bits(in.m, pristine.m)) << what << ": m_in changed";
  EXPECT_TRUE(same_bits(in.v, pristine.v)) << what << ": v_in changed";
}

TEST_F(AdamWHost, IntoMatchesInPlaceBitForBitAtEveryLevel) {
  const AdamWHyper h = adamw_hyper(6e-4f, 3, 0.1f);
  for (DType dtype : {DType::F32, DType::BF16}) {
    for (size_t n : kIntoSizes) {
      const State pristine = make_state(n, static_cast<uint32_t>(n * 13 + 1));
      // The threaded size also at other thread counts (the tiling must not change).
      const std::vector<int> thread_counts = n >= (size_t{1} << 18) ? std::vector<int>{0, 1, 3} : std::vector<int>{0};
      for (int threads : thread_counts) {
        set_global_thread_count(threads);
        for (SimdLevel s : available_levels()) {
          ASSERT_TRUE(adamw_force_simd_level(s));
          const std::string what = std::string(simd_level_name(s)) + " " + dtype_name(dtype) +
                                   " n=" + std::to_string(n) + " threads=" + std::to_string(threads);
          State want = pristine;
          host_step(dtype, want, 0.37f, h);
          State in = pristine, out = pristine;
          poison_outputs(out);
          host_step_into(dtype, in, out, 0.37f, h);
          expect_into(dtype, in, out, want, pristine, what);
          // Mixed: master in place, m and v out of place.
          State mixed_in = pristine, mixed_out = pristine;
          poison(mixed_out.m);
          poison(mixed_out.v);
          float scale_norm[2] = {0.37f, 0.0f};
          void* param = dtype == DType::BF16 ? static_cast<void*>(mixed_out.param_bf16.data())
                                             : mixed_out.param_f32.data();
          const void* grad = dtype == DType::BF16 ? static_cast<const void*>(pristine.grad_bf16.data())
                                                  : pristine.grad_f32.data();
          adamw_host_into(dtype, param, mixed_in.master.data(), mixed_in.m.data(), mixed_in.v.data(),
                          mixed_in.master.data(), mixed_out.m.data(), mixed_out.v.data(), grad, scale_norm, n, h);
          EXPECT_TRUE(same_bits(mixed_in.master, want.master)) << what << ": mixed master (in place)";
          EXPECT_TRUE(same_bits(mixed_out.m, want.m)) << what << ": mixed m_out";
          EXPECT_TRUE(same_bits(mixed_out.v, want.v)) << what << ": mixed v_out";
          EXPECT_TRUE(same_bits(mixed_in.m, pristine.m) && same_bits(mixed_in.v, pristine.v))
              << what << ": mixed m_in/v_in changed";
          if (dtype == DType::BF16)
            EXPECT_TRUE(same_bits(mixed_out.param_bf16, want.param_bf16)) << what << ": mixed param";
          else
            EXPECT_TRUE(same_bits(mixed_out.param_f32, want.param_f32)) << what << ": mixed param";
        }
      }
      set_global_thread_count(0);
    }
  }
}

// At the streaming size (adamw.cpp's kStreamMin = 1 << 22), with 64-byte aligned
// arrays, the out-of-place update stores master, m and v non-temporally too: the
// same bits as in place, the inputs untouched, at every SIMD level.
TEST_F(AdamWHost, IntoAtTheStreamingSizeMatchesInPlace) {
  const AdamWHyper h = adamw_hyper(6e-4f, 5, 0.1f);
  const size_t n = (size_t{1} << 22) + 17;
  for (DType dtype : {DType::F32, DType::BF16}) {
    const State pristine = make_state(n, 91u + static_cast<uint32_t>(dtype == DType::BF16));
    State want = pristine;
    host_step(dtype, want, 0.61f, h);
    for (SimdLevel s : available_levels()) {
      ASSERT_TRUE(adamw_force_simd_level(s));
      const std::string what = std::string(simd_level_name(s)) + " " + dtype_name(dtype) + " n=" + std::to_string(n);
      State in = pristine, out = pristine;
      poison_outputs(out);
      host_step_into(dtype, in, out, 0.61f, h);
      expect_into(dtype, in, out, want, pristine, what);
    }
  }
}

// A skipped step out of place: param = master_in rounded (as adamw_host writes it),
// the inputs copied to the outputs bit for bit, the inputs untouched.
TEST_F(AdamWHost, IntoSkippedStepCopiesInputsAtEveryLevel) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  const AdamWHyper h = adamw_hyper(1e-3f, 5, 0.1f);
  for (DType dtype : {DType::F32, DType::BF16}) {
    for (size_t n : kIntoSizes) {
      State pristine = make_state(n, static_cast<uint32_t>(n + 77));
      for (size_t i = 0; i < n; i += 5) {  // non-finite gradients, as a diverged step has
        pristine.grad_f32[i] = i % 2 ? nan : inf;
        pristine.grad_bf16[i] = static_cast<uint16_t>(bits_of(pristine.grad_f32[i]) >> 16);
      }
      for (SimdLevel s : available_levels()) {
        ASSERT_TRUE(adamw_force_simd_level(s));
        const std::string what =
            std::string(simd_level_name(s)) + " " + dtype_name(dtype) + " n=" + std::to_string(n);
        State want = pristine;
        std::fill(want.param_f32.begin(), want.param_f32.end(), -1234.5f);
        std::fill(want.param_bf16.begin(), want.param_bf16.end(), uint16_t{0xdead});
        host_step(dtype, want, nan, h);
        ASSERT_TRUE(same_bits(want.master, pristine.master));  // in place: nothing changed
        for (size_t i = 0; i < n; ++i) {  // and param is master rounded
          if (dtype == DType::F32)
            ASSERT_EQ(bits_of(want.param_f32[i]), bits_of(pristine.master[i])) << what << " [" << i << "]";
          else
            ASSERT_EQ(want.param_bf16[i], reference_bf16(pristine.master[i])) << what << " [" << i << "]";
        }
        State in = pristine, out = pristine;
        poison_outputs(out);
        host_step_into(dtype, in, out, nan, h);
        expect_into(dtype, in, out, want, pristine, what);
      }
    }
  }
}

TEST(AdamWHyperTest, ConstantsInDoubleRoundedOnce) {
  AdamWHyper h = adamw_hyper(6e-4f, 3, 0.1f);
  EXPECT_EQ(h.lr, 6e-4f);
  EXPECT_EQ(h.weight_decay, 0.1f);
  EXPECT_EQ(h.eps, 1e-8f);
  double b1 = 0.9f, b2 = 0.95f;
  EXPECT_EQ(h.one_minus_beta1, static_cast<float>(1.0 - b1));
  EXPECT_EQ(h.one_minus_beta2, static_cast<float>(1.0 - b2));
  EXPECT_EQ(h.bias_correction1, static_cast<float>(1.0 - b1 * b1 * b1));
  EXPECT_EQ(h.bias_correction2, static_cast<float>(1.0 - b2 * b2 * b2));
  AdamWHyper h1 = adamw_hyper(1e-3f, 1, 0.0f, 0.8f, 0.99f, 1e-6f);
  EXPECT_EQ(h1.bias_correction1, static_cast<float>(1.0 - double(0.8f)));
  EXPECT_EQ(h1.bias_correction2, static_cast<float>(1.0 - double(0.99f)));
  EXPECT_EQ(h1.eps, 1e-6f);
  // Far along, the corrections reach 1.
  EXPECT_EQ(adamw_hyper(1e-3f, 100000, 0.0f).bias_correction2, 1.0f);
}

TEST(ClipScale, BelowAndAboveMaxNorm) {
  const float sq[3] = {1.0f, 4.0f, 4.0f};  // norm 3
  float out[2];
  clip_scale_host(out, sq, 3, 5.0f);
  EXPECT_EQ(out[0], 1.0f);
  EXPECT_EQ(out[1], 3.0f);
  clip_scale_host(out, sq, 3, 1.0f);
  EXPECT_EQ(out[0], static_cast<float>(1.0 / (3.0 + 1e-6)));
  EXPECT_EQ(out[1], 3.0f);
  clip_scale_host(out, sq, 3, 3.0f);  // equal: not clipped
  EXPECT_EQ(out[0], 1.0f);
  // The sum is in double: 1e8 + sixteen 1s is exact there, not in float.
  std::vector<float> big(17, 1.0f);
  big[0] = 1e8f;
  clip_scale_host(out, big.data(), 17, 1.0f);
  EXPECT_EQ(out[1], static_cast<float>(std::sqrt(100000016.0)));
  EXPECT_EQ(out[0], static_cast<float>(1.0 / (std::sqrt(100000016.0) + 1e-6)));
  clip_scale_host(out, sq, 0, 1.0f);  // no tensors
  EXPECT_EQ(out[0], 1.0f);
  EXPECT_EQ(out[1], 0.0f);
}

TEST(ClipScale, NonFiniteNormMarksTheStepSkipped) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  float out[2];
  for (float bad : {nan, inf}) {
    for (float max_norm : {1.0f, 1e30f}) {
      const float sq[3] = {1.0f, bad, 4.0f};
      clip_scale_host(out, sq, 3, max_norm);
      EXPECT_TRUE(std::isnan(out[0])) << bad << " max_norm " << max_norm << ": scale " << out[0];
      EXPECT_TRUE(adamw_step_skipped(out));
      EXPECT_EQ(std::isnan(out[1]), std::isnan(bad));
      EXPECT_EQ(std::isinf(out[1]), std::isinf(bad));
    }
  }
  // Finite norms, clipped or not, are never marked.
  const float sq[2] = {1e38f, 1e38f};  // the sum overflows float but not double
  clip_scale_host(out, sq, 2, 1.0f);
  EXPECT_TRUE(std::isfinite(out[0]) && std::isfinite(out[1])) << out[0] << " " << out[1];
  EXPECT_FALSE(adamw_step_skipped(out));
}

TEST(Bf16, RoundingCases) {
  auto to = [](uint32_t u) { return float_to_bf16(from_bits(u)); };
  EXPECT_EQ(to(0x3f800000u), 0x3f80);  // 1.0
  EXPECT_EQ(to(0x3f808000u), 0x3f80);  // tie, even below
  EXPECT_EQ(to(0x3f818000u), 0x3f82);  // tie, odd below: up
  EXPECT_EQ(to(0x3f808001u), 0x3f81);  // above half
  EXPECT_EQ(to(0x3f807fffu), 0x3f80);  // below half
  EXPECT_EQ(to(0xbf818000u), 0xbf82);  // negative tie, away from zero to even
  EXPECT_EQ(to(0x80000000u), 0x8000);  // -0
  EXPECT_EQ(to(0x00008000u), 0x0000);  // denormal tie to even (zero)
  EXPECT_EQ(to(0x00018000u), 0x0002);  // denormal tie up
  EXPECT_EQ(to(0x7f800000u), 0x7f80);  // inf
  EXPECT_EQ(to(0xff800000u), 0xff80);  // -inf
  EXPECT_EQ(to(0x7f7f0000u), 0x7f7f);  // largest bf16
  EXPECT_EQ(to(0x7f7f7fffu), 0x7f7f);  // just under the halfway to inf
  EXPECT_EQ(to(0x7f7f8000u), 0x7f80);  // tie past the largest: inf
  EXPECT_EQ(to(0x7f7fffffu), 0x7f80);  // FLT_MAX rounds to inf
  EXPECT_EQ(to(0xff7fffffu), 0xff80);
  // NaN stays NaN, sign kept, never turned into inf by rounding.
  EXPECT_EQ(to(0x7fc00000u), 0x7fc0);
  EXPECT_EQ(to(0xffc00000u), 0xffc0);
  for (uint32_t u : {0x7f800001u, 0x7f80ffffu, 0x7fffffffu, 0xff800001u}) {
    uint16_t b = to(u);
    EXPECT_TRUE(std::isnan(bf16_to_float(b))) << std::hex << u;
    EXPECT_EQ(b & 0x8000, (u >> 16) & 0x8000);
  }
}

TEST(Bf16, AllValuesRoundTripAndRandomFloatsRoundToNearestEven) {
  for (uint32_t b = 0; b < 65536; ++b) {
    float f = bf16_to_float(static_cast<uint16_t>(b));
    EXPECT_EQ(bits_of(f), b << 16);
    if (!std::isnan(f)) {
      EXPECT_EQ(float_to_bf16(f), b);
    }
  }
  std::mt19937 rng(1);
  for (int i = 0; i < 2000000; ++i) {
    uint32_t u = rng();
    if (i % 4 == 0) u = (u & 0xffff0000u) | 0x8000u;  // ties
    float f = from_bits(u);
    ASSERT_EQ(float_to_bf16(f), reference_bf16(f)) << std::hex << u;
  }
}

TEST(SimdLevelTest, NamesAndForcing) {
  EXPECT_STREQ(simd_level_name(SimdLevel::Scalar), "scalar");
  EXPECT_STREQ(simd_level_name(SimdLevel::Avx2), "avx2");
  EXPECT_STREQ(simd_level_name(SimdLevel::Avx512), "avx512");
  SimdLevel saved = adamw_simd_level();
  EXPECT_TRUE(adamw_force_simd_level(SimdLevel::Scalar));
  EXPECT_EQ(adamw_simd_level(), SimdLevel::Scalar);
  EXPECT_TRUE(adamw_force_simd_level(saved));
  EXPECT_EQ(adamw_simd_level(), saved);
}

}  // namespace
}  // namespace spillway
