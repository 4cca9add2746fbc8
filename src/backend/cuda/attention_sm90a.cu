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
#include <cuda.h>
#include <cudaTypedefs.h>

#include <cmath>

#include "backend/cuda/attention.cuh"
#include "backend/cuda/attention_ptx.cuh"

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
using namespace attention_ptx;  // smem_addr, cp_async16, cp_async_commit/wait, pack_bf16, kLog2e, kLn2

#ifdef SPILLWAY_WGMMA_BODY

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

#define SPILLWAY_D64_LIST \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define SPILLWAY_D64_OUT(d) \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
  "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
  "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
  "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
  "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
  "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
  "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])

// d (+)= A·B, m64n64k16, A and B from shared memory (both K-major); accumulate when
// `accumulate` is nonzero, else overwrite.
__device__ __forceinline__ void wgmma_ss(float (&d)[32], uint64_t a, uint64_t b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " SPILLWAY_D32 ", %32, %33, p, 1, 1, 0, 0;\n}\n"
      : SPILLWAY_D32_OUT(d)
      : "l"(a), "l"(b), "r"(accumulate));
}

// The same, m64n128k16: d is a 64×128 accumulator (the fragment layout above with j
// up to 15), B a K-major tile of 128 rows. Used only with ForwardKeys<HD> of 128.
[[maybe_unused]] __device__ __forceinline__ void wgmma_ss(float (&d)[64], uint64_t a, uint64_t b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" SPILLWAY_D64_LIST "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
      : SPILLWAY_D64_OUT(d)
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

// d (+)= A·B, m64n64k16, A from registers (a[4], the m16n8k16 A layout per warp), B from
// shared memory K-major; accumulate when `accumulate` is nonzero, else overwrite. Used
// only with -DSPILLWAY_ATTENTION_FORWARD_Q_REGISTERS.
[[maybe_unused]] __device__ __forceinline__ void wgmma_rs(float (&d)[32], const uint32_t (&a)[4], uint64_t b,
                                                          int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " SPILLWAY_D32 ", {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
      : SPILLWAY_D32_OUT(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
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
#undef SPILLWAY_D64_LIST
#undef SPILLWAY_D64_OUT

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// d (+)= A·Bᵀ over the head dim with B the first N rows (N = 2 × d's length) of a tile of
// b_rows rows, [rows][HD] in column blocks (K-major): 32 bytes along a 128-byte row per
// step of 16, then the tail block's 32-byte rows. issue(step, b, accumulate) issues the
// product of step `step` (columns 16·step .. +15; the tail's is step 4·main) with B's
// descriptor b. Fenced, committed and waited for.
template <int HD, int ND, class Issue>
__device__ __forceinline__ void product_bt(float (&d)[ND], uint32_t b_tile, int b_rows, Issue&& issue) {
  using L = Cols<HD>;
  wgmma_fence();
#pragma unroll
  for (int c = 0; c < L::main; ++c)
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
      issue(4 * c + kk, descriptor(b_tile + c * b_rows * 128 + 32 * kk, 0, 1024, kSwizzle128), c + kk);
  if constexpr (L::tail != 0) issue(4 * L::main, descriptor(b_tile + L::main * b_rows * 128, 0, 256, kSwizzle32), 1);
  wgmma_commit();
  wgmma_wait_all();
  pin(d);
}

// d = A·Bᵀ (m64nN, N = 2 × d's length: 64 or 128): A is rows a_row0 .. a_row0+63 of a
// tile of a_rows rows, B the first N rows of a tile of b_rows rows, both [rows][HD] in
// column blocks, read from shared memory.
template <int HD, int ND>
__device__ __forceinline__ void product_abt(float (&d)[ND], uint32_t a_tile, int a_rows, int a_row0, uint32_t b_tile,
                                            int b_rows = 64) {
  using L = Cols<HD>;
  product_bt<HD>(d, b_tile, b_rows, [&](int step, uint64_t b, int accumulate) {
    const int c = step / 4, kk = step % 4;
    const uint64_t a = c < L::main
                           ? descriptor(a_tile + c * a_rows * 128 + a_row0 * 128 + 32 * kk, 0, 1024, kSwizzle128)
                           : descriptor(a_tile + L::main * a_rows * 128 + a_row0 * 32, 0, 256, kSwizzle32);
    wgmma_ss(d, a, b, accumulate);
  });
}

[[maybe_unused]] __device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// A warpgroup's rows a_row0 .. a_row0+63 of a Q tile of a_rows rows (column blocks as
// above) as the A operands of products over the head dim, in registers: qa[s] holds
// columns 16s .. 16s+15 (at head dim 80 the tail block's 16 columns are the last),
// read with ldmatrix through the tile's swizzles. Lane l addresses row l % 8 of 8×8
// matrix l / 8: rows +8 for matrices 1 and 3, the second 16-byte chunk for 2 and 3,
// which gives the m16n8k16 A layout (a0: rows g, columns 2t; a1: rows g + 8; a2 and
// a3 the same 8 columns on).
template <int HD>
__device__ __forceinline__ void load_q_fragments(uint32_t (&qa)[HD / 16][4], uint32_t q_tile, int a_rows, int a_row0) {
  using L = Cols<HD>;
  const int lane = static_cast<int>(threadIdx.x % 32), warp = static_cast<int>(threadIdx.x / 32 % 4);
  const int row = a_row0 + warp * 16 + (lane / 8 % 2) * 8 + lane % 8, hi = lane / 16;
#pragma unroll
  for (int c = 0; c < L::main; ++c)
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
      ldmatrix_x4(qa[4 * c + kk], q_tile + c * a_rows * 128 + row * 128 + (((2 * kk + hi) ^ (row & 7)) << 4));
  if constexpr (L::tail != 0)
    ldmatrix_x4(qa[4 * L::main], q_tile + L::main * a_rows * 128 + row * 32 + ((hi ^ ((row >> 2) & 1)) << 4));
}

// d = Q·Bᵀ over the head dim (m64n64) as product_abt computes it, with Q's fragments in
// registers (load_q_fragments) instead of read from shared memory by every product:
// half the shared-memory reads of S = Q·Kᵀ.
template <int HD>
__device__ __forceinline__ void product_qbt(float (&d)[32], const uint32_t (&qa)[HD / 16][4], uint32_t b_tile,
                                            int b_rows) {
  product_bt<HD>(d, b_tile, b_rows, [&](int step, uint64_t b, int accumulate) { wgmma_rs(d, qa[step], b, accumulate); });
}

// o += P·B (m64 × HD): P the 64×16KS A operand in registers (pa[ks]: columns 16ks ..
// 16ks+15), B rows b_row0 .. b_row0+16KS-1 of a tile of b_rows rows, [rows][HD] in
// column blocks, read N-major (transposed): 16 rows of a block per step. Issued,
// committed and waited for.
template <int HD, int KS>
__device__ __forceinline__ void product_pb(float (&o)[Cols<HD>::main][32], float (&o_tail)[Cols<HD>::tail ? 8 : 1],
                                           const uint32_t (&pa)[KS][4], uint32_t b_tile, int b_rows, int b_row0) {
  using L = Cols<HD>;
  wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < KS; ++ks) {
#pragma unroll
    for (int c = 0; c < L::main; ++c)
      wgmma_rs_tb(o[c], pa[ks],
                  descriptor(b_tile + c * b_rows * 128 + (b_row0 + 16 * ks) * 128, 1024, 1024, kSwizzle128));
    if constexpr (L::tail != 0)
      wgmma_rs_tb16(o_tail, pa[ks],
                    descriptor(b_tile + L::main * b_rows * 128 + (b_row0 + 16 * ks) * 32, 256, 256, kSwizzle32));
  }
  wgmma_commit();
  wgmma_wait_all();
#pragma unroll
  for (int c = 0; c < L::main; ++c) pin(o[c]);
  pin(o_tail);
}

// The A operand of a product over 16KS columns from a 64×16KS accumulator.
template <int KS>
__device__ __forceinline__ void to_a(uint32_t (&pa)[KS][4], const float (&s)[8 * KS]) {
#pragma unroll
  for (int ks = 0; ks < KS; ++ks) {
    pa[ks][0] = pack_bf16(s[8 * ks + 0], s[8 * ks + 1]);
    pa[ks][1] = pack_bf16(s[8 * ks + 2], s[8 * ks + 3]);
    pa[ks][2] = pack_bf16(s[8 * ks + 4], s[8 * ks + 5]);
    pa[ks][3] = pack_bf16(s[8 * ks + 6], s[8 * ks + 7]);
  }
}

// Stores row `row` (this thread's half of it: columns 8j + 2t, +1 of every block) of
// a m64 × HD accumulator, times `mul`, as bf16 at dst[0 .. HD-1]; r picks the thread's
// first (0) or second (1) row.
template <int HD>
__device__ __forceinline__ void store_row(bf16* dst, const float (&o)[Cols<HD>::main][32],
                                          const float (&o_tail)[Cols<HD>::tail ? 8 : 1], int r, int t4, float mul) {
  using L = Cols<HD>;
#pragma unroll
  for (int c = 0; c < L::main; ++c)
#pragma unroll
    for (int j = 0; j < 8; ++j)
      *reinterpret_cast<__nv_bfloat162*>(dst + 64 * c + 8 * j + 2 * t4) =
          __floats2bfloat162_rn(o[c][4 * j + 2 * r] * mul, o[c][4 * j + 2 * r + 1] * mul);
  if constexpr (L::tail != 0) {
#pragma unroll
    for (int j = 0; j < 2; ++j)
      *reinterpret_cast<__nv_bfloat162*>(dst + 64 * L::main + 8 * j + 2 * t4) =
          __floats2bfloat162_rn(o_tail[4 * j + 2 * r] * mul, o_tail[4 * j + 2 * r + 1] * mul);
  }
}

template <int HD>
__device__ __forceinline__ void zero(float (&o)[Cols<HD>::main][32], float (&o_tail)[Cols<HD>::tail ? 8 : 1]) {
#pragma unroll
  for (int c = 0; c < Cols<HD>::main; ++c)
#pragma unroll
    for (int i = 0; i < 32; ++i) o[c][i] = 0.0f;
#pragma unroll
  for (int i = 0; i < (Cols<HD>::tail ? 8 : 1); ++i) o_tail[i] = 0.0f;
}

// The query block a thread of the forward or dQ kernel works on (grid (ceil(T/kBM),
// B·NH), longest rows first) and its place in it, over key blocks of KB keys.
struct QueryBlock {
  int m0;        // first query row of the block
  int bh, b, h;  // (batch, head) = blockIdx.y
  int wg, warp, g, t4;  // warpgroup, warp in it, lane / 4, lane % 4
  int wg_row0;   // this warpgroup's first query row
  int n_blocks;  // key blocks the block needs (causal)
  int wg_last;   // the last key block this warpgroup needs
};

template <int KB = kBN>
__device__ __forceinline__ QueryBlock query_block(int T, int NH) {
  QueryBlock qb;
  qb.m0 = (gridDim.x - 1 - blockIdx.x) * kBM;
  qb.bh = blockIdx.y;
  qb.b = qb.bh / NH;
  qb.h = qb.bh % NH;
  qb.wg = threadIdx.x >> 7;
  qb.warp = (threadIdx.x >> 5) & 3;
  qb.g = (threadIdx.x & 31) >> 2;
  qb.t4 = threadIdx.x & 3;
  qb.wg_row0 = qb.m0 + qb.wg * kWgRows;
  qb.n_blocks = min((T + KB - 1) / KB, (qb.m0 + kBM - 1) / KB + 1);
  qb.wg_last = min(qb.n_blocks - 1, (qb.wg_row0 + kWgRows - 1) / KB);
  return qb;
}

// Key block nb of a query block's loop over n_blocks (K and V double-buffered at
// k_tile/v_tile + (nb % 2)·bytes): starts the loads of block nb + 1 into the other
// buffers, waits for block nb's, and makes them visible to the tensor cores (written
// through the generic proxy, read through the async one) and to every thread.
template <int HD>
__device__ __forceinline__ void next_kv_block(uint32_t k_tile, uint32_t v_tile, const bf16* kg, const bf16* vg,
                                              int nb, int n_blocks, int T, size_t ld) {
  constexpr int kKVBytes = Cols<HD>::bytes(kBN);
  const int other = (nb & 1) ^ 1;
  double_buffer_step<true>(nb + 1 < n_blocks, [&] {
    load_swizzled<HD>(k_tile + other * kKVBytes, kg, (nb + 1) * kBN, kBN, T, ld);
    load_swizzled<HD>(v_tile + other * kKVBytes, vg, (nb + 1) * kBN, kBN, T, ld);
  });
}

// N keys (64 or 128) of the forward for one warpgroup, once S = Q·Kᵀ is in s (its 64
// query rows from wg_row0; this thread's are row_a and row_a + 8): the causal mask and
// the one past T, the online softmax (row_max in log2 units, row_sum) and O += P·V. vt:
// the block's V tile (kv_rows rows, N ≤ kv_rows of them used); key0: the first key's
// index.
template <int HD, int N>
__device__ __forceinline__ void forward_softmax_pv(float (&o)[Cols<HD>::main][32],
                                                   float (&o_tail)[Cols<HD>::tail ? 8 : 1], float (&row_max)[2],
                                                   float (&row_sum)[2], float (&s)[N / 2], int wg_row0, int row_a,
                                                   int t4, uint32_t vt, int kv_rows, int key0, int T,
                                                   float scale_log2) {
  static_assert(N == 64 || N == 128, "the forward's key blocks are 64 or 128 keys");
  constexpr int kMain = Cols<HD>::main, kTail = Cols<HD>::tail, kS = N / 2;
  // Mask keys past a row (only the diagonal block) or past T.
  if (key0 + N - 1 > wg_row0 || key0 + N > T) {
#pragma unroll
    for (int j = 0; j < N / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = key0 + j * 8 + t4 * 2 + (e & 1);
        const int q = row_a + (e >> 1) * 8;
        if (key > q || key >= T) s[4 * j + e] = -INFINITY;
      }
  }
  float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int i = 0; i < kS; ++i) mx[(i >> 1) & 1] = fmaxf(mx[(i >> 1) & 1], s[i]);
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
  for (int i = 0; i < kS; ++i) {
    const int r = (i >> 1) & 1;
    const float p = fast_exp2(fmaf(s[i], scale_log2, neg_m[r]));
    s[i] = p;
    row_sum[r] += p;
  }
#pragma unroll
  for (int i = 0; i < 32; ++i)
#pragma unroll
    for (int c = 0; c < kMain; ++c) o[c][i] *= alpha[(i >> 1) & 1];
  if constexpr (kTail != 0) {
#pragma unroll
    for (int i = 0; i < 8; ++i) o_tail[i] *= alpha[(i >> 1) & 1];
  }
  uint32_t pa[N / 16][4];
  to_a(pa, s);
  product_pb<HD>(o, o_tail, pa, vt, kv_rows, 0);  // O += P·V
}

// The same from the start: S = Q·Kᵀ with Q read from its tile (the warpgroup's rows of
// q_tile) and the block's K tile kt, then forward_softmax_pv. Shared by the cp.async and
// the TMA forward.
template <int HD, int N = kBN>
__device__ __forceinline__ void forward_key_block(float (&o)[Cols<HD>::main][32],
                                                  float (&o_tail)[Cols<HD>::tail ? 8 : 1], float (&row_max)[2],
                                                  float (&row_sum)[2], uint32_t q_tile, int wg, int wg_row0,
                                                  int row_a, int t4, uint32_t kt, uint32_t vt, int kv_rows,
                                                  int key0, int T, float scale_log2) {
  float s[N / 2];
  product_abt<HD>(s, q_tile, kBM, wg * kWgRows, kt, kv_rows);  // S = Q·Kᵀ
  forward_softmax_pv<HD, N>(o, o_tail, row_max, row_sum, s, wg_row0, row_a, t4, vt, kv_rows, key0, T, scale_log2);
}

// One key block of the dQ kernels for one warpgroup: S = Q·Kᵀ and dP = dO·Vᵀ for its
// 64 query rows (from wg_row0; this thread's are row_a and row_a + 8, with lse2 in log2
// units and D), P, dS = P ∘ (dP − D), dQ += dS·K. kt and vt: the block's K and V tiles;
// nb: its index. Waits for its products. Shared by the cp.async and TMA dQ kernels.
template <int HD>
__device__ __forceinline__ void dq_key_block(float (&dq)[Cols<HD>::main][32], float (&dq_tail)[Cols<HD>::tail ? 8 : 1],
                                             uint32_t q_tile, uint32_t do_tile, int wg, int wg_row0, int row_a,
                                             int t4, const float (&lse2)[2], const float (&Dr)[2], uint32_t kt,
                                             uint32_t vt, int nb, int T, float scale_log2) {
  float s[32], dp[32];
  product_abt<HD>(s, q_tile, kBM, wg * kWgRows, kt);    // S = Q·Kᵀ
  product_abt<HD>(dp, do_tile, kBM, wg * kWgRows, vt);  // dP = dO·Vᵀ
  const bool need_mask = nb * kBN + kBN - 1 > wg_row0 || nb * kBN + kBN > T;
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = 4 * j + e, r = e >> 1;
      const int key = nb * kBN + 8 * j + 2 * t4 + (e & 1);
      float p = fast_exp2(fmaf(s[i], scale_log2, -lse2[r]));
      if (need_mask && (key > row_a + 8 * r || key >= T)) p = 0.0f;
      dp[i] = p * (dp[i] - Dr[r]);
    }
  uint32_t sa[4][4];
  to_a(sa, dp);
  product_pb<HD>(dq, dq_tail, sa, kt, kBN, 0);  // dQ += dS·K
}

// One query block of the dK/dV kernels for one warpgroup: Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ
// for its 64 keys (from wg_key0; this thread's are key_a and key_a + 8), Pᵀ with the
// block's lse (Lc, log2 units) and D (Dc), dSᵀ, then dV += Pᵀ·dO and dK += dSᵀ·Q. qt
// and dot: the block's Q and dO tiles; mb: its index. Waits for its products. Shared by
// the cp.async and TMA dK/dV kernels.
template <int HD>
__device__ __forceinline__ void dkv_query_block(float (&dk)[Cols<HD>::main][32],
                                                float (&dk_tail)[Cols<HD>::tail ? 8 : 1],
                                                float (&dv)[Cols<HD>::main][32],
                                                float (&dv_tail)[Cols<HD>::tail ? 8 : 1], uint32_t k_tile,
                                                uint32_t v_tile, int wg, int wg_key0, int key_a, int t4,
                                                const float* Lc, const float* Dc, uint32_t qt, uint32_t dot, int mb,
                                                float scale_log2) {
  constexpr int kKeys = kBM, kQ = kBN;
  float st[32], dpt[32];
  product_abt<HD>(st, k_tile, kKeys, wg * kWgRows, qt);    // Sᵀ = K·Qᵀ
  product_abt<HD>(dpt, v_tile, kKeys, wg * kWgRows, dot);  // dPᵀ = V·dOᵀ
  const bool need_mask = wg_key0 + kWgRows - 1 > mb * kQ;  // a key can pass a query
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = 4 * j + e, qi = 8 * j + 2 * t4 + (e & 1);
      float p = fast_exp2(fmaf(st[i], scale_log2, -Lc[qi]));
      if (need_mask && key_a + (e >> 1) * 8 > mb * kQ + qi) p = 0.0f;
      st[i] = p;
      dpt[i] = p * (dpt[i] - Dc[qi]);
    }
  uint32_t pa[4][4];
  to_a(pa, st);
  product_pb<HD>(dv, dv_tail, pa, dot, kQ, 0);  // dV += Pᵀ·dO
  to_a(pa, dpt);
  product_pb<HD>(dk, dk_tail, pa, qt, kQ, 0);  // dK += dSᵀ·Q
}

