#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>
#include <set>
#include <string>

#include "model/model.h"

using namespace spillway;

namespace {

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

const TensorInfo& info(const Program& p, const std::string& name) {
  TensorId id = p.tensors.find(name);
  EXPECT_NE(id, kNoTensor) << name;
  return p.tensors.info(id == kNoTensor ? 0 : id);
}

size_t find_op(const Program& p, const std::string& name) {
  for (size_t i = 0; i < p.ops.size(); ++i)
    if (p.ops[i].name == name) return i;
  ADD_FAILURE() << "no op " << name;
  return p.ops.size();
}

}  // namespace

TEST(ModelConfig, Presets) {
  auto tiny = model_preset("tiny");
  ASSERT_TRUE(tiny.ok());
  EXPECT_EQ(*tiny, (ModelConfig{4, 128, 4, 128, 256}));
  auto g = model_preset("gpt2-124m");
  ASSERT_TRUE(g.ok());
  EXPECT_EQ(*g, (ModelConfig{12, 768, 12, 1024, 50257}));
  EXPECT_EQ(*model_preset("gpt2-350m"), (ModelConfig{24, 1024, 16, 1024, 50257}));
  EXPECT_EQ(*model_preset("gpt2-774m"), (ModelConfig{36, 1280, 20, 1024, 50257}));
  EXPECT_EQ(*model_preset("gpt2-1.5b"), (ModelConfig{48, 1600, 25, 1024, 50257}));
  EXPECT_EQ(*model_preset("gpt-2.7b"), (ModelConfig{32, 2560, 32, 1024, 50257}));
  EXPECT_EQ(*model_preset("gpt-4b"), (ModelConfig{36, 3072, 24, 1024, 50257}));
  EXPECT_EQ(*model_preset("gpt-6.7b"), (ModelConfig{32, 4096, 32, 1024, 50257}));
  EXPECT_EQ(*model_preset("gpt-13b"), (ModelConfig{40, 5120, 40, 1024, 50257}));
  for (const std::string& name : model_preset_names()) {
    auto c = model_preset(name);
    ASSERT_TRUE(c.ok()) << name;
    EXPECT_TRUE(c->validate().is_ok()) << name;
  }
}

TEST(ModelConfig, UnknownPresetListsNames) {
  auto r = model_preset("gpt5");
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(contains(r.status().message(), "'gpt5'"));
  for (const std::string& name : model_preset_names()) EXPECT_TRUE(contains(r.status().message(), name)) << name;
}

TEST(ModelConfig, Validation) {
  Status s = ModelConfig{2, 100, 3, 64, 256}.validate();
  ASSERT_FALSE(s.is_ok());
  EXPECT_TRUE(contains(s.message(), "width 100 is not divisible by heads 3")) << s.message();
  s = ModelConfig{0, 64, 2, 64, 256}.validate();
  ASSERT_FALSE(s.is_ok());
  EXPECT_TRUE(contains(s.message(), "layers is 0")) << s.message();
  EXPECT_FALSE((ModelConfig{2, 64, 2, 0, 256}.validate().is_ok()));
  EXPECT_FALSE((ModelConfig{2, 64, 2, 64, -1}.validate().is_ok()));
}

TEST(ModelConfig, SizesAboveTheLimitsAreRefused) {
  // The UBSan case: --width 1073741824 overflowed in num_parameters.
  Status s = ModelConfig{1, 1073741824, 1, 64, 256}.validate();
  ASSERT_FALSE(s.is_ok());
  EXPECT_TRUE(contains(s.message(), "width is 1073741824; the limit is 2^24 = 16777216")) << s.message();
  // Each size: 2^24 passes the per-size check, 2^24 + 1 does not.
  const int over = static_cast<int>(kMaxModelDim) + 1;
  for (const auto& [c, what] : std::vector<std::pair<ModelConfig, std::string>>{
           {{over, 64, 1, 64, 256}, "layers"},
           {{1, 64, over, 64, 256}, "heads"},
           {{1, 64, 1, over, 256}, "context"},
           {{1, 64, 1, 64, over}, "vocab"}}) {
    s = c.validate();
    ASSERT_FALSE(s.is_ok()) << what;
    EXPECT_TRUE(contains(s.message(), what + " is " + std::to_string(over) + "; the limit is 2^24")) << s.message();
  }
  EXPECT_TRUE((ModelConfig{1, 64, 1, static_cast<int>(kMaxModelDim), 256}.validate().is_ok()));
  EXPECT_TRUE((ModelConfig{1, 64, 1, 64, static_cast<int>(kMaxModelDim)}.validate().is_ok()));
}

// The parameter count in 128-bit arithmetic, as the reference for the 64-bit one.
static __int128 wide_parameter_count(const ModelConfig& c) {
  const __int128 C = c.width;
  return __int128{c.vocab} * C + __int128{c.context} * C + __int128{c.layers} * (12 * C * C + 13 * C) + 2 * C;
}

