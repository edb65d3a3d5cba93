#include "ops/ops.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <atomic>
#include <bit>
#include <condition_variable>
#include <cstring>
#include <memory>
#include <new>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "mixlens/errors.h"
#include "ops/dtype.h"
#include "ops/env.h"
#include "ops/gemm16.h"
#include "ops/kernels.h"

namespace mixlens::ops {

void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
          int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  if (M == 0 || N == 0) return;
  if (!trans_a && trans_b && alpha == 1.0f && beta == 0.0f && deterministic()) {
    // C = A B^T, the linear layer's form: each element one dot product in the matvec order.
    kernels().gemm_f32(B, ldb, A, lda, M, C, ldc, N, K);
    return;
  }
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans,
              static_cast<blasint>(M), static_cast<blasint>(N), static_cast<blasint>(K), alpha, A,
              static_cast<blasint>(lda), B, static_cast<blasint>(ldb), beta, C, static_cast<blasint>(ldc));
}

namespace {

// Choice of the decode kernels, measured here (bench/results/kernels.md: Zen 4, busy 2-core
// machine, best of 9, single thread, GB/s of weight bytes; streaming-read ceiling ~12): our
// AVX-512 / AVX2 matvec 9.4-13.3 (f32), 12-15 (bf16, f16); Debian OpenBLAS 0.3.21 sgemv 5.5-6.5,
// scipy-openblas32 0.3.34 sgemv 8-9 (no sbgemv exported); oneDNN 2.6 bf16 matmul at M=1 3.9-11
// and it rounds x to bf16. No library does 16-bit weights x float32 activations, and none reaches
// 85% of the ceiling for f32 here, so decode runs our kernels for every dtype.
constexpr int64_t kMatvecRows = 4;  // up to this many rows: one matvec per row (weights stream once per row)
constexpr int64_t kTile = 256;      // least output features widened per sgemm call for narrow weights
// Floats widened per sgemm call for narrow weights: each call packs all of x again (rows x in), so
// few wide calls beat many narrow ones; 1M floats (4 MiB) keeps the buffer well inside L3.
constexpr int64_t kTileFloats = int64_t{1} << 20;
// Narrow weights go to gemm16 (one pass over the 16-bit weights) with fewer rows than this, or
// with one k block at any row count: there it measured 5-13% faster than widen + sgemm at 128-256
// rows and equal or faster at 512-1024; with 2+ k blocks (out_proj, K = 1536) at 512+ rows widen +
// sgemm measured 8-17% faster (bench/results/gemm16.md).
constexpr int64_t kGemm16MaxRows = 512;

// Rows [o0, o0 + n) of W times each of x's rows, into y[r * ldy .. + n).
void matvec_rows(const KernelTable& kt, const Tensor& W, const float* x, const X16& x16, int64_t rows, int64_t in,
                 float* y, int64_t ldy, int64_t o0, int64_t n) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * in;
    float* yr = y + r * ldy;
    switch (W.dtype()) {
      case ScalarType::float32: kt.matvec_f32(static_cast<const float*>(W.raw()) + o0 * in, in, xr, yr, n, in); break;
      case ScalarType::bfloat16: kt.matvec_bf16(static_cast<const uint16_t*>(W.raw()) + o0 * in, in, xr, yr, n, in); break;
      case ScalarType::float16: kt.matvec_f16(static_cast<const uint16_t*>(W.raw()) + o0 * in, in, xr, yr, n, in); break;
      case ScalarType::int8: {
        const int64_t ld = q8_row_bytes(in);
        kt.matvec_q8(static_cast<const uint8_t*>(W.raw()) + o0 * ld, ld, x16.row(r), yr, n);
        break;
      }
    }
  }
}

thread_local int tl_deterministic = -1;  // -1: the process default

}  // namespace

bool deterministic() {
  if (tl_deterministic >= 0) return tl_deterministic != 0;
  static const bool by_env = ::mixlens::detail::env_flag("MIXLENS_DETERMINISTIC", false);  // throws on a typo (retried)
  return by_env;
}
int deterministic_state() { return tl_deterministic; }
void set_deterministic_state(int state) { tl_deterministic = state; }
DeterministicScope::DeterministicScope(bool on) : prev_(tl_deterministic) { tl_deterministic = on ? 1 : 0; }
DeterministicScope::~DeterministicScope() { tl_deterministic = prev_; }

