// Gated delta rule (gated DeltaNet: Qwen3.5, Qwen3-Next): the chunked UT-form algorithm for prompts
// and multi-token continuations, and the token recurrence for decode steps. Per value head,
// with q, k L2-normalised in the kernel (fp32, eps 1e-6 inside the sqrt) and q scaled by 1/sqrt(Dk):
//   S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,   o_t = S_t^T q_t
// with S laid out [Dk, Dv] (key side first). Reference: transformers torch_chunk_gated_delta_rule /
// torch_recurrent_gated_delta_rule (model-math.md §3.3.4-3.3.5).
// Kimi Delta Attention (GatedDeltaArgs::g_per_key) is the same rule with a forget gate per key
// channel: exp(g_t) becomes diag(exp(g_t[0..Dk))), decaying each key row of S by its own factor
// (transformers chunk_kimi_delta_attention / recurrent_kimi_delta_attention).
#pragma once
#include <cstdint>
#include <vector>

#include "hooks/mixing.h"

namespace mixlens::detail {

/// A batch of rows. Layouts are the served (values.md) ones, tokens first. q and k come one per
/// *value* head (already repeated from the key heads when HV > HK), as the kernel consumes them.
struct GatedDeltaArgs {
  int64_t B = 0, T = 0, H = 0, Dk = 0, Dv = 0;
  const float* q = nullptr;     ///< [B,T,H,Dk] attention_queries (before the in-kernel L2 norm)
  const float* k = nullptr;     ///< [B,T,H,Dk] attention_keys (before the in-kernel L2 norm)
  const float* v = nullptr;     ///< [B,T,H,Dv] attention_values
  const float* g = nullptr;     ///< [B,T,H]    decays (log of the per-token state decay, <= 0);
                                ///< [B,T,H,Dk] with g_per_key
  bool g_per_key = false;       ///< one decay per key channel (Kimi Delta Attention), else one per head
  const float* beta = nullptr;  ///< [B,T,H]    betas
  float* S = nullptr;           ///< [B,H,Dk,Dv] in: initial state, out: final state
  float* o = nullptr;           ///< [B,T,H,Dv] attention_head_outputs
  float* states = nullptr;      ///< [B,T,H,Dk,Dv] optional: state after every token
  /// [B,H,ceil((t_end - t_begin) / chunk),Dk,Dv] optional (chunked kernel only): the state entering
  /// each chunk, chunk c starting at t_begin + c * chunk (a gradient call keeps them: the backward's
  /// checkpoints, so it need not run this scan again).
  float* chunk_entry = nullptr;
  /// [B,H,chunk,Dk] / [B,H,chunk,Dv] optional (chunked kernel): the normalised keys and the deltas
  /// (V_new) of the call's last chunk, for gated_delta_state_at.
  float* last_kn = nullptr;
  float* last_delta = nullptr;
  int64_t chunk = 64;           ///< chunk size (transformers' default; the mixer does not pass one)
  int64_t t_begin = 0;          ///< scan tokens [t_begin, t_end) of each row, from S (a split scan)
  int64_t t_end = -1;           ///< -1: T
};

/// Token-by-token recurrence (the decode kernel; also usable for whole prompts).
void gated_delta_recurrent(const GatedDeltaArgs& a);
/// Chunked (UT transform) algorithm; BLAS for the chunk products, parallel over (batch, head).
/// `states`, when asked for, are replayed token by token from each chunk's entering state with the
/// chunk's deltas (S_t = exp(g_t) S_{t-1} + k_t delta_t^T, one rank-1 update each), the same
/// recurrence that gives each chunk's end state. Calls over consecutive whole chunks equal one call.
void gated_delta_chunked(const GatedDeltaArgs& a);
/// The state after token t [B,H,Dk,Dv] into `out`, where a.S is the state entering the chunk that
/// starts at a.t_begin and holds t, and a.last_kn / a.last_delta hold that chunk as the last
/// gated_delta_chunked call (over [a.t_begin, chunk end)) left them: the kernel's own arithmetic
/// for that chunk's states and end state, so the three agree bitwise (a read computed on the side).
void gated_delta_state_at(const GatedDeltaArgs& a, int64_t t, float* out);

// ---- Token mixing (issue 26; docs/values.md "token_mixing"), mixers/gated_delta_mixing.cpp ---------
/// The delta rule's exact mixing over the block `blk` of every row of `a` (a.B rows [T,H,...],
/// row b from its first real token `first[b]`), the key removal included:
///   M[b,h,t,s] = beta_s q_t^T A_t ... A_{s+1} k_s,  A_r = (I - beta_r k_r k_r^T) exp(g_r)
/// (q, k L2-normalised, q scaled by 1/sqrt(Dk), as the kernels; exp(g_r) = diag(exp(g_r[d])) with
/// g_per_key), so o_t = sum_s M[t,s] v_s + Sin[t]^T state_input, Sin[b,h,t] = (A_t ... A_first)^T q_t
/// ([B,heads,rows,Dk]). Computed chunk by chunk of a.chunk tokens in float64: the UT form inside a
/// chunk (its mixing P (I + A)^-1 beta, the entry state's query q e^G - P W), the chunk's transition
/// F = e^{G_L} - Kd^T W carrying the source keys of earlier chunks; never a T^2 loop of products.
void gated_delta_token_mixing(const GatedDeltaArgs& a, const std::vector<int64_t>& first, const MixBlock& blk,
                              float* M, float* Sin);
/// What each source token s in [blk.c0, blk.c1) wrote that survives in the state after token t:
/// out [B, heads, cols, Dk, Dv] = (A_t ... A_{s+1} beta_s k_s) v_s^T for first[b] <= s <= t, else 0;
/// their sum plus (A_t ... A_first) state_input is the state after t.
void gated_delta_state_contributions(const GatedDeltaArgs& a, const std::vector<int64_t>& first, int64_t t,
                                     const MixBlock& blk, float* out);

}  // namespace mixlens::detail
