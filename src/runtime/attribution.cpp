// Residual decomposition, direct logit attribution and attribution patching (mixlens/attribution.h,
// docs/attribution.md). Everything is read from served values of ordinary forwards and backwards, so
// every family that serves layer_input / layer_output (all of them) is covered without family code
// beyond FamilyModel::residual_write.
#include "mixlens/attribution.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>

#include "mixlens/errors.h"
#include "mixlens/trace.h"
#include "models/family.h"
#include "ops/dtype.h"
#include "ops/ops.h"
#include "runtime/model_access.h"

namespace mixlens {

detail::FamilyModel::ResidualWrite detail::FamilyModel::residual_write(int layer) const {
  ResidualWrite w;
  const ValueTable& t = value_table();
  for (const char* v : {"linear_attn.attention_output", "self_attn.attention_output", "mlp.output"})
    if (t.at.count("layers." + std::to_string(layer) + "." + v)) w.added.emplace_back(v);
  return w;
}

namespace {

std::string layer_path(int i, const std::string& rest) { return "layers." + std::to_string(i) + "." + rest; }

std::vector<int64_t> resolve_positions(const std::vector<int64_t>& positions, int64_t T, const char* what) {
  if (positions.empty()) throw InputError(std::string(what) + ": give at least one position");
  std::vector<int64_t> out;
  for (int64_t p : positions) out.push_back(resolve_token(p, T, what));
  return out;
}

// x [B, T, ...] -> [B, P, ...] at call positions `pos`.
Tensor gather(const Tensor& x, const std::vector<int64_t>& pos) {
  const int64_t B = x.size(0), T = x.size(1), F = x.numel() / (B * T), P = static_cast<int64_t>(pos.size());
  Shape s = x.shape();
  s[1] = P;
  Tensor out(s);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = 0; j < P; ++j)
      std::copy_n(x.data() + (b * T + pos[static_cast<size_t>(j)]) * F, F, out.data() + (b * P + j) * F);
  return out;
}

// The logits the forward returned ([B,T,V], or [B,1,V] for the last position) at `pos`.
Tensor logits_at(const Tensor& logits, const std::vector<int64_t>& pos, int64_t T) {
  if (logits.size(1) == T) return gather(logits, pos);
  return logits;  // all_logits was false: pos is {T - 1}
}

bool last_only(const std::vector<int64_t>& pos, int64_t T) { return pos.size() == 1 && pos[0] == T - 1; }

// One forward of `batch` saving `paths`; returns the logits at `pos`.
Tensor run_saving(const Model& model, const Batch& batch, Trace& tr, const std::vector<std::string>& paths,
                  const std::vector<int64_t>& pos) {
  for (const std::string& p : paths) tr.save(p);
  const Tensor logits = model.run(batch, &tr, nullptr, !last_only(pos, batch.seq));
  return logits_at(logits, pos, batch.seq);
}

ResidStack stack_header(ResidStack::Kind kind, const Batch& batch, const std::vector<int64_t>& positions,
                        const char* what) {
  ResidStack s;
  s.kind = kind;
  s.positions = resolve_positions(positions, batch.seq, what);
  return s;
}

// Stacks `parts` ([B,P,D] each) into s.components [C,B,P,D].
void stack_components(ResidStack& s, const std::vector<Tensor>& parts) {
  const Tensor& r = s.resid;
  Tensor c({static_cast<int64_t>(parts.size()), r.size(0), r.size(1), r.size(2)});
  for (size_t k = 0; k < parts.size(); ++k)
    std::copy_n(parts[k].data(), r.numel(), c.data() + static_cast<int64_t>(k) * r.numel());
  s.components = std::move(c);
}

// The final norm of a family with a declared head, in double: weight (1 + w when zero-centred), eps, and
// one row of the LM head (narrow weights widened exactly).
struct Norm {
  std::vector<double> w;
  double eps = 0.0, logit_scale = 1.0;
  const Tensor* lm_head = nullptr;
  int64_t D = 0;
  explicit Norm(const Model& model) {
    const detail::FamilyModel::Head h = detail::ModelAccess::family(model).head();  // UnsupportedError if none
    D = model.info().hidden_size;
    for (int64_t d = 0; d < D; ++d) w.push_back((h.zero_centred ? 1.0 : 0.0) + (*h.norm)[d]);
    eps = h.eps;
    logit_scale = h.logit_scale;
    lm_head = h.lm_head;
  }
  // 1 / sqrt(mean(x^2) + eps): the RMSNorm's scale of one row.
  double inv_rms(const float* x) const {
    double ss = 0.0;
    for (int64_t d = 0; d < D; ++d) ss += static_cast<double>(x[d]) * x[d];
    return 1.0 / std::sqrt(ss / static_cast<double>(D) + eps);
  }
  std::vector<float> head_row(int32_t tok) const {
    std::vector<float> row(static_cast<size_t>(D));
    ops::copy_row(*lm_head, tok, row.data());
    return row;
  }
};

}  // namespace

