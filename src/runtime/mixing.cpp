// token_mixing / state_contributions (include/mixlens/mixing.h): run the prompt saving the layer's
// scan inputs as served, then ask the kind's mixing code (next to its kernels) for the block.
#include "mixlens/mixing.h"

#include <algorithm>
#include <vector>

#include "hooks/mixing.h"
#include "hooks/serve.h"
#include "mixers/gated_delta.h"
#include "mixers/mlstm_mixer.h"
#include "mixers/rg_lru_mixer.h"
#include "mixers/rwkv_mixer.h"
#include "mixers/selective_scan.h"
#include "mixers/short_conv_mixer.h"
#include "mixers/ssd.h"
#include "mixlens/errors.h"
#include "mixlens/trace.h"
#include "models/family.h"
#include "runtime/model_access.h"

namespace mixlens {

namespace {

int64_t resolve(int64_t i, int64_t n) { return i < 0 ? n + i : i; }

// [begin, end) of `s` on an axis of n entries; InputError naming the axis when it falls outside.
std::pair<int64_t, int64_t> resolve_span(const Span& s, int64_t n, const char* axis) {
  const int64_t b = resolve(s.begin, n), e = s.end == kSpanEnd ? n : resolve(s.end, n);
  if (b < 0 || e > n || b > e)
    throw InputError(std::string("token_mixing: ") + axis + " [" + std::to_string(s.begin) + ", " +
                     (s.end == kSpanEnd ? std::string("end") : std::to_string(s.end)) + ") is out of range for " +
                     std::to_string(n) + " (negative indices count from the end)");
  return {b, e};
}

// Which mixing code a layer's kind runs (the block kind alone does not say: a Zamba "hybrid" block
// runs Mamba-1, a Zamba2 one Mamba-2; the served decays' rank tells Mamba-1's [B,T,E,N] apart).
enum class Scan { ssd, delta, selective, rg_lru, short_conv, wkv, mlstm };

Scan scan_of(const Model& model, int layer, LayerKind kind) {
  switch (kind) {
    case LayerKind::gated_deltanet: return Scan::delta;
    case LayerKind::lightning: return Scan::ssd;
    case LayerKind::rg_lru: return Scan::rg_lru;
    case LayerKind::short_conv: return Scan::short_conv;
    case LayerKind::rwkv: return Scan::wkv;
    case LayerKind::mlstm: return Scan::mlstm;
    default: break;
  }
  for (const ValueInfo& v : model.values(1, 1))
    if (v.site.layer == layer && v.site.value == Value::decays) return v.shape.size() == 4 ? Scan::selective : Scan::ssd;
  return Scan::ssd;
}

// The layer's scan inputs of one fresh run of `batch`, as the kernel read them.
struct Inputs {
  LayerKind kind = LayerKind::mamba2;
  Scan scan = Scan::ssd;
  Tensor q, k, v, beta, decay;
  detail::FamilyModel::MixerConsts consts;
  std::vector<int64_t> first;
  int64_t B = 0, T = 0, H = 0, P = 1;  ///< the values viewed [B,T,H,P] (per-channel kinds: H channels, P = 1)
};

Inputs run_inputs(const Model& model, const Batch& batch, int layer) {
  const ModelInfo& info = model.info();
  if (layer < 0 || layer >= info.num_layers)
    throw InputError("token_mixing: layer " + std::to_string(layer) + " is out of range (the model has " +
                     std::to_string(info.num_layers) + " layers)");
  const auto sup = model.support();
  const auto it = sup.find("linear_attn.token_mixing");
  const std::string why = it == sup.end() ? std::string("not served by ") + info.family : it->second.at(layer);
  if (!why.empty()) throw UnsupportedError("token_mixing of layer " + std::to_string(layer) + ": " + why);
  const std::string p = "layers." + std::to_string(layer) + ".linear_attn.";
  Inputs in;
  in.kind = info.layer_kinds[static_cast<size_t>(layer)];
  in.scan = scan_of(model, layer, in.kind);
  // What each kind's mixing reads (docs/values.md "Token mixing").
  const bool qk = in.scan != Scan::rg_lru, q = qk && in.scan != Scan::wkv;
  const bool betas = in.scan == Scan::delta || in.scan == Scan::selective || in.scan == Scan::rg_lru || in.scan == Scan::mlstm ||
                     (in.scan == Scan::ssd && in.kind != LayerKind::lightning);
  const bool decays = in.scan != Scan::short_conv;
  Trace tr;
  tr.save(p + "attention_values", Steps::only(0));
  if (q) tr.save(p + "attention_queries", Steps::only(0));
  if (qk) tr.save(p + "attention_keys", Steps::only(0));
  if (betas) tr.save(p + "betas", Steps::only(0));
  if (decays) tr.save(p + "decays", Steps::only(0));
  // Last-position logits only: the values are all that is read (every position's logits cost a 4k-token
  // prompt ~4 GiB at a 248k vocabulary and a third of the call's time, measured on the Qwen3.5-0.8B layout).
  model.run(batch, &tr, nullptr, false);
  in.v = tr.get(p + "attention_values");
  if (q) in.q = tr.get(p + "attention_queries");
  if (qk) in.k = tr.get(p + "attention_keys");
  if (betas) in.beta = tr.get(p + "betas");
  if (decays) in.decay = tr.get(p + "decays");
  in.consts = detail::ModelAccess::family(model).mixer_consts(layer);
  in.first = detail::first_real_tokens(batch);
  in.B = in.v.size(0);
  in.T = in.v.size(1);
  in.H = in.v.size(2);
  in.P = in.v.dim() == 4 ? in.v.size(3) : 1;
  if (in.scan == Scan::mlstm) {  // values [B,T,NH*Dv]: per head
    in.H = in.beta.size(2);
    in.P = in.v.size(2) / in.H;
  }
  return in;
}

// The SSD scan inputs (Mamba-2: dt = betas, log decay = decays = A dt as the kernel forms it;
// lightning: dt = 1, its decays) over saved values [B,T,...]; `ones` holds lightning's dt.
detail::SsdBatch ssd_batch(const Inputs& in, Tensor& ones) {
  detail::SsdBatch sb;
  sb.B = in.B; sb.T = in.T; sb.H = in.H; sb.P = in.P;
  sb.G = in.q.size(2); sb.N = in.q.size(3);
  sb.x = in.v.data(); sb.Bm = in.k.data(); sb.C = in.q.data(); sb.da = in.decay.data();
  if (in.beta.defined()) {
    sb.dt = in.beta.data();
  } else {
    ones = Tensor({sb.B, sb.T, sb.H});
    for (int64_t i = 0; i < ones.numel(); ++i) ones[i] = 1.0f;
    sb.dt = ones.data();
  }
  return sb;
}

// The delta rule's inputs over saved values (q, k before the in-kernel L2 norm, as served).
detail::GatedDeltaArgs gdn_args(const Inputs& in) {
  detail::GatedDeltaArgs a;
  a.B = in.B; a.T = in.T; a.H = in.H; a.Dk = in.q.size(3); a.Dv = in.P;
  a.q = in.q.data(); a.k = in.k.data(); a.v = in.v.data(); a.beta = in.beta.data(); a.g = in.decay.data();
  a.g_per_key = in.decay.dim() == 4;  // Kimi Delta Attention: one decay per key channel
  return a;
}

// Mamba-1: B / C are [B,T,N] (one group) or Zamba's [B,T,heads,N].
detail::SelectiveMixArgs selective_args(const Inputs& in) {
  detail::SelectiveMixArgs a;
  a.B = in.B; a.T = in.T; a.E = in.H; a.N = in.q.size(in.q.dim() - 1); a.groups = in.q.dim() == 4 ? in.q.size(2) : 1;
  a.u = in.v.data(); a.dt = in.beta.data(); a.Bm = in.k.data(); a.C = in.q.data(); a.decay = in.decay.data();
  return a;
}

// RG-LRU over a fresh prompt: a row's first real token is its position 0 (the reset).
detail::RgLruMixArgs rg_lru_args(const Inputs& in, std::vector<int64_t>& pos) {
  pos.assign(static_cast<size_t>(in.B * in.T), 1);
  for (int64_t b = 0; b < in.B; ++b)
    for (int64_t t = in.first[static_cast<size_t>(b)]; t < in.T; ++t)
      pos[static_cast<size_t>(b * in.T + t)] = t - in.first[static_cast<size_t>(b)];
  detail::RgLruMixArgs a;
  a.B = in.B; a.T = in.T; a.W = in.H; a.u = in.v.data(); a.ig = in.beta.data(); a.la = in.decay.data(); a.pos = pos.data();
  return a;
}

detail::ShortConvMixArgs short_conv_args(const Inputs& in) {
  detail::ShortConvMixArgs a;
  a.B = in.B; a.T = in.T; a.D = in.H; a.K = in.consts.conv_wT.size(0);
  a.Bg = in.k.data(); a.Cg = in.q.data(); a.x = in.v.data(); a.conv_wT = in.consts.conv_wT.data();
  return a;
}

// RWKV-4 from transformers' fresh state: num = den = 0, max = -1e30 (kRwkvFreshMax).
detail::RwkvMixArgs rwkv_args(const Inputs& in, Tensor& start) {
  start = Tensor({in.B, 3 * in.H});
  for (int64_t b = 0; b < in.B; ++b)
    for (int64_t c = 0; c < in.H; ++c) start[b * 3 * in.H + 2 * in.H + c] = detail::kRwkvFreshMax;
  detail::RwkvMixArgs a;
  a.B = in.B; a.T = in.T; a.A = in.H; a.k = in.k.data(); a.v = in.v.data(); a.w = in.decay.data();
  a.u = in.consts.bonus.data(); a.start = start.data(); a.row_stride = 3 * in.H;
  return a;
}

// mLSTM from xLSTMCache's fresh state (all zeros: C, n and m).
detail::MlstmMixArgs mlstm_args(const Inputs& in, Tensor& start) {
  detail::MlstmMixArgs a;
  a.d.NH = in.H; a.d.Dqk = in.q.size(2) / in.H; a.d.Dv = in.P; a.d.eps = in.consts.eps;
  a.B = in.B; a.T = in.T;
  a.q = in.q.data(); a.k = in.k.data(); a.v = in.v.data(); a.betas = in.beta.data(); a.lf = in.decay.data();
  start = Tensor({in.B, a.d.NH * (a.d.Dqk + 1)});
  a.n_in = start.data();
  a.m_in = start.data() + a.d.NH * a.d.Dqk;
  a.stride = a.d.NH * (a.d.Dqk + 1);
  return a;
}

// One kind's mixing block (M [B,heads,rows,cols]) over the saved inputs.
void mixing_block(const Inputs& in, const detail::MixBlock& blk, float* M) {
  Tensor tmp;
  std::vector<int64_t> pos;
  switch (in.scan) {
    case Scan::ssd: return detail::ssd_token_mixing(ssd_batch(in, tmp), in.first, blk, M, nullptr);
    case Scan::delta: return detail::gated_delta_token_mixing(gdn_args(in), in.first, blk, M, nullptr);
    case Scan::selective: return detail::mamba_token_mixing(selective_args(in), in.first, blk, M, nullptr);
    case Scan::rg_lru: return detail::rg_lru_token_mixing(rg_lru_args(in, pos), in.first, blk, M, nullptr);
    case Scan::short_conv: return detail::short_conv_token_mixing(short_conv_args(in), in.first, blk, M, nullptr);
    case Scan::wkv: return detail::rwkv_token_mixing(rwkv_args(in, tmp), in.first, blk, M, nullptr);
    case Scan::mlstm: return detail::mlstm_token_mixing(mlstm_args(in, tmp), in.first, blk, M, nullptr);
  }
}

}  // namespace

TokenMixing token_mixing(const Model& model, const Batch& batch, const MixingQuery& q) {
  const Inputs in = run_inputs(model, batch, q.layer);
  const int64_t B = in.B, T = in.T, H = in.H, P = in.P;
  const auto [r0, r1] = resolve_span(q.rows, T, "rows");
  const auto [c0, c1] = resolve_span(q.cols, T, "cols");
  const auto [h0, h1] = resolve_span(q.heads, H, "heads");
  const detail::MixBlock blk{r0, r1, c0, c1, h0, h1};
  TokenMixing out;
  out.mixing = Tensor({B, h1 - h0, r1 - r0, c1 - c0});
  out.skip = Tensor({B, r1 - r0, h1 - h0, P});
  mixing_block(in, blk, out.mixing.data());
  const Tensor& D = in.consts.skip;
  const Tensor& cb = in.consts.conv_bias;
  out.skip_meaning = D.defined() ? (in.scan == Scan::selective ? "D u" : "D x") : cb.defined() ? "C * conv_bias" : "none";
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < r1 - r0; ++i)
      for (int64_t h = h0; h < h1; ++h)
        for (int64_t pp = 0; pp < P; ++pp) {
          const int64_t t = r0 + i, src = ((b * T + t) * H + h) * P + pp;
          float& o = out.skip[((b * (r1 - r0) + i) * (h1 - h0) + h - h0) * P + pp];
          // The short conv's bias is read through C at real tokens only (padded tokens read nothing).
          if (D.defined()) o = D[h] * in.v[src];
          else if (cb.defined() && t >= in.first[static_cast<size_t>(b)]) o = in.q[src] * cb[h];
        }
  return out;
}

