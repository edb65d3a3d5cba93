// One prompt forward (last-position logits) of one build, for instruction counts: run under
// `valgrind --tool=callgrind --instr-atstart=no --collect-atstart=no`; the load and a warm-up call run
// uninstrumented (fast) and only the second call is counted (a --toggle-collect on Model::run* would be
// switched off again by its nested overload). bench/results/build-ab.md.
//   callgrind_probe MODEL_DIR PROMPT_TOKENS
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <valgrind/callgrind.h>

#include "mixlens/model.h"

// Separate, never-inlined functions: the warm-up call is outside the collected one.
extern "C" __attribute__((noinline)) void probe_warmup(const mixlens::Model& m, const std::vector<int32_t>& p) {
  m.run({p}, nullptr, /*all_logits=*/false);
}
extern "C" __attribute__((noinline)) void probe_forward(const mixlens::Model& m, const std::vector<int32_t>& p) {
  m.run({p}, nullptr, /*all_logits=*/false);
}

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: callgrind_probe MODEL_DIR PROMPT_TOKENS\n");
    return 2;
  }
  const mixlens::Model model = mixlens::Model::load(argv[1]);
  const auto V = static_cast<size_t>(model.info().vocab_size), n = static_cast<size_t>(std::atoi(argv[2]));
  std::vector<int32_t> prompt(n);
  for (size_t i = 0; i < n; ++i) prompt[i] = static_cast<int32_t>((i * 7919 + 13) % V);  // speed_probe's ids
  probe_warmup(model, prompt);
  CALLGRIND_START_INSTRUMENTATION;
  CALLGRIND_TOGGLE_COLLECT;
  probe_forward(model, prompt);
  CALLGRIND_TOGGLE_COLLECT;
  CALLGRIND_STOP_INSTRUMENTATION;
  std::printf("ok %zu\n", n);
  return 0;
}
