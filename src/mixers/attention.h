// Softmax attention kernels (the attention mixer's, mixers/attention_mixer.h): partial rotate-half
// RoPE, a per-row KV cache and causal GQA attention with a key padding mask (model-math.md §6.1;
// transformers' sdpa_attention_forward).
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
  /// Keys dropped before row 0 (a sliding window keeps the last ones): kv row j is the row's key
  /// offset + j, whose key_mask entry is key_mask[b][offset + j].
  int64_t offset = 0;
  std::vector<std::vector<float>> k, v;
  /// Appends T tokens per row from k/v [B,T,kv_heads,head_dim].
  void append(const float* kn, const float* vn, int64_t B, int64_t T, int64_t width);
  /// Drops the oldest keys and values until at most n remain (transformers' sliding-window cache
  /// layer keeps sliding_window - 1).
  void keep_last(int64_t n);
};

/// The softmax scale the attention kernels use: `scale` when > 0, else 1/sqrt(d) (SDPA's default).
inline float attention_scale(int64_t d, float scale) {
  return scale > 0.0f ? scale : 1.0f / std::sqrt(static_cast<float>(d));
}

/// Causal GQA softmax attention: query t of row b sits at cache position past + t and attends
/// the cached keys j <= past + t whose key_mask[b][kv.offset + j] is 1 (left padding is masked out)
/// and, with `window` > 0, j > past + t - window (a sliding window of `window` keys, the query's own
/// included: transformers' sliding_window_overlay).
/// q [B,T,H,d] (RoPE applied), out [B,T,H,d]. Query head h reads KV head h / (H / Hkv).
/// A query with no visible key (a padded position of a left-padded row) gets 0, as torch's SDPA
/// (safe softmax) returns for a fully masked row.
/// `probs` (nullptr unless asked for): the softmax weights [B,H,T,past+T], 0 for masked and future
/// keys (transformers' eager attention weights, nnterp's attention_probabilities). The output is
/// always flash_causal_attention's (reading the probabilities never changes it); with `probs`, an
/// explicit per-query softmax materializes the weights as well.
/// `scale`: the softmax scale (attention_scale: 0 is 1/sqrt(d)).
void causal_attention(const float* q, int64_t B, int64_t T, int64_t H, int64_t Hkv, int64_t d, int64_t past,
                      const KvCache& kv, const std::vector<std::vector<uint8_t>>& key_mask, float* out,
                      float* probs = nullptr, float scale = 0.0f, int64_t window = 0);

/// The attention output, tiled (flash-attention style): per query tile and head, key tiles of
/// scores (register-blocked dots, ops/tile_kernels.h), an online softmax (running max and sum,
/// rescaling the partial output) and O += P V; no [T, T] matrix. Each query's
/// result depends only on its inputs (not on T, past, the tiling or the masked keys before the
/// row's first real key: key tiles start there), so a prompt split into calls, or a row alone and
/// behind any left padding, gives bitwise the same outputs. Same results as the explicit softmax to float32 rounding.
void flash_causal_attention(const float* q, int64_t B, int64_t T, int64_t H, int64_t Hkv, int64_t d, int64_t past,
                            const KvCache& kv, const std::vector<std::vector<uint8_t>>& key_mask, float* out,
                            float scale = 0.0f, int64_t window = 0);

}  // namespace mixlens::detail
