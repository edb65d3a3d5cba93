// Kimi-Linear: its Kimi Delta Attention mixer (the gated DeltaNet mixer's `kda` option, per-key-channel
// decays) against transformers' KimiLinearDeltaAttention on the golden fixture of
// scripts/make_kimi_mixer_fixture.py (a checkpoint transformers wrote; a left-padded prompt of two chunks,
// a decode step, a continuation), every value on both kernel routes. The kernel against a double
// recurrence: test_qwen.cpp (KimiDelta.*).
#include <gtest/gtest.h>

#include <cstring>

#include "fixture_util.h"
#include "io/json.h"
#include "io/safetensors.h"
#include "io/weights.h"
#include "mixers/attention_mixer.h"
#include "mixers/gated_delta_mixer.h"
#include "mixlens/errors.h"

using namespace mixlens;
using namespace mixlens::test;

namespace {

// Keeps a copy of every value it is handed (of layer 0, or of the layer given to want()).
class Keep final : public detail::Listener {
 public:
  explicit Keep(std::initializer_list<Value> vs) { want(0, vs); }
  void want(int layer, std::initializer_list<Value> vs) {
    mask_.assign(3, 0u);
    for (Value v : vs) mask_[static_cast<size_t>(layer + 1)] |= 1u << static_cast<unsigned>(v);
  }
  void begin_call(const detail::CallCtx&, int) override {}
  bool visit(int, Value v, Tensor& value, const Shape&) override {
    seen[v] = value.clone();
    return false;
  }
  std::map<Value, Tensor> seen;
};

struct KdaFixture {
  io::WeightStore w = io::WeightStore::open(fixture("kimi_linear_mixers"));
  io::SafetensorsFile golden{fixture("kimi_linear_mixers") / "golden.safetensors"};
  detail::GdnDims g;
  detail::GatedDeltaMixer mixer;
  detail::GatedDeltaMixerWeights l;
  int64_t K = 0;

  KdaFixture() {
    const auto cfg = read_json(fixture("kimi_linear_mixers") / "config.json");
    g.D = cfg["hidden_size"];
    g.HK = g.HV = cfg["linear_num_heads"];
    g.Dk = g.Dv = cfg["linear_head_dim"];
    g.kda = true;
    K = cfg["linear_conv_kernel_dim"];
    mixer = detail::GatedDeltaMixer(g, K, cfg["rms_norm_eps"].get<float>());
    const std::string m = "model.layers.0.self_attn.";
    // in_proj rows [q | k | v | z latent (g_a) | b | a latent (f_a)] (GdnDims with kda).
    std::vector<Tensor> parts;
    for (const auto& [name, rows] : {std::pair{"q_proj", g.key_dim()}, {"k_proj", g.key_dim()}, {"v_proj", g.value_dim()},
                                     {"g_a_proj", g.Dk}, {"b_proj", g.HV}, {"f_a_proj", g.Dk}})
      parts.push_back(w.get(m + name + ".weight", {rows, g.D}));
    l.in_proj = ops::RowStack(std::move(parts));
    EXPECT_EQ(l.in_proj.size(0), g.proj_rows());
    mixer.load(w, m, l);
  }
};

}  // namespace

