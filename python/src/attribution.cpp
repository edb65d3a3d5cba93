// Residual decomposition, direct logit attribution and attribution patching (mixlens/attribution.h):
// thin conversions; every computation is the C++ core's.
#include <nanobind/stl/function.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "bindings.h"
#include "mixlens/attribution.h"

namespace mixlens::py {

namespace {

using Rows = std::vector<std::vector<int32_t>>;
using Stack = ResidStack (*)(const Model&, const Batch&, const std::vector<int64_t>&);

nb::object stack_call(Stack f, const Model& mo, const Rows& prompts, const std::optional<FloatArray>& embeds,
                      const std::vector<uint8_t>& mask, const std::vector<int64_t>& positions) {
  const Batch b = prompt_batch(mo, prompts, embeds, mask);
  ResidStack s;
  {
    nb::gil_scoped_release r;
    s = f(mo, b, positions);
  }
  return nb::cast(std::move(s));
}

}  // namespace

void init_attribution(nb::module_& m) {
  nb::class_<ResidStack>(m, "ResidStack", "mixlens::ResidStack (mixlens/attribution.h)")
      .def_prop_ro("kind", [](const ResidStack& s) {
        return s.kind == ResidStack::Kind::decomposed ? "decomposed" : "accumulated";
      })
      .def_prop_ro("components", [](const ResidStack& s) { return to_numpy(s.components); })
      .def_ro("labels", &ResidStack::labels)
      .def_ro("sources", &ResidStack::sources)
      .def_ro("layers", &ResidStack::layers)
      .def_ro("positions", &ResidStack::positions)
      .def_prop_ro("resid", [](const ResidStack& s) { return to_numpy(s.resid); })
      .def_prop_ro("logits", [](const ResidStack& s) { return to_numpy(s.logits); })
      .def_ro("max_rel_error", &ResidStack::max_rel_error);
  const std::pair<const char*, Stack> stacks[] = {{"decompose_resid", &decompose_resid},
                                                  {"accumulated_resid", &accumulated_resid}};
  for (const auto& [name, f] : stacks)
    m.def(
        name,
        [f](const Model& mo, const Rows& prompts, const std::optional<FloatArray>& embeds,
            const std::vector<uint8_t>& mask, const std::vector<int64_t>& positions) {
          return stack_call(f, mo, prompts, embeds, mask, positions);
        },
        nb::arg("model"), nb::arg("prompts"), nb::arg("embeds") = nb::none(), nb::arg("mask") = std::vector<uint8_t>{},
        nb::arg("positions") = std::vector<int64_t>{-1}, "mixlens::decompose_resid / accumulated_resid -> ResidStack.");
  m.def(
      "apply_ln_to_stack", [](const Model& mo, const ResidStack& s) { return to_numpy(apply_ln_to_stack(mo, s)); },
      nb::arg("model"), nb::arg("stack"), "mixlens::apply_ln_to_stack: [C,B,P,hidden].");
  m.def(
      "logit_attrs",
      [](const Model& mo, const ResidStack& s, const std::vector<int32_t>& tokens, const std::vector<int32_t>& incorrect,
         bool exact) { return to_numpy(logit_attrs(mo, s, tokens, incorrect, exact ? LnMode::exact : LnMode::frozen)); },
      nb::arg("model"), nb::arg("stack"), nb::arg("tokens"), nb::arg("incorrect") = std::vector<int32_t>{},
      nb::arg("exact") = false, "mixlens::logit_attrs: [C,B,P].");
  m.def(
      "attribution_patching",
      [](const Model& mo, const Rows& clean, const Rows& corrupt, nb::callable metric,
         const std::vector<std::string>& nodes, const std::vector<uint8_t>& mask,
         const std::optional<FloatArray>& clean_embeds, const std::optional<FloatArray>& corrupt_embeds,
         const std::vector<int64_t>& positions,
         const std::vector<int64_t>& metric_positions, int ig_steps) {
        const Batch bc = prompt_batch(mo, clean, clean_embeds, mask), bx = prompt_batch(mo, corrupt, corrupt_embeds, mask);
        AtpOptions o;
        o.nodes = nodes;
        o.positions = positions;
        o.metric_positions = metric_positions;
        o.ig_steps = ig_steps;
        // metric(logits [B,P,V]) -> (value, dlogits [B,P,V]): a Python callable, called with the GIL held.
        const LogitsMetric f = [&metric](const Tensor& logits) {
          nb::gil_scoped_acquire g;
          nb::tuple r = nb::cast<nb::tuple>(metric(to_numpy(logits.clone())));
          metrics::MetricGrad out;
          out.value = nb::cast<double>(r[0]);
          out.dlogits = from_numpy(nb::cast<FloatArray>(r[1]));
          return out;
        };
        AtpResult res;
        {
          nb::gil_scoped_release rel;
          res = attribution_patching(mo, bc, bx, f, o);
        }
        nb::list ranked;
        for (const AtpResult::Row& row : res.ranked()) ranked.append(nb::make_tuple(row.node, row.position, row.estimate));
        nb::dict d;
        d["nodes"] = nb::cast(res.nodes);
        d["layers"] = nb::cast(res.layers);
        d["positions"] = nb::cast(res.positions);
        d["estimates"] = to_numpy(res.estimates);
        d["clean_metric"] = res.clean_metric;
        d["corrupt_metric"] = res.corrupt_metric;
        d["ranked"] = ranked;
        return d;
      },
      nb::arg("model"), nb::arg("clean"), nb::arg("corrupt"), nb::arg("metric"), nb::arg("nodes"),
      nb::arg("mask") = std::vector<uint8_t>{}, nb::arg("clean_embeds") = nb::none(),
      nb::arg("corrupt_embeds") = nb::none(), nb::arg("positions") = std::vector<int64_t>{}, nb::arg("metric_positions") = std::vector<int64_t>{},
      nb::arg("ig_steps") = 0,
      "mixlens::attribution_patching: {nodes, layers, positions, estimates [N,B,P], clean_metric, corrupt_metric, "
      "ranked [(node, position, estimate)]}. metric(logits [B,P,V]) -> (value, dlogits).");
}

}  // namespace mixlens::py
