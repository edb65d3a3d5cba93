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

}  // namespace mixlens::detail
