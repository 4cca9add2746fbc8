// cuBLASLt matrix products of the CUDA backend (see matmul.cuh).
#include "backend/cuda/matmul.cuh"

namespace spillway::cuda_detail {

std::string cublas_error_text(const char* what, cublasStatus_t s) {
  return std::string(what) + ": " + cublasLtGetStatusName(s) + " (" + cublasLtGetStatusString(s) + ")";
}

namespace {

Status lt_status(const char* what, cublasStatus_t s) {
  if (s == CUBLAS_STATUS_SUCCESS) return Status::ok();
  if (s == CUBLAS_STATUS_ALLOC_FAILED) return Status::out_of_memory(cublas_error_text(what, s));
  if (s == CUBLAS_STATUS_NOT_SUPPORTED) return Status::unsupported(cublas_error_text(what, s));
  if (s == CUBLAS_STATUS_INVALID_VALUE) return Status::invalid_argument(cublas_error_text(what, s));
  return Status::internal(cublas_error_text(what, s));
}

#define LT_RETURN_IF_ERROR(what, expr)                      \
  do {                                                      \
    cublasStatus_t lt_s__ = (expr);                         \
    if (lt_s__ != CUBLAS_STATUS_SUCCESS) return lt_status(what, lt_s__); \
  } while (0)

constexpr uint32_t kAlign = 256;  // every tensor is 256-byte aligned (Backend::alignment)

}  // namespace

LtMatmul::~LtMatmul() {
  for (auto& [key, p] : plans_) {
    // Destruction: nothing to report to, and the descriptors are host objects.
    if (p.a) (void)cublasLtMatrixLayoutDestroy(p.a);
    if (p.b) (void)cublasLtMatrixLayoutDestroy(p.b);
    if (p.c) (void)cublasLtMatrixLayoutDestroy(p.c);
    if (p.desc) (void)cublasLtMatmulDescDestroy(p.desc);
  }
  if (handle_) (void)cublasLtDestroy(handle_);
}

Status LtMatmul::init(void* workspace, size_t workspace_bytes) {
  LT_RETURN_IF_ERROR("cublasLtCreate", cublasLtCreate(&handle_));
  workspace_ = workspace;
  workspace_bytes_ = workspace_bytes;
  return Status::ok();
}

void LtMatmul::set_workspace(void* workspace, size_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  workspace_ = workspace;
  workspace_bytes_ = bytes;
}

Status LtMatmul::plan_for(const Key& key, Plan** out) {
  auto it = plans_.find(key);
  if (it != plans_.end()) {
    *out = &it->second;
    return Status::ok();
  }
  Plan p;
  // Destroys the partial plan on any early return.
  struct Guard {
    Plan* p;
    bool armed = true;
    ~Guard() {
      if (!armed) return;
      if (p->a) (void)cublasLtMatrixLayoutDestroy(p->a);
      if (p->b) (void)cublasLtMatrixLayoutDestroy(p->b);
      if (p->c) (void)cublasLtMatrixLayoutDestroy(p->c);
      if (p->desc) (void)cublasLtMatmulDescDestroy(p->desc);
    }
  } guard{&p};

  LT_RETURN_IF_ERROR("cublasLtMatmulDescCreate", cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  cublasOperation_t ta = key.ta ? CUBLAS_OP_T : CUBLAS_OP_N, tb = key.tb ? CUBLAS_OP_T : CUBLAS_OP_N;
  LT_RETURN_IF_ERROR("set TRANSA", cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
  LT_RETURN_IF_ERROR("set TRANSB", cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
  // The heuristic reads the bias and auxiliary pointers' alignments: it is given
  // pointers with exactly the real ones' alignments, offsets from any 256-aligned base
  // (the workspace, or kAlign itself when none is set yet).
  const char* align_base =
      workspace_ ? static_cast<const char*>(workspace_) : reinterpret_cast<const char*>(uintptr_t{kAlign});
  if (key.bgrad) {
    const cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BGRADB;
    LT_RETURN_IF_ERROR("set EPILOGUE", cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi)));
    // The bias gradient has D's type (bf16): cuBLASLt 13 refuses an fp32 one
    // (INVALID_VALUE from the heuristic, on an H100).
    const cudaDataType_t bt = CUDA_R_16BF;
    LT_RETURN_IF_ERROR("set BIAS_DATA_TYPE",
                       cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof(bt)));
    const void* bias = align_base + (key.align_bias % kAlign);
    LT_RETURN_IF_ERROR("set BIAS_POINTER",
                       cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
  } else if (key.gelu != 0 || key.bias) {
    const cublasLtEpilogue_t epi = key.gelu == 2 ? CUBLASLT_EPILOGUE_DGELU
                                   : key.gelu == 1 ? (key.bias ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS
                                                               : CUBLASLT_EPILOGUE_GELU_AUX)
                                                   : CUBLASLT_EPILOGUE_BIAS;
    LT_RETURN_IF_ERROR("set EPILOGUE", cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi)));
  }
  if (key.bias) {
    cudaDataType_t bt = CUDA_R_16BF;
    LT_RETURN_IF_ERROR("set BIAS_DATA_TYPE",
                       cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof(bt)));
    const void* bias = align_base + (key.align_bias % kAlign);
    LT_RETURN_IF_ERROR("set BIAS_POINTER",
                       cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
  }
  if (key.gelu != 0) {
    if (key.ldc % 8 != 0)  // cuBLASLt's rule for the auxiliary matrix's leading dimension
      return Status::unsupported("cuBLASLt GELU epilogue: leading dimension " + std::to_string(key.ldc) +
                                 " is not a multiple of 8");
    const int64_t aux_ld = key.ldc;
    LT_RETURN_IF_ERROR("set EPILOGUE_AUX_LD", cublasLtMatmulDescSetAttribute(
                                                  p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &aux_ld, sizeof(aux_ld)));
    const cudaDataType_t aux_type = CUDA_R_16BF;
    LT_RETURN_IF_ERROR("set EPILOGUE_AUX_DATA_TYPE",
                       cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE, &aux_type,
                                                      sizeof(aux_type)));
    const void* aux = align_base + (key.align_aux % kAlign);
    LT_RETURN_IF_ERROR("set EPILOGUE_AUX_POINTER", cublasLtMatmulDescSetAttribute(
                                                       p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, sizeof(aux)));
  }
  const uint64_t a_rows = key.ta ? key.k : key.m, a_cols = key.ta ? key.m : key.k;
  const uint64_t b_rows = key.tb ? key.n : key.k, b_cols = key.tb ? key.k : key.n;
  if (key.lda < static_cast<int64_t>(a_rows) || key.ldb < static_cast<int64_t>(b_rows) || key.ldc < key.m)
    return Status::invalid_argument("leading dimension below the rows of a bf16 product (m=" + std::to_string(key.m) +
                                    " n=" + std::to_string(key.n) + " k=" + std::to_string(key.k) +
                                    ", lda=" + std::to_string(key.lda) + " ldb=" + std::to_string(key.ldb) +
                                    " ldc=" + std::to_string(key.ldc) + ")");
  LT_RETURN_IF_ERROR("layout A", cublasLtMatrixLayoutCreate(&p.a, CUDA_R_16BF, a_rows, a_cols, key.lda));
  LT_RETURN_IF_ERROR("layout B", cublasLtMatrixLayoutCreate(&p.b, CUDA_R_16BF, b_rows, b_cols, key.ldb));
  LT_RETURN_IF_ERROR("layout C", cublasLtMatrixLayoutCreate(&p.c, CUDA_R_16BF, key.m, key.n, key.ldc));

  cublasLtMatmulPreference_t pref = nullptr;
  LT_RETURN_IF_ERROR("cublasLtMatmulPreferenceCreate", cublasLtMatmulPreferenceCreate(&pref));
  struct PrefGuard {
    cublasLtMatmulPreference_t p;
    ~PrefGuard() { (void)cublasLtMatmulPreferenceDestroy(p); }
  } pref_guard{pref};
  uint64_t ws = workspace_bytes_;
  LT_RETURN_IF_ERROR("pref workspace", cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
  // C and D are one buffer, unless C is a residual matrix.
  const std::pair<cublasLtMatmulPreferenceAttributes_t, uint32_t> aligns[] = {
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, key.align_a},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, key.align_b},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, key.residual ? key.align_residual : key.align_c},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, key.align_c}};
  for (const auto& [attr, align] : aligns) {
    LT_RETURN_IF_ERROR("pref alignment", cublasLtMatmulPreferenceSetAttribute(pref, attr, &align, sizeof(align)));
  }
  // Split-K only with a reduction through the workspace in a fixed order; never
  // in place in the output.
  uint32_t schemes = CUBLASLT_REDUCTION_SCHEME_NONE | CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE |
                     CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE;
  LT_RETURN_IF_ERROR("pref reduction scheme",
                     cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &schemes, sizeof(schemes)));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t hs = cublasLtMatmulAlgoGetHeuristic(handle_, p.desc, p.a, p.b, p.c, p.c, pref, 1, &result, &found);
  // An epilogue this cuBLASLt does not take for the problem may be refused as an invalid
  // value rather than as unsupported: for the bias-gradient epilogue, the caller's other
  // path then runs, the same way every time.
  if (key.bgrad && hs == CUBLAS_STATUS_INVALID_VALUE)
    return Status::unsupported(cublas_error_text("cublasLtMatmulAlgoGetHeuristic (BGRADB epilogue)", hs));
  LT_RETURN_IF_ERROR("cublasLtMatmulAlgoGetHeuristic", hs);
  if (found == 0 || result.state != CUBLAS_STATUS_SUCCESS)
    return Status::unsupported(std::string("cuBLASLt has no algorithm for a bf16 product") +
                               (key.gelu == 1 ? " with a GELU epilogue" : key.gelu == 2 ? " with a DGELU epilogue" : "") +
                               (key.residual ? " adding a residual matrix (beta = 1)" : "") +
                               (key.bgrad ? " with a bias-gradient (BGRADB) epilogue" : "") +
                               " of m=" + std::to_string(key.m) +
                               " n=" + std::to_string(key.n) + " k=" + std::to_string(key.k) +
                               " (lda=" + std::to_string(key.lda) + " ldb=" + std::to_string(key.ldb) +
                               " ldc=" + std::to_string(key.ldc) + ", alignments " + std::to_string(key.align_a) +
                               "/" + std::to_string(key.align_b) + "/" + std::to_string(key.align_c) + " bytes)");
  p.algo = result.algo;
  guard.armed = false;
  auto [pos, inserted] = plans_.emplace(key, p);
  *out = &pos->second;
  return Status::ok();
}

