// Bad input never crashes and never runs on silently: each case is a clear error from the library
// and a one-line message with a non-zero exit from the CLI.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "fixture_util.h"
#include "io/safetensors.h"
#include "mixlens/errors.h"
#include "mixlens/extract.h"
#include "mixlens/trace.h"

using namespace mixlens;
using namespace mixlens::test;
namespace fs = std::filesystem;

namespace {

class BadInput : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("mixlens_bad_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    for (const char* f : {"config.json", "model.safetensors"})
      fs::copy_file(fixture("mamba2/short_prompt") / f, dir_ / f);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string read(const fs::path& p) {
    std::ifstream f(p, std::ios::binary);
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
  }
  void write(const fs::path& p, const std::string& s) {
    std::ofstream f(p, std::ios::binary | std::ios::trunc);
    f << s;
  }
  // Rewrites model.safetensors through `edit` (name -> tensor list).
  void rewrite_weights(const std::function<void(std::vector<std::pair<std::string, Tensor>>&)>& edit) {
    std::vector<std::pair<std::string, Tensor>> ts;
    {
      io::SafetensorsFile f(dir_ / "model.safetensors");
      for (const auto& i : f.tensors()) ts.emplace_back(i.name, f.get_f32(i.name).clone());
    }
    edit(ts);
    io::write_safetensors(dir_ / "model.safetensors", ts);
  }
  // The library's error message, checked to be of type E.
  template <class E>
  std::string load_error() {
    try {
      Model::load(dir_.string());
    } catch (const E& e) {
      return e.what();
    } catch (const std::exception& e) {
      return std::string("wrong exception type: ") + e.what();
    }
    return "no error";
  }
  // Runs the CLI; returns the exit status and fills `err` with stderr.
  int cli(const std::string& args, std::string* err) {
    const fs::path errf = dir_ / "stderr.txt";
    const std::string cmd = std::string(MIXLENS_CLI_PATH) + " " + args + " > /dev/null 2> " + errf.string();
    const int rc = std::system(cmd.c_str());
    *err = read(errf);
    return WIFEXITED(rc) ? WEXITSTATUS(rc) : 128;
  }
  void expect_cli_fails(const std::string& needle) {
    std::string err;
    const int rc = cli("run --model " + dir_.string() + " 1,2,3 --ids --save logits --out " + (dir_ / "o.st").string(), &err);
    EXPECT_NE(rc, 0);
    EXPECT_NE(err.find("mixlens: error: "), std::string::npos) << err;
    EXPECT_NE(err.find(needle), std::string::npos) << err;
    EXPECT_EQ(std::count(err.begin(), err.end(), '\n'), 1) << "one line: " << err;
  }

  fs::path dir_;
};

TEST_F(BadInput, TruncatedSafetensorsAtManyLengths) {
  const std::string full = read(dir_ / "model.safetensors");
  for (size_t len : {size_t{0}, size_t{4}, size_t{8}, size_t{20}, full.size() / 2, full.size() - 1}) {
    write(dir_ / "model.safetensors", full.substr(0, len));
    const std::string msg = load_error<CheckpointError>();
    EXPECT_NE(msg.find("model.safetensors"), std::string::npos) << "len " << len << ": " << msg;
  }
  expect_cli_fails("model.safetensors");
}

TEST_F(BadInput, HeaderNotJson) {
  std::string s = read(dir_ / "model.safetensors");
  s[8] = '#';  // first byte of the JSON header
  write(dir_ / "model.safetensors", s);
  EXPECT_NE(load_error<CheckpointError>().find("JSON"), std::string::npos);
  expect_cli_fails("JSON");
}

TEST_F(BadInput, HeaderClaimsBytesPastTheEnd) {
  std::string s = read(dir_ / "model.safetensors");
  uint64_t n = 0;
  std::memcpy(&n, s.data(), 8);
  n += 1000000;
  std::memcpy(s.data(), &n, 8);
  write(dir_ / "model.safetensors", s);
  const std::string msg = load_error<CheckpointError>();
  EXPECT_NE(msg.find("model.safetensors"), std::string::npos) << msg;
  expect_cli_fails("model.safetensors");
}

TEST_F(BadInput, MissingTensor) {
  rewrite_weights([](auto& ts) {
    ts.erase(std::remove_if(ts.begin(), ts.end(), [](auto& p) { return p.first == "backbone.layers.1.mixer.dt_bias"; }),
             ts.end());
  });
  EXPECT_NE(load_error<CheckpointError>().find("backbone.layers.1.mixer.dt_bias"), std::string::npos);
  expect_cli_fails("backbone.layers.1.mixer.dt_bias");
}

TEST_F(BadInput, TensorOfTheWrongShape) {
  rewrite_weights([](auto& ts) {
    for (auto& [n, t] : ts)
      if (n == "backbone.layers.0.mixer.A_log") t = Tensor({3});
  });
  const std::string msg = load_error<CheckpointError>();
  EXPECT_NE(msg.find("backbone.layers.0.mixer.A_log"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[3]"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[4]"), std::string::npos) << msg;
  expect_cli_fails("A_log");
}

TEST_F(BadInput, UnknownModelType) {
  std::string c = read(dir_ / "config.json");
  const size_t at = c.find("\"mamba2\"");
  c = c.substr(0, at) + "\"rwkv7\"" + c.substr(at + 8);
  write(dir_ / "config.json", c);
  const std::string msg = load_error<UnsupportedError>();
  EXPECT_NE(msg.find("rwkv7"), std::string::npos) << msg;
  EXPECT_NE(msg.find("mamba2"), std::string::npos) << "lists the supported types: " << msg;
  expect_cli_fails("rwkv7");
}

TEST_F(BadInput, ConfigNotJsonOrMissingField) {
  write(dir_ / "config.json", "{\"model_type\": \"mamba2\", ");
  EXPECT_NE(load_error<ConfigError>().find("config.json"), std::string::npos);
  write(dir_ / "config.json", "{\"model_type\": \"mamba2\"}");
  EXPECT_NE(load_error<ConfigError>().find("hidden_size"), std::string::npos);
}

TEST_F(BadInput, NaNWeightsAndNonsenseConfigValues) {
  rewrite_weights([](auto& ts) {
    for (auto& [n, t] : ts)
      if (n == "backbone.layers.0.mixer.D") t[1] = std::nanf("");
  });
  EXPECT_NE(load_error<CheckpointError>().find("backbone.layers.0.mixer.D' in"), std::string::npos);
  expect_cli_fails("contains NaN");
  fs::copy_file(fixture("mamba2/short_prompt") / "model.safetensors", dir_ / "model.safetensors",
                fs::copy_options::overwrite_existing);
  const nlohmann::json good = read_json(dir_ / "config.json");
  auto with_field = [&](const std::string& field, const nlohmann::json& value) {
    nlohmann::json c = good;
    c[field] = value;
    write(dir_ / "config.json", c.dump());
  };
  with_field("layer_norm_epsilon", -1.0);
  EXPECT_NE(load_error<ConfigError>().find("layer_norm_epsilon"), std::string::npos);
  with_field("time_step_limit", {1.0, 0.5});
  EXPECT_NE(load_error<ConfigError>().find("time_step_limit"), std::string::npos);
}

// Mamba2Config's time_step_limit defaults to (0, inf) when absent (no clamp) and its strict field
// refuses null, as mixlens does (with the field named); a real limit clamps, so the comparison of
// the absent case with [0, inf] can tell.
TEST_F(BadInput, TimeStepLimitAsMamba2ConfigTakesIt) {
  const nlohmann::json good = read_json(dir_ / "config.json");
  auto set_limit = [&](const nlohmann::json* value) {
    nlohmann::json c = good;
    if (value) c["time_step_limit"] = *value;
    else c.erase("time_step_limit");
    write(dir_ / "config.json", c.dump());
  };
  const std::vector<std::vector<int32_t>> prompt{{3, 1, 4, 1, 5, 9}};
  // transformers writes the infinite bound as {"__float__": "Infinity"} (JSON has no inf).
  const nlohmann::json unlimited = nlohmann::json::array({0.0, {{"__float__", "Infinity"}}}), null = nullptr,
                       tight = nlohmann::json::array({0.5, 0.6});
  set_limit(&unlimited);
  const Tensor ref = Model::load(dir_.string()).run(prompt);
  set_limit(nullptr);
  const Tensor absent = Model::load(dir_.string()).run(prompt);
  ASSERT_EQ(absent.numel(), ref.numel());
  for (int64_t i = 0; i < ref.numel(); ++i) ASSERT_EQ(absent[i], ref[i]) << "absent at " << i;
  set_limit(&tight);
  const Tensor clamped = Model::load(dir_.string()).run(prompt);
  double diff = 0.0;
  for (int64_t i = 0; i < ref.numel(); ++i) diff = std::max(diff, static_cast<double>(std::fabs(clamped[i] - ref[i])));
  EXPECT_GT(diff, 1e-6) << "a real time_step_limit must clamp dt";
  set_limit(&null);
  EXPECT_NE(load_error<ConfigError>().find("time_step_limit is null"), std::string::npos) << load_error<ConfigError>();
}

TEST_F(BadInput, InfiniteWritesAreRefused) {
  Model m = Model::load(dir_.string());
  Trace t;
  t.edit("layers.0.linear_attn.betas", [](Tensor& v, const SiteContext&) { v[0] = INFINITY; });
  EXPECT_THROW(m.run({{1, 2, 3}}, &t), WriteError);
  EXPECT_THROW(route_kernels("Mamba2", "recurrent"), InputError);
}

TEST_F(BadInput, CliNumbersOutOfRangeAreUsageErrors) {
  std::string err;
  EXPECT_EQ(cli("generate --model " + dir_.string() + " 3,4294967296 --ids --max-new-tokens 2", &err), 2) << err;
  EXPECT_EQ(cli("generate --model " + dir_.string() + " 3 --ids --max-new-tokens 4294967299", &err), 2) << err;
  EXPECT_EQ(cli("generate --model " + dir_.string() + " 3 --ids --max-new-tokens 2 --seed -1", &err), 2) << err;
  EXPECT_EQ(cli("inspect --model " + dir_.string() + " --prompt-length 0", &err), 2) << err;
}

TEST_F(BadInput, NonexistentModelFolder) {
  try {
    Model::load((dir_ / "nope").string());
    FAIL();
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("does not exist"), std::string::npos) << e.what();
  }
  std::string err;
  EXPECT_NE(cli("generate --model " + (dir_ / "nope").string() + " 1 --ids --max-new-tokens 2", &err), 0);
  EXPECT_NE(err.find("does not exist"), std::string::npos) << err;
}

