// The cache of a hybrid LM whose blocks are recurrent mixers or softmax attention (Qwen3.5,
// Qwen3-Next, Nemotron-H, Bamba, Falcon-H1): the same state and the same position rule for all of
// them, so one struct.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "mixers/attention_mixer.h"
#include "models/family.h"

namespace mixlens::detail {

struct HybridCache : CacheState {
  bool has_state = false;
  std::vector<Tensor> conv;  ///< mixer layers: [B, K, conv channels], the last K pre-conv inputs
  std::vector<Tensor> ssm;   ///< mixer layers: [B, state row...] in the mixer's kernel layout
  std::vector<KvCache> kv;   ///< attention layers
  std::vector<std::vector<uint8_t>> key_mask;  ///< per row: 1 for every real token seen
  std::vector<int64_t> real_seen;              ///< per row: real tokens seen (next position id)

  /// An empty cache of `batch` rows: every layer with is_mixer[i] gets zero conv / state tensors.
  HybridCache(int64_t batch, const std::vector<bool>& is_mixer, int64_t conv_kernel, int64_t conv_channels,
              const Shape& state_row);
  std::unique_ptr<CacheState> clone() const override;
  /// Position ids of the call as transformers' generate builds them (cumsum(mask) - 1 over real
  /// tokens, 0 at padding), continuing from each row's real-token count; appends the call's mask
  /// to key_mask so padding stays out of every later attention call.
  std::vector<int64_t> advance_positions(const Batch& in);
  /// Attention layer `layer`'s mixer call over this cache (its KV cache, the key mask) at the call's
  /// positions `pos` (advance_positions' result, which must outlive the call).
  AttentionMixerCall attention_call(int layer, const std::vector<int64_t>& pos, Listener* ls);
};

/// route_kernels(family) when forced; otherwise "recurrent" for a one-token call over a cached
/// state (a decode step) and "chunked" for prompts and continuations.
std::string hybrid_kernel(const std::string& family, const CacheState& cache, int64_t seq);

}  // namespace mixlens::detail
