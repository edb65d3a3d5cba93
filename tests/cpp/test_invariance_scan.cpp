// One number per value, scan side (issue 23 items 1 and 2, values.md "One number per value"):
// states[:, t] == state_after(t) == the per-token state at t and states[:, -1] == state_output, exactly,
// on every family and both kernel routes, prompt, continuation and decode, with and without writes;
// a read of a per-token state changes no other number of the call; a token with dt / beta (and the
// gated DeltaNet decay) 0 keeps the state; a layer's states and per-token state in any order in one
// Session; a row's scan values are the same alone and inside a left-padded batch.
// "Exactly" is float == per element (what torch.equal checks): any rounding difference fails.
#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "fixture_util.h"
#include "mixlens/errors.h"
#include "mixlens/model.h"
#include "mixlens/session.h"
#include "mixlens/trace.h"

using namespace mixlens;
using namespace mixlens::test;

namespace {

const char* const kFamilies[] = {"mamba2", "mamba", "falcon_mamba", "qwen3_5", "qwen3_5_moe", "qwen3_next", "nemotron_h", "bamba", "falcon_h1",
                                 "granitemoehybrid",
                                 "jamba",
                                 "olmo_hybrid",
                                 "zamba2",
                                 "zamba",
                                 "kimi_linear",
                                 "minimax", "xlstm"};

std::string mix(int layer, const std::string& v) { return "layers." + std::to_string(layer) + ".linear_attn." + v; }
std::string at(int layer, int64_t t) { return mix(layer, "state") + "@t" + std::to_string(t); }

bool gated_delta(const std::string& family) {
  return family == "qwen3_5" || family == "qwen3_5_moe" || family == "qwen3_next" || family == "olmo_hybrid" ||
         family == "kimi_linear";
}

// The chunk size of the family's chunked kernel, set to a short one where the model allows it
// (gated DeltaNet's is transformers' fixed 64).
int64_t use_chunk(const std::string& family, Model& m) {
  if (gated_delta(family)) return 64;
  m.set_chunk_size(8);
  return 8;
}

std::vector<int> mixer_layers(const Model& m) {
  std::vector<int> out;
  for (int l = 0; l < m.info().num_layers; ++l)
    if (const LayerKind k = m.info().layer_kinds[static_cast<size_t>(l)];
        k != LayerKind::attention && k != LayerKind::mlp && k != LayerKind::moe)
      out.push_back(l);
  return out;
}

Model load_family(const std::string& family) { return Model::load(fixture(family + "/" + fixture_cases(family)[0]).string()); }

// A MoE product gathers every row's routed tokens, so a write on one row moves another row's rounding
// unless deterministic (README "Batch invariance"): BLAS's per-row sums depend on the expert's token
// count on some cores (OpenBLAS's Haswell / Zen sgemm kernels, not SkylakeX's).
bool routed_experts(const std::string& family) {
  return family == "jamba" || family == "qwen3_5_moe" || family == "qwen3_next" || family == "kimi_linear" ||
         family == "granitemoehybrid" || family == "nemotron_h" ||
         family == "minimax";
}
Model load_invariant(const std::string& family) {
  LoadOptions o;
  if (routed_experts(family)) o.deterministic = true;
  return Model::load(fixture(family + "/" + fixture_cases(family)[0]).string(), o);
}

std::vector<int32_t> random_ids(const Model& m, int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> d(1, static_cast<int32_t>(std::min<int64_t>(m.info().vocab_size, 1000)) - 1);
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (auto& i : ids) i = d(rng);
  return ids;
}

// Token t of [B,T,...] as [B,...].
Tensor token_of(const Tensor& states, int64_t t) {
  const int64_t B = states.size(0), T = states.size(1), per = states.numel() / (B * T);
  Shape s{B};
  for (size_t i = 2; i < states.shape().size(); ++i) s.push_back(states.shape()[i]);
  Tensor out = Tensor::uninitialized(s);
  for (int64_t b = 0; b < B; ++b)
    std::memcpy(out.data() + b * per, states.data() + (b * T + t) * per, sizeof(float) * static_cast<size_t>(per));
  return out;
}

// Row b, tokens [t0, T) of [B,T,...] (or all of row b of [B,...] when tokens is false).
std::vector<float> row_of(const Tensor& v, int64_t b, int64_t t0 = 0, bool tokens = true) {
  const int64_t B = v.size(0);
  if (!tokens) {
    const int64_t per = v.numel() / B;
    return {v.data() + b * per, v.data() + (b + 1) * per};
  }
  const int64_t T = v.size(1), per = v.numel() / (B * T);
  return {v.data() + (b * T + t0) * per, v.data() + (b + 1) * T * per};
}

// Exactly equal, element by element; the message names the first difference.
::testing::AssertionResult same(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return ::testing::AssertionFailure() << "sizes " << a.size() << " vs " << b.size();
  for (size_t i = 0; i < a.size(); ++i)
    if (!(a[i] == b[i]))
      return ::testing::AssertionFailure() << "element " << i << ": " << a[i] << " vs " << b[i] << " (|d| "
                                           << std::fabs(a[i] - b[i]) << ")";
  return ::testing::AssertionSuccess();
}
::testing::AssertionResult same(const Tensor& a, const Tensor& b) {
  if (a.shape() != b.shape()) return ::testing::AssertionFailure() << "shapes differ";
  return same(std::vector<float>(a.begin(), a.end()), std::vector<float>(b.begin(), b.end()));
}

struct Routed {
  std::string family;
  Routed(std::string f, const char* route) : family(std::move(f)) { route_kernels(family, route); }
  ~Routed() { route_kernels(family, "default"); }
};

struct Param {
  std::string family;
  const char* route;
  friend void PrintTo(const Param& p, std::ostream* os) { *os << p.family << "/" << p.route; }
};

std::vector<Param> all_params() {
  std::vector<Param> out;
  for (const char* f : kFamilies)
    for (const char* r : {"chunked", "recurrent"}) out.push_back({f, r});
  return out;
}

class ScanIdentity : public ::testing::TestWithParam<Param> {};

// Saves of one call: every mixer layer's states, state_output, head outputs and the logits; with
// `per_token`, also the per-token state at every token (the scan pauses at each).
void save_all(Trace& t, const Model& m, int64_t T, bool per_token, int step) {
  t.save("logits", Steps::only(step));
  for (int l : mixer_layers(m)) {
    t.save(mix(l, "states"), Steps::only(step)).save(mix(l, "state_output"), Steps::only(step));
    t.save(mix(l, "attention_head_outputs"), Steps::only(step));
    if (per_token)
      for (int64_t k = 0; k < T; ++k) t.save(at(l, k), Steps::only(step));
  }
}

// Checks the identities of one call's saves at `step` (T tokens): states rows == per-token saves (when
// present), states[:, -1] == state_output.
void expect_identities(const Trace& t, const Model& m, int64_t T, int step, const std::string& label) {
  for (int l : mixer_layers(m)) {
    const Tensor states = t.get(mix(l, "states"), step);
    EXPECT_TRUE(same(token_of(states, T - 1), t.get(mix(l, "state_output"), step)))
        << label << " layer " << l << ": states[:, -1] vs state_output";
    for (int64_t k = 0; k < T; ++k)
      if (t.has(at(l, k), step)) {
        EXPECT_TRUE(same(token_of(states, k), t.get(at(l, k), step))) << label << " layer " << l << " t=" << k;
      }
  }
}

// Everything two traces both saved at `step` is equal (a per-token read changed no other number).
void expect_same_values(const Trace& a, const Trace& b, const Model& m, int step, const std::string& label) {
  EXPECT_TRUE(same(a.get("logits", step), b.get("logits", step))) << label << ": logits";
  for (int l : mixer_layers(m))
    for (const char* v : {"states", "state_output", "attention_head_outputs"})
      EXPECT_TRUE(same(a.get(mix(l, v), step), b.get(mix(l, v), step))) << label << " layer " << l << " " << v;
}

}  // namespace

