// Model families (GPT-2 and Llama): configuration, parameters, initial values, and the
// Programs of a training step and of a forward pass. One Builder makes both; the
// architecture (ModelConfig::arch) picks the block's norm, MLP and position encoding.
//
//   auto cfg = model_preset("gpt2-124m");                  // or "tiny", "llama-3.2-1b", ...
//   if (!cfg) return cfg.status();
//   auto step = build_training_program(*cfg, {.B = 8, .T = 1024, .accum = 4}, DType::BF16);
//   if (!step) return step.status();
//   TensorId tokens0 = step->tensors.find("mb0.tokens");  // [B,T] I32, written by the trainer
//   for (const ParamSpec& p : parameter_specs(*cfg)) {
//     std::vector<float> init = init_parameter(*cfg, p, /*seed=*/1337);
//     ...  // upload into p.name, and into "master." + p.name
//   }
//
// Architecture GPT-2: learned position embeddings, pre-LayerNorm blocks
// (x += attn(ln_1(x)); x += mlp(ln_2(x))), causal multi-head attention, tanh GELU,
// MLP 4×width, final ln_f, LM head tied to wte (no bias).
//
// Architecture Llama: no position table; pre-RMSNorm blocks; rotary position
// embeddings (rotate-half, rope_theta, optional llama3 frequency scaling) on q and k;
// grouped-query attention (kv_heads key/value heads, each shared by heads/kv_heads
// query heads); SwiGLU MLP down(silu(gate(x)) · up(x)) of `intermediate` channels; no
// biases; final RMSNorm; LM head tied to the embedding table or its own lm_head.weight.
// Llama tensor names (W = (heads + 2·kv_heads)·D, D = width/heads, I = intermediate):
//   params      model.embed_tokens.weight [V,C]; model.layers.{i}.input_layernorm.weight [C],
//               .self_attn.{q_proj [heads·D,C], k_proj [kv_heads·D,C], v_proj [kv_heads·D,C],
//               o_proj [C,heads·D]}.weight, .post_attention_layernorm.weight [C],
//               .mlp.{gate_proj [I,C], up_proj [I,C], down_proj [C,I]}.weight;
//               model.norm.weight [C]; lm_head.weight [V,C] (untied only)
//   activations mb{k}.h{i}.{ln1_out [B,T,C], ln1_rstd [B,T] F32, qkv_rot [B,T,W], atty [B,T,C],
//               att_lse [B,NH,T] F32, res_attn, ln2_out [B,T,C], ln2_rstd [B,T] F32,
//               fch [B,T,2I] (gate | up), fch_act [B,T,I], res_mlp [B,T,C]}; lnf_out, lnf_rstd,
//               logits, losses as for GPT-2
//   scratch     h{i}.qkv [B,T,W] (before the rotation);
//               gradients h{i}.{d_fch_act [B,T,I], d_fch [B,T,2I], d_ln2_out, d_atty [B,T,C],
//               d_qkv_rot, d_qkv [B,T,W], d_ln1_out [B,T,C]}
//
// Tensor names of a training Program (k = micro-batch, i = layer, <p> = param name):
//   params      <p> (act dtype), Hugging Face names: transformer.wte.weight [V,C],
//               transformer.wpe.weight [context,C], transformer.h.{i}.ln_1.{weight,bias} [C],
//               transformer.h.{i}.attn.c_attn.{weight [3C,C], bias [3C]},
//               transformer.h.{i}.attn.c_proj.{weight [C,C], bias [C]},
//               transformer.h.{i}.ln_2.{weight,bias} [C],
//               transformer.h.{i}.mlp.c_fc.{weight [4C,C], bias [4C]},
//               transformer.h.{i}.mlp.c_proj.{weight [C,4C], bias [C]},
//               transformer.ln_f.{weight,bias} [C].  Matrices are [out,in].
//   state       grad.<p> (act), master.<p> (F32), adam_m.<p> (F32), adam_v.<p> (F32)
//   inputs      mb{k}.tokens, mb{k}.targets [B,T] I32
//   activations mb{k}.encoded [B,T,C]; mb{k}.h{i}.{ln1_out [B,T,C], ln1_mean/ln1_rstd [B,T] F32,
//               qkv [B,T,3C], atty [B,T,C], att_lse [B,NH,T] F32, res_attn [B,T,C],
//               ln2_out [B,T,C], ln2_mean/ln2_rstd [B,T] F32, fch [B,T,4C] (before the GELU),
//               fch_gelu [B,T,4C],
//               res_mlp [B,T,C]}; mb{k}.lnf_out [B,T,C], mb{k}.lnf_mean/lnf_rstd [B,T] F32,
//               mb{k}.logits [B,T,Vp] (Vp = logits_row_stride(V); becomes dlogits),
//               mb{k}.losses [B·T] F32,
//               mb{k}.dres [B,T,C] (residual-stream gradient of the backward pass)
//   scratch     gradients d_lnf_out [B,T,C], h{i}.{d_fch [B,T,4C], d_ln2_out,
//               d_atty [B,T,C], d_qkv [B,T,3C], d_ln1_out [B,T,C]} — shared by micro-batches,
//               each written before it is read; grad_sqnorms [P] F32 (one element per
//               parameter, wte one per kVocabBlock rows: Σ grad² of each); bf16 only:
//               grad_part<j>.<shape> (a later contribution to a gradient, see below)
//   vocab tiles (StepShape::tile_vocab, V > kVocabBlock): wte and its grad/master/adam_m/
//               adam_v are "<name>#j" [≤kVocabBlock, C] for rows from j·kVocabBlock, and
//               the embedding, LM-head, SquaredNorm and AdamW ops of wte are one per tile
//               (names "...#j"); Program::pieces("<name>") finds the tiles in order
//   outputs     mb{k}.losses ..., clip.scale_norm [2] F32 {clip scale, global grad norm}
//
// Op order: Zero of every grad; per micro-batch k: forward (embedding; per layer ln1,
// qkv, attention, proj with the residual add (MatmulResidualForward: res_attn), ln2,
// fc with its GELU (MatmulGeluForward), fc2 with the residual add (res_mlp); ln_f; LM head;
// CrossEntropyBackward with scale 1/(B·T·accum)), backward (LM head, Zero dres,
// ln_f, per layer in reverse fc2's parameter gradients (MatmulWeightBackward), fc2's
// input gradient through the GELU (MatmulGeluBackward), fc, ln2, proj, attention, qkv, ln1;
// embedding); then Zero grad_sqnorms, SquaredNorm per grad (Update of element p,
// attrs.index = p), ClipScale (scale_norm W, grad_sqnorms R), AdamW per param
// (all Phase Optimizer).
//
// Gradient accumulation. Every op that contributes to a gradient adds into it (Update).
// F32 programs: each contribution adds straight into grad.<p> (the CPU kernels form a
// contribution from zero and add it once: ((0 + c0) + c1) + ...). BF16 programs: the
// step's first contribution to grad.<p> adds into it in place (it was zeroed); each
// later one (micro-batches 1.. of accumulation; the tied embedding's second op in a
// micro-batch) goes into a zeroed scratch "grad_part<j>.<d0>x<d1>..." (act dtype, one
// per shape and per gradient operand j of the op, shared by every op) and is added by
// AccumulateGradient (grad.<p> U, part R): grad = bf16(float(grad) + float(part)).
// The CUDA weight-gradient product adds into its output with beta = 1 (fp32 sum of
// the product and the old bf16 value, rounded once), which no one can reproduce from
// a product formed elsewhere; with a contribution formed alone and added by an
// elementwise op, a data-parallel owner that adds its ranks' parts in the same order
// gets the same bits (dist/data_parallel.h).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"
#include "program/program.h"
#include "tensor/rope.h"
#include "tensor/tensor.h"

