#include "models/common.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>

#include "mixlens/errors.h"
#include "ops/ops.h"

namespace mixlens::detail {

std::string where(const io::Config& cfg) { return "config.json (" + cfg.path().string() + ")"; }

void require_positive(const io::Config& cfg, std::initializer_list<std::pair<const char*, int64_t>> fields) {
  for (const auto& [name, v] : fields)
    if (v <= 0 || v > kMaxConfigDim)
      throw ConfigError(where(cfg) + ": field '" + name + "' = " + std::to_string(v) +
                        " is out of range (must be a positive size <= " + std::to_string(kMaxConfigDim) + ")");
}

int64_t checked_size_product(const io::Config& cfg, const std::string& what, std::initializer_list<int64_t> factors,
                             int64_t limit) {
  int64_t p = 1;
  for (int64_t f : factors) {
    if (f < 0 || __builtin_mul_overflow(p, f, &p) || p > limit)
      throw ConfigError(where(cfg) + ": " + what + " is too large (over " + std::to_string(limit) +
                        " elements); refused before allocating");
  }
  return p;
}

namespace {

bool ends_with(const std::string& s, const char* suffix) {
  const std::string x(suffix);
  return s.size() >= x.size() && s.compare(s.size() - x.size(), x.size(), x) == 0;
}

// Field names that hold a tensor dimension or a count, across the families' HF configs.
bool is_size_field(const std::string& k) {
  static const char* const exact[] = {"n_groups", "mamba_n_groups", "num_experts", "num_experts_per_tok",
                                      "conv_kernel", "mamba_d_conv", "mamba_d_state", "mamba_d_head",
                                      "mamba_n_heads", "mamba_d_ssm", "time_step_rank", "decoder_sparse_step",
                                      "full_attention_interval"};
  for (const char* e : exact)
    if (k == e) return true;
  return ends_with(k, "_size") || ends_with(k, "_dim") || ends_with(k, "_heads") || ends_with(k, "_layers");
}

bool is_chunk_field(const std::string& k) { return k == "chunk_size" || ends_with(k, "_chunk_size"); }

std::optional<int64_t> int_field(const io::Config& cfg, const char* key) {
  if (!cfg.has(key)) return std::nullopt;
  const nlohmann::json& v = cfg.json()[key];
  if (!v.is_number_integer()) return std::nullopt;
  return cfg.get<int64_t>(key);  // range-checked by the size rules first
}

std::string value_text(const nlohmann::json& v) {
  if (v.is_number_float()) {
    const double d = v.get<double>();
    if (std::isnan(d)) return "NaN";
    if (std::isinf(d)) return d > 0 ? "Infinity" : "-Infinity";
  }
  return v.dump();
}

void validate_level(const io::Config& cfg, const std::string& prefix, std::optional<int64_t> vocab) {
  const std::string file = where(cfg);
  auto bad = [&](const std::string& k, const nlohmann::json& v, const std::string& rule) {
    throw ConfigError(file + ": field '" + prefix + k + "' = " + value_text(v) + " is out of range: " + rule);
  };
  for (const auto& [k, v] : cfg.json().items()) {
    if (v.is_null()) continue;
    if (is_chunk_field(k)) {
      if (!v.is_number_integer()) continue;  // the family's getter names the type error
      if (v.is_number_unsigned() ? (v.get<uint64_t>() < 1 || v.get<uint64_t>() > static_cast<uint64_t>(kMaxChunkSize))
                                 : (v.get<int64_t>() < 1 || v.get<int64_t>() > kMaxChunkSize))
        bad(k, v, "a chunk size must be in [1, " + std::to_string(kMaxChunkSize) +
                      "] (the chunked scan's cost grows with its square)");
    } else if (is_size_field(k) && v.is_number_integer()) {
      if (v.is_number_unsigned() ? v.get<uint64_t>() > static_cast<uint64_t>(kMaxConfigDim)
                                 : (v.get<int64_t>() < 0 || v.get<int64_t>() > kMaxConfigDim))
        bad(k, v, "a size must be in [0, " + std::to_string(kMaxConfigDim) + "]");
    } else if (k == "rope_theta" || k.find("eps") != std::string::npos || k == "expand" || ends_with(k, "_expand")) {
      if (!v.is_number()) continue;
      const double d = v.get<double>();
      if (!(std::isfinite(d) && d > 0.0)) bad(k, v, "must be a finite number > 0");
      if ((k == "expand" || ends_with(k, "_expand")) && d > static_cast<double>(kMaxConfigDim))
        bad(k, v, "expand must be at most " + std::to_string(kMaxConfigDim));
    } else if (k == "partial_rotary_factor") {
      if (!v.is_number()) continue;
      const double d = v.get<double>();
      if (!(d > 0.0 && d <= 1.0)) bad(k, v, "must be in (0, 1]");
    } else if (k.rfind("time_step_", 0) == 0 && v.is_number_float()) {
      const double d = v.get<double>();
      if (!(std::isfinite(d) && d >= 0.0)) bad(k, v, "must be a finite number >= 0");
    }
  }
  // Token ids index the embedding: an id of 10^12 would wrap to a negative int32.
  for (const char* key : {"bos_token_id", "eos_token_id", "pad_token_id"}) {
    if (!cfg.has(key) || cfg.is_null(key)) continue;
    const nlohmann::json& v = cfg.json()[key];
    const std::vector<nlohmann::json> ids = v.is_array() ? std::vector<nlohmann::json>(v.begin(), v.end())
                                                          : std::vector<nlohmann::json>{v};
    for (const nlohmann::json& id : ids) {
      if (!id.is_number_integer())
        throw ConfigError(file + ": field '" + prefix + key + "' has a " + id.type_name() +
                          " entry, expected an integer token id (or a list of them)");
      const int64_t hi = vocab.value_or(int64_t{1} << 31);
      const bool ok = !id.is_number_unsigned() || id.get<uint64_t>() <= static_cast<uint64_t>(INT64_MAX);
      if (!ok || id.get<int64_t>() < 0 || id.get<int64_t>() >= hi)
        throw ConfigError(file + ": field '" + prefix + key + "' = " + id.dump() + " is out of range: a token id must be in [0, " +
                          std::to_string(hi) + ")" + (vocab ? " (vocab_size)" : ""));
    }
  }

  // Products the families allocate, checked now that every factor is known to be <= 2^24.
  auto f = [&](const char* key) { return int_field(cfg, key); };
  auto product = [&](std::initializer_list<const char*> keys, int64_t limit = kMaxConfigNumel) {
    std::vector<int64_t> vals;
    std::string what;
    for (const char* key : keys) {
      auto x = f(key);
      if (!x) return;
      vals.push_back(*x);
      what += (what.empty() ? "" : " * ") + prefix + key;
    }
    int64_t p = 1;
    for (int64_t x : vals)
      if (__builtin_mul_overflow(p, x, &p) || p > limit)
        throw ConfigError(file + ": " + what + " is too large (over " + std::to_string(limit) +
                          "); refused before allocating");
  };
  product({"vocab_size", "hidden_size"});
  product({"intermediate_size", "hidden_size"});
  product({"num_heads", "head_dim"}, kMaxConfigDim);
  product({"num_heads", "head_dim", "state_size"});
  product({"n_groups", "state_size"}, kMaxConfigDim);
  product({"mamba_n_heads", "mamba_d_head"}, kMaxConfigDim);
  product({"mamba_num_heads", "mamba_head_dim"}, kMaxConfigDim);
  product({"n_groups", "ssm_state_size"}, kMaxConfigDim);
  product({"mamba_n_groups", "mamba_d_state"}, kMaxConfigDim);
  product({"num_attention_heads", "head_dim"}, kMaxConfigDim);
  product({"num_key_value_heads", "head_dim"}, kMaxConfigDim);
  product({"linear_num_key_heads", "linear_key_head_dim"}, kMaxConfigDim);
  product({"linear_num_value_heads", "linear_value_head_dim"}, kMaxConfigDim);
  product({"linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim"});
  product({"num_experts", "moe_intermediate_size", "hidden_size"});
  product({"chunk_size", "chunk_size", "num_heads"});
  product({"mamba_chunk_size", "mamba_chunk_size", "mamba_n_heads"});
  product({"num_hidden_layers", "hidden_size"});
  // expand * hidden_size becomes a width (Mamba's intermediate size, Mamba-2's num_heads * head_dim).
  for (const char* e : {"expand", "mamba_expand"}) {
    auto d = f("hidden_size");
    if (!cfg.has(e) || !cfg.json()[e].is_number() || !d) continue;
    const double w = cfg.json()[e].get<double>() * static_cast<double>(*d);
    if (!(w <= static_cast<double>(kMaxConfigDim)))
      throw ConfigError(file + ": " + prefix + e + " * " + prefix + "hidden_size = " + value_text(nlohmann::json(w)) +
                        " is too large (over " + std::to_string(kMaxConfigDim) + ")");
  }
}

}  // namespace

void validate_config(const io::Config& cfg) {
  auto vocab_of = [](const io::Config& c) -> std::optional<int64_t> {
    return c.has("vocab_size") && c.json()["vocab_size"].is_number_integer() ? int_field(c, "vocab_size") : std::nullopt;
  };
  // Sizes first, so the token-id bound uses a vocab_size already known to be sane.
  std::optional<io::Config> text;
  if (cfg.has("text_config") && cfg.json()["text_config"].is_object()) text = cfg.sub("text_config");
  auto check_vocab = [&](const io::Config& c, const std::string& prefix) {
    if (auto v = c.has("vocab_size") ? std::optional<nlohmann::json>(c.json()["vocab_size"]) : std::nullopt;
        v && v->is_number_integer() &&
        (v->is_number_unsigned() ? v->get<uint64_t>() > static_cast<uint64_t>(kMaxConfigDim)
                                 : (v->get<int64_t>() < 0 || v->get<int64_t>() > kMaxConfigDim)))
      throw ConfigError(where(c) + ": field '" + prefix + "vocab_size' = " + v->dump() +
                        " is out of range: a size must be in [0, " + std::to_string(kMaxConfigDim) + "]");
  };
  check_vocab(cfg, "");
  if (text) check_vocab(*text, "text_config.");
  const std::optional<int64_t> top_vocab = vocab_of(cfg);
  const std::optional<int64_t> text_vocab = text ? vocab_of(*text) : std::nullopt;
  validate_level(cfg, "", top_vocab ? top_vocab : text_vocab);
  if (text) validate_level(*text, "text_config.", text_vocab ? text_vocab : top_vocab);
  for (const io::Config* c : {&cfg, text ? &*text : static_cast<const io::Config*>(nullptr)}) {
    if (!c || !c->has("rope_parameters") || !c->json()["rope_parameters"].is_object()) continue;
    const std::string prefix = c == &cfg ? "rope_parameters." : "text_config.rope_parameters.";
    validate_level(c->sub("rope_parameters"), prefix, std::nullopt);
  }
}

Tensor load_embedding(const io::WeightStore& w, std::initializer_list<const char*> names, const Shape& shape) {
  for (const char* n : names)
    if (w.has(n)) return w.get_matmul(n, shape);
  return w.get_matmul(*names.begin(), shape);  // raises the missing-tensor error with suggestions
}

Tensor transpose_conv(const Tensor& w) {
  const int64_t C = w.size(0), K = w.size(2);
  Tensor t({K, C});
  for (int64_t c = 0; c < C; ++c)
    for (int64_t k = 0; k < K; ++k) t[k * C + c] = w[c * K + k];
  return t;
}

Tensor embed_tokens(const Tensor& embed, const Batch& in, const char* family) {
  const int64_t V = embed.size(0), D = embed.size(1);
  if (in.embeds.defined()) {  // inputs_embeds: the rows as given (shape checked by the caller)
    if (in.embeds.shape() != Shape{in.batch, in.seq, D})
      throw InputError(std::string(family) + ": inputs_embeds has shape " + shape_str(in.embeds.shape()) +
                       ", expected " + shape_str({in.batch, in.seq, D}));
    return in.embeds.clone();
  }
  Tensor h({in.batch, in.seq, D});
  for (int64_t i = 0; i < in.batch * in.seq; ++i) {
    const int32_t id = in.ids[static_cast<size_t>(i)];
    if (id < 0 || id >= V)
      throw InputError(std::string(family) + ": token id " + std::to_string(id) + " at position " +
                       std::to_string(i % in.seq) + " is outside the vocabulary [0, " + std::to_string(V) + ")");
    ops::copy_row(embed, id, h.data() + i * D);  // any weight dtype
  }
  return h;
}

namespace {
// Index of the first NaN / inf in p[0, n), or -1. Blocks are screened with an integer OR over the
// exponent bits (vectorizes without -ffast-math, unlike a float test); only a hit is located.
int64_t first_non_finite(const float* p, int64_t n) {
  constexpr int64_t kBlock = 4096;
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t e = std::min(n, b + kBlock);
    uint32_t hit = 0;
    for (int64_t i = b; i < e; ++i) {
      uint32_t bits;
      std::memcpy(&bits, p + i, sizeof bits);
      hit |= static_cast<uint32_t>((bits & 0x7f800000u) == 0x7f800000u);
    }
    if (hit)
      for (int64_t i = b; i < e; ++i)
        if (!std::isfinite(p[i])) return i;
  }
  return -1;
}
}  // namespace

