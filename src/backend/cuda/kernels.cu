// Fused deterministic kernels of the CUDA backend (see cuda_kernels.cuh).
#include <cub/device/device_radix_sort.cuh>

#include <cmath>
#include <cstring>

#include "backend/cuda/cuda_kernels.cuh"

namespace spillway::cuda_detail {
namespace {

constexpr float kLnEps = 1e-5f;
constexpr int kThreads = 256;

cudaError_t launched() { return cudaGetLastError(); }

// Grid size for an element-wise kernel over `items` work items, capped so that the
// grid-stride loop never needs more blocks than CUDA allows.
unsigned grid_for(size_t items, int threads = kThreads) {
  size_t g = (items + threads - 1) / threads;
  if (g < 1) g = 1;
  if (g > 65535u * 32u) g = 65535u * 32u;
  return static_cast<unsigned>(g);
}

// ---------------------------------------------------------------- embedding

// Row of a vocab tile [vocab_begin, vocab_begin + vocab_rows) that holds `token`, or -1
// when the token is outside it (64-bit arithmetic: vocab_rows may be INT_MAX).
__device__ __forceinline__ int64_t tile_row(int32_t token, int vocab_begin, int vocab_rows) {
  const int64_t row = static_cast<int64_t>(token) - vocab_begin;
  return row >= 0 && row < vocab_rows ? row : -1;
}

// out[N,C], tokens[N], wte[vocab_rows,C], wpe[T_max,C] or null (no position table);
// one thread per 8 columns (VEC=8) or 1. Positions whose token is outside the tile
// are left as they are.
template <int VEC>
__global__ void embedding_forward_kernel(bf16* out, const int32_t* tokens, const bf16* wte,
                                         const bf16* wpe, int N, int T, int C, int vocab_begin,
                                         int vocab_rows) {
  const size_t per_row = C / VEC;
  const size_t total = static_cast<size_t>(N) * per_row;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const int n = static_cast<int>(i / per_row);
    const int c = static_cast<int>(i % per_row) * VEC;
    const int t = n % T;
    const int64_t row = tile_row(tokens[n], vocab_begin, vocab_rows);
    if (row < 0) continue;
    const size_t tok = static_cast<size_t>(row);
    if (wpe == nullptr) {  // a copy of the row
      if constexpr (VEC == 8) store8(out + static_cast<size_t>(n) * C + c, load8(wte + tok * C + c));
      else out[static_cast<size_t>(n) * C + c] = wte[tok * C + c];
    } else if constexpr (VEC == 8) {
      float a[8], b[8];
      unpack8(load8(wte + tok * C + c), a);
      unpack8(load8(wpe + static_cast<size_t>(t) * C + c), b);
#pragma unroll
      for (int k = 0; k < 8; ++k) a[k] += b[k];
      store8(out + static_cast<size_t>(n) * C + c, pack8(a));
    } else {
      float a = __bfloat162float(wte[tok * C + c]) + __bfloat162float(wpe[static_cast<size_t>(t) * C + c]);
      out[static_cast<size_t>(n) * C + c] = __float2bfloat16_rn(a);
    }
  }
}

// The pairs to sort: keys[i] = the tile row of tokens[i] (-1 outside the tile), vals[i] = i.
__global__ void embedding_keys_kernel(int32_t* keys, int32_t* vals, const int32_t* tokens, int n,
                                      int vocab_begin, int vocab_rows) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    keys[i] = static_cast<int32_t>(tile_row(tokens[i], vocab_begin, vocab_rows));
    vals[i] = i;
  }
}

// dwte[rows,C] += Σ dout[pos, :] over each run of equal rows in keys[N] (sorted,
// stable, so positions pos = vals[N] ascend within a run). One warp per sorted
// element; only the warp at the start of a run works, on columns
// [blockIdx.y * 32 * VEC, +32 * VEC).
template <int VEC>
__global__ void embedding_dwte_kernel(bf16* dwte, const bf16* dout, const int32_t* keys,
                                      const int32_t* vals, int N, int C) {
  const int warps = blockDim.x / 32;
  const int i = blockIdx.x * warps + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (i >= N) return;
  const int key = keys[i];
  if (key < 0) return;  // outside the tile
  if (i > 0 && keys[i - 1] == key) return;
  const int c = (blockIdx.y * 32 + lane) * VEC;
  if (c >= C) return;
  float acc[VEC];
#pragma unroll
  for (int k = 0; k < VEC; ++k) acc[k] = 0.0f;
  for (int j = i; j < N && keys[j] == key; ++j) {
    const bf16* row = dout + static_cast<size_t>(vals[j]) * C + c;
    if constexpr (VEC == 8) {
      float f[8];
      unpack8(load8(row), f);
#pragma unroll
      for (int k = 0; k < 8; ++k) acc[k] += f[k];
    } else {
      acc[0] += __bfloat162float(row[0]);
    }
  }
  bf16* dst = dwte + static_cast<size_t>(key) * C + c;
  if constexpr (VEC == 8) {
    float f[8];
    unpack8(load8(dst), f);
#pragma unroll
    for (int k = 0; k < 8; ++k) f[k] += acc[k];
    store8(dst, pack8(f));
  } else {
    dst[0] = __float2bfloat16_rn(__bfloat162float(dst[0]) + acc[0]);
  }
}

// dwpe[T_max,C] += Σ_b dout[b,t,:]; one thread per (t, c); dout[B,T,C].
__global__ void embedding_dwpe_kernel(bf16* dwpe, const bf16* dout, int B, int T, int C) {
  const size_t total = static_cast<size_t>(T) * C;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    float acc = 0.0f;
    for (int b = 0; b < B; ++b) acc += __bfloat162float(dout[static_cast<size_t>(b) * total + i]);
    dwpe[i] = __float2bfloat16_rn(__bfloat162float(dwpe[i]) + acc);
  }
}

// ---------------------------------------------------------------- layernorm

// A LayerNorm forward's lane sums over 8 of a row's values, in column order: Σ f for
// the mean, Σ (f - mu)² for the variance. One definition for both forward kernels, so
// that their bits agree.
__device__ __forceinline__ void layernorm_sum8(const float (&f)[8], float& sum) {
#pragma unroll
  for (int k = 0; k < 8; ++k) sum += f[k];
}
__device__ __forceinline__ void layernorm_sq8(const float (&f)[8], float mu, float& sq) {
#pragma unroll
  for (int k = 0; k < 8; ++k) sq += (f[k] - mu) * (f[k] - mu);
}

// Columns c .. c+7 of a LayerNorm's output row o from the input values f (overwritten):
// (f - mu) · rs · weight + bias, rounded to bf16. One definition for both forward kernels.
__device__ __forceinline__ void layernorm_out8(bf16* o, int c, float (&f)[8], const bf16* weight, const bf16* bias,
                                               float mu, float rs) {
  float w[8], b[8];
  unpack8(load8(weight + c), w);
  unpack8(load8(bias + c), b);
#pragma unroll
  for (int k = 0; k < 8; ++k) f[k] = (f[k] - mu) * rs * w[k] + b[k];
  store8(o + c, pack8(f));
}

// One warp per row. out[N,C], mean[N], rstd[N], inp[N,C], weight[C], bias[C].
template <int VEC>
__global__ void layernorm_forward_kernel(bf16* out, float* mean, float* rstd, const bf16* inp,
                                         const bf16* weight, const bf16* bias, int N, int C) {
  const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (row >= N) return;
  const bf16* x = inp + static_cast<size_t>(row) * C;
  float sum = 0.0f;
  for (int c = lane * VEC; c < C; c += 32 * VEC) {
    if constexpr (VEC == 8) {
      float f[8];
      unpack8(load8(x + c), f);
      layernorm_sum8(f, sum);
    } else {
      sum += __bfloat162float(x[c]);
    }
  }
  const float mu = warp_sum(sum) / C;
  float sq = 0.0f;
  for (int c = lane * VEC; c < C; c += 32 * VEC) {
    if constexpr (VEC == 8) {
      float f[8];
      unpack8(load8(x + c), f);
      layernorm_sq8(f, mu, sq);
    } else {
      float d = __bfloat162float(x[c]) - mu;
      sq += d * d;
    }
  }
  const float rs = rsqrtf(warp_sum(sq) / C + kLnEps);
  bf16* o = out + static_cast<size_t>(row) * C;
  for (int c = lane * VEC; c < C; c += 32 * VEC) {
    if constexpr (VEC == 8) {
      float f[8];
      unpack8(load8(x + c), f);
      layernorm_out8(o, c, f, weight, bias, mu, rs);
    } else {
      float f = (__bfloat162float(x[c]) - mu) * rs * __bfloat162float(weight[c]) + __bfloat162float(bias[c]);
      o[c] = __float2bfloat16_rn(f);
    }
  }
  if (lane == 0) {
    if (mean) mean[row] = mu;
    if (rstd) rstd[row] = rs;
  }
}

