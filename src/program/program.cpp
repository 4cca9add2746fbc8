#include "program/program.h"

#include <algorithm>
#include <string>
#include <vector>

namespace spillway {

const char* op_kind_name(OpKind k) {
  switch (k) {
    case OpKind::Zero: return "Zero";
    case OpKind::EmbeddingForward: return "EmbeddingForward";
    case OpKind::EmbeddingBackward: return "EmbeddingBackward";
    case OpKind::LayerNormForward: return "LayerNormForward";
    case OpKind::LayerNormBackward: return "LayerNormBackward";
    case OpKind::MatmulForward: return "MatmulForward";
    case OpKind::MatmulBackward: return "MatmulBackward";
    case OpKind::AttentionForward: return "AttentionForward";
    case OpKind::AttentionBackward: return "AttentionBackward";
    case OpKind::GeluForward: return "GeluForward";
    case OpKind::GeluBackward: return "GeluBackward";
    case OpKind::ResidualForward: return "ResidualForward";
    case OpKind::CrossEntropyForward: return "CrossEntropyForward";
    case OpKind::CrossEntropyBackward: return "CrossEntropyBackward";
    case OpKind::SquaredNorm: return "SquaredNorm";
    case OpKind::ClipScale: return "ClipScale";
    case OpKind::AdamW: return "AdamW";
  }
  return "?";
}

namespace {

// What an operand slot holds: activation dtype (F32 or BF16), always F32, or I32.
enum class Elem : uint8_t { Act, F32, I32 };

struct Slot {
  const char* name;
  Access access;
  Elem elem;
  bool write_or_update = false;  // a Write slot that a tile after the first may Update
};

// The operand slots of each kind, in order, as documented in program.h.
// `optional` trailing slots may be left off (matmul biases).
struct KindSpec {
  std::vector<Slot> slots;
  size_t optional = 0;
};

const KindSpec& kind_spec(OpKind k) {
  using A = Access;
  static const KindSpec zero{{{"t", A::Write, Elem::Act}}};
  static const KindSpec emb_fwd{{{"out", A::Write, Elem::Act, true},
                                 {"tokens", A::Read, Elem::I32},
                                 {"wte", A::Read, Elem::Act},
                                 {"wpe", A::Read, Elem::Act}}};
  static const KindSpec emb_bwd{{{"dwte", A::Update, Elem::Act},
                                 {"dout", A::Read, Elem::Act},
                                 {"tokens", A::Read, Elem::I32},
                                 {"dwpe", A::Update, Elem::Act}},
                                1};
  static const KindSpec ln_fwd{{{"out", A::Write, Elem::Act},
                                {"mean", A::Write, Elem::F32},
                                {"rstd", A::Write, Elem::F32},
                                {"inp", A::Read, Elem::Act},
                                {"weight", A::Read, Elem::Act},
                                {"bias", A::Read, Elem::Act}}};
  static const KindSpec ln_bwd{{{"dinp", A::Update, Elem::Act},
                                {"dweight", A::Update, Elem::Act},
                                {"dbias", A::Update, Elem::Act},
                                {"dout", A::Read, Elem::Act},
                                {"inp", A::Read, Elem::Act},
                                {"weight", A::Read, Elem::Act},
                                {"mean", A::Read, Elem::F32},
                                {"rstd", A::Read, Elem::F32}}};
  static const KindSpec mm_fwd{{{"out", A::Write, Elem::Act, true},
                                {"inp", A::Read, Elem::Act},
                                {"weight", A::Read, Elem::Act},
                                {"bias", A::Read, Elem::Act}},
                               1};
  static const KindSpec mm_bwd{{{"dinp", A::Write, Elem::Act, true},
                                {"dweight", A::Update, Elem::Act},
                                {"dout", A::Read, Elem::Act},
                                {"inp", A::Read, Elem::Act},
                                {"weight", A::Read, Elem::Act},
                                {"dbias", A::Update, Elem::Act}},
                               1};
  static const KindSpec att_fwd{{{"out", A::Write, Elem::Act},
                                 {"lse", A::Write, Elem::F32},
                                 {"qkv", A::Read, Elem::Act}}};
  static const KindSpec att_bwd{{{"dqkv", A::Write, Elem::Act},
                                 {"dout", A::Read, Elem::Act},
                                 {"qkv", A::Read, Elem::Act},
                                 {"out", A::Read, Elem::Act},
                                 {"lse", A::Read, Elem::F32}}};
  static const KindSpec gelu_fwd{{{"out", A::Write, Elem::Act}, {"inp", A::Read, Elem::Act}}};
  static const KindSpec gelu_bwd{{{"dinp", A::Write, Elem::Act},
                                  {"inp", A::Read, Elem::Act},
                                  {"dout", A::Read, Elem::Act}}};
  static const KindSpec residual{{{"out", A::Write, Elem::Act},
                                  {"a", A::Read, Elem::Act},
                                  {"b", A::Read, Elem::Act}}};
  static const KindSpec ce_fwd{{{"losses", A::Write, Elem::F32},
                                {"logits", A::Read, Elem::Act},
                                {"targets", A::Read, Elem::I32}}};
  static const KindSpec ce_bwd{{{"losses", A::Write, Elem::F32},
                                {"logits", A::Update, Elem::Act},
                                {"targets", A::Read, Elem::I32}}};
  static const KindSpec sqnorm{{{"out_sq", A::Write, Elem::F32}, {"grad", A::Read, Elem::Act}}};
  static const KindSpec clip{{{"scale_norm", A::Write, Elem::F32}, {"squared_norms", A::Read, Elem::F32}}};
  static const KindSpec adamw{{{"param", A::Write, Elem::Act},
                               {"master", A::Update, Elem::F32},
                               {"m", A::Update, Elem::F32},
                               {"v", A::Update, Elem::F32},
                               {"grad", A::Read, Elem::Act},
                               {"scale_norm", A::Read, Elem::F32}}};
  switch (k) {
    case OpKind::Zero: return zero;
    case OpKind::EmbeddingForward: return emb_fwd;
    case OpKind::EmbeddingBackward: return emb_bwd;
    case OpKind::LayerNormForward: return ln_fwd;
    case OpKind::LayerNormBackward: return ln_bwd;
    case OpKind::MatmulForward: return mm_fwd;
    case OpKind::MatmulBackward: return mm_bwd;
    case OpKind::AttentionForward: return att_fwd;
    case OpKind::AttentionBackward: return att_bwd;
    case OpKind::GeluForward: return gelu_fwd;
    case OpKind::GeluBackward: return gelu_bwd;
    case OpKind::ResidualForward: return residual;
    case OpKind::CrossEntropyForward: return ce_fwd;
    case OpKind::CrossEntropyBackward: return ce_bwd;
    case OpKind::SquaredNorm: return sqnorm;
    case OpKind::ClipScale: return clip;
    case OpKind::AdamW: return adamw;
  }
  return zero;
}

const char* access_name(Access a) {
  switch (a) {
    case Access::Read: return "Read";
    case Access::Update: return "Update";
    case Access::Write: return "Write";
  }
  return "?";
}

bool persists_across_steps(Role r) {
  return r == Role::Param || r == Role::Grad || r == Role::Master || r == Role::OptState ||
         r == Role::Input;
}

// Checks one op against its kind's slots and attrs. `written[id]` says whether an
// earlier op wrote or updated the tensor.
class OpChecker {
 public:
  OpChecker(const Program& p, size_t index, const std::vector<bool>& written)
      : p_(p), op_(p.ops[index]), index_(index), written_(written) {}

