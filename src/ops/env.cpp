#include "ops/env.h"

#include <cstdlib>
#include <string>

#include "mixlens/errors.h"

namespace mixlens::detail {

uint64_t env_mib(const char* name, uint64_t default_mib, bool allow_zero) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return default_mib << 20;
  // strtoull alone would take " 5", "+5" and "-1" (wrapped to 2^64 - 1): digits only.
  uint64_t mib = 0;
  bool ok = true;
  for (const char* p = v; *p != '\0' && ok; ++p) {
    ok = *p >= '0' && *p <= '9' && mib <= (uint64_t{1} << 30);
    mib = mib * 10 + static_cast<uint64_t>(*p - '0');
  }
  if (!ok || mib > (uint64_t{1} << 30) || (mib == 0 && !allow_zero))
    throw InputError(std::string(name) + "='" + v + "' must be a whole number of MiB" +
                     (allow_zero ? " (0 turns it off)" : ", at least 1") + ", at most 1073741824");
  return mib << 20;
}

bool env_flag(const char* name, bool default_on) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return default_on;
  const std::string s(v);
  if (s == "1") return true;
  if (s == "0") return false;
  throw InputError(std::string(name) + "='" + s + "' must be 1 (on) or 0 (off)");
}

}  // namespace mixlens::detail
