// One checkpoint loaded once per dtype in one process, prompt calls alternating dtype by dtype
// (the finest interleaving: another process's load hits every dtype alike), process CPU time per
// call (min and median), for A/B on a shared machine and for `perf record` on the unstripped
// static library (the installed Python module is stripped). bench/prompt_loop.sh builds it.
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

namespace {
double now(clockid_t c) {
  timespec ts;
  clock_gettime(c, &ts);
  return ts.tv_sec + 1e-9 * ts.tv_nsec;
}
}  // namespace

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
      const double c0 = now(CLOCK_PROCESS_CPUTIME_ID), w0 = now(CLOCK_MONOTONIC);
      models[m]->run({prompt}, nullptr, /*all_logits=*/false);
      if (r) cpu[m].push_back(now(CLOCK_PROCESS_CPUTIME_ID) - c0), wall[m].push_back(now(CLOCK_MONOTONIC) - w0);
    }
  for (size_t m = 0; m < models.size(); ++m) {
    std::sort(cpu[m].begin(), cpu[m].end());
    std::sort(wall[m].begin(), wall[m].end());
    std::printf("%s %d tokens: cpu min %.1f ms, median %.1f ms; wall min %.1f ms, median %.1f ms (%d calls)\n",
                dtypes[m].c_str(), n, cpu[m][0] * 1e3, cpu[m][cpu[m].size() / 2] * 1e3, wall[m][0] * 1e3,
                wall[m][wall[m].size() / 2] * 1e3, calls);
  }
  return 0;
}