namespace {

// y[rows, out] = x @ W^T for W the rows of `nparts` parts stacked, part p at rows [starts[p], starts[p+1]).
// Work is split in blocks of output rows over the pool; a block that straddles parts runs a kernel
// call per part, so the split (and each element's sum order) does not depend on the stacking.
void linear_parts(const float* x, int64_t rows, int64_t in, const Tensor* parts, const int64_t* starts, int64_t nparts,
                  float* y, const float* bias) {
  const int64_t out = starts[nparts];
  if (rows == 0 || out == 0) return;
  const ScalarType dt = parts[0].dtype();
  // Runs f(part, first row in the part, n, first output column) over rows [o0, o0 + n) of the stack.
  auto for_parts = [&](int64_t o0, int64_t n, auto&& f) {
    int64_t p = std::upper_bound(starts, starts + nparts + 1, o0) - starts - 1;
    for (int64_t o = o0, end = o0 + n; o < end; ++p) {
      const int64_t m = std::min(end, starts[p + 1]) - o;
      if (m > 0) f(parts[p], o - starts[p], m, o);
      o += std::max<int64_t>(m, 0);
    }
  };
  const KernelTable& kt = kernels();
  const int64_t work = rows * out * in;
  if (rows <= kMatvecRows || deterministic()) {
    // Decode: memory-bound, so split the weight rows in blocks of 16+ over the pool (a few per
    // thread so a thread slowed by another process does not hold up the op). Every element is one
    // dot product in one order (KernelTable::gemm_*: the matvec's), so neither the split nor the
    // row count changes a value: the batch-invariant path (issue 23).
    const int64_t nblocks = work < (int64_t{1} << 16) ? 1 : std::min<int64_t>(4 * num_threads(), (out + 15) / 16);
    // int8 weights multiply x rounded to int16 (KernelTable::matvec_q8): once here for every block.
    const RoundedX16 rounded(x, in, dt == ScalarType::int8 ? rows : 0, in);
    const X16& x16 = rounded.view();
    const int64_t per = (out + nblocks - 1) / nblocks;
    parallel_for(nblocks, [&](int64_t blk) {
      const int64_t b0 = blk * per, bn = std::min(per, out - b0);
      if (bn <= 0) return;
      for_parts(b0, bn, [&](const Tensor& W, int64_t o0, int64_t n, int64_t col) {
        if (rows <= kMatvecRows) {
          matvec_rows(kt, W, x, x16, rows, in, y + col, out, o0, n);
          return;
        }
        switch (W.dtype()) {
          case ScalarType::float32: kt.gemm_f32(static_cast<const float*>(W.raw()) + o0 * in, in, x, in, rows, y + col, out, n, in); break;
          case ScalarType::bfloat16: kt.gemm_bf16(static_cast<const uint16_t*>(W.raw()) + o0 * in, in, x, in, rows, y + col, out, n, in); break;
          case ScalarType::float16: kt.gemm_f16(static_cast<const uint16_t*>(W.raw()) + o0 * in, in, x, in, rows, y + col, out, n, in); break;
          case ScalarType::int8: {
            const int64_t ld = q8_row_bytes(in);
            kt.gemm_q8(static_cast<const uint8_t*>(W.raw()) + o0 * ld, ld, x16, rows, y + col, out, n);
            break;
          }
        }
      });
    });
  } else {
    // Prompt: compute-bound, OpenBLAS sgemm per block of output features, each block a
    // single-threaded BLAS call: mixing OpenBLAS's own threads with ours oversubscribes the cores
    // (measured 10x slower on 2 cores). Narrow weights: our gemm16 where it measured better
    // (bench/results/gemm16.md), else widened (exactly) a tile at a time for sgemm.
    const int64_t nblocks = work < (int64_t{1} << 20) ? 1 : std::min<int64_t>(num_threads(), out);
    const int64_t per = (out + nblocks - 1) / nblocks;
    const bool w16 = dt == ScalarType::bfloat16 || dt == ScalarType::float16;
    const Gemm16Fn g16 = !w16 || (rows >= kGemm16MaxRows && in > kGemm16KBlock) ? nullptr : gemm16();
    parallel_for(nblocks, [&](int64_t blk) {
      const int64_t b0 = blk * per, bn = std::min(per, out - b0);
      if (bn <= 0) return;
      for_parts(b0, bn, [&](const Tensor& W, int64_t o0, int64_t n, int64_t col) {
        if (W.dtype() == ScalarType::float32) {
          gemm(false, true, rows, n, in, 1.0f, x, in, static_cast<const float*>(W.raw()) + o0 * in, in, 0.0f, y + col, out);
          return;
        }
        if (g16) {  // widened while packed (ops/gemm16.h): one pass over the 16-bit weights
          g16(x, in, rows, static_cast<const uint16_t*>(W.raw()) + o0 * in, in, W.dtype() == ScalarType::float16, n, in,
              y + col, out);
          return;
        }
        thread_local std::vector<float> buf;
        const int64_t tile = std::min(std::max(kTile, kTileFloats / in), n);
        if (buf.size() < static_cast<size_t>(tile * in)) buf.resize(static_cast<size_t>(tile * in));
        for (int64_t t0 = 0; t0 < n; t0 += tile) {
          const int64_t nt = std::min(tile, n - t0);
          widen_rows(W, o0 + t0, nt, buf.data());
          gemm(false, true, rows, nt, in, 1.0f, x, in, buf.data(), in, 0.0f, y + col + t0, out);
        }
      });
    });
  }
  if (bias)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t o = 0; o < out; ++o) y[r * out + o] += bias[o];
}

}  // namespace

