// Session (the interleaver): reads and writes in forward order on a worker thread, checked against
// the same edits made through a pre-registered Trace and against the golden fixtures.
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>

#include "fixture_util.h"
#include "mixlens/errors.h"
#include "mixlens/session.h"
#include "ops/ops.h"

using namespace mixlens;
using namespace mixlens::test;

namespace {

struct Fixture {
  std::filesystem::path dir;
  nlohmann::json spec;
  io::SafetensorsFile golden;
  Model model;
  std::vector<std::vector<int32_t>> prompts;
  explicit Fixture(const std::string& name)
      : dir(fixture("mamba2/" + name)), spec(read_json(dir / "case.json")), golden(dir / "golden.safetensors"),
        model(Model::load(dir.string())) {
    prompts = spec["prompts"].get<std::vector<std::vector<int32_t>>>();
  }
  // Tokens fed after each step (golden greedy run), per row.
  std::vector<std::vector<int32_t>> forced(int n) const {
    auto rows = rows_of(golden.get_i64("tokens"), static_cast<int64_t>(prompts.size()));
    for (auto& r : rows) r.resize(static_cast<size_t>(n));
    return rows;
  }
};

bool same(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && std::memcmp(a.data(), b.data(), sizeof(float) * static_cast<size_t>(a.numel())) == 0;
}

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

TEST(Session, ReadEqualsTraceSaveAndWriteEqualsTraceEdit) {
  Fixture f("g1_chunks");
  Trace ref;
  ref.save("layers.1.linear_attn.betas").save("layers.2.linear_attn.states");
  ref.edit("layers.1.linear_attn.betas", [](Tensor& v, const SiteContext&) {
    for (int64_t h = 0; h < v.size(2); ++h) v[3 * v.size(2) + h] = 0.0f;
  });
  const Tensor ref_logits = f.model.run(f.prompts, &ref);

  Session s = Session::run(f.model, f.prompts);
  Tensor b = s.read(0, "layers.1.linear_attn.betas");
  const Tensor unedited = b.clone();
  for (int64_t h = 0; h < b.size(2); ++h) b[3 * b.size(2) + h] = 0.0f;
  s.write(0, "layers.1.linear_attn.betas", b);
  // Reading again at the same site returns the written value.
  EXPECT_TRUE(same(s.read(0, "layers.1.linear_attn.betas"), b));
  const Tensor states = s.read(0, "layers.2.linear_attn.states");
  const SessionResult r = s.finish();
  ASSERT_EQ(r.logits.size(), 1u);
  EXPECT_TRUE(same(r.logits[0], ref_logits));
  EXPECT_TRUE(same(states, ref.get("layers.2.linear_attn.states")));
  // Read-after-write: the trace's save holds what the forward used (its own edit applied, though
  // the save was registered first), as the session's read after its write does.
  EXPECT_TRUE(same(b, ref.get("layers.1.linear_attn.betas")));
  EXPECT_FALSE(same(unedited, ref.get("layers.1.linear_attn.betas")));
  ASSERT_EQ(s.calls().size(), 1u);
  EXPECT_EQ(s.calls()[0].kernel, "chunked");
}

TEST(Session, ReadingAPassedValueNamesBothSites) {
  Fixture f("g1_chunks");
  Session s = Session::run(f.model, f.prompts);
  s.read(0, "layers.1.linear_attn.attention_output");
  try {
    s.read(0, "layers.0.linear_attn.betas");
    FAIL() << "a passed value was served";
  } catch (const OutOfOrderError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("'layers.0.linear_attn.betas' at step 0"), std::string::npos) << m;
    EXPECT_NE(m.find("'layers.1.linear_attn.attention_output' at step 0"), std::string::npos) << m;
  }
  // The session is still usable after the refused request.
  EXPECT_EQ(s.read(0, "layers.2.layer_output").shape(), (Shape{1, 21, 32}));
  EXPECT_EQ(s.finish().logits.size(), 1u);
  EXPECT_NE(message_of([&] { s.read(0, "logits"); }).find("finished"), std::string::npos);
}

