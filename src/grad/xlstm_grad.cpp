// Backward of xLSTM's block stack (XlstmModel::forward, transformers xLSTMForCausalLM): the soft-capped
// head, out_norm, then each block from last to first, recomputed from its recorded input:
//   h1 = h0 + mlstm(norm_mlstm(h0)),  h2 = h1 + proj_down(silu(proj_up_gate(x)) * proj_up(x)), x = norm_ffn(h1).
// The state the call starts from (C | n | m) is a constant of the call; its gradient is served as
// state_input's.
#include <algorithm>

#include "grad/ops_grad.h"
#include "grad/qwen_grad.h"
#include "grad/xlstm_grad.h"
#include "models/common.h"
#include "ops/ops.h"

namespace mixlens::grad {

void xlstm_backward(const detail::XlstmParts& p, const Tape& tape, const Tensor& dlogits, GradSink& sink) {
  const int64_t B = tape.batch.batch, T = tape.batch.seq, D = p.D, BT = B * T;
  const int64_t rn = p.mixer->dims().row_numel();
  const Tensor dhf = head_backward(tape, dlogits, *p.lm_head, 1.0f, sink, p.cap);
  Tensor dh({B, T, D});
  rmsnorm_backward(tape.final_hidden.data(), p.out_norm->data(), dhf.data(), dh.data(), BT, D, p.eps, false, false);
  const auto& before = static_cast<const detail::RowStateCache&>(*tape.cache_before);
  const bool chunked = tape.kernel == "chunked";
  MlpView mlp;
  mlp.D = D, mlp.I = p.I;
  Tensor n1({B, T, D}), h1({B, T, D}), n2({B, T, D}), dn({B, T, D}), dx({B, T, D});
  const auto norm = [&](const Tensor& x, const Tensor& w, Tensor& y) {
    ops::rmsnorm(x.data(), w.data(), y.data(), BT, D, p.eps);
  };
  for (int64_t i = p.L - 1; i >= 0; --i) {
    const int li = static_cast<int>(i);
    const size_t si = static_cast<size_t>(i);
    const detail::XlstmBlock& blk = (*p.blocks)[si];
    sink.put(li, Value::layer_output, dh);
    if (!sink.needs_below(li)) return;
    tape.block(li, Value::layer_output, dh);
    const Tensor& h0 = tape.layer_inputs[si];
    norm(h0, blk.norm_mlstm, n1);
    // The state the call started from, with a state_input write applied (a constant of the call).
    Tensor S0 = before.state[si].clone();
    tape.apply(li, Value::state_input, S0);
    MlstmMixerGrad mix(*p.mixer, blk.mlstm, li, n1, S0, chunked, tape);
    const Tensor& att = mix.output();
    for (int64_t k = 0; k < h1.numel(); ++k) h1[k] = h0[k] + att[k];
    norm(h1, blk.norm_ffn, n2);
    Tensor dm = dh.clone();
    sink.put(li, Value::mlp_output, dm);
    tape.block(li, Value::mlp_output, dm);
    mlp.gate_up = &blk.up_gate, mlp.down = &blk.down;
    mlp_backward(mlp, n2, dm, dx);
    rmsnorm_backward(h1.data(), blk.norm_ffn.data(), dx.data(), dh.data(), BT, D, p.eps, false, true);  // dL/dh1
    Tensor dS0({B, rn}), dstates;
    if (sink.wants(li, Value::states)) dstates = Tensor({B, T, rn});
    mix.backward(dh, dn, dS0, dstates, sink);
    rmsnorm_backward(h0.data(), blk.norm_mlstm.data(), dn.data(), dh.data(), BT, D, p.eps, false, true);  // dL/dh0
    if (dstates.defined()) sink.put(li, Value::states, dstates);
    if (sink.wants(li, Value::state_output)) sink.put(li, Value::state_output, Tensor({B, rn}));
    if (before.has_state || tape.write(li, Value::state_input)) sink.put(li, Value::state_input, dS0);
    sink.put(li, Value::layer_input, dh);
    tape.block(li, Value::layer_input, dh);
  }
  sink.put(-1, Value::embed_output, dh);
}

}  // namespace mixlens::grad
