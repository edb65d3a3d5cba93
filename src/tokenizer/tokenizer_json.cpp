// Reading tokenizer.json into Tokenizer::Impl, following HF tokenizers' serde rules (field
// defaults, added-token id assignment, merges formats), and the public Tokenizer API.
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <system_error>

#include "io/json.h"

#include "mixlens/errors.h"
#include "tokenizer/tokenizer_impl.h"

namespace mixlens {

using json = nlohmann::json;
using namespace tok;

namespace {

// HF byte_level.rs: the GPT-2 split regex used by ByteLevel(use_regex=true).
constexpr const char* kGpt2Regex =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// The largest tokenizer.json read (real ones: 2-35 MB).
constexpr uintmax_t kMaxTokenizerBytes = uintmax_t{1} << 30;
// Token ids index flat tables (id -> token): ids far past the number of tokens would make a tiny
// file allocate gigabytes. Real files use dense ids (added tokens right after the vocab).
constexpr int64_t kMaxIdSlack = 1 << 20;

// What LoadSax lifts out of model.vocab / model.merges (see there).
struct BigTables {
  bool vocab = false, merges = false;  // captured (the DOM then holds empty placeholders)
  std::vector<std::pair<std::string, int64_t>> vocab_entries;  // id -1: not an integer in range
  struct MergeEntry {
    std::string a, b;
    bool legacy;  // "a b" string form, kept whole in `a` until validated
  };
  std::vector<MergeEntry> merge_entries;
  std::string error;  // first structural problem, already phrased for the user
};

// SAX handler building the DOM for everything except model.vocab and model.merges, which go
// straight into flat vectors: their 150k-entry DOM would cost most of the load time.
class LoadSax final : public nlohmann::json_sax<json> {
 public:
  json root;
  BigTables tables;
  std::string parse_error_message;

  bool null() override { return value(nullptr); }
  bool boolean(bool v) override { return value(v); }
  bool number_integer(number_integer_t v) override { return integer(v); }
  bool number_unsigned(number_unsigned_t v) override {
    return integer(v > static_cast<number_unsigned_t>(INT32_MAX) ? -1 : static_cast<int64_t>(v));
  }
  bool number_float(number_float_t v, const string_t&) override { return value(v); }
  bool string(string_t& v) override {
    if (mode_ == Mode::Merges) {
      tables.merge_entries.push_back({std::move(v), {}, true});
      return true;
    }
    if (mode_ == Mode::MergePair) {
      pair_.push_back(std::move(v));
      return true;
    }
    return value(std::move(v));
  }
  bool binary(binary_t&) override { return value(nullptr); }
  bool start_object(std::size_t) override {
    if (mode_ == Mode::None && at_model_field("vocab")) {
      place(json::object());
      mode_ = Mode::Vocab;
      tables.vocab = true;
      return true;
    }
    if (mode_ != Mode::None) return bad_in_capture();
    open(json::object());
    return !too_deep_;
  }
  bool key(string_t& k) override {
    if (mode_ == Mode::Vocab) {
      vocab_key_ = std::move(k);
      return true;
    }
    keys_.back() = k;
    element_ = &(*stack_.back())[k];
    return true;
  }
  bool end_object() override {
    if (mode_ == Mode::Vocab) {
      mode_ = Mode::None;
      return true;
    }
    stack_.pop_back();
    keys_.pop_back();
    return true;
  }
  bool start_array(std::size_t) override {
    if (mode_ == Mode::None && at_model_field("merges")) {
      place(json::array());
      mode_ = Mode::Merges;
      tables.merges = true;
      return true;
    }
    if (mode_ == Mode::Merges) {
      mode_ = Mode::MergePair;
      pair_.clear();
      return true;
    }
    if (mode_ != Mode::None) return bad_in_capture();
    open(json::array());
    return !too_deep_;
  }
  bool end_array() override {
    if (mode_ == Mode::MergePair) {
      if (pair_.size() != 2) return bad_in_capture();
      tables.merge_entries.push_back({std::move(pair_[0]), std::move(pair_[1]), false});
      mode_ = Mode::Merges;
      return true;
    }
    if (mode_ == Mode::Merges) {
      mode_ = Mode::None;
      return true;
    }
    stack_.pop_back();
    keys_.pop_back();
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& ex) override {
    parse_error_message = ex.what();
    return false;
  }

