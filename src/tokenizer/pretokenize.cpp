// Text handling before BPE: UTF-8 helpers, the PCRE2 regex wrapper, NFC, the pre-tokenizers and
// the added-token splitter. Each reproduces the HF `tokenizers` code named in tokenizer_impl.h.
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <utf8proc.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <stdexcept>

#include "mixlens/errors.h"
#include "tokenizer/tokenizer_impl.h"

namespace mixlens::tok {

// ---------------------------------------------------------------------------------------------
// UTF-8
// ---------------------------------------------------------------------------------------------

namespace {

// Length of the longest prefix of s[i..] that is a valid start of a UTF-8 sequence, and whether
// that prefix is a complete character. Bounds follow the Unicode "maximal subpart" rules that
// Rust's from_utf8_lossy uses.
struct Utf8Step {
  size_t len;     // bytes examined that belong to this (possibly partial) sequence, >= 1
  bool complete;  // a whole valid character
  bool truncated; // a valid prefix cut short by the end of the input
};

Utf8Step utf8_step(std::string_view s, size_t i) {
  const auto b0 = static_cast<unsigned char>(s[i]);
  if (b0 < 0x80) return {1, true, false};
  size_t need;
  unsigned char lo = 0x80, hi = 0xBF;
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    need = 1;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    need = 2;
    if (b0 == 0xE0) lo = 0xA0;
    if (b0 == 0xED) hi = 0x9F;
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    need = 3;
    if (b0 == 0xF0) lo = 0x90;
    if (b0 == 0xF4) hi = 0x8F;
  } else {
    return {1, false, false};
  }
  size_t k = 1;
  for (; k <= need; ++k) {
    if (i + k >= s.size()) return {k, false, true};
    const auto b = static_cast<unsigned char>(s[i + k]);
    const unsigned char l = (k == 1) ? lo : 0x80, h = (k == 1) ? hi : 0xBF;
    if (b < l || b > h) return {k, false, false};
  }
  return {need + 1, true, false};
}

}  // namespace

size_t utf8_invalid_at(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    if (static_cast<unsigned char>(s[i]) < 0x80) {
      ++i;
      continue;
    }
    const Utf8Step st = utf8_step(s, i);
    if (!st.complete) return i;
    i += st.len;
  }
  return std::string_view::npos;
}

uint32_t utf8_decode(std::string_view s, size_t i, size_t* len) {
  const auto b0 = static_cast<unsigned char>(s[i]);
  auto cont = [&](size_t k) { return static_cast<uint32_t>(static_cast<unsigned char>(s[i + k]) & 0x3F); };
  if (b0 < 0x80) {
    *len = 1;
    return b0;
  }
  if (b0 < 0xE0) {
    *len = 2;
    return (static_cast<uint32_t>(b0 & 0x1F) << 6) | cont(1);
  }
  if (b0 < 0xF0) {
    *len = 3;
    return (static_cast<uint32_t>(b0 & 0x0F) << 12) | (cont(1) << 6) | cont(2);
  }
  *len = 4;
  return (static_cast<uint32_t>(b0 & 0x07) << 18) | (cont(1) << 12) | (cont(2) << 6) | cont(3);
}

