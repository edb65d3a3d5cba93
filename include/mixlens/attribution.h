// Residual-stream decomposition, direct logit attribution and attribution patching (issue 26 items 2
// and 3; docs/attribution.md). TransformerLens's ActivationCache.decompose_resid / accumulated_resid /
// apply_ln_to_stack / logit_attrs, and Nanda's attribution patching (AtP), over every family.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "mixlens/grad.h"
#include "mixlens/model.h"
#include "mixlens/tensor.h"

namespace mixlens {

/// Residual-stream pieces of one forward at chosen call positions.
struct ResidStack {
  /// decomposed: pieces that sum to the residual entering the final norm (decompose_resid);
  /// accumulated: the residual itself after the embedding and after each block (accumulated_resid).
  enum class Kind { decomposed, accumulated };
  Kind kind = Kind::decomposed;
  Tensor components;                ///< [C, B, P, hidden] float32
  /// One per component. decomposed: "embed", "layers.{i}.linear_attn", "layers.{i}.self_attn",
  /// "layers.{i}.mlp", or "layers.{i}" for a block whose change of the residual is not a sum of
  /// served values (FamilyModel::ResidualWrite::why); accumulated: "embed", "layers.0", ... "layers.{L-1}".
  std::vector<std::string> labels;
  /// The value each component was read from ("layers.3.mlp.output"; a whole block:
  /// "layers.3.layer_output - layers.3.layer_input"; the embedding: "layers.0.layer_input").
  std::vector<std::string> sources;
  std::vector<int> layers;          ///< block of each component, -1 for the embedding
  std::vector<int64_t> positions;   ///< the call positions of axis 2 (>= 0)
  Tensor resid;                     ///< [B, P, hidden] the residual stream entering the final norm, as the forward had it
  Tensor logits;                    ///< [B, P, vocab] the forward's logits at `positions`
  /// decomposed: max over (row, position) of |sum of components - resid| / |resid| (L2 norms).
  double max_rel_error = 0.0;
};

/// TransformerLens's decompose_resid: the residual stream entering the final norm at `positions` (call
/// positions, negative from the end) of `batch`'s forward, split into the embedding (the residual
/// entering block 0) and each block's mixer / attention / MLP output as added to the residual
/// (linear_attn.attention_output, self_attn.attention_output, mlp.output), each multiplied by the
/// residual scalings after it (RWKV's halving every rescale_every blocks). A block whose change is not
/// a sum of those values (MiniMax's re-normed residual, OLMo-Hybrid's post-norm attention blocks, RWKV's
/// pre_ln on block 0) is one component, layer_output - layer_input. The sum is checked against the
/// forward's residual: Error when it is off by more than 1e-4 relative (a wrong rule, never silent).
/// InputError on a position outside the call or an empty list.
ResidStack decompose_resid(const Model& model, const Batch& batch, const std::vector<int64_t>& positions);
/// TransformerLens's accumulated_resid: the residual stream at `positions` entering block 0 ("embed")
/// and leaving each block ("layers.{i}", layers.{i}.layer_output): [L + 1, B, P, hidden]; the last is
/// `resid`. For logit-lens curves (logit_attrs with LnMode::exact).
ResidStack accumulated_resid(const Model& model, const Batch& batch, const std::vector<int64_t>& positions);

/// How the final norm is applied to a stack's pieces.
enum class LnMode {
  /// TransformerLens's apply_ln_to_stack: every piece is divided by the norm scale of the real residual
  /// `resid` (sqrt(mean(resid^2) + eps) for the RMSNorm heads) and multiplied by the norm weight; the
  /// norm is then linear, and a decomposition's attributions sum exactly to the logit.
  frozen,
  /// decomposed: a component's attribution is logit(resid) - logit(resid - component), the change of
  /// the logit when the component is removed from the final residual with the norm recomputed (later
  /// blocks not re-run: the direct effect); accumulated: logit(piece), the logit lens (the real norm
  /// applied to each partial residual, as project_on_vocab).
  exact
};

/// The final norm applied to every piece of `stack` with its scale frozen at `resid`'s (LnMode::frozen):
/// [C, B, P, hidden]. UnsupportedError for a family whose head project_on_vocab does not declare (RWKV's
/// LayerNorm with bias, xLSTM's and RecurrentGemma's soft-capped logits).
Tensor apply_ln_to_stack(const Model& model, const ResidStack& stack);

/// Direct logit attribution (TransformerLens's logit_attrs): [C, B, P], each piece's contribution to the
/// logit of `tokens` (one id, or one per row), minus that of `incorrect` (the same sizes; empty: none), through
/// the final norm and the LM head (times Falcon-H1 / Granite's logit scale) as `mode` says.
/// InputError on a token outside the vocabulary or a list of the wrong size; UnsupportedError as
/// apply_ln_to_stack.
Tensor logit_attrs(const Model& model, const ResidStack& stack, const std::vector<int32_t>& tokens,
                   const std::vector<int32_t>& incorrect = {}, LnMode mode = LnMode::frozen);

/// A scalar metric of logits [B, P, vocab] at the metric's call positions, with its gradient.
using LogitsMetric = std::function<metrics::MetricGrad(const Tensor& logits)>;

/// Options of attribution_patching.
struct AtpOptions {
  /// Node kinds, per layer where the value exists: "layer_output", "linear_attn.attention_output",
  /// "self_attn.attention_output", "mlp.output", and "linear_attn.state" (the state after token p,
  /// state_after(p), of every recurrent layer that serves per-token states).
  std::vector<std::string> nodes = {"layer_output", "linear_attn.attention_output", "self_attn.attention_output",
                                    "mlp.output", "linear_attn.state"};
  std::vector<int64_t> positions;         ///< call positions of the nodes; empty: every position
  std::vector<int64_t> metric_positions;  ///< the positions the metric reads; empty: the last one
  /// 0: AtP, the gradient at the corrupt run. k >= 1: EAP-IG, the gradient averaged over k inputs
  /// corrupt + (j / k)(clean - corrupt), j = 1..k, interpolated at the embeddings (Hanna et al. 2024;
  /// Marks et al.'s integrated-gradients AtP).
  int ig_steps = 0;
};

/// Node attribution patching (Nanda 2023, "Attribution patching"; Syed et al. 2023): for each node n at
/// position p, estimate = sum over its elements of (clean_n - corrupt_n) * dMetric/dn at the corrupt run,
/// the first-order estimate of metric(corrupt with n patched to its clean value) - metric(corrupt).
struct AtpResult {
  std::vector<std::string> nodes;   ///< value paths without "@t" ("layers.3.mlp.output", "layers.1.linear_attn.state")
  std::vector<int> layers;          ///< block of each node
  std::vector<int64_t> positions;   ///< call positions of axis 2
  Tensor estimates;                 ///< [N, B, P] float32
  double clean_metric = 0.0, corrupt_metric = 0.0;
  /// One row of the ranked table: a node at a position, summed over the rows of the batch.
  struct Row {
    std::string node;
    int64_t position = 0;
    double estimate = 0.0;
  };
  /// Every (node, position), summed over the rows, ordered by |estimate| descending (ties: node order).
  std::vector<Row> ranked() const;
};

/// AtP (or EAP-IG with options.ig_steps) of `metric` between `clean` and `corrupt` (batches of one shape
/// and one padding). Runs one forward of each and one backward per gradient point. Errors: InputError
/// (shapes differ, a position outside the call, an unknown node kind), UnsupportedError (a family
/// without a backward), the metric's own.
AtpResult attribution_patching(const Model& model, const Batch& clean, const Batch& corrupt,
                               const LogitsMetric& metric, const AtpOptions& options = {});

}  // namespace mixlens
