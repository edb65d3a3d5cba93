// Shared pieces of the kernel tests (test_kernels.cpp, test_invariance.cpp, test_gemm16.cpp): the ISA
// levels this CPU runs, forcing one for a test, non-owned tensor storage, seeded normal data.
#pragma once
#include <cstdint>
#include <memory>
#include <random>
#include <vector>

#include "ops/kernels.h"

namespace mixlens::test_util {

/// Every dispatch level this CPU supports, lowest first.
inline std::vector<ops::Isa> levels() {
  std::vector<ops::Isa> out;
  for (ops::Isa i : {ops::Isa::scalar, ops::Isa::avx2, ops::Isa::avx512, ops::Isa::avx512bf16})
    if (ops::isa_supported(i)) out.push_back(i);
  return out;
}

/// Restores the level in use after a test forces one.
struct IsaGuard {
  ops::Isa saved = ops::isa();
  ~IsaGuard() { ops::set_isa(saved); }
};

/// A non-owning owner (a Tensor with a null owner counts as undefined).
inline std::shared_ptr<const void> unowned(const void* p) { return std::shared_ptr<const void>(p, [](const void*) {}); }

/// n draws of N(0, scale^2) from a generator seeded with `seed`.
inline std::vector<float> randn(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 g(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = d(g);
  return v;
}

}  // namespace mixlens::test_util
