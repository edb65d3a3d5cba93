// Vector kernels of the SSM mixers (Mamba-1 scan, softplus, Mamba-2 per-token states), chosen at
// run time like ops/kernels.h: the AVX2 + FMA versions live in ssm_kernels_avx2.cpp (compiled with
// those flags only) and run when ops::isa() is avx2 or above; otherwise the portable loops run.
#pragma once
#include <cstdint>

#include "mixers/selective_scan.h"

namespace mixlens::detail {

/// y[i] = softplus(x[i] + bias[i]) (torch softplus, beta 1, threshold 20: x + bias > 20 gives
/// x + bias). In place allowed. Vector log1p within 3 ulp of std::log1p.
void softplus_bias(const float* x, const float* bias, float* y, int64_t n);

/// Whether the AVX2 Mamba-1 token loop can run `a` (the ISA level allows it and N % 8 == 0).
bool selective_scan_avx2_ok(const SelectiveScanArgs& a);

/// One head's state recurrence over L tokens of a chunk, cur_l = decay[l] * cur_{l-1} + B_l ⊗ xdt_l
/// (cur_{-1} = S0, [N,P]; two roundings, no FMA), in place from S0 = cur allowed; `out` (optional)
/// gets every token's state at stride ld_out. Mamba-2's SSD (B = keys [L, ldb], xdt = x dt) and the
/// gated delta rule (N = Dk, P = Dv, B = normed keys, xdt = the deltas) both run it, so a chunk end,
/// the `states` stack and a per-token read are one number each; a token with decay 1 and input 0
/// keeps the state bit for bit. `avx2`: ssd_states_replay_avx2 (same roundings).
/// `decay_per_n`: decay is [L, N], one factor per state row n (Kimi Delta Attention's per-key-channel
/// forget gate), else [L].
void states_replay(const float* S0, const float* decay, const float* B, int64_t ldb, const float* xdt, int64_t L,
                   int64_t N, int64_t P, float* cur, float* out, int64_t ld_out, bool avx2, bool decay_per_n = false);

#if defined(__x86_64__)
/// The token loop for channels [e0, e1) (selective_scan_recurrent's block), N % 8 == 0.
void selective_scan_block_avx2(const SelectiveScanArgs& a, int64_t e0, int64_t e1);
/// softplus_bias, AVX2.
void softplus_bias_avx2(const float* x, const float* bias, float* y, int64_t n);
/// One Mamba-2 head's per-token states within a chunk, in the served layout [N,P] per token:
/// out_l = exp(da[l]) * out_{l-1} + B_l ⊗ xdt_l (out_{-1} = S0, [N,P]); `cur` [N*P] is scratch that
/// ends holding out_{L-1}. The outputs go out with streaming stores (they are not read back here);
/// `out` may be null (only the running state). No FMA anywhere (the scalar replay's roundings).
/// Also a gated-delta head's states (mixers/gated_delta.cpp): N = Dk, P = Dv, B = keys, xdt = deltas.
void ssd_states_replay_avx2(const float* S0, const float* da, const float* B, int64_t ldb, const float* xdt,
                            int64_t L, int64_t N, int64_t P, float* cur, float* out, int64_t ld_out, bool decay_per_n);
#endif

}  // namespace mixlens::detail
