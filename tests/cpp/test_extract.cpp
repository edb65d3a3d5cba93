// Dataset extraction (mixlens/extract.h) on the shipped Mamba-2: stored rows equal a run of each
// prompt alone, only real tokens are stored, a resumed run equals a clean one, max_bytes refuses
// before writing, prompts files are validated line by line.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <unistd.h>
#include <nlohmann/json.hpp>

#include "fixture_util.h"
#include "io/safetensors.h"
#include "mixlens/errors.h"
#include "mixlens/extract.h"

namespace fs = std::filesystem;
using namespace mixlens;

namespace {

const Model& shipped() {
  static const Model m = Model::load((test::source_dir() / "models" / "mamba2-tinystories").string());
  return m;
}

fs::path fresh_dir(const std::string& name) {
  const fs::path d = fs::temp_directory_path() / ("mixlens_test_extract_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(d);
  return d;
}

std::vector<ExtractPrompt> prompts() {
  return {{"Once upon a time, there was a little", {}, {}},
          {"The cat sat", {}, {}},
          {"Tom and Lily went to the park to play", {}, {}},
          {"", {1, 2, 3}, {}}};
}

std::string read_file(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), {}};
}

}  // namespace

TEST(Extract, RowsEqualARunOfEachPromptAlone) {
  const Model& m = shipped();
  ExtractOptions o;
  o.values = {"layers.*.linear_attn.betas", "layers.2.linear_attn.state_output", "logits"};
  o.batch_size = 3;
  o.shard_bytes = 40000;
  const ExtractPlan plan = plan_extraction(m, prompts(), o);
  ASSERT_EQ(plan.values.size(), static_cast<size_t>(m.info().num_layers) + 2);
  ASSERT_GE(plan.shards.size(), 2u);
  const fs::path dir = fresh_dir("rows");
  const ExtractSummary s = extract(m, plan, dir.string());
  EXPECT_TRUE(s.complete);
  EXPECT_EQ(s.shards_written, static_cast<int64_t>(plan.shards.size()));

  const auto index = test::read_json(dir / "index.json");
  EXPECT_EQ(index["format"], "mixlens-extract");
  EXPECT_EQ(index["complete"], true);
  EXPECT_EQ(index["num_rows"], plan.total_rows);
  int64_t rows = 0;
  for (size_t i = 0; i < plan.ids.size(); ++i) rows += static_cast<int64_t>(plan.ids[i].size());
  EXPECT_EQ(plan.total_rows, rows);  // positions "all": every real token, no padding

  for (size_t k = 0; k < plan.shards.size(); ++k) {
    io::SafetensorsFile f(dir / index["shards"][k]["file"].get<std::string>());
    const auto offsets = f.get_i64("offsets");
    const auto prompt_index = f.get_i64("prompt_index");
    const auto positions = f.get_i64("positions");
    const auto token_ids = f.get_i64("token_ids");
    for (size_t j = 0; j < prompt_index.size(); ++j) {
      const auto& ids = plan.ids[static_cast<size_t>(prompt_index[j])];
      Trace t;
      for (const auto& v : plan.values) t.save(v.name);
      m.run({ids}, &t);
      ASSERT_EQ(offsets[j + 1] - offsets[j], static_cast<int64_t>(ids.size()));
      for (int64_t r = offsets[j]; r < offsets[j + 1]; ++r) {
        EXPECT_EQ(positions[static_cast<size_t>(r)], r - offsets[j]);
        EXPECT_EQ(token_ids[static_cast<size_t>(r)], ids[static_cast<size_t>(r - offsets[j])]);
      }
      for (const auto& v : plan.values) {
        const Tensor got = f.get_f32(v.name);
        const Tensor want = t.get(v.name);
        const int64_t w = shape_numel(v.row_shape);
        const int64_t first = v.per_token ? offsets[j] : static_cast<int64_t>(j);
        const int64_t n = v.per_token ? offsets[j + 1] - offsets[j] : 1;
        for (int64_t e = 0; e < n * w; ++e) {
          const float a = got[first * w + e], b = want[e];
          ASSERT_NEAR(a, b, 1e-4 + 1e-4 * std::fabs(b)) << v.name << " prompt " << prompt_index[j];
        }
      }
    }
  }
  fs::remove_all(dir);
}