// The end of the forward for this thread's two rows (row_a, row_a + 8) of query block
// qb: the row sums over the quad, lse[B,NH,T] (natural log) and out[B,T,C] = O / sum.
// Shared by the cp.async and the TMA forward.
template <int HD>
__device__ __forceinline__ void forward_finish(bf16* out, float* lse, const float (&o)[Cols<HD>::main][32],
                                               const float (&o_tail)[Cols<HD>::tail ? 8 : 1],
                                               const float (&row_max)[2], const float (&row_sum)[2], int row_a,
                                               int t4, int T, int C, const QueryBlock& qb) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int q = row_a + r * 8;
    float l = row_sum[r];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    if (q >= T) continue;
    const float inv = 1.0f / l;
    if (t4 == 0) lse[static_cast<size_t>(qb.bh) * T + q] = row_max[r] * kLn2 + logf(l);
    store_row<HD>(out + (static_cast<size_t>(qb.b) * T + q) * C + qb.h * HD, o, o_tail, r, t4, inv);
  }
}

// The end of the dK/dV kernels for this thread's two keys (key_a, key_a + 8) of batch
// b: dK·scale at column k_col of each key's row of dqkv (ld elements a row; the key/value
// head's K columns), dV v_off columns after it. Shared by the cp.async and the TMA kernel.
template <int HD>
__device__ __forceinline__ void dkv_finish(bf16* dqkv, const float (&dk)[Cols<HD>::main][32],
                                           const float (&dk_tail)[Cols<HD>::tail ? 8 : 1],
                                           const float (&dv)[Cols<HD>::main][32],
                                           const float (&dv_tail)[Cols<HD>::tail ? 8 : 1], int key_a, int t4, int T,
                                           int b, size_t ld, int k_col, int v_off, float scale) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int key = key_a + r * 8;
    if (key >= T) continue;
    bf16* dst = dqkv + (static_cast<size_t>(b) * T + key) * ld + k_col;
    store_row<HD>(dst, dk, dk_tail, r, t4, scale);
    store_row<HD>(dst + v_off, dv, dv_tail, r, t4, 1.0f);
  }
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
  const uint32_t base = (smem_addr(smem_raw) + 1023u) & ~1023u;
  const uint32_t q_tile = base, k_tile = base + kQBytes, v_tile = k_tile + 2 * kKVBytes;

  const QueryBlock qb = query_block(T, NH);
  const int m0 = qb.m0, wg = qb.wg, warp = qb.warp, g = qb.g, t4 = qb.t4;
  const int wg_row0 = qb.wg_row0, n_blocks = qb.n_blocks, wg_last = qb.wg_last;
  const HeadView hv =
      head_view<HD, kGrouped>(qkv, nullptr, nullptr, nullptr, qb.b, qb.h, qb.h / (NH / KVH), T, C, NH, KVH);
  const size_t ld = hv.ld;
  const bf16 *qg = hv.q, *kg = hv.k, *vg = hv.v;

  load_swizzled<HD>(q_tile, qg, m0, kBM, T, ld);
  load_swizzled<HD>(k_tile, kg, 0, kBN, T, ld);
  load_swizzled<HD>(v_tile, vg, 0, kBN, T, ld);
  cp_async_commit();

  float o[kMain][32], o_tail[kTail ? 8 : 1];
  zero<HD>(o, o_tail);
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};
  const int row_a = wg_row0 + warp * 16 + g;  // this thread's rows: row_a and row_a + 8

  for (int nb = 0; nb < n_blocks; ++nb) {
    const int cur = nb & 1;
    next_kv_block<HD>(k_tile, v_tile, kg, vg, nb, n_blocks, T, ld);

    if (nb <= wg_last) {  // uniform over the warpgroup
      const uint32_t kt = k_tile + cur * kKVBytes, vt = v_tile + cur * kKVBytes;
      forward_key_block<HD>(o, o_tail, row_max, row_sum, q_tile, wg, wg_row0, row_a, t4, kt, vt, kBN, nb * kBN, T,
                            scale_log2);
    }
    __syncthreads();  // this buffer is refilled in the next iteration
  }

  forward_finish<HD>(out, lse, o, o_tail, row_max, row_sum, row_a, t4, T, C, qb);
