// Settings read from MIXLENS_* environment variables: one parser, so every one of them refuses a typo
// the same way instead of silently running with a default.
#pragma once
#include <cstdint>

namespace mixlens::detail {

/// $name as a whole number of MiB, returned in bytes; `default_mib` MiB when the variable is unset or
/// empty. InputError naming the variable for anything but decimal digits (no sign, no spaces, no
/// unit), for 0 unless `allow_zero`, and for more than 2^30 MiB (1 PiB).
uint64_t env_mib(const char* name, uint64_t default_mib, bool allow_zero);

/// $name as a switch: "1" on, "0" off, `default_on` when unset or empty. InputError naming the
/// variable for anything else ("false", "yes", " 1"), so a misspelled setting never runs silently.
bool env_flag(const char* name, bool default_on);

}  // namespace mixlens::detail
