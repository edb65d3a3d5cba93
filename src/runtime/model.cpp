#include "mixlens/model.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <filesystem>
#include <mutex>
#include <random>
#include <typeinfo>

#include "grad/tape.h"
#include "io/hub.h"
#include "io/json.h"
#include "io/weights.h"
#include "mixlens/errors.h"
#include "models/common.h"
#include "models/family.h"
#include "models/registry.h"
#include "ops/arena.h"
#include "ops/env.h"
#include "ops/kernels.h"
#include "ops/ops.h"
#include "runtime/model_access.h"
#include "runtime/sampling.h"
#include "runtime/trace_listener.h"

namespace mixlens {

namespace fs = std::filesystem;

// ---- Batch ----------------------------------------------------------------------------------

Batch Batch::left_padded(const std::vector<std::vector<int32_t>>& rows, int32_t pad_id) {
  if (rows.empty()) throw InputError("empty batch: give at least one prompt");
  Batch b;
  b.batch = static_cast<int64_t>(rows.size());
  for (size_t r = 0; r < rows.size(); ++r) {
    if (rows[r].empty()) throw InputError("prompt " + std::to_string(r) + " has no tokens");
    b.seq = std::max<int64_t>(b.seq, static_cast<int64_t>(rows[r].size()));
  }
  b.ids.assign(static_cast<size_t>(b.batch * b.seq), pad_id);
  b.mask.assign(static_cast<size_t>(b.batch * b.seq), 0);
  for (size_t r = 0; r < rows.size(); ++r) {
    const size_t off = r * static_cast<size_t>(b.seq) + (static_cast<size_t>(b.seq) - rows[r].size());
    for (size_t t = 0; t < rows[r].size(); ++t) {
      b.ids[off + t] = rows[r][t];
      b.mask[off + t] = 1;
    }
  }
  return b;
}

namespace {
// The mask rule shared by every caller-padded batch: a 0/1 entry per position, each row's padding
// before its first real token (left padding, as the forward's position and state handling assume).
void check_left_padding(std::vector<uint8_t>& mask, int64_t B, int64_t T, const std::string& what) {
  const size_t n = static_cast<size_t>(B * T);
  if (mask.empty()) mask.assign(n, 1);
  if (mask.size() != n)
    throw InputError("attention_mask has " + std::to_string(mask.size()) + " entries for " + what +
                     " (needs batch*seq = " + std::to_string(n) + ")");
  for (int64_t r = 0; r < B; ++r) {
    bool seen_real = false;
    for (int64_t t = 0; t < T; ++t) {
      const uint8_t m = mask[static_cast<size_t>(r * T + t)];
      if (m > 1) throw InputError("attention_mask entries must be 0 or 1");
      if (!m && seen_real)
        throw InputError("attention_mask row " + std::to_string(r) +
                         " is not left padding (a 0 after a 1): pad on the left (a tokenizer's padding_side=\"left\") "
                         "or pass the rows unpadded");
      seen_real = seen_real || m;
    }
    if (!seen_real) throw InputError("attention_mask row " + std::to_string(r) + " has no real token");
  }
}
}  // namespace

Batch Batch::padded(const std::vector<std::vector<int32_t>>& rows, std::vector<uint8_t> mask) {
  if (rows.empty()) throw InputError("empty batch: give at least one prompt");
  Batch b;
  b.batch = static_cast<int64_t>(rows.size());
  b.seq = static_cast<int64_t>(rows[0].size());
  if (b.seq == 0) throw InputError("prompt 0 has no tokens");
  for (size_t r = 1; r < rows.size(); ++r)
    if (static_cast<int64_t>(rows[r].size()) != b.seq)
      throw InputError("padded input_ids row " + std::to_string(r) + " has " + std::to_string(rows[r].size()) +
                       " tokens, row 0 has " + std::to_string(b.seq) + ": a padded batch is rectangular");
  check_left_padding(mask, b.batch, b.seq, "input_ids [" + std::to_string(b.batch) + ", " + std::to_string(b.seq) + "]");
  b.ids.reserve(static_cast<size_t>(b.batch * b.seq));
  for (const auto& r : rows) b.ids.insert(b.ids.end(), r.begin(), r.end());
  b.mask = std::move(mask);
  return b;
}

Batch Batch::from_embeddings(const Tensor& embeds, std::vector<uint8_t> mask) {
  if (!embeds.defined() || embeds.dim() != 3)
    throw InputError("inputs_embeds must be a [batch, seq, hidden] array, got " +
                     (embeds.defined() ? shape_str(embeds.shape()) : std::string("None")));
  Batch b;
  b.batch = embeds.size(0);
  b.seq = embeds.size(1);
  if (b.batch <= 0 || b.seq <= 0 || embeds.size(2) <= 0)
    throw InputError("inputs_embeds " + shape_str(embeds.shape()) + " is empty: give at least one row and one token");
  if (embeds.has_non_finite()) throw InputError("inputs_embeds contains NaN or inf");
  const size_t n = static_cast<size_t>(b.batch * b.seq);
  check_left_padding(mask, b.batch, b.seq, "inputs_embeds " + shape_str(embeds.shape()));
  b.ids.assign(n, 0);
  b.mask = std::move(mask);
  b.embeds = embeds.clone();
  return b;
}

bool Batch::has_padding() const {
  for (uint8_t m : mask)
    if (!m) return true;
  return false;
}

// ---- kernel routing -------------------------------------------------------------------------

namespace {
std::mutex g_route_mu;
std::map<std::string, KernelRoute>& routes() {
  static std::map<std::string, KernelRoute> r;
  return r;
}

// A misspelt family would silently route nothing, or read as routed by default.
void check_route_family(const char* fn, const std::string& family) {
  const std::vector<std::string>& families = detail::family_names();
  if (std::find(families.begin(), families.end(), family) == families.end())
    throw InputError(std::string(fn) + ": unknown family '" + family + "' (known: " + detail::join_names(families) + ")");
}
}  // namespace

void route_kernels(const std::string& family, const std::string& route) {
  KernelRoute k;
  if (route == "default") k = KernelRoute::default_route;
  else if (route == "chunked") k = KernelRoute::chunked;
  else if (route == "recurrent") k = KernelRoute::recurrent;
  else throw InputError("route_kernels: route '" + route + "' must be 'default', 'chunked' or 'recurrent'");
  check_route_family("route_kernels", family);
  if (k == KernelRoute::chunked)
    for (const detail::FamilyEntry& e : detail::family_registry())
      if (e.family == family && !e.one_kernel.empty())
        throw UnsupportedError("route_kernels('" + family + "', 'chunked'): " + e.one_kernel);
  std::lock_guard<std::mutex> lk(g_route_mu);
  routes()[family] = k;
}

KernelRoute kernel_route(const std::string& family) {
  check_route_family("kernel_route", family);
  std::lock_guard<std::mutex> lk(g_route_mu);
  auto it = routes().find(family);
  return it == routes().end() ? KernelRoute::default_route : it->second;
}

// ---- Cache ----------------------------------------------------------------------------------

struct Cache::Impl {
  std::unique_ptr<detail::CacheState> state;
  const detail::FamilyModel* owner = nullptr;
  // Why this cache must not be continued: a forward over it stopped midway, so the layers it
  // reached hold tokens that seen_tokens / steps do not count. Empty while the cache is consistent.
  std::string broken;
  void check_usable(const char* verb) const {
    if (!broken.empty())
      throw InputError(std::string("cannot ") + verb + " this cache: " + broken +
                       ", which left it partly updated (seen_tokens / steps still show the counts from before that "
                       "call); restore(snapshot) from a copy() taken before the call rolls it back (or use a new cache)");
  }
};
Cache::Cache() : impl_(std::make_unique<Impl>()) {}
Cache::~Cache() = default;
Cache::Cache(Cache&&) noexcept = default;
Cache& Cache::operator=(Cache&&) noexcept = default;
int64_t Cache::batch() const { return impl_->state->batch; }
int64_t Cache::seen_tokens() const { return impl_->state->seen; }
int Cache::steps() const { return impl_->state->steps; }
const std::string& Cache::broken() const { return impl_->broken; }

namespace {
std::unique_ptr<detail::CacheState> checked_clone(const detail::CacheState& st) {
  auto c = st.clone();
  // A derived cache that did not override clone() would come back sliced to its base.
  const detail::CacheState* copy = c.get();
  if (!copy || typeid(*copy) != typeid(st))
    throw UnsupportedError(std::string("Cache::copy: this family's cache (") + typeid(st).name() +
                           ") does not implement clone()");
  return c;
}
}  // namespace

Cache Cache::copy() const {
  impl_->check_usable("copy");
  Cache c;
  c.impl_->state = checked_clone(*impl_->state);
  c.impl_->owner = impl_->owner;
  return c;
}

void Cache::restore(const Cache& snapshot) {
  if (&snapshot == this) return;
  if (snapshot.impl_->owner != impl_->owner)
    throw InputError("Cache::restore: the snapshot belongs to another model");
  if (snapshot.impl_->state->batch != impl_->state->batch)
    throw InputError("Cache::restore: the snapshot has " + std::to_string(snapshot.impl_->state->batch) +
                     " rows but this cache has " + std::to_string(impl_->state->batch));
  snapshot.impl_->check_usable("restore from");
  impl_->state = checked_clone(*snapshot.impl_->state);
  impl_->broken.clear();
}

// ---- Model ----------------------------------------------------------------------------------

struct Model::Impl {
  std::unique_ptr<detail::FamilyModel> family;
  std::optional<Tokenizer> tokenizer;
  int32_t pad_id = 0;
  std::optional<int32_t> eos_id;
  int64_t prefill_chunk = Model::kDefaultPrefillChunk;
};

Model::Model() : impl_(std::make_unique<Impl>()) {}
Model::~Model() = default;
Model::Model(Model&&) noexcept = default;
Model& Model::operator=(Model&&) noexcept = default;

namespace detail {
// A config with fewer layers than its checkpoint would load as a silently truncated model (the
// extra layers' tensors unread): refuse it. Multi-token-prediction heads (`mtp.`) are not layers.
void check_no_extra_layers(const io::WeightStore& weights, int64_t num_layers, const io::Config& config) {
  for (const std::string& name : weights.names()) {
    if (name.rfind("mtp.", 0) == 0) continue;
    for (size_t at = name.find("layers."); at != std::string::npos; at = name.find("layers.", at + 1)) {
      if (at > 0 && name[at - 1] != '.') continue;
      size_t i = at + 7, j = i;
      while (j < name.size() && std::isdigit(static_cast<unsigned char>(name[j]))) ++j;
      if (j == i || j >= name.size() || name[j] != '.' || j - i > 9) continue;
      const int64_t layer = std::stoll(name.substr(i, j - i));
      if (layer >= num_layers)
        throw ConfigError(where(config) + ": the checkpoint has tensors of layer " + std::to_string(layer) + " ('" +
                          name + "') but the config describes " + std::to_string(num_layers) +
                          " layers; loading it would silently drop layers (fix num_hidden_layers / n_layer)");
      break;
    }
  }
}
}  // namespace detail

Model Model::load(const std::string& path_or_hub_id, const LoadOptions& options) {
  // The MIXLENS_* memory settings are read where first used (a trace, a big buffer): a typo there
  // surfaced mid-run. Reading them now refuses it at load, as MIXLENS_NUM_THREADS / _ISA are.
  (void)detail::arena_limit_bytes();
  (void)detail::big_limit_bytes();
  (void)save_budget_bytes();
  (void)ops::isa();  // MIXLENS_ISA: a name that is not a level, or one this CPU lacks
  io::WeightStore probe;
  probe.set_matmul_dtype(options.dtype);  // an unknown dtype fails before any file is read
  const fs::path dir = io::resolve_model(path_or_hub_id);
  io::Config config = io::Config::load(dir);
  io::WeightStore weights = io::WeightStore::open(dir);
  weights.set_matmul_dtype(options.dtype);
  Model m;
  try {
    m.impl_->family = detail::build_family(config, weights);
  } catch (const nlohmann::json::exception& e) {
    // A field of a JSON type no getter anticipated: still a ConfigError naming the file, never a
    // bare exception (exit 3 / RuntimeError).
    throw ConfigError(detail::where(config) + ": malformed field: " + e.what());
  }
  detail::check_no_extra_layers(weights, m.impl_->family->info.num_layers, config);
  m.impl_->family->info.path = dir.string();
  m.impl_->family->info.dtype = options.dtype;
  // Read even when the option decides, so a mistyped MIXLENS_DETERMINISTIC is refused, never ignored.
  const bool deterministic_by_env = detail::env_flag("MIXLENS_DETERMINISTIC", false);
  m.impl_->family->info.deterministic = options.deterministic.value_or(deterministic_by_env);
  m.impl_->family->info.weight_dtypes = weights.matmul_dtypes_kept();
  m.impl_->family->info.matmul_weights = weights.matmul_names();
  if (fs::exists(dir / "tokenizer.json")) m.impl_->tokenizer = Tokenizer::from_file((dir / "tokenizer.json").string());
  // VLM configs (Qwen3_5ForConditionalGeneration) keep the token ids in text_config, not at the
  // top level: fall back there when the top level has none.
  auto id_field = [&](const char* key) -> std::optional<int32_t> {
    const bool nested = (!config.has(key) || config.is_null(key)) && config.has("text_config") &&
                        !config.is_null("text_config");
    const io::Config src = nested ? config.sub("text_config") : config;
    if (!src.has(key) || src.is_null(key)) return std::nullopt;
    const auto& j = src.json()[key];
    if (j.is_array()) return j.empty() ? std::nullopt : std::optional<int32_t>(j[0].get<int32_t>());
    return src.get<int32_t>(key);
  };
  m.impl_->eos_id = id_field("eos_token_id");
  m.impl_->pad_id = id_field("pad_token_id").value_or(m.impl_->eos_id.value_or(0));
  return m;
}

const ModelInfo& Model::info() const { return impl_->family->info; }
bool Model::has_tokenizer() const { return impl_->tokenizer.has_value(); }
const Tokenizer& Model::tokenizer() const {
  if (!impl_->tokenizer)
    throw TokenizerError("model folder " + info().path + " has no tokenizer.json; pass token ids instead of text");
  return *impl_->tokenizer;
}
int32_t Model::pad_token_id() const { return impl_->pad_id; }
std::optional<int32_t> Model::eos_token_id() const { return impl_->eos_id; }

std::vector<ValueInfo> Model::values(int64_t batch, int64_t seq) const { return impl_->family->values(batch, seq); }
std::map<std::string, std::map<int, std::string>> Model::support() const {
  return detail::served_support(*impl_->family);
}
void Model::set_chunk_size(int64_t c) {
  if (c < 0 || c > detail::kMaxChunkSize)
    throw InputError("set_chunk_size: " + std::to_string(c) + " is out of range [0, " +
                     std::to_string(detail::kMaxChunkSize) + "] (0 restores the config's chunk size)");
  impl_->family->set_chunk_size(c);
}

void Model::set_prefill_chunk(int64_t tokens) {
  if (tokens < 0) throw InputError("set_prefill_chunk: " + std::to_string(tokens) + " must be >= 0 (0 turns it off)");
  impl_->prefill_chunk = tokens;
}
int64_t Model::prefill_chunk() const { return impl_->prefill_chunk; }

const detail::FamilyModel::ValueTable& detail::FamilyModel::value_table() const {
  std::call_once(table_once_, [this] {
    auto t = std::make_unique<ValueTable>();
    t->values = values(1, 1);
    t->at_site.assign(static_cast<size_t>((info.num_layers + 1) * kNumValues), -1);
    for (size_t i = 0; i < t->values.size(); ++i) {
      t->at.emplace(t->values[i].path, i);
      t->at_site[ValueTable::slot(t->values[i].site)] = static_cast<int>(i);
    }
    table_ = std::move(t);
  });
  return *table_;
}

detail::FamilyModel::Head detail::FamilyModel::head() const {
  throw UnsupportedError("family '" + info.family + "' does not declare its LM head yet: project_on_vocab and "
                         "head weights are unavailable (read 'logits' instead)");
}

detail::FamilyModel::Unembed detail::FamilyModel::unembed() const {
  const Head h = head();
  return {h.lm_head, h.logit_scale, 0.0f};
}

Tensor Model::project_on_vocab(const Tensor& hidden) const {
  const detail::FamilyModel::Head h = impl_->family->head();
  const int64_t D = info().hidden_size, V = info().vocab_size;
  if (!hidden.defined() || hidden.dim() < 1 || hidden.size(-1) != D)
    throw InputError("project_on_vocab: expected hidden states [..., " + std::to_string(D) + "], got " +
                     (hidden.defined() ? shape_str(hidden.shape()) : std::string("None")));
  if (hidden.has_non_finite()) throw InputError("project_on_vocab: the hidden states contain NaN or inf");
  const int64_t rows = hidden.numel() / D;
  const ops::DeterministicScope numerics(info().deterministic);
  Tensor n(hidden.shape());
  if (rows > 0) ops::rmsnorm(hidden.data(), h.norm->data(), n.data(), rows, D, h.eps, h.zero_centred);
  Shape out_shape = hidden.shape();
  out_shape.back() = V;
  Tensor logits(out_shape);
  if (rows > 0) ops::linear(n.data(), rows, D, *h.lm_head, logits.data());
  if (h.logit_scale != 1.0f)
    for (int64_t k = 0; k < logits.numel(); ++k) logits[k] *= h.logit_scale;
  return logits;
}

Tensor Model::head_weight(const std::string& role) const {
  const detail::FamilyModel::Head h = impl_->family->head();
  // Served values stay float32: narrow weights are widened (exactly) on the way out.
  if (role == "embed_tokens") return h.embed->to_f32();
  if (role == "ln_final") return *h.norm;
  if (role == "lm_head") return h.lm_head->to_f32();
  throw InputError("head_weight: unknown role '" + role + "' (embed_tokens, ln_final or lm_head)");
}

Cache Model::new_cache(int64_t batch) const {
  if (batch <= 0) throw InputError("new_cache: batch must be >= 1");
  Cache c;
  c.impl_->state = impl_->family->new_cache(batch);
  c.impl_->owner = impl_->family.get();
  return c;
}

Tensor Model::forward(const Batch& in, Cache& cache, Trace* trace, bool all_logits,
                      const std::atomic<bool>* cancel) const {
  return detail::ModelAccess::forward(*this, in, cache, trace, nullptr, all_logits, cancel);
}

const detail::FamilyModel& detail::ModelAccess::family(const Model& m) { return *m.impl_->family; }
void detail::ModelAccess::check_cache(const Cache& cache, const char* verb) { cache.impl_->check_usable(verb); }

Tensor detail::ModelAccess::forward(const Model& m, const Batch& in, Cache& cache, Trace* trace, Listener* extra,
                                    bool all_logits, const std::atomic<bool>* cancel) {
  const Model::Impl& impl = *m.impl_;
  if (cache.impl_->owner != impl.family.get()) throw InputError("forward: the cache belongs to another model");
  // The model's numerics setting for every op of this call (the pool's blocks included).
  const ops::DeterministicScope numerics(m.info().deterministic);
  auto& st = *cache.impl_->state;
  if (in.batch != st.batch)
    throw InputError("forward: batch has " + std::to_string(in.batch) + " rows but the cache was made for " +
                     std::to_string(st.batch));
  if (in.seq <= 0) throw InputError("forward: empty call (no tokens)");
  if (in.ids.size() != static_cast<size_t>(in.batch * in.seq) || in.mask.size() != in.ids.size())
    throw InputError("forward: ids/mask sizes do not match batch x seq");
  if (in.embeds.defined() && in.embeds.shape() != Shape{in.batch, in.seq, m.info().hidden_size})
    throw InputError("forward: inputs_embeds has shape " + shape_str(in.embeds.shape()) + ", expected " +
                     shape_str({in.batch, in.seq, m.info().hidden_size}) + " [batch, seq, hidden_size]");
  if (!in.embeds.defined()) {
    // Checked here, before the cache is touched, so a refused id leaves the cache usable.
    const int64_t V = m.info().vocab_size;
    for (size_t i = 0; i < in.ids.size(); ++i)
      if (in.ids[i] < 0 || in.ids[i] >= V)
        throw InputError("forward: token id " + std::to_string(in.ids[i]) + " at row " +
                         std::to_string(static_cast<int64_t>(i) / in.seq) + ", position " +
                         std::to_string(static_cast<int64_t>(i) % in.seq) + " is outside the vocabulary [0, " +
                         std::to_string(V) + ")");
  }
  cache.impl_->check_usable("continue");
  detail::CallCtx ctx;
  ctx.step = st.steps;
  ctx.batch = in.batch;
  ctx.seq = in.seq;
  ctx.first = st.seen;
  ctx.kernel = impl.family->kernel_for(st, in.seq);
  ctx.cancel = cancel;
  ctx.check_cancel();
  std::optional<detail::TraceListener> trace_listener;
  if (trace) trace_listener.emplace(*trace, *impl.family);
  std::optional<detail::ChainListener> chain;
  if (trace_listener && extra) chain.emplace(*trace_listener, *extra);
  detail::Listener* listener = chain ? static_cast<detail::Listener*>(&*chain)
                               : trace_listener ? static_cast<detail::Listener*>(&*trace_listener)
                                                : extra;
  // Gradients (src/grad): a trace with enable_grad() records this call for Trace::backward.
  std::shared_ptr<grad::Tape> tape;
  std::optional<grad::Recorder> recorder;
  if (trace && detail::GradAccess::enabled(*trace)) {
    tape = grad::begin_tape(*impl.family, in, st, ctx);
    recorder.emplace(listener, *tape);
    ctx.tape = tape.get();
    listener = &*recorder;
    // The LM head's input is recorded (Tape::final_normed): logits_at forms the logits a metric reads,
    // so the call returns every position's only when asked (at 248k vocab they cost as much as the blocks).
    try {
      tape->unembed = impl.family->unembed();
    } catch (const UnsupportedError&) {
      all_logits = true;  // no declared head: backward takes dMetric/dLogits of every position
    }
  }
  if (listener) listener->begin_call(ctx, m.info().num_layers);
  // Nobody observes this call: the mask is settled at begin_call and only changes inside a visit,
  // which an all-zero mask never makes.
  const bool observed = listener && std::any_of(listener->mask().begin(), listener->mask().end(),
                                                [](uint32_t w) { return w != 0; });
  const int64_t C = impl.prefill_chunk;
  Tensor logits;
  // From here an exception (a write's error, NumericError, a stopped trace, Ctrl-C) can leave the
  // layers already run holding this call's tokens: the cache is marked and refuses to continue.
  try {
    if (C > 0 && in.seq > C + 1 && !observed && !tape && !in.has_padding()) {
      logits = chunked_prefill(m, in, st, listener, ctx, all_logits, C);
    } else {
      logits = impl.family->forward(in, st, listener, ctx, all_logits);
      st.seen += in.seq;
    }
    if (listener) listener->end_call();
  } catch (const std::exception& e) {
    cache.impl_->broken = std::string("a forward over it stopped midway (") + e.what() + ")";
    throw;
  } catch (...) {
    cache.impl_->broken = "a forward over it stopped midway (its trace ended early or was aborted)";
    throw;
  }
  if (tape) {
    tape->logits_shape = logits.shape();
    detail::GradAccess::store(*trace, std::move(tape));
  }
  st.steps += 1;
  return logits;
}

Tensor detail::ModelAccess::chunked_prefill(const Model& m, const Batch& in, CacheState& st, Listener* listener,
                                            const CallCtx& call, bool all_logits, int64_t C) {
  const FamilyModel& fam = *m.impl_->family;
  const int64_t B = in.batch, T = in.seq, D = m.info().hidden_size;
  Tensor all;  // [B,T,V] when every position's logits are returned
  Tensor logits;
  for (int64_t t0 = 0; t0 < T;) {
    // Pieces of C tokens; a last piece of one token joins the one before (never a decode step).
    int64_t n = std::min(C, T - t0);
    if (T - t0 - n == 1) n += 1;
    Batch piece;
    piece.batch = B;
    piece.seq = n;
    piece.ids.resize(static_cast<size_t>(B * n));
    piece.mask.assign(static_cast<size_t>(B * n), 1);
    for (int64_t b = 0; b < B; ++b)
      std::copy_n(in.ids.begin() + b * T + t0, n, piece.ids.begin() + b * n);
    if (in.embeds.defined()) {
      piece.embeds = Tensor({B, n, D});
      for (int64_t b = 0; b < B; ++b)
        std::copy_n(in.embeds.data() + (b * T + t0) * D, n * D, piece.embeds.data() + b * n * D);
    }
    CallCtx ctx = call;
    ctx.seq = n;
      ctx.first = st.seen;
    ctx.kernel = fam.kernel_for(st, n);
    ctx.check_cancel();
    logits = fam.forward(piece, st, listener, ctx, all_logits);
    st.seen += n;
    if (all_logits) {
      const int64_t V = logits.size(2);
      if (!all.defined()) all = Tensor({B, T, V});
      for (int64_t b = 0; b < B; ++b)
        std::copy_n(logits.data() + b * n * V, n * V, all.data() + (b * T + t0) * V);
    }
    t0 += n;
  }
  return all_logits ? all : logits;
}

void GenerateOptions::check() const {
  if (max_new_tokens < 1) throw InputError("generate: max_new_tokens must be >= 1");
  if (greedy) {
    // Settings that only sampling reads: set with greedy decoding they would be a silent no-op.
    std::string ignored;
    if (temperature != 1.0f) ignored += " temperature=" + std::to_string(temperature);
    if (top_k != 0) ignored += " top_k=" + std::to_string(top_k);
    if (top_p != 1.0f) ignored += " top_p=" + std::to_string(top_p);
    if (seed != 0) ignored += " seed=" + std::to_string(seed);
    if (!ignored.empty())
      throw InputError("generate: sampling settings given with greedy decoding (" + ignored.substr(1) +
                       "), where nothing reads them: sample (Python do_sample=True, C++ greedy = false, CLI without "
                       "--greedy) or leave them at their defaults");
    return;
  }
  if (!(temperature > 0.0f) || !std::isfinite(temperature))
    throw InputError("generate: temperature must be a finite number > 0, got " + std::to_string(temperature));
  if (!(top_p > 0.0f && top_p <= 1.0f)) throw InputError("generate: top_p must be in (0, 1], got " + std::to_string(top_p));
  if (top_k < 0) throw InputError("generate: top_k must be >= 0, got " + std::to_string(top_k));
}

Tensor Model::run(const std::vector<std::vector<int32_t>>& prompts, Trace* trace, bool all_logits) const {
  return run(Batch::left_padded(prompts, impl_->pad_id), trace, nullptr, all_logits);
}

Tensor Model::run(const Batch& b, Trace* trace, const std::atomic<bool>* cancel, bool all_logits) const {
  if (trace) detail::TraceListener::check_steps_made(*trace, 0, 0);  // a fresh run makes step 0 only
  Cache c = new_cache(b.batch);
  return forward(b, c, trace, all_logits, cancel);
}

GenerationResult Model::generate(const std::vector<std::vector<int32_t>>& prompts, const GenerateOptions& o,
                                 Trace* trace) const {
  return detail::ModelAccess::generate(*this, Batch::left_padded(prompts, impl_->pad_id), o, trace, nullptr);
}

GenerationResult Model::generate(const Batch& prompt, const GenerateOptions& o, Trace* trace,
                                 const std::atomic<bool>* cancel) const {
  return detail::ModelAccess::generate(*this, prompt, o, trace, nullptr, cancel);
}

GenerationResult detail::ModelAccess::generate(const Model& m, Batch b, const GenerateOptions& o, Trace* trace,
                                               Listener* extra, const std::atomic<bool>* cancel) {
  const Model::Impl& impl = *m.impl_;
  o.check();
  if (trace) detail::TraceListener::check_steps_reachable(*trace, o.max_new_tokens);
  Cache cache = m.new_cache(b.batch);
  std::optional<int32_t> eos = impl.eos_id;
  // An id no token can take would never stop a row: refused rather than silently ignored.
  if (o.eos_token_id && (*o.eos_token_id < -1 || *o.eos_token_id >= m.info().vocab_size))
    throw InputError("generate: eos_token_id " + std::to_string(*o.eos_token_id) + " is outside the vocabulary [0, " +
                     std::to_string(m.info().vocab_size) + ") (-1 disables stopping at EOS)");
  if (o.eos_token_id) eos = *o.eos_token_id < 0 ? std::nullopt : o.eos_token_id;
  std::mt19937_64 rng(o.seed);
  GenerationResult res;
  res.new_tokens.resize(static_cast<size_t>(b.batch));
  std::vector<bool> done(static_cast<size_t>(b.batch), false);
  for (int step = 0; step < o.max_new_tokens; ++step) {
    Tensor logits = forward(m, b, cache, trace, extra, false, cancel);
    res.steps += 1;
    const int64_t V = logits.size(2), T = logits.size(1);
    std::vector<int32_t> next(static_cast<size_t>(b.batch));
    for (int64_t r = 0; r < b.batch; ++r) {
      const float* row = logits.data() + (r * T + T - 1) * V;
      // Finished rows keep receiving the pad token, as transformers does.
      next[r] = done[r] ? impl.pad_id : (o.greedy ? detail::argmax(row, V) : detail::sample(row, V, o, rng));
      if (!done[r]) {
        res.new_tokens[r].push_back(next[r]);
        if (eos.has_value() && next[r] == eos.value()) done[r] = true;
      }
    }
    if (std::all_of(done.begin(), done.end(), [](bool d) { return d; })) break;
    b.seq = 1;
    b.ids = next;
    b.mask.assign(static_cast<size_t>(b.batch), 1);
    b.embeds = Tensor();  // from step 1 the generated ids are fed
  }
  // Every row stopped (EOS) before a step something was registered at: not a silent no-op.
  if (trace) detail::TraceListener::check_steps_made(*trace, 0, res.steps - 1);
  return res;
}

}  // namespace mixlens
