// Dataset extraction (mixlens/extract.h): the plan and the run, for model.extract and the Ray workers.
#include <nanobind/stl/function.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "bindings.h"
#include "interrupt.h"
#include "mixlens/extract.h"

namespace mixlens::py {

namespace {

using PromptTuple = std::tuple<std::string, std::vector<int32_t>, std::vector<uint8_t>>;

nb::dict progress_dict(const ExtractProgress& p) {
  nb::dict d;
  d["prompts_done"] = p.prompts_done;
  d["prompts_total"] = p.prompts_total;
  d["prompts_skipped"] = p.prompts_skipped;
  d["shards_done"] = p.shards_done;
  d["shards_total"] = p.shards_total;
  d["bytes_done"] = p.bytes_done;
  d["bytes_total"] = p.bytes_total;
  d["elapsed_s"] = p.elapsed_s;
  return d;
}

}  // namespace

void init_extract(nb::module_& m) {
  m.def(
      "read_prompts_file",
      [](const std::string& path, const std::string& text_field, const std::string& mask_field) {
        std::vector<PromptTuple> out;
        for (auto& p : read_prompts_file(path, text_field, mask_field))
          out.emplace_back(std::move(p.text), std::move(p.ids), std::move(p.mask));
        return out;
      },
      nb::arg("path"), nb::arg("text_field") = "text", nb::arg("mask_field") = "",
      "mixlens::read_prompts_file: [(text, ids=[], mask)] from a .jsonl or plain-text prompts file.");

  nb::class_<ExtractPlan>(m, "ExtractPlan", "mixlens::ExtractPlan: tokens, rows and shards decided before a run.")
      .def_prop_ro("total_bytes", [](const ExtractPlan& p) { return p.total_bytes; })
      .def_prop_ro("total_rows", [](const ExtractPlan& p) { return p.total_rows; })
      .def_prop_ro("num_prompts", [](const ExtractPlan& p) { return p.ids.size(); })
      .def_prop_ro("num_shards", [](const ExtractPlan& p) { return p.shards.size(); })
      .def_prop_ro("fingerprint", [](const ExtractPlan& p) { return p.fingerprint; })
      .def_prop_ro("values", [](const ExtractPlan& p) {
        std::vector<std::string> names;
        for (const auto& v : p.values) names.push_back(v.name);
        return names;
      });

  m.def(
      "plan_extraction",
      [](const Model& model, const std::vector<PromptTuple>& prompts, const std::vector<std::string>& values,
         int64_t batch_size, const std::string& positions, uint64_t shard_bytes, uint64_t max_bytes,
         bool store_prompts) {
        std::vector<ExtractPrompt> ps;
        ps.reserve(prompts.size());
        for (const auto& [text, ids, mask] : prompts) ps.push_back({text, ids, mask});
        ExtractOptions o;
        o.values = values;
        o.batch_size = batch_size;
        o.positions = positions;
        o.shard_bytes = shard_bytes;
        o.max_bytes = max_bytes;
        o.store_prompts = store_prompts;
        nb::gil_scoped_release r;
        return plan_extraction(model, ps, o);
      },
      nb::arg("model"), nb::arg("prompts"), nb::arg("values"), nb::arg("batch_size"), nb::arg("positions"),
      nb::arg("shard_bytes"), nb::arg("max_bytes"), nb::arg("store_prompts"),
      "mixlens::plan_extraction (ResourceError past max_bytes, naming both numbers).");

  m.def(
      "extract",
      [](const Model& model, const ExtractPlan& plan, const std::string& out,
         std::optional<std::vector<int64_t>> only_shards, bool write_index, nb::object on_progress) {
        ExtractRunOptions run;
        run.only_shards = std::move(only_shards);
        run.write_index = write_index;
        // Called on the helper thread: take the GIL for the Python callback; its exception stops the run.
        if (!on_progress.is_none())
          run.on_progress = [&on_progress](const ExtractProgress& p) {
            nb::gil_scoped_acquire gil;
            on_progress(progress_dict(p));
          };
        const ExtractSummary s = run_interruptible<ExtractSummary>([&](const std::atomic<bool>* cancel) {
          run.cancel = cancel;
          return extract(model, plan, out, run);
        });
        nb::dict d;
        d["shards_written"] = s.shards_written;
        d["shards_skipped"] = s.shards_skipped;
        d["complete"] = s.complete;
        return d;
      },
      nb::arg("model"), nb::arg("plan"), nb::arg("out"), nb::arg("only_shards") = nb::none(),
      nb::arg("write_index") = true, nb::arg("on_progress") = nb::none(),
      "mixlens::extract: runs the plan into folder `out` (resumes; Ctrl-C stops it between layers).");
}

}  // namespace mixlens::py
