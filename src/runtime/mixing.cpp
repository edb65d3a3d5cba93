// token_mixing / state_contributions (include/mixlens/mixing.h): run the prompt saving the layer's
// scan inputs as served, then ask the kind's mixing code (next to its kernels) for the block.
#include "mixlens/mixing.h"

#include <algorithm>
#include <vector>

#include "hooks/mixing.h"
#include "hooks/serve.h"
#include "mixers/gated_delta.h"
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

// The layer's scan inputs of one fresh run of `batch`, as the kernel read them.
struct Inputs {
  LayerKind kind = LayerKind::mamba2;
  Tensor q, k, v, beta, decay, skip;
  std::vector<int64_t> first;
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
  const bool has_betas = in.kind != LayerKind::lightning;
  Trace tr;
  for (const char* n : {"attention_queries", "attention_keys", "attention_values", "decays"}) tr.save(p + n, Steps::only(0));
  if (has_betas) tr.save(p + "betas", Steps::only(0));
  model.run(batch, &tr);
  in.q = tr.get(p + "attention_queries");
  in.k = tr.get(p + "attention_keys");
  in.v = tr.get(p + "attention_values");
  in.decay = tr.get(p + "decays");
  if (has_betas) in.beta = tr.get(p + "betas");
  in.skip = detail::ModelAccess::family(model).mixer_skip(layer);
  in.first = detail::first_real_tokens(batch);
  return in;
}

// The SSD scan inputs (Mamba-2: dt = betas, log decay = decays = A dt as the kernel forms it;
// lightning: dt = 1, its decays) over saved values [B,T,...]; `ones` holds lightning's dt.
detail::SsdBatch ssd_batch(const Inputs& in, Tensor& ones) {
  detail::SsdBatch sb;
  sb.B = in.v.size(0); sb.T = in.v.size(1); sb.H = in.v.size(2); sb.P = in.v.size(3);
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
  a.B = in.v.size(0); a.T = in.v.size(1); a.H = in.v.size(2); a.Dk = in.q.size(3); a.Dv = in.v.size(3);
  a.q = in.q.data(); a.k = in.k.data(); a.v = in.v.data(); a.beta = in.beta.data(); a.g = in.decay.data();
  a.g_per_key = in.decay.dim() == 4;  // Kimi Delta Attention: one decay per key channel
  return a;
}

bool is_ssd(LayerKind k) { return k == LayerKind::mamba2 || k == LayerKind::hybrid || k == LayerKind::lightning; }

[[noreturn]] void not_derived(const Inputs& in) {
  throw UnsupportedError(std::string("token_mixing: no mixing for a ") + std::string(layer_kind_name(in.kind)) + " block");
}

}  // namespace

TokenMixing token_mixing(const Model& model, const Batch& batch, const MixingQuery& q) {
  const Inputs in = run_inputs(model, batch, q.layer);
  const int64_t B = in.v.size(0), T = in.v.size(1), H = in.v.size(2), P = in.v.size(3);
  const auto [r0, r1] = resolve_span(q.rows, T, "rows");
  const auto [c0, c1] = resolve_span(q.cols, T, "cols");
  const auto [h0, h1] = resolve_span(q.heads, H, "heads");
  const detail::MixBlock blk{r0, r1, c0, c1, h0, h1};
  TokenMixing out;
  out.mixing = Tensor({B, h1 - h0, r1 - r0, c1 - c0});
  out.skip = Tensor({B, r1 - r0, h1 - h0, P});
  out.skip_meaning = in.skip.defined() ? "D x" : "none";
  if (in.kind == LayerKind::gated_deltanet) {
    detail::gated_delta_token_mixing(gdn_args(in), in.first, blk, out.mixing.data(), nullptr);
  } else {
    if (!is_ssd(in.kind)) not_derived(in);
    Tensor ones;
    detail::ssd_token_mixing(ssd_batch(in, ones), in.first, blk, out.mixing.data(), nullptr);
  }
  if (in.skip.defined())
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < r1 - r0; ++i)
        for (int64_t h = h0; h < h1; ++h)
          for (int64_t pp = 0; pp < P; ++pp)
            out.skip[((b * (r1 - r0) + i) * (h1 - h0) + h - h0) * P + pp] = in.skip[h] * in.v[((b * T + r0 + i) * H + h) * P + pp];
  return out;
}

Tensor state_contributions(const Model& model, const Batch& batch, const MixingQuery& q, int64_t t) {
  const Inputs in = run_inputs(model, batch, q.layer);
  const int64_t B = in.v.size(0), T = in.v.size(1), H = in.v.size(2);
  const int64_t tt = resolve(t, T);
  if (tt < 0 || tt >= T)
    throw InputError("state_contributions: token " + std::to_string(t) + " is out of range for a call of " + std::to_string(T) + " tokens");
  const auto [c0, c1] = resolve_span(q.cols, T, "cols");
  const auto [h0, h1] = resolve_span(q.heads, H, "heads");
  const detail::MixBlock blk{0, 0, c0, c1, h0, h1};
  if (in.kind == LayerKind::gated_deltanet) {
    const detail::GatedDeltaArgs a = gdn_args(in);
    Tensor out({B, h1 - h0, c1 - c0, a.Dk, a.Dv});
    detail::gated_delta_state_contributions(a, in.first, tt, blk, out.data());
    return out;
  }
  if (!is_ssd(in.kind)) not_derived(in);
  Tensor ones;
  const detail::SsdBatch sb = ssd_batch(in, ones);
  Tensor out({B, h1 - h0, c1 - c0, sb.N, sb.P});
  detail::ssd_state_contributions(sb, in.first, tt, blk, out.data());
  return out;
}

}  // namespace mixlens
