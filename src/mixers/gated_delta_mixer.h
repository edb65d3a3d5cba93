// The gated DeltaNet mixer (in_proj -> causal conv + SiLU -> gated delta rule scan -> gated RMSNorm
// -> out_proj) as one component: the Qwen hybrids (models/qwen_hybrid.cpp) run it in their linear
// attention blocks. Reference: transformers Qwen3_5GatedDeltaNet.forward; model-math.md §3.3. Its
// backward: grad/gated_delta_mixer_grad.cpp.
// Option GdnDims::kda, Kimi Delta Attention (transformers KimiLinearDeltaAttention): the forget gate
// is per key channel, g [B,T,HV,Dk] = -exp(A_log[h]) * softplus(f_b(f_a(x)) + dt_bias[h,d]), the
// output gate is sigmoid(g_b(g_a(x))) instead of silu(z); q / k / v have one head count (HK = HV)
// and Dk = Dv. Its backward: grad/gated_delta_mixer_grad.cpp with GdnView::kda.
#pragma once
#include <cstdint>
#include <string>

#include "hooks/kept.h"
#include "hooks/listener.h"
#include "io/weights.h"
#include "mixlens/model.h"
#include "ops/ops.h"

namespace mixlens::detail {

/// GDN sizes of one model (model-math.md §3.3.2).
struct GdnDims {
  int64_t D = 0, HK = 0, HV = 0, Dk = 0, Dv = 0;
  bool kda = false;  ///< Kimi Delta Attention (see the file comment)
  int64_t key_dim() const { return HK * Dk; }
  int64_t value_dim() const { return HV * Dv; }
  int64_t conv_dim() const { return 2 * key_dim() + value_dim(); }
  /// Rows of z in the input projection: z itself, or g_a's output (the gate's latent, Dk wide) with kda.
  int64_t z_rows() const { return kda ? Dk : value_dim(); }
  /// Rows of a: one per value head, or f_a's output (the forget gate's latent, Dk wide) with kda.
  int64_t a_rows() const { return kda ? Dk : HV; }
  /// Decays per token and value head: 1, or Dk with kda (values.md `decays` [B,T,HV] / [B,T,HV,Dk]).
  int64_t decay_width() const { return kda ? Dk : 1; }
  /// Rows of the combined input projection [q | k | v | z | b | a].
  int64_t proj_rows() const { return conv_dim() + z_rows() + HV + a_rows(); }
};

/// How a family's gated DeltaNet differs from Qwen3_5GatedDeltaNet (the defaults).
struct GdnOptions {
  /// beta = beta_scale * sigmoid(b): 2 for OLMo-Hybrid's linear_allow_neg_eigval (beta in [0, 2]).
  float beta_scale = 1.0f;
  /// Gated RMSNorm epsilon; 0: the model's rms_norm_eps (Qwen). OLMo-Hybrid fixes 1e-5 (FLA's default).
  float norm_eps = 0.0f;
  /// Weight names under the mixer prefix: the gated norm and the output projection
  /// (Qwen: norm / out_proj; OLMo-Hybrid: o_norm / o_proj).
  std::string norm_name = "norm", out_name = "out_proj";
  /// The causal conv may be stored as q_conv1d / k_conv1d / v_conv1d (OLMo-Hybrid's checkpoints, which
  /// transformers concatenates into conv1d at load); conv1d itself is read when present.
  bool split_conv = false;
};

/// One layer's weights.
struct GatedDeltaMixerWeights {
  ops::RowStack in_proj;  // [proj_rows, D], as the family stacks it (QwenHybridSpec::load_gdn_in_proj)
  Tensor conv_wT;  // [K, conv_dim]
  Tensor neg_A;    // [HV] -exp(A_log)
  Tensor dt_bias;  // [HV], [HV * Dk] with kda
  Tensor gnorm;    // [Dv] plain weight
  Tensor out_proj; // [D, value_dim]
  Tensor f_b, g_b; // kda: [HV * Dk, Dk] forget gate, [value_dim, Dk] output gate (second stages)
};

/// What one mixer call reads and updates besides its input.
struct GatedDeltaMixerCall {
  int layer = 0;
  Tensor* conv = nullptr;  ///< [B, K, conv_dim] last K pre-conv inputs (updated)
  Tensor* ssm = nullptr;   ///< [B, HV, Dk, Dv] state; the served layout is this one (updated)
  bool has_state = false;  ///< conv/ssm hold a previous call's state
  bool chunked = true;     ///< the chunked kernel (else the token recurrence)
  Listener* ls = nullptr;
  /// A call recorded for gradients: the forward keeps in_proj's output, and on a whole chunked scan
  /// the chunk entry states and o (grad::Kept), which the backward would otherwise recompute.
  grad::KeptTensors* tape = nullptr;
};

/// Kimi Delta Attention's second-stage gate product: W [n, Dk] times the latent columns
/// [c0, c0 + Dk) of the in_proj output proj [rows, pr] (f_b(f_a(x)), g_b(g_a(x))); returns [rows, n].
Tensor kda_latent_times(const Tensor& proj, int64_t rows, int64_t pr, int64_t c0, int64_t Dk, const Tensor& W);

/// beta [rows, HV] = beta_scale * sigmoid(b) and g [rows, HV, gw] = neg_A[h] * softplus(a + dt_bias[h * gw + d])
/// (Qwen3_5GatedDeltaNet; KimiLinearForgetGate with gw = Dk), with b at in_proj's columns [b_col, b_col + HV) of
/// proj [rows, pr] and a the next HV columns, or fa [rows, HV * gw] (kda: f_b(f_a(x))) when given.
void gdn_beta_decay(const float* proj, int64_t rows, int64_t pr, int64_t b_col, int64_t HV, int64_t gw, float beta_scale,
                    const float* neg_A, const float* dt_bias, const float* fa, float* beta, float* g);

class GatedDeltaMixer {
 public:
  GatedDeltaMixer() = default;
  /// `eps`: the model's rms_norm_eps (the gated norm's unless `opt` fixes its own).
  GatedDeltaMixer(const GdnDims& g, int64_t K, float eps, const GdnOptions& opt = {})
      : g_(g), D_(g.D), K_(K), eps_(opt.norm_eps > 0.0f ? opt.norm_eps : eps), opt_(opt) {}
  /// The gated norm's epsilon and beta's scale, as the backward needs them.
  float norm_eps() const { return eps_; }
  float beta_scale() const { return opt_.beta_scale; }
  /// Every weight under the mixer prefix `m` but in_proj, whose row layout the family decides
  /// (QwenHybridSpec::load_gdn_in_proj). With kda, the names of KimiLinearDeltaAttention's checkpoint:
  /// q_conv1d / k_conv1d / v_conv1d, A_log [1,1,HV,1], dt_bias [HV*Dk], f_b_proj, g_b_proj, o_norm, o_proj.
  void load(const io::WeightStore& w, const std::string& m, GatedDeltaMixerWeights& l) const;
  /// One call on the normed block input [B,T,D]; `masked`: zero the padding rows of the input first
  /// (apply_mask_to_padding_states). Returns what the block adds to the residual.
  Tensor forward(const GatedDeltaMixerWeights& l, const Tensor& n_in, const Batch& in, bool masked,
                 const GatedDeltaMixerCall& call) const;

 private:
  GdnDims g_;
  int64_t D_ = 0, K_ = 4;
  float eps_ = 1e-6f;
  GdnOptions opt_;
};

}  // namespace mixlens::detail