ResidStack decompose_resid(const Model& model, const Batch& batch, const std::vector<int64_t>& positions) {
  const detail::FamilyModel& fam = detail::ModelAccess::family(model);
  ResidStack s = stack_header(ResidStack::Kind::decomposed, batch, positions, "decompose_resid");
  const int L = model.info().num_layers;
  std::vector<detail::FamilyModel::ResidualWrite> rules;
  std::vector<std::string> paths = {"layers.0.layer_input", layer_path(L - 1, "layer_output")};
  for (int i = 0; i < L; ++i) {
    rules.push_back(fam.residual_write(i));
    const auto& r = rules.back();
    if (!r.why.empty()) {
      paths.push_back(layer_path(i, "layer_input"));
      paths.push_back(layer_path(i, "layer_output"));
    } else {
      for (const std::string& a : r.added) paths.push_back(layer_path(i, a));
    }
  }
  std::sort(paths.begin(), paths.end());
  paths.erase(std::unique(paths.begin(), paths.end()), paths.end());
  Trace tr;
  s.logits = run_saving(model, batch, tr, paths, s.positions);
  const auto at = [&](const std::string& p) { return gather(tr.get(p), s.positions); };
  s.resid = at(layer_path(L - 1, "layer_output"));
  // after[i]: the product of the residual scalings of blocks i.. (a whole-block component carries its own).
  std::vector<double> after(static_cast<size_t>(L) + 1, 1.0);
  for (int i = L - 1; i >= 0; --i) {
    const auto& r = rules[static_cast<size_t>(i)];
    after[static_cast<size_t>(i)] = after[static_cast<size_t>(i) + 1] * (r.why.empty() ? r.scale : 1.0);
  }
  std::vector<Tensor> parts;
  const auto add = [&](Tensor t, double scale, std::string label, std::string source, int layer) {
    if (scale != 1.0)
      for (int64_t k = 0; k < t.numel(); ++k) t[k] = static_cast<float>(t[k] * scale);
    parts.push_back(std::move(t));
    s.labels.push_back(std::move(label));
    s.sources.push_back(std::move(source));
    s.layers.push_back(layer);
  };
  add(at("layers.0.layer_input"), after[0], "embed", "layers.0.layer_input", -1);
  for (int i = 0; i < L; ++i) {
    const auto& r = rules[static_cast<size_t>(i)];
    const std::string block = "layers." + std::to_string(i);
    if (!r.why.empty()) {
      Tensor d = at(layer_path(i, "layer_output"));
      const Tensor in = at(layer_path(i, "layer_input"));
      for (int64_t k = 0; k < d.numel(); ++k) d[k] -= in[k];
      add(std::move(d), after[static_cast<size_t>(i) + 1], block, block + ".layer_output - " + block + ".layer_input", i);
      continue;
    }
    for (const std::string& a : r.added)
      add(at(layer_path(i, a)), after[static_cast<size_t>(i)], block + "." + a.substr(0, a.find('.')), layer_path(i, a), i);
  }
  stack_components(s, parts);
  // The check that makes a wrong residual rule an error rather than a wrong answer.
  const int64_t D = s.resid.size(2), rows = s.resid.numel() / D, C = static_cast<int64_t>(parts.size());
  for (int64_t r = 0; r < rows; ++r) {
    double err = 0.0, norm = 0.0;
    for (int64_t d = 0; d < D; ++d) {
      double sum = 0.0;
      for (int64_t c = 0; c < C; ++c) sum += s.components[(c * rows + r) * D + d];
      const double want = s.resid[r * D + d];
      err += (sum - want) * (sum - want);
      norm += want * want;
    }
    s.max_rel_error = std::max(s.max_rel_error, std::sqrt(err) / std::max(std::sqrt(norm), 1e-30));
  }
  if (s.max_rel_error > 1e-4)
    throw Error("decompose_resid: the components of " + model.info().family + " sum to the residual only within " +
                std::to_string(s.max_rel_error) + " (relative): its FamilyModel::residual_write is wrong");
  return s;
}

