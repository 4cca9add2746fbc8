// CPU kernels other than attention: embedding, layernorm, RMSNorm, matmul, GELU, residual,
// RoPE, SwiGLU, cross-entropy and the squared norm. See cpu_kernels.h for the determinism rules.
#include "backend/cpu/cpu_kernels.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "backend/cpu/vector_math.h"

namespace spillway::cpu {

namespace {

// Rows per block of a column reduction (bias and layernorm weight gradients): fixed,
// so the sum order of every column is the same for any thread count.
constexpr int64_t kRowBlock = 32;
// Elements per chunk below which an elementwise loop is not worth a thread.
constexpr int64_t kElementGrain = int64_t{1} << 14;
// Elements per block of squared_norm.
constexpr int64_t kNormBlock = int64_t{1} << 16;

// acc[C] += Σ_n x[n, :] over N rows ld floats apart: rows are summed in order within
// blocks of kRowBlock rows, the block sums are added in block order, then added into acc.
void column_sums_into(ThreadPool& pool, float* acc, const float* x, int64_t N, int64_t C, int64_t ld) {
  const int64_t blocks = (N + kRowBlock - 1) / kRowBlock;
  std::vector<float> partial(static_cast<size_t>(blocks * C), 0.0f);  // [blocks, C]
  pool.parallel_for(blocks, [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1; ++blk) {
      float* p = partial.data() + blk * C;
      for (int64_t n = blk * kRowBlock; n < std::min(N, (blk + 1) * kRowBlock); ++n) add_into(p, x + n * ld, C);
    }
  });
  pool.parallel_for((C + 15) / 16, [&](int64_t g0, int64_t g1) {
    const int64_t c0 = g0 * 16, c1 = std::min(C, g1 * 16);
    std::vector<float> total(static_cast<size_t>(c1 - c0), 0.0f);
    for (int64_t blk = 0; blk < blocks; ++blk) add_into(total.data(), partial.data() + blk * C + c0, c1 - c0);
    add_into(acc + c0, total.data(), c1 - c0);
  });
}

}  // namespace

namespace {
// Row of token in a table holding rows [begin, begin + rows), or -1 when outside.
inline int64_t vocab_row(int32_t token, int vocab_begin, int vocab_rows) {
  const int64_t r = int64_t{token} - vocab_begin;
  return r >= 0 && r < vocab_rows ? r : -1;
}
}  // namespace

void embedding_forward(ThreadPool& pool, float* out, const int32_t* tokens, const float* wte,
                       const float* wpe, int B, int T, int C, int vocab_begin, int vocab_rows) {
  const int64_t N = int64_t{B} * T;
  pool.parallel_for(
      N,
      [&](int64_t n0, int64_t n1) {
        for (int64_t n = n0; n < n1; ++n) {
          const int64_t row = vocab_row(tokens[n], vocab_begin, vocab_rows);
          if (row < 0) continue;
          const float* te = wte + row * C;
          if (wpe == nullptr) {
            std::copy(te, te + C, out + n * C);
            continue;
          }
          const float* pe = wpe + (n % T) * C;
          map2(out + n * C, te, pe, C, [](auto a, auto b) { return a + b; });
        }
      },
      16);
}

void embedding_backward(ThreadPool& pool, float* dwte, float* dwpe, const float* dout,
                        const int32_t* tokens, int B, int T, int C, int vocab_begin, int vocab_rows) {
  const int64_t N = int64_t{B} * T;
  // Each table row gets one addition: the sum of its tokens' rows, formed in token
  // order from zero, is added into it once. So a gradient accumulated over
  // micro-batches is ((0 + g0) + g1) + ..., the same bits as each micro-batch's
  // gradient formed alone and then summed in order (data-parallel ranks, src/dist).
  std::vector<int64_t> order;  // positions with a token in the tile, by row, in token order within a row
  order.reserve(static_cast<size_t>(N));
  for (int64_t n = 0; n < N; ++n)
    if (vocab_row(tokens[n], vocab_begin, vocab_rows) >= 0) order.push_back(n);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return tokens[a] < tokens[b]; });
  pool.parallel_for((C + 15) / 16, [&](int64_t g0, int64_t g1) {
    const int64_t c0 = g0 * 16, c1 = std::min<int64_t>(C, g1 * 16), w = c1 - c0;
    std::vector<float> sum(static_cast<size_t>(w));
    for (size_t i = 0; i < order.size();) {
      const int32_t token = tokens[order[i]];
      std::fill(sum.begin(), sum.end(), 0.0f);
      for (; i < order.size() && tokens[order[i]] == token; ++i) add_into(sum.data(), dout + order[i] * C + c0, w);
      add_into(dwte + vocab_row(token, vocab_begin, vocab_rows) * C + c0, sum.data(), w);
    }
    if (dwpe != nullptr)
      for (int64_t t = 0; t < T; ++t) {
        std::fill(sum.begin(), sum.end(), 0.0f);
        for (int64_t b = 0; b < B; ++b) add_into(sum.data(), dout + (b * T + t) * C + c0, w);
        add_into(dwpe + t * C + c0, sum.data(), w);
      }
  });
}