// layernorm_forward_kernel<8> with the row held in registers: lane l loads its
// columns l·8 + 256·k (k < NCH) once, where the kernel above reads them from memory
// three times (the mean, the variance, the output). The same operations in the same
// order, so the same bits. C % 8 == 0, C ≤ 256·NCH, rows 16-byte aligned. Built in
// with -DSPILLWAY_LAYERNORM_FORWARD_REGISTERS (not yet run on a GPU).
template <int NCH>
__global__ void layernorm_forward_rows_kernel(bf16* out, float* mean, float* rstd, const bf16* inp,
                                              const bf16* weight, const bf16* bias, int N, int C) {
  const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (row >= N) return;
  const bf16* x = inp + static_cast<size_t>(row) * C;
  Bf16x8 xv[NCH];
#pragma unroll
  for (int k = 0; k < NCH; ++k)
    if (lane * 8 + 256 * k < C) xv[k] = load8(x + lane * 8 + 256 * k);
  float sum = 0.0f;
#pragma unroll
  for (int k = 0; k < NCH; ++k) {
    if (lane * 8 + 256 * k < C) {
      float f[8];
      unpack8(xv[k], f);
      layernorm_sum8(f, sum);
    }
  }
  const float mu = warp_sum(sum) / C;
  float sq = 0.0f;
#pragma unroll
  for (int k = 0; k < NCH; ++k) {
    if (lane * 8 + 256 * k < C) {
      float f[8];
      unpack8(xv[k], f);
      layernorm_sq8(f, mu, sq);
    }
  }
  const float rs = rsqrtf(warp_sum(sq) / C + kLnEps);
  bf16* o = out + static_cast<size_t>(row) * C;
#pragma unroll
  for (int k = 0; k < NCH; ++k) {
    const int c = lane * 8 + 256 * k;
    if (c < C) {
      float f[8];
      unpack8(xv[k], f);
      layernorm_out8(o, c, f, weight, bias, mu, rs);
    }
  }
  if (lane == 0) {
    if (mean) mean[row] = mu;
    if (rstd) rstd[row] = rs;
  }
}

// A norm's input gradient over 8 columns of a row, one definition for the dinp kernels
// below and norm_backward_onepass_kernel, so that their bits agree. dnorm = dout ·
// weight, norm = (inp - mu) · rs (RMSNorm: inp · rs, mu unused). The row sums, in
// column order: LN s1 += Σ dnorm and s2 += Σ dnorm·norm; RMSNorm s2 only.
template <bool LN>
__device__ __forceinline__ void norm_row_sums8(const float (&x)[8], const float (&d)[8], const float (&w)[8],
                                               float mu, float rs, float& s1, float& s2) {
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    if constexpr (LN) {
      float dn = d[k] * w[k];
      s1 += dn;
      s2 += dn * (x[k] - mu) * rs;
    } else {
      s2 += d[k] * w[k] * x[k] * rs;
    }
  }
}
// g += rs · (dnorm - m1 - norm · m2) (RMSNorm: no m1), with m1, m2 the row means of
// the sums above.
template <bool LN>
__device__ __forceinline__ void norm_dinp8(float (&g)[8], const float (&x)[8], const float (&d)[8],
                                           const float (&w)[8], float mu, float rs, float m1, float m2) {
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    if constexpr (LN) g[k] += rs * (d[k] * w[k] - m1 - (x[k] - mu) * rs * m2);
    else g[k] += rs * (d[k] * w[k] - x[k] * rs * m2);
  }
}

// dinp[N,C] += rstd * (dnorm - mean(dnorm) - norm * mean(dnorm * norm)), dnorm =
// dout * weight. One warp per row.
template <int VEC>
__global__ void layernorm_dinp_kernel(bf16* dinp, const bf16* dout, const bf16* inp, const bf16* weight,
                                      const float* mean, const float* rstd, int N, int C) {
  const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (row >= N) return;
  const size_t off = static_cast<size_t>(row) * C;
  const float mu = mean[row], rs = rstd[row];
  float s1 = 0.0f, s2 = 0.0f;
  for (int c = lane * VEC; c < C; c += 32 * VEC) {
    if constexpr (VEC == 8) {
      float x[8], d[8], w[8];
      unpack8(load8(inp + off + c), x);
      unpack8(load8(dout + off + c), d);
      unpack8(load8(weight + c), w);
      norm_row_sums8<true>(x, d, w, mu, rs, s1, s2);
    } else {
      float dn = __bfloat162float(dout[off + c]) * __bfloat162float(weight[c]);
      s1 += dn;
      s2 += dn * (__bfloat162float(inp[off + c]) - mu) * rs;
    }
  }
  const float m1 = warp_sum(s1) / C, m2 = warp_sum(s2) / C;
  for (int c = lane * VEC; c < C; c += 32 * VEC) {
    if constexpr (VEC == 8) {
      float x[8], d[8], w[8], g[8];
      unpack8(load8(inp + off + c), x);
      unpack8(load8(dout + off + c), d);
      unpack8(load8(weight + c), w);
      unpack8(load8(dinp + off + c), g);
      norm_dinp8<true>(g, x, d, w, mu, rs, m1, m2);
      store8(dinp + off + c, pack8(g));
    } else {
      float x = (__bfloat162float(inp[off + c]) - mu) * rs;
      float dn = __bfloat162float(dout[off + c]) * __bfloat162float(weight[c]);
      float g = __bfloat162float(dinp[off + c]) + rs * (dn - m1 - x * m2);
      dinp[off + c] = __float2bfloat16_rn(g);
    }
  }
}

// Row chunks of the column reductions: a function of N alone, never of the device
// (the scratch they need is sized by cuda_workspace, backend_sizes.h).
using cuda_workspace::column_chunks;
using Chunks = cuda_workspace::ColumnChunks;

// Per-chunk column sums: partial_b[P,C] = Σ_{rows of chunk} x[r,c]; with LN, also
// partial_w[P,C] = Σ dout[r,c] * (inp[r,c] - mean[r]) * rstd[r] (x = dout).
// Rows of x are ldx ≥ C elements apart (ldx == C with LN); inp[N,C].
// grid (ceil(C/256), P), one thread per column, rows in order.
template <bool LN>
__global__ void column_partials_kernel(float* partial_w, float* partial_b, const bf16* x, const bf16* inp,
                                       const float* mean, const float* rstd, int N, int C, int ldx, int rows) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  const int p = blockIdx.y;
  if (c >= C) return;
  const int r0 = p * rows;
  const int r1 = min(N, r0 + rows);
  float acc_w = 0.0f, acc_b = 0.0f;
  // Unrolled so that several rows' loads are in flight; the sums keep their order.
#pragma unroll 8
  for (int r = r0; r < r1; ++r) {
    const float d = __bfloat162float(x[static_cast<size_t>(r) * ldx + c]);
    acc_b += d;
    if constexpr (LN) acc_w += d * (__bfloat162float(inp[static_cast<size_t>(r) * C + c]) - mean[r]) * rstd[r];
  }
  partial_b[static_cast<size_t>(p) * C + c] = acc_b;
  if constexpr (LN) partial_w[static_cast<size_t>(p) * C + c] = acc_w;
}

// out[C] += Σ_p partial[p, c], p in order (out may be null: nothing to do).
__global__ void column_finish_kernel(bf16* out_w, const float* partial_w, bf16* out_b, const float* partial_b,
                                     int P, int C) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  if (out_b) {
    float s = 0.0f;
    for (int p = 0; p < P; ++p) s += partial_b[static_cast<size_t>(p) * C + c];
    out_b[c] = __float2bfloat16_rn(__bfloat162float(out_b[c]) + s);
  }
  if (out_w) {
    float s = 0.0f;
    for (int p = 0; p < P; ++p) s += partial_w[static_cast<size_t>(p) * C + c];
    out_w[c] = __float2bfloat16_rn(__bfloat162float(out_w[c]) + s);
  }
}

// ---------------------------------------------------------------- rmsnorm

// One warp per row. out[N,C] = inp * rstd * weight, rstd[N] = 1/sqrt(mean(inp²) + eps).
template <int VEC>
__global__ void rmsnorm_forward_kernel(bf16* out, float* rstd, const bf16* inp, const bf16* weight, int N, int C,
                                       float eps) {
  const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (row >= N) return;
  const bf16* x = inp + static_cast<size_t>(row) * C;
  float sq = 0.0f;
  for (int c = lane * VEC; c < C; c += 32 * VEC) {
    if constexpr (VEC == 8) {
      float f[8];
      unpack8(load8(x + c), f);
#pragma unroll
      for (int k = 0; k < 8; ++k) sq += f[k] * f[k];
    } else {
      float f = __bfloat162float(x[c]);
      sq += f * f;
    }
  }
  const float rs = rsqrtf(warp_sum(sq) / C + eps);
  bf16* o = out + static_cast<size_t>(row) * C;
  for (int c = lane * VEC; c < C; c += 32 * VEC) {
    if constexpr (VEC == 8) {
      float f[8], w[8];
      unpack8(load8(x + c), f);
      unpack8(load8(weight + c), w);
#pragma unroll
      for (int k = 0; k < 8; ++k) f[k] = f[k] * rs * w[k];
      store8(o + c, pack8(f));
    } else {
      o[c] = __float2bfloat16_rn(__bfloat162float(x[c]) * rs * __bfloat162float(weight[c]));
    }
  }
  if (lane == 0 && rstd) rstd[row] = rs;
}

// dinp[N,C] += rstd * (dnorm - norm * mean(dnorm * norm)), norm = inp * rstd, dnorm =
// dout * weight. One warp per row.
template <int VEC>
__global__ void rmsnorm_dinp_kernel(bf16* dinp, const bf16* dout, const bf16* inp, const bf16* weight,
                                    const float* rstd, int N, int C) {
  const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (row >= N) return;
  const size_t off = static_cast<size_t>(row) * C;
  const float rs = rstd[row];
  float s1 = 0.0f, s2 = 0.0f;  // s1 stays 0: LayerNorm's alone
  for (int c = lane * VEC; c < C; c += 32 * VEC) {
    if constexpr (VEC == 8) {
      float x[8], d[8], w[8];
      unpack8(load8(inp + off + c), x);
      unpack8(load8(dout + off + c), d);
      unpack8(load8(weight + c), w);
      norm_row_sums8<false>(x, d, w, 0.0f, rs, s1, s2);
    } else {
      s2 += __bfloat162float(dout[off + c]) * __bfloat162float(weight[c]) * __bfloat162float(inp[off + c]) * rs;
    }
  }
  const float m2 = warp_sum(s2) / C;
  for (int c = lane * VEC; c < C; c += 32 * VEC) {
    if constexpr (VEC == 8) {
      float x[8], d[8], w[8], g[8];
      unpack8(load8(inp + off + c), x);
      unpack8(load8(dout + off + c), d);
      unpack8(load8(weight + c), w);
      unpack8(load8(dinp + off + c), g);
      norm_dinp8<false>(g, x, d, w, 0.0f, rs, 0.0f, m2);
      store8(dinp + off + c, pack8(g));
    } else {
      float x = __bfloat162float(inp[off + c]) * rs;
      float dn = __bfloat162float(dout[off + c]) * __bfloat162float(weight[c]);
      dinp[off + c] = __float2bfloat16_rn(__bfloat162float(dinp[off + c]) + rs * (dn - x * m2));
    }
  }
}

