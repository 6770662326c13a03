// Binding of the greedy LM head; cb_kernels/ops/greedy_head.py owns the checks.
#include <pybind11/pybind11.h>

#include "bindings.h"
#include "cb_kernels/greedy_head.h"

namespace py = pybind11;

void bind_greedy_head(py::module_& m) {
  m.def("greedy_head_sizes", [](int64_t vocab, int64_t hidden) {
          return py::make_tuple(cbk::greedy_head_packed_bytes(vocab, hidden),
                                cbk::kGreedyHeadRowStats * cbk::greedy_head_padded_vocab(vocab));
        },
        py::arg("vocab"), py::arg("hidden"),
        "(packed bytes, floats of row stats) of a packed head.");
  m.def("greedy_head_has_simd",
        []() { return cbk::cpu::greedy_head_isa() == cbk::Isa::kAvx512Vnni; },
        "True where the CPU has AVX-512 VNNI (the fast path of the greedy head).");
  m.def(
      "greedy_head_pack",
      [](uintptr_t weight, int64_t vocab, int64_t hidden, int64_t weight_stride, uintptr_t packed,
         uintptr_t row_stats, int weight_dtype) {
        cbk::GreedyHeadPackParams p;
        p.weight = cbk::as_ptr<const void>(weight);
        p.weight_dtype = cbk::as_dtype(weight_dtype);
        p.vocab = vocab;
        p.hidden = hidden;
        p.weight_stride = weight_stride;
        p.packed = cbk::as_ptr<uint8_t>(packed);
        p.row_stats = cbk::as_ptr<float>(row_stats);
        py::gil_scoped_release nogil;
        cbk::throw_if_error(cbk::cpu::greedy_head_pack(p));
      },
      py::arg("weight"), py::arg("vocab"), py::arg("hidden"), py::arg("weight_stride"),
      py::arg("packed"), py::arg("row_stats"), py::arg("weight_dtype") = 0,
      "Quantise an fp32 (weight_dtype 0) or bf16 (2) [vocab, hidden] head into the greedy head's "
      "int8 layout.");
  m.def(
      "greedy_head",
      [](uintptr_t hidden_states, int64_t num_rows, int64_t hidden_stride, uintptr_t packed,
         uintptr_t row_stats, uintptr_t weight, int64_t vocab, int64_t hidden,
         int64_t weight_stride, uintptr_t exact_dims, uintptr_t exact_cols, int64_t num_exact,
         uintptr_t out, int64_t max_rescored_per_row, float outlier_ratio, uintptr_t outliers,
         int64_t max_outliers, const std::string& isa, int weight_dtype) {
        cbk::GreedyHeadParams p;
        p.hidden_states = cbk::as_ptr<const float>(hidden_states);
        p.num_rows = num_rows;
        p.hidden_stride = hidden_stride;
        p.packed = cbk::as_ptr<const uint8_t>(packed);
        p.row_stats = cbk::as_ptr<const float>(row_stats);
        p.weight = cbk::as_ptr<const void>(weight);
        p.weight_dtype = cbk::as_dtype(weight_dtype);
        p.vocab = vocab;
        p.hidden = hidden;
        p.weight_stride = weight_stride;
        p.exact_dims = cbk::as_ptr<const int32_t>(exact_dims);
        p.exact_cols = cbk::as_ptr<const float>(exact_cols);
        p.num_exact = num_exact;
        p.out = cbk::as_ptr<int64_t>(out);
        p.max_rescored_per_row = max_rescored_per_row;
        p.outlier_ratio = outlier_ratio;
        p.outliers = cbk::as_ptr<int32_t>(outliers);
        p.max_outliers = max_outliers;
        const cbk::Isa body = cbk::as_isa(isa);
        int64_t rescored = 0, found = 0, candidates = 0;
        p.num_rescored = &rescored;
        p.num_candidates = &candidates;
        p.num_outliers = &found;
        {
          py::gil_scoped_release nogil;
          cbk::throw_if_error(cbk::cpu::greedy_head(p, body));
        }
        return py::make_tuple(rescored, found, candidates);
      },
      py::arg("hidden_states"), py::arg("num_rows"), py::arg("hidden_stride"), py::arg("packed"),
      py::arg("row_stats"), py::arg("weight"), py::arg("vocab"), py::arg("hidden"),
      py::arg("weight_stride"), py::arg("exact_dims"), py::arg("exact_cols"), py::arg("num_exact"),
      py::arg("out"), py::arg("max_rescored_per_row") = 0, py::arg("outlier_ratio") = 0.0f,
      py::arg("outliers") = 0, py::arg("max_outliers") = 0, py::arg("isa") = "auto",
      py::arg("weight_dtype") = 0,
      "out[r] = argmax_j <h_r, w_j> (exact; lowest index on a tie), or -1 for a row that would "
      "keep more than max_rescored_per_row candidates. Returns (logits rescored, dims written to "
      "outliers: |h| > outlier_ratio x the row's RMS, not exact yet, candidates the bound kept). `isa` caps the body "
      "('portable' or 'avx512_vnni'; both give the same tokens). A bf16 weight (weight_dtype 2): "
      "the argmax of the exact logits rounded to bf16.");
}
