// Dataset extraction (include/mixlens/extract.h): plan, batched runs, shards, index, resume.
#include "mixlens/extract.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "io/json.h"
#include "io/safetensors.h"
#include "mixlens/errors.h"
#include "mixlens/tools.h"
// trace_listener.h first: it declares detail::FamilyModel, the type model_access.h refers to.
#include "runtime/trace_listener.h"
#include "runtime/model_access.h"

namespace mixlens {

namespace fs = std::filesystem;

namespace {

constexpr int kFormatVersion = 1;
const char* kIndexName = "index.json";

// FNV-1a 64: a stable fingerprint of the job (not a security hash; it tells runs apart).
struct Fnv {
  uint64_t h = 1469598103934665603ull;
  void bytes(const void* p, size_t n) {
    const auto* c = static_cast<const unsigned char*>(p);
    for (size_t i = 0; i < n; ++i) h = (h ^ c[i]) * 1099511628211ull;
  }
  void str(const std::string& s) {
    const uint64_t n = s.size();
    bytes(&n, 8);
    bytes(s.data(), s.size());
  }
  void i64(int64_t v) { bytes(&v, 8); }
  std::string hex() const {
    char buf[17];
    std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(h));
    return buf;
  }
};

std::string fnv_hex(const std::string& s) {
  Fnv f;
  f.bytes(s.data(), s.size());
  return f.hex();
}

std::string shard_name(int64_t k) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "shard-%05lld.safetensors", static_cast<long long>(k));
  return buf;
}

std::string line_label(const std::string& path, int64_t line) { return path + " line " + std::to_string(line); }

std::vector<uint8_t> parse_mask(const nlohmann::json& j, const std::string& where, const std::string& field) {
  if (!j.is_array()) throw InputError(where + ": field '" + field + "' must be an array of 0/1");
  std::vector<uint8_t> m;
  m.reserve(j.size());
  for (const auto& e : j) {
    if (!e.is_number_integer() && !e.is_boolean())
      throw InputError(where + ": field '" + field + "' must hold only 0 and 1");
    const int64_t v = e.is_boolean() ? int64_t{e.get<bool>()} : e.get<int64_t>();
    if (v != 0 && v != 1) throw InputError(where + ": field '" + field + "' must hold only 0 and 1, got " + std::to_string(v));
    m.push_back(static_cast<uint8_t>(v));
  }
  return m;
}

// Strict UTF-8 (no overlongs, surrogates or code points past U+10FFFF): texts go into index.json.
bool valid_utf8(const std::string& s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    int n = c < 0x80 ? 0 : (c >> 5) == 0x6 ? 1 : (c >> 4) == 0xE ? 2 : (c >> 3) == 0x1E ? 3 : -1;
    if (n < 0 || (n == 1 && c < 0xC2) || i + static_cast<size_t>(n) >= s.size()) return false;
    uint32_t cp = n == 0 ? c : c & (0x3F >> n);
    for (int k = 1; k <= n; ++k) {
      const auto d = static_cast<unsigned char>(s[i + static_cast<size_t>(k)]);
      if ((d >> 6) != 0x2) return false;
      cp = (cp << 6) | (d & 0x3F);
    }
    if ((n == 2 && (cp < 0x800 || (cp >= 0xD800 && cp <= 0xDFFF))) || (n == 3 && (cp < 0x10000 || cp > 0x10FFFF)))
      return false;
    i += static_cast<size_t>(n) + 1;
  }
  return true;
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// Bytes of a shard's index tensors per prompt and per row (prompt_index + offsets; positions + token_ids).
constexpr uint64_t kPromptIndexBytes = 16, kRowIndexBytes = 16;

void write_text_atomic(const fs::path& file, const std::string& text) {
  const fs::path tmp = file.string() + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    if (!f) throw CheckpointError("extract: cannot write '" + tmp.string() + "'");
    f << text;
    if (!f.flush()) throw CheckpointError("extract: cannot write '" + tmp.string() + "'");
  }
  std::error_code ec;
  fs::rename(tmp, file, ec);
  if (ec) throw CheckpointError("extract: cannot rename '" + tmp.string() + "' to '" + file.string() + "': " + ec.message());
}

