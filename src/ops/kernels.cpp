#include "ops/kernels.h"

#if defined(__x86_64__)
#include <cpuid.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>

#include "mixlens/errors.h"
#include "ops/q8_layout.h"

namespace mixlens::ops {

const char* isa_name(Isa i) {
  switch (i) {
    case Isa::scalar: return "scalar";
    case Isa::avx2: return "avx2";
    case Isa::avx512: return "avx512";
    case Isa::avx512bf16: return "avx512bf16";
  }
  return "?";
}

#if defined(__x86_64__)
namespace {
// CPUID bits __builtin_cpu_supports does not name in every compiler (clang 14: no "f16c",
// "avx512bf16"); the OS-support part (XSAVE state) is covered by the avx2 / avx512f checks.
bool cpuid_bit(unsigned leaf, unsigned sub, int reg, unsigned bit) {
  unsigned r[4] = {0, 0, 0, 0};
  if (!__get_cpuid_count(leaf, sub, &r[0], &r[1], &r[2], &r[3])) return false;
  return (r[reg] >> bit) & 1u;
}
}  // namespace
#endif

bool isa_supported(Isa i) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  switch (i) {
    case Isa::scalar: return true;
    case Isa::avx2:  // F16C: CPUID.1:ECX[29]
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && cpuid_bit(1, 0, 2, 29);
    case Isa::avx512:
      return isa_supported(Isa::avx2) && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl");
    case Isa::avx512bf16:  // AVX512_BF16: CPUID.(7,1):EAX[5]
      return isa_supported(Isa::avx512) && cpuid_bit(7, 1, 0, 5);
  }
  return false;
#else
  return i == Isa::scalar;
#endif
}

Isa best_isa() {
  for (Isa i : {Isa::avx512bf16, Isa::avx512, Isa::avx2})
    if (isa_supported(i)) return i;
  return Isa::scalar;
}

Isa parse_isa(const std::string& name) {
  for (Isa i : {Isa::scalar, Isa::avx2, Isa::avx512, Isa::avx512bf16})
    if (name == isa_name(i)) return i;
  throw InputError("ISA level '" + name + "' is not one of scalar, avx2, avx512, avx512bf16");
}

const KernelTable* kernels_for(Isa i) {
#if defined(__x86_64__)
  switch (i) {
    case Isa::scalar: return &kScalarKernels;
    case Isa::avx2: return &kAvx2Kernels;
    // The bf16 dot instruction (vdpbf16ps) would round the activations to bf16; widening the
    // weights in registers is as fast here (decode is memory-bound) and exact, so the avx512bf16
    // level runs the avx512 kernels (bench/results/kernels.md).
    case Isa::avx512:
    case Isa::avx512bf16: return &kAvx512Kernels;
  }
  return nullptr;
#else
  return i == Isa::scalar ? &kScalarKernels : nullptr;
#endif
}

namespace {
Isa initial_isa() {
  if (const char* s = std::getenv("MIXLENS_ISA"); s && *s) {
    Isa i;
    try {
      i = parse_isa(s);
    } catch (const InputError& e) {
      throw InputError(std::string("MIXLENS_ISA=") + s + ": " + e.what());
    }
    if (!isa_supported(i))
      throw Error(std::string("MIXLENS_ISA=") + s + ": this CPU cannot run that level (best: " + isa_name(best_isa()) + ")");
    return i;
  }
  return best_isa();
}
std::atomic<int>& current() {
  static std::atomic<int> c{static_cast<int>(initial_isa())};
  return c;
}
}  // namespace

Isa isa() { return static_cast<Isa>(current().load(std::memory_order_relaxed)); }

void set_isa(Isa i) {
  if (!isa_supported(i) || !kernels_for(i))
    throw Error(std::string("set_isa: this CPU cannot run ") + isa_name(i) + " (best: " + isa_name(best_isa()) + ")");
  current().store(static_cast<int>(i));
}

const KernelTable& kernels() { return *kernels_for(isa()); }

X16 round_x16(const float* X, int64_t ldx, int64_t rows, int64_t in, int16_t* q, float* s, float* f) {
  const int64_t nb = q8_blocks(in);
  std::fill(q, q + rows * nb * kQ8Block, int16_t{0});
  // Adding and subtracting 1.5 * 2^52 rounds a double below 2^51 to the nearest integer, ties to
  // even (the default mode), as nearbyint does; unlike that libm call it vectorizes (4 -> 1 ns an element).
  constexpr double kRound = 6755399441055744.0;
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = X + r * ldx;
    float big = 0.0f;
    for (int64_t k = 0; k < in; ++k) big = std::max(big, std::fabs(x[k]));  // NaN: skipped, caught per block
    int e = 0;
    if (big > 0.0f && big < 0x1p-60f) std::frexp(big, &e);
    f[r] = std::ldexp(1.0f, e);
    const double p = std::ldexp(1.0, -e);
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + b * kQ8Block;
      const int64_t m = std::min(kQ8Block, in - b * kQ8Block);
      float amax = 0.0f;
      bool finite = true;
      for (int64_t j = 0; j < m; ++j) {
        finite &= std::isfinite(xb[j]);
        amax = std::max(amax, std::fabs(xb[j]));
      }
      float& scale = s[r * nb + b];
      if (!finite) {
        scale = std::nanf("");
        continue;
      }
      scale = static_cast<float>(double(amax) * p / 32767.0);
      if (amax == 0.0f) continue;
      const double inv = 32767.0 / double(amax);
      int16_t* d = q + (r * nb + b) * kQ8Block;
      for (int64_t j = 0; j < m; ++j) d[j] = static_cast<int16_t>((double(xb[j]) * inv + kRound) - kRound);
    }
  }
  return {q, s, f, nb};
}

}  // namespace mixlens::ops
