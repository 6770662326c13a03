// Row gathers with a dtype change, for the one-call backbones (mamba2_stack.cpp,
// qwen3_next_stack.cpp): the embedding of a step's ids and the selection of its sampled rows.
#pragma once

#include <cstdint>
#include <cstring>

#include "cb_kernels/common.h"

namespace cbk {
namespace cpu {

// n rows of src (dtype `from`, rows given by index, or 0..n-1 when index is null) into dst
// (dtype `to`, packed): bf16 -> fp32 widens exactly, fp32 -> bf16 rounds to nearest even.
inline void copy_rows(const void* src, const int64_t* index, int64_t n, int64_t dim, DType from,
                      void* dst, DType to) {
  const int64_t from_size = dtype_size(from), to_size = dtype_size(to);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t r = index ? index[i] : i;
    const char* s = static_cast<const char*>(src) + r * dim * from_size;
    char* d = static_cast<char*>(dst) + i * dim * to_size;
    if (from == to) {
      std::memcpy(d, s, dim * to_size);
    } else if (from == DType::kBFloat16) {
      const uint16_t* sb = reinterpret_cast<const uint16_t*>(s);
      float* df = reinterpret_cast<float*>(d);
      for (int64_t j = 0; j < dim; ++j) df[j] = bf16_to_float(sb[j]);
    } else {
      const float* sf = reinterpret_cast<const float*>(s);
      uint16_t* db = reinterpret_cast<uint16_t*>(d);
      for (int64_t j = 0; j < dim; ++j) db[j] = float_to_bf16(sf[j]);
    }
  }
}

}  // namespace cpu
}  // namespace cbk
