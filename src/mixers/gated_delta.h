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

}  // namespace mixlens::detail
