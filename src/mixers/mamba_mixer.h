// The Mamba-1 mixer (in_proj -> causal conv + SiLU -> x_proj / dt_proj -> selective scan -> silu(z)
// gate -> out_proj) as one component, as mixers/mamba2_mixer.h is for Mamba-2: the family files
// (models/mamba.cpp, models/falcon_mamba.cpp, and Jamba's Mamba blocks through models/mamba2_hybrid.*)
// hold the blocks around it. Reference: transformers 5.18 MambaMixer.forward, FalconMambaMixer.forward
// (the same with RMS norms on dt_low, B and C) and JambaMambaMixer.forward (those norms with weights);
// model-math.md §3.1. Its backward: grad/mamba_mixer_grad.cpp.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "hooks/listener.h"
#include "io/weights.h"
#include "mixlens/model.h"

namespace mixlens::detail {

/// Sizes and options of one Mamba-1 mixer (MambaConfig, FalconMambaConfig).
struct MambaMixerDims {
  int64_t D = 0, E = 0, N = 0, R = 0, K = 4;  ///< hidden, intermediate, state, dt rank, conv kernel
  bool use_bias = false, use_conv_bias = true;
  /// FalconMamba: weightless RMS norms (eps mixer_rms_eps) on x_proj's three outputs dt_low [R],
  /// B [N] and C [N] before dt_proj and the scan read them (FalconMambaMixer.forward).
  bool bcdt_rms_norm = false;
  float mixer_rms_eps = 1e-6f;
  /// Jamba: those norms carry weights (dt_layernorm / b_layernorm / c_layernorm.weight, JambaRMSNorm).
  bool bcdt_norm_weights = false;
  /// Zamba (ZambaMambaMixer): `heads` Mamba heads of E / heads channels, each with its own x_proj and
  /// dt_proj (so its own dt_low, B and C), stored per head: x_proj_weight [H, R+2N, E/H],
  /// dt_proj_weight [H, E/H, R], dt_proj_bias / D [H, E/H], A_log [H, E/H, N]; in_proj's x and z
  /// rows interleaved (x_c = row 2c, z_c = row 2c+1). B and C are served [B,T,H,N].
  bool per_head = false;
  int64_t heads = 1;
};

/// In place on x_proj's output rows [rows, R + 2N] (dt_low | B | C): each of the three sections
/// becomes x / sqrt(mean(x^2) + eps) (FalconMambaWeightlessRMSNorm), times its weight [R] / [N] / [N]
/// where given (Jamba; null: none). The forward and its backward's recompute both call it, so the
/// two see the same numbers.
void norm_dt_b_c(float* dbc, int64_t rows, int64_t R, int64_t N, float eps, const float* dt_w = nullptr,
                 const float* b_w = nullptr, const float* c_w = nullptr);

/// ZambaMambaMixer's interleaved in_proj output rows [rows, 2E] (x_c, z_c pairs) into [x | z], in
/// place; interleave_xz is its inverse (the backward's gradient back into in_proj's row order).
void deinterleave_xz(float* xz, int64_t rows, int64_t E);
void interleave_xz(float* xz, int64_t rows, int64_t E);
/// y [rows, H, out] = per head h: x's columns [h xstep, h xstep + in) (rows ldx floats apart) times
/// W's rows [h out, (h+1) out) transposed, W [H out, in] (ops::linear, any matmul dtype). Mamba-1's
/// x_proj (u [rows, E] -> dbc [rows, H, XR]) and dt_proj (each head's dt_low, the first R of its XR
/// columns of dbc -> dt [rows, E]); Zamba's heads each have their own block. The forward and the
/// backward's recompute both call it, so the two see the same numbers.
void linear_heads(const Tensor& W, const float* x, int64_t rows, int64_t ldx, int64_t xstep, int64_t in, int64_t H,
                  float* y);

/// One layer's weights (HF names under the layer's mixer prefix).
struct MambaMixerWeights {
  Tensor in_proj;        // [2E, D]: rows 0..E-1 -> x, E..2E-1 -> gate z
  Tensor in_proj_bias;   // optional (use_bias)
  Tensor conv_wT;        // [K, E] (transposed from [E, 1, K])
  Tensor conv_bias;      // [E] (zeros when use_conv_bias is false)
  Tensor x_proj;         // [R + 2N, E]: rows -> dt_low | B | C (per_head: [H * (R + 2N), E / H], head-major)
  Tensor dt_proj;        // [E, R], a matmul weight (narrow under a 16-bit / int8 dtype; per_head: head h's rows h*E/H ..)
  Tensor dt_proj_bias;   // [E]
  Tensor A;              // [E, N] = -exp(A_log)
  Tensor D;              // [E]
  Tensor out_proj;       // [D, E]
  Tensor out_proj_bias;  // optional (use_bias)
  Tensor dt_norm, b_norm, c_norm;  // [R], [N], [N] with bcdt_norm_weights (Jamba), else undefined
};

/// What one mixer call reads and updates besides its input. The state sites belong to the
/// skeleton that owns the cache (models/ssm_lm.h begin_state / end_state).
struct MambaMixerCall {
  int layer = 0;
  Tensor* conv = nullptr;  ///< [B, K, E] last K pre-conv inputs (updated)
  bool chunked = true;     ///< the chunked scan (else the token loop)
  Listener* ls = nullptr;
  std::function<Tensor&()> begin_state;                  ///< serves state_input; the [B,E,N] state to scan from
  std::function<void()> end_state;                       ///< serves state_output
};

class MambaMixer {
 public:
  /// Default chunk length of the chunked scan.
  static constexpr int64_t kChunk = 64;
  MambaMixer() = default;
  explicit MambaMixer(const MambaMixerDims& dims) : dims_(dims), D_(dims.D), E_(dims.E), N_(dims.N), R_(dims.R),
                                                    K_(dims.K), use_bias_(dims.use_bias),
                                                    use_conv_bias_(dims.use_conv_bias) {}
  /// One layer's weights under `p` ("backbone.layers.3.mixer.").
  MambaMixerWeights load(const io::WeightStore& w, const std::string& p) const;
  /// The linear_attn values of layer `i`, in forward order.
  void values(int i, int64_t B, int64_t T, std::vector<ValueInfo>& v) const;
  /// One call on the normed block input [B,T,D]; returns what the block adds to the residual.
  Tensor forward(const MambaMixerWeights& lw, const Tensor& n_in, const Batch& in, const MambaMixerCall& call) const;
  /// The betas (dt) implied by a decays write (FamilyModel::betas_for_decays); WriteError when none does.
  Tensor betas_for_decays(int li, const MambaMixerWeights& lw, const Tensor& betas_before, const Tensor& dec) const;
  /// The algorithm of a call without a cached state (or a multi-token continuation).
  std::string prompt_kernel(int64_t seq) const;
  /// The chunked scan's chunk length (0 restores the default). It changes no value beyond float
  /// rounding; tests use short chunks to cover the carry between chunks.
  void set_chunk(int64_t c) { chunk_ = c > 0 ? c : kChunk; }
  int64_t chunk() const { return chunk_; }
  /// The sizes and options it was built with (its backward reads them).
  const MambaMixerDims& dims() const { return dims_; }

 private:
  Tensor decays_of(const MambaMixerWeights& lw, const Tensor& dt) const;
  void visit_decays(int li, const MambaMixerWeights& lw, Tensor& dt, Listener* ls) const;

  MambaMixerDims dims_;
  int64_t D_ = 0, E_ = 0, N_ = 0, R_ = 0, K_ = 4, chunk_ = kChunk;
  bool use_bias_ = false, use_conv_bias_ = true;
};

}  // namespace mixlens::detail
