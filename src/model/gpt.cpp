#include "model/gpt.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <utility>

#include "core/random.h"
#include "core/thread_pool.h"

namespace spillway {

// ---------------------------------------------------------------- configuration

namespace {

// V·C + context·C + L·(12C² + 13C) + 2C with every product and sum checked; nullopt
// when it does not fit in int64 (or a size is negative).
std::optional<int64_t> checked_num_parameters(const GPTConfig& c) {
  const int64_t L = c.layers, C = c.width, ctx = c.context, V = c.vocab;
  if (L < 0 || C < 0 || ctx < 0 || V < 0) return std::nullopt;
  int64_t wte = 0, wpe = 0, c2 = 0, c2x12 = 0, c13 = 0, block = 0, blocks = 0, c2x2 = 0, total = 0;
  if (__builtin_mul_overflow(V, C, &wte) || __builtin_mul_overflow(ctx, C, &wpe) ||
      __builtin_mul_overflow(C, C, &c2) || __builtin_mul_overflow(c2, int64_t{12}, &c2x12) ||
      __builtin_mul_overflow(C, int64_t{13}, &c13) || __builtin_add_overflow(c2x12, c13, &block) ||
      __builtin_mul_overflow(L, block, &blocks) || __builtin_mul_overflow(C, int64_t{2}, &c2x2) ||
      __builtin_add_overflow(wte, wpe, &total) || __builtin_add_overflow(total, blocks, &total) ||
      __builtin_add_overflow(total, c2x2, &total))
    return std::nullopt;
  return total;
}

}  // namespace

Status GPTConfig::validate() const {
  auto in_range = [](const char* what, int v) -> Status {
    if (v <= 0) return Status::invalid_argument(std::string("model ") + what + " is " + std::to_string(v) + "; must be positive");
    if (v > kMaxModelDim)
      return Status::invalid_argument(std::string("model ") + what + " is " + std::to_string(v) +
                                      "; the limit is 2^24 = " + std::to_string(kMaxModelDim));
    return Status::ok();
  };
  SPILLWAY_RETURN_IF_ERROR(in_range("layers", layers));
  SPILLWAY_RETURN_IF_ERROR(in_range("width", width));
  SPILLWAY_RETURN_IF_ERROR(in_range("heads", heads));
  SPILLWAY_RETURN_IF_ERROR(in_range("context", context));
  SPILLWAY_RETURN_IF_ERROR(in_range("vocab", vocab));
  if (width % heads != 0)
    return Status::invalid_argument("model width " + std::to_string(width) + " is not divisible by heads " +
                                    std::to_string(heads));
  const std::optional<int64_t> params = checked_num_parameters(*this);
  if (!params || *params > kMaxModelParameters)
    return Status::invalid_argument(
        "model " + to_string() + " has " +
        (params ? std::to_string(*params) : std::string("more than 2^63")) +
        " parameters; the limit is 2^40 = " + std::to_string(kMaxModelParameters));
  return Status::ok();
}

int64_t GPTConfig::num_parameters() const {
  if (layers < 0 || width < 0 || context < 0 || vocab < 0) return 0;
  return checked_num_parameters(*this).value_or(std::numeric_limits<int64_t>::max());
}

std::string GPTConfig::to_string() const {
  return "layers=" + std::to_string(layers) + " width=" + std::to_string(width) + " heads=" + std::to_string(heads) +
         " context=" + std::to_string(context) + " vocab=" + std::to_string(vocab);
}

namespace {

struct Preset {
  const char* name;
  GPTConfig cfg;
};

constexpr int kGpt2Vocab = 50257;
constexpr int kGpt2Context = 1024;

const std::vector<Preset>& presets() {
  static const std::vector<Preset> p = {
      {"tiny", {4, 128, 4, 128, 256}},
      {"gpt2-124m", {12, 768, 12, kGpt2Context, kGpt2Vocab}},
      {"gpt2-350m", {24, 1024, 16, kGpt2Context, kGpt2Vocab}},
      {"gpt2-774m", {36, 1280, 20, kGpt2Context, kGpt2Vocab}},
      {"gpt2-1.5b", {48, 1600, 25, kGpt2Context, kGpt2Vocab}},
      {"gpt-2.7b", {32, 2560, 32, kGpt2Context, kGpt2Vocab}},
      {"gpt-4b", {36, 3072, 24, kGpt2Context, kGpt2Vocab}},
      {"gpt-6.7b", {32, 4096, 32, kGpt2Context, kGpt2Vocab}},
      {"gpt-13b", {40, 5120, 40, kGpt2Context, kGpt2Vocab}},
  };
  return p;
}

}  // namespace

Result<GPTConfig> gpt_preset(std::string_view name) {
  for (const Preset& p : presets())
    if (name == p.name) return p.cfg;
  std::string names;
  for (const Preset& p : presets()) names += std::string(names.empty() ? "" : ", ") + p.name;
  return Status::invalid_argument("unknown model preset '" + std::string(name) + "'; known presets: " + names);
}

std::vector<std::string> gpt_preset_names() {
  std::vector<std::string> names;
  for (const Preset& p : presets()) names.emplace_back(p.name);
  return names;
}

// ---------------------------------------------------------------- parameters

std::vector<ParamSpec> parameter_specs(const GPTConfig& cfg) {
  const int64_t C = cfg.width;
  std::vector<ParamSpec> specs;
  specs.push_back({"transformer.wte.weight", {cfg.vocab, C}, -1, true, false});
  specs.push_back({"transformer.wpe.weight", {cfg.context, C}, -1, true, false});
  for (int i = 0; i < cfg.layers; ++i) {
    std::string h = "transformer.h." + std::to_string(i) + ".";
    specs.push_back({h + "ln_1.weight", {C}, i, false, false});
    specs.push_back({h + "ln_1.bias", {C}, i, false, false});
    specs.push_back({h + "attn.c_attn.weight", {3 * C, C}, i, true, true});
    specs.push_back({h + "attn.c_attn.bias", {3 * C}, i, false, false});
    specs.push_back({h + "attn.c_proj.weight", {C, C}, i, true, true});
    specs.push_back({h + "attn.c_proj.bias", {C}, i, false, false});
    specs.push_back({h + "ln_2.weight", {C}, i, false, false});
    specs.push_back({h + "ln_2.bias", {C}, i, false, false});
    specs.push_back({h + "mlp.c_fc.weight", {4 * C, C}, i, true, true});
    specs.push_back({h + "mlp.c_fc.bias", {4 * C}, i, false, false});
    specs.push_back({h + "mlp.c_proj.weight", {C, 4 * C}, i, true, true});
    specs.push_back({h + "mlp.c_proj.bias", {C}, i, false, false});
  }
  specs.push_back({"transformer.ln_f.weight", {C}, -1, false, false});
  specs.push_back({"transformer.ln_f.bias", {C}, -1, false, false});
  return specs;
}

namespace {

uint64_t fnv1a64(std::string_view s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  return h;
}


}  // namespace

namespace {

// Pairs of elements (one Box–Muller draw each) per chunk of a parallel initialization:
// 16 Ki pairs = 128 KiB of floats, about a millisecond of work: enough to outweigh
// handing it to a thread, small enough to balance the threads.
constexpr size_t kInitPairsPerChunk = size_t{1} << 14;

}  // namespace

void init_parameter_range(const GPTConfig& cfg, const ParamSpec& param, uint64_t seed, size_t begin, size_t end,
                          float* out) {
  const size_t n = static_cast<size_t>(param.shape.numel());
  end = std::min(end, n);
  if (begin >= end) return;
  if (std::string_view(param.name).ends_with(".bias")) {
    std::fill(out, out + (end - begin), 0.0f);
    return;
  }
  if (param.name.find(".ln_") != std::string::npos) {
    std::fill(out, out + (end - begin), 1.0f);
    return;
  }
  double std_dev = 0.02;
  if (std::string_view(param.name).ends_with("c_proj.weight")) std_dev = 0.02 / std::sqrt(2.0 * cfg.layers);
  const uint64_t key = splitmix64_mix(seed ^ fnv1a64(param.name));
  auto bits = [key](uint64_t c) { return splitmix64_mix(key + (c + 1) * kSplitMixGolden); };
  const double two_pi = 6.283185307179586476925286766559;
  const double inv53 = 1.0 / 9007199254740992.0;  // 2^-53
  // Pair q gives elements 2q (cos) and 2q+1 (sin); a range may start or end inside a pair.
  for (size_t q = begin / 2; 2 * q < end; ++q) {
    double u1 = static_cast<double>((bits(2 * q) >> 11) + 1) * inv53;
    double u2 = static_cast<double>(bits(2 * q + 1) >> 11) * inv53;
    double r = std::sqrt(-2.0 * std::log(u1));
    if (2 * q >= begin) out[2 * q - begin] = static_cast<float>(std_dev * (r * std::cos(two_pi * u2)));
    if (2 * q + 1 < end) out[2 * q + 1 - begin] = static_cast<float>(std_dev * (r * std::sin(two_pi * u2)));
  }
}

void init_parameter_into(const GPTConfig& cfg, const ParamSpec& param, uint64_t seed, float* out, ThreadPool& pool) {
  const size_t n = static_cast<size_t>(param.shape.numel());
  const size_t chunk = 2 * kInitPairsPerChunk;  // even, so no pair is split between chunks
  const auto chunks = static_cast<int64_t>((n + chunk - 1) / chunk);
  pool.parallel_for(chunks, [&](int64_t c0, int64_t c1) {
    const size_t begin = static_cast<size_t>(c0) * chunk, end = std::min(n, static_cast<size_t>(c1) * chunk);
    init_parameter_range(cfg, param, seed, begin, end, out + begin);
  });
}

std::vector<float> init_parameter(const GPTConfig& cfg, const ParamSpec& param, uint64_t seed, ThreadPool* pool) {
  std::vector<float> out(static_cast<size_t>(param.shape.numel()));
  init_parameter_into(cfg, param, seed, out.data(), pool ? *pool : global_thread_pool());
  return out;
}

// ---------------------------------------------------------------- program building

namespace {

// The tensors of one parameter, or of one vocab tile of wte (rows [row_begin,
// row_begin + rows) of the table): shape = the piece's shape.
struct ParamTensors {
  TensorId param = kNoTensor;   // [rows, ...] act dtype
  TensorId grad = kNoTensor;    // [rows, ...] act dtype (training only)
  TensorId master = kNoTensor;  // [rows, ...] F32 (training only)
  TensorId m = kNoTensor;       // [rows, ...] F32 (training only)
  TensorId v = kNoTensor;       // [rows, ...] F32 (training only)
  int64_t row_begin = 0;
  int64_t rows = 0;
};

// Indices into the ParamSpec list of one block's parameters.
struct BlockParams {
  size_t ln1_w, ln1_b, qkv_w, qkv_b, proj_w, proj_b, ln2_w, ln2_b, fc_w, fc_b, fc2_w, fc2_b;
};

BlockParams block_params(int layer) {
  size_t b = 2 + static_cast<size_t>(layer) * 12;
  return {b, b + 1, b + 2, b + 3, b + 4, b + 5, b + 6, b + 7, b + 8, b + 9, b + 10, b + 11};
}

// The activations one micro-batch saves from its forward pass for its backward pass.
struct LayerActs {
  TensorId ln1_out, ln1_mean, ln1_rstd;  // [B,T,C], [B,T] F32, [B,T] F32
  TensorId qkv;                          // [B,T,3C]
  TensorId atty, att_lse;                // [B,T,C], [B,NH,T] F32
  TensorId res_attn;                     // [B,T,C]
  TensorId ln2_out, ln2_mean, ln2_rstd;  // [B,T,C], [B,T] F32, [B,T] F32
  TensorId fch, fch_gelu;                // [B,T,4C], [B,T,4C]
  TensorId res_mlp;                      // [B,T,C]
};

struct MicroBatch {
  TensorId tokens, targets;                // [B,T] I32
  TensorId encoded;                        // [B,T,C]
  std::vector<LayerActs> layers;           // per block
  TensorId lnf_out, lnf_mean, lnf_rstd;    // [B,T,C], [B,T] F32, [B,T] F32
  TensorId logits;                         // [B,T,V]
  TensorId losses;                         // [B·T] F32
};

// Per-layer scratch, shared by micro-batches; each is written before it is read.
struct LayerScratch {
  TensorId attn_proj, mlp_proj;  // [B,T,C]
  TensorId d_fch_gelu, d_fch;    // [B,T,4C]
  TensorId d_ln2_out, d_atty;    // [B,T,C]
  TensorId d_qkv;                // [B,T,3C]
  TensorId d_ln1_out;            // [B,T,C]
};

// The most elements one activation tensor may have (2^58: its bytes fit in 63 bits).
constexpr int64_t kMaxActivationElements = int64_t{1} << 58;

class Builder {
 public:
  Builder(const GPTConfig& cfg, int B, int T, DType act, bool training, bool tile_vocab)
      : cfg_(cfg), B_(B), T_(T), act_(act), training_(training), tile_vocab_(tile_vocab),
        specs_(parameter_specs(cfg)) {
    C_ = cfg.width;
    V_ = cfg.vocab;
    Vpad_ = logits_row_stride(cfg.vocab);
    N_ = int64_t{B} * T;
  }

