// The op registry's table: one entry per OpKind, in enum order.
//
// Each entry documents its kind: operand slots in order (W = Write, U = Update,
// R = Read; W|U: Write for the first tile, Update after), the attrs it reads, and
// what its check, flops and bytes compute.
#include "program/op_registry.h"

#include <algorithm>
#include <array>
#include <iterator>
#include <set>
#include <string>

namespace spillway {

namespace {

using A = Access;
using D = SlotDType;

// ---- Shared formulas ----------------------------------------------------------

double tensor_bytes(const Program& program, TensorId t) {
  if (t < 0 || static_cast<size_t>(t) >= program.tensors.size()) return 0;
  return static_cast<double>(program.tensors.info(t).bytes());
}

// The default: each distinct operand once for Read or Write, twice for Update
// (read and written back).
double bytes_per_operand(const Program& program, const Op& op) {
  double bytes = 0;
  std::set<TensorId> seen;
  for (const Operand& o : op.operands) {
    if (!seen.insert(o.tensor).second) continue;
    const double b = tensor_bytes(program, o.tensor);
    bytes += o.access == Access::Update ? 2 * b : b;
  }
  return bytes;
}

// Embedding ops touch only the rows their tokens select: out/dout [B,T,C] written
// or read once, the selected wte rows and wpe rows (when there is a position table,
// slot 3) once each (updated in place for the backward), and the tokens.
double embedding_bytes(const Program& program, const Op& op) {
  const bool forward = op.kind == OpKind::EmbeddingForward;
  const double rows = static_cast<double>(op.attrs.B * op.attrs.T * op.attrs.C);
  const TensorId act = op.operands.size() < 2 ? kNoTensor : op.operands[forward ? 0 : 1].tensor;
  const double elem = rows > 0 ? tensor_bytes(program, act) / rows : 0;
  const bool positions = op.operands.size() > 3;
  const double factor = forward ? (positions ? 3 : 2) : (positions ? 5 : 3);
  return factor * rows * elem + 4 * static_cast<double>(op.attrs.B * op.attrs.T);
}

// ---- Zero: (t W) --------------------------------------------------------------

constexpr OpSlot kZeroSlots[] = {{"t", A::Write, D::Act}};

// ---- Embedding ----------------------------------------------------------------
// EmbeddingForward  (out W|U, tokens R, wte R [, wpe R])     attrs B T C [V begin]
// EmbeddingBackward (dwte U, dout R, tokens R [, dwpe U])    attrs B T C [V begin]
// Without wpe/dwpe (Llama: no position table) out = wte[token] only.
// wte/dwte may be one vocab tile: V rows from row `begin` (V = 0: the whole table);
// only tokens in the tile are gathered/scattered, so the forward's out is Write for
// the first tile and Update after.

constexpr OpSlot kEmbeddingForwardSlots[] = {{"out", A::Write, D::Act, false, true},
                                             {"tokens", A::Read, D::I32},
                                             {"wte", A::Read, D::Act},
                                             {"wpe", A::Read, D::Act, true}};
constexpr OpSlot kEmbeddingBackwardSlots[] = {{"dwte", A::Update, D::Act},
                                              {"dout", A::Read, D::Act},
                                              {"tokens", A::Read, D::I32},
                                              {"dwpe", A::Update, D::Act, true}};

Status check_embedding(const OpCheck& c) {
  const OpAttrs& a = c.attrs();
  SPILLWAY_RETURN_IF_ERROR(c.positive({{"B", a.B}, {"T", a.T}, {"C", a.C}}));
  if (a.V < 0 || a.begin < 0)
    return c.fail("attrs.V " + std::to_string(a.V) + " and attrs.begin " + std::to_string(a.begin) +
                  " must not be negative");
  const bool fwd = c.op().kind == OpKind::EmbeddingForward;
  const size_t act = fwd ? 0 : 1, tokens = fwd ? 1 : 2, wte = fwd ? 2 : 0, wpe = 3;
  SPILLWAY_RETURN_IF_ERROR(c.numel_is(act, a.B * a.T * a.C, "B*T*C"));
  SPILLWAY_RETURN_IF_ERROR(c.numel_is(tokens, a.B * a.T, "B*T"));
  if (a.V > 0) SPILLWAY_RETURN_IF_ERROR(c.numel_is(wte, a.V * a.C, "V*C (rows of the vocab tile)"));
  SPILLWAY_RETURN_IF_ERROR(c.rows_of(wte, a.C, 1, "rows of C"));
  if (wpe < c.operands()) return c.rows_of(wpe, a.C, a.T, "at least T rows of C");
  return Status::ok();
}

// ---- LayerNorm ----------------------------------------------------------------
// LayerNormForward  (out W, mean W, rstd W, inp R, weight R, bias R)                    attrs N C
// LayerNormBackward (dinp U, dweight U, dbias U, dout R, inp R, weight R, mean R, rstd R)  attrs N C

constexpr OpSlot kLayerNormForwardSlots[] = {{"out", A::Write, D::Act},   {"mean", A::Write, D::F32},
                                             {"rstd", A::Write, D::F32},  {"inp", A::Read, D::Act},
                                             {"weight", A::Read, D::Act}, {"bias", A::Read, D::Act}};
constexpr OpSlot kLayerNormBackwardSlots[] = {{"dinp", A::Update, D::Act},    {"dweight", A::Update, D::Act},
                                              {"dbias", A::Update, D::Act},   {"dout", A::Read, D::Act},
                                              {"inp", A::Read, D::Act},       {"weight", A::Read, D::Act},
                                              {"mean", A::Read, D::F32},      {"rstd", A::Read, D::F32}};

Status check_layernorm_forward(const OpCheck& c) {
  const OpAttrs& a = c.attrs();
  SPILLWAY_RETURN_IF_ERROR(c.positive({{"N", a.N}, {"C", a.C}}));
  SPILLWAY_RETURN_IF_ERROR(c.numel_is(0, a.N * a.C, "N*C"));
  SPILLWAY_RETURN_IF_ERROR(c.numel_is(1, a.N, "N"));
  SPILLWAY_RETURN_IF_ERROR(c.numel_is(2, a.N, "N"));
  SPILLWAY_RETURN_IF_ERROR(c.numel_is(3, a.N * a.C, "N*C"));
  SPILLWAY_RETURN_IF_ERROR(c.numel_is(4, a.C, "C"));
  return c.numel_is(5, a.C, "C");
}

Status check_layernorm_backward(const OpCheck& c) {
  const OpAttrs& a = c.attrs();
  SPILLWAY_RETURN_IF_ERROR(c.positive({{"N", a.N}, {"C", a.C}}));
  SPILLWAY_RETURN_IF_ERROR(c.numel_is(0, a.N * a.C, "N*C"));
  SPILLWAY_RETURN_IF_ERROR(c.numel_is(1, a.C, "C"));
  SPILLWAY_RETURN_IF_ERROR(c.numel_is(2, a.C, "C"));
  SPILLWAY_RETURN_IF_ERROR(c.numel_is(3, a.N * a.C, "N*C"));
  SPILLWAY_RETURN_IF_ERROR(c.numel_is(4, a.N * a.C, "N*C"));
  SPILLWAY_RETURN_IF_ERROR(c.numel_is(5, a.C, "C"));
  SPILLWAY_RETURN_IF_ERROR(c.numel_is(6, a.N, "N"));
  return c.numel_is(7, a.N, "N");
}

// ---- RMSNorm (Llama) --------------------------------------------------------------
// RmsNormForward  (out W, rstd W, inp R, weight R)                      attrs N C, scale = eps
// RmsNormBackward (dinp U, dweight U, dout R, inp R, weight R, rstd R)  attrs N C
// rstd = 1/sqrt(mean(inp²) + eps) per row; dinp and dweight are added into.

constexpr OpSlot kRmsNormForwardSlots[] = {{"out", A::Write, D::Act},
                                           {"rstd", A::Write, D::F32},
                                           {"inp", A::Read, D::Act},
                                           {"weight", A::Read, D::Act}};
constexpr OpSlot kRmsNormBackwardSlots[] = {{"dinp", A::Update, D::Act}, {"dweight", A::Update, D::Act},
                                            {"dout", A::Read, D::Act},   {"inp", A::Read, D::Act},
                                            {"weight", A::Read, D::Act}, {"rstd", A::Read, D::F32}};

Status check_rmsnorm_forward(const OpCheck& c) {
  const OpAttrs& a = c.attrs();
  SPILLWAY_RETURN_IF_ERROR(c.positive({{"N", a.N}, {"C", a.C}}));
  if (!(a.scale > 0)) return c.fail("attrs.scale (eps) is " + std::to_string(a.scale) + "; must be positive");
  SPILLWAY_RETURN_IF_ERROR(c.numel_is(0, a.N * a.C, "N*C"));
  SPILLWAY_RETURN_IF_ERROR(c.numel_is(1, a.N, "N"));
  SPILLWAY_RETURN_IF_ERROR(c.numel_is(2, a.N * a.C, "N*C"));
  return c.numel_is(3, a.C, "C");
}

Status check_rmsnorm_backward(const OpCheck& c) {
  const OpAttrs& a = c.attrs();
  SPILLWAY_RETURN_IF_ERROR(c.positive({{"N", a.N}, {"C", a.C}}));
  SPILLWAY_RETURN_IF_ERROR(c.numel_is(0, a.N * a.C, "N*C"));
  SPILLWAY_RETURN_IF_ERROR(c.numel_is(1, a.C, "C"));
  SPILLWAY_RETURN_IF_ERROR(c.numel_is(2, a.N * a.C, "N*C"));
  SPILLWAY_RETURN_IF_ERROR(c.numel_is(3, a.N * a.C, "N*C"));
  SPILLWAY_RETURN_IF_ERROR(c.numel_is(4, a.C, "C"));
  return c.numel_is(5, a.N, "N");
}

// ---- Matmul -------------------------------------------------------------------
// MatmulForward  (out W|U, inp R, weight R [, bias R])                    attrs N C OC [ld begin block]
// MatmulBackward (dinp W|U, dweight U, dout R, inp R, weight R [, dbias U])  attrs N C OC [ld begin block]
// out/dout may be OC columns from column `begin` of an [N, ld] matrix (a tile of the
// output channels); dinp Update adds into it. block > 0: computed as consecutive
// blocks of `block` output channels, dinp summed block by block in order, so tiles
// made of whole blocks give the same bits as the whole op.

constexpr OpSlot kMatmulForwardSlots[] = {{"out", A::Write, D::Act, false, true},
                                          {"inp", A::Read, D::Act},
                                          {"weight", A::Read, D::Act},
                                          {"bias", A::Read, D::Act, true}};
constexpr OpSlot kMatmulBackwardSlots[] = {{"dinp", A::Write, D::Act, false, true},
                                           {"dweight", A::Update, D::Act},
                                           {"dout", A::Read, D::Act},
                                           {"inp", A::Read, D::Act},
                                           {"weight", A::Read, D::Act},
                                           {"dbias", A::Update, D::Act, true}};

Status check_matmul(const OpCheck& c) {
  const OpAttrs& a = c.attrs();
  SPILLWAY_RETURN_IF_ERROR(c.positive({{"N", a.N}, {"C", a.C}, {"OC", a.OC}}));
  const int64_t ld = a.ld == 0 ? a.OC : a.ld;
  if (a.begin < 0 || a.block < 0 || a.begin + a.OC > ld)
    return c.fail("columns [" + std::to_string(a.begin) + ", " + std::to_string(a.begin + a.OC) + ") with block " +
                  std::to_string(a.block) + " do not fit rows of ld = " + std::to_string(ld));
  const bool fwd = c.op().kind == OpKind::MatmulForward;
  // A column block of out/dout: a Write of the first tile leaves the other columns.
  SPILLWAY_RETURN_IF_ERROR(c.numel_is(fwd ? 0 : 2, a.N * ld, "N*ld (ld = OC unless given)"));
  SPILLWAY_RETURN_IF_ERROR(c.numel_is(fwd ? 1 : 3, a.N * a.C, "N*C"));
  SPILLWAY_RETURN_IF_ERROR(c.numel_is(fwd ? 2 : 4, a.OC * a.C, "OC*C"));
  if (fwd) return c.numel_is(3, a.OC, "OC");
  SPILLWAY_RETURN_IF_ERROR(c.numel_is(0, a.N * a.C, "N*C"));
  SPILLWAY_RETURN_IF_ERROR(c.numel_is(1, a.OC * a.C, "OC*C"));
  return c.numel_is(5, a.OC, "OC");
}

// A product and the elementwise op beside it, so that a backend can run that op in
// the product's epilogue: the GELU of GPT-2's MLP (cuBLASLt GELU_AUX_BIAS and DGELU)
// and the residual add after a block's proj and fc2 (beta = 1, the residual as C);
// and the parameter gradients of a product apart from its input gradient. Whole
// products only (ld, begin and block 0). No op needs more device memory than the
// MatmulBackward and GeluBackward it replaces; MatmulResidualForward replaces a
// MatmulForward, a ResidualForward and the [N,OC] scratch between them, and where
// C ≥ OC (a block's proj and fc2) its working set is below the MatmulBackward's of
// the same product.
// MatmulGeluForward    (out W, pre W, inp R, weight R [, bias R])   attrs N C OC
//   pre[N,OC] = inp·weightᵀ + bias, out[N,OC] = gelu(pre) (tanh approximation)
// MatmulGeluBackward   (dpre W, dout R, weight R, pre R)            attrs N C OC
//   the input gradient of a product whose input was gelu(pre) [N,C], carried through
//   the GELU: dpre[N,C] = (dout[N,OC]·weight[OC,C]) ∘ gelu'(pre)
// MatmulWeightBackward (dweight U, dout R, inp R [, dbias U])       attrs N C OC
//   dweight[OC,C] += doutᵀ·inp, dbias[OC] += Σ_n dout
// MatmulResidualForward (out W, inp R, weight R, residual R [, bias R])  attrs N C OC
//   out[N,OC] = residual[N,OC] + (inp·weightᵀ + bias): a product and the residual add
//   after it (cuBLASLt: beta = 1 with residual as C); out is not residual
constexpr OpSlot kMatmulGeluForwardSlots[] = {{"out", A::Write, D::Act},
                                              {"pre", A::Write, D::Act},
                                              {"inp", A::Read, D::Act},
                                              {"weight", A::Read, D::Act},
                                              {"bias", A::Read, D::Act, true}};
constexpr OpSlot kMatmulGeluBackwardSlots[] = {
    {"dpre", A::Write, D::Act}, {"dout", A::Read, D::Act}, {"weight", A::Read, D::Act}, {"pre", A::Read, D::Act}};
constexpr OpSlot kMatmulWeightBackwardSlots[] = {
    {"dweight", A::Update, D::Act}, {"dout", A::Read, D::Act}, {"inp", A::Read, D::Act}, {"dbias", A::Update, D::Act, true}};
constexpr OpSlot kMatmulResidualForwardSlots[] = {{"out", A::Write, D::Act},
                                                  {"inp", A::Read, D::Act},
                                                  {"weight", A::Read, D::Act},
                                                  {"residual", A::Read, D::Act},
                                                  {"bias", A::Read, D::Act, true}};

Status check_whole_matmul(const OpCheck& c) {
  const OpAttrs& a = c.attrs();
  SPILLWAY_RETURN_IF_ERROR(c.positive({{"N", a.N}, {"C", a.C}, {"OC", a.OC}}));
  if (a.ld != 0 || a.begin != 0 || a.block != 0)
    return c.fail("attrs ld = " + std::to_string(a.ld) + ", begin = " + std::to_string(a.begin) + ", block = " +
                  std::to_string(a.block) + ": this product is whole (all three 0)");
  const int64_t nc = a.N * a.C, noc = a.N * a.OC, w = a.OC * a.C;
  switch (c.op().kind) {
    case OpKind::MatmulGeluForward:
      SPILLWAY_RETURN_IF_ERROR(c.numel_is(0, noc, "N*OC"));
      SPILLWAY_RETURN_IF_ERROR(c.numel_is(1, noc, "N*OC"));
      SPILLWAY_RETURN_IF_ERROR(c.numel_is(2, nc, "N*C"));
      SPILLWAY_RETURN_IF_ERROR(c.numel_is(3, w, "OC*C"));
      return c.numel_is(4, a.OC, "OC");
    case OpKind::MatmulGeluBackward:
      SPILLWAY_RETURN_IF_ERROR(c.numel_is(0, nc, "N*C"));
      SPILLWAY_RETURN_IF_ERROR(c.numel_is(1, noc, "N*OC"));
      SPILLWAY_RETURN_IF_ERROR(c.numel_is(2, w, "OC*C"));
      return c.numel_is(3, nc, "N*C");
    case OpKind::MatmulResidualForward:
      SPILLWAY_RETURN_IF_ERROR(c.numel_is(0, noc, "N*OC"));
      SPILLWAY_RETURN_IF_ERROR(c.numel_is(1, nc, "N*C"));
      SPILLWAY_RETURN_IF_ERROR(c.numel_is(2, w, "OC*C"));
      SPILLWAY_RETURN_IF_ERROR(c.numel_is(3, noc, "N*OC"));
      return c.numel_is(4, a.OC, "OC");
    default:  // MatmulWeightBackward
      SPILLWAY_RETURN_IF_ERROR(c.numel_is(0, w, "OC*C"));
      SPILLWAY_RETURN_IF_ERROR(c.numel_is(1, noc, "N*OC"));
      SPILLWAY_RETURN_IF_ERROR(c.numel_is(2, nc, "N*C"));
      return c.numel_is(3, a.OC, "OC");
  }
}

// The bytes of the elementwise part of a fused op, as its own kind's op would move
// them: kTensors tensors of operand 0's size. The GELU of MatmulGeluForward as
// GeluForward (pre read, out written: 2), of MatmulGeluBackward as GeluBackward (pre
// and the product read, dpre written: 3); the add of MatmulResidualForward as
// ResidualForward (residual and the product read, out written: 3).
template <int kTensors>
double elementwise_part_bytes(const Program& program, const Op& op) {
  return kTensors * static_cast<double>(program.tensors.info(op.operands[0].tensor).bytes());
}

// One product: 2·N·C·OC (MatmulForward, and each half of MatmulBackward).
double matmul_forward_flops(const OpAttrs& a) { return 2.0 * a.N * a.C * a.OC; }
// dinp = dout·W and dW += doutᵀ·inp.
double matmul_backward_flops(const OpAttrs& a) { return 4.0 * a.N * a.C * a.OC; }

// ---- Attention ----------------------------------------------------------------
// AttentionForward  (out W, lse W, qkv R)                     attrs B T C NH [KVH]
// AttentionBackward (dqkv W, dout R, qkv R, out R, lse R)     attrs B T C NH [KVH]
// qkv/dqkv [B,T,(NH+2·KVH)·D] with D = C/NH: NH query heads, then KVH key heads, then
// KVH value heads (KVH = 0: NH, so [q C | k C | v C]); query head h reads key/value
// head h / (NH/KVH). out/dout [B,T,C]; lse [B,NH,T]. The flops count the query heads.

constexpr OpSlot kAttentionForwardSlots[] = {
    {"out", A::Write, D::Act}, {"lse", A::Write, D::F32}, {"qkv", A::Read, D::Act}};
constexpr OpSlot kAttentionBackwardSlots[] = {{"dqkv", A::Write, D::Act},
                                              {"dout", A::Read, D::Act},
                                              {"qkv", A::Read, D::Act},
                                              {"out", A::Read, D::Act},
                                              {"lse", A::Read, D::F32}};

// Heads: B, T, C, NH positive, C a multiple of NH, KVH (0: NH) dividing NH.
Status check_heads(const OpCheck& c) {
  const OpAttrs& a = c.attrs();
  SPILLWAY_RETURN_IF_ERROR(c.positive({{"B", a.B}, {"T", a.T}, {"C", a.C}, {"NH", a.NH}}));
  if (a.C % a.NH != 0)
    return c.fail("attrs.C = " + std::to_string(a.C) + " is not divisible by attrs.NH = " + std::to_string(a.NH));
  if (a.KVH < 0 || (a.KVH > 0 && a.NH % a.KVH != 0))
    return c.fail("attrs.KVH = " + std::to_string(a.KVH) + " does not divide attrs.NH = " + std::to_string(a.NH) +
                  " (key/value heads: 0 for NH, or a divisor of NH)");
  return Status::ok();
}

// Elements of a qkv tensor: B*T*(NH+2*KVH)*(C/NH), KVH = 0 meaning NH.
int64_t qkv_elements(const OpAttrs& a) {
  const int64_t kvh = a.KVH == 0 ? a.NH : a.KVH;
  return a.B * a.T * (a.NH + 2 * kvh) * (a.C / a.NH);
}
constexpr const char* kQkvFormula = "B*T*(NH+2*KVH)*C/NH";

Status check_attention(const OpCheck& c) {
  const OpAttrs& a = c.attrs();
  SPILLWAY_RETURN_IF_ERROR(check_heads(c));
  const int64_t btc = a.B * a.T * a.C, lse = a.B * a.NH * a.T, qkv = qkv_elements(a);
  if (c.op().kind == OpKind::AttentionForward) {
    SPILLWAY_RETURN_IF_ERROR(c.numel_is(0, btc, "B*T*C"));
    SPILLWAY_RETURN_IF_ERROR(c.numel_is(1, lse, "B*NH*T"));
    return c.numel_is(2, qkv, kQkvFormula);
  }
  SPILLWAY_RETURN_IF_ERROR(c.numel_is(0, qkv, kQkvFormula));
  SPILLWAY_RETURN_IF_ERROR(c.numel_is(1, btc, "B*T*C"));
  SPILLWAY_RETURN_IF_ERROR(c.numel_is(2, qkv, kQkvFormula));
  SPILLWAY_RETURN_IF_ERROR(c.numel_is(3, btc, "B*T*C"));
  return c.numel_is(4, lse, "B*NH*T");
}

// Q·Kᵀ and P·V are 2·B·T²·C each without a mask; the causal mask halves the work
// actually needed: 4·B·T²·C / 2.
double attention_forward_flops(const OpAttrs& a) { return 2.0 * a.B * a.T * a.T * a.C; }
// Twice the forward (dQ, dK from dS; dV, dP).
double attention_backward_flops(const OpAttrs& a) { return 4.0 * a.B * a.T * a.T * a.C; }
// The kernel recomputes P and runs four more products: 2.5× the forward.
double attention_backward_cost_flops(const OpAttrs& a) { return 5.0 * a.B * a.T * a.T * a.C; }

// ---- Elementwise --------------------------------------------------------------
// GeluForward     (out W, inp R)           attrs n
// GeluBackward    (dinp W, inp R, dout R)  attrs n
// ResidualForward (out W, a R, b R)        attrs n

constexpr OpSlot kGeluForwardSlots[] = {{"out", A::Write, D::Act}, {"inp", A::Read, D::Act}};
constexpr OpSlot kGeluBackwardSlots[] = {
    {"dinp", A::Write, D::Act}, {"inp", A::Read, D::Act}, {"dout", A::Read, D::Act}};
constexpr OpSlot kResidualForwardSlots[] = {{"out", A::Write, D::Act}, {"a", A::Read, D::Act}, {"b", A::Read, D::Act}};

// Every operand has n elements.
Status check_elementwise(const OpCheck& c) {
  SPILLWAY_RETURN_IF_ERROR(c.positive({{"n", c.attrs().n}}));
  for (size_t i = 0; i < c.operands(); ++i) SPILLWAY_RETURN_IF_ERROR(c.numel_is(i, c.attrs().n, "n"));
  return Status::ok();
}

// ---- CrossEntropy -------------------------------------------------------------
// CrossEntropyForward  (losses W, logits R, targets R)          attrs N V [ld]
// CrossEntropyBackward (losses W, logits U→dlogits, targets R)  attrs N V [ld], scale = dloss scale
// logits rows ld ≥ V apart (a padded stride), columns past V unused.

constexpr OpSlot kCrossEntropyForwardSlots[] = {
    {"losses", A::Write, D::F32}, {"logits", A::Read, D::Act}, {"targets", A::Read, D::I32}};
constexpr OpSlot kCrossEntropyBackwardSlots[] = {
    {"losses", A::Write, D::F32}, {"logits", A::Update, D::Act}, {"targets", A::Read, D::I32}};

Status check_crossentropy(const OpCheck& c) {
  const OpAttrs& a = c.attrs();
  SPILLWAY_RETURN_IF_ERROR(c.positive({{"N", a.N}, {"V", a.V}}));
  if (a.ld != 0 && a.ld < a.V)
    return c.fail("attrs.ld " + std::to_string(a.ld) + " is below attrs.V " + std::to_string(a.V));
  SPILLWAY_RETURN_IF_ERROR(c.numel_is(0, a.N, "N"));
  SPILLWAY_RETURN_IF_ERROR(c.numel_is(1, a.N * (a.ld == 0 ? a.V : a.ld), "N*ld (ld = V unless given)"));
  return c.numel_is(2, a.N, "N");
}

// ---- RoPE (Llama) -------------------------------------------------------------
// RopeForward  (out W, inp R)    attrs B T C NH [KVH] rope
// RopeBackward (dinp W, dout R)  attrs B T C NH [KVH] rope
// Both [B,T,(NH+2·KVH)·D], D = C/NH, laid out as attention's qkv: the q and k heads
// are turned by position t (tensor/rope.h), the v heads copied; the backward turns
// the gradient back (the transpose). D must be even (pairs i, i + D/2).

constexpr OpSlot kRopeForwardSlots[] = {{"out", A::Write, D::Act}, {"inp", A::Read, D::Act}};
constexpr OpSlot kRopeBackwardSlots[] = {{"dinp", A::Write, D::Act}, {"dout", A::Read, D::Act}};

Status check_rope(const OpCheck& c) {
  const OpAttrs& a = c.attrs();
  SPILLWAY_RETURN_IF_ERROR(check_heads(c));
  const int64_t D = a.C / a.NH;
  if (D % 2 != 0) return c.fail("head size C/NH = " + std::to_string(D) + " is odd; rotary pairs need an even one");
  const RopeParams& r = a.rope;
  if (!(r.theta > 0)) return c.fail("attrs.rope.theta is " + std::to_string(r.theta) + "; must be positive");
  if (r.llama3) {
    if (!(r.factor > 0) || !(r.low_freq_factor > 0) || !(r.high_freq_factor > r.low_freq_factor) ||
        r.original_context <= 0)
      return c.fail("attrs.rope (llama3) has factor " + std::to_string(r.factor) + ", low_freq_factor " +
                    std::to_string(r.low_freq_factor) + ", high_freq_factor " + std::to_string(r.high_freq_factor) +
                    ", original_context " + std::to_string(r.original_context) +
                    "; need factor > 0, 0 < low_freq_factor < high_freq_factor, original_context > 0");
  }
  SPILLWAY_RETURN_IF_ERROR(c.numel_is(0, qkv_elements(a), kQkvFormula));
  return c.numel_is(1, qkv_elements(a), kQkvFormula);
}

// ---- SwiGLU (Llama MLP) ---------------------------------------------------------
// SwiGluForward  (out W, inp R)           attrs N, C = I
// SwiGluBackward (dinp W, inp R, dout R)  attrs N, C = I
// inp/dinp [N, 2I] = [gate | up] per row; out/dout [N, I]: out = silu(gate) · up.

constexpr OpSlot kSwiGluForwardSlots[] = {{"out", A::Write, D::Act}, {"inp", A::Read, D::Act}};
constexpr OpSlot kSwiGluBackwardSlots[] = {
    {"dinp", A::Write, D::Act}, {"inp", A::Read, D::Act}, {"dout", A::Read, D::Act}};

Status check_swiglu(const OpCheck& c) {
  const OpAttrs& a = c.attrs();
  SPILLWAY_RETURN_IF_ERROR(c.positive({{"N", a.N}, {"C", a.C}}));
  if (c.op().kind == OpKind::SwiGluForward) {
    SPILLWAY_RETURN_IF_ERROR(c.numel_is(0, a.N * a.C, "N*C"));
    return c.numel_is(1, 2 * a.N * a.C, "N*2C (gate | up)");
  }
  SPILLWAY_RETURN_IF_ERROR(c.numel_is(0, 2 * a.N * a.C, "N*2C (gate | up)"));
  SPILLWAY_RETURN_IF_ERROR(c.numel_is(1, 2 * a.N * a.C, "N*2C (gate | up)"));
  return c.numel_is(2, a.N * a.C, "N*C");
}

// ---- SquaredNorm: (out_sq W, grad R)  attrs n -----------------------------------
// or packed (the GPT builder's form): (out_sq[P] U, grad R), writing element
// attrs.index of a P-element F32 tensor zeroed before; with attrs.block > 0, one
// element per segment of `block` elements (index, index+1, ...), so a tiled gradient
// gives the same norms.

constexpr OpSlot kSquaredNormSlots[] = {{"out_sq", A::Write, D::F32, false, true}, {"grad", A::Read, D::Act}};

Status check_squared_norm(const OpCheck& c) {
  const OpAttrs& a = c.attrs();
  SPILLWAY_RETURN_IF_ERROR(c.positive({{"n", a.n}}));
  if (a.block < 0) return c.fail("attrs.block is " + std::to_string(a.block) + "; must not be negative");
  const int64_t segments = a.block > 0 ? (a.n + a.block - 1) / a.block : 1;
  if (c.access(0) == Access::Write) {
    SPILLWAY_RETURN_IF_ERROR(c.numel_is(0, 1, "1"));
    if (a.index != 0 || segments != 1)
      return c.fail("attrs.index is " + std::to_string(a.index) + " with " + std::to_string(segments) +
                    " segments; a written out_sq has one element");
  } else {
    int64_t len = c.numel(0);
    if (a.index < 0 || a.index + segments > len)
      return c.fail("elements [" + std::to_string(a.index) + ", " + std::to_string(a.index + segments) +
                    ") are outside out_sq's " + std::to_string(len) + " elements");
  }
  return c.numel_is(1, a.n, "n");
}

// ---- AccumulateGradient: (grad U, part R)  attrs n ----------------------------------
// grad = grad + part, elementwise, rounded to the activation dtype (the residual
// kernel, in place): bf16 training programs form each contribution to a gradient
// after the step's first in a zeroed part of its own and add it here, so that a
// data-parallel owner adding the ranks' parts in order gets the same bits (model.h,
// "Gradient accumulation"; dist/data_parallel.h).

constexpr OpSlot kAccumulateGradientSlots[] = {{"grad", A::Update, D::Act}, {"part", A::Read, D::Act}};

Status check_same_dtype(const OpCheck& c) {
  const DType first = c.program().tensors.info(c.op().operands[0].tensor).dtype;
  for (size_t i = 1; i < c.operands(); ++i)
    if (c.program().tensors.info(c.op().operands[i].tensor).dtype != first)
      return c.fail_operand(i, std::string("has dtype ") +
                                   dtype_name(c.program().tensors.info(c.op().operands[i].tensor).dtype) +
                                   "; operand 0 has " + dtype_name(first) + " (all must match)");
  return Status::ok();
}

Status check_accumulate_gradient(const OpCheck& c) {
  SPILLWAY_RETURN_IF_ERROR(check_elementwise(c));
  return check_same_dtype(c);
}

// ---- ClipScale: (scale_norm W, squared_norms[P] R)  attrs P, scale = max norm ----

constexpr OpSlot kClipScaleSlots[] = {{"scale_norm", A::Write, D::F32}, {"squared_norms", A::Read, D::F32}};

Status check_clip_scale(const OpCheck& c) {
  if (c.attrs().P < 1) return c.fail("attrs.P is " + std::to_string(c.attrs().P) + "; need at least 1");
  SPILLWAY_RETURN_IF_ERROR(c.numel_is(0, 2, "2 (scale, norm)"));
  return c.numel_is(1, c.attrs().P, "P");
}

// ---- Collectives (data-parallel ranks, src/dist) -----------------------------------
// ReduceGradient       (sum W, part0 R [, part1 R ... part7 R])  attrs n, root = this rank
// SendGradient         (part0 R [, part1 R ... part7 R])         attrs n, root = the owner
// AllReduceInRankOrder (buf U)                         attrs n
// BroadcastParam       (param U)                       attrs n, root = the owner
// GatherParam          (out W [, param R])             attrs n, root = the owner; the
//                      owner gives its parameter, every rank's `out` receives a copy
// Every operand has n elements, and the parts and the sum one dtype: the program's
// activation dtype (a bf16 parameter is broadcast as bf16). F32: the owner's sum is,
// per element, +0 plus every rank's parts in rank order and, within a rank, part order
// (Communicator::reduce_in_rank_order): one rank's accumulation of its micro-batches.
// BF16: rank 0's first part, then every other part added in that order, each addition
// in fp32 rounded to bf16 (Communicator::reduce_bf16_in_rank_order): one bf16 rank's
// AccumulateGradient ops. A gradient with two contributions per micro-batch (tied
// embeddings) has two parts; a rank of A micro-batches has A times as many (at most 8
// in all).
// AllReduceInRankOrder leaves that sum over ranks on every rank (exact for the packed
// squared norms, whose elements are non-zero on their owner only). Every rank runs
// the matching op at the same point of its program.

constexpr OpSlot kReduceGradientSlots[] = {
    {"sum", A::Write, D::Act},           {"part0", A::Read, D::Act},       {"part1", A::Read, D::Act, true},
    {"part2", A::Read, D::Act, true},    {"part3", A::Read, D::Act, true}, {"part4", A::Read, D::Act, true},
    {"part5", A::Read, D::Act, true},    {"part6", A::Read, D::Act, true}, {"part7", A::Read, D::Act, true}};
constexpr OpSlot kSendGradientSlots[] = {
    {"part0", A::Read, D::Act},       {"part1", A::Read, D::Act, true}, {"part2", A::Read, D::Act, true},
    {"part3", A::Read, D::Act, true}, {"part4", A::Read, D::Act, true}, {"part5", A::Read, D::Act, true},
    {"part6", A::Read, D::Act, true}, {"part7", A::Read, D::Act, true}};
constexpr OpSlot kAllReduceSlots[] = {{"buf", A::Update, D::F32}};
constexpr OpSlot kBroadcastParamSlots[] = {{"param", A::Update, D::Act}};
constexpr OpSlot kGatherParamSlots[] = {{"out", A::Write, D::Act}, {"param", A::Read, D::Act, true}};

Status check_collective(const OpCheck& c) {
  SPILLWAY_RETURN_IF_ERROR(c.positive({{"n", c.attrs().n}}));
  if (c.attrs().root < 0) return c.fail("attrs.root is " + std::to_string(c.attrs().root) + "; must be a rank (>= 0)");
  for (size_t i = 0; i < c.operands(); ++i) SPILLWAY_RETURN_IF_ERROR(c.numel_is(i, c.attrs().n, "n"));
  return check_same_dtype(c);
}

// ---- AdamW: (param W, master U, m U, v U, grad R, scale_norm R) ------------------
// attrs n, index = parameter number, scale = weight decay. Runs on host where its
// master weights rest (run_host_op).

constexpr OpSlot kAdamWSlots[] = {{"param", A::Write, D::Act, false, false, true},
                                  {"master", A::Update, D::F32, false, false, true},
                                  {"m", A::Update, D::F32, false, false, true},
                                  {"v", A::Update, D::F32, false, false, true},
                                  {"grad", A::Read, D::Act, false, false, true},
                                  {"scale_norm", A::Read, D::F32}};

Status check_adamw(const OpCheck& c) {
  const OpAttrs& a = c.attrs();
  SPILLWAY_RETURN_IF_ERROR(c.positive({{"n", a.n}}));
  if (a.index < 0) return c.fail("attrs.index is " + std::to_string(a.index) + "; must be >= 0");
  for (size_t i = 0; i < 5; ++i) SPILLWAY_RETURN_IF_ERROR(c.numel_is(i, a.n, "n"));
  return c.numel_is(5, 2, "2 (scale, norm)");
}

// ---- The table ----------------------------------------------------------------

constexpr OpKindInfo kOpKinds[] = {
    {.kind = OpKind::Zero, .name = "Zero", .slots = kZeroSlots},
    {.kind = OpKind::EmbeddingForward, .name = "EmbeddingForward", .slots = kEmbeddingForwardSlots,
     .check = check_embedding, .bytes = embedding_bytes},
    {.kind = OpKind::EmbeddingBackward, .name = "EmbeddingBackward", .slots = kEmbeddingBackwardSlots,
     .check = check_embedding, .bytes = embedding_bytes},
    {.kind = OpKind::LayerNormForward, .name = "LayerNormForward", .slots = kLayerNormForwardSlots,
     .check = check_layernorm_forward},
    {.kind = OpKind::LayerNormBackward, .name = "LayerNormBackward", .slots = kLayerNormBackwardSlots,
     .check = check_layernorm_backward},
    {.kind = OpKind::RmsNormForward, .name = "RmsNormForward", .slots = kRmsNormForwardSlots,
     .check = check_rmsnorm_forward},
    {.kind = OpKind::RmsNormBackward, .name = "RmsNormBackward", .slots = kRmsNormBackwardSlots,
     .check = check_rmsnorm_backward},
    {.kind = OpKind::MatmulForward, .name = "MatmulForward", .slots = kMatmulForwardSlots, .check = check_matmul,
     .flops = matmul_forward_flops, .op_class = OpClass::Matmul},
    {.kind = OpKind::MatmulBackward, .name = "MatmulBackward", .slots = kMatmulBackwardSlots, .check = check_matmul,
     .flops = matmul_backward_flops, .op_class = OpClass::Matmul},
    {.kind = OpKind::MatmulGeluForward, .name = "MatmulGeluForward", .slots = kMatmulGeluForwardSlots,
     .check = check_whole_matmul, .flops = matmul_forward_flops, .op_class = OpClass::Matmul,
     .priced_as = OpKind::MatmulForward, .priced_with = OpKind::GeluForward,
     .priced_with_bytes = elementwise_part_bytes<2>},
    {.kind = OpKind::MatmulGeluBackward, .name = "MatmulGeluBackward", .slots = kMatmulGeluBackwardSlots,
     .check = check_whole_matmul, .flops = matmul_forward_flops, .op_class = OpClass::Matmul,
     .priced_as = OpKind::MatmulBackward, .priced_with = OpKind::GeluBackward,
     .priced_with_bytes = elementwise_part_bytes<3>},
    {.kind = OpKind::MatmulWeightBackward, .name = "MatmulWeightBackward", .slots = kMatmulWeightBackwardSlots,
     .check = check_whole_matmul, .flops = matmul_forward_flops, .op_class = OpClass::Matmul,
     .priced_as = OpKind::MatmulBackward},
    {.kind = OpKind::MatmulResidualForward, .name = "MatmulResidualForward", .slots = kMatmulResidualForwardSlots,
     .check = check_whole_matmul, .flops = matmul_forward_flops, .op_class = OpClass::Matmul,
     .priced_as = OpKind::MatmulForward, .priced_with = OpKind::ResidualForward,
     .priced_with_bytes = elementwise_part_bytes<3>},
    {.kind = OpKind::AttentionForward, .name = "AttentionForward", .slots = kAttentionForwardSlots,
     .check = check_attention, .flops = attention_forward_flops, .op_class = OpClass::Attention},
    {.kind = OpKind::AttentionBackward, .name = "AttentionBackward", .slots = kAttentionBackwardSlots,
     .check = check_attention, .flops = attention_backward_flops, .cost_flops = attention_backward_cost_flops,
     .op_class = OpClass::Attention},
    {.kind = OpKind::GeluForward, .name = "GeluForward", .slots = kGeluForwardSlots, .check = check_elementwise},
    {.kind = OpKind::GeluBackward, .name = "GeluBackward", .slots = kGeluBackwardSlots, .check = check_elementwise},
    {.kind = OpKind::ResidualForward, .name = "ResidualForward", .slots = kResidualForwardSlots,
     .check = check_elementwise},
    {.kind = OpKind::CrossEntropyForward, .name = "CrossEntropyForward", .slots = kCrossEntropyForwardSlots,
     .check = check_crossentropy},
    {.kind = OpKind::CrossEntropyBackward, .name = "CrossEntropyBackward", .slots = kCrossEntropyBackwardSlots,
     .check = check_crossentropy},
    {.kind = OpKind::RopeForward, .name = "RopeForward", .slots = kRopeForwardSlots, .check = check_rope},
    {.kind = OpKind::RopeBackward, .name = "RopeBackward", .slots = kRopeBackwardSlots, .check = check_rope},
    {.kind = OpKind::SwiGluForward, .name = "SwiGluForward", .slots = kSwiGluForwardSlots, .check = check_swiglu},
    {.kind = OpKind::SwiGluBackward, .name = "SwiGluBackward", .slots = kSwiGluBackwardSlots,
     .check = check_swiglu},
    {.kind = OpKind::AccumulateGradient, .name = "AccumulateGradient", .slots = kAccumulateGradientSlots,
     .check = check_accumulate_gradient},
    {.kind = OpKind::SquaredNorm, .name = "SquaredNorm", .slots = kSquaredNormSlots, .check = check_squared_norm},
    {.kind = OpKind::ClipScale, .name = "ClipScale", .slots = kClipScaleSlots, .check = check_clip_scale},
    {.kind = OpKind::ReduceGradient, .name = "ReduceGradient", .slots = kReduceGradientSlots,
     .check = check_collective, .op_class = OpClass::Collective},
    {.kind = OpKind::SendGradient, .name = "SendGradient", .slots = kSendGradientSlots, .check = check_collective,
     .op_class = OpClass::Collective},
    {.kind = OpKind::AllReduceInRankOrder, .name = "AllReduceInRankOrder", .slots = kAllReduceSlots,
     .check = check_collective, .op_class = OpClass::Collective},
    {.kind = OpKind::BroadcastParam, .name = "BroadcastParam", .slots = kBroadcastParamSlots,
     .check = check_collective, .op_class = OpClass::Collective},
    {.kind = OpKind::GatherParam, .name = "GatherParam", .slots = kGatherParamSlots, .check = check_collective,
     .op_class = OpClass::Collective},
    {.kind = OpKind::AdamW, .name = "AdamW", .slots = kAdamWSlots, .check = check_adamw, .host = true,
     .home = "master"},
};

constexpr bool in_kind_order() {
  for (size_t i = 0; i < std::size(kOpKinds); ++i)
    if (static_cast<size_t>(kOpKinds[i].kind) != i) return false;
  return true;
}
// Optional slots come last; a host op names a slot that exists as its home.
constexpr bool slots_well_formed() {
  for (const OpKindInfo& info : kOpKinds) {
    bool optional = false;
    for (const OpSlot& s : info.slots) {
      if (optional && !s.optional) return false;
      optional = optional || s.optional;
    }
    if (info.host != (info.home != nullptr)) return false;
  }
  return true;
}
static_assert(std::size(kOpKinds) == kOpKindCount, "the op registry needs one entry per OpKind");
static_assert(in_kind_order(), "the op registry's entries must follow OpKind's order");
static_assert(slots_well_formed(), "optional slots go last; host ops name their home slot");

const OpKindInfo kUnknown{.kind = OpKind::Zero, .name = "?", .slots = {}};

bool known(OpKind k) { return static_cast<size_t>(k) < kOpKindCount; }

bool persists_across_steps(Role r) {
  return r == Role::Param || r == Role::Grad || r == Role::Master || r == Role::OptState || r == Role::Input;
}

}  // namespace

const char* op_kind_name(OpKind k) { return op_info(k).name; }

const OpKindInfo& op_info(OpKind k) { return known(k) ? kOpKinds[static_cast<size_t>(k)] : kUnknown; }

size_t op_required_operands(OpKind k) {
  const OpKindInfo& info = op_info(k);
  return static_cast<size_t>(std::count_if(info.slots.begin(), info.slots.end(),
                                           [](const OpSlot& s) { return !s.optional; }));
}

int op_slot(OpKind k, std::string_view name) {
  const OpKindInfo& info = op_info(k);
  for (size_t i = 0; i < info.slots.size(); ++i)
    if (name == info.slots[i].name) return static_cast<int>(i);
  return -1;
}

const char* access_name(Access a) {
  switch (a) {
    case Access::Read: return "Read";
    case Access::Update: return "Update";
    case Access::Write: return "Write";
  }
  return "?";
}

bool op_is_collective(OpKind k) { return op_info(k).op_class == OpClass::Collective; }

double op_flops(const Op& op) {
  const OpKindInfo& info = op_info(op.kind);
  return info.flops ? info.flops(op.attrs) : 0;
}

double op_cost_flops(const Op& op) {
  const OpKindInfo& info = op_info(op.kind);
  if (info.cost_flops) return info.cost_flops(op.attrs);
  return info.flops ? info.flops(op.attrs) : 0;
}

double op_bytes_moved(const Program& program, const Op& op) {
  const OpKindInfo& info = op_info(op.kind);
  return info.bytes ? info.bytes(program, op) : bytes_per_operand(program, op);
}

// ---- Checking an op against its entry -------------------------------------------

int64_t OpCheck::numel(size_t i) const { return p_.tensors.info(op_.operands[i].tensor).shape.numel(); }

std::string OpCheck::op_text() const {
  return "op " + std::to_string(index_) + " '" + op_.name + "' (" + op_kind_name(op_.kind) + ")";
}

Status OpCheck::fail(const std::string& what) const { return Status::invalid_argument(op_text() + ": " + what); }

Status OpCheck::fail_operand(size_t i, const std::string& what) const {
  const std::span<const OpSlot> slots = op_info(op_.kind).slots;
  std::string slot = i < slots.size() ? slots[i].name : "extra";
  std::string tensor;
  TensorId id = op_.operands[i].tensor;
  if (id >= 0 && static_cast<size_t>(id) < p_.tensors.size()) tensor = " '" + p_.tensors.info(id).name + "'";
  return fail("operand " + std::to_string(i) + " (" + slot + ")" + tensor + " " + what);
}

Status OpCheck::positive(std::initializer_list<std::pair<const char*, int64_t>> attrs) const {
  for (auto& [name, v] : attrs)
    if (v <= 0) return fail(std::string("attrs.") + name + " is " + std::to_string(v) + "; must be positive");
  return Status::ok();
}

Status OpCheck::numel_is(size_t i, int64_t want, const char* formula) const {
  if (i >= op_.operands.size()) return Status::ok();
  int64_t got = numel(i);
  if (got != want)
    return fail_operand(i, "has " + std::to_string(got) + " elements; expected " + formula + " = " +
                               std::to_string(want));
  return Status::ok();
}

Status OpCheck::rows_of(size_t i, int64_t width, int64_t min_rows, const char* what) const {
  int64_t got = numel(i);
  if (got % width != 0 || got / width < min_rows)
    return fail_operand(i, "has " + std::to_string(got) + " elements; expected " + what);
  return Status::ok();
}

Status check_op(const Program& program, size_t index, const std::vector<bool>& written) {
  const Op& op = program.ops[index];
  const OpCheck c(program, index);
  if (!known(op.kind))
    return c.fail("kind " + std::to_string(static_cast<int>(op.kind)) + " is not in the op registry");
  const OpKindInfo& info = op_info(op.kind);
  const size_t min_count = op_required_operands(op.kind), max_count = info.slots.size();
  if (op.operands.size() < min_count || op.operands.size() > max_count) {
    std::string want = min_count == max_count ? std::to_string(min_count)
                                              : std::to_string(min_count) + " or " + std::to_string(max_count);
    return c.fail("has " + std::to_string(op.operands.size()) + " operands; " + info.name + " takes " + want);
  }
  for (size_t i = 0; i < op.operands.size(); ++i) {
    const Operand& o = op.operands[i];
    const OpSlot& s = info.slots[i];
    if (o.tensor < 0 || static_cast<size_t>(o.tensor) >= program.tensors.size())
      return c.fail_operand(i, "tensor id " + std::to_string(o.tensor) + " is out of range (table has " +
                                   std::to_string(program.tensors.size()) + " tensors)");
    for (size_t j = 0; j < i; ++j)
      if (op.operands[j].tensor == o.tensor) return c.fail_operand(i, "is the same tensor as operand " + std::to_string(j));
    if (o.access != s.access && !(s.may_update && o.access == Access::Update))
      return c.fail_operand(i, std::string("has access ") + access_name(o.access) + "; " + info.name + " needs " +
                                   access_name(s.access));
    const TensorInfo& t = program.tensors.info(o.tensor);
    bool dtype_ok = s.dtype == SlotDType::F32   ? t.dtype == DType::F32
                    : s.dtype == SlotDType::I32 ? t.dtype == DType::I32
                                                : (t.dtype == DType::F32 || t.dtype == DType::BF16);
    if (!dtype_ok) {
      const char* want = s.dtype == SlotDType::F32 ? "f32" : s.dtype == SlotDType::I32 ? "i32" : "f32 or bf16";
      return c.fail_operand(i, std::string("has dtype ") + dtype_name(t.dtype) + "; expected " + want);
    }
    if (o.access != Access::Write && !persists_across_steps(t.role) && !written[o.tensor])
      return c.fail_operand(i, std::string("is ") + (o.access == Access::Read ? "read" : "updated") +
                                   " before any earlier op writes it (role " + role_name(t.role) + ")");
  }
  return info.check ? info.check(c) : Status::ok();
}

}  // namespace spillway
