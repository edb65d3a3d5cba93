// Backward of the pure SSM LM skeleton (models/ssm_lm.cpp): LM head, final norm, residual blocks
// recomputed one at a time from their recorded inputs, embeddings.
#include <cstring>
#include <utility>

#include "grad/families.h"
#include "grad/ops_grad.h"
#include "mixlens/errors.h"
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

void ssm_lm_backward(const detail::FamilyModel& model, const detail::SsmLmParts& p, const Tape& tape,
                     const Tensor& dlogits, GradSink& sink) {
  const auto& cache = static_cast<const detail::SsmCache&>(*tape.cache_before);
  const SsmBackbone bb{p.norm_f, p.lm_head, p.norms, p.eps, p.D, p.L, p.V};
  if (p.mamba) {  // Mamba-1 (src/grad/mamba_mixer_grad.cpp)
    ssm_lm_backward(bb, tape, dlogits, sink, [&](int li, const Tensor& n, const Tensor& dout, Tensor& dn) {
      const size_t i = static_cast<size_t>(li);
      const MambaMixerView w = mamba_mixer_view(*p.mamba, (*p.mamba_layers)[i]);
      MambaCallState call;
      call.conv = &cache.conv[i];
      call.ssm = &cache.ssm[i];
      call.has_state = cache.has_state;
      call.chunked = tape.kernel == "chunked";
      call.betas_for_decays = [&](const Tensor& b, const Tensor& dec) { return model.betas_for_decays(li, b, dec); };
      mamba_mixer_backward(w, li, n, call, tape, dout, dn, sink);
    });
  } else if (p.mamba2) {  // Mamba-2 (src/grad/mamba2_mixer_grad.cpp)
    ssm_lm_backward(bb, tape, dlogits, sink, [&](int li, const Tensor& n, const Tensor& dout, Tensor& dn) {
      const size_t i = static_cast<size_t>(li);
      const Mamba2CallState call{&cache.conv[i], &cache.ssm[i], cache.has_state, tape.kernel == "chunked"};
      mamba2_mixer_backward(*p.mamba2, (*p.mamba2_layers)[i], li, n, call, tape, dout, dn, sink);
    });
  } else {
    throw UnsupportedError("backward: the " + model.info.family + " family's mixer has no backward (docs/gradients.md)");
  }
}

}  // namespace mixlens::grad
