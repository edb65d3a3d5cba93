// One checkpoint loaded once per dtype in one process, prompt calls alternating dtype by dtype
// (the finest interleaving: another process's load hits every dtype alike), process CPU time per
// call (min and median), for A/B on a shared machine and for `perf record` on the unstripped
// static library (the installed Python module is stripped). Build: cmake -S . -B build/py -DMIXLENS_BENCH=ON && cmake --build build/py --target prompt_loop.
//   prompt_loop MODEL_DIR DTYPE[,DTYPE...] TOKENS CALLS
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "mixlens/model.h"
#include "timing.h"

using mixlens_bench::best;
using mixlens_bench::median;

int main(int argc, char** argv) {
  if (argc < 5) {
    std::fprintf(stderr, "usage: prompt_loop MODEL_DIR DTYPE[,DTYPE...] TOKENS CALLS\n");
    return 2;
  }
  std::vector<std::string> dtypes;
  std::stringstream ss(argv[2]);
  for (std::string d; std::getline(ss, d, ',');) dtypes.push_back(d);
  std::vector<std::unique_ptr<mixlens::Model>> models;
  for (const std::string& d : dtypes) {
    mixlens::LoadOptions o;
    o.dtype = d;
    models.push_back(std::make_unique<mixlens::Model>(mixlens::Model::load(argv[1], o)));
  }
  const int n = std::atoi(argv[3]), calls = std::atoi(argv[4]);
  const int32_t V = static_cast<int32_t>(models[0]->info().vocab_size);
  std::vector<int32_t> prompt(static_cast<size_t>(n));
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int32_t>((i * 7919 + 13) % static_cast<size_t>(V));
  std::vector<std::vector<double>> cpu(dtypes.size()), wall(dtypes.size());
  for (int r = 0; r <= calls; ++r)  // r == 0 warms up
    for (size_t m = 0; m < models.size(); ++m) {
      const mixlens_bench::Sample s = mixlens_bench::timed([&] { models[m]->run({prompt}, nullptr, /*all_logits=*/false); });
      if (r) cpu[m].push_back(s.cpu), wall[m].push_back(s.wall);
    }
  for (size_t m = 0; m < models.size(); ++m) {
    std::printf("%s %d tokens: cpu min %.1f ms, median %.1f ms; wall min %.1f ms, median %.1f ms (%d calls)\n",
                dtypes[m].c_str(), n, best(cpu[m]) * 1e3, median(cpu[m]) * 1e3, best(wall[m]) * 1e3,
                median(wall[m]) * 1e3, calls);
  }
  return 0;
}