#endif  // SPILLWAY_WGMMA_BODY
}

// ---- the forward with a producer warp: TMA loads, mbarriers, no block-wide sync ----
//
// Block: the two consumer warpgroups of attention_forward_wgmma (query rows m0 + 64w
// .. +63) and one producer warp (threads 256 .. 287). The producer's lane 0 loads the
// Q tile once and the K and V tiles of each key block into a ring of kStages stages
// with the Tensor Memory Accelerator (cp.async.bulk.tensor, 128-byte swizzle: the
// layout the tensor cores read, as load_swizzled writes it), each stage's arrival
// counted by its `full` mbarrier (transaction bytes). A consumer waits on `full` for
// every key block, computes as attention_forward_wgmma does when the block has keys
// its rows need, and arrives on the stage's `empty` mbarrier (all 256 consumer
// threads) once its products have read the stage; the producer waits on `empty`
// before it refills. So no consumer waits for the other warpgroup, and no consumer
// thread computes a load address. Head dims 64, 80 and 128: the 16-column tail block of
// head dim 80 comes through tensor maps of its own, boxes of 16 columns (32 bytes) in
// the 32-byte swizzle, as load_swizzled lays it out.

#ifdef SPILLWAY_WGMMA_BODY
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Waits until the phase of the given parity has completed.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}
// A box of the 3-D tensor map (columns, tokens, batch) into shared memory at `dst`,
// its bytes counted on `bar`. Coordinates out of range read as zero.
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap* map, int c0, int c1, int c2,
                                            uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
      "[%5];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
}