TEST_F(BadInput, CliUnknownValuePathSuggestsNearest) {
  std::string err;
  EXPECT_NE(cli("run --model " + dir_.string() + " 1,2 --ids --save layers.0.linear_attn.beta --out " +
                    (dir_ / "o.st").string(), &err), 0);
  EXPECT_NE(err.find("did you mean 'layers.0.linear_attn.betas'"), std::string::npos) << err;
}

TEST_F(BadInput, CliTokenIdOutsideVocabulary) {
  std::string err;
  EXPECT_NE(cli("run --model " + dir_.string() + " 1,5000 --ids --save logits --out " + (dir_ / "o.st").string(), &err), 0);
  EXPECT_NE(err.find("outside the vocabulary"), std::string::npos) << err;
}

TEST_F(BadInput, CliUsageErrors) {
  std::string err;
  EXPECT_EQ(cli("frobnicate", &err), 2);
  EXPECT_EQ(cli("generate --model " + dir_.string() + " 1 --ids", &err), 2);  // no --max-new-tokens
  EXPECT_NE(err.find("--max-new-tokens"), std::string::npos) << err;
  EXPECT_EQ(cli("generate --model " + dir_.string() + " 1 --ids --max-new-tokens x", &err), 2);
}

TEST_F(BadInput, CliRunWritesSafetensorsWithMetadata) {
  std::string err;
  const fs::path out = dir_ / "vals.safetensors";
  ASSERT_EQ(cli("run --model " + dir_.string() + " 3,4,5 --ids --save layers.*.linear_attn.state_output --save logits --out " +
                    out.string(), &err), 0) << err;
  io::SafetensorsFile f(out);
  EXPECT_TRUE(f.has("layers.0.linear_attn.state_output"));
  EXPECT_TRUE(f.has("layers.1.linear_attn.state_output"));
  EXPECT_EQ(f.info("logits").shape, (Shape{1, 3, 97}));
  ASSERT_TRUE(f.metadata().count("mixlens"));
  auto meta = nlohmann::json::parse(f.metadata().at("mixlens"));
  EXPECT_EQ(meta["prompt_ids"][0], (std::vector<int>{3, 4, 5}));
  // The same values as the library computes.
  Model m = Model::load(dir_.string());
  Trace t;
  t.save("logits");
  m.run({{3, 4, 5}}, &t);
  EXPECT_EQ(rel_rms(f.get_f32("logits"), t.get("logits")), 0.0);

  const fs::path gen = dir_ / "gen.safetensors";
  ASSERT_EQ(cli("generate --model " + dir_.string() + " 3,4,5 --ids --max-new-tokens 3 --save layers.1.linear_attn.betas --out " +
                    gen.string(), &err), 0) << err;
  io::SafetensorsFile g(gen);
  EXPECT_EQ(g.info("layers.1.linear_attn.betas@step0").shape, (Shape{1, 3, 4}));
  EXPECT_EQ(g.info("layers.1.linear_attn.betas@step2").shape, (Shape{1, 1, 4}));
  EXPECT_EQ(nlohmann::json::parse(g.metadata().at("mixlens"))["generated_ids"][0].size(), 3u);
}

}  // namespace

