// Rotary position embeddings (RoPE) as Hugging Face Llama computes them: the
// rotate-half convention, rope_theta, and Llama 3's frequency scaling.
//
//   RopeParams r{.theta = 500000.0f, .llama3 = true, .factor = 32, .low_freq_factor = 1,
//                .high_freq_factor = 4, .original_context = 8192};   // Llama 3.2
//   float f = rope_inv_freq(r, /*D=*/64, /*i=*/5);   // frequency of rotation pair 5
//   // A head x[D] at position t turns pair (i, i + D/2) by angle float(t) * f:
//   //   y[i] = x[i]·cos − x[i+D/2]·sin,  y[i+D/2] = x[i+D/2]·cos + x[i]·sin
//
// The backends' rope_forward / rope_backward (backend/backend.h) apply it to the q
// and k heads of a qkv tensor; the op registry's Rope* ops carry a RopeParams.
#pragma once

namespace spillway {

struct RopeParams {            // Hugging Face Llama rotary embedding, rotate-half convention
  float theta = 10000.0f;      // rope_theta
  bool llama3 = false;         // rope_type "llama3" frequency scaling
  float factor = 0, low_freq_factor = 0, high_freq_factor = 0;  // llama3 only
  int original_context = 0;    // llama3 original_max_position_embeddings
  bool operator==(const RopeParams&) const = default;
};

// inv_freq of rotation pair i (0 <= i < D/2) for head size D, as transformers computes it
// (_compute_default_rope_parameters; _compute_llama3_parameters when llama3): compute in double,
// return float. Default: 1 / theta^(2i/D). llama3: with wavelen = 2π/inv_freq,
// low_wl = original_context/low_freq_factor and high_wl = original_context/high_freq_factor,
// inv/factor where wavelen > low_wl, inv where wavelen < high_wl, and between them
// (1 − smooth)·inv/factor + smooth·inv with
// smooth = (original_context/wavelen − low_freq_factor)/(high_freq_factor − low_freq_factor).
float rope_inv_freq(const RopeParams& r, int D, int i);

}  // namespace spillway
