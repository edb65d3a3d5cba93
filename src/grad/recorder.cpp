// The tape of one forward call (grad/tape.h): a listener wrapped around the trace / session
// listener that keeps each block's input and every write the call makes.
#include <algorithm>
#include <cstring>
#include <utility>

#include "grad/tape.h"
#include "mixlens/errors.h"

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
    const bool read_only = v == Value::states || v == Value::attn_probs;
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

void GradSink::put(int layer, Value v, const Tensor& g) {
  if (wants(layer, v)) grads_[site_path({layer, v})] = g.clone();
}

std::map<std::string, Tensor> run_backward(const Tape& tape, const Tensor& dlogits, const std::vector<Site>& wanted) {
  if (!tape.unsupported.empty()) throw UnsupportedError("backward: " + tape.unsupported);
  if (!dlogits.defined() || dlogits.shape() != tape.logits_shape)
    throw InputError("backward: dlogits must have the shape of the call's logits " + shape_str(tape.logits_shape) +
                     ", got " + (dlogits.defined() ? shape_str(dlogits.shape()) : std::string("None")));
  if (dlogits.has_non_finite()) throw InputError("backward: dlogits contains NaN or inf");
  GradSink sink(wanted);
  tape.family->backward(tape, dlogits, sink);
  return std::move(sink.grads());
}

}  // namespace mixlens::grad
