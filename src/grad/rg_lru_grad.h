// Backward of the RG-LRU mixer (mixers/rg_lru_mixer.h; transformers RecurrentGemmaRecurrentBlock):
// recomputed from the normed block input with the tape's writes re-applied in forward order, then
// differentiated through linear_out, the gelu_tanh(linear_y) gate, the recurrence (rg_lru_backward),
// the block-diagonal input / recurrence gates, the depthwise conv and linear_x. Run by RecurrentGemma's
// backward (grad/recurrent_gemma_grad.cpp).
#pragma once
#include <cstdint>
#include <vector>

#include "grad/tape.h"
#include "mixers/rg_lru_mixer.h"

namespace mixlens::grad {

/// What one RG-LRU call read from its cache (constants of the backward).
struct RgLruCallState {
  const Tensor* S0 = nullptr;  ///< [B,K,W] the state before the call (window rows, then h)
  bool has_state = false;
  const std::vector<int64_t>* pos = nullptr;  ///< [B*T] the call's position ids (0: a reset)
};

class RgLruMixerGrad {
 public:
  /// n [B,T,D] the normed block input; UnsupportedError when a state@t write made the call (the
  /// tape says so).
  RgLruMixerGrad(const detail::RgLruMixer& mixer, const detail::RgLruMixerWeights& w, int layer, const Tensor& n,
                 const RgLruCallState& call, const Tape& tape);
  /// attention_output as the forward added it (writes applied).
  const Tensor& output() const { return out_; }
  /// dn [B,T,D] (overwritten) from dL/d(output); puts attention_output, attention_head_outputs,
  /// attention_values (through the write path: the gates read u before a write), betas, decays,
  /// state_input (when the call had a state or it was written), state_output (zero) and `states`
  /// [B,T,K,W]: dL/dS_t, the window rows' adjoint (what tokens t+1.. read of them through the conv) and
  /// dL/dh_t (y_t and the recurrence); at a row's padding the state the row starts from (state_input's).
  void backward(const Tensor& dout, Tensor& dn, GradSink& sink) const;

 private:
  const detail::RgLruMixerDims& d_;
  const detail::RgLruMixerWeights& w_;
  int li_;
  const Tape& tape_;
  RgLruCallState call_;
  std::vector<int64_t> first_;
  Tensor S0_, yl_, y_, u_, ig0_, r_, uw_, ig_, la_, hs_, out_;  ///< ig0_ / r_: the gates before writes
};

}  // namespace mixlens::grad
