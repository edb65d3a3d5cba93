// Internal interface every model family implements (one file per family in src/models/).
#pragma once
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "hooks/listener.h"
#include "io/json.h"
#include "io/weights.h"
#include "mixlens/model.h"

namespace mixlens::grad {
struct Tape;
class GradSink;
}  // namespace mixlens::grad

namespace mixlens::detail {

/// Per-batch cached state of one model; families extend it.
struct CacheState {
  virtual ~CacheState() = default;
  /// A deep, independent copy of the same dynamic type (every tensor cloned; Tensor copies share
  /// storage). Every derived cache overrides it: Cache::copy refuses a copy of another type (a
  /// derived cache that forgot the override would be sliced).
  virtual std::unique_ptr<CacheState> clone() const = 0;
  int64_t batch = 0;
  int64_t seen = 0;   ///< tokens consumed
  int steps = 0;      ///< forward calls made

 protected:
  /// Replaces every defined tensor of `ts` by an independent copy (for clone()).
  static void deep_copy(std::vector<Tensor>& ts) {
    for (Tensor& t : ts)
      if (t.defined()) t = t.clone();
  }
};

/// What a skeleton's backward reads of a loaded model (pointers into it). Each skeleton header
/// derives its own (SsmLmParts, Mamba2HybridParts, QwenHybridParts); src/grad/backward.cpp picks the
/// backward by that type, so models/ never includes grad/ (docs/architecture.md).
struct BackwardParts {
  virtual ~BackwardParts() = default;
};

class FamilyModel {
 public:
  virtual ~FamilyModel() = default;
  ModelInfo info;

  virtual std::unique_ptr<CacheState> new_cache(int64_t batch) const = 0;
  /// The recurrent algorithm this call will use (decided before any value is visited).
  virtual std::string kernel_for(const CacheState& cache, int64_t seq) const = 0;
  /// One forward call; returns logits [B,T,V] (or [B,1,V] when !all_logits and nobody wants
  /// the full logits). `listener` may be null.
  virtual Tensor forward(const Batch& batch, CacheState& cache, Listener* listener, const CallCtx& ctx,
                         bool all_logits) const = 0;
  /// Every value for a call of B rows and T tokens, in forward order.
  virtual std::vector<ValueInfo> values(int64_t B, int64_t T) const = 0;
  /// values(1, 1) with its paths indexed, built once (thread-safe): every Session and every path
  /// lookup rebuilt it, ~0.1 ms of each trace of a 24-layer model.
  struct ValueTable {
    struct PathHash {  // looks a std::string_view up without making a string
      using is_transparent = void;
      size_t operator()(std::string_view p) const noexcept { return std::hash<std::string_view>{}(p); }
    };
    std::vector<ValueInfo> values;  ///< values(1, 1), forward order
    std::unordered_map<std::string, size_t, PathHash, std::equal_to<>> at;  ///< path -> index in `values`
    std::vector<int> at_site;  ///< slot(site) -> index in `values`, -1 if absent
    static size_t slot(Site s) { return static_cast<size_t>((s.layer + 1) * kNumValues + static_cast<int>(s.value)); }
  };
  const ValueTable& value_table() const;
  /// values.md support(): value name -> per layer reason ("" when available).
  virtual std::map<std::string, std::map<int, std::string>> support() const = 0;
  /// Gated DeltaNet: value heads per key head (linear_num_value_heads / linear_num_key_heads), 1 for
  /// every other mixer. TransformerLens names q / k before that repetition (docs/transformer_lens.md).
  virtual int64_t key_head_repeat() const { return 1; }
  /// Model::set_chunk_size (range already checked): the chunked kernel's chunk length, 0 = the
  /// default. A family whose chunk is fixed refuses any other length (never a silent no-op).
  virtual void set_chunk_size(int64_t c) {
    if (c != 0)
      throw UnsupportedError("set_chunk_size(" + std::to_string(c) + "): " + info.family +
                             " has no settable chunk length; per-token states are served on any chunk");
  }
  /// Where betas and decays are two views of one dt (Mamba: betas = dt, decays = A*dt): the betas
  /// the forward will use after `decays` [B,T,...] of `layer` is written over `betas_before`
  /// (read-after-write in a Session). WriteError when the write implies no dt. Undefined where
  /// betas does not depend on decays (gated DeltaNet).
  virtual Tensor betas_for_decays(int layer, const Tensor& betas_before, const Tensor& decays) const {
    (void)layer, (void)betas_before, (void)decays;
    return Tensor();
  }

