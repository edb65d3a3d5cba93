#include "mixers/attention_mixer.h"

#include <cmath>
#include <cstring>
#include <utility>

#include "hooks/serve.h"
#include "mixlens/errors.h"
#include "ops/ops.h"

namespace mixlens::detail {

namespace {
const float* opt(const Tensor& t) { return t.defined() ? t.data() : nullptr; }

void scale_by(Tensor& t, float s) {
  for (int64_t e = 0; e < t.numel(); ++e) t[e] *= s;
}
}  // namespace

void add_lora(const float* x, int64_t rows, const Tensor& down, const Tensor& up, Tensor& y) {
  const int64_t r = down.size(0), out = up.size(0);
  Tensor t = Tensor::uninitialized({rows, r}), u = Tensor::uninitialized({rows, out});
  ops::linear(x, rows, down.size(1), down, t.data());
  ops::linear(t.data(), rows, r, up, u.data());
  float* yp = y.data();
  for (int64_t e = 0; e < rows * out; ++e) yp[e] += u[e];
}

// MLA's queries: q_proj, or q_b_proj(q_a_layernorm(q_a_proj(x))).
void latent_queries(const AttentionMixerDims& d, const AttentionMixerWeights& w, const float* x, int64_t rows, float* q,
                    Tensor* qa_out) {
  if (d.q_lora_rank == 0) return ops::linear(x, rows, d.D, w.q_proj, q);
  Tensor qa = Tensor::uninitialized({rows, d.q_lora_rank});
  ops::linear(x, rows, d.D, w.q_a_proj, qa.data());
  if (qa_out) *qa_out = qa.clone();
  ops::rmsnorm(qa.data(), w.q_a_norm.data(), qa.data(), rows, d.q_lora_rank, d.latent_eps, false);
  ops::linear(qa.data(), rows, d.q_lora_rank, w.q_b_proj, q);
}

// KimiLinearAttention.expand_kv over kv_a_proj_with_mqa's output.
void latent_keys_values(const AttentionMixerDims& d, const AttentionMixerWeights& w, const float* x, int64_t rows,
                        float* k, float* v, Tensor* ckv_out) {
  const int64_t r = d.kv_lora_rank, ca = r + d.qk_rope, H = d.H, nv = d.qk_nope + d.v_hd;
  Tensor ckv = Tensor::uninitialized({rows, ca}), lat = Tensor::uninitialized({rows, r}),
         kvb = Tensor::uninitialized({rows, H * nv});
  ops::linear(x, rows, d.D, w.kv_a_proj, ckv.data());
  if (ckv_out) *ckv_out = ckv;
  for (int64_t row = 0; row < rows; ++row)
    std::memcpy(lat.data() + row * r, ckv.data() + row * ca, sizeof(float) * static_cast<size_t>(r));
  ops::rmsnorm(lat.data(), w.kv_a_norm.data(), lat.data(), rows, r, d.latent_eps, false);
  ops::linear(lat.data(), rows, r, w.kv_b_proj, kvb.data());
  for (int64_t row = 0; row < rows; ++row)
    for (int64_t h = 0; h < H; ++h) {
      const float* src = kvb.data() + (row * H + h) * nv;
      float* kh = k + (row * H + h) * d.hd;
      std::memcpy(kh, src, sizeof(float) * static_cast<size_t>(d.qk_nope));
      std::memcpy(kh + d.qk_nope, ckv.data() + row * ca + r, sizeof(float) * static_cast<size_t>(d.qk_rope));
      std::memcpy(v + (row * H + h) * d.v_hd, src + d.qk_nope, sizeof(float) * static_cast<size_t>(d.v_hd));
    }
}

Tensor pad_heads(const Tensor& x, int64_t d) {
  Shape s = x.shape();
  const int64_t w = s.back(), n = x.numel() / w;
  s.back() = d;
  Tensor y(s);
  for (int64_t i = 0; i < n; ++i) std::memcpy(y.data() + i * d, x.data() + i * w, sizeof(float) * static_cast<size_t>(w));
  return y;
}
Tensor unpad_heads(const Tensor& x, int64_t w) {
  Shape s = x.shape();
  const int64_t d = s.back(), n = x.numel() / d;
  s.back() = w;
  Tensor y = Tensor::uninitialized(s);
  for (int64_t i = 0; i < n; ++i) std::memcpy(y.data() + i * w, x.data() + i * d, sizeof(float) * static_cast<size_t>(w));
  return y;
}

AttentionMixer::AttentionMixer(const AttentionMixerDims& dims, const std::string& where) : d_(dims) {
  const std::pair<const char*, int64_t> sizes[] = {
      {"hidden_size", d_.D}, {"num_attention_heads", d_.H}, {"num_key_value_heads", d_.Hkv}, {"head_dim", d_.hd}};
  for (const auto& [name, v] : sizes)
    if (v <= 0 || v > (int64_t{1} << 32))
      throw ConfigError(where + ": attention " + name + " = " + std::to_string(v) + " is out of range (must be a positive size)");
  if (d_.H % d_.Hkv != 0)
    throw ConfigError(where + ": num_attention_heads (" + std::to_string(d_.H) + ") is not divisible by num_key_value_heads (" +
                      std::to_string(d_.Hkv) + ")");
  if (d_.rope) {
    if (d_.rot <= 0 || d_.rot > d_.hd || d_.rot % 2 != 0)
      throw ConfigError(where + ": rotary dim " + std::to_string(d_.rot) + " must be even and in (0, head_dim = " +
                        std::to_string(d_.hd) + "]");
    inv_freq_ = rope_inv_freq(d_.rot, d_.theta);
  }
  if (!(d_.scale >= 0.0f) || !std::isfinite(d_.scale))
    throw ConfigError(where + ": the attention softmax scale must be a finite number >= 0 (0: 1/sqrt(head_dim))");
  if (d_.qk_norm != AttentionQkNorm::none && (!(d_.eps > 0.0f) || !std::isfinite(d_.eps)))
    throw ConfigError(where + ": the q / k norm epsilon must be a finite number > 0");
  for (float m : {d_.in_multiplier, d_.key_multiplier, d_.out_multiplier})
    if (!std::isfinite(m)) throw ConfigError(where + ": attention multipliers must be finite");
  if (d_.in_width < 0 || d_.in_width > (int64_t{1} << 32) || d_.lora_rank < 0 || d_.lora_rank > (int64_t{1} << 32))
    throw ConfigError(where + ": attention input width " + std::to_string(d_.in_width) + " / adapter rank " +
                      std::to_string(d_.lora_rank) + " out of range");
  if (d_.mla()) {
    if (d_.qk_nope < 0 || d_.qk_rope < 0 || d_.qk_nope + d_.qk_rope != d_.hd || d_.v_hd <= 0 || d_.v_hd > d_.hd ||
        d_.q_lora_rank < 0)
      throw ConfigError(where + ": latent attention needs qk_nope_head_dim + qk_rope_head_dim = head_dim (" +
                        std::to_string(d_.qk_nope) + " + " + std::to_string(d_.qk_rope) + " vs " + std::to_string(d_.hd) +
                        "), 0 < v_head_dim (" + std::to_string(d_.v_hd) + ") <= head_dim and q_lora_rank >= 0");
    if (d_.Hkv != d_.H)
      throw ConfigError(where + ": latent attention expands keys and values per query head: num_key_value_heads (" +
                        std::to_string(d_.Hkv) + ") must equal num_attention_heads (" + std::to_string(d_.H) + ")");
    if (d_.rope || d_.gate || d_.bias || d_.qk_norm != AttentionQkNorm::none || d_.in_multiplier != 1.0f ||
        d_.key_multiplier != 1.0f || d_.out_multiplier != 1.0f)
      throw UnsupportedError(where + ": latent attention with RoPE, an output gate, biases, q / k norms or "
                             "multipliers is not supported (Kimi-Linear has none of them)");
    if (!(d_.latent_eps > 0.0f) || !std::isfinite(d_.latent_eps))
      throw ConfigError(where + ": the latent norms' epsilon must be a finite number > 0");
  }
}

AttentionMixerWeights AttentionMixer::load(const io::WeightStore& w, const std::string& m) const {
  const int64_t qr = d_.q_rows(), kd = d_.Hkv * d_.hd, D = d_.in_dim();
  AttentionMixerWeights a;
  if (d_.mla()) {  // KimiLinearAttention's names
    const int64_t H = d_.H, r = d_.kv_lora_rank, qlr = d_.q_lora_rank;
    if (qlr > 0) {
      a.q_a_proj = w.get_matmul(m + "q_a_proj.weight", {qlr, D});
      a.q_a_norm = w.get(m + "q_a_layernorm.weight", {qlr});
      a.q_b_proj = w.get_matmul(m + "q_b_proj.weight", {H * d_.hd, qlr});
    } else {
      a.q_proj = w.get_matmul(m + "q_proj.weight", {H * d_.hd, D});
    }
    a.kv_a_proj = w.get_matmul(m + "kv_a_proj_with_mqa.weight", {r + d_.qk_rope, D});
    a.kv_a_norm = w.get(m + "kv_a_layernorm.weight", {r});
    a.kv_b_proj = w.get_matmul(m + "kv_b_proj.weight", {H * (d_.qk_nope + d_.v_hd), r});
    a.o_proj = w.get_matmul(m + "o_proj.weight", {D, H * d_.v_hd});
    return a;
  }
  a.q_proj = w.get_matmul(m + "q_proj.weight", {qr, D});
  a.k_proj = w.get_matmul(m + "k_proj.weight", {kd, D});
  a.v_proj = w.get_matmul(m + "v_proj.weight", {kd, D});
  a.o_proj = w.get_matmul(m + d_.o_name + ".weight", {d_.D, d_.H * d_.hd});
  if (d_.bias) {
    a.q_bias = w.get(m + "q_proj.bias", {qr});
    a.k_bias = w.get(m + "k_proj.bias", {kd});
    a.v_bias = w.get(m + "v_proj.bias", {kd});
    a.o_bias = w.get(m + d_.o_name + ".bias", {d_.D});
  } else if (d_.out_bias) {
    a.o_bias = w.get(m + d_.o_name + ".bias", {d_.D});
  }
  if (d_.qk_norm != AttentionQkNorm::none) {
    const bool whole = d_.qk_norm == AttentionQkNorm::whole;
    a.q_norm = w.get(m + d_.q_norm_name + ".weight", {whole ? d_.H * d_.hd : d_.hd});
    a.k_norm = w.get(m + d_.k_norm_name + ".weight", {whole ? kd : d_.hd});
  }
  return a;
}

void AttentionMixer::load_adapters(const io::WeightStore& w, const std::string& m, int64_t index,
                                   AttentionMixerWeights& a) const {
  const int64_t r = d_.lora_rank, in = d_.in_dim(), kd = d_.Hkv * d_.hd;
  if (r <= 0) throw ConfigError("attention adapters asked for without an adapter rank (" + m + ")");
  const std::string k = "_adapter_list." + std::to_string(index) + ".";
  const auto pair = [&](const char* p, int64_t rows, Tensor& down, Tensor& up) {
    down = w.get_matmul(m + "linear_" + p + k + "0.weight", {r, in});
    up = w.get_matmul(m + "linear_" + p + k + "1.weight", {rows, r});
  };
  pair("q", d_.q_rows(), a.q_lora_a, a.q_lora_b);
  pair("k", kd, a.k_lora_a, a.k_lora_b);
  pair("v", kd, a.v_lora_a, a.v_lora_b);
}

void AttentionMixer::values(int i, int64_t B, int64_t T, std::vector<ValueInfo>& v) const {
  const int64_t D = d_.D, H = d_.H, Hkv = d_.Hkv, hd = d_.hd;
  const bool norm = d_.qk_norm != AttentionQkNorm::none;
  const std::string rope = d_.rope ? " and RoPE" : " (no positional encoding)";
  v.push_back(layer_value(i, Value::attn_queries, {B, T, H, hd}, true,
                          d_.mla() ? std::string(d_.q_lora_rank > 0 ? "q = q_b_proj(q_a_layernorm(q_a_proj(x)))" : "q after q_proj") + rope
                                   : std::string(norm ? "q after q_norm" : "q after q_proj") + rope));
  if (d_.mla())
    v.push_back(layer_value(i, Value::attn_keys, {B, T, Hkv, hd}, true,
                            "per head [k_nope from kv_b_proj | k_rope shared by the heads]" + rope + " (as cached)"));
  const std::string k = norm ? "k after k_norm" : d_.key_multiplier != 1.0f ? "k * key_multiplier" : "k";
  if (!d_.mla()) v.push_back(layer_value(i, Value::attn_keys, {B, T, Hkv, hd}, true, k + rope + " (as cached)"));
  v.push_back(layer_value(i, Value::attn_values, {B, T, Hkv, d_.value_hd()}, true,
                          d_.mla() ? "v from kv_b_proj(kv_a_layernorm(latent)) (as cached)" : "v (as cached)"));
  ValueInfo p = layer_value(i, Value::attn_probs, {B, H, T, T}, true,
                            "softmax attention weights [B,heads,T_q,T_k] (T_k = cached + new tokens; 0 for "
                            "masked and future keys; transformers' eager attn_weights), read-only");
  p.writable = false;
  v.push_back(p);
  if (d_.gate) v.push_back(layer_value(i, Value::attn_gate, {B, T, H * hd}, true, "output-gate logits before the sigmoid"));
  v.push_back(layer_value(i, Value::attn_output, {B, T, D}, true,
                          d_.gate ? "o_proj(attention * sigmoid(gate)), added to the residual"
                          : d_.out_multiplier != 1.0f ? "o_proj(attention) * out multiplier (Falcon-H1 attention_out_multiplier, Granite residual_multiplier), added to the residual"
                                                      : "o_proj(attention), added to the residual"));
}

// Qwen3_5Attention / NemotronHAttention / BambaAttention / FalconH1Attention with SDPA.
Tensor AttentionMixer::forward(const AttentionMixerWeights& w, const Tensor& x_in, const Batch& in,
                               const AttentionMixerCall& call) const {
  const int li = call.layer;
  Listener* ls = call.ls;
  // MLA's backward recomputes the call (its latent norms need their inputs): nothing to keep for it.
  grad::KeptTensors* tape = d_.mla() ? nullptr : call.tape;
  const bool last_only = call.last_rows_only;
  const std::vector<int64_t>& pos = *call.pos;
  const int64_t B = in.batch, T = in.seq, BT = B * T, d = d_.hd, H = d_.H, Hkv = d_.Hkv, D = d_.D, Din = d_.in_dim();
  const int64_t Tq = last_only ? 1 : T, BTq = B * Tq;  // query rows
  const bool norm = d_.qk_norm != AttentionQkNorm::none;
  const float* x = x_in.data();
  Tensor xm;
  if (d_.in_multiplier != 1.0f) {  // Falcon-H1: self_attn(hidden_states * attention_in_multiplier)
    xm = x_in.clone();
    scale_by(xm, d_.in_multiplier);
    x = xm.data();
  }
  // q_proj's output; without the gate it is q itself (normed and rotated in place below).
  Tensor qp = d_.gate ? Tensor::uninitialized({BTq, d_.q_rows()}) : Tensor::uninitialized({B, Tq, H, d});
  Tensor xl;  // the query rows' input with last_rows_only
  if (last_only) {
    xl = Tensor::uninitialized({B, Din});
    for (int64_t b = 0; b < B; ++b)
      std::memcpy(xl.data() + b * Din, x + (b * T + T - 1) * Din, sizeof(float) * static_cast<size_t>(Din));
  }
  const float* xq = last_only ? xl.data() : x;
  if (d_.mla())
    latent_queries(d_, w, xq, BTq, qp.data());
  else
    ops::linear(xq, BTq, Din, w.q_proj, qp.data(), opt(w.q_bias));
  if (d_.lora_rank > 0) add_lora(xq, BTq, w.q_lora_a, w.q_lora_b, qp);
  // A gradient call (never last_only) keeps the projections and the attention output
  // (grad::Kept::attn_*): the backward then runs no product of its forward again.
  if (tape) tape->keep(li, grad::Kept::attn_q_gate, d_.gate ? qp : qp.clone());  // read-only from here on
  Tensor q = d_.gate ? Tensor::uninitialized({B, Tq, H, d}) : qp;
  Tensor gate = d_.gate ? Tensor::uninitialized({B, Tq, H * d}) : Tensor();
  const int64_t dv = d_.value_hd();
  Tensor k = Tensor::uninitialized({B, T, Hkv, d}), v = Tensor::uninitialized({B, T, Hkv, dv});
  if (d_.mla()) {
    latent_keys_values(d_, w, x, BT, k.data(), v.data());
  } else {
    ops::linear(x, BT, Din, w.k_proj, k.data(), opt(w.k_bias));
    ops::linear(x, BT, Din, w.v_proj, v.data(), opt(w.v_bias));
  }
  if (d_.lora_rank > 0) {  // Zamba2Attention adds the adapters to the projections before the head split
    add_lora(x, BT, w.k_lora_a, w.k_lora_b, k);
    add_lora(x, BT, w.v_lora_a, w.v_lora_b, v);
  }
  if (d_.key_multiplier != 1.0f) scale_by(k, d_.key_multiplier);
  if (tape) tape->keep(li, grad::Kept::attn_k, k.clone());  // k_norm and RoPE below work in place
  std::vector<int64_t> qpos;
  if (last_only)
    for (int64_t b = 0; b < B; ++b) qpos.push_back(pos[static_cast<size_t>(b * T + T - 1)]);
  const int64_t* qp_pos = last_only ? qpos.data() : pos.data();
  // Per head [query | gate] split, q_norm and RoPE, then k_norm and RoPE: row blocks on the pool;
  // every row is computed on its own, so the blocks do not change its result.
  if (d_.gate || norm || d_.rope)
    ops::parallel_rows(BTq, 3 * H * d, [&](int64_t r0, int64_t r1) {
      if (d_.gate)
        for (int64_t row = r0; row < r1; ++row)
          for (int64_t h = 0; h < H; ++h) {
            const float* src = qp.data() + (row * H + h) * 2 * d;
            std::memcpy(q.data() + (row * H + h) * d, src, sizeof(float) * static_cast<size_t>(d));
            std::memcpy(gate.data() + (row * H + h) * d, src + d, sizeof(float) * static_cast<size_t>(d));
          }
      float* qr = q.data() + r0 * H * d;
      if (norm) {  // per head: rows of d; whole: rows of H * d
        const int64_t g = d_.qk_norm == AttentionQkNorm::whole ? H : 1;
        ops::rmsnorm(qr, w.q_norm.data(), qr, (r1 - r0) * H / g, g * d, d_.eps, d_.qk_norm_centred);
      }
      if (d_.rope) apply_rope(qr, r1 - r0, H, d, d_.rot, qp_pos + r0, inv_freq_);
    });
  if (norm || d_.rope)
    ops::parallel_rows(BT, 2 * Hkv * d, [&](int64_t r0, int64_t r1) {
      float* kr = k.data() + r0 * Hkv * d;
      if (norm) {
        const int64_t g = d_.qk_norm == AttentionQkNorm::whole ? Hkv : 1;
        ops::rmsnorm(kr, w.k_norm.data(), kr, (r1 - r0) * Hkv / g, g * d, d_.eps, d_.qk_norm_centred);
      }
      if (d_.rope) apply_rope(kr, r1 - r0, Hkv, d, d_.rot, pos.data() + r0, inv_freq_);
    });
  visit_if(ls, li, Value::attn_queries, q);
  visit_if(ls, li, Value::attn_keys, k);
  visit_if(ls, li, Value::attn_values, v);
  if (tape) tape->keep(li, grad::Kept::attn_v, v);
  KvCache& kv = *call.kv;
  const int64_t past = kv.len;
  // The kernels take one head width: MLA's values (v_hd < hd) go in zero-padded to hd, and the
  // padding's zero outputs are dropped before o_proj.
  const Tensor vk = dv == d ? v : pad_heads(v, d);
  kv.append(k.data(), vk.data(), B, T, Hkv * d);
  Tensor att = Tensor::uninitialized({B, Tq, H, d});
  // Attention probabilities cost [B,H,T,T_k]: made only when someone asks (nnterp's attention_probabilities).
  Tensor probs = ls && ls->wants(li, Value::attn_probs) ? Tensor({B, H, T, past + T}) : Tensor();
  causal_attention(q.data(), B, Tq, H, Hkv, d, past + T - Tq, kv, *call.key_mask, att.data(),
                   probs.defined() ? probs.data() : nullptr, d_.scale, d_.window);
  if (probs.defined()) visit_if(ls, li, Value::attn_probs, probs);
  // A sliding window: later queries never read keys older than the last window - 1 (transformers'
  // sliding-window cache layer keeps as many).
  if (d_.window > 0) kv.keep_last(d_.window - 1);
  if (tape) tape->keep(li, grad::Kept::attn_core, d_.gate ? att.clone() : att);  // gated in place below
  if (d_.gate) {
    visit_if(ls, li, Value::attn_gate, gate);
    Tensor sg = Tensor::uninitialized(gate.shape());  // gate is served: sigmoid into a copy, vectorized
    const int64_t wd = H * d;
    ops::parallel_rows(BTq, wd, [&](int64_t r0, int64_t r1) {
      ops::sigmoid(gate.data() + r0 * wd, sg.data() + r0 * wd, (r1 - r0) * wd);
      for (int64_t e = r0 * wd; e < r1 * wd; ++e) att[e] *= sg[e];
    });
  }
  if (dv != d) att = unpad_heads(att, dv);
  Tensor out = Tensor::uninitialized({B, Tq, D});
  ops::linear(att.data(), BTq, H * dv, w.o_proj, out.data(), opt(w.o_bias));
  if (d_.out_multiplier != 1.0f) scale_by(out, d_.out_multiplier);
  visit_if(ls, li, Value::attn_output, out);
  if (tape) tape->keep(li, grad::Kept::attn_output, out);
  return out;
}

}  // namespace mixlens::detail