// Per-chunk column sums of the weight gradient: partial_w[P,C] = Σ_{rows of chunk}
// dout[r,c] * inp[r,c] * rstd[r]. grid (ceil(C/256), P), one thread per column, rows in order.
__global__ void rmsnorm_dweight_partials_kernel(float* partial_w, const bf16* dout, const bf16* inp,
                                                const float* rstd, int N, int C, int rows) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  const int p = blockIdx.y;
  if (c >= C) return;
  const int r0 = p * rows;
  const int r1 = min(N, r0 + rows);
  float acc = 0.0f;
#pragma unroll 8
  for (int r = r0; r < r1; ++r) {
    const size_t i = static_cast<size_t>(r) * C + c;
    acc += __bfloat162float(dout[i]) * __bfloat162float(inp[i]) * rstd[r];
  }
  partial_w[static_cast<size_t>(p) * C + c] = acc;
}

// The backward of a LayerNorm (LN) or an RMSNorm (!LN) of at most 8192 columns, in
// one pass: block p takes chunk p of column_chunks(N) (`rows` rows) with its 8 warps,
// S warps to a row (S = 1, 2, 4 or 8: 8/S row groups). Warp `part` q of row group g
// takes rows r0 + g, r0 + g + 8/S, ... and, of each, the columns of 256-column slots
// q·KP .. q·KP + KP - 1 (lane l: columns l·8 + 256·k + j, j < 8). It writes its part of
// dinp with norm_row_sums8 and norm_dinp8, and adds the part into its lanes' column
// sums in registers while the row is there; the row groups' sums are then added in
// group order through shared memory into the chunk's partial_w[p,:] (Σ dout·norm) and,
// with LN, partial_b[p,:] (Σ dout). Each row is read from HBM once, against twice for
// the two passes.
// The row sums: each part's lanes sum their columns in order and the warp adds the
// lanes (warp_sum); with S = 1 that is the row's sum, as layernorm_dinp_kernel and
// rmsnorm_dinp_kernel form it, so up to 1024 columns the bits are theirs. With S > 1
// the parts' sums are added in part order through shared memory (a named barrier per
// row group): a fixed order, so the same bits in every run, but not the two-pass
// kernels' (which run only where this kernel does not).
// C % 8 == 0, rows 16-byte aligned, ceil(C/256) ≤ S·KP, KP ≤ 4. dinp[N,C], dout[N,C],
// inp[N,C], weight[C], mean[N] (LN), rstd[N]; partial_w, partial_b [P,C].
constexpr int kNormRowWarps = 8;
template <bool LN, int KP, int S>
__global__ void __launch_bounds__(kNormRowWarps * 32, 2)
    norm_backward_onepass_kernel(bf16* dinp, float* partial_w, float* partial_b, const bf16* dout, const bf16* inp,
                                 const bf16* weight, const float* mean, const float* rstd, int N, int C, int rows) {
  static_assert(S == 1 || S == 2 || S == 4 || S == 8, "1, 2, 4 or 8 warps to a row");
  constexpr int kGroups = kNormRowWarps / S;  // rows in flight in a block
  constexpr int kWidth = S * KP * 256;        // columns a row group covers (≥ C)
  __shared__ float sums[kGroups * kWidth];    // [kGroups][kWidth] each row group's column sums
  __shared__ float part_sums[2][kNormRowWarps][2];  // [row parity][warp][s1, s2] with S > 1
  const int p = blockIdx.x;
  const int warp = static_cast<int>(threadIdx.x / 32), lane = static_cast<int>(threadIdx.x & 31);
  const int group = warp / S, part = warp % S;
  const int col0 = lane * 8 + part * KP * 256;  // this lane's first column
  const int r0 = p * rows, r1 = min(N, r0 + rows);
  float aw[KP][8], ab[KP][8];
#pragma unroll
  for (int k = 0; k < KP; ++k)
#pragma unroll
    for (int j = 0; j < 8; ++j) aw[k][j] = ab[k][j] = 0.0f;
  int parity = 0;
  for (int r = r0 + group; r < r1; r += kGroups, parity ^= 1) {
    const size_t off = static_cast<size_t>(r) * C;
    const float mu = LN ? mean[r] : 0.0f, rs = rstd[r];
    Bf16x8 xv[KP], dv[KP], gv[KP];
#pragma unroll
    for (int k = 0; k < KP; ++k) {
      const int c = col0 + k * 256;
      if (c < C) {
        xv[k] = load8(inp + off + c);
        dv[k] = load8(dout + off + c);
        gv[k] = load8(dinp + off + c);
      }
    }
    float s1 = 0.0f, s2 = 0.0f;
#pragma unroll
    for (int k = 0; k < KP; ++k) {
      const int c = col0 + k * 256;
      if (c < C) {
        float x[8], d[8], w[8];
        unpack8(xv[k], x);
        unpack8(dv[k], d);
        unpack8(load8(weight + c), w);
        norm_row_sums8<LN>(x, d, w, mu, rs, s1, s2);
      }
    }
    float t1 = LN ? warp_sum(s1) : 0.0f, t2 = warp_sum(s2);
    if constexpr (S > 1) {
      // The row group's parts, added in part order. Two buffers by row parity: a warp
      // rewrites one only after every warp of its group has passed the next row's
      // barrier, that is, has read it.
      if (lane == 0) {
        part_sums[parity][warp][0] = t1;
        part_sums[parity][warp][1] = t2;
      }
      asm volatile("bar.sync %0, %1;\n" ::"r"(1 + group), "r"(S * 32) : "memory");
      const int w0 = group * S;
      t1 = part_sums[parity][w0][0];
      t2 = part_sums[parity][w0][1];
#pragma unroll
      for (int q = 1; q < S; ++q) {
        t1 += part_sums[parity][w0 + q][0];
        t2 += part_sums[parity][w0 + q][1];
      }
    }
    const float m1 = LN ? t1 / C : 0.0f, m2 = t2 / C;
#pragma unroll
    for (int k = 0; k < KP; ++k) {
      const int c = col0 + k * 256;
      if (c < C) {
        float x[8], d[8], w[8], g[8];
        unpack8(xv[k], x);
        unpack8(dv[k], d);
        unpack8(load8(weight + c), w);
        unpack8(gv[k], g);
        norm_dinp8<LN>(g, x, d, w, mu, rs, m1, m2);
#pragma unroll
        for (int j = 0; j < 8; ++j) {  // the column sums, as column_partials_kernel and
          if constexpr (LN) {          // rmsnorm_dweight_partials_kernel form them
            ab[k][j] += d[j];
            aw[k][j] += d[j] * (x[j] - mu) * rs;
          } else {
            aw[k][j] += d[j] * x[j] * rs;
          }
        }
        store8(dinp + off + c, pack8(g));
      }
    }
  }
  // The chunk's column sums: the row groups' in group order, one thread per column.
  auto combine = [&](float (&acc)[KP][8], float* partial) {
#pragma unroll
    for (int k = 0; k < KP; ++k) {
      const int c = col0 + k * 256;
      if (c < C)
#pragma unroll
        for (int j = 0; j < 8; ++j) sums[group * kWidth + c + j] = acc[k][j];
    }
    __syncthreads();
    for (int c = static_cast<int>(threadIdx.x); c < C; c += blockDim.x) {
      float t = 0.0f;
#pragma unroll
      for (int g = 0; g < kGroups; ++g) t += sums[g * kWidth + c];
      partial[static_cast<size_t>(p) * C + c] = t;
    }
    __syncthreads();
  };
  combine(aw, partial_w);
  if constexpr (LN) combine(ab, partial_b);
}

// The widest row norm_backward_onepass_kernel takes: 8 warps of 4 slots of 256
// columns. -DSPILLWAY_NORM_ONEPASS_MAX_1024 keeps wider rows on the two passes, to time
// both in one call.
#ifdef SPILLWAY_NORM_ONEPASS_MAX_1024
constexpr int kNormOnepassMaxC = 1024;
#else
constexpr int kNormOnepassMaxC = 8192;
#endif