void utf8_append(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

size_t utf8_lossy(std::string& out, std::string_view bytes, bool final) {
  static constexpr char kReplacement[] = "\xEF\xBF\xBD";
  size_t i = 0, run = 0;  // [run, i) is valid text not yet copied
  while (i < bytes.size()) {
    if (static_cast<unsigned char>(bytes[i]) < 0x80) {
      ++i;
      continue;
    }
    const Utf8Step st = utf8_step(bytes, i);
    if (st.complete) {
      i += st.len;
      continue;
    }
    out.append(bytes.data() + run, i - run);
    if (st.truncated && !final) return i;  // hold the incomplete tail back
    out += kReplacement;
    i += st.len;
    run = i;
  }
  out.append(bytes.data() + run, i - run);
  return i;
}

bool is_white_space(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F ||
         cp == 0x205F || cp == 0x3000;
}

// ---------------------------------------------------------------------------------------------
// Regex
// ---------------------------------------------------------------------------------------------

namespace {

// One match-data block (overall match only) and one JIT stack per thread serve every pattern.
struct MatchScratch {
  pcre2_match_data* md = nullptr;
  pcre2_match_context* mc = nullptr;
  pcre2_jit_stack* js = nullptr;
  MatchScratch() {
    md = pcre2_match_data_create(1, nullptr);
    mc = pcre2_match_context_create(nullptr);
    // The default 32 KiB JIT stack can run out on very long runs of one character class.
    js = pcre2_jit_stack_create(64 * 1024, 64 * 1024 * 1024, nullptr);
    if (mc && js) pcre2_jit_stack_assign(mc, nullptr, js);
    // Patterns like \s*[\r\n]+ backtrack once per character of a long whitespace run; PCRE2's
    // default limit (10M steps) would reject inputs that Oniguruma handles in linear time.
    if (mc) pcre2_set_match_limit(mc, UINT32_MAX);
  }
  ~MatchScratch() {
    pcre2_jit_stack_free(js);
    pcre2_match_context_free(mc);
    pcre2_match_data_free(md);
  }
};

MatchScratch& scratch() {
  thread_local MatchScratch s;
  if (!s.md || !s.mc) throw Error("tokenizer: out of memory creating PCRE2 match data");
  return s;
}

// HF compiles split patterns with Oniguruma. Where its shorthand classes differ from PCRE2's in
// UCP mode they are spelled out: \s is Unicode White_Space (PCRE2 adds U+180E), \w is
// Alphabetic+M+Nd+Pc+Join_Control (PCRE2: L+N+_), \h is a hex digit (PCRE2: horizontal space).
// \W inside a [...] class has no PCRE2 spelling and keeps PCRE2's meaning.
std::string onig_compatible(std::string_view p) {
  static constexpr const char* kWord = "\\p{Alphabetic}\\p{M}\\p{Nd}\\p{Pc}\\p{Join_Control}";
  std::string out;
  out.reserve(p.size() + 32);
  bool in_class = false;
  for (size_t i = 0; i < p.size(); ++i) {
    const char c = p[i];
    if (c == '\\' && i + 1 < p.size() && p[i + 1] == 'Q') {
      const size_t close = p.find("\\E", i + 2);  // \Q...\E quotes its content verbatim
      const size_t stop = close == std::string_view::npos ? p.size() : close + 2;
      out.append(p.substr(i, stop - i));
      i = stop - 1;
      continue;
    }
    if (c == '\\' && i + 1 < p.size()) {
      const char e = p[++i];
      switch (e) {
        case 's': out += "\\p{White_Space}"; break;
        case 'S': out += "\\P{White_Space}"; break;
        case 'h': out += "\\p{ASCII_Hex_Digit}"; break;
        case 'H': out += "\\P{ASCII_Hex_Digit}"; break;
        case 'w': out += in_class ? std::string(kWord) : "[" + std::string(kWord) + "]"; break;
        case 'W': out += in_class ? std::string("\\W") : "[^" + std::string(kWord) + "]"; break;
        default: out += c; out += e;
      }
      continue;
    }
    if (!in_class && c == '[') {
      in_class = true;
      out += c;
      // A ']' right after '[' or '[^' is a literal member, not the end of the class.
      if (i + 1 < p.size() && p[i + 1] == '^') out += p[++i];
      if (i + 1 < p.size() && p[i + 1] == ']') out += p[++i];
      continue;
    }
    if (in_class && c == '[' && i + 1 < p.size() && p[i + 1] == ':') {
      const size_t close = p.find(":]", i + 2);  // POSIX [:name:] inside a class
      if (close != std::string_view::npos) {
        out.append(p.substr(i, close + 2 - i));
        i = close + 1;
        continue;
      }
    }
    if (in_class && c == ']') in_class = false;
    out += c;
  }
  return out;
}

}  // namespace

Regex::Regex(std::string_view pattern, bool literal) {
  const std::string src = literal ? std::string(pattern) : onig_compatible(pattern);
  uint32_t opts = PCRE2_UTF;
  if (literal) {
    opts |= PCRE2_LITERAL;
  } else {
    opts |= PCRE2_UCP;
  }
  int err = 0;
  PCRE2_SIZE off = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(src.data()), src.size(), opts, &err,
                                   &off, nullptr);
  if (!code) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(err, msg, sizeof msg);
    throw std::invalid_argument(std::string(reinterpret_cast<const char*>(msg)) + " (near offset " +
                                std::to_string(off) + ")");
  }
  code_ = code;
  jit_ = pcre2_jit_compile(code, PCRE2_JIT_COMPLETE) == 0;
}