  static Status check(const GPTConfig& cfg, int B, int T, DType act) {
    SPILLWAY_RETURN_IF_ERROR(cfg.validate());
    if (B <= 0) return Status::invalid_argument("batch size B is " + std::to_string(B) + "; must be positive");
    if (T <= 0 || T > cfg.context)
      return Status::invalid_argument("sequence length T is " + std::to_string(T) + "; must be in 1.." +
                                      std::to_string(cfg.context) + " (the model's context)");
    if (act != DType::F32 && act != DType::BF16)
      return Status::invalid_argument(std::string("activation dtype ") + dtype_name(act) + " is not f32 or bf16");
    // The widest activation, [B,T,max(4C, Vp)]: its element count, and its bytes, in 64 bits.
    const int64_t widest = std::max<int64_t>(int64_t{4} * cfg.width, logits_row_stride(cfg.vocab));
    int64_t elems = 0;
    if (__builtin_mul_overflow(int64_t{B} * T, widest, &elems) || elems > kMaxActivationElements)
      return Status::invalid_argument("batch size B " + std::to_string(B) + " x sequence length T " + std::to_string(T) +
                                      " x row width " + std::to_string(widest) +
                                      " (the widest activation of model " + cfg.to_string() +
                                      ") exceeds 2^58 elements per tensor");
    return Status::ok();
  }

