// Backward of LFM2's gated short conv mixer (ShortConvMixer::forward, transformers Lfm2ShortConv):
// recomputed from the normed input with the recorded writes re-applied, then per row and channel
//   u_t = B_t x_t,  ext = window (K, constant of the call) ++ u (real tokens),
//   acc_t = bias + sum_k w_k ext[t+1+k],  o_t = C_t acc_t,  out = out_proj(o),
// differentiated through out_proj, C, the depthwise conv (its window's gradient is state_input's),
// B * x and in_proj.
#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

#include "grad/ops_grad.h"
#include "grad/qwen_grad.h"
#include "hooks/serve.h"
#include "ops/ops.h"

namespace mixlens::grad {

ShortConvMixerGrad::ShortConvMixerGrad(const detail::ShortConvMixer& mixer, const detail::ShortConvMixerWeights& w,
                                       int li, const Tensor& n, const detail::HybridCache& before, const Tape& tape)
    : w_(w), li_(li), tape_(tape), D_(mixer.hidden()), K_(mixer.width()) {
  const Batch& in = tape.batch;
  const int64_t B = in.batch, T = in.seq, BT = B * T, D = D_, K = K_;
  masked_ = T > 1 && in.has_padding();  // as QwenHybrid::forward passes it
  has_state_ = before.has_state;
  first_ = detail::first_real_tokens(in);
  const Tensor nm = detail::masked_input(n, in, masked_);
  Tensor proj = Tensor::uninitialized({BT, 3 * D});
  ops::linear(nm.data(), BT, D, w.in_proj, proj.data(), mixer.bias() ? w.in_bias.data() : nullptr);
  Bg_ = Tensor::uninitialized({B, T, D});
  Cg_ = Tensor::uninitialized({B, T, D});
  xg_ = Tensor::uninitialized({B, T, D});
  for (int64_t r = 0; r < BT; ++r) {
    const float* p = proj.data() + r * 3 * D;
    std::memcpy(Bg_.data() + r * D, p, sizeof(float) * static_cast<size_t>(D));
    std::memcpy(Cg_.data() + r * D, p + D, sizeof(float) * static_cast<size_t>(D));
    std::memcpy(xg_.data() + r * D, p + 2 * D, sizeof(float) * static_cast<size_t>(D));
  }
  tape.apply(li, Value::attention_queries, Cg_);
  tape.apply(li, Value::attention_keys, Bg_);
  tape.apply(li, Value::attention_values, xg_);
  // The cache's window [B,K,D] in the served layout [B,D,K] (where a state_input write applies).
  const Tensor& win = before.conv[static_cast<size_t>(li)];
  S0_ = Tensor({B, D, K});
  if (has_state_)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t k = 0; k < K; ++k)
        for (int64_t d = 0; d < D; ++d) S0_[(b * D + d) * K + k] = win[(b * K + k) * D + d];
  tape.apply(li, Value::state_input, S0_);
  acc_ = Tensor({B, T, D});
  Tensor o({B, T, D});  // padded tokens read nothing (0)
  std::vector<float> ext(static_cast<size_t>(K + T));
  for (int64_t b = 0; b < B; ++b) {
    const int64_t f = first_[static_cast<size_t>(b)];
    for (int64_t d = 0; d < D; ++d) {
      for (int64_t k = 0; k < K; ++k) ext[static_cast<size_t>(k)] = S0_[(b * D + d) * K + k];
      for (int64_t t = f; t < T; ++t) {
        const int64_t r = (b * T + t) * D + d;
        ext[static_cast<size_t>(K + t - f)] = Bg_[r] * xg_[r];
      }
      for (int64_t t = f; t < T; ++t) {
        const int64_t r = (b * T + t) * D + d;
        float a = mixer.bias() ? w.conv_bias[d] : 0.0f;
        for (int64_t k = 0; k < K; ++k) a += w.conv_wT[k * D + d] * ext[static_cast<size_t>(t - f + 1 + k)];
        acc_[r] = a;
        o[r] = Cg_[r] * a;
      }
    }
  }
  tape.apply(li, Value::attention_head_outputs, o);
  out_ = Tensor::uninitialized({B, T, D});
  ops::linear(o.data(), BT, D, w.out_proj, out_.data(), mixer.bias() ? w.out_bias.data() : nullptr);
  tape.apply(li, Value::attention_output, out_);
}

