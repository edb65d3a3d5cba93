// Backward of xLSTM (issue 25, docs/gradients.md): the mLSTM mixer's (grad/mlstm_mixer_grad.cpp) and
// the block stack's with its RMSNorms, feed-forward and soft-capped head (grad/xlstm_grad.cpp).
#pragma once
#include <cstdint>
#include <vector>

#include "grad/tape.h"
#include "models/xlstm.h"

namespace mixlens::grad {

/// Backward of XlstmModel::forward: the soft-capped head, out_norm, blocks from last to first, into the
/// embeddings.
void xlstm_backward(const detail::XlstmParts& p, const Tape& tape, const Tensor& dlogits, GradSink& sink);

/// One mLSTM call (MlstmMixer::forward) recomputed from norm_mlstm's output n [B,T,D] and the state the call
/// started from S0 [B,row_numel] (the cache's, state_input write applied: a constant of the call), writes
/// re-applied, on the kernel the forward ran (chunked: whole chunks in the chunkwise form, the rest by the
/// recurrent step). The backward is the exact derivative of the per-token recurrence
/// (mlstm_recurrent_step_native): m' = max(log f + m, i), C' = e^(log f + m - m') C + e^(i - m') k v^T,
/// n' likewise, h = (qs C') / (max(|qs n'|, e^(-m')) + eps), qs = q / sqrt(Dqk). The stabiliser's paths
/// are differentiated too (through the max to the branch taken, as torch.maximum; ties split): without
/// eps they cancel exactly (C, n, m stand for (C e^m, n e^m)), with eps the read depends on m, and the m
/// entry of a state gets dL/dm with C and n held. The chunkwise form is the same function of the inputs
/// (its stabiliser is the same max, unrolled), so its derivative is the recurrence's; the token states are
/// replayed from the forward's chunk-entry states (checkpoints every 64 tokens on the recurrent route).
class MlstmMixerGrad {
 public:
  MlstmMixerGrad(const detail::MlstmMixer& mixer, const detail::MlstmMixerWeights& w, int layer, const Tensor& n,
                 const Tensor& S0, bool chunked, const Tape& tape);
  /// The mixer output as the forward added it (attention_output, writes applied).
  const Tensor& output() const { return out_; }
  /// From dL/d(output): dn [B,T,D] (overwritten), dS0 [B,row_numel] (overwritten), dstates (defined:
  /// [B,T,row_numel], overwritten). Puts the linear_attn values' gradients but state_input / states.
  void backward(const Tensor& dout, Tensor& dn, Tensor& dS0, Tensor& dstates, GradSink& sink) const;

 private:
  /// The recurrence's backward for row b: dq, dk [B,T,qk], dv [B,T,v], dig / dlf [B,T,NH] (d log input gate,
  /// d log forget gate) from dy [B,T,v]; dS0 / dstates rows as backward().
  void scan_backward(int64_t b, const Tensor& dy, Tensor& dq, Tensor& dk, Tensor& dv, Tensor& dig, Tensor& dlf,
                     Tensor& dS0, Tensor& dstates) const;
  const detail::MlstmMixerDims d_;
  const detail::MlstmMixerWeights& w_;
  int li_;
  const Tape& tape_;
  bool chunked_;
  int64_t G_ = 64;               ///< checkpoint spacing: the chunk on the chunked route
  std::vector<int64_t> first_;   ///< per row, its first real token
  Tensor gp_;                    ///< [BT, 2NH] gate pre-activations (before the soft cap)
  Tensor q_, k_, v_, og_;        ///< writes applied; og_ the output gate pre-activation [B,T,v]
  Tensor gi_, ig_, lf_;          ///< betas (writes applied), log betas, decays (writes applied) [B,T,NH]
  Tensor S0_, ckpt_;             ///< [B,rn]; [B, ceil(T/G), rn] the state entering each checkpoint segment
  Tensor y_, ln_, out_;          ///< head outputs (writes applied), multihead_norm(y) [B,T,v], output [B,T,D]
};

}  // namespace mixlens::grad
