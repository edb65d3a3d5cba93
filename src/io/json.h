// JSON files of a checkpoint folder (config.json, tokenizer.json, index files) and typed access to
// config fields. Accepts the bare Infinity / -Infinity / NaN tokens Python's json module writes
// (e.g. transformers' Mamba-2 config has "time_step_limit": [0.0, Infinity]).
#pragma once
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <type_traits>
#include <vector>

namespace mixlens::io {

/// Which mixlens error type a JSON failure raises.
enum class ErrorKind { Config, Checkpoint, Tokenizer };

/// Throws the error type for `kind` with `message`.
[[noreturn]] void raise_error(ErrorKind kind, const std::string& message);

/// Deepest nesting of arrays / objects accepted in any JSON mixlens reads (config.json, index files,
/// safetensors headers, tokenizer.json). Real files nest under 10 levels; the bound keeps every
/// recursive walk over the DOM (ours, nlohmann's copy and dump) far from the stack limit.
inline constexpr size_t kMaxJsonDepth = 128;
/// Largest config.json / index file read (real ones are a few KB; a tokenizer.json has its own limit).
inline constexpr uint64_t kMaxJsonFileBytes = uint64_t{64} << 20;

/// Parses [begin, end) into a DOM in linear time. Refuses nesting beyond kMaxJsonDepth with `kind`:
/// "<label>: JSON nested deeper than 128 levels". `on_key(depth, key)`, when given, sees every object
/// key (depth 1 = keys of the top-level object). Syntax errors propagate as
/// nlohmann::json::parse_error (callers map the position). Strings starting with a NUL byte that
/// name a non-finite sentinel (see parse_json_text) become doubles when `decode_sentinels`.
nlohmann::json parse_json_bounded(const char* begin, const char* end, const std::string& label, ErrorKind kind,
                                  const std::function<void(size_t, const std::string&)>& on_key = {},
                                  bool decode_sentinels = false);

/// Parses JSON text. Bare Infinity, -Infinity and NaN outside strings become the doubles +-inf and
/// NaN. On a syntax error raises `kind` with "<label>: not valid JSON at line L, column C: ..."
/// (positions refer to the original text).
nlohmann::json parse_json_text(const std::string& text, const std::string& label,
                               ErrorKind kind = ErrorKind::Config);

/// Reads and parses a JSON file (as parse_json_text). `what` names it in messages, e.g.
/// "config.json"; errors read "<what> (<path>): ...". Raises `kind` when the file is missing, not a
/// regular file (a FIFO or device would hang or never end), larger than kMaxJsonFileBytes,
/// unreadable, not valid JSON, or nested deeper than kMaxJsonDepth.
nlohmann::json read_json_file(const std::filesystem::path& path, const std::string& what,
                              ErrorKind kind = ErrorKind::Config);

/// A JSON object of configuration fields (config.json, or a nested object such as text_config),
/// with typed getters whose errors name the file and the field. All errors are ConfigError.
/// Supported T: bool, std::string, integer types, float, double, nlohmann::json, and
/// std::vector of any of these.
class Config {
 public:
  Config() = default;
  /// `j` must be an object (else ConfigError). `prefix` is prepended to field names in messages.
  Config(nlohmann::json j, std::filesystem::path path, std::string prefix = "");
  /// Reads `folder/config.json`, or the file itself when given a file path.
  static Config load(const std::filesystem::path& folder_or_file);

  /// True when the field is present (even if it is null).
  bool has(const std::string& key) const;
  /// True when the field is present and null.
  bool is_null(const std::string& key) const;

