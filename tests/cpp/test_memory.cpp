// Issue 9 item 4 on every family (tests/fixtures): logits only where read, chunked prefill (same
// numbers as one call, one step, not applied when the call is observed) and the activation arena
// (buffers reused across layers and calls).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "fixture_util.h"
#include "mixlens/errors.h"
#include "mixlens/session.h"
#include "ops/arena.h"

using namespace mixlens;
using namespace mixlens::test;

namespace {

const char* kFamilies[] = {"mamba/basic",          "mamba2/g1_chunks",         "qwen3_5/hv_2hk",
                           "qwen3_next/moe_hv_2hk", "nemotron_h/groups2_edits", "bamba/groups2_edits",
                           "falcon_h1/norm_before_gate"};

class Memory : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override { model_.emplace(Model::load(fixture(GetParam()).string())); }
  Model& model() { return *model_; }
  std::vector<int32_t> tokens(int n, int seed = 0) const {
    const int64_t V = std::min<int64_t>(model_->info().vocab_size, 97);
    std::vector<int32_t> ids;
    for (int i = 0; i < n; ++i) ids.push_back(static_cast<int32_t>((i * 37 + seed * 11 + 5) % V));
    return ids;
  }
  Batch row(const std::vector<int32_t>& ids) const { return Batch::left_padded({ids}, model_->pad_token_id()); }
  std::optional<Model> model_;
};

std::string family_name(const ::testing::TestParamInfo<const char*>& i) {
  std::string s = i.param;
  for (char& c : s)
    if (c == '/') c = '_';
  return s;
}

// Row t of logits [B,T,V] as [B,1,V].
Tensor position(const Tensor& logits, int64_t t) {
  const int64_t B = logits.size(0), T = logits.size(1), V = logits.size(2);
  Tensor out({B, 1, V});
  for (int64_t b = 0; b < B; ++b) std::memcpy(out.data() + b * V, logits.data() + (b * T + t) * V, sizeof(float) * V);
  return out;
}

// ---- logits only where read --------------------------------------------------------------------

TEST_P(Memory, LastPositionLogitsAreTheLastRowOfTheFullOnes) {
  const auto ids = tokens(13);
  const Tensor full = model().run({ids});
  ASSERT_EQ(full.size(1), 13);
  const Tensor last = model().run({ids}, nullptr, /*all_logits=*/false);
  ASSERT_EQ(last.shape(), (Shape{1, 1, model().info().vocab_size}));
  EXPECT_LT(rel_rms(last, position(full, 12)), 1e-6);
  // A padded batch: the last position of every row.
  const Tensor fullb = model().run({ids, tokens(5, 1)});
  const Tensor lastb = model().run({ids, tokens(5, 1)}, nullptr, false);
  ASSERT_EQ(lastb.size(0), 2);
  EXPECT_LT(rel_rms(lastb, position(fullb, 12)), 1e-6);
  // Continuation and the public forward take the same option.
  Cache c = model().new_cache(1);
  model().forward(row({ids.begin(), ids.begin() + 6}), c, nullptr, false);
  const Tensor cont = model().forward(row({ids.begin() + 6, ids.end()}), c, nullptr, false);
  EXPECT_EQ(cont.size(1), 1);
  EXPECT_LT(rel_rms(cont, position(full, 12)), 1e-4);
}

TEST_P(Memory, SavedOrReadLogitsStillGetEveryPosition) {
  const auto ids = tokens(9);
  const Tensor full = model().run({ids});
  Trace tr;
  tr.save("logits");
  model().run({ids}, &tr, false);
  ASSERT_EQ(tr.get("logits").shape(), full.shape());
  EXPECT_LT(rel_rms(tr.get("logits"), full), 1e-6);
  // Read in an interleaved block: the whole [B,T,V] is served.
  Session s = Session::run(model(), {ids});
  const Tensor read = s.read(0, "logits");
  EXPECT_EQ(read.shape(), full.shape());
  s.finish();
}

// ---- chunked prefill ---------------------------------------------------------------------------

TEST_P(Memory, ChunkedPrefillEqualsOneCall) {
  const std::string fam = model().info().family;
  for (int n : {29, 17, 24}) {  // 8+8+8+5; 8+9 (no one-token piece); 8+8+8
    const auto ids = tokens(n, n);
    model().set_prefill_chunk(0);
    Cache whole = model().new_cache(1);
    const Tensor ref = model().forward(row(ids), whole);
    const Tensor ref_next = model().forward(row(tokens(3, 7)), whole);
    model().set_prefill_chunk(8);
    Cache c = model().new_cache(1);
    Trace tr;  // nothing registered: the call is unobserved
    const Tensor got = model().forward(row(ids), c, &tr);
    ASSERT_EQ(got.shape(), ref.shape());
    EXPECT_LT(rel_rms(got, ref), kLogitsTolerance) << fam << " n=" << n;
    EXPECT_EQ(c.seen_tokens(), n);
    EXPECT_EQ(c.steps(), 1);  // one call, one step
    ASSERT_EQ(tr.calls().size(), 1u);
    EXPECT_EQ(tr.calls()[0].seq, n);
    // The carried cache continues like the unchunked one (a multi-token continuation).
    const Tensor next = model().forward(row(tokens(3, 7)), c);
    EXPECT_LT(rel_rms(next, ref_next), kLogitsTolerance) << fam << " n=" << n;
    // Last position only, chunked.
    Cache c2 = model().new_cache(1);
    const Tensor last = model().forward(row(ids), c2, nullptr, false);
    EXPECT_LT(rel_rms(last, position(ref, n - 1)), kLogitsTolerance);
  }
  model().set_prefill_chunk(Model::kDefaultPrefillChunk);
}

