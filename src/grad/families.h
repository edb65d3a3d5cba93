// Backwards of the pure SSM LMs (issue 12): the skeleton's and its mixers' (FamilyModel::backward,
// src/grad/backward.cpp, runs them from the family's SsmLmParts); the mixers' backwards the hybrid
// skeletons share (Mamba-2, attention).
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

#include "grad/tape.h"
#include "mixers/attention_mixer.h"
#include "mixers/mamba2_mixer.h"
#include "models/ssm_lm.h"

namespace mixlens::grad {

/// The tensors around the blocks of a pure SSM LM (models/ssm_lm.h).
struct SsmBackbone {
  const Tensor* norm_f = nullptr;
  const Tensor* lm_head = nullptr;
  const std::vector<Tensor>* norms = nullptr;
  float eps = 1e-5f;
  int64_t D = 0, L = 0, V = 0;
};

/// A mixer's backward: given the normed block input n [B,T,D] (recomputed) and dL/d(mixer output)
/// [B,T,D], writes dL/dn into dn [B,T,D] and puts the mixer values' gradients into the sink.
using MixerBackward = std::function<void(int layer, const Tensor& n, const Tensor& dout, Tensor& dn)>;

/// Backward of embeddings -> blocks h += mixer(RMSNorm(h)) -> RMSNorm -> lm_head (SsmLm::forward).
void ssm_lm_backward(const SsmBackbone& bb, const Tape& tape, const Tensor& dlogits, GradSink& sink,
                     const MixerBackward& mixer);

/// Backward of a loaded SSM LM: ssm_lm_backward with the backward of the mixer `p` names (Mamba-1
/// or Mamba-2). `model` maps a decays write back to dt (FamilyModel::betas_for_decays).
void ssm_lm_backward(const detail::FamilyModel& model, const detail::SsmLmParts& p, const Tape& tape,
                     const Tensor& dlogits, GradSink& sink);

/// What a Mamba-2 mixer call read from its cache (constants of the backward).
struct Mamba2CallState {
  const Tensor* conv = nullptr;  ///< [B,K,conv_dim] window before the call
  const Tensor* ssm = nullptr;   ///< [B,H,P,N] state before the call
  bool has_state = false;
  bool chunked = true;
};

/// Backward of Mamba2Mixer::forward (recomputed from n with the tape's writes re-applied).
void mamba2_mixer_backward(const detail::Mamba2Mixer& mixer, const detail::Mamba2MixerWeights& w, int layer,
                           const Tensor& n, const Mamba2CallState& call, const Tape& tape, const Tensor& dout,
                           Tensor& dn, GradSink& sink);

/// Given the mixer's output as the block adds it (attention_output after writes), returns
/// dL/d(that output): lets a block whose later part reads the mixer output (a second branch)
/// differentiate that part between the mixer's recompute and its backward.
using MixerDout = std::function<Tensor(const Tensor& out)>;
/// As mamba2_mixer_backward, with dout obtained from the recomputed output (one recompute, no
/// separate forward for the output).
void mamba2_mixer_backward(const detail::Mamba2Mixer& mixer, const detail::Mamba2MixerWeights& w, int layer,
                           const Tensor& n, const Mamba2CallState& call, const Tape& tape, const MixerDout& dout_of,
                           Tensor& dn, GradSink& sink);
/// What an attention mixer call read (constants of the backward; pointers into the caller's copies).
struct AttentionCallState {
  const detail::KvCache* kv = nullptr;  ///< the layer's keys and values before the call
  /// Per row, 1 for every real token up to the call's last (the cache advanced by the call).
  const std::vector<std::vector<uint8_t>>* key_mask = nullptr;
  const std::vector<int64_t>* pos = nullptr;  ///< [B * T] the call's position ids
};

/// One attention mixer call (AttentionMixer::forward), recomputed for its backward from the normed
/// block input n with the tape's writes re-applied, or taken from what the forward kept
/// (grad::Kept::attn_*). The block reads output() (e.g. for a second branch) before backward().
class AttentionMixerGrad {
 public:
  AttentionMixerGrad(const detail::AttentionMixer& mixer, const detail::AttentionMixerWeights& w, int layer,
                     const Tensor& n, const AttentionCallState& call, const Tape& tape);
  /// The mixer output as the forward added it (attn_output, writes applied).
  const Tensor& output() const { return out_; }
  /// dn [B,T,in_dim] (overwritten) from dL/d(output); puts the self_attn values' gradients.
  void backward(const Tensor& dout, Tensor& dn, GradSink& sink) const;

