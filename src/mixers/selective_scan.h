// Mamba-1 selective scan: per channel e and state index n,
//   S_t[e,n] = exp(A[e,n] dt_t[e]) S_{t-1}[e,n] + (dt_t[e] B_t[n]) u_t[e],
//   y_t[e]   = sum_n S_t[e,n] C_t[n] + D[e] u_t[e]
// (model-math.md §3.1 / §9.1; transformers mamba_selective_scan / mamba_selective_state_update).
// Two algorithms compute it: the token loop (also the decode step) and a chunked parallel scan.
#pragma once
#include <cstdint>

namespace mixlens::detail {

/// One batch row. Layouts are the served (values.md) ones, tokens first.
struct SelectiveScanArgs {
  int64_t T = 0, E = 0, N = 0;
  const float* u = nullptr;   ///< [T,E]  attention_values (conv + SiLU output)
  const float* dt = nullptr;  ///< [T,E]  betas (softplus(dt_proj(...)))
  const float* B = nullptr;   ///< [T,N]  attention_keys
  const float* C = nullptr;   ///< [T,N]  attention_queries
  const float* A = nullptr;   ///< [E,N]  -exp(A_log)
  const float* D = nullptr;   ///< [E]
  float* S = nullptr;         ///< [E,N]  in: initial state, out: final state
  float* y = nullptr;         ///< [T,E]  attention_head_outputs (before the silu(z) gate)
  float* states = nullptr;    ///< [T,E,N] optional: the state after every token
  int64_t chunk = 64;         ///< tokens per chunk (chunked algorithm only)
};

/// Token-by-token recurrence, channels in parallel: the decode kernel, and the faster one for
/// prompts whenever there are enough channels to occupy the threads.
void selective_scan_recurrent(const SelectiveScanArgs& a);

/// Chunked parallel scan, parallel over chunks as well as channels: (1) every chunk scans from a
/// zero state, keeping its final state and its total decay; (2) the chunk-entry states are carried
/// across chunks; (3) each chunk adds the carried state's contribution,
/// C_t . (prod_{k<=t} exp(A dt_k)) S_enter, to y and to the per-token states.
void selective_scan_chunked(const SelectiveScanArgs& a);

}  // namespace mixlens::detail