 private:
  enum class Mode { None, Vocab, Merges, MergePair };
  Mode mode_ = Mode::None;
  bool too_deep_ = false;
  std::vector<json*> stack_;
  std::vector<std::string> keys_;  // latest key of each open object
  json* element_ = nullptr;        // where the next object member goes
  std::string vocab_key_;
  std::vector<std::string> pair_;

  bool at_model_field(const char* name) const {
    return stack_.size() == 2 && stack_[1]->is_object() && keys_[0] == "model" && keys_[1] == name;
  }
  json* place(json v) {
    if (stack_.empty()) {
      root = std::move(v);
      return &root;
    }
    if (stack_.back()->is_array()) {
      stack_.back()->push_back(std::move(v));
      return &stack_.back()->back();
    }
    *element_ = std::move(v);
    return element_;
  }
  void open(json v) {
    // The parser's walks over normalizers / pre-tokenizers recurse: bound the nesting up front.
    if (stack_.size() >= io::kMaxJsonDepth) {
      tables.error = "JSON nested deeper than " + std::to_string(io::kMaxJsonDepth) + " levels (arrays / objects); refused";
      too_deep_ = true;
      return;
    }
    stack_.push_back(place(std::move(v)));
    keys_.emplace_back();
  }
  template <class V>
  bool value(V&& v) {
    if (mode_ != Mode::None) return bad_in_capture();
    place(json(std::forward<V>(v)));
    return true;
  }
  bool integer(int64_t v) {
    if (mode_ == Mode::Vocab) {
      tables.vocab_entries.emplace_back(std::move(vocab_key_), v < 0 || v > INT32_MAX ? -1 : v);
      return true;
    }
    return value(v);
  }
  bool bad_in_capture() {
    if (mode_ == Mode::Vocab) {
      tables.error = "model.vocab['" + vocab_key_ + "']: token id must be an integer in [0, 2^31)";
    } else {
      tables.error = "model.merges[" + std::to_string(tables.merge_entries.size()) +
                     "]: a merge must be \"a b\" or [\"a\", \"b\"]";
    }
    return false;  // stops the parse; from_json reports tables.error
  }
};

class Parser {
 public:
  Parser(std::string origin, BigTables& tables) : origin_(std::move(origin)), tables_(tables) {}

  [[noreturn]] void fail(const std::string& where, const std::string& what) const {
    throw TokenizerError(origin_ + ": " + (where.empty() ? "" : where + ": ") + what);
  }

  const json* find(const json& obj, const char* key) const {
    auto it = obj.find(key);
    return it == obj.end() ? nullptr : &*it;
  }
  const json& require(const json& obj, const char* key, const std::string& where) const {
    const json* v = find(obj, key);
    if (!v) fail(where, std::string("missing field '") + key + "'");
    return *v;
  }
  std::string str(const json& obj, const char* key, const std::string& where) const {
    const json& v = require(obj, key, where);
    if (!v.is_string()) fail(where, std::string("field '") + key + "' must be a string");
    return v.get<std::string>();
  }
  bool flag(const json& obj, const char* key, bool dflt, const std::string& where) const {
    const json* v = find(obj, key);
    if (!v || v->is_null()) return dflt;
    if (!v->is_boolean()) fail(where, std::string("field '") + key + "' must be true or false");
    return v->get<bool>();
  }
  int32_t id(const json& v, const std::string& where) const {
    if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > INT32_MAX)
      fail(where, "token id must be an integer in [0, 2^31)");
    return static_cast<int32_t>(v.get<int64_t>());
  }
  std::string type_of(const json& obj, const std::string& where) const {
    if (!obj.is_object()) fail(where, "must be an object or null");
    return str(obj, "type", where);
  }

