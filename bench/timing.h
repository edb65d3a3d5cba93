// The C++ benches' one timer (the Python benches' twin: dev/mixlens_dev/timing.py): wall and
// process-CPU seconds of a block, repeats with a warm-up, interleaved candidates, median / best /
// spread. Process CPU counts every thread (a forward's workers, a spinning wait): on a machine
// shared with other work it is the steadier measure, the wall time what a user waits.
#pragma once

#include <algorithm>
#include <chrono>
#include <ctime>
#include <functional>
#include <vector>

namespace mixlens_bench {

inline double clock_s(clockid_t c) {
  timespec ts{};
  clock_gettime(c, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}
inline double wall_s() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
inline double cpu_s() { return clock_s(CLOCK_PROCESS_CPUTIME_ID); }
inline double thread_cpu_s() { return clock_s(CLOCK_THREAD_CPUTIME_ID); }

struct Sample {
  double wall = 0, cpu = 0;
};

/// Starts at construction; elapsed() is the wall and process-CPU seconds since.
class Timer {
 public:
  Timer() : w0_(wall_s()), c0_(cpu_s()) {}
  Sample elapsed() const { return {wall_s() - w0_, cpu_s() - c0_}; }

 private:
  double w0_, c0_;
};

template <class F>
Sample timed(F&& f) {
  const Timer t;
  f();
  return t.elapsed();
}

/// `warmup` untimed calls, then `n` timed ones.
inline std::vector<Sample> repeat(const std::function<void()>& f, int n, int warmup = 1) {
  for (int i = 0; i < warmup; ++i) f();
  std::vector<Sample> out;
  for (int i = 0; i < n; ++i) out.push_back(timed(f));
  return out;
}

/// Every round calls each candidate once, in order (another process's load hits them alike);
/// `warmup` rounds first, dropped. out[i] holds candidate i's samples.
inline std::vector<std::vector<Sample>> interleave(const std::vector<std::function<void()>>& cands, int rounds,
                                                   int warmup = 1) {
  std::vector<std::vector<Sample>> out(cands.size());
  for (int r = 0; r < warmup + rounds; ++r)
    for (size_t i = 0; i < cands.size(); ++i) {
      const Sample s = timed(cands[i]);
      if (r >= warmup) out[i].push_back(s);
    }
  return out;
}

inline std::vector<double> walls(const std::vector<Sample>& s) {
  std::vector<double> v;
  for (const Sample& x : s) v.push_back(x.wall);
  return v;
}
inline std::vector<double> cpus(const std::vector<Sample>& s) {
  std::vector<double> v;
  for (const Sample& x : s) v.push_back(x.cpu);
  return v;
}

/// The upper median (the middle element of an odd count); 0 for no runs.
inline double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2), v.end());
  return v[v.size() / 2];
}
inline double best(const std::vector<double>& v) { return v.empty() ? 0.0 : *std::min_element(v.begin(), v.end()); }
/// (max - min) / median: the relative width of the runs.
inline double spread(const std::vector<double>& v) {
  const double m = median(v);
  return v.empty() || m == 0 ? 0.0 : (*std::max_element(v.begin(), v.end()) - best(v)) / m;
}

}  // namespace mixlens_bench
