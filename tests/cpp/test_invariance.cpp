// Batch-invariant numerics, the ops side (issue 23 item 2): a row's results from ops::linear and
// the attention kernel are bitwise the same alone, at any position of any batch, with any split of
// the outputs over threads and any left padding, at every ISA level this CPU runs.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "mixers/attention.h"
#include "mixlens/tensor.h"
#include "ops/dtype.h"
#include "ops/kernels.h"
#include "ops/ops.h"
#include "kernel_test_util.h"

using namespace mixlens;
using namespace mixlens::test_util;

namespace {

bool same_bits(const float* a, const float* b, int64_t n) { return std::memcmp(a, b, sizeof(float) * static_cast<size_t>(n)) == 0; }

// The weight of one test case in each dtype (narrow ones rounded from the float32 draw).
struct Weights {
  std::vector<float> f;
  std::vector<uint16_t> b, h;
  Tensor get(ScalarType t, int64_t out, int64_t in) const {
    if (t == ScalarType::float32) return Tensor::from({out, in}, f);
    const std::vector<uint16_t>& v = t == ScalarType::bfloat16 ? b : h;
    return Tensor::narrow({out, in}, t, v.data(), unowned(v.data()));
  }
};
Weights make_weights(int64_t out, int64_t in, uint32_t seed) {
  Weights w;
  w.f = randn(static_cast<size_t>(out * in), seed);
  w.b.resize(w.f.size());
  w.h.resize(w.f.size());
  for (size_t i = 0; i < w.f.size(); ++i) w.b[i] = ops::f32_to_bf16(w.f[i]), w.h[i] = ops::f32_to_f16(w.f[i]);
  return w;
}

}  // namespace

// The kernel itself: gemm_* over any row count, row offset and output split equals the matvec of
// the row, bitwise, for the odd sizes that exercise every tail (k blocks of 64 / 32 / 16 / 8, the
// masked or scalar rest, the bf16 deinterleave's < 32 rest).
TEST(Invariance, GemmKernelEqualsMatvecPerRow) {
  for (ops::Isa isa : levels()) {
    const ops::KernelTable& kt = *ops::kernels_for(isa);
    for (int64_t in : {1, 7, 16, 31, 33, 64, 100, 129, 773}) {
      const int64_t out = 37, ld = in + 5, maxrows = 9;
      std::vector<float> W = randn(static_cast<size_t>(out * ld), 11u + static_cast<uint32_t>(in));
      std::vector<uint16_t> Wb(W.size()), Wh(W.size());
      for (size_t i = 0; i < W.size(); ++i) Wb[i] = ops::f32_to_bf16(W[i]), Wh[i] = ops::f32_to_f16(W[i]);
      const int64_t ldx = in + 3;
      const std::vector<float> X = randn(static_cast<size_t>(maxrows * ldx), 5u + static_cast<uint32_t>(in));
      for (int dt = 0; dt < 3; ++dt) {
        // Reference: one matvec per row over every output.
        std::vector<float> ref(static_cast<size_t>(maxrows * out));
        for (int64_t r = 0; r < maxrows; ++r) {
          float* y = ref.data() + r * out;
          if (dt == 0) kt.matvec_f32(W.data(), ld, X.data() + r * ldx, y, out, in);
          if (dt == 1) kt.matvec_bf16(Wb.data(), ld, X.data() + r * ldx, y, out, in);
          if (dt == 2) kt.matvec_f16(Wh.data(), ld, X.data() + r * ldx, y, out, in);
        }
        for (int64_t rows = 1; rows <= maxrows; ++rows)
          for (int64_t r0 = 0; r0 + rows <= maxrows; r0 += 4)
            for (int64_t split : {out, int64_t{16}, int64_t{5}}) {
              const int64_t ldy = out + 2;
              std::vector<float> Y(static_cast<size_t>(rows * ldy), -7.0f);
              for (int64_t o0 = 0; o0 < out; o0 += split) {
                const int64_t n = std::min(split, out - o0);
                const float* x = X.data() + r0 * ldx;
                if (dt == 0) kt.gemm_f32(W.data() + o0 * ld, ld, x, ldx, rows, Y.data() + o0, ldy, n, in);
                if (dt == 1) kt.gemm_bf16(Wb.data() + o0 * ld, ld, x, ldx, rows, Y.data() + o0, ldy, n, in);
                if (dt == 2) kt.gemm_f16(Wh.data() + o0 * ld, ld, x, ldx, rows, Y.data() + o0, ldy, n, in);
              }
              for (int64_t r = 0; r < rows; ++r) {
                ASSERT_TRUE(same_bits(Y.data() + r * ldy, ref.data() + (r0 + r) * out, out))
                    << ops::isa_name(isa) << " dtype " << dt << " in " << in << " rows " << rows << " at " << r0
                    << " row " << r << " split " << split;
                ASSERT_EQ(Y[static_cast<size_t>(r * ldy + out)], -7.0f) << "wrote past the row";
              }
            }
      }
    }
  }
}

