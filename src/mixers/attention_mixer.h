// Softmax attention as one mixer kind: the self_attn block of every hybrid (q / k / v projections,
// optional q / k RMS norms, optional RoPE, causal GQA attention over the layer's KV cache, optional
// sigmoid output gate, o_proj). The Qwen hybrids (models/qwen_hybrid.cpp) and the Mamba-2 hybrids
// (models/mamba2_hybrid.cpp) run it; its kernels are mixers/attention.h, its backward
// grad/attention_mixer_grad.cpp. References: transformers 5.18 Qwen3_5Attention, NemotronHAttention,
// BambaAttention, FalconH1Attention; model-math.md §6.1.
//
// What a family sets (AttentionMixerDims), and who sets it:
//  - GQA: H query heads, Hkv key / value heads (H % Hkv == 0), head_dim hd (given, not D / H).
//  - rope, rot, theta: rotate-half RoPE on the first `rot` dims of each head (rot < hd: partial
//    rotary, Bamba, Qwen); rope = false: no positional encoding (Nemotron-H, Jamba, Granite 4.0-H
//    "nope" layouts).
//  - scale: the softmax scale, 0 for 1/sqrt(hd) (Granite 4.0-H: attention_multiplier; Zamba:
//    (hd / 2)^-0.5).
//  - gate: q_proj gives per head [query | gate] and the output is o_proj(attention * sigmoid(gate))
//    (Qwen's gated attention).
//  - qk_norm: RMSNorm of q and k after the projections (Qwen: per head over hd; OLMo-Hybrid: over
//    the whole projection, H * hd and Hkv * hd), qk_norm_centred for the (1 + w) weight (Qwen) or
//    the plain w (OLMo-Hybrid).
//  - bias: q / k / v / o_proj biases (attention_bias: Bamba, Falcon-H1, Granite, OLMo-Hybrid);
//    out_bias: an o_proj bias without the others (RecurrentGemma's o_proj always has one).
//  - window: sliding-window attention (RecurrentGemma's attention_window_size, transformers'
//    sliding_window_overlay): a query sees the last `window` keys, its own included; after each call
//    the KV cache keeps the last window - 1 (KvCache::keep_last; transformers' sliding-window layer).
//  - in_multiplier, key_multiplier, out_multiplier: Falcon-H1 µP (input, keys after k_proj, output).
//  - in_width: the width of the projections' input when it is not D (Zamba / Zamba2: the
//    concatenated [h, embeddings] of width 2 * hidden_size); the output stays D wide.
//  - lora_rank: per-layer LoRA adapters on q / k / v (Zamba2's shared attention, one adapter per
//    depth): q = q_proj(x) + B_q(A_q(x)), the same for k and v, loaded by load_adapters.
//  - mla: Kimi-Linear's multi-head latent attention (KimiLinearAttention, DeepSeek-V2 MLA without
//    RoPE): kv_a_proj_with_mqa gives [latent (kv_lora_rank) | k_rope (qk_rope_head_dim)], the latent
//    is RMS-normed (kv_a_layernorm) and expanded by kv_b_proj into per head [k_nope | v]; each head's
//    key is [k_nope | k_rope], k_rope shared by the heads; q from q_proj, or q_a_proj ->
//    q_a_layernorm -> q_b_proj with q_lora_rank. Not absorbed (transformers' math): the cache holds
//    the expanded keys and values, hd = qk_nope + qk_rope, v_hd <= hd. Differentiated by
//    grad/attention_mixer_grad.cpp (latent norms, kv_b_proj, the shared k_rope summed over heads).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "hooks/kept.h"
#include "hooks/listener.h"
#include "io/weights.h"
#include "mixers/attention.h"
#include "mixlens/model.h"

