// The gated short convolution mixer (LFM2's Lfm2ShortConv: in_proj -> B, C, x; B * x through a
// depthwise causal conv of width L_cache; C * conv output; out_proj) as one component: the LFM2
// families (models/lfm2.cpp over models/qwen_hybrid.cpp) run it in their conv blocks. Reference:
// transformers models/lfm2/modeling_lfm2.py Lfm2ShortConv.forward. Its state is the conv window
// (the last L_cache values of B * x), served [B, hidden, L_cache] as transformers' conv_states.
// One kernel (a token loop): the window shift is the whole recurrence. Backward: grad/short_conv_mixer_grad.cpp.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "hooks/listener.h"
#include "hooks/mixing.h"
#include "io/weights.h"
#include "mixlens/model.h"

namespace mixlens::detail {

/// One layer's weights (HF names under the layer's `conv.` prefix).
struct ShortConvMixerWeights {
  Tensor in_proj;          // [3D, D], rows B | C | x
  Tensor in_bias;          // [3D] with conv_bias
  Tensor conv_wT;          // [K, D] (conv.weight [D, 1, K] transposed)
  Tensor conv_bias;        // [D] with conv_bias
  Tensor out_proj;         // [D, D]
  Tensor out_bias;         // [D] with conv_bias
};

/// What one mixer call reads and updates besides its input.
struct ShortConvMixerCall {
  int layer = 0;
  Tensor* conv = nullptr;  ///< [B, K, D] the last K values of B * x, oldest first (updated)
  bool has_state = false;  ///< conv holds a previous call's window
  Listener* ls = nullptr;
};

class ShortConvMixer {
 public:
  ShortConvMixer() = default;
  /// `D`: hidden_size; `K`: conv_L_cache; `bias`: conv_bias (in_proj, conv and out_proj biases).
  ShortConvMixer(int64_t D, int64_t K, bool bias) : D_(D), K_(K), bias_(bias) {}
  int64_t width() const { return K_; }
  int64_t hidden() const { return D_; }
  bool bias() const { return bias_; }
  void load(const io::WeightStore& w, const std::string& m, ShortConvMixerWeights& l) const;
  /// The linear_attn values of layer `layer`, in forward order.
  void values(int layer, int64_t B, int64_t T, std::vector<ValueInfo>& out) const;
  /// One call on the normed block input [B,T,D]; `masked`: zero the padding rows of the input first
  /// (apply_mask_to_padding_states). Returns what the block adds to the residual.
  Tensor forward(const ShortConvMixerWeights& l, const Tensor& n_in, const Batch& in, bool masked,
                 const ShortConvMixerCall& call) const;

 private:
  int64_t D_ = 0, K_ = 3;
  bool bias_ = false;
};

// ---- Token mixing (issue 26; docs/values.md "Token mixing"), mixers/short_conv_mixing.cpp ---------
/// One call's short conv inputs over a batch, served layouts [B,T,D], and the layer's conv weights.
struct ShortConvMixArgs {
  int64_t B = 0, T = 0, D = 0, K = 0;
  const float *Bg = nullptr, *Cg = nullptr, *x = nullptr;  ///< attention_keys, attention_queries, attention_values
  const float* conv_wT = nullptr;                          ///< [K, D], index K-1 = the token's own tap
};
/// Per channel (depthwise conv), so MixBlock's "heads" are the D channels, and the mixing is of
/// the served values x (B is folded into the columns): M[b,d,t,s] = C_t[d] w[K-1-(t-s), d] B_s[d]
/// for first[b] <= s <= t < s + K (a band); Sin [B, channels, rows, K] = C_t[d] w[j-1-(t-first), d]
/// on window column j >= t - first + 1 (state_input [D, K], oldest first), so
/// y_t = sum_s M[t,s] x_s + Sin[t] . state_input + C_t conv_bias.
void short_conv_token_mixing(const ShortConvMixArgs& a, const std::vector<int64_t>& first, const MixBlock& blk,
                             float* M, float* Sin);
/// out [B, channels, cols, K]: the window after t (served [D, K] per channel) split by source: token
/// s's B_s x_s sits in column s - t + K - 1 while it is in the window (first[b] <= s <= t), else 0.
void short_conv_state_contributions(const ShortConvMixArgs& a, const std::vector<int64_t>& first, int64_t t,
                                    const MixBlock& blk, float* out);

}  // namespace mixlens::detail
