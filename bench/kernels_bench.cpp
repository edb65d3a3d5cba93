// Decode matvec micro-benchmark (issue 9 item 2): GB/s of weight bytes streamed by
//   - a streaming read (the memory bandwidth ceiling),
//   - Debian OpenBLAS cblas_sgemv (linked),
//   - scipy-openblas32's cblas_sgemv (dlopen'ed; PyPI wheel, optional) and its sbgemv if exported,
//   - oneDNN bf16 matmul with M = 1 (libdnnl-dev, optional; rounds x to bf16),
//   - mixlens' own kernels at every ISA level this CPU runs, f32 / bf16 / f16 weights.
// Build: cmake -S . -B build/py -DMIXLENS_BENCH=ON && cmake --build build/py --target kernels_bench;
// run: [REPS=7] build/py/bench/kernels_bench [path/to/libscipy_openblas.so]. Single thread (per-core bandwidth: the cores are shared,
// see the load average printed) plus mixlens' ops::linear on its pool. Best of --reps.
#include <cblas.h>
#include <dlfcn.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "mixlens/tensor.h"
#include "ops/dtype.h"
#include "ops/kernels.h"
#include "ops/ops.h"
#include "timing.h"

#if __has_include(<oneapi/dnnl/dnnl.hpp>) && defined(MIXLENS_BENCH_DNNL)
#include <oneapi/dnnl/dnnl.hpp>
#define HAVE_DNNL 1
#endif

using namespace mixlens;

namespace {
constexpr int64_t kOut = 3352, kIn = 768;  // mamba2-130m in_proj
constexpr int kMats = 24;                  // 247 MB of f32 weights: far beyond the 32 MB L3
int reps = 7;

double best_of(const std::function<void()>& f) {
  return mixlens_bench::best(mixlens_bench::walls(mixlens_bench::repeat(f, reps)));
}
void report(const char* what, double bytes, double secs) {
  std::printf("| %-44s | %7.2f |\n", what, bytes / secs / 1e9);
  std::fflush(stdout);
}
}  // namespace