// The mbarriers of a producer warp and its consumers, at `bars` in shared memory:
// `once` (tiles loaded once per block), then full[kStages] and empty[kStages] of a ring
// of stages. Item i of the stream goes to stage i % kStages; its `full` counts the
// producer's arrival and the TMA bytes, its `empty` the consumers' arrivals.
struct TmaRing {
  uint32_t bars;
  __device__ uint32_t once() const { return bars; }
  __device__ uint32_t full(int i) const;
  __device__ uint32_t empty(int i) const;
  // One thread, before the block's __syncthreads: every barrier, `consumers` arrivals
  // completing a phase of `empty`.
  __device__ void init(uint32_t consumers) const;
  // The producer, before it fills item i: waits until the consumers have released item
  // i - kStages of the same stage.
  __device__ void acquire(int i) const;
  // A consumer: waits for item i; then, once nothing reads its stage any more, releases it.
  __device__ void wait_full(int i) const;
  __device__ void release(int i) const;
};
#endif  // SPILLWAY_WGMMA_BODY

constexpr int kStages = 2;                      // stages in a TMA ring
#ifdef SPILLWAY_WGMMA_BODY
__device__ uint32_t TmaRing::full(int i) const { return bars + 8u * (1 + i % kStages); }
__device__ uint32_t TmaRing::empty(int i) const { return bars + 8u * (1 + kStages + i % kStages); }
__device__ void TmaRing::init(uint32_t consumers) const {
  mbar_init(once(), 1);
#pragma unroll
  for (int st = 0; st < kStages; ++st) {
    mbar_init(full(st), 1);
    mbar_init(empty(st), consumers);
  }
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ void TmaRing::acquire(int i) const {
  if (i >= kStages) mbar_wait(empty(i), ((i / kStages) + 1) & 1);
}
__device__ void TmaRing::wait_full(int i) const { mbar_wait(full(i), (i / kStages) & 1); }
__device__ void TmaRing::release(int i) const { mbar_arrive(empty(i)); }

// One head's tile of `rows` tokens from column `col`, token row0, batch b: its 64-column
// boxes from `map` and, at head dim 80, its 16-column tail from `tail_map` (unused
// otherwise), into `dst` as load_swizzled lays the tile out; the bytes counted on `bar`.
// Every TMA producer loads its tiles through here.
template <int HD>
__device__ __forceinline__ void tma_load_tile(uint32_t dst, int rows, const CUtensorMap* map,
                                              const CUtensorMap* tail_map, int col, int row0, int b, uint32_t bar) {
  using L = Cols<HD>;
#pragma unroll
  for (int c = 0; c < L::main; ++c) tma_load_3d(dst + c * rows * 128, map, col + 64 * c, row0, b, bar);
  if constexpr (L::tail != 0) tma_load_3d(dst + L::main * rows * 128, tail_map, col + 64 * L::main, row0, b, bar);
}

// A query block's producer loop over its n_blocks key blocks: block nb's K and V tiles
// (KB tokens, columns k_col and v_col of qkv through map and tail_map, boxes of KB
// tokens) into stage nb % kStages of the ring at k_tile and v_tile, once the consumers
// have released it. The TMA forward's and the TMA dQ kernel's.
template <int HD, int KB = kBN>
__device__ __forceinline__ void produce_kv_blocks(const TmaRing& ring, uint32_t k_tile, uint32_t v_tile,
                                                  const CUtensorMap* map, const CUtensorMap* tail_map, int k_col,
                                                  int v_col, int n_blocks, int b) {
  constexpr int kKVBytes = Cols<HD>::bytes(KB);
  for (int nb = 0; nb < n_blocks; ++nb) {
    ring.acquire(nb);
    mbar_expect_tx(ring.full(nb), 2 * kKVBytes);
    const uint32_t st = static_cast<uint32_t>(nb % kStages) * kKVBytes;
    tma_load_tile<HD>(k_tile + st, KB, map, tail_map, k_col, nb * KB, b, ring.full(nb));
    tma_load_tile<HD>(v_tile + st, KB, map, tail_map, v_col, nb * KB, b, ring.full(nb));
  }
}
#endif  // SPILLWAY_WGMMA_BODY
constexpr size_t kRingBarrierBytes = (1 + 2 * kStages) * sizeof(uint64_t);
constexpr int kTmaThreads = kThreads + 32;      // two consumer warpgroups, one producer warp
template <int HD, int KB>
constexpr size_t tma_smem_bytes() {
  return static_cast<size_t>(Cols<HD>::bytes(kBM) + 2 * kStages * Cols<HD>::bytes(KB)) + 1024 +
         kRingBarrierBytes;  // Q, K/V stages, alignment, barriers
}

// The keys of the TMA forward's key blocks at a head dim: 64, or 128 at head dims 64
// and 80 with -DSPILLWAY_ATTENTION_FORWARD_WIDE_64 and _80 (S = Q·Kᵀ as one m64n128
// product per step of 16, half the online-softmax rescales and barrier rounds; a
// warpgroup whose rows end before the second half of the diagonal block takes only
// its first 64 keys).
#ifdef SPILLWAY_ATTENTION_FORWARD_WIDE_64
constexpr bool kForwardWide64 = true;
#else
constexpr bool kForwardWide64 = false;
#endif
#ifdef SPILLWAY_ATTENTION_FORWARD_WIDE_80
constexpr bool kForwardWide80 = true;
#else
constexpr bool kForwardWide80 = false;
#endif
// -DSPILLWAY_ATTENTION_FORWARD_Q_REGISTERS: the TMA forward at head dim 64 with 64-key
// blocks holds each warpgroup's Q rows in registers (16 a thread; at head dim 80 the 20
// would leave room for only one block an SM) and reads only K from shared memory for
// S = Q·Kᵀ (product_qbt): m64n64k16 products with both operands in shared memory read
// 4 KiB per 32 tensor-core cycles, the whole of an SM's shared-memory bandwidth.
#ifdef SPILLWAY_ATTENTION_FORWARD_Q_REGISTERS
constexpr bool kForwardQRegisters = true;
#else
constexpr bool kForwardQRegisters = false;
#endif
template <int HD>
struct ForwardKeys {
  static constexpr int value = (HD == 64 && kForwardWide64) || (HD == 80 && kForwardWide80) ? 128 : 64;
};

// out[B,T,C], lse[B,NH,T] (natural log) from qkv[B,T,(NH+2·KVH)·HD] through q_map
// (boxes of 64 columns × kBM tokens) and kv_map (64 columns × KB tokens), both over
// (ld columns, T tokens, B), and for head dim 80 q_tail_map and kv_tail_map (16
// columns); grid (ceil(T/kBM), B·NH), kTmaThreads threads. Grouped heads or not, the
// tensor maps' columns say where each head is.
// At head dim 80 ptxas takes 110 registers with the bound of one block, and two blocks
// of 288 threads still fit an SM at run time (a bound of two makes it spill at 93).
// With -DSPILLWAY_ATTENTION_FORWARD_Q_REGISTERS at head dim 64, 112 registers a thread
// (Q's fragments take 16 more than the 96 of the bound of two blocks, which would
// spill), as the dQ kernel below: two blocks of 288 threads still fit an SM.
template <int HD, int KB>
__global__ void
#ifdef SPILLWAY_ATTENTION_FORWARD_Q_REGISTERS
    __launch_bounds__(kTmaThreads) __maxnreg__(HD == 64 ? 112 : 224)
#else
    __launch_bounds__(kTmaThreads, HD == 64 ? 2 : 1)
#endif
    attention_forward_tma(bf16* out, float* lse, const __grid_constant__ CUtensorMap q_map,
                          const __grid_constant__ CUtensorMap kv_map, const __grid_constant__ CUtensorMap q_tail_map,
                          const __grid_constant__ CUtensorMap kv_tail_map, int T, int C, int NH, int KVH,
                          float scale_log2) {
#ifdef SPILLWAY_WGMMA_BODY
  using L = Cols<HD>;
  constexpr int kMain = L::main, kTail = L::tail;
  constexpr int kQBytes = L::bytes(kBM), kKVBytes = L::bytes(KB);
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const uint32_t base = (smem_addr(smem_raw) + 1023u) & ~1023u;
  const uint32_t q_tile = base, k_tile = base + kQBytes, v_tile = k_tile + kStages * kKVBytes;
  const TmaRing ring{v_tile + kStages * kKVBytes};  // once: Q; the ring: K and V

  const QueryBlock qb = query_block<KB>(T, NH);
  const int m0 = qb.m0, n_blocks = qb.n_blocks;
  // Columns of qkv's rows: query head h, then key/value head kvh (h itself without
  // grouping, where NH·HD = C, so K at C + h·HD and V at 2C + h·HD).
  const int kvh = qb.h / (NH / KVH);
  const int q_col = qb.h * HD, k_col = (NH + kvh) * HD, v_col = (NH + KVH + kvh) * HD;

  if (threadIdx.x == kThreads) ring.init(kThreads);
  __syncthreads();

  if (threadIdx.x >= kThreads) {  // the producer warp
    if (threadIdx.x == kThreads) {
      mbar_expect_tx(ring.once(), kQBytes);
      tma_load_tile<HD>(q_tile, kBM, &q_map, &q_tail_map, q_col, m0, qb.b, ring.once());
      produce_kv_blocks<HD, KB>(ring, k_tile, v_tile, &kv_map, &kv_tail_map, k_col, v_col, n_blocks, qb.b);
    }
    return;
  }

  const int wg = qb.wg, warp = qb.warp, g = qb.g, t4 = qb.t4;
  const int wg_row0 = qb.wg_row0, wg_last = qb.wg_last;
  float o[kMain][32], o_tail[kTail ? 8 : 1];
  zero<HD>(o, o_tail);
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};
  const int row_a = wg_row0 + warp * 16 + g;  // this thread's rows: row_a and row_a + 8
  mbar_wait(ring.once(), 0);
  constexpr bool kQRegs = kForwardQRegisters && HD == 64 && KB == 64;
  uint32_t qa[kQRegs ? HD / 16 : 1][4];
  if constexpr (kQRegs) load_q_fragments<HD>(qa, q_tile, kBM, wg * kWgRows);

  for (int nb = 0; nb < n_blocks; ++nb) {
    const int st = nb % kStages;
    ring.wait_full(nb);
    if (nb <= wg_last) {  // uniform over the warpgroup
      const uint32_t kt = k_tile + st * kKVBytes, vt = v_tile + st * kKVBytes;
      // Waits for its products: the stage is read when it returns. With 128 keys a
      // block, a warpgroup whose rows all precede the block's second half (or that half
      // lies past T) takes only the first 64 keys: the rest would be masked whole.
      const int key0 = nb * KB;
      if constexpr (kQRegs) {
        float s[32];
        product_qbt<HD>(s, qa, kt, KB);  // S = Q·Kᵀ
        forward_softmax_pv<HD, 64>(o, o_tail, row_max, row_sum, s, wg_row0, row_a, t4, vt, KB, key0, T, scale_log2);
      } else if (KB == 64 || key0 + 64 > wg_row0 + kWgRows - 1 || key0 + 64 >= T)
        forward_key_block<HD, 64>(o, o_tail, row_max, row_sum, q_tile, wg, wg_row0, row_a, t4, kt, vt, KB, key0, T,
                                  scale_log2);
      else
        forward_key_block<HD, KB>(o, o_tail, row_max, row_sum, q_tile, wg, wg_row0, row_a, t4, kt, vt, KB, key0, T,
                                  scale_log2);
    }
    ring.release(nb);
  }

  forward_finish<HD>(out, lse, o, o_tail, row_max, row_sum, row_a, t4, T, C, qb);
#endif  // SPILLWAY_WGMMA_BODY
}

