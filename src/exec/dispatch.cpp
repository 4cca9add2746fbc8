#include "exec/dispatch.h"

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <set>
#include <string>

#include "backend/communicator.h"
#include "optim/adamw.h"
#include "program/op_registry.h"

namespace spillway {

namespace {
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

// ---- One backend call per kind ----------------------------------------------------
// `x` holds one pointer per operand, in the kind's slot order (op_registry.cpp), its
// count already checked against the slots.

Status run_zero(Backend& b, const Program& program, const Op& op, const std::vector<void*>& x, const OptimizerStep&) {
  b.fill_zero(x[0], program.tensors.info(op.operands[0].tensor).bytes());
  return Status::ok();
}

// Vocab tile: V rows from row `begin` (V = 0: every row).
int vocab_rows(const OpAttrs& a) { return a.V > 0 ? static_cast<int>(a.V) : Backend::kAllRows; }

Status run_embedding_forward(Backend& b, const Program&, const Op& op, const std::vector<void*>& x,
                             const OptimizerStep&) {
  const OpAttrs& a = op.attrs;
  b.embedding_forward(x[0], i32(x[1]), x[2], x.size() > 3 ? x[3] : nullptr, static_cast<int>(a.B),
                      static_cast<int>(a.T), static_cast<int>(a.C), static_cast<int>(a.begin), vocab_rows(a));
  return Status::ok();
}

Status run_embedding_backward(Backend& b, const Program&, const Op& op, const std::vector<void*>& x,
                              const OptimizerStep&) {
  const OpAttrs& a = op.attrs;
  b.embedding_backward(x[0], x.size() > 3 ? x[3] : nullptr, x[1], i32(x[2]), static_cast<int>(a.B),
                       static_cast<int>(a.T), static_cast<int>(a.C), static_cast<int>(a.begin), vocab_rows(a));
  return Status::ok();
}
uint64_t embedding_backward_workspace(const BackendSizes& b, const Op& op) {
  return b.embedding_backward_workspace(static_cast<int>(op.attrs.B), static_cast<int>(op.attrs.T));
}

Status run_layernorm_forward(Backend& b, const Program&, const Op& op, const std::vector<void*>& x,
                             const OptimizerStep&) {
  b.layernorm_forward(x[0], f32w(x[1]), f32w(x[2]), x[3], x[4], x[5], static_cast<int>(op.attrs.N),
                      static_cast<int>(op.attrs.C));
  return Status::ok();
}

Status run_layernorm_backward(Backend& b, const Program&, const Op& op, const std::vector<void*>& x,
                              const OptimizerStep&) {
  b.layernorm_backward(x[0], x[1], x[2], x[3], x[4], x[5], f32(x[6]), f32(x[7]), static_cast<int>(op.attrs.N),
                       static_cast<int>(op.attrs.C));
  return Status::ok();
}
uint64_t layernorm_backward_workspace(const BackendSizes& b, const Op& op) {
  return b.layernorm_backward_workspace(static_cast<int>(op.attrs.N), static_cast<int>(op.attrs.C));
}

Status run_rmsnorm_forward(Backend& b, const Program&, const Op& op, const std::vector<void*>& x,
                           const OptimizerStep&) {
  b.rmsnorm_forward(x[0], f32w(x[1]), x[2], x[3], static_cast<int>(op.attrs.N), static_cast<int>(op.attrs.C),
                    op.attrs.scale);
  return Status::ok();
}

Status run_rmsnorm_backward(Backend& b, const Program&, const Op& op, const std::vector<void*>& x,
                            const OptimizerStep&) {
  b.rmsnorm_backward(x[0], x[1], x[2], x[3], x[4], f32(x[5]), static_cast<int>(op.attrs.N),
                     static_cast<int>(op.attrs.C));
  return Status::ok();
}
uint64_t rmsnorm_backward_workspace(const BackendSizes& b, const Op& op) {
  return b.rmsnorm_backward_workspace(static_cast<int>(op.attrs.N), static_cast<int>(op.attrs.C));
}

Status run_matmul_op(Backend& b, const Program& program, const Op& op, const std::vector<void*>& x,
                     const OptimizerStep&) {
  return run_matmul(b, program, op, x);
}
// The blocks of run_matmul, each one backend call.
uint64_t matmul_workspace(const BackendSizes& b, const Op& op) {
  const OpAttrs& a = op.attrs;
  const bool backward = op.kind == OpKind::MatmulBackward;
  const bool dbias = backward && op.operands.size() > 5;
  const int64_t block = a.block == 0 ? a.OC : a.block;
  uint64_t need = 0;
  for (int64_t o0 = 0; o0 < a.OC; o0 += block) {
    const int oc = static_cast<int>(std::min(block, a.OC - o0));
    need = std::max<uint64_t>(need, b.matmul_workspace(static_cast<int>(a.N), oc, backward, dbias));
  }
  return need;
}

// The whole products of op_registry.cpp's MatmulGelu*, MatmulWeightBackward and
// MatmulResidualForward kinds.
Status run_matmul_gelu_forward(Backend& b, const Program&, const Op& op, const std::vector<void*>& x,
                               const OptimizerStep&) {
  const OpAttrs& a = op.attrs;
  b.matmul_gelu_forward(x[0], x[1], x[2], x[3], x.size() > 4 ? x[4] : nullptr, static_cast<int>(a.N),
                        static_cast<int>(a.C), static_cast<int>(a.OC));
  return Status::ok();
}
Status run_matmul_gelu_backward(Backend& b, const Program&, const Op& op, const std::vector<void*>& x,
                                const OptimizerStep&) {
  const OpAttrs& a = op.attrs;
  b.matmul_gelu_backward(x[0], x[1], x[2], x[3], static_cast<int>(a.N), static_cast<int>(a.C),
                         static_cast<int>(a.OC));
  return Status::ok();
}
Status run_matmul_weight_backward(Backend& b, const Program&, const Op& op, const std::vector<void*>& x,
                                  const OptimizerStep&) {
  const OpAttrs& a = op.attrs;
  b.matmul_weight_backward(x[0], x.size() > 3 ? x[3] : nullptr, x[1], x[2], static_cast<int>(a.N),
                           static_cast<int>(a.C), static_cast<int>(a.OC));
  return Status::ok();
}
Status run_matmul_residual_forward(Backend& b, const Program&, const Op& op, const std::vector<void*>& x,
                                   const OptimizerStep&) {
  const OpAttrs& a = op.attrs;
  b.matmul_residual_forward(x[0], x[1], x[2], x.size() > 4 ? x[4] : nullptr, x[3], static_cast<int>(a.N),
                            static_cast<int>(a.C), static_cast<int>(a.OC));
  return Status::ok();
}
uint64_t whole_matmul_workspace(const BackendSizes& b, const Op& op) {
  const bool backward = op.kind == OpKind::MatmulGeluBackward || op.kind == OpKind::MatmulWeightBackward;
  const bool dbias = op.kind == OpKind::MatmulWeightBackward && op.operands.size() > 3;
  return b.matmul_workspace(static_cast<int>(op.attrs.N), static_cast<int>(op.attrs.OC), backward, dbias);
}

// Key/value heads: attrs.KVH, 0 meaning NH (multi-head attention).
int kv_heads(const OpAttrs& a) { return static_cast<int>(a.KVH == 0 ? a.NH : a.KVH); }

Status run_attention_forward(Backend& b, const Program&, const Op& op, const std::vector<void*>& x,
                             const OptimizerStep&) {
  const OpAttrs& a = op.attrs;
  b.attention_forward(x[0], f32w(x[1]), x[2], static_cast<int>(a.B), static_cast<int>(a.T), static_cast<int>(a.C),
                      static_cast<int>(a.NH), kv_heads(a));
  return Status::ok();
}

Status run_attention_backward(Backend& b, const Program&, const Op& op, const std::vector<void*>& x,
                              const OptimizerStep&) {
  const OpAttrs& a = op.attrs;
  b.attention_backward(x[0], x[1], x[2], x[3], f32(x[4]), static_cast<int>(a.B), static_cast<int>(a.T),
                       static_cast<int>(a.C), static_cast<int>(a.NH), kv_heads(a));
  return Status::ok();
}
uint64_t attention_backward_workspace(const BackendSizes& b, const Op& op) {
  return b.attention_backward_workspace(static_cast<int>(op.attrs.B), static_cast<int>(op.attrs.T),
                                        static_cast<int>(op.attrs.NH));
}

Status run_gelu_forward(Backend& b, const Program&, const Op& op, const std::vector<void*>& x, const OptimizerStep&) {
  b.gelu_forward(x[0], x[1], static_cast<size_t>(op.attrs.n));
  return Status::ok();
}

Status run_gelu_backward(Backend& b, const Program&, const Op& op, const std::vector<void*>& x, const OptimizerStep&) {
  b.gelu_backward(x[0], x[1], x[2], static_cast<size_t>(op.attrs.n));
  return Status::ok();
}

Status run_residual_forward(Backend& b, const Program&, const Op& op, const std::vector<void*>& x,
                            const OptimizerStep&) {
  b.residual_forward(x[0], x[1], x[2], static_cast<size_t>(op.attrs.n));
  return Status::ok();
}

// grad = grad + part: the residual kernel in place (elementwise on both backends: each
// element of `a` is read before the same element of `out` is written).
Status run_accumulate_gradient(Backend& b, const Program&, const Op& op, const std::vector<void*>& x,
                               const OptimizerStep&) {
  b.residual_forward(x[0], x[0], x[1], static_cast<size_t>(op.attrs.n));
  return Status::ok();
}

// Rows of the logits: ld apart (0: V).
int logits_ld(const OpAttrs& a) { return static_cast<int>(a.ld == 0 ? a.V : a.ld); }

Status run_crossentropy_forward(Backend& b, const Program&, const Op& op, const std::vector<void*>& x,
                                const OptimizerStep&) {
  const OpAttrs& a = op.attrs;
  b.crossentropy_forward(f32w(x[0]), x[1], i32(x[2]), static_cast<int>(a.N), static_cast<int>(a.V), logits_ld(a));
  return Status::ok();
}

Status run_crossentropy_backward(Backend& b, const Program&, const Op& op, const std::vector<void*>& x,
                                 const OptimizerStep&) {
  const OpAttrs& a = op.attrs;
  b.crossentropy_backward(f32w(x[0]), x[1], i32(x[2]), static_cast<int>(a.N), static_cast<int>(a.V), logits_ld(a),
                          a.scale);
  return Status::ok();
}

Status run_rope_forward(Backend& b, const Program&, const Op& op, const std::vector<void*>& x, const OptimizerStep&) {
  const OpAttrs& a = op.attrs;
  b.rope_forward(x[0], x[1], static_cast<int>(a.B), static_cast<int>(a.T), static_cast<int>(a.NH), kv_heads(a),
                 static_cast<int>(a.C / a.NH), a.rope);
  return Status::ok();
}

Status run_rope_backward(Backend& b, const Program&, const Op& op, const std::vector<void*>& x, const OptimizerStep&) {
  const OpAttrs& a = op.attrs;
  b.rope_backward(x[0], x[1], static_cast<int>(a.B), static_cast<int>(a.T), static_cast<int>(a.NH), kv_heads(a),
                  static_cast<int>(a.C / a.NH), a.rope);
  return Status::ok();
}

Status run_swiglu_forward(Backend& b, const Program&, const Op& op, const std::vector<void*>& x,
                          const OptimizerStep&) {
  b.swiglu_forward(x[0], x[1], op.attrs.N, static_cast<int>(op.attrs.C));
  return Status::ok();
}

Status run_swiglu_backward(Backend& b, const Program&, const Op& op, const std::vector<void*>& x,
                           const OptimizerStep&) {
  b.swiglu_backward(x[0], x[1], x[2], op.attrs.N, static_cast<int>(op.attrs.C));
  return Status::ok();
}

// One element of out_sq per segment of attrs.block elements (one when 0).
Status run_squared_norm(Backend& b, const Program& program, const Op& op, const std::vector<void*>& x,
                        const OptimizerStep&) {
  const OpAttrs& a = op.attrs;
  const size_t n = static_cast<size_t>(a.n);
  const size_t elem = dtype_size(program.tensors.info(op.operands[1].tensor).dtype);
  const size_t segment = a.block > 0 ? static_cast<size_t>(a.block) : n;
  for (size_t s0 = 0, k = 0; s0 < n; s0 += segment, ++k)
    b.squared_norm(f32w(x[0]) + a.index + k, advance(x[1], static_cast<int64_t>(s0), elem), std::min(segment, n - s0));
  return Status::ok();
}
uint64_t squared_norm_workspace(const BackendSizes& b, const Op&) { return b.squared_norm_workspace(); }

Status run_clip_scale(Backend& b, const Program&, const Op& op, const std::vector<void*>& x, const OptimizerStep&) {
  b.clip_scale(f32w(x[0]), f32(x[1]), static_cast<int>(op.attrs.P), op.attrs.scale);
  return Status::ok();
}

// ---- Collectives: the backend's Communicator ----------------------------------------
// With a stream (NCCL), a collective runs there, ordered with the compute stream by
// events as PyTorch's ProcessGroupNCCL does: its stream waits for the compute
// submitted before it (its inputs' producers), the communicator only enqueues, and the
// compute stream waits for it only before the first later op that touches one of its
// operands (run_device_op: Backend::order_compute_for), so the host never waits and a
// reduce overlaps the backward after it. Without a stream (the in-process
// communicator), the backend's queued work finishes first and the call is synchronous.

// The device memory of the op's operands (null pointers left out).
std::vector<Backend::DeviceRange> operand_ranges(const Program& program, const Op& op, const std::vector<void*>& x) {
  std::vector<Backend::DeviceRange> r;
  r.reserve(x.size());
  for (size_t i = 0; i < x.size() && i < op.operands.size(); ++i)
    if (x[i] != nullptr)
      r.push_back({x[i], static_cast<size_t>(program.tensors.info(op.operands[i].tensor).bytes()),
                   op.operands[i].access != Access::Read});
  return r;
}

// Runs `call` (the communicator's calls of the op) in the collective's order.
template <class Call>
Status ordered_collective(Backend& b, Communicator& c, const Program& program, const Op& op,
                          const std::vector<void*>& x, Call&& call) {
  void* stream = c.stream();
  if (stream == nullptr) {
    SPILLWAY_RETURN_IF_ERROR(b.synchronize());
    return call();
  }
  const Status after = b.order_stream_after_compute(stream);
  if (!after.is_ok()) return after.with_context("op " + op.name);
  c.set_enqueue_only(true);
  const Status done = call();
  c.set_enqueue_only(false);
  // Even a call that failed may have enqueued work: later compute waits for it too.
  const Status ordered = b.order_after_stream(stream, operand_ranges(program, op, x));
  SPILLWAY_RETURN_IF_ERROR(done);
  return ordered.is_ok() ? ordered : ordered.with_context("op " + op.name);
}

Result<Communicator*> communicator_for(Backend& b, const Program& program, const Op& op) {
  Communicator* c = b.communicator();
  if (c == nullptr)
    return Status::invalid_argument("op " + op.name + " (" + op_kind_name(op.kind) +
                                    "): a collective op needs the backend's communicator (Backend::set_communicator)");
  // Sums are f32 or bf16 (the gradient's dtype, every operand the same: the registry's
  // check); the squared norms are f32.
  for (const Operand& o : op.operands) {
    const DType d = program.tensors.info(o.tensor).dtype;
    if (d != DType::F32 && !(d == DType::BF16 && op.kind != OpKind::AllReduceInRankOrder))
      return Status::unsupported("op " + op.name + " (" + op_kind_name(op.kind) + "): tensor '" +
                                 program.tensors.info(o.tensor).name + "' is " + dtype_name(d) +
                                 (op.kind == OpKind::AllReduceInRankOrder ? "; it sums f32 only"
                                                                          : "; collectives take f32 or bf16"));
  }
  if (op.attrs.root >= c->world_size())
    return Status::invalid_argument("op " + op.name + ": root " + std::to_string(op.attrs.root) + " is not a rank of " +
                                    std::to_string(c->world_size()));
  return c;
}

Status run_reduce_gradient(Backend& b, const Program& program, const Op& op, const std::vector<void*>& x,
                           const OptimizerStep&) {
  SPILLWAY_ASSIGN_OR_RETURN(Communicator * c, communicator_for(b, program, op));
  const bool owner = op.kind == OpKind::ReduceGradient;
  if (owner != (op.attrs.root == c->rank()))
    return Status::invalid_argument("op " + op.name + " (" + op_kind_name(op.kind) + ") with root " +
                                    std::to_string(op.attrs.root) + " runs on rank " + std::to_string(c->rank()) +
                                    (owner ? "; only the root reduces" : "; the root reduces, it does not send"));
  const size_t n = static_cast<size_t>(op.attrs.n);
  const int root = static_cast<int>(op.attrs.root);
  return ordered_collective(b, *c, program, op, x, [&]() -> Status {
    if (program.tensors.info(op.operands[0].tensor).dtype == DType::BF16) {
      std::vector<const void*> parts(x.begin() + (owner ? 1 : 0), x.end());
      return c->reduce_bf16_in_rank_order(parts, owner ? x[0] : nullptr, n, root);
    }
    std::vector<const float*> parts;
    for (size_t i = owner ? 1 : 0; i < x.size(); ++i) parts.push_back(f32(x[i]));
    return c->reduce_in_rank_order(parts, owner ? f32w(x[0]) : nullptr, n, root);
  });
}

Status run_all_reduce_in_rank_order(Backend& b, const Program& program, const Op& op, const std::vector<void*>& x,
                                    const OptimizerStep&) {
  SPILLWAY_ASSIGN_OR_RETURN(Communicator * c, communicator_for(b, program, op));
  const size_t n = static_cast<size_t>(op.attrs.n);
  return ordered_collective(b, *c, program, op, x, [&]() -> Status {
    SPILLWAY_RETURN_IF_ERROR(c->reduce_in_rank_order({f32(x[0])}, c->rank() == 0 ? f32w(x[0]) : nullptr, n, 0));
    return c->broadcast(x[0], n * sizeof(float), 0);
  });
}

Status run_broadcast_param(Backend& b, const Program& program, const Op& op, const std::vector<void*>& x,
                           const OptimizerStep&) {
  SPILLWAY_ASSIGN_OR_RETURN(Communicator * c, communicator_for(b, program, op));
  const size_t bytes = static_cast<size_t>(op.attrs.n) * dtype_size(program.tensors.info(op.operands[0].tensor).dtype);
  return ordered_collective(b, *c, program, op, x,
                            [&]() -> Status { return c->broadcast(x[0], bytes, static_cast<int>(op.attrs.root)); });
}

// ZeRO stage 3: the owner copies its parameter into `out`, then every rank's `out`
// receives the owner's (a broadcast on the collective's stream, after the copy).
Status run_gather_param(Backend& b, const Program& program, const Op& op, const std::vector<void*>& x,
                        const OptimizerStep&) {
  SPILLWAY_ASSIGN_OR_RETURN(Communicator * c, communicator_for(b, program, op));
  const bool owner = x.size() > 1 && x[1] != nullptr;
  if (owner != (op.attrs.root == c->rank()))
    return Status::invalid_argument("op " + op.name + " (GatherParam) with root " + std::to_string(op.attrs.root) +
                                    " runs on rank " + std::to_string(c->rank()) +
                                    (owner ? " with the parameter; only the root has it" : " without the parameter"));
  const size_t bytes = static_cast<size_t>(op.attrs.n) * dtype_size(program.tensors.info(op.operands[0].tensor).dtype);
  if (owner) b.copy_device(x[0], x[1], bytes);  // on the compute stream, before the collective's
  return ordered_collective(b, *c, program, op, x,
                            [&]() -> Status { return c->broadcast(x[0], bytes, static_cast<int>(op.attrs.root)); });
}

Status run_adamw(Backend& b, const Program&, const Op& op, const std::vector<void*>& x, const OptimizerStep& step) {
  AdamWHyper h = adamw_hyper(step.lr, step.step, op.attrs.scale);
  b.adamw(x[0], f32w(x[1]), f32w(x[2]), f32w(x[3]), x[4], f32(x[5]), static_cast<size_t>(op.attrs.n), h);
  return Status::ok();
}
Status run_adamw_host(const Op& op, const std::vector<void*>& x, DType param_dtype, const OptimizerStep& step) {
  AdamWHyper h = adamw_hyper(step.lr, step.step, op.attrs.scale);
  adamw_host(param_dtype, x[0], f32w(x[1]), f32w(x[2]), f32w(x[3]), x[4], f32(x[5]), static_cast<size_t>(op.attrs.n), h);
  return Status::ok();
}

// ---- The dispatch table: one entry per OpKind, in enum order ------------------------

using DeviceCall = Status (*)(Backend&, const Program&, const Op&, const std::vector<void*>&, const OptimizerStep&);
using WorkspaceCall = uint64_t (*)(const BackendSizes&, const Op&);
using HostCall = Status (*)(const Op&, const std::vector<void*>&, DType, const OptimizerStep&);

struct DispatchEntry {
  OpKind kind;
  DeviceCall device;
  WorkspaceCall workspace = nullptr;  // nullptr: no device workspace
  HostCall host = nullptr;            // nullptr: no host implementation (op_info(kind).host is false)
};

constexpr DispatchEntry kDeviceOps[] = {
    {OpKind::Zero, run_zero},
    {OpKind::EmbeddingForward, run_embedding_forward},
    {OpKind::EmbeddingBackward, run_embedding_backward, embedding_backward_workspace},
    {OpKind::LayerNormForward, run_layernorm_forward},
    {OpKind::LayerNormBackward, run_layernorm_backward, layernorm_backward_workspace},
    {OpKind::RmsNormForward, run_rmsnorm_forward},
    {OpKind::RmsNormBackward, run_rmsnorm_backward, rmsnorm_backward_workspace},
    {OpKind::MatmulForward, run_matmul_op, matmul_workspace},
    {OpKind::MatmulBackward, run_matmul_op, matmul_workspace},
    {OpKind::MatmulGeluForward, run_matmul_gelu_forward, whole_matmul_workspace},
    {OpKind::MatmulGeluBackward, run_matmul_gelu_backward, whole_matmul_workspace},
    {OpKind::MatmulWeightBackward, run_matmul_weight_backward, whole_matmul_workspace},
    {OpKind::MatmulResidualForward, run_matmul_residual_forward, whole_matmul_workspace},
    {OpKind::AttentionForward, run_attention_forward},
    {OpKind::AttentionBackward, run_attention_backward, attention_backward_workspace},
    {OpKind::GeluForward, run_gelu_forward},
    {OpKind::GeluBackward, run_gelu_backward},
    {OpKind::ResidualForward, run_residual_forward},
    {OpKind::CrossEntropyForward, run_crossentropy_forward},
    {OpKind::CrossEntropyBackward, run_crossentropy_backward},
    {OpKind::RopeForward, run_rope_forward},
    {OpKind::RopeBackward, run_rope_backward},
    {OpKind::SwiGluForward, run_swiglu_forward},
    {OpKind::SwiGluBackward, run_swiglu_backward},
    {OpKind::AccumulateGradient, run_accumulate_gradient},
    {OpKind::SquaredNorm, run_squared_norm, squared_norm_workspace},
    {OpKind::ClipScale, run_clip_scale},
    {OpKind::ReduceGradient, run_reduce_gradient},
    {OpKind::SendGradient, run_reduce_gradient},
    {OpKind::AllReduceInRankOrder, run_all_reduce_in_rank_order},
    {OpKind::BroadcastParam, run_broadcast_param},
    {OpKind::GatherParam, run_gather_param},
    {OpKind::AdamW, run_adamw, nullptr, run_adamw_host},
};

constexpr bool dispatch_complete() {
  for (size_t i = 0; i < std::size(kDeviceOps); ++i)
    if (static_cast<size_t>(kDeviceOps[i].kind) != i || kDeviceOps[i].device == nullptr) return false;
  return true;
}
static_assert(std::size(kDeviceOps) == kOpKindCount, "the dispatch table needs one entry per OpKind");
static_assert(dispatch_complete(), "the dispatch table's entries follow OpKind's order, each with a device call");

const DispatchEntry* dispatch_entry(OpKind k) {
  return static_cast<size_t>(k) < kOpKindCount ? &kDeviceOps[static_cast<size_t>(k)] : nullptr;
}

// The operand count the op's registry slots allow.
Status check_count(const Op& op, const std::vector<void*>& ptrs) {
  const size_t lo = op_required_operands(op.kind), hi = op_info(op.kind).slots.size();
  if (ptrs.size() < lo || ptrs.size() > hi)
    return Status::internal("op " + op.name + " (" + op_kind_name(op.kind) + "): " + std::to_string(ptrs.size()) +
                            " operands, expected " + std::to_string(lo) + (lo == hi ? "" : ".." + std::to_string(hi)));
  return Status::ok();
}

}  // namespace

bool has_host_implementation(OpKind kind) {
  const DispatchEntry* e = dispatch_entry(kind);
  return e != nullptr && e->host != nullptr;
}

Status run_device_op(Backend& b, const Program& program, const Op& op, const std::vector<void*>& x,
                     const OptimizerStep& step) {
  const DispatchEntry* e = dispatch_entry(op.kind);
  if (e == nullptr) return Status::internal("op " + op.name + ": unknown kind");
  SPILLWAY_RETURN_IF_ERROR(check_count(op, x));
  // Compute waits for a collective still on its own stream, or the optimizer's updates
  // on theirs, only where it touches their tensors (collectives are ordered among
  // themselves on their stream). Without either nothing is pending: the ranges are
  // not built (every op of every step passes here).
  if ((b.communicator() != nullptr || b.optimizer_on_own_stream()) && !op_is_collective(op.kind)) {
    const Status waited = b.order_compute_for(operand_ranges(program, op, x));
    if (!waited.is_ok()) return waited.with_context("op " + op.name);
  }
  return e->device(b, program, op, x, step);
}

Result<uint64_t> op_workspace_bytes(const BackendSizes& b, const Program& program, const Op& op) {
  (void)program;
  const DispatchEntry* e = dispatch_entry(op.kind);
  const uint64_t need = e != nullptr && e->workspace != nullptr ? e->workspace(b, op) : 0;
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
    // Collectives run the communicator's kernels, not the backend's (and need the
    // other ranks).
    if (op_is_collective(op.kind)) continue;
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
  const DispatchEntry* e = dispatch_entry(op.kind);
  if (e == nullptr || e->host == nullptr)
    return Status::internal("op " + op.name + " (" + op_kind_name(op.kind) + ") has no host implementation");
  SPILLWAY_RETURN_IF_ERROR(check_count(op, x));
  return e->host(op, x, param_dtype, step);
}

Status run_adamw_host_speculative(const Op& op, void* param, const void* grad, const float* const state[3],
                                  float* const into[3], DType param_dtype, const OptimizerStep& step) {
  if (op.kind != OpKind::AdamW) return Status::internal("op " + op.name + " is not an AdamW: no speculative update");
  const AdamWHyper h = adamw_hyper(step.lr, step.step, op.attrs.scale);
  const float unclipped[2] = {1.0f, 0.0f};
  adamw_host_into(param_dtype, param, state[0], state[1], state[2], into[0], into[1], into[2], grad, unclipped,
                  static_cast<size_t>(op.attrs.n), h);
  return Status::ok();
}

}  // namespace spillway
