// Fused causal attention of the CUDA backend (see attention.cuh).
//
// Tensor-core kernels use mma.sync.m16n8k16 (bf16 in, fp32 accumulate) with
// ldmatrix fragments. Fragment layout (g = lane / 4, t = lane % 4):
//   A 16×16: a0 (row g, cols 2t..2t+1), a1 (row g+8), a2 (row g, cols 8+2t..), a3 (row g+8, cols 8+2t..)
//   B 16×8:  b0 (rows 2t..2t+1, col g), b1 (rows 8+2t.., col g)
//   C 16×8:  c0,c1 (row g, cols 2t..2t+1), c2,c3 (row g+8, cols 2t..2t+1)
// so the accumulators of two adjacent 8-column tiles are the A fragment of a
// product over those 16 columns (P and dS never leave registers).
#include <cmath>

#include "backend/cuda/attention.cuh"
#include "backend/cuda/attention_ptx.cuh"

namespace spillway::cuda_detail {
namespace {

using namespace attention_ptx;  // smem_addr, cp_async16, cp_async_commit/wait, pack_bf16, kLog2e, kLn2

// ------------------------------------------------------------- PTX helpers

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const bf16* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], const bf16* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

// c[4] += a[4] · (b0, b1)
__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// A fragment over 16 columns from the accumulators of two 8-column tiles.
__device__ __forceinline__ void acc_to_a(uint32_t (&a)[4], const float (&c0)[4], const float (&c1)[4]) {
  a[0] = pack_bf16(c0[0], c0[1]);
  a[1] = pack_bf16(c0[2], c0[3]);
  a[2] = pack_bf16(c1[0], c1[1]);
  a[3] = pack_bf16(c1[2], c1[3]);
}

// A fragment of the 16×16 block at (row0, col0) of a row-major smem tile.
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const bf16* s, int row0, int col0, int lds) {
  const int lane = threadIdx.x & 31;
  ldsm_x4(a, s + (row0 + (lane & 15)) * lds + col0 + (lane >> 4) * 8);
}

// B fragments of two 8-column tiles (n0, n0+8) over k0..k0+15, where the smem tile
// is stored n-major (row = n, col = k): b[0..1] for n0, b[2..3] for n0+8.
__device__ __forceinline__ void load_b_nk(uint32_t (&b)[4], const bf16* s, int n0, int k0, int lds) {
  const int lane = threadIdx.x & 31;
  ldsm_x4(b, s + (n0 + (lane & 7) + (lane >> 4) * 8) * lds + k0 + ((lane >> 3) & 1) * 8);
}

// The same from a tile stored k-major (row = k, col = n), via the transposing load.
__device__ __forceinline__ void load_b_kn(uint32_t (&b)[4], const bf16* s, int k0, int n0, int lds) {
  const int lane = threadIdx.x & 31;
  ldsm_x4_t(b, s + (k0 + (lane & 7) + ((lane >> 3) & 1) * 8) * lds + n0 + (lane >> 4) * 8);
}


// Rows row0..row0+ROWS-1 of a [T, HD] matrix (row stride `ld` elements) into a
// smem tile [ROWS, HD + 8]; rows at or past T are zero-filled.
template <int HD, int ROWS, int THREADS>
__device__ __forceinline__ void load_tile(bf16* s, const bf16* g, int row0, int T, size_t ld) {
  constexpr int kChunks = HD / 8;
  constexpr int LDS = HD + 8;
  for (int i = threadIdx.x; i < ROWS * kChunks; i += THREADS) {
    const int r = i / kChunks, c = (i % kChunks) * 8;
    const bool valid = row0 + r < T;
    const bf16* src = valid ? g + static_cast<size_t>(row0 + r) * ld + c : g;
    cp_async16(smem_addr(s + r * LDS + c), src, valid);
  }
}

// ------------------------------------------------------------- forward (tensor cores)

constexpr int kWarps = 4;
constexpr int kTC = kWarps * 32;
constexpr int kFwdBN = 64;

// Row tiles of 16 per warp: two where registers allow, so that each B fragment read
// from shared memory feeds two products (shared-memory traffic per flop halves).
template <int HD>
constexpr int row_tiles() {
  return HD <= 64 ? 2 : 1;
}
template <int HD>
constexpr int fwd_bm() {
  return 16 * kWarps * row_tiles<HD>();
}

template <int HD>
constexpr size_t fwd_smem_bytes() {
  return static_cast<size_t>(fwd_bm<HD>() + 4 * kFwdBN) * (HD + 8) * sizeof(bf16);
}

