// Backward of RWKV-4 (issue 25, docs/gradients.md): the time-mixing mixer's (grad/rwkv_mixer_grad.cpp)
// and the block stack's with its LayerNorms and channel mixing (grad/rwkv_grad.cpp).
#pragma once
#include <cstdint>
#include <vector>

#include "grad/tape.h"
#include "models/rwkv.h"

namespace mixlens::grad {

/// Backward of RwkvModel::forward: ln_out, blocks from last to first, pre_ln, into the embeddings.
void rwkv_backward(const detail::RwkvParts& p, const Tape& tape, const Tensor& dlogits, GradSink& sink);

/// Backward of detail::token_shift_mix (out[t] = x[t] mix + prev (1 - mix), prev = x[t-1], or start at
/// and before the row's first real token): dx [B,T,D] += mix dout and the next token's share; dstart
/// [B,D] += what tokens reading start take; dprev (optional [B,T,D]) += (1 - mix) dout per token.
void token_shift_mix_backward(const Tensor& dout, const std::vector<int64_t>& first, const float* mix, Tensor& dx,
                              float* dstart, Tensor* dprev = nullptr);

/// The gradient of a shift part of `states` [B,T,row_numel] at `offset` (D wide): what token t + 1 reads as
/// its previous x (dprev [B,T,D] of token_shift_mix_backward), 0 after the last token, and on a row's
/// padding (where the state is the one the row starts from) what the tokens reading start take (dstart [B,D]).
void shift_state_adjoint(const Tensor& dprev, const Tensor& dstart, const std::vector<int64_t>& first,
                         int64_t offset, Tensor& dstates);

/// One time-mixing call (RwkvMixer::forward) recomputed from ln1's output n [B,T,D] and the state the
/// call started from (the cache's, state_input write applied: a constant of the call), writes re-applied.
class RwkvMixerGrad {
 public:
  RwkvMixerGrad(const detail::RwkvMixer& mixer, const detail::RwkvMixerWeights& w, int layer, const Tensor& n,
                const Tensor& S0, const Tape& tape);
  /// The mixer output as the forward added it (attention_output, writes applied).
  const Tensor& output() const { return out_; }
  /// From dL/d(output): dn [B,T,D] (overwritten); dS0 [B,row_numel] (overwritten): num | den | max | the
  /// time-mix shift (the block adds the channel-mix shift's); dstates (defined: [B,T,row_numel],
  /// overwritten likewise). Puts the linear_attn values' gradients but state_input / states.
  void backward(const Tensor& dout, Tensor& dn, Tensor& dS0, Tensor& dstates, GradSink& sink) const;

 private:
  const detail::RwkvMixerDims& d_;
  const detail::RwkvMixerWeights& w_;
  int li_;
  const Tape& tape_;
  std::vector<int64_t> first_;
  Tensor k_, v_, r_, w_dec_, y_, out_;
  Tensor before_;  ///< [B,T,3A] num | den | max before each real token
};

}  // namespace mixlens::grad