void FiniteWatch::check(int layer, Value v, const Tensor& t) {
  if (!first_.empty() || !t.defined()) return;
  const float* p = t.begin();
  const int64_t bad = first_non_finite(p, t.numel());
  if (bad < 0) {
    last_finite_ = Site{layer, v};  // its path only for the message (every layer passes here)
    return;
  }
  const std::string path = site_path({layer, v});
  // Row-major index -> coordinates, for the message.
  std::string at;
  int64_t rest = bad;
  std::vector<int64_t> idx(t.shape().size());
  for (size_t d = t.shape().size(); d-- > 0;) {
    idx[d] = rest % t.shape()[d];
    rest /= t.shape()[d];
  }
  for (size_t d = 0; d < idx.size(); ++d) at += (d ? ", " : "") + std::to_string(idx[d]);
  const float x = p[bad];
  first_ = path + " = " + (std::isnan(x) ? "NaN" : x > 0 ? "inf" : "-inf") + " at [" + at + "]";
}

void FiniteWatch::finish(const Tensor& logits) const {
  const float* p = logits.begin();
  int64_t bad = 0;
  if (first_non_finite(p, logits.numel()) >= 0)
    for (int64_t i = 0; i < logits.numel(); ++i) bad += !std::isfinite(p[i]);
  // Also when the logits computed stayed finite (e.g. only the last position's): the NaN is in the
  // cache or in values that full logits would show, so the call's results are not trustworthy.
  if (bad == 0 && first_.empty()) return;
  std::string msg = bad ? family_ + ": forward produced non-finite logits (" + std::to_string(bad) + " of " +
                              std::to_string(logits.numel()) + " entries are NaN or inf)"
                        : family_ + ": forward produced a non-finite value (the logits computed stayed finite)";
  if (!first_.empty()) {
    msg += "; the first non-finite value was " + first_;
    if (last_finite_) msg += " (" + site_path(*last_finite_) + " before it was finite)";
  } else {
    msg += "; every value before the lm_head was finite (logits overflowed float32)";
  }
  msg += ". A written value or input of extreme magnitude (e.g. 3e38) overflows float32; check the edits of this call";
  throw NumericError(msg);
}