TEST_F(BadInput, CliOutRefusesTheCheckpointsOwnFiles) {
  // --out inside the model folder used to overwrite model.safetensors with the saved values (rc 0): the
  // next load failed. Refused before the run, the checkpoint untouched, also through a symlink.
  const auto before = fs::file_size(dir_ / "model.safetensors");
  std::string err;
  for (const fs::path& out : {dir_ / "model.safetensors", dir_ / "config.json"}) {
    EXPECT_EQ(cli("run --model " + dir_.string() + " 1,2,3 --ids --save logits --out " + out.string(), &err), 2) << err;
    EXPECT_NE(err.find("is a file of the loaded checkpoint"), std::string::npos) << err;
  }
  fs::create_symlink(dir_ / "model.safetensors", dir_ / "link.st");
  EXPECT_EQ(cli("run --model " + dir_.string() + " 1,2,3 --ids --save logits --out " + (dir_ / "link.st").string(), &err), 2);
  EXPECT_EQ(fs::file_size(dir_ / "model.safetensors"), before);
  EXPECT_EQ(cli("run --model " + dir_.string() + " 1,2,3 --ids --save logits --out " + (dir_ / "o.st").string(), &err), 0) << err;
}

// A chunk length the family cannot take is refused, not ignored (Qwen's gated delta chunk is fixed);
// 0, the default, is accepted everywhere.
TEST(Settings, ChunkSizeOnAFixedChunkFamilyIsRefused) {
  Model m = Model::load(fixture("qwen3_5/hv_2hk").string());
  try {
    m.set_chunk_size(1);
    FAIL() << "set_chunk_size(1) on qwen3_5 did not throw";
  } catch (const UnsupportedError& e) {
    EXPECT_NE(std::string(e.what()).find("chunks of 64 tokens, fixed"), std::string::npos) << e.what();
  }
  EXPECT_NO_THROW(m.set_chunk_size(0));
  Model mamba = Model::load(fixture("mamba2/short_prompt").string());
  EXPECT_NO_THROW(mamba.set_chunk_size(1));
  EXPECT_NO_THROW(mamba.set_chunk_size(0));
}