int main(int argc, char** argv) {
  const char* sob = argc > 1 ? argv[1] : nullptr;  // path of libscipy_openblas.so
  if (const char* r = std::getenv("REPS")) reps = std::atoi(r);
  openblas_set_num_threads(1);
  double load[3] = {0, 0, 0};
  if (FILE* f = std::fopen("/proc/loadavg", "r")) {
    if (std::fscanf(f, "%lf %lf %lf", &load[0], &load[1], &load[2]) != 3) load[0] = -1;
    std::fclose(f);
  }
  std::printf("load average at start: %.2f %.2f %.2f; best of %d; matrices %d x [%lld, %lld]\n\n", load[0], load[1],
              load[2], reps, kMats, (long long)kOut, (long long)kIn);
  std::printf("| kernel (1 thread unless said) | GB/s |\n|---|---|\n");
  const size_t n = static_cast<size_t>(kOut * kIn);
  std::vector<std::vector<float>> W32(kMats, std::vector<float>(n));
  std::vector<std::vector<uint16_t>> W16(kMats, std::vector<uint16_t>(n)), W16h(kMats, std::vector<uint16_t>(n));
  uint32_t s = 12345;
  for (int m = 0; m < kMats; ++m)
    for (size_t i = 0; i < n; ++i) {
      s = s * 1664525u + 1013904223u;
      const float v = static_cast<float>(static_cast<int32_t>(s >> 8) % 2001 - 1000) * 1e-4f;
      W32[m][i] = v;
      W16[m][i] = ops::f32_to_bf16(v);
      W16h[m][i] = ops::f32_to_f16(v);
    }
  // int8 blocks (ops/dtype.h), quantized from the f32 weights.
  const int64_t ld8 = ops::q8_row_bytes(kIn);
  std::vector<std::vector<uint8_t>> W8(kMats, std::vector<uint8_t>(static_cast<size_t>(kOut * ld8)));
  for (int m = 0; m < kMats; ++m)
    for (int64_t o = 0; o < kOut; ++o) ops::quantize_q8_row(W32[m].data() + o * kIn, kIn, W8[m].data() + o * ld8);
  const double b8 = double(kMats) * double(kOut * ld8);
  std::vector<float> x(kIn, 0.01f), y(kOut);
  const double b32 = double(kMats) * n * 4, b16 = double(kMats) * n * 2;

  // Streaming read: the same bytes as the f32 weights, summed (AVX-512 via the f32 matvec with
  // one row per matrix would add FMA work; a plain vectorizable sum is the ceiling).
  report("streaming read (sum, 1 thread)", b32, best_of([&] {
           float acc = 0;
           for (int m = 0; m < kMats; ++m) {
             const float* p = W32[m].data();
             float a[16] = {0};
             for (size_t i = 0; i < n; i += 16)
               for (int j = 0; j < 16; ++j) a[j] += p[i + j];
             for (float v : a) acc += v;
           }
           if (acc == 12345.f) std::puts("");
         }));
  report("Debian OpenBLAS cblas_sgemv f32", b32, best_of([&] {
           for (int m = 0; m < kMats; ++m)
             cblas_sgemv(CblasRowMajor, CblasNoTrans, kOut, kIn, 1.0f, W32[m].data(), kIn, x.data(), 1, 0.0f, y.data(), 1);
         }));
  if (sob) {
    if (void* h = dlopen(sob, RTLD_NOW | RTLD_LOCAL)) {
      using sgemv_t = void (*)(int, int, int, int, float, const float*, int, const float*, int, float, float*, int);
      auto sg = reinterpret_cast<sgemv_t>(dlsym(h, "scipy_cblas_sgemv"));
      auto setn = reinterpret_cast<void (*)(int)>(dlsym(h, "scipy_openblas_set_num_threads"));
      if (setn) setn(1);
      if (sg)
        report("scipy-openblas32 0.3.34 cblas_sgemv f32", b32, best_of([&] {
                 for (int m = 0; m < kMats; ++m) sg(101, 111, kOut, kIn, 1.0f, W32[m].data(), kIn, x.data(), 1, 0.0f, y.data(), 1);
               }));
      if (!dlsym(h, "scipy_cblas_sbgemv") && !dlsym(h, "cblas_sbgemv"))
        std::printf("| scipy-openblas32: no sbgemv/sbgemm exported (built without BFLOAT16) | - |\n");
    } else {
      std::printf("| scipy-openblas32: dlopen failed: %s | - |\n", dlerror());
    }
  }
#ifdef HAVE_DNNL
  {
    using namespace dnnl;
    engine eng(engine::kind::cpu, 0);
    stream st(eng);
    memory::desc src_md({1, kIn}, memory::data_type::bf16, memory::format_tag::ab);
    memory::desc wei_md({kIn, kOut}, memory::data_type::bf16, memory::format_tag::ba);  // W [out,in] row-major
    memory::desc dst_md({1, kOut}, memory::data_type::f32, memory::format_tag::ab);
    matmul::primitive_desc pd(matmul::desc(src_md, wei_md, dst_md), eng);
    matmul mm(pd);
    std::vector<uint16_t> xb(kIn, ops::f32_to_bf16(0.01f));
    memory src(src_md, eng, xb.data()), dst(dst_md, eng, y.data());
    std::vector<memory> wm;
    for (int m = 0; m < kMats; ++m) wm.emplace_back(wei_md, eng, W16[m].data());
    std::printf("| (oneDNN impl, plain weights: %s) | |\n", pd.impl_info_str());
    report("oneDNN 2.6 matmul bf16 x bf16 -> f32, M=1, plain W", b16, best_of([&] {
             for (int m = 0; m < kMats; ++m)
               mm.execute(st, {{DNNL_ARG_SRC, src}, {DNNL_ARG_WEIGHTS, wm[m]}, {DNNL_ARG_DST, dst}});
             st.wait();
           }));
    // The way oneDNN wants it used: weights in the layout it picks (format any), reordered once.
    memory::desc any_md({kIn, kOut}, memory::data_type::bf16, memory::format_tag::any);
    matmul::primitive_desc pd2(matmul::desc(src_md, any_md, dst_md), eng);
    matmul mm2(pd2);
    std::vector<memory> wr;
    for (int m = 0; m < kMats; ++m) {
      wr.emplace_back(pd2.weights_desc(), eng);
      reorder(wm[static_cast<size_t>(m)], wr.back()).execute(st, wm[static_cast<size_t>(m)], wr.back());
    }
    st.wait();
    std::printf("| (oneDNN impl, blocked weights: %s) | |\n", pd2.impl_info_str());
    report("oneDNN 2.6 matmul bf16, M=1, blocked W", b16, best_of([&] {
             for (int m = 0; m < kMats; ++m)
               mm2.execute(st, {{DNNL_ARG_SRC, src}, {DNNL_ARG_WEIGHTS, wr[static_cast<size_t>(m)]}, {DNNL_ARG_DST, dst}});
             st.wait();
           }));
  }
#endif
  for (ops::Isa isa : {ops::Isa::scalar, ops::Isa::avx2, ops::Isa::avx512}) {
    if (!ops::isa_supported(isa)) continue;
    const ops::KernelTable& kt = *ops::kernels_for(isa);
    const std::string lvl = std::string("mixlens ") + ops::isa_name(isa);
    report((lvl + " matvec f32").c_str(), b32, best_of([&] {
             for (int m = 0; m < kMats; ++m) kt.matvec_f32(W32[m].data(), kIn, x.data(), y.data(), kOut, kIn);
           }));
    report((lvl + " matvec bf16").c_str(), b16, best_of([&] {
             for (int m = 0; m < kMats; ++m) kt.matvec_bf16(W16[m].data(), kIn, x.data(), y.data(), kOut, kIn);
           }));
    report((lvl + " matvec f16").c_str(), b16, best_of([&] {
             for (int m = 0; m < kMats; ++m) kt.matvec_f16(W16h[m].data(), kIn, x.data(), y.data(), kOut, kIn);
           }));
    report((lvl + " matvec int8").c_str(), b8, best_of([&] {
             const ops::RoundedX16 x16(x.data(), kIn, 1, kIn);  // once per call, as ops::linear
             for (int m = 0; m < kMats; ++m) kt.matvec_q8(W8[m].data(), ld8, x16.view(), y.data(), kOut);
           }));
  }
  // Through ops::linear on the pool (MIXLENS_NUM_THREADS, default all cores), best ISA level.
  std::vector<Tensor> T32, T16, T8;
  for (int m = 0; m < kMats; ++m) {
    T32.push_back(Tensor::borrow({kOut, kIn}, W32[m].data(), std::shared_ptr<const void>(W32[m].data(), [](const void*) {})));
    T16.push_back(Tensor::narrow({kOut, kIn}, ScalarType::bfloat16, W16[m].data(), std::shared_ptr<const void>(W16[m].data(), [](const void*) {})));
    T8.push_back(Tensor::narrow({kOut, kIn}, ScalarType::int8, W8[m].data(), std::shared_ptr<const void>(W8[m].data(), [](const void*) {})));
  }
  const std::string pool = "mixlens ops::linear f32, " + std::to_string(ops::num_threads()) + " threads";
  report(pool.c_str(), b32, best_of([&] {
           for (int m = 0; m < kMats; ++m) ops::linear(x.data(), 1, kIn, T32[m], y.data());
         }));
  const std::string pool16 = "mixlens ops::linear bf16, " + std::to_string(ops::num_threads()) + " threads";
  report(pool16.c_str(), b16, best_of([&] {
           for (int m = 0; m < kMats; ++m) ops::linear(x.data(), 1, kIn, T16[m], y.data());
         }));
  const std::string pool8 = "mixlens ops::linear int8, " + std::to_string(ops::num_threads()) + " threads";
  report(pool8.c_str(), b8, best_of([&] {
           for (int m = 0; m < kMats; ++m) ops::linear(x.data(), 1, kIn, T8[m], y.data());
         }));
  {
    const size_t big = n * kMats;
    report("streaming read, 2 threads (ops::parallel_for)", b32, best_of([&] {
             ops::parallel_for(kMats, [&](int64_t m) {
               const float* p = W32[static_cast<size_t>(m)].data();
               float a[16] = {0};
               for (size_t i = 0; i < n; i += 16)
                 for (int j = 0; j < 16; ++j) a[j] += p[i + j];
               if (a[0] == 12345.f) std::puts("");
             });
           }));
    (void)big;
  }
  if (FILE* f = std::fopen("/proc/loadavg", "r")) {
    if (std::fscanf(f, "%lf %lf %lf", &load[0], &load[1], &load[2]) == 3)
      std::printf("\nload average at end: %.2f %.2f %.2f\n", load[0], load[1], load[2]);
    std::fclose(f);
  }
  return 0;
}
