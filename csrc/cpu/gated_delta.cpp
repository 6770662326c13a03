// The gated delta rule over a variable-length batch (cb_kernels/gated_delta.h says what it
// computes). One work item is one (row, value head): its state [k_dim, v_dim] is read from the
// slot (or zeroed), run through the row's tokens, and left in the slot. Items are independent,
// so OpenMP threads split them and a row's result never depends on the rest of the batch.
//
// Inside an item the columns of S evolve independently (k' and q' are shared, d is per column),
// so the state is walked in column tiles of kTile floats, the tile outer and the tokens inner:
// a [k_dim, kTile] tile (32 KiB at k_dim 128) stays in L1 across a prefill's tokens, and the
// tile's sums (k'^T S, q'^T S) stay in registers (4 zmm in the avx512 body). Each token makes two
// passes over the tile: decay and k'^T S first (d needs the whole sum), then the rank-1 update
// and q'^T S. Built portable and with AVX-512 flags (CMakeLists.txt).
#include <algorithm>
#include <cmath>
#include <vector>

#include "cb_kernels/gated_delta.h"
#include "scan_items.h"  // load, store, run_scan_items

namespace cbk {
namespace CBK_CPU_NS {
namespace {

constexpr int64_t kTile = 64;

// dst = x * rsqrt(sum x^2 + 1e-6) * scale (transformers' l2norm, then the query scale).
template <typename T>
void normalized(const T* x, int64_t n, bool l2norm, float scale, float* dst) {
  float ss = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    dst[i] = load(x, i);
    ss += dst[i] * dst[i];
  }
  const float f = (l2norm ? 1.0f / std::sqrt(ss + 1e-6f) : 1.0f) * scale;
  for (int64_t i = 0; i < n; ++i) dst[i] *= f;
}

// Columns [j0, j0 + W) of one item's state through tokens [t0, t1). W == kTile: a fixed trip
// count the compiler keeps in registers; W == 0: the remainder, `width` columns.
template <int64_t W, typename T>
void run_tile(const GatedDeltaParams& p, float* S, int64_t h, int64_t t0, int64_t t1,
              const float* qn, const float* kn, int64_t j0, int64_t width) {
  const int64_t K = p.k_dim, V = p.v_dim, Hv = p.num_v_heads;
  const int64_t n = W ? W : width;
  const T* v = static_cast<const T*>(p.v);
  T* out = static_cast<T*>(p.out);
  for (int64_t t = t0; t < t1; ++t) {
    const float* kt = kn + (t - t0) * K;
    const float* qt = qn + (t - t0) * K;
    const float decay = std::exp(p.g[t * Hv + h]);
    const float beta = p.beta[t * Hv + h];
    float acc[W ? W : kTile];
    for (int64_t j = 0; j < n; ++j) acc[j] = 0.0f;
    for (int64_t i = 0; i < K; ++i) {
      float* row = S + i * V + j0;
      const float ki = kt[i];
      for (int64_t j = 0; j < n; ++j) {
        row[j] *= decay;
        acc[j] += ki * row[j];
      }
    }
    const T* vt = v + t * p.v_stride[0] + h * p.v_stride[1] + j0;
    for (int64_t j = 0; j < n; ++j) acc[j] = (load(vt, j) - acc[j]) * beta;   // d
    float o[W ? W : kTile];
    for (int64_t j = 0; j < n; ++j) o[j] = 0.0f;
    for (int64_t i = 0; i < K; ++i) {
      float* row = S + i * V + j0;
      const float ki = kt[i], qi = qt[i];
      for (int64_t j = 0; j < n; ++j) {
        row[j] += ki * acc[j];
        o[j] += qi * row[j];
      }
    }
    T* ot = out + (t * Hv + h) * V + j0;
    for (int64_t j = 0; j < n; ++j) store(ot, j, o[j]);
  }
}

template <typename T>
void run_item(const GatedDeltaParams& p, int64_t s, int64_t h) {
  const int64_t K = p.k_dim, V = p.v_dim;
  const int64_t t0 = p.rows.cu_seqlens[s], t1 = p.rows.cu_seqlens[s + 1];
  float* S = p.state + (p.rows.slots[s] * p.num_v_heads + h) * K * V;
  if (!p.rows.has_state[s]) std::fill(S, S + K * V, 0.0f);
  if (t1 == t0) return;
  const int64_t kh = h / (p.num_v_heads / p.num_k_heads);
  thread_local std::vector<float> qk;      // the row's normalised q' then k', [2, len, K]
  qk.resize(static_cast<size_t>(2 * (t1 - t0) * K));
  float *qn = qk.data(), *kn = qn + (t1 - t0) * K;
  const T* q = static_cast<const T*>(p.q);
  const T* k = static_cast<const T*>(p.k);
  for (int64_t t = t0; t < t1; ++t) {
    normalized(q + t * p.q_stride[0] + kh * p.q_stride[1], K, p.l2norm_qk, p.scale,
               qn + (t - t0) * K);
    normalized(k + t * p.k_stride[0] + kh * p.k_stride[1], K, p.l2norm_qk, 1.0f,
               kn + (t - t0) * K);
  }
  int64_t j0 = 0;
  for (; j0 + kTile <= V; j0 += kTile) run_tile<kTile, T>(p, S, h, t0, t1, qn, kn, j0, kTile);
  for (; j0 < V; j0 += kTile)
    run_tile<0, T>(p, S, h, t0, t1, qn, kn, j0, std::min(kTile, V - j0));
}

}  // namespace

Status gated_delta_rule(const GatedDeltaParams& p) {
  return run_scan_items(p, p.num_v_heads, p.k_dim * p.v_dim, [&](int64_t s, int64_t h, auto t) {
    run_item<decltype(t)>(p, s, h);
  });
}

}  // namespace CBK_CPU_NS

#if CBK_CPU_PORTABLE
#if CBK_X86_BODIES
namespace cpu_avx512 {
Status gated_delta_rule(const GatedDeltaParams& p);
}
#endif

namespace cpu {
Isa gated_delta_rule_isa(Isa isa) {
  const Isa top = isa == Isa::kAuto || isa > best_isa() ? best_isa() : isa;
  return top >= Isa::kAvx512 && CBK_X86_BODIES ? Isa::kAvx512 : Isa::kPortable;
}

Status gated_delta_rule(const GatedDeltaParams& p, Isa isa) {
  if (const Status rows = check_rows(p.rows); !rows.ok()) return rows;
  if (p.num_k_heads <= 0 || p.num_v_heads <= 0 || p.k_dim <= 0 || p.v_dim <= 0)
    return Status::Error("gated_delta_rule: need positive heads and dims");
  if (p.num_v_heads % p.num_k_heads != 0)
    return Status::Error("gated_delta_rule: num_v_heads must be a multiple of num_k_heads");
  if (p.dtype != DType::kFloat32 && p.dtype != DType::kBFloat16)
    return Status::Error("gated_delta_rule: dtype must be float32 or bfloat16");
  if (p.rows.num_seqs == 0) return Status::Ok();
  if (!p.state) return Status::Error("gated_delta_rule: null pointer");
  if (p.rows.num_tokens() > 0 && (!p.q || !p.k || !p.v || !p.g || !p.beta || !p.out))
    return Status::Error("gated_delta_rule: null pointer");   // (empty tensors may have none)
#if CBK_X86_BODIES
  if (gated_delta_rule_isa(isa) == Isa::kAvx512) return cpu_avx512::gated_delta_rule(p);
#endif
  return cpu_portable::gated_delta_rule(p);
}
}  // namespace cpu
#endif

}  // namespace cbk