TEST(ModelConfig, ParameterCountLimitAndOverflow) {
  // Every size within 2^24 but the count past 2^63: refused, and num_parameters
  // saturates instead of overflowing.
  const int max = static_cast<int>(kMaxModelDim);
  ModelConfig huge{max, max, 1, max, max};
  ASSERT_GT(wide_parameter_count(huge), __int128{std::numeric_limits<int64_t>::max()});
  Status s = huge.validate();
  ASSERT_FALSE(s.is_ok());
  EXPECT_TRUE(contains(s.message(), "more than 2^63 parameters; the limit is 2^40 = 1099511627776")) << s.message();
  EXPECT_EQ(huge.num_parameters(), std::numeric_limits<int64_t>::max());
  // At the 2^40 boundary (width 16384): the deepest model under it passes with the
  // exact count; one more layer is refused, its count named.
  ModelConfig c{1, 16384, 128, 1024, 50257};
  const __int128 per_layer = wide_parameter_count(ModelConfig{2, 16384, 128, 1024, 50257}) - wide_parameter_count(c);
  c.layers = static_cast<int>((kMaxModelParameters - wide_parameter_count(ModelConfig{0, 16384, 128, 1024, 50257})) /
                              per_layer);
  ASSERT_LE(wide_parameter_count(c), __int128{kMaxModelParameters});
  s = c.validate();
  EXPECT_TRUE(s.is_ok()) << s.message();
  EXPECT_EQ(__int128{c.num_parameters()}, wide_parameter_count(c));
  ++c.layers;
  ASSERT_GT(wide_parameter_count(c), __int128{kMaxModelParameters});
  s = c.validate();
  ASSERT_FALSE(s.is_ok());
  EXPECT_TRUE(contains(s.message(), std::to_string(static_cast<int64_t>(wide_parameter_count(c))) +
                                        " parameters; the limit is 2^40"))
      << s.message();
  // Accepted configs with large sizes: the count is exact.
  for (const ModelConfig& ok : {ModelConfig{1, 64, 1, max, max}, ModelConfig{1, 65536, 1, 1, 1},
                              ModelConfig{max, 64, 64, 64, 64}}) {
    ASSERT_TRUE(ok.validate().is_ok()) << ok.to_string();
    EXPECT_EQ(__int128{ok.num_parameters()}, wide_parameter_count(ok)) << ok.to_string();
  }
}

TEST(GPTProgram, RefusesActivationsWhoseSizeOverflows) {
  // Context and vocab at the limit: B·T·Vp overflows 64 bits for a large batch.
  ModelConfig c{1, 64, 1, static_cast<int>(kMaxModelDim), static_cast<int>(kMaxModelDim)};
  ASSERT_TRUE(c.validate().is_ok());
  auto r = build_training_program(c, {.B = 1 << 30, .T = c.context, .accum = 1}, DType::F32);
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(contains(r.status().message(), "exceeds 2^58 elements per tensor")) << r.status().message();
  auto f = build_forward_program(c, 1 << 30, c.context, DType::F32, /*with_loss=*/false);
  ASSERT_FALSE(f.ok());
  EXPECT_TRUE(contains(f.status().message(), "exceeds 2^58 elements per tensor")) << f.status().message();
}

TEST(ModelConfig, ParameterCount) {
  EXPECT_EQ(model_preset("gpt2-124m")->num_parameters(), 124439808);
  for (const std::string& name : model_preset_names()) {
    ModelConfig c = *model_preset(name);
    int64_t sum = 0;
    for (const ParamSpec& p : parameter_specs(c)) sum += p.shape.numel();
    EXPECT_EQ(sum, c.num_parameters()) << name;
    const size_t per_block = c.arch == Arch::Llama ? 9 : 12, outside = c.arch == Arch::Llama ? (c.tied ? 2 : 3) : 4;
    EXPECT_EQ(parameter_specs(c).size(), outside + per_block * c.layers) << name;
  }
}

TEST(GPTParams, SpecsUseHuggingFaceNamesAndOurLayout) {
  ModelConfig c = *model_preset("tiny");
  std::vector<ParamSpec> specs = parameter_specs(c);
  EXPECT_EQ(specs[0].name, "transformer.wte.weight");
  EXPECT_EQ(specs[0].shape, (Shape{256, 128}));
  EXPECT_EQ(specs[1].name, "transformer.wpe.weight");
  EXPECT_EQ(specs[1].shape, (Shape{128, 128}));
  EXPECT_EQ(specs[2].name, "transformer.h.0.ln_1.weight");
  EXPECT_EQ(specs[4].name, "transformer.h.0.attn.c_attn.weight");
  EXPECT_EQ(specs[4].shape, (Shape{384, 128}));
  EXPECT_TRUE(specs[4].conv1d);
  EXPECT_EQ(specs[12].name, "transformer.h.0.mlp.c_proj.weight");
  EXPECT_EQ(specs[12].shape, (Shape{128, 512}));
  EXPECT_EQ(specs.back().name, "transformer.ln_f.bias");
  for (const ParamSpec& p : specs) {
    bool matrix = p.shape.rank() == 2;
    EXPECT_EQ(p.decay, matrix) << p.name;
    EXPECT_EQ(p.conv1d, matrix && p.name.find(".h.") != std::string::npos) << p.name;
  }
}