RoundedX16::RoundedX16(const float* X, int64_t ldx, int64_t rows, int64_t in)
    : q_(static_cast<size_t>(rows * q8_blocks(in) * kQ8Block)), s_(static_cast<size_t>(rows * q8_blocks(in))),
      f_(static_cast<size_t>(rows)), view_(round_x16(X, ldx, rows, in, q_.data(), s_.data(), f_.data())) {}

void linear(const float* x, int64_t rows, int64_t in, const Tensor& W, float* y, const float* bias) {
  if (W.dim() != 2) throw InputError("linear: weight " + shape_str(W.shape()) + " is not a matrix");
  if (W.size(1) != in) throw InputError("linear: weight " + shape_str(W.shape()) + " does not take " +
                                        std::to_string(in) + " inputs");
  const int64_t starts[2] = {0, W.size(0)};
  linear_parts(x, rows, in, &W, starts, 1, y, bias);
}

RowStack::RowStack(Tensor whole) {
  if (whole.defined()) *this = RowStack(std::vector<Tensor>{std::move(whole)});  // undefined: an undefined stack
}

RowStack::RowStack(std::vector<Tensor> parts) : parts_(std::move(parts)) {
  if (parts_.empty()) throw InputError("RowStack: no parts");
  const Tensor& first = parts_.front();
  for (const Tensor& p : parts_) {
    if (p.dim() != 2) throw InputError("RowStack: part " + shape_str(p.shape()) + " is not a matrix");
    if (p.size(1) != first.size(1))
      throw InputError("RowStack: parts of " + std::to_string(first.size(1)) + " and " + std::to_string(p.size(1)) +
                       " columns");
    if (p.dtype() != first.dtype())
      throw InputError(std::string("RowStack: parts of dtypes ") + dtype_str(first.dtype()) + " and " + dtype_str(p.dtype()));
    starts_.push_back(starts_.back() + p.size(0));
  }
}

int64_t RowStack::size(int64_t i) const {
  if (parts_.empty()) throw InputError("RowStack: size of an undefined weight");
  if (i == 0 || i == -2) return starts_.back();
  if (i == 1 || i == -1) return parts_.front().size(1);
  throw InputError("RowStack: dimension " + std::to_string(i) + " of a matrix");
}

void linear(const float* x, int64_t rows, int64_t in, const RowStack& W, float* y, const float* bias) {
  if (!W.defined()) throw InputError("linear: undefined weight");
  if (W.size(1) != in) throw InputError("linear: weight of " + std::to_string(W.size(1)) + " columns does not take " +
                                        std::to_string(in) + " inputs");
  linear_parts(x, rows, in, W.parts().data(), W.starts().data(), static_cast<int64_t>(W.parts().size()), y, bias);
}

void copy_row(const Tensor& W, int64_t r, float* out) { widen_rows(W, r, 1, out); }

void widen_rows(const Tensor& W, int64_t r0, int64_t n, float* dst) {
  const int64_t cols = W.shape().back();
  const KernelTable& kt = kernels();
  switch (W.dtype()) {
    case ScalarType::float32:
      std::memcpy(dst, W.data() + r0 * cols, sizeof(float) * static_cast<size_t>(n * cols));
      return;
    case ScalarType::bfloat16: kt.widen_bf16(static_cast<const uint16_t*>(W.raw()) + r0 * cols, dst, n * cols); return;
    case ScalarType::float16: kt.widen_f16(static_cast<const uint16_t*>(W.raw()) + r0 * cols, dst, n * cols); return;
    case ScalarType::int8: {
      const int64_t ld = q8_row_bytes(cols);
      kt.widen_q8(static_cast<const uint8_t*>(W.raw()) + r0 * ld, ld, dst, n, cols);
      return;
    }
  }
}