namespace mixlens::detail {

/// Where the q / k RMS norms act (AttentionMixerDims::qk_norm).
enum class AttentionQkNorm {
  none,      ///< no q_norm / k_norm
  per_head,  ///< over each head's hd dims, weights [hd] (Qwen3.5, Qwen3-Next)
  whole,     ///< over all heads at once, weights [H * hd] and [Hkv * hd] (OLMo-Hybrid)
};

/// Sizes and options of one model's attention mixers (all its attention layers share them).
struct AttentionMixerDims {
  int64_t D = 0;                  ///< hidden_size (input and output width)
  int64_t H = 0, Hkv = 0, hd = 0; ///< query heads, key / value heads, head_dim
  bool rope = true;               ///< RoPE on q and k (else no positional encoding)
  int64_t rot = 0;                ///< rotary dims per head (even, in (0, hd]) when rope
  double theta = 10000.0;         ///< RoPE base
  float scale = 0.0f;             ///< softmax scale (0: 1/sqrt(hd), SDPA's default)
  bool gate = false;              ///< sigmoid output gate: q_proj rows per head [query | gate]
  AttentionQkNorm qk_norm = AttentionQkNorm::none;
  bool qk_norm_centred = false;   ///< q / k norm weight (1 + w) (else w)
  float eps = 1e-6f;              ///< q / k norm epsilon
  bool bias = false;              ///< q / k / v / o_proj biases
  bool out_bias = false;          ///< an o_proj bias alone (implied by bias)
  int64_t window = 0;             ///< sliding window in keys, the query's own included (0: none)
  /// Falcon-H1 µP: the input is scaled by in_multiplier before the projections, k_proj's output by
  /// key_multiplier (before any k norm and RoPE), the output by out_multiplier (before attn_output
  /// is served, so attn_output is what the block adds).
  float in_multiplier = 1.0f, key_multiplier = 1.0f, out_multiplier = 1.0f;
  int64_t in_width = 0;   ///< the projections' input width (0: D; Zamba's concatenated input: 2D)
  int64_t lora_rank = 0;  ///< rank of the q / k / v LoRA adapters (0: none; Zamba2 adapter_rank)
  /// MLA (see the file comment): kv_lora_rank > 0 turns it on; hd must be qk_nope + qk_rope, Hkv = H.
  int64_t kv_lora_rank = 0, q_lora_rank = 0, qk_nope = 0, qk_rope = 0, v_hd = 0;
  float latent_eps = 1e-6f;  ///< q_a_layernorm / kv_a_layernorm epsilon (KimiLinearRMSNorm's default)
  /// Weight names under the prefix (LFM2: out_proj, q_layernorm, k_layernorm).
  std::string o_name = "o_proj", q_norm_name = "q_norm", k_norm_name = "k_norm";

