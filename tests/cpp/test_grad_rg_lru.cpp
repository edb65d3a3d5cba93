// The RG-LRU mixer's backward (grad/rg_lru_mixer_grad.cpp) against central differences of its own
// forward (RgLruMixer::forward) on random weights: the normed input's gradient along random directions
// (through linear_x, the conv, both gates, the recurrence with its reset, the gelu_tanh(linear_y) gate
// and linear_out), on a fresh left-padded call and on a continuation from a state, whose state_input
// gradient is checked the same way. The whole model: test_grad_recurrent_gemma.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "grad/rg_lru_grad.h"
#include "grad_check.h"
#include "io/weights.h"
#include "ops/ops.h"

using namespace mixlens;
using namespace mixlens::grad_check;

namespace {

struct Setup {
  detail::RgLruMixerDims d{6, 8, 2, 3};  // D, W, H (bw 4), K
  detail::RgLruMixer mixer{d};
  detail::RgLruMixerWeights w;
  Setup() {
    const int64_t D = d.D, W = d.W, H = d.H, bw = W / H, K = d.K;
    w.linear_x = random_like({W, D}, 1, 0.5f), w.linear_y = random_like({W, D}, 2, 0.5f);
    w.linear_out = random_like({D, W}, 3, 0.5f);
    w.x_bias = random_like({W}, 4, 0.1f), w.y_bias = random_like({W}, 5, 0.1f), w.out_bias = random_like({D}, 6, 0.1f);
    w.conv_wT = detail::transpose_conv(random_like({W, 1, K}, 7, 0.5f)), w.conv_bias = random_like({W}, 8, 0.1f);
    const Tensor rp = random_like({W}, 9, 1.0f);
    w.log_a_scale = Tensor({W});
    for (int64_t c = 0; c < W; ++c) w.log_a_scale[c] = -8.0f * ops::softplus(rp[c]);
    w.in_gate_w = random_like({H, bw, bw}, 10, 0.5f), w.in_gate_b = random_like({H, bw}, 11, 0.1f);
    w.rec_gate_w = random_like({H, bw, bw}, 12, 0.5f), w.rec_gate_b = random_like({H, bw}, 13, 0.1f);
  }
  Tensor forward(const Tensor& n, const Batch& in, const Tensor& S0, bool has_state, const std::vector<int64_t>& pos) const {
    Tensor S = S0.clone();
    detail::RgLruMixerCall c;
    c.h = &S;
    c.has_state = has_state;
    c.pos = &pos;
    return mixer.forward(w, n, in, c);
  }
};

// padded: row 1 is left-padded by 2 (on a continuation its window, written or cached, reaches its first
// real tokens: the scan's window, not the padding's zeros).
void check(bool continuation, bool padded) {
  Setup s;
  const int64_t B = 2, T = 5, D = s.d.D, K = s.d.K, W = s.d.W;
  const Batch in = padded ? Batch::left_padded({{1, 2, 3, 4, 5}, {6, 7, 8}}, 0)
                          : Batch::left_padded({{1, 2, 3, 4, 5}, {6, 7, 8, 9, 10}}, 0);
  std::vector<int64_t> pos(static_cast<size_t>(B * T));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      const int64_t first = padded && b == 1 ? 2 : 0;
      pos[static_cast<size_t>(b * T + t)] = t < first ? 0 : continuation ? 4 + t - first : t - first;
    }
  const Tensor S0 = continuation ? random_like({B, K, W}, 20, 0.5f) : Tensor({B, K, W});
  const Tensor n = random_like({B, T, D}, 21), dout = random_like({B, T, D}, 22);
  grad::Tape tape;
  tape.batch = in;
  const grad::RgLruMixerGrad g(s.mixer, s.w, 0, n, grad::RgLruCallState{&S0, continuation, &pos}, tape);
  const Tensor fwd = s.forward(n, in, S0, continuation, pos);
  for (int64_t i = 0; i < fwd.numel(); ++i) EXPECT_NEAR(g.output()[i], fwd[i], 1e-5f) << "recompute = forward, " << i;
  grad::GradSink sink({Site{0, Value::state_input}});
  Tensor dn({B, T, D});
  g.backward(dout, dn, sink);
  const float h = 1e-2f;
  for (uint32_t k = 0; k < 3; ++k) {
    const Tensor v = random_like({B, T, D}, 30 + k);
    if (padded) {  // the padded row's padding inputs are zeroed: the direction there changes nothing
      for (int64_t t = 0; t < 2; ++t)
        for (int64_t i = 0; i < D; ++i) EXPECT_EQ(dn[(T + t) * D + i], 0.0f);
    }
    const double want = (dot(dout, s.forward(axpy(n, h, v), in, S0, continuation, pos)) -
                         dot(dout, s.forward(axpy(n, -h, v), in, S0, continuation, pos))) / (2.0 * h);
    EXPECT_NEAR(dot(dn, v), want, 2e-3 * (1.0 + std::fabs(want))) << (continuation ? "continuation" : "fresh") << " dn dir " << k;
  }
  if (continuation) {
    const Tensor& dS0 = sink.grads().at("layers.0.linear_attn.state_input");
    for (uint32_t k = 0; k < 3; ++k) {
      const Tensor v = random_like({B, K, W}, 40 + k);
      const double want = (dot(dout, s.forward(n, in, axpy(S0, h, v), true, pos)) -
                           dot(dout, s.forward(n, in, axpy(S0, -h, v), true, pos))) / (2.0 * h);
      EXPECT_NEAR(dot(dS0, v), want, 2e-3 * (1.0 + std::fabs(want))) << "state_input dir " << k;
    }
  }
}

}  // namespace

TEST(GradRgLru, FreshLeftPaddedCallMatchesFiniteDifferences) { check(false, true); }
TEST(GradRgLru, ContinuationAndStateInputMatchFiniteDifferences) { check(true, false); }
TEST(GradRgLru, LeftPaddedContinuationAndStateInputMatchFiniteDifferences) { check(true, true); }
