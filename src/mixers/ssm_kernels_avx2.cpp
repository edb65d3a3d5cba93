// AVX2 + FMA kernels of the SSM mixers (declared in ssm_kernels.h). Compiled with those target
// flags (CMakeLists.txt) and called only when ops::isa() says the CPU has them; like
// ops/kernels_avx2.cpp it uses no library templates or inline functions that could be emitted
// here with AVX2 code and picked by the linker for other callers.
#if defined(__x86_64__)
// GCC 12's own intrinsic headers trip -Wmaybe-uninitialized (their __Y = __Y idiom).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>

#include <cstdint>

#include "mixers/ssm_kernels.h"
#include "ops/avx2_inline.h"

namespace mixlens::detail {

namespace {

using avx2::hsum;

// exp(x) for the discretisation exp(A dt) (x <= 0 there): the Cephes polynomial of fast_exp
// (selective_scan.h), 0 below -87.34 as fast_exp; NaN propagates (max/min keep x's NaN).
inline __m256 exp_ssm(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.33654f);
  __m256 n;
  const __m256 p = avx2::exp_core(_mm256_min_ps(_mm256_set1_ps(88.0f), _mm256_max_ps(lo, x)), n);
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 v = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
  return _mm256_andnot_ps(_mm256_cmp_ps(x, lo, _CMP_LT_OQ), v);
}

// log(x) for x >= 1 (finite): Cephes logf (mantissa in [sqrt(1/2), sqrt(2)), degree-8 polynomial).
inline __m256 log_ge1(__m256 x) {
  const __m256i xi = _mm256_castps_si256(x);
  __m256 e = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(xi, 23), _mm256_set1_epi32(126)));
  __m256 m = _mm256_castsi256_ps(
      _mm256_or_si256(_mm256_and_si256(xi, _mm256_set1_epi32(0x007fffff)), _mm256_set1_epi32(0x3f000000)));  // [0.5, 1)
  const __m256 small = _mm256_cmp_ps(m, _mm256_set1_ps(0.707106781186547524f), _CMP_LT_OQ);
  e = _mm256_sub_ps(e, _mm256_and_ps(small, _mm256_set1_ps(1.0f)));
  m = _mm256_sub_ps(_mm256_add_ps(m, _mm256_and_ps(small, m)), _mm256_set1_ps(1.0f));
  const __m256 z = _mm256_mul_ps(m, m);
  __m256 y = _mm256_set1_ps(7.0376836292e-2f);
  y = _mm256_fmadd_ps(y, m, _mm256_set1_ps(-1.1514610310e-1f));
  y = _mm256_fmadd_ps(y, m, _mm256_set1_ps(1.1676998740e-1f));
  y = _mm256_fmadd_ps(y, m, _mm256_set1_ps(-1.2420140846e-1f));
  y = _mm256_fmadd_ps(y, m, _mm256_set1_ps(1.4249322787e-1f));
  y = _mm256_fmadd_ps(y, m, _mm256_set1_ps(-1.6668057665e-1f));
  y = _mm256_fmadd_ps(y, m, _mm256_set1_ps(2.0000714765e-1f));
  y = _mm256_fmadd_ps(y, m, _mm256_set1_ps(-2.4999993993e-1f));
  y = _mm256_fmadd_ps(y, m, _mm256_set1_ps(3.3333331174e-1f));
  y = _mm256_mul_ps(_mm256_mul_ps(y, m), z);
  y = _mm256_fmadd_ps(e, _mm256_set1_ps(-2.12194440e-4f), y);
  y = _mm256_fnmadd_ps(_mm256_set1_ps(0.5f), z, y);
  return _mm256_fmadd_ps(e, _mm256_set1_ps(0.693359375f), _mm256_add_ps(m, y));
}

// The general exp (ops/kernels_avx2.cpp's exp8, without the gradual-underflow split: softplus
// only needs exp(v) for v <= 20, and exp(v) < 2^-126 adds nothing to 1 + exp(v)).
inline __m256 softplus8(__m256 v) {
  const __m256 ev = exp_ssm(v);  // v <= 20 where used; 0 below -87.34
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 u = _mm256_add_ps(one, ev);
  const __m256 d = _mm256_sub_ps(u, one);
  // log1p(y) = log(1 + y) * y / ((1 + y) - 1): exact rounding error compensation (Goldberg);
  // where 1 + y rounds to 1, log1p(y) = y.
  const __m256 lp = _mm256_mul_ps(log_ge1(u), _mm256_div_ps(ev, d));
  const __m256 tiny = _mm256_cmp_ps(d, _mm256_setzero_ps(), _CMP_EQ_OQ);
  const __m256 small = _mm256_blendv_ps(lp, ev, tiny);
  // torch's threshold: x > 20 returns x (a NaN input compares false and goes through exp: NaN).
  return _mm256_blendv_ps(small, v, _mm256_cmp_ps(v, _mm256_set1_ps(20.0f), _CMP_GT_OQ));
}

// [sum(v[0]), ..., sum(v[7])]: the horizontal sums of 8 vectors in one vector.
inline __m256 hsum8(const __m256* v) {
  const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}
// One token of one channel (transformers' order: S = exp(A dt) S + (dt B) u); returns the vector
// of the S . C partial sums.
template <int NV>
inline __m256 channel_step(const float* A, float* S, float* st, const __m256* Bv, const __m256* Cv, float dt, float u) {
  const __m256 dtv = _mm256_set1_ps(dt), uv = _mm256_set1_ps(u);
  __m256 acc = _mm256_setzero_ps();
  for (int v = 0; v < NV; ++v) {
    const __m256 dA = exp_ssm(_mm256_mul_ps(_mm256_loadu_ps(A + 8 * v), dtv));
    const __m256 dBu = _mm256_mul_ps(_mm256_mul_ps(dtv, Bv[v]), uv);
    const __m256 s = _mm256_fmadd_ps(dA, _mm256_loadu_ps(S + 8 * v), dBu);
    _mm256_storeu_ps(S + 8 * v, s);
    if (st) _mm256_storeu_ps(st + 8 * v, s);
    acc = _mm256_fmadd_ps(s, Cv[v], acc);
  }
  return acc;
}

