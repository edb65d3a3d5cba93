#include "ops/ops.h"

#include <cblas.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <vector>

#include "mixlens/errors.h"

namespace mixlens::ops {

void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
          int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  if (M == 0 || N == 0) return;
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans,
              static_cast<blasint>(M), static_cast<blasint>(N), static_cast<blasint>(K), alpha, A,
              static_cast<blasint>(lda), B, static_cast<blasint>(ldb), beta, C, static_cast<blasint>(ldc));
}

void linear(const float* x, int64_t rows, int64_t in, const Tensor& W, float* y, const float* bias) {
  const int64_t out = W.size(0);
  if (W.size(1) != in) throw InputError("linear: weight " + shape_str(W.shape()) + " does not take " +
                                        std::to_string(in) + " inputs");
  // Split the output features across our pool, each block a single-threaded BLAS call: mixing
  // OpenBLAS's own threads with ours oversubscribes the cores (measured 10x slower on 2 cores).
  const int64_t work = rows * out * in;
  const int64_t nblocks = work < (int64_t{1} << 20) ? 1 : std::min<int64_t>(num_threads(), out);
  const int64_t per = (out + nblocks - 1) / nblocks;
  parallel_for(nblocks, [&](int64_t blk) {
    const int64_t o0 = blk * per, n = std::min(per, out - o0);
    if (n <= 0) return;
    const float* Wb = W.data() + o0 * in;
    if (rows == 1)  // matrix-vector: gemv streams the weight once
      cblas_sgemv(CblasRowMajor, CblasNoTrans, static_cast<blasint>(n), static_cast<blasint>(in), 1.0f, Wb,
                  static_cast<blasint>(in), x, 1, 0.0f, y + o0, 1);
    else
      gemm(false, true, rows, n, in, 1.0f, x, in, Wb, in, 0.0f, y + o0, out);
  });
  if (bias)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t o = 0; o < out; ++o) y[r * out + o] += bias[o];
}

void rmsnorm(const float* x, const float* w, float* y, int64_t rows, int64_t dim, float eps,
             bool zero_centred) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * dim;
    float* yr = y + r * dim;
    double ss = 0.0;
    for (int64_t i = 0; i < dim; ++i) ss += static_cast<double>(xr[i]) * xr[i];
    const float inv = 1.0f / std::sqrt(static_cast<float>(ss / static_cast<double>(dim)) + eps);
    if (zero_centred)
      for (int64_t i = 0; i < dim; ++i) yr[i] = (xr[i] * inv) * (1.0f + w[i]);
    else
      for (int64_t i = 0; i < dim; ++i) yr[i] = w[i] * (xr[i] * inv);
  }
}

namespace {

// A small persistent pool: the forward calls parallel_for many times per token, so threads are
// kept alive rather than spawned per call.
class Pool {
 public:
  explicit Pool(int n) : n_(n) {
    for (int i = 1; i < n_; ++i) workers_.emplace_back([this] { loop(); });
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
  }
  int size() const { return n_; }

  void run(int64_t n, const std::function<void(int64_t)>& f) {
    if (n_ <= 1 || n <= 1 || busy_.exchange(true)) {
      // Serial when single-threaded, trivial, or nested inside another parallel_for.
      for (int64_t i = 0; i < n; ++i) f(i);
      return;
    }
    {
      std::lock_guard<std::mutex> lk(mu_);
      job_ = &f;
      total_ = n;
      next_.store(0);
      done_ = 0;
      ++generation_;
    }
    cv_.notify_all();
    work();
    std::unique_lock<std::mutex> lk(mu_);
    done_cv_.wait(lk, [&] { return done_ == n_ - 1; });
    job_ = nullptr;
    busy_.store(false);
    if (error_) {
      auto e = error_;
      error_ = nullptr;
      std::rethrow_exception(e);
    }
  }

 private:
  void work() {
    for (;;) {
      int64_t i = next_.fetch_add(1);
      if (i >= total_) break;
      try {
        (*job_)(i);
      } catch (...) {
        std::lock_guard<std::mutex> lk(mu_);
        if (!error_) error_ = std::current_exception();
        next_.store(total_);
      }
    }
  }
  void loop() {
    uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
      }
      work();
      {
        std::lock_guard<std::mutex> lk(mu_);
        ++done_;
      }
      done_cv_.notify_one();
    }
  }

  int n_;
  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  const std::function<void(int64_t)>* job_ = nullptr;
  int64_t total_ = 0;
  std::atomic<int64_t> next_{0};
  int done_ = 0;
  uint64_t generation_ = 0;
  bool stop_ = false;
  std::atomic<bool> busy_{false};
  std::exception_ptr error_;
};

int configured_threads() {
  if (const char* s = std::getenv("MIXLENS_NUM_THREADS")) {
    int n = std::atoi(s);
    if (n > 0) return n;
  }
  return std::max(1u, std::thread::hardware_concurrency());
}

Pool& pool() {
  // BLAS runs single-threaded inside our pool's tasks (see linear()).
  static const bool blas_single = (openblas_set_num_threads(1), true);
  (void)blas_single;
  static Pool p(configured_threads());
  return p;
}

}  // namespace

void parallel_for(int64_t n, const std::function<void(int64_t)>& f) { pool().run(n, f); }
int num_threads() { return pool().size(); }

}  // namespace mixlens::ops
