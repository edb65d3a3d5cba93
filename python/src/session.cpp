// Session: the interleaver behind `with model.trace(...)`. Every call that runs the forward releases
// the GIL; the forward (a fiber on this thread) takes it only to run a pre-registered Python edit.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <memory>
#include <optional>

#include "bindings.h"
#include "interrupt.h"
#include "mixlens/session.h"

namespace mixlens::py {

namespace {

using Rows = std::vector<std::vector<int32_t>>;

// Owns the pre-registered trace and the session; the session is declared after the trace so it
// is destroyed (its paused forward unwound) first.
struct PySession {
  std::unique_ptr<Trace> trace = std::make_unique<Trace>();
  std::optional<Session> session;

  PySession(const std::vector<SaveSpec>& saves, const std::vector<EditSpec>& edits) {
    register_saves(*trace, saves);
    register_edits(*trace, edits);
  }
  ~PySession() { close(); }
  void close() {
    if (!session) return;
    nb::gil_scoped_release r;
    session->abort();
  }
  Session& s() {
    if (!session) throw InputError("this session was closed");
    return *session;
  }
  // Ctrl-C while the caller waits in read / write / reach_step / finish aborts the run.
  PySession* start(Session&& s) {
    session.emplace(std::move(s));
    session->set_interrupt_check(check_signals);
    return this;
  }
};

nb::dict result_dict(const SessionResult& r, const Trace& trace) {
  nb::dict d;
  nb::list logits;
  for (const Tensor& t : r.logits) logits.append(to_numpy(t.clone()));
  d["logits"] = logits;
  d["new_tokens"] = nb::cast(r.new_tokens);
  d["steps"] = r.steps;
  d["saved"] = saved_dict(trace);
  return d;
}

nb::list calls_list(const std::vector<CallRecord>& calls) {
  nb::list out;
  for (const CallRecord& c : calls) {
    nb::dict d;
    d["step"] = c.step;
    d["batch"] = c.batch;
    d["seq"] = c.seq;
    d["fresh"] = c.fresh;
    d["kernel"] = c.kernel;
    out.append(d);
  }
  return out;
}

}  // namespace

void init_session(nb::module_& m) {
  nb::class_<PySession>(m, "Session",
                        "A forward run as a fiber on the caller's thread, paused where read()/write() ask (mixlens/session.h).")
      .def("read",
           [](PySession& p, int step, const std::string& path) {
             Tensor t;
             {
               nb::gil_scoped_release r;
               t = p.s().read(step, path);
             }
             return to_numpy(std::move(t));
           },
           nb::arg("step"), nb::arg("path"))
      .def("write",
           [](PySession& p, int step, const std::string& path, const FloatArray& value) {
             Tensor t = from_numpy(value);
             nb::gil_scoped_release r;
             p.s().write(step, path, t);
           },
           nb::arg("step"), nb::arg("path"), nb::arg("value"))
      .def("reach_step",
           [](PySession& p, int step) {
             nb::gil_scoped_release r;
             return p.s().reach_step(step);
           },
           nb::arg("step"))
      .def("finish",
           [](PySession& p) {
             SessionResult res;
             {
               nb::gil_scoped_release r;
               res = p.s().finish();
             }
             return result_dict(res, *p.trace);
           })
      .def("close", &PySession::close, "Abort the run if it is still going (idempotent).")
      .def_prop_ro("in_forward", [](PySession& p) { return p.session && p.session->in_forward(); },
                   "True inside this session's forward (a pre-registered edit function).")
      .def_prop_ro("first_step", [](PySession& p) { return p.s().first_step(); })
      .def_prop_ro("last_step", [](PySession& p) { return p.s().last_step(); })
      .def_prop_ro("calls", [](PySession& p) { return calls_list(p.s().calls()); })
      .def_prop_ro("where", [](PySession& p) { return p.s().where(); })
      // Gradients (issue 12, docs/gradients.md): after the run, through the trace's record.
      .def("backward",
           [](PySession& p, const FloatArray& dlogits, const std::vector<std::string>& paths) {
             Tensor d = from_numpy(dlogits);
             nb::gil_scoped_release r;
             p.trace->backward(d, paths);
           },
           nb::arg("dlogits"), nb::arg("paths") = std::vector<std::string>{})
      .def("grad", [](PySession& p, const std::string& path) { return to_numpy(p.trace->grad(path).clone()); },
           nb::arg("path"))
      .def("grad_paths",
           [](PySession& p) {
             std::vector<std::string> out;
             for (const auto& [k, v] : p.trace->grads()) out.push_back(k);
             return out;
           });

  // Factories: the session keeps the model (and a continued cache) alive.
  m.def(
      "session_run",
      [](const Model& mo, const Rows& prompts, const std::vector<SaveSpec>& saves, const std::vector<EditSpec>& edits,
         const std::optional<FloatArray>& embeds, const std::vector<uint8_t>& mask, bool all_logits, bool grad) {
        auto p = std::make_unique<PySession>(saves, edits);
        p->trace->enable_grad(grad);
        p->start(Session::run(mo, prompt_batch(mo, prompts, embeds, mask), p->trace.get(), all_logits));
        return p.release();
      },
      nb::arg("model"), nb::arg("prompts"), nb::arg("saves") = std::vector<SaveSpec>{},
      nb::arg("edits") = std::vector<EditSpec>{}, nb::arg("embeds") = nb::none(), nb::arg("mask") = std::vector<uint8_t>{},
      nb::arg("all_logits") = true, nb::arg("grad") = false, nb::rv_policy::take_ownership, nb::keep_alive<0, 1>());
  m.def(
      "session_generate",
      [](const Model& mo, const Rows& prompts, int max_new_tokens, bool greedy, float temperature, int top_k,
         float top_p, uint64_t seed, std::optional<int32_t> eos, const std::vector<SaveSpec>& saves,
         const std::vector<EditSpec>& edits, const std::optional<FloatArray>& embeds, const std::vector<uint8_t>& mask) {
        auto p = std::make_unique<PySession>(saves, edits);
        p->start(Session::generate(mo, prompt_batch(mo, prompts, embeds, mask),
                                   make_options(max_new_tokens, greedy, temperature, top_k, top_p, seed, eos),
                                   p->trace.get()));
        return p.release();
      },
      nb::arg("model"), nb::arg("prompts"), nb::arg("max_new_tokens"), nb::arg("greedy") = true,
      nb::arg("temperature") = 1.0f, nb::arg("top_k") = 0, nb::arg("top_p") = 1.0f, nb::arg("seed") = 0,
      nb::arg("eos_token_id") = nb::none(), nb::arg("saves") = std::vector<SaveSpec>{},
      nb::arg("edits") = std::vector<EditSpec>{}, nb::arg("embeds") = nb::none(), nb::arg("mask") = std::vector<uint8_t>{},
      nb::rv_policy::take_ownership, nb::keep_alive<0, 1>());
  m.def(
      "session_teacher_forced",
      [](const Model& mo, const Rows& prompts, const Rows& forced, const std::vector<SaveSpec>& saves,
         const std::vector<EditSpec>& edits) {
        auto p = std::make_unique<PySession>(saves, edits);
        p->start(Session::teacher_forced(mo, prompts, forced, p->trace.get()));
        return p.release();
      },
      nb::arg("model"), nb::arg("prompts"), nb::arg("forced"), nb::arg("saves") = std::vector<SaveSpec>{},
      nb::arg("edits") = std::vector<EditSpec>{}, nb::rv_policy::take_ownership, nb::keep_alive<0, 1>());
  m.def(
      "session_forward",
      [](const Model& mo, const Rows& rows, Cache& cache, const std::vector<SaveSpec>& saves,
         const std::vector<EditSpec>& edits, bool all_logits, const std::optional<FloatArray>& embeds, bool grad) {
        auto p = std::make_unique<PySession>(saves, edits);
        p->trace->enable_grad(grad);
        p->start(Session::forward(mo, continuation_batch(rows, embeds), cache, p->trace.get(), all_logits));
        return p.release();
      },
      nb::arg("model"), nb::arg("rows"), nb::arg("cache"), nb::arg("saves") = std::vector<SaveSpec>{},
      nb::arg("edits") = std::vector<EditSpec>{}, nb::arg("all_logits") = true, nb::arg("embeds") = nb::none(),
      nb::arg("grad") = false, nb::rv_policy::take_ownership,
      nb::keep_alive<0, 1>(), nb::keep_alive<0, 3>());
}

}  // namespace mixlens::py