  // Every parameter is one piece, except wte when tiled: one piece per kVocabBlock rows,
  // named "<name>#<j>" (Program::pieces finds them).
  void add_params() {
    for (size_t p = 0; p < specs_.size(); ++p) {
      const ParamSpec& s = specs_[p];
      std::vector<ParamTensors> pieces;
      const int64_t rows = s.shape.dims[0];
      const bool tiled = p == 0 && tile_vocab_ && rows > kVocabBlock;
      for (int64_t r0 = 0, j = 0; r0 < rows; r0 += tiled ? kVocabBlock : rows, ++j) {
        ParamTensors t;
        t.row_begin = r0;
        t.rows = tiled ? std::min<int64_t>(kVocabBlock, rows - r0) : rows;
        Shape shape = s.shape;
        shape.dims[0] = t.rows;
        const std::string name = tiled ? s.name + "#" + std::to_string(j) : s.name;
        t.param = add(name, act_, shape, Role::Param);
        if (training_) {
          t.grad = add("grad." + name, act_, shape, Role::Grad);
          t.master = add("master." + name, DType::F32, shape, Role::Master);
          t.m = add("adam_m." + name, DType::F32, shape, Role::OptState);
          t.v = add("adam_v." + name, DType::F32, shape, Role::OptState);
        }
        pieces.push_back(t);
      }
      params_.push_back(std::move(pieces));
    }
  }

