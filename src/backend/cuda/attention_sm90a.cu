// The Hopper forward of causal attention, head dim 64 (see attention.cuh): warpgroup
// matrix products (wgmma) with operands read by the tensor cores straight from shared
// memory. Built for sm_90a only (CMakeLists.txt); elsewhere the launcher reports
// cudaErrorNotSupported and the mma.sync kernel of attention.cu runs instead.
//
// Block: 256 threads, two warpgroups; warpgroup w owns query rows m0 + 64w .. +63 of
// one (batch, head). Keys and values stream through shared memory 64 rows at a time,
// double-buffered (cp.async); per key block each warpgroup computes
//   S = Q·Kᵀ      4 × wgmma m64n64k16, Q and K from shared memory,
//   P = 2^(S·scale·log2e − m), online softmax in registers (the accumulator layout),
//   O += P·V      4 × wgmma m64n64k16, P from registers, V from shared memory (N-major).
//
// Shared tiles are [rows][64] bf16, 128 bytes a row, in the 128-byte swizzle the
// tensor cores read: the 16-byte chunk c of row r sits at chunk c ^ (r % 8), each
// tile 1024-byte aligned. Accumulator fragment of m64nN (warp q of the warpgroup,
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

constexpr int kHd = 64;                  // head dim this kernel takes
constexpr int kRowBytes = kHd * 2;       // one tile row, = the swizzle width
constexpr int kWgRows = 64;              // query rows per warpgroup
constexpr int kWarpgroups = 2;
constexpr int kThreads = 128 * kWarpgroups;
constexpr int kBM = kWgRows * kWarpgroups;  // query rows per block
constexpr int kBN = 64;                     // keys per iteration
constexpr int kQBytes = kBM * kRowBytes;
constexpr int kKVBytes = kBN * kRowBytes;
// Q, then K[2], V[2]; 1 KiB slack to align the base to 1024.
constexpr size_t kSmemBytes = kQBytes + 4 * kKVBytes + 1024;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

#ifdef SPILLWAY_WGMMA_BODY

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}

// Rows row0.. of a [T, 64] bf16 matrix (row stride ld elements) into the swizzled
// tile at `tile` (shared address, 1024-aligned), `rows` rows; rows at or past T zero.
__device__ __forceinline__ void load_swizzled(uint32_t tile, const bf16* g, int row0, int rows, int T, size_t ld) {
  for (int i = threadIdx.x; i < rows * 8; i += kThreads) {
    const int r = i >> 3, c = i & 7;
    const bool valid = row0 + r < T;
    const bf16* src = valid ? g + static_cast<size_t>(row0 + r) * ld + c * 8 : g;
    cp_async16(tile + r * kRowBytes + ((c ^ (r & 7)) << 4), src, valid);
  }
}

// Shared-memory matrix descriptor: start address, leading and stride byte offsets
// (the stride between 8-row groups is 1024 bytes in every tile here), 128-byte swizzle.
__device__ __forceinline__ uint64_t descriptor(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>((lbo >> 4) & 0x3FFF) << 16) |
         (static_cast<uint64_t>((sbo >> 4) & 0x3FFF) << 32) | (uint64_t{1} << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }

// Keeps the compiler from moving reads or writes of an accumulator across the
// asynchronous product (the wait above names no registers).
__device__ __forceinline__ void pin(float (&d)[32]) {
#pragma unroll
  for (int i = 0; i < 32; ++i) asm volatile("" : "+f"(d[i])::"memory");
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

// out[B,T,C], lse[B,NH,T] (natural log), qkv[B,T,(NH+2·KVH)·64]; grid (ceil(T/128),
// B·NH), 256 threads. Query head h reads key/value head h/(NH/KVH) (kGrouped; else
// KVH = NH and the [B,T,3C] layout).
template <bool kGrouped>
__global__ void __launch_bounds__(kThreads) attention_forward_wgmma64(bf16* out, float* lse, const bf16* qkv, int T,
                                                                    int C, int NH, int KVH, float scale_log2) {
#ifdef SPILLWAY_WGMMA_BODY
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u;
  const uint32_t q_tile = base, k_tile = base + kQBytes, v_tile = k_tile + 2 * kKVBytes;

  const int mb = gridDim.x - 1 - blockIdx.x;  // longest rows first
  const int m0 = mb * kBM;
  const int bh = blockIdx.y, b = bh / NH, h = bh % NH;
  const int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
  const int g = lane >> 2, t4 = lane & 3;
  const size_t ld = kGrouped ? static_cast<size_t>(NH + 2 * KVH) * kHd : 3 * static_cast<size_t>(C);
  const bf16* qg = qkv + static_cast<size_t>(b) * T * ld + h * kHd;
  const bf16* kg = kGrouped ? qkv + static_cast<size_t>(b) * T * ld + (NH + h / (NH / KVH)) * kHd : qg + C;
  const bf16* vg = kGrouped ? kg + KVH * kHd : qg + 2 * C;

  const int wg_row0 = m0 + wg * kWgRows;                           // this warpgroup's first query
  const int n_blocks = min((T + kBN - 1) / kBN, (m0 + kBM - 1) / kBN + 1);  // key blocks the block needs
  const int wg_last = min(n_blocks - 1, (wg_row0 + kWgRows - 1) / kBN);     // ... and this warpgroup

  load_swizzled(q_tile, qg, m0, kBM, T, ld);
  load_swizzled(k_tile, kg, 0, kBN, T, ld);
  load_swizzled(v_tile, vg, 0, kBN, T, ld);
  asm volatile("cp.async.commit_group;\n" ::);

  const uint64_t q_desc = descriptor(q_tile + wg * kWgRows * kRowBytes, 0, 1024);
  float o[32], s[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) o[i] = 0.0f;
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};
  const int row_a = wg_row0 + warp * 16 + g;  // this thread's rows: row_a and row_a + 8

  for (int nb = 0; nb < n_blocks; ++nb) {
    const int cur = nb & 1;
    if (nb + 1 < n_blocks) {
      load_swizzled(k_tile + (cur ^ 1) * kKVBytes, kg, (nb + 1) * kBN, kBN, T, ld);
      load_swizzled(v_tile + (cur ^ 1) * kKVBytes, vg, (nb + 1) * kBN, kBN, T, ld);
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
      // S = Q·Kᵀ over the head dim in 4 steps of 16 (32 bytes along the swizzled row).
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kHd / 16; ++kk)
        wgmma_ss(s, q_desc + 2 * kk, descriptor(kt + 32 * kk, 0, 1024), kk);
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
        o[i] *= alpha[r];
      }
      // O += P·V over the 64 keys in 4 steps of 16 (16 rows of 128 bytes each).
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
      for (int ks = 0; ks < 4; ++ks) wgmma_rs_tb(o, pa[ks], descriptor(vt + ks * 16 * kRowBytes, 1024, 1024));
      wgmma_commit();
      wgmma_wait_all();
      pin(o);
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
    bf16* dst = out + (static_cast<size_t>(b) * T + q) * C + h * kHd;
#pragma unroll
    for (int j = 0; j < 8; ++j)
      *reinterpret_cast<__nv_bfloat162*>(dst + 8 * j + 2 * t4) =
          __floats2bfloat162_rn(o[4 * j + 2 * r] * inv, o[4 * j + 2 * r + 1] * inv);
  }
#endif  // SPILLWAY_WGMMA_BODY
}

}  // namespace

bool attention_wgmma_built() {
#ifdef SPILLWAY_WGMMA_BODY
  return true;
#else
  return false;
#endif
}

cudaError_t launch_attention_forward_wgmma64(bf16* out, float* lse, const bf16* qkv, int B, int T, int C, int NH,
                                             int KVH, cudaStream_t stream) {
  if (C / NH != kHd || !aligned16(qkv) || !aligned16(out)) return cudaErrorInvalidValue;
  if (B == 0 || T == 0) return cudaSuccess;
  auto kernel = KVH == NH ? attention_forward_wgmma64<false> : attention_forward_wgmma64<true>;
  cudaError_t e =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kSmemBytes));
  if (e != cudaSuccess) return e;
  const float scale_log2 = kLog2e / sqrtf(static_cast<float>(kHd));
  dim3 grid(ceil_div(T, kBM), B * NH);
  kernel<<<grid, kThreads, kSmemBytes, stream>>>(out, lse, qkv, T, C, NH, KVH, scale_log2);
  return cudaGetLastError();
}

}  // namespace spillway::cuda_detail
