// Pieces shared by the model families: embedding lookup, LM head, support tables. Config checks
// live in models/config.h, value serving (row masks, state sites, finite watch) in hooks/serve.h.
#pragma once
#include <functional>
#include <initializer_list>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "hooks/listener.h"
#include "hooks/serve.h"
#include "io/json.h"
#include "io/weights.h"
#include "mixlens/model.h"
#include "models/config.h"
#include "models/family.h"

namespace mixlens::detail {

/// The first of `names` present in the checkpoint, checked against `shape`.
Tensor load_embedding(const io::WeightStore& w, std::initializer_list<const char*> names, const Shape& shape);
/// Embedding rows for the batch's ids; InputError for an id outside [0, vocab).
Tensor embed_tokens(const Tensor& embed, const Batch& in, const char* family);

/// Final logits: [B,T,V] when all_logits or someone wants them, else [B,1,V] (last position).
/// soft_cap > 0: logits = soft_cap * tanh(logits / soft_cap) before they are served (RecurrentGemma).
Tensor lm_logits(const Tensor& lm_head, const Tensor& h, Listener* ls, bool all_logits, float soft_cap = 0.0f);
/// support() entries for the per-token state methods (state_after, set_state_after): as "state".
void add_state_methods(std::map<std::string, std::map<int, std::string>>& s);
/// token_mixing / state_input_mixing (issue 26): a block whose values do not list them in `table` (no
/// recurrent mixer: every recurrent kind serves them) gets a reason naming its kind, unless the family gave one.
void add_mixing_support(std::map<std::string, std::map<int, std::string>>& s, const ModelInfo& info,
                        const FamilyModel::ValueTable& table);
/// Model::support(): the family's support() with the per-token state methods and the token mixing
/// reasons added (what path resolution and Model::support both read).
std::map<std::string, std::map<int, std::string>> served_support(const FamilyModel& family);

/// The cache of a family whose every layer keeps one flat state row per sequence (RWKV-4, xLSTM): per layer
/// [B, row_numel], served as is at state_input / state_output (copies; a write laid back in place).
struct RowStateCache : CacheState {
  bool has_state = false;
  std::vector<Tensor> state;  ///< per layer [B, row_numel]
  /// `layers` zeroed [batch, row_numel] rows.
  RowStateCache(int64_t batch, int64_t layers, int64_t row_numel);
  std::unique_ptr<CacheState> clone() const override;
  /// Checks a written state [B, row_numel] before it is stored (`what`: "state_input" / "state_output");
  /// raises WriteError for a state outside the kind's domain (RWKV-4: a negative den). Optional.
  using WriteCheck = std::function<void(const Tensor& written, const char* what)>;
  /// Serves layer `li`'s state_input (None while !has_state) and returns the live state the call updates.
  Tensor& begin_state(int li, Listener* ls, const WriteCheck& check = {});
  /// Serves layer `li`'s state_output.
  void end_state(int li, Listener* ls, const WriteCheck& check = {});
};

/// ModelInfo of a model of `layers` blocks of one kind (RWKV-4, xLSTM): family, the config's model_type, sizes.
void one_kind_info(ModelInfo& info, const io::Config& cfg, const char* family, int64_t layers, int64_t hidden,
                   int64_t vocab, LayerKind kind);

/// support() for a model whose every block is one recurrent mixer: everything available,
/// self_attn values unavailable with the reason.
std::map<std::string, std::map<int, std::string>> mixer_only_support(int num_layers, const std::string& family);

/// Group-limited top-k expert choice (NemotronHMoE, KimiLinearTopkRouter): choice = scores [E] +
/// bias [E] (e_score_correction_bias); the E experts split into n_group groups, ranked by the sum of
/// their two best choices (the best alone with one expert per group), the topk_group best kept; the
/// topk best choices among those, best first, ties to the lower index (torch.topk's order).
std::vector<int64_t> group_limited_topk(const float* scores, const float* bias, int64_t E, int64_t n_group,
                                        int64_t topk_group, int64_t topk);

}  // namespace mixlens::detail