void ShortConvMixerGrad::backward(const Tensor& dout_in, Tensor& dn, GradSink& sink) const {
  const Batch& in = tape_.batch;
  const int li = li_;
  const int64_t B = in.batch, T = in.seq, BT = B * T, D = D_, K = K_;
  Tensor dout = dout_in.clone();
  sink.put(li, Value::attention_output, dout);
  tape_.block(li, Value::attention_output, dout);
  Tensor dO = Tensor::uninitialized({B, T, D});
  linear_backward(dout.data(), BT, D, w_.out_proj, dO.data(), false);
  sink.put(li, Value::attention_head_outputs, dO);
  tape_.block(li, Value::attention_head_outputs, dO);
  // o = C acc: dC = dO acc, dacc = dO C; the conv spreads dacc over the window and the call's u.
  Tensor dC({B, T, D}), dacc({B, T, D}), dB({B, T, D}), dx({B, T, D}), dS0({B, D, K});
  const bool want_states = sink.wants(li, Value::states);
  Tensor dstates;
  if (want_states) dstates = Tensor({B, T, D, K});
  std::vector<double> dext(static_cast<size_t>(K + T));
  std::vector<float> lam(static_cast<size_t>(K));
  for (int64_t b = 0; b < B; ++b) {
    const int64_t f = first_[static_cast<size_t>(b)];
    for (int64_t d = 0; d < D; ++d) {
      std::fill(dext.begin(), dext.end(), 0.0);
      for (int64_t t = f; t < T; ++t) {
        const int64_t r = (b * T + t) * D + d;
        dC[r] = dO[r] * acc_[r];
        dacc[r] = dO[r] * Cg_[r];
        for (int64_t k = 0; k < K; ++k) dext[static_cast<size_t>(t - f + 1 + k)] += static_cast<double>(w_.conv_wT[k * D + d]) * dacc[r];
      }
      for (int64_t k = 0; k < K; ++k) dS0[(b * D + d) * K + k] = static_cast<float>(dext[static_cast<size_t>(k)]);
      for (int64_t t = f; t < T; ++t) {
        const int64_t r = (b * T + t) * D + d;
        const float du = static_cast<float>(dext[static_cast<size_t>(K + t - f)]);
        dB[r] = du * xg_[r];
        dx[r] = du * Bg_[r];
      }
      if (!want_states) continue;
      // dL/dS_t of the window after token t (served [B,T,D,K]): what token t reads (w_k dacc_t) plus what
      // the next window keeps of it (S_{t+1}[k-1] = S_t[k]); padded tokens read nothing.
      std::fill(lam.begin(), lam.end(), 0.0f);
      for (int64_t t = T - 1; t >= 0; --t) {
        const float da = dacc[(b * T + t) * D + d];
        for (int64_t k = K - 1; k >= 0; --k)  // descending: lam[k - 1] is still token t + 1's
          lam[static_cast<size_t>(k)] = w_.conv_wT[k * D + d] * da + (k > 0 ? lam[static_cast<size_t>(k - 1)] : 0.0f);
        float* st = dstates.data() + ((b * T + t) * D + d) * K;
        for (int64_t k = 0; k < K; ++k) st[k] = lam[static_cast<size_t>(k)];
      }
    }
  }
  if (want_states) sink.put(li, Value::states, dstates);
  // state_output feeds only the next call: this call's metric does not depend on it.
  if (sink.wants(li, Value::state_output)) sink.put(li, Value::state_output, Tensor({B, D, K}));
  if (has_state_ || tape_.write(li, Value::state_input)) sink.put(li, Value::state_input, dS0);
  for (auto [v, t] : {std::pair<Value, Tensor*>{Value::attention_queries, &dC}, {Value::attention_keys, &dB},
                      {Value::attention_values, &dx}}) {
    sink.put(li, v, *t);
    tape_.block(li, v, *t);
  }
  Tensor dproj = Tensor::uninitialized({BT, 3 * D});
  for (int64_t r = 0; r < BT; ++r) {
    float* p = dproj.data() + r * 3 * D;
    std::memcpy(p, dB.data() + r * D, sizeof(float) * static_cast<size_t>(D));
    std::memcpy(p + D, dC.data() + r * D, sizeof(float) * static_cast<size_t>(D));
    std::memcpy(p + 2 * D, dx.data() + r * D, sizeof(float) * static_cast<size_t>(D));
  }
  linear_backward(dproj.data(), BT, 3 * D, w_.in_proj, dn.data(), false);
  if (masked_) detail::apply_row_mask(dn, in);
}

}  // namespace mixlens::grad
