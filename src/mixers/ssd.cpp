#include "mixers/ssd.h"

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "mixers/ssm_kernels.h"
#include "ops/kernels.h"
#include "ops/ops.h"

namespace mixlens::detail {

// ssm_kernels.h; the portable loop keeps the AVX2 kernel's two roundings (no FMA).
void states_replay(const float* S0, const float* decay, const float* B, int64_t ldb, const float* xdt, int64_t L,
                   int64_t N, int64_t P, float* cur, float* out, int64_t ld_out, bool avx2, bool decay_per_n) {
#if defined(__x86_64__)
  if (avx2) return ssd_states_replay_avx2(S0, decay, B, ldb, xdt, L, N, P, cur, out, ld_out, decay_per_n);
#endif
  (void)avx2;
  const float* prev = S0;
  for (int64_t l = 0; l < L; ++l) {
    const float* Bl = B + l * ldb;
    const float* xl = xdt + l * P;
    for (int64_t n = 0; n < N; ++n) {
      const float e = decay_per_n ? decay[l * N + n] : decay[l];
      const float bn = Bl[n];
      const float* pr = prev + n * P;
      float* c = cur + n * P;
      for (int64_t p = 0; p < P; ++p) c[p] = pr[p] * e + bn * xl[p];
    }
    if (out) std::copy(cur, cur + N * P, out + l * ld_out);
    prev = cur;
  }
}

namespace {

constexpr int64_t kTriRows = 64;  // row block of the intra-chunk product (ssd_chunked)

// Writes S [P,N] transposed into the served layout [N,P].
void store_state(const float* S, int64_t P, int64_t N, float* out) { ops::transpose(S, P, N, out); }

// Token t's log decay of head h: SsdArgs::da where given (lightning attention), else A dt.
inline float log_decay(const SsdArgs& a, int64_t t, int64_t h, float dt) { return a.da ? a.da[t * a.H + h] : a.A[h] * dt; }

// One token's update and read-out for one head; S is [P,N]; da the token's log decay.
inline void step_head(float* S, const float* x, const float* Bv, const float* Cv, float dt, float da,
                      float D, int64_t P, int64_t N, float* y) {
  const float dA = std::exp(da);
  for (int64_t p = 0; p < P; ++p) {
    float* Sp = S + p * N;
    const float xp = x[p];
    float acc = 0.0f;
    for (int64_t n = 0; n < N; ++n) {
      Sp[n] = Sp[n] * dA + (dt * Bv[n]) * xp;
      acc += Sp[n] * Cv[n];
    }
    if (y) y[p] = acc + xp * D;
  }
}


// The chunk end state in the chunk form, S = exp(Acum_last) S + sum_l exp(Acum_last - Acum_l) xdt_l ⊗ B_l
// (one product), S [P,N] in place; da = A dt of the chunk's L tokens, tmp [L,P] scratch. Acum is
// the running sum of da, as the kernel forms it.
void chunk_end(const float* da, const float* xdt, const float* Bc, int64_t ldbc, int64_t L, int64_t P, int64_t N,
               float* S, float* tmp) {
  float last = 0.0f;
  for (int64_t l = 0; l < L; ++l) last += da[l];
  float acc = 0.0f;
  for (int64_t l = 0; l < L; ++l) {
    acc += da[l];
    const float e = std::exp(last - acc);
    for (int64_t p = 0; p < P; ++p) tmp[l * P + p] = xdt[l * P + p] * e;
  }
  ops::gemm(true, false, P, N, L, 1.0f, tmp, P, Bc, ldbc, std::exp(last), S, N);
}

// Whether the chunk end comes from the token recurrence: when a token of the chunk has dt = 0 (the
// "skip token" write) or a log decay da of 0 (lightning attention's skip: decays and keys 0), so that
// token keeps the state bit for bit (exp(0) * S + 0); otherwise the one-product chunk form, which is
// faster (the per-token states of the chunk's other tokens are the recurrence's either way).
bool end_by_recurrence(const float* dt, int64_t ld, const float* da, int64_t L) {
  for (int64_t l = 0; l < L; ++l)
    if (dt[l * ld] == 0.0f || da[l] == 0.0f) return true;
  return false;
}

bool use_avx2() {
#if defined(__x86_64__)
  return ops::isa() != ops::Isa::scalar;
#else
  return false;
#endif
}

}  // namespace

void ssd_state_at(const SsdArgs& a, int64_t upto, int64_t chunk_len, float* served) {
  const int64_t H = a.H, P = a.P, N = a.N, heads_per_group = a.H / a.G;
  const bool avx2 = use_avx2();
  ops::parallel_for(H, [&](int64_t h) {
    const int64_t g = h / heads_per_group;
    std::vector<float> da(static_cast<size_t>(upto)), decay(static_cast<size_t>(upto)), xdt(static_cast<size_t>(upto * P));
    for (int64_t l = 0; l < upto; ++l) {  // as ssd_chunked forms them
      const float dt = a.dt[l * H + h];
      da[static_cast<size_t>(l)] = log_decay(a, l, h, dt);
      decay[static_cast<size_t>(l)] = std::exp(da[static_cast<size_t>(l)]);
      for (int64_t p = 0; p < P; ++p) xdt[static_cast<size_t>(l * P + p)] = a.x[l * H * P + h * P + p] * dt;
    }
    float* out = served + h * N * P;
    if (upto == chunk_len && !end_by_recurrence(a.dt + h, H, da.data(), chunk_len)) {  // the kernel's chunk end
      std::vector<float> S(a.S + h * P * N, a.S + (h + 1) * P * N), tmp(static_cast<size_t>(upto * P));
      chunk_end(da.data(), xdt.data(), a.B + g * N, a.G * N, upto, P, N, S.data(), tmp.data());
      store_state(S.data(), P, N, out);
      return;
    }
    store_state(a.S + h * P * N, P, N, out);
    states_replay(out, decay.data(), a.B + g * N, a.G * N, xdt.data(), upto, N, P, out, nullptr, 0, avx2);
  });
}

void ssd_recurrent(const SsdArgs& a) {
  const int64_t heads_per_group = a.H / a.G;
  ops::parallel_for(a.H, [&](int64_t h) {
    const int64_t g = h / heads_per_group;
    float* S = a.S + h * a.P * a.N;
    for (int64_t t = 0; t < a.T; ++t) {
      step_head(S, a.x + (t * a.H + h) * a.P, a.B + (t * a.G + g) * a.N, a.C + (t * a.G + g) * a.N,
                a.dt[t * a.H + h], log_decay(a, t, h, a.dt[t * a.H + h]), a.D[h], a.P, a.N, a.y + (t * a.H + h) * a.P);
      if (a.states) store_state(S, a.P, a.N, a.states + (t * a.H + h) * a.N * a.P);
    }
  });
}

void ssd_chunked(const SsdArgs& a) {
  const int64_t T = a.T, H = a.H, P = a.P, G = a.G, N = a.N;
  const int64_t Q = a.chunk < 1 ? 1 : a.chunk;
  const int64_t nchunks = (T + Q - 1) / Q;
  const int64_t heads_per_group = H / G;
  const int64_t ldx = H * P, ldbc = G * N;

  // CB[g][c] = C_c B_c^T (Qe x Qe, Qe = min(Q, T)): shared by every head of a group, so computed
  // once per group. A short prompt has one group and one chunk: split into row blocks (rows l of a
  // block need columns s <= l only) so the product does not run on one thread while the rest wait.
  const int64_t Qe = std::min(Q, T);
  // The split depends on the chunk size only (not on the thread count or the prompt length), so a
  // chunk's products are the same whatever ran with it.
  const int64_t rb = Q < 64 ? 1 : std::min<int64_t>(4, Q / 32);
  std::vector<float> CB(static_cast<size_t>(G * nchunks * Qe * Qe));
  ops::parallel_for(G * nchunks * rb, [&](int64_t job) {
    const int64_t gc = job / rb, blk = job % rb;
    const int64_t g = gc / nchunks, c = gc % nchunks;
    const int64_t t0 = c * Q, L = std::min(Q, T - t0);
    const int64_t r0 = L * blk / rb, r1 = L * (blk + 1) / rb;
    if (r1 <= r0) return;
    ops::gemm(false, true, r1 - r0, r1, N, 1.0f, a.C + (t0 + r0) * ldbc + g * N, ldbc, a.B + t0 * ldbc + g * N, ldbc,
              0.0f, CB.data() + gc * Qe * Qe + r0 * Qe, Qe);
  });

  const bool avx2 = use_avx2();
  ops::parallel_for(H, [&](int64_t h) {
    const int64_t g = h / heads_per_group;
    const float D = a.D[h];
    float* S = a.S + h * P * N;
    // Per-thread scratch sized by the longest chunk this call has (Qe, not Q: a 128-token prompt
    // with Q = 256 zeroed and touched 4x the M it uses), kept across heads and calls up to 4 MiB (a
    // huge configured chunk gets a buffer of its own, freed after the head), never zeroed: every
    // entry is written before it is read.
    constexpr size_t kKeepFloats = size_t{1} << 20;
    thread_local std::vector<float> kept;
    std::vector<float> own;
    const size_t need = static_cast<size_t>(3 * Qe + Qe * Qe + 2 * Qe * P + P * N + Qe);
    std::vector<float>& scratch = need <= kKeepFloats ? kept : own;
    if (scratch.size() < need) scratch.resize(need);
    float* const acum = scratch.data();
    float* const da = acum + Qe;
    float* const segs = da + Qe;
    float* const M = segs + Qe;
    float* const xdt = M + Qe * Qe;
    float* const tmp = xdt + Qe * P;
    float* const Sr = tmp + Qe * P;
    float* const decay = Sr + P * N;
    for (int64_t c = 0; c < nchunks; ++c) {
      const int64_t t0 = c * Q, L = std::min(Q, T - t0);
      const float* xc = a.x + t0 * ldx + h * P;
      const float* Bc = a.B + t0 * ldbc + g * N;
      const float* Cc = a.C + t0 * ldbc + g * N;
      float* yc = a.y + t0 * ldx + h * P;
      float run = 0.0f;
      for (int64_t l = 0; l < L; ++l) {
        const float dt = a.dt[(t0 + l) * H + h];
        da[l] = log_decay(a, t0 + l, h, dt);
        run += da[l];
        acum[l] = run;
        for (int64_t p = 0; p < P; ++p) xdt[l * P + p] = xc[l * ldx + p] * dt;
      }
      // M[l,s] = (C_l . B_s) exp(sum_{k=s+1..l} a_k) for s <= l; the segment sums are accumulated
      // in increasing k as transformers' segment_sum does (no cumsum differences). Built row by row:
      // segs[s] (s < l) holds the sum up to row l, so each row is one contiguous add, exp and
      // product (the column-wise build was a serial add chain and strided stores).
      const float* cb = CB.data() + (g * nchunks + c) * Qe * Qe;
      for (int64_t l = 0; l < L; ++l) {
        float* Ml = M + l * Qe;
        const float* cbl = cb + l * Qe;
        const float al = da[l];
        for (int64_t s = 0; s < l; ++s) segs[s] += al;
        ops::exp(segs, Ml, l);
        for (int64_t s = 0; s < l; ++s) Ml[s] *= cbl[s];
        Ml[l] = cbl[l];
        std::fill(Ml + l + 1, Ml + L, 0.0f);
        segs[l] = 0.0f;
      }
      // Intra-chunk: y_c = M xdt, written straight into the head's columns of y. M is lower
      // triangular: rows [r0, r1) take columns [0, r1) only (a 128-token chunk: 3/4 of the
      // products, 256 tokens: 5/8; the columns left out hold zeros).
      for (int64_t r0 = 0; r0 < L; r0 += kTriRows) {
        const int64_t r1 = std::min(L, r0 + kTriRows);
        ops::gemm(false, false, r1 - r0, P, r1, 1.0f, M + r0 * Qe, Qe, xdt, P, 0.0f, yc + r0 * ldx, ldx);
      }
      // Inter-chunk: y_c += exp(Acum_l) C_l S_enter (nothing to add from a zero state: a fresh
      // prompt's first chunk skips the product).
      const bool zero_state = std::all_of(S, S + P * N, [](float v) { return v == 0.0f; });
      if (!zero_state) ops::gemm(false, true, L, P, N, 1.0f, Cc, ldbc, S, N, 0.0f, tmp, P);
      for (int64_t l = 0; l < L; ++l) {
        const float e = std::exp(acum[l]);
        if (zero_state)
          for (int64_t p = 0; p < P; ++p) yc[l * ldx + p] += D * xc[l * ldx + p];
        else
          for (int64_t p = 0; p < P; ++p) yc[l * ldx + p] += e * tmp[l * P + p] + D * xc[l * ldx + p];
      }
      // Per-token states by the token recurrence from the chunk's entering state; the chunk end by
      // the chunk form, or by the recurrence when a token has dt = 0 (end_by_recurrence). The last
      // token's state is the chunk end itself, and ssd_state_at makes the same choice, so
      // states[:, t], state_after(t) and state_output are one number (values.md).
      const bool by_rec = end_by_recurrence(a.dt + t0 * H + h, H, da, L);
      float* st = a.states ? a.states + (t0 * H + h) * N * P : nullptr;
      if (a.states || by_rec) {
        store_state(S, P, N, Sr);
        for (int64_t l = 0; l < L; ++l) decay[l] = std::exp(da[l]);
        states_replay(Sr, decay, Bc, ldbc, xdt, by_rec ? L : L - 1, N, P, Sr, st, H * N * P, avx2);
      }
      if (by_rec) {
        ops::transpose(Sr, N, P, S);
      } else {
        chunk_end(da, xdt, Bc, ldbc, L, P, N, S, tmp);
        if (st) store_state(S, P, N, st + (L - 1) * H * N * P);
      }
    }
  });
}

void ssd_serve_state(const float* S, int64_t heads, int64_t P, int64_t N, float* served) {
  for (int64_t bh = 0; bh < heads; ++bh) ops::transpose(S + bh * P * N, P, N, served + bh * N * P);
}

void ssd_store_state(const float* served, int64_t heads, int64_t P, int64_t N, float* S) {
  for (int64_t bh = 0; bh < heads; ++bh) ops::transpose(served + bh * N * P, N, P, S + bh * P * N);
}

RowScan ssd_row_scan(const SsdBatch& sb, std::vector<int64_t> first) {
  const int64_t T = sb.T, H = sb.H, P = sb.P, N = sb.N, E = H * P;
  const auto args = [sb](int64_t b, int64_t t0, int64_t t1, float* S_row) {
    SsdArgs a;
    a.T = t1 - t0; a.H = sb.H; a.P = sb.P; a.G = sb.G; a.N = sb.N;
    a.x = sb.x + (b * sb.T + t0) * sb.H * sb.P;
    a.B = sb.Bm + (b * sb.T + t0) * sb.G * sb.N;
    a.C = sb.C + (b * sb.T + t0) * sb.G * sb.N;
    a.dt = sb.dt + (b * sb.T + t0) * sb.H;
    a.da = sb.da ? sb.da + (b * sb.T + t0) * sb.H : nullptr;
    a.A = sb.A;
    a.D = sb.D;
    a.S = S_row;
    a.chunk = sb.chunk;
    return a;
  };
  RowScan rs;
  rs.B = sb.B; rs.T = T; rs.row_numel = H * P * N; rs.S = sb.S; rs.y_row_numel = T * E;
  rs.first = std::move(first);
  rs.chunk = sb.chunked ? sb.chunk : 0;
  rs.run = [sb, args, E, H, P, N](int64_t b, int64_t t0, int64_t t1, float* S_row, float* y_scratch, float* states_row) {
    SsdArgs a = args(b, t0, t1, S_row);
    a.y = y_scratch ? y_scratch + t0 * E : sb.y + (b * sb.T + t0) * E;
    a.states = states_row ? states_row + t0 * H * N * P : nullptr;
    if (sb.chunked) ssd_chunked(a); else ssd_recurrent(a);
  };
  rs.serve = [H, P, N](const float* S_row, float* out) { ssd_serve_state(S_row, H, P, N, out); };
  rs.store = [H, P, N](const float* in_row, float* S_row) { ssd_store_state(in_row, H, P, N, S_row); };
  rs.state_at = [sb, args, T](int64_t b, int64_t ck, const float* S_ck, int64_t t, float* out) {
    const int64_t ce = std::min(ck + sb.chunk, T);
    ssd_state_at(args(b, ck, ce, const_cast<float*>(S_ck)), t - ck + 1, ce - ck, out);
  };
  for (int64_t b = 0; b < sb.B; ++b)
    std::fill(sb.y + b * T * E, sb.y + (b * T + std::min(rs.first[static_cast<size_t>(b)], T)) * E, 0.0f);
  return rs;
}

}  // namespace mixlens::detail
