// Program: the ordered ops of one training step and the table of tensors they touch.
//
//   Program p;
//   TensorId x = p.tensors.add({"x", DType::F32, {B, T, C}, Role::Activation});
//   TensorId y = p.tensors.add({"y", DType::F32, {B, T, C}, Role::Activation});
//   p.add_op({.kind = OpKind::GeluForward, .name = "h0.gelu",
//             .operands = {{y, Access::Write}, {x, Access::Read}},
//             .attrs = {.n = B * T * C}});
//
// An op's operands come in the order its kind documents (OpKind below). Access says
// what it does to each: Read (must be valid before), Update (read and modified in
// place) or Write (overwritten entirely: nothing to fetch first, DRAGON's write-only
// hint). Ops run on the device unless `place` is Host (the host optimizer).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tensor/tensor.h"

namespace spillway {

enum class Access : uint8_t { Read, Update, Write };

// Operand order for each kind, matching the Backend call of the same name.
enum class OpKind : uint8_t {
  Zero,                  // (t W)
  EmbeddingForward,      // (out W|U, tokens R, wte R, wpe R)                    attrs B T C [V begin]
  EmbeddingBackward,     // (dwte U, dout R, tokens R [, dwpe U])                attrs B T C [V begin]
                         //   wte/dwte may be one vocab tile: V rows from row `begin` (V = 0: the
                         //   whole table); only tokens in the tile are gathered/scattered, so
                         //   the forward's out is Write for the first tile and Update after
  LayerNormForward,      // (out W, mean W, rstd W, inp R, weight R, bias R)     attrs N C
  LayerNormBackward,     // (dinp U, dweight U, dbias U, dout R, inp R, weight R, mean R, rstd R)  attrs N C
  MatmulForward,         // (out W|U, inp R, weight R [, bias R])                attrs N C OC [ld begin block]
  MatmulBackward,        // (dinp W|U, dweight U, dout R, inp R, weight R [, dbias U])  attrs N C OC [ld begin block]
                         //   out/dout may be OC columns from column `begin` of an [N, ld]
                         //   matrix (a tile of the output channels); dinp Update adds into it.
                         //   block > 0: computed as consecutive blocks of `block` output
                         //   channels, dinp summed block by block in order, so tiles made of
                         //   whole blocks give the same bits as the whole op
  AttentionForward,      // (out W, lse W, qkv R)                                attrs B T C NH
  AttentionBackward,     // (dqkv W, dout R, qkv R, out R, lse R)                attrs B T C NH
  GeluForward,           // (out W, inp R)                                       attrs n
  GeluBackward,          // (dinp W, inp R, dout R)                              attrs n
  ResidualForward,       // (out W, a R, b R)                                    attrs n
  CrossEntropyForward,   // (losses W, logits R, targets R)                      attrs N V [ld]
  CrossEntropyBackward,  // (losses W, logits U→dlogits, targets R)              attrs N V [ld], scale
                         //   logits rows ld ≥ V apart (a padded stride), columns past V unused
  SquaredNorm,           // (out_sq W, grad R)                                   attrs n
                         //   or packed (the GPT builder's form): (out_sq[P] U, grad R), writing
                         //   element attrs.index of a P-element F32 tensor zeroed before;
                         //   with attrs.block > 0, one element per segment of `block` elements
                         //   (index, index+1, ...), so a tiled gradient gives the same norms
  ClipScale,             // (scale_norm W, squared_norms[P] R)                   attrs P, scale=max_norm
  AdamW,                 // (param W, master U, m U, v U, grad R, scale_norm R)  attrs n, index=param#, scale=weight_decay
};
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
  Status validate() const;
  // The tensor called `name`, or when it was split into row tiles, the tiles
  // "<name>#0", "<name>#1", ... in row order; empty when neither exists.
  std::vector<TensorId> pieces(const std::string& name) const;
  // Whether t keeps its value from one step to the next, so that it has a home tier:
  // parameters, gradients, master weights, optimizer state, inputs and outputs.
  bool is_persistent(TensorId t) const;
  // Total floating-point operations of the step (for MFU): matrix products only.
  // MatmulForward 2·N·C·OC, MatmulBackward 4·N·C·OC, AttentionForward 2·B·T²·C
  // (causal: half of 4·B·T²·C), AttentionBackward 4·B·T²·C.
  double flops() const;
};

}  // namespace spillway
