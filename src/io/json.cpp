#include "io/json.h"

#include <fstream>
#include <limits>
#include <sstream>
#include <system_error>

#include "mixlens/errors.h"

namespace mixlens::io {

void raise_error(ErrorKind kind, const std::string& message) {
  switch (kind) {
    case ErrorKind::Checkpoint: throw CheckpointError(message);
    case ErrorKind::Tokenizer: throw TokenizerError(message);
    case ErrorKind::Config: break;
  }
  throw ConfigError(message);
}

namespace {

// Bare non-finite tokens become these strings before parsing, then doubles again in the parse
// callback. The leading NUL cannot occur in any real config string, so there is no collision.
struct NonFinite {
  const char* token;     // as Python writes it
  const char* sentinel;  // JSON string literal substituted for it
  const char* decoded;   // the sentinel's value after parsing (without the NUL)
  double value;
};
const NonFinite kNonFinite[] = {
    {"-Infinity", "\"\\u0000mixlens:-Infinity\"", "mixlens:-Infinity",
     -std::numeric_limits<double>::infinity()},
    {"Infinity", "\"\\u0000mixlens:Infinity\"", "mixlens:Infinity",
     std::numeric_limits<double>::infinity()},
    {"NaN", "\"\\u0000mixlens:NaN\"", "mixlens:NaN", std::numeric_limits<double>::quiet_NaN()},
};

struct Replacement {
  size_t orig_pos, orig_len, new_pos, new_len;
};

bool ident_char(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
}

// Rewrites bare tokens outside strings; records where, so error positions map back.
std::string replace_non_finite(const std::string& text, std::vector<Replacement>* reps) {
  std::string out;
  bool in_string = false;
  size_t i = 0;
  while (i < text.size()) {
    const char c = text[i];
    if (in_string) {
      out += c;
      if (c == '\\' && i + 1 < text.size()) {
        out += text[i + 1];
        i += 2;
        continue;
      }
      if (c == '"') in_string = false;
      ++i;
      continue;
    }
    if (c == '"') {
      in_string = true;
      out += c;
      ++i;
      continue;
    }
    bool replaced = false;
    if ((c == '-' || c == 'I' || c == 'N') && (i == 0 || !ident_char(text[i - 1]))) {
      for (const NonFinite& nf : kNonFinite) {
        const size_t len = std::char_traits<char>::length(nf.token);
        if (text.compare(i, len, nf.token) == 0 &&
            (i + len == text.size() || !ident_char(text[i + len]))) {
          const size_t slen = std::char_traits<char>::length(nf.sentinel);
          reps->push_back({i, len, out.size(), slen});
          out += nf.sentinel;
          i += len;
          replaced = true;
          break;
        }
      }
    }
    if (!replaced) {
      out += c;
      ++i;
    }
  }
  return out;
}

size_t map_back(size_t pos, const std::vector<Replacement>& reps) {
  const Replacement* last = nullptr;
  for (const Replacement& r : reps) {
    if (r.new_pos > pos) break;
    last = &r;
  }
  if (!last) return pos;
  if (pos < last->new_pos + last->new_len) return last->orig_pos;
  return pos - (last->new_pos + last->new_len) + (last->orig_pos + last->orig_len);
}

// nlohmann messages start with "[json.exception.x.N] "; the part after the position is the detail.
std::string detail_of(const std::string& what) {
  std::string s = what;
  if (auto col = s.find("column "); col != std::string::npos) {
    if (auto colon = s.find(": ", col); colon != std::string::npos) s = s.substr(colon + 2);
  } else if (!s.empty() && s[0] == '[') {
    if (auto close = s.find("] "); close != std::string::npos) s = s.substr(close + 2);
  }
  for (const NonFinite& nf : kNonFinite) {
    const std::string sent = nf.sentinel;
    for (size_t p = s.find(sent); p != std::string::npos; p = s.find(sent, p))
      s.replace(p, sent.size(), nf.token);
  }
  return s;
}

// transformers >= 5 writes non-finite floats as {"__float__": "Infinity"} (e.g. Mamba-2's
// time_step_limit); turn those objects back into doubles. Iterative: the depth is bounded at parse
// time, but a walk that cannot overflow the stack needs no such argument.
void decode_float_objects(nlohmann::json& root) {
  std::vector<nlohmann::json*> todo{&root};
  while (!todo.empty()) {
    nlohmann::json& j = *todo.back();
    todo.pop_back();
    if (j.is_object()) {
      if (j.size() == 1 && j.contains("__float__") && j["__float__"].is_string()) {
        const std::string v = j["__float__"].get<std::string>();
        if (v == "Infinity" || v == "inf") j = std::numeric_limits<double>::infinity();
        else if (v == "-Infinity" || v == "-inf") j = -std::numeric_limits<double>::infinity();
        else if (v == "NaN" || v == "nan") j = std::numeric_limits<double>::quiet_NaN();
        continue;
      }
      for (auto& [k, v] : j.items()) todo.push_back(&v);
    } else if (j.is_array()) {
      for (auto& v : j) todo.push_back(&v);
    }
  }
}

// nlohmann's DOM builder with a depth bound, key hook and sentinel decoding. (nlohmann's own
// callback parser scans the parent object after every child object: O(n^2) on a safetensors header.)
class BoundedSax {
 public:
  using json = nlohmann::json;
  using number_integer_t = json::number_integer_t;
  using number_unsigned_t = json::number_unsigned_t;
  using number_float_t = json::number_float_t;
  using string_t = json::string_t;
  using binary_t = json::binary_t;

