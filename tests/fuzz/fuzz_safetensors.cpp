// libFuzzer harness for the safetensors header parser (see README.md in this folder).
// Any input must either parse into entries that lie inside the buffer or throw mixlens::Error;
// anything else (another exception, a crash, an ASan report) is a bug.
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "io/safetensors.h"
#include "mixlens/errors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const auto header = mixlens::io::SafetensorsFile::parse_header(data, size, "fuzz");
    uint64_t sum = 0;
    for (const auto& t : header.tensors) {
      if (t.offset < header.data_start || t.offset + t.nbytes > size) std::abort();
      // Touch the first and last byte so ASan checks the claimed range really is in bounds.
      if (t.nbytes) sum += data[t.offset] + data[t.offset + t.nbytes - 1];
    }
    volatile uint64_t sink = sum;
    (void)sink;
  } catch (const mixlens::Error&) {
  }
  return 0;
}
