// The Mamba-2 mixer (in_proj -> causal conv + SiLU -> SSD scan -> gated norm -> out_proj) as one
// reusable component: Mamba-2 runs it in every block, and the hybrids (Nemotron-H, Bamba,
// Falcon-H1) run the same mixer inside their own blocks. What the families vary is a parameter of
// Mamba2MixerDims (n_groups and the grouped gated norm, the dt clamp, an optional norm, d_ssm, the
// Falcon-H1 µP multipliers). References: transformers 5.18 Mamba2Mixer, NemotronHMamba2Mixer,
// BambaMixer, FalconH1Mixer (torch paths); model-math.md §3.2.
#pragma once
#include <array>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "hooks/kept.h"
#include "hooks/listener.h"
#include "io/weights.h"
#include "mixlens/model.h"

namespace mixlens::detail {

/// How the scan output y is gated and normalised before out_proj (z = the gate projection).
enum class Mamba2Norm {
  gated_full,         ///< RMSNorm(y * silu(z)) over the full width E (Mamba2 / Bamba: n_groups ignored)
  gated_grouped,      ///< RMSNorm(y * silu(z)) per group of E/G channels (Nemotron-H Zamba2RMSNormGated;
                      ///< Falcon-H1 with mamba_norm_before_gate false)
  grouped_then_gate,  ///< RMSNorm(y) per group, then * silu(z) (Falcon-H1 mamba_norm_before_gate true)
  none,               ///< y * silu(z), no norm weight (Falcon-H1 mamba_rms_norm false). transformers gates
                      ///< inside the decode kernel there, so a decode step's attention_head_outputs
                      ///< already carry silu(z) while a prompt's do not; mixlens serves the same.
};

/// Sizes and options of one model's Mamba-2 mixers (all its mixer layers share them).
struct Mamba2MixerDims {
  int64_t D = 0;  ///< hidden_size (mixer input/output width)
  int64_t E = 0;  ///< intermediate width = heads * head_dim (Falcon-H1 mamba_d_ssm)
  int64_t H = 0, P = 0, G = 1, N = 0, K = 4;  ///< heads, head_dim, n_groups, state_size, conv kernel
  int64_t chunk = 256;                        ///< SSD chunk size of the chunked kernel
  float eps = 1e-5f;                          ///< gated-norm epsilon
  /// dt clamp applied on prompt / continuation calls (mamba2_chunk_scan's dt_limit); the decode
  /// update (mamba2_selective_state_update) has none, as in transformers.
  float dt_lo = 0.0f, dt_hi = std::numeric_limits<float>::infinity();
  Mamba2Norm norm = Mamba2Norm::gated_full;
  bool in_proj_bias = false, conv_bias = true, out_proj_bias = false;
  /// Falcon-H1 µP: the input is scaled by in_multiplier (ssm_in_multiplier) before in_proj; the
  /// projection's z | x | B | C | dt sections by proj_multipliers (ssm_multipliers, mup_vector);
  /// the mixer output by out_multiplier (ssm_out_multiplier, applied in FalconH1DecoderLayer; here
  /// before attention_output is served, so attention_output is what the block adds).
  float in_multiplier = 1.0f;
  std::array<float, 5> proj_multipliers{1.0f, 1.0f, 1.0f, 1.0f, 1.0f};
  float out_multiplier = 1.0f;

  int64_t conv_dim() const { return E + 2 * G * N; }
  int64_t proj_rows() const { return E + conv_dim() + H; }
};

/// One layer's weights (HF names under the layer's mixer prefix).
struct Mamba2MixerWeights {
  Tensor in_proj;        ///< [E + conv_dim + H, D]
  Tensor in_proj_bias;   ///< optional [proj_rows]
  Tensor conv_wT;        ///< [K, conv_dim] (transposed from conv1d.weight [conv_dim, 1, K])
  Tensor conv_bias;      ///< [conv_dim] (zeros when the conv has no bias)
  Tensor dt_bias, A, D;  ///< [H]; A = -exp(A_log)
  Tensor gnorm;          ///< [E] gated-norm weight (undefined for Mamba2Norm::none)
  Tensor out_proj;       ///< [D, E]
  Tensor out_proj_bias;  ///< optional [D]
};

/// What one mixer call reads and updates besides its input.
struct Mamba2MixerCall {
  int layer = 0;
  Tensor* conv = nullptr;  ///< [B, K, conv_dim] last K pre-conv inputs (updated)
  Tensor* ssm = nullptr;   ///< [B, H, P, N] kernel-layout state (updated)
  bool has_state = false;  ///< conv/ssm hold a previous call's state (else zeroed first)
  bool chunked = true;     ///< the chunked kernel (else the token recurrence)
  Listener* ls = nullptr;
  /// A call recorded for gradients: the forward keeps in_proj's output and the scan's output on it
  /// (grad::Kept::in_proj / head_outputs), which the backward would otherwise recompute.
  grad::KeptTensors* tape = nullptr;
};

class Mamba2Mixer {
 public:
  Mamba2Mixer() = default;
  /// Checks the sizes (ConfigError naming `where` and the field): positive sizes, E == H * P,
  /// H % G == 0, E % G == 0 for grouped norms, 0 <= dt_lo <= dt_hi.
  Mamba2Mixer(const Mamba2MixerDims& dims, const std::string& where);
  const Mamba2MixerDims& dims() const { return d_; }
  void set_chunk(int64_t c) { d_.chunk = c; }

  /// Loads `prefix`in_proj.weight, conv1d.weight/bias, dt_bias, A_log, D, norm.weight,
  /// out_proj.weight (and the biases the dims ask for), checked against the dims' shapes.
  Mamba2MixerWeights load(const io::WeightStore& w, const std::string& prefix) const;

  /// One row's kernel-layout state [H, P, N] and the served layout [H, N, P] (key side first).
  Shape state_shape() const { return {d_.H, d_.P, d_.N}; }
  Shape served_state_shape() const { return {d_.H, d_.N, d_.P}; }
  Tensor served_state(const Tensor& S) const;                    ///< [B,H,P,N] -> [B,H,N,P]
  void store_served_state(const Tensor& served, Tensor& S) const;  ///< [B,H,N,P] -> [B,H,P,N]

  /// The linear_attn values of layer `layer`, in forward order.
  void values(int layer, int64_t B, int64_t T, std::vector<ValueInfo>& out) const;

  /// One call on the mixer input x [B,T,D] (the normed block input); returns what the block adds
  /// to the residual [B,T,D] (after out_multiplier), visiting every linear_attn value on the way.
  Tensor forward(const Mamba2MixerWeights& w, const Tensor& x, const Batch& in, const Mamba2MixerCall& call) const;
  /// The dt (betas) a decays write [B,T,H] implies: decays / A for every entry, as forward() uses
  /// it (FamilyModel::betas_for_decays, read-after-write).
  Tensor betas_for_decays(const Mamba2MixerWeights& w, const Tensor& betas_before, const Tensor& decays) const;

 private:
  void group_rmsnorm_rows(float* g, const float* w, int64_t rows) const;  ///< rows of E floats
  Mamba2MixerDims d_;
};

}  // namespace mixlens::detail