// out[B,T,C], lse[B,NH,T], qkv[B,T,(NH+2·KVH)·HD]. grid (ceil(T/BM), B*NH), 128
// threads; each warp owns MT×16 consecutive query rows of query head h, reading key/value
// head h/(NH/KVH) (kGrouped; else KVH = NH and head h, the multi-head kernel as it was,
// register for register); keys stream through smem 64 at a time,
// double-buffered. Scores stay raw until the exponent: p = 2^(s·scale·log2e − m).
template <int HD, bool kGrouped>
__global__ void __launch_bounds__(kTC) attention_forward_tc(bf16* out, float* lse, const bf16* qkv, int T,
                                                            int C, int NH, int KVH, float scale_log2) {
  constexpr int LDS = HD + 8, MT = row_tiles<HD>(), BM = fwd_bm<HD>(), BN = kFwdBN;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* Qs = reinterpret_cast<bf16*>(smem_raw);
  bf16* Ks = Qs + BM * LDS;      // [2][BN*LDS]
  bf16* Vs = Ks + 2 * BN * LDS;  // [2][BN*LDS]

  const int mb = gridDim.x - 1 - blockIdx.x;  // longest rows first
  const int m0 = mb * BM;
  const int bh = blockIdx.y, b = bh / NH, h = bh % NH;
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
  const HeadView hv = head_view<HD, kGrouped>(qkv, nullptr, nullptr, nullptr, b, h, h / (NH / KVH), T, C, NH, KVH);
  const size_t ld = hv.ld;
  const bf16 *qg = hv.q, *kg = hv.k, *vg = hv.v;
  const int warp_row0 = warp * 16 * MT;  // first row of this warp in the tile
  const int warp_q0 = m0 + warp_row0;

  const int n_blocks = min((T + BN - 1) / BN, (m0 + BM - 1) / BN + 1);
  load_tile<HD, BM, kTC>(Qs, qg, m0, T, ld);
  load_tile<HD, BN, kTC>(Ks, kg, 0, T, ld);
  load_tile<HD, BN, kTC>(Vs, vg, 0, T, ld);
  cp_async_commit();

  uint32_t qf[MT][HD / 16][4];
  float o[MT][HD / 8][4];
  float row_max[MT][2], row_sum[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int i = 0; i < HD / 8; ++i) o[mt][i][0] = o[mt][i][1] = o[mt][i][2] = o[mt][i][3] = 0.0f;
    row_max[mt][0] = row_max[mt][1] = -INFINITY;
    row_sum[mt][0] = row_sum[mt][1] = 0.0f;
  }

  for (int nb = 0; nb < n_blocks; ++nb) {
    const int cur = nb & 1;
    double_buffer_step<false>(nb + 1 < n_blocks, [&] {
      load_tile<HD, BN, kTC>(Ks + (cur ^ 1) * BN * LDS, kg, (nb + 1) * BN, T, ld);
      load_tile<HD, BN, kTC>(Vs + (cur ^ 1) * BN * LDS, vg, (nb + 1) * BN, T, ld);
    });
    if (nb == 0) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int kk = 0; kk < HD / 16; ++kk) load_a(qf[mt][kk], Qs, warp_row0 + mt * 16, kk * 16, LDS);
    }
    const bf16* Kc = Ks + cur * BN * LDS;
    const bf16* Vc = Vs + cur * BN * LDS;

    float s[MT][BN / 8][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int j = 0; j < BN / 8; ++j) s[mt][j][0] = s[mt][j][1] = s[mt][j][2] = s[mt][j][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
#pragma unroll
      for (int j = 0; j < BN / 8; j += 2) {
        uint32_t bfr[4];
        load_b_nk(bfr, Kc, j * 8, kk * 16, LDS);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma16816(s[mt][j], qf[mt][kk], bfr[0], bfr[1]);
          mma16816(s[mt][j + 1], qf[mt][kk], bfr[2], bfr[3]);
        }
      }
    }
    // Keys past a row (or past T) are masked; only blocks that reach past this
    // warp's first row need the test (a warp-uniform branch).
    const bool need_mask = nb * BN + BN - 1 > warp_q0;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float x = s[mt][j][e];
          if (need_mask) {
            const int key = nb * BN + j * 8 + t4 * 2 + (e & 1);
            const int q = warp_q0 + mt * 16 + g + (e >> 1) * 8;
            if (key > q || key >= T) x = -INFINITY;
            s[mt][j][e] = x;
          }
          mx[e >> 1] = fmaxf(mx[e >> 1], x);
        }
      }
      float alpha[2], neg_m[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
        const float m_new = fmaxf(row_max[mt][r], mx[r] * scale_log2);  // log2 units
        alpha[r] = m_new == -INFINITY ? 1.0f : exp2f(row_max[mt][r] - m_new);
        neg_m[r] = m_new == -INFINITY ? 0.0f : -m_new;
        row_max[mt][r] = m_new;
        row_sum[mt][r] *= alpha[r];
      }
#pragma unroll
      for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = e >> 1;
          const float p = exp2f(fmaf(s[mt][j][e], scale_log2, neg_m[r]));
          s[mt][j][e] = p;
          row_sum[mt][r] += p;
        }
      }
#pragma unroll
      for (int i = 0; i < HD / 8; ++i) {
        o[mt][i][0] *= alpha[0];
        o[mt][i][1] *= alpha[0];
        o[mt][i][2] *= alpha[1];
        o[mt][i][3] *= alpha[1];
      }
    }
    // O += P · V
#pragma unroll
    for (int ks = 0; ks < BN / 16; ++ks) {
      uint32_t pa[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) acc_to_a(pa[mt], s[mt][2 * ks], s[mt][2 * ks + 1]);
#pragma unroll
      for (int dn = 0; dn < HD / 16; ++dn) {
        uint32_t bfr[4];
        load_b_kn(bfr, Vc, ks * 16, dn * 16, LDS);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma16816(o[mt][2 * dn], pa[mt], bfr[0], bfr[1]);
          mma16816(o[mt][2 * dn + 1], pa[mt], bfr[2], bfr[3]);
        }
      }
    }
    __syncthreads();  // this buffer is refilled in the next iteration
  }

#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int q = warp_q0 + mt * 16 + g + r * 8;
      float l = row_sum[mt][r];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      if (q >= T) continue;
      const float inv = 1.0f / l;
      if (t4 == 0) lse[static_cast<size_t>(bh) * T + q] = row_max[mt][r] * kLn2 + logf(l);
      bf16* dst = out + (static_cast<size_t>(b) * T + q) * C + h * HD;