// ops::linear in deterministic mode: row r of a [rows] call equals the same row alone (the matvec
// path), for 1..9 rows, every position, the shapes that take the threaded split, every dtype.
TEST(Invariance, LinearRowAloneEqualsRowInBatch) {
  IsaGuard guard;
  ops::DeterministicScope det(true);
  for (ops::Isa isa : levels()) {
    ops::set_isa(isa);
    for (auto [out, in] : {std::pair<int64_t, int64_t>{3, 5}, {300, 129}, {1029, 257}, {96, 1031}}) {
      const Weights w = make_weights(out, in, 3);
      const std::vector<float> bias = randn(static_cast<size_t>(out), 9);
      const int64_t maxrows = 9;
      const std::vector<float> X = randn(static_cast<size_t>(maxrows * in), 4);
      for (ScalarType t : {ScalarType::float32, ScalarType::bfloat16, ScalarType::float16}) {
        const Tensor W = w.get(t, out, in);
        std::vector<float> alone(static_cast<size_t>(maxrows * out));
        for (int64_t r = 0; r < maxrows; ++r) ops::linear(X.data() + r * in, 1, in, W, alone.data() + r * out, bias.data());
        for (int64_t rows = 1; rows <= maxrows; ++rows)
          for (int64_t r0 = 0; r0 + rows <= maxrows; ++r0) {
            std::vector<float> Y(static_cast<size_t>(rows * out));
            ops::linear(X.data() + r0 * in, rows, in, W, Y.data(), bias.data());
            for (int64_t r = 0; r < rows; ++r)
              ASSERT_TRUE(same_bits(Y.data() + r * out, alone.data() + (r0 + r) * out, out))
                  << ops::isa_name(isa) << " " << dtype_str(t) << " [" << out << "," << in << "] rows " << rows
                  << " from " << r0 << ": row " << r << " differs from the row alone";
          }
        // A long batch (the prompt path's sizes): its row 0 equals row 0 alone.
        const int64_t big = 70;
        const std::vector<float> XB = randn(static_cast<size_t>(big * in), 8);
        std::vector<float> YB(static_cast<size_t>(big * out)), y0(static_cast<size_t>(out));
        ops::linear(XB.data(), big, in, W, YB.data());
        for (int64_t r : {int64_t{0}, int64_t{33}, big - 1}) {
          ops::linear(XB.data() + r * in, 1, in, W, y0.data());
          ASSERT_TRUE(same_bits(YB.data() + r * out, y0.data(), out)) << ops::isa_name(isa) << " " << dtype_str(t) << " row " << r;
        }
      }
    }
  }
}