TEST(GPTInit, DeterministicPortableAndGPT2Distributed) {
  ModelConfig c = *model_preset("tiny");
  std::vector<ParamSpec> specs = parameter_specs(c);
  auto wte = init_parameter(c, specs[0], 1337);
  EXPECT_EQ(wte, init_parameter(c, specs[0], 1337));
  EXPECT_NE(wte, init_parameter(c, specs[0], 1338));
  // Pinned values (also computed by a Python transcription of the documented
  // algorithm): the same on every compiler and machine.
  EXPECT_EQ(std::bit_cast<uint32_t>(wte[0]), 0x3d7237c0u) << wte[0];
  EXPECT_EQ(std::bit_cast<uint32_t>(wte[1]), 0x3cb099d6u) << wte[1];
  EXPECT_EQ(std::bit_cast<uint32_t>(wte[2]), 0x3c4b6e82u) << wte[2];
  EXPECT_EQ(std::bit_cast<uint32_t>(wte[12345]), 0xbc00b988u) << wte[12345];

  auto stats = [](const std::vector<float>& v) {
    double s = 0, s2 = 0;
    for (float x : v) s += x, s2 += double(x) * x;
    double mean = s / v.size();
    return std::pair<double, double>(mean, std::sqrt(s2 / v.size() - mean * mean));
  };
  auto [mean, sd] = stats(wte);  // 32768 samples
  EXPECT_NEAR(mean, 0.0, 0.0005);
  EXPECT_NEAR(sd, 0.02, 0.0005);
  auto proj = init_parameter(c, specs[12], 1337);  // mlp.c_proj: 0.02 / sqrt(2·4)
  auto [pm, psd] = stats(proj);
  EXPECT_NEAR(pm, 0.0, 0.0003);
  EXPECT_NEAR(psd, 0.02 / std::sqrt(8.0), 0.0003);
  auto attn_proj = stats(init_parameter(c, specs[6], 1337));  // attn.c_proj
  EXPECT_EQ(specs[6].name, "transformer.h.0.attn.c_proj.weight");
  EXPECT_NEAR(attn_proj.second, 0.02 / std::sqrt(8.0), 0.0006);
  // Different tensors get different streams.
  EXPECT_NE(init_parameter(c, specs[1], 1337)[0], wte[0]);
  for (float x : init_parameter(c, specs[3], 1337)) EXPECT_EQ(x, 0.0f);   // ln_1.bias
  for (float x : init_parameter(c, specs[2], 1337)) EXPECT_EQ(x, 1.0f);   // ln_1.weight
  for (float x : init_parameter(c, specs[5], 1337)) EXPECT_EQ(x, 0.0f);   // c_attn.bias
  // Element j depends on (seed, name, j) only, not on the tensor's size.
  ModelConfig bigger = c;
  bigger.vocab = 300;
  auto wte2 = init_parameter(bigger, parameter_specs(bigger)[0], 1337);
  ASSERT_EQ(wte2.size(), 300u * 128);
  for (size_t i = 0; i < wte.size(); ++i) ASSERT_EQ(wte[i], wte2[i]) << i;
}

