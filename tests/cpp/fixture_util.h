// Helpers for tests that compare against the committed golden fixtures (tests/fixtures/).
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "io/safetensors.h"
#include "mixlens/model.h"

namespace mixlens::test {

inline std::filesystem::path source_dir() { return MIXLENS_SOURCE_DIR; }
inline std::filesystem::path fixture(const std::string& rel) { return source_dir() / "tests" / "fixtures" / rel; }

inline nlohmann::json read_json(const std::filesystem::path& p) {
  std::ifstream f(p);
  return nlohmann::json::parse(f);
}

/// ||a - b|| / ||b|| (relative RMS error); 0 when both are zero.
inline double rel_rms(const Tensor& a, const Tensor& b) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    const double d = static_cast<double>(a[i]) - b[i];
    num += d * d;
    den += static_cast<double>(b[i]) * b[i];
  }
  if (den == 0) return std::sqrt(num);
  return std::sqrt(num / den);
}

inline double max_abs_diff(const Tensor& a, const Tensor& b) {
  double m = 0;
  for (int64_t i = 0; i < a.numel(); ++i) m = std::max(m, std::fabs(static_cast<double>(a[i]) - b[i]));
  return m;
}

/// Relative-RMS tolerance per value (issue 2: float32 1e-5 on values, 1e-4 on logits).
inline double tolerance_for(const std::string& key) {
  if (key.find("logits") != std::string::npos) return 1e-4;
  return 1e-5;
}

inline std::vector<std::string> fixture_cases(const std::string& family) {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(fixture(family)))
    if (e.is_directory() && std::filesystem::exists(e.path() / "golden.safetensors"))
      out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

/// Rows of a [B, n] int64 golden tensor.
inline std::vector<std::vector<int32_t>> rows_of(const std::vector<int64_t>& flat, int64_t B) {
  std::vector<std::vector<int32_t>> r(static_cast<size_t>(B));
  const int64_t n = static_cast<int64_t>(flat.size()) / B;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < n; ++i) r[b].push_back(static_cast<int32_t>(flat[static_cast<size_t>(b * n + i)]));
  return r;
}

}  // namespace mixlens::test
