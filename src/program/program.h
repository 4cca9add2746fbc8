// Program: the ordered ops of one training step and the table of tensors they touch.
//
//   Program p;
//   TensorId x = p.tensors.add({"x", DType::F32, {B, T, C}, Role::Activation});
//   TensorId y = p.tensors.add({"y", DType::F32, {B, T, C}, Role::Activation});
//   p.add_op({.kind = OpKind::GeluForward, .name = "h0.gelu",
//             .operands = {{y, Access::Write}, {x, Access::Read}},
//             .attrs = {.n = B * T * C}});
//
// An op's operands come in the order of its kind's slots in the op registry
// (program/op_registry.cpp, where each kind's operands and attrs are documented). Access says
// what it does to each: Read (must be valid before), Update (read and modified in
// place) or Write (overwritten entirely: nothing to fetch first, DRAGON's write-only
// hint). Ops run on the device unless `place` is Host (the host optimizer).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "tensor/rope.h"
#include "tensor/tensor.h"

namespace spillway {

// The one naming rule for a tensor split into row tiles (the vocab tiles of the
// embedding and LM head): tile j of "<name>" is "<name>#j".
//   tile_name("transformer.wte.weight", 1) == "transformer.wte.weight#1"
std::string tile_name(const std::string& name, int64_t j);
// The pieces of `name` among the names `find` knows (it returns -1 for a name it does
// not): the whole tensor when it exists, else its tiles "#0", "#1", ... in row order
// (up to the first missing one); empty when neither exists.
std::vector<int64_t> find_pieces(const std::string& name, const std::function<int64_t(const std::string&)>& find);

enum class Access : uint8_t { Read, Update, Write };

// The kinds of op. Each has one entry in the op registry (program/op_registry.h),
// which gives its operand slots in order, its attrs, flops and bytes; its backend
// call is the Backend method of the same name (exec/dispatch.cpp).
enum class OpKind : uint8_t {
  Zero,
  EmbeddingForward,
  EmbeddingBackward,
  LayerNormForward,
  LayerNormBackward,
  RmsNormForward,
  RmsNormBackward,
  MatmulForward,
  MatmulBackward,
  MatmulGeluForward,      // out = gelu(pre), pre = inp·weightᵀ + bias: a product and its GELU in one (GPT-2's fc)
  MatmulGeluBackward,     // dpre = (dout·weight) ∘ gelu'(pre): an input gradient through the GELU (GPT-2's fc2)
  MatmulWeightBackward,   // dweight += doutᵀ·inp, dbias += Σ dout: a product's parameter gradients alone
  MatmulResidualForward,  // out = residual + (inp·weightᵀ + bias): a product and the residual add after it (proj, fc2)
  AttentionForward,
  AttentionBackward,
  GeluForward,
  GeluBackward,
  ResidualForward,
  CrossEntropyForward,
  CrossEntropyBackward,
  RopeForward,
  RopeBackward,
  SwiGluForward,
  SwiGluBackward,
  AccumulateGradient,  // grad += part, elementwise in the activation dtype (bf16 programs' later contributions)
  SquaredNorm,
  ClipScale,
  // Collectives of data-parallel ranks (src/dist), through the backend's Communicator:
  ReduceGradient,        // on the owner: sum of every rank's gradient parts, in rank order
  SendGradient,          // on the other ranks: their parts to the owner
  AllReduceInRankOrder,  // every rank: the sum over ranks in rank order (the squared norms)
  BroadcastParam,        // the owner's parameter to every rank
  GatherParam,           // ZeRO stage 3: the owner's parameter into a copy on every rank, ahead of its use
  AdamW,  // keep it last, or change kOpKindCount
};
// The number of kinds. The registry and the dispatch table static_assert one entry
// for each.
inline constexpr size_t kOpKindCount = static_cast<size_t>(OpKind::AdamW) + 1;
const char* op_kind_name(OpKind k);

enum class Place : uint8_t { Device, Host };
enum class Phase : uint8_t { Forward, Backward, Optimizer };

struct Operand {
  TensorId tensor = kNoTensor;
  Access access = Access::Read;
};

struct OpAttrs {
  int64_t B = 0, T = 0, C = 0, OC = 0, NH = 0, N = 0, V = 0, P = 0;
  int64_t n = 0;
  int64_t index = 0;  // AdamW: which parameter; SquaredNorm: element of out_sq
  int64_t ld = 0;     // Matmul*: row stride of out/dout (0: OC); CrossEntropy*: of logits (0: V)
  int64_t begin = 0;  // Matmul*: first column of out/dout; Embedding*: first vocab row of wte
  int64_t block = 0;  // Matmul*: output channels per block; SquaredNorm: elements per segment
  float scale = 0;    // CrossEntropyBackward: dloss scale; ClipScale: max norm; AdamW: weight decay
  int64_t KVH = 0;    // Attention*, Rope*: key/value heads (0: NH, multi-head attention)
  RopeParams rope = {};  // Rope*
  int64_t root = 0;   // ReduceGradient, SendGradient, BroadcastParam: the owning rank
};

struct Op {
  OpKind kind = OpKind::Zero;
  std::string name;  // "mb0.h3.attn.forward"
  std::vector<Operand> operands;
  OpAttrs attrs;
  Place place = Place::Device;
  Phase phase = Phase::Forward;
  int layer = -1;         // transformer block, -1 outside blocks
  int micro_batch = -1;   // -1 for the optimizer phase
};

struct Program {
  TensorTable tensors;
  std::vector<Op> ops;
  // Tensors the trainer writes before the step (tokens, targets) and reads after it.
  std::vector<TensorId> inputs;
  std::vector<TensorId> outputs;  // losses, clip scale/norm

  size_t add_op(Op op) {
    ops.push_back(std::move(op));
    return ops.size() - 1;
  }
  // Checks operand counts per kind, ids in range, and that every Read operand is
  // produced by an earlier op or is an input/param/master/optstate/grad (state
  // that persists across steps). Names the op and operand on failure.
  // Also: Update operands obey the same rule as Read (they read first); each
  // operand's access, dtype (act = F32 or BF16; stats F32; tokens I32) and element
  // count match its kind's slot and attrs; no tensor appears twice in one op.
  // Each op is checked against its op registry entry (check_op, program/op_registry.h).
  Status validate() const;
  // The tensor called `name`, or when it was split into row tiles, the tiles
  // "<name>#0", "<name>#1", ... in row order; empty when neither exists.
  std::vector<TensorId> pieces(const std::string& name) const;
  // Whether t keeps its value from one step to the next, so that it has a home tier:
  // parameters, gradients, master weights, optimizer state, inputs and outputs.
  bool is_persistent(TensorId t) const;
  // Total floating-point operations of the step (for MFU): matrix products only,
  // the sum of the registry's flops (op_flops): MatmulForward 2·N·C·OC,
  // MatmulBackward 4·N·C·OC, AttentionForward 2·B·T²·C (causal: half of 4·B·T²·C),
  // AttentionBackward 4·B·T²·C.
  double flops() const;
};

}  // namespace spillway