void quantize_q8_row(const float* w, int64_t in, uint8_t* dst) {
  float pad[kQ8Block];
  for (int64_t k0 = 0; k0 < in; k0 += kQ8Block, dst += kQ8BlockBytes) {
    const float* x = w + k0;
    if (in - k0 < kQ8Block) {  // the last block, zero-padded
      std::fill(std::copy(x, w + in, pad), pad + kQ8Block, 0.0f);
      x = pad;
    }
    // Fixed-length loops the compiler vectorizes (a 7B checkpoint quantizes 7e9 weights at load).
    // max |x| through the bits: for finite floats |x| orders as its bit pattern, and an integer
    // maximum vectorizes where a float one (NaN-ordered) does not.
    int32_t bits = 0;
    for (int64_t j = 0; j < kQ8Block; ++j) bits = std::max(bits, std::bit_cast<int32_t>(x[j]) & 0x7fffffff);
    const auto amax = std::bit_cast<float>(bits);
    const float s = amax / 127.0f;
    std::memcpy(dst, &s, 4);
    auto* q = reinterpret_cast<int8_t*>(dst + 4);
    if (!(s > 0.0f)) {  // zeros, or so small that s underflows to 0
      std::fill(q, q + kQ8Block, int8_t{0});
      continue;
    }
    for (int64_t j = 0; j < kQ8Block; ++j) {
      // Adding and subtracting 1.5 * 2^23 rounds |v| < 2^22 to nearest even, as nearbyint does in the
      // default mode without its libm call; s keeps |w / s| <= 127 up to rounding, the clamp the rest.
      const float v = (x[j] / s + 0x1.8p23f) - 0x1.8p23f;
      q[j] = static_cast<int8_t>(std::clamp(v, -127.0f, 127.0f));
    }
  }
}

void exp(const float* x, float* y, int64_t n) { kernels().exp(x, y, n); }
void silu(const float* x, float* y, int64_t n) { kernels().mul_silu(nullptr, x, y, n); }
void sigmoid(const float* x, float* y, int64_t n) { kernels().sigmoid(x, y, n); }
void mul_silu(const float* x, const float* g, float* y, int64_t n) { kernels().mul_silu(x, g, y, n); }

double mean_ss(const float* x, int64_t dim, double& ss) {
  double s = 0.0;
  for (int64_t i = 0; i < dim; ++i) s += x[i];
  const double mean = s / static_cast<double>(dim);
  ss = 0.0;
  for (int64_t i = 0; i < dim; ++i) ss += (x[i] - mean) * (x[i] - mean);
  return mean;
}

void layernorm(const float* x, const float* w, const float* b, float* y, int64_t rows, int64_t dim, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * dim;
    float* yr = y + r * dim;
    double ss = 0.0;
    const double mean = mean_ss(xr, dim, ss);
    const float m = static_cast<float>(mean);
    const float inv = inv_rms(static_cast<float>(ss / static_cast<double>(dim)), eps);
    for (int64_t i = 0; i < dim; ++i) yr[i] = (xr[i] - m) * inv * w[i] + b[i];
  }
}

void rmsnorm(const float* x, const float* w, float* y, int64_t rows, int64_t dim, float eps,
             bool zero_centred) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * dim;
    float* yr = y + r * dim;
    // Four partial sums: one serial chain of double adds was latency-bound (~2% of a prompt).
    double s4[4] = {0.0, 0.0, 0.0, 0.0};
    int64_t k = 0;
    for (; k + 4 <= dim; k += 4)
      for (int64_t j = 0; j < 4; ++j) s4[j] += static_cast<double>(xr[k + j]) * xr[k + j];
    for (; k < dim; ++k) s4[0] += static_cast<double>(xr[k]) * xr[k];
    const double ss = (s4[0] + s4[1]) + (s4[2] + s4[3]);
    const float inv = inv_rms(static_cast<float>(ss / static_cast<double>(dim)), eps);
    if (zero_centred)
      for (int64_t i = 0; i < dim; ++i) yr[i] = (xr[i] * inv) * (1.0f + w[i]);
    else
      for (int64_t i = 0; i < dim; ++i) yr[i] = w[i] * (xr[i] * inv);
  }
}