TEST(KimiLinearKda, EveryValueOfEveryCallMatchesTransformersOnBothKernels) {
  KdaFixture f;
  const int64_t B = 2;
  const auto mask64 = f.golden.get_i64("mask");
  const std::vector<uint8_t> mask(mask64.begin(), mask64.end());
  for (bool chunked : {true, false}) {
    Tensor conv({B, f.K, f.g.conv_dim()}), ssm({B, f.g.HV, f.g.Dk, f.g.Dv});
    for (int step = 0; step < 3; ++step) {
      const std::string at = "@step" + std::to_string(step);
      const Tensor x = f.golden.get_f32("x" + at);
      const Batch in = step == 0 ? Batch::from_embeddings(x, mask) : Batch::from_embeddings(x);
      Keep keep({Value::attention_queries, Value::attention_keys, Value::attention_values, Value::betas, Value::decays,
                 Value::attention_head_outputs, Value::state_output, Value::attention_output});
      detail::GatedDeltaMixerCall call;
      call.conv = &conv;
      call.ssm = &ssm;
      call.has_state = step > 0;
      call.chunked = chunked;
      call.ls = &keep;
      const Tensor out = f.mixer.forward(f.l, x, in, in.seq > 1 && in.has_padding(), call);
      const std::string label = std::string(chunked ? "chunked" : "recurrent") + at;
      EXPECT_EQ(keep.seen.at(Value::decays).shape(), (Shape{B, in.seq, f.g.HV, f.g.Dk})) << label;
      for (const auto& [v, name] : {std::pair{Value::attention_queries, "q"}, {Value::attention_keys, "k"},
                                    {Value::attention_values, "v"}, {Value::betas, "beta"}, {Value::decays, "g"},
                                    {Value::attention_head_outputs, "o"}, {Value::state_output, "state"},
                                    {Value::attention_output, "out"}}) {
        const Tensor ref = f.golden.get_f32(name + at);
        EXPECT_LE(rel_rms(keep.seen.at(v), ref), kValueTolerance) << label << " " << name << " max|diff| "
                                                                   << max_abs_diff(keep.seen.at(v), ref);
      }
      EXPECT_LE(rel_rms(out, f.golden.get_f32("out" + at)), kValueTolerance) << label;
    }
  }
}

// Bad shapes in a KDA checkpoint are clear errors naming the tensor.
TEST(KimiLinearKda, AWrongForgetGateShapeNamesTheTensor) {
  KdaFixture f;
  detail::GdnDims g = f.g;
  g.Dk = g.Dv = f.g.Dk * 2;  // the checkpoint's f_b_proj / dt_bias are [H*8, 8], [H*8]
  detail::GatedDeltaMixer wrong(g, f.K, 1e-5f);
  detail::GatedDeltaMixerWeights l;
  try {
    wrong.load(f.w, "model.layers.0.self_attn.", l);
    FAIL() << "loaded a checkpoint of another head size";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("self_attn."), std::string::npos) << e.what();
  }
}