// Launches norm_backward_onepass_kernel when its conditions hold (C % 8 == 0,
// C ≤ kNormOnepassMaxC, every row 16-byte aligned); false when they do not (nothing
// launched). S: the fewest warps to a row that keep a warp's part at 4 slots or fewer.
template <bool LN>
bool launch_norm_backward_onepass(bf16* dinp, float* partial_w, float* partial_b, const bf16* dout, const bf16* inp,
                                  const bf16* weight, const float* mean, const float* rstd, int N, int C,
                                  const cuda_workspace::ColumnChunks& ch, cudaStream_t stream) {
  if (C % 8 != 0 || C > kNormOnepassMaxC || !aligned16(dinp) || !aligned16(dout) || !aligned16(inp) ||
      !aligned16(weight))
    return false;
  const int nch = (C + 255) / 256;
  const dim3 grid(ch.count), block(kNormRowWarps * 32);
#define SPILLWAY_NORM_ONEPASS(KP, S)                                                                       \
  norm_backward_onepass_kernel<LN, KP, S><<<grid, block, 0, stream>>>(dinp, partial_w, partial_b, dout, inp, \
                                                                      weight, mean, rstd, N, C, ch.rows)
  if (nch <= 4) {
    switch (nch) {
      case 1: SPILLWAY_NORM_ONEPASS(1, 1); break;
      case 2: SPILLWAY_NORM_ONEPASS(2, 1); break;
      case 3: SPILLWAY_NORM_ONEPASS(3, 1); break;
      default: SPILLWAY_NORM_ONEPASS(4, 1); break;
    }
  } else {
    const int S = nch <= 8 ? 2 : nch <= 16 ? 4 : 8;
    const bool three = (nch + S - 1) / S <= 3;  // slots a part: 3 or 4
    switch (S) {
      case 2: three ? SPILLWAY_NORM_ONEPASS(3, 2) : SPILLWAY_NORM_ONEPASS(4, 2); break;
      case 4: three ? SPILLWAY_NORM_ONEPASS(3, 4) : SPILLWAY_NORM_ONEPASS(4, 4); break;
      default: three ? SPILLWAY_NORM_ONEPASS(3, 8) : SPILLWAY_NORM_ONEPASS(4, 8); break;
    }
  }
#undef SPILLWAY_NORM_ONEPASS
  return true;
}

// ---------------------------------------------------------------- element-wise

constexpr float kGeluS = 0.7978845608028654f;  // sqrt(2/pi)

__device__ __forceinline__ float gelu_f(float x) {
  float cube = 0.044715f * x * x * x;
  return 0.5f * x * (1.0f + tanhf(kGeluS * (x + cube)));
}

__device__ __forceinline__ float gelu_grad_f(float x) {
  float cube = 0.044715f * x * x * x;
  float t = tanhf(kGeluS * (x + cube));
  float sech2 = 1.0f - t * t;
  return 0.5f * (1.0f + t) + x * 0.5f * sech2 * kGeluS * (1.0f + 3.0f * 0.044715f * x * x);
}

enum class Ew { Gelu, GeluBackward, Add };

// out[n] = f(a[n], b[n]); 8 elements per thread when VEC == 8 (then n % 8 == 0).
template <Ew OP, int VEC>
__global__ void elementwise_kernel(bf16* out, const bf16* a, const bf16* b, size_t n) {
  const size_t items = n / VEC;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < items;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    float x[VEC], y[VEC];
    if constexpr (VEC == 8) {
      unpack8(load8(a + i * 8), x);
      if constexpr (OP != Ew::Gelu) unpack8(load8(b + i * 8), y);
    } else {
      x[0] = __bfloat162float(a[i]);
      if constexpr (OP != Ew::Gelu) y[0] = __bfloat162float(b[i]);
    }
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      if constexpr (OP == Ew::Gelu) x[k] = gelu_f(x[k]);
      else if constexpr (OP == Ew::GeluBackward) x[k] = gelu_grad_f(x[k]) * y[k];
      else x[k] = x[k] + y[k];
    }
    if constexpr (VEC == 8) store8(out + i * 8, pack8(x));
    else out[i] = __float2bfloat16_rn(x[0]);
  }
}

template <Ew OP>
cudaError_t launch_elementwise(bf16* out, const bf16* a, const bf16* b, size_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const bool vec = n % 8 == 0 && aligned16(out) && aligned16(a) && (b == nullptr || aligned16(b));
  if (vec) elementwise_kernel<OP, 8><<<grid_for(n / 8), kThreads, 0, stream>>>(out, a, b, n);
  else elementwise_kernel<OP, 1><<<grid_for(n), kThreads, 0, stream>>>(out, a, b, n);
  return launched();
}

// ---------------------------------------------------------------- RoPE

// The rotation frequencies, by value (a kernel argument).
struct RopeFreqs {
  float f[kMaxRopeHeadDim / 2];
};

// out/inp [N, (NH+2·KVH)·D]. Work item = (row n, pairs [c, c+VEC)): cos/sin of
// float(t)·inv_freq computed once, then every q and k head turned, the v heads copied.
template <int VEC>
__global__ void rope_kernel(bf16* out, const bf16* inp, int N, int T, int NH, int KVH, int D, RopeFreqs freqs,
                            float sign) {
  const int half = D / 2, chunks = half / VEC;
  const size_t width = static_cast<size_t>(NH + 2 * KVH) * D;
  const size_t items = static_cast<size_t>(N) * chunks;
  for (size_t it = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; it < items;
       it += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const int n = static_cast<int>(it / chunks), c = static_cast<int>(it % chunks) * VEC;
    const float t = static_cast<float>(n % T);
    float cs[VEC], sn[VEC];
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      sincosf(__fmul_rn(t, freqs.f[c + k]), &sn[k], &cs[k]);
      sn[k] *= sign;
    }
    const bf16* x = inp + static_cast<size_t>(n) * width + c;
    bf16* y = out + static_cast<size_t>(n) * width + c;
    for (int h = 0; h < NH + KVH; ++h) {
      const size_t o = static_cast<size_t>(h) * D;
      float a[VEC], b[VEC];
      if constexpr (VEC == 8) {
        unpack8(load8(x + o), a);
        unpack8(load8(x + o + half), b);
      } else {
        a[0] = __bfloat162float(x[o]);
        b[0] = __bfloat162float(x[o + half]);
      }
      float y1[VEC], y2[VEC];
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        y1[k] = a[k] * cs[k] - b[k] * sn[k];
        y2[k] = b[k] * cs[k] + a[k] * sn[k];
      }
      if constexpr (VEC == 8) {
        store8(y + o, pack8(y1));
        store8(y + o + half, pack8(y2));
      } else {
        y[o] = __float2bfloat16_rn(y1[0]);
        y[o + half] = __float2bfloat16_rn(y2[0]);
      }
    }
    for (int h = NH + KVH; h < NH + 2 * KVH; ++h) {
      const size_t o = static_cast<size_t>(h) * D;
      if constexpr (VEC == 8) {
        store8(y + o, load8(x + o));
        store8(y + o + half, load8(x + o + half));
      } else {
        y[o] = x[o];
        y[o + half] = x[o + half];
      }
    }
  }
}

// ---------------------------------------------------------------- SwiGLU

__device__ __forceinline__ float sigmoid_f(float x) { return 1.0f / (1.0f + expf(-x)); }

// inp[N,2I] = [gate | up]; forward: out[N,I] = silu(gate)·up; backward (dout given):
// out = dinp[N,2I] = [dout·up·silu'(gate) | dout·silu(gate)]. Item = (row, VEC columns).
template <bool BACKWARD, int VEC>
__global__ void swiglu_kernel(bf16* out, const bf16* inp, const bf16* dout, int64_t N, int I) {
  const int chunks = I / VEC;
  const size_t items = static_cast<size_t>(N) * chunks;
  for (size_t it = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; it < items;
       it += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const size_t n = it / chunks;
    const int c = static_cast<int>(it % chunks) * VEC;
    const bf16* gate = inp + n * 2 * I + c;
    float g[VEC], u[VEC], d[VEC];
    if constexpr (VEC == 8) {
      unpack8(load8(gate), g);
      unpack8(load8(gate + I), u);
      if constexpr (BACKWARD) unpack8(load8(dout + n * I + c), d);
    } else {
      g[0] = __bfloat162float(gate[0]);
      u[0] = __bfloat162float(gate[I]);
      if constexpr (BACKWARD) d[0] = __bfloat162float(dout[n * I + c]);
    }
    if constexpr (!BACKWARD) {
      float y[VEC];
#pragma unroll
      for (int k = 0; k < VEC; ++k) y[k] = g[k] * sigmoid_f(g[k]) * u[k];
      if constexpr (VEC == 8) store8(out + n * I + c, pack8(y));
      else out[n * I + c] = __float2bfloat16_rn(y[0]);
    } else {
      float dg[VEC], du[VEC];
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const float sig = sigmoid_f(g[k]);
        du[k] = d[k] * (g[k] * sig);
        dg[k] = d[k] * u[k] * sig * (1.0f + g[k] * (1.0f - sig));
      }
      bf16* dst = out + n * 2 * I + c;
      if constexpr (VEC == 8) {
        store8(dst, pack8(dg));
        store8(dst + I, pack8(du));
      } else {
        dst[0] = __float2bfloat16_rn(dg[0]);
        dst[I] = __float2bfloat16_rn(du[0]);
      }
    }
  }
}

// ---------------------------------------------------------------- cross-entropy

