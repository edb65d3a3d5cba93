#include "hooks/serve.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "mixlens/errors.h"

namespace mixlens::detail {

namespace {
// Index of the first NaN / inf in p[0, n) (with `huge`: or |x| >= 2^64), or -1. Blocks are screened
// with an integer OR over the exponent bits (vectorizes without -ffast-math, unlike a float test);
// only a hit is located.
int64_t first_non_finite(const float* p, int64_t n, bool huge = false) {
  constexpr int64_t kBlock = 4096;
  const uint32_t limit = huge ? (127u + 64u) << 23 : 0x7f800000u;  // biased exponent of 2^64 / of inf
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t e = std::min(n, b + kBlock);
    uint32_t hit = 0;
    for (int64_t i = b; i < e; ++i) {
      uint32_t bits;
      std::memcpy(&bits, p + i, sizeof bits);
      hit |= static_cast<uint32_t>((bits & 0x7f800000u) >= limit);
    }
    if (hit)
      for (int64_t i = b; i < e; ++i)
        if (!(std::fabs(p[i]) < (huge ? 0x1p64f : INFINITY))) return i;
  }
  return -1;
}
}  // namespace

void FiniteWatch::check(int layer, Value v, const Tensor& t) {
  if (!first_.empty() || !t.defined()) return;
  const float* p = t.begin();
  // |x| >= 2^64 counts too: no real activation comes near it, and beyond it float32 sums absorb
  // every later addition and norms' squares overflow (a 3e38 residual in RWKV-4 gave finite logits).
  const int64_t bad = first_non_finite(p, t.numel(), true);
  if (bad < 0) {
    last_finite_ = Site{layer, v};  // its path only for the message (every layer passes here)
    return;
  }
  const std::string path = site_path({layer, v});
  // Row-major index -> coordinates, for the message.
  std::string at;
  int64_t rest = bad;
  std::vector<int64_t> idx(t.shape().size());
  for (size_t d = t.shape().size(); d-- > 0;) {
    idx[d] = rest % t.shape()[d];
    rest /= t.shape()[d];
  }
  for (size_t d = 0; d < idx.size(); ++d) at += (d ? ", " : "") + std::to_string(idx[d]);
  const float x = p[bad];
  char mag[32];
  std::snprintf(mag, sizeof mag, "%.3g", static_cast<double>(x));
  first_ = path + " = " + (std::isnan(x) ? "NaN" : std::isinf(x) ? (x > 0 ? "inf" : "-inf") : mag) + " at [" + at + "]" +
           (std::isfinite(x) ? " (finite, but |x| >= 2^64 is beyond float32's reach for sums and norms)" : "");
}

void FiniteWatch::finish(const Tensor& logits) const {
  const float* p = logits.begin();
  int64_t bad = 0;
  if (first_non_finite(p, logits.numel()) >= 0)
    for (int64_t i = 0; i < logits.numel(); ++i) bad += !std::isfinite(p[i]);
  // Also when the logits computed stayed finite (e.g. only the last position's): the NaN is in the
  // cache or in values that full logits would show, so the call's results are not trustworthy.
  if (bad == 0 && first_.empty()) return;
  std::string msg = bad ? family_ + ": forward produced non-finite logits (" + std::to_string(bad) + " of " +
                              std::to_string(logits.numel()) + " entries are NaN or inf)"
                        : family_ + ": forward produced a non-finite or out-of-range value (the logits computed stayed finite)";
  if (!first_.empty()) {
    msg += "; the first non-finite value was " + first_;
    if (last_finite_) msg += " (" + site_path(*last_finite_) + " before it was finite)";
  } else {
    msg += "; every value checked before the lm_head was finite (the final norm or the logits overflowed float32)";
  }
  msg += ". A written value or input of extreme magnitude (e.g. 3e38) overflows float32; check the edits of this call";
  throw NumericError(msg);
}

Tensor masked_input(const Tensor& x, const Batch& in, bool masked) {
  if (!masked) return x;
  Tensor m = x.clone();
  apply_row_mask(m, in);
  return m;
}

void apply_row_mask(Tensor& t, const Batch& in) {
  const int64_t rows = in.batch * in.seq;
  const int64_t width = t.numel() / rows;
  float* p = t.data();
  for (int64_t r = 0; r < rows; ++r)
    if (!in.mask[static_cast<size_t>(r)]) std::memset(p + r * width, 0, sizeof(float) * static_cast<size_t>(width));
}

std::vector<int64_t> first_real_tokens(const Batch& in) {
  std::vector<int64_t> first(static_cast<size_t>(in.batch), 0);
  if (in.mask.empty()) return first;
  for (int64_t b = 0; b < in.batch; ++b) {
    int64_t t = 0;
    while (t < in.seq && !in.mask[static_cast<size_t>(b * in.seq + t)]) ++t;
    first[static_cast<size_t>(b)] = t;
  }
  return first;
}

ValueInfo global_value(Value v, Shape shape, std::string meaning) {
  ValueInfo i;
  i.site = {-1, v};
  i.path = site_path(i.site);
  i.shape = std::move(shape);
  i.meaning = std::move(meaning);
  return i;
}

ValueInfo layer_value(int layer, Value v, Shape shape, bool per_token, std::string meaning) {
  ValueInfo i;
  i.site = {layer, v};
  i.path = site_path(i.site);
  i.shape = std::move(shape);
  i.per_token = per_token;
  // The token axis is a property of the value: the single-state values have none, states has one
  // (family tables once passed 'writable' here for them).
  if (v == Value::state_input || v == Value::state_output || v == Value::state) i.per_token = false;
  if (v == Value::states) i.per_token = true;
  i.meaning = std::move(meaning);
  return i;
}

void visit_state_input(int li, Tensor& S, bool has_state, Listener* ls, const Shape& served_row,
                       const std::function<Tensor(const Tensor&)>& serve,
                       const std::function<void(const Tensor&, Tensor&)>& store) {
  if (ls && ls->wants(li, Value::state_input)) {
    Tensor served = has_state ? serve(S) : Tensor();
    Shape shape{S.size(0)};
    for (int64_t d : served_row) shape.push_back(d);
    if (ls->visit(li, Value::state_input, served, shape) && served.defined()) store(served, S);
  }
}

void visit_state_output(int li, Tensor& S, Listener* ls, const std::function<Tensor(const Tensor&)>& serve,
                        const std::function<void(const Tensor&, Tensor&)>& store) {
  if (!ls || !ls->wants(li, Value::state_output)) return;
  Tensor served = serve(S);
  if (ls->visit(li, Value::state_output, served, served.shape())) store(served, S);
}

}  // namespace mixlens::detail
