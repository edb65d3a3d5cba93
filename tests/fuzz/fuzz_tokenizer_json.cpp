// libFuzzer harness for tokenizer.json loading (LoadSax's depth bound and capture of vocab /
// merges, every component parser, the id bounds) and, when a file loads, one encode / decode.
// Only mixlens::Error may escape; see README.md in this folder.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "mixlens/errors.h"
#include "mixlens/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const mixlens::Tokenizer t =
        mixlens::Tokenizer::from_json(std::string_view(reinterpret_cast<const char*>(data), size), "fuzz.json");
    const auto ids = t.encode("Hello world, 123 héllo\n\t<|x|>");
    (void)t.decode(ids);
    (void)t.decode(ids, true);
  } catch (const mixlens::Error&) {
  }
  return 0;
}