  void add_scratch() {
    const int64_t C = C_;
    for (int i = 0; i < cfg_.layers; ++i) {
      std::string h = "h" + std::to_string(i) + ".";
      LayerScratch s{};
      s.attn_proj = add(h + "attn_proj", act_, {B_, T_, C}, Role::Scratch);
      s.mlp_proj = add(h + "mlp_proj", act_, {B_, T_, C}, Role::Scratch);
      if (training_) {
        s.d_fch_gelu = add(h + "d_fch_gelu", act_, {B_, T_, 4 * C}, Role::Scratch);
        s.d_fch = add(h + "d_fch", act_, {B_, T_, 4 * C}, Role::Scratch);
        s.d_ln2_out = add(h + "d_ln2_out", act_, {B_, T_, C}, Role::Scratch);
        s.d_atty = add(h + "d_atty", act_, {B_, T_, C}, Role::Scratch);
        s.d_qkv = add(h + "d_qkv", act_, {B_, T_, 3 * C}, Role::Scratch);
        s.d_ln1_out = add(h + "d_ln1_out", act_, {B_, T_, C}, Role::Scratch);
      }
      scratch_.push_back(s);
    }
    if (training_) d_lnf_out_ = add("d_lnf_out", act_, {B_, T_, C}, Role::Scratch);
  }

