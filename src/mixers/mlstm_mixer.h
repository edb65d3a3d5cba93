// The mLSTM layer of xLSTM-7B (q, k, v, output-gate and soft-capped input / forget gate projections ->
// the matrix-memory recurrence C [Dqk x Dv], normaliser n, stabiliser m per head -> multi-head LayerNorm
// -> sigmoid output gate -> out_proj) as one mixer, with its two kernels: transformers' chunkwise
// parallel form (mlstm_chunkwise_native_autograd) and its recurrent step (mlstm_recurrent_step_native).
// The family file (models/xlstm.cpp) holds the RMSNorms, residuals, feed-forward and head.
// Reference: transformers 5.18 models/xlstm/modeling_xlstm.py (xLSTMLayer, xLSTMBackend in "inference"
// mode: wrap_chunkwise_arbitrary_sequence_length). Served values and state layout: docs/values.md "xLSTM".
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "hooks/listener.h"
#include "hooks/mixing.h"
#include "io/weights.h"
#include "mixlens/model.h"
#include "mixlens/values.h"
#include "ops/ops.h"

namespace mixlens::detail {

/// Sizes and constants of one mLSTM layer (xLSTMConfig: hidden_size, num_heads, qk_dim_factor,
/// v_dim_factor, chunk_size, eps, gate_soft_cap).
struct MlstmMixerDims {
  int64_t D = 0, NH = 0;
  int64_t Dqk = 0, Dv = 0;   ///< per head: int(hidden_size * qk_dim_factor) / num_heads, likewise v
  int64_t chunk = 64;        ///< chunk_size: the chunkwise kernel's chunk length
  float eps = 1e-6f;         ///< eps: added to the read's denominator max(|q.n|, exp(-m))
  float gate_cap = 15.0f;    ///< gate_soft_cap (<= 0: none): cap * tanh(preact / cap) on both gates
  float norm_eps = 1e-6f;    ///< norm_eps: multihead_norm's LayerNorm eps
  int64_t qk() const { return NH * Dqk; }
  int64_t v() const { return NH * Dv; }
  /// One row's state, flat: C [NH, Dqk, Dv] | n [NH, Dqk] | m [NH] (transformers' (c, n, m) in order).
  int64_t row_numel() const { return NH * Dqk * Dv + NH * Dqk + NH; }
  int64_t n_off() const { return NH * Dqk * Dv; }
  int64_t m_off() const { return NH * Dqk * Dv + NH * Dqk; }
};

/// One layer's weights (HF names under "backbone.blocks.{i}.mlstm_layer."), used fused whatever
/// weight_mode: "single" q / k / v / ogate_preact and igate_preact / fgate_preact are stacked (no copy).
struct MlstmMixerWeights {
  ops::RowStack qkvo;   ///< [2 qk + 2 v, D]: q | k | v | output-gate pre-activation (qkv_opreact)
  ops::RowStack gates;  ///< [2 NH, D]: input | forget gate pre-activations (ifgate_preact)
  Tensor gate_bias;  ///< [2 NH]
  Tensor norm_w;     ///< [v] multihead_norm.weight
  Tensor out;        ///< [D, v] out_proj.weight
};

/// The recurrent form over tokens [0, T) of one row (mlstm_recurrent_step_native per token, float32, in its
/// operation order): q, k [T, NH*Dqk], v [T, NH*Dv], ig (log input gate = soft-capped i pre-activation, log betas)
/// and lf (log forget gate = logsigmoid of the soft-capped f pre-activation) [T, NH]; st [row_numel]
/// updated in place; h [T, NH*Dv]; when `states` is given, each token's state into states + t * stride.
void mlstm_recurrent(const MlstmMixerDims& d, int64_t T, const float* q, const float* k, const float* v,
                     const float* ig, const float* lf, float* st, float* h, float* states = nullptr,
                     int64_t stride = 0);
/// One chunk of L tokens in the chunkwise parallel form (mlstm_chunkwise_parallel_fw_H for h,
/// mlstm_chunkwise_recurrent_fw_C for the end state), same arguments as mlstm_recurrent; per-token states
/// (when `states` is given) are mlstm_chunk_state of each prefix.
void mlstm_chunk(const MlstmMixerDims& d, int64_t L, const float* q, const float* k, const float* v,
                 const float* ig, const float* lf, float* st, float* h, float* states = nullptr, int64_t stride = 0);
/// The state after the first L tokens of a chunk that starts from s0, by the chunk update
/// (mlstm_chunkwise_recurrent_fw_C with the chunk cut at L): what mlstm_chunk ends in for L = its length.
void mlstm_chunk_state(const MlstmMixerDims& d, int64_t L, const float* k, const float* v, const float* ig,
                       const float* lf, const float* s0, float* out);

/// What one mixer call reads and updates besides its input.
struct MlstmMixerCall {
  int layer = 0;
  Listener* ls = nullptr;
  bool chunked = true;                   ///< kernel: chunkwise ("chunked") or token loop ("recurrent")
  std::function<Tensor&()> begin_state;  ///< serves state_input; the [B, row_numel] cached state
  std::function<void()> end_state;       ///< serves state_output
};

class MlstmMixer {
 public:
  MlstmMixer() = default;
  explicit MlstmMixer(const MlstmMixerDims& dims) : d_(dims) {}
  /// One layer's weights under `p` ("backbone.blocks.3.mlstm_layer."); fused: weight_mode "fused".
  MlstmMixerWeights load(const io::WeightStore& w, const std::string& p, bool fused) const;
  void values(int i, int64_t B, int64_t T, std::vector<ValueInfo>& v) const;
  /// The projections of `rows` normed tokens x [rows, D] (xLSTMLayer): q, k [rows, qk], v and og (the output
  /// gate pre-activation) [rows, v], gp [rows, 2 NH] the input | forget gate pre-activations, ig (the
  /// soft-capped input gate: log betas) and lf (logsigmoid of the soft-capped forget gate: decays) [rows, NH].
  void project(const MlstmMixerWeights& lw, const float* x, int64_t rows, float* q, float* k, float* v, float* og,
               float* gp, float* ig, float* lf) const;
  /// multihead_norm of y [rows, v]: a LayerNorm (no bias, norm_eps) over each head's Dv, times the weight.
  void head_norm(const MlstmMixerWeights& lw, const float* y, int64_t rows, float* out) const;
  /// One call on norm_mlstm's output [B,T,D]; returns what the block adds to the residual [B,T,D].
  Tensor forward(const MlstmMixerWeights& lw, const Tensor& n_in, const Batch& in, const MlstmMixerCall& call) const;
  const MlstmMixerDims& dims() const { return d_; }
  /// The chunkwise kernel's chunk length (Model::set_chunk_size; the config's chunk_size by default).
  void set_chunk(int64_t c) { d_.chunk = c; }

