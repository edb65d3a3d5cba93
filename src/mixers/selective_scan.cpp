#include "mixers/selective_scan.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "mixers/ssm_kernels.h"
#include "ops/kernels.h"
#include "ops/ops.h"

namespace mixlens::detail {

namespace {

// Channels per parallel task: a block's states (kBlock x N floats) stay in L1 across tokens.
constexpr int64_t kBlock = 32;

// sum_n a[n] b[n] with 8 partial sums (vectorizes; a serial sum would dominate for N = 16).
inline float dot(const float* a, const float* b, int64_t N) {
  float lanes[8] = {};
  int64_t n = 0;
  for (; n + 8 <= N; n += 8)
    for (int64_t j = 0; j < 8; ++j) lanes[j] += a[n + j] * b[n + j];
  float acc = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
  for (; n < N; ++n) acc += a[n] * b[n];
  return acc;
}

// dA[n] = exp(A[n] dt) for one channel.
inline void discretize(const float* A, float dt, int64_t N, float* dA) {
  for (int64_t n = 0; n < N; ++n) dA[n] = fast_exp(A[n] * dt);
}

// One token for one channel, transformers' operation order: S = dA*S + (dt*B)*u.
inline void update(float* S, const float* dA, const float* Bt, float dt, float u, int64_t N) {
  for (int64_t n = 0; n < N; ++n) S[n] = dA[n] * S[n] + (dt * Bt[n]) * u;
}

// The token loop over channels [e0, e1). kN > 0 fixes the state size at compile time (the
// published Mamba-1 models all use 16), so the per-channel loops unroll into whole vectors.
// Per token, the block's exps come first in a pass of their own: they do not depend on the state,
// so the CPU overlaps them across channels instead of waiting on each channel's update chain.
template <int64_t kN>
void recurrent_block(const SelectiveScanArgs& a, int64_t e0, int64_t e1) {
  const int64_t T = a.T, E = a.E, N = kN > 0 ? kN : a.N;
  std::vector<float> dA(static_cast<size_t>((e1 - e0) * N));
  for (int64_t t = 0; t < T; ++t) {
    const float* Bt = group_row(a.B, a, t, e0);
    const float* Ct = group_row(a.C, a, t, e0);
    for (int64_t e = e0; e < e1; ++e) discretize(a.A + e * N, a.dt[t * E + e], N, dA.data() + (e - e0) * N);
    for (int64_t e = e0; e < e1; ++e) {
      const float dt = a.dt[t * E + e], u = a.u[t * E + e];
      float* S = a.S + e * N;
      update(S, dA.data() + (e - e0) * N, Bt, dt, u, N);
      a.y[t * E + e] = dot(S, Ct, N) + u * a.D[e];
      if (a.states) std::memcpy(a.states + (t * E + e) * N, S, sizeof(float) * static_cast<size_t>(N));
    }
  }
}

}  // namespace

bool selective_scan_avx2_ok(const SelectiveScanArgs& a) {
#if defined(__x86_64__)
  return ops::isa() != ops::Isa::scalar && (a.N == 8 || a.N == 16 || a.N == 32 || a.N == 64);
#else
  (void)a;
  return false;
#endif
}

void softplus_bias(const float* x, const float* bias, float* y, int64_t n) {
#if defined(__x86_64__)
  if (ops::isa() != ops::Isa::scalar) return softplus_bias_avx2(x, bias, y, n);
#endif
  for (int64_t i = 0; i < n; ++i) y[i] = ops::softplus(x[i] + bias[i]);
}

void selective_scan_recurrent(const SelectiveScanArgs& a) {
  const int64_t blocks = channel_blocks(a, kBlock);
  // The AVX2 loop runs the scalar one's math 8 lanes wide with FMA (its own rounding, within the
  // parity tolerances); it was ~10x faster on a Mamba-1 prompt's scan, most of its non-GEMM time.
  const bool avx2 = selective_scan_avx2_ok(a);
  (void)avx2;
  ops::parallel_for(blocks, [&](int64_t blk) {
    int64_t e0 = 0, e1 = 0;
    channel_block(a, kBlock, blk, e0, e1);
#if defined(__x86_64__)
    if (avx2) return selective_scan_block_avx2(a, e0, e1);
#endif
    if (a.N == 16) recurrent_block<16>(a, e0, e1); else recurrent_block<0>(a, e0, e1);
  });
}

void selective_scan_state_at(const SelectiveScanArgs& a, int64_t upto, float* out) {
  const int64_t E = a.E, N = a.N;
  const int64_t blocks = channel_blocks(a, kBlock);
  // selective_scan_chunked's arithmetic for one chunk: the scan from zero (pass 1) plus the carried
  // state's contribution (pass 3), per block of channels as there.
  ops::parallel_for(blocks, [&](int64_t blk) {
    int64_t e0 = 0, e1 = 0;
    channel_block(a, kBlock, blk, e0, e1);
    const float* S0 = a.S;
    const bool carried = std::any_of(S0 + e0 * N, S0 + e1 * N, [](float v) { return v != 0.0f; });
    std::vector<float> P(static_cast<size_t>((e1 - e0) * N), 1.0f), dA(static_cast<size_t>(N));
    float* loc = out + e0 * N;
    std::fill(loc, out + e1 * N, 0.0f);
    for (int64_t t = 0; t < upto; ++t)
      for (int64_t e = e0; e < e1; ++e) {
        const float dt = a.dt[t * E + e], u = a.u[t * E + e];
        discretize(a.A + e * N, dt, N, dA.data());
        update(out + e * N, dA.data(), group_row(a.B, a, t, e), dt, u, N);
        float* Pe = P.data() + (e - e0) * N;
        for (int64_t n = 0; n < N; ++n) Pe[n] *= dA[n];
      }
    if (carried)
      for (int64_t e = e0; e < e1; ++e)
        for (int64_t n = 0; n < N; ++n) {
          const float carry = P[static_cast<size_t>((e - e0) * N + n)] * S0[e * N + n];
          out[e * N + n] += carry;
        }
  });
}

void selective_scan_chunked(const SelectiveScanArgs& a) {
  const int64_t T = a.T, E = a.E, N = a.N;
  const int64_t Q = std::max<int64_t>(1, a.chunk);
  const int64_t chunks = (T + Q - 1) / Q;
  const int64_t blocks = channel_blocks(a, kBlock);
  const size_t per_chunk = static_cast<size_t>(E * N);
  // Per chunk: the final state of a scan from zero, the product of the chunk's decays, and (after
  // the carry) the true state entering the chunk.
  std::vector<float> local_end(static_cast<size_t>(chunks) * per_chunk), decay(local_end.size()),
      enter(local_end.size());

  // (1) Independent chunk scans from a zero state.
  ops::parallel_for(chunks * blocks, [&](int64_t job) {
    const int64_t c = job / blocks, blk = job % blocks;
    int64_t e0 = 0, e1 = 0;
    channel_block(a, kBlock, blk, e0, e1);
    const int64_t t0 = c * Q, t1 = std::min(T, t0 + Q);
    float* S = local_end.data() + c * per_chunk;
    float* P = decay.data() + c * per_chunk;
    std::fill(S + e0 * N, S + e1 * N, 0.0f);
    std::fill(P + e0 * N, P + e1 * N, 1.0f);
    std::vector<float> dA(static_cast<size_t>(N));
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t e = e0; e < e1; ++e) {
        const float dt = a.dt[t * E + e], u = a.u[t * E + e];
        discretize(a.A + e * N, dt, N, dA.data());
        update(S + e * N, dA.data(), group_row(a.B, a, t, e), dt, u, N);
        for (int64_t n = 0; n < N; ++n) P[e * N + n] *= dA[n];
        a.y[t * E + e] = dot(S + e * N, group_row(a.C, a, t, e), N);
        if (a.states) std::memcpy(a.states + (t * E + e) * N, S + e * N, sizeof(float) * static_cast<size_t>(N));
      }
  });

