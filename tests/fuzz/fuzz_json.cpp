// libFuzzer harness for config.json: the JSON reader (depth bound, Infinity/NaN rewriting,
// {"__float__": ...} objects, error-position mapping), the typed Config getters and the range
// validator every family runs first. Only mixlens::Error may escape; see README.md in this folder.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "io/json.h"
#include "mixlens/errors.h"
#include "models/common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    nlohmann::json j = mixlens::io::parse_json_text(text, "fuzz.json");
    mixlens::io::Config c(std::move(j), "fuzz.json");
    try { mixlens::detail::validate_config(c); } catch (const mixlens::Error&) {}
    for (const std::string& k : c.keys()) {
      try { (void)c.get<int64_t>(k); } catch (const mixlens::Error&) {}
      try { (void)c.get<int32_t>(k); } catch (const mixlens::Error&) {}
      try { (void)c.get<float>(k); } catch (const mixlens::Error&) {}
      try { (void)c.get<std::vector<double>>(k); } catch (const mixlens::Error&) {}
      try { (void)c.get<std::string>(k); } catch (const mixlens::Error&) {}
      try { (void)c.sub(k).keys(); } catch (const mixlens::Error&) {}
    }
  } catch (const mixlens::Error&) {
  }
  return 0;
}
