// cb_kernels._C: the one pybind11 module. It knows Python, not torch: tensors arrive as data
// pointers, sizes and strides from the wrappers in cb_kernels/ops, which own every check.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <vector>

#include "bindings.h"
#include "cb_kernels/isa.h"
#include "cb_kernels/paged_attention.h"

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
  m.doc() = "cb_kernels compiled kernels (torch-free; see cb_kernels.ops for the API)";

  py::dict info;
  info["cuda_compiled"] = static_cast<bool>(CBK_WITH_CUDA);
  info["cuda_archs"] = std::string(CBK_CUDA_ARCH_LIST);
  info["cuda_version"] = std::string(CBK_CUDA_VERSION_STR);
  info["compiler"] = std::string(CBK_VERSION_INFO);
  m.attr("build_info") = info;
  m.def("cpu_isas", []() {
          std::vector<std::string> names;
          for (int i = 0; i <= static_cast<int>(cbk::cpu::best_isa()); ++i)
            names.push_back(cbk::cpu::isa_name(static_cast<cbk::Isa>(i)));
          return names;
        },
        "The values of a CPU kernel's `isa` argument this machine runs, besides 'auto' "
        "(ascending: 'portable', then 'avx2', 'avx512', 'avx512_vnni', 'avx512_bf16' as far as "
        "the CPU goes).");
  m.def("cpu_isa", []() { return std::string(cbk::cpu::isa_name(cbk::cpu::paged_attention_isa())); },
        "The body paged attention (and the elementwise and argmax kernels) run here: "
        "'avx2' or 'portable'.");
  m.def("paged_attention_bf16_isa",
        [](int64_t head_dim) {
          return std::string(cbk::cpu::isa_name(cbk::cpu::paged_attention_bf16_isa(head_dim)));
        },
        py::arg("head_dim") = 64,
        "The body bf16 paged attention of this head_dim runs here: 'avx512_bf16' (vdpbf16ps, "
        "head_dim % 32 == 0), else 'avx2' or 'portable' (fp32 math on converted rows).");

  bind_runtime(m);
  bind_paged_attention(m);
  bind_cache_ops(m);
  bind_greedy_tokens(m);
  bind_sample_tokens(m);
  bind_elementwise(m);
  bind_greedy_head(m);
  bind_linear(m);
  bind_fused_decoder(m);
  bind_gated_delta(m);
  bind_causal_conv1d(m);
  bind_selective_scan(m);
  bind_moe(m);
  bind_gated_rms_norm(m);
  bind_offset_rms_norm(m);
  bind_fused_hybrid(m);
  bind_fused_gated_attention(m);
  bind_qwen3_next_stack(m);
  bind_paged_attention_cuda(m);
}