  /// The weights of layer `layer`'s mixer that token_mixing (include/mixlens/mixing.h) reads besides
  /// the served values; each undefined where the kind has none.
  struct MixerConsts {
    Tensor skip;       ///< Mamba-2's D [H], Mamba-1's D [E]: attention_head_outputs add skip * values
    Tensor conv_wT;    ///< LFM2's short conv taps [K, D] (index K-1 = the token's own)
    Tensor conv_bias;  ///< LFM2's conv bias [D] (conv_bias)
    Tensor bonus;      ///< RWKV-4's time_first [A]
    float eps = 0.0f;  ///< mLSTM's eps (added to the read's denominator)
  };
  virtual MixerConsts mixer_consts(int layer) const {
    (void)layer;
    return {};
  }

  /// The LM head around the blocks, for nnterp's project_on_vocab and read access to the weights
  /// (Model::project_on_vocab, Model::head_weight). Pointers into the family's own tensors.
  struct Head {
    const Tensor* embed = nullptr;    ///< [V, D] token embeddings
    const Tensor* norm = nullptr;     ///< [D] final RMSNorm weight
    const Tensor* lm_head = nullptr;  ///< [V, D] unembedding (the embedding when tied)
    float eps = 1e-5f;
    bool zero_centred = false;        ///< Qwen's RMSNorm scales by (1 + w)
    float logit_scale = 1.0f;         ///< Falcon-H1's lm_head_multiplier (logits = lm_head(h) * scale)
  };
  /// UnsupportedError by default, so a family that has not declared its head never projects
  /// with a wrong norm.
  virtual Head head() const;

  /// The head's last step, ln_final.output x -> served logits: z = logit_scale * lm_head(x), then
  /// soft_cap * tanh(z / soft_cap) when soft_cap > 0 (RecurrentGemma, xLSTM). What logits_at forms for a
  /// metric (attribution patching); declared apart from head() because it needs no final norm (RWKV's is
  /// a LayerNorm). Default: head()'s lm_head and scale, UnsupportedError when the family has no head().
  struct Unembed {
    const Tensor* lm_head = nullptr;  ///< [V, D]
    float logit_scale = 1.0f;
    float soft_cap = 0.0f;
  };
  virtual Unembed unembed() const;

  /// How block `layer` changes the residual stream, for decompose_resid (runtime/attribution.cpp): when
  /// `why` is empty, layer_output = scale * (layer_input + the sum of the `added` values of the block);
  /// otherwise `why` says why not, and the block is one component (layer_output - layer_input).
  struct ResidualWrite {
    std::vector<std::string> added;  ///< paths after "layers.{i}." ("linear_attn.attention_output", "mlp.output")
    float scale = 1.0f;
    std::string why;
  };
  /// Default: the block adds whichever of linear_attn.attention_output, self_attn.attention_output and
  /// mlp.output it serves (runtime/attribution.cpp). A family whose blocks differ overrides it.
  virtual ResidualWrite residual_write(int layer) const;

  /// The parts its skeleton's backward reads; null (the default) for a skeleton without one.
  virtual std::unique_ptr<BackwardParts> backward_parts() const { return nullptr; }
  /// Trace::backward (issue 12, docs/gradients.md): given dMetric/dLogits of the call recorded in
  /// `tape`, puts the gradient of every value `sink` asks for. Defined in src/grad/backward.cpp: runs
  /// the backward of backward_parts()' skeleton when the registry line says the family has one;
  /// UnsupportedError naming the family otherwise, so a family never returns wrong gradients.
  void backward(const grad::Tape& tape, const Tensor& dlogits, grad::GradSink& sink) const;

 private:
  mutable std::once_flag table_once_;
  mutable std::unique_ptr<const ValueTable> table_;
};

// The factories and the model_type registry: models/registry.h.

}  // namespace mixlens::detail