TEST(Extract, ResumeEqualsACleanRunAndSkipsFinishedShards) {
  const Model& m = shipped();
  ExtractOptions o;
  o.values = {"layers.1.linear_attn.states"};
  o.positions = "last";
  o.batch_size = 2;
  o.shard_bytes = 1;  // one prompt per shard
  const ExtractPlan plan = plan_extraction(m, prompts(), o);
  ASSERT_EQ(plan.shards.size(), 4u);
  const fs::path clean = fresh_dir("clean"), resumed = fresh_dir("resumed");
  extract(m, plan, clean.string());

  ExtractRunOptions stop;
  stop.on_progress = [](const ExtractProgress& p) {
    if (p.shards_done == 2) throw InterruptedError("simulated interruption");
  };
  EXPECT_THROW(extract(m, plan, resumed.string(), stop), InterruptedError);
  EXPECT_EQ(test::read_json(resumed / "index.json")["complete"], false);
  const ExtractSummary s = extract(m, plan, resumed.string());
  EXPECT_EQ(s.shards_skipped, 2);
  EXPECT_EQ(s.shards_written, 2);
  EXPECT_EQ(read_file(clean / "index.json"), read_file(resumed / "index.json"));
  for (int k = 0; k < 4; ++k) {
    const std::string name = "shard-0000" + std::to_string(k) + ".safetensors";
    EXPECT_EQ(read_file(clean / name), read_file(resumed / name)) << name;
  }
  // Another plan into the same folder is refused.
  ExtractOptions other = o;
  other.positions = "all";
  EXPECT_THROW(extract(m, plan_extraction(m, prompts(), other), resumed.string()), InputError);
  fs::remove_all(clean);
  fs::remove_all(resumed);
}

TEST(Extract, MaxBytesRefusesBeforeWriting) {
  ExtractOptions o;
  o.values = {"logits"};
  const uint64_t need = plan_extraction(shipped(), prompts(), o).total_bytes;
  o.max_bytes = need - 1;
  try {
    plan_extraction(shipped(), prompts(), o);
    FAIL() << "no ResourceError";
  } catch (const ResourceError& e) {
    EXPECT_NE(std::string(e.what()).find(std::to_string(need)), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(std::to_string(need - 1)), std::string::npos) << e.what();
  }
  o.max_bytes = need;
  EXPECT_NO_THROW(plan_extraction(shipped(), prompts(), o));
}

TEST(Extract, PromptsFilesAreValidatedLineByLine) {
  const fs::path dir = fresh_dir("files");
  fs::create_directories(dir);
  auto write = [&](const std::string& name, const std::string& text) {
    std::ofstream(dir / name, std::ios::binary) << text;
    return (dir / name).string();
  };
  auto message = [](const std::function<void()>& f) -> std::string {
    try {
      f();
    } catch (const InputError& e) {
      return e.what();
    }
    return "no error";
  };
  const auto ok = read_prompts_file(write("a.jsonl", "{\"t\": \"x\", \"m\": [1, 0]}\r\n{\"t\": \"y\", \"m\": [0]}\n"), "t", "m");
  ASSERT_EQ(ok.size(), 2u);
  EXPECT_EQ(ok[0].text, "x");
  EXPECT_EQ(ok[0].mask, (std::vector<uint8_t>{1, 0}));
  EXPECT_EQ(read_prompts_file(write("a.txt", "one\ntwo")).size(), 2u);
  EXPECT_NE(message([&] { read_prompts_file((dir / "nope.txt").string()); }).find("does not exist"), std::string::npos);
  EXPECT_NE(message([&] { read_prompts_file(write("e.txt", "")); }).find("is empty"), std::string::npos);
  EXPECT_NE(message([&] { read_prompts_file(write("b.jsonl", "{\"text\": \"a\"}\n{bad\n")); }).find("b.jsonl line 2: not valid JSON"),
            std::string::npos);
  EXPECT_NE(message([&] { read_prompts_file(write("u.txt", "a\n\xff\xfe\n")); }).find("line 2 is not valid UTF-8"),
            std::string::npos);
  EXPECT_NE(message([&] { read_prompts_file(write("m.jsonl", "{\"text\": \"a\", \"mask\": [3]}\n"), "text", "mask"); })
                .find("line 1: field 'mask' must hold only 0 and 1"),
            std::string::npos);
  fs::remove_all(dir);
}

// A mask given through the API (not a prompts file) holding anything but 0 and 1 is refused by name:
// every nonzero entry picked a position while only the 1s counted rows (heap overflow, fresh-user trial).
TEST(Extract, AMaskEntryOtherThanZeroOrOneIsRefused) {
  const Model& m = shipped();
  ExtractOptions o;
  o.values = {"logits"};
  o.positions = "mask";
  std::vector<ExtractPrompt> ps = {{"", {1, 2, 3, 4}, {1, 0, 2, 1}}};
  try {
    plan_extraction(m, ps, o);
    FAIL() << "a mask entry 2 was accepted";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("mask entry 2 is 2"), std::string::npos) << e.what();
  }
  ps[0].mask = {1, 0, 0, 1};
  EXPECT_EQ(plan_extraction(m, ps, o).total_rows, 2);
}