Tensor state_contributions(const Model& model, const Batch& batch, const MixingQuery& q, int64_t t) {
  const Inputs in = run_inputs(model, batch, q.layer);
  const int64_t B = in.B, T = in.T, H = in.H;
  const int64_t tt = resolve(t, T);
  if (tt < 0 || tt >= T)
    throw InputError("state_contributions: token " + std::to_string(t) + " is out of range for a call of " + std::to_string(T) + " tokens");
  const auto [c0, c1] = resolve_span(q.cols, T, "cols");
  const auto [h0, h1] = resolve_span(q.heads, H, "heads");
  const detail::MixBlock blk{0, 0, c0, c1, h0, h1};
  const int64_t Hn = h1 - h0, Cn = c1 - c0;
  Tensor tmp;
  std::vector<int64_t> pos;
  switch (in.scan) {
    case Scan::delta: {
      const detail::GatedDeltaArgs a = gdn_args(in);
      Tensor out({B, Hn, Cn, a.Dk, a.Dv});
      detail::gated_delta_state_contributions(a, in.first, tt, blk, out.data());
      return out;
    }
    case Scan::ssd: {
      const detail::SsdBatch sb = ssd_batch(in, tmp);
      Tensor out({B, Hn, Cn, sb.N, sb.P});
      detail::ssd_state_contributions(sb, in.first, tt, blk, out.data());
      return out;
    }
    case Scan::selective: {
      const detail::SelectiveMixArgs a = selective_args(in);
      Tensor out({B, Hn, Cn, a.N});
      detail::mamba_state_contributions(a, in.first, tt, blk, out.data());
      return out;
    }
    case Scan::rg_lru: {
      Tensor out({B, Hn, Cn});
      detail::rg_lru_state_contributions(rg_lru_args(in, pos), in.first, tt, blk, out.data());
      return out;
    }
    case Scan::short_conv: {
      const detail::ShortConvMixArgs a = short_conv_args(in);
      Tensor out({B, Hn, Cn, a.K});
      detail::short_conv_state_contributions(a, in.first, tt, blk, out.data());
      return out;
    }
    case Scan::wkv: {
      Tensor out({B, Hn, Cn, 2});
      detail::rwkv_state_contributions(rwkv_args(in, tmp), in.first, tt, blk, out.data());
      return out;
    }
    case Scan::mlstm: {
      const detail::MlstmMixArgs a = mlstm_args(in, tmp);
      Tensor out({B, Hn, Cn, a.d.Dqk, a.d.Dv + 1});
      detail::mlstm_state_contributions(a, in.first, tt, blk, out.data());
      return out;
    }
  }
  return Tensor();
}

}  // namespace mixlens
