// The Mamba-2 selective scan over a variable-length batch (cb_kernels/selective_scan.h says what
// it computes). A work item is one (row, head): its [head_dim, d_state] state (64 KiB at 128 x
// 128) runs through the row's tokens in place; items are independent, so OpenMP threads split
// them and a row's result never depends on the batch. Per token each state row p is one pass:
// decay, the rank-1 write and the C read fused (the d_state loop vectorises). Built portable and
// with AVX-512 flags (CMakeLists.txt).
#include <algorithm>
#include <cmath>
#include <vector>

#include "cb_kernels/gated_delta.h"  // gated_delta_rule_isa: the same two bodies
#include "attention_vec.h"  // v8f, load8, hsum
#include "cb_kernels/selective_scan.h"
#include "scan_items.h"  // load, store, run_scan_items

namespace cbk {
namespace CBK_CPU_NS {
namespace {

template <typename T>
void run_item(const SelectiveScanParams& p, int64_t s, int64_t h) {
  const int64_t P = p.head_dim, N = p.d_state, H = p.num_heads;
  const int64_t t0 = p.rows.cu_seqlens[s], t1 = p.rows.cu_seqlens[s + 1];
  float* S = p.state + (p.rows.slots[s] * H + h) * P * N;
  if (!p.rows.has_state[s]) std::fill(S, S + P * N, 0.0f);
  const int64_t gr = h / (H / p.num_groups);
  const T* x = static_cast<const T*>(p.x);
  const T* Bm = static_cast<const T*>(p.B);
  const T* Cm = static_cast<const T*>(p.C);
  T* out = static_cast<T*>(p.out);
  thread_local std::vector<float> bc;      // this token's B then C, [2, d_state]
  bc.resize(static_cast<size_t>(2 * N));
  float *b = bc.data(), *c = b + N;
  const float d = p.D ? p.D[h] : 0.0f;
  for (int64_t t = t0; t < t1; ++t) {
    float dt = p.dt[t * H + h] + (p.dt_bias ? p.dt_bias[h] : 0.0f);
    if (p.dt_softplus) dt = dt > 20.0f ? dt : std::log1p(std::exp(dt));
    if (p.dt_max > p.dt_min) dt = std::min(std::max(dt, p.dt_min), p.dt_max);
    const float decay = std::exp(dt * p.A[h]);
    for (int64_t n = 0; n < N; ++n) {
      b[n] = load(Bm, t * p.b_stride + gr * N + n);
      c[n] = load(Cm, t * p.c_stride + gr * N + n);
    }
    const T* xt = x + t * p.x_stride + h * P;
    T* ot = out + (t * H + h) * P;
    const int64_t N16 = N / 16 * 16;
    const v8f vdecay = splat(decay);
    for (int64_t i = 0; i < P; ++i) {
      const float xv = load(xt, i), dx = dt * xv;
      const v8f vdx = splat(dx);
      float* row = S + i * N;
      // y over d_state in 16 lanes of partial sums, added pairwise at the end: one serial
      // chain of N fused multiply-adds (4 cycles each) was the decode's whole cost, 0.70 ms
      // a layer for 16 rows x 8 heads x 64 x 128 bf16 (1 thread, Zen 4). The order depends on
      // d_state only, never on the batch.
      v8f y0 = splat(0.0f), y1 = splat(0.0f);
      int64_t n = 0;
      for (; n < N16; n += 16) {
        const v8f r0 = load8(row + n) * vdecay + vdx * load8(b + n);
        const v8f r1 = load8(row + n + 8) * vdecay + vdx * load8(b + n + 8);
        store8(row + n, r0);
        store8(row + n + 8, r1);
        y0 += r0 * load8(c + n);
        y1 += r1 * load8(c + n + 8);
      }
      float y = hsum(y0 + y1);
      for (; n < N; ++n) {
        row[n] = row[n] * decay + dx * b[n];
        y += row[n] * c[n];
      }
      store(ot, i, y + d * xv);
    }
  }
}

}  // namespace

Status selective_scan(const SelectiveScanParams& p) {
  return run_scan_items(p, p.num_heads, p.head_dim * p.d_state, [&](int64_t s, int64_t h, auto t) {
    run_item<decltype(t)>(p, s, h);
  });
}

}  // namespace CBK_CPU_NS

#if CBK_CPU_PORTABLE
#if CBK_X86_BODIES
namespace cpu_avx512 {
Status selective_scan(const SelectiveScanParams& p);
}
#endif

namespace cpu {
Status selective_scan(const SelectiveScanParams& p, Isa isa) {
  if (const Status rows = check_rows(p.rows); !rows.ok()) return rows;
  if (p.num_heads <= 0 || p.head_dim <= 0 || p.num_groups <= 0 ||
      p.d_state <= 0 || p.num_heads % p.num_groups != 0)
    return Status::Error("selective_scan: need positive sizes, num_heads % num_groups == 0");
  if (p.dtype != DType::kFloat32 && p.dtype != DType::kBFloat16)
    return Status::Error("selective_scan: dtype must be float32 or bfloat16");
  if (p.rows.num_seqs == 0) return Status::Ok();
  if (!p.A || !p.state) return Status::Error("selective_scan: null pointer");
  if (p.rows.num_tokens() > 0 && (!p.x || !p.dt || !p.B || !p.C || !p.out))
    return Status::Error("selective_scan: null pointer");   // (empty tensors may have none)
#if CBK_X86_BODIES
  if (gated_delta_rule_isa(isa) == Isa::kAvx512) return cpu_avx512::selective_scan(p);
#endif
  return cpu_portable::selective_scan(p);
}
}  // namespace cpu
#endif

}  // namespace cbk