  bool mla() const { return kv_lora_rank > 0; }
  /// Each value head's width: hd, or v_hd with MLA.
  int64_t value_hd() const { return mla() ? v_hd : hd; }
  /// Rows of q_proj: H * hd, twice that with the gate.
  int64_t q_rows() const { return H * hd * (gate ? 2 : 1); }
  /// Width of the projections' input.
  int64_t in_dim() const { return in_width > 0 ? in_width : D; }
};

/// One layer's weights (HF names under the layer's attention prefix; optional tensors undefined).
struct AttentionMixerWeights {
  Tensor q_proj;          ///< [q_rows, D] (per head [query | gate] with the gate)
  Tensor k_proj, v_proj;  ///< [Hkv * hd, D]
  Tensor o_proj;          ///< [D, H * hd]
  Tensor q_bias, k_bias, v_bias, o_bias;  ///< with bias: [q_rows], [Hkv * hd], [Hkv * hd], [D]
  Tensor q_norm, k_norm;  ///< per_head: [hd]; whole: [H * hd], [Hkv * hd]
  /// With lora_rank: the adapters' down ([r, in_dim]) and up ([rows, r]) projections of q, k, v.
  Tensor q_lora_a, q_lora_b, k_lora_a, k_lora_b, v_lora_a, v_lora_b;
  /// MLA: [q_lora_rank, D], [q_lora_rank], [H * hd, q_lora_rank] (with q_lora_rank; else q_proj);
  /// [kv_lora_rank + qk_rope, D], [kv_lora_rank], [H * (qk_nope + v_hd), kv_lora_rank].
  Tensor q_a_proj, q_a_norm, q_b_proj, kv_a_proj, kv_a_norm, kv_b_proj;
};

/// y += up(down(x)) for x [rows, in]: one LoRA adapter (down [r, in], up [y's row width, r]); the
/// forward's and the backward's recompute share it.
void add_lora(const float* x, int64_t rows, const Tensor& down, const Tensor& up, Tensor& y);

/// MLA's queries q [rows, H * hd] of inputs x [rows, D] (q_proj, or q_b_proj(q_a_layernorm(q_a_proj(x))));
/// `qa_out`: q_a_proj's output before its norm (with q_lora_rank). The forward's and the backward's recompute.
void latent_queries(const AttentionMixerDims& d, const AttentionMixerWeights& w, const float* x, int64_t rows, float* q,
                    Tensor* qa_out = nullptr);
/// MLA's keys k [rows, H, hd] = per head [k_nope | k_rope] and values v [rows, H, v_hd]
/// (KimiLinearAttention.expand_kv); `ckv_out`: kv_a_proj_with_mqa's output [rows, kv_lora_rank + qk_rope].
void latent_keys_values(const AttentionMixerDims& d, const AttentionMixerWeights& w, const float* x, int64_t rows,
                        float* k, float* v, Tensor* ckv_out = nullptr);
/// x [.., heads, w] into [.., heads, d] (d > w), zeros after each head's w (MLA's values in the cache); and back.
Tensor pad_heads(const Tensor& x, int64_t d);
Tensor unpad_heads(const Tensor& x, int64_t w);

/// What one mixer call reads and updates besides its input.
struct AttentionMixerCall {
  int layer = 0;
  KvCache* kv = nullptr;  ///< the layer's keys and values (the call's are appended)
  /// Per row, 1 for every real token up to the call's last (HybridCache::key_mask, advanced).
  const std::vector<std::vector<uint8_t>>* key_mask = nullptr;
  const std::vector<int64_t>* pos = nullptr;  ///< [B * T] position ids (HybridCache::advance_positions)
  /// Queries, attention and o_proj for the last position of each row only ([B,1,D] out, nothing
  /// visited: the caller checks that nobody observes the call); keys and values for every position.
  bool last_rows_only = false;
  Listener* ls = nullptr;
  /// A call recorded for gradients: the forward keeps q_proj's and k_proj's outputs, the values (after
  /// writes), the attention output and the mixer output (grad::Kept::attn_*), so the backward runs
  /// no product of the forward again. Null: the backward recomputes them from the block input.
  grad::KeptTensors* tape = nullptr;
};

class AttentionMixer {
 public:
  AttentionMixer() = default;
  /// Checks the sizes and options (ConfigError naming `where`): positive sizes, H % Hkv == 0, an even
  /// rotary dim in (0, hd] with RoPE, a finite scale >= 0, a finite eps > 0 with q / k norms, finite
  /// multipliers.
  AttentionMixer(const AttentionMixerDims& dims, const std::string& where);
  const AttentionMixerDims& dims() const { return d_; }
  /// RoPE inverse frequencies [rot / 2] (empty without RoPE).
  const std::vector<float>& inv_freq() const { return inv_freq_; }

  /// Loads `prefix`q_proj / k_proj / v_proj / o_proj.weight (and .bias), q_norm / k_norm.weight as the
  /// dims ask, checked against their shapes.
  AttentionMixerWeights load(const io::WeightStore& w, const std::string& prefix) const;
  /// Adds the LoRA adapters of entry `index` of `prefix`linear_{q,k,v}_adapter_list (Zamba2Attention:
  /// `index`.0 the down projection [r, in_dim], `index`.1 the up projection [rows, r]) to `a`, whose
  /// shared projections stay as loaded: one weight set per depth of a shared block.
  void load_adapters(const io::WeightStore& w, const std::string& prefix, int64_t index, AttentionMixerWeights& a) const;

  /// The self_attn values of layer `layer`, in forward order.
  void values(int layer, int64_t B, int64_t T, std::vector<ValueInfo>& out) const;

  /// One call on the mixer input x [B,T,D] (the normed block input); returns what the block adds to
  /// the residual [B,T,D] ([B,1,D] with last_rows_only), visiting every self_attn value on the way.
  Tensor forward(const AttentionMixerWeights& w, const Tensor& x, const Batch& in, const AttentionMixerCall& call) const;

 private:
  AttentionMixerDims d_;
  std::vector<float> inv_freq_;
};

}  // namespace mixlens::detail