// dK, dV of 128 keys per block (64 per warpgroup) of key/value head kvh:
// dqkv[B,T,(NH+2·KVH)·HD] (its k and v parts), from dout[B,T,C], qkv, lse[B,NH,T]
// and D[B,NH,T] = rowsum(dout ∘ out). grid (ceil(T/128), B·KVH), 256 threads. The
// query blocks (64 queries) of the group's query heads stream through shared memory,
// head after head, double-buffered; per block each warpgroup computes Sᵀ = K·Qᵀ and
// dPᵀ = V·dOᵀ, Pᵀ = 2^(Sᵀ·scale·log2e − lse·log2e), dSᵀ = Pᵀ ∘ (dPᵀ − D), then
// dV += Pᵀ·dO and dK += dSᵀ·Q in fp32 registers: a fixed order, no atomics.
template <int HD, bool kGrouped>
__global__ void __launch_bounds__(kThreads) attention_backward_dkv_wgmma(bf16* dqkv, const bf16* dout,
                                                                       const bf16* qkv, const float* lse,
                                                                       const float* Dg, int T, int C, int NH,
                                                                       int KVH, float scale, float scale_log2) {
#ifdef SPILLWAY_WGMMA_BODY
  using L = Cols<HD>;
  constexpr int kKeys = kBM, kQ = kBN;
  constexpr int kKBytes = L::bytes(kKeys), kQBytes = L::bytes(kQ);
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const uint32_t raw = smem_addr(smem_raw), base = (raw + 1023u) & ~1023u;
  const uint32_t k_tile = base, v_tile = base + kKBytes, q_tile = v_tile + kKBytes, do_tile = q_tile + 2 * kQBytes;
  float* Ls = reinterpret_cast<float*>(smem_raw + (do_tile + 2 * kQBytes - raw));  // [2][kQ] lse, log2 units
  float* Ds = Ls + 2 * kQ;                                                          // [2][kQ]

  const int n0 = blockIdx.x * kKeys;
  const int bg = blockIdx.y, b = bg / KVH, kvh = bg % KVH;
  const int group = kGrouped ? NH / KVH : 1, h0 = kvh * group;
  const int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
  const int g = lane >> 2, t4 = lane & 3;
  const HeadView hv = head_view<HD, kGrouped>(qkv, dout, lse, Dg, b, h0, kvh, T, C, NH, KVH);  // query head h0
  const size_t ld = hv.ld;
  const bf16 *qg = hv.q, *kg = hv.k, *vg = hv.v, *dog = hv.dout;
  const float *lse_bh = hv.lse, *D_bh = hv.D;
  const int wg_key0 = n0 + wg * kWgRows;  // this warpgroup's first key

  // Iteration it covers query block mb_first + it % n_mb of query head h0 + it / n_mb.
  const int mb_first = n0 / kQ, n_mb = (T + kQ - 1) / kQ - mb_first;
  auto load_q_block = [&](int it, int buf) {
    const int hh = kGrouped ? it / n_mb : 0, mb = mb_first + (kGrouped ? it % n_mb : it);
    load_swizzled<HD>(q_tile + buf * kQBytes, qg + hh * HD, mb * kQ, kQ, T, ld);
    load_swizzled<HD>(do_tile + buf * kQBytes, dog + hh * HD, mb * kQ, kQ, T, C);
    const float* lse_h = lse_bh + static_cast<size_t>(hh) * T;
    const float* D_h = D_bh + static_cast<size_t>(hh) * T;
    for (int i = threadIdx.x; i < kQ; i += kThreads) {
      const int q = mb * kQ + i;
      Ls[buf * kQ + i] = q < T ? lse_h[q] * kLog2e : INFINITY;
      Ds[buf * kQ + i] = q < T ? D_h[q] : 0.0f;
    }
  };
  load_swizzled<HD>(k_tile, kg, n0, kKeys, T, ld);
  load_swizzled<HD>(v_tile, vg, n0, kKeys, T, ld);
  load_q_block(0, 0);
  cp_async_commit();

  float dk[L::main][32], dk_tail[L::tail ? 8 : 1], dv[L::main][32], dv_tail[L::tail ? 8 : 1];
  zero<HD>(dk, dk_tail);
  zero<HD>(dv, dv_tail);
  const int key_a = wg_key0 + warp * 16 + g;  // this thread's keys: key_a and key_a + 8

  const int n_it = group * n_mb;
  for (int it = 0; it < n_it; ++it) {
    const int mb = mb_first + (kGrouped ? it % n_mb : it), cur = it & 1;
    double_buffer_step<true>(it + 1 < n_it, [&] { load_q_block(it + 1, cur ^ 1); });

    if (mb * kQ + kQ - 1 >= wg_key0) {  // some query of the block sees a key of this warpgroup
      const uint32_t qt = q_tile + cur * kQBytes, dot = do_tile + cur * kQBytes;
      dkv_query_block<HD>(dk, dk_tail, dv, dv_tail, k_tile, v_tile, wg, wg_key0, key_a, t4, Ls + cur * kQ,
                          Ds + cur * kQ, qt, dot, mb, scale_log2);
    }
    __syncthreads();  // this buffer is refilled in the next iteration
  }

  dkv_finish<HD>(dqkv, dk, dk_tail, dv, dv_tail, key_a, t4, T, b, ld, (NH + kvh) * HD, kGrouped ? KVH * HD : C,
                 scale);
#endif  // SPILLWAY_WGMMA_BODY
}

