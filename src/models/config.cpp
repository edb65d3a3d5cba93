#include "models/config.h"

#include <cmath>
#include <optional>

#include "mixlens/errors.h"

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
  static const char* const exact[] = {"n_groups", "mamba_n_groups", "num_experts", "num_local_experts", "num_experts_per_tok",
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
  product({"num_local_experts", "intermediate_size", "hidden_size"});  // Granite's fused experts (x2)
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

int64_t read_dt_rank(const io::Config& cfg, const char* field, int64_t hidden) {
  const nlohmann::json rank = cfg.has(field) ? cfg.json()[field] : nlohmann::json("auto");
  if (rank.is_string() && rank.get<std::string>() == "auto") return (hidden + 15) / 16;
  if (rank.is_number_integer()) return rank.get<int64_t>();
  throw ConfigError(where(cfg) + ": field '" + field + "' must be an integer or \"auto\", got " + rank.dump());
}

void read_time_step_limit(const io::Config& cfg, Mamba2MixerDims& d, bool nullable) {
  if (!cfg.has("time_step_limit")) return;
  if (cfg.is_null("time_step_limit")) {
    if (nullable) return;
    throw ConfigError(where(cfg) + ": time_step_limit is null; this model_type takes a list [min, max] "
                      "(transformers refuses null here too); leave the field out for the default (0, inf)");
  }
  auto lim = cfg.get<std::vector<double>>("time_step_limit");
  if (lim.size() != 2) throw ConfigError(where(cfg) + ": time_step_limit must have 2 entries");
  d.dt_lo = static_cast<float>(lim[0]);
  d.dt_hi = static_cast<float>(lim[1]);
  if (!(d.dt_lo >= 0.0f && d.dt_lo <= d.dt_hi))
    throw ConfigError(where(cfg) + ": time_step_limit [" + std::to_string(lim[0]) + ", " + std::to_string(lim[1]) +
                      "] must satisfy 0 <= min <= max");
}

void read_rope(const io::Config& cfg, double default_partial, double& theta, double& partial) {
  theta = cfg.get_double_or("rope_theta", 10000.0);
  partial = cfg.get_double_or("partial_rotary_factor", default_partial);
  if (cfg.has("rope_parameters") && !cfg.is_null("rope_parameters")) {
    const io::Config rp = cfg.sub("rope_parameters");
    const std::string rt = rp.get_or<std::string>("rope_type", "default");
    if (rt != "default")
      throw UnsupportedError(where(cfg) + ": rope_parameters.rope_type '" + rt + "' is not supported (only 'default')");
    theta = rp.get_double_or("rope_theta", theta);
    partial = rp.get_double_or("partial_rotary_factor", partial);
  }
  if (!(theta > 0.0) || !std::isfinite(theta)) throw ConfigError(where(cfg) + ": rope_theta must be a finite number > 0");
}

void read_full_rope(const io::Config& cfg, AttentionMixerDims& d) {
  double partial = 1.0;
  read_rope(cfg, 1.0, d.theta, partial);
  d.rope = true;
  d.rot = d.hd;
}

bool read_layer_types(const io::Config& cfg, std::initializer_list<const char*> names, int64_t layers,
                      std::vector<std::string>& types, std::string& field) {
  field = *names.begin();
  types.clear();
  for (const char* f : names)
    if (types.empty() && cfg.has(f) && !cfg.is_null(f)) {
      types = cfg.get<std::vector<std::string>>(f);
      field = f;
    }
  if (types.empty()) return false;
  if (static_cast<int64_t>(types.size()) != layers)
    throw ConfigError(where(cfg) + ": " + field + " has " + std::to_string(types.size()) + " entries but num_hidden_layers is " +
                      std::to_string(layers));
  return true;
}

void read_attention_heads(const io::Config& cfg, int64_t hidden, AttentionMixerDims& d) {
  d.H = cfg.get<int64_t>("num_attention_heads");
  d.Hkv = cfg.has("num_key_value_heads") && !cfg.is_null("num_key_value_heads") ? cfg.get<int64_t>("num_key_value_heads") : d.H;
  require_positive(cfg, {{"num_attention_heads", d.H}, {"num_key_value_heads", d.Hkv}});
  if (!cfg.has("head_dim") && hidden % d.H != 0)
    throw ConfigError(where(cfg) + ": hidden_size (" + std::to_string(hidden) + ") is not divisible by num_attention_heads (" +
                      std::to_string(d.H) + ") and head_dim is not given");
  d.hd = cfg.get_or<int64_t>("head_dim", hidden / d.H);
  require_positive(cfg, {{"head_dim", d.hd}});
}

namespace {
// The first of `names` present and not null, else `fallback`; `used` names the field read (or the
// first name) for messages.
int64_t first_of(const io::Config& cfg, const std::vector<std::string>& names, int64_t fallback, std::string& used) {
  used = names.front();
  for (const std::string& n : names)
    if (cfg.has(n) && !cfg.is_null(n)) {
      used = n;
      return cfg.get<int64_t>(n);
    }
  return fallback;
}
}  // namespace

void read_mamba2_dims(const io::Config& cfg, int64_t D, float eps, const Mamba2Spelling& f, Mamba2MixerDims& d) {
  std::string used;
  d.D = D;
  d.H = first_of(cfg, f.heads, f.heads_default, used);
  require_positive(cfg, {{used.c_str(), d.H}});
  if (f.width_from_heads) {
    d.P = first_of(cfg, f.head_dim, f.head_dim_default, used);
    d.E = d.H * d.P;
  } else {
    // mamba_d_ssm when given, else int(mamba_expand * hidden_size) (FalconH1Mixer.intermediate_size).
    d.E = f.d_ssm && cfg.has("mamba_d_ssm") && !cfg.is_null("mamba_d_ssm")
              ? cfg.get<int64_t>("mamba_d_ssm")
              : static_cast<int64_t>(cfg.get_double_or("mamba_expand", 2.0) * static_cast<double>(D));
    const std::string& hn = f.head_dim.front();
    const bool auto_head = !cfg.has(hn) || cfg.is_null(hn) || cfg.json().at(hn).is_string();
    d.P = auto_head ? d.E / d.H : cfg.get<int64_t>(hn);
  }
  d.N = first_of(cfg, f.state, f.state_default, used);
  d.G = first_of(cfg, f.groups, f.groups_default, used);
  d.K = first_of(cfg, f.conv, f.conv_default, used);
  d.chunk = first_of(cfg, f.chunk, f.chunk_default, used);
  d.eps = eps;
}

void read_mamba2_dims(const io::Config& cfg, int64_t D, float eps, bool d_ssm, Mamba2MixerDims& d) {
  Mamba2Spelling f;
  f.d_ssm = d_ssm;
  read_mamba2_dims(cfg, D, eps, f, d);
}

}  // namespace mixlens::detail
