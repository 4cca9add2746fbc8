#include "model/model.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <set>
#include <utility>

#include "core/random.h"
#include "core/thread_pool.h"

namespace spillway {

// ---------------------------------------------------------------- configuration

namespace {

// Sums and products of int64 with overflow checks: `ok` turns false at the first
// overflow (or a negative input) and stays false.
struct CheckedSum {
  bool ok = true;
  int64_t total = 0;
  int64_t mul(std::initializer_list<int64_t> xs) {
    int64_t r = 1;
    for (int64_t x : xs)
      if (x < 0 || __builtin_mul_overflow(r, x, &r)) ok = false;
    return ok ? r : 0;
  }
  void add(int64_t x) {
    if (!ok || __builtin_add_overflow(total, x, &total)) ok = false;
  }
};

// The parameter count with every product and sum checked; nullopt when it does not
// fit in int64 (or a size is negative). GPT-2: V·C + context·C + L·(12C² + 13C) + 2C;
// Llama: V·C (·2 untied) + L·(2C + 2·C·NH·D + 2·C·KVH·D + 3·C·I) + C.
std::optional<int64_t> checked_num_parameters(const ModelConfig& c) {
  const int64_t L = c.layers, C = c.width, ctx = c.context, V = c.vocab;
  if (L < 0 || C < 0 || ctx < 0 || V < 0 || c.heads < 0 || c.kv_heads < 0 || c.intermediate < 0) return std::nullopt;
  CheckedSum s;
  if (c.arch == Arch::GPT2) {
    s.add(s.mul({V, C}));
    s.add(s.mul({ctx, C}));
    CheckedSum block;
    block.add(block.mul({12, C, C}));
    block.add(block.mul({13, C}));
    if (!block.ok) return std::nullopt;
    s.add(s.mul({L, block.total}));
    s.add(s.mul({2, C}));
  } else {
    const int64_t D = c.heads > 0 ? C / c.heads : 0, KVH = c.kv_heads_or_heads(), I = c.intermediate;
    s.add(s.mul({c.tied ? 1 : 2, V, C}));
    CheckedSum block;
    block.add(block.mul({2, C}));
    block.add(block.mul({2, C, c.heads, D}));
    block.add(block.mul({2, C, KVH, D}));
    block.add(block.mul({3, C, I}));
    if (!block.ok) return std::nullopt;
    s.add(s.mul({L, block.total}));
    s.add(C);
  }
  if (!s.ok) return std::nullopt;
  return s.total;
}

}  // namespace

Status ModelConfig::validate() const {
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
  if (arch == Arch::GPT2) {
    if (kv_heads != 0 || intermediate != 0 || !tied)
      return Status::invalid_argument("a gpt2 model has no kv_heads or intermediate and always ties its LM head; got " +
                                      to_string());
  } else {
    SPILLWAY_RETURN_IF_ERROR(in_range("kv_heads", kv_heads));
    SPILLWAY_RETURN_IF_ERROR(in_range("intermediate", intermediate));
    if (heads % kv_heads != 0)
      return Status::invalid_argument("model heads " + std::to_string(heads) + " is not divisible by kv_heads " +
                                      std::to_string(kv_heads));
    if (head_dim() % 2 != 0)
      return Status::invalid_argument("model head size width/heads = " + std::to_string(head_dim()) +
                                      " is odd; rotary embeddings need an even head size");
    if (!(norm_eps > 0) || !std::isfinite(norm_eps))
      return Status::invalid_argument("model norm_eps (rms_norm_eps) is " + std::to_string(norm_eps) +
                                      "; must be positive");
    if (!(rope.theta > 0) || !std::isfinite(rope.theta))
      return Status::invalid_argument("model rope_theta is " + std::to_string(rope.theta) + "; must be positive");
    if (rope.llama3) {
      if (!(rope.factor > 0) || !(rope.low_freq_factor > 0) || !(rope.high_freq_factor > rope.low_freq_factor) ||
          rope.original_context <= 0)
        return Status::invalid_argument(
            "llama3 rope scaling needs factor > 0, low_freq_factor > 0, high_freq_factor > low_freq_factor and "
            "original_max_position_embeddings > 0; got factor " + std::to_string(rope.factor) + ", low_freq_factor " +
            std::to_string(rope.low_freq_factor) + ", high_freq_factor " + std::to_string(rope.high_freq_factor) +
            ", original_max_position_embeddings " + std::to_string(rope.original_context));
    }
  }
  const std::optional<int64_t> params = checked_num_parameters(*this);
  if (!params || *params > kMaxModelParameters)
    return Status::invalid_argument(
        "model " + to_string() + " has " +
        (params ? std::to_string(*params) : std::string("more than 2^63")) +
        " parameters; the limit is 2^40 = " + std::to_string(kMaxModelParameters));
  return Status::ok();
}

const char* arch_name(Arch a) { return a == Arch::Llama ? "llama" : "gpt2"; }

int64_t ModelConfig::num_parameters() const {
  if (layers < 0 || width < 0 || context < 0 || vocab < 0 || heads < 0 || kv_heads < 0 || intermediate < 0) return 0;
  return checked_num_parameters(*this).value_or(std::numeric_limits<int64_t>::max());
}

std::string ModelConfig::to_string() const {
  std::string s = "layers=" + std::to_string(layers) + " width=" + std::to_string(width) +
                  " heads=" + std::to_string(heads) + " context=" + std::to_string(context) +
                  " vocab=" + std::to_string(vocab);
  if (arch == Arch::GPT2) return s;
  auto num = [](double v) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%g", v);
    return std::string(buf);
  };
  s += " arch=llama kv_heads=" + std::to_string(kv_heads) + " intermediate=" + std::to_string(intermediate) +
       " tied=" + (tied ? "1" : "0") + " norm_eps=" + num(norm_eps) + " rope_theta=" + num(rope.theta);
  if (rope.llama3)
    s += " rope=llama3 factor=" + num(rope.factor) + " low_freq_factor=" + num(rope.low_freq_factor) +
         " high_freq_factor=" + num(rope.high_freq_factor) +
         " original_context=" + std::to_string(rope.original_context);
  return s;
}

