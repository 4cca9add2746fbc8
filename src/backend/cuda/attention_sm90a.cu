// The Hopper forward of causal attention, head dims 64, 80 and 128 (see
// attention.cuh): warpgroup matrix products (wgmma) with operands read by the tensor
// cores straight from shared memory. Built for sm_90a only (CMakeLists.txt); elsewhere the launcher reports
// cudaErrorNotSupported and the mma.sync kernel of attention.cu runs instead.
//
// Block: 256 threads, two warpgroups; warpgroup w owns query rows m0 + 64w .. +63 of
// one (batch, head). Keys and values stream through shared memory 64 rows at a time,
// double-buffered (cp.async); per key block each warpgroup computes
//   S = Q·Kᵀ      wgmma m64n64k16 over the head dim, Q and K from shared memory,
//   P = 2^(S·scale·log2e − m), online softmax in registers (the accumulator layout),
//   O += P·V      wgmma m64n64k16 (and m64n16k16) over the keys, P from registers, V
//                 from shared memory (N-major).
//
// Each matrix tile (Q, K, V) is stored as column blocks: HD/64 blocks of [rows][64]
// bf16, 128 bytes a row, in the 128-byte swizzle the tensor cores read (the 16-byte
// chunk c of row r sits at chunk c ^ (r % 8)), then for head dim 80 a tail block of
// [rows][16], 32 bytes a row, in the 32-byte swizzle (chunk c of row r at c ^ (r/4 % 2)).
// Every block starts 1024-byte aligned. Accumulator fragment of m64nN (warp q of the warpgroup,
// g = lane / 4, t = lane % 4): d[4j + e] is row 16q + g + 8·(e / 2), column
// 8j + 2t + (e % 2), which is also the A-operand layout of a product over those
// columns, so P never leaves registers.
#include <cmath>

#include "backend/cuda/attention.cuh"

namespace spillway::cuda_detail {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL) || !defined(__CUDA_ARCH__)
#define SPILLWAY_WGMMA_BODY 1
#endif

namespace {

constexpr int kWgRows = 64;              // query rows per warpgroup
constexpr int kWarpgroups = 2;
constexpr int kThreads = 128 * kWarpgroups;
constexpr int kBM = kWgRows * kWarpgroups;  // query rows per block
constexpr int kBN = 64;                     // keys per iteration

// The column blocks of a head dim: `main` blocks of 64 columns (128-byte rows) and,
// when `tail` is 16, one block of 16 columns (32-byte rows).
template <int HD>
struct Cols {
  static_assert(HD == 64 || HD == 80 || HD == 128, "the Hopper forward takes head dims 64, 80 and 128");
  static constexpr int main = HD / 64, tail = HD % 64;
  // Bytes of a tile of `rows` rows (every block 1024-aligned: rows are multiples of 64).
  static constexpr int bytes(int rows) { return rows * (128 * main + 2 * tail); }
};
template <int HD>
constexpr size_t smem_bytes() {
  return static_cast<size_t>(Cols<HD>::bytes(kBM) + 4 * Cols<HD>::bytes(kBN)) + 1024;  // Q, K[2], V[2], alignment
}
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

#ifdef SPILLWAY_WGMMA_BODY

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}

// Rows row0 .. row0+rows-1 of a [T, HD] bf16 matrix (row stride ld elements) into
// the tile at `tile` (shared address, 1024-aligned) in its column blocks; rows at or
// past T are zero.
template <int HD>
__device__ __forceinline__ void load_swizzled(uint32_t tile, const bf16* g, int row0, int rows, int T, size_t ld) {
  constexpr int kChunks = HD / 8, kMainChunks = 8 * Cols<HD>::main;
  for (int i = threadIdx.x; i < rows * kChunks; i += kThreads) {
    const int r = i / kChunks, c = i % kChunks;
    const bool valid = row0 + r < T;
    const bf16* src = valid ? g + static_cast<size_t>(row0 + r) * ld + c * 8 : g;
    uint32_t dst;
    if (c < kMainChunks) {
      dst = tile + (c >> 3) * rows * 128 + r * 128 + (((c & 7) ^ (r & 7)) << 4);
    } else {
      const int tc = c - kMainChunks;
      dst = tile + Cols<HD>::main * rows * 128 + r * 32 + ((tc ^ ((r >> 2) & 1)) << 4);
    }
    cp_async16(dst, src, valid);
  }
}