Regex::~Regex() { pcre2_code_free(static_cast<pcre2_code*>(code_)); }

int Regex::match_at(std::string_view text, size_t start, size_t* ovector) const {
  MatchScratch& s = scratch();
  auto* code = static_cast<pcre2_code*>(code_);
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  // Input was validated as UTF-8 once up front, so PCRE2 need not re-check it on every call.
  const int rc = jit_ ? pcre2_jit_match(code, subject, text.size(), start, PCRE2_NO_UTF_CHECK, s.md, s.mc)
                      : pcre2_match(code, subject, text.size(), start, PCRE2_NO_UTF_CHECK, s.md, s.mc);
  if (rc == PCRE2_ERROR_NOMATCH) return 0;
  if (rc < 0) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(rc, msg, sizeof msg);
    throw Error(std::string("tokenizer: regex matching failed: ") + reinterpret_cast<const char*>(msg));
  }
  const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(s.md);
  ovector[0] = ov[0];
  ovector[1] = ov[1];
  return 1;
}

void Regex::find_all(std::string_view text, std::vector<Span>& out) const {
  // Same iteration as the onig crate's FindMatches: an empty match right after the previous
  // match is not reported; the search then resumes one character further on.
  size_t last_end = 0;
  bool have_last = false;
  size_t last_match_end = 0;
  size_t ov[2];
  while (last_end <= text.size()) {
    if (!match_at(text, last_end, ov)) break;
    const size_t b = ov[0], e = std::max(ov[0], ov[1]);
    if (b == e && have_last && last_match_end == e) {
      if (last_end >= text.size()) break;
      size_t len = 1;
      utf8_decode(text, last_end, &len);
      last_end += len;
      continue;
    }
    last_end = e;
    have_last = true;
    last_match_end = e;
    out.push_back({b, e});
  }
}

bool Regex::search(std::string_view text) const {
  size_t ov[2];
  return match_at(text, 0, ov) != 0;
}

// ---------------------------------------------------------------------------------------------
// Normalizer
// ---------------------------------------------------------------------------------------------

std::string Normalizer::apply(std::string_view s) const {
  std::string cur(s);
  for (Kind k : steps) {
    if (k != Kind::NFC) continue;
    // ASCII is already NFC; skipping utf8proc keeps plain English text fast.
    if (std::all_of(cur.begin(), cur.end(), [](char c) { return static_cast<unsigned char>(c) < 0x80; }))
      continue;
    utf8proc_uint8_t* dst = nullptr;
    const utf8proc_ssize_t n =
        utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(cur.data()),
                     static_cast<utf8proc_ssize_t>(cur.size()), &dst,
                     static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE));
    if (n < 0) {
      throw InputError(std::string("tokenizer: NFC normalization failed: ") + utf8proc_errmsg(n));
    }
    cur.assign(reinterpret_cast<const char*>(dst), static_cast<size_t>(n));
    std::free(dst);
  }
  return cur;
}

// ---------------------------------------------------------------------------------------------
// Pre-tokenizers
// ---------------------------------------------------------------------------------------------

ByteLevelMap::ByteLevelMap() {
  // HF byte_level.rs bytes_char(): printable bytes map to themselves, the rest to 256 + n.
  std::fill(std::begin(cp_to_byte), std::end(cp_to_byte), static_cast<int16_t>(-1));
  uint32_t cps[256];
  bool printable[256] = {};
  for (int b = '!'; b <= '~'; ++b) printable[b] = true;
  for (int b = 0xA1; b <= 0xAC; ++b) printable[b] = true;
  for (int b = 0xAE; b <= 0xFF; ++b) printable[b] = true;
  uint32_t n = 0;
  for (int b = 0; b < 256; ++b) cps[b] = printable[b] ? static_cast<uint32_t>(b) : 256 + n++;
  for (int b = 0; b < 256; ++b) {
    utf8_append(byte_to_utf8[b], cps[b]);
    cp_to_byte[cps[b]] = static_cast<int16_t>(b);
  }
}