TEST_P(ScanIdentity, StatesStateAfterStateOutputAreOneNumberAndReadsChangeNothing) {
  const Param& p = GetParam();
  Routed routed(p.family, p.route);
  Model m = load_family(p.family);
  const int64_t Q = use_chunk(p.family, m);
  for (int64_t T : {int64_t{1}, Q - 1, Q, Q + 1, 2 * Q + 1}) {
    const std::string label = p.family + "/" + p.route + " T=" + std::to_string(T);
    const auto ids = random_ids(m, T, static_cast<uint32_t>(T));
    Trace plain, read;
    save_all(plain, m, T, false, 0);
    save_all(read, m, T, true, 0);
    m.run({ids}, &plain);
    m.run({ids}, &read);
    expect_identities(plain, m, T, 0, label + " plain");
    expect_identities(read, m, T, 0, label + " read");
    expect_same_values(plain, read, m, 0, label);

    // Continuation (3 tokens over the cache) and a decode step: the same identities there.
    Cache cache = m.new_cache(1);
    m.forward(Batch::left_padded({ids}, m.pad_token_id()), cache, nullptr, false);
    const auto more = random_ids(m, 3, 99);
    Trace cont;  // a call over a cache is step cache.steps() of its run
    const int s1 = cache.steps();
    save_all(cont, m, 3, true, s1);
    m.forward(Batch::left_padded({more}, m.pad_token_id()), cache, &cont, false);
    expect_identities(cont, m, 3, s1, label + " continuation");
    Trace dec;
    const int s2 = cache.steps();
    save_all(dec, m, 1, true, s2);
    m.forward(Batch::left_padded({{ids[0]}}, m.pad_token_id()), cache, &dec, false);
    expect_identities(dec, m, 1, s2, label + " decode");
  }
}

