#include "mixers/rg_lru_mixer.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "hooks/mixing.h"
#include "hooks/serve.h"
#include "mixlens/errors.h"
#include "ops/ops.h"

namespace mixlens::detail {

namespace {

// u_t = bias + sum_j wT[j] * rows[j]: the depthwise conv over the K inputs ending at token t (rows[K-1]).
void conv_token(const float* const* rows, int64_t K, int64_t W, const float* wT, const float* bias, float* u) {
  for (int64_t c = 0; c < W; ++c) {
    float s = 0.0f;
    for (int64_t j = 0; j < K; ++j) s += wT[j * W + c] * rows[j][c];
    u[c] = s + bias[c];
  }
}

}  // namespace

RgLruMixerWeights RgLruMixer::load(const io::WeightStore& w, const std::string& p) const {
  const int64_t D = d_.D, W = d_.W, H = d_.H, bw = W / H, K = d_.K;
  RgLruMixerWeights l;
  l.linear_x = w.get_matmul(p + "linear_x.weight", {W, D});
  l.x_bias = w.get(p + "linear_x.bias", {W});
  l.linear_y = w.get_matmul(p + "linear_y.weight", {W, D});
  l.y_bias = w.get(p + "linear_y.bias", {W});
  l.linear_out = w.get_matmul(p + "linear_out.weight", {D, W});
  l.out_bias = w.get(p + "linear_out.bias", {D});
  l.conv_wT = transpose_conv(w.get(p + "conv_1d.weight", {W, 1, K}));
  l.conv_bias = w.get(p + "conv_1d.bias", {W});
  const Tensor rp = w.get(p + "rg_lru.recurrent_param", {W});
  l.log_a_scale = Tensor({W});
  for (int64_t c = 0; c < W; ++c) l.log_a_scale[c] = -8.0f * ops::softplus(rp[c]);
  l.in_gate_w = w.get(p + "rg_lru.input_gate_weight", {H, bw, bw});
  l.in_gate_b = w.get(p + "rg_lru.input_gate_bias", {H, bw});
  l.rec_gate_w = w.get(p + "rg_lru.recurrent_gate_weight", {H, bw, bw});
  l.rec_gate_b = w.get(p + "rg_lru.recurrent_gate_bias", {H, bw});
  return l;
}

void RgLruMixer::values(int i, int64_t B, int64_t T, std::vector<ValueInfo>& v) const {
  const int64_t W = d_.W, K = d_.K;
  const std::string layout = "[K, lru_width]: rows 0..K-2 the conv window (the last conv1d_width - 1 linear_x "
                             "outputs, oldest first), row K-1 the RG-LRU h";
  // Served first: the conv of the call's first K-1 tokens reads the window a write leaves.
  v.push_back(layer_value(i, Value::state_input, {B, K, W}, true, "state the call starts from " + layout + "; None on a fresh prompt"));
  v.push_back(layer_value(i, Value::attention_values, {B, T, W}, true,
                          "u = conv_1d(linear_x(x)), the RG-LRU input before the input gate (padding inputs count as 0); the "
                          "gates are computed from it first, so a write changes what the token writes, not its gates"));
  v.push_back(layer_value(i, Value::betas, {B, T, W}, true,
                          "input gate i_t = sigmoid(u W_input_gate + b), block-diagonal per head; the token writes "
                          "sqrt(1 - a_t^2) * i_t * u_t"));
  v.push_back(layer_value(i, Value::decays, {B, T, W}, true,
                          "log a_t = -8 * r_t * softplus(recurrent_param), r_t = sigmoid(u W_recurrent_gate + b) the "
                          "recurrence gate; <= 0 (a write sets a_t = exp(decays) and the normaliser sqrt(1 - a_t^2))"));
  auto s = layer_value(i, Value::states, {B, T, K, W}, false, "state after every token " + layout + " (computed only when asked)");
  s.writable = false;
  v.push_back(s);
  v.push_back(layer_value(i, Value::state_output, {B, K, W}, true, "state after the call's last token " + layout + " (goes to the cache)"));
  v.push_back(layer_value(i, Value::attention_head_outputs, {B, T, W}, true,
                          "RG-LRU output h_t per channel, before the gelu(linear_y(x)) gate"));
  // Diagonal per channel: the mixing's "heads" are the lru_width channels; its state side is h alone.
  add_mixing_values(i, B, T, W, 1, "nothing (no skip); state_input_mixing multiplies state_input's h row (K-1)", v);
  v.push_back(layer_value(i, Value::attention_output, {B, T, d_.D}, true, "linear_out(h * gelu(linear_y(x))), added to the residual"));
}

Tensor RgLruMixer::forward(const RgLruMixerWeights& l, const Tensor& x, const Batch& in, const RgLruMixerCall& call) const {
  const int li = call.layer;
  Listener* ls = call.ls;
  const int64_t B = in.batch, T = in.seq, BT = B * T, D = d_.D, W = d_.W, H = d_.H, bw = W / H, K = d_.K;
  const int64_t SN = K * W;  // one row's state: K - 1 window rows and h
  Tensor xb = Tensor::uninitialized({B, T, W}), y = Tensor::uninitialized({B, T, W});
  ops::linear(x.data(), BT, D, l.linear_x, xb.data(), l.x_bias.data());
  ops::linear(x.data(), BT, D, l.linear_y, y.data(), l.y_bias.data());
  for (int64_t e = 0; e < BT * W; ++e) y[e] = ops::gelu_tanh(y[e]);
  // transformers feeds the padding positions' linear_x outputs into the conv of a row's first real
  // tokens; mixlens zeroes them, so a padded row equals the row alone (docs/values.md, RecurrentGemma).
  if (in.has_padding()) apply_row_mask(xb, in);

  Tensor& S = *call.h;
  // state_input before the conv: a window write reaches the served u, betas and decays of the first K-1 tokens.
  visit_state_input(li, S, call.has_state, ls, Shape{K, W}, [](const Tensor& s) { return s.clone(); },
                    [](const Tensor& o, Tensor& s) {
                      std::memcpy(s.data(), o.data(), sizeof(float) * static_cast<size_t>(s.numel()));
                    });
  // The window each precomputed conv reads (a state@t write is caught by run's window check).
  const Tensor win0 = S.clone();
  const auto gates = [&](const float* u, float* ig, float* la) {
    for (int64_t h = 0; h < H; ++h)
      for (int64_t j = 0; j < bw; ++j) {
        float si = l.in_gate_b[h * bw + j], sr = l.rec_gate_b[h * bw + j];
        for (int64_t k = 0; k < bw; ++k) {
          const float uk = u[h * bw + k];
          si += uk * l.in_gate_w[(h * bw + k) * bw + j];
          sr += uk * l.rec_gate_w[(h * bw + k) * bw + j];
        }
        ig[h * bw + j] = ops::sigmoid(si);
        la[h * bw + j] = l.log_a_scale[h * bw + j] * ops::sigmoid(sr);
      }
  };
  Tensor u = Tensor::uninitialized({B, T, W}), ig = Tensor::uninitialized({B, T, W}), la = Tensor::uninitialized({B, T, W});
  // Row b's input at step e of win0's rows ++ the call's inputs (e < K - 1: the window).
  const auto ext = [&](const Tensor& win, int64_t b, int64_t e) {
    return e < K - 1 ? win.data() + b * SN + e * W : xb.data() + (b * T + e - (K - 1)) * W;
  };
  ops::parallel_for(BT, [&](int64_t r) {
    const int64_t b = r / T, t = r % T;
    std::vector<const float*> rows(static_cast<size_t>(K));
    for (int64_t j = 0; j < K; ++j) rows[static_cast<size_t>(j)] = ext(win0, b, t + j);
    conv_token(rows.data(), K, W, l.conv_wT.data(), l.conv_bias.data(), u.data() + r * W);
    gates(u.data() + r * W, ig.data() + r * W, la.data() + r * W);
  });
  visit_if(ls, li, Value::attention_values, u);
  visit_if(ls, li, Value::betas, ig);
  // A token at position 0 resets the recurrence (a_t = 0): a decays write there would change nothing.
  const std::vector<int64_t>& pos = *call.pos;
  std::vector<float> la_reset;
  for (int64_t r = 0; r < BT && ls; ++r)
    if (pos[static_cast<size_t>(r)] == 0) la_reset.insert(la_reset.end(), la.data() + r * W, la.data() + (r + 1) * W);
  visit_if(ls, li, Value::decays, la);
  for (int64_t r = 0, k = 0; r < BT && ls; ++r)
    if (pos[static_cast<size_t>(r)] == 0 &&
        std::memcmp(la.data() + r * W, la_reset.data() + (k++) * W, sizeof(float) * static_cast<size_t>(W)) != 0)
      throw WriteError("layers." + std::to_string(li) + ".linear_attn.decays: a write at a sequence's first token (row " +
                       std::to_string(r / T) + ", token " + std::to_string(r % T) +
                       ") changes nothing: the RG-LRU resets there (a_t = 0, transformers' RecurrentGemmaRglru)");

  Tensor hs({B, T, W});  // zeros: padding positions read nothing
  RowScan rs;
  rs.B = B; rs.T = T; rs.row_numel = SN; rs.S = S.data(); rs.y_row_numel = T * W;
  rs.first = first_real_tokens(in);
  rs.chunk = 0;  // the token loop: the state after t is the live one
  rs.run = [&](int64_t b, int64_t t0, int64_t t1, float* S_row, float* y_scratch, float* states_row) {
    // A window that is not the one the precomputed conv read (a state write) recomputes u and the
    // gates of the next K - 1 tokens from it.
    bool dirty = false;
    for (int64_t j = 0; j < K - 1 && !dirty; ++j)
      dirty = std::memcmp(S_row + j * W, ext(win0, b, t0 + j), sizeof(float) * static_cast<size_t>(W)) != 0;
    float* hrow = S_row + (K - 1) * W;
    std::vector<const float*> rows(static_cast<size_t>(K));
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t r = b * T + t;
      const float* xt = xb.data() + r * W;
      if (dirty && t - t0 < K - 1) {
        for (int64_t j = 0; j < K - 1; ++j) rows[static_cast<size_t>(j)] = S_row + j * W;
        rows[static_cast<size_t>(K - 1)] = xt;
        conv_token(rows.data(), K, W, l.conv_wT.data(), l.conv_bias.data(), u.data() + r * W);
        gates(u.data() + r * W, ig.data() + r * W, la.data() + r * W);
      }
      // RecurrentGemmaRglru: a reset (position 0) drops h and skips the sqrt(1 - a^2) normaliser.
      const bool reset = pos[static_cast<size_t>(r)] == 0;
      // The reset drops h: a written h (state_input or state@t before it) would be a silent no-op.
      if (reset)
        for (int64_t c = 0; c < W; ++c)
          if (hrow[c] != 0.0f)
            throw WriteError("layers." + std::to_string(li) + ".linear_attn: the h part (row K-1) of a state written "
                             "before a sequence's first token (row " + std::to_string(b) +
                             ") changes nothing: the RG-LRU resets h there (a_t = 0); write the conv-window rows, "
                             "or write state@t at a later token");
      float* out = (y_scratch ? y_scratch + t * W : hs.data() + r * W);
      for (int64_t c = 0; c < W; ++c) {
        const float lg = la[r * W + c];
        const float a = reset ? 0.0f : std::exp(lg);
        const float mult = reset ? 1.0f : std::sqrt(1.0f - std::exp(2.0f * lg));
        hrow[c] = a * hrow[c] + u[r * W + c] * ig[r * W + c] * mult;
        out[c] = hrow[c];
      }
      // The window moves on by this token's conv input.
      if (K > 1) {
        std::memmove(S_row, S_row + W, sizeof(float) * static_cast<size_t>((K - 2) * W));
        std::memcpy(S_row + (K - 2) * W, xt, sizeof(float) * static_cast<size_t>(W));
      }
      if (states_row) std::memcpy(states_row + t * SN, S_row, sizeof(float) * static_cast<size_t>(SN));
    }
  };
  rs.serve = [&](const float* S_row, float* o) { std::memcpy(o, S_row, sizeof(float) * static_cast<size_t>(SN)); };
  rs.store = rs.serve;
  Tensor states = scan_rows(ls, li, rs, {B, T, K, W});
  if (states.defined()) {
    ls->visit(li, Value::states, states, states.shape());
    ls->recycle_stack(std::move(states));
  }
  visit_if(ls, li, Value::state_output, S);  // served layout is the cache layout: writes land in place
  visit_if(ls, li, Value::attention_head_outputs, hs);
  visit_mixing(ls, li, B, T, W, 1, [&](const MixBlock& blk, float* M, float* Sin) {
    RgLruMixArgs ma;
    ma.B = B; ma.T = T; ma.W = W; ma.u = u.data(); ma.ig = ig.data(); ma.la = la.data(); ma.pos = pos.data();
    rg_lru_token_mixing(ma, rs.first, blk, M, Sin);
  });
  for (int64_t e = 0; e < BT * W; ++e) hs[e] *= y[e];
  Tensor out = Tensor::uninitialized({B, T, D});
  ops::linear(hs.data(), BT, W, l.linear_out, out.data(), l.out_bias.data());
  visit_if(ls, li, Value::attention_output, out);
  return out;
}

}  // namespace mixlens::detail