Tensor lm_logits(const Tensor& lm_head, const Tensor& h, Listener* ls, bool all_logits) {
  const int64_t B = h.size(0), T = h.size(1), D = h.size(2), V = lm_head.size(0);
  const bool full = all_logits || (ls && ls->wants(-1, Value::logits));
  if (full) {
    Tensor logits({B, T, V});
    ops::linear(h.data(), B * T, D, lm_head, logits.data());
    visit_if(ls, -1, Value::logits, logits);
    return logits;
  }
  Tensor last({B, 1, D});
  for (int64_t b = 0; b < B; ++b)
    std::memcpy(last.data() + b * D, h.data() + (b * T + T - 1) * D, sizeof(float) * static_cast<size_t>(D));
  Tensor logits({B, 1, V});
  ops::linear(last.data(), B, D, lm_head, logits.data());
  return logits;
}

void apply_row_mask(Tensor& t, const Batch& in) {
  const int64_t rows = in.batch * in.seq;
  const int64_t width = t.numel() / rows;
  float* p = t.data();
  for (int64_t r = 0; r < rows; ++r)
    if (!in.mask[static_cast<size_t>(r)]) std::memset(p + r * width, 0, sizeof(float) * static_cast<size_t>(width));
}

std::vector<int64_t> first_real_tokens(const Batch& in) {
  std::vector<int64_t> first(static_cast<size_t>(in.batch), 0);
  if (in.mask.empty()) return first;
  for (int64_t b = 0; b < in.batch; ++b) {
    int64_t t = 0;
    while (t < in.seq && !in.mask[static_cast<size_t>(b * in.seq + t)]) ++t;
    first[static_cast<size_t>(b)] = t;
  }
  return first;
}