  // (2) Carry: enter[c+1] = decay[c] * enter[c] + local_end[c], from the initial state.
  ops::parallel_for(blocks, [&](int64_t blk) {
    int64_t e0 = 0, e1 = 0;
    channel_block(a, kBlock, blk, e0, e1);
    for (int64_t i = e0 * N; i < e1 * N; ++i) {
      float s = a.S[i];
      for (int64_t c = 0; c < chunks; ++c) {
        const size_t k = static_cast<size_t>(c) * per_chunk + static_cast<size_t>(i);
        enter[k] = s;
        s = decay[k] * s + local_end[k];
      }
      a.S[i] = s;
    }
  });

  // (3) Add what the entering state contributes inside each chunk, then the D skip.
  ops::parallel_for(chunks * blocks, [&](int64_t job) {
    const int64_t c = job / blocks, blk = job % blocks;
    int64_t e0 = 0, e1 = 0;
    channel_block(a, kBlock, blk, e0, e1);
    const int64_t t0 = c * Q, t1 = std::min(T, t0 + Q);
    const float* S0 = enter.data() + c * per_chunk;
    const bool carried = std::any_of(S0 + e0 * N, S0 + e1 * N, [](float v) { return v != 0.0f; });
    std::vector<float> P(static_cast<size_t>((e1 - e0) * N), 1.0f), dA(static_cast<size_t>(N)),
        carry(static_cast<size_t>(N));
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t e = e0; e < e1; ++e) {
        const float u = a.u[t * E + e];
        float& y = a.y[t * E + e];
        if (carried) {
          float* Pe = P.data() + (e - e0) * N;
          discretize(a.A + e * N, a.dt[t * E + e], N, dA.data());
          for (int64_t n = 0; n < N; ++n) {
            Pe[n] *= dA[n];
            carry[n] = Pe[n] * S0[e * N + n];
          }
          y += dot(carry.data(), group_row(a.C, a, t, e), N);
          if (a.states)
            for (int64_t n = 0; n < N; ++n) a.states[(t * E + e) * N + n] += carry[n];
        }
        y += u * a.D[e];
      }
  });
}

}  // namespace mixlens::detail
