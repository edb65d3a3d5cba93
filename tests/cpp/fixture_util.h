// Helpers for tests that compare against the committed golden fixtures (tests/fixtures/).
#pragma once
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
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

/// A copy of fixture `rel` in a fresh temporary folder (`tag` in its name) whose matmul weights (those a
/// float32 load lists in ModelInfo::matmul_weights) are replaced by fn(weight) (float32), with every other
/// tensor and the JSON files as they were: the reference a narrow-dtype load is compared with.
inline std::filesystem::path weight_transformed_copy(const std::string& rel, const std::string& tag,
                                                     const std::function<Tensor(const Tensor&)>& fn) {
  namespace fs = std::filesystem;
  const fs::path src = fixture(rel);
  const std::vector<std::string> mm = Model::load(src.string()).info().matmul_weights;
  const fs::path dst = fs::temp_directory_path() / ("mixlens_" + tag + "_" + std::to_string(::getpid()) + "_" +
                                                    std::to_string(std::hash<std::string>{}(rel)));
  fs::create_directories(dst);
  for (const auto& e : fs::directory_iterator(src))
    if (e.path().extension() == ".json") fs::copy_file(e.path(), dst / e.path().filename(), fs::copy_options::overwrite_existing);
  io::SafetensorsFile f(src / "model.safetensors");
  std::vector<std::pair<std::string, Tensor>> out;
  for (const io::TensorInfo& t : f.tensors()) {
    const Tensor v = f.get_f32(t.name).clone();
    out.emplace_back(t.name, std::binary_search(mm.begin(), mm.end(), t.name) ? fn(v) : v);
  }
  io::write_safetensors(dst / "model.safetensors", out);
  return dst;
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

/// Relative-RMS tolerance per value: 3e-5 on values, 1e-4 on logits.
/// Why: mixlens and transformers both compute in float32 but in different orders (BLAS blocking,
/// chunked vs token-loop scans, and whatever FMA contraction the compiler chooses), so every value
/// differs from the oracle by rounding (unit roundoff 6e-8) that compounds through the layers and is
/// amplified where a value is a cancelling sum (out_proj of a gated RMSNorm). Measured on the
/// fixtures: ~5e-7 in layer 0, worst 8.9e-6 with GCC 12 and 1.18e-5 with clang 14 (the compilers
/// differ only in FMA contraction) at layers.3.linear_attn.attention_output of the 4-layer,
/// 70-token qwen3_5/hv_eq_hk_chunks case. 3e-5 leaves 2.5x headroom over that and stays far below
/// what a real defect gives (a wrong gate, chunk carry or token offset moves values by 1e-3 or more).
/// Logits add the lm_head's vocabulary-wide sums on top. dev/mixlens_dev/common.py (rel_rms) uses the same.
inline constexpr double kValueTolerance = 3e-5;
inline constexpr double kLogitsTolerance = 1e-4;
inline double tolerance_for(const std::string& key) {
  if (key.find("logits") != std::string::npos) return kLogitsTolerance;
  return kValueTolerance;
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


/// A golden case of any family (tests/fixtures/<family>/<name>): the checkpoint, case.json and
/// golden.safetensors, and what each call of the recorded run was fed.
struct GoldenCase {
  std::string name;
  std::filesystem::path dir;
  nlohmann::json spec;
  io::SafetensorsFile golden;
  Model model;
  std::vector<std::vector<int32_t>> prompts;
  int n_steps = 0;
  std::vector<std::vector<int32_t>> tokens;               ///< greedy token after each step, per row
  std::vector<std::vector<std::vector<int32_t>>> feeds;   ///< feeds[k-1]: rows fed at step k

  GoldenCase(const std::string& family, const std::string& n)
      : name(n), dir(fixture(family + "/" + n)), spec(read_json(dir / "case.json")), golden(dir / "golden.safetensors"),
        model(Model::load(dir.string())) {
    prompts = spec["prompts"].get<std::vector<std::vector<int32_t>>>();
    n_steps = spec["n_steps"].get<int>();
    tokens = rows_of(golden.get_i64("tokens"), static_cast<int64_t>(prompts.size()));
    if (spec.contains("feeds")) {
      feeds = spec["feeds"].get<std::vector<std::vector<std::vector<int32_t>>>>();
    } else {
      for (int k = 1; k < n_steps; ++k) {
        std::vector<std::vector<int32_t>> f;
        for (const auto& row : tokens) f.push_back({row[static_cast<size_t>(k - 1)]});
        feeds.push_back(f);
      }
    }
  }
};

/// Runs the prompt, then steps 1.. with the recorded feeds (teacher forcing); logits per step.
inline std::vector<Tensor> run_recorded_steps(const GoldenCase& c, Trace* trace) {
  Batch b = Batch::left_padded(c.prompts, c.model.pad_token_id());
  Cache cache = c.model.new_cache(b.batch);
  std::vector<Tensor> logits;
  for (int step = 0; step < c.n_steps; ++step) {
    logits.push_back(c.model.forward(b, cache, trace));
    if (step + 1 == c.n_steps) break;
    const auto& f = c.feeds[static_cast<size_t>(step)];
    b.seq = static_cast<int64_t>(f[0].size());
    b.ids.clear();
    for (const auto& row : f) b.ids.insert(b.ids.end(), row.begin(), row.end());
    b.mask.assign(b.ids.size(), 1);
  }
  return logits;
}

// Kernel identity (docs/values.md): each call's `first` is the positions the calls before it pushed
// through; the mixer's kinds and kernels are what the calls record.
inline void expect_kernel_identity(const Model& m, const Trace& t, const std::string& kind) {
  int64_t pushed = 0;
  for (const CallRecord& call : t.calls()) {
    EXPECT_EQ(call.first, pushed) << "step " << call.step;
    pushed += call.seq;
  }
  int layer = 0;
  while (m.info().layer_kinds[static_cast<size_t>(layer)] == LayerKind::attention) ++layer;
  const MixerIdentity id = mixer_identity(m, layer, t.calls().at(0).seq);
  EXPECT_EQ(id.kind, kind);
  EXPECT_EQ(id.state_op, kind == "gated_delta"  ? "gated_delta_rule"
                         : kind == "kimi_delta" ? "kimi_delta_rule"
                         : kind == "short_conv" ? "causal_conv1d_update"
                         : kind == "lightning"  ? "lightning_attention"
                                                : "selective_state_update");
  EXPECT_EQ(id.prompt_kernel, t.calls()[0].kernel);
  for (const CallRecord& call : t.calls()) {
    if (!call.fresh && call.seq == 1) {
      EXPECT_EQ(call.kernel, id.step_kernel) << "step " << call.step;
    }
  }
}

/// generate()'s greedy tokens (eos off, n_steps of them) are the golden run's, row by row.
inline void expect_greedy_tokens(const GoldenCase& c) {
  GenerateOptions o;
  o.max_new_tokens = c.n_steps;
  o.eos_token_id = -1;
  const auto res = c.model.generate(c.prompts, o);
  for (size_t r = 0; r < c.tokens.size(); ++r) EXPECT_EQ(res.new_tokens[r], c.tokens[r]) << "row " << r;
}

inline void save_all_values(const Model& m, Trace& t) {
  for (const auto& v : m.values(1, 1)) t.save(v.path);
}

/// Every golden "path@stepK" (not edits, not ids) equals ours within tolerance_for(); returns the
/// number of values compared.
inline int expect_golden_values(const io::SafetensorsFile& golden, const Trace& t, const std::string& label) {
  int compared = 0;
  for (const auto& info : golden.tensors()) {
    const std::string& key = info.name;
    if (key.rfind("edit/", 0) == 0 || key.find('@') == std::string::npos) continue;
    const std::string path = key.substr(0, key.find('@'));
    const int step = std::stoi(key.substr(key.find("@step") + 5));
    EXPECT_TRUE(t.has(path, step)) << label << ": " << key << " was not produced";
    if (!t.has(path, step)) continue;
    const Tensor& ours = t.get(path, step);
    Tensor ref = golden.get_f32(key);
    EXPECT_EQ(ours.shape(), ref.shape()) << label << ": " << key;
    if (ours.shape() != ref.shape()) continue;
    EXPECT_LE(rel_rms(ours, ref), tolerance_for(key)) << label << ": " << key << " max|diff| " << max_abs_diff(ours, ref);
    ++compared;
  }
  return compared;
}

/// Registers a case.json edit ({"path","step","op": "scale" | "set_index", ...}) on `t`.
inline void add_fixture_edit(Trace& t, const nlohmann::json& e) {
  const std::string op = e["op"];
  const float factor = e.value("factor", 1.0f);
  const int64_t index = e.value("index", 0);
  const float value = e.value("value", 0.0f);
  t.edit(e["path"].get<std::string>(),
         [=](Tensor& v, const SiteContext&) {
           if (op == "scale") {
             for (int64_t i = 0; i < v.numel(); ++i) v[i] *= factor;
           } else {  // set_index along axis 1 (the token, or the head of a state)
             const int64_t B = v.size(0), n1 = v.size(1), inner = v.numel() / (B * n1);
             for (int64_t b = 0; b < B; ++b)
               for (int64_t i = 0; i < inner; ++i) v[(b * n1 + index) * inner + i] = value;
           }
         },
         Steps::only(e["step"].get<int>()));
}

}  // namespace mixlens::test