ValueInfo global_value(Value v, Shape shape, std::string meaning) {
  ValueInfo i;
  i.site = {-1, v};
  i.path = site_path(i.site);
  i.shape = std::move(shape);
  i.meaning = std::move(meaning);
  return i;
}

ValueInfo layer_value(int layer, Value v, Shape shape, bool per_token, std::string meaning) {
  ValueInfo i;
  i.site = {layer, v};
  i.path = site_path(i.site);
  i.shape = std::move(shape);
  i.per_token = per_token;
  // The token axis is a property of the value: the single-state values have none, states has one
  // (family tables once passed 'writable' here for them).
  if (v == Value::state_input || v == Value::state_output || v == Value::state) i.per_token = false;
  if (v == Value::states) i.per_token = true;
  i.meaning = std::move(meaning);
  return i;
}

void add_state_methods(std::map<std::string, std::map<int, std::string>>& s) {
  auto it = s.find("linear_attn.state");
  if (it == s.end()) return;
  const auto per_layer = it->second;
  s["linear_attn.state_after"] = per_layer;
  s["linear_attn.set_state_after"] = per_layer;
}

void visit_state_input(int li, Tensor& S, bool has_state, Listener* ls, const Shape& served_row,
                       const std::function<Tensor(const Tensor&)>& serve,
                       const std::function<void(const Tensor&, Tensor&)>& store) {
  if (ls && ls->wants(li, Value::state_input)) {
    Tensor served = has_state ? serve(S) : Tensor();
    Shape shape{S.size(0)};
    for (int64_t d : served_row) shape.push_back(d);
    if (ls->visit(li, Value::state_input, served, shape) && served.defined()) store(served, S);
  }
}