// Shared-memory matrix descriptor: start address, leading and stride byte offsets,
// swizzle (1: 128-byte, 3: 32-byte). The stride between 8-row groups is 1024 bytes in
// 128-byte-swizzled blocks and 256 in 32-byte ones.
__device__ __forceinline__ uint64_t descriptor(uint32_t addr, uint32_t lbo, uint32_t sbo, uint32_t swizzle) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>((lbo >> 4) & 0x3FFF) << 16) |
         (static_cast<uint64_t>((sbo >> 4) & 0x3FFF) << 32) | (static_cast<uint64_t>(swizzle) << 62);
}
constexpr uint32_t kSwizzle128 = 1, kSwizzle32 = 3;

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }

// Keeps the compiler from moving reads or writes of an accumulator across the
// asynchronous product (the wait above names no registers).
template <int N>
__device__ __forceinline__ void pin(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

#define SPILLWAY_D32                                                                                              \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, " \
  "%23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define SPILLWAY_D32_OUT(d)                                                                                        \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),     \
      "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),      \
      "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),     \
      "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])

// d (+)= A·B, m64n64k16, A and B from shared memory (both K-major); accumulate when
// `accumulate` is nonzero, else overwrite.
__device__ __forceinline__ void wgmma_ss(float (&d)[32], uint64_t a, uint64_t b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " SPILLWAY_D32 ", %32, %33, p, 1, 1, 0, 0;\n}\n"
      : SPILLWAY_D32_OUT(d)
      : "l"(a), "l"(b), "r"(accumulate));
}

// d += A·B, m64n64k16, A from registers (a[4], the m16n8k16 A layout per warp), B from
// shared memory N-major (transposed).
__device__ __forceinline__ void wgmma_rs_tb(float (&d)[32], const uint32_t (&a)[4], uint64_t b) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " SPILLWAY_D32
      ", {%32, %33, %34, %35}, %36, 1, 1, 1, 1;\n"
      : SPILLWAY_D32_OUT(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}

// The same, m64n16k16 (a 16-column block of the output).
__device__ __forceinline__ void wgmma_rs_tb16(float (&d)[8], const uint32_t (&a)[4], uint64_t b) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, "
      "%12, 1, 1, 1, 1;\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}

#undef SPILLWAY_D32
#undef SPILLWAY_D32_OUT

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

#endif  // SPILLWAY_WGMMA_BODY

