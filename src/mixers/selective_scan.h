// Mamba-1 selective scan: per channel e and state index n,
//   S_t[e,n] = exp(A[e,n] dt_t[e]) S_{t-1}[e,n] + (dt_t[e] B_t[n]) u_t[e],
//   y_t[e]   = sum_n S_t[e,n] C_t[n] + D[e] u_t[e]
// (model-math.md §3.1 / §9.1; transformers mamba_selective_scan / mamba_selective_state_update).
// Two algorithms compute it: the token loop (also the decode step) and a chunked parallel scan.
#pragma once
#include <algorithm>
#include <bit>
#include <cstdint>
#include <vector>

#include "hooks/mixing.h"

namespace mixlens::detail {

// exp for the discretisation exp(A dt) (argument <= 0 here): Cephes' expf polynomial, within 2 ulp
// of std::exp on [-87.3, 88], 0 below. Branch-free so that loops over the state index vectorize;
// std::exp does not, and it is most of a Mamba-1 scan's time. exp(0) is exactly 1 (dt = 0 keeps
// the state bit for bit). Shared with the backward (grad/selective_scan_grad.cpp).
inline float fast_exp(float x) {
  const float xc = std::min(std::max(x, -87.33654f), 88.0f);
  const float n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round(x / ln 2)
  float r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float e_r = p * r * r + r + 1.0f;
  const float scale = std::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23);
  return x < -87.33654f ? 0.0f : e_r * scale;
}

/// One batch row. Layouts are the served (values.md) ones, tokens first.
struct SelectiveScanArgs {
  int64_t T = 0, E = 0, N = 0;
  const float* u = nullptr;   ///< [T,E]  attention_values (conv + SiLU output)
  const float* dt = nullptr;  ///< [T,E]  betas (softplus(dt_proj(...)))
  const float* B = nullptr;   ///< [T,groups,N]  attention_keys
  const float* C = nullptr;   ///< [T,groups,N]  attention_queries
  const float* A = nullptr;   ///< [E,N]  -exp(A_log)
  const float* D = nullptr;   ///< [E]
  float* S = nullptr;         ///< [E,N]  in: initial state, out: final state
  float* y = nullptr;         ///< [T,E]  attention_head_outputs (before the silu(z) gate)
  float* states = nullptr;    ///< [T,E,N] optional: the state after every token
  int64_t chunk = 64;         ///< tokens per chunk (chunked algorithm only)
  /// Channel groups with their own B and C (Zamba's Mamba heads: E / groups channels each); 1 for
  /// Mamba-1, whose B and C every channel shares.
  int64_t groups = 1;
};

/// Token t's B (or C) row [N] read by channel e: the row of e's group (a: the scan's or its
/// backward's arguments).
template <class Args>
inline const float* group_row(const float* X, const Args& a, int64_t t, int64_t e) {
  return X + (t * a.groups + e * a.groups / a.E) * a.N;
}
/// The parallel tasks' channel blocks: at most `block` channels each, never across a group, so a
/// block reads one B / C row per token. Block k is [e0, e1).
template <class Args>
inline int64_t channel_blocks(const Args& a, int64_t block) {
  const int64_t per = a.E / a.groups;
  return a.groups * ((per + block - 1) / block);
}
template <class Args>
inline void channel_block(const Args& a, int64_t block, int64_t k, int64_t& e0, int64_t& e1) {
  const int64_t per = a.E / a.groups, in_group = (per + block - 1) / block;
  const int64_t g = k / in_group;
  e0 = g * per + (k % in_group) * block;
  e1 = std::min((g + 1) * per, e0 + block);
}

/// Token-by-token recurrence, channels in parallel: the decode kernel, and the faster one for
/// prompts whenever there are enough channels to occupy the threads.
void selective_scan_recurrent(const SelectiveScanArgs& a);

/// Chunked parallel scan, parallel over chunks as well as channels: (1) every chunk scans from a
/// zero state, keeping its final state and its total decay; (2) the chunk-entry states are carried
/// across chunks; (3) each chunk adds the carried state's contribution,
/// C_t . (prod_{k<=t} exp(A dt_k)) S_enter, to y and to the per-token states.
void selective_scan_chunked(const SelectiveScanArgs& a);
/// The state after token upto - 1 [E,N] into `out`, tokens [0, upto) of one chunk of
/// selective_scan_chunked from a.S (the state entering that chunk, not changed): that kernel's
/// arithmetic for the chunk's per-token states and end state, so the three agree bitwise.
void selective_scan_state_at(const SelectiveScanArgs& a, int64_t upto, float* out);

// ---- Token mixing (issue 26; docs/values.md "Token mixing"), mixers/mamba_mixing.cpp --------------
/// One Mamba-1 call's scan inputs over a batch, served layouts [B,T,...] (what the scan read).
struct SelectiveMixArgs {
  int64_t B = 0, T = 0, E = 0, N = 0, groups = 1;  ///< groups: Zamba's Mamba heads (B / C per head)
  const float* u = nullptr;      ///< [B,T,E] attention_values
  const float* dt = nullptr;     ///< [B,T,E] betas
  const float* Bm = nullptr;     ///< [B,T,groups,N] attention_keys
  const float* C = nullptr;      ///< [B,T,groups,N] attention_queries
  const float* decay = nullptr;  ///< [B,T,E,N] decays (A dt, the exponent the scan takes)
  /// Blocks of the mixing's token grid (from each row's first token): across blocks the decay is
  /// factored through the block ends, so a T x T matrix costs T^2 N products and O(T N) exps.
  int64_t chunk = 32;
};
/// Mamba-1's mixing is per channel (A is [E,N]: every channel decays its own way), so the "heads"
/// of MixBlock are the E channels: M [B, channels, rows, cols] with
///   M[b,e,t,s] = dt_s[e] sum_n C_t[n] B_s[n] exp(sum_{r=s+1..t} decay_r[e,n])   (first[b] <= s <= t),
/// and Sin [B, channels, rows, N] = C_t[n] exp(sum_{r=first..t} decay_r[e,n]), so that
/// y_t[e] = sum_s M[e,t,s] u_s[e] + sum_n Sin[e,t,n] state_input[e,n] + D[e] u_t[e]. Double sums.
void mamba_token_mixing(const SelectiveMixArgs& a, const std::vector<int64_t>& first, const MixBlock& blk, float* M,
                        float* Sin);
/// out [B, channels, cols, N]: exp(sum_{r=s+1..t} decay_r[e,n]) dt_s[e] B_s[n] u_s[e] for
/// first[b] <= s <= t, else 0 (the state is linear in the writes: they sum to the state after t
/// from a zero start).
void mamba_state_contributions(const SelectiveMixArgs& a, const std::vector<int64_t>& first, int64_t t,
                               const MixBlock& blk, float* out);

}  // namespace mixlens::detail