  std::shared_ptr<const Regex> regex(const std::string& pattern, bool literal, const std::string& where) const {
    try {
      return std::make_shared<const Regex>(pattern, literal);
    } catch (const std::invalid_argument& e) {
      fail(where, "bad regex '" + pattern + "': " + e.what());
    }
  }

  void normalizer(const json& j, Normalizer& out, const std::string& where) const {
    if (j.is_null()) return;
    const std::string t = type_of(j, where);
    if (t == "NFC") {
      out.steps.push_back(Normalizer::Kind::NFC);
    } else if (t == "Sequence") {
      const json& list = require(j, "normalizers", where);
      if (!list.is_array()) fail(where, "'normalizers' must be a list");
      for (size_t i = 0; i < list.size(); ++i) normalizer(list[i], out, where + "[" + std::to_string(i) + "]");
    } else {
      fail(where, "normalizer type '" + t + "' is not supported (mixlens supports NFC and Sequence)");
    }
  }

  void pre_tokenizer(const json& j, PreTokenizer& out, const std::string& where) const {
    if (j.is_null()) return;
    const std::string t = type_of(j, where);
    if (t == "ByteLevel") {
      PreTokStep st;
      st.kind = PreTokStep::Kind::ByteLevel;
      st.add_prefix_space = flag(j, "add_prefix_space", true, where);
      st.use_regex = flag(j, "use_regex", true, where);
      if (st.use_regex) st.regex = regex(kGpt2Regex, false, where);
      out.steps.push_back(std::move(st));
    } else if (t == "Split") {
      PreTokStep st;
      st.kind = PreTokStep::Kind::Split;
      const json& pat = require(j, "pattern", where);
      if (pat.is_object() && pat.contains("Regex") && pat["Regex"].is_string()) {
        st.regex = regex(pat["Regex"].get<std::string>(), false, where + ".pattern");
      } else if (pat.is_object() && pat.contains("String") && pat["String"].is_string()) {
        st.regex = regex(pat["String"].get<std::string>(), true, where + ".pattern");
      } else {
        fail(where, "'pattern' must be {\"Regex\": ...} or {\"String\": ...}");
      }
      const std::string b = str(j, "behavior", where);
      if (b == "Removed") st.behavior = SplitBehavior::Removed;
      else if (b == "Isolated") st.behavior = SplitBehavior::Isolated;
      else if (b == "MergedWithPrevious") st.behavior = SplitBehavior::MergedWithPrevious;
      else if (b == "MergedWithNext") st.behavior = SplitBehavior::MergedWithNext;
      else if (b == "Contiguous") st.behavior = SplitBehavior::Contiguous;
      else fail(where, "unknown split behavior '" + b + "'");
      st.invert = flag(j, "invert", false, where);
      out.steps.push_back(std::move(st));
    } else if (t == "Sequence") {
      const json& list = require(j, "pretokenizers", where);
      if (!list.is_array()) fail(where, "'pretokenizers' must be a list");
      for (size_t i = 0; i < list.size(); ++i) pre_tokenizer(list[i], out, where + "[" + std::to_string(i) + "]");
    } else {
      fail(where, "pre_tokenizer type '" + t +
                      "' is not supported (mixlens supports ByteLevel, Split and Sequence)");
    }
  }

