#include "bindings.h"

namespace py = pybind11;

void bind_cache_ops(py::module_& m) { (void)m; }