namespace spillway {

class ThreadPool;  // core/thread_pool.h

// Limits of ModelConfig::validate: each size (layers, width, heads, context, vocab) at
// most 2^24, and at most 2^40 parameters (4 TiB of F32 weights alone), so that every
// size product of a model, and of its step's tensors, fits in 64 bits.
inline constexpr int64_t kMaxModelDim = int64_t{1} << 24;
inline constexpr int64_t kMaxModelParameters = int64_t{1} << 40;

enum class Arch : uint8_t { GPT2, Llama };
const char* arch_name(Arch a);  // "gpt2", "llama" (Hugging Face model_type)

struct ModelConfig {
  int layers = 0;   // transformer blocks (L)
  int width = 0;    // channels (C)
  int heads = 0;    // attention (query) heads (NH); head size D = C/NH
  int context = 0;  // maximum sequence length (GPT-2: rows of wpe)
  int vocab = 0;    // vocabulary size (V, rows of wte / embed_tokens)
  Arch arch = Arch::GPT2;
  // Llama only (0 / defaults for GPT-2):
  int kv_heads = 0;         // key/value heads (KVH), NH % KVH == 0
  int intermediate = 0;     // SwiGLU MLP channels (I)
  bool tied = true;         // LM head is the embedding table (GPT-2: always)
  float norm_eps = 1e-5f;   // RMSNorm epsilon
  RopeParams rope = {};     // rotary embedding (theta, llama3 scaling)