  void model(const json& j, Bpe& bpe) const {
    const std::string where = "model";
    if (!j.is_object()) fail(where, "must be an object");
    // HF accepts an untagged model; one with merges is a BPE.
    if (!j.contains("type") && !j.contains("merges"))
      fail(where, "has neither 'type' nor 'merges' (mixlens supports byte-level BPE)");
    const std::string t = j.contains("type") ? str(j, "type", where) : "BPE";
    if (t != "BPE") {
      throw TokenizerError(origin_ + ": tokenizer.json model type '" + t +
                           "' is not supported (mixlens supports byte-level BPE)");
    }
    if (const json* d = find(j, "dropout"); d && !d->is_null()) {
      if (!d->is_number() || d->get<double>() < 0.0 || d->get<double>() > 1.0) fail(where, "dropout must be in [0, 1]");
      if (d->get<double>() > 0.0) fail(where, "BPE dropout is not supported (it makes encoding random)");
    }
    if (const json* u = find(j, "unk_token"); u && !u->is_null()) {
      if (!u->is_string()) fail(where, "'unk_token' must be a string or null");
      unk_token_ = u->get<std::string>();
    }
    auto opt_str = [&](const char* key) {
      const json* v = find(j, key);
      if (!v || v->is_null()) return std::string();
      if (!v->is_string()) fail(where, std::string("'") + key + "' must be a string or null");
      return v->get<std::string>();
    };
    bpe.continuing_subword_prefix = opt_str("continuing_subword_prefix");
    bpe.end_of_word_suffix = opt_str("end_of_word_suffix");
    bpe.fuse_unk = flag(j, "fuse_unk", false, where);
    bpe.byte_fallback = flag(j, "byte_fallback", false, where);
    bpe.ignore_merges = flag(j, "ignore_merges", false, where);

    const json* vocab = find(j, "vocab");
    const json* merges = find(j, "merges");
    if (!vocab || !merges) fail(where, "missing vocab/merges");
    if (!tables_.vocab) {
      if (!vocab->is_object()) fail("model.vocab", "must be an object {token: id}");
      for (auto it = vocab->begin(); it != vocab->end(); ++it) {
        const json& v = it.value();
        const bool ok = v.is_number_integer() && v.get<int64_t>() >= 0 && v.get<int64_t>() <= INT32_MAX;
        tables_.vocab_entries.emplace_back(it.key(), ok ? v.get<int64_t>() : -1);
      }
    }
    if (!tables_.merges) {
      if (!merges->is_array()) fail("model.merges", "must be a list");
      for (size_t i = 0; i < merges->size(); ++i) {
        const json& m = (*merges)[i];
        if (m.is_string()) {
          tables_.merge_entries.push_back({m.get<std::string>(), {}, true});
        } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
          tables_.merge_entries.push_back({m[0].get<std::string>(), m[1].get<std::string>(), false});
        } else {
          fail("model.merges[" + std::to_string(i) + "]", "a merge must be \"a b\" or [\"a\", \"b\"]");
        }
      }
    }

    int32_t max_id = -1;
    bpe.vocab.reserve(tables_.vocab_entries.size());
    for (auto& [tok, v] : tables_.vocab_entries) {
      if (v < 0) fail("model.vocab['" + tok + "']", "token id must be an integer in [0, 2^31)");
      max_id = std::max(max_id, static_cast<int32_t>(v));
      bpe.vocab[std::move(tok)] = static_cast<int32_t>(v);  // a repeated key keeps its last id
    }
    if (static_cast<int64_t>(max_id) >= static_cast<int64_t>(bpe.vocab.size()) + kMaxIdSlack)
      fail("model.vocab", "token id " + std::to_string(max_id) + " is far past the " + std::to_string(bpe.vocab.size()) +
                              " tokens defined (ids must stay below token count + " + std::to_string(kMaxIdSlack) +
                              "; the id -> token table would be huge)");
    bpe.id_to_token.assign(static_cast<size_t>(max_id + 1), std::string());
    bpe.has_token.assign(static_cast<size_t>(max_id + 1), false);
    for (const auto& [tok, v] : bpe.vocab) {
      bpe.id_to_token[static_cast<size_t>(v)] = tok;
      bpe.has_token[static_cast<size_t>(v)] = true;
    }
    if (unk_token_) {
      auto it = bpe.vocab.find(*unk_token_);
      if (it == bpe.vocab.end()) fail(where, "unk_token '" + *unk_token_ + "' is not in the vocab");
      bpe.unk_id = it->second;
    }
    for (int b = 0; b < 256; ++b) {
      char name[8];
      std::snprintf(name, sizeof name, "<0x%02X>", b);
      auto it = bpe.vocab.find(name);
      bpe.byte_fallback_ids[b] = it == bpe.vocab.end() ? -1 : it->second;
    }