namespace {

// A bf16 program with each later contribution folded back into its gradient: the
// part's Zero and its AccumulateGradient dropped and the contribution's operand made
// the gradient again (model.h, "Gradient accumulation"), which gives the f32 program's
// op order. `additions` counts the AccumulateGradient ops.
Program fold_bf16_parts(const Program& p, int* additions) {
  std::set<size_t> drop;
  *additions = 0;
  for (size_t i = 0; i < p.ops.size(); ++i) {
    if (p.ops[i].kind != OpKind::AccumulateGradient) continue;
    ++*additions;
    drop.insert(i);
    size_t at = i;
    while (p.ops[at].kind == OpKind::AccumulateGradient) --at;  // the contribution
    for (size_t k = at; k-- > 0;)
      if (p.ops[k].kind == OpKind::Zero && p.ops[k].operands[0].tensor == p.ops[i].operands[1].tensor) {
        drop.insert(k);
        break;
      }
  }
  Program out = p;
  out.ops.clear();
  for (size_t i = 0; i < p.ops.size(); ++i) {
    if (drop.count(i)) continue;
    Op op = p.ops[i];
    // A contribution into a part: the AccumulateGradient ops right after name its gradient.
    for (size_t j = i + 1; j < p.ops.size() && p.ops[j].kind == OpKind::AccumulateGradient; ++j)
      for (Operand& o : op.operands)
        if (o.tensor == p.ops[j].operands[1].tensor) o.tensor = p.ops[j].operands[0].tensor;
    out.ops.push_back(std::move(op));
  }
  return out;
}

void check_training_program(const ModelConfig& c, StepShape s, DType act) {
  auto r = build_training_program(c, s, act);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  ASSERT_TRUE(r->validate().is_ok());
  int additions = 0;
  const Program folded = fold_bf16_parts(*r, &additions);
  const Program& p = act == DType::BF16 ? folded : *r;
  {
    // BF16: every contribution after a gradient's first is added (the tied wte has two
    // a micro-batch); F32: none.
    const int P_ = static_cast<int>(parameter_specs(c).size());
    EXPECT_EQ(additions, act == DType::BF16 ? s.accum * (P_ + 1) - P_ : 0);
    std::set<std::string> all_names;
    for (const Op& op : r->ops) EXPECT_TRUE(all_names.insert(op.name).second) << "duplicate op name " << op.name;
  }
  const int64_t B = s.B, T = s.T, C = c.width, V = c.vocab, L = c.layers;
  const size_t P = parameter_specs(c).size();

  // Tensors and roles.
  EXPECT_EQ(p.tensors.bytes_with_role(Role::Param), c.num_parameters() * dtype_size(act));
  EXPECT_EQ(p.tensors.bytes_with_role(Role::Grad), c.num_parameters() * dtype_size(act));
  EXPECT_EQ(p.tensors.bytes_with_role(Role::Master), c.num_parameters() * 4);
  EXPECT_EQ(p.tensors.bytes_with_role(Role::OptState), c.num_parameters() * 8);
  EXPECT_EQ(info(p, "transformer.h.0.attn.c_attn.weight").shape, (Shape{3 * C, C}));
  EXPECT_EQ(info(p, "transformer.h.0.attn.c_attn.weight").dtype, act);
  EXPECT_EQ(info(p, "grad.transformer.wte.weight").role, Role::Grad);
  EXPECT_EQ(info(p, "master.transformer.h.1.mlp.c_fc.weight").dtype, DType::F32);
  EXPECT_EQ(info(p, "adam_m.transformer.ln_f.bias").role, Role::OptState);
  EXPECT_EQ(info(p, "adam_v.transformer.wpe.weight").shape, (Shape{c.context, C}));
  std::set<std::string> names;
  for (const TensorInfo& t : p.tensors.infos()) EXPECT_TRUE(names.insert(t.name).second) << "duplicate " << t.name;

  for (int k = 0; k < s.accum; ++k) {
    std::string mb = "mb" + std::to_string(k) + ".";
    EXPECT_EQ(info(p, mb + "tokens").dtype, DType::I32);
    EXPECT_EQ(info(p, mb + "tokens").shape, (Shape{B, T}));
    EXPECT_EQ(info(p, mb + "targets").role, Role::Input);
    EXPECT_EQ(info(p, mb + "losses").shape, (Shape{B * T}));
    EXPECT_EQ(info(p, mb + "losses").dtype, DType::F32);
    EXPECT_EQ(info(p, mb + "logits").shape, (Shape{B, T, logits_row_stride(V)}));
    EXPECT_EQ(info(p, mb + "h" + std::to_string(L - 1) + ".qkv").shape, (Shape{B, T, 3 * C}));
    EXPECT_EQ(info(p, mb + "h0.att_lse").shape, (Shape{B, c.heads, T}));
    EXPECT_EQ(info(p, mb + "h0.fch_gelu").shape, (Shape{B, T, 4 * C}));
    EXPECT_EQ(info(p, mb + "h0.ln1_out").role, Role::Activation);
    EXPECT_EQ(info(p, mb + "dres").shape, (Shape{B, T, C}));
  }
  // The projections add into the residual stream themselves (MatmulResidualForward): no scratch between.
  EXPECT_EQ(p.tensors.find("h0.attn_proj"), kNoTensor);
  EXPECT_EQ(p.tensors.find("h0.mlp_proj"), kNoTensor);
  EXPECT_EQ(info(p, "clip.scale_norm").shape, (Shape{2}));
  ASSERT_EQ(p.inputs.size(), static_cast<size_t>(2 * s.accum));
  EXPECT_EQ(p.tensors.info(p.inputs[0]).name, "mb0.tokens");
  EXPECT_EQ(p.tensors.info(p.inputs[1]).name, "mb0.targets");
  ASSERT_EQ(p.outputs.size(), static_cast<size_t>(s.accum + 1));
  EXPECT_EQ(p.tensors.info(p.outputs[0]).name, "mb0.losses");
  EXPECT_EQ(p.tensors.info(p.outputs.back()).name, "clip.scale_norm");

  // Op order.
  const size_t per_mb = 1 + 7 * L + 2 + 1 + 3 + 8 * L + 1;
  ASSERT_EQ(p.ops.size(), P + s.accum * per_mb + 1 + P + 1 + P);
  std::set<std::string> op_names;
  for (const Op& op : p.ops) {
    EXPECT_TRUE(op_names.insert(op.name).second) << "duplicate op name " << op.name;
    EXPECT_FALSE(op.name.empty());
  }
  for (size_t i = 0; i < P; ++i) {
    EXPECT_EQ(p.ops[i].kind, OpKind::Zero);
    EXPECT_EQ(p.ops[i].operands[0].access, Access::Write);
    EXPECT_EQ(p.tensors.info(p.ops[i].operands[0].tensor).role, Role::Grad);
  }
  for (int k = 0; k < s.accum; ++k) {
    std::string mb = "mb" + std::to_string(k) + ".";
    size_t base = P + k * per_mb;
    EXPECT_EQ(p.ops[base].name, mb + "embedding.forward");
    // fc with its GELU is one op (MatmulGeluForward); proj and fc2 each with the
    // residual add after it (MatmulResidualForward).
    struct Step {
      const char* name;
      OpKind kind;
    };
    const Step fwd[] = {{"ln1", OpKind::LayerNormForward},      {"qkv", OpKind::MatmulForward},
                        {"attn", OpKind::AttentionForward},     {"proj", OpKind::MatmulResidualForward},
                        {"ln2", OpKind::LayerNormForward},      {"fc", OpKind::MatmulGeluForward},
                        {"fc2", OpKind::MatmulResidualForward}};
    for (int i = 0; i < L; ++i)
      for (int j = 0; j < 7; ++j) {
        const Op& op = p.ops[base + 1 + 7 * i + j];
        EXPECT_EQ(op.name, mb + "h" + std::to_string(i) + "." + fwd[j].name + ".forward");
        EXPECT_EQ(op.kind, fwd[j].kind) << op.name;
        EXPECT_EQ(op.layer, i);
        EXPECT_EQ(op.micro_batch, k);
        EXPECT_EQ(op.phase, Phase::Forward);
      }
    // h0's proj: res_attn = encoded + atty·c_projᵀ + bias; its fc2: res_mlp = res_attn + ...
    const Op& proj = p.ops[base + 1 + 3];
    ASSERT_EQ(proj.operands.size(), 5u);
    EXPECT_EQ(p.tensors.info(proj.operands[0].tensor).name, mb + "h0.res_attn");
    EXPECT_EQ(p.tensors.info(proj.operands[1].tensor).name, mb + "h0.atty");
    EXPECT_EQ(p.tensors.info(proj.operands[2].tensor).name, "transformer.h.0.attn.c_proj.weight");
    EXPECT_EQ(p.tensors.info(proj.operands[3].tensor).name, mb + "encoded");
    EXPECT_EQ(p.tensors.info(proj.operands[4].tensor).name, "transformer.h.0.attn.c_proj.bias");
    const Op& fc2 = p.ops[base + 1 + 6];
    ASSERT_EQ(fc2.operands.size(), 5u);
    EXPECT_EQ(p.tensors.info(fc2.operands[0].tensor).name, mb + "h0.res_mlp");
    EXPECT_EQ(p.tensors.info(fc2.operands[3].tensor).name, mb + "h0.res_attn");
    EXPECT_EQ(fc2.attrs.C, 4 * C);
    EXPECT_EQ(fc2.attrs.OC, C);
    size_t ce = find_op(p, mb + "crossentropy");
    EXPECT_EQ(p.ops[ce].kind, OpKind::CrossEntropyBackward);
    EXPECT_FLOAT_EQ(p.ops[ce].attrs.scale, static_cast<float>(1.0 / (double(B) * T * s.accum)));
    EXPECT_EQ(p.ops[ce - 1].name, mb + "lm_head.forward");
    EXPECT_EQ(p.ops[ce - 1].operands.size(), 3u);  // no bias
    EXPECT_EQ(p.tensors.info(p.ops[ce - 1].operands[2].tensor).name, "transformer.wte.weight");
    EXPECT_EQ(p.ops[ce + 1].name, mb + "lm_head.backward");
    EXPECT_EQ(p.tensors.info(p.ops[ce + 1].operands[1].tensor).name, "grad.transformer.wte.weight");
    EXPECT_EQ(p.ops[ce + 2].name, mb + "dres.zero");
    EXPECT_EQ(p.ops[ce + 3].name, mb + "ln_f.backward");
    // fc2's parameter gradients, then its input gradient through the GELU.
    const char* bwd[] = {"fc2.weight", "fc2", "fc", "ln2", "proj", "attn", "qkv", "ln1"};
    const OpKind bwd_kind[] = {OpKind::MatmulWeightBackward, OpKind::MatmulGeluBackward, OpKind::MatmulBackward};
    for (int i = L - 1, n = 0; i >= 0; --i, ++n)
      for (int j = 0; j < 8; ++j) {
        const Op& op = p.ops[ce + 4 + 8 * n + j];
        EXPECT_EQ(op.name, mb + "h" + std::to_string(i) + "." + bwd[j] + ".backward");
        if (j < 3) {
          EXPECT_EQ(op.kind, bwd_kind[j]) << op.name;
        }
        EXPECT_EQ(op.phase, Phase::Backward);
        EXPECT_EQ(op.layer, i);
      }
    EXPECT_EQ(p.ops[ce + 4 + 8 * L].name, mb + "embedding.backward");
  }
  // Squared norms, packed: Zero grad_sqnorms, SquaredNorm p updates element p, wte's
  // one element per kVocabBlock rows (7 for 50257), so the others come 6 later.
  const int64_t wte_blocks = (V + kVocabBlock - 1) / kVocabBlock;
  const int64_t norms = static_cast<int64_t>(P) - 1 + wte_blocks;
  size_t zero_sq = P + s.accum * per_mb;
  EXPECT_EQ(p.ops[zero_sq].kind, OpKind::Zero);
  TensorId sq = p.ops[zero_sq].operands[0].tensor;
  EXPECT_EQ(p.tensors.info(sq).name, "grad_sqnorms");
  EXPECT_EQ(p.tensors.info(sq).shape, (Shape{norms}));
  EXPECT_EQ(p.tensors.info(sq).dtype, DType::F32);
  size_t opt = zero_sq + 1;
  for (size_t i = 0; i < P; ++i) {
    const Op& op = p.ops[opt + i];
    EXPECT_EQ(op.kind, OpKind::SquaredNorm);
    EXPECT_EQ(op.attrs.index, i == 0 ? 0 : static_cast<int64_t>(i) + wte_blocks - 1);
    EXPECT_EQ(op.attrs.block, i == 0 ? kVocabBlock * C : 0);
    EXPECT_EQ(op.operands[0].tensor, sq);
    EXPECT_EQ(op.operands[0].access, Access::Update);
    EXPECT_EQ(op.phase, Phase::Optimizer);
  }
  const Op& clip = p.ops[opt + P];
  EXPECT_EQ(clip.kind, OpKind::ClipScale);
  EXPECT_EQ(clip.attrs.P, norms);
  ASSERT_EQ(clip.operands.size(), 2u);
  EXPECT_EQ(clip.operands[1].tensor, sq);
  EXPECT_FLOAT_EQ(clip.attrs.scale, 1.0f);
  std::vector<ParamSpec> specs = parameter_specs(c);
  for (size_t i = 0; i < P; ++i) {
    const Op& a = p.ops[opt + P + 1 + i];
    EXPECT_EQ(a.kind, OpKind::AdamW);
    EXPECT_EQ(a.phase, Phase::Optimizer);
    EXPECT_EQ(a.micro_batch, -1);
    EXPECT_EQ(a.attrs.index, static_cast<int64_t>(i));
    EXPECT_EQ(p.tensors.info(a.operands[0].tensor).name, specs[i].name);
    EXPECT_FLOAT_EQ(a.attrs.scale, specs[i].decay ? 0.1f : 0.0f) << specs[i].name;
  }

  // FLOPs: per micro-batch the forward matmuls are 2·N·(12·L·C² + C·V), backward
  // twice that; attention 2·B·T²·C forward and 4·B·T²·C backward per layer.
  double N = double(B) * T;
  double mm = 2.0 * N * (12.0 * L * C * C + double(C) * V);
  double att = 6.0 * L * B * double(T) * T * C;
  EXPECT_DOUBLE_EQ(p.flops(), s.accum * (3.0 * mm + att));
}

}  // namespace