const ByteLevelMap& byte_level_map() {
  static const ByteLevelMap m;
  return m;
}

namespace {

// HF NormalizedString::split: `matches` are the pattern's matches; gaps become non-matches.
void split_with_behavior(std::string_view s, const Regex& re, SplitBehavior behavior, bool invert,
                         std::vector<std::string>& out, std::vector<Span>& buf) {
  struct Part {
    Span span;
    bool is_match;
  };
  std::vector<Part> parts;
  if (s.empty()) {
    parts.push_back({{0, 0}, false});
  } else {
    buf.clear();
    re.find_all(s, buf);
    size_t prev = 0;
    for (const Span& m : buf) {
      if (prev != m.begin) parts.push_back({{prev, m.begin}, false});
      parts.push_back({m, true});
      prev = m.end;
    }
    if (prev != s.size()) parts.push_back({{prev, s.size()}, false});
  }
  if (invert) {
    for (Part& p : parts) p.is_match = !p.is_match;
  }

  std::vector<Span> keep;
  switch (behavior) {
    case SplitBehavior::Isolated:
      for (const Part& p : parts) keep.push_back(p.span);
      break;
    case SplitBehavior::Removed:
      for (const Part& p : parts)
        if (!p.is_match) keep.push_back(p.span);
      break;
    case SplitBehavior::Contiguous: {
      bool prev_match = false;
      for (const Part& p : parts) {
        if (p.is_match == prev_match && !keep.empty()) {
          keep.back().end = p.span.end;
        } else {
          keep.push_back(p.span);
        }
        prev_match = p.is_match;
      }
      break;
    }
    case SplitBehavior::MergedWithPrevious: {
      bool prev_match = false;
      for (const Part& p : parts) {
        if (p.is_match && !prev_match && !keep.empty()) {
          keep.back().end = p.span.end;
        } else {
          keep.push_back(p.span);
        }
        prev_match = p.is_match;
      }
      break;
    }
    case SplitBehavior::MergedWithNext: {
      bool prev_match = false;
      for (auto it = parts.rbegin(); it != parts.rend(); ++it) {
        if (it->is_match && !prev_match && !keep.empty()) {
          keep.back().begin = it->span.begin;
        } else {
          keep.push_back(it->span);
        }
        prev_match = it->is_match;
      }
      std::reverse(keep.begin(), keep.end());
      break;
    }
  }
  for (const Span& k : keep) {
    if (k.end > k.begin) out.emplace_back(s.substr(k.begin, k.end - k.begin));
  }
}

}  // namespace

void PreTokenizer::run(std::string_view piece, std::vector<std::string>& words) const {
  std::vector<std::string> cur, next;
  cur.emplace_back(piece);
  std::vector<Span> buf;
  const ByteLevelMap& bl = byte_level_map();
  for (const PreTokStep& st : steps) {
    next.clear();
    for (std::string& w : cur) {
      if (st.kind == PreTokStep::Kind::Split) {
        split_with_behavior(w, *st.regex, st.behavior, st.invert, next, buf);
        continue;
      }
      // ByteLevel: optional prefix space, optional GPT-2 regex split, then bytes -> symbols.
      if (st.add_prefix_space && (w.empty() || w[0] != ' ')) w.insert(w.begin(), ' ');
      const size_t first = next.size();
      if (st.use_regex) {
        split_with_behavior(w, *st.regex, SplitBehavior::Isolated, false, next, buf);
      } else if (!w.empty()) {
        next.push_back(std::move(w));
      }
      for (size_t i = first; i < next.size(); ++i) {
        std::string mapped;
        mapped.reserve(next[i].size() * 2);
        for (char c : next[i]) mapped += bl.byte_to_utf8[static_cast<unsigned char>(c)];
        next[i] = std::move(mapped);
      }
    }
    std::swap(cur, next);
  }
  for (std::string& w : cur) {
    if (!w.empty()) words.push_back(std::move(w));
  }
}