void transpose(const float* __restrict src, int64_t rows, int64_t cols, float* __restrict dst) {
  constexpr int64_t kTile = 16;  // a 16 x 16 tile of each side fits in L1 with room to spare
  for (int64_t r0 = 0; r0 < rows; r0 += kTile) {
    const int64_t r1 = std::min(rows, r0 + kTile);
    for (int64_t c0 = 0; c0 < cols; c0 += kTile) {
      const int64_t c1 = std::min(cols, c0 + kTile);
      for (int64_t c = c0; c < c1; ++c)
        for (int64_t r = r0; r < r1; ++r) dst[c * rows + r] = src[r * cols + c];
    }
  }
}

namespace {

// A small persistent pool: the forward calls parallel_for many times per token, so threads are
// kept alive, and between the ops of one token they spin briefly (a few tens of microseconds)
// on an atomic generation counter instead of sleeping on a condvar, which cost a futex wake per op
// (3.6% of decode). Idle workers then sleep, so an idle process burns no CPU.
//
// The caller waits for the op's blocks, not for the workers: a worker that is descheduled (2 cores
// shared) or still spinning when the caller has done every block itself is not waited for, and
// workers never acknowledge an op (the old wait for every worker to check in was ~19% of a
// mamba-130m decode step at 2 threads, bench/results/decode_profile.md). A late worker cannot take
// a block of a later op by mistake: blocks are claimed by CAS on one word holding (generation,
// next block), and each op's block count and function sit in a slot of their own (two slots,
// alternating: an op's slot is rewritten only two ops later, after this one's word is gone).
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}
constexpr int kSpin = 2000;  // pause iterations (~40 ns each) before sleeping

class Pool {
 public:
  explicit Pool(int n) : n_(n) {
    for (int i = 1; i < n_; ++i) workers_.emplace_back([this] { loop(); });
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_.store(true);
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
  }
  int size() const { return n_; }
  // Workers stop spinning once the job they finished is the last one before this call.
  void park() {
    if (workers_.empty()) return;
    park_gen_.store(generation_.load(std::memory_order_acquire), std::memory_order_release);
  }

  void run(int64_t n, const std::function<void(int64_t)>& f) {
    if (n_ <= 1 || n <= 1 || busy_.exchange(true)) {
      // Serial when single-threaded, trivial, or nested inside another parallel_for.
      for (int64_t i = 0; i < n; ++i) f(i);
      return;
    }
    // The claim word holds 32 bits of block index: larger ops go in pieces.
    for (int64_t off = 0; off < n; off += kMaxBlocks) {
      const int64_t m = std::min(kMaxBlocks, n - off);
      if (off == 0) {
        run_blocks(m, f);
      } else {
        const std::function<void(int64_t)> g = [&](int64_t i) { f(off + i); };
        run_blocks(m, g);
      }
    }
    busy_.store(false);
  }

 private:
  static constexpr int64_t kMaxBlocks = int64_t{1} << 31;

  void run_blocks(int64_t n, const std::function<void(int64_t)>& f) {
    const uint64_t g = generation_.load(std::memory_order_relaxed) + 1;  // only the caller changes it
    Slot& slot = slots_[g & 1];
    slot.job = &f;
    slot.total.store(n, std::memory_order_relaxed);
    finished_.store(0, std::memory_order_relaxed);
    failed_.store(false, std::memory_order_relaxed);
    claim_.store(static_cast<uint64_t>(static_cast<uint32_t>(g)) << 32, std::memory_order_release);
    generation_.fetch_add(1);  // seq_cst: pairs with sleepers_ (no lost wake-up)
    if (sleepers_.load() > 0) {
      std::lock_guard<std::mutex> lk(mu_);
      cv_.notify_all();
    }
    work();
    for (int i = 0; i < kSpin && finished_.load(std::memory_order_acquire) != n; ++i) cpu_relax();
    if (finished_.load(std::memory_order_acquire) != n) {
      std::unique_lock<std::mutex> lk(mu_);
      caller_waiting_.store(true);  // seq_cst: pairs with the last block's finished_ increment
      done_cv_.wait(lk, [&] { return finished_.load() == n; });
      caller_waiting_.store(false);
    }
    std::exception_ptr e;
    {
      std::lock_guard<std::mutex> lk(mu_);
      std::swap(e, error_);
    }
    if (e) {
      busy_.store(false);
      std::rethrow_exception(e);
    }
  }