TEST(GPTProgram, TinyTrainingProgram) {
  check_training_program(*model_preset("tiny"), {.B = 2, .T = 16, .accum = 2}, DType::F32);
  check_training_program(*model_preset("tiny"), {.B = 1, .T = 128, .accum = 1}, DType::BF16);
}

TEST(GPTProgram, GPT2_124MTrainingProgramWithAccumulation) {
  check_training_program(*model_preset("gpt2-124m"), {.B = 4, .T = 1024, .accum = 2}, DType::BF16);
}

TEST(GPTProgram, RejectsBadShapes) {
  ModelConfig c = *model_preset("tiny");
  auto r = build_training_program(c, {.B = 2, .T = 129, .accum = 1}, DType::F32);
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(contains(r.status().message(), "T is 129")) << r.status().message();
  EXPECT_FALSE(build_training_program(c, {.B = 0, .T = 8, .accum = 1}, DType::F32).ok());
  r = build_training_program(c, {.B = 1, .T = 8, .accum = 0}, DType::F32);
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(contains(r.status().message(), "accumulation")) << r.status().message();
  EXPECT_FALSE(build_training_program(c, {.B = 1, .T = 8, .accum = 1}, DType::I32).ok());
  EXPECT_FALSE(build_training_program(ModelConfig{2, 10, 3, 8, 16}, {.B = 1, .T = 8, .accum = 1}, DType::F32).ok());
  EXPECT_FALSE(build_forward_program(c, 1, 200, DType::F32, true).ok());
}