  /// The field converted to T. ConfigError "config.json (<path>): field 'X' is missing" or
  /// "... field 'X' has type string, expected integer" (also for null, out-of-range integers
  /// and floats with a fractional part where an integer is expected).
  template <class T>
  T get(const std::string& key) const {
    return convert<T>(at(key), prefix_ + key);
  }
  /// As get, but `fallback` when the field is missing or null (HF configs use null for "default").
  template <class T>
  T get_or(const std::string& key, T fallback) const {
    auto it = json_.find(key);
    if (it == json_.end() || it->is_null()) return fallback;
    return convert<T>(*it, prefix_ + key);
  }
  /// A number as double; accepts integers, and +-inf / NaN written as Infinity / NaN.
  double get_double(const std::string& key) const { return get<double>(key); }
  double get_double_or(const std::string& key, double fallback) const {
    return get_or<double>(key, fallback);
  }
  /// A nested object, e.g. sub("text_config"); its errors name fields as "text_config.X".
  Config sub(const std::string& key) const;

  std::vector<std::string> keys() const;
  const nlohmann::json& json() const { return json_; }
  const std::filesystem::path& path() const { return path_; }

 private:
  const nlohmann::json& at(const std::string& key) const;
  [[noreturn]] void type_error(const std::string& field, const nlohmann::json& v,
                               const char* expected) const;
  [[noreturn]] void range_error(const std::string& field, const nlohmann::json& v,
                                const char* expected) const;

  template <class T>
  struct is_vector : std::false_type {};
  template <class U, class A>
  struct is_vector<std::vector<U, A>> : std::true_type {};

  template <class T>
  T convert(const nlohmann::json& v, const std::string& field) const {
    if constexpr (std::is_same_v<T, nlohmann::json>) {
      return v;
    } else if constexpr (std::is_same_v<T, bool>) {
      if (!v.is_boolean()) type_error(field, v, "boolean");
      return v.get<bool>();
    } else if constexpr (std::is_same_v<T, std::string>) {
      if (!v.is_string()) type_error(field, v, "string");
      return v.get<std::string>();
    } else if constexpr (std::is_integral_v<T>) {
      using L = std::numeric_limits<T>;
      if (v.is_number_unsigned()) {
        const uint64_t u = v.get<uint64_t>();
        if (u > static_cast<uint64_t>(L::max())) range_error(field, v, "integer");
        return static_cast<T>(u);
      }
      if (v.is_number_integer()) {
        const int64_t i = v.get<int64_t>();
        if constexpr (std::is_signed_v<T>) {
          if (i < static_cast<int64_t>(L::min()) || i > static_cast<int64_t>(L::max()))
            range_error(field, v, "integer");
        } else {
          if (i < 0 || static_cast<uint64_t>(i) > static_cast<uint64_t>(L::max()))
            range_error(field, v, "integer");
        }
        return static_cast<T>(i);
      }
      if (v.is_number_float()) {
        // Accept 4.0 for 4 (some exporters write integral floats); refuse 4.5 and out-of-range.
        const double d = v.get<double>();
        if (!std::isfinite(d) || std::trunc(d) != d) type_error(field, v, "integer");
        if (d < static_cast<double>(L::min()) || d >= static_cast<double>(L::max()) + 1.0)
          range_error(field, v, "integer");
        return static_cast<T>(d);
      }
      type_error(field, v, "integer");
    } else if constexpr (std::is_floating_point_v<T>) {
      if (!v.is_number()) type_error(field, v, "number");
      const double d = v.get<double>();
      if constexpr (sizeof(T) < sizeof(double)) {
        // A finite double beyond float's range would be UB to cast; inf written as Infinity is fine.
        if (std::isfinite(d) && std::fabs(d) > static_cast<double>(std::numeric_limits<T>::max()))
          range_error(field, v, "float");
      }
      return static_cast<T>(d);
    } else if constexpr (is_vector<T>::value) {
      if (!v.is_array()) type_error(field, v, "array");
      T out;
      out.reserve(v.size());
      for (size_t i = 0; i < v.size(); ++i)
        out.push_back(convert<typename T::value_type>(v[i], field + "[" + std::to_string(i) + "]"));
      return out;
    } else {
      static_assert(!sizeof(T), "Config::get: unsupported type");
    }
  }

  nlohmann::json json_ = nlohmann::json::object();
  std::filesystem::path path_;
  std::string prefix_;
};

}  // namespace mixlens::io