 private:
  MlstmMixerDims d_;
};

// ---- Token mixing (issue 26; docs/values.md "Token mixing"), mixers/mlstm_mixing.cpp --------------
/// One call's mLSTM inputs over a batch, served layouts (what the kernels read), and where each row starts.
struct MlstmMixArgs {
  MlstmMixerDims d;
  int64_t B = 0, T = 0;
  const float *q = nullptr, *k = nullptr, *v = nullptr;  ///< [B,T,NH*Dqk] / [B,T,NH*Dqk] / [B,T,NH*Dv]
  const float* betas = nullptr;  ///< [B,T,NH] exp(i): the kernels read log(betas)
  const float* lf = nullptr;     ///< [B,T,NH] decays, log sigmoid(f)
  /// The n [NH*Dqk] and m [NH] the call starts from, row b at + b * stride (C is not read: the
  /// mixing's rows do not depend on it).
  const float *n_in = nullptr, *m_in = nullptr;
  int64_t stride = 0;
};
/// Per head, with F_t = sum_{r=first..t} lf_r, the stabiliser m_t = max(F_t + m_in, max_{s<=t} F_t - F_s
/// + i_s) (the recurrent step's, which the chunkwise form reaches too) and the read's denominator
/// den_t = max(|q_t . n_t| / sqrt(Dqk), exp(-m_t)) + eps:
///   M[b,h,t,s] = (q_t . k_s / sqrt(Dqk)) exp(F_t - F_s + i_s - m_t) / den_t   (first[b] <= s <= t),
///   Sin [B, heads, rows, Dqk] = q_t exp(F_t + m_in - m_t) / (sqrt(Dqk) den_t), the rows C_in is read with,
/// so h_t = sum_s M[t,s] v_s + Sin[t] C_in exactly; den_t (through n_t) depends on the keys and gates,
/// not on v. Double sums.
void mlstm_token_mixing(const MlstmMixArgs& a, const std::vector<int64_t>& first, const MixBlock& blk, float* M,
                        float* Sin);
/// out [B, heads, cols, Dqk, Dv + 1]: token s's share of the served C (columns 0..Dv-1) and n (column Dv)
/// after t, exp(F_t - F_s + i_s - m_t) k_s (v_s, 1), in the frame of the stabiliser m_t (not split).
void mlstm_state_contributions(const MlstmMixArgs& a, const std::vector<int64_t>& first, int64_t t,
                               const MixBlock& blk, float* out);

}  // namespace mixlens::detail