TEST_P(ScanIdentity, WritesKeepTheIdentities) {
  const Param& p = GetParam();
  Routed routed(p.family, p.route);
  Model m = load_family(p.family);
  const int64_t Q = use_chunk(p.family, m);
  const int64_t T = 2 * Q + 1;
  const auto ids = random_ids(m, T, 7);
  const int layer = mixer_layers(m).front();
  Trace plain;
  save_all(plain, m, T, false, 0);
  m.run({ids}, &plain);
  const Tensor before = plain.get(mix(layer, "states"));
  for (int64_t w : {int64_t{0}, Q - 1, Q, Q + 2, T - 1}) {
    const std::string label = p.family + "/" + p.route + " write at " + std::to_string(w);
    for (bool per_token : {false, true}) {
      Trace t;
      save_all(t, m, T, per_token, 0);
      t.edit(at(layer, w), [](Tensor& v, const SiteContext&) {
        for (int64_t i = 0; i < v.numel(); ++i) v[i] *= 0.5f;
      });
      m.run({ids}, &t);
      expect_identities(t, m, T, 0, label);
      Tensor half = token_of(before, w);
      for (int64_t i = 0; i < half.numel(); ++i) half[i] *= 0.5f;
      EXPECT_TRUE(same(token_of(t.get(mix(layer, "states")), w), half)) << label << ": states[:, w] is the written state";
      // Tokens before the write keep their states.
      for (int64_t k = 0; k < w; ++k)
        EXPECT_TRUE(same(token_of(t.get(mix(layer, "states")), k), token_of(before, k))) << label << " t=" << k;
    }
  }
}

TEST_P(ScanIdentity, ASkippedTokenKeepsTheStateExactly) {
  const Param& p = GetParam();
  Routed routed(p.family, p.route);
  Model m = load_family(p.family);
  const int64_t Q = use_chunk(p.family, m);
  const int64_t T = 2 * Q + 2;
  const auto ids = random_ids(m, T, 11);
  for (int64_t w : {int64_t{1}, Q - 1, Q, Q + 1, 2 * Q - 1, T - 1}) {
    Trace t;
    std::vector<int> layers = mixer_layers(m);
    for (int l : layers) {
      t.save(mix(l, "states")).save(mix(l, "state_output"));
      const auto zero_at = [w](Tensor& v, const SiteContext&) {  // [B,T,...]: token w's entries
        const int64_t per = v.numel() / (v.size(0) * v.size(1));
        for (int64_t b = 0; b < v.size(0); ++b)
          std::fill(v.data() + (b * v.size(1) + w) * per, v.data() + (b * v.size(1) + w + 1) * per, 0.0f);
      };
      // Mamba: dt = 0 (decay exp(0) = 1, input 0); gated DeltaNet: beta = 0 and g = 0; lightning
      // attention (no betas): k = 0 and its decay 0; mLSTM: input gate 0 and log forget gate 0 (m, C, n kept).
      if (p.family == "minimax") t.edit(mix(l, "attention_keys"), zero_at).edit(mix(l, "decays"), zero_at);
      else t.edit(mix(l, "betas"), zero_at);
      if (gated_delta(p.family) || p.family == "xlstm") t.edit(mix(l, "decays"), zero_at);
    }
    m.run({ids}, &t);
    for (int l : layers) {
      const Tensor s = t.get(mix(l, "states"));
      EXPECT_TRUE(same(token_of(s, w), token_of(s, w - 1))) << p.family << "/" << p.route << " layer " << l << " w=" << w;
      EXPECT_TRUE(same(token_of(s, T - 1), t.get(mix(l, "state_output"))));
    }
  }
}