  // Claims and runs blocks of the current op until none is left (caller and workers alike).
  void work() {
    for (;;) {
      uint64_t w = claim_.load(std::memory_order_acquire);
      const Slot& slot = slots_[(w >> 32) & 1];
      const int64_t total = slot.total.load(std::memory_order_relaxed);
      const int64_t i = static_cast<int64_t>(w & 0xffffffffu);
      if (i >= total) return;
      // Fails (and retries) if another thread took block i, or a new op replaced the word.
      if (!claim_.compare_exchange_weak(w, w + 1, std::memory_order_acq_rel, std::memory_order_acquire)) continue;
      if (!failed_.load(std::memory_order_relaxed)) {
        try {
          (*slot.job)(i);
        } catch (...) {
          std::lock_guard<std::mutex> lk(mu_);
          if (!error_) error_ = std::current_exception();
          failed_.store(true, std::memory_order_relaxed);  // the remaining blocks are skipped
        }
      }
      if (finished_.fetch_add(1) + 1 == total && caller_waiting_.load()) {
        std::lock_guard<std::mutex> lk(mu_);  // the caller may be between its check and its wait
        done_cv_.notify_one();
      }
    }
  }
  void loop() {
    uint64_t seen = 0;
    for (;;) {
      uint64_t g = generation_.load(std::memory_order_acquire);
      for (int i = 0; i < kSpin && g == seen && !stop_.load(std::memory_order_relaxed) &&
                      park_gen_.load(std::memory_order_acquire) != seen;
           ++i) {
        cpu_relax();
        g = generation_.load(std::memory_order_acquire);
      }
      if (g == seen) {
        std::unique_lock<std::mutex> lk(mu_);
        sleepers_.fetch_add(1);
        cv_.wait(lk, [&] { return stop_.load() || generation_.load() != seen; });
        sleepers_.fetch_sub(1);
        g = generation_.load();
      }
      if (stop_.load()) return;
      seen = g;
      work();
    }
  }

  struct Slot {
    const std::function<void(int64_t)>* job = nullptr;
    std::atomic<int64_t> total{0};
  };

  int n_;
  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  Slot slots_[2];
  std::atomic<uint64_t> claim_{0};  // (low 32 bits of the op's generation) << 32 | next block
  std::atomic<int64_t> finished_{0};  // blocks of the current op done (or skipped after an error)
  std::atomic<bool> failed_{false};
  std::atomic<bool> caller_waiting_{false};
  std::atomic<int> sleepers_{0};
  std::atomic<uint64_t> generation_{0};
  std::atomic<uint64_t> park_gen_{~uint64_t{0}};  // park(): the generation after which to sleep at once
  std::atomic<bool> stop_{false};
  std::atomic<bool> busy_{false};
  std::exception_ptr error_;
};

int configured_threads() {
  if (const char* s = std::getenv("MIXLENS_NUM_THREADS"); s && *s) {
    // A typo would otherwise silently run on every core: refuse it like the other MIXLENS_* settings.
    char* end = nullptr;
    const long n = std::strtol(s, &end, 10);
    if (*end != '\0' || n < 1 || n > 4096)
      throw InputError("MIXLENS_NUM_THREADS='" + std::string(s) + "' must be a whole number of threads in 1..4096");
    return static_cast<int>(n);
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

void parallel_for(int64_t n, const std::function<void(int64_t)>& f) {
  // The workers run the blocks under the caller's deterministic() (a linear or gemm inside a block).
  const int det = tl_deterministic;
  if (det < 0) {
    pool().run(n, f);
    return;
  }
  pool().run(n, [&f, det](int64_t i) {
    const int prev = tl_deterministic;
    tl_deterministic = det;
    f(i);
    tl_deterministic = prev;
  });
}

void parallel_rows(int64_t rows, int64_t row_elems, const std::function<void(int64_t, int64_t)>& f) {
  const int64_t nt = num_threads();
  if (nt <= 1 || rows < 2 || rows * row_elems < (int64_t{1} << 15)) {
    f(0, rows);
    return;
  }
  const int64_t nb = std::min<int64_t>(rows, 2 * nt), per = (rows + nb - 1) / nb;
  parallel_for(nb, [&](int64_t i) {
    const int64_t r0 = i * per, r1 = std::min(rows, r0 + per);
    if (r0 < r1) f(r0, r1);
  });
}
int num_threads() { return pool().size(); }
void park_threads() { pool().park(); }

}  // namespace mixlens::ops