// The token loop over channels [e0, e1), N = 8 * NV. Eight channels at a time so that their eight
// dot products reduce in one hsum8.
template <int NV>
void scan_block(const SelectiveScanArgs& a, int64_t e0, int64_t e1) {
  const int64_t T = a.T, E = a.E, N = 8 * NV;
  __m256 Bv[NV], Cv[NV], acc[8];
  for (int64_t t = 0; t < T; ++t) {
    const float* Bt = group_row(a.B, a, t, e0);  // the block lies in one group
    const float* Ct = group_row(a.C, a, t, e0);
    for (int v = 0; v < NV; ++v) Bv[v] = _mm256_loadu_ps(Bt + 8 * v), Cv[v] = _mm256_loadu_ps(Ct + 8 * v);
    const float* dtt = a.dt + t * E;
    const float* ut = a.u + t * E;
    float* yt = a.y + t * E;
    float* stt = a.states ? a.states + t * E * N : nullptr;
    int64_t e = e0;
    for (; e + 8 <= e1; e += 8) {
      for (int j = 0; j < 8; ++j) {
        const int64_t c = e + j;
        acc[j] = channel_step<NV>(a.A + c * N, a.S + c * N, stt ? stt + c * N : nullptr, Bv, Cv, dtt[c], ut[c]);
      }
      // y = S . C + u D (the D skip added after the dot, as transformers).
      _mm256_storeu_ps(yt + e, _mm256_fmadd_ps(_mm256_loadu_ps(ut + e), _mm256_loadu_ps(a.D + e), hsum8(acc)));
    }
    for (; e < e1; ++e) {
      const __m256 s = channel_step<NV>(a.A + e * N, a.S + e * N, stt ? stt + e * N : nullptr, Bv, Cv, dtt[e], ut[e]);
      yt[e] = __builtin_fmaf(ut[e], a.D[e], hsum(s));
    }
  }
}

}  // namespace

void selective_scan_block_avx2(const SelectiveScanArgs& a, int64_t e0, int64_t e1) {
  switch (a.N) {
    case 8: scan_block<1>(a, e0, e1); break;
    case 16: scan_block<2>(a, e0, e1); break;
    case 32: scan_block<4>(a, e0, e1); break;
    case 64: scan_block<8>(a, e0, e1); break;
    default: break;  // selective_scan_avx2_ok admits N in {8, 16, 32, 64} only
  }
}

void softplus_bias_avx2(const float* x, const float* bias, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(y + i, softplus8(_mm256_add_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(bias + i))));
  if (i < n) {
    float xb[8] = {0, 0, 0, 0, 0, 0, 0, 0}, yb[8];
    for (int64_t j = i; j < n; ++j) xb[j - i] = x[j] + bias[j];
    _mm256_storeu_ps(yb, softplus8(_mm256_loadu_ps(xb)));
    for (int64_t j = i; j < n; ++j) y[j] = yb[j - i];
  }
}

void ssd_states_replay_avx2(const float* S0, const float* decay, const float* B, int64_t ldb, const float* xdt,
                            int64_t L, int64_t N, int64_t P, float* cur, float* out, int64_t ld_out, bool decay_per_n) {
  const bool p8 = P % 8 == 0;
  const float* prev = S0;
  for (int64_t l = 0; l < L; ++l) {
    const __m256 ev_token = _mm256_set1_ps(decay[decay_per_n ? 0 : l]);
    const float* Bl = B + l * ldb;
    const float* xl = xdt + l * P;
    float* o = out ? out + l * ld_out : nullptr;
    const bool aligned = o && (reinterpret_cast<uintptr_t>(o) & 31u) == 0 && p8;
    for (int64_t n = 0; n < N; ++n) {
      const __m256 ev = decay_per_n ? _mm256_set1_ps(decay[l * N + n]) : ev_token;
      const __m256 bn = _mm256_set1_ps(Bl[n]);
      const float* pr = prev + n * P;
      float* c = cur + n * P;
      float* on = o ? o + n * P : nullptr;
      int64_t p = 0;
      for (; p + 8 <= P; p += 8) {
        // prev * e + B_n x_p, as the scalar replay (two roundings, no FMA: same values as before).
        const __m256 v = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(pr + p), ev), _mm256_mul_ps(bn, _mm256_loadu_ps(xl + p)));
        _mm256_storeu_ps(c + p, v);
        if (!on) continue;
        if (aligned) _mm256_stream_ps(on + p, v); else _mm256_storeu_ps(on + p, v);
      }
      if (p < P) {  // the tail through the same vector ops (a scalar a * b + c here may be contracted to an FMA)
        float pb[8] = {}, xb[8] = {}, vb[8];
        for (int64_t j = p; j < P; ++j) pb[j - p] = pr[j], xb[j - p] = xl[j];
        _mm256_storeu_ps(vb, _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(pb), ev), _mm256_mul_ps(bn, _mm256_loadu_ps(xb))));
        for (int64_t j = p; j < P; ++j) c[j] = vb[j - p];
        if (on)
          for (int64_t j = p; j < P; ++j) on[j] = vb[j - p];
      }
    }
    prev = cur;
  }
  _mm_sfence();
}

}  // namespace mixlens::detail
#endif  // __x86_64__