TEST(Session, MomentValuesReadInAnyOrderButWrittenInOrder) {
  Fixture f("g1_chunks");
  Trace ref;
  ref.save("layers.0.linear_attn.attention_queries").save("layers.0.linear_attn.attention_keys").save("layers.0.linear_attn.betas");
  f.model.run(f.prompts, &ref);

  Session s = Session::run(f.model, f.prompts);
  const Tensor x = s.read(0, "layers.0.linear_attn.attention_values");  // last of its moment
  EXPECT_TRUE(same(s.read(0, "layers.0.linear_attn.attention_queries"), ref.get("layers.0.linear_attn.attention_queries")));
  EXPECT_TRUE(same(s.read(0, "layers.0.linear_attn.attention_keys"), ref.get("layers.0.linear_attn.attention_keys")));
  EXPECT_THROW(s.write(0, "layers.0.linear_attn.attention_queries", ref.get("layers.0.linear_attn.attention_queries")),
               OutOfOrderError);
  const Tensor d = s.read(0, "layers.0.linear_attn.decays");
  EXPECT_TRUE(same(s.read(0, "layers.0.linear_attn.betas"), ref.get("layers.0.linear_attn.betas")));
  // On Mamba betas and decays are one dt: after a decays write, betas reads the dt = decays / A
  // the forward will use, the same value a pre-registered save records under the same edit.
  Tensor half = d.clone();
  for (int64_t i = 0; i < half.numel(); ++i) half[i] *= 0.5f;
  s.write(0, "layers.0.linear_attn.decays", half);
  Trace edited;
  edited.save("layers.0.linear_attn.betas").set("layers.0.linear_attn.decays", half);
  f.model.run(f.prompts, &edited);
  const Tensor b_after = s.read(0, "layers.0.linear_attn.betas");
  EXPECT_TRUE(same(b_after, edited.get("layers.0.linear_attn.betas")));
  EXPECT_FALSE(same(b_after, ref.get("layers.0.linear_attn.betas")));
  // A later moment: the earlier one's copies are gone.
  s.read(0, "layers.1.linear_attn.attention_keys");
  EXPECT_THROW(s.read(0, "layers.0.linear_attn.attention_queries"), OutOfOrderError);
  s.finish();
}

TEST(Session, BadWritesRaiseAndApplyNothing) {
  Fixture f("g1_chunks");
  const Tensor base = f.model.run(f.prompts);
  Session s = Session::run(f.model, f.prompts);
  Tensor b = s.read(0, "layers.0.linear_attn.betas");
  const std::string shape_msg = message_of([&] { s.write(0, "layers.0.linear_attn.betas", Tensor({1, 2, 3})); });
  EXPECT_NE(shape_msg.find("expected shape [1, 21, 4], got [1, 2, 3]"), std::string::npos) << shape_msg;
  Tensor neg = b.clone();
  neg[5] = -1.0f;
  EXPECT_THROW(s.write(0, "layers.0.linear_attn.betas", neg), WriteError);
  Tensor nan = b.clone();
  nan[0] = std::nanf("");
  EXPECT_THROW(s.write(0, "layers.0.linear_attn.betas", nan), WriteError);
  EXPECT_THROW(s.write(0, "layers.1.linear_attn.states", Tensor({1, 21, 4, 16, 16})), WriteError);
  EXPECT_THROW(s.read(0, "layers.0.linear_attn.beta"), UnknownValueError);
  EXPECT_THROW(s.read(0, "layers.*.linear_attn.betas"), InputError);
  EXPECT_THROW(s.read(1, "logits"), InputError);  // a run has only step 0
  EXPECT_TRUE(same(s.finish().logits[0], base));
}