Status LtMatmul::run(cudaStream_t stream, const Key& key, const void* A, const void* B, void* D, const void* bias,
                     const void* aux, const void* C) {
  std::lock_guard<std::mutex> lock(mu_);
  if (auto it = unsupported_.find(key); it != unsupported_.end()) return it->second;
  Plan* p = nullptr;
  if (Status s = plan_for(key, &p); !s.is_ok()) {
    if (s.code() == StatusCode::Unsupported) unsupported_.emplace(key, s);  // asked once per shape
    return s;
  }
  if (key.bias || key.bgrad)
    LT_RETURN_IF_ERROR("set BIAS_POINTER",
                       cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
  if (key.gelu != 0)
    LT_RETURN_IF_ERROR("set EPILOGUE_AUX_POINTER",
                       cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux,
                                                      sizeof(aux)));
  const float alpha = 1.0f, beta = key.accumulate || key.residual ? 1.0f : 0.0f;
  const cublasStatus_t st = cublasLtMatmul(handle_, p->desc, &alpha, A, p->a, B, p->b, &beta, key.residual ? C : D,
                                           p->c, D, p->c, &p->algo, workspace_, workspace_bytes_, stream);
  if (st == CUBLAS_STATUS_NOT_SUPPORTED) {  // refused before launching: refused for this problem from now on
    Status s = lt_status("cublasLtMatmul", st);
    unsupported_.emplace(key, s);  // checked before plans_ (which keeps the descriptors until ~LtMatmul)
    return s;
  }
  LT_RETURN_IF_ERROR("cublasLtMatmul", st);
  return Status::ok();
}