    // Merges: "a b" strings (split on ' ', exactly two parts) or [a, b] pairs. Later duplicates
    // overwrite earlier ones, as HF's HashMap collect does.
    bpe.merges.reserve(tables_.merge_entries.size());
    uint32_t rank = 0;
    std::string merged;
    for (size_t i = 0; i < tables_.merge_entries.size(); ++i) {
      BigTables::MergeEntry& m = tables_.merge_entries[i];
      auto mw = [i] { return "model.merges[" + std::to_string(i) + "]"; };
      if (m.legacy) {
        if (m.a.rfind("#version", 0) == 0) continue;
        const size_t sp = m.a.find(' ');
        if (sp == std::string::npos || m.a.find(' ', sp + 1) != std::string::npos)
          fail(mw(), "merge '" + m.a + "' must be two tokens separated by one space");
        m.b = m.a.substr(sp + 1);
        m.a.resize(sp);
      }
      auto ia = bpe.vocab.find(m.a), ib = bpe.vocab.find(m.b);
      if (ia == bpe.vocab.end())
        fail(mw(), "merge ('" + m.a + "', '" + m.b + "') uses token '" + m.a + "' which is not in the vocab");
      if (ib == bpe.vocab.end())
        fail(mw(), "merge ('" + m.a + "', '" + m.b + "') uses token '" + m.b + "' which is not in the vocab");
      merged = m.a;
      merged.append(m.b, std::min(bpe.continuing_subword_prefix.size(), m.b.size()), std::string::npos);
      auto im = bpe.vocab.find(merged);
      if (im == bpe.vocab.end())
        fail(mw(), "merge ('" + m.a + "', '" + m.b + "') produces '" + merged + "' which is not in the vocab");
      bpe.merges[Bpe::pair_key(ia->second, ib->second)] = {rank, im->second};
      ++rank;
    }
  }

  // HF AddedVocabulary::add_tokens as called by the tokenizer.json deserializer: ids come from
  // the vocab when the content is there, else they continue after the model vocab size.
  void added_tokens(const json* list, Loaded& impl) const {
    AddedVocab& av = impl.added;
    if (!list || list->is_null()) return;
    if (!list->is_array()) fail("added_tokens", "must be a list");
    auto next_id = static_cast<int32_t>(impl.bpe.vocab.size());
    for (size_t i = 0; i < list->size(); ++i) {
      const json& e = (*list)[i];
      const std::string where = "added_tokens[" + std::to_string(i) + "]";
      if (!e.is_object()) fail(where, "must be an object");
      AddedToken t;
      t.content = str(e, "content", where);
      (void)id(require(e, "id", where), where + ".id");
      t.special = flag(e, "special", false, where);
      t.normalized = flag(e, "normalized", !t.special, where);
      t.lstrip = flag(e, "lstrip", false, where);
      t.rstrip = flag(e, "rstrip", false, where);
      t.single_word = flag(e, "single_word", false, where);
      if (t.content.empty()) continue;
      auto known = av.by_content.find(t.content);
      if (known != av.by_content.end()) {
        t.id = known->second;
      } else if (auto v = impl.bpe.vocab.find(t.content); v != impl.bpe.vocab.end()) {
        t.id = v->second;
      } else {
        t.id = next_id++;
      }
      if (t.normalized && !impl.normalizer.empty()) {
        std::string n = impl.normalizer.apply(t.content);
        if (n != t.content) av.normalized_content[t.id] = n;
      }
      av.by_content[t.content] = t.id;
      if (t.special) av.special_contents.insert(t.content);
      auto slot = av.by_id.find(t.id);
      if (slot != av.by_id.end()) {
        av.tokens[slot->second] = t;
      } else {
        av.by_id[t.id] = av.tokens.size();
        av.tokens.push_back(t);
      }
    }
    for (size_t k = 0; k < av.tokens.size(); ++k) {
      const AddedToken& t = av.tokens[k];
      if (t.normalized) {
        auto n = av.normalized_content.find(t.id);
        av.normalized_matcher.add(n == av.normalized_content.end() ? t.content : n->second, static_cast<int32_t>(k));
      } else {
        av.raw_matcher.add(t.content, static_cast<int32_t>(k));
      }
      if (t.single_word && !av.word_start) {
        // Rust regex's Unicode \w, used by HF for single_word boundaries.
        const std::string w = R"([\p{Alphabetic}\p{M}\p{Nd}\p{Pc}\p{Join_Control}])";
        av.word_start = regex("^" + w, false, "added_tokens");
        av.word_end = regex(w + "$", false, "added_tokens");
      }
    }
  }

