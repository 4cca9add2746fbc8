#include "exec/dispatch.h"

#include <algorithm>
#include <cstdint>
#include <set>
#include <string>

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
void* advance(void* p, int64_t elements, size_t element_size) {
  return p == nullptr ? nullptr : static_cast<char*>(p) + elements * static_cast<int64_t>(element_size);
}

// A matrix product over output channels [0, OC) of the op, in blocks of attrs.block
// channels (one block when 0): out/dout columns from attrs.begin of rows attrs.ld
// apart. dinp is overwritten by the first block of an op whose dinp is Write and
// accumulated by every other block, so the whole op and its tiles made of whole blocks
// make the same backend calls in the same order.
Status run_matmul(Backend& b, const Program& program, const Op& op, const std::vector<void*>& x) {
  const OpAttrs& a = op.attrs;
  const bool forward = op.kind == OpKind::MatmulForward;
  const size_t elem = dtype_size(program.tensors.info(op.operands[forward ? 0 : 2].tensor).dtype);
  const int64_t ld = a.ld == 0 ? a.OC : a.ld, block = a.block == 0 ? a.OC : a.block;
  const int N = static_cast<int>(a.N), C = static_cast<int>(a.C);
  for (int64_t o0 = 0; o0 < a.OC; o0 += block) {
    const int oc = static_cast<int>(std::min(block, a.OC - o0));
    void* weight = advance(x[forward ? 2 : 4], o0 * C, elem);
    if (forward) {
      b.matmul_forward(advance(x[0], a.begin + o0, elem), x[1], weight, x.size() > 3 ? advance(x[3], o0, elem) : nullptr,
                       N, C, oc, static_cast<int>(ld));
    } else {
      const bool accumulate = o0 > 0 || op.operands[0].access == Access::Update;
      b.matmul_backward(x[0], advance(x[1], o0 * C, elem), x.size() > 5 ? advance(x[5], o0, elem) : nullptr,
                        advance(x[2], a.begin + o0, elem), x[3], weight, N, C, oc, static_cast<int>(ld), accumulate);
    }
  }
  return Status::ok();
}
}  // namespace