ModelConfig llama_config(int layers, int width, int heads, int kv_heads, int intermediate, int context, int vocab,
                         bool tied, float norm_eps, RopeParams rope) {
  ModelConfig c{layers, width, heads, context, vocab};
  c.arch = Arch::Llama;
  c.kv_heads = kv_heads;
  c.intermediate = intermediate;
  c.tied = tied;
  c.norm_eps = norm_eps;
  c.rope = rope;
  return c;
}

namespace {

struct Preset {
  const char* name;
  ModelConfig cfg;
};

ModelConfig llama(int layers, int width, int heads, int kv_heads, int intermediate, int context, int vocab, bool tied,
                  RopeParams rope) {
  return llama_config(layers, width, heads, kv_heads, intermediate, context, vocab, tied, 1e-5f, rope);
}

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
      {"llama-tiny", llama(4, 128, 4, 2, 256, 256, 256, true, {500000.0f, true, 8.0f, 1.0f, 4.0f, 64})},
      // meta-llama/Llama-3.2-1B, Llama-3.2-3B and Llama-3.1-8B config.json.
      {"llama-3.2-1b", llama(16, 2048, 32, 8, 8192, 131072, 128256, true, {500000.0f, true, 32.0f, 1.0f, 4.0f, 8192})},
      {"llama-3.2-3b", llama(28, 3072, 24, 8, 8192, 131072, 128256, true, {500000.0f, true, 32.0f, 1.0f, 4.0f, 8192})},
      {"llama-3.1-8b", llama(32, 4096, 32, 8, 14336, 131072, 128256, false, {500000.0f, true, 8.0f, 1.0f, 4.0f, 8192})},
  };
  return p;
}

}  // namespace

Result<ModelConfig> model_preset(std::string_view name) {
  for (const Preset& p : presets())
    if (name == p.name) return p.cfg;
  std::string names;
  for (const Preset& p : presets()) names += std::string(names.empty() ? "" : ", ") + p.name;
  return Status::invalid_argument("unknown model preset '" + std::string(name) + "'; known presets: " + names);
}

std::vector<std::string> model_preset_names() {
  std::vector<std::string> names;
  for (const Preset& p : presets()) names.emplace_back(p.name);
  return names;
}

// ---------------------------------------------------------------- parameters

namespace {

std::vector<ParamSpec> gpt2_parameter_specs(const ModelConfig& cfg) {
  const int64_t C = cfg.width;
  const double std_dev = 0.02, proj_std = 0.02 / std::sqrt(2.0 * cfg.layers);
  auto weight = [&](std::string name, Shape shape, int layer, bool conv1d, double sd) {
    return ParamSpec{std::move(name), std::move(shape), layer, true, conv1d, ParamInit::Normal, sd};
  };
  auto constant = [](std::string name, int64_t n, int layer, ParamInit init) {
    return ParamSpec{std::move(name), Shape{n}, layer, false, false, init, 0.0};
  };
  std::vector<ParamSpec> specs;
  specs.push_back(weight("transformer.wte.weight", {cfg.vocab, C}, -1, false, std_dev));
  specs.back().vocab = true;
  specs.push_back(weight("transformer.wpe.weight", {cfg.context, C}, -1, false, std_dev));
  for (int i = 0; i < cfg.layers; ++i) {
    std::string h = "transformer.h." + std::to_string(i) + ".";
    specs.push_back(constant(h + "ln_1.weight", C, i, ParamInit::Ones));
    specs.push_back(constant(h + "ln_1.bias", C, i, ParamInit::Zeros));
    specs.push_back(weight(h + "attn.c_attn.weight", {3 * C, C}, i, true, std_dev));
    specs.push_back(constant(h + "attn.c_attn.bias", 3 * C, i, ParamInit::Zeros));
    specs.push_back(weight(h + "attn.c_proj.weight", {C, C}, i, true, proj_std));
    specs.push_back(constant(h + "attn.c_proj.bias", C, i, ParamInit::Zeros));
    specs.push_back(constant(h + "ln_2.weight", C, i, ParamInit::Ones));
    specs.push_back(constant(h + "ln_2.bias", C, i, ParamInit::Zeros));
    specs.push_back(weight(h + "mlp.c_fc.weight", {4 * C, C}, i, true, std_dev));
    specs.push_back(constant(h + "mlp.c_fc.bias", 4 * C, i, ParamInit::Zeros));
    specs.push_back(weight(h + "mlp.c_proj.weight", {C, 4 * C}, i, true, proj_std));
    specs.push_back(constant(h + "mlp.c_proj.bias", C, i, ParamInit::Zeros));
  }
  specs.push_back(constant("transformer.ln_f.weight", C, -1, ParamInit::Ones));
  specs.push_back(constant("transformer.ln_f.bias", C, -1, ParamInit::Zeros));
  return specs;
}

std::vector<ParamSpec> llama_parameter_specs(const ModelConfig& cfg) {
  const int64_t C = cfg.width, D = cfg.head_dim(), NH = cfg.heads, KVH = cfg.kv_heads_or_heads(),
                I = cfg.intermediate;
  auto weight = [](std::string name, Shape shape, int layer) {
    return ParamSpec{std::move(name), std::move(shape), layer, true, false, ParamInit::Normal, 0.02};
  };
  auto norm = [C](std::string name, int layer) {
    return ParamSpec{std::move(name), Shape{C}, layer, false, false, ParamInit::Ones, 0.0};
  };
  std::vector<ParamSpec> specs;
  specs.push_back(weight("model.embed_tokens.weight", {cfg.vocab, C}, -1));
  specs.back().vocab = true;
  for (int i = 0; i < cfg.layers; ++i) {
    std::string h = "model.layers." + std::to_string(i) + ".";
    specs.push_back(norm(h + "input_layernorm.weight", i));
    specs.push_back(weight(h + "self_attn.q_proj.weight", {NH * D, C}, i));
    specs.push_back(weight(h + "self_attn.k_proj.weight", {KVH * D, C}, i));
    specs.push_back(weight(h + "self_attn.v_proj.weight", {KVH * D, C}, i));
    specs.push_back(weight(h + "self_attn.o_proj.weight", {C, NH * D}, i));
    specs.push_back(norm(h + "post_attention_layernorm.weight", i));
    specs.push_back(weight(h + "mlp.gate_proj.weight", {I, C}, i));
    specs.push_back(weight(h + "mlp.up_proj.weight", {I, C}, i));
    specs.push_back(weight(h + "mlp.down_proj.weight", {C, I}, i));
  }
  specs.push_back(norm("model.norm.weight", -1));
  if (!cfg.tied) {
    specs.push_back(weight("lm_head.weight", {cfg.vocab, C}, -1));
    specs.back().vocab = true;
  }
  return specs;
}

}  // namespace