 private:
  const detail::AttentionMixerDims& d_;
  const std::vector<float>& inv_freq_;
  const detail::AttentionMixerWeights& w_;
  int li_;
  const Tape& tape_;
  AttentionCallState call_;
  int64_t past_ = 0;
  Tensor qpre_, kpre_, q_, k_, v_, gate_, att_, out_;  ///< q / k before their norm; gate undefined without
  Tensor qa_, ckv_;  ///< MLA: q_a_proj's output before its norm (with q_lora_rank), kv_a_proj_with_mqa's output
  /// MLA: dn [B,T,D] (overwritten) from the gradients of q [B,T,H,hd], k [B,T,H,hd] and v [B,T,H,v_hd].
  void latent_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv, Tensor& dn) const;
  detail::KvCache kv_;  ///< the cache before the call with the call's keys and values appended
};

/// The weights and options of one Mamba-1 mixer (mixers/mamba_mixer.h), as its backward reads them.
struct MambaMixerView {
  int64_t D = 0, E = 0, N = 0, R = 0, K = 0;
  int64_t chunk = 64;                   ///< the chunked scan's chunk length (recomputation as the forward)
  const Tensor* in_proj = nullptr;      ///< [2E, D]: x | z
  const Tensor* in_proj_bias = nullptr; ///< [2E] or undefined
  const Tensor* conv_wT = nullptr;      ///< [K, E]
  const Tensor* conv_bias = nullptr;    ///< [E]
  const Tensor* x_proj = nullptr;       ///< [R + 2N, E]: dt_low | B | C
  const Tensor* dt_proj = nullptr;      ///< [E, R], any matmul dtype
  const Tensor* dt_proj_bias = nullptr; ///< [E]
  const Tensor* A = nullptr;            ///< [E, N] = -exp(A_log)
  const Tensor* Dskip = nullptr;        ///< [E]
  const Tensor* out_proj = nullptr;     ///< [D, E]
  const Tensor* out_proj_bias = nullptr;  ///< [D] or undefined (the recomputed output adds it)
  bool bcdt_rms_norm = false;           ///< FalconMamba: weightless RMS norms on dt_low, B, C
  float mixer_rms_eps = 1e-6f;
  /// Jamba: those norms' weights [R], [N], [N] (nullptr: weightless).
  const float* dt_norm = nullptr;
  const float* b_norm = nullptr;
  const float* c_norm = nullptr;
  /// Zamba: per-head x_proj / dt_proj (MambaMixerDims::per_head), in_proj's x / z rows interleaved.
  bool per_head = false;
  int64_t heads = 1;
};
/// The view of a loaded mixer's layer `l` (pointers into `mixer` and `l`).
MambaMixerView mamba_mixer_view(const detail::MambaMixer& mixer, const detail::MambaMixerWeights& l);

/// What a Mamba-1 mixer call read from its cache (constants of the backward), and how the family
/// maps a decays write back to dt (MambaModel::betas_for_decays: one dt per (token, channel)).
struct MambaCallState {
  const Tensor* conv = nullptr;  ///< [B,K,E] window before the call
  const Tensor* ssm = nullptr;   ///< [B,E,N] state before the call
  bool has_state = false;
  bool chunked = true;
  std::function<Tensor(const Tensor& betas, const Tensor& decays)> betas_for_decays;
};

/// Backward of MambaModel::mixer (recomputed from n with the tape's writes re-applied).
void mamba_mixer_backward(const MambaMixerView& w, int layer, const Tensor& n, const MambaCallState& call,
                          const Tape& tape, const Tensor& dout, Tensor& dn, GradSink& sink);
/// As above, with dout obtained from the recomputed output (a hybrid block's second branch reads it).
void mamba_mixer_backward(const MambaMixerView& w, int layer, const Tensor& n, const MambaCallState& call,
                          const Tape& tape, const MixerDout& dout_of, Tensor& dn, GradSink& sink);

}  // namespace mixlens::grad