TEST_P(ScanIdentity, StatesAndPerTokenStateInAnyOrderInOneSession) {
  const Param& p = GetParam();
  Routed routed(p.family, p.route);
  Model m = load_family(p.family);
  const int64_t Q = use_chunk(p.family, m);
  const int64_t T = Q + 3;
  const auto ids = random_ids(m, T, 5);
  const int layer = mixer_layers(m).back();
  Trace plain;
  plain.save(mix(layer, "states"));
  m.run({ids}, &plain);
  const Tensor states = plain.get(mix(layer, "states"));
  {  // write the state after token 0, then read every later state
    Session s = Session::run(m, {ids});
    Tensor v = s.read(0, at(layer, 0));
    for (int64_t i = 0; i < v.numel(); ++i) v[i] *= 0.5f;
    s.write(0, at(layer, 0), v);
    const Tensor got = s.read(0, mix(layer, "states"));
    s.finish();
    Trace ref;
    ref.save(mix(layer, "states")).edit(at(layer, 0), [](Tensor& x, const SiteContext&) {
      for (int64_t i = 0; i < x.numel(); ++i) x[i] *= 0.5f;
    });
    m.run({ids}, &ref);
    EXPECT_TRUE(same(got, ref.get(mix(layer, "states")))) << "set_state_after(0) then states";
    EXPECT_TRUE(same(token_of(got, 0), v));
  }
  {  // states, then a per-token state
    Session s = Session::run(m, {ids});
    const Tensor got = s.read(0, mix(layer, "states"));
    const Tensor t3 = s.read(0, at(layer, 3));
    s.finish();
    EXPECT_TRUE(same(got, states));
    EXPECT_TRUE(same(t3, token_of(states, 3))) << "states then state_after(3)";
  }
  {  // a per-token state, then states (recorded from the pause on, the tokens before it again)
    Session s = Session::run(m, {ids});
    const Tensor t2 = s.read(0, at(layer, 2));
    const Tensor t_q = s.read(0, at(layer, Q));
    const Tensor got = s.read(0, mix(layer, "states"));
    s.finish();
    EXPECT_TRUE(same(got, states)) << "state_after(2), state_after(Q), then states";
    EXPECT_TRUE(same(t2, token_of(states, 2)));
    EXPECT_TRUE(same(t_q, token_of(states, Q)));
  }
}

TEST_P(ScanIdentity, ARowsScanValuesAreTheSameAloneAndInAPaddedBatch) {
  const Param& p = GetParam();
  Routed routed(p.family, p.route);
  Model m = load_family(p.family);
  const int64_t Q = use_chunk(p.family, m);
  const int layer = mixer_layers(m).front();
  const auto a = random_ids(m, Q + 3, 21), other = random_ids(m, 2 * Q + 5, 22);
  const std::vector<std::string> inputs =
      gated_delta(p.family) || p.family == "xlstm" ? std::vector<std::string>{"attention_queries", "attention_keys", "attention_values", "betas", "decays"}
      : p.family == "minimax" ? std::vector<std::string>{"attention_queries", "attention_keys", "attention_values", "decays"}
                            : std::vector<std::string>{"attention_queries", "attention_keys", "attention_values", "betas"};
  Trace alone;
  for (const auto& v : inputs) alone.save(mix(layer, v));
  for (const char* v : {"states", "state_output", "attention_head_outputs"}) alone.save(mix(layer, v));
  alone.save(at(layer, Q));
  m.run({a}, &alone);
  const int64_t T = static_cast<int64_t>(other.size()), pad = T - static_cast<int64_t>(a.size());
  for (int64_t row : {int64_t{0}, int64_t{1}}) {
    // The scan's inputs of the row made exactly the alone run's (the projections before it are the
    // other work item's); what the scan makes of them must then be bitwise the alone run's.
    Trace batched;
    for (const auto& v : inputs)
      batched.edit(mix(layer, v), [&, v, row](Tensor& x, const SiteContext&) {
        const Tensor src = alone.get(mix(layer, v));
        const int64_t per = x.numel() / (x.size(0) * x.size(1));
        std::memcpy(x.data() + (row * T + pad) * per, src.data(), sizeof(float) * static_cast<size_t>(src.numel()));
      });
    for (const char* v : {"states", "state_output", "attention_head_outputs"}) batched.save(mix(layer, v));
    batched.save(at(layer, pad + Q));
    const std::vector<std::vector<int32_t>> rows = row == 0 ? std::vector<std::vector<int32_t>>{a, other}
                                                            : std::vector<std::vector<int32_t>>{other, a};
    m.run(rows, &batched);
    const std::string label = p.family + "/" + p.route + " row " + std::to_string(row);
    for (const char* v : {"states", "attention_head_outputs"})
      EXPECT_TRUE(same(row_of(batched.get(mix(layer, v)), row, pad), row_of(alone.get(mix(layer, v)), 0))) << label << " " << v;
    EXPECT_TRUE(same(row_of(batched.get(mix(layer, "state_output")), row, 0, false),
                     row_of(alone.get(mix(layer, "state_output")), 0, 0, false))) << label << " state_output";
    EXPECT_TRUE(same(row_of(batched.get(at(layer, pad + Q)), row, 0, false), row_of(alone.get(at(layer, Q)), 0, 0, false)))
        << label << " state_after";
    // Padded tokens neither write nor decay the (zero) state and read nothing.
    const Tensor st = batched.get(mix(layer, "states"));
    const int64_t per = st.numel() / (st.size(0) * T);
    for (int64_t i = 0; i < pad * per; ++i) ASSERT_EQ(st.data()[row * T * per + i], 0.0f) << label << " padded state";
  }
}