#pragma unroll
      for (int i = 0; i < HD / 8; ++i) {
        const int d = i * 8 + t4 * 2;
        *reinterpret_cast<__nv_bfloat162*>(dst + d) =
            __floats2bfloat162_rn(o[mt][i][2 * r] * inv, o[mt][i][2 * r + 1] * inv);
      }
    }
  }
}

// ------------------------------------------------------------- backward (tensor cores)

// D[B,NH,T] = Σ_d dout ∘ out; dout[B,T,C], out[B,T,C]. One warp per (b, t, h).
__global__ void attention_bwd_dot_kernel(float* D, const bf16* dout, const bf16* out, int B, int T, int C,
                                         int NH) {
  const int HD = C / NH;
  const size_t w = blockIdx.x * static_cast<size_t>(blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (w >= static_cast<size_t>(B) * T * NH) return;
  const int h = static_cast<int>(w % NH);
  const size_t bt = w / NH;
  const size_t off = bt * C + static_cast<size_t>(h) * HD;
  float acc = 0.0f;
  for (int d = lane; d < HD; d += 32) acc += __bfloat162float(dout[off + d]) * __bfloat162float(out[off + d]);
  acc = warp_sum(acc);
  const int b = static_cast<int>(bt / T), t = static_cast<int>(bt % T);
  if (lane == 0) D[(static_cast<size_t>(b) * NH + h) * T + t] = acc;
}

// dK/dV kernel: keys per block (MT×16 per warp) and queries per inner iteration.
template <int HD>
constexpr int dkv_keys() {
  return 16 * kWarps * row_tiles<HD>();
}
constexpr int kDkvQueries = 32;
// dQ kernel: queries per block (MT×16 per warp) and keys per inner iteration.
template <int HD>
constexpr int dq_queries() {
  return 16 * kWarps * row_tiles<HD>();
}
template <int HD>
constexpr int dq_keys() {
  return HD <= 32 ? 64 : 32;
}

template <int HD>
constexpr size_t dkv_smem_bytes() {
  return static_cast<size_t>(2 * dkv_keys<HD>() + 4 * kDkvQueries) * (HD + 8) * sizeof(bf16) +
         4 * kDkvQueries * sizeof(float);
}

template <int HD>
constexpr size_t dq_smem_bytes() {
  return static_cast<size_t>(2 * dq_queries<HD>() + 4 * dq_keys<HD>()) * (HD + 8) * sizeof(bf16) +
         2 * dq_queries<HD>() * sizeof(float);
}

// x = A·Bᵀ and y = A2·B2ᵀ over the head dim, both zeroed first, for this warp's MT
// row tiles of A and A2 (rows row0 + 16·mt) against the N rows of B and B2 (all in
// shared memory, rows of HD + 8): the first two products of both backward kernels.
template <int HD, int MT, int N>
__device__ __forceinline__ void two_products(float (&x)[MT][N / 8][4], float (&y)[MT][N / 8][4], const bf16* A,
                                             const bf16* A2, const bf16* B, const bf16* B2, int row0) {
  constexpr int LDS = HD + 8;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int j = 0; j < N / 8; ++j) {
      x[mt][j][0] = x[mt][j][1] = x[mt][j][2] = x[mt][j][3] = 0.0f;
      y[mt][j][0] = y[mt][j][1] = y[mt][j][2] = y[mt][j][3] = 0.0f;
    }
#pragma unroll
  for (int kk = 0; kk < HD / 16; ++kk) {
    uint32_t a[MT][4], a2[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      load_a(a[mt], A, row0 + mt * 16, kk * 16, LDS);
      load_a(a2[mt], A2, row0 + mt * 16, kk * 16, LDS);
    }
#pragma unroll
    for (int j = 0; j < N / 8; j += 2) {
      uint32_t b[4], b2[4];
      load_b_nk(b, B, j * 8, kk * 16, LDS);
      load_b_nk(b2, B2, j * 8, kk * 16, LDS);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        mma16816(x[mt][j], a[mt], b[0], b[1]);
        mma16816(x[mt][j + 1], a[mt], b[2], b[3]);
        mma16816(y[mt][j], a2[mt], b2[0], b2[1]);
        mma16816(y[mt][j + 1], a2[mt], b2[2], b2[3]);
      }
    }
  }
}