// Layer 1, KimiLinearAttention (the attention mixer's mla option) against transformers' eager
// attention over the same three calls (its own inputs, the KV cache and the 2-D mask growing):
// queries, keys, values, probabilities and output; row 1's left-padded queries of the prompt are
// left out (transformers gives them a uniform softmax over masked keys, mixlens zeros).
TEST(KimiLinearMla, EveryValueOfEveryCallMatchesTransformers) {
  const auto dir = fixture("kimi_linear_mixers");
  const auto cfg = read_json(dir / "config.json");
  const io::WeightStore w = io::WeightStore::open(dir);
  const io::SafetensorsFile golden{dir / "golden.safetensors"};
  detail::AttentionMixerDims d;
  d.D = cfg["hidden_size"];
  d.H = d.Hkv = cfg["num_attention_heads"];
  d.qk_nope = cfg["qk_nope_head_dim"];
  d.qk_rope = cfg["qk_rope_head_dim"];
  d.hd = d.qk_nope + d.qk_rope;
  d.v_hd = cfg["v_head_dim"];
  d.kv_lora_rank = cfg["kv_lora_rank"];
  d.rope = false;
  const detail::AttentionMixer mixer(d, "kimi_linear");
  const detail::AttentionMixerWeights l = mixer.load(w, "model.layers.1.self_attn.");
  const int64_t B = 2, pad = read_json(dir / "case.json")["pad"];
  detail::KvCache kv;
  std::vector<std::vector<uint8_t>> key_mask(B);
  for (int step = 0; step < 3; ++step) {
    const std::string at = "@step" + std::to_string(step);
    const Tensor x = golden.get_f32("ax" + at);
    const int64_t T = x.size(1);
    std::vector<uint8_t> mask(static_cast<size_t>(B * T), 1);
    if (step == 0) std::fill(mask.begin() + T, mask.begin() + T + pad, 0);
    const Batch in = Batch::from_embeddings(x, mask);
    for (int64_t b = 0; b < B; ++b)
      key_mask[static_cast<size_t>(b)].insert(key_mask[static_cast<size_t>(b)].end(), mask.begin() + b * T, mask.begin() + (b + 1) * T);
    std::vector<int64_t> pos(static_cast<size_t>(B * T));
    for (int64_t i = 0; i < B * T; ++i) pos[static_cast<size_t>(i)] = kv.len + i % T;
    Keep keep({Value::attn_output});
    keep.want(1, {Value::attn_queries, Value::attn_keys, Value::attn_values, Value::attn_probs, Value::attn_output});
    detail::AttentionMixerCall call;
    call.layer = 1;
    call.kv = &kv;
    call.key_mask = &key_mask;
    call.pos = &pos;
    call.ls = &keep;
    const Tensor out = mixer.forward(l, x, in, call);
    // Rows of query positions to compare: all, but row 1's padded prompt positions.
    const auto real_queries = [&](const Tensor& t, int64_t per_query, bool heads_first) {
      Tensor c = t.clone();
      if (step == 0)
        for (int64_t h = 0; h < (heads_first ? d.H : 1); ++h)
          for (int64_t q = 0; q < pad; ++q) {
            const int64_t off = heads_first ? ((1 * d.H + h) * T + q) * per_query : (1 * T + q) * per_query;
            std::fill(c.data() + off, c.data() + off + per_query, 0.0f);
          }
      return c;
    };
    for (const auto& [v, name] : {std::pair{Value::attn_queries, "aq"}, {Value::attn_keys, "ak"}, {Value::attn_values, "av"}}) {
      const Tensor ref = golden.get_f32(name + at);
      EXPECT_LE(rel_rms(keep.seen.at(v), ref), kValueTolerance) << name << at;
    }
    const Tensor probs = golden.get_f32("aprobs" + at), aout = golden.get_f32("aout" + at);
    EXPECT_LE(rel_rms(real_queries(keep.seen.at(Value::attn_probs), probs.size(3), true), real_queries(probs, probs.size(3), true)),
              kValueTolerance) << at;
    EXPECT_LE(rel_rms(real_queries(out, d.D, false), real_queries(aout, d.D, false)), kValueTolerance) << at;
    EXPECT_LE(rel_rms(real_queries(keep.seen.at(Value::attn_output), d.D, false), real_queries(aout, d.D, false)),
              kValueTolerance) << at;
  }
}

// MLA's options are checked: key / value heads must be the query heads, v_head_dim <= head_dim.
TEST(KimiLinearMla, BadLatentSizesAreConfigErrors) {
  detail::AttentionMixerDims d{.D = 32, .H = 2, .Hkv = 1, .hd = 12, .rope = false};
  d.kv_lora_rank = 8; d.qk_nope = 8; d.qk_rope = 4; d.v_hd = 6;
  EXPECT_THROW(detail::AttentionMixer(d, "x"), ConfigError);
  d.Hkv = 2; d.v_hd = 13;
  EXPECT_THROW(detail::AttentionMixer(d, "x"), ConfigError);
  d.v_hd = 6; d.qk_rope = 5;
  EXPECT_THROW(detail::AttentionMixer(d, "x"), ConfigError);
  d.qk_rope = 4;
  EXPECT_NO_THROW(detail::AttentionMixer(d, "x"));
}

// Kernel identity (docs/values.md): KDA names its own kind and state op, not gated DeltaNet's, since its
// decay is per key channel; Qwen's gated DeltaNet layers keep "gated_delta" (test_qwen.cpp).
TEST(KimiLinearKda, KernelIdentityNamesThePerKeyChannelRule) {
  const Model m = Model::load(fixture("kimi_linear/padded_batch").string());
  int seen = 0;
  for (int l = 0; l < m.info().num_layers; ++l) {
    if (m.info().layer_kinds[static_cast<size_t>(l)] != LayerKind::gated_deltanet) continue;
    const MixerIdentity id = mixer_identity(m, l, 8);
    EXPECT_EQ(id.kind, "kimi_delta") << l;
    EXPECT_EQ(id.state_op, "kimi_delta_rule") << l;
    EXPECT_EQ(id.prompt_kernel, "chunked") << l;
    ++seen;
  }
  EXPECT_GT(seen, 0);
}