  Status check() {
    const KindSpec& spec = kind_spec(op_.kind);
    std::vector<Slot> slots = spec.slots;
    size_t min_count = slots.size() - spec.optional;
    if (op_.kind == OpKind::ClipScale && op_.attrs.P < 1)
      return fail("attrs.P is " + std::to_string(op_.attrs.P) + "; need at least 1");
    // The packed form: SquaredNorm updates element attrs.index of a P-element tensor.
    if (op_.kind == OpKind::SquaredNorm && !op_.operands.empty() && op_.operands[0].access == Access::Update)
      slots[0].access = Access::Update;
    if (op_.operands.size() < min_count || op_.operands.size() > slots.size()) {
      std::string want = min_count == slots.size() ? std::to_string(min_count)
                                                   : std::to_string(min_count) + " or " + std::to_string(slots.size());
      return fail("has " + std::to_string(op_.operands.size()) + " operands; " + op_kind_name(op_.kind) +
                  " takes " + want);
    }
    slots_ = std::move(slots);
    for (size_t i = 0; i < op_.operands.size(); ++i) {
      const Operand& o = op_.operands[i];
      const Slot& s = slots_[i];
      if (o.tensor < 0 || static_cast<size_t>(o.tensor) >= p_.tensors.size())
        return fail_operand(i, "tensor id " + std::to_string(o.tensor) + " is out of range (table has " +
                                   std::to_string(p_.tensors.size()) + " tensors)");
      for (size_t j = 0; j < i; ++j)
        if (op_.operands[j].tensor == o.tensor)
          return fail_operand(i, "is the same tensor as operand " + std::to_string(j));
      if (o.access != s.access && !(s.write_or_update && o.access == Access::Update))
        return fail_operand(i, std::string("has access ") + access_name(o.access) + "; " + op_kind_name(op_.kind) +
                                   " needs " + access_name(s.access));
      const TensorInfo& t = p_.tensors.info(o.tensor);
      bool dtype_ok = s.elem == Elem::F32   ? t.dtype == DType::F32
                      : s.elem == Elem::I32 ? t.dtype == DType::I32
                                            : (t.dtype == DType::F32 || t.dtype == DType::BF16);
      if (!dtype_ok) {
        const char* want = s.elem == Elem::F32 ? "f32" : s.elem == Elem::I32 ? "i32" : "f32 or bf16";
        return fail_operand(i, std::string("has dtype ") + dtype_name(t.dtype) + "; expected " + want);
      }
      if (o.access != Access::Write && !persists_across_steps(t.role) && !written_[o.tensor])
        return fail_operand(i, std::string("is ") + (o.access == Access::Read ? "read" : "updated") +
                                   " before any earlier op writes it (role " + role_name(t.role) + ")");
    }
    return check_sizes();
  }