// dK, dV of BN keys of key/value head kvh per block: dqkv[B,T,(NH+2·KVH)·HD] (k and v
// parts), dout[B,T,C], qkv, lse[B,NH,T], D[B,NH,T]. grid (ceil(T/BN), B*KVH), 128
// threads; each warp owns MT×16 keys and streams the query blocks of the group's
// query heads, one head after the other (double-buffered) through smem, computing
// Sᵀ = K·Qᵀ, Pᵀ, dV += Pᵀ·dO, dPᵀ = V·dOᵀ, dSᵀ, dK += dSᵀ·Q in fp32 registers: the
// sum over the group is in a fixed order, without atomics. Without kGrouped (KVH = NH)
// it is the multi-head kernel as it was: one query head per block.
template <int HD, bool kGrouped>
__global__ void __launch_bounds__(kTC) attention_backward_dkv_tc(bf16* dqkv, const bf16* dout, const bf16* qkv,
                                                                 const float* lse, const float* Dg, int T, int C,
                                                                 int NH, int KVH, float scale, float scale_log2) {
  constexpr int LDS = HD + 8, MT = row_tiles<HD>(), BN = dkv_keys<HD>(), BM = kDkvQueries;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* Ks = reinterpret_cast<bf16*>(smem_raw);
  bf16* Vs = Ks + BN * LDS;
  bf16* Qs = Vs + BN * LDS;      // [2][BM*LDS]
  bf16* dOs = Qs + 2 * BM * LDS;  // [2][BM*LDS]
  float* Ls = reinterpret_cast<float*>(dOs + 2 * BM * LDS);  // [2][BM] lse in log2 units
  float* Ds = Ls + 2 * BM;                                   // [2][BM]

  const int n0 = blockIdx.x * BN;
  // Key/value head kvh of batch b; its query heads h0 .. h0 + group - 1.
  const int bg = blockIdx.y, b = bg / KVH, kvh = bg % KVH;
  const int group = kGrouped ? NH / KVH : 1, h0 = kvh * group;
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
  const HeadView hv = head_view<HD, kGrouped>(qkv, dout, lse, Dg, b, h0, kvh, T, C, NH, KVH);  // query head h0
  const size_t ld = hv.ld;
  const bf16 *qg = hv.q, *kg = hv.k, *vg = hv.v, *dog = hv.dout;
  const float *lse_bh = hv.lse, *D_bh = hv.D;
  const int warp_row0 = warp * 16 * MT;
  const int warp_key_last = n0 + warp_row0 + 16 * MT - 1;

  // Iteration it covers query block mb_first + it % n_mb of query head h0 + it / n_mb.
  const int mb_first = n0 / BM;
  const int mb_end = (T + BM - 1) / BM;
  const int n_mb = mb_end - mb_first;
  auto load_q_block = [&](int it, int buf) {
    const int hh = kGrouped ? it / n_mb : 0, mb = kGrouped ? mb_first + it % n_mb : mb_first + it;
    load_tile<HD, BM, kTC>(Qs + buf * BM * LDS, qg + hh * HD, mb * BM, T, ld);
    load_tile<HD, BM, kTC>(dOs + buf * BM * LDS, dog + hh * HD, mb * BM, T, C);
    const float* lse_h = lse_bh + static_cast<size_t>(hh) * T;
    const float* D_h = D_bh + static_cast<size_t>(hh) * T;
    for (int i = threadIdx.x; i < BM; i += kTC) {
      const int q = mb * BM + i;
      Ls[buf * BM + i] = q < T ? lse_h[q] * kLog2e : INFINITY;
      Ds[buf * BM + i] = q < T ? D_h[q] : 0.0f;
    }
  };
  load_tile<HD, BN, kTC>(Ks, kg, n0, T, ld);
  load_tile<HD, BN, kTC>(Vs, vg, n0, T, ld);
  load_q_block(0, 0);
  cp_async_commit();

  float dk[MT][HD / 8][4], dv[MT][HD / 8][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int i = 0; i < HD / 8; ++i) {
      dk[mt][i][0] = dk[mt][i][1] = dk[mt][i][2] = dk[mt][i][3] = 0.0f;
      dv[mt][i][0] = dv[mt][i][1] = dv[mt][i][2] = dv[mt][i][3] = 0.0f;
    }

  const int n_it = group * n_mb;
  for (int it = 0; it < n_it; ++it) {
    const int mb = kGrouped ? mb_first + it % n_mb : mb_first + it;
    const int cur = it & 1;
    double_buffer_step<false>(it + 1 < n_it, [&] { load_q_block(it + 1, cur ^ 1); });
    const bf16* Qc = Qs + cur * BM * LDS;
    const bf16* dOc = dOs + cur * BM * LDS;
    const float* Lc = Ls + cur * BM;
    const float* Dc = Ds + cur * BM;

    // Sᵀ = K · Qᵀ and dPᵀ = V · dOᵀ (rows: this warp's keys; columns: queries).
    float st[MT][BM / 8][4], dpt[MT][BM / 8][4];
    two_products<HD, MT, BM>(st, dpt, Ks, Vs, Qc, dOc, warp_row0);
    // Pᵀ and dSᵀ = Pᵀ ∘ (dPᵀ − D); the causal test only where a key can pass a query.
    const bool need_mask = warp_key_last > mb * BM;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int j = 0; j < BM / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int qi = j * 8 + t4 * 2 + (e & 1);
          float p = exp2f(fmaf(st[mt][j][e], scale_log2, -Lc[qi]));
          if (need_mask && n0 + warp_row0 + mt * 16 + g + (e >> 1) * 8 > mb * BM + qi) p = 0.0f;
          st[mt][j][e] = p;
          dpt[mt][j][e] = p * (dpt[mt][j][e] - Dc[qi]);
        }
      }
    // dV += Pᵀ · dO and dK += dSᵀ · Q.
#pragma unroll
    for (int ks = 0; ks < BM / 16; ++ks) {
      uint32_t pa[MT][4], sa[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        acc_to_a(pa[mt], st[mt][2 * ks], st[mt][2 * ks + 1]);
        acc_to_a(sa[mt], dpt[mt][2 * ks], dpt[mt][2 * ks + 1]);
      }
#pragma unroll
      for (int dn = 0; dn < HD / 16; ++dn) {
        uint32_t bo[4], bq[4];
        load_b_kn(bo, dOc, ks * 16, dn * 16, LDS);
        load_b_kn(bq, Qc, ks * 16, dn * 16, LDS);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma16816(dv[mt][2 * dn], pa[mt], bo[0], bo[1]);
          mma16816(dv[mt][2 * dn + 1], pa[mt], bo[2], bo[3]);
          mma16816(dk[mt][2 * dn], sa[mt], bq[0], bq[1]);
          mma16816(dk[mt][2 * dn + 1], sa[mt], bq[2], bq[3]);
        }
      }
    }
    __syncthreads();
  }

