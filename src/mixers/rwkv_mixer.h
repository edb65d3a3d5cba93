// The RWKV-4 time-mixing block (token shift -> key / value / receptance -> WKV recurrence with the
// max-shifted (num, den, max) state -> receptance gate -> output) as one mixer, with its recurrent
// kernel. The family file (models/rwkv.cpp) holds the layer norms and the channel mixing around it.
// Reference: transformers 5.18 models/rwkv/modeling_rwkv.py (RwkvSelfAttention,
// rwkv_linear_attention_cpu). Served state layout: docs/values.md "RWKV-4".
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

namespace mixlens::detail {

/// Sizes of one RWKV-4 time-mixing block (RwkvConfig: hidden_size, attention_hidden_size).
struct RwkvMixerDims {
  int64_t D = 0, A = 0;
  /// One row's state, flat: num [A] | den [A] | max [A] | time-mix last x [D] | channel-mix last x [D].
  int64_t row_numel() const { return 3 * A + 2 * D; }
  int64_t att_shift() const { return 3 * A; }
  int64_t ffn_shift() const { return 3 * A + D; }
};

/// transformers' fresh max state (RwkvModel.forward with use_cache: state[4] -= 1e30).
inline constexpr float kRwkvFreshMax = -1e30f;

/// One layer's weights (HF names under "rwkv.blocks.{i}.attention.").
struct RwkvMixerWeights {
  Tensor decay;                       // [A] -exp(time_decay): the log decay per token
  Tensor time_first;                  // [A] u, the bonus of a token's own write
  Tensor mix_k, mix_v, mix_r;         // [D] time_mix_key / value / receptance
  Tensor key, value, receptance;      // [A, D]
  Tensor output;                      // [D, A], divided by 2^(layer / rescale_every) (RwkvModel._rescale_layers)
};

/// The WKV recurrence over tokens [0, T) of one row: reads k, v, w (log decays) [T, A] and u [A],
/// updates st = num | den | max [3A] in place, writes y [T, A] and, when `states` is given, each
/// token's num | den | max into states + t * stride. transformers' rwkv_linear_attention_cpu
/// arithmetic, float32, in its operation order.
void wkv_recurrent(int64_t T, int64_t A, const float* k, const float* v, const float* w, const float* u, float* st,
                   float* y, float* states = nullptr, int64_t stride = 0);

/// RWKV's token shift, for time and channel mixing: out[b,t] = x[b,t] * mix + prev * (1 - mix), where prev
/// is x[b,t-1], or start[b] (the cached last x; zeros on a fresh call) at and before the row's first
/// real token, so left padding never reaches a real token. x, out [B,T,D]; start [B,D]; mix [D].
void token_shift_mix(const Tensor& x, const float* start, const std::vector<int64_t>& first, const float* mix,
                     Tensor& out);

/// What one mixer call reads and updates besides its input.
struct RwkvMixerCall {
  int layer = 0;
  Listener* ls = nullptr;
  std::function<Tensor&()> begin_state;  ///< serves state_input; the [B, row_numel] cached state
  std::function<void()> end_state;       ///< serves state_output
  /// The channel-mix shift state after token t of row b given what the block adds there
  /// (ln2(h + att_out)); the family's, since ln2 and the residual are the block's.
  std::function<void(int64_t b, int64_t t, const float* att_out, float* x_ffn)> ffn_shift;
  Tensor* ffn_start = nullptr;  ///< out: [B, D] the channel-mix shift the call starts from (after state_input)
};

class RwkvMixer {
 public:
  RwkvMixer() = default;
  explicit RwkvMixer(const RwkvMixerDims& dims) : d_(dims) {}
  /// One layer's weights under `p` ("rwkv.blocks.3.attention."); output scaled by `out_scale`.
  RwkvMixerWeights load(const io::WeightStore& w, const std::string& p, float out_scale) const;
  void values(int i, int64_t B, int64_t T, std::vector<ValueInfo>& v) const;
  /// One call on ln1's output [B,T,D]; returns what the block adds to the residual.
  Tensor forward(const RwkvMixerWeights& lw, const Tensor& n_in, const Batch& in, const RwkvMixerCall& call) const;
  const RwkvMixerDims& dims() const { return d_; }
  /// WriteError when a written state (`rows` [nrows, row_numel], `what` names the value) has a
  /// negative den: den is a sum of positive weights exp(...) (max-shifted), and a negative one
  /// turns wkv's weighted average into a ratio that can cross zero (transformers' state[3] >= 0).
  void check_state_write(const float* rows, int64_t nrows, int layer, const char* what) const;

 private:
  RwkvMixerDims d_;
};

// ---- Token mixing (issue 26; docs/values.md "Token mixing"), mixers/rwkv_mixing.cpp ---------------
/// One call's WKV inputs over a batch, served layouts [B,T,A], and where each row starts.
struct RwkvMixArgs {
  int64_t B = 0, T = 0, A = 0;
  const float *k = nullptr, *v = nullptr, *w = nullptr;  ///< attention_keys, attention_values, decays
  const float* u = nullptr;       ///< [A] time_first (the bonus of a token's own write)
  const float* start = nullptr;   ///< [B, row_stride] the state the call starts from (num | den | max ...)
  int64_t row_stride = 0;
};
/// WKV is diagonal per channel, so MixBlock's "heads" are the A channels. With the call's own
/// denominator den_t = e^{m_in + W(f..t-1)} den_in + sum_{s<t} e^{k_s + W(s+1..t-1)} + e^{u + k_t}
/// (W(a..b) = sum of decays_r over r in [a, b], f = first[b]):
///   M[b,c,t,s] = e^{k_s + W(s+1..t-1)} / den_t (f <= s < t),  e^{u + k_t} / den_t (s = t),
///   Sin [B, channels, rows, 1] = e^{m_in + W(f..t-1)} / den_t, the factor on state_input's num,
/// so wkv_t = sum_s M[t,s] v_s + Sin num_in exactly; den_t does not depend on v (a linear map of v
/// given the keys and decays), computed in log space in double.
void rwkv_token_mixing(const RwkvMixArgs& a, const std::vector<int64_t>& first, const MixBlock& blk, float* M,
                       float* Sin);
/// out [B, channels, cols, 2]: token s's share of (num, den) after t in the frame of the served max
/// (e^{k_s + W(s+1..t) - max_t} (v_s, 1), max_t by the kernel's own float recurrence). From a fresh
/// state they sum to the served num and den; max is a stabiliser, not a sum, and is not split.
void rwkv_state_contributions(const RwkvMixArgs& a, const std::vector<int64_t>& first, int64_t t, const MixBlock& blk,
                              float* out);

}  // namespace mixlens::detail