  MicroBatch add_micro_batch(int k, bool with_targets, bool logits_output) {
    const int64_t C = C_;
    std::string mb = "mb" + std::to_string(k) + ".";
    MicroBatch m{};
    m.tokens = add(mb + "tokens", DType::I32, {B_, T_}, Role::Input);
    p_.inputs.push_back(m.tokens);
    m.targets = kNoTensor;
    if (with_targets) {
      m.targets = add(mb + "targets", DType::I32, {B_, T_}, Role::Input);
      p_.inputs.push_back(m.targets);
    }
    m.encoded = add(mb + "encoded", act_, {B_, T_, C}, Role::Activation);
    for (int i = 0; i < cfg_.layers; ++i) {
      std::string h = mb + "h" + std::to_string(i) + ".";
      LayerActs a{};
      a.ln1_out = add(h + "ln1_out", act_, {B_, T_, C}, Role::Activation);
      a.ln1_mean = add(h + "ln1_mean", DType::F32, {B_, T_}, Role::Activation);
      a.ln1_rstd = add(h + "ln1_rstd", DType::F32, {B_, T_}, Role::Activation);
      a.qkv = add(h + "qkv", act_, {B_, T_, 3 * C}, Role::Activation);
      a.atty = add(h + "atty", act_, {B_, T_, C}, Role::Activation);
      a.att_lse = add(h + "att_lse", DType::F32, {B_, cfg_.heads, T_}, Role::Activation);
      a.res_attn = add(h + "res_attn", act_, {B_, T_, C}, Role::Activation);
      a.ln2_out = add(h + "ln2_out", act_, {B_, T_, C}, Role::Activation);
      a.ln2_mean = add(h + "ln2_mean", DType::F32, {B_, T_}, Role::Activation);
      a.ln2_rstd = add(h + "ln2_rstd", DType::F32, {B_, T_}, Role::Activation);
      a.fch = add(h + "fch", act_, {B_, T_, 4 * C}, Role::Activation);
      a.fch_gelu = add(h + "fch_gelu", act_, {B_, T_, 4 * C}, Role::Activation);
      a.res_mlp = add(h + "res_mlp", act_, {B_, T_, C}, Role::Activation);
      m.layers.push_back(a);
    }
    m.lnf_out = add(mb + "lnf_out", act_, {B_, T_, C}, Role::Activation);
    m.lnf_mean = add(mb + "lnf_mean", DType::F32, {B_, T_}, Role::Activation);
    m.lnf_rstd = add(mb + "lnf_rstd", DType::F32, {B_, T_}, Role::Activation);
    m.logits = add(mb + "logits", act_, {B_, T_, Vpad_}, Role::Activation);
    m.losses = kNoTensor;
    if (with_targets) m.losses = add(mb + "losses", DType::F32, {N_}, Role::Activation);
    if (logits_output) p_.outputs.push_back(m.logits);
    if (with_targets) p_.outputs.push_back(m.losses);
    return m;
  }

  void zero_grads() {
    for (size_t p = 0; p < specs_.size(); ++p)
      for (const ParamTensors& t : params_[p])
        op(OpKind::Zero, "zero." + p_.tensors.info(t.grad).name, {w(t.grad)}, {}, Phase::Forward, specs_[p].layer, 0);
  }

  // Forward of micro-batch k up to the logits.
  void forward(int k, const MicroBatch& m) {
    const int64_t C = C_;
    std::string mb = "mb" + std::to_string(k) + ".";
    // One op per vocab tile: each writes the positions whose token is in its tile.
    for (const ParamTensors& t : params_[0]) {
      OpAttrs a{.B = B_, .T = T_, .C = C, .V = t.rows};
      a.begin = t.row_begin;
      op(OpKind::EmbeddingForward, mb + "embedding.forward" + tile_suffix(t),
         {t.row_begin == 0 ? w(m.encoded) : u(m.encoded), r(m.tokens), r(t.param), r(param(1))}, a, Phase::Forward,
         -1, k);
    }
    TensorId x = m.encoded;  // the residual stream entering block i
    for (int i = 0; i < cfg_.layers; ++i) {
      const LayerActs& a = m.layers[i];
      const LayerScratch& s = scratch_[i];
      BlockParams bp = block_params(i);
      std::string h = mb + "h" + std::to_string(i) + ".";
      auto fwd = [&](OpKind kind, const std::string& what, std::vector<Operand> ops, OpAttrs attrs) {
        op(kind, h + what + ".forward", std::move(ops), attrs, Phase::Forward, i, k);
      };
      fwd(OpKind::LayerNormForward, "ln1",
          {w(a.ln1_out), w(a.ln1_mean), w(a.ln1_rstd), r(x), r(param(bp.ln1_w)), r(param(bp.ln1_b))}, nc());
      fwd(OpKind::MatmulForward, "qkv", {w(a.qkv), r(a.ln1_out), r(param(bp.qkv_w)), r(param(bp.qkv_b))},
          mm(C, 3 * C));
      fwd(OpKind::AttentionForward, "attn", {w(a.atty), w(a.att_lse), r(a.qkv)},
          {.B = B_, .T = T_, .C = C, .NH = cfg_.heads});
      fwd(OpKind::MatmulForward, "proj", {w(s.attn_proj), r(a.atty), r(param(bp.proj_w)), r(param(bp.proj_b))},
          mm(C, C));
      fwd(OpKind::ResidualForward, "residual1", {w(a.res_attn), r(x), r(s.attn_proj)}, {.n = N_ * C});
      fwd(OpKind::LayerNormForward, "ln2",
          {w(a.ln2_out), w(a.ln2_mean), w(a.ln2_rstd), r(a.res_attn), r(param(bp.ln2_w)), r(param(bp.ln2_b))}, nc());
      fwd(OpKind::MatmulForward, "fc", {w(a.fch), r(a.ln2_out), r(param(bp.fc_w)), r(param(bp.fc_b))},
          mm(C, 4 * C));
      fwd(OpKind::GeluForward, "gelu", {w(a.fch_gelu), r(a.fch)}, {.n = N_ * 4 * C});
      fwd(OpKind::MatmulForward, "fc2", {w(s.mlp_proj), r(a.fch_gelu), r(param(bp.fc2_w)), r(param(bp.fc2_b))},
          mm(4 * C, C));
      fwd(OpKind::ResidualForward, "residual2", {w(a.res_mlp), r(a.res_attn), r(s.mlp_proj)}, {.n = N_ * C});
      x = a.res_mlp;
    }
    size_t lnf_w = specs_.size() - 2, lnf_b = specs_.size() - 1;
    op(OpKind::LayerNormForward, mb + "ln_f.forward",
       {w(m.lnf_out), w(m.lnf_mean), w(m.lnf_rstd), r(x), r(param(lnf_w)), r(param(lnf_b))}, nc(), Phase::Forward,
       -1, k);
    // The LM head in blocks of kVocabBlock output channels (vocab rows), one op per
    // vocab tile: logits columns [row_begin, row_begin + rows).
    for (const ParamTensors& t : params_[0])
      op(OpKind::MatmulForward, mb + "lm_head.forward" + tile_suffix(t),
         {t.row_begin == 0 ? w(m.logits) : u(m.logits), r(m.lnf_out), r(t.param)}, lm_head(t), Phase::Forward, -1, k);
  }