// A shard file counts as done when it parses and names this plan's fingerprint and shard number.
bool shard_done(const fs::path& file, const ExtractPlan& plan, int64_t k) {
  std::error_code ec;
  if (!fs::is_regular_file(file, ec)) return false;
  try {
    io::SafetensorsFile f(file);
    auto it = f.metadata().find("mixlens_extract");
    if (it == f.metadata().end()) return false;
    const auto meta = nlohmann::json::parse(it->second);
    return meta.value("fingerprint", "") == plan.fingerprint && meta.value("shard", int64_t{-1}) == k;
  } catch (const std::exception&) {
    return false;  // truncated or foreign: written again
  }
}

nlohmann::json index_json(const Model& model, const ExtractPlan& plan, const std::vector<bool>& done) {
  using nlohmann::json;
  const auto& info = model.info();
  const auto& o = plan.options;
  json j;
  j["format"] = "mixlens-extract";
  j["format_version"] = kFormatVersion;
  j["mixlens_version"] = version();
  j["model"] = {{"path", info.path},           {"family", info.family},        {"model_type", info.model_type},
                {"num_layers", info.num_layers}, {"hidden_size", info.hidden_size}, {"vocab_size", info.vocab_size}};
  j["fingerprint"] = plan.fingerprint;
  j["positions"] = o.positions;
  j["batch_size"] = o.batch_size;
  j["shard_bytes"] = o.shard_bytes;
  j["layout"] =
      "left padding is never stored. Per-token VALUE: F32 [rows, *shape], the rows of the shard's prompts one "
      "after another; offsets I64 [P+1] (rows of the shard's j-th prompt: offsets[j]..offsets[j+1]-1), "
      "prompt_index I64 [P] (global prompt number), positions I64 [rows] (token index in its prompt), "
      "token_ids I64 [rows]. A VALUE without a token axis: F32 [P, *shape].";
  json values = json::array();
  for (const auto& v : plan.values)
    values.push_back({{"name", v.name}, {"dtype", "F32"}, {"shape", v.row_shape}, {"per_token", v.per_token}});
  j["values"] = values;
  j["num_prompts"] = static_cast<int64_t>(plan.ids.size());
  j["num_rows"] = plan.total_rows;
  j["total_bytes"] = plan.total_bytes;
  json prompts = json::array();
  for (size_t k = 0; k < plan.shards.size(); ++k)
    for (int64_t i = plan.shards[k].first; i < plan.shards[k].end; ++i) {
      json p;
      if (o.store_prompts) p["text"] = plan.texts[i];
      else p["fnv1a64"] = fnv_hex(plan.texts[i]);
      p["num_tokens"] = plan.ids[i].size();
      p["rows"] = plan.rows[i];
      p["shard"] = k;
      if (o.positions == "mask") p["mask"] = plan.masks[i];
      prompts.push_back(std::move(p));
    }
  j["prompts"] = prompts;
  json shards = json::array();
  bool complete = true;
  for (size_t k = 0; k < plan.shards.size(); ++k) {
    const auto& s = plan.shards[k];
    shards.push_back({{"file", shard_name(static_cast<int64_t>(k))},
                      {"prompts", {s.first, s.end}},
                      {"rows", s.rows},
                      {"bytes", s.bytes},
                      {"done", bool(done[k])}});
    complete = complete && done[k];
  }
  j["shards"] = shards;
  j["complete"] = complete;
  return j;
}

// Positions of prompt i's stored rows, as token indices inside the prompt.
std::vector<int64_t> stored_positions(const ExtractPlan& plan, size_t i) {
  const int64_t n = static_cast<int64_t>(plan.ids[i].size());
  std::vector<int64_t> pos;
  if (plan.options.positions == "all") {
    pos.resize(static_cast<size_t>(n));
    for (int64_t t = 0; t < n; ++t) pos[static_cast<size_t>(t)] = t;
  } else if (plan.options.positions == "last") {
    pos.push_back(n - 1);
  } else {
    for (int64_t t = 0; t < n; ++t)
      if (plan.masks[i][static_cast<size_t>(t)]) pos.push_back(t);
  }
  return pos;
}

