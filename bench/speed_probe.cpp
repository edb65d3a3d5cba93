// Prompt and decode speed of one build through the public API, timed in-process (no load or
// start-up in the figures): bench/build_ab.py compiles this file against two builds' libraries
// and alternates the processes. Prints one line per metric: `metric tokens wall_s cpu_s` (medians).
//   [MIXLENS_DTYPE=D] speed_probe MODEL_DIR PROMPTS(e.g. 128,1024) DECODE_TOKENS CALLS
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include "mixlens/model.h"
#include "timing.h"

using mixlens_bench::median;

int main(int argc, char** argv) {
  if (argc < 5) {
    std::fprintf(stderr, "usage: speed_probe MODEL_DIR PROMPTS DECODE_TOKENS CALLS\n");
    return 2;
  }
  mixlens::LoadOptions opts;
  if (const char* d = std::getenv("MIXLENS_DTYPE")) opts.dtype = d;  // e.g. bfloat16, int8 (7B layouts)
  const mixlens::Model model = mixlens::Model::load(argv[1], opts);
  std::vector<int> lengths;
  std::stringstream ss(argv[2]);
  for (std::string n; std::getline(ss, n, ',');) lengths.push_back(std::atoi(n.c_str()));
  const int decode = std::atoi(argv[3]), calls = std::atoi(argv[4]);
  const auto V = static_cast<size_t>(model.info().vocab_size);
  auto ids = [&](size_t n) {
    std::vector<int32_t> p(n);
    for (size_t i = 0; i < n; ++i) p[i] = static_cast<int32_t>((i * 7919 + 13) % V);
    return p;
  };
  for (const int n : lengths) {
    const std::vector<int32_t> prompt = ids(static_cast<size_t>(n));
    std::vector<double> wall, cpu;
    for (int r = 0; r <= calls; ++r) {  // r == 0 warms up
      const auto s = mixlens_bench::timed([&] { model.run({prompt}, nullptr, /*all_logits=*/false); });
      if (r) wall.push_back(s.wall), cpu.push_back(s.cpu);
    }
    std::printf("prompt%d %d %.6f %.6f\n", n, n, median(wall), median(cpu));
  }
  // Decode: generate(1 + decode) less generate(1) from the same 8-token prompt; greedy, no EOS stop.
  mixlens::GenerateOptions shortg, longg;
  shortg.max_new_tokens = 1, longg.max_new_tokens = 1 + decode;
  shortg.eos_token_id = longg.eos_token_id = -1;
  const std::vector<int32_t> p8 = ids(8);
  std::vector<double> wall, cpu;
  for (int r = 0; r <= calls; ++r) {
    const auto a = mixlens_bench::timed([&] { model.generate({p8}, shortg); });
    const auto b = mixlens_bench::timed([&] { model.generate({p8}, longg); });
    if (r) wall.push_back(b.wall - a.wall), cpu.push_back(b.cpu - a.cpu);
  }
  std::printf("decode %d %.6f %.6f\n", decode, median(wall), median(cpu));
  return 0;
}