  void loss(int k, const MicroBatch& m, int accum, bool backward) {
    std::string mb = "mb" + std::to_string(k) + ".";
    if (backward) {
      OpAttrs a{.N = N_, .V = V_};
      a.ld = Vpad_;
      a.scale = static_cast<float>(1.0 / (static_cast<double>(N_) * accum));
      op(OpKind::CrossEntropyBackward, mb + "crossentropy", {w(m.losses), u(m.logits), r(m.targets)}, a,
         Phase::Forward, -1, k);
    } else {
      op(OpKind::CrossEntropyForward, mb + "crossentropy.forward", {w(m.losses), r(m.logits), r(m.targets)},
         ce_forward(), Phase::Forward, -1, k);
    }
  }

  void backward(int k, const MicroBatch& m) {
    const int64_t C = C_;
    std::string mb = "mb" + std::to_string(k) + ".";
    TensorId dres = add(mb + "dres", act_, {B_, T_, C}, Role::Activation);
    auto bwd = [&](const std::string& name, OpKind kind, std::vector<Operand> ops, OpAttrs attrs, int layer) {
      op(kind, name, std::move(ops), attrs, Phase::Backward, layer, k);
    };
    for (const ParamTensors& t : params_[0])
      bwd(mb + "lm_head.backward" + tile_suffix(t), OpKind::MatmulBackward,
          {t.row_begin == 0 ? w(d_lnf_out_) : u(d_lnf_out_), u(t.grad), r(m.logits), r(m.lnf_out), r(t.param)},
          lm_head(t), -1);
    bwd(mb + "dres.zero", OpKind::Zero, {w(dres)}, {}, -1);
    size_t lnf_w = specs_.size() - 2, lnf_b = specs_.size() - 1;
    TensorId last = cfg_.layers > 0 ? m.layers.back().res_mlp : m.encoded;
    bwd(mb + "ln_f.backward", OpKind::LayerNormBackward,
        {u(dres), u(grad(lnf_w)), u(grad(lnf_b)), r(d_lnf_out_), r(last), r(param(lnf_w)), r(m.lnf_mean),
         r(m.lnf_rstd)},
        nc(), -1);
    for (int i = cfg_.layers - 1; i >= 0; --i) {
      const LayerActs& a = m.layers[i];
      const LayerScratch& s = scratch_[i];
      BlockParams bp = block_params(i);
      TensorId x = i == 0 ? m.encoded : m.layers[i - 1].res_mlp;
      std::string h = mb + "h" + std::to_string(i) + ".";
      auto lb = [&](const std::string& what, OpKind kind, std::vector<Operand> ops, OpAttrs attrs) {
        bwd(h + what + ".backward", kind, std::move(ops), attrs, i);
      };
      lb("fc2", OpKind::MatmulBackward,
         {w(s.d_fch_gelu), u(grad(bp.fc2_w)), r(dres), r(a.fch_gelu), r(param(bp.fc2_w)), u(grad(bp.fc2_b))},
         mm(4 * C, C));
      lb("gelu", OpKind::GeluBackward, {w(s.d_fch), r(a.fch), r(s.d_fch_gelu)}, {.n = N_ * 4 * C});
      lb("fc", OpKind::MatmulBackward,
         {w(s.d_ln2_out), u(grad(bp.fc_w)), r(s.d_fch), r(a.ln2_out), r(param(bp.fc_w)), u(grad(bp.fc_b))},
         mm(C, 4 * C));
      lb("ln2", OpKind::LayerNormBackward,
         {u(dres), u(grad(bp.ln2_w)), u(grad(bp.ln2_b)), r(s.d_ln2_out), r(a.res_attn), r(param(bp.ln2_w)),
          r(a.ln2_mean), r(a.ln2_rstd)},
         nc());
      lb("proj", OpKind::MatmulBackward,
         {w(s.d_atty), u(grad(bp.proj_w)), r(dres), r(a.atty), r(param(bp.proj_w)), u(grad(bp.proj_b))},
         mm(C, C));
      lb("attn", OpKind::AttentionBackward, {w(s.d_qkv), r(s.d_atty), r(a.qkv), r(a.atty), r(a.att_lse)},
         {.B = B_, .T = T_, .C = C, .NH = cfg_.heads});
      lb("qkv", OpKind::MatmulBackward,
         {w(s.d_ln1_out), u(grad(bp.qkv_w)), r(s.d_qkv), r(a.ln1_out), r(param(bp.qkv_w)), u(grad(bp.qkv_b))},
         mm(C, 3 * C));
      lb("ln1", OpKind::LayerNormBackward,
         {u(dres), u(grad(bp.ln1_w)), u(grad(bp.ln1_b)), r(s.d_ln1_out), r(x), r(param(bp.ln1_w)), r(a.ln1_mean),
          r(a.ln1_rstd)},
         nc());
    }
    for (const ParamTensors& t : params_[0]) {
      OpAttrs a{.B = B_, .T = T_, .C = C, .V = t.rows};
      a.begin = t.row_begin;
      std::vector<Operand> ops{u(t.grad), r(dres), r(m.tokens)};
      if (t.row_begin == 0) ops.push_back(u(grad(1)));  // wpe's gradient, once
      bwd(mb + "embedding.backward" + tile_suffix(t), OpKind::EmbeddingBackward, std::move(ops), a, -1);
    }
  }

