// Prompt GEMM with bf16 weights at mamba2-130m's per-thread shapes (issue 9, bf16 prompts): thread
// CPU time of one call, single thread, weights cycled over 24 copies (one per layer) so they come
// from memory as in a forward. Candidates:
//   - OpenBLAS sgemm on float32 weights (what the f32 path runs),
//   - widen bf16 -> float32 tile + OpenBLAS sgemm (the bf16 path before this bench),
//   - ops::kGemm16Avx2 (widen while packing, src/ops/gemm16_avx2.cpp),
//   - oneDNN matmul with bf16 weights (libdnnl-dev, optional: -DMIXLENS_BENCH_DNNL).
// Build: cmake -S . -B build/py -DMIXLENS_BENCH=ON && cmake --build build/py --target gemm16_bench;
// run: OMP_NUM_THREADS=1 build/py/bench/gemm16_bench [REPS=24] [ROWS=128,1024]
#include <cblas.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "ops/gemm16.h"
#include "timing.h"

#if defined(MIXLENS_BENCH_DNNL) && __has_include(<oneapi/dnnl/dnnl.hpp>)
#include <oneapi/dnnl/dnnl.hpp>
#define HAVE_DNNL 1
#endif

namespace {

using mixlens_bench::thread_cpu_s;

uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fff + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}

void widen(const uint16_t* s, float* d, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(d + i, _mm256_castsi256_ps(_mm256_slli_epi32(
                                _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i))), 16)));
  for (; i < n; ++i) {
    uint32_t u = static_cast<uint32_t>(s[i]) << 16;
    std::memcpy(d + i, &u, 4);
  }
}

struct Cand {
  std::string name;
  std::function<void(int)> f;
};

