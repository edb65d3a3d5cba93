#include "bindings.h"
#include <nanobind/stl/string.h>

#include "mixlens/tools.h"

NB_MODULE(_core, m) {
  m.doc() = "mixlens native core: models, traces and the interleaving Session (use the `mixlens` package)";
  mixlens::py::init_errors(m);
  mixlens::py::init_model(m);
  mixlens::py::init_session(m);
  mixlens::py::init_extract(m);
  mixlens::py::init_attribution(m);
  m.attr("__version__") = mixlens::version();
  m.def("version", &mixlens::version, "mixlens::version(): CMakeLists.txt's project(VERSION), the one version source.");
}
