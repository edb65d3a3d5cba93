// Decode and prompt speed of one checkpoint per weight dtype (issue 9 items 1-2), in C++ so the
// same file builds against an older mixlens (no LoadOptions: -DMIXLENS_BENCH_NO_DTYPE) for
// before/after runs. bench/bench_dtype.sh builds both and interleaves them.
//   bench_dtype MODEL_DIR DTYPE REPEATS  -> one markdown row: prompt-1024 tok/s, decode tok/s
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "mixlens/model.h"
#include "timing.h"

using mixlens_bench::timed;

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: bench_dtype MODEL_DIR DTYPE REPEATS\n");
    return 2;
  }
  const std::string dir = argv[1], dtype = argv[2];
  const int reps = std::atoi(argv[3]);
#ifdef MIXLENS_BENCH_NO_DTYPE
  if (dtype != "float32") return 0;
  const mixlens::Model m = mixlens::Model::load(dir);
#else
  mixlens::LoadOptions o;
  o.dtype = dtype;
  const mixlens::Model m = mixlens::Model::load(dir, o);
#endif
  const int32_t V = static_cast<int32_t>(m.info().vocab_size);
  std::vector<int32_t> prompt(1024);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int32_t>((i * 7919 + 13) % static_cast<size_t>(V));
  double best_prompt = 1e30, best_decode = 1e30;
  const int steps = 32;
  for (int r = 0; r <= reps; ++r) {  // r == 0 warms up
    {
      mixlens::Cache c = m.new_cache(1);
      const double s =
          timed([&] { m.forward(mixlens::Batch::left_padded({prompt}, 0), c, nullptr, /*all_logits=*/false); }).wall;
      if (r) best_prompt = std::min(best_prompt, s);
    }
    {
      mixlens::Cache c = m.new_cache(1);
      m.forward(mixlens::Batch::left_padded({std::vector<int32_t>(prompt.begin(), prompt.begin() + 16)}, 0), c, nullptr, false);
      const double s = timed([&] {
                         for (int k = 0; k < steps; ++k)
                           m.forward(mixlens::Batch::left_padded({{prompt[static_cast<size_t>(16 + k)]}}, 0), c,
                                     nullptr, false);
                       }).wall;
      if (r) best_decode = std::min(best_decode, s);
    }
  }
  std::printf("| %s | %.0f | %.1f |\n", dtype.c_str(), 1024.0 / best_prompt, steps / best_decode);
  return 0;
}
