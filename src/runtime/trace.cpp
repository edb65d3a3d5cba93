#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <map>
#include <optional>

#include "grad/tape.h"
#include "io/weights.h"
#include "mixers/rwkv_mixer.h"
#include "mixlens/errors.h"
#include "mixlens/trace.h"
#include "models/common.h"
#include "models/family.h"
#include "ops/env.h"
#include "runtime/model_access.h"
#include "runtime/tl_names.h"
#include "runtime/trace_listener.h"

namespace mixlens {

struct Trace::Impl {
  enum class Kind { save, edit, set };
  struct Reg {
    std::string path;
    Kind kind;
    EditFn fn;
    Tensor value;
    Steps steps;
    std::optional<int64_t> token;  // "...state@t5": the per-token state after token 5 (may be < 0)
    std::string base;              // path without the "@t" suffix
    bool tl = false;               // `base` is a TransformerLens name: saved under it (tl_key), not the canonical path
  };
  std::vector<Reg> regs;
  std::vector<std::pair<std::string, Tensor>> saved;
  uint64_t saved_bytes = 0;  // float32 bytes held by `saved`
  std::map<std::string, size_t> index;
  std::vector<CallRecord> calls;
  // Registrations resolved against a model, kept so a generation does not re-resolve every path
  // at every decode step; redone when the registrations or the model's structure (family and
  // layer kinds, which alone decide which paths exist) change.
  std::string bound_family;
  std::vector<LayerKind> bound_kinds;
  std::vector<std::vector<Site>> bound;
  // Gradients (src/grad): the record of the last call made with enable_grad, and backward's result.
  bool grad_on = false;
  std::shared_ptr<grad::Tape> tape;
  std::map<std::string, Tensor> grads;
};

Trace::Trace() : impl_(std::make_unique<Impl>()) {}
Trace::~Trace() = default;
Trace::Trace(Trace&&) noexcept = default;
Trace& Trace::operator=(Trace&&) noexcept = default;

Trace& Trace::save(std::string_view path, Steps steps) {
  impl_->regs.push_back({std::string(path), Impl::Kind::save, nullptr, Tensor(), steps, {}, {}});
  return *this;
}
Trace& Trace::edit(std::string_view path, EditFn fn, Steps steps) {
  if (!fn) throw InputError("Trace::edit('" + std::string(path) + "'): empty edit function");
  impl_->regs.push_back({std::string(path), Impl::Kind::edit, std::move(fn), Tensor(), steps, {}, {}});
  return *this;
}
Trace& Trace::set(std::string_view path, Tensor value, Steps steps) {
  if (!value.defined()) throw InputError("Trace::set('" + std::string(path) + "'): undefined tensor");
  impl_->regs.push_back({std::string(path), Impl::Kind::set, nullptr, std::move(value), steps, {}, {}});
  return *this;
}

StepPath split_step(std::string_view key) {
  static constexpr std::string_view kStep = "@step";
  const size_t at = key.rfind(kStep);
  if (at == std::string_view::npos) return {std::string(key), Steps::all()};
  const std::string_view num = key.substr(at + kStep.size());
  const bool digits = !num.empty() && num.size() <= 10 &&
                      std::all_of(num.begin(), num.end(), [](char c) { return c >= '0' && c <= '9'; });
  const long long k = digits ? std::stoll(std::string(num)) : -1;
  if (!digits || k > INT_MAX || at == 0)
    throw InputError("'" + std::string(key) + "': a step suffix is '@step<k>' at the end of a value path (k = 0 for " +
                     "the prompt, k >= 1 for the k-th decode step, e.g. 'layers.0.linear_attn.betas@step2')");
  return {std::string(key.substr(0, at)), Steps::only(static_cast<int>(k))};
}

uint64_t save_budget_bytes() {
  // Read per call (cheap): tests and long-running processes may change it.
  return detail::env_mib("MIXLENS_SAVE_BUDGET_MB", kDefaultSaveBudgetBytes >> 20, false);
}

namespace {
bool restricted(const Steps& s) { return s.first != Steps::all().first || s.last != Steps::all().last; }
}  // namespace

void detail::TraceListener::check_steps_made(const Trace& trace, int made_first, int made_last) {
  for (const auto& r : trace.impl_->regs) {
    if (!restricted(r.steps) || (r.steps.first >= made_first && r.steps.first <= made_last)) continue;
    const std::string made = made_last < made_first ? "no step"
                             : made_last == made_first ? "step " + std::to_string(made_first)
                                                       : "steps " + std::to_string(made_first) + ".." + std::to_string(made_last);
    throw InputError(std::string(r.kind == Trace::Impl::Kind::save ? "save" : "edit") + " '" + r.path + "@step" +
                     std::to_string(r.steps.first) + "': the run never made step " + std::to_string(r.steps.first) +
                     " (it ran " + made + ")");
  }
}

void detail::TraceListener::check_steps_reachable(const Trace& trace, int max_new_tokens) {
  for (const auto& r : trace.impl_->regs)
    if (restricted(r.steps) && r.steps.first >= max_new_tokens)
      throw InputError(std::string(r.kind == Trace::Impl::Kind::save ? "save" : "edit") + " '" + r.path + "@step" +
                       std::to_string(r.steps.first) + "': generate(max_new_tokens=" + std::to_string(max_new_tokens) +
                       ") never makes step " + std::to_string(r.steps.first) + " (it runs steps 0.." +
                       std::to_string(max_new_tokens - 1) + "; step 0 is the prompt)");
}

static std::string key_of(std::string_view path, int step) {
  return std::string(path) + "@step" + std::to_string(step);
}

bool Trace::has(std::string_view path, int step) const { return impl_->index.count(key_of(path, step)) > 0; }

Tensor Trace::get(std::string_view path, int step) const {
  auto it = impl_->index.find(key_of(path, step));
  if (it == impl_->index.end())
    throw UnknownValueError("'" + std::string(path) + "' was not saved at step " + std::to_string(step) +
                            (impl_->saved.empty() ? " (nothing was saved: register it with save() before the run)"
                                                  : " (saved: " + impl_->saved.front().first + ", ...)"));
  return impl_->saved[it->second].second;
}

const std::vector<std::pair<std::string, Tensor>>& Trace::saved() const { return impl_->saved; }
const std::vector<CallRecord>& Trace::calls() const { return impl_->calls; }
void Trace::clear_results() {
  impl_->saved.clear();
  impl_->saved_bytes = 0;
  impl_->index.clear();
  impl_->calls.clear();
}

Trace& Trace::enable_grad(bool on) {
  impl_->grad_on = on;
  return *this;
}
bool Trace::grad_enabled() const { return impl_->grad_on; }

void Trace::backward(const Tensor& dlogits, const std::vector<std::string>& paths) { backward(dlogits, paths, {}); }

Tensor Trace::logits_at(const std::vector<int64_t>& positions) const {
  if (!impl_->tape)
    throw InputError("logits_at: no forward call of this trace was recorded for gradients (call enable_grad() "
                     "before the run)");
  return grad::logits_at(*impl_->tape, positions);
}

void Trace::backward(const Tensor& dlogits, const std::vector<std::string>& paths,
                     const std::vector<int64_t>& positions) {
  auto& impl = *impl_;
  if (!impl.tape)
    throw InputError("backward: no forward call of this trace was recorded for gradients (call enable_grad() "
                     "before the run)");
  std::vector<std::string> patterns = paths;
  if (patterns.empty())
    for (const auto& r : impl.regs)
      if (r.kind == Impl::Kind::save) patterns.push_back(r.path);
  // A per-token state's gradient is dL/dS_t: token t of its layer's `states` gradient (docs/gradients.md).
  struct TokenGrad {
    std::string path, states_path;
    int64_t t;
  };
  std::vector<TokenGrad> per_token;
  std::vector<std::string> asked;  // paths whose gradient was asked for as such
  std::vector<Site> wanted;
  const int64_t T = impl.tape->batch.seq;
  for (const std::string& p : patterns) {
    std::string base = p;
    const std::optional<int64_t> token = split_token(base);
    for (const Site& s : detail::resolve_path(*impl.tape->family, base, p)) {
      if (!token) {
        wanted.push_back(s);
        asked.push_back(site_path(s));
        continue;
      }
      if (s.value != Value::state)
        throw UnknownValueError("backward: '" + p + "': only 'linear_attn.state' takes a token suffix '@t<t>'");
      const int64_t t = *token < 0 ? *token + T : *token;
      if (t < 0 || t >= T)
        throw InputError("backward: '" + p + "': token " + std::to_string(*token) + " is outside the recorded call's " +
                         std::to_string(T) + " tokens");
      const Site states{s.layer, Value::states};
      wanted.push_back(states);
      per_token.push_back({site_path(s) + "@t" + std::to_string(*token), site_path(states), t});
    }
  }
  impl.grads = grad::run_backward(*impl.tape, dlogits, wanted, positions);
  for (const TokenGrad& g : per_token) {
    const Tensor& S = impl.grads.at(g.states_path);
    const int64_t B = S.size(0), per = S.numel() / (B * T);
    Shape shape{B};
    shape.insert(shape.end(), S.shape().begin() + 2, S.shape().end());
    Tensor out = Tensor::uninitialized(shape);
    for (int64_t b = 0; b < B; ++b)
      std::copy_n(S.data() + (b * T + g.t) * per, per, out.data() + b * per);
    impl.grads[g.path] = std::move(out);
  }
  for (const TokenGrad& g : per_token)  // a stack nobody asked for: [B,T,...] would stay held
    if (std::find(asked.begin(), asked.end(), g.states_path) == asked.end()) impl.grads.erase(g.states_path);
}

bool Trace::has_grad(std::string_view path) const { return impl_->grads.count(std::string(path)) > 0; }

Tensor Trace::grad(std::string_view path) const {
  auto it = impl_->grads.find(std::string(path));
  if (it == impl_->grads.end())
    throw UnknownValueError("no gradient of '" + std::string(path) + "'" +
                            (impl_->grads.empty() ? std::string(" (run backward() first, naming it in paths or saving it)")
                                                  : " (computed: " + impl_->grads.begin()->first + ", ...; name it in "
                                                    "backward's paths or save it)"));
  return it->second;
}

const std::map<std::string, Tensor>& Trace::grads() const { return impl_->grads; }

MixerIdentity mixer_identity(const Model& model, int layer, int64_t prompt_seq) {
  const ModelInfo& info = model.info();
  const int n = static_cast<int>(info.layer_kinds.size());
  if (layer < 0 || layer >= n)
    throw InputError("mixer_identity: layer " + std::to_string(layer) + " out of range (the model has " +
                     std::to_string(n) + " layers)");
  if (prompt_seq < 1) throw InputError("mixer_identity: prompt_seq must be >= 1, got " + std::to_string(prompt_seq));
  MixerIdentity id;
  switch (info.layer_kinds[static_cast<size_t>(layer)]) {
    case LayerKind::mamba2:
    case LayerKind::hybrid:  // Falcon-H1 / Zamba2: the block's recurrent mixer is Mamba-2's; Zamba's is Mamba-1's
      id.kind = info.family == "zamba" ? "selective_scan" : "ssd";
      id.state_op = "selective_state_update";
      break;
    case LayerKind::mamba:
      id.kind = "selective_scan";
      id.state_op = "selective_state_update";
      break;
    case LayerKind::gated_deltanet:  // Kimi Delta Attention decays each key channel, not the head's state
      id.kind = info.family == "kimi_linear" ? "kimi_delta" : "gated_delta";
      id.state_op = info.family == "kimi_linear" ? "kimi_delta_rule" : "gated_delta_rule";
      break;
    case LayerKind::short_conv:  // LFM2: the window shift is the whole recurrence
      id.kind = "short_conv";
      id.state_op = "causal_conv1d_update";
      break;
    case LayerKind::rwkv:  // RWKV-4 time mixing: transformers' rwkv_linear_attention(_cpu)
      id.kind = "wkv";
      id.state_op = "rwkv_linear_attention";
      break;
    case LayerKind::rg_lru:  // RecurrentGemma: the RG-LRU token loop (rg_lru_mixer)
      id.kind = "rg_lru", id.state_op = "rg_lru_step";
      break;
    case LayerKind::lightning:  // MiniMax: linear attention with a per-head decay, on the SSD scan (lightning_mixer)
      id.kind = "lightning", id.state_op = "lightning_attention";
      break;
    case LayerKind::mlstm:  // xLSTM: transformers' mlstm_chunkwise / mlstm_recurrent_step_native
      id.kind = "mlstm", id.state_op = "mlstm_recurrent_step";
      break;
    default:
      throw UnsupportedError("mixer_identity: block " + std::to_string(layer) + " is " +
                             std::string(layer_kind_name(info.layer_kinds[static_cast<size_t>(layer)])) +
                             ": it has no recurrent mixer (layers." + std::to_string(layer) + ".linear_attn)");
  }
  // The prompt kernel is the family's own choice for a fresh cache (Mamba-1 picks by length); a decode
  // step runs the recurrent kernel unless the route forces the chunked one (route_kernels).
  const detail::FamilyModel& fam = detail::ModelAccess::family(model);
  id.prompt_kernel = fam.kernel_for(*fam.new_cache(1), prompt_seq);
  id.step_kernel = kernel_route(info.family) == KernelRoute::chunked ? "chunked" : "recurrent";
  return id;
}

namespace detail {

bool GradAccess::enabled(const Trace& t) { return t.impl_->grad_on; }
void GradAccess::store(Trace& t, std::shared_ptr<grad::Tape> tape) {
  t.impl_->tape = std::move(tape);
  t.impl_->grads.clear();
}
grad::Tape* GradAccess::tape(Trace& t) { return t.impl_->tape.get(); }

namespace {

// Whether token t (negative: from the end) exists in a call of `seq` tokens.
bool token_in_call(int64_t t, int64_t seq) { return t < 0 ? -t <= seq : t < seq; }

// "layers.12.linear_attn.betas" -> "layers.*.linear_attn.betas"
std::string with_star(const std::string& path, std::string* layer = nullptr) {
  if (path.rfind("layers.", 0) != 0) return path;
  size_t end = path.find('.', 7);
  if (end == std::string::npos) return path;
  if (layer) *layer = path.substr(7, end - 7);
  return "layers.*" + path.substr(end);
}

}  // namespace

std::vector<Site> resolve_path(const FamilyModel& model, const std::string& pattern, const std::string& shown) {
  const std::string& said = shown.empty() ? pattern : shown;  // the path as the caller spelled it
  // A TransformerLens name addresses the canonical values it is an exact alias of (tl_names.h).
  if (is_tl_name(pattern)) {
    std::vector<Site> out;
    for (const std::string& canonical : tl_canonical_paths(model, pattern)) {
      try {
        for (const Site& s : resolve_path(model, canonical)) out.push_back(s);
      } catch (const UnknownValueError& e) {
        throw UnknownValueError("'" + pattern + "' (TransformerLens name of '" + canonical + "'): " + e.what());
      }
    }
    return out;
  }
  // The per-token "state" is not a separate entry of values(): it addresses `states` by token, so it
  // exists exactly where `states` does. Where it does not, the errors below name `state` (what was
  // asked for), not `states`.
  static constexpr std::string_view kState = ".linear_attn.state";
  if (pattern.size() > kState.size() && pattern.compare(pattern.size() - kState.size(), kState.size(), kState) == 0) {
    std::vector<Site> sites;
    try {
      sites = resolve_path(model, pattern + "s");
    } catch (const UnknownValueError&) {
    }
    for (Site& s : sites) s.value = Value::state;
    if (!sites.empty()) return sites;
  }
  const auto& values = model.value_table().values;
  std::vector<Site> out;
  std::string layer;
  const std::string starred = with_star(pattern, &layer);
  const bool wildcard = layer == "*";
  for (const auto& v : values)
    if (wildcard ? with_star(v.path) == starred : v.path == pattern) out.push_back(v.site);
  if (!out.empty()) return out;

  const int L = model.info.num_layers;
  if (!layer.empty() && !wildcard) {
    bool numeric = !layer.empty() && std::all_of(layer.begin(), layer.end(), ::isdigit);
    if (!numeric || layer.size() > 9)
      throw UnknownValueError("value path '" + said + "': layer index '" + layer + "' is not a number or '*'");
    const int li = std::stoi(layer);
    if (li >= L)
      throw UnknownValueError("value path '" + said + "': layer " + layer + " is out of range (the model has " +
                              std::to_string(L) + " layers, 0.." + std::to_string(L - 1) + ")");
    // A component this block does not have: name the block's kind (values.md).
    const std::string rest = starred.substr(9);  // after "layers.*."
    const std::string comp = rest.substr(0, rest.find('.'));
    const auto support = served_support(model);
    auto it = support.find(rest);
    if (it != support.end()) {
      auto r = it->second.find(li);
      if (r != it->second.end() && !r->second.empty())
        throw UnknownValueError("value path '" + said + "': " + r->second);
    }
    if (comp == "self_attn" || comp == "mlp" || comp == "linear_attn") {
      std::string kind(layer_kind_name(model.info.layer_kinds[static_cast<size_t>(li)]));
      bool has_comp = false;
      for (const auto& v : values)
        if (with_star(v.path).rfind("layers.*." + comp + ".", 0) == 0) has_comp = true;
      if (!has_comp)
        throw UnknownValueError("value path '" + said + "': block " + layer + (kind[0] == 'a' ? " is an " : " is a ") + kind + " block and has no " +
                                comp);
    }
  }
  // Unknown name: suggest the nearest valid path (on the same layer when one was given).
  std::string best;
  size_t best_d = SIZE_MAX;
  for (const auto& v : values) {
    std::string cand = v.path;
    if (!layer.empty() && cand.rfind("layers.", 0) == 0)
      cand = "layers." + layer + with_star(cand).substr(8);
    size_t d = io::edit_distance(pattern, cand);
    if (d < best_d) best_d = d, best = cand;
  }
  // A misspelt name of the vocabulary this family does not serve (`betaz` on LFM2) is nearer to that
  // name than to any served path: say so with support()'s reason instead of suggesting a far path.
  for (const auto& [rest, per_layer] : model.support()) {
    for (const auto& [li, reason] : per_layer) {
      if (reason.empty() || (!layer.empty() && !wildcard && std::to_string(li) != layer)) continue;
      const std::string cand = "layers." + (layer.empty() ? std::to_string(li) : layer) + "." + rest;
      if (io::edit_distance(pattern, cand) < best_d)
        throw UnknownValueError("unknown value path '" + said + "' for this " + model.info.family + " model; the " +
                                "nearest name, '" + cand + "', is not served here: " + reason +
                                " (`mixlens inspect` lists every value)");
    }
  }
  throw UnknownValueError("unknown value path '" + said + "' for this " + model.info.family +
                          " model; did you mean '" + best + "'? (`mixlens inspect` lists every value)");
}

void check_write(const std::string& path, Value v, const Tensor& w, const Shape& expected) {
  if (!w.defined()) throw WriteError("write to '" + path + "': the new value is undefined (None)");
  if (w.shape() != expected)
    throw WriteError("write to '" + path + "': expected shape " + shape_str(expected) + ", got " + shape_str(w.shape()));
  // inf is refused too: it turns into NaN in the scan and every later value (values.md: no
  // silently wrong output). A full reset is a large negative decay, e.g. -1e4.
  if (w.has_non_finite()) throw WriteError("write to '" + path + "': the new value contains NaN or inf");
  if (v == Value::betas)
    for (float x : w)
      if (x < 0.0f) throw WriteError("write to '" + path + "': betas must be >= 0 (got " + std::to_string(x) + ")");
  if (v == Value::decays)
    for (float x : w)
      if (x > 0.0f) throw WriteError("write to '" + path + "': decays must be <= 0 (got " + std::to_string(x) + ")");
}

TraceListener::TraceListener(Trace& trace, const FamilyModel& model)
    : trace_(trace), sites_(trace.impl_->bound) {
  auto& impl = *trace_.impl_;
  if (impl.bound_family == model.info.family && impl.bound_kinds == model.info.layer_kinds &&
      impl.bound.size() == impl.regs.size())
    return;
  impl.bound_family.clear();  // stays unbound if a path below fails
  impl.bound.clear();
  for (auto& r : impl.regs) {
    r.base = r.path;
    r.token = split_token(r.base);
    r.tl = is_tl_name(r.base);
    impl.bound.push_back(resolve_path(model, r.base, r.path));
    for (const Site& s : impl.bound.back()) {
      if (r.kind != Trace::Impl::Kind::save && s.value == Value::states)
        throw WriteError("'" + site_path(s) +
                         "' is read-only (the per-token state stack); write one token's state with '" +
                         site_path({s.layer, Value::state}) + "@t<t>', or state_input / state_output");
      if (r.kind != Trace::Impl::Kind::save && !derived_value_reason(s.value).empty())
        throw WriteError("'" + site_path(s) + "' is read-only (" + derived_value_reason(s.value) + ")");
      if (s.value == Value::state && !r.token)
        throw UnknownValueError("value path '" + r.path + "': 'state' is addressed per token, e.g. '" +
                                site_path(s) + "@t5' (the state after token 5; '@t-1' is the last token)");
      if (s.value != Value::state && r.token)
        throw UnknownValueError("value path '" + r.path + "': only 'linear_attn.state' takes a token suffix '@t<t>'");
    }
  }
  impl.bound_family = model.info.family;
  impl.bound_kinds = model.info.layer_kinds;
}

void TraceListener::begin_call(const CallCtx& ctx, int num_layers) {
  ctx_ = ctx;
  mask_.assign(static_cast<size_t>(num_layers + 1), 0u);
  const auto& regs = trace_.impl_->regs;
  for (size_t i = 0; i < regs.size(); ++i) {
    if (!regs[i].steps.contains(ctx.step)) continue;
    // A token out of range for this call is an error before anything runs, except on a one-token
    // decode step that a registration over several steps reaches: a generation saving 'state@t3'
    // saves the prompt's state after token 3 (t indexes the tokens of each call; a decode step has
    // only t0 == t-1). Asked for at that step alone (Steps::only), it is an error too.
    if (regs[i].token) {
      if (!token_in_call(*regs[i].token, ctx.seq)) {
        if (ctx.seq == 1 && ctx.step > regs[i].steps.first) continue;
        resolve_token(*regs[i].token, ctx.seq, regs[i].path + " at step " + std::to_string(ctx.step));
      }
    }
    for (const Site& s : sites_[i]) mask_[static_cast<size_t>(s.layer + 1)] |= 1u << static_cast<unsigned>(s.value);
  }
  trace_.impl_->calls.push_back({ctx.step, ctx.batch, ctx.seq, ctx.fresh(), ctx.kernel, ctx.first});
}

void TraceListener::end_call() {}

// Edits first (in registration order), then saves: a save holds the value the forward uses,
// whichever order the two were registered in (read-after-write, issue 7).
bool TraceListener::visit(int layer, Value v, Tensor& value, const Shape& shape) {
  return serve(layer, v, -1, value, shape);
}

int64_t TraceListener::next_state_token(int layer, int64_t after) const {
  const auto& regs = trace_.impl_->regs;
  const Site site{layer, Value::state};
  int64_t best = -1;
  for (size_t i = 0; i < regs.size(); ++i) {
    const auto& r = regs[i];
    if (!r.token || !r.steps.contains(ctx_.step)) continue;
    if (std::find(sites_[i].begin(), sites_[i].end(), site) == sites_[i].end()) continue;
    if (!token_in_call(*r.token, ctx_.seq)) continue;  // a decode step without that token (begin_call)
    const int64_t t = resolve_token(*r.token, ctx_.seq, r.path);
    if (t > after && (best < 0 || t < best)) best = t;
  }
  return best;
}

bool TraceListener::visit_state(int layer, int64_t t, Tensor& value, const Shape& shape) {
  return serve(layer, Value::state, t, value, shape);
}

// Saves and writes of every registration on (layer, v) at this step; for Value::state only those
// whose token resolves to `token`. Writes apply in registration order, each on the previous one.
bool TraceListener::serve(int layer, Value v, int64_t token, Tensor& value, const Shape& shape) {
  auto& impl = *trace_.impl_;
  const Site site{layer, v};
  bool written = false;
  for (size_t i = 0; i < impl.regs.size(); ++i) {
    const auto& r = impl.regs[i];
    if (r.kind == Trace::Impl::Kind::save || !r.steps.contains(ctx_.step)) continue;
    if (std::find(sites_[i].begin(), sites_[i].end(), site) == sites_[i].end()) continue;
    std::string path = site_path(site);
    if (v == Value::state) {
      if (!r.token || !token_in_call(*r.token, ctx_.seq) || resolve_token(*r.token, ctx_.seq, r.path) != token) continue;
      path += "@t" + std::to_string(*r.token);
    }
    Tensor candidate;
    if (r.kind == Trace::Impl::Kind::set) {
      candidate = r.value.clone();
    } else {
      candidate = value.defined() ? value.clone() : Tensor();
      SiteContext where{site, path, ctx_.step, ctx_.batch, ctx_.seq,
                        value_component(v) == Component::linear_attn ? ctx_.kernel : std::string()};
      r.fn(candidate, where);
      if (!candidate.defined() && !value.defined()) continue;  // left None as None
    }
    check_write(path, v, candidate, shape);
    if (value.defined() && value.shape() == shape) {
      std::copy(candidate.begin(), candidate.end(), value.data());
    } else {
      value = candidate;
    }
    written = true;
  }
  if (!defer_saves_) record_saves(site, token, value, false);
  return written;
}

void TraceListener::settled(int layer, Value v, const Tensor& value) { record_saves({layer, v}, -1, value, false); }

void TraceListener::settled_state(int layer, int64_t t, const Tensor& value) {
  record_saves({layer, Value::state}, t, value, false);
}

void TraceListener::revised(int layer, Value v, const Tensor& value) { record_saves({layer, v}, -1, value, true); }

// For Value::state, the registrations whose token resolves to `token`, each stored under its path
// as spelled ("...state@t-1@step0"), so get() finds what was asked for. A TransformerLens name is
// stored under that name too ("blocks.3.hook_resid_post@step0"): one copy per distinct key.
void TraceListener::record_saves(Site site, int64_t token, const Tensor& value, bool only_existing) {
  auto& impl = *trace_.impl_;
  if (!value.defined()) return;  // None (state_input of a fresh prompt) is not stored
  std::vector<std::string> stored;  // keys stored by this call (registrations naming one site share a key)
  for (size_t i = 0; i < impl.regs.size(); ++i) {
    const auto& r = impl.regs[i];
    if (r.kind != Trace::Impl::Kind::save || !r.steps.contains(ctx_.step)) continue;
    if (std::find(sites_[i].begin(), sites_[i].end(), site) == sites_[i].end()) continue;
    std::string key = r.tl ? tl_key(r.base, site.layer) : site_path(site);
    if (site.value == Value::state) {
      if (!r.token || !token_in_call(*r.token, ctx_.seq) || resolve_token(*r.token, ctx_.seq, r.path) != token) continue;
      key += "@t" + std::to_string(*r.token);
    }
    key += "@step" + std::to_string(ctx_.step);
    if (std::find(stored.begin(), stored.end(), key) != stored.end()) continue;
    auto it = impl.index.find(key);
    if (it == impl.index.end() && only_existing) continue;
    const uint64_t bytes = static_cast<uint64_t>(value.numel()) * sizeof(float);
    const uint64_t replaced =
        it != impl.index.end() ? static_cast<uint64_t>(impl.saved[it->second].second.numel()) * sizeof(float) : 0;
    // Saved values only grow (e.g. a long generation saving every step): stop at a stated budget
    // rather than when the machine runs out of memory.
    const uint64_t budget = save_budget_bytes();
    if (impl.saved_bytes - replaced + bytes > budget)
      throw ResourceError("trace: saving '" + key + "' (" + std::to_string(bytes) + " bytes) would take the saved values past the " +
                          std::to_string(budget >> 20) + " MiB budget (" + std::to_string(impl.saved_bytes >> 20) +
                          " MiB held, " + std::to_string(impl.saved.size()) +
                          " values); save fewer values or steps (Steps), or set MIXLENS_SAVE_BUDGET_MB");
    impl.saved_bytes = impl.saved_bytes - replaced + bytes;
    // The `states` stack is read-only and the forward never touches it after serving it: share it
    // rather than copy hundreds of MiB (the forward's next stack_buffer sees it held and allocates).
    Tensor kept = site.value == Value::states ? value : value.clone();
    if (it != impl.index.end()) impl.saved[it->second].second = std::move(kept);
    else {
      impl.index[key] = impl.saved.size();
      impl.saved.emplace_back(key, std::move(kept));
    }
    stored.push_back(std::move(key));
  }
}

}  // namespace detail
}  // namespace mixlens