#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int key = n0 + warp_row0 + mt * 16 + g + r * 8;
      if (key >= T) continue;
      // dK of key/value head kvh (for multi-head attention, at C + h·HD); dV follows.
      bf16* dst = dqkv + (static_cast<size_t>(b) * T + key) * ld + (NH + kvh) * HD;
      const int v_off = kGrouped ? KVH * HD : C;
#pragma unroll
      for (int i = 0; i < HD / 8; ++i) {
        const int d = i * 8 + t4 * 2;
        *reinterpret_cast<__nv_bfloat162*>(dst + d) =
            __floats2bfloat162_rn(dk[mt][i][2 * r] * scale, dk[mt][i][2 * r + 1] * scale);
        *reinterpret_cast<__nv_bfloat162*>(dst + v_off + d) =
            __floats2bfloat162_rn(dv[mt][i][2 * r], dv[mt][i][2 * r + 1]);
      }
    }
}

// dQ of BM queries per block: dqkv[B,T,(NH+2·KVH)·HD] (q part), dout[B,T,C], qkv,
// lse[B,NH,T], D[B,NH,T]. grid (ceil(T/BM), B*NH), 128 threads; each warp owns
// MT×16 queries and streams the key blocks of key/value head h/(NH/KVH):
// S = Q·Kᵀ, P, dP = dO·Vᵀ, dS, dQ += dS·K. kGrouped as in the forward.
template <int HD, bool kGrouped>
__global__ void __launch_bounds__(kTC) attention_backward_dq_tc(bf16* dqkv, const bf16* dout, const bf16* qkv,
                                                                const float* lse, const float* Dg, int T, int C,
                                                                int NH, int KVH, float scale, float scale_log2) {
  constexpr int LDS = HD + 8, MT = row_tiles<HD>(), BM = dq_queries<HD>(), BN = dq_keys<HD>();
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* Qs = reinterpret_cast<bf16*>(smem_raw);
  bf16* dOs = Qs + BM * LDS;
  bf16* Ks = dOs + BM * LDS;      // [2][BN*LDS]
  bf16* Vs = Ks + 2 * BN * LDS;   // [2][BN*LDS]
  float* Ls = reinterpret_cast<float*>(Vs + 2 * BN * LDS);  // [BM] lse in log2 units
  float* Ds = Ls + BM;                                      // [BM]

  const int mb = gridDim.x - 1 - blockIdx.x;
  const int m0 = mb * BM;
  const int bh = blockIdx.y, b = bh / NH, h = bh % NH;
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
  const HeadView hv = head_view<HD, kGrouped>(qkv, dout, lse, Dg, b, h, h / (NH / KVH), T, C, NH, KVH);
  const size_t ld = hv.ld;
  const bf16 *qg = hv.q, *kg = hv.k, *vg = hv.v, *dog = hv.dout;
  const int warp_row0 = warp * 16 * MT;

  load_tile<HD, BM, kTC>(Qs, qg, m0, T, ld);
  load_tile<HD, BM, kTC>(dOs, dog, m0, T, C);
  for (int i = threadIdx.x; i < BM; i += kTC) {
    const int q = m0 + i;
    Ls[i] = q < T ? hv.lse[q] * kLog2e : INFINITY;
    Ds[i] = q < T ? hv.D[q] : 0.0f;
  }
  load_tile<HD, BN, kTC>(Ks, kg, 0, T, ld);
  load_tile<HD, BN, kTC>(Vs, vg, 0, T, ld);
  cp_async_commit();

  float dq[MT][HD / 8][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int i = 0; i < HD / 8; ++i) dq[mt][i][0] = dq[mt][i][1] = dq[mt][i][2] = dq[mt][i][3] = 0.0f;
  const int n_blocks = min((T + BN - 1) / BN, (m0 + BM - 1) / BN + 1);

  for (int nb = 0; nb < n_blocks; ++nb) {
    const int cur = nb & 1;
    double_buffer_step<false>(nb + 1 < n_blocks, [&] {
      load_tile<HD, BN, kTC>(Ks + (cur ^ 1) * BN * LDS, kg, (nb + 1) * BN, T, ld);
      load_tile<HD, BN, kTC>(Vs + (cur ^ 1) * BN * LDS, vg, (nb + 1) * BN, T, ld);
    });
    const bf16* Kc = Ks + cur * BN * LDS;
    const bf16* Vc = Vs + cur * BN * LDS;

    // S = Q · Kᵀ and dP = dO · Vᵀ (rows: this warp's queries; columns: keys).
    float s[MT][BN / 8][4], dp[MT][BN / 8][4];
    two_products<HD, MT, BN>(s, dp, Qs, dOs, Kc, Vc, warp_row0);
    const bool need_mask = nb * BN + BN - 1 > m0 + warp_row0;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int ql = warp_row0 + mt * 16 + g + (e >> 1) * 8;
          float p = exp2f(fmaf(s[mt][j][e], scale_log2, -Ls[ql]));
          if (need_mask && nb * BN + j * 8 + t4 * 2 + (e & 1) > m0 + ql) p = 0.0f;
          dp[mt][j][e] = p * (dp[mt][j][e] - Ds[ql]);
        }
      }
    // dQ += dS · K