// Issue 23's fresh-user trial: a per-token state write on one row of a batch split the scan for every
// row (the other rows moved by ~1e-7 on states, ~4e-6 on logits), and writing the state read back
// unchanged moved later values by ~1e-5. Now a write splits only the rows whose state it changes: in a
// left-padded batch of three, rows 0 and 2 are bitwise the run without the write, row 1 keeps its
// values through t, and the state written back unchanged is bitwise no write.
TEST_P(ScanIdentity, AWriteSplitsOnlyTheRowsItChanges) {
  const Param& p = GetParam();
  Routed routed(p.family, p.route);
  Model m = load_invariant(p.family);
  const int64_t Q = use_chunk(p.family, m);
  const int64_t T = 2 * Q + 1;
  const std::vector<std::vector<int32_t>> rows = {random_ids(m, T, 31), random_ids(m, T - 2, 32), random_ids(m, T - 3, 33)};
  const int layer = mixer_layers(m).front();
  Trace plain;
  save_all(plain, m, T, false, 0);
  m.run(rows, &plain);
  // Tokens [0, t1) of row b of [B,T,...].
  const auto upto = [](const Tensor& v, int64_t b, int64_t t1) {
    const int64_t per = v.numel() / (v.size(0) * v.size(1));
    return std::vector<float>(v.data() + b * v.size(1) * per, v.data() + (b * v.size(1) + t1) * per);
  };
  for (int64_t w : {Q + 1, Q + Q / 2}) {  // row 1 (2 pads): the last token of its first chunk; mid-chunk
    const std::string label = p.family + "/" + p.route + " write at " + std::to_string(w);
    Trace half, back;
    save_all(half, m, T, false, 0);
    save_all(back, m, T, false, 0);
    half.edit(at(layer, w), [](Tensor& v, const SiteContext&) {
      const int64_t per = v.numel() / v.size(0);
      for (int64_t i = per; i < 2 * per; ++i) v[i] *= 0.5f;
    });
    back.edit(at(layer, w), [](Tensor&, const SiteContext&) {});  // written back as read
    m.run(rows, &half);
    m.run(rows, &back);
    expect_identities(half, m, T, 0, label);
    expect_same_values(back, plain, m, 0, label + " (written back unchanged)");
    const auto& pl = plain;
    const auto check = [&](const std::string& path, bool tokens) {
      const Tensor a = half.get(path), b = pl.get(path);
      for (int64_t row : {int64_t{0}, int64_t{2}})
        EXPECT_TRUE(same(row_of(a, row, 0, tokens), row_of(b, row, 0, tokens))) << label << " row " << row << " " << path;
      if (tokens) {  // row 1 through t (its states before t: the state after t is the written one)
        const int64_t t1 = path.find("states") == std::string::npos ? w + 1 : w;
        EXPECT_TRUE(same(upto(a, 1, t1), upto(b, 1, t1))) << label << " row 1 through t: " << path;
      }
    };
    check("logits", true);
    for (int l : mixer_layers(m)) {
      check(mix(l, "states"), true);
      check(mix(l, "attention_head_outputs"), true);
      check(mix(l, "state_output"), false);
    }
    const std::vector<float> before = row_of(plain.get("logits"), 1, w + 1), after = row_of(half.get("logits"), 1, w + 1);
    EXPECT_FALSE(same(after, before)) << label << ": the write changed nothing on row 1";
  }
}

INSTANTIATE_TEST_SUITE_P(Families, ScanIdentity, ::testing::ValuesIn(all_params()),
                         [](const ::testing::TestParamInfo<Param>& i) { return i.param.family + "_" + i.param.route; });
