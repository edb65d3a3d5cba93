// The tape of one forward call (grad/tape.h): a listener wrapped around the trace / session
// listener that keeps each block's input and every write the call makes.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>

#include "grad/ops_grad.h"
#include "grad/tape.h"
#include "mixlens/errors.h"
#include "ops/ops.h"

namespace mixlens::grad {

void Written::apply(Tensor& t) const {
  float* p = t.data();
  for (int64_t k = 0; k < t.numel(); ++k)
    if (changed[static_cast<size_t>(k)]) p[k] = value[k];
}

void Written::block(Tensor& g) const {
  float* p = g.data();
  for (int64_t k = 0; k < g.numel(); ++k)
    if (changed[static_cast<size_t>(k)]) p[k] = 0.0f;
}

bool Written::any() const { return std::find(changed.begin(), changed.end(), uint8_t{1}) != changed.end(); }

void Recorder::refresh() {
  if (inner_) mask_ = inner_->mask();
  mask_.resize(static_cast<size_t>(layers_ + 1), 0u);
  // Every block input (the recomputation checkpoints) and the last block's output.
  for (int i = 0; i < layers_; ++i) mask_[static_cast<size_t>(i + 1)] |= 1u << static_cast<unsigned>(Value::layer_input);
  if (layers_ > 0) mask_[static_cast<size_t>(layers_)] |= 1u << static_cast<unsigned>(Value::layer_output);
  mask_[0] |= 1u << static_cast<unsigned>(Value::ln_final_output);  // what the LM head read (logits_at)
}

void Recorder::begin_call(const detail::CallCtx& ctx, int num_layers) {
  layers_ = num_layers;
  if (inner_) inner_->begin_call(ctx, num_layers);
  tape_.layer_inputs.assign(static_cast<size_t>(num_layers), Tensor());
  refresh();
}

void Recorder::end_call() {
  if (inner_) inner_->end_call();
}

bool Recorder::visit(int layer, Value v, Tensor& value, const Shape& shape) {
  bool written = false;
  if (inner_ && inner_->wants(layer, v)) {
    // The value before the visit (to find what a write changed) goes into one reused buffer: most
    // visits are saves. Read-only sites (a states stack: T states) are never copied.
    const bool read_only = v == Value::states || !derived_value_reason(v).empty();
    const bool had = value.defined() && !read_only;
    const Shape before_shape = had ? value.shape() : Shape{};
    if (had) before_.assign(std::as_const(value).begin(), std::as_const(value).end());
    written = inner_->visit(layer, v, value, shape);
    if (written && value.defined()) {
      Written w;
      w.value = value.clone();
      w.changed.assign(static_cast<size_t>(value.numel()), 1);
      if (had && before_shape == value.shape()) {
        const float* now = std::as_const(value).data();
        for (int64_t k = 0; k < value.numel(); ++k)
          w.changed[static_cast<size_t>(k)] = std::memcmp(before_.data() + k, now + k, sizeof(float)) != 0;
      }
      tape_.writes[{layer, static_cast<int>(v)}] = std::move(w);
    }
    // The buffer is kept for the next visit unless it is large (a saved logits tensor).
    if (before_.size() > (size_t{1} << 24)) std::vector<float>().swap(before_);
  }
  if (v == Value::layer_input && layer >= 0 && layer < layers_) tape_.layer_inputs[static_cast<size_t>(layer)] = value.clone();
  if (v == Value::layer_output && layer == layers_ - 1) tape_.final_hidden = value.clone();
  if (v == Value::ln_final_output && layer == -1) tape_.final_normed = value.clone();
  refresh();
  return written;
}

int64_t Recorder::next_state_token(int layer, int64_t after) const {
  return inner_ && inner_->wants(layer, Value::state) ? inner_->next_state_token(layer, after) : -1;
}

bool Recorder::visit_state(int layer, int64_t t, Tensor& value, const Shape& shape) {
  if (!inner_ || !inner_->wants(layer, Value::state)) return false;
  const bool written = inner_->visit_state(layer, t, value, shape);
  if (written && tape_.unsupported.empty())
    tape_.unsupported = "the call wrote a per-token state ('" + site_path({layer, Value::state}) + "@t" +
                        std::to_string(t) + "'); backward does not differentiate through per-token state writes yet";
  refresh();
  return written;
}

void Recorder::revised(int layer, Value v, const Tensor& value) {
  if (inner_) inner_->revised(layer, v, value);
}

GradSink::GradSink(std::vector<Site> wanted) : wanted_(std::move(wanted)) {}

bool GradSink::wants(int layer, Value v) const {
  return std::find(wanted_.begin(), wanted_.end(), Site{layer, v}) != wanted_.end();
}

bool GradSink::needs_below(int layer) const {
  return std::any_of(wanted_.begin(), wanted_.end(), [&](const Site& s) {
    return s.layer < 0 ? s.value == Value::embed_output
                       : s.layer < layer || (s.layer == layer && s.value != Value::layer_output);
  });
}

void GradSink::put(int layer, Value v, const Tensor& g) {
  if (wants(layer, v)) grads_[site_path({layer, v})] = g.clone();
}

std::map<std::string, Tensor> run_backward(const Tape& tape, const Tensor& dlogits, const std::vector<Site>& wanted,
                                           const std::vector<int64_t>& positions) {
  if (!tape.unsupported.empty()) throw UnsupportedError("backward: " + tape.unsupported);
  const int64_t B = tape.batch.batch, T = tape.batch.seq, V = tape.logits_shape.back();
  const bool lazy = tape.final_normed.defined() && tape.unembed.lm_head;  // logits of any position can be formed
  GradSink sink(wanted);
  if (!positions.empty()) {
    if (!lazy) throw InputError("backward: this call's record cannot give logits by position (pass dlogits for every position)");
    for (size_t i = 0; i < positions.size(); ++i)
      if (positions[i] < 0 || positions[i] >= T || (i > 0 && positions[i] <= positions[i - 1]))
        throw InputError("backward: positions must be ascending, distinct call positions in [0, " + std::to_string(T) +
                         "), got " + std::to_string(positions[i]) + " at index " + std::to_string(i));
    sink.positions = positions;
  } else if (dlogits.defined() && dlogits.dim() == 3 && dlogits.size(1) == T) {
    for (int64_t t = 0; t < T; ++t) sink.positions.push_back(t);
  } else {
    sink.positions = {T - 1};  // the call's logits were the last position's
  }
  const Shape want{B, static_cast<int64_t>(sink.positions.size()), V};
  // Every position's dlogits is accepted whenever the record can form them (the grad forward returns the
  // last position's logits unless every one was asked for).
  const bool ok = dlogits.defined() && (dlogits.shape() == want) &&
                  (!positions.empty() || dlogits.shape() == tape.logits_shape || (lazy && want[1] == T));
  if (!ok)
    throw InputError("backward: dlogits must have the shape of the call's logits " +
                     shape_str(positions.empty() ? tape.logits_shape : want) + ", got " +
                     (dlogits.defined() ? shape_str(dlogits.shape()) : std::string("None")));
  if (dlogits.has_non_finite()) throw InputError("backward: dlogits contains NaN or inf");
  tape.family->backward(tape, dlogits, sink);
  return std::move(sink.grads());
}

Tensor logits_at(const Tape& tape, const std::vector<int64_t>& positions) {
  if (!tape.final_normed.defined() || !tape.unembed.lm_head)
    throw UnsupportedError("logits_at: this call's record has no LM head input (a family without a declared head)");
  const int64_t B = tape.batch.batch, T = tape.batch.seq, D = tape.final_normed.size(2),
                V = tape.unembed.lm_head->size(0), P = static_cast<int64_t>(positions.size());
  for (int64_t t : positions)
    if (t < 0 || t >= T) throw InputError("logits_at: position " + std::to_string(t) + " is outside the call [0, " + std::to_string(T) + ")");
  Tensor rows({B, P, D}), out({B, P, V});
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < P; ++i)
      std::memcpy(rows.data() + (b * P + i) * D, tape.final_normed.data() + (b * T + positions[static_cast<size_t>(i)]) * D,
                  sizeof(float) * static_cast<size_t>(D));
  if (B * P > 0) ops::linear(rows.data(), B * P, D, *tape.unembed.lm_head, out.data());
  const float scale = tape.unembed.logit_scale, cap = tape.unembed.soft_cap;
  if (scale != 1.0f)
    for (int64_t k = 0; k < out.numel(); ++k) out[k] *= scale;
  if (cap > 0.0f)  // as lm_logits' soft cap, so the metric reads the served logits
    for (int64_t k = 0; k < out.numel(); ++k) out[k] = cap * std::tanh(out[k] / cap);
  return out;
}

