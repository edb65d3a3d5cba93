// The Griffin / Hawk recurrent block as one mixer kind (transformers 5.18
// RecurrentGemmaRecurrentBlock + RecurrentGemmaRglru): y = gelu_tanh(linear_y(x)); u = conv_1d(linear_x(x))
// (depthwise causal, width conv1d_width, with bias); the RG-LRU per channel c of head h = c / bw:
//   i_t = sigmoid(u_t W_i[h] + b_i[h]), r_t = sigmoid(u_t W_a[h] + b_a[h])  (block-diagonal gates),
//   log a_t = -8 r_t softplus(recurrent_param),
//   h_t = a_t h_{t-1} + sqrt(1 - a_t^2) (i_t u_t), with a_t = 0 and the multiplier 1 at a reset
//   (position id 0: a row's first real token);
// out = linear_out(h_t * y). RecurrentGemma (models/recurrent_gemma.cpp) runs it as layers[i].linear_attn.
// The recurrence is diagonal: the sequential token loop is the only kernel (no chunked scan).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "hooks/listener.h"
#include "hooks/mixing.h"
#include "io/weights.h"
#include "mixlens/model.h"

namespace mixlens::detail {

struct RgLruMixerDims {
  int64_t D = 0;   ///< hidden_size
  int64_t W = 0;   ///< lru_width
  int64_t H = 0;   ///< num_attention_heads: the gates' diagonal blocks, W / H wide each
  int64_t K = 4;   ///< conv1d_width
};

/// One layer's weights (HF names under `...temporal_block.`).
struct RgLruMixerWeights {
  Tensor linear_x, linear_y, linear_out;  ///< [W, D], [W, D], [D, W]
  Tensor x_bias, y_bias, out_bias;        ///< [W], [W], [D]
  Tensor conv_wT, conv_bias;              ///< [K, W], [W]
  Tensor log_a_scale;                     ///< [W] -8 * softplus(recurrent_param): log a_t = r_t * this
  Tensor in_gate_w, in_gate_b, rec_gate_w, rec_gate_b;  ///< [H, bw, bw] (x @ W), [H, bw]
};

struct RgLruMixerCall {
  int layer = 0;
  Tensor* conv = nullptr;   ///< [B, K, W] the last K conv inputs (updated)
  Tensor* h = nullptr;      ///< [B, W] the RG-LRU state (updated); the served layout is this one
  bool has_state = false;   ///< conv / h hold a previous call's state
  const std::vector<int64_t>* pos = nullptr;  ///< [B * T] position ids: 0 at a real token resets h
  Listener* ls = nullptr;
};

class RgLruMixer {
 public:
  RgLruMixer() = default;
  explicit RgLruMixer(const RgLruMixerDims& d) : d_(d) {}
  const RgLruMixerDims& dims() const { return d_; }
  RgLruMixerWeights load(const io::WeightStore& w, const std::string& prefix) const;
  /// The linear_attn values of layer `layer`, in forward order.
  void values(int layer, int64_t B, int64_t T, std::vector<ValueInfo>& out) const;
  /// One call on the normed block input x [B,T,D]; returns linear_out's output [B,T,D].
  Tensor forward(const RgLruMixerWeights& w, const Tensor& x, const Batch& in, const RgLruMixerCall& call) const;

 private:
  RgLruMixerDims d_;
};

// ---- Token mixing (issue 26; docs/values.md "Token mixing"), mixers/rg_lru_mixing.cpp -------------
/// One call's RG-LRU inputs over a batch, served layouts [B,T,W] (what the recurrence read).
struct RgLruMixArgs {
  int64_t B = 0, T = 0, W = 0;
  const float* u = nullptr;       ///< attention_values
  const float* ig = nullptr;      ///< betas (input gate i_t)
  const float* la = nullptr;      ///< decays (log a_t)
  const int64_t* pos = nullptr;   ///< [B*T] position ids: 0 at a real token is a reset (a_t = 0, multiplier 1)
};
/// The RG-LRU is diagonal per channel, so MixBlock's "heads" are the W channels: M [B, channels,
/// rows, cols] with M[b,c,t,s] = w_s prod_{r=s+1..t} a_r (first[b] <= s <= t), w_s = i_s
/// sqrt(1 - a_s^2) (i_s at a reset), a_r = exp(la_r) (0 at a reset); Sin [B, channels, rows, 1] =
/// prod_{r=first..t} a_r, the factor on state_input's h row (row K-1), so h_t = sum_s M u_s + Sin h_in.
void rg_lru_token_mixing(const RgLruMixArgs& a, const std::vector<int64_t>& first, const MixBlock& blk, float* M,
                         float* Sin);
/// out [B, channels, cols]: M[b,c,t,s] u_s, token s's share of h after t (the h row of the state;
/// the conv-window rows are copies of the last K-1 linear_x outputs, not a mixture, so not split).
void rg_lru_state_contributions(const RgLruMixArgs& a, const std::vector<int64_t>& first, int64_t t,
                                const MixBlock& blk, float* out);

}  // namespace mixlens::detail