ResidStack accumulated_resid(const Model& model, const Batch& batch, const std::vector<int64_t>& positions) {
  ResidStack s = stack_header(ResidStack::Kind::accumulated, batch, positions, "accumulated_resid");
  const int L = model.info().num_layers;
  std::vector<std::string> paths = {"layers.0.layer_input"};
  for (int i = 0; i < L; ++i) paths.push_back(layer_path(i, "layer_output"));
  Trace tr;
  s.logits = run_saving(model, batch, tr, paths, s.positions);
  std::vector<Tensor> parts;
  for (size_t k = 0; k < paths.size(); ++k) {
    parts.push_back(gather(tr.get(paths[k]), s.positions));
    s.labels.push_back(k == 0 ? "embed" : "layers." + std::to_string(k - 1));
    s.sources.push_back(paths[k]);
    s.layers.push_back(static_cast<int>(k) - 1);
  }
  s.resid = parts.back();
  stack_components(s, parts);
  return s;
}

Tensor apply_ln_to_stack(const Model& model, const ResidStack& stack) {
  const Norm n(model);
  const Tensor& c = stack.components;
  const int64_t D = n.D, rows = stack.resid.numel() / D, C = c.size(0);
  Tensor out(c.shape());
  for (int64_t r = 0; r < rows; ++r) {
    const double inv = n.inv_rms(stack.resid.data() + r * D);
    for (int64_t k = 0; k < C; ++k)
      for (int64_t d = 0; d < D; ++d) {
        const int64_t e = (k * rows + r) * D + d;
        out[e] = static_cast<float>(c[e] * inv * n.w[static_cast<size_t>(d)]);
      }
  }
  return out;
}

Tensor logit_attrs(const Model& model, const ResidStack& stack, const std::vector<int32_t>& tokens,
                   const std::vector<int32_t>& incorrect, LnMode mode) {
  const Norm n(model);
  const int64_t B = stack.resid.size(0), P = stack.resid.size(1), D = n.D, C = stack.components.size(0);
  const int64_t V = model.info().vocab_size;
  if (tokens.size() != 1 && static_cast<int64_t>(tokens.size()) != B)
    throw InputError("logit_attrs: give one token or one per row (" + std::to_string(B) + "), got " +
                     std::to_string(tokens.size()));
  if (!incorrect.empty() && incorrect.size() != tokens.size())
    throw InputError("logit_attrs: incorrect_tokens must have the size of tokens (" + std::to_string(tokens.size()) +
                     "), got " + std::to_string(incorrect.size()));
  for (const auto* list : {&tokens, &incorrect})
    for (int32_t t : *list)
      if (t < 0 || t >= V)
        throw InputError("logit_attrs: token " + std::to_string(t) + " is outside the vocabulary [0, " +
                         std::to_string(V) + ")");
  Tensor out({C, B, P});
  std::vector<double> u(static_cast<size_t>(D));
  for (int64_t b = 0; b < B; ++b) {
    // u = logit_scale * w ⊙ (W_U[token] - W_U[incorrect]): the logit difference is inv_rms(x) * x . u.
    const size_t ti = tokens.size() == 1 ? 0 : static_cast<size_t>(b);
    const std::vector<float> up = n.head_row(tokens[ti]);
    const std::vector<float> down = incorrect.empty() ? std::vector<float>(static_cast<size_t>(D), 0.0f)
                                                      : n.head_row(incorrect[ti]);
    for (int64_t d = 0; d < D; ++d) {
      const size_t k = static_cast<size_t>(d);
      u[k] = n.logit_scale * n.w[k] * (static_cast<double>(up[k]) - down[k]);
    }
    const auto dot = [&](const float* x, const float* minus) {
      double s = 0.0;
      for (int64_t d = 0; d < D; ++d) s += (minus ? static_cast<double>(x[d]) - minus[d] : x[d]) * u[static_cast<size_t>(d)];
      return s;
    };
    for (int64_t p = 0; p < P; ++p) {
      const float* resid = stack.resid.data() + (b * P + p) * D;
      const double inv = n.inv_rms(resid), full = dot(resid, nullptr) * inv;
      for (int64_t c = 0; c < C; ++c) {
        const float* x = stack.components.data() + ((c * B + b) * P + p) * D;
        double a;
        if (mode == LnMode::frozen) {
          a = dot(x, nullptr) * inv;
        } else if (stack.kind == ResidStack::Kind::decomposed) {
          std::vector<float> rest(static_cast<size_t>(D));
          for (int64_t d = 0; d < D; ++d) rest[static_cast<size_t>(d)] = resid[d] - x[d];
          a = full - dot(rest.data(), nullptr) * n.inv_rms(rest.data());
        } else {
          a = dot(x, nullptr) * n.inv_rms(x);
        }
        out[(c * B + b) * P + p] = static_cast<float>(a);
      }
    }
  }
  return out;
}