 private:
  std::string op_text() const {
    return "op " + std::to_string(index_) + " '" + op_.name + "' (" + op_kind_name(op_.kind) + ")";
  }
  Status fail(const std::string& what) const { return Status::invalid_argument(op_text() + ": " + what); }
  Status fail_operand(size_t i, const std::string& what) const {
    std::string slot = i < slots_.size() ? slots_[i].name : "extra";
    std::string tensor;
    TensorId id = op_.operands[i].tensor;
    if (id >= 0 && static_cast<size_t>(id) < p_.tensors.size()) tensor = " '" + p_.tensors.info(id).name + "'";
    return fail("operand " + std::to_string(i) + " (" + slot + ")" + tensor + " " + what);
  }

  Status positive(std::initializer_list<std::pair<const char*, int64_t>> attrs) const {
    for (auto& [name, v] : attrs)
      if (v <= 0) return fail(std::string("attrs.") + name + " is " + std::to_string(v) + "; must be positive");
    return Status::ok();
  }
  // Operand i has exactly `want` elements.
  Status numel_is(size_t i, int64_t want, const char* formula) const {
    if (i >= op_.operands.size()) return Status::ok();
    int64_t got = p_.tensors.info(op_.operands[i].tensor).shape.numel();
    if (got != want)
      return fail_operand(i, "has " + std::to_string(got) + " elements; expected " + formula + " = " +
                                 std::to_string(want));
    return Status::ok();
  }
  // Operand i is a table of rows of `width` elements with at least `min_rows` rows.
  Status rows_of(size_t i, int64_t width, int64_t min_rows, const char* what) const {
    int64_t got = p_.tensors.info(op_.operands[i].tensor).shape.numel();
    if (got % width != 0 || got / width < min_rows)
      return fail_operand(i, "has " + std::to_string(got) + " elements; expected " + what);
    return Status::ok();
  }