void write_shard(const Model& model, const ExtractPlan& plan, int64_t k, const fs::path& file,
                 const ExtractRunOptions& run, const std::function<void(int64_t)>& batch_done) {
  const auto& s = plan.shards[static_cast<size_t>(k)];
  const int64_t P = s.end - s.first;
  std::vector<Tensor> outs;
  for (const auto& v : plan.values) {
    Shape shape{v.per_token ? s.rows : P};
    shape.insert(shape.end(), v.row_shape.begin(), v.row_shape.end());
    outs.emplace_back(shape);
  }
  io::I64Tensor prompt_index{{P}, {}}, offsets{{P + 1}, {0}}, positions{{s.rows}, {}}, token_ids{{s.rows}, {}};
  int64_t row = 0;
  for (int64_t b0 = s.first; b0 < s.end; b0 += plan.options.batch_size) {
    const int64_t b1 = std::min(s.end, b0 + plan.options.batch_size);
    std::vector<std::vector<int32_t>> rows(plan.ids.begin() + b0, plan.ids.begin() + b1);
    const Batch batch = Batch::left_padded(rows, model.pad_token_id());
    Trace trace;
    for (const auto& v : plan.values) trace.save(v.name, Steps::only(0));
    model.run(batch, &trace, run.cancel);
    const int64_t T = batch.seq;
    std::vector<Tensor> got;
    for (const auto& v : plan.values) got.push_back(trace.get(v.name, 0));
    for (int64_t i = b0; i < b1; ++i) {
      const int64_t b = i - b0, j = i - s.first;
      const int64_t n = static_cast<int64_t>(plan.ids[static_cast<size_t>(i)].size());
      const auto pos = stored_positions(plan, static_cast<size_t>(i));
      for (size_t vi = 0; vi < plan.values.size(); ++vi) {
        const auto& v = plan.values[vi];
        const int64_t w = shape_numel(v.row_shape);
        const float* src = got[vi].data();
        float* dst = outs[vi].data();
        if (v.per_token) {
          for (size_t r = 0; r < pos.size(); ++r) {
            const int64_t t = T - n + pos[r];  // left padding: prompt token p sits at T - n + p
            std::memcpy(dst + (row + static_cast<int64_t>(r)) * w, src + (b * T + t) * w,
                        static_cast<size_t>(w) * sizeof(float));
          }
        } else {
          std::memcpy(dst + j * w, src + b * w, static_cast<size_t>(w) * sizeof(float));
        }
      }
      prompt_index.values.push_back(i);
      for (int64_t p : pos) {
        positions.values.push_back(p);
        token_ids.values.push_back(plan.ids[static_cast<size_t>(i)][static_cast<size_t>(p)]);
      }
      row += static_cast<int64_t>(pos.size());
      offsets.values.push_back(row);
    }
    batch_done(b1 - b0);
  }
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (size_t vi = 0; vi < plan.values.size(); ++vi) tensors.emplace_back(plan.values[vi].name, outs[vi]);
  const nlohmann::json meta = {{"fingerprint", plan.fingerprint}, {"shard", k}, {"prompts", {s.first, s.end}}};
  const fs::path tmp = file.string() + ".tmp";
  io::write_safetensors(tmp, tensors, {{"mixlens_extract", meta.dump()}},
                        {{"prompt_index", prompt_index}, {"offsets", offsets}, {"positions", positions},
                         {"token_ids", token_ids}});
  std::error_code ec;
  fs::rename(tmp, file, ec);
  if (ec) throw CheckpointError("extract: cannot rename '" + tmp.string() + "' to '" + file.string() + "': " + ec.message());
}

}  // namespace

