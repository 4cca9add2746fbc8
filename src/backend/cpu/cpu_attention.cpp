// Causal self-attention on the CPU, flash-style: no T×T buffer. The forward is split
// by (batch, query head): one thread owns a head and walks its query rows in blocks
// of kQueryBlock, holding only that block's score rows [kQueryBlock, T]. The products
// inside a block are single-threaded sgemm calls reading q, k and v in place
// (leading dimension (NH+2·KVH)·D); the softmax and its gradient are vector loops.
// The forward saves the log-sum-exp of every score row; the backward, split by
// (batch, key/value head), recomputes the probabilities from q, k and lse, and adds
// into dK and dV block by block in query order, for the group's query heads one
// after the other (grouped-query attention: NH/KVH query heads share a key/value
// head). Block shapes depend only on T, so the bits do not depend on the thread count.
#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <memory>

#include "backend/cpu/cpu_kernels.h"
#include "backend/cpu/vector_math.h"

namespace spillway::cpu {

namespace {

constexpr int64_t kQueryBlock = 64;  // query rows per block

inline int64_t round_up16(int64_t x) { return (x + 15) & ~int64_t{15}; }

// Per-thread scratch, 64-byte aligned so that its alignment never varies.
class Scratch {
 public:
  explicit Scratch(int64_t floats)
      : p_(static_cast<float*>(std::aligned_alloc(64, static_cast<size_t>(round_up16(floats)) * sizeof(float)))) {
    if (p_ == nullptr) throw std::bad_alloc();
  }
  float* data() { return p_.get(); }

 private:
  struct Free {
    void operator()(float* p) const { std::free(p); }
  };
  std::unique_ptr<float, Free> p_;
};

// s[rows, ld] (first `width` columns) = scale · q[rows, hs] · k[width, hs]ᵀ; q and k rows
// are `ldq` / `ldk` floats apart.
void block_scores(float* s, int64_t ld, const float* q, int64_t ldq, const float* k, int64_t ldk, int64_t rows,
                  int64_t width, int64_t hs, float scale) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(rows), static_cast<int>(width),
              static_cast<int>(hs), scale, q, static_cast<int>(ldq), k, static_cast<int>(ldk), 0.0f, s,
              static_cast<int>(ld));
}

}  // namespace

void attention_forward(ThreadPool& pool, float* out, float* lse, const float* qkv, int B, int T, int C, int NH,
                       int KVH) {
  use_single_threaded_blas();
  const int64_t hs = C / NH, C3 = (int64_t{NH} + 2 * KVH) * hs, ld = round_up16(T), group = NH / KVH;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  pool.parallel_for(int64_t{B} * NH, [&](int64_t u0, int64_t u1) {
    Scratch p(kQueryBlock * ld);  // [kQueryBlock, ld]: scores, then probabilities
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t b = u / NH, h = u % NH, g = h / group;
      const float* q = qkv + b * T * C3 + h * hs;  // [T, hs], rows C3 apart
      const float* k = qkv + b * T * C3 + (NH + g) * hs;
      const float* v = k + KVH * hs;
      float* lse_row = lse + u * T;
      for (int64_t i0 = 0; i0 < T; i0 += kQueryBlock) {
        const int64_t i1 = std::min<int64_t>(T, i0 + kQueryBlock), rows = i1 - i0;
        block_scores(p.data(), ld, q + i0 * C3, C3, k, C3, rows, i1, hs, scale);
        for (int64_t r = 0; r < rows; ++r) {
          float* pr = p.data() + r * ld;
          const int64_t keys = i0 + r + 1;  // causal: keys 0..i
          const float m = row_max(pr, keys);
          const float l = exp_shift_sum<true>(pr, pr, m, keys);  // pr[0, keys) = exp(score - m)
          lse_row[i0 + r] = m + std::log(l);
          map1(pr, pr, keys, [l](auto e) { return e / l; });
          std::fill(pr + keys, pr + i1, 0.0f);
        }
        // out[i0:i1, head] = p[rows, i1] · v[0:i1]
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(rows), static_cast<int>(hs),
                    static_cast<int>(i1), 1.0f, p.data(), static_cast<int>(ld), v, static_cast<int>(C3), 0.0f,
                    out + (b * T + i0) * C + h * hs, C);
      }
    }
  });
}