// dQ of 128 queries per block (64 per warpgroup): dqkv[B,T,(NH+2·KVH)·HD] (its q
// part) from dout, qkv, lse and D as above. grid (ceil(T/128), B·NH), 256 threads;
// the key blocks of key/value head h/(NH/KVH) stream through shared memory
// (double-buffered): S = Q·Kᵀ, dP = dO·Vᵀ, P, dS = P ∘ (dP − D), dQ += dS·K.
template <int HD, bool kGrouped>
__global__ void __launch_bounds__(kThreads) attention_backward_dq_wgmma(bf16* dqkv, const bf16* dout,
                                                                      const bf16* qkv, const float* lse,
                                                                      const float* Dg, int T, int C, int NH,
                                                                      int KVH, float scale, float scale_log2) {
#ifdef SPILLWAY_WGMMA_BODY
  using L = Cols<HD>;
  constexpr int kQBytes = L::bytes(kBM), kKVBytes = L::bytes(kBN);
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const uint32_t base = (smem_addr(smem_raw) + 1023u) & ~1023u;
  const uint32_t q_tile = base, do_tile = base + kQBytes, k_tile = do_tile + kQBytes,
                 v_tile = k_tile + 2 * kKVBytes;

  const QueryBlock qb = query_block(T, NH);
  const int m0 = qb.m0, wg = qb.wg, warp = qb.warp, g = qb.g, t4 = qb.t4;
  const int wg_row0 = qb.wg_row0, n_blocks = qb.n_blocks, wg_last = qb.wg_last;
  const HeadView hv = head_view<HD, kGrouped>(qkv, dout, lse, Dg, qb.b, qb.h, qb.h / (NH / KVH), T, C, NH, KVH);
  const size_t ld = hv.ld;
  const bf16 *qg = hv.q, *kg = hv.k, *vg = hv.v, *dog = hv.dout;

  load_swizzled<HD>(q_tile, qg, m0, kBM, T, ld);
  load_swizzled<HD>(do_tile, dog, m0, kBM, T, C);
  load_swizzled<HD>(k_tile, kg, 0, kBN, T, ld);
  load_swizzled<HD>(v_tile, vg, 0, kBN, T, ld);
  cp_async_commit();

  const int row_a = wg_row0 + warp * 16 + g;  // this thread's rows: row_a and row_a + 8
  float lse2[2], Dr[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int q = row_a + 8 * r;
    lse2[r] = q < T ? hv.lse[q] * kLog2e : INFINITY;
    Dr[r] = q < T ? hv.D[q] : 0.0f;
  }
  float dq[L::main][32], dq_tail[L::tail ? 8 : 1];
  zero<HD>(dq, dq_tail);

  for (int nb = 0; nb < n_blocks; ++nb) {
    const int cur = nb & 1;
    next_kv_block<HD>(k_tile, v_tile, kg, vg, nb, n_blocks, T, ld);

    if (nb <= wg_last) {
      const uint32_t kt = k_tile + cur * kKVBytes, vt = v_tile + cur * kKVBytes;
      dq_key_block<HD>(dq, dq_tail, q_tile, do_tile, wg, wg_row0, row_a, t4, lse2, Dr, kt, vt, nb, T, scale_log2);
    }
    __syncthreads();
  }

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int q = row_a + r * 8;
    if (q >= T) continue;
    store_row<HD>(dqkv + (static_cast<size_t>(qb.b) * T + q) * ld + qb.h * HD, dq, dq_tail, r, t4, scale);
  }
#endif  // SPILLWAY_WGMMA_BODY
}

// ---- the backward with a producer warp (head dims 64 and 80) ----
//
// The dK/dV and dQ kernels above with their loads by TMA under a TmaRing, as the
// forward's: a producer warp loads the tiles each block keeps (K and V; Q and dO) once
// and streams the others (Q, dO and their lse and D; K and V) through kStages stages;
// the consumer warpgroups compute exactly as above and synchronize only through the
// ring's barriers. Head dims 64 and 80 (gpt-2.7b's), whose 16-column tail comes
// through the 32-byte-swizzled tail maps as in the forward; not 128: there the
// producer warp's registers push the kernels into spilling (dK/dV: 224 a thread at
// one block of 288 per SM).

template <int HD>
constexpr size_t tma_dkv_smem_bytes() {
  return static_cast<size_t>(2 * Cols<HD>::bytes(kBM) + 2 * kStages * Cols<HD>::bytes(kBN)) +
         2 * kStages * kBN * sizeof(float) + 1024 + kRingBarrierBytes;  // K, V, Q/dO stages, lse/D, barriers
}
template <int HD>
constexpr size_t tma_dq_smem_bytes() {
  return static_cast<size_t>(2 * Cols<HD>::bytes(kBM) + 2 * kStages * Cols<HD>::bytes(kBN)) + 1024 +
         kRingBarrierBytes;  // Q, dO, K/V stages, alignment, barriers
}

// dK, dV as attention_backward_dkv_wgmma. qkv128 and qkv64: tensor maps over qkv with
// boxes of kBM and kBN tokens; dout64: over dout (ld = C), boxes of kBN tokens; the
// *_tail maps: the same boxes of head dim 80's 16-column tail (unused at 64).
template <int HD, bool kGrouped>
__global__ void __launch_bounds__(kTmaThreads, 1)
    attention_backward_dkv_tma(bf16* dqkv, const float* lse, const float* Dg,
                               const __grid_constant__ CUtensorMap qkv128, const __grid_constant__ CUtensorMap qkv64,
                               const __grid_constant__ CUtensorMap dout64,
                               const __grid_constant__ CUtensorMap qkv128_tail,
                               const __grid_constant__ CUtensorMap qkv64_tail,
                               const __grid_constant__ CUtensorMap dout64_tail, int T, int C, int NH, int KVH,
                               float scale, float scale_log2) {
#ifdef SPILLWAY_WGMMA_BODY
  using L = Cols<HD>;
  static_assert(HD == 64 || HD == 80, "the TMA backward takes head dims 64 and 80");
  constexpr int kMain = L::main, kTail = L::tail;
  constexpr int kKeys = kBM, kQ = kBN;
  constexpr int kKBytes = L::bytes(kKeys), kQBytes = L::bytes(kQ);
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const uint32_t raw = smem_addr(smem_raw), base = (raw + 1023u) & ~1023u;
  const uint32_t k_tile = base, v_tile = base + kKBytes, q_tile = v_tile + kKBytes,
                 do_tile = q_tile + kStages * kQBytes;
  float* Ls = reinterpret_cast<float*>(smem_raw + (do_tile + kStages * kQBytes - raw));  // [kStages][kQ], log2 units
  float* Ds = Ls + kStages * kQ;                                                          // [kStages][kQ]
  const TmaRing ring{do_tile + kStages * kQBytes + 2 * kStages * kQ * static_cast<uint32_t>(sizeof(float))};

  const int n0 = blockIdx.x * kKeys;
  const int bg = blockIdx.y, b = bg / KVH, kvh = bg % KVH;
  const int group = kGrouped ? NH / KVH : 1, h0 = kvh * group;
  // qkv's row length and the columns of key/value head kvh: the grouped formulas are
  // also the ungrouped ones (NH·HD = C).
  const size_t ld = static_cast<size_t>(NH + 2 * KVH) * HD;
  const int k_col = (NH + kvh) * HD, v_col = (NH + KVH + kvh) * HD;
  const int mb_first = n0 / kQ, n_mb = (T + kQ - 1) / kQ - mb_first;
  const int n_it = group * n_mb;
  // Iteration it covers query block mb_first + it % n_mb of query head h0 + it / n_mb.
  auto head_of = [&](int it) { return kGrouped ? it / n_mb : 0; };
  auto block_of = [&](int it) { return mb_first + (kGrouped ? it % n_mb : it); };

  if (threadIdx.x == kThreads) ring.init(kThreads);
  __syncthreads();

  if (threadIdx.x >= kThreads) {  // the producer warp
    const int lane = threadIdx.x & 31;
    if (lane == 0) {
      mbar_expect_tx(ring.once(), 2 * kKBytes);
      tma_load_tile<HD>(k_tile, kKeys, &qkv128, &qkv128_tail, k_col, n0, b, ring.once());
      tma_load_tile<HD>(v_tile, kKeys, &qkv128, &qkv128_tail, v_col, n0, b, ring.once());
    }
    for (int it = 0; it < n_it; ++it) {
      const int st = it % kStages, hh = head_of(it), mb = block_of(it);
      ring.acquire(it);  // every lane: the stage's lse and D are rewritten below
      const float* lse_h = lse + (static_cast<size_t>(b) * NH + h0 + hh) * T;
      const float* D_h = Dg + (static_cast<size_t>(b) * NH + h0 + hh) * T;
      for (int i = lane; i < kQ; i += 32) {
        const int q = mb * kQ + i;
        Ls[st * kQ + i] = q < T ? lse_h[q] * kLog2e : INFINITY;
        Ds[st * kQ + i] = q < T ? D_h[q] : 0.0f;
      }
      __syncwarp();  // the lanes' stores before lane 0's arrival (a release) on `full`
      if (lane == 0) {
        mbar_expect_tx(ring.full(it), 2 * kQBytes);
        const int q_col = (h0 + hh) * HD;
        tma_load_tile<HD>(q_tile + st * kQBytes, kQ, &qkv64, &qkv64_tail, q_col, mb * kQ, b, ring.full(it));
        tma_load_tile<HD>(do_tile + st * kQBytes, kQ, &dout64, &dout64_tail, q_col, mb * kQ, b, ring.full(it));
      }
    }
    return;
  }

  const int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
  const int g = lane >> 2, t4 = lane & 3;
  const int wg_key0 = n0 + wg * kWgRows;  // this warpgroup's first key
  float dk[kMain][32], dk_tail[kTail ? 8 : 1], dv[kMain][32], dv_tail[kTail ? 8 : 1];
  zero<HD>(dk, dk_tail);
  zero<HD>(dv, dv_tail);
  const int key_a = wg_key0 + warp * 16 + g;  // this thread's keys: key_a and key_a + 8
  mbar_wait(ring.once(), 0);

  for (int it = 0; it < n_it; ++it) {
    const int mb = block_of(it), st = it % kStages;
    ring.wait_full(it);
    if (mb * kQ + kQ - 1 >= wg_key0) {  // some query of the block sees a key of this warpgroup
      const uint32_t qt = q_tile + st * kQBytes, dot = do_tile + st * kQBytes;
      // Waits for its products: the stage is read when it returns.
      dkv_query_block<HD>(dk, dk_tail, dv, dv_tail, k_tile, v_tile, wg, wg_key0, key_a, t4, Ls + st * kQ,
                          Ds + st * kQ, qt, dot, mb, scale_log2);
    }
    ring.release(it);
  }

  dkv_finish<HD>(dqkv, dk, dk_tail, dv, dv_tail, key_a, t4, T, b, ld, (NH + kvh) * HD, kGrouped ? KVH * HD : C,
                 scale);
#endif  // SPILLWAY_WGMMA_BODY
}

