// The int8 weight layout's constants alone, for the ISA-specific kernel files (which include no
// header with inline functions or library templates: see kernels_avx512.cpp).
#pragma once
#include <cstdint>

namespace mixlens::ops {

/// An int8 weight row of `in` weights is ceil(in / kQ8Block) blocks of kQ8BlockBytes, each a
/// float32 scale s then kQ8Block int8 values q (the last block zero-padded); weight = float(q * s).
constexpr int64_t kQ8Block = 32;
constexpr int64_t kQ8BlockBytes = 4 + kQ8Block;

}  // namespace mixlens::ops
