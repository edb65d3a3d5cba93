// Softmax attention pieces of the hybrid families (Qwen3.5 / Qwen3-Next gated attention): partial
// rotate-half RoPE, a per-row KV cache and causal GQA attention with a key padding mask
// (model-math.md §6.1; transformers Qwen3_5Attention with SDPA).
#pragma once
#include <cmath>
#include <cstdint>
#include <vector>

namespace mixlens::detail {

/// inv_freq[j] = theta^(-2j/R), j < R/2, computed as transformers does (float32).
std::vector<float> rope_inv_freq(int64_t rotary_dim, double theta);

/// Rotate-half RoPE on the first `rotary_dim` dims of every head of x [rows, heads, head_dim] in
/// place; the remaining dims pass through. pos[row] is the token's position id.
void apply_rope(float* x, int64_t rows, int64_t heads, int64_t head_dim, int64_t rotary_dim,
                const int64_t* pos, const std::vector<float>& inv_freq);

/// Keys and values of one attention layer for a batch, per row [len, kv_heads, head_dim].
struct KvCache {
  int64_t len = 0;
  std::vector<std::vector<float>> k, v;
  /// Appends T tokens per row from k/v [B,T,kv_heads,head_dim].
  void append(const float* kn, const float* vn, int64_t B, int64_t T, int64_t width);
};

/// Causal GQA softmax attention: query t of row b sits at cache position past + t and attends
/// the cached keys j <= past + t whose key_mask[b][j] is 1 (left padding is masked out).
/// q [B,T,H,d] (RoPE applied), out [B,T,H,d]. Query head h reads KV head h / (H / Hkv).
/// A query with no visible key (a padded position of a left-padded row) gets 0, as torch's SDPA
/// (safe softmax) returns for a fully masked row.
/// `probs` (nullptr unless asked for): the softmax weights [B,H,T,past+T], 0 for masked and future
/// keys (transformers' eager attention weights, nnterp's attention_probabilities). The output is
/// always flash_causal_attention's (reading the probabilities never changes it); with `probs`, an
/// explicit per-query softmax materializes the weights as well.
/// `scale` multiplies q.k before the softmax; 0 means 1/sqrt(d) (Granite passes attention_multiplier).
void causal_attention(const float* q, int64_t B, int64_t T, int64_t H, int64_t Hkv, int64_t d, int64_t past,
                      const KvCache& kv, const std::vector<std::vector<uint8_t>>& key_mask, float* out,
                      float* probs = nullptr, float scale = 0.0f);

/// The attention output, tiled (flash-attention style): per query tile and head, key tiles of
/// scores (register-blocked dots, ops/tile_kernels.h), an online softmax (running max and sum,
/// rescaling the partial output) and O += P V; no [T, T] matrix. Each query's
/// result depends only on its inputs (not on T, past, the tiling or the masked keys before the
/// row's first real key: key tiles start there), so a prompt split into calls, or a row alone and
/// behind any left padding, gives bitwise the same outputs. Same results as the explicit softmax to float32 rounding.
void flash_causal_attention(const float* q, int64_t B, int64_t T, int64_t H, int64_t Hkv, int64_t d, int64_t past,
                            const KvCache& kv, const std::vector<std::vector<uint8_t>>& key_mask, float* out,
                            float scale = 0.0f);

/// The softmax scale causal_attention uses: `scale`, or 1/sqrt(d) when it is 0.
inline float attention_scale(float scale, int64_t d) { return scale != 0.0f ? scale : 1.0f / std::sqrt(static_cast<float>(d)); }

}  // namespace mixlens::detail