// dQ as attention_backward_dq_wgmma. qkv128, qkv64: tensor maps over qkv with boxes of
// kBM and kBN tokens; dout128: over dout (ld = C), boxes of kBM tokens; the *_tail maps:
// the same boxes of head dim 80's 16-column tail (unused at 64). At head dim 64, 112
// registers a thread, so that two blocks of 288 threads fit an SM (it needs 112
// without spilling); at 80 one block, and ptxas takes 150 of the 168 allowed.
template <int HD>
__global__ void __maxnreg__(HD == 64 ? 112 : 168)
    attention_backward_dq_tma(bf16* dqkv, const float* lse, const float* Dg,
                              const __grid_constant__ CUtensorMap qkv128, const __grid_constant__ CUtensorMap qkv64,
                              const __grid_constant__ CUtensorMap dout128,
                              const __grid_constant__ CUtensorMap qkv128_tail,
                              const __grid_constant__ CUtensorMap qkv64_tail,
                              const __grid_constant__ CUtensorMap dout128_tail, int T, int C, int NH, int KVH,
                              float scale, float scale_log2) {
#ifdef SPILLWAY_WGMMA_BODY
  using L = Cols<HD>;
  static_assert(HD == 64 || HD == 80, "the TMA backward takes head dims 64 and 80");
  constexpr int kMain = L::main, kTail = L::tail;
  constexpr int kQBytes = L::bytes(kBM), kKVBytes = L::bytes(kBN);
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const uint32_t base = (smem_addr(smem_raw) + 1023u) & ~1023u;
  const uint32_t q_tile = base, do_tile = base + kQBytes, k_tile = do_tile + kQBytes,
                 v_tile = k_tile + kStages * kKVBytes;
  const TmaRing ring{v_tile + kStages * kKVBytes};  // once: Q and dO; the ring: K and V

  const QueryBlock qb = query_block(T, NH);
  const int m0 = qb.m0, n_blocks = qb.n_blocks;
  const int kvh = qb.h / (NH / KVH);
  const size_t ld = static_cast<size_t>(NH + 2 * KVH) * HD;  // 3C without grouping
  const int q_col = qb.h * HD;
  const int k_col = (NH + kvh) * HD, v_col = (NH + KVH + kvh) * HD;  // as the forward's

  if (threadIdx.x == kThreads) ring.init(kThreads);
  __syncthreads();

  if (threadIdx.x >= kThreads) {  // the producer warp
    if (threadIdx.x == kThreads) {
      mbar_expect_tx(ring.once(), 2 * kQBytes);
      tma_load_tile<HD>(q_tile, kBM, &qkv128, &qkv128_tail, q_col, m0, qb.b, ring.once());
      tma_load_tile<HD>(do_tile, kBM, &dout128, &dout128_tail, q_col, m0, qb.b, ring.once());
      produce_kv_blocks<HD>(ring, k_tile, v_tile, &qkv64, &qkv64_tail, k_col, v_col, n_blocks, qb.b);
    }
    return;
  }

  const int wg = qb.wg, warp = qb.warp, g = qb.g, t4 = qb.t4;
  const int wg_row0 = qb.wg_row0, wg_last = qb.wg_last;
  const float* lse_bh = lse + static_cast<size_t>(qb.bh) * T;
  const float* D_bh = Dg + static_cast<size_t>(qb.bh) * T;
  const int row_a = wg_row0 + warp * 16 + g;  // this thread's rows: row_a and row_a + 8
  float lse2[2], Dr[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int q = row_a + 8 * r;
    lse2[r] = q < T ? lse_bh[q] * kLog2e : INFINITY;
    Dr[r] = q < T ? D_bh[q] : 0.0f;
  }
  float dq[kMain][32], dq_tail[kTail ? 8 : 1];
  zero<HD>(dq, dq_tail);
  mbar_wait(ring.once(), 0);

  for (int nb = 0; nb < n_blocks; ++nb) {
    const int st = nb % kStages;
    ring.wait_full(nb);
    if (nb <= wg_last) {
      const uint32_t kt = k_tile + st * kKVBytes, vt = v_tile + st * kKVBytes;
      // Waits for its products: the stage is read when it returns.
      dq_key_block<HD>(dq, dq_tail, q_tile, do_tile, wg, wg_row0, row_a, t4, lse2, Dr, kt, vt, nb, T, scale_log2);
    }
    ring.release(nb);
  }

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int q = row_a + r * 8;
    if (q >= T) continue;
    store_row<HD>(dqkv + (static_cast<size_t>(qb.b) * T + q) * ld + qb.h * HD, dq, dq_tail, r, t4, scale);
  }
#endif  // SPILLWAY_WGMMA_BODY
}

// cuTensorMapEncodeTiled from the driver (no link to libcuda: the runtime hands out
// the entry point); null where the driver has none.
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess)
      p = nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }();
  return fn;
}

// A tensor map over a [B,T,ld] bf16 tensor (qkv, or dout with ld = C) as (ld columns,
// T tokens, B), boxes of `cols` columns × `rows` tokens × 1: 64 columns (128 bytes) in
// the 128-byte swizzle, or 16 (32 bytes, head dim 80's tail) in the 32-byte swizzle.
bool encode_qkv_map(CUtensorMap* map, const bf16* qkv, size_t ld, int T, int B, int rows, int cols = 64) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (encode == nullptr) return false;
  const cuuint64_t dims[3] = {ld, static_cast<cuuint64_t>(T), static_cast<cuuint64_t>(B)};
  const cuuint64_t strides[2] = {ld * sizeof(bf16), ld * sizeof(bf16) * static_cast<cuuint64_t>(T)};
  const cuuint32_t box[3] = {static_cast<cuuint32_t>(cols), static_cast<cuuint32_t>(rows), 1};
  const cuuint32_t element_strides[3] = {1, 1, 1};
  return encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, const_cast<bf16*>(qkv), dims, strides, box,
                element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                cols == 64 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_32B,
                CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// Which backward kernels load by TMA at a head dim: dQ at 64 and 80; dK/dV at 64, and