std::vector<ExtractPrompt> read_prompts_file(const std::string& path, const std::string& text_field,
                                             const std::string& mask_field) {
  std::error_code ec;
  if (!fs::exists(path, ec)) throw InputError("prompts file '" + path + "' does not exist");
  if (!fs::is_regular_file(path, ec)) throw InputError("prompts file '" + path + "' is not a regular file");
  std::ifstream f(path, std::ios::binary);
  if (!f) throw InputError("prompts file '" + path + "' cannot be read");
  const bool jsonl = ends_with(path, ".jsonl");
  if (!jsonl && !mask_field.empty())
    throw InputError("prompts file '" + path + "': a mask field needs a .jsonl file (plain text has one prompt per line)");
  if (!jsonl && text_field != "text")  // the default is no choice; another field name would be ignored
    throw InputError("prompts file '" + path + "': a text field ('" + text_field +
                     "') needs a .jsonl file (plain text has one prompt per line)");
  std::vector<ExtractPrompt> out;
  std::string line;
  int64_t n = 0;
  while (std::getline(f, line)) {
    ++n;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    const std::string where = line_label(path, n);
    if (line.find_first_not_of(" \t") == std::string::npos)
      throw InputError(where + " is empty (every line is one prompt)");
    if (!valid_utf8(line)) throw InputError(where + " is not valid UTF-8");
    ExtractPrompt p;
    if (!jsonl) {
      p.text = line;
    } else {
      nlohmann::json j;
      try {
        j = io::parse_json_bounded(line.data(), line.data() + line.size(), where, io::ErrorKind::Checkpoint);
      } catch (const nlohmann::json::exception& e) {
        throw InputError(where + ": not valid JSON (" + e.what() + ")");
      } catch (const Error& e) {
        throw InputError(std::string(e.what()));
      }
      if (!j.is_object()) throw InputError(where + ": expected a JSON object with a string field '" + text_field + "'");
      auto it = j.find(text_field);
      if (it == j.end()) throw InputError(where + ": no field '" + text_field + "'");
      if (!it->is_string()) throw InputError(where + ": field '" + text_field + "' is not a string");
      p.text = it->get<std::string>();
      if (p.text.empty()) throw InputError(where + ": field '" + text_field + "' is an empty string");
      if (!mask_field.empty()) {
        auto m = j.find(mask_field);
        if (m == j.end()) throw InputError(where + ": no field '" + mask_field + "'");
        p.mask = parse_mask(*m, where, mask_field);
      }
    }
    out.push_back(std::move(p));
  }
  if (f.bad()) throw InputError("prompts file '" + path + "' cannot be read");
  if (out.empty()) throw InputError("prompts file '" + path + "' is empty (no prompts)");
  return out;
}

void ExtractOptions::check() const {
  if (batch_size < 1) throw InputError("extract: batch size must be >= 1, got " + std::to_string(batch_size));
  if (shard_bytes == 0) throw InputError("extract: shard bytes must be > 0");
  if (positions != "all" && positions != "last" && positions != "mask")
    throw InputError("extract: positions must be 'all', 'last' or 'mask', got '" + positions + "'");
}

