// The gated RMSNorm of the stateful layers (cb_kernels/gated_rms_norm.h says what it computes).
//
// Why: after the gated delta rule, transformers' Qwen3NextRMSNormGated is ~12 torch ops (casts,
// pow, mean, rsqrt, two multiplies, the SiLU) over a [num_tokens * num_v_heads, head_v_dim]
// view of a copied z: 75-90 us a layer per decode step of 16 rows at the Qwen3-Next hd128 shape
// (bf16, 1 thread, Zen 4), for 8192 elements. Here one pass per (token, group) item. The sums
// are fp32 in another order than torch's (results agree to fp32 rounding, not bit for bit); bf16
// results are rounded where each of transformers' bf16 ops rounds. Built portable and with
// AVX-512 flags (CMakeLists.txt), picked as the gated delta rule's body; the loops are written
// branch-free so the compiler vectorises them.
#include "cb_kernels/gated_rms_norm.h"
#include "cb_kernels/gated_delta.h"  // gated_delta_rule_isa: the same two bodies

#include <omp.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "attention_vec.h"  // v8f, exp8, hsum
#include "bf16_scalar.h"  // bits_to_float, rne, widen, put
#include "threads.h"

namespace cbk {
namespace CBK_CPU_NS {
namespace {

// Elements below which one thread does the call (~8 us of work at ~1 ns an element with its exp).
constexpr int64_t kParallelElems = int64_t{1} << 13;

inline float round_as(const float*, float x) { return x; }
inline float round_as(const uint16_t*, float x) { return bits_to_float(rne(x)); }

// s[0, n) = silu(s[0, n)) in fp32, x * sigmoid(x) with sigmoid from e = exp(-|x|) (exp8's
// relative error ~2e-7, the steps of elementwise.cpp's silu_mul).
inline void silu_inplace(float* s, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const v8f x = load8(s + i);
    const v8f ax = x < 0 ? -x : x;
    const v8f e = exp8(-ax);
    const v8f one = splat(1.0f);
    store8(s + i, x * (x < 0 ? e / (one + e) : one / (one + e)));
  }
  for (; i < n; ++i) s[i] = s[i] / (1.0f + std::exp(-s[i]));
}

template <typename T>
void run_item(const GatedRmsNormParams& p, int64_t t, int64_t j) {
  const int64_t d = p.group_size;
  const T* x = static_cast<const T*>(p.x) + t * p.x_stride + j * d;
  const T* g = static_cast<const T*>(p.gate) + t * p.gate_token_stride +
               (j / p.groups_per_block) * p.gate_block_stride + (j % p.groups_per_block) * d;
  const T* w = static_cast<const T*>(p.weight) + (j * d) % p.weight_len;
  T* out = static_cast<T*>(p.out) + (t * p.num_groups + j) * d;
  thread_local std::vector<float> buf;
  buf.resize(static_cast<size_t>(2 * d));
  float* h = buf.data();
  float* sg = h + d;
  for (int64_t i = 0; i < d; ++i) sg[i] = widen(g[i]);
  silu_inplace(sg, d);
  if (p.norm_before_gate) {
    for (int64_t i = 0; i < d; ++i) h[i] = widen(x[i]);
  } else {
    for (int64_t i = 0; i < d; ++i) h[i] = widen(x[i]) * sg[i];
  }
  v8f acc = splat(0.0f);
  int64_t i = 0;
  for (; i + 8 <= d; i += 8) {
    const v8f v = load8(h + i);
    acc += v * v;
  }
  float ss = hsum(acc);
  for (; i < d; ++i) ss += h[i] * h[i];
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(d) + p.eps);
  if (p.norm_before_gate) {
    for (i = 0; i < d; ++i)
      put(out + i, round_as(out, widen(w[i]) * round_as(out, h[i] * r)) * sg[i]);
  } else {
    for (i = 0; i < d; ++i) put(out + i, widen(w[i]) * round_as(out, h[i] * r));
  }
}

}  // namespace

Status gated_rms_norm(const GatedRmsNormParams& p) {
  const int64_t items = p.tokens * p.num_groups;
  const bool bf16 = p.dtype == DType::kBFloat16;
  const bool par = items > 1 && items * p.group_size >= kParallelElems;
#pragma omp parallel for schedule(static) num_threads(cpu::max_threads()) if (par)
  for (int64_t it = 0; it < items; ++it)
    bf16 ? run_item<uint16_t>(p, it / p.num_groups, it % p.num_groups)
         : run_item<float>(p, it / p.num_groups, it % p.num_groups);
  return Status::Ok();
}

}  // namespace CBK_CPU_NS

#if CBK_CPU_PORTABLE
#if CBK_X86_BODIES
namespace cpu_avx512 {
Status gated_rms_norm(const GatedRmsNormParams& p);
}
#endif

namespace cpu {
Status gated_rms_norm(const GatedRmsNormParams& p, Isa isa) {
  if (p.tokens < 0 || p.num_groups <= 0 || p.group_size <= 0 ||
      p.groups_per_block <= 0 || p.x_stride < p.num_groups * p.group_size ||
      (p.weight_len != p.group_size && p.weight_len != p.num_groups * p.group_size))
    return Status::Error("gated_rms_norm: need tokens >= 0, group_size > 0, "
                         "groups_per_block > 0, x_stride >= num_groups * group_size and "
                         "weight_len group_size or num_groups * group_size");
  if (p.dtype != DType::kFloat32 && p.dtype != DType::kBFloat16)
    return Status::Error("gated_rms_norm: dtype must be float32 or bfloat16");
  if (p.tokens == 0) return Status::Ok();
  if (!p.x || !p.gate || !p.weight || !p.out) return Status::Error("gated_rms_norm: null pointer");
#if CBK_X86_BODIES
  if (gated_delta_rule_isa(isa) == Isa::kAvx512) return cpu_avx512::gated_rms_norm(p);
#endif
  return cpu_portable::gated_rms_norm(p);
}
}  // namespace cpu
#endif

}  // namespace cbk