void layernorm_forward(ThreadPool& pool, float* out, float* mean, float* rstd, const float* inp,
                       const float* weight, const float* bias, int N, int C) {
  pool.parallel_for(
      N,
      [&](int64_t n0, int64_t n1) {
        for (int64_t n = n0; n < n1; ++n) {
          const float* x = inp + n * C;
          const float m = lane_sum(x, C) / static_cast<float>(C);
          const float var = lane_sum_sq_dev(x, m, C) / static_cast<float>(C);
          const float s = 1.0f / std::sqrt(var + kLayerNormEps);
          map3(out + n * C, x, weight, bias, C, [m, s](auto xv, auto w, auto b) { return ((xv - m) * s) * w + b; });
          mean[n] = m;
          rstd[n] = s;
        }
      },
      8);
}

void layernorm_backward(ThreadPool& pool, float* dinp, float* dweight, float* dbias, const float* dout,
                        const float* inp, const float* weight, const float* mean, const float* rstd,
                        int N, int C) {
  const int64_t blocks = (int64_t{N} + kRowBlock - 1) / kRowBlock;
  // partial[blocks, 2, C]: per block of rows, the dweight then the dbias contributions.
  std::vector<float> partial(static_cast<size_t>(blocks * 2 * C), 0.0f);
  pool.parallel_for(blocks, [&](int64_t b0, int64_t b1) {
    std::vector<float> norm(static_cast<size_t>(C)), dnorm(static_cast<size_t>(C));
    for (int64_t blk = b0; blk < b1; ++blk) {
      float* pw = partial.data() + blk * 2 * C;
      float* pb = pw + C;
      for (int64_t n = blk * kRowBlock; n < std::min<int64_t>(N, (blk + 1) * kRowBlock); ++n) {
        const float* x = inp + n * C;
        const float* g = dout + n * C;
        float* dx = dinp + n * C;
        const float m = mean[n], s = rstd[n];
        map1(norm.data(), x, C, [m, s](auto xv) { return (xv - m) * s; });
        map2(dnorm.data(), weight, g, C, [](auto w, auto gv) { return w * gv; });
        const float dnorm_mean = lane_sum(dnorm.data(), C) / static_cast<float>(C);
        const float dnorm_norm_mean = lane_dot(dnorm.data(), norm.data(), C) / static_cast<float>(C);
        add_into(pb, g, C);
        map3(pw, pw, norm.data(), g, C, [](auto acc, auto nv, auto gv) { return acc + nv * gv; });
        map3(dx, dx, dnorm.data(), norm.data(), C, [=](auto acc, auto dn, auto nv) {
          return acc + ((dn - dnorm_mean) - nv * dnorm_norm_mean) * s;
        });
      }
    }
  });
  pool.parallel_for((C + 15) / 16, [&](int64_t g0, int64_t g1) {
    const int64_t c0 = g0 * 16, c1 = std::min<int64_t>(C, g1 * 16), w = c1 - c0;
    std::vector<float> tw(static_cast<size_t>(w), 0.0f), tb(static_cast<size_t>(w), 0.0f);
    for (int64_t blk = 0; blk < blocks; ++blk) {
      add_into(tw.data(), partial.data() + blk * 2 * C + c0, w);
      add_into(tb.data(), partial.data() + blk * 2 * C + C + c0, w);
    }
    add_into(dweight + c0, tw.data(), w);
    add_into(dbias + c0, tb.data(), w);
  });
}

void rmsnorm_forward(ThreadPool& pool, float* out, float* rstd, const float* inp, const float* weight, int N, int C,
                     float eps) {
  pool.parallel_for(
      N,
      [&](int64_t n0, int64_t n1) {
        for (int64_t n = n0; n < n1; ++n) {
          const float* x = inp + n * C;
          const float s = 1.0f / std::sqrt(lane_dot(x, x, C) / static_cast<float>(C) + eps);
          map2(out + n * C, x, weight, C, [s](auto xv, auto w) { return (xv * s) * w; });
          rstd[n] = s;
        }
      },
      8);
}

