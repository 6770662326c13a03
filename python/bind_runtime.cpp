// Bindings of the process-wide CPU thread count (csrc/cpu/threads.h) and the CUDA device
// queries (cb_kernels/runtime.h).
#include <omp.h>
#include <pybind11/pybind11.h>

#include "bindings.h"
#include "cb_kernels/runtime.h"
#include "threads.h"

namespace py = pybind11;

void bind_runtime(py::module_& m) {
  m.def("set_num_threads", [](int n) { cbk::cpu::thread_setting().store(n > 0 ? n : 1); },
        "Threads the CPU kernels use (the wrappers keep it equal to torch.get_num_threads()).");
  m.def("get_num_threads", []() { return cbk::cpu::max_threads(); });
#if CBK_WITH_CUDA
  m.def("cuda_device_error", []() { return cbk::cuda::device_error(); });
  m.def("cuda_device_count", []() { return cbk::cuda::device_count(); });
  m.def("cuda_device_name", [](int d) { return cbk::cuda::device_name(d); });
  m.def("cuda_device_sm", [](int d) { return cbk::cuda::device_sm(d); });
#else
  m.def("cuda_device_error",
        []() { return std::string("cb_kernels was built without CUDA kernels (no nvcc at build time, or CBK_CUDA=off)"); });
  m.def("cuda_device_count", []() { return 0; });
  m.def("cuda_device_name", [](int) { return std::string(); });
  m.def("cuda_device_sm", [](int) { return -1; });
#endif
}
