// Exact token-to-token mixing of a recurrent mixer (issue 26 item 1; docs/values.md "token_mixing"),
// by block: the rows, columns and heads asked for, so a 4k-token prompt never holds [B,H,T,T] of
// every head at once. The trace value layers.{i}.linear_attn.token_mixing is the whole block of one
// call; these functions run a fresh prompt and compute only the block asked for.
#pragma once
#include <cstdint>
#include <limits>
#include <string>

#include "mixlens/model.h"
#include "mixlens/tensor.h"

namespace mixlens {

/// Half-open index range [begin, end) along one axis, as a Python slice of step 1: negative begin /
/// end count from the end; end = kSpanEnd (the default) is the axis' length.
inline constexpr int64_t kSpanEnd = std::numeric_limits<int64_t>::max();
struct Span {
  int64_t begin = 0;
  int64_t end = kSpanEnd;
};

/// Which block of layer `layer`'s mixing: query tokens (rows), source tokens (cols), heads.
struct MixingQuery {
  int layer = 0;
  Span rows, cols, heads;
};

/// token_mixing()'s result for one fresh prompt batch (no cached state: the state_input term is 0).
struct TokenMixing {
  /// [B, heads, rows, cols] float32: attention_head_outputs[b, t, h] = sum_s mixing[b, h, t, s]
  /// attention_values[b, s, h] + skip[b, t, h] (over every s; columns outside `cols` are the rest).
  Tensor mixing;
  /// [B, rows, heads, P] float32: the head outputs' term that no earlier token mixes in: Mamba-2's
  /// D x_t; zeros for lightning attention and gated DeltaNet (no skip).
  Tensor skip;
  std::string skip_meaning;  ///< "D x" / "none"
};

/// The block `q` of the mixing matrix of `q.layer` over the left-padded `batch` run from a fresh
/// cache (the same numbers the token_mixing value gives, rows / cols / heads sliced). Per kind
/// (docs/values.md): Mamba-2 SSD (Mamba-2, the Mamba-2 hybrids, MiniMax's lightning attention)
///   M[t,s] = (C_t . B_s) exp(sum_{r=s+1..t} A dt_r) dt_s  (Dao & Gu 2024, SSD's L o C B^T with dt),
/// gated DeltaNet (Qwen3.5 / Qwen3-Next / OLMo-Hybrid, Kimi Delta Attention)
///   M[t,s] = beta_s q_t^T A_t ... A_{s+1} k_s,  A_r = (I - beta_r k_r k_r^T) exp(g_r)
/// (q, k L2-normalised, q scaled by 1/sqrt(Dk), as transformers' torch_chunk_gated_delta_rule);
/// per channel ("heads" = channels, values [B,T,channels]): Mamba-1, the RG-LRU, LFM2's short conv
/// and RWKV-4 (given its denominator); per head: xLSTM's mLSTM (given its denominator). The skip
/// (D x, D u, C * conv_bias) is `skip`. Errors: InputError (layer or range out of range, an empty
/// batch), UnsupportedError (a block without a recurrent mixer: support() says why).
TokenMixing token_mixing(const Model& model, const Batch& batch, const MixingQuery& q);

/// state_after(t) of layer `q.layer` split by source token: [B, heads, cols, *state] float32 (the
/// served state layout, key side first), entry s = what token s wrote that survives to t (0 for
/// s > t and padding). Over a fresh prompt the sum over every s equals state_after(t) (the
/// `states` value at t). Where the state is not a sum of writes, the part that is: RG-LRU
/// [B, channels, cols] (h only), RWKV-4 [B, channels, cols, 2] (num, den in the served max's frame),
/// mLSTM [B, heads, cols, Dqk, Dv + 1] (C | n with m given); docs/values.md "Token mixing".
/// `q.rows` is ignored; `t` may be negative (from the end).
/// Errors as token_mixing().
Tensor state_contributions(const Model& model, const Batch& batch, const MixingQuery& q, int64_t t);

}  // namespace mixlens
