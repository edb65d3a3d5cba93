// Mamba-2 state-space duality (SSD) scan: the chunked algorithm for prompts and continuations,
// and the token recurrence for decode steps. Both compute, per head h (group g = h / (H/G)):
//   S_t = exp(A_h dt_t) S_{t-1} + (dt_t x_t) ⊗ B_t,   y_t = S_t C_t + D_h x_t
// (model-math.md §3.2 / §9.3; transformers mamba2_chunk_scan / mamba2_selective_state_update).
#pragma once
#include <cstdint>
#include <vector>

#include "hooks/listener.h"
#include "hooks/mixing.h"

namespace mixlens::detail {

/// One batch row. Layouts are the served (values.md) ones, tokens first.
struct SsdArgs {
  int64_t T = 0, H = 0, P = 0, G = 0, N = 0;
  const float* x = nullptr;   ///< [T,H,P]  attention_values
  const float* B = nullptr;   ///< [T,G,N]  attention_keys
  const float* C = nullptr;   ///< [T,G,N]  attention_queries
  const float* dt = nullptr;  ///< [T,H]    betas
  const float* A = nullptr;   ///< [H]      -exp(A_log)
  /// [T,H] optional: each token's log decay, used in place of A dt (dt still scales x). Lightning
  /// attention (mixers/lightning_mixer.h) runs this scan with dt = 1, D = 0 and da = its decays.
  const float* da = nullptr;
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

/// A [rows*H, P, N] kernel-layout state <-> the served layout [rows*H, N, P] (key side first), for
/// every head of `rows` rows: what state_input / state_output serve and a write lays back.
void ssd_serve_state(const float* S, int64_t heads, int64_t P, int64_t N, float* served);
void ssd_store_state(const float* served, int64_t heads, int64_t P, int64_t N, float* S);

/// One mixer call's scan inputs over a batch, [B,T,...] tokens first (SsdArgs per row).
struct SsdBatch {
  int64_t B = 0, T = 0, H = 0, P = 0, G = 0, N = 0, chunk = 256;
  bool chunked = true;  ///< ssd_chunked, else ssd_recurrent
  const float *x = nullptr, *Bm = nullptr, *C = nullptr, *dt = nullptr, *da = nullptr, *A = nullptr, *D = nullptr;
  float* S = nullptr;  ///< [B,H,P,N] kernel-layout state (the cache's)
  float* y = nullptr;  ///< [B,T,H,P] head outputs
};
/// The RowScan (hooks/listener.h) of that call from each row's first real token `first` (left
/// padding: the chunk grid is the row's own; the padded tokens' y are zeroed here): the Mamba-2 and
/// lightning mixers hand it to scan_rows, which serves the per-token states.
RowScan ssd_row_scan(const SsdBatch& sb, std::vector<int64_t> first);

// ---- Token mixing (issue 26; docs/values.md "token_mixing"), mixers/ssd_mixing.cpp ----------------
/// SSD's mixing matrix over the block `blk` of every row of `sb` (row b scanned from `first[b]`):
///   M[b,h,t,s] = (C_t . B_s) exp(sum_{r=s+1..t} da_r) dt_s   for first[b] <= s <= t, else 0,
/// da_r = SsdBatch::da or A dt_r (the kernel's log decay), so y_t = sum_s M[t,s] x_s + D x_t +
/// Sin[t] . state_input with Sin[b,h,t,n] = exp(sum_{r=first..t} da_r) C_t[n] ([B,heads,rows,N]; the
/// served state_input is [N,P]). Cumulative decays in double; `M` [B,heads,rows,cols] or null.
void ssd_token_mixing(const SsdBatch& sb, const std::vector<int64_t>& first, const MixBlock& blk, float* M, float* Sin);
/// What each source token s in [blk.c0, blk.c1) wrote that survives in the state after token t
/// (heads [blk.h0, blk.h1)): out [B, heads, cols, N, P] (served layout) = exp(sum_{r=s+1..t} da_r)
/// dt_s B_s x_s^T for first[b] <= s <= t, else 0. Their sum over s in [first, t] plus
/// exp(sum_{r=first..t} da_r) state_input is the state after t.
void ssd_state_contributions(const SsdBatch& sb, const std::vector<int64_t>& first, int64_t t, const MixBlock& blk,
                             float* out);

}  // namespace mixlens::detail
