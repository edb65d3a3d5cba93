// Tokenizer tests: exact agreement with HF `tokenizers` on the committed corpus (fixtures made by
// scripts/make_tokenizer_fixtures.py), llama.cpp's vectors, streaming decode, and bad files.
#include <gtest/gtest.h>

#include <chrono>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "mixlens/errors.h"
#include "mixlens/tokenizer.h"

#ifndef MIXLENS_SOURCE_DIR
#error "MIXLENS_SOURCE_DIR must name the repository root"
#endif

namespace {

using mixlens::Tokenizer;
using mixlens::TokenizerError;
using json = nlohmann::json;

const std::string kFix = std::string(MIXLENS_SOURCE_DIR) + "/tests/fixtures/tokenizer";

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error("cannot open " + path);
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::vector<json> read_jsonl(const std::string& path) {
  std::vector<json> out;
  std::istringstream in(read_file(path));
  std::string line;
  while (std::getline(in, line)) out.push_back(json::parse(line));
  return out;
}

// Same overlay rules as scripts/make_tokenizer_fixtures.py apply_overlay().
std::string variant_json(const std::string& name) {
  const json overlay = json::parse(read_file(kFix + "/" + name + "/overlay.json"));
  json base = json::parse(read_file(kFix + "/" + overlay["base"].get<std::string>() + "/tokenizer.json"));
  if (overlay.contains("replace"))
    for (auto& [k, v] : overlay["replace"].items()) base[k] = v;
  if (overlay.contains("model"))
    for (auto& [k, v] : overlay["model"].items()) base["model"][k] = v;
  if (overlay.contains("append_added_tokens"))
    for (const json& t : overlay["append_added_tokens"]) base["added_tokens"].push_back(t);
  return base.dump();
}

// Loading qwen3 parses 11 MB of JSON; each tokenizer is loaded once for the whole run.
const Tokenizer& get(const std::string& name) {
  static std::map<std::string, std::unique_ptr<Tokenizer>> cache;
  auto it = cache.find(name);
  if (it != cache.end()) return *it->second;
  std::unique_ptr<Tokenizer> t;
  if (name == "qwen3.5-variant" || name == "gpt2-flags" || name == "gpt2-split" || name == "gpt2-regex") {
    t = std::make_unique<Tokenizer>(Tokenizer::from_json(variant_json(name), name));
  } else {
    t = std::make_unique<Tokenizer>(Tokenizer::from_file(kFix + "/" + name + "/tokenizer.json"));
  }
  return *cache.emplace(name, std::move(t)).first->second;
}

const std::vector<std::string>& corpus() {
  static const std::vector<std::string> c = [] {
    std::vector<std::string> v;
    for (const json& j : read_jsonl(kFix + "/corpus.jsonl")) v.push_back(j["text"].get<std::string>());
    return v;
  }();
  return c;
}

std::string show(const std::string& s) { return json(s).dump(); }

std::string show(const std::vector<int32_t>& ids) {
  std::string out = "[";
  for (size_t i = 0; i < ids.size(); ++i) out += (i ? ", " : "") + std::to_string(ids[i]);
  return out + "]";
}

bool valid_utf8(const std::string& s) {
  try {
    (void)json(s).dump();  // nlohmann throws on invalid UTF-8
    return true;
  } catch (const json::type_error&) {
    return false;
  }
}

// ------------------------------------------------------------------------------------------
// Corpus agreement with HF tokenizers
// ------------------------------------------------------------------------------------------

class TokenizerCorpus : public ::testing::TestWithParam<std::string> {};

TEST_P(TokenizerCorpus, IdsAndDecodeMatchHF) {
  const std::string name = GetParam();
  const Tokenizer& tok = get(name);
  const auto& texts = corpus();
  const std::vector<json> expected = read_jsonl(kFix + "/expected/" + name + ".jsonl");
  ASSERT_EQ(texts.size(), expected.size()) << "fixtures out of date: rerun scripts/make_tokenizer_fixtures.py";
  ASSERT_GE(texts.size(), 1000u);

  int id_fail = 0, dec_fail = 0;
  for (size_t i = 0; i < texts.size(); ++i) {
    const auto want = expected[i]["ids"].get<std::vector<int32_t>>();
    const auto got = tok.encode(texts[i]);
    if (got != want && ++id_fail <= 10) {
      ADD_FAILURE() << name << " line " << i << " text " << show(texts[i]) << "\n  HF:      " << show(want)
                    << "\n  mixlens: " << show(got);
    }
    // Decode is checked on HF's ids so an encode bug does not hide a decode bug.
    const std::string d = tok.decode(want, false), ds = tok.decode(want, true);
    if ((d != expected[i]["decoded"].get<std::string>() || ds != expected[i]["decoded_skip"].get<std::string>()) &&
        ++dec_fail <= 10) {
      ADD_FAILURE() << name << " line " << i << " decode of " << show(want) << "\n  HF:      "
                    << expected[i]["decoded"].dump() << " / " << expected[i]["decoded_skip"].dump()
                    << "\n  mixlens: " << show(d) << " / " << show(ds);
    }
  }
  EXPECT_EQ(id_fail, 0) << "strings whose ids differ from HF (of " << texts.size() << ")";
  EXPECT_EQ(dec_fail, 0) << "strings whose decode differs from HF (of " << texts.size() << ")";
}

INSTANTIATE_TEST_SUITE_P(HF, TokenizerCorpus,
                         ::testing::Values("gpt-neox-20b", "qwen3", "qwen3.5-variant", "gpt2", "gpt2-flags",
                                           "gpt2-split", "gpt2-regex", "tiny-unk"),
                         [](const auto& param_info) {
                           std::string n = param_info.param;
                           for (char& c : n)
                             if (!isalnum(static_cast<unsigned char>(c))) c = '_';
                           return n;
                         });

// ------------------------------------------------------------------------------------------
// llama.cpp test vectors
// ------------------------------------------------------------------------------------------

void check_llama_cpp(const std::string& vocab, const std::string& tokenizer) {
  const std::string inp = read_file(kFix + "/llama.cpp-vectors/ggml-vocab-" + vocab + ".gguf.inp");
  const std::string out = read_file(kFix + "/llama.cpp-vectors/ggml-vocab-" + vocab + ".gguf.out");
  const std::string sep = "\n__ggml_vocab_test__\n";
  std::vector<std::string> texts;
  for (size_t pos = 0;;) {
    const size_t k = inp.find(sep, pos);
    if (k == std::string::npos) {
      if (pos < inp.size()) texts.push_back(inp.substr(pos));
      break;
    }
    texts.push_back(inp.substr(pos, k - pos));
    pos = k + sep.size();
  }
  std::vector<std::vector<int32_t>> want;
  std::istringstream lines(out);
  std::string line;
  while (std::getline(lines, line)) {
    std::istringstream nums(line);
    std::vector<int32_t> ids;
    int32_t x;
    while (nums >> x) ids.push_back(x);
    want.push_back(ids);
  }
  ASSERT_EQ(texts.size(), want.size());
  ASSERT_GE(texts.size(), 40u);
  const Tokenizer& tok = get(tokenizer);
  for (size_t i = 0; i < texts.size(); ++i) {
    EXPECT_EQ(show(tok.encode(texts[i], false)), show(want[i])) << vocab << " case " << i << " " << show(texts[i]);
  }
}

TEST(TokenizerLlamaCppVectors, Qwen2WithQwen3Tokenizer) { check_llama_cpp("qwen2", "qwen3"); }
TEST(TokenizerLlamaCppVectors, Gpt2) { check_llama_cpp("gpt-2", "gpt2"); }

// ------------------------------------------------------------------------------------------
// Known values and API
// ------------------------------------------------------------------------------------------

TEST(Tokenizer, GptNeoxBasics) {
  const Tokenizer& t = get("gpt-neox-20b");
  EXPECT_EQ(t.vocab_size(), 50277);
  EXPECT_EQ(t.special_ids(), (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(t.token_to_id("<|endoftext|>"), 0);
  EXPECT_EQ(t.token_to_id("  "), 50276);  // the whitespace-run added tokens
  EXPECT_EQ(t.token_to_id("no such token"), std::nullopt);
  EXPECT_EQ(t.id_to_token(50276), "  ");
  EXPECT_EQ(t.id_to_token(12092), "Hello");
  EXPECT_EQ(t.id_to_token(1533), "Ġworld");
  EXPECT_THROW(t.id_to_token(-1), mixlens::InputError);
  EXPECT_THROW(t.id_to_token(50277), mixlens::InputError);
  // Four spaces are one added token, cut out before the regex (so "b" loses its space).
  EXPECT_EQ(t.encode("a    b"), (std::vector<int32_t>{66, 50274, 67}));
  EXPECT_EQ(t.encode(""), std::vector<int32_t>{});
  EXPECT_EQ(t.decode({12092, 99999, -5, 1533}), "Hello world");  // unknown ids dropped, like HF
  EXPECT_EQ(t.decode({0, 12092}, true), "Hello");
}

TEST(Tokenizer, Qwen3Basics) {
  const Tokenizer& t = get("qwen3");
  EXPECT_EQ(t.vocab_size(), 151669);
  const auto sp = t.special_ids();
  ASSERT_EQ(sp.size(), 14u);  // <|endoftext|> .. <|video_pad|>; <tool_call> etc. are not special
  EXPECT_EQ(sp.front(), 151643);
  EXPECT_EQ(sp.back(), 151656);
  EXPECT_EQ(t.token_to_id("<|im_start|>"), 151644);
  EXPECT_EQ(t.encode("<|im_start|>user"), (std::vector<int32_t>{151644, 872}));
}

TEST(Tokenizer, InvalidUtf8IsInputError) {
  const Tokenizer& t = get("gpt2");
  EXPECT_THROW(t.encode(std::string("ab\xC3", 3)), mixlens::InputError);
  EXPECT_THROW(t.encode(std::string("\xFF")), mixlens::InputError);
  EXPECT_THROW(t.encode(std::string("\xED\xA0\x80")), mixlens::InputError);  // a surrogate
}

TEST(Tokenizer, CopiesShareTablesAndThreadsAgree) {
  const Tokenizer copy = get("qwen3");
  const auto& texts = corpus();
  std::vector<std::vector<int32_t>> a(texts.size()), b(texts.size());
  std::thread th([&] {
    for (size_t i = 0; i < texts.size(); ++i) a[i] = copy.encode(texts[i]);
  });
  for (size_t i = 0; i < texts.size(); ++i) b[i] = get("qwen3").encode(texts[i]);
  th.join();
  EXPECT_EQ(a, b);
}

// ------------------------------------------------------------------------------------------
// Streaming decode
// ------------------------------------------------------------------------------------------

// Pushes every id; checks each emitted chunk is valid UTF-8; returns the concatenation.
std::string stream_all(const Tokenizer& t, const std::vector<int32_t>& ids, bool skip,
                       std::vector<std::string>* chunks = nullptr) {
  Tokenizer::StreamDecoder sd(t, skip);
  std::string all;
  for (int32_t id : ids) {
    std::string c = sd.push(id);
    EXPECT_TRUE(valid_utf8(c)) << show(ids);
    if (chunks) chunks->push_back(c);
    all += c;
  }
  all += sd.flush();
  return all;
}

TEST(TokenizerStreamDecoder, HoldsBackSplitCharacters) {
  const Tokenizer& t = get("gpt-neox-20b");
  for (const std::string s : {"😀", "👨‍👩‍👧‍👦 family", "𠀀𠀁 𪚥", "日本語のテキスト", "🇺🇸🇫🇷"}) {
    const auto ids = t.encode(s);
    std::vector<std::string> chunks;
    EXPECT_EQ(stream_all(t, ids, false, &chunks), s);
    if (std::string(s) == "😀") {
      // One character in several byte tokens: nothing until the last byte arrives.
      ASSERT_GE(ids.size(), 2u);
      for (size_t i = 0; i + 1 < chunks.size(); ++i) EXPECT_EQ(chunks[i], "");
      EXPECT_EQ(chunks.back(), "😀");
    }
  }
  // An incomplete character left at the end is flushed as U+FFFD, like HF decode.
  const auto ids = t.encode("😀");
  Tokenizer::StreamDecoder sd(t);
  EXPECT_EQ(sd.push(ids[0]), "");
  EXPECT_EQ(sd.flush(), t.decode({ids[0]}));
  EXPECT_EQ(sd.flush(), "");
}

TEST(TokenizerStreamDecoder, OutlivesItsTokenizer) {
  std::unique_ptr<Tokenizer::StreamDecoder> sd;
  std::vector<int32_t> ids;
  {
    const Tokenizer t = Tokenizer::from_file(kFix + "/gpt2/tokenizer.json");
    ids = t.encode("héllo 😀");
    sd = std::make_unique<Tokenizer::StreamDecoder>(t);
  }
  std::string s;
  for (int32_t id : ids) s += sd->push(id);
  EXPECT_EQ(s + sd->flush(), "héllo 😀");
}

TEST(TokenizerStreamDecoder, ConcatenationEqualsDecodeOnCorpus) {
  for (const std::string name : {"gpt-neox-20b", "qwen3", "gpt2-split"}) {
    const Tokenizer& t = get(name);
    for (const std::string& s : corpus()) {
      const auto ids = t.encode(s);
      ASSERT_EQ(stream_all(t, ids, false), t.decode(ids, false)) << name << " " << show(s);
      ASSERT_EQ(stream_all(t, ids, true), t.decode(ids, true)) << name << " " << show(s);
      // Ids cut at arbitrary points (as a sampler may produce) must also agree with decode.
      std::vector<int32_t> odd(ids.rbegin(), ids.rend());
      ASSERT_EQ(stream_all(t, odd, false), t.decode(odd, false)) << name << " reversed " << show(s);
    }
  }
}

// HF DecodeStream's rule: after each id, the text so far is either all out (decode of the ids so far,
// which then does not end in U+FFFD) or held back because that decode ends in U+FFFD.
TEST(TokenizerStreamDecoder, EmitsAsHfDecodeStream) {
  const std::string fffd = "\xEF\xBF\xBD";
  for (const std::string name : {"gpt-neox-20b", "qwen3"}) {
    const Tokenizer& t = get(name);
    int held = 0;
    for (const std::string& s : corpus()) {
      const auto ids = t.encode(s);
      Tokenizer::StreamDecoder sd(t);
      std::string out;
      for (size_t i = 0; i < ids.size(); ++i) {
        const std::string piece = sd.push(ids[i]);
        out += piece;
        const std::string so_far = t.decode(std::vector<int32_t>(ids.begin(), ids.begin() + static_cast<long>(i) + 1));
        const bool ends_fffd = so_far.size() >= 3 && so_far.compare(so_far.size() - 3, 3, fffd) == 0;
        if (ends_fffd) {
          ASSERT_EQ(piece, "") << name << " " << show(s) << " at id " << i;
          ++held;
        } else {
          ASSERT_EQ(out, so_far) << name << " " << show(s) << " at id " << i;
        }
      }
    }
    EXPECT_GT(held, 0) << name << ": the corpus never split a character";
  }
}

// ------------------------------------------------------------------------------------------
// Bad files
// ------------------------------------------------------------------------------------------

// A tiny valid byte-level BPE tokenizer.json that the cases below break in one place each.
json tiny() {
  return json::parse(R"({
    "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
    "normalizer": null,
    "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
    "post_processor": null,
    "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
    "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
              "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
              "vocab": {"a": 0, "b": 1, "ab": 2, "Ġ": 3}, "merges": ["a b"]}})");
}

bool has(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

std::string error_of(const std::string& text) {
  try {
    (void)Tokenizer::from_json(text, "bad.json");
  } catch (const TokenizerError& e) {
    return e.what();
  }
  return "(no TokenizerError)";
}

TEST(TokenizerBadFiles, TinyTokenizerWorks) {
  const Tokenizer t = Tokenizer::from_json(tiny().dump());
  EXPECT_EQ(t.encode("ab a b"), (std::vector<int32_t>{2, 3, 0, 3, 1}));
  EXPECT_EQ(t.decode({2, 3, 0}), "ab a");
}

TEST(TokenizerBadFiles, ClearErrors) {
  EXPECT_PRED2(has, error_of("{not json"), "not valid JSON");
  EXPECT_PRED2(has, error_of("[1, 2]"), "top level must be a JSON object");

  json j = tiny();
  j.erase("model");
  EXPECT_PRED2(has, error_of(j.dump()), "missing field 'model'");

  j = tiny();
  j["model"]["type"] = "WordPiece";
  EXPECT_PRED2(has, error_of(j.dump()), "tokenizer.json model type 'WordPiece' is not supported (mixlens supports byte-level BPE)");

  j = tiny();
  j["pre_tokenizer"] = json::parse(R"({"type": "Split", "pattern": {"Regex": "(?i:'s|[a-"}, "behavior": "Isolated", "invert": false})");
  EXPECT_PRED2(has, error_of(j.dump()), "bad regex");

  j = tiny();
  j["model"]["merges"] = json::parse(R"(["a b", "b zz"])");
  EXPECT_PRED2(has, error_of(j.dump()), "uses token 'zz' which is not in the vocab");

  j = tiny();
  j["model"]["merges"] = json::parse(R"([["b", "a"]])");
  EXPECT_PRED2(has, error_of(j.dump()), "produces 'ba' which is not in the vocab");

  j = tiny();
  j["model"]["merges"] = json::parse(R"(["a b c"])");
  EXPECT_PRED2(has, error_of(j.dump()), "two tokens separated by one space");

  j = tiny();
  j["normalizer"] = json::parse(R"({"type": "Lowercase"})");
  EXPECT_PRED2(has, error_of(j.dump()), "normalizer type 'Lowercase' is not supported");

  j = tiny();
  j["pre_tokenizer"] = json::parse(R"({"type": "Metaspace", "replacement": "_"})");
  EXPECT_PRED2(has, error_of(j.dump()), "pre_tokenizer type 'Metaspace' is not supported");

  j = tiny();
  j["decoder"] = json::parse(R"({"type": "WordPiece"})");
  EXPECT_PRED2(has, error_of(j.dump()), "decoder type 'WordPiece' is not supported");

  j = tiny();
  j["model"]["vocab"]["a"] = "zero";
  EXPECT_PRED2(has, error_of(j.dump()), "model.vocab['a']");

  j = tiny();
  j["model"]["dropout"] = 0.1;
  EXPECT_PRED2(has, error_of(j.dump()), "dropout");

  j = tiny();
  j["post_processor"] = json::parse(R"({"type": "BertProcessing", "sep": ["[SEP]", 7], "cls": ["a", 0]})");
  EXPECT_PRED2(has, error_of(j.dump()), "post_processor: special token id 7 has no token");

  j = tiny();
  j["version"] = "2.0";
  EXPECT_PRED2(has, error_of(j.dump()), "unknown tokenizer.json version");

  j = tiny();
  j["added_tokens"] = json::parse(R"([{"id": 9}])");
  EXPECT_PRED2(has, error_of(j.dump()), "added_tokens[0]: missing field 'content'");

  try {
    (void)Tokenizer::from_file(kFix + "/does-not-exist/tokenizer.json");
    ADD_FAILURE() << "no error for a missing file";
  } catch (const TokenizerError& e) {
    EXPECT_PRED2(has, std::string(e.what()), "does-not-exist/tokenizer.json: cannot open");
  }
}

// ------------------------------------------------------------------------------------------
// Throughput (reported, not gated: machines differ)
// ------------------------------------------------------------------------------------------

TEST(TokenizerThroughput, GptNeox) {
  // tinyshakespeare when the shared data folder sits beside the repo; else the corpus repeated.
  std::string text, source = "tinyshakespeare";
  try {
    text = read_file(std::string(MIXLENS_SOURCE_DIR) + "/../shared/data/text/tinyshakespeare/input.txt");
  } catch (const std::runtime_error&) {
    source = "corpus x N";
    for (const std::string& s : corpus()) text += s + "\n";
    while (text.size() < (1u << 20)) text += text;
  }
  const Tokenizer& t = get("gpt-neox-20b");
  double best = 1e9;
  size_t n = 0;
  for (int rep = 0; rep < 3; ++rep) {  // the first pass also fills the word cache
    const auto t0 = std::chrono::steady_clock::now();
    n = t.encode(text).size();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::printf("[ throughput ] gpt-neox-20b on %s: %.2f MB in %.3f s = %.1f MB/s (%zu tokens)\n", source.c_str(),
              static_cast<double>(text.size()) / 1e6, best, static_cast<double>(text.size()) / 1e6 / best, n);
  EXPECT_LT(best, 10.0);
}

}  // namespace