#pragma unroll
    for (int ks = 0; ks < BN / 16; ++ks) {
      uint32_t sa[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) acc_to_a(sa[mt], dp[mt][2 * ks], dp[mt][2 * ks + 1]);
#pragma unroll
      for (int dn = 0; dn < HD / 16; ++dn) {
        uint32_t bk[4];
        load_b_kn(bk, Kc, ks * 16, dn * 16, LDS);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma16816(dq[mt][2 * dn], sa[mt], bk[0], bk[1]);
          mma16816(dq[mt][2 * dn + 1], sa[mt], bk[2], bk[3]);
        }
      }
    }
    __syncthreads();
  }

#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int q = m0 + warp_row0 + mt * 16 + g + r * 8;
      if (q >= T) continue;
      bf16* dst = dqkv + (static_cast<size_t>(b) * T + q) * ld + h * HD;
#pragma unroll
      for (int i = 0; i < HD / 8; ++i) {
        const int d = i * 8 + t4 * 2;
        *reinterpret_cast<__nv_bfloat162*>(dst + d) =
            __floats2bfloat162_rn(dq[mt][i][2 * r] * scale, dq[mt][i][2 * r + 1] * scale);
      }
    }
}

// ------------------------------------------------------------- simple kernels (any head dim ≤ 256)

constexpr int kSimpleWarps = 8;
constexpr int kMaxPerLane = kMaxHeadDim / 32;

// One warp per (b, h, query): online softmax over keys 0..q, head dim spread over
// lanes (d = lane + 32 k). out[B,T,C], lse[B,NH,T], qkv[B,T,(NH+2·KVH)·HD]; query
// head h reads key/value head h/(NH/KVH).
__global__ void attention_forward_simple(bf16* out, float* lse, const bf16* qkv, int B, int T, int C, int NH,
                                         int KVH, float scale) {
  const int HD = C / NH;
  const size_t w = blockIdx.x * static_cast<size_t>(kSimpleWarps) + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (w >= static_cast<size_t>(B) * NH * T) return;
  const int q = static_cast<int>(w % T);
  const int bh = static_cast<int>(w / T), b = bh / NH, h = bh % NH, kvh = h / (NH / KVH);
  const size_t ld = static_cast<size_t>(NH + 2 * KVH) * HD;
  const bf16* base = qkv + static_cast<size_t>(b) * T * ld + h * HD;
  const bf16* kbase = qkv + static_cast<size_t>(b) * T * ld + (NH + kvh) * HD;
  const bf16* vbase = kbase + KVH * HD;
  float qv[kMaxPerLane], acc[kMaxPerLane];
#pragma unroll
  for (int k = 0; k < kMaxPerLane; ++k) {
    const int d = lane + 32 * k;
    qv[k] = d < HD ? __bfloat162float(base[q * ld + d]) * scale : 0.0f;
    acc[k] = 0.0f;
  }
  float m = -INFINITY, l = 0.0f;
  for (int j = 0; j <= q; ++j) {
    const bf16* kr = kbase + j * ld;
    float dot = 0.0f;
#pragma unroll
    for (int k = 0; k < kMaxPerLane; ++k) {
      const int d = lane + 32 * k;
      if (d < HD) dot += qv[k] * __bfloat162float(kr[d]);
    }
    dot = warp_sum(dot);
    const float m_new = fmaxf(m, dot);
    const float alpha = __expf(m - m_new), p = __expf(dot - m_new);
    l = l * alpha + p;
    const bf16* vr = vbase + j * ld;
#pragma unroll
    for (int k = 0; k < kMaxPerLane; ++k) {
      const int d = lane + 32 * k;
      acc[k] = acc[k] * alpha + (d < HD ? p * __bfloat162float(vr[d]) : 0.0f);
    }
    m = m_new;
  }
  bf16* o = out + (static_cast<size_t>(b) * T + q) * C + h * HD;
#pragma unroll
  for (int k = 0; k < kMaxPerLane; ++k) {
    const int d = lane + 32 * k;
    if (d < HD) o[d] = __float2bfloat16_rn(acc[k] / l);
  }
  if (lane == 0) lse[static_cast<size_t>(bh) * T + q] = m + logf(l);
}

// One warp per (b, h, query): dq = scale Σ_j dS_ij k_j. Arguments as above.
__global__ void attention_backward_dq_simple(bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse,
                                             const float* Dg, int B, int T, int C, int NH, int KVH, float scale) {
  const int HD = C / NH;
  const size_t w = blockIdx.x * static_cast<size_t>(kSimpleWarps) + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (w >= static_cast<size_t>(B) * NH * T) return;
  const int q = static_cast<int>(w % T);
  const int bh = static_cast<int>(w / T), b = bh / NH, h = bh % NH, kvh = h / (NH / KVH);
  const size_t ld = static_cast<size_t>(NH + 2 * KVH) * HD;
  const bf16* base = qkv + static_cast<size_t>(b) * T * ld + h * HD;
  const bf16* kbase = qkv + static_cast<size_t>(b) * T * ld + (NH + kvh) * HD;
  const bf16* vbase = kbase + KVH * HD;
  const bf16* dor = dout + (static_cast<size_t>(b) * T + q) * C + h * HD;
  const float L = lse[static_cast<size_t>(bh) * T + q], Dq = Dg[static_cast<size_t>(bh) * T + q];
  float qv[kMaxPerLane], dov[kMaxPerLane], acc[kMaxPerLane];
#pragma unroll
  for (int k = 0; k < kMaxPerLane; ++k) {
    const int d = lane + 32 * k;
    qv[k] = d < HD ? __bfloat162float(base[q * ld + d]) * scale : 0.0f;
    dov[k] = d < HD ? __bfloat162float(dor[d]) : 0.0f;
    acc[k] = 0.0f;
  }
  for (int j = 0; j <= q; ++j) {
    const bf16* kr = kbase + j * ld;
    const bf16* vr = vbase + j * ld;
    float s = 0.0f, dp = 0.0f;
#pragma unroll
    for (int k = 0; k < kMaxPerLane; ++k) {
      const int d = lane + 32 * k;
      if (d < HD) {
        s += qv[k] * __bfloat162float(kr[d]);
        dp += dov[k] * __bfloat162float(vr[d]);
      }
    }
    s = warp_sum(s);
    dp = warp_sum(dp);
    const float ds = __expf(s - L) * (dp - Dq);
#pragma unroll
    for (int k = 0; k < kMaxPerLane; ++k) {
      const int d = lane + 32 * k;
      if (d < HD) acc[k] += ds * __bfloat162float(kr[d]);
    }
  }
  bf16* dst = dqkv + (static_cast<size_t>(b) * T + q) * ld + h * HD;
#pragma unroll
  for (int k = 0; k < kMaxPerLane; ++k) {
    const int d = lane + 32 * k;
    if (d < HD) dst[d] = __float2bfloat16_rn(acc[k] * scale);
  }
}