// One block per row. losses[N], logits[N,V], targets[N]. With `backward`,
// logits[n,:] is overwritten with (softmax - onehot) * scale.
// VEC = 8: the first V/8·8 columns in vectors of 8, then the tail one per thread.
// CACHE: the row is read from global memory once and kept in dynamic shared memory
// (V bf16, rounded up to 16 bytes) for the backward's second pass; the same values in
// the same order, so the same bits as without it, with a third less traffic.
template <int VEC, bool CACHE>
__global__ void crossentropy_kernel(float* losses, bf16* logits, const int32_t* targets, int V, int ld,
                                    bool backward, float scale) {
  static_assert(!CACHE || VEC == 8, "the cached row is kept in vectors of 8");
  __shared__ float red[32];
  extern __shared__ __align__(16) unsigned char cache_bytes[];
  bf16* cache = reinterpret_cast<bf16*>(cache_bytes);  // [V] when CACHE
  const int n = blockIdx.x;
  bf16* row = logits + static_cast<size_t>(n) * ld;
  const int target = targets[n];
  const bool valid = target >= 0 && target < V;
  const float xt = valid ? __bfloat162float(row[target]) : NAN;  // read before any write
  const int body = V / VEC * VEC;
  const int tail = static_cast<int>(threadIdx.x) + body;  // this thread's tail column, if < V
  float m = -INFINITY, s = 0.0f;
  auto accumulate = [&](float x) {
    if (x > m) {
      s = s * __expf(m - x) + 1.0f;
      m = x;
    } else {
      s += __expf(x - m);
    }
  };
  for (int c = threadIdx.x * VEC; c < body; c += blockDim.x * VEC) {
    float f[VEC];
    if constexpr (VEC == 8) {
      const Bf16x8 v = load8(row + c);
      if constexpr (CACHE) store8(cache + c, v);
      unpack8(v, f);
    } else {
      f[0] = __bfloat162float(row[c]);
    }
#pragma unroll
    for (int k = 0; k < VEC; ++k) accumulate(f[k]);
  }
  if (VEC > 1 && tail < V) {
    const bf16 x = row[tail];
    if constexpr (CACHE) cache[tail] = x;
    accumulate(__bfloat162float(x));
  }
  // block_max synchronizes the block, so every thread's cached values are visible
  // after it (each thread reads back only what it wrote, but the order is kept plain).
  const float M = block_max(m, red);
  const float S = block_sum(m == -INFINITY ? 0.0f : s * __expf(m - M), red);
  if (threadIdx.x == 0) losses[n] = logf(S) + M - xt;
  if (!backward) return;
  const bf16* src = CACHE ? cache : row;
  const float inv = 1.0f / S;
  for (int c = threadIdx.x * VEC; c < body; c += blockDim.x * VEC) {
    float f[VEC];
    if constexpr (VEC == 8) unpack8(load8(src + c), f);
    else f[0] = __bfloat162float(src[c]);
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      float p = __expf(f[k] - M) * inv;
      f[k] = (p - (c + k == target ? 1.0f : 0.0f)) * scale;
    }
    if constexpr (VEC == 8) store8(row + c, pack8(f));
    else row[c] = __float2bfloat16_rn(f[0]);
  }
  if (VEC > 1 && tail < V) {
    float p = __expf(__bfloat162float(src[tail]) - M) * inv;
    row[tail] = __float2bfloat16_rn((p - (tail == target ? 1.0f : 0.0f)) * scale);
  }
}

// ---------------------------------------------------------------- norms, AdamW

using cuda_workspace::kNormBlocks;  // squared_norm_scratch_bytes() holds one partial per block

unsigned norm_blocks(size_t n) {
  size_t g = (n + 8 * kThreads * 4 - 1) / (8 * kThreads * 4);
  if (g < 1) g = 1;
  if (g > kNormBlocks) g = kNormBlocks;
  return static_cast<unsigned>(g);
}

// The reduction tree of a squared norm, shared by the one-tensor kernels and the
// multi-tensor ones so that both give the same bits. Pass 1: `blocks` blocks; block b's
// thread t adds, in order, the squares of items b·blockDim + t, then every
// blocks·blockDim items further (an item: VEC elements, added one by one), each as one
// fused multiply-add; then block_sum. Pass 2: one block adds the partials (thread t:
// partial t, t + blockDim, ...) and then the square of tail element t, then block_sum.
template <int VEC>
__device__ __forceinline__ float norm_partial_sum(const bf16* grad, size_t items, unsigned block, unsigned blocks) {
  float acc = 0.0f;
  for (size_t i = block * static_cast<size_t>(blockDim.x) + threadIdx.x; i < items;
       i += static_cast<size_t>(blocks) * blockDim.x) {
    if constexpr (VEC == 8) {
      float f[8];
      unpack8(load8(grad + i * 8), f);
#pragma unroll
      for (int k = 0; k < 8; ++k) acc = __fmaf_rn(f[k], f[k], acc);
    } else {
      const float f = __bfloat162float(grad[i]);
      acc = __fmaf_rn(f, f, acc);
    }
  }
  return acc;
}

// Pass 2 (above): every thread gets Σ partial[P] + Σ tail[tail_n]².
__device__ __forceinline__ float norm_finish_sum(const float* partial, int P, const bf16* tail, int tail_n,
                                                 float* red) {
  float acc = 0.0f;
  for (int i = threadIdx.x; i < P; i += blockDim.x) acc += partial[i];
  if (threadIdx.x < tail_n) {
    const float f = __bfloat162float(tail[threadIdx.x]);
    acc = __fmaf_rn(f, f, acc);
  }
  return block_sum(acc, red);
}