std::vector<ParamSpec> parameter_specs(const ModelConfig& cfg) {
  return cfg.arch == Arch::Llama ? llama_parameter_specs(cfg) : gpt2_parameter_specs(cfg);
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

void init_parameter_range(const ModelConfig& /*cfg*/, const ParamSpec& param, uint64_t seed, size_t begin, size_t end,
                          float* out) {
  const size_t n = static_cast<size_t>(param.shape.numel());
  end = std::min(end, n);
  if (begin >= end) return;
  if (param.init != ParamInit::Normal) {
    std::fill(out, out + (end - begin), param.init == ParamInit::Ones ? 1.0f : 0.0f);
    return;
  }
  const double std_dev = param.init_std;
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

void init_parameter_into(const ModelConfig& cfg, const ParamSpec& param, uint64_t seed, float* out, ThreadPool& pool) {
  const size_t n = static_cast<size_t>(param.shape.numel());
  const size_t chunk = 2 * kInitPairsPerChunk;  // even, so no pair is split between chunks
  const auto chunks = static_cast<int64_t>((n + chunk - 1) / chunk);
  pool.parallel_for(chunks, [&](int64_t c0, int64_t c1) {
    const size_t begin = static_cast<size_t>(c0) * chunk, end = std::min(n, static_cast<size_t>(c1) * chunk);
    init_parameter_range(cfg, param, seed, begin, end, out + begin);
  });
}

std::vector<float> init_parameter(const ModelConfig& cfg, const ParamSpec& param, uint64_t seed, ThreadPool* pool) {
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

// Indices into the ParamSpec list of one block's parameters. GPT-2 uses all but q, k,
// v, gate, up and down (n = none); Llama has no biases and uses ln1_w, q, k, v,
// proj_w (o_proj), ln2_w, gate, up, fc2_w (down_proj).
constexpr size_t n = SIZE_MAX;
struct BlockParams {
  size_t ln1_w = n, ln1_b = n, qkv_w = n, qkv_b = n, q = n, k = n, v = n, proj_w = n, proj_b = n;
  size_t ln2_w = n, ln2_b = n, fc_w = n, fc_b = n, gate = n, up = n, fc2_w = n, fc2_b = n;
};

BlockParams block_params(const ModelConfig& cfg, int layer) {
  BlockParams p;
  if (cfg.arch == Arch::Llama) {
    const size_t b = 1 + static_cast<size_t>(layer) * 9;
    p.ln1_w = b, p.q = b + 1, p.k = b + 2, p.v = b + 3, p.proj_w = b + 4, p.ln2_w = b + 5;
    p.gate = b + 6, p.up = b + 7, p.fc2_w = b + 8;
    return p;
  }
  const size_t b = 2 + static_cast<size_t>(layer) * 12;
  p.ln1_w = b, p.ln1_b = b + 1, p.qkv_w = b + 2, p.qkv_b = b + 3, p.proj_w = b + 4, p.proj_b = b + 5;
  p.ln2_w = b + 6, p.ln2_b = b + 7, p.fc_w = b + 8, p.fc_b = b + 9, p.fc2_w = b + 10, p.fc2_b = b + 11;
  return p;
}

// The activations one micro-batch saves from its forward pass for its backward pass.
// Fields an architecture does not use are kNoTensor (GPT-2: qkv_rot, fch_act; Llama:
// ln*_mean, fch_gelu).
struct LayerActs {
  TensorId ln1_out, ln1_mean, ln1_rstd;  // [B,T,C], [B,T] F32, [B,T] F32
  TensorId qkv;                          // GPT-2 [B,T,3C]
  TensorId qkv_rot;                      // Llama [B,T,W]: q and k rotated
  TensorId atty, att_lse;                // [B,T,C], [B,NH,T] F32
  TensorId res_attn;                     // [B,T,C]
  TensorId ln2_out, ln2_mean, ln2_rstd;  // [B,T,C], [B,T] F32, [B,T] F32
  TensorId fch;                          // GPT-2 [B,T,4C]; Llama [B,T,2I] (gate | up)
  TensorId fch_gelu;                     // GPT-2 [B,T,4C]
  TensorId fch_act;                      // Llama [B,T,I] = silu(gate)·up
  TensorId res_mlp;                      // [B,T,C]
};

struct MicroBatch {
  TensorId tokens, targets;                // [B,T] I32
  TensorId encoded;                        // [B,T,C]
  std::vector<LayerActs> layers;           // per block
  TensorId lnf_out, lnf_mean, lnf_rstd;    // [B,T,C], [B,T] F32 (GPT-2), [B,T] F32
  TensorId logits;                         // [B,T,Vp]
  TensorId losses;                         // [B·T] F32
};

// Per-layer scratch, shared by micro-batches; each is written before it is read.
struct LayerScratch {
  TensorId qkv;                  // Llama [B,T,W]: q|k|v before the rotation
  TensorId d_fch_act, d_fch;     // Llama [B,T,I], [B,T,2I]; GPT-2 only d_fch [B,T,4C] (of fch, through the GELU)
  TensorId d_ln2_out, d_atty;    // [B,T,C]
  TensorId d_qkv_rot;            // Llama [B,T,W]
  TensorId d_qkv;                // [B,T,3C] / [B,T,W]
  TensorId d_ln1_out;            // [B,T,C]
};

// The most elements one activation tensor may have (2^58: its bytes fit in 63 bits).
constexpr int64_t kMaxActivationElements = int64_t{1} << 58;

class Builder {
 public:
  Builder(const ModelConfig& cfg, int B, int T, DType act, bool training, bool tile_vocab)
      : cfg_(cfg), llama_(cfg.arch == Arch::Llama), B_(B), T_(T), act_(act), training_(training),
        tile_vocab_(tile_vocab), specs_(parameter_specs(cfg)) {
    C_ = cfg.width;
    V_ = cfg.vocab;
    Vpad_ = logits_row_stride(cfg.vocab);
    N_ = int64_t{B} * T;
    W_ = cfg.qkv_width();
    H_ = llama_ ? cfg.intermediate : 4 * C_;
    head_ = llama_ && !cfg.tied ? specs_.size() - 1 : 0;
    lnf_w_ = llama_ ? specs_.size() - (cfg.tied ? 1 : 2) : specs_.size() - 2;
    lnf_b_ = llama_ ? n : specs_.size() - 1;
  }

  static Status check(const ModelConfig& cfg, int B, int T, DType act) {
    SPILLWAY_RETURN_IF_ERROR(cfg.validate());
    if (B <= 0) return Status::invalid_argument("batch size B is " + std::to_string(B) + "; must be positive");
    if (T <= 0 || T > cfg.context)
      return Status::invalid_argument("sequence length T is " + std::to_string(T) + "; must be in 1.." +
                                      std::to_string(cfg.context) + " (the model's context)");
    if (act != DType::F32 && act != DType::BF16)
      return Status::invalid_argument(std::string("activation dtype ") + dtype_name(act) + " is not f32 or bf16");
    // The widest activation, [B,T,max(MLP, q|k|v, Vp)]: its element count, and its bytes, in 64 bits.
    const int64_t mlp = cfg.arch == Arch::Llama ? int64_t{2} * cfg.intermediate : int64_t{4} * cfg.width;
    const int64_t widest = std::max({mlp, cfg.qkv_width(), logits_row_stride(cfg.vocab)});
    int64_t elems = 0;
    if (__builtin_mul_overflow(int64_t{B} * T, widest, &elems) || elems > kMaxActivationElements)
      return Status::invalid_argument("batch size B " + std::to_string(B) + " x sequence length T " + std::to_string(T) +
                                      " x row width " + std::to_string(widest) +
                                      " (the widest activation of model " + cfg.to_string() +
                                      ") exceeds 2^58 elements per tensor");
    return Status::ok();
  }

  // Every parameter is one piece, except a vocabulary table (the embedding, an untied
  // LM head) when tiled: one piece per kVocabBlock rows, named "<name>#<j>"
  // (Program::pieces finds them).
  void add_params() {
    for (size_t p = 0; p < specs_.size(); ++p) {
      const ParamSpec& s = specs_[p];
      std::vector<ParamTensors> pieces;
      const int64_t rows = s.shape.dims[0];
      const bool tiled = s.vocab && tile_vocab_ && rows > kVocabBlock;
      for (int64_t r0 = 0, j = 0; r0 < rows; r0 += tiled ? kVocabBlock : rows, ++j) {
        ParamTensors t;
        t.row_begin = r0;
        t.rows = tiled ? std::min<int64_t>(kVocabBlock, rows - r0) : rows;
        Shape shape = s.shape;
        shape.dims[0] = t.rows;
        const std::string name = tiled ? tile_name(s.name, j) : s.name;
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
      s.qkv = s.d_qkv_rot = kNoTensor;
      if (llama_) s.qkv = add(h + "qkv", act_, {B_, T_, W_}, Role::Scratch);
      if (training_) {
        s.d_fch_act = llama_ ? add(h + "d_fch_act", act_, {B_, T_, H_}, Role::Scratch) : kNoTensor;
        s.d_fch = add(h + "d_fch", act_, {B_, T_, llama_ ? 2 * H_ : H_}, Role::Scratch);
        s.d_ln2_out = add(h + "d_ln2_out", act_, {B_, T_, C}, Role::Scratch);
        s.d_atty = add(h + "d_atty", act_, {B_, T_, C}, Role::Scratch);
        if (llama_) s.d_qkv_rot = add(h + "d_qkv_rot", act_, {B_, T_, W_}, Role::Scratch);
        s.d_qkv = add(h + "d_qkv", act_, {B_, T_, W_}, Role::Scratch);
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
      a.ln1_mean = a.ln2_mean = a.qkv = a.qkv_rot = a.fch_gelu = a.fch_act = kNoTensor;
      a.ln1_out = add(h + "ln1_out", act_, {B_, T_, C}, Role::Activation);
      if (!llama_) a.ln1_mean = add(h + "ln1_mean", DType::F32, {B_, T_}, Role::Activation);
      a.ln1_rstd = add(h + "ln1_rstd", DType::F32, {B_, T_}, Role::Activation);
      if (llama_)
        a.qkv_rot = add(h + "qkv_rot", act_, {B_, T_, W_}, Role::Activation);
      else
        a.qkv = add(h + "qkv", act_, {B_, T_, W_}, Role::Activation);
      a.atty = add(h + "atty", act_, {B_, T_, C}, Role::Activation);
      a.att_lse = add(h + "att_lse", DType::F32, {B_, cfg_.heads, T_}, Role::Activation);
      a.res_attn = add(h + "res_attn", act_, {B_, T_, C}, Role::Activation);
      a.ln2_out = add(h + "ln2_out", act_, {B_, T_, C}, Role::Activation);
      if (!llama_) a.ln2_mean = add(h + "ln2_mean", DType::F32, {B_, T_}, Role::Activation);
      a.ln2_rstd = add(h + "ln2_rstd", DType::F32, {B_, T_}, Role::Activation);
      a.fch = add(h + "fch", act_, {B_, T_, llama_ ? 2 * H_ : H_}, Role::Activation);
      if (llama_)
        a.fch_act = add(h + "fch_act", act_, {B_, T_, H_}, Role::Activation);
      else
        a.fch_gelu = add(h + "fch_gelu", act_, {B_, T_, H_}, Role::Activation);
      a.res_mlp = add(h + "res_mlp", act_, {B_, T_, C}, Role::Activation);
      m.layers.push_back(a);
    }
    m.lnf_out = add(mb + "lnf_out", act_, {B_, T_, C}, Role::Activation);
    m.lnf_mean = llama_ ? kNoTensor : add(mb + "lnf_mean", DType::F32, {B_, T_}, Role::Activation);
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
    std::string mb = "mb" + std::to_string(k) + ".";
    // One op per vocab tile: each writes the positions whose token is in its tile.
    for (const ParamTensors& t : params_[0]) {
      OpAttrs a{.B = B_, .T = T_, .C = C_, .V = t.rows};
      a.begin = t.row_begin;
      std::vector<Operand> ops{t.row_begin == 0 ? w(m.encoded) : u(m.encoded), r(m.tokens), r(t.param)};
      if (!llama_) ops.push_back(r(param(1)));  // wpe
      op(OpKind::EmbeddingForward, mb + "embedding.forward" + tile_suffix(0, t), std::move(ops), a, Phase::Forward,
         -1, k);
    }
    TensorId x = m.encoded;  // the residual stream entering block i
    for (int i = 0; i < cfg_.layers; ++i) {
      if (llama_)
        forward_llama_block(k, i, m.layers[i], x);
      else
        forward_gpt2_block(k, i, m.layers[i], x);
      x = m.layers[i].res_mlp;
    }
    norm_forward(mb + "ln_f.forward", m.lnf_out, m.lnf_mean, m.lnf_rstd, x, lnf_w_, lnf_b_, -1, k);
    // The LM head in blocks of kVocabBlock output channels (vocab rows), one op per
    // vocab tile: logits columns [row_begin, row_begin + rows).
    for (const ParamTensors& t : params_[head_])
      op(OpKind::MatmulForward, mb + "lm_head.forward" + tile_suffix(head_, t),
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
    std::string mb = "mb" + std::to_string(k) + ".";
    TensorId dres = add(mb + "dres", act_, {B_, T_, C_}, Role::Activation);
    for (const ParamTensors& t : params_[head_])
      op(OpKind::MatmulBackward, mb + "lm_head.backward" + tile_suffix(head_, t),
         {t.row_begin == 0 ? w(d_lnf_out_) : u(d_lnf_out_), u(t.grad), r(m.logits), r(m.lnf_out), r(t.param)},
         lm_head(t), Phase::Backward, -1, k);
    op(OpKind::Zero, mb + "dres.zero", {w(dres)}, {}, Phase::Backward, -1, k);
    TensorId last = cfg_.layers > 0 ? m.layers.back().res_mlp : m.encoded;
    norm_backward(mb + "ln_f.backward", dres, d_lnf_out_, last, lnf_w_, lnf_b_, m.lnf_mean, m.lnf_rstd, -1, k);
    for (int i = cfg_.layers - 1; i >= 0; --i) {
      TensorId x = i == 0 ? m.encoded : m.layers[i - 1].res_mlp;
      if (llama_)
        backward_llama_block(k, i, m.layers[i], x, dres);
      else
        backward_gpt2_block(k, i, m.layers[i], x, dres);
    }
    for (const ParamTensors& t : params_[0]) {
      OpAttrs a{.B = B_, .T = T_, .C = C_, .V = t.rows};
      a.begin = t.row_begin;
      std::vector<Operand> ops{u(t.grad), r(dres), r(m.tokens)};
      if (!llama_ && t.row_begin == 0) ops.push_back(u(grad(1)));  // wpe's gradient, once
      op(OpKind::EmbeddingBackward, mb + "embedding.backward" + tile_suffix(0, t), std::move(ops), a,
         Phase::Backward, -1, k);
    }
  }

  void optimizer(float max_grad_norm, float weight_decay) {
    // One F32 element per parameter tensor, and a vocabulary table one per
    // kVocabBlock rows whether tiled or not: the packed form of program.h, so ClipScale
    // reads one contiguous [P] tensor and a tiled run sums the same norms in the same order.
    const int64_t vocab_segments = (V_ + kVocabBlock - 1) / kVocabBlock;
    int64_t P = 0;
    for (const ParamSpec& s : specs_) P += s.vocab ? vocab_segments : 1;
    TensorId sq = add("grad_sqnorms", DType::F32, {P}, Role::Scratch);
    op(OpKind::Zero, "grad_sqnorms.zero", {w(sq)}, {}, Phase::Optimizer, -1, -1);
    int64_t element = 0;
    for (size_t p = 0; p < specs_.size(); ++p) {
      for (const ParamTensors& t : params_[p]) {
        OpAttrs a{.n = p_.tensors.info(t.grad).shape.numel(), .index = element};
        if (specs_[p].vocab) a.block = kVocabBlock * C_;
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
  void forward_gpt2_block(int k, int i, const LayerActs& a, TensorId x) {
    const int64_t C = C_;
    const BlockParams bp = block_params(cfg_, i);
    const std::string h = "mb" + std::to_string(k) + ".h" + std::to_string(i) + ".";
    auto fwd = [&](OpKind kind, const std::string& what, std::vector<Operand> ops, OpAttrs attrs) {
      op(kind, h + what + ".forward", std::move(ops), attrs, Phase::Forward, i, k);
    };
    norm_forward(h + "ln1.forward", a.ln1_out, a.ln1_mean, a.ln1_rstd, x, bp.ln1_w, bp.ln1_b, i, k);
    fwd(OpKind::MatmulForward, "qkv", {w(a.qkv), r(a.ln1_out), r(param(bp.qkv_w)), r(param(bp.qkv_b))},
        mm(C, 3 * C));
    fwd(OpKind::AttentionForward, "attn", {w(a.atty), w(a.att_lse), r(a.qkv)}, attention());
    // res_attn = x + (atty·proj_wᵀ + proj_b), one op (the residual added in the product on CUDA);
    // res_mlp from fc2 and res_attn the same way.
    fwd(OpKind::MatmulResidualForward, "proj",
        {w(a.res_attn), r(a.atty), r(param(bp.proj_w)), r(x), r(param(bp.proj_b))}, mm(C, C));
    norm_forward(h + "ln2.forward", a.ln2_out, a.ln2_mean, a.ln2_rstd, a.res_attn, bp.ln2_w, bp.ln2_b, i, k);
    // fch = ln2_out·fc_wᵀ + fc_b and fch_gelu = gelu(fch), one op (the GELU in the product's epilogue on CUDA).
    fwd(OpKind::MatmulGeluForward, "fc",
        {w(a.fch_gelu), w(a.fch), r(a.ln2_out), r(param(bp.fc_w)), r(param(bp.fc_b))}, mm(C, 4 * C));
    fwd(OpKind::MatmulResidualForward, "fc2",
        {w(a.res_mlp), r(a.fch_gelu), r(param(bp.fc2_w)), r(a.res_attn), r(param(bp.fc2_b))}, mm(4 * C, C));
  }

  void forward_llama_block(int k, int i, const LayerActs& a, TensorId x) {
    const int64_t C = C_, I = H_;
    const LayerScratch& s = scratch_[i];
    const BlockParams bp = block_params(cfg_, i);
    const std::string h = "mb" + std::to_string(k) + ".h" + std::to_string(i) + ".";
    auto fwd = [&](OpKind kind, const std::string& what, std::vector<Operand> ops, OpAttrs attrs) {
      op(kind, h + what + ".forward", std::move(ops), attrs, Phase::Forward, i, k);
    };
    norm_forward(h + "ln1.forward", a.ln1_out, kNoTensor, a.ln1_rstd, x, bp.ln1_w, n, i, k);
    // q, k and v side by side in one row of W channels: three products into columns.
    const int64_t q_w = int64_t{cfg_.heads} * cfg_.head_dim(), kv_w = int64_t{cfg_.kv_heads} * cfg_.head_dim();
    fwd(OpKind::MatmulForward, "q", {w(s.qkv), r(a.ln1_out), r(param(bp.q))}, columns(C, q_w, 0, W_));
    fwd(OpKind::MatmulForward, "k", {u(s.qkv), r(a.ln1_out), r(param(bp.k))}, columns(C, kv_w, q_w, W_));
    fwd(OpKind::MatmulForward, "v", {u(s.qkv), r(a.ln1_out), r(param(bp.v))}, columns(C, kv_w, q_w + kv_w, W_));
    fwd(OpKind::RopeForward, "rope", {w(a.qkv_rot), r(s.qkv)}, rope());
    fwd(OpKind::AttentionForward, "attn", {w(a.atty), w(a.att_lse), r(a.qkv_rot)}, attention());
    // The projections with the residual add after them, one op each (as GPT-2's).
    fwd(OpKind::MatmulResidualForward, "proj", {w(a.res_attn), r(a.atty), r(param(bp.proj_w)), r(x)}, mm(q_w, C));
    norm_forward(h + "ln2.forward", a.ln2_out, kNoTensor, a.ln2_rstd, a.res_attn, bp.ln2_w, n, i, k);
    fwd(OpKind::MatmulForward, "gate", {w(a.fch), r(a.ln2_out), r(param(bp.gate))}, columns(C, I, 0, 2 * I));
    fwd(OpKind::MatmulForward, "up", {u(a.fch), r(a.ln2_out), r(param(bp.up))}, columns(C, I, I, 2 * I));
    fwd(OpKind::SwiGluForward, "swiglu", {w(a.fch_act), r(a.fch)}, {.C = I, .N = N_});
    fwd(OpKind::MatmulResidualForward, "fc2", {w(a.res_mlp), r(a.fch_act), r(param(bp.fc2_w)), r(a.res_attn)},
        mm(I, C));
  }

  void backward_gpt2_block(int k, int i, const LayerActs& a, TensorId x, TensorId dres) {
    const int64_t C = C_;
    const LayerScratch& s = scratch_[i];
    const BlockParams bp = block_params(cfg_, i);
    const std::string h = "mb" + std::to_string(k) + ".h" + std::to_string(i) + ".";
    auto lb = [&](const std::string& what, OpKind kind, std::vector<Operand> ops, OpAttrs attrs) {
      op(kind, h + what + ".backward", std::move(ops), attrs, Phase::Backward, i, k);
    };
    // fc2's parameter gradients, then its input gradient carried through the GELU to
    // d_fch in one op (the DGELU epilogue on CUDA).
    lb("fc2.weight", OpKind::MatmulWeightBackward, {u(grad(bp.fc2_w)), r(dres), r(a.fch_gelu), u(grad(bp.fc2_b))},
       mm(4 * C, C));
    lb("fc2", OpKind::MatmulGeluBackward, {w(s.d_fch), r(dres), r(param(bp.fc2_w)), r(a.fch)}, mm(4 * C, C));
    lb("fc", OpKind::MatmulBackward,
       {w(s.d_ln2_out), u(grad(bp.fc_w)), r(s.d_fch), r(a.ln2_out), r(param(bp.fc_w)), u(grad(bp.fc_b))},
       mm(C, 4 * C));
    norm_backward(h + "ln2.backward", dres, s.d_ln2_out, a.res_attn, bp.ln2_w, bp.ln2_b, a.ln2_mean, a.ln2_rstd, i,
                  k);
    lb("proj", OpKind::MatmulBackward,
       {w(s.d_atty), u(grad(bp.proj_w)), r(dres), r(a.atty), r(param(bp.proj_w)), u(grad(bp.proj_b))}, mm(C, C));
    lb("attn", OpKind::AttentionBackward, {w(s.d_qkv), r(s.d_atty), r(a.qkv), r(a.atty), r(a.att_lse)},
       attention());
    lb("qkv", OpKind::MatmulBackward,
       {w(s.d_ln1_out), u(grad(bp.qkv_w)), r(s.d_qkv), r(a.ln1_out), r(param(bp.qkv_w)), u(grad(bp.qkv_b))},
       mm(C, 3 * C));
    norm_backward(h + "ln1.backward", dres, s.d_ln1_out, x, bp.ln1_w, bp.ln1_b, a.ln1_mean, a.ln1_rstd, i, k);
  }

  void backward_llama_block(int k, int i, const LayerActs& a, TensorId x, TensorId dres) {
    const int64_t C = C_, I = H_;
    const LayerScratch& s = scratch_[i];
    const BlockParams bp = block_params(cfg_, i);
    const std::string h = "mb" + std::to_string(k) + ".h" + std::to_string(i) + ".";
    auto lb = [&](const std::string& what, OpKind kind, std::vector<Operand> ops, OpAttrs attrs) {
      op(kind, h + what + ".backward", std::move(ops), attrs, Phase::Backward, i, k);
    };
    const int64_t q_w = int64_t{cfg_.heads} * cfg_.head_dim(), kv_w = int64_t{cfg_.kv_heads} * cfg_.head_dim();
    lb("fc2", OpKind::MatmulBackward, {w(s.d_fch_act), u(grad(bp.fc2_w)), r(dres), r(a.fch_act), r(param(bp.fc2_w))},
       mm(I, C));
    lb("swiglu", OpKind::SwiGluBackward, {w(s.d_fch), r(a.fch), r(s.d_fch_act)}, {.C = I, .N = N_});
    lb("gate", OpKind::MatmulBackward, {w(s.d_ln2_out), u(grad(bp.gate)), r(s.d_fch), r(a.ln2_out), r(param(bp.gate))},
       columns(C, I, 0, 2 * I));
    lb("up", OpKind::MatmulBackward, {u(s.d_ln2_out), u(grad(bp.up)), r(s.d_fch), r(a.ln2_out), r(param(bp.up))},
       columns(C, I, I, 2 * I));
    norm_backward(h + "ln2.backward", dres, s.d_ln2_out, a.res_attn, bp.ln2_w, n, kNoTensor, a.ln2_rstd, i, k);
    lb("proj", OpKind::MatmulBackward, {w(s.d_atty), u(grad(bp.proj_w)), r(dres), r(a.atty), r(param(bp.proj_w))},
       mm(q_w, C));
    lb("attn", OpKind::AttentionBackward, {w(s.d_qkv_rot), r(s.d_atty), r(a.qkv_rot), r(a.atty), r(a.att_lse)},
       attention());
    lb("rope", OpKind::RopeBackward, {w(s.d_qkv), r(s.d_qkv_rot)}, rope());
    lb("q", OpKind::MatmulBackward, {w(s.d_ln1_out), u(grad(bp.q)), r(s.d_qkv), r(a.ln1_out), r(param(bp.q))},
       columns(C, q_w, 0, W_));
    lb("k", OpKind::MatmulBackward, {u(s.d_ln1_out), u(grad(bp.k)), r(s.d_qkv), r(a.ln1_out), r(param(bp.k))},
       columns(C, kv_w, q_w, W_));
    lb("v", OpKind::MatmulBackward, {u(s.d_ln1_out), u(grad(bp.v)), r(s.d_qkv), r(a.ln1_out), r(param(bp.v))},
       columns(C, kv_w, q_w + kv_w, W_));
    norm_backward(h + "ln1.backward", dres, s.d_ln1_out, x, bp.ln1_w, n, kNoTensor, a.ln1_rstd, i, k);
  }

  // LayerNorm (GPT-2: weight and bias, mean and rstd saved) or RMSNorm (Llama: weight,
  // rstd saved) of x into out.
  void norm_forward(const std::string& name, TensorId out, TensorId mean, TensorId rstd, TensorId x, size_t weight,
                    size_t bias, int layer, int k) {
    if (llama_) {
      OpAttrs a = nc();
      a.scale = cfg_.norm_eps;
      op(OpKind::RmsNormForward, name, {w(out), w(rstd), r(x), r(param(weight))}, a, Phase::Forward, layer, k);
    } else {
      op(OpKind::LayerNormForward, name, {w(out), w(mean), w(rstd), r(x), r(param(weight)), r(param(bias))}, nc(),
         Phase::Forward, layer, k);
    }
  }
  // Its backward: adds into dres and the parameters' gradients.
  void norm_backward(const std::string& name, TensorId dres, TensorId dout, TensorId x, size_t weight, size_t bias,
                     TensorId mean, TensorId rstd, int layer, int k) {
    if (llama_)
      op(OpKind::RmsNormBackward, name, {u(dres), u(grad(weight)), r(dout), r(x), r(param(weight)), r(rstd)}, nc(),
         Phase::Backward, layer, k);
    else
      op(OpKind::LayerNormBackward, name,
         {u(dres), u(grad(weight)), u(grad(bias)), r(dout), r(x), r(param(weight)), r(mean), r(rstd)}, nc(),
         Phase::Backward, layer, k);
  }

  TensorId add(std::string name, DType dt, Shape shape, Role role) {
    return p_.tensors.add({std::move(name), dt, std::move(shape), role});
  }
  // Adds the op. In a bf16 training program, a gradient operand that is not the
  // step's first contribution to that gradient is retargeted to a zeroed part, which
  // AccumulateGradient then adds into the gradient (model.h, "Gradient accumulation").
  void op(OpKind kind, std::string name, std::vector<Operand> operands, OpAttrs attrs, Phase phase, int layer,
          int micro_batch) {
    std::vector<std::pair<TensorId, TensorId>> adds;  // (gradient, its part)
    if (act_ == DType::BF16 && kind != OpKind::Zero) {
      int j = 0;
      for (Operand& o : operands) {
        if (o.access == Access::Read || p_.tensors.info(o.tensor).role != Role::Grad) continue;
        if (contributed_.insert(o.tensor).second) continue;  // the first: in place
        const TensorId part = grad_part(p_.tensors.info(o.tensor).shape, j++);
        emit(OpKind::Zero, name + ".part" + std::to_string(adds.size()) + ".zero", {w(part)}, {}, phase, layer,
             micro_batch);
        adds.emplace_back(o.tensor, part);
        o.tensor = part;
      }
    }
    const std::string base = name;
    emit(kind, std::move(name), std::move(operands), attrs, phase, layer, micro_batch);
    for (size_t i = 0; i < adds.size(); ++i) {
      const auto [grad, part] = adds[i];
      emit(OpKind::AccumulateGradient, base + ".part" + std::to_string(i) + ".accumulate", {u(grad), r(part)},
           {.n = p_.tensors.info(grad).shape.numel()}, phase, layer, micro_batch);
    }
  }
  void emit(OpKind kind, std::string name, std::vector<Operand> operands, OpAttrs attrs, Phase phase, int layer,
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
  // The bf16 part of shape `shape` for an op's j-th later contribution: one scratch
  // tensor per (shape, j), shared by every op (each zeroes it, adds into it, and its
  // AccumulateGradient reads it before the next op zeroes it).
  TensorId grad_part(const Shape& shape, int j) {
    std::string name = "grad_part" + std::to_string(j) + ".";
    for (size_t d = 0; d < shape.dims.size(); ++d) name += (d ? "x" : "") + std::to_string(shape.dims[d]);
    const TensorId found = p_.tensors.find(name);
    if (found != kNoTensor) return found;
    return add(name, act_, shape, Role::Scratch);
  }
  static Operand r(TensorId t) { return {t, Access::Read}; }
  static Operand u(TensorId t) { return {t, Access::Update}; }
  static Operand w(TensorId t) { return {t, Access::Write}; }
  // The only piece of a parameter that is never tiled.
  TensorId param(size_t p) const { return params_[p].front().param; }
  TensorId grad(size_t p) const { return params_[p].front().grad; }
  // "" for a whole table, "#j" for vocab tile j of parameter p.
  std::string tile_suffix(size_t p, const ParamTensors& t) const {
    return params_[p].size() == 1 ? "" : tile_name("", t.row_begin / kVocabBlock);
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
  // A product into (or, backward, from) columns [begin, begin + OC) of rows ld wide.
  OpAttrs columns(int64_t C, int64_t OC, int64_t begin, int64_t ld) const {
    OpAttrs a = mm(C, OC);
    a.begin = begin;
    a.ld = ld;
    return a;
  }
  OpAttrs attention() const {
    OpAttrs a{.B = B_, .T = T_, .C = C_, .NH = cfg_.heads};
    a.KVH = cfg_.kv_heads_or_heads();
    return a;
  }
  OpAttrs rope() const {
    OpAttrs a = attention();
    a.rope = cfg_.rope;
    return a;
  }
  OpAttrs nc() const { return {.C = C_, .N = N_}; }
  OpAttrs ce_forward() const {
    OpAttrs a{.N = N_, .V = V_};
    a.ld = Vpad_;
    return a;
  }
  OpAttrs mm(int64_t C, int64_t OC) const { return {.C = C, .OC = OC, .N = N_}; }

  const ModelConfig& cfg_;
  bool llama_;
  int64_t B_, T_;
  DType act_;
  bool training_;
  bool tile_vocab_;
  std::vector<ParamSpec> specs_;
  int64_t C_ = 0, V_ = 0, N_ = 0;
  int64_t Vpad_ = 0;  // row stride of the logits
  int64_t W_ = 0;     // channels of a q|k|v row
  int64_t H_ = 0;     // MLP channels: GPT-2 4C, Llama intermediate
  size_t head_ = 0;   // ParamSpec index of the LM head's weight (0, the embedding, when tied)
  size_t lnf_w_ = 0, lnf_b_ = n;  // the final norm's parameters (Llama: no bias)
  Program p_;
  std::vector<std::vector<ParamTensors>> params_;  // by ParamSpec index: its pieces in row order
  std::vector<LayerScratch> scratch_;  // by layer
  TensorId d_lnf_out_ = kNoTensor;     // [B,T,C] scratch
  std::set<TensorId> contributed_;     // bf16: gradients with a contribution so far this step
};

}  // namespace

Result<Program> build_training_program(const ModelConfig& cfg, StepShape shape, DType act_dtype, float max_grad_norm,
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

Result<Program> build_forward_program(const ModelConfig& cfg, int B, int T, DType act_dtype, bool with_loss,
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