// One warp per (b, key/value head kvh, key j): dk = scale Σ_h Σ_i dS_ij q_i and
// dv = Σ_h Σ_i P_ij dO_i over the group's query heads h (in order) and queries i ≥ j.
__global__ void attention_backward_dkv_simple(bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse,
                                              const float* Dg, int B, int T, int C, int NH, int KVH, float scale) {
  const int HD = C / NH, group = NH / KVH;
  const size_t w = blockIdx.x * static_cast<size_t>(kSimpleWarps) + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (w >= static_cast<size_t>(B) * KVH * T) return;
  const int j = static_cast<int>(w % T);
  const int bg = static_cast<int>(w / T), b = bg / KVH, kvh = bg % KVH;
  const size_t ld = static_cast<size_t>(NH + 2 * KVH) * HD;
  const bf16* base = qkv + static_cast<size_t>(b) * T * ld;
  const bf16* krow = base + j * ld + (NH + kvh) * HD;
  float kv[kMaxPerLane], vv[kMaxPerLane], dk[kMaxPerLane], dv[kMaxPerLane];
#pragma unroll
  for (int k = 0; k < kMaxPerLane; ++k) {
    const int d = lane + 32 * k;
    kv[k] = d < HD ? __bfloat162float(krow[d]) : 0.0f;
    vv[k] = d < HD ? __bfloat162float(krow[KVH * HD + d]) : 0.0f;
    dk[k] = dv[k] = 0.0f;
  }
  for (int h = kvh * group; h < (kvh + 1) * group; ++h) {
    const size_t bh = static_cast<size_t>(b) * NH + h;
    for (int i = j; i < T; ++i) {
      const bf16* qr = base + i * ld + h * HD;
      const bf16* dor = dout + (static_cast<size_t>(b) * T + i) * C + h * HD;
      float s = 0.0f, dp = 0.0f;
#pragma unroll
      for (int k = 0; k < kMaxPerLane; ++k) {
        const int d = lane + 32 * k;
        if (d < HD) {
          s += __bfloat162float(qr[d]) * kv[k];
          dp += __bfloat162float(dor[d]) * vv[k];
        }
      }
      s = warp_sum(s) * scale;
      dp = warp_sum(dp);
      const float p = __expf(s - lse[bh * T + i]);
      const float ds = p * (dp - Dg[bh * T + i]);
#pragma unroll
      for (int k = 0; k < kMaxPerLane; ++k) {
        const int d = lane + 32 * k;
        if (d < HD) {
          dv[k] += p * __bfloat162float(dor[d]);
          dk[k] += ds * __bfloat162float(qr[d]);
        }
      }
    }
  }
  bf16* dst = dqkv + (static_cast<size_t>(b) * T + j) * ld + (NH + kvh) * HD;  // dK; dV follows
#pragma unroll
  for (int k = 0; k < kMaxPerLane; ++k) {
    const int d = lane + 32 * k;
    if (d < HD) {
      dst[d] = __float2bfloat16_rn(dk[k] * scale);
      dst[KVH * HD + d] = __float2bfloat16_rn(dv[k]);
    }
  }
}

// ------------------------------------------------------------- dispatch

template <int HD>
cudaError_t forward_tc(bf16* out, float* lse, const bf16* qkv, int B, int T, int C, int NH, int KVH,
                       cudaStream_t stream) {
  constexpr size_t smem = fwd_smem_bytes<HD>();
  auto kernel = KVH == NH ? attention_forward_tc<HD, false> : attention_forward_tc<HD, true>;
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (e != cudaSuccess) return e;
  const float scale_log2 = kLog2e / sqrtf(static_cast<float>(HD));
  dim3 grid(ceil_div(T, fwd_bm<HD>()), B * NH);
  kernel<<<grid, kTC, smem, stream>>>(out, lse, qkv, T, C, NH, KVH, scale_log2);
  return cudaGetLastError();
}

