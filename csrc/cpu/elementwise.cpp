// Fused per-row fp32 decoder-layer operations on CPU (see cb_kernels/elementwise.h).
//
// Why: after the linears, a decode step of a small model is dozens of tiny torch ops per layer
// (an RMSNorm is 6, the rotary embedding 12), each a few microseconds of dispatch and, for
// torch, one thread. Profiled on SmolLM2-135M (30 layers, 16 rows, 2 threads): rms_norm 28 us a
// call, silu 21 us, about 4 ms a step of elementwise work in all. Here each is one pass over the
// rows. Results agree with torch's to fp32 rounding, not bit for bit (other summation order in
// the RMSNorm, a polynomial exp in SiLU, fused multiply-adds).
#include "cb_kernels/elementwise.h"

#include <omp.h>

#include <cmath>

#include "attention_vec.h"
#include "threads.h"

namespace cbk {
namespace CBK_CPU_NS {
namespace {

// Work below which one thread does the call: ~6 us of it (an RMSNorm or rotary element costs
// ~0.1 ns, a SiLU element ~0.7 ns with its exp, on one core of the bench machine).
constexpr int64_t kParallelElems = 1 << 16;
constexpr int64_t kParallelSiluElems = 1 << 13;

inline bool parallel(int64_t rows, int64_t elems, int64_t grain = kParallelElems) {
  return rows > 1 && rows * elems >= grain;
}

void rms_row(const RmsNormParams& p, int64_t r) {
  float* x = p.x + r * p.x_stride;
  float* out = p.out + r * p.out_stride;
  const int64_t d = p.dim, d8 = d / 8 * 8;
  if (p.residual != nullptr) {
    const float* res = p.residual + r * p.residual_stride;
    int64_t i = 0;
    for (; i < d8; i += 8) store8(x + i, load8(x + i) + load8(res + i));
    for (; i < d; ++i) x[i] += res[i];
  }
  v8f acc0 = splat(0.0f), acc1 = splat(0.0f);
  int64_t i = 0;
  for (; i + 16 <= d8; i += 16) {
    const v8f a = load8(x + i), b = load8(x + i + 8);
    acc0 += a * a;
    acc1 += b * b;
  }
  for (; i < d8; i += 8) {
    const v8f a = load8(x + i);
    acc0 += a * a;
  }
  float ss = hsum(acc0 + acc1);
  for (; i < d; ++i) ss += x[i] * x[i];
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(d) + p.eps);
  const v8f vinv = splat(inv);
  for (i = 0; i < d8; i += 8) store8(out + i, load8(p.weight + i) * (load8(x + i) * vinv));
  for (; i < d; ++i) out[i] = p.weight[i] * (x[i] * inv);
}

// x * sigmoid(x) with sigmoid from e = exp(-|x|) (exp8 takes arguments <= 0 only).
inline v8f silu8(v8f x) {
  const v8f ax = x < 0 ? -x : x;
  const v8f e = exp8(-ax);
  const v8f one = splat(1.0f);
  const v8f sig = x < 0 ? e / (one + e) : one / (one + e);
  return x * sig;
}

inline float silu1(float x) { return x / (1.0f + std::exp(-x)); }

void silu_row(const SiluMulParams& p, int64_t r) {
  const float* g = p.gate_up + r * p.in_stride;
  const float* u = g + p.dim;
  float* out = p.out + r * p.out_stride;
  int64_t i = 0;
  for (; i + 8 <= p.dim; i += 8) store8(out + i, silu8(load8(g + i)) * load8(u + i));
  for (; i < p.dim; ++i) out[i] = silu1(g[i]) * u[i];
}

void rope_token(const RopeParams& p, int64_t t) {
  const int64_t half = p.head_dim / 2, h8 = half / 8 * 8;
  const float* c = p.cos + t * p.head_dim;
  const float* s = p.sin + t * p.head_dim;
  for (int64_t h = 0; h < p.heads; ++h) {
    float* x = p.x + t * p.token_stride + h * p.head_stride;
    int64_t i = 0;
    for (; i < h8; i += 8) {
      const v8f a = load8(x + i), b = load8(x + half + i);
      store8(x + i, a * load8(c + i) - b * load8(s + i));
      store8(x + half + i, b * load8(c + half + i) + a * load8(s + half + i));
    }
    for (; i < half; ++i) {
      const float a = x[i], b = x[half + i];
      x[i] = a * c[i] - b * s[i];
      x[half + i] = b * c[half + i] + a * s[half + i];
    }
  }
}

}  // namespace

Status rms_norm(const RmsNormParams& p) {
  if (p.rows < 0 || p.dim <= 0 || p.x_stride < p.dim || p.out_stride < p.dim ||
      (p.residual != nullptr && p.residual_stride < p.dim))
    return Status::Error("rms_norm: need rows >= 0, dim > 0 and strides >= dim");
  if (p.rows == 0) return Status::Ok();
  if (p.x == nullptr || p.weight == nullptr || p.out == nullptr) return Status::Error("rms_norm: null pointer");
#pragma omp parallel for schedule(static) num_threads(cpu::max_threads()) if (parallel(p.rows, p.dim))
  for (int64_t r = 0; r < p.rows; ++r) rms_row(p, r);
  return Status::Ok();
}

Status silu_mul(const SiluMulParams& p) {
  if (p.rows < 0 || p.dim <= 0 || p.in_stride < 2 * p.dim || p.out_stride < p.dim)
    return Status::Error("silu_mul: need rows >= 0, dim > 0, in_stride >= 2 * dim, out_stride >= dim");
  if (p.rows == 0) return Status::Ok();
  if (p.gate_up == nullptr || p.out == nullptr) return Status::Error("silu_mul: null pointer");
#pragma omp parallel for schedule(static) num_threads(cpu::max_threads()) if (parallel(p.rows, p.dim, kParallelSiluElems))
  for (int64_t r = 0; r < p.rows; ++r) silu_row(p, r);
  return Status::Ok();
}

Status rope(const RopeParams& p) {
  if (p.tokens < 0 || p.heads <= 0 || p.head_dim <= 0 || p.head_dim % 2 != 0)
    return Status::Error("rope: need tokens >= 0, heads > 0 and an even head_dim > 0");
  if (p.tokens == 0) return Status::Ok();
  if (p.x == nullptr || p.cos == nullptr || p.sin == nullptr) return Status::Error("rope: null pointer");
#pragma omp parallel for schedule(static) num_threads(cpu::max_threads()) \
    if (parallel(p.tokens, p.heads * p.head_dim))
  for (int64_t t = 0; t < p.tokens; ++t) rope_token(p, t);
  return Status::Ok();
}

}  // namespace CBK_CPU_NS
}  // namespace cbk