  void optimizer(float max_grad_norm, float weight_decay) {
    // One F32 element per parameter tensor, and wte one per kVocabBlock rows whether
    // tiled or not: the packed form of program.h, so ClipScale reads one contiguous [P]
    // tensor and a tiled run sums the same norms in the same order.
    const int64_t wte_segments = (V_ + kVocabBlock - 1) / kVocabBlock;
    const auto P = static_cast<int64_t>(specs_.size()) - 1 + wte_segments;
    TensorId sq = add("grad_sqnorms", DType::F32, {P}, Role::Scratch);
    op(OpKind::Zero, "grad_sqnorms.zero", {w(sq)}, {}, Phase::Optimizer, -1, -1);
    int64_t element = 0;
    for (size_t p = 0; p < specs_.size(); ++p) {
      for (const ParamTensors& t : params_[p]) {
        OpAttrs a{.n = p_.tensors.info(t.grad).shape.numel(), .index = element};
        if (p == 0) a.block = kVocabBlock * C_;
        op(OpKind::SquaredNorm, "sqnorm." + p_.tensors.info(t.param).name, {u(sq), r(t.grad)}, a, Phase::Optimizer,
           specs_[p].layer, -1);
        element += a.block > 0 ? (a.n + a.block - 1) / a.block : 1;
      }
    }
    TensorId scale_norm = add("clip.scale_norm", DType::F32, {2}, Role::Activation);
    p_.outputs.push_back(scale_norm);
    std::vector<Operand> clip_ops{w(scale_norm), r(sq)};
    OpAttrs clip{.P = P};
    clip.scale = max_grad_norm;
    op(OpKind::ClipScale, "clip", std::move(clip_ops), clip, Phase::Optimizer, -1, -1);
    for (size_t p = 0; p < specs_.size(); ++p) {
      for (const ParamTensors& t : params_[p]) {
        OpAttrs a{.n = p_.tensors.info(t.param).shape.numel(), .index = static_cast<int64_t>(p)};
        a.scale = specs_[p].decay ? weight_decay : 0.0f;
        op(OpKind::AdamW, "adamw." + p_.tensors.info(t.param).name,
           {w(t.param), u(t.master), u(t.m), u(t.v), r(t.grad), r(scale_norm)}, a, Phase::Optimizer,
           specs_[p].layer, -1);
      }
    }
  }

  Program take() { return std::move(p_); }

