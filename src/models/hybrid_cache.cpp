#include "models/hybrid_cache.h"

namespace mixlens::detail {

HybridCache::HybridCache(int64_t rows, const std::vector<bool>& is_mixer, int64_t conv_kernel,
                         int64_t conv_channels, const Shape& state_row) {
  batch = rows;
  const size_t L = is_mixer.size();
  conv.resize(L);
  ssm.resize(L);
  kv.resize(L);
  Shape st{rows};
  st.insert(st.end(), state_row.begin(), state_row.end());
  for (size_t i = 0; i < L; ++i)
    if (is_mixer[i]) {
      conv[i] = Tensor({rows, conv_kernel, conv_channels});
      ssm[i] = Tensor(st);
    }
  key_mask.resize(static_cast<size_t>(rows));
  real_seen.assign(static_cast<size_t>(rows), 0);
}

std::unique_ptr<CacheState> HybridCache::clone() const {
  auto c = std::make_unique<HybridCache>(*this);  // KV entries, masks, counters: value copies
  deep_copy(c->conv);
  deep_copy(c->ssm);
  return c;
}

std::vector<int64_t> HybridCache::advance_positions(const Batch& in) {
  const int64_t B = in.batch, T = in.seq;
  std::vector<int64_t> pos(static_cast<size_t>(B * T));
  for (int64_t b = 0; b < B; ++b) {
    auto& seen_real = real_seen[static_cast<size_t>(b)];
    for (int64_t t = 0; t < T; ++t) {
      const uint8_t m = in.mask[static_cast<size_t>(b * T + t)];
      pos[static_cast<size_t>(b * T + t)] = m ? seen_real++ : 0;
      key_mask[static_cast<size_t>(b)].push_back(m);
    }
  }
  return pos;
}

std::string hybrid_kernel(const std::string& family, const CacheState& cache, int64_t seq) {
  switch (kernel_route(family)) {
    case KernelRoute::chunked: return "chunked";
    case KernelRoute::recurrent: return "recurrent";
    default: break;
  }
  return static_cast<const HybridCache&>(cache).has_state && seq == 1 ? "recurrent" : "chunked";
}

AttentionMixerCall HybridCache::attention_call(int layer, const std::vector<int64_t>& pos, Listener* ls) {
  AttentionMixerCall call;
  call.layer = layer;
  call.kv = &kv[static_cast<size_t>(layer)];
  call.key_mask = &key_mask;
  call.pos = &pos;
  call.ls = ls;
  return call;
}

}  // namespace mixlens::detail