TEST(Settings, ExtractOptionsOutOfRangeAreRefusedBeforeAnythingRuns) {
  ExtractOptions o;
  o.values = {"logits"};
  EXPECT_NO_THROW(o.check());
  o.batch_size = 0;
  EXPECT_THROW(o.check(), InputError);
  o.batch_size = 1;
  o.positions = "first";
  EXPECT_THROW(o.check(), InputError);
  o.positions = "last";
  o.shard_bytes = 0;
  EXPECT_THROW(o.check(), InputError);
}

TEST(Settings, KernelRouteOfAnUnknownFamilyIsRefused) {
  EXPECT_EQ(kernel_route("mamba2"), KernelRoute::default_route);
  try {
    kernel_route("mamab2");
    FAIL() << "a misspelt family read as routed by default";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("unknown family 'mamab2'"), std::string::npos) << e.what();
  }
}

TEST(Settings, ATextFieldOnAPlainTextPromptsFileIsRefused) {
  const auto path = std::filesystem::temp_directory_path() / ("mixlens_prompts_" + std::to_string(::getpid()) + ".txt");
  std::ofstream(path) << "hello\nworld\n";
  EXPECT_EQ(read_prompts_file(path.string()).size(), 2u);
  EXPECT_THROW(read_prompts_file(path.string(), "body"), InputError);
  std::filesystem::remove(path);
}