  BoundedSax(json& root, const std::function<void(size_t, const std::string&)>& on_key, bool decode)
      : dom_(root, true), on_key_(on_key), decode_(decode) {}
  bool too_deep = false;

  bool null() { return dom_.null(); }
  bool boolean(bool v) { return dom_.boolean(v); }
  bool number_integer(number_integer_t v) { return dom_.number_integer(v); }
  bool number_unsigned(number_unsigned_t v) { return dom_.number_unsigned(v); }
  bool number_float(number_float_t v, const string_t& s) { return dom_.number_float(v, s); }
  bool string(string_t& v) {
    if (decode_ && v.size() > 1 && v[0] == '\0') {
      for (const NonFinite& nf : kNonFinite)
        if (v.compare(1, std::string::npos, nf.decoded) == 0) return dom_.number_float(nf.value, v);
    }
    return dom_.string(v);
  }
  bool binary(binary_t& v) { return dom_.binary(v); }
  bool start_object(std::size_t n) { return enter() && dom_.start_object(n); }
  bool key(string_t& k) {
    if (on_key_) on_key_(depth_, k);
    return dom_.key(k);
  }
  bool end_object() {
    --depth_;
    return dom_.end_object();
  }
  bool start_array(std::size_t n) { return enter() && dom_.start_array(n); }
  bool end_array() {
    --depth_;
    return dom_.end_array();
  }
  template <class Exception>
  bool parse_error(std::size_t pos, const std::string& tok, const Exception& ex) {
    return dom_.parse_error(pos, tok, ex);  // throws ex
  }

 private:
  bool enter() {
    if (++depth_ > kMaxJsonDepth) {
      too_deep = true;
      return false;
    }
    return true;
  }
  nlohmann::detail::json_sax_dom_parser<json> dom_;
  const std::function<void(size_t, const std::string&)>& on_key_;
  bool decode_;
  size_t depth_ = 0;
};

}  // namespace

nlohmann::json parse_json_bounded(const char* begin, const char* end, const std::string& label, ErrorKind kind,
                                  const std::function<void(size_t, const std::string&)>& on_key,
                                  bool decode_sentinels) {
  nlohmann::json j;
  BoundedSax sax(j, on_key, decode_sentinels);
  const bool ok = nlohmann::json::sax_parse(begin, end, &sax, nlohmann::json::input_format_t::json, true);
  if (sax.too_deep)
    raise_error(kind, label + ": JSON nested deeper than " + std::to_string(kMaxJsonDepth) +
                          " levels (arrays / objects); refused");
  if (!ok) raise_error(kind, label + ": not valid JSON");  // parse_error normally threw already
  return j;
}

nlohmann::json parse_json_text(const std::string& text, const std::string& label, ErrorKind kind) {
  std::vector<Replacement> reps;
  const std::string rewritten = replace_non_finite(text, &reps);
  const std::string& src = reps.empty() ? text : rewritten;
  try {
    nlohmann::json j = parse_json_bounded(src.data(), src.data() + src.size(), label, kind, {}, !reps.empty());
    decode_float_objects(j);
    return j;
  } catch (const nlohmann::json::parse_error& e) {
    // e.byte is the 1-based index of the last character read in the rewritten text.
    size_t pos = e.byte > 0 ? e.byte - 1 : 0;
    pos = std::min(map_back(pos, reps), text.size());
    size_t line = 1, line_start = 0;
    for (size_t i = 0; i < pos; ++i)
      if (text[i] == '\n') {
        ++line;
        line_start = i + 1;
      }
    raise_error(kind, label + ": not valid JSON at line " + std::to_string(line) + ", column " +
                          std::to_string(pos - line_start + 1) + ": " + detail_of(e.what()));
  } catch (const nlohmann::json::exception& e) {
    raise_error(kind, label + ": not valid JSON: " + detail_of(e.what()));
  }
}

nlohmann::json read_json_file(const std::filesystem::path& path, const std::string& what,
                              ErrorKind kind) {
  const std::string label = what + " (" + path.string() + ")";
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) raise_error(kind, label + " does not exist");
  if (std::filesystem::is_directory(path, ec)) raise_error(kind, label + " is a directory, not a file");
  // Follows symlinks (HF cache snapshots are symlinks into blobs/); a FIFO would block the read
  // forever and a device such as /dev/zero would never end.
  if (!std::filesystem::is_regular_file(path, ec))
    raise_error(kind, label + " is not a regular file (a folder, FIFO, device or socket); refused");
  const uintmax_t size = std::filesystem::file_size(path, ec);
  if (ec) raise_error(kind, label + " cannot be read: " + ec.message());
  if (size > kMaxJsonFileBytes)
    raise_error(kind, label + " is " + std::to_string(size) + " bytes, over the " +
                          std::to_string(kMaxJsonFileBytes) + "-byte limit for a JSON file");
  std::ifstream f(path, std::ios::binary);
  if (!f) raise_error(kind, label + " cannot be opened for reading");
  std::ostringstream ss;
  ss << f.rdbuf();
  if (f.bad()) raise_error(kind, label + " could not be read");
  return parse_json_text(ss.str(), label, kind);
}