TEST(GPTProgram, ForwardProgram) {
  ModelConfig c = *model_preset("tiny");
  auto r = build_forward_program(c, 2, 32, DType::F32, /*with_loss=*/true);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->tensors.bytes_with_role(Role::Grad), 0u);
  EXPECT_EQ(r->tensors.bytes_with_role(Role::Master), 0u);
  EXPECT_EQ(r->tensors.bytes_with_role(Role::Param), static_cast<size_t>(c.num_parameters()) * 4);
  ASSERT_EQ(r->inputs.size(), 2u);
  ASSERT_EQ(r->outputs.size(), 1u);
  EXPECT_EQ(r->tensors.info(r->outputs[0]).name, "mb0.losses");
  EXPECT_EQ(r->ops.size(), static_cast<size_t>(1 + 7 * c.layers + 3));
  EXPECT_EQ(r->ops.back().kind, OpKind::CrossEntropyForward);
  for (const Op& op : r->ops) EXPECT_EQ(op.phase, Phase::Forward);

  auto g = build_forward_program(c, 1, 7, DType::BF16, /*with_loss=*/false);
  ASSERT_TRUE(g.ok()) << g.status().to_string();
  ASSERT_EQ(g->inputs.size(), 1u);
  ASSERT_EQ(g->outputs.size(), 1u);
  EXPECT_EQ(g->tensors.info(g->outputs[0]).name, "mb0.logits");
  EXPECT_EQ(g->tensors.info(g->outputs[0]).shape, (Shape{1, 7, 256}));
  EXPECT_EQ(g->ops.back().name, "mb0.lm_head.forward");
  EXPECT_EQ(g->tensors.find("mb0.targets"), kNoTensor);
}