// ---- attribution patching ----------------------------------------------------------------------

namespace {

const std::vector<std::string>& node_kinds() {
  static const std::vector<std::string> k = {"layer_output", "linear_attn.attention_output", "self_attn.attention_output",
                                             "mlp.output", "linear_attn.state"};
  return k;
}

// Call positions t0 .. t1-1; with `repeat_last`, t1-1 once more.
std::vector<int64_t> span(int64_t t0, int64_t t1, bool repeat_last = false) {
  std::vector<int64_t> pos(static_cast<size_t>(t1 - t0));
  std::iota(pos.begin(), pos.end(), t0);
  if (repeat_last) pos.push_back(t1 - 1);
  return pos;
}

// The tokens of `b` at `pos` as a batch of their own (a prefix or a continuation).
Batch slice(const Batch& b, const std::vector<int64_t>& pos) {
  Batch out;
  out.batch = b.batch;
  out.seq = static_cast<int64_t>(pos.size());
  for (int64_t r = 0; r < b.batch; ++r)
    for (int64_t t : pos) {
      out.ids.push_back(b.ids[static_cast<size_t>(r * b.seq + t)]);
      out.mask.push_back(b.mask[static_cast<size_t>(r * b.seq + t)]);
    }
  if (b.embeds.defined()) out.embeds = gather(b.embeds, pos);
  return out;
}

// (1 - a) x + a y, elementwise.
Tensor lerp(const Tensor& x, const Tensor& y, double a) {
  Tensor out(x.shape());
  for (int64_t k = 0; k < x.numel(); ++k) out[k] = static_cast<float>(x[k] + a * (static_cast<double>(y[k]) - x[k]));
  return out;
}

void accumulate(Tensor& sum, const Tensor& g, double w) {
  if (!sum.defined()) sum = Tensor(g.shape());
  for (int64_t k = 0; k < g.numel(); ++k) sum[k] = static_cast<float>(sum[k] + w * g[k]);
}

}  // namespace

std::vector<AtpResult::Row> AtpResult::ranked() const {
  std::vector<Row> rows;
  const int64_t N = estimates.size(0), B = estimates.size(1), P = estimates.size(2);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t p = 0; p < P; ++p) {
      double s = 0.0;
      for (int64_t b = 0; b < B; ++b) s += estimates[(n * B + b) * P + p];
      rows.push_back({nodes[static_cast<size_t>(n)], positions[static_cast<size_t>(p)], s});
    }
  std::stable_sort(rows.begin(), rows.end(),
                   [](const Row& a, const Row& b) { return std::fabs(a.estimate) > std::fabs(b.estimate); });
  return rows;
}