// read_live (issue 10 item 2 in C++, issue 9 item 5): the value read last shares its storage with
// the session, and an in-place change of it is applied as a write when the caller moves on.
TEST(Session, ReadLiveAppliesInPlaceEditsWhenTheCallerMovesOn) {
  Fixture f("g1_chunks");
  const Tensor base = f.model.run(f.prompts);
  auto zero_token3 = [](Tensor& v) {
    for (int64_t h = 0; h < v.size(2); ++h) v[3 * v.size(2) + h] = 0.0f;
  };
  Trace ref;
  ref.save("layers.2.linear_attn.states");
  ref.edit("layers.1.linear_attn.betas", [&](Tensor& v, const SiteContext&) { zero_token3(v); });
  const Tensor ref_logits = f.model.run(f.prompts, &ref);

  {  // Edited in place, consumed by the next read: same as the pre-registered edit.
    Session s = Session::run(f.model, f.prompts);
    Tensor b = s.read_live(0, "layers.1.linear_attn.betas");
    zero_token3(b);
    const Tensor states = s.read(0, "layers.2.linear_attn.states");
    EXPECT_TRUE(same(states, ref.get("layers.2.linear_attn.states")));
    EXPECT_TRUE(same(s.finish().logits[0], ref_logits));
  }
  {  // Consumed by finish() too; an unchanged live value writes nothing.
    Session s = Session::run(f.model, f.prompts);
    s.read_live(0, "layers.0.linear_attn.betas");
    Tensor b = s.read_live(0, "layers.1.linear_attn.betas");
    zero_token3(b);
    EXPECT_TRUE(same(s.finish().logits[0], ref_logits));
    Session plain = Session::run(f.model, f.prompts);
    plain.read_live(0, "layers.1.linear_attn.betas");
    EXPECT_TRUE(same(plain.finish().logits[0], base));
  }
  {  // A write of the live value supersedes the changes before it; later changes still count.
    Session s = Session::run(f.model, f.prompts);
    Tensor b = s.read_live(0, "layers.1.linear_attn.betas");
    const Tensor orig = b.clone();
    Tensor seven = b.clone();
    for (int64_t i = 0; i < seven.numel(); ++i) seven[i] *= 7.0f;
    b[0] = 123.0f;  // superseded by the write below
    s.write(0, "layers.1.linear_attn.betas", seven);
    std::copy(orig.begin(), orig.end(), b.data());
    zero_token3(b);
    EXPECT_TRUE(same(s.finish().logits[0], ref_logits));
  }
  {  // A change that cannot be applied raises the write's error type, naming the edit.
    Session s = Session::run(f.model, f.prompts);
    s.read_live(0, "layers.0.linear_attn.decays");
    Tensor b = s.read_live(0, "layers.0.linear_attn.betas");  // served from the moment's copy
    b[0] = 0.0f;
    const std::string msg = message_of([&] { s.read(0, "logits"); });
    EXPECT_NE(msg.find("in-place edit of 'layers.0.linear_attn.betas' (read at step 0) could not be applied: "),
              std::string::npos) << msg;
    EXPECT_THROW(
        {
          Session s2 = Session::run(f.model, f.prompts);
          s2.read_live(0, "layers.0.linear_attn.decays");
          Tensor b2 = s2.read_live(0, "layers.0.linear_attn.betas");
          b2[0] = 0.0f;
          s2.settle();
        },
        OutOfOrderError);
    Session s3 = Session::run(f.model, f.prompts);
    Tensor b3 = s3.read_live(0, "layers.0.linear_attn.betas");
    b3[0] = -1.0f;  // betas must be >= 0
    EXPECT_THROW(s3.reach_step(0), WriteError);
  }
}

// The forward's thread pool as a session drives it (parked at every pause), here so that the TSan
// build (make test-tsan: the session tests) checks it: the caller returns once an op's blocks are
// done, so a late worker meets the next op; each op sees each of its indices exactly once.
TEST(Session, PoolOpsOfEverySizeNeverMixUnderParking) {
  const int64_t sizes[] = {2, 3, 2, 7, 2, 16, 1, 5};
  std::vector<std::atomic<int>> hits(16);
  for (int rep = 0; rep < 3000; ++rep) {
    const int64_t n = sizes[rep % 8];
    std::atomic<int> bad{0};
    ops::parallel_for(n, [&, n](int64_t i) {
      if (i < 0 || i >= n) bad.fetch_add(1);
      else hits[static_cast<size_t>(i)].fetch_add(1);
    });
    ASSERT_EQ(bad.load(), 0);
    for (int64_t i = 0; i < 16; ++i) ASSERT_EQ(hits[static_cast<size_t>(i)].exchange(0), i < n ? 1 : 0) << rep;
    if (rep % 5 == 0) ops::park_threads();
  }
  EXPECT_THROW(ops::parallel_for(4, [](int64_t i) { if (i == 1) throw InputError("boom"); }), InputError);
  std::atomic<int> count{0};
  ops::parallel_for(3, [&](int64_t) { count.fetch_add(1); });
  EXPECT_EQ(count.load(), 3);
}

TEST(Session, StateInputOfAFreshPromptIsNoneAndWritingItStartsFromThatState) {
  Fixture f("g1_chunks");
  Session a = Session::run(f.model, f.prompts);
  EXPECT_FALSE(a.read(0, "layers.0.linear_attn.state_input").defined());
  const Tensor so = a.read(0, "layers.0.linear_attn.state_output");
  a.finish();

  // A prompt started from that state ends elsewhere: the written state was consumed.
  Session b = Session::run(f.model, f.prompts);
  b.write(0, "layers.0.linear_attn.state_input", so);
  const Tensor out = b.read(0, "layers.0.linear_attn.state_output");
  b.finish();
  EXPECT_FALSE(same(out, so));
  EXPECT_GT(rel_rms(out, so), 1e-3);
}