TEST(Paths, AStepSuffixIsParsedOnceForEveryFrontEnd) {
  // split_step is what Python's saves= / edits= keys and the CLI's --save go through.
  const StepPath per = split_step("layers.0.linear_attn.state@t0@step2");
  EXPECT_EQ(per.path, "layers.0.linear_attn.state@t0");
  EXPECT_EQ(per.steps.first, 2);
  EXPECT_EQ(per.steps.last, 2);
  const StepPath all = split_step("layers.0.linear_attn.betas");
  EXPECT_EQ(all.path, "layers.0.linear_attn.betas");
  EXPECT_EQ(all.steps.first, Steps::all().first);
  EXPECT_EQ(all.steps.last, Steps::all().last);
  EXPECT_EQ(split_step("logits@step0").steps.last, 0);
  for (const char* bad : {"logits@step", "logits@stepx", "logits@step-1", "logits@step2x", "logits@step99999999999", "@step1"})
    EXPECT_THROW(split_step(bad), InputError) << bad;
}

TEST(Paths, AStatePathOnAnAttentionBlockNamesStateAndTheBlock) {
  // Qwen3.5 fixture: layer 1 is full attention. The error named `states`, not what was asked for.
  Model m = Model::load(fixture("qwen3_5/hv_2hk").string());
  for (const char* asked : {"layers.1.linear_attn.state@t0", "layers.1.linear_attn.state@t-1"}) {
    const std::string path = asked;
    Trace t;
    t.save(path);
    try {
      m.run({{5, 6, 7}}, &t);
      FAIL() << path << " was accepted on an attention block";
    } catch (const UnknownValueError& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("'" + path + "'"), std::string::npos) << msg;
      EXPECT_NE(msg.find("attention block"), std::string::npos) << msg;
      EXPECT_NE(msg.find("self_attn"), std::string::npos) << msg;
      EXPECT_EQ(msg.find("states"), std::string::npos) << msg;
    }
  }
  Trace ok;  // the same path on a gated DeltaNet block is served
  ok.save("layers.0.linear_attn.state@t0");
  m.run({{5, 6, 7}}, &ok);
  EXPECT_TRUE(ok.has("layers.0.linear_attn.state@t0"));
}
