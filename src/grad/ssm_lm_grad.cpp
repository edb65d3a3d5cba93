// Backward of the pure SSM LM skeleton (models/ssm_lm.cpp): LM head, final norm, residual blocks
// recomputed one at a time from their recorded inputs, embeddings.
#include <cstring>
#include <utility>

#include "grad/families.h"
#include "grad/ops_grad.h"
#include "ops/ops.h"

namespace mixlens::grad {

void ssm_lm_backward(const SsmBackbone& bb, const Tape& tape, const Tensor& dlogits, GradSink& sink,
                     const MixerBackward& mixer) {
  const int64_t B = tape.batch.batch, T = tape.batch.seq, D = bb.D, BT = B * T;
  const Tensor dhf = head_backward(tape, dlogits, *bb.lm_head, 1.0f, sink);
  Tensor dh({B, T, D});
  rmsnorm_backward(tape.final_hidden.data(), bb.norm_f->data(), dhf.data(), dh.data(), BT, D, bb.eps, false, false);
  Tensor n({B, T, D}), dn({B, T, D});
  for (int64_t i = bb.L - 1; i >= 0; --i) {
    const int li = static_cast<int>(i);
    sink.put(li, Value::layer_output, dh);
    if (!sink.needs_below(li)) return;  // nothing asked for below: block li's backward would serve nothing
    tape.block(li, Value::layer_output, dh);
    const Tensor& hin = tape.layer_inputs[static_cast<size_t>(i)];
    const Tensor& w = (*bb.norms)[static_cast<size_t>(i)];
    ops::rmsnorm(hin.data(), w.data(), n.data(), BT, D, bb.eps);
    mixer(li, n, dh, dn);
    rmsnorm_backward(hin.data(), w.data(), dn.data(), dh.data(), BT, D, bb.eps, false, true);
    sink.put(li, Value::layer_input, dh);
    tape.block(li, Value::layer_input, dh);
  }
  sink.put(-1, Value::embed_output, dh);
}

}  // namespace mixlens::grad