TEST(Session, GenerateServesEveryStepAndMatchesTheGolden) {
  Fixture f("g1_chunks");
  GenerateOptions o;
  o.max_new_tokens = f.spec["n_steps"].get<int>();
  o.eos_token_id = -1;
  Session s = Session::generate(f.model, f.prompts, o);
  for (int step = 0; step < o.max_new_tokens; ++step) {
    ASSERT_TRUE(s.reach_step(step));
    const std::string key = "layers.2.linear_attn.state_output@step" + std::to_string(step);
    const Tensor so = s.read(step, "layers.2.linear_attn.state_output");
    EXPECT_LE(rel_rms(so, f.golden.get_f32(key)), 1e-5) << key;
    if (step > 0) {
      const Tensor si = s.read(step, "layers.2.linear_attn.attention_output");
      EXPECT_EQ(si.shape(), (Shape{1, 1, 32}));
    }
  }
  EXPECT_FALSE(s.reach_step(o.max_new_tokens));
  const SessionResult r = s.finish();
  EXPECT_EQ(r.new_tokens, f.forced(o.max_new_tokens));
  ASSERT_EQ(s.calls().size(), static_cast<size_t>(o.max_new_tokens));
  EXPECT_EQ(s.calls()[1].kernel, "recurrent");
}

TEST(Session, TeacherForcedWritesMatchTransformersEditedLogits) {
  Fixture f("g1_chunks");
  const int n = f.spec["n_steps"].get<int>();
  int checked = 0;
  for (const auto& e : f.spec["edits"]) {
    if (e["op"] != "scale") continue;
    const int step = e["step"].get<int>();
    const std::string path = e["path"];
    Session s = Session::teacher_forced(f.model, f.prompts, f.forced(n - 1));
    Tensor v = s.read(step, path);
    for (int64_t i = 0; i < v.numel(); ++i) v[i] *= e["factor"].get<float>();
    s.write(step, path, v);
    const SessionResult r = s.finish();
    ASSERT_EQ(r.logits.size(), static_cast<size_t>(n));
    for (int k = 0; k < n; ++k) {
      const std::string key = "edit/" + e["name"].get<std::string>() + "/logits@step" + std::to_string(k);
      EXPECT_LE(rel_rms(r.logits[static_cast<size_t>(k)], f.golden.get_f32(key)), 1e-4) << key;
    }
    ++checked;
  }
  EXPECT_GE(checked, 3);
}

TEST(Session, PreRegisteredTraceRunsInTheSameForward) {
  Fixture f("padded_batch");
  Trace t;
  t.save("layers.*.linear_attn.state_output");
  t.set("layers.0.linear_attn.attention_output", Tensor({2, 13, 32}, 0.0f));
  Session s = Session::run(f.model, f.prompts, &t);
  // The block sees the trace's edit (applied first).
  const Tensor ao = s.read(0, "layers.0.linear_attn.attention_output");
  for (float x : ao) ASSERT_EQ(x, 0.0f);
  s.finish();
  EXPECT_TRUE(t.has("layers.1.linear_attn.state_output"));
  ASSERT_EQ(t.calls().size(), 1u);
}

TEST(Session, WorkerErrorsReachTheCallerOnce) {
  Fixture f("g1_chunks");
  Trace t;
  t.set("layers.1.linear_attn.betas", Tensor({1, 2, 3}));  // wrong shape: raised inside the forward
  Session s = Session::run(f.model, f.prompts, &t);
  EXPECT_THROW(s.read(0, "layers.2.linear_attn.betas"), WriteError);
  EXPECT_THROW(s.finish(), InputError);  // "stopped after an error"
  // A trace that names an unknown value fails when the session is made, before any computation.
  Trace bad;
  bad.save("layers.0.linear_attn.betaz");
  EXPECT_THROW(Session::run(f.model, f.prompts, &bad), UnknownValueError);
}

TEST(Session, DestroyingMidRunAbortsCleanly) {
  Fixture f("g1_chunks");
  for (int i = 0; i < 20; ++i) {
    Session s = Session::run(f.model, f.prompts);
    if (i % 2) s.read(0, "layers.1.linear_attn.betas");
  }
  GenerateOptions o;
  o.max_new_tokens = 50;
  o.eos_token_id = -1;
  { Session s = Session::generate(f.model, f.prompts, o); s.read(3, "logits"); }
  { Session s = Session::generate(f.model, f.prompts, o); }  // never started
  SUCCEED();
}

TEST(Session, ContinuationStepsFollowTheCache) {
  Fixture f("g1_chunks");
  const auto& p = f.prompts[0];
  Cache cache = f.model.new_cache(1);
  f.model.forward(Batch::left_padded({{p.begin(), p.begin() + 9}}, 0), cache);
  Session s = Session::forward(f.model, Batch::left_padded({{p.begin() + 9, p.end()}}, 0), cache);
  EXPECT_EQ(s.first_step(), 1);
  EXPECT_TRUE(s.read(1, "layers.0.linear_attn.state_input").defined());
  EXPECT_THROW(s.read(0, "logits"), InputError);
  const Tensor logits = s.finish().logits[0];
  EXPECT_EQ(logits.shape(), (Shape{1, 12, 97}));
  EXPECT_EQ(cache.steps(), 2);
}

}  // namespace
