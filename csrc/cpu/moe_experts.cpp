// The routed experts of an MoE layer in one call (cb_kernels/moe.h for the contract).
//
// Why our own: transformers runs the experts as torch._grouped_mm over the (token, expert) pairs
// sorted by expert (plus a sort, a histogram, gathers and the weighted sum as separate torch
// ops); on the 2-core Zen 4 a 16-row decode step of the bf16 Qwen3-Next hd128 bench shape spent
// 5.9 of its 7.8 ms MoE time there, and with two threads its OpenMP regions waited on each
// other. Here one call does the routing sort, every expert's gate_up GEMM, silu * up, the down
// GEMM and the weighted sum, with the packed weights and register tiles of linear.cpp /
// linear_bf16.cpp (the same bits as ops.PackedLinear per expert).
//
// Work items are (expert, row chunk) pairs: a chunk of at most kItemRows of the expert's pairs
// runs both GEMMs on one thread (the chunk's weights stream once through its core). Items go
// longest first to threads chosen on the call's work (kMinWorkPerThread multiply-adds each, as
// varlen_items.h gates the stateful kernels): a small decode step runs on the calling thread
// instead of waking the team. Each pair writes its weighted result to its own row of a buffer;
// after one barrier the tokens sum their top_k rows in k order, so no result depends on the
// split. The file is built portable, avx512 (the fp32 tile) and avx512_bf16 (the bf16 tile).
#include "cb_kernels/moe.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <mutex>
#include <vector>

#include "attention_vec.h"
#include "bf16_tile.h"
#include "moe_workspace.h"
#include "row_tiles.h"
#include "threads.h"

#if defined(__AVX512F__)
#define CBK_MOE_F32_SIMD 1
#else
#define CBK_MOE_F32_SIMD 0
#endif
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define CBK_MOE_BF16_SIMD 1
#else
#define CBK_MOE_BF16_SIMD 0
#endif