  std::vector<int32_t> special_ids(const json& v, const std::string& where) const {
    // Bert/Roberta processors give [token, id]; HF uses the id as written.
    if (!v.is_array() || v.size() != 2 || !v[0].is_string()) fail(where, "must be [token, id]");
    return {id(v[1], where)};
  }

  void post_processor(const json& j, Loaded& impl, const std::string& where) const {
    if (j.is_null()) return;
    const std::string t = type_of(j, where);
    if (t == "ByteLevel") return;  // only adjusts offsets
    if (t == "Sequence") {
      const json& list = require(j, "processors", where);
      if (!list.is_array()) fail(where, "'processors' must be a list");
      for (size_t i = 0; i < list.size(); ++i) post_processor(list[i], impl, where + "[" + std::to_string(i) + "]");
      return;
    }
    PostStep st;
    if (t == "BertProcessing" || t == "RobertaProcessing") {
      st.items.push_back({false, special_ids(require(j, "cls", where), where + ".cls")});
      st.items.push_back({true, {}});
      st.items.push_back({false, special_ids(require(j, "sep", where), where + ".sep")});
    } else if (t == "TemplateProcessing") {
      const json& single = require(j, "single", where);
      const json* specials = find(j, "special_tokens");
      if (!single.is_array()) fail(where, "'single' must be a list");
      for (size_t i = 0; i < single.size(); ++i) {
        const json& piece = single[i];
        const std::string pw = where + ".single[" + std::to_string(i) + "]";
        if (piece.is_object() && piece.contains("Sequence")) {
          st.items.push_back({true, {}});
        } else if (piece.is_object() && piece.contains("SpecialToken") && piece["SpecialToken"].is_object()) {
          const std::string name = str(piece["SpecialToken"], "id", pw);
          if (!specials || !specials->is_object() || !specials->contains(name))
            fail(pw, "special token '" + name + "' is not listed in special_tokens");
          const json& ids = require((*specials)[name], "ids", where + ".special_tokens['" + name + "']");
          if (!ids.is_array()) fail(where + ".special_tokens['" + name + "']", "'ids' must be a list");
          PostStep::Item item;
          for (const json& x : ids) item.ids.push_back(id(x, where + ".special_tokens['" + name + "']"));
          st.items.push_back(std::move(item));
        } else {
          fail(pw, "template piece must be {\"Sequence\": ...} or {\"SpecialToken\": ...}");
        }
      }
    } else {
      fail(where, "post_processor type '" + t +
                      "' is not supported (mixlens supports ByteLevel, TemplateProcessing, BertProcessing, "
                      "RobertaProcessing and Sequence)");
    }
    impl.post.push_back(std::move(st));
  }

  void decoder(const json& j, Decoder& out, const std::string& where) const {
    if (j.is_null()) return;
    const std::string t = type_of(j, where);
    if (t == "ByteLevel") {
      out.kind = Decoder::Kind::ByteLevel;
    } else if (t == "Sequence") {
      const json& list = require(j, "decoders", where);
      if (!list.is_array()) fail(where, "'decoders' must be a list");
      // A second ByteLevel pass would re-map the first one's output, so only a one-step
      // Sequence (what converters emit around ByteLevel) is accepted.
      if (list.size() != 1) fail(where, "a decoder Sequence must hold exactly one ByteLevel decoder");
      decoder(list[0], out, where + "[0]");
    } else {
      fail(where, "decoder type '" + t + "' is not supported (mixlens supports ByteLevel)");
    }
  }

