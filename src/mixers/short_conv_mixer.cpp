#include "mixers/short_conv_mixer.h"

#include <algorithm>
#include <cstring>

#include "hooks/mixing.h"
#include "hooks/serve.h"
#include "ops/ops.h"

namespace mixlens::detail {

void ShortConvMixer::load(const io::WeightStore& w, const std::string& m, ShortConvMixerWeights& l) const {
  l.in_proj = w.get_matmul(m + "in_proj.weight", {3 * D_, D_});
  l.conv_wT = transpose_conv(w.get(m + "conv.weight", {D_, 1, K_}));
  l.out_proj = w.get_matmul(m + "out_proj.weight", {D_, D_});
  if (bias_) {
    l.in_bias = w.get(m + "in_proj.bias", {3 * D_});
    l.conv_bias = w.get(m + "conv.bias", {D_});
    l.out_bias = w.get(m + "out_proj.bias", {D_});
  }
}

void ShortConvMixer::values(int i, int64_t B, int64_t T, std::vector<ValueInfo>& v) const {
  const int64_t D = D_, K = K_;
  v.push_back(layer_value(i, Value::attention_queries, {B, T, D}, true, "C (in_proj rows D..2D): the output gate that reads the conv"));
  v.push_back(layer_value(i, Value::attention_keys, {B, T, D}, true, "B (in_proj rows 0..D): the input gate, B * x enters the window"));
  v.push_back(layer_value(i, Value::attention_values, {B, T, D}, true, "x (in_proj rows 2D..3D): what B gates into the window"));
  v.push_back(layer_value(i, Value::state_input, {B, D, K}, true, "conv window the call starts from (the last L_cache values of B * x, oldest first); None on a fresh prompt"));
  auto s = layer_value(i, Value::states, {B, T, D, K}, false, "conv window after every token (computed only when asked)");
  s.writable = false;
  v.push_back(s);
  v.push_back(layer_value(i, Value::state_output, {B, D, K}, true, "conv window after the call's last token (goes to the cache)"));
  v.push_back(layer_value(i, Value::attention_head_outputs, {B, T, D}, true, "C * conv(B * x), before out_proj"));
  // Depthwise: the mixing's "heads" are the D channels; its state side the K window columns.
  add_mixing_values(i, B, T, D, K, bias_ ? "C * conv_bias" : "nothing (no conv bias)", v);
  v.push_back(layer_value(i, Value::attention_output, {B, T, D}, true, "out_proj(C * conv(B * x)), added to the residual"));
}

// Lfm2ShortConv.forward; the prompt path (causal_conv1d_fn over the cached window and the call) and
// the decode path (causal_conv1d_update) compute the same sums, here one token loop for both.
Tensor ShortConvMixer::forward(const ShortConvMixerWeights& l, const Tensor& n_in, const Batch& in, bool masked,
                               const ShortConvMixerCall& call) const {
  const int li = call.layer;
  Listener* ls = call.ls;
  const int64_t B = in.batch, T = in.seq, BT = B * T, D = D_, K = K_;
  const Tensor nm = masked_input(n_in, in, masked);
  const float* n = nm.data();
  Tensor proj = Tensor::uninitialized({BT, 3 * D});
  ops::linear(n, BT, D, l.in_proj, proj.data(), bias_ ? l.in_bias.data() : nullptr);
  // BCx.chunk(3) along channels: B, C, x in that order.
  Tensor Bg = Tensor::uninitialized({B, T, D}), Cg = Tensor::uninitialized({B, T, D}), xg = Tensor::uninitialized({B, T, D});
  for (int64_t r = 0; r < BT; ++r) {
    const float* p = proj.data() + r * 3 * D;
    std::memcpy(Bg.data() + r * D, p, sizeof(float) * static_cast<size_t>(D));
    std::memcpy(Cg.data() + r * D, p + D, sizeof(float) * static_cast<size_t>(D));
    std::memcpy(xg.data() + r * D, p + 2 * D, sizeof(float) * static_cast<size_t>(D));
  }
  // Served in the table's order (values()): a reader walking the values in order meets each in turn.
  visit_if(ls, li, Value::attention_queries, Cg);
  visit_if(ls, li, Value::attention_keys, Bg);
  visit_if(ls, li, Value::attention_values, xg);
  Tensor u = Tensor::uninitialized({B, T, D});  // B * x, the conv's input
  for (int64_t k = 0; k < BT * D; ++k) u[k] = Bg[k] * xg[k];

  // Kernel layout [K, D] per row <-> served [D, K] (transformers' conv_states row).
  const auto serve_row = [&](const float* S, float* out) {
    for (int64_t k = 0; k < K; ++k)
      for (int64_t d = 0; d < D; ++d) out[d * K + k] = S[k * D + d];
  };
  const auto store_row = [&](const float* s, float* S) {
    for (int64_t k = 0; k < K; ++k)
      for (int64_t d = 0; d < D; ++d) S[k * D + d] = s[d * K + k];
  };
  const auto serve_all = [&](const Tensor& S) {
    Tensor o = Tensor::uninitialized({B, D, K});
    for (int64_t b = 0; b < B; ++b) serve_row(S.data() + b * K * D, o.data() + b * K * D);
    return o;
  };
  const auto store_all = [&](const Tensor& o, Tensor& S) {
    for (int64_t b = 0; b < B; ++b) store_row(o.data() + b * K * D, S.data() + b * K * D);
  };
  Tensor& S = *call.conv;
  visit_state_input(li, S, call.has_state, ls, Shape{D, K}, serve_all, store_all);

  Tensor o({B, T, D});  // padded tokens read nothing (zeros, as C = 0 there in transformers)
  RowScan rs;
  rs.B = B; rs.T = T; rs.row_numel = K * D; rs.S = S.data(); rs.y_row_numel = T * D;
  rs.first = first_real_tokens(in);
  rs.chunk = 0;  // a token loop: the live window after t is the state after t
  rs.run = [&](int64_t b, int64_t t0, int64_t t1, float* Sr, float* y_scratch, float* states_row) {
    float* y = y_scratch ? y_scratch : o.data() + b * T * D;
    for (int64_t t = t0; t < t1; ++t) {
      std::memmove(Sr, Sr + D, sizeof(float) * static_cast<size_t>((K - 1) * D));  // shift the window
      std::memcpy(Sr + (K - 1) * D, u.data() + (b * T + t) * D, sizeof(float) * static_cast<size_t>(D));
      const float* c = Cg.data() + (b * T + t) * D;
      float* yt = y + t * D;
      for (int64_t d = 0; d < D; ++d) {
        float acc = bias_ ? l.conv_bias[d] : 0.0f;
        for (int64_t k = 0; k < K; ++k) acc += l.conv_wT[k * D + d] * Sr[k * D + d];
        yt[d] = c[d] * acc;
      }
      if (states_row) serve_row(Sr, states_row + t * K * D);
    }
  };
  rs.serve = serve_row;
  rs.store = store_row;
  Tensor states = scan_rows(ls, li, rs, {B, T, D, K});
  if (states.defined()) {
    ls->visit(li, Value::states, states, states.shape());
    ls->recycle_stack(std::move(states));
  }
  visit_state_output(li, S, ls, serve_all, store_all);
  visit_if(ls, li, Value::attention_head_outputs, o);
  visit_mixing(ls, li, B, T, D, K, [&](const MixBlock& blk, float* M, float* Sin) {
    ShortConvMixArgs ma;
    ma.B = B; ma.T = T; ma.D = D; ma.K = K;
    ma.Bg = Bg.data(); ma.Cg = Cg.data(); ma.x = xg.data(); ma.conv_wT = l.conv_wT.data();
    short_conv_token_mixing(ma, rs.first, blk, M, Sin);
  });
  Tensor out = Tensor::uninitialized({B, T, D});
  ops::linear(o.data(), BT, D, l.out_proj, out.data(), bias_ ? l.out_bias.data() : nullptr);
  visit_if(ls, li, Value::attention_output, out);
  return out;
}

}  // namespace mixlens::detail