  Status check_sizes() const {
    const OpAttrs& a = op_.attrs;
    switch (op_.kind) {
      case OpKind::Zero: return Status::ok();
      case OpKind::EmbeddingForward:
      case OpKind::EmbeddingBackward: {
        SPILLWAY_RETURN_IF_ERROR(positive({{"B", a.B}, {"T", a.T}, {"C", a.C}}));
        if (a.V < 0 || a.begin < 0)
          return fail("attrs.V " + std::to_string(a.V) + " and attrs.begin " + std::to_string(a.begin) +
                      " must not be negative");
        const bool fwd = op_.kind == OpKind::EmbeddingForward;
        const size_t act = fwd ? 0 : 1, tokens = fwd ? 1 : 2, wte = fwd ? 2 : 0, wpe = fwd ? 3 : 3;
        SPILLWAY_RETURN_IF_ERROR(numel_is(act, a.B * a.T * a.C, "B*T*C"));
        SPILLWAY_RETURN_IF_ERROR(numel_is(tokens, a.B * a.T, "B*T"));
        if (a.V > 0) SPILLWAY_RETURN_IF_ERROR(numel_is(wte, a.V * a.C, "V*C (rows of the vocab tile)"));
        SPILLWAY_RETURN_IF_ERROR(rows_of(wte, a.C, 1, "rows of C"));
        if (wpe < op_.operands.size()) return rows_of(wpe, a.C, a.T, "at least T rows of C");
        return Status::ok();
      }
      case OpKind::LayerNormForward:
        SPILLWAY_RETURN_IF_ERROR(positive({{"N", a.N}, {"C", a.C}}));
        SPILLWAY_RETURN_IF_ERROR(numel_is(0, a.N * a.C, "N*C"));
        SPILLWAY_RETURN_IF_ERROR(numel_is(1, a.N, "N"));
        SPILLWAY_RETURN_IF_ERROR(numel_is(2, a.N, "N"));
        SPILLWAY_RETURN_IF_ERROR(numel_is(3, a.N * a.C, "N*C"));
        SPILLWAY_RETURN_IF_ERROR(numel_is(4, a.C, "C"));
        return numel_is(5, a.C, "C");
      case OpKind::LayerNormBackward:
        SPILLWAY_RETURN_IF_ERROR(positive({{"N", a.N}, {"C", a.C}}));
        SPILLWAY_RETURN_IF_ERROR(numel_is(0, a.N * a.C, "N*C"));
        SPILLWAY_RETURN_IF_ERROR(numel_is(1, a.C, "C"));
        SPILLWAY_RETURN_IF_ERROR(numel_is(2, a.C, "C"));
        SPILLWAY_RETURN_IF_ERROR(numel_is(3, a.N * a.C, "N*C"));
        SPILLWAY_RETURN_IF_ERROR(numel_is(4, a.N * a.C, "N*C"));
        SPILLWAY_RETURN_IF_ERROR(numel_is(5, a.C, "C"));
        SPILLWAY_RETURN_IF_ERROR(numel_is(6, a.N, "N"));
        return numel_is(7, a.N, "N");
      case OpKind::MatmulForward:
      case OpKind::MatmulBackward: {
        SPILLWAY_RETURN_IF_ERROR(positive({{"N", a.N}, {"C", a.C}, {"OC", a.OC}}));
        const int64_t ld = a.ld == 0 ? a.OC : a.ld;
        if (a.begin < 0 || a.block < 0 || a.begin + a.OC > ld)
          return fail("columns [" + std::to_string(a.begin) + ", " + std::to_string(a.begin + a.OC) +
                      ") with block " + std::to_string(a.block) + " do not fit rows of ld = " + std::to_string(ld));
        const bool fwd = op_.kind == OpKind::MatmulForward;
        // A column block of out/dout: a Write of the first tile leaves the other columns.
        SPILLWAY_RETURN_IF_ERROR(numel_is(fwd ? 0 : 2, a.N * ld, "N*ld (ld = OC unless given)"));
        SPILLWAY_RETURN_IF_ERROR(numel_is(fwd ? 1 : 3, a.N * a.C, "N*C"));
        SPILLWAY_RETURN_IF_ERROR(numel_is(fwd ? 2 : 4, a.OC * a.C, "OC*C"));
        if (fwd) return numel_is(3, a.OC, "OC");
        SPILLWAY_RETURN_IF_ERROR(numel_is(0, a.N * a.C, "N*C"));
        SPILLWAY_RETURN_IF_ERROR(numel_is(1, a.OC * a.C, "OC*C"));
        return numel_is(5, a.OC, "OC");
      }
      case OpKind::AttentionForward:
      case OpKind::AttentionBackward: {
        SPILLWAY_RETURN_IF_ERROR(positive({{"B", a.B}, {"T", a.T}, {"C", a.C}, {"NH", a.NH}}));
        if (a.C % a.NH != 0)
          return fail("attrs.C = " + std::to_string(a.C) + " is not divisible by attrs.NH = " + std::to_string(a.NH));
        int64_t btc = a.B * a.T * a.C, lse = a.B * a.NH * a.T;
        if (op_.kind == OpKind::AttentionForward) {
          SPILLWAY_RETURN_IF_ERROR(numel_is(0, btc, "B*T*C"));
          SPILLWAY_RETURN_IF_ERROR(numel_is(1, lse, "B*NH*T"));
          return numel_is(2, 3 * btc, "B*T*3C");
        }
        SPILLWAY_RETURN_IF_ERROR(numel_is(0, 3 * btc, "B*T*3C"));
        SPILLWAY_RETURN_IF_ERROR(numel_is(1, btc, "B*T*C"));
        SPILLWAY_RETURN_IF_ERROR(numel_is(2, 3 * btc, "B*T*3C"));
        SPILLWAY_RETURN_IF_ERROR(numel_is(3, btc, "B*T*C"));
        return numel_is(4, lse, "B*NH*T");
      }
      case OpKind::GeluForward:
      case OpKind::GeluBackward:
      case OpKind::ResidualForward:
        SPILLWAY_RETURN_IF_ERROR(positive({{"n", a.n}}));
        for (size_t i = 0; i < op_.operands.size(); ++i) SPILLWAY_RETURN_IF_ERROR(numel_is(i, a.n, "n"));
        return Status::ok();
      case OpKind::CrossEntropyForward:
      case OpKind::CrossEntropyBackward:
        SPILLWAY_RETURN_IF_ERROR(positive({{"N", a.N}, {"V", a.V}}));
        if (a.ld != 0 && a.ld < a.V)
          return fail("attrs.ld " + std::to_string(a.ld) + " is below attrs.V " + std::to_string(a.V));
        SPILLWAY_RETURN_IF_ERROR(numel_is(0, a.N, "N"));
        SPILLWAY_RETURN_IF_ERROR(numel_is(1, a.N * (a.ld == 0 ? a.V : a.ld), "N*ld (ld = V unless given)"));
        return numel_is(2, a.N, "N");
      case OpKind::SquaredNorm: {
        SPILLWAY_RETURN_IF_ERROR(positive({{"n", a.n}}));
        if (a.block < 0) return fail("attrs.block is " + std::to_string(a.block) + "; must not be negative");
        const int64_t segments = a.block > 0 ? (a.n + a.block - 1) / a.block : 1;
        if (op_.operands[0].access == Access::Write) {
          SPILLWAY_RETURN_IF_ERROR(numel_is(0, 1, "1"));
          if (a.index != 0 || segments != 1)
            return fail("attrs.index is " + std::to_string(a.index) + " with " + std::to_string(segments) +
                        " segments; a written out_sq has one element");
        } else {
          int64_t len = p_.tensors.info(op_.operands[0].tensor).shape.numel();
          if (a.index < 0 || a.index + segments > len)
            return fail("elements [" + std::to_string(a.index) + ", " + std::to_string(a.index + segments) +
                        ") are outside out_sq's " + std::to_string(len) + " elements");
        }
        return numel_is(1, a.n, "n");
      }
      case OpKind::ClipScale:
        SPILLWAY_RETURN_IF_ERROR(numel_is(0, 2, "2 (scale, norm)"));
        return numel_is(1, a.P, "P");
      case OpKind::AdamW:
        SPILLWAY_RETURN_IF_ERROR(positive({{"n", a.n}}));
        if (a.index < 0) return fail("attrs.index is " + std::to_string(a.index) + "; must be >= 0");
        for (size_t i = 0; i < 5; ++i) SPILLWAY_RETURN_IF_ERROR(numel_is(i, a.n, "n"));
        return numel_is(5, 2, "2 (scale, norm)");
    }
    return Status::ok();
  }

