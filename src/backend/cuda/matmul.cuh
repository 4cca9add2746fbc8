// Internal to the CUDA backend: bf16 matrix products through cuBLASLt with fp32
// compute, each shape's algorithm chosen once and cached, so the bits never depend
// on pointer addresses or on what ran before.
//
//   LtMatmul mm;
//   SPILLWAY_RETURN_IF_ERROR(mm.init(stream, workspace, 32 << 20));
//   // row-major out[N,OC] = inp[N,C] · weight[OC,C]ᵀ + bias[OC]
//   Status s = mm.forward(out, inp, weight, bias, N, C, OC);
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

  // `workspace` (device, workspace_bytes) is owned by the caller and outlives this.
  Status init(cudaStream_t stream, void* workspace, size_t workspace_bytes);

  // out[N,OC] = inp[N,C] · weight[OC,C]ᵀ (+ bias[OC] when bias is not null).
  Status forward(bf16* out, const bf16* inp, const bf16* weight, const bf16* bias, int N, int C, int OC);
  // dinp[N,C] = dout[N,OC] · weight[OC,C] (overwritten).
  Status backward_input(bf16* dinp, const bf16* dout, const bf16* weight, int N, int C, int OC);
  // dweight[OC,C] += dout[N,OC]ᵀ · inp[N,C].
  Status backward_weight(bf16* dweight, const bf16* dout, const bf16* inp, int N, int C, int OC);

  size_t cached_shapes() const { return plans_.size(); }

 private:
  // Column-major problem D[m,n] = op(A)[m,k] · op(B)[k,n] (+ beta·C) (+ bias[m]).
  struct Key {
    bool ta, tb;
    int m, n, k;
    bool bias;
    bool accumulate;
    auto tie() const { return std::tie(ta, tb, m, n, k, bias, accumulate); }
    bool operator<(const Key& o) const { return tie() < o.tie(); }
  };
  struct Plan {
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
    cublasLtMatmulAlgo_t algo{};
  };
  Status plan_for(const Key& key, Plan** out);
  Status run(const Key& key, const void* A, const void* B, void* D, const void* bias);

  cublasLtHandle_t handle_ = nullptr;
  cudaStream_t stream_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  std::mutex mu_;
  std::map<Key, Plan> plans_;
};

}  // namespace spillway::cuda_detail