  // All positive and at most kMaxModelDim, width divisible by heads, and at most
  // kMaxModelParameters parameters (every product computed with overflow checks);
  // Llama: kv_heads divides heads, even head size, intermediate, eps and rope valid.
  Status validate() const;
  // Total parameters (tied embeddings counted once). GPT-2: V·C + context·C +
  // L·(12C² + 13C) + 2C; Llama: V·C (2·V·C untied) + L·(2C + 2C·NH·D + 2C·KVH·D + 3C·I) + C.
  // Exact for every config validate() accepts; INT64_MAX when the count does not fit
  // in 64 bits (and 0 for a config with a negative size), never an overflow.
  int64_t num_parameters() const;
  // "layers=12 width=768 heads=12 context=1024 vocab=50257"; Llama adds "arch=llama
  // kv_heads=8 intermediate=8192 tied=1 rope_theta=500000 ..." after it.
  std::string to_string() const;
  int head_dim() const { return heads > 0 ? width / heads : 0; }
  int kv_heads_or_heads() const { return kv_heads > 0 ? kv_heads : heads; }
  // Channels of the fused q|k|v row: (NH + 2·KVH)·D (GPT-2: 3C).
  int64_t qkv_width() const { return int64_t{heads + 2 * kv_heads_or_heads()} * head_dim(); }
  bool operator==(const ModelConfig&) const = default;
};

// A Llama config from its config.json sizes (arch Llama, the other fields as given):
//   llama_config(16, 2048, 32, 8, 8192, 131072, 128256, /*tied=*/true, 1e-5f, rope)
ModelConfig llama_config(int layers, int width, int heads, int kv_heads, int intermediate, int context, int vocab,
                         bool tied, float norm_eps, RopeParams rope);

// GPT-2: "tiny" (4, 128, 4 heads, context 128, vocab 256), "gpt2-124m", "gpt2-350m",
// "gpt2-774m", "gpt2-1.5b", "gpt-2.7b", "gpt-4b", "gpt-6.7b", "gpt-13b" (context 1024,
// vocab 50257). Llama, from the published config.json files: "llama-tiny" (4 layers,
// width 128, 4 heads, 2 kv heads, intermediate 256, context 256, vocab 256, llama3
// rope), "llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b". An unknown name gives an
// error listing the known ones.
Result<ModelConfig> model_preset(std::string_view name);
std::vector<std::string> model_preset_names();

// How a parameter starts: N(0, std) (init_parameter's generator), all 0, or all 1.
enum class ParamInit : uint8_t { Normal, Zeros, Ones };

// One parameter tensor.
struct ParamSpec {
  std::string name;  // Hugging Face name, "transformer.h.3.attn.c_attn.weight"
  Shape shape;       // our layout: matrices [out,in] (the Backend matmul layout)
  int layer = -1;    // block index, -1 for the embeddings, the final norm and the LM head
  bool decay = false;   // weight decay applies (≥2-D weights, the embeddings included)
  bool conv1d = false;  // Hugging Face stores it as Conv1D [in,out] (transposed)
  ParamInit init = ParamInit::Normal;
  double init_std = 0.0;  // Normal only
  bool vocab = false;     // rows are the vocabulary (the embedding table, the LM head)
};
// In Program order. GPT-2: wte, wpe, per block ln_1.w/b, c_attn.w/b, attn.c_proj.w/b,
// ln_2.w/b, c_fc.w/b, mlp.c_proj.w/b; then ln_f.w/b. Llama: embed_tokens, per block
// input_layernorm, q_proj, k_proj, v_proj, o_proj, post_attention_layernorm,
// gate_proj, up_proj, down_proj; then norm, and lm_head when untied. AdamW
// attrs.index is the position in this list.
std::vector<ParamSpec> parameter_specs(const ModelConfig& cfg);

// Initial values of one parameter (its ParamSpec's init), identical on every compiler
// and machine. GPT-2: weights N(0, 0.02) (attn.c_proj and mlp.c_proj weights
// N(0, 0.02/sqrt(2·layers))), biases 0, LayerNorm weights 1. Llama (transformers'
// LlamaPreTrainedModel): every matrix N(0, 0.02), RMSNorm weights 1. Element j of a tensor depends only on (seed, name, j):
//   key   = splitmix64_mix(seed ^ fnv1a64(name))
//   r(c)  = splitmix64_mix(key + (c+1)·0x9E3779B97F4A7C15)      (64 random bits)
//   pair  q = j/2: u1 = ((r(2q) >> 11) + 1)·2⁻⁵³ ∈ (0,1], u2 = (r(2q+1) >> 11)·2⁻⁵³
//   z     = sqrt(-2 ln u1) · (j even ? cos(2π u2) : sin(2π u2))   (Box–Muller, double)
//   value = float(std · z), rounded once.
// Because of that, the work is split into fixed chunks of whole pairs over `pool`
// (default global_thread_pool()): the values are the same for every thread count.
std::vector<float> init_parameter(const ModelConfig& cfg, const ParamSpec& param, uint64_t seed,
                                  ThreadPool* pool = nullptr);
// The same into out[0, numel) (no allocation).
void init_parameter_into(const ModelConfig& cfg, const ParamSpec& param, uint64_t seed, float* out, ThreadPool& pool);
// Elements [begin, end) of init_parameter (end clipped to numel) into out[0, end - begin),
// on the calling thread; begin and end may fall inside a pair.
void init_parameter_range(const ModelConfig& cfg, const ParamSpec& param, uint64_t seed, size_t begin, size_t end,
                          float* out);

// Rows of wte per block of the LM head and of its gradient norm, and per vocab tile.
// The LM head is always computed in blocks of this many vocab rows (its dinp summed
// block by block) and wte's gradient norm is one per block, so a tiled program (one op
// and one tensor per block) gives the same bits as the untiled one. A multiple of the
// CPU backend's matmul tiles (256 columns, 128 rows).
inline constexpr int64_t kVocabBlock = 8192;

// Row stride of the logits: the vocabulary rounded up to 64, so every row starts
// 128-byte aligned in bf16 and the LM head and cross-entropy use vectorized,
// tensor-core paths (50257 → 50304). Columns past the vocabulary are never read.
inline int64_t logits_row_stride(int64_t vocab) { return (vocab + 63) / 64 * 64; }

struct StepShape {
  int B = 0;      // sequences per micro-batch
  int T = 0;      // tokens per sequence (≤ context)
  int accum = 1;  // micro-batches per step (gradient accumulation)
  // Split wte, its gradient, master copy and moments into vocab tiles of kVocabBlock
  // rows ("<name>#0", "#1", ...), with one embedding and LM-head op per tile (DESIGN
  // step 8: an op too big for the budget is split). Same losses bit for bit.
  bool tile_vocab = false;
};

// The Program of one training step (see the names and op order above).
// act_dtype is F32 or BF16. AdamW attrs.scale = weight_decay for params with
// decay, 0 for biases and LayerNorm parameters.
Result<Program> build_training_program(const ModelConfig& cfg, StepShape shape, DType act_dtype,
                                       float max_grad_norm = 1.0f, float weight_decay = 0.1f);

// Forward pass only (eval, sampling), one batch, param names as above. Inputs
// mb0.tokens (and mb0.targets with_loss) [B,T] I32. with_loss: CrossEntropyForward
// into output mb0.losses [B·T] F32; without: output mb0.logits [B,T,Vp] (the first V
// columns of each row are the logits).
Result<Program> build_forward_program(const ModelConfig& cfg, int B, int T, DType act_dtype, bool with_loss,
                                      bool tile_vocab = false);

}  // namespace spillway