void rmsnorm_backward(ThreadPool& pool, float* dinp, float* dweight, const float* dout, const float* inp,
                      const float* weight, const float* rstd, int N, int C) {
  const int64_t blocks = (int64_t{N} + kRowBlock - 1) / kRowBlock;
  // partial[blocks, C]: per block of rows, the dweight contributions.
  std::vector<float> partial(static_cast<size_t>(blocks * C), 0.0f);
  pool.parallel_for(blocks, [&](int64_t b0, int64_t b1) {
    std::vector<float> norm(static_cast<size_t>(C)), dnorm(static_cast<size_t>(C));
    for (int64_t blk = b0; blk < b1; ++blk) {
      float* pw = partial.data() + blk * C;
      for (int64_t n = blk * kRowBlock; n < std::min<int64_t>(N, (blk + 1) * kRowBlock); ++n) {
        const float* x = inp + n * C;
        const float* g = dout + n * C;
        float* dx = dinp + n * C;
        const float s = rstd[n];
        map1(norm.data(), x, C, [s](auto xv) { return xv * s; });
        map2(dnorm.data(), weight, g, C, [](auto w, auto gv) { return w * gv; });
        const float dnorm_norm_mean = lane_dot(dnorm.data(), norm.data(), C) / static_cast<float>(C);
        map3(pw, pw, norm.data(), g, C, [](auto acc, auto nv, auto gv) { return acc + nv * gv; });
        map3(dx, dx, dnorm.data(), norm.data(), C,
             [=](auto acc, auto dn, auto nv) { return acc + (dn - nv * dnorm_norm_mean) * s; });
      }
    }
  });
  pool.parallel_for((C + 15) / 16, [&](int64_t g0, int64_t g1) {
    const int64_t c0 = g0 * 16, c1 = std::min<int64_t>(C, g1 * 16), w = c1 - c0;
    std::vector<float> tw(static_cast<size_t>(w), 0.0f);
    for (int64_t blk = 0; blk < blocks; ++blk) add_into(tw.data(), partial.data() + blk * C + c0, w);
    add_into(dweight + c0, tw.data(), w);
  });
}

namespace {

// Matrix products are cut into fixed tiles of kTileRows × kTileCols outputs, each one
// single-threaded sgemm call on one pool thread: the tiles depend only on the shape,
// so the bits do not depend on the thread count. Tile offsets are multiples of 16
// floats, so every tile starts as aligned as the whole matrix.
constexpr int64_t kTileRows = 128;
constexpr int64_t kTileCols = 256;

// f(r0, r1, c0, c1) for every tile of an [M, N] output.
template <class F>
void for_each_tile(ThreadPool& pool, int64_t M, int64_t N, F f) {
  const int64_t tiles_m = (M + kTileRows - 1) / kTileRows, tiles_n = (N + kTileCols - 1) / kTileCols;
  pool.parallel_for(tiles_m * tiles_n, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t i = t / tiles_n, j = t % tiles_n;
      f(i * kTileRows, std::min(M, (i + 1) * kTileRows), j * kTileCols, std::min(N, (j + 1) * kTileCols));
    }
  });
}

}  // namespace

void use_single_threaded_blas() {
  if (openblas_get_num_threads() != 1) openblas_set_num_threads(1);
}

void matmul_forward(ThreadPool& pool, float* out, const float* inp, const float* weight,
                    const float* bias, int N, int C, int OC, int ld_out) {
  use_single_threaded_blas();
  for_each_tile(pool, N, OC, [&](int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(r1 - r0), static_cast<int>(c1 - c0), C,
                1.0f, inp + r0 * C, C, weight + c0 * C, C, 0.0f, out + r0 * ld_out + c0, ld_out);
    if (bias != nullptr)
      for (int64_t n = r0; n < r1; ++n) add_into(out + n * ld_out + c0, bias + c0, c1 - c0);
  });
}

