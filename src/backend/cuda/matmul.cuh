// Internal to the CUDA backend: bf16 matrix products through cuBLASLt with fp32
// compute, each shape's algorithm chosen once and cached, so the bits never depend
// on pointer addresses or on what ran before. The cache key is the whole problem:
// shape, transposes, leading dimensions, bias, epilogue, beta and whether C is D, and
// each operand's alignment (min(256, largest power of two dividing its address)):
// every tensor is 256-aligned, so the alignment is one of an offset into a tensor (a
// column block), which the program fixes, never of where the allocator put it.
//
//   LtMatmul mm;
//   SPILLWAY_RETURN_IF_ERROR(mm.init(workspace, 32 << 20));
//   // row-major out[N,OC] = inp[N,C] · weight[OC,C]ᵀ + bias[OC], enqueued on `stream`
//   Status s = mm.forward(stream, out, inp, weight, bias, N, C, OC, /*ld_out=*/OC);
#pragma once

#include <cublasLt.h>

#include <map>
#include <mutex>
#include <string>
#include <tuple>

#include "backend/cuda/cuda_common.cuh"

namespace spillway::cuda_detail {

std::string cublas_error_text(const char* what, cublasStatus_t s);

class LtMatmul {
 public:
  LtMatmul() = default;
  LtMatmul(const LtMatmul&) = delete;
  LtMatmul& operator=(const LtMatmul&) = delete;
  ~LtMatmul();

  // `workspace` (device, workspace_bytes; may be null until set_workspace) is owned
  // by the caller. workspace_bytes is the heuristic's workspace limit for every
  // product: it never changes, so neither does any algorithm choice. Each product is
  // enqueued on the stream it is given.
  Status init(void* workspace, size_t workspace_bytes);
  // The workspace of the next products: `bytes` must equal init's workspace_bytes,
  // at a 256-aligned address.
  void set_workspace(void* workspace, size_t bytes);

  // out[N,OC] = inp[N,C] · weight[OC,C]ᵀ (+ bias[OC] when bias is not null); rows of
  // out are ld_out ≥ OC elements apart.
  Status forward(cudaStream_t stream, bf16* out, const bf16* inp, const bf16* weight, const bf16* bias, int N, int C,
                 int OC, int ld_out);
  // dinp[N,C] = dout[N,OC] · weight[OC,C], overwritten, or added into dinp (beta = 1)
  // when `accumulate`; rows of dout are ld_dout ≥ OC elements apart.
  Status backward_input(cudaStream_t stream, bf16* dinp, const bf16* dout, const bf16* weight, int N, int C, int OC,
                        int ld_dout, bool accumulate);
  // dweight[OC,C] += dout[N,OC]ᵀ · inp[N,C]; rows of dout are ld_dout ≥ OC elements apart.
  // With dbias_sum (bf16 [OC], not null), the same product with a BGRADB epilogue
  // also writes dbias_sum[oc] = Σ_n dout[n,oc] (summed by cuBLASLt, written in bf16,
  // overwritten, not added) from the dout it reads anyway; Unsupported where cuBLASLt
  // has no such algorithm (the caller then sums the columns itself).
  Status backward_weight(cudaStream_t stream, bf16* dweight, const bf16* dout, const bf16* inp, int N, int C, int OC,
                         int ld_dout, bf16* dbias_sum = nullptr);

  // The forward with the GELU in cuBLASLt's epilogue (GELU_AUX_BIAS, or GELU_AUX
  // without a bias): pre[N,OC] = inp · weightᵀ + bias and out[N,OC] = gelu(the same
  // sum in fp32, before its rounding to bf16). Unsupported (Status::unsupported) where
  // cuBLASLt has no algorithm for it: the caller then runs forward and a GELU kernel.
  Status forward_gelu(cudaStream_t stream, bf16* out, bf16* pre, const bf16* inp, const bf16* weight,
                      const bf16* bias, int N, int C, int OC);
  // backward_input through a GELU (DGELU epilogue): dpre[N,C] = (dout · weight) ∘
  // gelu'(pre), overwritten. Unsupported as above.
  Status backward_input_gelu(cudaStream_t stream, bf16* dpre, const bf16* dout, const bf16* weight, const bf16* pre,
                             int N, int C, int OC);
  // The forward with the residual added in the product (beta = 1, residual as C beside
  // D = out, the same layout): out[N,OC] = residual[N,OC] + inp · weightᵀ (+ bias[OC]),
  // summed in fp32 and rounded to bf16 once; out is not residual. Unsupported as
  // above: the caller then runs forward and a residual kernel.
  Status forward_residual(cudaStream_t stream, bf16* out, const bf16* inp, const bf16* weight, const bf16* bias,
                          const bf16* residual, int N, int C, int OC);

  size_t cached_shapes() const { return plans_.size(); }

 private:
  // Column-major problem D[m,n] = op(A)[m,k] · op(B)[k,n] (+ beta·C) (+ bias[m]),
  // beta = 1 when `accumulate` (C is D) or `residual` (C is another matrix of D's
  // shape and leading dimension, at alignment align_residual). lda/ldb/ldc: leading
  // dimensions (elements) of A, B and C and D as stored. align_*: the operands'
  // address alignments in bytes (2..256; see align_of), given to the heuristic so it
  // picks only algorithms that can work with them.
  // gelu: 0 none; 1 D = gelu(sum) with the sum kept in the auxiliary matrix
  // (GELU_AUX[_BIAS]); 2 D = sum ∘ gelu'(auxiliary) (DGELU). The auxiliary matrix has
  // D's shape, leading dimension ldc.
  // bgrad: the BGRADB epilogue, the column sums of op(B) over k into a bf16 vector of
  // n (at alignment align_bias); never with bias or gelu.
  struct Key {
    bool ta, tb;
    int m, n, k;
    int64_t lda, ldb, ldc;
    bool bias;
    bool accumulate;
    uint32_t align_a, align_b, align_c, align_bias;
    int gelu = 0;
    uint32_t align_aux = 0;
    bool residual = false;
    uint32_t align_residual = 0;
    bool bgrad = false;
    auto tie() const {
      return std::tie(ta, tb, m, n, k, lda, ldb, ldc, bias, accumulate, align_a, align_b, align_c, align_bias, gelu,
                      align_aux, residual, align_residual, bgrad);
    }
    bool operator<(const Key& o) const { return tie() < o.tie(); }
  };
  // min(256, the largest power of two dividing p's address); 256 for null.
  static uint32_t align_of(const void* p);
  struct Plan {
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
    cublasLtMatmulAlgo_t algo{};
  };
  Status plan_for(const Key& key, Plan** out);
  // C: the residual matrix when key.residual (else D is C).
  Status run(cudaStream_t stream, const Key& key, const void* A, const void* B, void* D, const void* bias,
             const void* aux = nullptr, const void* C = nullptr);

  cublasLtHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  std::mutex mu_;
  std::map<Key, Plan> plans_;
  std::map<Key, Status> unsupported_;  // problems cuBLASLt has no algorithm for, and why
};

}  // namespace spillway::cuda_detail