namespace cbk {
namespace CBK_CPU_NS {
using cpu::max_threads;
namespace {

constexpr int64_t kP = kLinearPanel;
constexpr int kMR = 12;                       // rows of a register tile (12 x 32 outputs)
constexpr int64_t kItemRows = 64;             // pairs per work item at most
constexpr int64_t kMinWorkPerThread = 1 << 18;  // multiply-adds (~10 us) a thread gets at least

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));

// float_to_bf16 then back, on 16 lanes: round to nearest even, a NaN kept quiet (the same bits
// as the scalar helper, lane by lane).
inline v16f round_bf16(v16f v) {
  v16u b;
  __builtin_memcpy(&b, &v, sizeof(b));
  const v16u rne = (b + 0x7fffu + ((b >> 16) & 1u)) & 0xffff0000u;
  const v16u quiet = (b | 0x400000u) & 0xffff0000u;
  const v16u r = (b & 0x7fffffffu) > 0x7f800000u ? quiet : rne;
  v16f out;
  __builtin_memcpy(&out, &r, sizeof(out));
  return out;
}

inline v16f load16(const float* p, int64_t n) {
  v16f v = v16f{};
  if (n == 16)
    __builtin_memcpy(&v, p, sizeof(v));
  else
    for (int64_t j = 0; j < n; ++j) v[j] = p[j];
  return v;
}

// The element types: T in memory, Unit one packed k step of x (a float, or a bf16 pair).
// round16 / store16: the same on 16 lanes (store16's values already rounded for BF16).
struct F32 {
  using T = float;
  using Unit = float;
  static constexpr int kPerUnit = 1;
  static float get(const T* p) { return *p; }
  static float round(float v) { return v; }
  static T put(float v) { return v; }
  static v16f round16(v16f v) { return v; }
  static void store16(T* p, v16f v, int64_t n) {
    if (n == 16)
      __builtin_memcpy(p, &v, sizeof(v));
    else
      for (int64_t j = 0; j < n; ++j) p[j] = v[j];
  }
  static v16f load16t(const T* p, int64_t n) { return load16(p, n); }
};
struct BF16 {
  using T = uint16_t;
  using Unit = uint32_t;
  static constexpr int kPerUnit = 2;
  static float get(const T* p) { return bf16_to_float(*p); }
  static float round(float v) { return bf16_to_float(float_to_bf16(v)); }
  static T put(float v) { return float_to_bf16(v); }
  static v16f round16(v16f v) { return round_bf16(v); }
  static void store16(T* p, v16f v, int64_t n) {
    v16u b;
    __builtin_memcpy(&b, &v, sizeof(b));
    const v16h h = __builtin_convertvector(b >> 16, v16h);
    if (n == 16)
      __builtin_memcpy(p, &h, sizeof(h));
    else
      for (int64_t j = 0; j < n; ++j) p[j] = h[j];
  }
  static v16f load16t(const T* p, int64_t n) {
    v16h h = v16h{};
    if (n == 16)
      __builtin_memcpy(&h, p, sizeof(h));
    else
      for (int64_t j = 0; j < n; ++j) h[j] = p[j];
    const v16u b = __builtin_convertvector(h, v16u) << 16;
    v16f v;
    __builtin_memcpy(&v, &b, sizeof(v));
    return v;
  }
};

// Rows src[0..rows) (each k elements) into blocks of kMR rows, block b at b * kMR * units, each
// [units][rows in block]: one k step's broadcasts read one line.
void pack_rows(const float* const* src, int64_t rows, int64_t k, float* xp) {
  for (int64_t b0 = 0; b0 < rows; b0 += kMR) {
    const int64_t n = std::min<int64_t>(kMR, rows - b0);
    float* dst = xp + b0 * k;
    for (int64_t r = 0; r < n; ++r)
      for (int64_t i = 0; i < k; ++i) dst[i * n + r] = src[b0 + r][i];
  }
}
void pack_rows(const uint16_t* const* src, int64_t rows, int64_t k, uint32_t* xp) {
  const int64_t pairs = (k + 1) / 2;
  for (int64_t b0 = 0; b0 < rows; b0 += kMR) {
    const int64_t n = std::min<int64_t>(kMR, rows - b0);
    uint32_t* dst = xp + b0 * pairs;
    for (int64_t r = 0; r < n; ++r) {
      const uint16_t* s = src[b0 + r];
      for (int64_t i = 0; i < pairs; ++i) {
        const uint32_t lo = s[2 * i], hi = 2 * i + 1 < k ? s[2 * i + 1] : 0;
        dst[i * n + r] = lo | (hi << 16);
      }
    }
  }
}

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
// One register tile: MR rows x `cols` (<= 32) columns of y (fp32, rows ldy apart) from packed x
// rows xp ([units][MR]) and one weight panel wp ([units][32] floats or [units][32][2] bf16).
template <int MR>
void tile(const float* xp, int64_t units, const float* wp, int64_t cols, float* y, int64_t ldy) {
#if CBK_MOE_F32_SIMD
  __mmask16 m0, m1;
  tile_masks(cols, m0, m1);
  __m512 a0[MR], a1[MR];
  for (int r = 0; r < MR; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < units; ++k) {
    const __m512 w0 = _mm512_loadu_ps(wp + k * kP), w1 = _mm512_loadu_ps(wp + k * kP + 16);
#pragma GCC unroll 12
    for (int r = 0; r < MR; ++r) {
      const __m512 xb = _mm512_set1_ps(xp[k * MR + r]);
      a0[r] = _mm512_fmadd_ps(xb, w0, a0[r]);
      a1[r] = _mm512_fmadd_ps(xb, w1, a1[r]);
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < MR; ++r) {
    _mm512_mask_storeu_ps(y + r * ldy, m0, a0[r]);
    _mm512_mask_storeu_ps(y + r * ldy + 16, m1, a1[r]);
  }
#else
  for (int r = 0; r < MR; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      float acc = 0.0f;
      for (int64_t k = 0; k < units; ++k) acc = std::fma(xp[k * MR + r], wp[k * kP + c], acc);
      y[r * ldy + c] = acc;
    }
#endif
}

template <int MR>
void tile(const uint32_t* xp, int64_t units, const uint16_t* wp, int64_t cols, float* y,
          int64_t ldy) {
#if CBK_MOE_BF16_SIMD
  __mmask16 m0, m1;
  tile_masks(cols, m0, m1);
  __m512 a0[MR], a1[MR];
  bf16_tile_sums<MR>(xp, units, wp, a0, a1);
#pragma GCC unroll 12
  for (int r = 0; r < MR; ++r) {
    _mm512_mask_storeu_ps(y + r * ldy, m0, a0[r]);
    _mm512_mask_storeu_ps(y + r * ldy + 16, m1, a1[r]);
  }
#else
  for (int r = 0; r < MR; ++r)
    for (int64_t c = 0; c < cols; ++c) y[r * ldy + c] = bf16_tile_sum(xp, MR, r, units, wp, c);
#endif
}
#pragma GCC diagnostic pop

// y [rows, n] (fp32 sums) = src rows [rows, k] @ W^T for one packed weight W [n, k]; xp: scratch
// of rows * units.
template <typename E>
void gemm(const typename E::T* const* src, int64_t rows, int64_t k, const typename E::T* packed,
          int64_t n, typename E::Unit* xp, float* y) {
  const int64_t units = (k + E::kPerUnit - 1) / E::kPerUnit;
  pack_rows(src, rows, k, xp);
  for (int64_t col0 = 0; col0 < n; col0 += kP) {
    const int64_t cols = std::min(kP, n - col0);
    const typename E::T* wp = packed + col0 * units * E::kPerUnit;
    int64_t r = 0;
    for (; r + kMR <= rows; r += kMR) tile<kMR>(xp + r * units, units, wp, cols, y + r * n + col0, n);
    with_rows<kMR - 1>(rows - r, [&](auto mr) {
      tile<decltype(mr)::value>(xp + r * units, units, wp, cols, y + r * n + col0, n);
    });
  }
}

// x * sigmoid(x), sigmoid from e = exp(-|x|) (exp_poly takes arguments <= 0): elementwise.cpp's
// silu on 16 lanes.
inline v16f silu16(v16f x) {
  const v16f ax = x < 0 ? -x : x;
  const v16f e = exp_poly<v16f, v16i>(-ax);
  const v16f one = v16f{} + 1.0f;
  const v16f sig = x < 0 ? e / (one + e) : one / (one + e);
  return x * sig;
}

// h[j] = round(round(silu(round(gate[j]))) * round(up[j])) for j < inter: transformers'
// act_fn(gate) * up, each op in the dtype.
template <typename E>
void silu_mul(const float* g, int64_t inter, typename E::T* h) {
  for (int64_t j0 = 0; j0 < inter; j0 += 16) {
    const int64_t n = std::min<int64_t>(16, inter - j0);
    const v16f gate = E::round16(load16(g + j0, n)), up = E::round16(load16(g + inter + j0, n));
    E::store16(h + j0, E::round16(E::round16(silu16(gate)) * up), n);
  }
}

struct Item {
  int64_t expert, start, rows;   // pairs sorted[start .. start + rows) of `expert`
};

// What one thread reuses from item to item.
template <typename E>
struct Scratch : cpu::moe_ws::Buffers {
  std::vector<typename E::Unit> xp;
  std::vector<float> g, d;
  std::vector<typename E::T> h;
  std::vector<const typename E::T*> src;
  int64_t bytes() const override {
    using cpu::moe_ws::capacity_bytes;
    return capacity_bytes(xp) + capacity_bytes(g) + capacity_bytes(d) + capacity_bytes(h) +
           capacity_bytes(src);
  }
  void clear() override {
    using cpu::moe_ws::free_vector;
    free_vector(xp), free_vector(g), free_vector(d), free_vector(h), free_vector(src);
  }
};

// What the calling thread reuses from call to call: the routing sort and the contributions.
struct CallBuffers : cpu::moe_ws::Buffers {
  std::vector<int64_t> counts, sorted;
  std::vector<Item> items;
  std::vector<float> contrib;
  int64_t bytes() const override {
    using cpu::moe_ws::capacity_bytes;
    return capacity_bytes(counts) + capacity_bytes(sorted) + capacity_bytes(items) +
           capacity_bytes(contrib);
  }
  void clear() override {
    using cpu::moe_ws::free_vector;
    free_vector(counts), free_vector(sorted), free_vector(items), free_vector(contrib);
  }
};

template <typename E>
void run_item(const MoeExpertsParams& p, const Item& it, const int64_t* sorted, float* contrib) {
  using T = typename E::T;
  thread_local Scratch<E> s;
  std::lock_guard<std::mutex> lock(s.mu);
  const int64_t rows = it.rows, H = p.hidden, I = p.inter;
  const int64_t units = std::max((H + E::kPerUnit - 1) / E::kPerUnit, (I + E::kPerUnit - 1) / E::kPerUnit);
  const int64_t padded = (rows + kMR - 1) / kMR * kMR;
  s.xp.resize(static_cast<size_t>(padded * units));
  s.g.resize(static_cast<size_t>(rows * 2 * I));
  s.h.resize(static_cast<size_t>(rows * I));
  s.d.resize(static_cast<size_t>(rows * H));
  s.src.resize(static_cast<size_t>(rows));
  const int64_t* pairs = sorted + it.start;
  const T* x = static_cast<const T*>(p.x);
  for (int64_t r = 0; r < rows; ++r) s.src[r] = x + pairs[r] / p.top_k * p.x_stride;
  gemm<E>(s.src.data(), rows, H, static_cast<const T*>(p.gate_up) + it.expert * p.gate_up_stride,
          2 * I, s.xp.data(), s.g.data());
  for (int64_t r = 0; r < rows; ++r) {
    silu_mul<E>(s.g.data() + r * 2 * I, I, s.h.data() + r * I);
    s.src[r] = s.h.data() + r * I;
  }
  gemm<E>(s.src.data(), rows, I, static_cast<const T*>(p.down) + it.expert * p.down_stride, H,
          s.xp.data(), s.d.data());
  for (int64_t r = 0; r < rows; ++r) {
    const float w = p.topk_weights[pairs[r]];
    const float* d = s.d.data() + r * H;
    float* out = contrib + pairs[r] * H;
    for (int64_t c = 0; c < H; c += 16) {
      const int64_t n = std::min<int64_t>(16, H - c);
      F32::store16(out + c, E::round16(E::round16(load16(d + c, n)) * w), n);
    }
  }
}

// y[t] = round(sum over k), then (with p.add) + round(add[t] * add_scale[t]), rounded: torch's
// `routed.add_(shared.mul_(sigmoid))`, each op rounded; the product goes through memory (the asm)
// so that the avx512 build cannot contract it into the sum's FMA.
template <typename E>
void sum_token(const MoeExpertsParams& p, int64_t t, const float* contrib) {
  using T = typename E::T;
  const int64_t H = p.hidden;
  T* y = static_cast<T*>(p.y) + t * p.y_stride;
  const float* c0 = contrib + t * p.top_k * H;
  const T* add = p.add ? static_cast<const T*>(p.add) + t * p.add_stride : nullptr;
  for (int64_t c = 0; c < H; c += 16) {
    const int64_t n = std::min<int64_t>(16, H - c);
    v16f acc = load16(c0 + c, n);
    for (int64_t k = 1; k < p.top_k; ++k) acc += load16(c0 + k * H + c, n);
    v16f out = E::round16(acc);
    if (add) {
      v16f a = E::load16t(add + c, n);
      if (p.add_scale) {
        a = a * p.add_scale[t];
        __asm__("" : "+m"(a));
        a = E::round16(a);
      }
      out = E::round16(out + a);
    }
    E::store16(y + c, out, n);
  }
}

template <typename E>
Status run(const MoeExpertsParams& p) {
  const int64_t num_pairs = p.num_tokens * p.top_k;
  // The pairs by expert (a counting sort, stable: token order inside an expert).
  thread_local CallBuffers w;
  std::lock_guard<std::mutex> lock(w.mu);
  std::vector<int64_t>& counts = w.counts;
  std::vector<int64_t>& sorted = w.sorted;
  std::vector<Item>& items = w.items;
  std::vector<float>& contrib = w.contrib;
  counts.assign(static_cast<size_t>(p.num_experts + 1), 0);
  for (int64_t i = 0; i < num_pairs; ++i) {
    const int64_t e = p.topk_ids[i];
    if (e < 0 || e >= p.num_experts) return Status::Error("moe_experts: expert id out of range");
    ++counts[e + 1];
  }
  for (int64_t e = 0; e < p.num_experts; ++e) counts[e + 1] += counts[e];
  sorted.resize(static_cast<size_t>(num_pairs));
  {
    std::vector<int64_t> next(counts.begin(), counts.end() - 1);
    for (int64_t i = 0; i < num_pairs; ++i) sorted[next[p.topk_ids[i]]++] = i;
  }
  items.clear();
  for (int64_t e = 0; e < p.num_experts; ++e) {
    const int64_t n = counts[e + 1] - counts[e];
    if (n == 0) continue;
    const int64_t chunks = (n + kItemRows - 1) / kItemRows, chunk = (n + chunks - 1) / chunks;
    for (int64_t r0 = 0; r0 < n; r0 += chunk)
      items.push_back(Item{e, counts[e] + r0, std::min(chunk, n - r0)});
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return a.rows > b.rows; });
  contrib.resize(static_cast<size_t>(num_pairs * p.hidden));
  const int64_t num_items = static_cast<int64_t>(items.size());
  const int64_t work = num_pairs * 3 * p.inter * p.hidden;
  const int threads = static_cast<int>(std::max<int64_t>(
      1, std::min<int64_t>({static_cast<int64_t>(max_threads()), num_items,
                            work / kMinWorkPerThread})));
  const int64_t* order = sorted.data();
  float* c = contrib.data();
  const Item* its = items.data();
  if (threads == 1) {
    for (int64_t i = 0; i < num_items; ++i) run_item<E>(p, its[i], order, c);
    for (int64_t t = 0; t < p.num_tokens; ++t) sum_token<E>(p, t, c);
    return Status::Ok();
  }
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_items; ++i) run_item<E>(p, its[i], order, c);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < p.num_tokens; ++t) sum_token<E>(p, t, c);
  }
  return Status::Ok();
}

}  // namespace