// partial[gridDim.x] = per-block Σ grad² (grid-stride, fixed grid); grad[n].
template <int VEC>
__global__ void squared_norm_partial_kernel(float* partial, const bf16* grad, size_t n) {
  __shared__ float red[32];
  float acc = norm_partial_sum<VEC>(grad, n / VEC, blockIdx.x, gridDim.x);
  acc = block_sum(acc, red);
  if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

// out[0] = Σ partial[P] + Σ tail grad² (tail = elements past the last full vector).
__global__ void squared_norm_finish_kernel(float* out, const float* partial, int P, const bf16* tail,
                                           int tail_n) {
  __shared__ float red[32];
  const float acc = norm_finish_sum(partial, P, tail, tail_n, red);
  if (threadIdx.x == 0) out[0] = acc;
}

// The calls of one multi-tensor squared-norm launch, passed by value (kernel
// parameter space: at most 32764 bytes on sm_70+ with CUDA 12.1+).
struct NormTable {
  const bf16* grad[kMultiNormTensors];               // [count] each call's grad
  float* out[kMultiNormTensors];                     // [count] each call's out_sq
  uint64_t body[kMultiNormTensors];                  // [count] elements of pass 1 (n, or n/8·8 vectorized)
  uint32_t first_block[kMultiNormTensors + 1];       // [count + 1] pass-1 blocks (= partials) before call i
  uint8_t tail[kMultiNormTensors];                   // [count] elements past body, squared in pass 2 (0..7)
  uint8_t vec[kMultiNormTensors];                    // [count] 1: pass 1 reads 8 elements at a time
  int count;
};
static_assert(sizeof(NormTable) <= 32764, "kernel parameters hold at most 32764 bytes");

// The call whose blocks hold block b: the last i < count with first[i] <= b (every
// call has at least one block, so first[] increases).
__device__ __forceinline__ int call_of_block(const uint32_t* first, int count, uint32_t b) {
  int lo = 0, hi = count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (first[mid] <= b) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

// Pass 1 of every call of t: block first_block[i] + b is call i's block b of
// first_block[i + 1] - first_block[i]; partial[first_block[count]].
__global__ void multi_squared_norm_partial_kernel(float* partial, const __grid_constant__ NormTable t) {
  __shared__ float red[32];
  const int i = call_of_block(t.first_block, t.count, blockIdx.x);
  const unsigned block = blockIdx.x - t.first_block[i], blocks = t.first_block[i + 1] - t.first_block[i];
  float acc = t.vec[i] ? norm_partial_sum<8>(t.grad[i], t.body[i] / 8, block, blocks)
                       : norm_partial_sum<1>(t.grad[i], t.body[i], block, blocks);
  acc = block_sum(acc, red);
  if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

// Pass 2: block i finishes call i.
__global__ void multi_squared_norm_finish_kernel(const float* partial, const __grid_constant__ NormTable t) {
  __shared__ float red[32];
  const int i = blockIdx.x;
  const uint32_t p0 = t.first_block[i];
  const float acc = norm_finish_sum(partial + p0, static_cast<int>(t.first_block[i + 1] - p0), t.grad[i] + t.body[i],
                                    t.tail[i], red);
  if (threadIdx.x == 0) t.out[i][0] = acc;
}

// scale_norm[2] from sq[P]: the double sum of clip_scale_host, in index order.
__global__ void clip_scale_kernel(float* scale_norm, const float* sq, int P, float max_norm) {
  double sum = 0.0;
  for (int i = 0; i < P; ++i) sum += static_cast<double>(sq[i]);
  const double norm = sqrt(sum);
  float scale = 1.0f;
  if (norm > static_cast<double>(max_norm))
    scale = static_cast<float>(static_cast<double>(max_norm) / (norm + 1e-6));
  if (!isfinite(norm)) scale = __int_as_float(0x7fc00000);  // NaN: the step is skipped (optim/adamw.h)
  scale_norm[0] = scale;
  scale_norm[1] = static_cast<float>(norm);
}

// bf16 of optim's round_bf16: nearest even; NaN keeps sign and top payload, made quiet.
__device__ __forceinline__ bf16 round_bf16(float f) {
  const uint32_t bits = __float_as_uint(f);
  if ((bits & 0x7fffffffu) > 0x7f800000u)
    return __ushort_as_bfloat16(static_cast<unsigned short>((bits >> 16) | 0x0040u));
  return __float2bfloat16_rn(f);
}

__device__ __forceinline__ void adamw_one(float gin, float scale, float& m, float& v, float& w,
                                          const AdamWHyper& h) {
  const float g = __fmul_rn(gin, scale);
  m = __fmaf_rn(h.beta1, m, __fmul_rn(h.one_minus_beta1, g));
  v = __fmaf_rn(h.beta2, v, __fmul_rn(__fmul_rn(h.one_minus_beta2, g), g));
  const float mhat = __fdiv_rn(m, h.bias_correction1);
  const float vhat = __fdiv_rn(v, h.bias_correction2);
  const float upd = __fdiv_rn(mhat, __fadd_rn(__fsqrt_rn(vhat), h.eps));
  w = __fmaf_rn(-h.lr, __fmaf_rn(h.weight_decay, w, upd), w);
}

// Elements 4i..4i+3 (adamw_vec4) or element i (adamw_elem) of one AdamW update:
// param[n], master[n], m[n], v[n], grad[n]; the 4-wide form needs 16-byte aligned F32
// arrays and 8-byte aligned bf16 ones. With `skip` (a non-finite scale, a skipped
// step, optim/adamw.h) master, m and v are left untouched and param is rewritten as
// the rounded master.
__device__ __forceinline__ void adamw_vec4(bf16* param, float* master, float* m, float* v, const bf16* grad,
                                           size_t i, float scale, bool skip, const AdamWHyper& h) {
  if (skip) {
#pragma unroll
    for (int k = 0; k < 4; ++k) param[i * 4 + k] = round_bf16(master[i * 4 + k]);
    return;
  }
  float4 mm = reinterpret_cast<const float4*>(m)[i];
  float4 vv = reinterpret_cast<const float4*>(v)[i];
  float4 ww = reinterpret_cast<const float4*>(master)[i];
  uint2 graw = reinterpret_cast<const uint2*>(grad)[i];
  const __nv_bfloat162* g2 = reinterpret_cast<const __nv_bfloat162*>(&graw);
  float2 g01 = __bfloat1622float2(g2[0]), g23 = __bfloat1622float2(g2[1]);
  adamw_one(g01.x, scale, mm.x, vv.x, ww.x, h);
  adamw_one(g01.y, scale, mm.y, vv.y, ww.y, h);
  adamw_one(g23.x, scale, mm.z, vv.z, ww.z, h);
  adamw_one(g23.y, scale, mm.w, vv.w, ww.w, h);
  reinterpret_cast<float4*>(m)[i] = mm;
  reinterpret_cast<float4*>(v)[i] = vv;
  reinterpret_cast<float4*>(master)[i] = ww;
  __nv_bfloat162 p[2];
  p[0].x = round_bf16(ww.x);
  p[0].y = round_bf16(ww.y);
  p[1].x = round_bf16(ww.z);
  p[1].y = round_bf16(ww.w);
  reinterpret_cast<uint2*>(param)[i] = *reinterpret_cast<const uint2*>(p);
}

__device__ __forceinline__ void adamw_elem(bf16* param, float* master, float* m, float* v, const bf16* grad,
                                           size_t i, float scale, bool skip, const AdamWHyper& h) {
  if (skip) {
    param[i] = round_bf16(master[i]);
    return;
  }
  float mm = m[i], vv = v[i], ww = master[i];
  adamw_one(__bfloat162float(grad[i]), scale, mm, vv, ww, h);
  m[i] = mm;
  v[i] = vv;
  master[i] = ww;
  param[i] = round_bf16(ww);
}

// param[n], master[n], m[n], v[n], grad[n]; VEC = 4 elements per thread (16-byte
// F32 accesses) or 1. A non-finite scale (a skipped step, optim/adamw.h) leaves
// master, m and v untouched and rewrites param as the rounded master.
template <int VEC>
__global__ void adamw_kernel(bf16* param, float* master, float* m, float* v, const bf16* grad,
                             const float* scale_norm, size_t n, AdamWHyper h) {
  const float scale = scale_norm[0];
  const bool skip = !isfinite(scale);
  const size_t items = n / VEC;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < items;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    if constexpr (VEC == 4) adamw_vec4(param, master, m, v, grad, i, scale, skip, h);
    else adamw_elem(param, master, m, v, grad, i, scale, skip, h);
  }
}

// Elements of one call that one block of the multi-tensor AdamW updates (a multiple of
// 4): 16 a thread. -DSPILLWAY_ADAMW_CHUNK=N builds another size (each element's update
// is the same whatever the chunk), to time against it in one call.
#ifdef SPILLWAY_ADAMW_CHUNK
constexpr size_t kAdamWChunk = SPILLWAY_ADAMW_CHUNK;
#else
constexpr size_t kAdamWChunk = 4096;
#endif
static_assert(kAdamWChunk % 4 == 0 && kAdamWChunk >= 4, "a chunk is a whole number of 4-element quads");

// The calls of one multi-tensor AdamW launch, passed by value (see NormTable).
struct AdamWTable {
  AdamWHyper hyper[kMultiAdamWHypers];              // [hypers] the distinct ones but for weight_decay (0 here)
  bf16* param[kMultiAdamWTensors];                  // [count] each call's operands
  float* master[kMultiAdamWTensors];                // [count]
  float* m[kMultiAdamWTensors];                     // [count]
  float* v[kMultiAdamWTensors];                     // [count]
  const bf16* grad[kMultiAdamWTensors];             // [count]
  const float* scale_norm[kMultiAdamWTensors];      // [count]
  uint64_t n[kMultiAdamWTensors];                   // [count] elements
  float weight_decay[kMultiAdamWTensors];           // [count] each call's hyper.weight_decay
  uint32_t first_block[kMultiAdamWTensors + 1];     // [count + 1] blocks (kAdamWChunk elements) before call i
  uint8_t hyper_index[kMultiAdamWTensors];          // [count] into hyper
  uint8_t vec[kMultiAdamWTensors];                  // [count] 1: aligned for adamw_vec4
  int count;
};
static_assert(sizeof(AdamWTable) <= 32764, "kernel parameters hold at most 32764 bytes");
static_assert(kMultiAdamWHypers <= 256, "hyper_index is 8 bits");

// Block first_block[i] + c updates elements [c·kAdamWChunk, +kAdamWChunk) of call i.
__global__ void multi_adamw_kernel(const __grid_constant__ AdamWTable t) {
  const int i = call_of_block(t.first_block, t.count, blockIdx.x);
  const size_t begin = static_cast<size_t>(blockIdx.x - t.first_block[i]) * kAdamWChunk;
  const size_t end = begin + kAdamWChunk < t.n[i] ? begin + kAdamWChunk : t.n[i];
  AdamWHyper h = t.hyper[t.hyper_index[i]];
  h.weight_decay = t.weight_decay[i];
  const float scale = t.scale_norm[i][0];
  const bool skip = !isfinite(scale);
  bf16* param = t.param[i];
  float *master = t.master[i], *m = t.m[i], *v = t.v[i];
  const bf16* grad = t.grad[i];
  size_t scalar_from = begin;
  if (t.vec[i]) {
    const size_t quads_end = (begin + (end - begin) / 4 * 4) / 4;  // begin is a multiple of 4
    for (size_t q = begin / 4 + threadIdx.x; q < quads_end; q += blockDim.x)
      adamw_vec4(param, master, m, v, grad, q, scale, skip, h);
    scalar_from = quads_end * 4;
  }
  for (size_t j = scalar_from + threadIdx.x; j < end; j += blockDim.x)
    adamw_elem(param, master, m, v, grad, j, scale, skip, h);
}

}  // namespace

// ---------------------------------------------------------------- launchers

cudaError_t launch_embedding_forward(bf16* out, const int32_t* tokens, const bf16* wte, const bf16* wpe,
                                     int B, int T, int C, int vocab_begin, int vocab_rows,
                                     cudaStream_t stream) {
  const int N = B * T;
  if (N == 0 || C == 0 || vocab_rows <= 0) return cudaSuccess;
  if (C % 8 == 0 && aligned16(out) && aligned16(wte) && aligned16(wpe))
    embedding_forward_kernel<8><<<grid_for(static_cast<size_t>(N) * C / 8), kThreads, 0, stream>>>(
        out, tokens, wte, wpe, N, T, C, vocab_begin, vocab_rows);
  else
    embedding_forward_kernel<1><<<grid_for(static_cast<size_t>(N) * C), kThreads, 0, stream>>>(
        out, tokens, wte, wpe, N, T, C, vocab_begin, vocab_rows);
  return launched();
}

cudaError_t embedding_sort_temp_query(int N, size_t* bytes) {
  *bytes = 0;
  return cub::DeviceRadixSort::SortPairs(nullptr, *bytes, static_cast<const int32_t*>(nullptr),
                                         static_cast<int32_t*>(nullptr), static_cast<const int32_t*>(nullptr),
                                         static_cast<int32_t*>(nullptr), N);
}

cudaError_t launch_embedding_backward(bf16* dwte, bf16* dwpe, const bf16* dout, const int32_t* tokens,
                                      int B, int T, int C, int vocab_begin, int vocab_rows, void* scratch,
                                      size_t scratch_bytes, cudaStream_t stream) {
  const int N = B * T;
  if (N == 0 || C == 0) return cudaSuccess;
  cudaError_t e = cudaSuccess;
  if (vocab_rows > 0) {
    char* s = static_cast<char*>(scratch);
    const size_t vec_bytes = cuda_workspace::align(static_cast<size_t>(N) * 4);
    int32_t* keys_in = reinterpret_cast<int32_t*>(s);
    int32_t* vals_in = reinterpret_cast<int32_t*>(s + vec_bytes);
    int32_t* keys_out = reinterpret_cast<int32_t*>(s + 2 * vec_bytes);
    int32_t* vals_out = reinterpret_cast<int32_t*>(s + 3 * vec_bytes);
    void* temp = s + 4 * vec_bytes;
    size_t temp_bytes = scratch_bytes - 4 * vec_bytes;
    // Tokens outside the tile get key -1: they sort first and no warp sums them.
    embedding_keys_kernel<<<grid_for(N), kThreads, 0, stream>>>(keys_in, vals_in, tokens, N, vocab_begin,
                                                                vocab_rows);
    e = launched();
    if (e != cudaSuccess) return e;
    // Stable: the positions of one row stay in ascending order.
    e = cub::DeviceRadixSort::SortPairs(temp, temp_bytes, keys_in, keys_out, vals_in, vals_out, N, 0,
                                        static_cast<int>(sizeof(int32_t) * 8), stream);
    if (e != cudaSuccess) return e;
    const int warps = kThreads / 32;
    if (C % 8 == 0 && aligned16(dwte) && aligned16(dout)) {
      dim3 grid(ceil_div(N, warps), ceil_div(C, 32 * 8));
      embedding_dwte_kernel<8><<<grid, kThreads, 0, stream>>>(dwte, dout, keys_out, vals_out, N, C);
    } else {
      dim3 grid(ceil_div(N, warps), ceil_div(C, 32));
      embedding_dwte_kernel<1><<<grid, kThreads, 0, stream>>>(dwte, dout, keys_out, vals_out, N, C);
    }
    e = launched();
    if (e != cudaSuccess) return e;
  }
  if (dwpe == nullptr) return cudaSuccess;
  embedding_dwpe_kernel<<<grid_for(static_cast<size_t>(T) * C), kThreads, 0, stream>>>(dwpe, dout, B, T, C);
  return launched();
}

cudaError_t launch_layernorm_forward(bf16* out, float* mean, float* rstd, const bf16* inp,
                                     const bf16* weight, const bf16* bias, int N, int C,
                                     cudaStream_t stream) {
  if (N == 0 || C == 0) return cudaSuccess;
  const int warps = kThreads / 32;
  const bool vec = C % 8 == 0 && aligned16(out) && aligned16(inp) && aligned16(weight) && aligned16(bias);
#ifdef SPILLWAY_LAYERNORM_FORWARD_REGISTERS
  if (vec && C <= 256 * 12) {
    const dim3 grid(ceil_div(N, warps)), block(kThreads);
#define SPILLWAY_LN_ROWS(K) \
  layernorm_forward_rows_kernel<K><<<grid, block, 0, stream>>>(out, mean, rstd, inp, weight, bias, N, C)
    switch ((C + 255) / 256) {
      case 1: SPILLWAY_LN_ROWS(1); break;
      case 2: SPILLWAY_LN_ROWS(2); break;
      case 3: SPILLWAY_LN_ROWS(3); break;
      case 4: SPILLWAY_LN_ROWS(4); break;
      case 5: SPILLWAY_LN_ROWS(5); break;
      case 6: SPILLWAY_LN_ROWS(6); break;
      case 7: SPILLWAY_LN_ROWS(7); break;
      case 8: SPILLWAY_LN_ROWS(8); break;
      case 9: SPILLWAY_LN_ROWS(9); break;
      case 10: SPILLWAY_LN_ROWS(10); break;
      case 11: SPILLWAY_LN_ROWS(11); break;
      default: SPILLWAY_LN_ROWS(12); break;
    }
#undef SPILLWAY_LN_ROWS
    return launched();
  }
#endif
  if (vec)
    layernorm_forward_kernel<8><<<ceil_div(N, warps), kThreads, 0, stream>>>(out, mean, rstd, inp, weight,
                                                                            bias, N, C);
  else
    layernorm_forward_kernel<1><<<ceil_div(N, warps), kThreads, 0, stream>>>(out, mean, rstd, inp, weight,
                                                                            bias, N, C);
  return launched();
}

cudaError_t launch_layernorm_backward(bf16* dinp, bf16* dweight, bf16* dbias, const bf16* dout,
                                      const bf16* inp, const bf16* weight, const float* mean,
                                      const float* rstd, int N, int C, void* scratch,
                                      cudaStream_t stream) {
  if (N == 0 || C == 0) return cudaSuccess;
  const Chunks ch = column_chunks(N);
  float* pw = static_cast<float*>(scratch);
  float* pb = pw + static_cast<size_t>(ch.count) * C;
  // dinp and the chunks' column sums: in one pass where it applies, else a row pass and
  // a column pass; then the sums over the chunks.
  if (!launch_norm_backward_onepass<true>(dinp, pw, pb, dout, inp, weight, mean, rstd, N, C, ch, stream)) {
    const int warps = kThreads / 32;
    if (C % 8 == 0 && aligned16(dinp) && aligned16(dout) && aligned16(inp) && aligned16(weight))
      layernorm_dinp_kernel<8><<<ceil_div(N, warps), kThreads, 0, stream>>>(dinp, dout, inp, weight, mean,
                                                                           rstd, N, C);
    else
      layernorm_dinp_kernel<1><<<ceil_div(N, warps), kThreads, 0, stream>>>(dinp, dout, inp, weight, mean,
                                                                           rstd, N, C);
    if (const cudaError_t e = launched(); e != cudaSuccess) return e;
    dim3 grid(ceil_div(C, kThreads), ch.count);
    column_partials_kernel<true><<<grid, kThreads, 0, stream>>>(pw, pb, dout, inp, mean, rstd, N, C, C, ch.rows);
  }
  if (const cudaError_t e = launched(); e != cudaSuccess) return e;
  column_finish_kernel<<<ceil_div(C, kThreads), kThreads, 0, stream>>>(dweight, pw, dbias, pb, ch.count, C);
  return launched();
}

cudaError_t launch_rmsnorm_forward(bf16* out, float* rstd, const bf16* inp, const bf16* weight, int N, int C,
                                   float eps, cudaStream_t stream) {
  if (N == 0 || C == 0) return cudaSuccess;
  const int warps = kThreads / 32;
  if (C % 8 == 0 && aligned16(out) && aligned16(inp) && aligned16(weight))
    rmsnorm_forward_kernel<8><<<ceil_div(N, warps), kThreads, 0, stream>>>(out, rstd, inp, weight, N, C, eps);
  else
    rmsnorm_forward_kernel<1><<<ceil_div(N, warps), kThreads, 0, stream>>>(out, rstd, inp, weight, N, C, eps);
  return launched();
}

cudaError_t launch_rmsnorm_backward(bf16* dinp, bf16* dweight, const bf16* dout, const bf16* inp,
                                    const bf16* weight, const float* rstd, int N, int C, void* scratch,
                                    cudaStream_t stream) {
  if (N == 0 || C == 0) return cudaSuccess;
  const Chunks ch = column_chunks(N);
  float* pw = static_cast<float*>(scratch);
  // As the LayerNorm's: one pass or two, then the sums over the chunks.
  if (!launch_norm_backward_onepass<false>(dinp, pw, nullptr, dout, inp, weight, nullptr, rstd, N, C, ch, stream)) {
    const int warps = kThreads / 32;
    if (C % 8 == 0 && aligned16(dinp) && aligned16(dout) && aligned16(inp) && aligned16(weight))
      rmsnorm_dinp_kernel<8><<<ceil_div(N, warps), kThreads, 0, stream>>>(dinp, dout, inp, weight, rstd, N, C);
    else
      rmsnorm_dinp_kernel<1><<<ceil_div(N, warps), kThreads, 0, stream>>>(dinp, dout, inp, weight, rstd, N, C);
    if (const cudaError_t e = launched(); e != cudaSuccess) return e;
    dim3 grid(ceil_div(C, kThreads), ch.count);
    rmsnorm_dweight_partials_kernel<<<grid, kThreads, 0, stream>>>(pw, dout, inp, rstd, N, C, ch.rows);
  }
  if (const cudaError_t e = launched(); e != cudaSuccess) return e;
  column_finish_kernel<<<ceil_div(C, kThreads), kThreads, 0, stream>>>(dweight, pw, nullptr, nullptr, ch.count, C);
  return launched();
}

cudaError_t launch_bias_backward(bf16* dbias, const bf16* dout, int N, int OC, int ld_dout, void* scratch,
                                 cudaStream_t stream) {
  if (N == 0 || OC == 0 || dbias == nullptr) return cudaSuccess;
  const Chunks ch = column_chunks(N);
  float* pb = static_cast<float*>(scratch);
  dim3 grid(ceil_div(OC, kThreads), ch.count);
  column_partials_kernel<false><<<grid, kThreads, 0, stream>>>(nullptr, pb, dout, nullptr, nullptr, nullptr,
                                                               N, OC, ld_dout, ch.rows);
  cudaError_t e = launched();
  if (e != cudaSuccess) return e;
  column_finish_kernel<<<ceil_div(OC, kThreads), kThreads, 0, stream>>>(nullptr, nullptr, dbias, pb, ch.count,
                                                                        OC);
  return launched();
}

cudaError_t launch_gelu_forward(bf16* out, const bf16* inp, size_t n, cudaStream_t stream) {
  return launch_elementwise<Ew::Gelu>(out, inp, nullptr, n, stream);
}

cudaError_t launch_gelu_backward(bf16* dinp, const bf16* inp, const bf16* dout, size_t n,
                                 cudaStream_t stream) {
  return launch_elementwise<Ew::GeluBackward>(dinp, inp, dout, n, stream);
}

cudaError_t launch_residual_forward(bf16* out, const bf16* a, const bf16* b, size_t n,
                                    cudaStream_t stream) {
  return launch_elementwise<Ew::Add>(out, a, b, n, stream);
}

cudaError_t launch_rope(bf16* out, const bf16* inp, int B, int T, int NH, int KVH, int D, const float* inv_freq,
                        float sign, cudaStream_t stream) {
  const int N = B * T, half = D / 2;
  if (N == 0 || half == 0) return cudaSuccess;
  if (D % 2 != 0 || D > kMaxRopeHeadDim) return cudaErrorInvalidValue;
  RopeFreqs freqs{};
  for (int i = 0; i < half; ++i) freqs.f[i] = inv_freq[i];
  if (half % 8 == 0 && aligned16(out) && aligned16(inp))
    rope_kernel<8><<<grid_for(static_cast<size_t>(N) * (half / 8)), kThreads, 0, stream>>>(out, inp, N, T, NH, KVH,
                                                                                            D, freqs, sign);
  else
    rope_kernel<1><<<grid_for(static_cast<size_t>(N) * half), kThreads, 0, stream>>>(out, inp, N, T, NH, KVH, D,
                                                                                      freqs, sign);
  return launched();
}

cudaError_t launch_swiglu_forward(bf16* out, const bf16* inp, int64_t N, int I, cudaStream_t stream) {
  if (N == 0 || I == 0) return cudaSuccess;
  if (I % 8 == 0 && aligned16(out) && aligned16(inp))
    swiglu_kernel<false, 8><<<grid_for(static_cast<size_t>(N) * (I / 8)), kThreads, 0, stream>>>(out, inp, nullptr,
                                                                                                  N, I);
  else
    swiglu_kernel<false, 1><<<grid_for(static_cast<size_t>(N) * I), kThreads, 0, stream>>>(out, inp, nullptr, N, I);
  return launched();
}

cudaError_t launch_swiglu_backward(bf16* dinp, const bf16* inp, const bf16* dout, int64_t N, int I,
                                   cudaStream_t stream) {
  if (N == 0 || I == 0) return cudaSuccess;
  if (I % 8 == 0 && aligned16(dinp) && aligned16(inp) && aligned16(dout))
    swiglu_kernel<true, 8><<<grid_for(static_cast<size_t>(N) * (I / 8)), kThreads, 0, stream>>>(dinp, inp, dout, N,
                                                                                                 I);
  else
    swiglu_kernel<true, 1><<<grid_for(static_cast<size_t>(N) * I), kThreads, 0, stream>>>(dinp, inp, dout, N, I);
  return launched();
}

// The dynamic shared memory one block may opt in to on the current device (0 when it
// cannot be read: the row is then streamed twice).
static size_t max_optin_shared_bytes() {
  int dev = 0, bytes = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 0;
  if (cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess) return 0;
  return static_cast<size_t>(bytes);
}

cudaError_t launch_crossentropy(float* losses, bf16* logits, const int32_t* targets, int N, int V, int ld,
                                bool backward, float dlogits_scale, cudaStream_t stream) {
  if (N == 0) return cudaSuccess;
  constexpr int kRowThreads = 512;  // one block per row
  if (ld % 8 == 0 && aligned16(logits)) {  // every row starts 16-byte aligned
    // The backward reads each row twice; keep it in shared memory when it fits
    // (GPT-2's 50257 logits: 100.5 KB, two blocks per SM on Hopper).
    const size_t cache = (static_cast<size_t>(V) * sizeof(bf16) + 15) / 16 * 16;
    static const size_t optin = max_optin_shared_bytes();  // one device per process
    if (backward && cache + 32 * sizeof(float) <= optin) {
      cudaError_t e = cudaFuncSetAttribute(crossentropy_kernel<8, true>,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(cache));
      if (e != cudaSuccess) return e;
      crossentropy_kernel<8, true><<<N, kRowThreads, cache, stream>>>(losses, logits, targets, V, ld, backward,
                                                                  dlogits_scale);
    } else {
      crossentropy_kernel<8, false><<<N, kRowThreads, 0, stream>>>(losses, logits, targets, V, ld, backward,
                                                               dlogits_scale);
    }
  } else {
    crossentropy_kernel<1, false><<<N, kRowThreads, 0, stream>>>(losses, logits, targets, V, ld, backward,
                                                             dlogits_scale);
  }
  return launched();
}

unsigned squared_norm_partials(size_t n) { return norm_blocks(n); }

cudaError_t launch_squared_norm(float* out_sq, const bf16* grad, size_t n, void* scratch,
                                cudaStream_t stream, uint64_t* launches) {
  float* partial = static_cast<float*>(scratch);
  const bool vec = aligned16(grad);
  const size_t body = vec ? n / 8 * 8 : n;
  const unsigned blocks = norm_blocks(n);
  if (vec) squared_norm_partial_kernel<8><<<blocks, kThreads, 0, stream>>>(partial, grad, body);
  else squared_norm_partial_kernel<1><<<blocks, kThreads, 0, stream>>>(partial, grad, body);
  cudaError_t e = launched();
  if (e != cudaSuccess) return e;
  squared_norm_finish_kernel<<<1, kThreads, 0, stream>>>(out_sq, partial, static_cast<int>(blocks),
                                                         grad + body, static_cast<int>(n - body));
  if (launches) *launches += 2;
  return launched();
}

cudaError_t launch_squared_norms(const SquaredNormCall* calls, size_t count, void* scratch, size_t scratch_bytes,
                                 cudaStream_t stream, uint64_t* launches) {
  const size_t capacity = scratch_bytes / sizeof(float);  // partials the scratch holds
  if (count > 0 && (scratch == nullptr || capacity < static_cast<size_t>(kNormBlocks))) return cudaErrorInvalidValue;
  float* partial = static_cast<float*>(scratch);
  NormTable t;
  size_t next = 0;
  while (next < count) {
    // A group: as many calls as the table and the scratch hold (at least one: any
    // call's partials fit in kNormBlocks floats).
    t.count = 0;
    uint32_t blocks = 0;
    while (next < count && t.count < kMultiNormTensors) {
      const SquaredNormCall& c = calls[next];
      const unsigned b = norm_blocks(c.n);
      if (blocks + b > capacity) break;
      const bool vec = aligned16(c.grad);
      const size_t body = vec ? c.n / 8 * 8 : c.n;
      t.grad[t.count] = c.grad;
      t.out[t.count] = c.out_sq;
      t.body[t.count] = body;
      t.first_block[t.count] = blocks;
      t.tail[t.count] = static_cast<uint8_t>(c.n - body);
      t.vec[t.count] = vec ? 1 : 0;
      blocks += b;
      ++t.count;
      ++next;
    }
    t.first_block[t.count] = blocks;
    multi_squared_norm_partial_kernel<<<blocks, kThreads, 0, stream>>>(partial, t);
    cudaError_t e = launched();
    if (e != cudaSuccess) return e;
    multi_squared_norm_finish_kernel<<<t.count, kThreads, 0, stream>>>(partial, t);
    e = launched();
    if (e != cudaSuccess) return e;
    if (launches) *launches += 2;
  }
  return cudaSuccess;
}

cudaError_t launch_clip_scale(float* scale_norm, const float* sq, int P, float max_norm,
                              cudaStream_t stream) {
  clip_scale_kernel<<<1, 1, 0, stream>>>(scale_norm, sq, P, max_norm);
  return launched();
}

cudaError_t launch_adamw(bf16* param, float* master, float* m, float* v, const bf16* grad,
                         const float* scale_norm, size_t n, const AdamWHyper& hyper,
                         cudaStream_t stream, uint64_t* launches) {
  if (n == 0) return cudaSuccess;
  const bool vec = aligned16(master) && aligned16(m) && aligned16(v) &&
                   (reinterpret_cast<uintptr_t>(param) & 7u) == 0 &&
                   (reinterpret_cast<uintptr_t>(grad) & 7u) == 0;
  size_t body = 0;
  if (vec && n >= 4) {
    body = n / 4 * 4;
    adamw_kernel<4><<<grid_for(body / 4), kThreads, 0, stream>>>(param, master, m, v, grad, scale_norm, body,
                                                                 hyper);
    cudaError_t e = launched();
    if (e != cudaSuccess) return e;
    if (launches) *launches += 1;
  }
  if (body < n) {
    adamw_kernel<1><<<grid_for(n - body), kThreads, 0, stream>>>(param + body, master + body, m + body,
                                                                 v + body, grad + body, scale_norm,
                                                                 n - body, hyper);
    if (launches) *launches += 1;
    return launched();
  }
  return cudaSuccess;
}

cudaError_t launch_adamws(const AdamWCall* calls, size_t count, cudaStream_t stream, uint64_t* launches) {
  // The most blocks one launch takes (gridDim.x allows 2^31 - 1).
  constexpr uint64_t kMaxBlocks = uint64_t{1} << 30;
  AdamWTable t;
  size_t next = 0;
  while (next < count) {
    t.count = 0;
    int hypers = 0;
    uint64_t blocks = 0;
    while (next < count && t.count < kMultiAdamWTensors) {
      const AdamWCall& c = calls[next];
      if (c.n == 0) {  // nothing to update (launch_adamw launches nothing either)
        ++next;
        continue;
      }
      const uint64_t b = (c.n + kAdamWChunk - 1) / kAdamWChunk;
      if (b > kMaxBlocks) return cudaErrorInvalidValue;  // over 4·10^12 elements: no such tensor fits a GPU
      if (blocks + b > kMaxBlocks) break;
      // Weight decay differs between tensors of one step; the rest rarely does.
      AdamWHyper shared = c.hyper;
      shared.weight_decay = 0.0f;
      int h = 0;
      while (h < hypers && std::memcmp(&t.hyper[h], &shared, sizeof(AdamWHyper)) != 0) ++h;
      if (h == hypers) {
        if (hypers == kMultiAdamWHypers) break;
        t.hyper[hypers++] = shared;
      }
      t.weight_decay[t.count] = c.hyper.weight_decay;
      t.param[t.count] = c.param;
      t.master[t.count] = c.master;
      t.m[t.count] = c.m;
      t.v[t.count] = c.v;
      t.grad[t.count] = c.grad;
      t.scale_norm[t.count] = c.scale_norm;
      t.n[t.count] = c.n;
      t.first_block[t.count] = static_cast<uint32_t>(blocks);
      t.hyper_index[t.count] = static_cast<uint8_t>(h);
      t.vec[t.count] = aligned16(c.master) && aligned16(c.m) && aligned16(c.v) &&
                               (reinterpret_cast<uintptr_t>(c.param) & 7u) == 0 &&
                               (reinterpret_cast<uintptr_t>(c.grad) & 7u) == 0
                           ? 1
                           : 0;
      blocks += b;
      ++t.count;
      ++next;
    }
    if (t.count == 0) continue;  // only empty calls were left
    t.first_block[t.count] = static_cast<uint32_t>(blocks);
    multi_adamw_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(t);
    cudaError_t e = launched();
    if (e != cudaSuccess) return e;
    if (launches) *launches += 1;
  }
  return cudaSuccess;
}

}  // namespace spillway::cuda_detail