 private:
  std::string origin_;
  BigTables& tables_;
  mutable std::optional<std::string> unk_token_;
};

}  // namespace

// ---------------------------------------------------------------------------------------------
// Loading
// ---------------------------------------------------------------------------------------------

Tokenizer::Tokenizer(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}

Tokenizer Tokenizer::from_file(const std::string& path) {
  std::error_code ec;
  // A FIFO would block forever and a device such as /dev/zero would read until memory runs out.
  if (std::filesystem::exists(path, ec) && !std::filesystem::is_regular_file(path, ec))
    throw TokenizerError(path + ": tokenizer.json is not a regular file (a FIFO, device, socket or folder); refused");
  const uintmax_t size = std::filesystem::file_size(path, ec);
  if (!ec && size > kMaxTokenizerBytes)
    throw TokenizerError(path + ": tokenizer.json is " + std::to_string(size) + " bytes, over the " +
                         std::to_string(kMaxTokenizerBytes) + "-byte limit");
  std::ifstream f(path, std::ios::binary);
  if (!f) throw TokenizerError(path + ": cannot open tokenizer.json");
  std::ostringstream ss;
  ss << f.rdbuf();
  if (f.bad()) throw TokenizerError(path + ": error reading tokenizer.json");
  return from_json(ss.str(), path);
}

Tokenizer Tokenizer::from_json(std::string_view json_text, std::string_view origin) {
  LoadSax sax;
  Parser p{std::string(origin), sax.tables};
  const bool ok = json::sax_parse(json_text.begin(), json_text.end(), &sax, nlohmann::detail::input_format_t::json,
                                  /*strict=*/true);
  if (!ok) {
    if (!sax.tables.error.empty()) p.fail("", sax.tables.error);
    p.fail("", "not valid JSON: " + sax.parse_error_message);
  }
  const json& root = sax.root;
  if (!root.is_object()) p.fail("", "top level must be a JSON object");
  if (const json* v = p.find(root, "version"); v && !(v->is_string() && v->get<std::string>() == "1.0"))
    p.fail("version", "unknown tokenizer.json version " + v->dump() + " (expected \"1.0\")");

  auto impl = std::make_shared<Impl>();
  impl->origin = std::string(origin);
  try {
    const json& model = p.require(root, "model", "");
    p.model(model, impl->bpe);
    if (const json* n = p.find(root, "normalizer")) p.normalizer(*n, impl->normalizer, "normalizer");
    if (const json* t = p.find(root, "pre_tokenizer")) p.pre_tokenizer(*t, impl->pre_tokenizer, "pre_tokenizer");
    p.added_tokens(p.find(root, "added_tokens"), *impl);
    if (const json* pp = p.find(root, "post_processor")) p.post_processor(*pp, *impl, "post_processor");
    if (const json* d = p.find(root, "decoder")) p.decoder(*d, impl->decoder, "decoder");
  } catch (const json::exception& e) {
    // A field of an unexpected JSON type that the checks above did not anticipate.
    p.fail("", std::string("malformed tokenizer.json: ") + e.what());
  }

  int32_t max_id = static_cast<int32_t>(impl->bpe.id_to_token.size()) - 1;
  for (const AddedToken& t : impl->added.tokens) {
    max_id = std::max(max_id, t.id);
    if (t.special) impl->special_ids.push_back(t.id);
  }
  const int64_t defined = static_cast<int64_t>(impl->bpe.vocab.size() + impl->added.tokens.size());
  if (static_cast<int64_t>(max_id) >= defined + kMaxIdSlack)
    p.fail("added_tokens", "token id " + std::to_string(max_id) + " is far past the " + std::to_string(defined) +
                               " tokens defined (ids must stay below token count + " + std::to_string(kMaxIdSlack) + ")");
  std::sort(impl->special_ids.begin(), impl->special_ids.end());
  impl->special_ids.erase(std::unique(impl->special_ids.begin(), impl->special_ids.end()), impl->special_ids.end());
  impl->vocab_size = max_id + 1;
  // HF would emit such ids unchecked; they would index past the model's embedding.
  for (const PostStep& st : impl->post)
    for (const PostStep::Item& it : st.items)
      for (int32_t x : it.ids)
        if (!impl->token_of(x)) p.fail("post_processor", "special token id " + std::to_string(x) + " has no token");
  return Tokenizer(std::move(impl));
}