// Median and best of `reps` timed calls per candidate (after one warm-up), in ms; the candidates
// alternate call by call so that the other load on the machine hits them alike.
void report(int64_t M, int64_t N, int64_t K, int reps, const std::vector<Cand>& cands) {
  std::vector<std::vector<double>> t(cands.size());
  for (const Cand& c : cands) c.f(0);
  for (int r = 0; r < reps; ++r)
    for (size_t i = 0; i < cands.size(); ++i) {
      const double t0 = thread_cpu_s();
      cands[i].f(r + 1);
      t[i].push_back(thread_cpu_s() - t0);
    }
  const double gf = 2.0 * static_cast<double>(M) * static_cast<double>(N) * static_cast<double>(K) / 1e9;
  for (size_t i = 0; i < cands.size(); ++i) {
    const double med = mixlens_bench::median(t[i]);
    std::printf("| %d x %d x %d | %s | %.3f | %.3f | %.1f |\n", static_cast<int>(M), static_cast<int>(N),
                static_cast<int>(K), cands[i].name.c_str(), mixlens_bench::best(t[i]) * 1e3, med * 1e3, gf / med);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const int reps = argc > 1 ? std::atoi(argv[1]) : 24;
  openblas_set_num_threads(1);
  constexpr int kLayers = 24;
  std::printf("| M x N x K | kernel | best ms | median ms | GFLOP/s (median) |\n|---|---|---|---|---|\n");
  struct Shape {
    int64_t M, N, K;
  };
  // Per thread with 2 threads: in_proj [3352, 768] split in 2, out_proj [768, 1536] split in 2.
  // Rows (prompt tokens) to measure: argv[2], comma-separated (default 128,1024).
  std::vector<Shape> shapes;
  for (const char* p = argc > 2 ? argv[2] : "128,1024"; *p;) {
    char* end = nullptr;
    const int64_t m = std::strtol(p, &end, 10);
    shapes.push_back({m, 1676, 768});
    shapes.push_back({m, 384, 1536});
    p = *end ? end + 1 : end;
  }
  for (Shape s : shapes) {
    const int64_t M = s.M, N = s.N, K = s.K;
    const blasint bm = static_cast<blasint>(M), bn = static_cast<blasint>(N), bk = static_cast<blasint>(K);
    std::mt19937 rng(1);
    std::normal_distribution<float> nd(0.0f, 0.05f);
    std::vector<float> x(M * K), w32(kLayers * N * K), y(M * N);
    std::vector<uint16_t> w16(kLayers * N * K);
    for (float& v : x) v = nd(rng);
    for (int64_t i = 0; i < kLayers * N * K; ++i) {
      w16[i] = to_bf16(nd(rng));
      uint32_t u = static_cast<uint32_t>(w16[i]) << 16;
      std::memcpy(&w32[i], &u, 4);
    }
    std::vector<Cand> cands;
    cands.push_back({"OpenBLAS sgemm, f32 weights", [&](int r) {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, bm, bn, bk, 1.0f, x.data(), bk,
                  w32.data() + (r % kLayers) * N * K, bk, 0.0f, y.data(), bn);
    }});
    // The bf16 path of ops::linear before: tiles of max(256, 1M floats / K) outputs.
    std::vector<float> buf;
    for (int64_t tile : {std::max<int64_t>(256, (int64_t{1} << 20) / K), int64_t{64}}) {
      char name[96];
      std::snprintf(name, sizeof name, "widen bf16 tile of %d outputs + OpenBLAS sgemm", static_cast<int>(tile));
      cands.push_back({name, [&, tile](int r) {
        const uint16_t* w = w16.data() + (r % kLayers) * N * K;
        const int64_t t = std::min(tile, N);
        buf.resize(t * K);
        for (int64_t t0 = 0; t0 < N; t0 += t) {
          const int64_t nt = std::min(t, N - t0);
          widen(w + t0 * K, buf.data(), nt * K);
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, bm, static_cast<blasint>(nt), bk, 1.0f, x.data(), bk,
                      buf.data(), bk, 0.0f, y.data() + t0, bn);
        }
      }});
    }
    cands.push_back({"mixlens gemm16 AVX2 (widen while packing)", [&](int r) {
      mixlens::ops::kGemm16Avx2(x.data(), K, M, w16.data() + (r % kLayers) * N * K, K, false, N, K, y.data(), N);
    }});
    report(M, N, K, reps, cands);
#ifdef HAVE_DNNL
    {
      using namespace dnnl;
      engine eng(engine::kind::cpu, 0);
      stream st(eng);
      for (auto sdt : {memory::data_type::f32, memory::data_type::bf16}) {
        memory::desc sd({M, K}, sdt, memory::format_tag::ab);
        memory::desc wd({K, N}, memory::data_type::bf16, memory::format_tag::ba);  // W[N, K] row-major
        memory::desc dd({M, N}, memory::data_type::f32, memory::format_tag::ab);
        try {
          matmul::primitive_desc pd(matmul::desc(sd, wd, dd), eng);
          std::vector<uint16_t> xb(M * K);
          for (int64_t i = 0; i < M * K; ++i) xb[i] = to_bf16(x[i]);
          memory src(sd, eng, sdt == memory::data_type::f32 ? static_cast<void*>(x.data()) : xb.data());
          memory dst(dd, eng, y.data());
          std::vector<memory> wm;
          for (int l = 0; l < kLayers; ++l) wm.emplace_back(wd, eng, w16.data() + l * N * K);
          matmul mm(pd);
          char name[160];
          std::snprintf(name, sizeof name, "oneDNN 2.6 matmul %s src x bf16 W -> f32 (%s)",
                        sdt == memory::data_type::f32 ? "f32" : "bf16", pd.impl_info_str());
          report(M, N, K, reps, {{name, [&](int r) {
                   mm.execute(st, {{DNNL_ARG_SRC, src}, {DNNL_ARG_WEIGHTS, wm[r % kLayers]}, {DNNL_ARG_DST, dst}});
                   st.wait();
                 }}});
        } catch (const dnnl::error& e) {
          std::printf("| %d x %d x %d | oneDNN 2.6 matmul %s src x bf16 W | unsupported: %s | | |\n",
                      static_cast<int>(M), static_cast<int>(N), static_cast<int>(K),
                      sdt == memory::data_type::f32 ? "f32" : "bf16", e.what());
        }
      }
    }
#endif
  }
  return 0;
}
