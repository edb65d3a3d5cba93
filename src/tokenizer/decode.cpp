// Decoding: HF Tokenizer::decode with the ByteLevel decoder (or none), and the streaming decoder.
#include "mixlens/errors.h"
#include "tokenizer/tokenizer_impl.h"

namespace mixlens {

using namespace tok;

void Loaded::token_bytes(const std::string& token, std::string& out) const {
  if (decoder.kind == Decoder::Kind::Join) {
    out += token;
    return;
  }
  // HF ByteLevel decoder: every character must be one of the 256 byte symbols, otherwise the
  // token (e.g. an added token with a real space) is copied as-is.
  const ByteLevelMap& bl = byte_level_map();
  const size_t start = out.size();
  size_t i = 0;
  while (i < token.size()) {
    size_t len = 1;
    const uint32_t cp = utf8_decode(token, i, &len);
    const int b = cp < 512 ? bl.cp_to_byte[cp] : -1;
    if (b < 0) {
      out.resize(start);
      out += token;
      return;
    }
    out += static_cast<char>(b);
    i += len;
  }
}

std::string Tokenizer::decode(const std::vector<int32_t>& ids, bool skip_special_tokens) const {
  const Impl& im = *impl_;
  std::string bytes;
  bool first = true;
  for (int32_t id : ids) {
    const std::string* t = im.token_of(id);
    if (!t || (skip_special_tokens && im.is_special_content(*t))) continue;
    if (im.decoder.kind == Decoder::Kind::Join && !first) bytes += ' ';
    im.token_bytes(*t, bytes);
    first = false;
  }
  if (im.decoder.kind == Decoder::Kind::Join) return bytes;  // tokens are valid UTF-8 already
  std::string out;
  out.reserve(bytes.size());
  utf8_lossy(out, bytes, true);
  return out;
}

Tokenizer::StreamDecoder::StreamDecoder(const Tokenizer& tokenizer, bool skip_special_tokens)
    : impl_(tokenizer.impl_), skip_special_(skip_special_tokens) {}

std::string Tokenizer::StreamDecoder::push(int32_t id) { return push(std::vector<int32_t>{id}); }

std::string Tokenizer::StreamDecoder::push(const std::vector<int32_t>& ids) {
  const Impl& im = *impl_;
  for (const int32_t id : ids) {
    const std::string* t = im.token_of(id);
    if (!t || (skip_special_ && im.is_special_content(*t))) continue;
    if (im.decoder.kind == Decoder::Kind::Join && any_token_) pending_ += ' ';
    im.token_bytes(*t, pending_);
    any_token_ = true;
  }
  // HF's rule, once per step (a step of several ids is held back whole, as HF's): the pending text
  // goes out whole once it does not end in U+FFFD (EF BF BD), an incomplete character or an invalid byte.
  std::string out;
  utf8_lossy(out, pending_, true);
  if (out.size() >= 3 && out.compare(out.size() - 3, 3, "\xEF\xBF\xBD") == 0) return {};
  pending_.clear();
  return out;
}

std::string Tokenizer::StreamDecoder::flush() {
  std::string out;
  utf8_lossy(out, pending_, true);
  pending_.clear();
  any_token_ = false;
  return out;
}

}  // namespace mixlens
