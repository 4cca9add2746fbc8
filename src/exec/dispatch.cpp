#include "exec/dispatch.h"

#include "optim/adamw.h"

namespace spillway {

namespace {
Status check_count(const Op& op, const std::vector<void*>& ptrs, size_t lo, size_t hi) {
  if (ptrs.size() < lo || ptrs.size() > hi)
    return Status::internal("op " + op.name + " (" + op_kind_name(op.kind) + "): " + std::to_string(ptrs.size()) +
                            " operands, expected " + std::to_string(lo) + (lo == hi ? "" : ".." + std::to_string(hi)));
  return Status::ok();
}
const float* f32(void* p) { return static_cast<const float*>(p); }
float* f32w(void* p) { return static_cast<float*>(p); }
const int32_t* i32(void* p) { return static_cast<const int32_t*>(p); }
}  // namespace

Status run_device_op(Backend& b, const Program& program, const Op& op, const std::vector<void*>& x,
                     const OptimizerStep& step) {
  const OpAttrs& a = op.attrs;
  const int B = static_cast<int>(a.B), T = static_cast<int>(a.T), C = static_cast<int>(a.C);
  const int N = static_cast<int>(a.N), OC = static_cast<int>(a.OC), NH = static_cast<int>(a.NH);
  const int V = static_cast<int>(a.V);
  const size_t n = static_cast<size_t>(a.n);
  switch (op.kind) {
    case OpKind::Zero:
      SPILLWAY_RETURN_IF_ERROR(check_count(op, x, 1, 1));
      b.fill_zero(x[0], program.tensors.info(op.operands[0].tensor).bytes());
      return Status::ok();
    case OpKind::EmbeddingForward:
      SPILLWAY_RETURN_IF_ERROR(check_count(op, x, 4, 4));
      b.embedding_forward(x[0], i32(x[1]), x[2], x[3], B, T, C);
      return Status::ok();
    case OpKind::EmbeddingBackward:
      SPILLWAY_RETURN_IF_ERROR(check_count(op, x, 4, 4));
      b.embedding_backward(x[0], x[1], x[2], i32(x[3]), B, T, C);
      return Status::ok();
    case OpKind::LayerNormForward:
      SPILLWAY_RETURN_IF_ERROR(check_count(op, x, 6, 6));
      b.layernorm_forward(x[0], f32w(x[1]), f32w(x[2]), x[3], x[4], x[5], N, C);
      return Status::ok();
    case OpKind::LayerNormBackward:
      SPILLWAY_RETURN_IF_ERROR(check_count(op, x, 8, 8));
      b.layernorm_backward(x[0], x[1], x[2], x[3], x[4], x[5], f32(x[6]), f32(x[7]), N, C);
      return Status::ok();
    case OpKind::MatmulForward:
      SPILLWAY_RETURN_IF_ERROR(check_count(op, x, 3, 4));
      b.matmul_forward(x[0], x[1], x[2], x.size() > 3 ? x[3] : nullptr, N, C, OC);
      return Status::ok();
    case OpKind::MatmulBackward:
      SPILLWAY_RETURN_IF_ERROR(check_count(op, x, 5, 6));
      b.matmul_backward(x[0], x[1], x.size() > 5 ? x[5] : nullptr, x[2], x[3], x[4], N, C, OC);
      return Status::ok();
    case OpKind::AttentionForward:
      SPILLWAY_RETURN_IF_ERROR(check_count(op, x, 3, 3));
      b.attention_forward(x[0], f32w(x[1]), x[2], B, T, C, NH);
      return Status::ok();
    case OpKind::AttentionBackward:
      SPILLWAY_RETURN_IF_ERROR(check_count(op, x, 5, 5));
      b.attention_backward(x[0], x[1], x[2], x[3], f32(x[4]), B, T, C, NH);
      return Status::ok();
    case OpKind::GeluForward:
      SPILLWAY_RETURN_IF_ERROR(check_count(op, x, 2, 2));
      b.gelu_forward(x[0], x[1], n);
      return Status::ok();
    case OpKind::GeluBackward:
      SPILLWAY_RETURN_IF_ERROR(check_count(op, x, 3, 3));
      b.gelu_backward(x[0], x[1], x[2], n);
      return Status::ok();
    case OpKind::ResidualForward:
      SPILLWAY_RETURN_IF_ERROR(check_count(op, x, 3, 3));
      b.residual_forward(x[0], x[1], x[2], n);
      return Status::ok();
    case OpKind::CrossEntropyForward:
      SPILLWAY_RETURN_IF_ERROR(check_count(op, x, 3, 3));
      b.crossentropy_forward(f32w(x[0]), x[1], i32(x[2]), N, V);
      return Status::ok();
    case OpKind::CrossEntropyBackward:
      SPILLWAY_RETURN_IF_ERROR(check_count(op, x, 3, 3));
      b.crossentropy_backward(f32w(x[0]), x[1], i32(x[2]), N, V, a.scale);
      return Status::ok();
    case OpKind::SquaredNorm:
      SPILLWAY_RETURN_IF_ERROR(check_count(op, x, 2, 2));
      b.squared_norm(f32w(x[0]) + a.index, x[1], n);
      return Status::ok();
    case OpKind::ClipScale: {
      // (scale_norm W, sq_0 R, ..., sq_{P-1} R) or (scale_norm W, sq[P] R)
      if (x.size() < 2) return check_count(op, x, 2, 2);
      if (x.size() == 2) {
        b.clip_scale(f32w(x[0]), f32(x[1]), static_cast<int>(a.P), a.scale);
        return Status::ok();
      }
      return Status::internal("op " + op.name + ": ClipScale with one operand per parameter runs through "
                              "run_clip_scale_gathered (executor)");
    }
    case OpKind::AdamW: {
      SPILLWAY_RETURN_IF_ERROR(check_count(op, x, 6, 6));
      AdamWHyper h = adamw_hyper(step.lr, step.step, a.scale);
      b.adamw(x[0], f32w(x[1]), f32w(x[2]), f32w(x[3]), x[4], f32(x[5]), n, h);
      return Status::ok();
    }
  }
  return Status::internal("op " + op.name + ": unknown kind");
}

Status run_host_op(const Op& op, const std::vector<void*>& x, DType param_dtype, const OptimizerStep& step) {
  if (op.kind != OpKind::AdamW)
    return Status::internal("op " + op.name + " (" + op_kind_name(op.kind) + ") has no host implementation");
  SPILLWAY_RETURN_IF_ERROR(check_count(op, x, 6, 6));
  AdamWHyper h = adamw_hyper(step.lr, step.step, op.attrs.scale);
  adamw_host(param_dtype, x[0], f32w(x[1]), f32w(x[2]), f32w(x[3]), x[4], f32(x[5]), static_cast<size_t>(op.attrs.n), h);
  return Status::ok();
}

}  // namespace spillway