Status moe_experts(const MoeExpertsParams& p) {
  return p.dtype == DType::kBFloat16 ? run<BF16>(p) : run<F32>(p);
}

}  // namespace CBK_CPU_NS

#if CBK_CPU_PORTABLE
#if CBK_X86_BODIES
namespace cpu_avx512 {
Status moe_experts(const MoeExpertsParams& p);
}
namespace cpu_avx512_bf16 {
Status moe_experts(const MoeExpertsParams& p);
}
#endif

namespace cpu {
int64_t moe_workspace_bytes() {
  std::lock_guard<std::mutex> lock(moe_ws::registry_mutex());
  int64_t n = 0;
  for (moe_ws::Buffers* b : moe_ws::registry()) {
    std::unique_lock<std::mutex> held(b->mu, std::try_to_lock);
    if (held.owns_lock()) n += b->bytes();
  }
  return n;
}

int64_t moe_release_workspaces() {
  std::lock_guard<std::mutex> lock(moe_ws::registry_mutex());
  int64_t freed = 0;
  for (moe_ws::Buffers* b : moe_ws::registry()) {
    std::unique_lock<std::mutex> held(b->mu, std::try_to_lock);
    if (!held.owns_lock()) continue;       // a call is using it now
    freed += b->bytes();
    b->clear();
  }
  return freed;
}

Isa moe_experts_isa(DType dtype, Isa isa) {
  if (!CBK_X86_BODIES) return Isa::kPortable;
  return dtype == DType::kBFloat16 ? pick(isa, {Isa::kPortable, Isa::kAvx512Bf16})
                                   : pick(isa, {Isa::kPortable, Isa::kAvx512});
}

Status moe_experts(const MoeExpertsParams& p, Isa isa) {
  if (p.dtype != DType::kFloat32 && p.dtype != DType::kBFloat16)
    return Status::Error("moe_experts: dtype must be float32 or bfloat16");
  if (p.num_tokens < 0 || p.hidden <= 0 || p.top_k <= 0 || p.num_experts <= 0 || p.inter <= 0 ||
      p.x_stride < p.hidden || p.y_stride < p.hidden || (p.add && p.add_stride < p.hidden))
    return Status::Error("moe_experts: need num_tokens >= 0, positive sizes, strides >= hidden");
  if (p.gate_up_stride < moe_packed_elems(p.dtype, 2 * p.inter, p.hidden) ||
      p.down_stride < moe_packed_elems(p.dtype, p.hidden, p.inter))
    return Status::Error("moe_experts: an expert stride is below its packed weight's size");
  if (p.num_tokens == 0) return Status::Ok();
  if (!p.x || !p.topk_ids || !p.topk_weights || !p.gate_up || !p.down || !p.y)
    return Status::Error("moe_experts: null pointer");
#if CBK_X86_BODIES
  const Isa body = moe_experts_isa(p.dtype, isa);
  if (body == Isa::kAvx512Bf16) return cpu_avx512_bf16::moe_experts(p);
  if (body == Isa::kAvx512) return cpu_avx512::moe_experts(p);
#endif
  return cpu_portable::moe_experts(p);
}
}  // namespace cpu
#endif

}  // namespace cbk
