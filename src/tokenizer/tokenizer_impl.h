// Internal pieces of mixlens::Tokenizer (not installed). Each struct mirrors one HF `tokenizers`
// component; the comments name the Rust code whose behaviour it reproduces.
#pragma once
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "mixlens/tokenizer.h"

namespace mixlens::tok {

// ---------------------------------------------------------------------------------------------
// UTF-8
// ---------------------------------------------------------------------------------------------

/// Offset of the first byte that breaks UTF-8 validity, or npos when `s` is valid.
size_t utf8_invalid_at(std::string_view s);
/// Decodes the (valid) character at s[i]; stores its byte length in *len.
uint32_t utf8_decode(std::string_view s, size_t i, size_t* len);
void utf8_append(std::string& out, uint32_t cp);
/// Rust `String::from_utf8_lossy` of `bytes` appended to `out` (U+FFFD per maximal invalid
/// subpart). With `final == false` an incomplete sequence at the end is not replaced but left
/// unconsumed; returns the number of bytes consumed.
size_t utf8_lossy(std::string& out, std::string_view bytes, bool final);
/// Unicode White_Space (what Rust's `char::is_whitespace` and regex `\s` test).
bool is_white_space(uint32_t cp);

// ---------------------------------------------------------------------------------------------
// Regex (PCRE2, UTF + UCP), iterated like the `onig` crate's find_iter that HF uses.
// ---------------------------------------------------------------------------------------------

struct Span {
  size_t begin, end;
};

class Regex {
 public:
  /// Compiles `pattern` (a literal string when `literal`). Throws std::invalid_argument with
  /// PCRE2's message and the offending offset; callers wrap it into a TokenizerError.
  Regex(std::string_view pattern, bool literal);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  /// All matches left to right; an empty match directly after the previous match is skipped.
  void find_all(std::string_view text, std::vector<Span>& out) const;
  /// True when the pattern matches somewhere in `text`.
  bool search(std::string_view text) const;

 private:
  void* code_ = nullptr;  // pcre2_code_8*; kept opaque so pcre2.h stays in one .cpp
  bool jit_ = false;
  int match_at(std::string_view text, size_t start, size_t* ovector) const;
};

// ---------------------------------------------------------------------------------------------
// Normalizer, pre-tokenizer, added vocabulary
// ---------------------------------------------------------------------------------------------

/// HF normalizers: only NFC (and Sequences of it) are supported.
struct Normalizer {
  enum class Kind { NFC };
  std::vector<Kind> steps;
  bool empty() const { return steps.empty(); }
  std::string apply(std::string_view s) const;
};

/// HF SplitDelimiterBehavior.
enum class SplitBehavior { Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous };

struct PreTokStep {
  enum class Kind { ByteLevel, Split };
  Kind kind = Kind::ByteLevel;
  bool add_prefix_space = false;        // ByteLevel
  bool use_regex = true;                // ByteLevel: split with the GPT-2 regex first
  std::shared_ptr<const Regex> regex;   // Split (or the GPT-2 regex for ByteLevel)
  SplitBehavior behavior = SplitBehavior::Isolated;
  bool invert = false;
};

/// HF pre_tokenizers (Sequence flattened): turns one normalized piece into words for BPE.
struct PreTokenizer {
  std::vector<PreTokStep> steps;
  /// Appends the words of `piece` (never empty strings) to `words`.
  void run(std::string_view piece, std::vector<std::string>& words) const;
};

/// Byte <-> printable-character map of GPT-2's byte-level BPE (HF `bytes_char`).
struct ByteLevelMap {
  std::string byte_to_utf8[256];
  int16_t cp_to_byte[512];  // -1 where the code point is not one of the 256 symbols
  ByteLevelMap();
};
const ByteLevelMap& byte_level_map();

struct AddedToken {
  std::string content;
  int32_t id = -1;
  bool special = false, normalized = true, lstrip = false, rstrip = false, single_word = false;
};

/// Leftmost-longest multi-pattern matcher over bytes (the role of daachorse in HF).
class LeftmostLongest {
 public:
  void add(std::string_view pattern, int32_t value);
  bool empty() const { return nodes_.size() <= 1; }
  /// Finds the next match at or after `from`; returns false when none.
  bool next(std::string_view text, size_t from, size_t* begin, size_t* end, int32_t* value) const;