ExtractPlan plan_extraction(const Model& model, const std::vector<ExtractPrompt>& prompts, const ExtractOptions& o) {
  if (prompts.empty()) throw InputError("extract: no prompts");
  if (o.values.empty()) throw InputError("extract: no values to extract (give value paths, e.g. layers.*.mixer.betas)");
  o.check();

  ExtractPlan plan;
  plan.options = o;
  // Values: resolve wildcards with the trace's own resolver, then read each one's shape at two
  // lengths to split it into [B, T] + row shape (per token) or [B] + shape.
  const auto& fam = detail::ModelAccess::family(model);
  const auto v1 = model.values(1, 1), v2 = model.values(1, 2);
  std::set<std::string> seen;
  for (const auto& pattern : o.values) {
    if (pattern.find('@') != std::string::npos)
      throw UnsupportedError("extract: '" + pattern + "': per-token state paths (@t) are not extracted; extract "
                             "'...linear_attn.states' with positions instead");
    for (const Site& site : detail::resolve_path(fam, pattern)) {
      const std::string name = site_path(site);
      auto find = [&](const std::vector<ValueInfo>& vs) -> const ValueInfo* {
        for (const auto& v : vs)
          if (v.path == name) return &v;
        return nullptr;
      };
      const ValueInfo* a = find(v1);
      const ValueInfo* b = find(v2);
      if (!a || !b)
        throw UnsupportedError("extract: '" + name + "' is not a stored value of this model (per-token state "
                               "paths are not extracted; use 'states')");
      if (!seen.insert(name).second) continue;
      ExtractPlan::Value v{name, {}, a->per_token};
      const Shape& s1 = a->shape;
      const Shape& s2 = b->shape;
      const bool ok = v.per_token ? (s1.size() >= 2 && s1.size() == s2.size() && s1[0] == 1 && s1[1] == 1 && s2[1] == 2 &&
                                     std::equal(s1.begin() + 2, s1.end(), s2.begin() + 2))
                                  : (!s1.empty() && s1 == s2 && s1[0] == 1);
      if (!ok)
        throw UnsupportedError("extract: '" + name + "' has shape " + shape_str(s1) + " for one token and " +
                               shape_str(s2) + " for two: only values laid out [batch, tokens, ...] or [batch, ...] "
                               "with the rest fixed are extracted");
      v.row_shape.assign(s1.begin() + (v.per_token ? 2 : 1), s1.end());
      plan.values.push_back(std::move(v));
    }
  }

  uint64_t token_bytes = 0, prompt_bytes = kPromptIndexBytes;
  for (const auto& v : plan.values)
    (v.per_token ? token_bytes : prompt_bytes) += static_cast<uint64_t>(shape_numel(v.row_shape)) * 4;
  token_bytes += kRowIndexBytes;

  Fnv fp;
  fp.i64(kFormatVersion);
  const auto& info = model.info();
  for (const auto& s : {info.path, info.family, info.model_type, o.positions}) fp.str(s);
  for (int64_t x : {int64_t{info.num_layers}, info.hidden_size, info.vocab_size, o.batch_size,
                    static_cast<int64_t>(o.shard_bytes)})
    fp.i64(x);
  for (const auto& v : plan.values) fp.str(v.name);

  const size_t N = prompts.size();
  plan.ids.resize(N);
  plan.texts.resize(N);
  plan.rows.resize(N);
  if (o.positions == "mask") plan.masks.resize(N);
  uint64_t cur = 0;
  for (size_t i = 0; i < N; ++i) {
    const auto& p = prompts[i];
    const std::string who = "extract: prompt " + std::to_string(i);
    if (!valid_utf8(p.text)) throw InputError(who + ": the text is not valid UTF-8");
    plan.texts[i] = p.text;
    if (!p.ids.empty()) {
      plan.ids[i] = p.ids;
      for (int32_t id : p.ids)
        if (id < 0 || id >= info.vocab_size)
          throw InputError(who + ": token id " + std::to_string(id) + " is out of range [0, " +
                           std::to_string(info.vocab_size) + ")");
    } else {
      plan.ids[i] = model.tokenizer().encode(p.text);
    }
    if (plan.ids[i].empty()) throw InputError(who + " has no tokens (empty text)");
    const int64_t n = static_cast<int64_t>(plan.ids[i].size());
    if (o.positions == "mask") {
      if (p.mask.size() != plan.ids[i].size())
        throw InputError(who + ": the mask has " + std::to_string(p.mask.size()) + " entries for " + std::to_string(n) +
                         " tokens (one 0/1 per token)");
      // Only 0 and 1: a row is written per 1, and every nonzero entry picks a position.
      for (size_t t = 0; t < p.mask.size(); ++t)
        if (p.mask[t] > 1)
          throw InputError(who + ": mask entry " + std::to_string(t) + " is " + std::to_string(p.mask[t]) +
                           "; a mask holds only 0 and 1");
      plan.masks[i] = p.mask;
      plan.rows[i] = std::count(p.mask.begin(), p.mask.end(), uint8_t{1});
    } else {
      if (!p.mask.empty()) throw InputError(who + ": a mask is only taken with positions 'mask'");
      plan.rows[i] = o.positions == "all" ? n : 1;
    }
    fp.i64(n);
    fp.bytes(plan.ids[i].data(), plan.ids[i].size() * sizeof(int32_t));
    if (o.positions == "mask") fp.bytes(plan.masks[i].data(), plan.masks[i].size());
    fp.str(p.text);  // the index records the text: another text is another extraction
    // A prompt is never split: a new shard starts when it would pass shard_bytes.
    const uint64_t bytes = static_cast<uint64_t>(plan.rows[i]) * token_bytes + prompt_bytes;
    if (plan.shards.empty() || (cur > 0 && cur + bytes > o.shard_bytes)) {
      plan.shards.push_back({static_cast<int64_t>(i), static_cast<int64_t>(i), 0, kPromptIndexBytes / 2});
      cur = kPromptIndexBytes / 2;  // the extra offsets entry
    }
    auto& s = plan.shards.back();
    s.end = static_cast<int64_t>(i) + 1;
    s.rows += plan.rows[i];
    s.bytes += bytes;
    cur += bytes;
    plan.total_rows += plan.rows[i];
  }
  for (const auto& s : plan.shards) plan.total_bytes += s.bytes;
  plan.fingerprint = fp.hex();
  if (o.max_bytes > 0 && plan.total_bytes > o.max_bytes)
    throw ResourceError("extract: the output would take " + std::to_string(plan.total_bytes) + " bytes (" +
                        std::to_string(N) + " prompts, " + std::to_string(plan.total_rows) + " rows), past the limit of " +
                        std::to_string(o.max_bytes) + " bytes (max bytes); extract fewer values, positions or prompts, "
                        "or raise the limit");
  return plan;
}

