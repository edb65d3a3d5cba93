// Prompt (prefill) cost of one checkpoint, in CPU seconds as well as wall seconds: on a shared
// machine the process CPU time of a fixed amount of work is the steadier measure (the wall time
// mostly measures the other processes). Built against two libraries by bench/bench_qwen_prompt.sh
// for interleaved before/after runs (issue 9, Qwen3.5 prompts).
//   bench_qwen_prompt MODEL_DIR DTYPE TOKENS REPEATS
// prints one line: load s, peak RSS after load and at the end (MiB), then per-forward median CPU s
// and median / min wall s of REPEATS timed calls after one warm-up (last-position logits).
// Profiling the timed calls only: perf record --control=fifo:CTL -D -1 ... with MIXLENS_PERF_CTL=CTL
// (the bench writes "enable" there after the warm-up).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <string>
#include <vector>

#include "mixlens/model.h"
#include "timing.h"

using mixlens_bench::cpu_s;
using mixlens_bench::median;
using mixlens_bench::wall_s;

namespace {
long peak_rss_mib() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("VmHWM:", 0) == 0) return std::atol(line.c_str() + 6) / 1024;
  return -1;
}
}  // namespace

int main(int argc, char** argv) {
  if (argc < 5) {
    std::fprintf(stderr, "usage: bench_qwen_prompt MODEL_DIR DTYPE TOKENS REPEATS\n");
    return 2;
  }
  const std::string dir = argv[1], dtype = argv[2];
  const int tokens = std::atoi(argv[3]), reps = std::atoi(argv[4]);
  const double l0 = wall_s();
  mixlens::LoadOptions o;
  o.dtype = dtype;
  const mixlens::Model m = mixlens::Model::load(dir, o);
  const double load = wall_s() - l0;
  const long rss_load = peak_rss_mib();
  std::vector<int32_t> prompt(static_cast<size_t>(tokens));
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int32_t>(3 + (i * 7919 + 13) % 4997);
  std::vector<double> cpu, wall;
  mixlens::Tensor logits;
  for (int r = 0; r <= reps; ++r) {  // r == 0 warms up (pages, pools, arena)
    mixlens::Cache c = m.new_cache(1);
    const double c0 = cpu_s(), w0 = wall_s();
    logits = m.forward(mixlens::Batch::left_padded({prompt}, 0), c, nullptr, /*all_logits=*/false);
    if (r == 0)
      if (const char* ctl = std::getenv("MIXLENS_PERF_CTL")) std::ofstream(ctl) << "enable\n" << std::flush;
    if (r > 0) {
      cpu.push_back(cpu_s() - c0);
      wall.push_back(wall_s() - w0);
    }
  }
  // A fingerprint of the last logits, to see two builds compute the same thing.
  double sum = 0, sq = 0;
  int64_t arg = 0;
  for (int64_t i = 0; i < logits.numel(); ++i) {
    sum += logits[i];
    sq += static_cast<double>(logits[i]) * logits[i];
    if (logits[i] > logits[arg]) arg = i;
  }
  std::printf("logits sum %.6g rms %.6g argmax %lld | ", sum, std::sqrt(sq / static_cast<double>(logits.numel())),
              static_cast<long long>(arg));
  std::printf("load %.2f s | peak RSS %ld MiB after load, %ld MiB at end | prompt %d: CPU %.3f s (median), wall %.3f s median, %.3f s min\n",
              load, rss_load, peak_rss_mib(), tokens, median(cpu), median(wall), *std::min_element(wall.begin(), wall.end()));
  return 0;
}