Tensor head_backward(const Tape& tape, const Tensor& dlogits, const Tensor& lm_head, float scale, GradSink& sink,
                     float soft_cap) {
  const int64_t B = tape.batch.batch, T = tape.batch.seq, V = lm_head.size(0), D = lm_head.size(1);
  const std::vector<int64_t>& pos = sink.positions;
  const int64_t P = static_cast<int64_t>(pos.size());
  // dlogits rows at `pos`, as the LM head saw them: a full [B,T,V] is formed only when the logits'
  // gradient is served or a write changed logits (its blocked elements may be at any position).
  Tensor rows = (P == T && scale == 1.0f) ? dlogits : dlogits.clone();
  if (sink.wants(-1, Value::logits) || tape.write(-1, Value::logits)) {
    Tensor full({B, T, V});
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < P; ++i)
        std::memcpy(full.data() + (b * T + pos[static_cast<size_t>(i)]) * V, dlogits.data() + (b * P + i) * V,
                    sizeof(float) * static_cast<size_t>(V));
    sink.put(-1, Value::logits, full);
    if (tape.write(-1, Value::logits)) {
      tape.block(-1, Value::logits, full);
      if (P == T && scale == 1.0f) rows = full;
      else
        for (int64_t b = 0; b < B; ++b)
          for (int64_t i = 0; i < P; ++i)
            std::memcpy(rows.data() + (b * P + i) * V, full.data() + (b * T + pos[static_cast<size_t>(i)]) * V,
                        sizeof(float) * static_cast<size_t>(V));
    }
  }
  if (scale != 1.0f)  // logits are served after the multiplier
    for (int64_t k = 0; k < rows.numel(); ++k) rows[k] *= scale;
  if (soft_cap > 0.0f) {  // served logits = cap tanh(z / cap): dz = (1 - tanh^2) dlogits, z from the head's input
    if (!tape.final_normed.defined())
      throw UnsupportedError("backward: the call's record has no ln_final.output (the soft cap's input)");
    if (rows.data() == dlogits.data()) rows = dlogits.clone();
    Tensor x({B * P, D}), z({B * P, V});
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < P; ++i)
        std::memcpy(x.data() + (b * P + i) * D, tape.final_normed.data() + (b * T + pos[static_cast<size_t>(i)]) * D,
                    sizeof(float) * static_cast<size_t>(D));
    if (B * P > 0) ops::linear(x.data(), B * P, D, lm_head, z.data());
    for (int64_t k = 0; k < rows.numel(); ++k) {  // in double: 1 - tanh^2 cancels near saturation
      const double th = std::tanh(static_cast<double>(z[k]) / soft_cap);
      rows[k] = static_cast<float>(rows[k] * (1.0 - th * th));
    }
  }
  Tensor dhf({B, T, D});
  if (P == T) {
    linear_backward(std::as_const(rows).data(), B * T, V, lm_head, dhf.data(), false);
  } else if (P > 0) {
    Tensor dr({B * P, D});
    linear_backward(std::as_const(rows).data(), B * P, V, lm_head, dr.data(), false);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < P; ++i)
        std::memcpy(dhf.data() + (b * T + pos[static_cast<size_t>(i)]) * D, dr.data() + (b * P + i) * D,
                    sizeof(float) * static_cast<size_t>(D));
  }
  sink.put(-1, Value::ln_final_output, dhf);
  tape.block(-1, Value::ln_final_output, dhf);
  return dhf;
}

}  // namespace mixlens::grad