// at 80 unless -DSPILLWAY_ATTENTION_CP_ASYNC_DKV_80 (there the TMA dK/dV kernel has
// 168 registers, the most that 288 threads allow, and ptxas serializes its products;
// the cp.async one has 206). -DSPILLWAY_ATTENTION_TMA_BACKWARD_64_ONLY keeps head dim
// 80 on the cp.async kernels, -DSPILLWAY_ATTENTION_NO_TMA every head dim: builds to
// time against each other in one call.
template <int HD>
struct TmaBackward {
#if defined(SPILLWAY_ATTENTION_NO_TMA)
  static constexpr bool dq = false, dkv = false;
#elif defined(SPILLWAY_ATTENTION_TMA_BACKWARD_64_ONLY)
  static constexpr bool dq = HD == 64, dkv = HD == 64;
#elif defined(SPILLWAY_ATTENTION_CP_ASYNC_DKV_80)
  static constexpr bool dq = HD == 64 || HD == 80, dkv = HD == 64;
#else
  static constexpr bool dq = HD == 64 || HD == 80, dkv = HD == 64 || HD == 80;
#endif
};

// The tensor maps of the TMA backward over qkv [B,T,ld] and dout [B,T,C]: boxes of kBM
// and kBN tokens, 64 columns, and at head dim 80 the same boxes of the 16-column tail.
struct BackwardMaps {
  CUtensorMap qkv128, qkv64, dout128, dout64, qkv128_tail, qkv64_tail, dout128_tail, dout64_tail;
};
// False where the TMA backward does not apply (rows not a multiple of 16 bytes, no
// encoder in the driver).
template <int HD>
bool encode_backward_maps(BackwardMaps& m, const bf16* dout, const bf16* qkv, size_t ld, int B, int T, int C) {
  constexpr int tail = Cols<HD>::tail ? Cols<HD>::tail : 64;  // without a tail, unused copies of the maps
  return ld % 8 == 0 && C % 8 == 0 && encode_qkv_map(&m.qkv128, qkv, ld, T, B, kBM) &&
         encode_qkv_map(&m.qkv64, qkv, ld, T, B, kBN) && encode_qkv_map(&m.dout128, dout, C, T, B, kBM) &&
         encode_qkv_map(&m.dout64, dout, C, T, B, kBN) && encode_qkv_map(&m.qkv128_tail, qkv, ld, T, B, kBM, tail) &&
         encode_qkv_map(&m.qkv64_tail, qkv, ld, T, B, kBN, tail) &&
         encode_qkv_map(&m.dout128_tail, dout, C, T, B, kBM, tail) &&
         encode_qkv_map(&m.dout64_tail, dout, C, T, B, kBN, tail);
}

// dK/dV, then dQ, each by its TMA kernel where TmaBackward<HD> says so and the maps
// encode, else by its cp.async kernel above.
template <int HD>
cudaError_t backward_wgmma(bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse, const float* D, int B,
                           int T, int C, int NH, int KVH, cudaStream_t stream) {
  using L = Cols<HD>;
  const float scale = 1.0f / sqrtf(static_cast<float>(HD)), scale_log2 = scale * kLog2e;
  const bool grouped = KVH != NH;
  const size_t ld = static_cast<size_t>(NH + 2 * KVH) * HD;  // 3C without grouping
  BackwardMaps maps;
  const bool tma = (TmaBackward<HD>::dq || TmaBackward<HD>::dkv) &&
                   encode_backward_maps<HD>(maps, dout, qkv, ld, B, T, C);
  const dim3 dkv_grid(ceil_div(T, kBM), B * KVH), dq_grid(ceil_div(T, kBM), B * NH);
  cudaError_t e = cudaSuccess;
  if constexpr (TmaBackward<HD>::dkv) {
    if (tma) {
      constexpr size_t smem = tma_dkv_smem_bytes<HD>();
      auto dkv = grouped ? attention_backward_dkv_tma<HD, true> : attention_backward_dkv_tma<HD, false>;
      e = cudaFuncSetAttribute(dkv, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
      if (e != cudaSuccess) return e;
      dkv<<<dkv_grid, kTmaThreads, smem, stream>>>(dqkv, lse, D, maps.qkv128, maps.qkv64, maps.dout64,
                                                   maps.qkv128_tail, maps.qkv64_tail, maps.dout64_tail, T, C, NH,
                                                   KVH, scale, scale_log2);
    }
  }
  if (!TmaBackward<HD>::dkv || !tma) {
    constexpr size_t smem = 2 * L::bytes(kBM) + 4 * L::bytes(kBN) + 4 * kBN * sizeof(float) + 1024;
    auto dkv = grouped ? attention_backward_dkv_wgmma<HD, true> : attention_backward_dkv_wgmma<HD, false>;
    e = cudaFuncSetAttribute(dkv, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (e != cudaSuccess) return e;
    dkv<<<dkv_grid, kThreads, smem, stream>>>(dqkv, dout, qkv, lse, D, T, C, NH, KVH, scale, scale_log2);
  }
  e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  if constexpr (TmaBackward<HD>::dq) {
    if (tma) {
      constexpr size_t smem = tma_dq_smem_bytes<HD>();
      auto dq = attention_backward_dq_tma<HD>;
      e = cudaFuncSetAttribute(dq, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
      if (e != cudaSuccess) return e;
      dq<<<dq_grid, kTmaThreads, smem, stream>>>(dqkv, lse, D, maps.qkv128, maps.qkv64, maps.dout128,
                                                 maps.qkv128_tail, maps.qkv64_tail, maps.dout128_tail, T, C, NH, KVH,
                                                 scale, scale_log2);
      return cudaGetLastError();
    }
  }
  constexpr size_t smem = 2 * L::bytes(kBM) + 4 * L::bytes(kBN) + 1024;
  auto dq = grouped ? attention_backward_dq_wgmma<HD, true> : attention_backward_dq_wgmma<HD, false>;
  e = cudaFuncSetAttribute(dq, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (e != cudaSuccess) return e;
  dq<<<dq_grid, kThreads, smem, stream>>>(dqkv, dout, qkv, lse, D, T, C, NH, KVH, scale, scale_log2);
  return cudaGetLastError();
}

// The TMA forward where it applies (qkv rows a multiple of 16 bytes, the driver's
// encoder present); cudaErrorNotSupported where it does not, and the caller runs
// attention_forward_wgmma.
template <int HD>
cudaError_t forward_tma(bf16* out, float* lse, const bf16* qkv, int B, int T, int C, int NH, int KVH,
                        cudaStream_t stream) {
  const size_t ld = static_cast<size_t>(NH + 2 * KVH) * HD;  // 3C without grouping
  constexpr int tail = Cols<HD>::tail ? Cols<HD>::tail : 64;  // without a tail, unused copies of the maps
  constexpr int KB = ForwardKeys<HD>::value;
  CUtensorMap q_map, kv_map, q_tail_map, kv_tail_map;
  if (ld % 8 != 0 || !encode_qkv_map(&q_map, qkv, ld, T, B, kBM) || !encode_qkv_map(&kv_map, qkv, ld, T, B, KB) ||
      !encode_qkv_map(&q_tail_map, qkv, ld, T, B, kBM, tail) ||
      !encode_qkv_map(&kv_tail_map, qkv, ld, T, B, KB, tail))
    return cudaErrorNotSupported;
  constexpr size_t smem = tma_smem_bytes<HD, KB>();
  auto kernel = attention_forward_tma<HD, KB>;
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (e != cudaSuccess) return e;
  const float scale_log2 = kLog2e / sqrtf(static_cast<float>(HD));
  kernel<<<dim3(ceil_div(T, kBM), B * NH), kTmaThreads, smem, stream>>>(out, lse, q_map, kv_map, q_tail_map,
                                                                        kv_tail_map, T, C, NH, KVH, scale_log2);
  return cudaGetLastError();
}

template <int HD>
cudaError_t forward_wgmma(bf16* out, float* lse, const bf16* qkv, int B, int T, int C, int NH, int KVH,
                          cudaStream_t stream) {
#ifndef SPILLWAY_ATTENTION_NO_TMA  // a build without it, to time both in one call (scripts/device-attention.sh VARIANTS)
  if (const cudaError_t e = forward_tma<HD>(out, lse, qkv, B, T, C, NH, KVH, stream); e != cudaErrorNotSupported)
    return e;
#endif
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

cudaError_t launch_attention_backward_wgmma(bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse,
                                            const float* D, int B, int T, int C, int NH, int KVH,
                                            cudaStream_t stream) {
  if (!aligned16(qkv) || !aligned16(dqkv) || !aligned16(dout)) return cudaErrorInvalidValue;
  if (B == 0 || T == 0) return cudaSuccess;
  switch (C / NH) {
    case 64: return backward_wgmma<64>(dqkv, dout, qkv, lse, D, B, T, C, NH, KVH, stream);
    case 80: return backward_wgmma<80>(dqkv, dout, qkv, lse, D, B, T, C, NH, KVH, stream);
    case 128: return backward_wgmma<128>(dqkv, dout, qkv, lse, D, B, T, C, NH, KVH, stream);
    default: return cudaErrorInvalidValue;
  }
}

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