ExtractSummary extract(const Model& model, const ExtractPlan& plan, const std::string& out, const ExtractRunOptions& run) {
  const auto start = std::chrono::steady_clock::now();
  const fs::path dir(out);
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (!fs::is_directory(dir, ec)) throw CheckpointError("extract: cannot create output folder '" + out + "'");
  const fs::path index = dir / kIndexName;
  if (fs::exists(index, ec)) {
    std::ifstream f(index, std::ios::binary);
    std::stringstream ss;
    ss << f.rdbuf();
    std::string fp;
    try {
      fp = nlohmann::json::parse(ss.str()).value("fingerprint", "");
    } catch (const std::exception&) {
      throw InputError("extract: '" + index.string() + "' is not a mixlens index (not JSON); use another output folder");
    }
    if (fp != plan.fingerprint)
      throw InputError("extract: '" + out + "' holds another extraction (fingerprint " + fp + ", this one " +
                       plan.fingerprint + ": other model, values, options or prompts); use another output folder "
                       "or delete it");
  }
  const int64_t S = static_cast<int64_t>(plan.shards.size());
  std::vector<bool> selected(static_cast<size_t>(S), !run.only_shards.has_value());
  if (run.only_shards)
    for (int64_t k : *run.only_shards) {
      if (k < 0 || k >= S)
        throw InputError("extract: shard " + std::to_string(k) + " is out of range (the plan has " + std::to_string(S) +
                         " shards)");
      selected[static_cast<size_t>(k)] = true;
    }
  std::vector<bool> done(static_cast<size_t>(S));
  for (int64_t k = 0; k < S; ++k) done[static_cast<size_t>(k)] = shard_done(dir / shard_name(k), plan, k);
  if (run.write_index) write_text_atomic(index, index_json(model, plan, done).dump(1) + "\n");

  ExtractProgress pr;
  pr.prompts_total = static_cast<int64_t>(plan.ids.size());
  pr.bytes_total = plan.total_bytes;
  pr.shards_total = S;
  if (run.only_shards) {  // a worker's progress covers its own shards
    pr.prompts_total = 0, pr.bytes_total = 0, pr.shards_total = 0;
    for (int64_t k = 0; k < S; ++k)
      if (selected[static_cast<size_t>(k)]) {
        pr.prompts_total += plan.shards[static_cast<size_t>(k)].end - plan.shards[static_cast<size_t>(k)].first;
        pr.bytes_total += plan.shards[static_cast<size_t>(k)].bytes;
        ++pr.shards_total;
      }
  }
  auto report = [&] {
    pr.elapsed_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (run.on_progress) run.on_progress(pr);
  };
  ExtractSummary sum;
  for (int64_t k = 0; k < S; ++k) {
    if (!selected[static_cast<size_t>(k)]) continue;
    const auto& s = plan.shards[static_cast<size_t>(k)];
    if (done[static_cast<size_t>(k)]) {
      ++sum.shards_skipped;
      pr.prompts_done += s.end - s.first;
      pr.prompts_skipped += s.end - s.first;
      pr.bytes_done += s.bytes;
      ++pr.shards_done;
      report();
      continue;
    }
    const uint64_t per_prompt = s.bytes / static_cast<uint64_t>(s.end - s.first), before = pr.bytes_done;
    write_shard(model, plan, k, dir / shard_name(k), run, [&](int64_t n) {
      pr.prompts_done += n;
      pr.bytes_done += per_prompt * static_cast<uint64_t>(n);
      report();
    });
    done[static_cast<size_t>(k)] = true;
    pr.bytes_done = before + s.bytes;
    ++sum.shards_written;
    ++pr.shards_done;
    report();
  }
  sum.complete = std::all_of(done.begin(), done.end(), [](bool b) { return b; });
  if (run.write_index) write_text_atomic(index, index_json(model, plan, done).dump(1) + "\n");
  return sum;
}

}  // namespace mixlens