void visit_state_output(int li, Tensor& S, Listener* ls, const std::function<Tensor(const Tensor&)>& serve,
                        const std::function<void(const Tensor&, Tensor&)>& store) {
  if (!ls || !ls->wants(li, Value::state_output)) return;
  Tensor served = serve(S);
  if (ls->visit(li, Value::state_output, served, served.shape())) store(served, S);
}

std::map<std::string, std::map<int, std::string>> mixer_only_support(int num_layers, const std::string& family) {
  std::map<std::string, std::map<int, std::string>> s;
  for (int v = 0; v < kNumValues; ++v) {
    const Value val = static_cast<Value>(v);
    if (value_component(val) != Component::linear_attn) continue;
    for (int i = 0; i < num_layers; ++i) s["linear_attn." + std::string(value_name(val))][i] = "";
  }
  for (int i = 0; i < num_layers; ++i) {
    const std::string block = "block " + std::to_string(i) + " is a " + family + " block";
    for (Value v : {Value::attn_queries, Value::attn_keys, Value::attn_values, Value::attn_gate, Value::attn_output,
                    Value::attn_probs})
      s["self_attn." + std::string(value_name(v))][i] =
          block + " (recurrent mixer linear_attn), not softmax attention: use linear_attn values";
    s["mlp.output"][i] = block + ", which has no MLP: the mixer output is layers." + std::to_string(i) +
                         ".linear_attn.attention_output";
  }
  return s;
}

}  // namespace mixlens::detail