// ---------------------------------------------------------------------------------------------
// Added tokens
// ---------------------------------------------------------------------------------------------

int32_t LeftmostLongest::child(int32_t node, unsigned char b) const {
  const auto& ch = nodes_[static_cast<size_t>(node)].children;
  auto it = std::lower_bound(ch.begin(), ch.end(), b,
                             [](const std::pair<unsigned char, int32_t>& e, unsigned char x) { return e.first < x; });
  return (it != ch.end() && it->first == b) ? it->second : -1;
}

void LeftmostLongest::add(std::string_view pattern, int32_t value) {
  if (pattern.empty()) return;
  int32_t node = 0;
  for (char c : pattern) {
    const auto b = static_cast<unsigned char>(c);
    int32_t nx = child(node, b);
    if (nx < 0) {
      nx = static_cast<int32_t>(nodes_.size());
      nodes_.emplace_back();
      auto& ch = nodes_[static_cast<size_t>(node)].children;
      auto it = std::lower_bound(ch.begin(), ch.end(), b,
                                 [](const std::pair<unsigned char, int32_t>& e, unsigned char x) { return e.first < x; });
      ch.insert(it, {b, nx});
    }
    node = nx;
  }
  nodes_[static_cast<size_t>(node)].value = value;
  first_byte_[static_cast<unsigned char>(pattern[0])] = true;
}

bool LeftmostLongest::next(std::string_view text, size_t from, size_t* begin, size_t* end,
                           int32_t* value) const {
  for (size_t i = from; i < text.size(); ++i) {
    if (!first_byte_[static_cast<unsigned char>(text[i])]) continue;
    int32_t node = 0, best = -1;
    size_t best_end = 0;
    for (size_t j = i; j < text.size(); ++j) {
      node = child(node, static_cast<unsigned char>(text[j]));
      if (node < 0) break;
      if (nodes_[static_cast<size_t>(node)].value >= 0) {
        best = nodes_[static_cast<size_t>(node)].value;
        best_end = j + 1;
      }
    }
    if (best >= 0) {
      *begin = i;
      *end = best_end;
      *value = best;
      return true;
    }
  }
  return false;
}

void AddedVocab::split(std::string_view s, const LeftmostLongest& m, std::vector<Piece>& out) const {
  if (m.empty()) {
    out.push_back({{0, s.size()}, -1});
    return;
  }
  size_t start_offset = 0, search_from = 0;
  size_t b = 0, e = 0;
  int32_t idx = -1;
  while (m.next(s, search_from, &b, &e, &idx)) {
    search_from = e;  // the matcher keeps going from the raw match end, as daachorse does
    const AddedToken& t = tokens[static_cast<size_t>(idx)];
    size_t start = b, stop = e;
    if (t.single_word) {
      const bool start_space = start == 0 || !word_end->search(s.substr(0, start));
      const bool stop_space = stop == s.size() || !word_start->search(s.substr(stop));
      if (!start_space || !stop_space) continue;
    }
    if (t.lstrip) {
      // Start of the whitespace run that ends at the match (HF: regex \s*$), not before
      // the end of the previous piece.
      size_t k = start;
      while (k > 0) {
        size_t p = k - 1;
        while (p > 0 && (static_cast<unsigned char>(s[p]) & 0xC0) == 0x80) --p;
        size_t len = 0;
        if (!is_white_space(utf8_decode(s, p, &len))) break;
        k = p;
      }
      start = std::max(k, start_offset);
    }
    if (t.rstrip) {
      while (stop < s.size()) {
        size_t len = 0;
        if (!is_white_space(utf8_decode(s, stop, &len))) break;
        stop += len;
      }
    }
    if (start_offset < start) out.push_back({{start_offset, start}, -1});
    out.push_back({{start, stop}, t.id});
    start_offset = stop;
  }
  if (start_offset != s.size()) out.push_back({{start_offset, s.size()}, -1});
}

}  // namespace mixlens::tok