TEST(GPTProgram, EveryPresetBuildsAndValidates) {
  for (const std::string& name : model_preset_names()) {
    ModelConfig c = *model_preset(name);
    auto r = build_training_program(c, {.B = 1, .T = std::min(c.context, 4096), .accum = 2}, DType::BF16);
    ASSERT_TRUE(r.ok()) << name << ": " << r.status().to_string();
    EXPECT_EQ(r->tensors.bytes_with_role(Role::Master), static_cast<size_t>(c.num_parameters()) * 4) << name;
  }
}

// The Llama presets are the published configurations, and their parameter counts
// are the published models' (Llama 3.2 1B and 3B tie the LM head; 3.1 8B does not).
TEST(LlamaConfig, PresetsMatchThePublishedModels) {
  struct Want {
    const char* name;
    int layers, width, heads, kv_heads, intermediate;
    bool tied;
    float factor;
    int64_t params;
  };
  for (const Want& w : {Want{"llama-3.2-1b", 16, 2048, 32, 8, 8192, true, 32.0f, 1235814400},
                        Want{"llama-3.2-3b", 28, 3072, 24, 8, 8192, true, 32.0f, 3212749824},
                        Want{"llama-3.1-8b", 32, 4096, 32, 8, 14336, false, 8.0f, 8030261248}}) {
    auto c = model_preset(w.name);
    ASSERT_TRUE(c.ok()) << w.name;
    EXPECT_EQ(c->arch, Arch::Llama);
    EXPECT_EQ(c->layers, w.layers);
    EXPECT_EQ(c->width, w.width);
    EXPECT_EQ(c->heads, w.heads);
    EXPECT_EQ(c->kv_heads, w.kv_heads);
    EXPECT_EQ(c->intermediate, w.intermediate);
    EXPECT_EQ(c->vocab, 128256);
    EXPECT_EQ(c->tied, w.tied);
    EXPECT_EQ(c->rope.theta, 500000.0f);
    EXPECT_TRUE(c->rope.llama3);
    EXPECT_EQ(c->rope.factor, w.factor);
    EXPECT_EQ(c->rope.original_context, 8192);
    EXPECT_EQ(c->num_parameters(), w.params) << w.name;
    int64_t sum = 0;
    for (const ParamSpec& p : parameter_specs(*c)) sum += p.shape.numel();
    EXPECT_EQ(sum, w.params) << w.name;
  }
}

TEST(LlamaConfig, ValidationNamesTheField) {
  ModelConfig c = *model_preset("llama-tiny");
  ASSERT_TRUE(c.validate().is_ok()) << c.validate().to_string();
  auto refused = [](ModelConfig bad, const char* word) {
    Status s = bad.validate();
    EXPECT_FALSE(s.is_ok()) << word;
    EXPECT_TRUE(contains(s.message(), word)) << s.to_string();
  };
  ModelConfig b = c;
  b.kv_heads = 3;  // 4 heads
  refused(b, "kv_heads");
  b = c;
  b.kv_heads = 0;
  refused(b, "kv_heads");
  b = c;
  b.intermediate = 0;
  refused(b, "intermediate");
  b = c;
  b.width = 12, b.heads = 4, b.kv_heads = 2;  // head size 3: no rotation pairs
  refused(b, "odd");
  b = c;
  b.norm_eps = 0;
  refused(b, "norm_eps");
  b = c;
  b.rope.theta = -1;
  refused(b, "rope_theta");
  b = c;
  b.rope.high_freq_factor = b.rope.low_freq_factor;
  refused(b, "high_freq_factor");
  ModelConfig g = *model_preset("tiny");
  g.kv_heads = 2;  // a GPT-2 has none
  refused(g, "gpt2");
}

TEST(LlamaParams, SpecsUseHuggingFaceNamesAndStartAsTransformersDoes) {
  ModelConfig c = *model_preset("llama-tiny");
  c.tied = false;
  std::vector<ParamSpec> specs = parameter_specs(c);
  ASSERT_EQ(specs.size(), 1u + 9u * c.layers + 2u);
  EXPECT_EQ(specs[0].name, "model.embed_tokens.weight");
  EXPECT_TRUE(specs[0].vocab);
  EXPECT_EQ(specs[1].name, "model.layers.0.input_layernorm.weight");
  EXPECT_EQ(specs[1].init, ParamInit::Ones);
  EXPECT_FALSE(specs[1].decay);
  EXPECT_EQ(specs[3].name, "model.layers.0.self_attn.k_proj.weight");
  EXPECT_EQ(specs[3].shape, (Shape{2 * 32, 128}));  // kv_heads · head size, width
  EXPECT_EQ(specs[5].name, "model.layers.0.self_attn.o_proj.weight");
  EXPECT_EQ(specs[9].name, "model.layers.0.mlp.down_proj.weight");
  EXPECT_EQ(specs[9].shape, (Shape{128, 256}));
  EXPECT_EQ(specs[9].init, ParamInit::Normal);
  EXPECT_EQ(specs[9].init_std, 0.02);
  EXPECT_EQ(specs[specs.size() - 2].name, "model.norm.weight");
  EXPECT_EQ(specs.back().name, "lm_head.weight");
  EXPECT_TRUE(specs.back().vocab);
  for (const ParamSpec& p : specs) EXPECT_FALSE(p.conv1d) << p.name;
  std::vector<float> ones = init_parameter(c, specs[1], 7);
  for (float x : ones) ASSERT_EQ(x, 1.0f);
  c.tied = true;
  EXPECT_EQ(parameter_specs(c).back().name, "model.norm.weight");
}

