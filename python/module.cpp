// cb_kernels._C: the one pybind11 module. It knows Python, not torch: tensors arrive as data
// pointers, sizes and strides from the wrappers in cb_kernels/ops, which own every check.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bindings.h"
#include "isa.h"

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
  m.doc() = "cb_kernels compiled kernels (torch-free; see cb_kernels.ops for the API)";

  py::dict info;
  info["cuda_compiled"] = static_cast<bool>(CBK_WITH_CUDA);
  info["cuda_archs"] = std::string(CBK_CUDA_ARCH_LIST);
  info["cuda_version"] = std::string(CBK_CUDA_VERSION_STR);
  info["compiler"] = std::string(CBK_VERSION_INFO);
  info["cpu_avx2_variant"] = static_cast<bool>(CBK_HAVE_AVX2_VARIANT);
  m.attr("build_info") = info;
  m.def("cpu_isa", []() { return std::string(cbk::cpu::has_avx2() ? "avx2" : "generic"); },
        "The CPU kernel variant chosen on this machine.");

  bind_runtime(m);
  bind_paged_attention(m);
  bind_cache_ops(m);
  bind_sampling(m);
  bind_elementwise(m);
  bind_greedy_head(m);
  bind_linear(m);
  bind_paged_attention_cuda(m);
}
