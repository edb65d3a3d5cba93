// The C++ side of the Python hand-off (issue 9 item 5): what reading N small values through a
// Session adds to one forward, without Python. Prints, for read and read_live, the least process
// CPU time (every thread: the caller, the pool's workers) and the least caller-thread CPU time of
// R blocks, and per value = (t(N) - t(0)) / N. Blocks of each kind alternate (interleaved).
//   built with -DMIXLENS_BENCH=ON (bench/CMakeLists.txt): build/py/bench/bench_handoff_cpp
//   bench_handoff_cpp MODEL_DIR [N=100] [R=200] [only: none | read | read_live, for a profiler]
// MODEL_DIR: bench/bench_handoff.py's tiny model (build/bench-handoff-mamba2-24l). Link an older
// libmixlens_core.a the same way to compare builds.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "mixlens/model.h"
#include "mixlens/session.h"
#include "timing.h"

using mixlens_bench::cpu_s;
using mixlens_bench::thread_cpu_s;

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s MODEL_DIR [N] [R]\n", argv[0]);
    return 2;
  }
  const int n = argc > 2 ? std::atoi(argv[2]) : 100;
  const int reps = argc > 3 ? std::atoi(argv[3]) : 200;
  const std::string only = argc > 4 ? argv[4] : "";
  mixlens::Model model = mixlens::Model::load(argv[1]);
  std::vector<int32_t> ids;
  for (int i = 0; i < 8; ++i) ids.push_back((i * 37 + 5) % 256);
  // The first n small values in forward order, as bench/bench_handoff.py picks them.
  std::vector<std::string> paths;
  for (const auto& v : model.values(1, 8)) {
    int64_t numel = 1;
    for (int64_t d : v.shape) numel *= d;
    const bool state_input = v.path.size() >= 11 && v.path.compare(v.path.size() - 11, 11, "state_input") == 0;
    if (numel <= (1 << 16) && !state_input && static_cast<int>(paths.size()) < n) paths.push_back(v.path);
  }
  enum Kind { kNone, kRead, kLive, kCount };
  const char* names[kCount] = {"none", "read", "read_live"};
  std::vector<double> best_proc(kCount, 1e9), best_thread(kCount, 1e9);
  for (int r = 0; r < reps + 5; ++r) {
    for (int k = 0; k < kCount; ++k) {
      if (!only.empty() && only != names[k]) continue;
      const double p0 = cpu_s(), t0 = thread_cpu_s();
      mixlens::Session s = mixlens::Session::run(model, {ids});
      for (const std::string& p : paths) {
        if (k == kRead) (void)s.read(0, p);
        if (k == kLive) (void)s.read_live(0, p);
      }
      (void)s.finish();
      const double dp = cpu_s() - p0, dt = thread_cpu_s() - t0;
      if (r >= 5) {
        best_proc[k] = std::min(best_proc[k], dp);
        best_thread[k] = std::min(best_thread[k], dt);
      }
    }
  }
  std::printf("%d values, least of %d blocks each\n", static_cast<int>(paths.size()), reps);
  for (int k = 0; k < kCount; ++k) {
    if (!only.empty() && only != names[k]) continue;
    const double m = static_cast<double>(paths.size());
    std::printf("%-10s process CPU %.3f ms (%.2f us/value)  caller thread CPU %.3f ms (%.2f us/value)\n", names[k],
                best_proc[k] * 1e3, k ? (best_proc[k] - best_proc[0]) / m * 1e6 : 0.0, best_thread[k] * 1e3,
                k ? (best_thread[k] - best_thread[0]) / m * 1e6 : 0.0);
  }
  return 0;
}