// ---------------------------------------------------------------------------------------------
// Config

namespace {

const char* type_word(const nlohmann::json& v) {
  switch (v.type()) {
    case nlohmann::json::value_t::null: return "null";
    case nlohmann::json::value_t::boolean: return "boolean";
    case nlohmann::json::value_t::string: return "string";
    case nlohmann::json::value_t::array: return "array";
    case nlohmann::json::value_t::object: return "object";
    case nlohmann::json::value_t::number_float: return "float";
    case nlohmann::json::value_t::number_integer:
    case nlohmann::json::value_t::number_unsigned: return "integer";
    default: return "unknown";
  }
}

// nlohmann dumps non-finite doubles as null; show them the way the file wrote them.
std::string value_text(const nlohmann::json& v) {
  if (v.is_number_float()) {
    const double d = v.get<double>();
    if (std::isnan(d)) return "NaN";
    if (std::isinf(d)) return d > 0 ? "Infinity" : "-Infinity";
  }
  return v.dump();
}

std::string file_label(const std::filesystem::path& p) {
  const std::string name = p.filename().string();
  return (name.empty() ? std::string("config") : name) + " (" + p.string() + ")";
}

}  // namespace

Config::Config(nlohmann::json j, std::filesystem::path path, std::string prefix)
    : json_(std::move(j)), path_(std::move(path)), prefix_(std::move(prefix)) {
  if (!json_.is_object()) {
    const std::string where = prefix_.empty() ? std::string("top level")
                                              : "field '" + prefix_.substr(0, prefix_.size() - 1) + "'";
    throw ConfigError(file_label(path_) + ": " + where + " has type " + type_word(json_) +
                      ", expected object");
  }
}

Config Config::load(const std::filesystem::path& folder_or_file) {
  std::error_code ec;
  std::filesystem::path p = folder_or_file;
  if (std::filesystem::is_directory(p, ec)) p /= "config.json";
  return Config(read_json_file(p, p.filename().string(), ErrorKind::Config), p);
}

bool Config::has(const std::string& key) const { return json_.contains(key); }

bool Config::is_null(const std::string& key) const {
  auto it = json_.find(key);
  return it != json_.end() && it->is_null();
}

const nlohmann::json& Config::at(const std::string& key) const {
  auto it = json_.find(key);
  if (it == json_.end())
    throw ConfigError(file_label(path_) + ": field '" + prefix_ + key + "' is missing");
  return *it;
}

void Config::type_error(const std::string& field, const nlohmann::json& v, const char* expected) const {
  std::string shown;
  if (v.is_number()) shown = " (" + value_text(v) + ")";
  throw ConfigError(file_label(path_) + ": field '" + field + "' has type " + type_word(v) + shown +
                    ", expected " + expected);
}

void Config::range_error(const std::string& field, const nlohmann::json& v, const char* expected) const {
  throw ConfigError(file_label(path_) + ": field '" + field + "' = " + value_text(v) +
                    " is out of range for " + expected);
}

Config Config::sub(const std::string& key) const { return Config(at(key), path_, prefix_ + key + "."); }

std::vector<std::string> Config::keys() const {
  std::vector<std::string> out;
  for (const auto& [k, v] : json_.items()) out.push_back(k);
  return out;
}

}  // namespace mixlens::io