void matmul_backward(ThreadPool& pool, float* dinp, float* dweight, float* dbias, const float* dout,
                     const float* inp, const float* weight, int N, int C, int OC, int ld_dout,
                     bool accumulate_dinp) {
  use_single_threaded_blas();
  const float beta = accumulate_dinp ? 1.0f : 0.0f;
  // dinp[r0:r1, c0:c1] (+)= dout[r0:r1, :] · weight[:, c0:c1]
  if (dinp != nullptr) {
    for_each_tile(pool, N, C, [&](int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(r1 - r0), static_cast<int>(c1 - c0),
                  OC, 1.0f, dout + r0 * ld_dout, ld_dout, weight + c0, C, beta, dinp + r0 * C + c0, C);
    });
  }
  if (dweight == nullptr) return;
  // dweight[o0:o1, c0:c1] += dout[:, o0:o1]ᵀ · inp[:, c0:c1]: the product over all N rows
  // is formed from zero in one call, then added into dweight once (sgemm with beta 1
  // would add some of its row blocks into dweight before others), so micro-batches
  // accumulate as ((0 + g0) + g1) + ...: the bits of their gradients summed in order.
  for_each_tile(pool, OC, C, [&](int64_t o0, int64_t o1, int64_t c0, int64_t c1) {
    thread_local std::vector<float> tile;
    tile.resize(static_cast<size_t>(kTileRows * kTileCols));
    const int64_t w = c1 - c0;
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, static_cast<int>(o1 - o0), static_cast<int>(w), N, 1.0f,
                dout + o0, ld_dout, inp + c0, C, 0.0f, tile.data(), static_cast<int>(w));
    for (int64_t o = o0; o < o1; ++o) add_into(dweight + o * C + c0, tile.data() + (o - o0) * w, w);
  });
  if (dbias != nullptr) column_sums_into(pool, dbias, dout, N, OC, ld_dout);
}

namespace {
constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kGeluCubic = 0.044715f;
constexpr float kGeluCubic3 = 3.0f * 0.044715f;
}  // namespace

void gelu_forward(ThreadPool& pool, float* out, const float* inp, size_t n) {
  pool.parallel_for(
      static_cast<int64_t>(n),
      [&](int64_t i0, int64_t i1) {
        map1(out + i0, inp + i0, i1 - i0, [](auto x) {
          auto u = kSqrt2OverPi * (x + ((kGeluCubic * x) * x) * x);
          auto sig = 1.0f / (1.0f + exp_any(-2.0f * u));
          return x * sig;
        });
      },
      kElementGrain);
}

void gelu_backward(ThreadPool& pool, float* dinp, const float* inp, const float* dout, size_t n) {
  pool.parallel_for(
      static_cast<int64_t>(n),
      [&](int64_t i0, int64_t i1) {
        map2(dinp + i0, inp + i0, dout + i0, i1 - i0, [](auto x, auto g) {
          auto u = kSqrt2OverPi * (x + ((kGeluCubic * x) * x) * x);
          auto sig = 1.0f / (1.0f + exp_any(-2.0f * u));
          auto du = kSqrt2OverPi * (1.0f + (kGeluCubic3 * x) * x);
          auto local = sig + (((2.0f * x) * sig) * (1.0f - sig)) * du;
          return local * g;
        });
      },
      kElementGrain);
}

void residual_forward(ThreadPool& pool, float* out, const float* a, const float* b, size_t n) {
  pool.parallel_for(
      static_cast<int64_t>(n),
      [&](int64_t i0, int64_t i1) { map2(out + i0, a + i0, b + i0, i1 - i0, [](auto x, auto y) { return x + y; }); },
      kElementGrain);
}

void rope(ThreadPool& pool, float* out, const float* inp, int B, int T, int NH, int KVH, int D,
          const RopeParams& rope, float sign) {
  const int64_t N = int64_t{B} * T, half = D / 2, width = (int64_t{NH} + 2 * KVH) * D;
  const int64_t rotated = int64_t{NH} + KVH;  // q and k heads; the v heads follow
  std::vector<float> inv_freq(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i) inv_freq[i] = rope_inv_freq(rope, D, static_cast<int>(i));
  pool.parallel_for(
      N,
      [&](int64_t n0, int64_t n1) {
        std::vector<float> c(static_cast<size_t>(half)), s(static_cast<size_t>(half));
        for (int64_t n = n0; n < n1; ++n) {
          const float t = static_cast<float>(n % T);
          for (int64_t i = 0; i < half; ++i) {
            const float angle = t * inv_freq[i];
            c[i] = std::cos(angle);
            s[i] = sign * std::sin(angle);
          }
          const float* x = inp + n * width;
          float* y = out + n * width;
          for (int64_t h = 0; h < rotated; ++h) {
            const float* x1 = x + h * D;
            const float* x2 = x1 + half;
            float* y1 = y + h * D;
            float* y2 = y1 + half;
            for (int64_t i = 0; i < half; ++i) {
              const float a = x1[i], b = x2[i];
              y1[i] = a * c[i] - b * s[i];
              y2[i] = b * c[i] + a * s[i];
            }
          }
          std::copy(x + rotated * D, x + width, y + rotated * D);
        }
      },
      8);
}