AtpResult attribution_patching(const Model& model, const Batch& clean, const Batch& corrupt,
                               const LogitsMetric& metric, const AtpOptions& opt) {
  if (clean.batch != corrupt.batch || clean.seq != corrupt.seq)
    throw InputError("attribution_patching: clean and corrupt batches differ in shape ([" + std::to_string(clean.batch) +
                     ", " + std::to_string(clean.seq) + "] vs [" + std::to_string(corrupt.batch) + ", " +
                     std::to_string(corrupt.seq) + "]): pair prompts of the same token length");
  if (clean.mask != corrupt.mask)
    throw InputError("attribution_patching: clean and corrupt batches have different left padding");
  if (clean.embeds.defined() != corrupt.embeds.defined())
    throw InputError("attribution_patching: give both batches as ids or both as embeddings");
  for (const Batch* b : {&clean, &corrupt})
    if (b->ids.size() != static_cast<size_t>(b->batch * b->seq) || b->mask.size() != b->ids.size())
      throw InputError("attribution_patching: a batch's ids / mask do not have batch x seq entries");
  if (opt.ig_steps < 0) throw InputError("attribution_patching: ig_steps must be >= 0");
  if (!metric) throw InputError("attribution_patching: no metric");
  const int64_t T = clean.seq, B = clean.batch;
  AtpResult res;
  if (opt.positions.empty()) {
    for (int64_t t = 0; t < T; ++t) res.positions.push_back(t);
  } else {
    res.positions = resolve_positions(opt.positions, T, "attribution_patching position");
  }
  std::vector<int64_t> mpos = opt.metric_positions.empty()
                                  ? std::vector<int64_t>{T - 1}
                                  : resolve_positions(opt.metric_positions, T, "attribution_patching metric position");
  std::sort(mpos.begin(), mpos.end());
  mpos.erase(std::unique(mpos.begin(), mpos.end()), mpos.end());
  for (const std::string& k : opt.nodes)
    if (std::find(node_kinds().begin(), node_kinds().end(), k) == node_kinds().end())
      throw InputError("attribution_patching: unknown node kind '" + k +
                       "' (layer_output, linear_attn.attention_output, self_attn.attention_output, mlp.output, "
                       "linear_attn.state)");

  // Nodes in forward order; a state node is read from its layer's `states`.
  const detail::FamilyModel& fam = detail::ModelAccess::family(model);
  const auto& table = fam.value_table().at;
  const auto support = model.support();
  const auto state_ok = [&](int i) {
    auto it = support.find("linear_attn.state");
    if (it == support.end()) return false;
    auto r = it->second.find(i);
    return r != it->second.end() && r->second.empty() && table.count(layer_path(i, "linear_attn.state_input"));
  };
  struct Node {
    std::string path, served;
    int layer;
    bool state;
  };
  std::vector<Node> nodes;
  for (int i = 0; i < model.info().num_layers; ++i)
    for (const std::string& k : node_kinds()) {
      if (std::find(opt.nodes.begin(), opt.nodes.end(), k) == opt.nodes.end()) continue;
      const std::string p = layer_path(i, k);
      if (k == "linear_attn.state") {
        if (state_ok(i)) nodes.push_back({p, layer_path(i, "linear_attn.states"), i, true});
      } else if (table.count(p)) {
        nodes.push_back({p, p, i, false});
      }
    }
  if (nodes.empty()) throw InputError("attribution_patching: no node of the kinds asked for exists in this model");
  std::vector<std::string> served;
  for (const Node& n : nodes) served.push_back(n.served);
  served.push_back("embed_tokens.output");
  std::sort(served.begin(), served.end());
  served.erase(std::unique(served.begin(), served.end()), served.end());

  // The clean and corrupt values of every node (and their embeddings, EAP-IG's endpoints).
  Trace tc, tx;
  res.clean_metric = metric(run_saving(model, clean, tc, served, mpos)).value;
  res.corrupt_metric = metric(run_saving(model, corrupt, tx, served, mpos)).value;
  const Tensor e_clean = tc.get("embed_tokens.output"), e_corrupt = tx.get("embed_tokens.output");
  const int K = std::max(opt.ig_steps, 1);
  // Interpolation point j of K (EAP-IG), or the corrupt run itself (AtP).
  const auto alpha = [&](int j) { return opt.ig_steps == 0 ? 0.0 : static_cast<double>(j + 1) / K; };
  const auto set_embeds = [&](Trace& tr, int j, const std::vector<int64_t>& pos) {
    if (opt.ig_steps == 0) return;
    tr.set("embed_tokens.output", gather(lerp(e_corrupt, e_clean, alpha(j)), pos));
  };

  // Block nodes: the gradient at the corrupt run (AtP) or its mean over the interpolation (EAP-IG).
  std::map<std::string, Tensor> grads;
  std::vector<std::string> block_paths;
  for (const Node& n : nodes)
    if (!n.state) block_paths.push_back(n.path);
  if (!block_paths.empty())
    for (int j = 0; j < K; ++j) {
      Trace tr;
      set_embeds(tr, j, span(0, T));
      tr.enable_grad();
      model.run(corrupt, &tr, nullptr, false);
      const metrics::MetricGrad mg = metric(tr.logits_at(mpos));
      tr.backward(mg.dlogits, block_paths, mpos);
      for (const std::string& p : block_paths) accumulate(grads[p], tr.grad(p), 1.0 / K);
    }

  const int64_t N = static_cast<int64_t>(nodes.size()), P = static_cast<int64_t>(res.positions.size());
  res.estimates = Tensor({N, B, P});
  const auto dot_at = [&](const Tensor& cl, const Tensor& co, const Tensor& g, int64_t b, int64_t t, int64_t gt) {
    // sum over one token's elements of (clean - corrupt) * grad; `gt` the gradient's token index.
    const int64_t F = cl.numel() / (cl.size(0) * cl.size(1)), GT = g.size(1);
    double s = 0.0;
    for (int64_t f = 0; f < F; ++f) {
      const int64_t e = (b * T + t) * F + f;
      s += (static_cast<double>(cl[e]) - co[e]) * g[(b * GT + gt) * F + f];
    }
    return s;
  };
  for (int64_t n = 0; n < N; ++n) {
    const Node& nd = nodes[static_cast<size_t>(n)];
    res.nodes.push_back(nd.path);
    res.layers.push_back(nd.layer);
    if (nd.state) continue;
    const Tensor cl = tc.get(nd.served), co = tx.get(nd.served), &g = grads.at(nd.path);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t p = 0; p < P; ++p)
        res.estimates[(n * B + b) * P + p] = static_cast<float>(dot_at(cl, co, g, b, res.positions[static_cast<size_t>(p)],
                                                                       res.positions[static_cast<size_t>(p)]));
  }

  // State nodes: a write of state_after(t) changes tokens t+1.. only (docs/values.md), so its gradient is
  // state_input's of a continuation from t+1 (the served `states` gradient also holds token t's own read).
  std::vector<std::string> state_inputs;
  for (const Node& nd : nodes)
    if (nd.state) state_inputs.push_back(layer_path(nd.layer, "linear_attn.state_input"));
  const int64_t last_metric = mpos.back();
  if (!state_inputs.empty())
    for (int64_t p = 0; p < P; ++p) {
      const int64_t t = res.positions[static_cast<size_t>(p)];
      if (t >= last_metric) continue;  // nothing the metric reads comes after: the estimate is 0
      // A one-token continuation would be a decode step, which some families compute unlike a prompt
      // (transformers' dt clamp on prompts only): the last token goes twice, the copy after every metric position.
      const std::vector<int64_t> prefix = span(0, t + 1), after = span(t + 1, T, t + 2 == T);
      const Batch rest = slice(corrupt, after);
      if (rest.has_padding())
        throw UnsupportedError("attribution_patching: a state node at position " + std::to_string(t) +
                               " of a row that is still left padding after it (its continuation would be padded); "
                               "give positions past every row's padding");
      std::vector<int64_t> cpos;
      for (int64_t m : mpos)
        if (m > t) cpos.push_back(m - t - 1);
      std::map<std::string, Tensor> g;
      for (int j = 0; j < K; ++j) {
        Cache cache = model.new_cache(B);
        Trace pre;
        set_embeds(pre, j, prefix);
        model.forward(slice(corrupt, prefix), cache, &pre, false);
        Trace tr;
        set_embeds(tr, j, after);
        tr.enable_grad();
        model.forward(rest, cache, &tr, false);
        // A metric over positions before t + 1 as well sees zeros there: they do not depend on the state.
        const Tensor part = tr.logits_at(cpos);
        Tensor lg({B, static_cast<int64_t>(mpos.size()), part.size(2)});
        const int64_t V = part.size(2), skip = static_cast<int64_t>(mpos.size() - cpos.size());
        for (int64_t b = 0; b < B; ++b)
          std::copy_n(part.data() + b * static_cast<int64_t>(cpos.size()) * V, static_cast<int64_t>(cpos.size()) * V,
                      lg.data() + (b * static_cast<int64_t>(mpos.size()) + skip) * V);
        const metrics::MetricGrad mg = metric(lg);
        Tensor dl({B, static_cast<int64_t>(cpos.size()), V});
        for (int64_t b = 0; b < B; ++b)
          std::copy_n(mg.dlogits.data() + (b * static_cast<int64_t>(mpos.size()) + skip) * V,
                      static_cast<int64_t>(cpos.size()) * V, dl.data() + b * static_cast<int64_t>(cpos.size()) * V);
        tr.backward(dl, state_inputs, cpos);
        for (const std::string& s : state_inputs) accumulate(g[s], tr.grad(s), 1.0 / K);
      }
      for (int64_t n = 0; n < N; ++n) {
        const Node& nd = nodes[static_cast<size_t>(n)];
        if (!nd.state) continue;
        const Tensor cl = tc.get(nd.served), co = tx.get(nd.served);
        const Tensor& gs = g.at(layer_path(nd.layer, "linear_attn.state_input"));
        const Tensor g1 = gs.reshape([&] {
          Shape s = gs.shape();
          s.insert(s.begin() + 1, 1);
          return s;
        }());
        for (int64_t b = 0; b < B; ++b)
          res.estimates[(n * B + b) * P + p] = static_cast<float>(dot_at(cl, co, g1, b, t, 0));
      }
    }
  return res;
}

}  // namespace mixlens