Status run_device_op(Backend& b, const Program& program, const Op& op, const std::vector<void*>& x,
                     const OptimizerStep& step) {
  const OpAttrs& a = op.attrs;
  const int B = static_cast<int>(a.B), T = static_cast<int>(a.T), C = static_cast<int>(a.C);
  const int N = static_cast<int>(a.N), NH = static_cast<int>(a.NH);
  const int V = static_cast<int>(a.V);
  const size_t n = static_cast<size_t>(a.n);
  switch (op.kind) {
    case OpKind::Zero:
      SPILLWAY_RETURN_IF_ERROR(check_count(op, x, 1, 1));
      b.fill_zero(x[0], program.tensors.info(op.operands[0].tensor).bytes());
      return Status::ok();
    case OpKind::EmbeddingForward:
      SPILLWAY_RETURN_IF_ERROR(check_count(op, x, 4, 4));
      b.embedding_forward(x[0], i32(x[1]), x[2], x[3], B, T, C, static_cast<int>(a.begin),
                          a.V > 0 ? V : Backend::kAllRows);
      return Status::ok();
    case OpKind::EmbeddingBackward:
      SPILLWAY_RETURN_IF_ERROR(check_count(op, x, 3, 4));
      b.embedding_backward(x[0], x.size() > 3 ? x[3] : nullptr, x[1], i32(x[2]), B, T, C,
                           static_cast<int>(a.begin), a.V > 0 ? V : Backend::kAllRows);
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
      return run_matmul(b, program, op, x);
    case OpKind::MatmulBackward:
      SPILLWAY_RETURN_IF_ERROR(check_count(op, x, 5, 6));
      return run_matmul(b, program, op, x);
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
      b.crossentropy_forward(f32w(x[0]), x[1], i32(x[2]), N, V, static_cast<int>(a.ld == 0 ? a.V : a.ld));
      return Status::ok();
    case OpKind::CrossEntropyBackward:
      SPILLWAY_RETURN_IF_ERROR(check_count(op, x, 3, 3));
      b.crossentropy_backward(f32w(x[0]), x[1], i32(x[2]), N, V, static_cast<int>(a.ld == 0 ? a.V : a.ld), a.scale);
      return Status::ok();
    case OpKind::SquaredNorm: {
      SPILLWAY_RETURN_IF_ERROR(check_count(op, x, 2, 2));
      // One element of out_sq per segment of attrs.block elements (one when 0).
      const size_t elem = dtype_size(program.tensors.info(op.operands[1].tensor).dtype);
      const size_t segment = a.block > 0 ? static_cast<size_t>(a.block) : n;
      for (size_t s0 = 0, k = 0; s0 < n; s0 += segment, ++k)
        b.squared_norm(f32w(x[0]) + a.index + k, advance(x[1], static_cast<int64_t>(s0), elem),
                       std::min(segment, n - s0));
      return Status::ok();
    }
    case OpKind::ClipScale: {
      // (scale_norm W, sq[P] R)
      SPILLWAY_RETURN_IF_ERROR(check_count(op, x, 2, 2));
      b.clip_scale(f32w(x[0]), f32(x[1]), static_cast<int>(a.P), a.scale);
      return Status::ok();
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

Result<uint64_t> op_workspace_bytes(const BackendSizes& b, const Program& program, const Op& op) {
  const OpAttrs& a = op.attrs;
  const int B = static_cast<int>(a.B), T = static_cast<int>(a.T), C = static_cast<int>(a.C);
  const int N = static_cast<int>(a.N), NH = static_cast<int>(a.NH);
  (void)program;
  uint64_t need = 0;
  switch (op.kind) {
    case OpKind::EmbeddingBackward:
      need = b.embedding_backward_workspace(B, T);
      break;
    case OpKind::LayerNormBackward:
      need = b.layernorm_backward_workspace(N, C);
      break;
    case OpKind::MatmulForward:
    case OpKind::MatmulBackward: {
      // The blocks of run_matmul, each one backend call.
      const bool backward = op.kind == OpKind::MatmulBackward;
      const bool dbias = backward && op.operands.size() > 5;
      const int64_t block = a.block == 0 ? a.OC : a.block;
      for (int64_t o0 = 0; o0 < a.OC; o0 += block) {
        const int oc = static_cast<int>(std::min(block, a.OC - o0));
        need = std::max<uint64_t>(need, b.matmul_workspace(N, oc, backward, dbias));
      }
      break;
    }
    case OpKind::AttentionBackward:
      need = b.attention_backward_workspace(B, T, NH);
      break;
    case OpKind::SquaredNorm:
      need = b.squared_norm_workspace();
      break;
    default:
      break;
  }
  if (need == SIZE_MAX)
    return Status::internal("the " + b.name() + " backend cannot size the workspace of op " + op.name);
  return need;
}

Result<WorkspaceNeed> program_workspace(const BackendSizes& backend, const Program& program) {
  WorkspaceNeed w;
  for (const Op& op : program.ops) {
    SPILLWAY_ASSIGN_OR_RETURN(uint64_t bytes, op_workspace_bytes(backend, program, op));
    if (bytes > w.bytes) {
      w.bytes = bytes;
      w.op = op.name;
    }
  }
  return w;
}

Status warm_up_kernels(Backend& backend, const Program& program, uint64_t limit) {
  if (backend.name() == "cpu") return Status::ok();  // nothing is loaded lazily
  std::set<std::string> seen;
  const size_t align = backend.alignment();
  for (const Op& op : program.ops) {
    if (op.place != Place::Device) continue;
    // One of each kind and operand shapes (and attributes that pick a kernel).
    std::string key = std::to_string(static_cast<int>(op.kind));
    uint64_t bytes = 0;
    for (const Operand& o : op.operands) {
      const TensorInfo& info = program.tensors.info(o.tensor);
      key += "|" + std::to_string(static_cast<int>(info.dtype));
      for (int64_t d : info.shape.dims) key += "," + std::to_string(d);
      bytes += (std::max<uint64_t>(1, info.bytes()) + align - 1) / align * align;
    }
    key += "|" + std::to_string(op.attrs.ld) + "," + std::to_string(op.attrs.begin) + "," +
           std::to_string(op.attrs.block) + "," + std::to_string(op.attrs.V);
    if (!seen.insert(key).second) continue;
    SPILLWAY_ASSIGN_OR_RETURN(uint64_t workspace, op_workspace_bytes(backend, program, op));
    const uint64_t ws = (workspace + align - 1) / align * align;
    if (bytes + ws > limit) continue;
    SPILLWAY_ASSIGN_OR_RETURN(void* block, backend.device_alloc(bytes + ws));
    backend.fill_zero(block, bytes + ws);
    std::vector<void*> ptrs;
    uint64_t at = 0;
    for (const Operand& o : op.operands) {
      ptrs.push_back(static_cast<char*>(block) + at);
      at += (std::max<uint64_t>(1, program.tensors.info(o.tensor).bytes()) + align - 1) / align * align;
    }
    backend.set_workspace(ws ? static_cast<char*>(block) + at : nullptr, ws);
    Status s = run_device_op(backend, program, op, ptrs, OptimizerStep{1, 0.0f});
    if (s.is_ok()) s = backend.synchronize();
    backend.set_workspace(nullptr, 0);
    backend.device_free(block);
    if (!s.is_ok()) return s.with_context("loading the kernels of " + op.name + " before planning");
  }
  backend.remeasure_fixed_device_bytes();
  return Status::ok();
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