// The flash attention: a row's outputs alone equal its outputs behind any left padding (the key
// tiles start at its first real key), for prompts longer than a key tile, and for decode steps
// over a cache.
TEST(Invariance, AttentionLeftPaddingChangesNothing) {
  IsaGuard guard;
  const int64_t H = 4, Hkv = 2, d = 24, T = 300;  // T > 2 key tiles of 128
  for (ops::Isa isa : levels()) {
    ops::set_isa(isa);
    const std::vector<float> q = randn(static_cast<size_t>(T * H * d), 1), k = randn(static_cast<size_t>(T * Hkv * d), 2),
                             v = randn(static_cast<size_t>(T * Hkv * d), 3);
    // Alone: one row of T real tokens.
    detail::KvCache kv1;
    kv1.append(k.data(), v.data(), 1, T, Hkv * d);
    std::vector<std::vector<uint8_t>> m1{std::vector<uint8_t>(static_cast<size_t>(T), 1)};
    std::vector<float> o1(static_cast<size_t>(T * H * d));
    detail::flash_causal_attention(q.data(), 1, T, H, Hkv, d, 0, kv1, m1, o1.data());
    for (int64_t pad : {1, 7, 100, 129}) {
      // Row 1 of a batch of 2: `pad` masked keys (garbage values) before the same T tokens.
      const int64_t Tp = T + pad;
      std::vector<float> qb(static_cast<size_t>(2 * Tp * H * d)), kb(static_cast<size_t>(2 * Tp * Hkv * d)),
          vb(kb.size());
      const std::vector<float> junk = randn(qb.size() + 2 * kb.size(), 77);
      std::copy(junk.begin(), junk.begin() + static_cast<long>(qb.size()), qb.begin());
      std::copy(junk.begin(), junk.begin() + static_cast<long>(kb.size()), kb.begin());
      std::copy(junk.begin() + 5, junk.begin() + 5 + static_cast<long>(vb.size()), vb.begin());
      std::copy(q.begin(), q.end(), qb.begin() + (Tp + pad) * H * d);
      std::copy(k.begin(), k.end(), kb.begin() + (Tp + pad) * Hkv * d);
      std::copy(v.begin(), v.end(), vb.begin() + (Tp + pad) * Hkv * d);
      detail::KvCache kv2;
      kv2.append(kb.data(), vb.data(), 2, Tp, Hkv * d);
      std::vector<std::vector<uint8_t>> m2{std::vector<uint8_t>(static_cast<size_t>(Tp), 1),
                                           std::vector<uint8_t>(static_cast<size_t>(Tp), 1)};
      std::fill(m2[1].begin(), m2[1].begin() + pad, 0);
      std::vector<float> o2(static_cast<size_t>(2 * Tp * H * d));
      detail::flash_causal_attention(qb.data(), 2, Tp, H, Hkv, d, 0, kv2, m2, o2.data());
      ASSERT_TRUE(same_bits(o2.data() + (Tp + pad) * H * d, o1.data(), T * H * d))
          << ops::isa_name(isa) << " prompt behind " << pad << " pads";
      // One decode step over each cache (the new token's key appended to both).
      const std::vector<float> qs = randn(static_cast<size_t>(H * d), 5), ks = randn(static_cast<size_t>(Hkv * d), 6),
                               vs = randn(static_cast<size_t>(Hkv * d), 7);
      detail::KvCache c1 = kv1, c2 = kv2;
      c1.append(ks.data(), vs.data(), 1, 1, Hkv * d);
      std::vector<float> ks2(static_cast<size_t>(2 * Hkv * d)), vs2(ks2.size()), qs2(static_cast<size_t>(2 * H * d));
      std::copy(ks.begin(), ks.end(), ks2.begin() + Hkv * d);
      std::copy(vs.begin(), vs.end(), vs2.begin() + Hkv * d);
      std::copy(qs.begin(), qs.end(), qs2.begin() + H * d);
      c2.append(ks2.data(), vs2.data(), 2, 1, Hkv * d);
      auto mm1 = m1, mm2 = m2;
      mm1[0].push_back(1);
      mm2[0].push_back(1), mm2[1].push_back(1);
      std::vector<float> s1(static_cast<size_t>(H * d)), s2(static_cast<size_t>(2 * H * d));
      detail::flash_causal_attention(qs.data(), 1, 1, H, Hkv, d, T, c1, mm1, s1.data());
      detail::flash_causal_attention(qs2.data(), 2, 1, H, Hkv, d, Tp, c2, mm2, s2.data());
      ASSERT_TRUE(same_bits(s2.data() + H * d, s1.data(), H * d)) << ops::isa_name(isa) << " decode behind " << pad << " pads";
    }
  }
}
