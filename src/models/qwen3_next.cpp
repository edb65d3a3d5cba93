// Qwen3-Next (model_type "qwen3_next", Qwen3NextForCausalLM): the Qwen3.5 block stack
// (qwen_hybrid.cpp) with sparse-MoE MLPs and GDN input projections fused per key head:
// in_proj_qkvz rows grouped as [q_g | k_g | v_g (r*Dv) | z_g (r*Dv)] per key head g, in_proj_ba as
// [b_g (r) | a_g (r)] (model-math.md §3.3.2, fix_query_key_value_ordering). They are regrouped at
// load into the shared [q | k | v | z | b | a] order, value head j = g*r + i, so the forward is shared.
#include <cstring>

#include "models/common.h"
#include "models/qwen_hybrid.h"
#include "models/registry.h"
#include "ops/ops.h"

namespace mixlens::detail {

namespace {

ops::RowStack load_fused(const io::WeightStore& w, const std::string& p, const GdnDims& g) {
  const int64_t D = g.D, Dk = g.Dk, r = g.HV / g.HK, rv = r * g.Dv;
  const int64_t group = 2 * Dk + 2 * rv;
  const Tensor qkvz = w.get_matmul(p + "in_proj_qkvz.weight", {g.HK * group, D});
  const Tensor ba = w.get_matmul(p + "in_proj_ba.weight", {g.HK * 2 * r, D});
  // Views of the file's rows in the shared order (no copy): q of every key head, then k, v, z, b, a.
  std::vector<Tensor> parts;
  auto rows = [&](const Tensor& src, int64_t first, int64_t stride, int64_t n) {
    for (int64_t h = 0; h < g.HK; ++h) parts.push_back(row_block(src, h * stride + first, {n, D}));
  };
  rows(qkvz, 0, group, Dk);                // q
  rows(qkvz, Dk, group, Dk);               // k
  rows(qkvz, 2 * Dk, group, rv);           // v: value heads h*r .. h*r+r-1
  rows(qkvz, 2 * Dk + rv, group, rv);      // z
  rows(ba, 0, 2 * r, r);                   // b
  rows(ba, r, 2 * r, r);                   // a
  return ops::RowStack(std::move(parts));
}

}  // namespace

std::unique_ptr<FamilyModel> make_qwen3_next(const io::Config& config, const io::WeightStore& weights) {
  return make_qwen_hybrid(QwenHybridSpec{"qwen3_next", load_fused}, config, config, weights);
}

}  // namespace mixlens::detail
