// Byte-level BPE tokenizer read from a HuggingFace `tokenizer.json`.
//
// Behaviour matches HF `tokenizers` (the Rust library behind transformers' fast tokenizers):
//   encode(text)  == tokenizers.Tokenizer.encode(text).ids            (add_special_tokens=True)
//   decode(ids)   == tokenizers.Tokenizer.decode(ids, skip_special_tokens)
//   token_to_id   == tokenizers.Tokenizer.token_to_id
//   id_to_token   == tokenizers.Tokenizer.id_to_token (but throws instead of returning None)
// Nothing is hard-coded per model: vocab, merges, added tokens, split regexes and flags all come
// from the file.
//
// Supported tokenizer.json components (anything else raises TokenizerError naming it):
//   normalizer      null | NFC | Sequence of those
//   pre_tokenizer   null | ByteLevel (add_prefix_space, use_regex: the GPT-2 regex) |
//                   Split (Regex or String pattern; every behavior; invert) | Sequence of those
//   model           BPE (merges as "a b" strings or [a, b] pairs; ignore_merges; unk_token/fuse_unk;
//                   byte_fallback; continuing_subword_prefix / end_of_word_suffix; no dropout)
//   added_tokens    special and non-special, with normalized / lstrip / rstrip / single_word, split
//                   out before pre-tokenization (leftmost-longest), exactly as HF AddedVocabulary
//   post_processor  null | ByteLevel | TemplateProcessing (single) | BertProcessing |
//                   RobertaProcessing | Sequence of those
//   decoder         null (tokens joined by " ") | ByteLevel | Sequence of ByteLevel
// `truncation` and `padding` sections are ignored (transformers disables them for plain encodes).
// Regexes run on PCRE2 (UTF + UCP) where HF uses Oniguruma. Shorthands whose meaning differs are
// rewritten to Oniguruma's (`\s` = White_Space, `\w`, `\h`), so the engines agree on every
// pattern in the tested tokenizers. Known gap: Oniguruma's case-insensitive groups also fold one
// character onto several (`(?i:ss)` matches "ẞ", `(?i:st)` matches "ﬆ"); PCRE2 does not. The
// contraction groups `(?i:'s|'t|'re|'ve|'m|'ll|'d)` of GPT-2/Qwen regexes are unaffected.
//
// Thread safety: all const member functions may be called concurrently. Copies share the loaded
// tables (cheap to copy).
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace mixlens {

class Tokenizer {
  struct Impl;  // the loaded tables (src/tokenizer/tokenizer_impl.h)

 public:
  /// Loads a tokenizer.json. Throws TokenizerError when the file is missing or unreadable, is not
  /// JSON, lacks a required field, uses an unsupported component / model type, has a bad regex, or
  /// has merges naming tokens absent from the vocab. The message names the file and the field.
  static Tokenizer from_file(const std::string& tokenizer_json_path);
  /// Same as from_file, for tokenizer.json text already in memory; `origin` names it in errors.
  static Tokenizer from_json(std::string_view json_text, std::string_view origin = "<memory>");

  /// Token ids of `text` (UTF-8). Matches HF `Tokenizer.encode(text, add_special_tokens).ids`:
  /// added tokens split out, NFC etc., pre-tokenized, BPE, then the post_processor's template when
  /// add_special_tokens. Throws InputError if `text` is not valid UTF-8 (Python strings always are).
  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens = true) const;

  /// Text of `ids`. Matches HF `Tokenizer.decode(ids, skip_special_tokens)`: ids with no token
  /// (e.g. the padded embedding rows past the vocab) are dropped, like HF; byte sequences that are
  /// not valid UTF-8 become U+FFFD (Rust from_utf8_lossy: one per maximal invalid subpart).
  std::string decode(const std::vector<int32_t>& ids, bool skip_special_tokens = false) const;

  /// Incremental decoding for generation, as HF tokenizers' DecodeStream.step: push() returns the
  /// text of the tokens since the last non-empty return, or "" while that text would end in U+FFFD
  /// (a multi-byte character split across tokens, held back until its last byte arrives; an invalid
  /// byte, until a later token follows it). So a piece never splits a character, and the
  /// concatenation of every push() and the final flush() equals decode(all ids).
  /// The decoder keeps the tokenizer's tables alive, so it may outlive the Tokenizer object.
  class StreamDecoder {
   public:
    explicit StreamDecoder(const Tokenizer& tokenizer, bool skip_special_tokens = false);
    /// Unknown ids decode to nothing, as in decode().
    std::string push(int32_t id);
    /// Several ids as one step (HF DecodeStream.step with a list): the text of all of them, or ""
    /// while it would end in U+FFFD (then all of it is held back).
    std::string push(const std::vector<int32_t>& ids);
    /// Emits what is held back (an incomplete character becomes U+FFFD) and resets the stream.
    std::string flush();

   private:
    std::shared_ptr<const Impl> impl_;
    bool skip_special_;
    bool any_token_ = false;  // a null decoder joins tokens with " "; needs to know the first
    std::string pending_;     // bytes not yet emitted: an incomplete UTF-8 sequence
  };

  /// HF `Tokenizer.token_to_id`: added tokens first, then the model vocab.
  std::optional<int32_t> token_to_id(std::string_view token) const;
  /// HF `Tokenizer.id_to_token`: the token string with byte-level symbols like "Ġ" (for an added
  /// token with normalized=true, its normalized form, as HF).
  /// Throws InputError for an id that is negative, >= vocab_size(), or has no token.
  std::string id_to_token(int32_t id) const;
  /// Highest assigned id + 1, added tokens included (the model's embedding may be larger).
  int32_t vocab_size() const;
  /// Ids of the added tokens marked special, ascending (what skip_special_tokens removes).
  std::vector<int32_t> special_ids() const;

 private:
  explicit Tokenizer(std::shared_ptr<const Impl> impl);
  std::shared_ptr<const Impl> impl_;
};

}  // namespace mixlens