  const Program& p_;
  const Op& op_;
  size_t index_;
  const std::vector<bool>& written_;
  std::vector<Slot> slots_;
};

}  // namespace

Status Program::validate() const {
  std::vector<bool> written(tensors.size(), false);
  for (size_t i = 0; i < ops.size(); ++i) {
    SPILLWAY_RETURN_IF_ERROR(OpChecker(*this, i, written).check());
    for (const Operand& o : ops[i].operands)
      if (o.access != Access::Read) written[o.tensor] = true;
  }
  auto check_ids = [&](const std::vector<TensorId>& ids, const char* what) -> Status {
    for (size_t i = 0; i < ids.size(); ++i)
      if (ids[i] < 0 || static_cast<size_t>(ids[i]) >= tensors.size())
        return Status::invalid_argument(std::string("program ") + what + "[" + std::to_string(i) + "]: tensor id " +
                                        std::to_string(ids[i]) + " is out of range (table has " +
                                        std::to_string(tensors.size()) + " tensors)");
    return Status::ok();
  };
  SPILLWAY_RETURN_IF_ERROR(check_ids(inputs, "inputs"));
  SPILLWAY_RETURN_IF_ERROR(check_ids(outputs, "outputs"));
  for (TensorId id : outputs)
    if (!written[id] && !persists_across_steps(tensors.info(id).role))
      return Status::invalid_argument("program output '" + tensors.info(id).name + "' is never written by any op");
  return Status::ok();
}

// FLOP counts, the usual MFU convention: only matrix products count (LayerNorm,
// GELU, softmax, cross-entropy and AdamW are memory-bound and left out); a
// multiply-add is 2 FLOPs.
// - MatmulForward:  2·N·C·OC.
// - MatmulBackward: 4·N·C·OC (dinp = dout·W and dW += doutᵀ·inp).
// - AttentionForward: Q·Kᵀ and P·V are 2·B·T²·C each without a mask; the causal
//   mask halves the work actually needed, so 4·B·T²·C / 2 = 2·B·T²·C.
// - AttentionBackward: twice the forward, 4·B·T²·C (dQ, dK from dS; dV, dP).
bool Program::is_persistent(TensorId t) const {
  Role r = tensors.info(t).role;
  if (r == Role::Param || r == Role::Grad || r == Role::Master || r == Role::OptState || r == Role::Input) return true;
  return std::find(outputs.begin(), outputs.end(), t) != outputs.end();
}

std::vector<TensorId> Program::pieces(const std::string& name) const {
  TensorId whole = tensors.find(name);
  if (whole != kNoTensor) return {whole};
  std::vector<TensorId> out;
  for (int j = 0;; ++j) {
    TensorId t = tensors.find(name + "#" + std::to_string(j));
    if (t == kNoTensor) break;
    out.push_back(t);
  }
  return out;
}

double Program::flops() const {
  double total = 0;
  for (const Op& op : ops) {
    const OpAttrs& a = op.attrs;
    switch (op.kind) {
      case OpKind::MatmulForward: total += 2.0 * a.N * a.C * a.OC; break;
      case OpKind::MatmulBackward: total += 4.0 * a.N * a.C * a.OC; break;
      case OpKind::AttentionForward: total += 2.0 * a.B * a.T * a.T * a.C; break;
      case OpKind::AttentionBackward: total += 4.0 * a.B * a.T * a.T * a.C; break;
      default: break;
    }
  }
  return total;
}

}  // namespace spillway