void swiglu_forward(ThreadPool& pool, float* out, const float* inp, int64_t N, int I) {
  pool.parallel_for(
      N,
      [&](int64_t n0, int64_t n1) {
        for (int64_t n = n0; n < n1; ++n) {
          const float* gate = inp + n * 2 * I;
          map2(out + n * I, gate, gate + I, I, [](auto g, auto u) { return (g / (1.0f + exp_any(-g))) * u; });
        }
      },
      8);
}

void swiglu_backward(ThreadPool& pool, float* dinp, const float* inp, const float* dout, int64_t N, int I) {
  pool.parallel_for(
      N,
      [&](int64_t n0, int64_t n1) {
        for (int64_t n = n0; n < n1; ++n) {
          const float* gate = inp + n * 2 * I;
          const float* up = gate + I;
          const float* d = dout + n * I;
          float* dgate = dinp + n * 2 * I;
          float* dup = dgate + I;
          // dup = dout·silu(gate), then dgate = dout·up·σ(gate)·(1 + gate·(1 − σ(gate))).
          map2(dup, gate, d, I, [](auto g, auto dv) { return dv * (g / (1.0f + exp_any(-g))); });
          map3(dgate, gate, up, d, I, [](auto g, auto u, auto dv) {
            auto sig = 1.0f / (1.0f + exp_any(-g));
            return ((dv * u) * sig) * (1.0f + g * (1.0f - sig));
          });
        }
      },
      8);
}

void crossentropy_forward(ThreadPool& pool, float* losses, const float* logits, const int32_t* targets,
                          int N, int V, int ld) {
  pool.parallel_for(N, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const float* x = logits + n * ld;
      const float m = row_max(x, V);
      const float sum = exp_shift_sum<false>(nullptr, x, m, V);
      losses[n] = std::log(sum) - (x[targets[n]] - m);
    }
  });
}

void crossentropy_backward(ThreadPool& pool, float* losses, float* logits, const int32_t* targets,
                           int N, int V, int ld, float dloss_scale) {
  pool.parallel_for(N, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      float* x = logits + n * ld;
      const int32_t t = targets[n];
      const float m = row_max(x, V);
      const float xt = x[t];
      const float sum = exp_shift_sum<true>(x, x, m, V);  // x now holds exp(x - m)
      losses[n] = std::log(sum) - (xt - m);
      const float et = x[t];
      map1(x, x, V, [=](auto e) { return (e / sum) * dloss_scale; });
      x[t] = (et / sum - 1.0f) * dloss_scale;
    }
  });
}

void squared_norm(ThreadPool& pool, float* out_sq, const float* grad, size_t n) {
  typedef float f32x2 __attribute__((vector_size(8)));
  typedef double f64x2 __attribute__((vector_size(16)));
  const int64_t count = static_cast<int64_t>(n);
  const int64_t blocks = (count + kNormBlock - 1) / kNormBlock;
  std::vector<double> partial(static_cast<size_t>(blocks), 0.0);
  pool.parallel_for(blocks, [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1; ++blk) {
      const float* x = grad + blk * kNormBlock;
      const int64_t len = std::min(kNormBlock, count - blk * kNormBlock);
      f64x2 acc[4] = {};  // 8 lanes; a float's square is exact in double
      int64_t i = 0;
      for (; i + 8 <= len; i += 8)
        for (int k = 0; k < 4; ++k) {
          f32x2 v;
          std::memcpy(&v, x + i + 2 * k, sizeof v);
          f64x2 d = __builtin_convertvector(v, f64x2);
          acc[k] += d * d;
        }
      for (int l = 0; i < len; ++i, ++l) {
        const double d = x[i];
        acc[l / 2][l % 2] += d * d;
      }
      double s = 0.0;
      for (int k = 0; k < 4; ++k) s += acc[k][0] + acc[k][1];
      partial[static_cast<size_t>(blk)] = s;
    }
  });
  double total = 0.0;
  for (double p : partial) total += p;
  out_sq[0] = static_cast<float>(total);
}

}  // namespace spillway::cpu
