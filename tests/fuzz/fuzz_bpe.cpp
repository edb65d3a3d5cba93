// libFuzzer harness for BPE encode / decode on a real tokenizer (GPT-2's byte-level BPE from
// tests/fixtures/tokenizer/gpt2). Contract: valid UTF-8 text encodes and decodes back to itself
// exactly (byte-level BPE is lossless); invalid UTF-8 raises InputError; decoding arbitrary ids
// never crashes (ids outside the vocabulary raise a mixlens error or are dropped).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "mixlens/errors.h"
#include "mixlens/tokenizer.h"

namespace {
const mixlens::Tokenizer& gpt2() {
  static const mixlens::Tokenizer t =
      mixlens::Tokenizer::from_file(MIXLENS_SOURCE_DIR "/tests/fixtures/tokenizer/gpt2/tokenizer.json");
  return t;
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const mixlens::Tokenizer& t = gpt2();
  if (size == 0) return 0;
  // First byte picks the mode, so one corpus exercises both directions.
  const std::string_view rest(reinterpret_cast<const char*>(data + 1), size - 1);
  if (data[0] & 1) {
    std::vector<int32_t> ids;
    for (size_t i = 0; i + 4 <= rest.size(); i += 4) {
      int32_t id;
      std::memcpy(&id, rest.data() + i, 4);
      ids.push_back(id);
    }
    try {
      (void)t.decode(ids);
      (void)t.decode(ids, true);
    } catch (const mixlens::Error&) {
    }
    return 0;
  }
  std::vector<int32_t> ids;
  try {
    ids = t.encode(rest, (data[0] & 2) != 0);
  } catch (const mixlens::InputError&) {
    return 0;  // not valid UTF-8
  }
  for (int32_t id : ids)
    if (id < 0 || id >= t.vocab_size()) std::abort();
  if (t.decode(ids) != rest) std::abort();  // byte-level BPE must round-trip exactly
  return 0;
}
