// The skeleton shared by the pure state-space language models (Mamba-1 "mamba", Mamba-2 "mamba2"):
// embeddings -> blocks of h += mixer(RMSNorm(h)) -> final RMSNorm -> lm_head, a cache of one conv
// window and one SSM state per layer, kernel routing, the value table, and the state_input /
// state_output sites. A family file supplies only its mixer (model-math.md §3.1, §3.2).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "mixers/mamba2_mixer.h"
#include "mixers/mamba_mixer.h"
#include "models/family.h"

namespace mixlens::detail {

struct SsmCache : CacheState {
  bool has_state = false;    ///< a forward call has run: conv windows and states are live
  std::vector<Tensor> conv;  ///< per layer [B, K, conv channels]: last K pre-conv inputs, oldest first
  std::vector<Tensor> ssm;   ///< per layer, in the family's kernel layout
  std::unique_ptr<CacheState> clone() const override {
    auto c = std::make_unique<SsmCache>(*this);
    deep_copy(c->conv);
    deep_copy(c->ssm);
    return c;
  }
};

/// What the backward (src/grad/ssm_lm_grad.cpp) reads of a loaded SSM LM: the tensors around the
/// blocks and the blocks' mixer, exactly one kind set (pointers into the model).
struct SsmLmParts : BackwardParts {
  const Tensor* norm_f = nullptr;
  const Tensor* lm_head = nullptr;
  const std::vector<Tensor>* norms = nullptr;  ///< per layer [D]
  float eps = 1e-5f;
  int64_t D = 0, L = 0, V = 0;
  const MambaMixer* mamba = nullptr;  ///< Mamba-1, with its layers' weights
  const std::vector<MambaMixerWeights>* mamba_layers = nullptr;
  const Mamba2Mixer* mamba2 = nullptr;  ///< Mamba-2, with its layers' weights
  const std::vector<Mamba2MixerWeights>* mamba2_layers = nullptr;
};

class SsmLm : public FamilyModel {
 public:
  std::unique_ptr<CacheState> new_cache(int64_t batch) const override;
  /// route_kernels(family) when forced; else "recurrent" for a one-token call over a cached
  /// state (decode) and prompt_kernel() otherwise.
  std::string kernel_for(const CacheState& cache, int64_t seq) const override;
  Tensor forward(const Batch& batch, CacheState& cache, Listener* listener, const CallCtx& ctx,
                 bool all_logits) const override;
  std::vector<ValueInfo> values(int64_t B, int64_t T) const override;
  std::map<std::string, std::map<int, std::string>> support() const override;
  Head head() const override { return {&embed_, &norm_f_, &lm_head_, eps_, false}; }

 protected:
  /// Reads the fields and tensors every SSM LM has (hidden_size, num_hidden_layers, vocab_size,
  /// conv_kernel, layer_norm_epsilon, tie_word_embeddings with `tie_default` when absent; the
  /// embeddings under either HF name, norm_f, per-layer norm, lm_head when untied).
  void load_backbone(const io::Config& cfg, const io::WeightStore& w, const std::string& family, bool tie_default);
  /// The backbone's parts (the family's backward_parts() adds its mixer).
  std::unique_ptr<SsmLmParts> backbone_parts() const {
    auto p = std::make_unique<SsmLmParts>();
    p->norm_f = &norm_f_;
    p->lm_head = &lm_head_;
    p->norms = &norms_;
    p->eps = eps_;
    p->D = D_;
    p->L = L_;
    p->V = V_;
    return p;
  }

  /// One mixer call on the normed block input n [B,T,D]; returns what is added to the residual.
  virtual Tensor mixer(int layer, const Tensor& n, const Batch& in, SsmCache& cache, Listener* ls,
                       const CallCtx& ctx) const = 0;
  /// The linear_attn values of `layer`, in forward order.
  virtual void mixer_values(int layer, int64_t B, int64_t T, std::vector<ValueInfo>& out) const = 0;
  /// Channels of the conv window and the shape of one row's SSM state (kernel layout).
  virtual int64_t conv_channels() const = 0;
  virtual Shape ssm_state_shape() const = 0;
  /// One row's state as served (values.md: key side first); the kernel layout by default.
  virtual Shape served_state_shape() const { return ssm_state_shape(); }
  /// Kernel layout <-> served layout. Identity by default.
  virtual Tensor served_state(const Tensor& S) const { return S.clone(); }
  virtual void store_served_state(const Tensor& served, Tensor& S) const;
  /// The algorithm a call without a cached state (or a multi-token continuation) uses.
  virtual std::string prompt_kernel(int64_t seq) const;

  /// Zeroes the layer's state on a fresh call, then serves state_input (None when fresh) and
  /// lays a written value back into the cache. Returns the kernel-layout state to scan from.
  Tensor& begin_state(int layer, SsmCache& cache, Listener* ls) const;
  /// Serves state_output from the cache and lays a written value back (the next call sees it).
  void end_state(int layer, SsmCache& cache, Listener* ls) const;

  std::string family_;
  int64_t D_ = 0, L_ = 0, V_ = 0, K_ = 0;
  float eps_ = 1e-5f;
  Tensor embed_, norm_f_, lm_head_;
  std::vector<Tensor> norms_;  // per layer [D]
};

}  // namespace mixlens::detail
