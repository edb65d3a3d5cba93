// Token-to-token mixing (issue 26 item 1, docs/values.md "token_mixing"): the block of a recurrent
// mixer's mixing matrix a caller asks for, and how a mixer serves the token_mixing /
// state_input_mixing values of a call. Each kind computes its block next to its kernels
// (mixers/ssd_mixing.cpp, mixers/gated_delta_mixing.cpp); this header only addresses and serves it.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "hooks/listener.h"
#include "hooks/serve.h"

namespace mixlens::detail {

/// Rows (query tokens) [r0, r1), columns (source tokens) [c0, c1) and heads [h0, h1) of one call's
/// [B, H, T, T] mixing matrix, already resolved against the call (0 <= r0 <= r1 <= T, ...).
struct MixBlock {
  int64_t r0 = 0, r1 = 0, c0 = 0, c1 = 0, h0 = 0, h1 = 0;
  int64_t rows() const { return r1 - r0; }
  int64_t cols() const { return c1 - c0; }
  int64_t heads() const { return h1 - h0; }
  static MixBlock whole(int64_t T, int64_t H) { return {0, T, 0, T, 0, H}; }
};

/// Fills `M` [B, heads, rows, cols] (every element; skipped when null) and, when `Sin` is not null, `Sin`
/// [B, heads, rows, Nk]: the rows of the state_input term (head outputs += Sin @ state_input).
using MixFn = std::function<void(const MixBlock& blk, float* M, float* Sin)>;

/// The token_mixing and state_input_mixing entries of a mixer's values() (read-only, no token axis
/// first: [B,H,T,T] and [B,H,T,Nk]); `skip` says what the head outputs add besides the two products.
inline void add_mixing_values(int layer, int64_t B, int64_t T, int64_t H, int64_t Nk, const std::string& skip,
                              std::vector<ValueInfo>& out) {
  ValueInfo m = layer_value(layer, Value::token_mixing, {B, H, T, T}, false,
                            "exact token-to-token mixing: attention_head_outputs = token_mixing @ attention_values + "
                            "state_input_mixing @ state_input + " + skip + " (derived, computed only when read)");
  ValueInfo s = layer_value(layer, Value::state_input_mixing, {B, H, T, Nk}, false,
                            "the state_input term's rows: head outputs += state_input_mixing @ state_input (the state "
                            "the call starts from, key side first; 0 contribution on a fresh prompt), derived");
  m.writable = s.writable = false;
  out.push_back(std::move(m));
  out.push_back(std::move(s));
}

/// Serves `layer`'s token_mixing [B,H,T,T] and state_input_mixing [B,H,T,Nk] where a listener
/// wants them (read-only, derived: computed only then). Call it after attention_head_outputs.
inline void visit_mixing(Listener* ls, int layer, int64_t B, int64_t T, int64_t H, int64_t Nk, const MixFn& fn) {
  // Each asked for just before its visit: a reader paused at token_mixing may want the other next.
  if (ls && ls->wants(layer, Value::token_mixing)) {
    Tensor M = Tensor::uninitialized({B, H, T, T});
    fn(MixBlock::whole(T, H), M.data(), nullptr);
    ls->visit(layer, Value::token_mixing, M, M.shape());
  }
  if (ls && ls->wants(layer, Value::state_input_mixing)) {
    Tensor Sin = Tensor::uninitialized({B, H, T, Nk});
    fn(MixBlock::whole(T, H), nullptr, Sin.data());
    ls->visit(layer, Value::state_input_mixing, Sin, Sin.shape());
  }
}

}  // namespace mixlens::detail