template <int HD>
cudaError_t backward_tc(bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse, const float* D, int B,
                        int T, int C, int NH, int KVH, cudaStream_t stream) {
  const float scale = 1.0f / sqrtf(static_cast<float>(HD));
  const float scale_log2 = scale * kLog2e;
  constexpr size_t smem_kv = dkv_smem_bytes<HD>(), smem_q = dq_smem_bytes<HD>();
  const bool grouped = KVH != NH;
  auto dkv = grouped ? attention_backward_dkv_tc<HD, true> : attention_backward_dkv_tc<HD, false>;
  auto dq = grouped ? attention_backward_dq_tc<HD, true> : attention_backward_dq_tc<HD, false>;
  cudaError_t e = cudaFuncSetAttribute(dkv, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem_kv));
  if (e != cudaSuccess) return e;
  e = cudaFuncSetAttribute(dq, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem_q));
  if (e != cudaSuccess) return e;
  // dK/dV: one block per key block and key/value head (its group's query heads in turn).
  dim3 grid_kv(ceil_div(T, dkv_keys<HD>()), B * KVH);
  dkv<<<grid_kv, kTC, smem_kv, stream>>>(dqkv, dout, qkv, lse, D, T, C, NH, KVH, scale, scale_log2);
  e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  dim3 grid_q(ceil_div(T, dq_queries<HD>()), B * NH);
  dq<<<grid_q, kTC, smem_q, stream>>>(dqkv, dout, qkv, lse, D, T, C, NH, KVH, scale, scale_log2);
  return cudaGetLastError();
}

}  // namespace

bool attention_uses_tensor_cores(int hd, const void* qkv) {
  return (hd == 32 || hd == 64 || hd == 80 || hd == 96 || hd == 128) && aligned16(qkv);
}

cudaError_t launch_attention_forward(bf16* out, float* lse, const bf16* qkv, int B, int T, int C, int NH,
                                     int KVH, cudaStream_t stream, bool sm90, AttentionKernel kernel) {
  if (B == 0 || T == 0 || C == 0) return cudaSuccess;
  const int HD = C / NH;
  if (kernel == AttentionKernel::kAuto && sm90 && attention_wgmma_takes(HD) && attention_wgmma_built() &&
      aligned16(qkv) && aligned16(out))
    return launch_attention_forward_wgmma(out, lse, qkv, B, T, C, NH, KVH, stream);
  if (attention_uses_tensor_cores(HD, qkv) && aligned16(out)) {
    switch (HD) {
      case 32: return forward_tc<32>(out, lse, qkv, B, T, C, NH, KVH, stream);
      case 64: return forward_tc<64>(out, lse, qkv, B, T, C, NH, KVH, stream);
      case 80: return forward_tc<80>(out, lse, qkv, B, T, C, NH, KVH, stream);
      case 96: return forward_tc<96>(out, lse, qkv, B, T, C, NH, KVH, stream);
      case 128: return forward_tc<128>(out, lse, qkv, B, T, C, NH, KVH, stream);
      default: break;
    }
  }
  const size_t warps = static_cast<size_t>(B) * NH * T;
  attention_forward_simple<<<ceil_div(warps, kSimpleWarps), kSimpleWarps * 32, 0, stream>>>(
      out, lse, qkv, B, T, C, NH, KVH, 1.0f / sqrtf(static_cast<float>(HD)));
  return cudaGetLastError();
}

cudaError_t launch_attention_backward(bf16* dqkv, const bf16* dout, const bf16* qkv, const bf16* out,
                                      const float* lse, int B, int T, int C, int NH, int KVH, void* scratch,
                                      cudaStream_t stream, bool sm90, AttentionKernel kernel) {
  if (B == 0 || T == 0 || C == 0) return cudaSuccess;
  const int HD = C / NH;
  float* D = static_cast<float*>(scratch);
  const size_t rows = static_cast<size_t>(B) * T * NH;
  attention_bwd_dot_kernel<<<ceil_div(rows, 8), 256, 0, stream>>>(D, dout, out, B, T, C, NH);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  if (kernel == AttentionKernel::kAuto && sm90 && attention_wgmma_takes(HD) && attention_wgmma_built() &&
      aligned16(qkv) && aligned16(dqkv) && aligned16(dout))
    return launch_attention_backward_wgmma(dqkv, dout, qkv, lse, D, B, T, C, NH, KVH, stream);
  if (attention_uses_tensor_cores(HD, qkv) && aligned16(dqkv) && aligned16(dout)) {
    switch (HD) {
      case 32: return backward_tc<32>(dqkv, dout, qkv, lse, D, B, T, C, NH, KVH, stream);
      case 64: return backward_tc<64>(dqkv, dout, qkv, lse, D, B, T, C, NH, KVH, stream);
      case 80: return backward_tc<80>(dqkv, dout, qkv, lse, D, B, T, C, NH, KVH, stream);
      case 96: return backward_tc<96>(dqkv, dout, qkv, lse, D, B, T, C, NH, KVH, stream);
      case 128: return backward_tc<128>(dqkv, dout, qkv, lse, D, B, T, C, NH, KVH, stream);
      default: break;
    }
  }
  const float scale = 1.0f / sqrtf(static_cast<float>(HD));
  const size_t kv_warps = static_cast<size_t>(B) * KVH * T, q_warps = static_cast<size_t>(B) * NH * T;
  attention_backward_dkv_simple<<<ceil_div(kv_warps, kSimpleWarps), kSimpleWarps * 32, 0, stream>>>(
      dqkv, dout, qkv, lse, D, B, T, C, NH, KVH, scale);
  e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  attention_backward_dq_simple<<<ceil_div(q_warps, kSimpleWarps), kSimpleWarps * 32, 0, stream>>>(
      dqkv, dout, qkv, lse, D, B, T, C, NH, KVH, scale);
  return cudaGetLastError();
}

}  // namespace spillway::cuda_detail
