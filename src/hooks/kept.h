// What a forward call keeps for its backward (grad::Tape derives from it): the forwards of models/
// and mixers/ hand intermediates over here without seeing the tape, which sits above them (grad/).
#pragma once
#include <map>
#include <utility>

#include "mixlens/tensor.h"

namespace mixlens::grad {

/// Forward intermediates a family may keep for its backward (Tape::keep): the large products the
/// backward would otherwise recompute from the block's input. head_outputs: the Mamba-2 scan's
/// output y as the norm read it (after writes), so the backward need not rerun the scan forward.
/// attn_*: an attention mixer's q_proj output (per head [query | gate] with the gate), k_proj's output
/// before k_norm and RoPE, the values (after writes), the attention output before the sigmoid gate
/// and the mixer's output (after writes).
/// chunk_states: a gated DeltaNet scan's state entering every chunk of 64 tokens (with head_outputs,
/// its o after writes): the backward's checkpoints, so it does not run the scan again.
/// mlp_output: a post-norm block's MLP output (after writes), which its norm's backward reads.
/// embeddings (layer -1): Zamba2's embeddings as its shared blocks read them (after a write).
enum class Kept { in_proj, mlp_gate_up, mixer_output, head_outputs, attn_q_gate, attn_k, attn_v, attn_core, attn_output,
                  chunk_states, mlp_output, embeddings };

struct KeptTensors {
  /// (layer, Kept) -> the forward's own tensor (shared, not copied). What is kept, and why, is the
  /// family's choice (docs/gradients.md "Memory"); a missing entry is recomputed.
  std::map<std::pair<int, int>, Tensor> kept;

  void keep(int layer, Kept what, const Tensor& t) { kept[{layer, static_cast<int>(what)}] = t; }
  /// The kept tensor, or nullptr.
  const Tensor* kept_of(int layer, Kept what) const {
    auto it = kept.find({layer, static_cast<int>(what)});
    return it == kept.end() ? nullptr : &it->second;
  }
};

}  // namespace mixlens::grad
