// Each python/bind_<op>.cpp adds its functions to the module through one of these.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "cb_kernels/common.h"
#include "cb_kernels/isa.h"

void bind_runtime(pybind11::module_& m);         // threads, CUDA device checks
void bind_paged_attention(pybind11::module_& m);
void bind_cache_ops(pybind11::module_& m);
void bind_greedy_tokens(pybind11::module_& m);     // the greedy token of each logits row
void bind_sample_tokens(pybind11::module_& m);     // a drawn token per logits row, its logprob
void bind_elementwise(pybind11::module_& m);       // fused RMSNorm, SiLU*mul, rotary (CPU)
void bind_greedy_head(pybind11::module_& m);       // argmax of hidden @ W^T (CPU, int8 + exact rescoring)
void bind_linear(pybind11::module_& m);            // fp32 linear on a packed weight (CPU)
void bind_fused_decoder(pybind11::module_& m);           // the fused CPU decoder stack in one call
void bind_gated_delta(pybind11::module_& m);       // the gated delta rule with state slots (CPU)
void bind_causal_conv1d(pybind11::module_& m);     // short causal conv1d with state slots (CPU)
void bind_selective_scan(pybind11::module_& m);    // the Mamba-2 selective scan with state slots (CPU)
void bind_moe(pybind11::module_& m);               // the fused MoE experts on packed weights (CPU)
void bind_gated_rms_norm(pybind11::module_& m);    // the stateful layers' gated RMSNorm (CPU)
void bind_offset_rms_norm(pybind11::module_& m);   // Qwen3-Next's (1 + w) RMSNorm (CPU)
void bind_fused_hybrid(pybind11::module_& m);     // a hybrid layer's conv + scan + norm in one call (CPU)
void bind_fused_gated_attention(pybind11::module_& m);  // Qwen3-Next's attention layer in one call (CPU)
void bind_qwen3_next_stack(pybind11::module_& m);  // a Qwen3-Next backbone in one call (CPU)
void bind_paged_attention_cuda(pybind11::module_& m);  // CUDA kernels (stubs raise when built without CUDA)

namespace cbk {
// Pointers cross the binding as Python ints (tensor.data_ptr()).
template <typename T>
inline T* as_ptr(uintptr_t p) {
  return reinterpret_cast<T*>(p);
}

// A pointer field of a bound parameter struct: Python reads and writes it as an int
// (tensor.data_ptr(); 0 for null).
template <class S, class T>
void def_ptr(pybind11::class_<S>& c, const char* name, T* S::*field) {
  c.def_property(
      name, [field](const S& s) { return reinterpret_cast<uintptr_t>(s.*field); },
      [field](S& s, uintptr_t v) { s.*field = reinterpret_cast<T*>(v); });
}

inline void throw_if_error(const Status& s) {
  if (!s.ok()) throw std::runtime_error(s.message);
}

// The `isa` argument of the CPU kernels: "auto" or an ISA this CPU runs (ValueError otherwise).
inline Isa as_isa(const std::string& name) {
  Isa isa = Isa::kAuto;
  if (!cpu::parse_isa(name.c_str(), &isa))
    throw pybind11::value_error("isa must be 'auto', 'portable', 'avx2', 'avx512' or 'avx512_vnni', got '" +
                                name + "'");
  if (!cpu::isa_supported(isa))
    throw pybind11::value_error("isa='" + name + "' cannot run on this CPU (its best is '" +
                                cpu::isa_name(cpu::best_isa()) + "')");
  return isa;
}

inline DType as_dtype(int code) {
  if (code < 0 || code > 2) throw std::invalid_argument("dtype code must be 0 (fp32), 1 (fp16) or 2 (bf16)");
  return static_cast<DType>(code);
}

// A DType field of a bound parameter struct, as its int code (ops/_backend.py DTYPE_CODES).
template <class S>
void def_dtype(pybind11::class_<S>& c, const char* name, DType S::*field) {
  c.def_property(
      name, [field](const S& s) { return static_cast<int>(s.*field); },
      [field](S& s, int code) { s.*field = as_dtype(code); });
}
}  // namespace cbk