// ---------------------------------------------------------------------------------------------
// Encoding (HF TokenizerImpl::encode_single_sequence + post_process)
// ---------------------------------------------------------------------------------------------

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_special_tokens) const {
  const Impl& im = *impl_;
  if (const size_t bad = utf8_invalid_at(text); bad != std::string_view::npos)
    throw InputError("Tokenizer::encode: text is not valid UTF-8 (byte offset " + std::to_string(bad) + ")");

  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 4);
  std::vector<AddedVocab::Piece> raw, norm;
  std::vector<std::string> words;
  im.added.split(text, im.added.raw_matcher, raw);
  for (const AddedVocab::Piece& rp : raw) {
    if (rp.id >= 0) {
      ids.push_back(rp.id);
      continue;
    }
    if (rp.span.end <= rp.span.begin) continue;
    const std::string normalized = im.normalizer.apply(text.substr(rp.span.begin, rp.span.end - rp.span.begin));
    norm.clear();
    im.added.split(normalized, im.added.normalized_matcher, norm);
    for (const AddedVocab::Piece& np : norm) {
      if (np.id >= 0) {
        ids.push_back(np.id);
        continue;
      }
      if (np.span.end <= np.span.begin) continue;
      words.clear();
      im.pre_tokenizer.run(std::string_view(normalized).substr(np.span.begin, np.span.end - np.span.begin), words);
      for (const std::string& w : words) im.bpe.tokenize(w, ids);
    }
  }

  if (add_special_tokens) {
    for (const PostStep& st : im.post) {
      std::vector<int32_t> out;
      for (const PostStep::Item& it : st.items) {
        if (it.is_sequence) out.insert(out.end(), ids.begin(), ids.end());
        else out.insert(out.end(), it.ids.begin(), it.ids.end());
      }
      ids = std::move(out);
    }
  }
  return ids;
}

// ---------------------------------------------------------------------------------------------
// Vocabulary access
// ---------------------------------------------------------------------------------------------

const std::string* Loaded::token_of(int32_t id) const {
  if (id < 0) return nullptr;
  if (auto it = added.by_id.find(id); it != added.by_id.end()) {
    // HF simple_id_to_token: the normalized form of a normalized added token.
    if (auto n = added.normalized_content.find(id); n != added.normalized_content.end()) return &n->second;
    return &added.tokens[it->second].content;
  }
  const auto u = static_cast<size_t>(id);
  if (u < bpe.has_token.size() && bpe.has_token[u]) return &bpe.id_to_token[u];
  return nullptr;
}

std::optional<int32_t> Tokenizer::token_to_id(std::string_view token) const {
  const std::string key(token);
  if (auto it = impl_->added.by_content.find(key); it != impl_->added.by_content.end()) return it->second;
  if (auto it = impl_->bpe.vocab.find(key); it != impl_->bpe.vocab.end()) return it->second;
  return std::nullopt;
}

std::string Tokenizer::id_to_token(int32_t id) const {
  if (id < 0 || id >= impl_->vocab_size)
    throw InputError("token id " + std::to_string(id) + " is out of range [0, " + std::to_string(impl_->vocab_size) + ")");
  const std::string* t = impl_->token_of(id);
  if (!t) throw InputError("token id " + std::to_string(id) + " has no token in " + impl_->origin);
  return *t;
}

int32_t Tokenizer::vocab_size() const { return impl_->vocab_size; }

std::vector<int32_t> Tokenizer::special_ids() const { return impl_->special_ids; }

}  // namespace mixlens
