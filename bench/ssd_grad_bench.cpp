// The SSD backward's two forms (src/grad/ssd_grad.cpp) against each other and against the chunked
// forward, on the mamba2-130m layer shape (H=24, P=64, G=1, N=128), one batch row: process CPU time
// and wall time per call, best of R, the forms interleaved; plus their relative RMS difference.
// Build: cmake -S . -B build/py -DMIXLENS_BENCH=ON && cmake --build build/py --target ssd_grad_bench;
// run: build/py/bench/ssd_grad_bench [R=5] [CHUNK=64]. Not a test: times depend on the (shared) machine.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <functional>
#include <random>
#include <vector>

#include "grad/ops_grad.h"
#include "mixers/ssd.h"
#include "ops/ops.h"
#include "timing.h"

using namespace mixlens;

namespace {

struct Time {
  double cpu = 1e30, wall = 1e30;
};

void measure(const std::function<void()>& f, Time& t) {
  const mixlens_bench::Sample s = mixlens_bench::timed(f);
  t.cpu = std::min(t.cpu, s.cpu);
  t.wall = std::min(t.wall, s.wall);
}

std::vector<float> rnd(size_t n, uint32_t seed, float lo, float hi) {
  std::mt19937 g(seed);
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = u(g);
  return v;
}

double rel(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = static_cast<double>(a[i]) - b[i];
    num += d * d, den += static_cast<double>(b[i]) * b[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

}  // namespace

int main(int argc, char** argv) {
  const int R = argc > 1 ? std::atoi(argv[1]) : 5;
  const int64_t H = 24, P = 64, G = 1, N = 128, Q = argc > 2 ? std::atoi(argv[2]) : 64;
  std::printf("threads %d, best of %d, chunk %lld (backward), 256 (forward)\n\n", ops::num_threads(), R,
              static_cast<long long>(Q));
  std::printf("| tokens | forward chunked ms (cpu / wall) | backward recurrent ms (cpu / wall) | backward chunked ms "
              "(cpu / wall) | recurrent / chunked (cpu) | max rel RMS difference |\n|---|---|---|---|---|---|\n");
  for (int64_t T : {1, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048}) {
    const uint32_t s = static_cast<uint32_t>(T);
    auto x = rnd(T * H * P, s + 1, -1, 1), Bv = rnd(T * G * N, s + 2, -1, 1), Cv = rnd(T * G * N, s + 3, -1, 1),
         dt = rnd(T * H, s + 4, 0.001f, 0.1f), A = rnd(H, s + 5, -16, -1), D = rnd(H, s + 6, -1, 1),
         dy = rnd(T * H * P, s + 7, -1, 1), S0 = rnd(H * P * N, s + 8, -1, 1);
    struct Out {
      std::vector<float> dx, dB, dC, ddt, ddA, dS0;
    };
    auto make = [&] {
      return Out{std::vector<float>(x.size()), std::vector<float>(Bv.size()), std::vector<float>(Cv.size()),
                 std::vector<float>(dt.size()), std::vector<float>(dt.size()), std::vector<float>(S0.size())};
    };
    Out r = make(), c = make();
    auto args = [&](Out& o, int64_t chunk) {
      grad::SsdGradArgs g;
      g.T = T; g.H = H; g.P = P; g.G = G; g.N = N;
      g.x = x.data(); g.B = Bv.data(); g.C = Cv.data(); g.dt = dt.data(); g.A = A.data(); g.D = D.data();
      g.S0 = S0.data(); g.dy = dy.data();
      g.dx = o.dx.data(); g.dB = o.dB.data(); g.dC = o.dC.data(); g.ddt = o.ddt.data(); g.ddA = o.ddA.data();
      g.dS0 = o.dS0.data();
      g.chunk = chunk;
      return g;
    };
    std::vector<float> S(S0.size()), y(x.size());
    Time tf, tr, tc;
    for (int i = 0; i < R + 1; ++i) {  // the first round warms up
      Time f, rr, cc;
      measure([&] {
        std::copy(S0.begin(), S0.end(), S.begin());
        detail::SsdArgs a;
        a.T = T; a.H = H; a.P = P; a.G = G; a.N = N;
        a.x = x.data(); a.B = Bv.data(); a.C = Cv.data(); a.dt = dt.data(); a.A = A.data(); a.D = D.data();
        a.S = S.data(); a.y = y.data();
        detail::ssd_chunked(a);
      }, i ? tf : f);
      measure([&] { grad::ssd_backward_recurrent(args(r, 64)); }, i ? tr : rr);
      measure([&] { grad::ssd_backward_chunked(args(c, Q)); }, i ? tc : cc);
    }
    const double d = std::max({rel(c.dx, r.dx), rel(c.dB, r.dB), rel(c.dC, r.dC), rel(c.ddt, r.ddt),
                               rel(c.ddA, r.ddA), rel(c.dS0, r.dS0)});
    std::printf("| %lld | %.2f / %.2f | %.2f / %.2f | %.2f / %.2f | %.2f | %.1e |\n", static_cast<long long>(T),
                1e3 * tf.cpu, 1e3 * tf.wall, 1e3 * tr.cpu, 1e3 * tr.wall, 1e3 * tc.cpu, 1e3 * tc.wall, tr.cpu / tc.cpu, d);
  }
}