 private:
  struct Node {
    std::vector<std::pair<unsigned char, int32_t>> children;  // sorted by byte
    int32_t value = -1;                                        // index of the token ending here
  };
  std::vector<Node> nodes_{1};
  bool first_byte_[256] = {};
  int32_t child(int32_t node, unsigned char b) const;
};

/// HF AddedVocabulary: added tokens are cut out of the text before the pre-tokenizer runs;
/// the non-normalized ones on the raw text, the normalized ones on the normalized pieces.
struct AddedVocab {
  std::vector<AddedToken> tokens;                       // one per distinct id, JSON order
  std::unordered_map<std::string, int32_t> by_content;  // content -> id
  std::unordered_map<int32_t, size_t> by_id;            // id -> index in tokens
  std::unordered_map<int32_t, std::string> normalized_content;  // HF normalized_cache
  std::unordered_set<std::string> special_contents;
  LeftmostLongest raw_matcher, normalized_matcher;      // values are indices into tokens
  std::shared_ptr<const Regex> word_start, word_end;    // Rust regex ^\w and \w$

  struct Piece {
    Span span;
    int32_t id;  // -1: ordinary text
  };
  /// HF AddedVocabulary::find_matches (single_word, lstrip, rstrip included).
  void split(std::string_view s, const LeftmostLongest& m, std::vector<Piece>& out) const;
};

// ---------------------------------------------------------------------------------------------
// BPE model
// ---------------------------------------------------------------------------------------------

/// HF models::bpe::BPE (without dropout). Words are merged with the same priority queue as
/// HF `Word::merge_all`, so ties and stale entries resolve identically.
struct Bpe {
  std::unordered_map<std::string, int32_t> vocab;
  std::vector<std::string> id_to_token;  // indexed by id; holes are empty with has_token false
  std::vector<bool> has_token;
  std::unordered_map<uint64_t, std::pair<uint32_t, int32_t>> merges;  // (a,b) -> (rank, new id)
  std::optional<int32_t> unk_id;
  bool fuse_unk = false;
  bool byte_fallback = false;
  bool ignore_merges = false;
  std::string continuing_subword_prefix, end_of_word_suffix;
  int32_t byte_fallback_ids[256];  // id of "<0xXX>" or -1

  /// Appends the ids of one pre-tokenized word.
  void tokenize(std::string_view word, std::vector<int32_t>& out) const;

  static uint64_t pair_key(int32_t a, int32_t b) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
  }

 private:
  void merge_word(std::string_view word, std::vector<int32_t>& out) const;
  // Per-word cache shared by all threads (HF keeps one too); bounded so memory stays flat.
  mutable std::mutex cache_mu_;
  mutable std::unordered_map<std::string, std::vector<int32_t>> cache_;
};

// ---------------------------------------------------------------------------------------------
// Post-processor, decoder
// ---------------------------------------------------------------------------------------------

/// Single-sequence template: each item is the sequence itself (is_sequence) or fixed ids.
struct PostStep {
  struct Item {
    bool is_sequence = false;
    std::vector<int32_t> ids;
  };
  std::vector<Item> items;
};

struct Decoder {
  enum class Kind { Join, ByteLevel };  // Join: no decoder, HF joins tokens with " "
  Kind kind = Kind::Join;
};

/// Everything read from one tokenizer.json. Tokenizer::Impl is this; the loader works on it
/// directly because Impl itself is private to Tokenizer.
struct Loaded {
  std::string origin;
  Normalizer normalizer;
  PreTokenizer pre_tokenizer;
  Bpe bpe;
  AddedVocab added;
  std::vector<PostStep> post;  // applied in order when add_special_tokens
  Decoder decoder;
  int32_t vocab_size = 0;
  std::vector<int32_t> special_ids;

  /// The token string HF's decode uses for `id` (added tokens first), or nullptr.
  const std::string* token_of(int32_t id) const;
  bool is_special_content(const std::string& token) const { return added.special_contents.count(token) != 0; }
  /// Bytes the decoder turns `token` into (before the final lossy UTF-8 conversion).
  void token_bytes(const std::string& token, std::string& out) const;
};

}  // namespace mixlens::tok

namespace mixlens {

struct Tokenizer::Impl : tok::Loaded {};

}  // namespace mixlens