TEST(LlamaProgram, StepHasRopeGqaAttentionAndSwiGlu) {
  ModelConfig c = *model_preset("llama-tiny");
  auto p = build_training_program(c, {.B = 2, .T = 16, .accum = 2}, DType::F32);
  ASSERT_TRUE(p.ok()) << p.status().to_string();
  const int64_t W = (4 + 2 * 2) * 32;
  EXPECT_EQ(p->tensors.info(p->tensors.find("mb0.h0.qkv_rot")).shape, (Shape{2, 16, W}));
  EXPECT_EQ(p->tensors.info(p->tensors.find("h0.qkv")).role, Role::Scratch);
  EXPECT_EQ(p->tensors.info(p->tensors.find("mb1.h3.fch")).shape, (Shape{2, 16, 512}));
  EXPECT_EQ(p->tensors.find("mb0.h0.ln1_mean"), kNoTensor);
  EXPECT_EQ(p->tensors.find("transformer.wpe.weight"), kNoTensor);
  int rope = 0, swiglu = 0, attention = 0;
  for (const Op& op : p->ops) {
    rope += op.kind == OpKind::RopeForward || op.kind == OpKind::RopeBackward;
    swiglu += op.kind == OpKind::SwiGluForward || op.kind == OpKind::SwiGluBackward;
    if (op.kind == OpKind::AttentionForward) {
      ++attention;
      EXPECT_EQ(op.attrs.KVH, 2);
      EXPECT_EQ(op.attrs.NH, 4);
    }
    if (op.kind == OpKind::RopeForward) {
      EXPECT_EQ(op.attrs.rope, c.rope);
    }
    if (op.kind == OpKind::RmsNormForward) {
      EXPECT_EQ(op.attrs.scale, c.norm_eps);
    }
  }
  EXPECT_EQ(rope, 2 * 4 * 2);  // forward and backward, 4 layers, 2 micro-batches
  EXPECT_EQ(swiglu, 2 * 4 * 2);
  EXPECT_EQ(attention, 4 * 2);
  // A layer's forward: proj and fc2 each with the residual add after it (MatmulResidualForward).
  struct Step {
    const char* name;
    OpKind kind;
  };
  const Step fwd[] = {{"ln1", OpKind::RmsNormForward},        {"q", OpKind::MatmulForward},
                      {"k", OpKind::MatmulForward},           {"v", OpKind::MatmulForward},
                      {"rope", OpKind::RopeForward},          {"attn", OpKind::AttentionForward},
                      {"proj", OpKind::MatmulResidualForward}, {"ln2", OpKind::RmsNormForward},
                      {"gate", OpKind::MatmulForward},        {"up", OpKind::MatmulForward},
                      {"swiglu", OpKind::SwiGluForward},      {"fc2", OpKind::MatmulResidualForward}};
  const size_t h1 = find_op(*p, "mb1.h1.ln1.forward");
  for (size_t j = 0; j < std::size(fwd); ++j) {
    ASSERT_LT(h1 + j, p->ops.size());
    EXPECT_EQ(p->ops[h1 + j].name, std::string("mb1.h1.") + fwd[j].name + ".forward");
    EXPECT_EQ(p->ops[h1 + j].kind, fwd[j].kind) << p->ops[h1 + j].name;
  }
  EXPECT_EQ(p->ops[h1 + std::size(fwd)].name, "mb1.h2.ln1.forward");
  const Op& proj = p->ops[h1 + 6];
  ASSERT_EQ(proj.operands.size(), 4u);  // no bias
  EXPECT_EQ(proj.operands[0].tensor, p->tensors.find("mb1.h1.res_attn"));
  EXPECT_EQ(proj.operands[3].tensor, p->tensors.find("mb1.h0.res_mlp"));
  const Op& fc2 = p->ops[h1 + 11];
  ASSERT_EQ(fc2.operands.size(), 4u);
  EXPECT_EQ(fc2.operands[0].tensor, p->tensors.find("mb1.h1.res_mlp"));
  EXPECT_EQ(fc2.operands[1].tensor, p->tensors.find("mb1.h1.fch_act"));
  EXPECT_EQ(fc2.operands[3].tensor, p->tensors.find("mb1.h1.res_attn"));
  for (const Op& op : p->ops) EXPECT_NE(op.kind, OpKind::ResidualForward) << op.name;
  EXPECT_EQ(p->tensors.find("h0.attn_proj"), kNoTensor);
  EXPECT_EQ(p->tensors.find("h0.mlp_proj"), kNoTensor);
  // An untied head adds its own product per micro-batch; the forward program ends with it.
  c.tied = false;
  auto f = build_forward_program(c, 1, 7, DType::F32, /*with_loss=*/false);
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  EXPECT_EQ(f->ops.back().name, "mb0.lm_head.forward");
  EXPECT_EQ(f->ops.back().operands[2].tensor, f->tensors.find("lm_head.weight"));
}
