// Checks the recurrent families' tests share on a GoldenCase (fixture_util.h): edits against the
// goldens and the values.md invariants (state chaining, continuation, padding, skip token, writes).
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "fixture_util.h"
#include "mixlens/errors.h"
#include "mixlens/model.h"
#include "mixlens/trace.h"

namespace mixlens::test {

/// Whether block `l` has a recurrent mixer (linear_attn values); hybrids also have attention and MLP blocks.
inline bool has_mixer(const Model& m, int l) {
  const LayerKind k = m.info().layer_kinds[static_cast<size_t>(l)];
  return k != LayerKind::attention && k != LayerKind::mlp && k != LayerKind::moe;
}

/// Every golden value of `c` (expect_golden_values) and at least `min_compared` of them.
inline void expect_values_match(const GoldenCase& c, const Trace& t, const std::string& label, int min_compared = 50) {
  EXPECT_GT(expect_golden_values(c.golden, t, label), min_compared) << label;
}

/// Runs every edit of the case teacher-forced and compares all steps' logits with the goldens;
/// each edit must also change some step's logits (an edit that changes nothing proves nothing),
/// or the last step's when `last_step_changes` (edits that reach the state persist to the end).
/// Returns the number of edits checked.
inline int expect_edits_match(const GoldenCase& c, bool last_step_changes = false) {
  int checked = 0;
  const std::vector<Tensor> base = run_recorded_steps(c, nullptr);
  for (const auto& e : c.spec["edits"]) {
    Trace t;
    add_fixture_edit(t, e);
    auto logits = run_recorded_steps(c, &t);
    for (int s = 0; s < c.n_steps; ++s) {
      const std::string key = "edit/" + e["name"].get<std::string>() + "/logits@step" + std::to_string(s);
      Tensor ref = c.golden.get_f32(key);
      EXPECT_LE(rel_rms(logits[static_cast<size_t>(s)], ref), 1e-4) << key;
    }
    double change = 0.0;
    for (size_t s = last_step_changes ? base.size() - 1 : 0; s < base.size(); ++s)
      change = std::max(change, max_abs_diff(logits[s], base[s]));
    EXPECT_GT(change, 0.0) << e["name"] << " changed nothing";
    ++checked;
  }
  return checked;
}

/// The last n positions of logits [1, T, V].
inline Tensor tail_positions(const Tensor& full, int64_t n) {
  const int64_t V = full.size(2);
  Tensor out({1, n, V});
  std::memcpy(out.data(), full.data() + (full.size(1) - n) * V, sizeof(float) * static_cast<size_t>(n * V));
  return out;
}

/// values.md state invariants on the recorded run of every step: states[:, -1] ==
/// state_output (within `rel` of each entry's magnitude) and state_input@k+1 == state_output@k
/// (bit for bit: both are the cache).
inline void expect_state_invariants(const GoldenCase& c, double rel) {
  Trace t;
  t.save("layers.*.linear_attn.states").save("layers.*.linear_attn.state_output").save("layers.*.linear_attn.state_input");
  run_recorded_steps(c, &t);
  for (int l = 0; l < c.model.info().num_layers; ++l) {
    if (!has_mixer(c.model, l)) continue;
    const std::string p = "layers." + std::to_string(l) + ".linear_attn.";
    for (int s = 0; s < c.n_steps; ++s) {
      const Tensor& st = t.get(p + "states", s);         // [B,T,...]
      const Tensor& out = t.get(p + "state_output", s);  // [B,...]
      const int64_t B = st.size(0), T = st.size(1), per = out.numel() / B;
      for (int64_t b = 0; b < B; ++b)
        for (int64_t i = 0; i < per; ++i)
          ASSERT_NEAR(st[(b * T + T - 1) * per + i], out[b * per + i], rel * (1 + std::fabs(out[b * per + i])))
              << c.name << " " << p << " step " << s;
      if (s + 1 < c.n_steps) {
        const Tensor& next_in = t.get(p + "state_input", s + 1);
        ASSERT_EQ(0, std::memcmp(next_in.data(), out.data(), sizeof(float) * static_cast<size_t>(out.numel())))
            << c.name << " " << p << " step " << s;
      }
    }
  }
}

/// values.md: a prompt in one call equals a prefix then the rest as a continuation from the
/// cached state, for the logits, every layer's state_output and per-token states; the
/// continuation's state_input is the prefix's state_output.
inline void expect_continuation_equals_whole(const Model& m, const std::vector<int32_t>& prompt,
                                             const std::vector<size_t>& splits, double tol = 1e-5) {
  Trace whole;
  whole.save("layers.*.linear_attn.state_output").save("logits").save("layers.*.linear_attn.states");
  m.run({prompt}, &whole);
  for (size_t split : splits) {
    Cache cache = m.new_cache(1);
    Trace parts;
    parts.save("layers.*.linear_attn.state_output").save("logits").save("layers.*.linear_attn.states")
        .save("layers.*.linear_attn.state_input");
    m.forward(Batch::left_padded({{prompt.begin(), prompt.begin() + static_cast<std::ptrdiff_t>(split)}}, 0), cache, &parts);
    m.forward(Batch::left_padded({{prompt.begin() + static_cast<std::ptrdiff_t>(split), prompt.end()}}, 0), cache, &parts);
    EXPECT_FALSE(parts.calls()[1].fresh);
    const Tensor& tail = parts.get("logits", 1);
    EXPECT_LE(rel_rms(tail, tail_positions(whole.get("logits"), tail.size(1))), tol) << "split " << split;
    for (int l = 0; l < m.info().num_layers; ++l) {
      if (!has_mixer(m, l)) continue;
      const std::string p = "layers." + std::to_string(l) + ".linear_attn.";
      EXPECT_LE(rel_rms(parts.get(p + "state_output", 1), whole.get(p + "state_output")), tol) << p << " split " << split;
      const Tensor& st_whole = whole.get(p + "states");  // [1,T,...]
      const Tensor& st_tail = parts.get(p + "states", 1);
      const int64_t per = st_whole.numel() / st_whole.size(1), n = st_tail.size(1);
      Tensor ref(st_tail.shape());
      std::memcpy(ref.data(), st_whole.data() + (st_whole.size(1) - n) * per, sizeof(float) * static_cast<size_t>(n * per));
      EXPECT_LE(rel_rms(st_tail, ref), tol) << p << "states, split " << split;
      EXPECT_EQ(0, std::memcmp(parts.get(p + "state_input", 1).data(), parts.get(p + "state_output", 0).data(),
                               sizeof(float) * static_cast<size_t>(parts.get(p + "state_output", 0).numel())));
    }
  }
}

/// values.md: each row of a left-padded batch equals its unbatched run, and padded positions
/// neither write nor decay the state (it is exactly zero there).
inline void expect_batched_equals_unbatched(const Model& m, const std::vector<std::vector<int32_t>>& prompts) {
  Trace batched;
  batched.save("logits").save("layers.*.linear_attn.states");
  m.run(prompts, &batched);
  const Tensor& lb = batched.get("logits");
  const int64_t T = lb.size(1);
  for (size_t r = 0; r < prompts.size(); ++r) {
    Trace single;
    single.save("logits");
    m.run({prompts[r]}, &single);
    const Tensor& ls = single.get("logits");
    const int64_t n = ls.size(1), V = ls.size(2), pad = T - n, row_i = static_cast<int64_t>(r);
    Tensor row({1, n, V});
    std::memcpy(row.data(), lb.data() + (row_i * T + pad) * V, sizeof(float) * static_cast<size_t>(n * V));
    EXPECT_LE(rel_rms(row, ls), 1e-5) << "row " << r;
    for (int l = 0; l < m.info().num_layers; ++l) {
      if (!has_mixer(m, l)) continue;
      const Tensor& st = batched.get("layers." + std::to_string(l) + ".linear_attn.states");
      const int64_t per = st.numel() / (st.size(0) * T);
      for (int64_t t = 0; t < pad; ++t)
        for (int64_t i = 0; i < per; ++i) ASSERT_EQ(st[(row_i * T + t) * per + i], 0.0f) << "layer " << l << " row " << r;
    }
  }
}

/// values.md: betas[:, token] = 0 skips the token: on the recurrent path the state after it is
/// bit for bit the state before it (batch of one prompt).
inline void expect_zero_beta_skips_token(const Model& m, const std::string& family, const std::vector<int32_t>& prompt,
                                         int layer, int64_t token) {
  route_kernels(family, "recurrent");
  Trace t;
  const std::string p = "layers." + std::to_string(layer) + ".linear_attn.";
  t.save(p + "states");
  t.edit(p + "betas", [token](Tensor& v, const SiteContext&) {
    const int64_t per = v.numel() / v.size(1);
    for (int64_t i = 0; i < per; ++i) v[token * per + i] = 0.0f;
  });
  m.run({prompt}, &t);
  route_kernels(family, "default");
  const Tensor& s = t.get(p + "states");
  const int64_t per = s.numel() / s.size(1);
  EXPECT_EQ(0, std::memcmp(s.data() + token * per, s.data() + (token - 1) * per, sizeof(float) * static_cast<size_t>(per)));
}

/// The UnknownValueError message a save of `path` raises ("no error" when it does not).
inline std::string unknown_path_message(const Model& m, const std::vector<std::vector<int32_t>>& prompts,
                                        const std::string& path) {
  Trace t;
  t.save(path);
  try {
    m.run(prompts, &t);
  } catch (const UnknownValueError& e) {
    return e.what();
  }
  return "no error";
}

/// Writing back unchanged values of every mixer input changes nothing.
inline void expect_unchanged_writes_change_nothing(const Model& m, const std::vector<std::vector<int32_t>>& prompts) {
  Tensor base = m.run(prompts);
  Trace t;
  for (const char* p : {"layers.*.linear_attn.betas", "layers.*.linear_attn.decays", "layers.*.linear_attn.attention_values",
                        "layers.*.linear_attn.attention_keys", "layers.*.linear_attn.attention_queries",
                        "layers.*.linear_attn.state_output", "layers.*.linear_attn.attention_head_outputs"}) {
    // The component too: RecurrentGemma's self_attn has attention_keys, its linear_attn has none.
    const std::string leaf = std::string(p).substr(std::string(p).find(".linear_attn."));
    const auto vals = m.values(1, 1);
    if (std::none_of(vals.begin(), vals.end(), [&](const ValueInfo& v) { return v.path.ends_with(leaf); }))
      continue;  // a value the family does not have (LFM2's short conv: betas, decays)
    t.edit(p, [](Tensor&, const SiteContext&) {});
  }
  Tensor again = m.run(prompts, &t);
  EXPECT_LE(rel_rms(again, base), 1e-6);
}

}  // namespace mixlens::test