void attention_backward(ThreadPool& pool, float* dqkv, const float* dout, const float* qkv, const float* out,
                        const float* lse, int B, int T, int C, int NH, int KVH) {
  use_single_threaded_blas();
  const int64_t hs = C / NH, C3 = (int64_t{NH} + 2 * KVH) * hs, ld = round_up16(T), group = NH / KVH;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  pool.parallel_for(int64_t{B} * KVH, [&](int64_t u0, int64_t u1) {
    // Per query block: probabilities p and score gradients ds [kQueryBlock, ld]; D [T].
    Scratch p(kQueryBlock * ld), ds(kQueryBlock * ld), D(T);
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t b = u / KVH, kvh = u % KVH;
      const float* k = qkv + b * T * C3 + (NH + kvh) * hs;  // [T, hs] each, rows C3 apart
      const float* v = k + KVH * hs;
      float* dk = dqkv + b * T * C3 + (NH + kvh) * hs;
      float* dv = dk + KVH * hs;
      for (int64_t t = 0; t < T; ++t) {
        std::fill(dk + t * C3, dk + t * C3 + hs, 0.0f);
        std::fill(dv + t * C3, dv + t * C3 + hs, 0.0f);
      }
      // The group's query heads in order, each adding into dk and dv.
      for (int64_t h = kvh * group; h < (kvh + 1) * group; ++h) {
        const float* q = qkv + b * T * C3 + h * hs;  // [T, hs], rows C3 apart
        const float* g = dout + b * T * C + h * hs;  // [T, hs], rows C apart
        const float* o = out + b * T * C + h * hs;
        float* dq = dqkv + b * T * C3 + h * hs;
        const float* lse_row = lse + (b * NH + h) * T;
        for (int64_t t = 0; t < T; ++t) D.data()[t] = lane_dot(g + t * C, o + t * C, hs);  // D_i = dout_i · out_i
        for (int64_t i0 = 0; i0 < T; i0 += kQueryBlock) {
          const int64_t i1 = std::min<int64_t>(T, i0 + kQueryBlock), rows = i1 - i0;
          const int R = static_cast<int>(rows), W = static_cast<int>(i1), H = static_cast<int>(hs);
          const int LD = static_cast<int>(ld), L3 = static_cast<int>(C3);
          block_scores(p.data(), ld, q + i0 * C3, C3, k, C3, rows, i1, hs, scale);
          // dP[rows, i1] = dout[i0:i1] · v[0:i1]ᵀ
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, R, W, H, 1.0f, g + i0 * C, C, v, L3, 0.0f, ds.data(),
                      LD);
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t keys = i0 + r + 1;
            float* pr = p.data() + r * ld;
            float* dr = ds.data() + r * ld;
            const float lse_i = lse_row[i0 + r], D_i = D.data()[i0 + r];
            map1(pr, pr, keys, [lse_i](auto x) { return exp_any(x - lse_i); });
            map2(dr, pr, dr, keys, [D_i, scale](auto pv, auto dp) { return (pv * (dp - D_i)) * scale; });
            std::fill(pr + keys, pr + i1, 0.0f);
            std::fill(dr + keys, dr + i1, 0.0f);
          }
          // dq[i0:i1] = ds · k[0:i1]
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, R, H, W, 1.0f, ds.data(), LD, k, L3, 0.0f,
                      dq + i0 * C3, L3);
          // dk[0:i1] += dsᵀ · q[i0:i1]; dv[0:i1] += pᵀ · dout[i0:i1]
          cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, W, H, R, 1.0f, ds.data(), LD, q + i0 * C3, L3, 1.0f, dk,
                      L3);
          cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, W, H, R, 1.0f, p.data(), LD, g + i0 * C, C, 1.0f, dv,
                      L3);
        }
      }
    }
  });
}

}  // namespace spillway::cpu