 private:
  TensorId add(std::string name, DType dt, Shape shape, Role role) {
    return p_.tensors.add({std::move(name), dt, std::move(shape), role});
  }
  void op(OpKind kind, std::string name, std::vector<Operand> operands, OpAttrs attrs, Phase phase, int layer,
          int micro_batch) {
    Op o;
    o.kind = kind;
    o.name = std::move(name);
    o.operands = std::move(operands);
    o.attrs = attrs;
    o.phase = phase;
    o.layer = layer;
    o.micro_batch = micro_batch;
    p_.add_op(std::move(o));
  }
  static Operand r(TensorId t) { return {t, Access::Read}; }
  static Operand u(TensorId t) { return {t, Access::Update}; }
  static Operand w(TensorId t) { return {t, Access::Write}; }
  // The only piece of a parameter that is never tiled.
  TensorId param(size_t p) const { return params_[p].front().param; }
  TensorId grad(size_t p) const { return params_[p].front().grad; }
  // "" for the whole table, "#j" for vocab tile j.
  std::string tile_suffix(const ParamTensors& t) const {
    return params_[0].size() == 1 ? "" : "#" + std::to_string(t.row_begin / kVocabBlock);
  }
  // LM head over one vocab piece: logits columns [row_begin, row_begin + rows) of rows
  // V apart, in blocks of kVocabBlock channels.
  OpAttrs lm_head(const ParamTensors& t) const {
    OpAttrs a = mm(C_, t.rows);
    a.ld = Vpad_;
    a.begin = t.row_begin;
    a.block = kVocabBlock;
    return a;
  }
  OpAttrs nc() const { return {.C = C_, .N = N_}; }
  OpAttrs ce_forward() const {
    OpAttrs a{.N = N_, .V = V_};
    a.ld = Vpad_;
    return a;
  }
  OpAttrs mm(int64_t C, int64_t OC) const { return {.C = C, .OC = OC, .N = N_}; }

  const GPTConfig& cfg_;
  int64_t B_, T_;
  DType act_;
  bool training_;
  bool tile_vocab_;
  std::vector<ParamSpec> specs_;
  int64_t C_ = 0, V_ = 0, N_ = 0;
  int64_t Vpad_ = 0;  // row stride of the logits
  Program p_;
  std::vector<std::vector<ParamTensors>> params_;  // by ParamSpec index: its pieces in row order
  std::vector<LayerScratch> scratch_;  // by layer
  TensorId d_lnf_out_ = kNoTensor;     // [B,T,C] scratch
};

}  // namespace

Result<Program> build_training_program(const GPTConfig& cfg, StepShape shape, DType act_dtype, float max_grad_norm,
                                       float weight_decay) {
  SPILLWAY_RETURN_IF_ERROR(Builder::check(cfg, shape.B, shape.T, act_dtype));
  if (shape.accum <= 0)
    return Status::invalid_argument("gradient accumulation steps is " + std::to_string(shape.accum) +
                                    "; must be positive");
  if (!(max_grad_norm > 0))
    return Status::invalid_argument("max gradient norm is " + std::to_string(max_grad_norm) + "; must be positive");
  Builder b(cfg, shape.B, shape.T, act_dtype, /*training=*/true, shape.tile_vocab);
  b.add_params();
  b.add_scratch();
  std::vector<MicroBatch> mbs;
  for (int k = 0; k < shape.accum; ++k) mbs.push_back(b.add_micro_batch(k, /*with_targets=*/true, false));
  b.zero_grads();
  for (int k = 0; k < shape.accum; ++k) {
    b.forward(k, mbs[k]);
    b.loss(k, mbs[k], shape.accum, /*backward=*/true);
    b.backward(k, mbs[k]);
  }
  b.optimizer(max_grad_norm, weight_decay);
  Program p = b.take();
  SPILLWAY_RETURN_IF_ERROR(p.validate().with_context("built training program for " + cfg.to_string()));
  return p;
}

Result<Program> build_forward_program(const GPTConfig& cfg, int B, int T, DType act_dtype, bool with_loss,
                                      bool tile_vocab) {
  SPILLWAY_RETURN_IF_ERROR(Builder::check(cfg, B, T, act_dtype));
  Builder b(cfg, B, T, act_dtype, /*training=*/false, tile_vocab);
  b.add_params();
  b.add_scratch();
  MicroBatch m = b.add_micro_batch(0, with_loss, /*logits_output=*/!with_loss);
  b.forward(0, m);
  if (with_loss) b.loss(0, m, 1, /*backward=*/false);
  Program p = b.take();
  SPILLWAY_RETURN_IF_ERROR(p.validate().with_context("built forward program for " + cfg.to_string()));
  return p;
}

}  // namespace spillway