uint32_t LtMatmul::align_of(const void* p) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  if (a == 0) return kAlign;
  const uintptr_t low = a & (~a + 1);  // lowest set bit
  return low >= kAlign ? kAlign : static_cast<uint32_t>(low);
}

Status LtMatmul::forward(cudaStream_t stream, bf16* out, const bf16* inp, const bf16* weight, const bf16* bias,
                         int N, int C, int OC, int ld_out) {
  if (N == 0 || OC == 0) return Status::ok();
  // Column-major: D = out as [OC,N] (ld ld_out) = Aᵀ · B, A = weight as [C,OC] (ld C),
  // B = inp as [C,N] (ld C).
  Key key{true, false, OC, N, C, C, C, ld_out, bias != nullptr, false,
          align_of(weight), align_of(inp), align_of(out), align_of(bias)};
  return run(stream, key, weight, inp, out, bias);
}

Status LtMatmul::forward_gelu(cudaStream_t stream, bf16* out, bf16* pre, const bf16* inp, const bf16* weight,
                              const bf16* bias, int N, int C, int OC) {
  if (N == 0 || OC == 0) return Status::ok();
  // As forward, with pre (D's shape and leading dimension) as the epilogue's auxiliary matrix.
  Key key{true, false, OC, N, C, C, C, OC, bias != nullptr, false,
          align_of(weight), align_of(inp), align_of(out), align_of(bias), 1, align_of(pre)};
  return run(stream, key, weight, inp, out, bias, pre);
}