// out[B,T,C], lse[B,NH,T] (natural log), qkv[B,T,(NH+2·KVH)·HD]; grid (ceil(T/128),
// B·NH), 256 threads. Query head h reads key/value head h/(NH/KVH) (kGrouped; else
// KVH = NH and the [B,T,3C] layout).
template <int HD, bool kGrouped>
__global__ void __launch_bounds__(kThreads) attention_forward_wgmma(bf16* out, float* lse, const bf16* qkv, int T,
                                                                  int C, int NH, int KVH, float scale_log2) {
#ifdef SPILLWAY_WGMMA_BODY
  using L = Cols<HD>;
  constexpr int kMain = L::main, kTail = L::tail;
  constexpr int kQBytes = L::bytes(kBM), kKVBytes = L::bytes(kBN);
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u;
  const uint32_t q_tile = base, k_tile = base + kQBytes, v_tile = k_tile + 2 * kKVBytes;

  const int mb = gridDim.x - 1 - blockIdx.x;  // longest rows first
  const int m0 = mb * kBM;
  const int bh = blockIdx.y, b = bh / NH, h = bh % NH;
  const int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
  const int g = lane >> 2, t4 = lane & 3;
  const size_t ld = kGrouped ? static_cast<size_t>(NH + 2 * KVH) * HD : 3 * static_cast<size_t>(C);
  const bf16* qg = qkv + static_cast<size_t>(b) * T * ld + h * HD;
  const bf16* kg = kGrouped ? qkv + static_cast<size_t>(b) * T * ld + (NH + h / (NH / KVH)) * HD : qg + C;
  const bf16* vg = kGrouped ? kg + KVH * HD : qg + 2 * C;

  const int wg_row0 = m0 + wg * kWgRows;                                   // this warpgroup's first query
  const int n_blocks = min((T + kBN - 1) / kBN, (m0 + kBM - 1) / kBN + 1);  // key blocks the block needs
  const int wg_last = min(n_blocks - 1, (wg_row0 + kWgRows - 1) / kBN);     // ... and this warpgroup

  load_swizzled<HD>(q_tile, qg, m0, kBM, T, ld);
  load_swizzled<HD>(k_tile, kg, 0, kBN, T, ld);
  load_swizzled<HD>(v_tile, vg, 0, kBN, T, ld);
  asm volatile("cp.async.commit_group;\n" ::);

  // This warpgroup's 64 query rows in each column block of the Q tile.
  const uint32_t q_main = q_tile + wg * kWgRows * 128, q_tail = q_tile + kMain * kBM * 128 + wg * kWgRows * 32;
  float o[kMain][32], o_tail[kTail ? 8 : 1], s[32];
#pragma unroll
  for (int c = 0; c < kMain; ++c)
#pragma unroll
    for (int i = 0; i < 32; ++i) o[c][i] = 0.0f;
#pragma unroll
  for (int i = 0; i < (kTail ? 8 : 1); ++i) o_tail[i] = 0.0f;
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};
  const int row_a = wg_row0 + warp * 16 + g;  // this thread's rows: row_a and row_a + 8

  for (int nb = 0; nb < n_blocks; ++nb) {
    const int cur = nb & 1;
    if (nb + 1 < n_blocks) {
      load_swizzled<HD>(k_tile + (cur ^ 1) * kKVBytes, kg, (nb + 1) * kBN, kBN, T, ld);
      load_swizzled<HD>(v_tile + (cur ^ 1) * kKVBytes, vg, (nb + 1) * kBN, kBN, T, ld);
      asm volatile("cp.async.commit_group;\n" ::);
      asm volatile("cp.async.wait_group 1;\n" ::: "memory");
    } else {
      asm volatile("cp.async.wait_group 0;\n" ::: "memory");
    }
    // The tiles were written through the generic proxy; the tensor cores read them
    // through the async proxy.
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();

    if (nb <= wg_last) {  // uniform over the warpgroup
      const uint32_t kt = k_tile + cur * kKVBytes, vt = v_tile + cur * kKVBytes;
      // S = Q·Kᵀ over the head dim in steps of 16: 32 bytes along a 128-byte row, then
      // the tail block's whole 32-byte row.
      wgmma_fence();
#pragma unroll
      for (int c = 0; c < kMain; ++c)
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
          wgmma_ss(s, descriptor(q_main + c * kBM * 128 + 32 * kk, 0, 1024, kSwizzle128),
                   descriptor(kt + c * kBN * 128 + 32 * kk, 0, 1024, kSwizzle128), c + kk);
      if constexpr (kTail != 0)
        wgmma_ss(s, descriptor(q_tail, 0, 256, kSwizzle32), descriptor(kt + kMain * kBN * 128, 0, 256, kSwizzle32),
                 1);
      wgmma_commit();
      wgmma_wait_all();
      pin(s);

      // Mask keys past a row (only the diagonal block) or past T.
      if (nb * kBN + kBN - 1 > wg_row0 || nb * kBN + kBN > T) {
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int key = nb * kBN + j * 8 + t4 * 2 + (e & 1);
            const int q = row_a + (e >> 1) * 8;
            if (key > q || key >= T) s[4 * j + e] = -INFINITY;
          }
      }
      float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int i = 0; i < 32; ++i) mx[(i >> 1) & 1] = fmaxf(mx[(i >> 1) & 1], s[i]);
      float alpha[2], neg_m[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
        const float m_new = fmaxf(row_max[r], mx[r] * scale_log2);  // log2 units
        alpha[r] = m_new == -INFINITY ? 1.0f : fast_exp2(row_max[r] - m_new);
        neg_m[r] = m_new == -INFINITY ? 0.0f : -m_new;
        row_max[r] = m_new;
        row_sum[r] *= alpha[r];
      }
