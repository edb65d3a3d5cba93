// Mamba-2 state-space duality (SSD) scan: the chunked algorithm for prompts and continuations,
// and the token recurrence for decode steps. Both compute, per head h (group g = h / (H/G)):
//   S_t = exp(A_h dt_t) S_{t-1} + (dt_t x_t) ⊗ B_t,   y_t = S_t C_t + D_h x_t
// (model-math.md §3.2 / §9.3; transformers mamba2_chunk_scan / mamba2_selective_state_update).
#pragma once
#include <cstdint>

namespace mixlens::detail {

/// One batch row. Layouts are the served (values.md) ones, tokens first.
struct SsdArgs {
  int64_t T = 0, H = 0, P = 0, G = 0, N = 0;
  const float* x = nullptr;   ///< [T,H,P]  attention_values
  const float* B = nullptr;   ///< [T,G,N]  attention_keys
  const float* C = nullptr;   ///< [T,G,N]  attention_queries
  const float* dt = nullptr;  ///< [T,H]    betas
  const float* A = nullptr;   ///< [H]      -exp(A_log)
  const float* D = nullptr;   ///< [H]
  float* S = nullptr;         ///< [H,P,N]  in: initial state, out: final state (kernel layout)
  float* y = nullptr;         ///< [T,H,P]  attention_head_outputs
  float* states = nullptr;    ///< [T,H,N,P] optional: state after every token (served layout)
  int64_t chunk = 256;        ///< chunk size Q (chunked kernel only)
};

/// Token-by-token recurrence (the decode kernel; also usable for whole prompts).
void ssd_recurrent(const SsdArgs& a);
/// Chunked SSD: intra-chunk quadratic form + inter-chunk state passing, BLAS for the products.
/// `states`, when asked for, are replayed from each chunk's entering state directly in the served
/// layout (vectorised over head_dim, no per-token transposes); the last token's is the chunk end state
/// (one product, or the token recurrence when a token of the chunk has dt = 0, so a skipped token
/// keeps the state exactly). Calls over consecutive whole chunks equal one call, bit for bit.
void ssd_chunked(const SsdArgs& a);
/// The state after token upto - 1 of `a` (tokens [0, upto) of a chunk of `chunk_len` tokens, from
/// a.S = the state entering that chunk, kernel layout, not changed), served layout [H,N,P] into
/// `served`: the same arithmetic ssd_chunked uses for that chunk's per-token states and end state,
/// so the three agree bitwise (a per-token read computed on the side, without splitting the scan).
void ssd_state_at(const SsdArgs& a, int64_t upto, int64_t chunk_len, float* served);

}  // namespace mixlens::detail