Status LtMatmul::forward_residual(cudaStream_t stream, bf16* out, const bf16* inp, const bf16* weight,
                                  const bf16* bias, const bf16* residual, int N, int C, int OC) {
  if (N == 0 || OC == 0) return Status::ok();
  // As forward, with C = residual (D's shape and leading dimension) and beta = 1.
  Key key{true, false, OC, N, C, C, C, OC, bias != nullptr, false,
          align_of(weight), align_of(inp), align_of(out), align_of(bias)};
  key.residual = true;
  key.align_residual = align_of(residual);
  return run(stream, key, weight, inp, out, bias, nullptr, residual);
}

Status LtMatmul::backward_input_gelu(cudaStream_t stream, bf16* dpre, const bf16* dout, const bf16* weight,
                                     const bf16* pre, int N, int C, int OC) {
  if (N == 0 || C == 0) return Status::ok();
  if (OC == 0)  // an empty sum: dpre = 0 · gelu'(pre) = 0
    return cuda_status("cudaMemsetAsync (dpre of an empty product)",
                       cudaMemsetAsync(dpre, 0, static_cast<size_t>(N) * C * sizeof(bf16), stream));
  // As backward_input (overwriting), with pre (dinp's shape) as the auxiliary matrix.
  Key key{false, false, C, N, OC, C, OC, C, false, false,
          align_of(weight), align_of(dout), align_of(dpre), kAlign, 2, align_of(pre)};
  return run(stream, key, weight, dout, dpre, nullptr, pre);
}

Status LtMatmul::backward_input(cudaStream_t stream, bf16* dinp, const bf16* dout, const bf16* weight, int N,
                                int C, int OC, int ld_dout, bool accumulate) {
  if (N == 0 || C == 0) return Status::ok();
  if (OC == 0) {  // an empty sum: dinp += 0, or dinp = 0
    if (accumulate) return Status::ok();
    return cuda_status("cudaMemsetAsync (dinp of an empty product)",
                       cudaMemsetAsync(dinp, 0, static_cast<size_t>(N) * C * sizeof(bf16), stream));
  }
  // Column-major: D = dinp as [C,N] (ld C) = A · B (+ D), A = weight as [C,OC] (ld C),
  // B = dout as [OC,N] (ld ld_dout).
  Key key{false, false, C, N, OC, C, ld_dout, C, false, accumulate,
          align_of(weight), align_of(dout), align_of(dinp), kAlign};
  return run(stream, key, weight, dout, dinp, nullptr);
}

Status LtMatmul::backward_weight(cudaStream_t stream, bf16* dweight, const bf16* dout, const bf16* inp, int N,
                                 int C, int OC, int ld_dout, bf16* dbias_sum) {
  if (OC == 0 || C == 0) return Status::ok();
  if (N == 0)  // an empty sum: dweight += 0, and the bias' column sums are 0
    return dbias_sum == nullptr ? Status::ok()
                                : cuda_status("cudaMemsetAsync (bias sums of an empty product)",
                                              cudaMemsetAsync(dbias_sum, 0, static_cast<size_t>(OC) * sizeof(bf16), stream));
  // Column-major: D = dweight as [C,OC] (ld C) += A · Bᵀ, A = inp as [C,N] (ld C),
  // B = dout as [OC,N] (ld ld_dout); BGRADB sums op(B) = doutᵀ [N,OC] over k = N.
  Key key{false, true, C, OC, N, C, ld_dout, C, false, true,
          align_of(inp), align_of(dout), align_of(dweight), dbias_sum ? align_of(dbias_sum) : kAlign};
  key.bgrad = dbias_sum != nullptr;
  return run(stream, key, inp, dout, dweight, dbias_sum);
}

}  // namespace spillway::cuda_detail