TEST_P(Memory, ChunkedPrefillContinuesACacheAndGenerates) {
  const auto ids = tokens(30, 3);
  GenerateOptions o;
  o.max_new_tokens = 4;
  o.eos_token_id = -1;
  model().set_prefill_chunk(0);
  const auto ref = model().generate({ids}, o);
  Cache whole = model().new_cache(1);
  model().forward(row(tokens(4)), whole);
  const Tensor ref_cont = model().forward(row(ids), whole, nullptr, false);
  model().set_prefill_chunk(8);
  EXPECT_EQ(model().generate({ids}, o).new_tokens, ref.new_tokens);
  Cache c = model().new_cache(1);
  model().forward(row(tokens(4)), c);
  const Tensor cont = model().forward(row(ids), c, nullptr, false);  // continuation, chunked
  EXPECT_LT(rel_rms(cont, ref_cont), kLogitsTolerance);
  model().set_prefill_chunk(Model::kDefaultPrefillChunk);
}

TEST_P(Memory, AnObservedCallIsNotChunked) {
  const auto ids = tokens(29);
  model().set_prefill_chunk(8);
  // A per-token value saved: one [B,T,D] value of the whole call (not a piece per chunk).
  Trace tr;
  tr.save("layers.0.layer_output");
  model().run({ids}, &tr, false);
  EXPECT_EQ(tr.get("layers.0.layer_output").size(1), 29);
  // An interleaved read sees the whole call too.
  Session s = Session::run(model(), {ids});
  EXPECT_EQ(s.read(0, "layers.0.layer_input").size(1), 29);
  s.finish();
  // A padded batch runs as one call and still equals the unchunked one.
  const Tensor got = model().run({ids, tokens(20, 2)});
  model().set_prefill_chunk(0);
  EXPECT_LT(rel_rms(got, model().run({ids, tokens(20, 2)})), 1e-6);
  EXPECT_THROW(model().set_prefill_chunk(-1), InputError);
  model().set_prefill_chunk(Model::kDefaultPrefillChunk);
}

// ---- activation arena --------------------------------------------------------------------------

TEST_P(Memory, ASecondCallReusesTheFirstCallsBuffers) {
  if (!detail::arena_stats().enabled) GTEST_SKIP() << "the arena is off in sanitizer builds";
  if (detail::arena_limit_bytes() == 0) GTEST_SKIP() << "MIXLENS_ARENA_MB=0";
  model().set_prefill_chunk(0);
  const auto ids = tokens(700);  // [1,700,32] floats: 87 KiB per activation, above kArenaMinBytes
  const Tensor first = model().run({ids});
  const detail::ArenaStats a = detail::arena_stats();
  const Tensor second = model().run({ids});
  const detail::ArenaStats b = detail::arena_stats();
  EXPECT_GT(b.reused - a.reused, 0u);
  // Every large buffer of the second call came from the pool (the first call's are still held by
  // `first` only for its logits: one buffer).
  EXPECT_LE(b.fresh - a.fresh, 1u) << "fresh allocations in a repeated call";
  EXPECT_EQ(std::memcmp(first.data(), second.data(), sizeof(float) * first.numel()), 0);
  model().set_prefill_chunk(Model::kDefaultPrefillChunk);
}

INSTANTIATE_TEST_SUITE_P(Families, Memory, ::testing::ValuesIn(kFamilies), family_name);

TEST(Arena, RecycledBuffersAreZeroedAndReleaseEmptiesThePool) {
  if (!detail::arena_stats().enabled) GTEST_SKIP() << "the arena is off in sanitizer builds";
  if (detail::arena_limit_bytes() == 0) GTEST_SKIP() << "MIXLENS_ARENA_MB=0";
  const int64_t n = 100000;  // 400 KB
  {
    Tensor t({n});
    for (int64_t i = 0; i < n; ++i) t[i] = 1.5f;
  }
  const auto before = detail::arena_stats();
  EXPECT_GE(before.pooled_bytes, static_cast<uint64_t>(n) * 4);
  Tensor u({n});  // same size class: the buffer just freed, zero-filled again
  EXPECT_EQ(detail::arena_stats().reused, before.reused + 1);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(u[i], 0.0f);
  Tensor w({n}, 2.0f);
  EXPECT_EQ(w[n - 1], 2.0f);
  detail::arena_release();
  EXPECT_EQ(detail::arena_stats().pooled_bytes, 0u);
}

}  // namespace
