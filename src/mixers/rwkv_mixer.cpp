#include "mixers/rwkv_mixer.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "hooks/mixing.h"
#include "hooks/serve.h"
#include "mixlens/errors.h"
#include "ops/ops.h"

namespace mixlens::detail {

void wkv_recurrent(int64_t T, int64_t A, const float* k, const float* v, const float* w, const float* u, float* st,
                   float* y, float* states, int64_t stride) {
  float* num = st;
  float* den = st + A;
  float* mx = st + 2 * A;
  for (int64_t t = 0; t < T; ++t) {
    const float* kt = k + t * A;
    const float* vt = v + t * A;
    const float* wt = w + t * A;
    float* yt = y + t * A;
    for (int64_t a = 0; a < A; ++a) {
      // The read: the state and the token's own write (bonus u), both shifted by their max.
      const float ku = kt[a] + u[a];
      const float mo = std::max(mx[a], ku);
      float e1 = std::exp(mx[a] - mo), e2 = std::exp(ku - mo);
      yt[a] = (e1 * num[a] + e2 * vt[a]) / (e1 * den[a] + e2);
      // The update: decay the state by exp(w), add exp(k) v, keep the new max out of the exponents.
      const float md = mx[a] + wt[a];
      const float ms = std::max(md, kt[a]);
      e1 = std::exp(md - ms), e2 = std::exp(kt[a] - ms);
      num[a] = e1 * num[a] + e2 * vt[a];
      den[a] = e1 * den[a] + e2;
      mx[a] = ms;
    }
    if (states) std::copy(st, st + 3 * A, states + t * stride);
  }
}

void token_shift_mix(const Tensor& x, const float* start, const std::vector<int64_t>& first, const float* mix,
                     Tensor& out) {
  const int64_t B = x.size(0), T = x.size(1), D = x.size(2);
  std::vector<float> keep(static_cast<size_t>(D));
  for (int64_t d = 0; d < D; ++d) keep[static_cast<size_t>(d)] = 1.0f - mix[d];
  ops::parallel_for(B * T, [&](int64_t r) {
    const int64_t b = r / T, t = r % T;
    const float* xr = x.data() + r * D;
    const float* prev = t <= first[static_cast<size_t>(b)] ? start + b * D : xr - D;
    float* o = out.data() + r * D;
    for (int64_t d = 0; d < D; ++d) o[d] = xr[d] * mix[d] + prev[d] * keep[static_cast<size_t>(d)];
  });
}

RwkvMixerWeights RwkvMixer::load(const io::WeightStore& w, const std::string& p, float out_scale) const {
  const int64_t D = d_.D, A = d_.A;
  RwkvMixerWeights l;
  const Tensor td = w.get(p + "time_decay", {A});
  l.decay = Tensor({A});
  for (int64_t a = 0; a < A; ++a) l.decay[a] = -std::exp(td[a]);
  l.time_first = w.get(p + "time_first", {A});
  l.mix_k = w.get(p + "time_mix_key", {1, 1, D}).reshape({D});
  l.mix_v = w.get(p + "time_mix_value", {1, 1, D}).reshape({D});
  l.mix_r = w.get(p + "time_mix_receptance", {1, 1, D}).reshape({D});
  l.key = w.get_matmul(p + "key.weight", {A, D});
  l.value = w.get_matmul(p + "value.weight", {A, D});
  l.receptance = w.get_matmul(p + "receptance.weight", {A, D});
  l.output = w.get(p + "output.weight", {D, A}).clone();
  for (int64_t i = 0; i < D * A; ++i) l.output[i] /= out_scale;  // a power of two: exact
  return l;
}

void RwkvMixer::values(int i, int64_t B, int64_t T, std::vector<ValueInfo>& v) const {
  const int64_t D = d_.D, A = d_.A, n = d_.row_numel();
  v.push_back(layer_value(i, Value::state_input, {B, n}, true,
                          "state the call starts from, num | den | max [3A] | time-mix last x | channel-mix last x "
                          "[2D]; None on a fresh prompt"));
  v.push_back(layer_value(i, Value::attention_keys, {B, T, A}, true,
                          "k = key(token-shifted ln1 output): each token writes exp(k) v (exp(time_first + k) v into "
                          "its own read)"));
  v.push_back(layer_value(i, Value::attention_values, {B, T, A}, true, "v = value(token-shifted ln1 output)"));
  v.push_back(layer_value(i, Value::decays, {B, T, A}, true,
                          "-exp(time_decay) per channel (one per token, writable per token): log of the state kept"));
  v.push_back(layer_value(i, Value::attention_queries, {B, T, A}, true,
                          "receptance r = sigmoid(receptance(...)): the per-channel gate on the state's read"));
  auto s = layer_value(i, Value::states, {B, T, n}, false, "state after every token (computed only when asked)");
  s.writable = false;
  v.push_back(s);
  v.push_back(layer_value(i, Value::attention_head_outputs, {B, T, A}, true,
                          "wkv = (num + exp(u + k) v) / (den + exp(u + k)), the state's read before receptance"));
  // Per channel: the mixing's "heads" are the A channels; its state side the num entry.
  add_mixing_values(i, B, T, A, 1, "nothing (no skip); state_input_mixing multiplies state_input's num [A]", v);
  v.push_back(layer_value(i, Value::attention_output, {B, T, D}, true, "output(r * wkv), added to the residual"));
  v.push_back(layer_value(i, Value::state_output, {B, n}, true, "state after the call's last token (goes to the cache)"));
}

void RwkvMixer::check_state_write(const float* rows, int64_t nrows, int layer, const char* what) const {
  for (int64_t b = 0; b < nrows; ++b)
    for (int64_t a = 0; a < d_.A; ++a) {
      const float den = rows[b * d_.row_numel() + d_.A + a];
      if (den < 0.0f)
        throw WriteError("write to 'layers." + std::to_string(layer) + ".linear_attn." + what + "': den (entries A.." +
                         "2A-1 of the state row) must be >= 0, a sum of positive weights; got " + std::to_string(den) +
                         " at row " + std::to_string(b) + ", channel " + std::to_string(a));
    }
}

Tensor RwkvMixer::forward(const RwkvMixerWeights& lw, const Tensor& n_in, const Batch& in,
                          const RwkvMixerCall& call) const {
  const int li = call.layer;
  Listener* ls = call.ls;
  const int64_t B = in.batch, T = in.seq, BT = B * T, D = d_.D, A = d_.A, n = d_.row_numel();
  const std::vector<int64_t> first = first_real_tokens(in);
  Tensor& S = call.begin_state();
  // The shift states the call starts from (state_input included), before the scan overwrites them.
  Tensor att_start({B, D});
  *call.ffn_start = Tensor({B, D});
  for (int64_t b = 0; b < B; ++b) {
    std::copy_n(S.data() + b * n + d_.att_shift(), D, att_start.data() + b * D);
    std::copy_n(S.data() + b * n + d_.ffn_shift(), D, call.ffn_start->data() + b * D);
  }
  Tensor xm({B, T, D}), k({B, T, A}), v({B, T, A}), r({B, T, A});
  token_shift_mix(n_in, att_start.data(), first, lw.mix_k.data(), xm);
  ops::linear(xm.data(), BT, D, lw.key, k.data());
  token_shift_mix(n_in, att_start.data(), first, lw.mix_v.data(), xm);
  ops::linear(xm.data(), BT, D, lw.value, v.data());
  token_shift_mix(n_in, att_start.data(), first, lw.mix_r.data(), xm);
  ops::linear(xm.data(), BT, D, lw.receptance, r.data());
  ops::sigmoid(r.data(), r.data(), BT * A);
  Tensor w({B, T, A});
  for (int64_t q = 0; q < BT; ++q) std::copy_n(lw.decay.data(), A, w.data() + q * A);
  visit_if(ls, li, Value::attention_keys, k);
  visit_if(ls, li, Value::attention_values, v);
  visit_if(ls, li, Value::decays, w);
  visit_if(ls, li, Value::attention_queries, r);

  Tensor y({B, T, A});  // zeros: padded tokens read nothing
  // The state the call starts from, kept for the mixing (the scan overwrites S in place). Always: an
  // interleaved reader may first want token_mixing after the scan; one row is 3A + 2D floats.
  const Tensor start = S.clone();
  // The channel-mix shift after token t: ln2 of the residual plus output(r * y) of that token alone.
  const auto ffn_at = [&](int64_t b, int64_t t, const float* ybuf, float* dst) {
    std::vector<float> g(static_cast<size_t>(A)), o(static_cast<size_t>(D));
    for (int64_t a = 0; a < A; ++a) g[static_cast<size_t>(a)] = r[(b * T + t) * A + a] * ybuf[a];
    ops::linear(g.data(), 1, A, lw.output, o.data());
    call.ffn_shift(b, t, o.data(), dst);
  };
  RowScan rs;
  rs.B = B, rs.T = T, rs.row_numel = n, rs.S = S.data(), rs.y_row_numel = T * A;
  rs.first = first;
  rs.chunk = 0;  // the token loop: the live state after t is the state after t
  rs.run = [&](int64_t b, int64_t t0, int64_t t1, float* S_row, float* y_scratch, float* states_row) {
    const int64_t o = (b * T + t0) * A;
    float* yb = y_scratch ? y_scratch : y.data() + b * T * A;  // the row's [T, A], absolute token index
    wkv_recurrent(t1 - t0, A, k.data() + o, v.data() + o, w.data() + o, lw.time_first.data(), S_row, yb + t0 * A,
                  states_row ? states_row + t0 * n : nullptr, n);
    if (states_row)
      for (int64_t t = t0; t < t1; ++t) {
        std::copy_n(n_in.data() + (b * T + t) * D, D, states_row + t * n + d_.att_shift());
        ffn_at(b, t, yb + t * A, states_row + t * n + d_.ffn_shift());
      }
    std::copy_n(n_in.data() + (b * T + t1 - 1) * D, D, S_row + d_.att_shift());
    ffn_at(b, t1 - 1, yb + (t1 - 1) * A, S_row + d_.ffn_shift());
  };
  rs.serve = [n](const float* S_row, float* out) { std::copy(S_row, S_row + n, out); };
  rs.store = [this, li](const float* served, float* S_row) {
    // Inside a call the shift states are the tokens' own normed inputs (k / v / r of the next token and the
    // channel mixing are computed from them already): only num | den | max are written per token.
    if (std::memcmp(served + d_.att_shift(), S_row + d_.att_shift(), sizeof(float) * static_cast<size_t>(2 * d_.D)) != 0)
      throw WriteError("layers." + std::to_string(li) +
                       ".linear_attn.state: a per-token write may change num | den | max (the first 3 * "
                       "attention_hidden_size entries) only; the token-shift parts are the tokens' normed inputs "
                       "(write them through state_input, or write layer_input)");
    check_state_write(served, 1, li, "state");
    std::copy(served, served + 3 * d_.A, S_row);
  };
  Tensor states = scan_rows(ls, li, rs, {B, T, n});
  if (states.defined()) {
    ls->visit(li, Value::states, states, states.shape());
    ls->recycle_stack(std::move(states));
  }
  const bool y_written = visit_if(ls, li, Value::attention_head_outputs, y);
  visit_mixing(ls, li, B, T, A, 1, [&](const MixBlock& blk, float* M, float* Sin) {
    RwkvMixArgs ma;
    ma.B = B; ma.T = T; ma.A = A; ma.k = k.data(); ma.v = v.data(); ma.w = w.data(); ma.u = lw.time_first.data();
    ma.start = start.data(); ma.row_stride = n;
    rwkv_token_mixing(ma, first, blk, M, Sin);
  });
  Tensor g({B, T, A}), out({B, T, D});
  for (int64_t q = 0; q < BT * A; ++q) g[q] = r[q] * y[q];
  ops::linear(g.data(), BT, A, lw.output, out.data());
  const bool out_written = visit_if(ls, li, Value::attention_output, out);
  if (y_written || out_written)  // the channel-mix shift the cache carries follows what the block adds
    for (int64_t b = 0; b < B; ++b) call.ffn_shift(b, T - 1, out.data() + (b * T + T - 1) * D, S.data() + b * n + d_.ffn_shift());
  call.end_state();
  return out;
}

}  // namespace mixlens::detail