#pragma unroll
      for (int i = 0; i < 32; ++i) {
        const int r = (i >> 1) & 1;
        const float p = fast_exp2(fmaf(s[i], scale_log2, neg_m[r]));
        s[i] = p;
        row_sum[r] += p;
#pragma unroll
        for (int c = 0; c < kMain; ++c) o[c][i] *= alpha[r];
      }
      if constexpr (kTail != 0) {
#pragma unroll
        for (int i = 0; i < 8; ++i) o_tail[i] *= alpha[(i >> 1) & 1];
      }
      // O += P·V over the 64 keys in 4 steps of 16: 16 rows of a block (2048 bytes of
      // a 128-byte-row block, 512 of the tail block).
      uint32_t pa[4][4];
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) {
        pa[ks][0] = pack_bf16(s[8 * ks + 0], s[8 * ks + 1]);
        pa[ks][1] = pack_bf16(s[8 * ks + 2], s[8 * ks + 3]);
        pa[ks][2] = pack_bf16(s[8 * ks + 4], s[8 * ks + 5]);
        pa[ks][3] = pack_bf16(s[8 * ks + 6], s[8 * ks + 7]);
      }
      wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) {
#pragma unroll
        for (int c = 0; c < kMain; ++c)
          wgmma_rs_tb(o[c], pa[ks], descriptor(vt + c * kBN * 128 + ks * 2048, 1024, 1024, kSwizzle128));
        if constexpr (kTail != 0)
          wgmma_rs_tb16(o_tail, pa[ks], descriptor(vt + kMain * kBN * 128 + ks * 512, 256, 256, kSwizzle32));
      }
      wgmma_commit();
      wgmma_wait_all();
#pragma unroll
      for (int c = 0; c < kMain; ++c) pin(o[c]);
      pin(o_tail);
    }
    __syncthreads();  // this buffer is refilled in the next iteration
  }

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int q = row_a + r * 8;
    float l = row_sum[r];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    if (q >= T) continue;
    const float inv = 1.0f / l;
    if (t4 == 0) lse[static_cast<size_t>(bh) * T + q] = row_max[r] * kLn2 + logf(l);
    bf16* dst = out + (static_cast<size_t>(b) * T + q) * C + h * HD;
#pragma unroll
    for (int c = 0; c < kMain; ++c)
#pragma unroll
      for (int j = 0; j < 8; ++j)
        *reinterpret_cast<__nv_bfloat162*>(dst + 64 * c + 8 * j + 2 * t4) =
            __floats2bfloat162_rn(o[c][4 * j + 2 * r] * inv, o[c][4 * j + 2 * r + 1] * inv);
    if constexpr (kTail != 0) {
#pragma unroll
      for (int j = 0; j < 2; ++j)
        *reinterpret_cast<__nv_bfloat162*>(dst + 64 * kMain + 8 * j + 2 * t4) =
            __floats2bfloat162_rn(o_tail[4 * j + 2 * r] * inv, o_tail[4 * j + 2 * r + 1] * inv);
    }
  }
#endif  // SPILLWAY_WGMMA_BODY
}

template <int HD>
cudaError_t forward_wgmma(bf16* out, float* lse, const bf16* qkv, int B, int T, int C, int NH, int KVH,
                          cudaStream_t stream) {
  constexpr size_t smem = smem_bytes<HD>();
  auto kernel = KVH == NH ? attention_forward_wgmma<HD, false> : attention_forward_wgmma<HD, true>;
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (e != cudaSuccess) return e;
  const float scale_log2 = kLog2e / sqrtf(static_cast<float>(HD));
  dim3 grid(ceil_div(T, kBM), B * NH);
  kernel<<<grid, kThreads, smem, stream>>>(out, lse, qkv, T, C, NH, KVH, scale_log2);
  return cudaGetLastError();
}

}  // namespace

bool attention_wgmma_built() {
#ifdef SPILLWAY_WGMMA_BODY
  return true;
#else
  return false;
#endif
}

bool attention_wgmma_takes(int hd) { return hd == 64 || hd == 80 || hd == 128; }

cudaError_t launch_attention_forward_wgmma(bf16* out, float* lse, const bf16* qkv, int B, int T, int C, int NH,
                                           int KVH, cudaStream_t stream) {
  if (!aligned16(qkv) || !aligned16(out)) return cudaErrorInvalidValue;
  if (B == 0 || T == 0) return cudaSuccess;
  switch (C / NH) {
    case 64: return forward_wgmma<64>(out, lse, qkv, B, T, C, NH, KVH, stream);
    case 80: return forward_wgmma<80>(out, lse, qkv, B, T, C, NH, KVH, stream);
    case 128: return forward_wgmma<128>(out, lse, qkv, B, T, C, NH, KVH, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace spillway::cuda_detail
