// Qwen3-Next's RMSNorm with the residual add before it (cb_kernels/offset_rms_norm.h says what
// it computes).
//
// Why: transformers' Qwen3NextRMSNorm is a cast to fp32, pow, mean, add, rsqrt, two multiplies,
// the (1 + w) and a cast back, after the residual add: ~10 torch ops per norm, 11 norms a step
// on the 4-layer bench model, each op 10-25 us in a decode step whose recurrent state keeps
// the caches cold (measured in the engine, Zen 4, bf16 at 1 thread: a [16, 8] topk took 26 us
// there, 2.6 us alone). Here one pass a row. The sum of squares is fp32 in another order than
// torch's (agrees to fp32 rounding); the bf16 output is rounded once, where transformers' cast
// rounds. Built portable and with AVX-512 flags (CMakeLists.txt); the loops are branch-free so
// the compiler vectorises them.
#include "cb_kernels/offset_rms_norm.h"
#include "cb_kernels/gated_delta.h"  // gated_delta_rule_isa: the same two bodies

#include <omp.h>

#include <cmath>
#include <cstring>

#include "bf16_scalar.h"  // bits_to_float, rne, widen, put
#include "threads.h"

namespace cbk {
namespace CBK_CPU_NS {
namespace {

// Elements below which one thread does the call (a 16 x 256 decode row block is 4096).
constexpr int64_t kParallelElems = int64_t{1} << 15;

template <typename T>
void run_row(const OffsetRmsNormParams& p, int64_t t) {
  const int64_t d = p.dim;
  T* x = static_cast<T*>(p.x) + t * p.x_stride;
  const T* w = static_cast<const T*>(p.weight);
  T* out = static_cast<T*>(p.out) + t * d;
  if (p.residual) {
    const T* r = static_cast<const T*>(p.residual) + t * p.residual_stride;
    for (int64_t i = 0; i < d; ++i) put(x + i, widen(x[i]) + widen(r[i]));
  }
  // 16 partial sums, so the adds are not one serial chain (and vectorise without -ffast-math).
  float acc[16] = {};
  int64_t i = 0;
  for (; i + 16 <= d; i += 16)
    for (int j = 0; j < 16; ++j) {
      const float v = widen(x[i + j]);
      acc[j] += v * v;
    }
  float ss = 0.0f;
  for (int j = 0; j < 16; ++j) ss += acc[j];
  for (; i < d; ++i) ss += widen(x[i]) * widen(x[i]);
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(d) + p.eps);
  for (i = 0; i < d; ++i) put(out + i, (widen(x[i]) * r) * (1.0f + widen(w[i])));
}

}  // namespace

Status offset_rms_norm(const OffsetRmsNormParams& p) {
  const bool bf16 = p.dtype == DType::kBFloat16;
  const bool par = p.rows > 1 && p.rows * p.dim >= kParallelElems;
#pragma omp parallel for schedule(static) num_threads(cpu::max_threads()) if (par)
  for (int64_t t = 0; t < p.rows; ++t) bf16 ? run_row<uint16_t>(p, t) : run_row<float>(p, t);
  return Status::Ok();
}

}  // namespace CBK_CPU_NS

#if CBK_CPU_PORTABLE
#if CBK_X86_BODIES
namespace cpu_avx512 {
Status offset_rms_norm(const OffsetRmsNormParams& p);
}
#endif

namespace cpu {
Status offset_rms_norm(const OffsetRmsNormParams& p, Isa isa) {
  if (p.rows < 0 || p.dim <= 0 || p.x_stride < p.dim ||
      (p.residual && p.residual_stride < p.dim))
    return Status::Error("offset_rms_norm: need rows >= 0, dim > 0 and row strides >= dim");
  if (p.dtype != DType::kFloat32 && p.dtype != DType::kBFloat16)
    return Status::Error("offset_rms_norm: dtype must be float32 or bfloat16");
  if (p.rows == 0) return Status::Ok();
  if (!p.x || !p.weight || !p.out) return Status::Error("offset_rms_norm: null pointer");
#if CBK_X86_BODIES
  if (gated_delta_rule_isa(isa) == Isa::kAvx512) return cpu_avx512::offset_rms_norm(p);
#endif
  return cpu_portable::offset_rms_norm(p);
}
}  // namespace cpu
#endif

}  // namespace cbk
