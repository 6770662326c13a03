// The short causal conv1d with its state over a variable-length batch (cb_kernels/causal_conv1d.h
// says what it computes). A work item is one row and a block of kBlock channels: its tokens in
// order, the channels inner (packed in x and out, so the loop vectorises), the weights of the
// block transposed once to [width, kBlock] and the slot's old window to [state_len, kBlock]
// (so the taps before the row's first token read a packed row too: no per-element branch).
// Items are independent: threads split them (varlen_items.h) and a row's result never depends
// on the batch. Built portable and with AVX-512 flags (CMakeLists.txt): the portable compile
// vectorises the channel loop with SSE2 only, and the bf16 loads (a shift each) with it; the
// op moves ~width x 2 values per output, memory-bound next to the gated delta rule.
#include <algorithm>
#include <cmath>
#include <vector>

#include "attention_vec.h"  // exp8: the Cephes-style exp of the attention and SiLU kernels
#include "cb_kernels/causal_conv1d.h"
#include "cb_kernels/gated_delta.h"  // gated_delta_rule_isa: the same two bodies
#include "varlen_items.h"

namespace cbk {
namespace CBK_CPU_NS {
namespace {

constexpr int64_t kBlock = 64;
// Multiply-adds (outputs x width) a thread must get before a second one joins: 2^15. (2^17,
// which kept a decode step's conv of 16 rows x 1024 channels x width 4 = 2^16 on one thread,
// measured 160 us there against 99 us on two, fp32, Zen 4, with the SiLU's exp still scalar.)
constexpr int64_t kWorkPerThread = int64_t{1} << 14;

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const uint16_t* p, int64_t i) { return bf16_to_float(p[i]); }
inline void store(float* p, int64_t i, float x) { p[i] = x; }
inline void store(uint16_t* p, int64_t i, float x) { p[i] = float_to_bf16(x); }
inline float round_as(const float*, float x) { return x; }
inline float round_as(const uint16_t*, float x) { return bf16_to_float(float_to_bf16(x)); }

// a[0, kBlock) = silu(a), x * sigmoid(x) with sigmoid from e = exp(-|x|) on 8 lanes at a time
// (elementwise.cpp's silu_mul takes the same steps; exp8's relative error ~2e-7). A scalar
// std::exp per output was the kernel's whole cost (~3 ns an output, the taps ~0.1 ns).
inline void silu_block(float* a) {
  for (int64_t c = 0; c < kBlock; c += 8) {
    const v8f x = load8(a + c);
    const v8f ax = x < 0 ? -x : x;
    const v8f e = exp8(-ax);
    const v8f one = splat(1.0f);
    store8(a + c, x * (x < 0 ? e / (one + e) : one / (one + e)));
  }
}

template <typename T>
void run_item(const CausalConv1dParams& p, int64_t s, int64_t c0) {
  const int64_t W = p.width, L = p.state_len, C = p.channels;
  const int64_t n = std::min(kBlock, C - c0);
  const int64_t t0 = p.rows.cu_seqlens[s], t1 = p.rows.cu_seqlens[s + 1];
  const T* x = static_cast<const T*>(p.x);
  const T* w = static_cast<const T*>(p.weight);
  const T* bias = static_cast<const T*>(p.bias);
  T* state = static_cast<T*>(p.conv_state) + (p.rows.slots[s] * C + c0) * L;   // [n, L]
  T* out = static_cast<T*>(p.out);
  float wt[16][kBlock];                 // [width, channel] (width <= 16, checked)
  for (int64_t c = 0; c < n; ++c)
    for (int64_t k = 0; k < W; ++k) wt[k][c] = load(w, (c0 + c) * W + k);
  float b[kBlock];
  for (int64_t c = 0; c < n; ++c) b[c] = bias ? load(bias, c0 + c) : 0.0f;
  // The L inputs before the row, oldest first ([L, kBlock]): the slot's window or zeros.
  thread_local std::vector<float> before_buf;
  before_buf.assign(static_cast<size_t>(std::max<int64_t>(L, 1) * kBlock), 0.0f);
  float* before = before_buf.data();
  if (p.rows.has_state[s])
    for (int64_t c = 0; c < n; ++c)
      for (int64_t i = 0; i < L; ++i) before[i * kBlock + c] = load(state, c * L + i);
  float acc[kBlock] = {};               // lanes past n stay finite for silu_block
  for (int64_t t = t0; t < t1; ++t) {
    for (int64_t c = 0; c < n; ++c) acc[c] = b[c];
    for (int64_t k = 0; k < W; ++k) {
      const int64_t pos = t - W + 1 + k;
      if (pos >= t0) {
        const T* xr = x + pos * p.x_stride + c0;
        for (int64_t c = 0; c < n; ++c) acc[c] += wt[k][c] * load(xr, c);
      } else {       // t0 - pos <= W - 1 <= L (state_len >= width - 1, checked)
        const float* br = before + (L - (t0 - pos)) * kBlock;
        for (int64_t c = 0; c < n; ++c) acc[c] += wt[k][c] * br[c];
      }
    }
    T* o = out + t * C + c0;
    for (int64_t c = 0; c < n; ++c) acc[c] = round_as(o, acc[c]);
    if (p.silu) silu_block(acc);
    for (int64_t c = 0; c < n; ++c) store(o, c, acc[c]);
  }
  // The new window: the last L inputs, the older ones from the old window (already copied).
  for (int64_t i = 0; i < L; ++i) {
    const int64_t pos = t1 - L + i;
    if (pos >= t0) {
      const T* xr = x + pos * p.x_stride + c0;
      for (int64_t c = 0; c < n; ++c) state[c * L + i] = xr[c];
    } else {
      const float* br = before + (L - (t0 - pos)) * kBlock;
      for (int64_t c = 0; c < n; ++c) store(state, c * L + i, br[c]);
    }
  }
}

// A decode row (one token, continuing from its slot) over channels [c0, c0 + n): each channel
// reads its own window in place ([L] in the slot, packed) and shifts it by one, with no
// transposed copies. run_item's per-item set-up (the weights to [width, kBlock], the old window
// to [L, kBlock]) is what a decode paid: 134 us for 16 rows x 1024 channels bf16 (1 thread,
// Zen 4), ~8 ns an output. Same sums in the same order as run_item (bias, then the taps oldest
// first), so a row's outputs do not depend on which path ran it. W_, L_ > 0: the width and
// window known at compile time (4 and 4: every model here), 0: read from p.
template <typename T, int W_, int L_>
void decode_item(const CausalConv1dParams& p, int64_t s, int64_t c0) {
  const int64_t W = W_ > 0 ? W_ : p.width, L = L_ > 0 ? L_ : p.state_len, C = p.channels;
  const int64_t n = std::min(kBlock, C - c0);
  const int64_t t = p.rows.cu_seqlens[s];
  const T* xr = static_cast<const T*>(p.x) + t * p.x_stride + c0;
  const T* w = static_cast<const T*>(p.weight) + c0 * W;
  const T* bias = static_cast<const T*>(p.bias);
  T* state = static_cast<T*>(p.conv_state) + (p.rows.slots[s] * C + c0) * L;   // [n, L]
  T* o = static_cast<T*>(p.out) + t * C + c0;
  float acc[kBlock] = {};               // lanes past n stay finite for silu_block
  for (int64_t c = 0; c < n; ++c) {
    const T* wc = w + c * W;
    T* win = state + c * L;
    float a = bias ? load(bias, c0 + c) : 0.0f;
    for (int64_t k = 0; k + 1 < W; ++k) a += load(wc, k) * load(win, L - W + 1 + k);
    a += load(wc, W - 1) * load(xr, c);
    acc[c] = round_as(o, a);
    for (int64_t i = 0; i + 1 < L; ++i) win[i] = win[i + 1];
    win[L - 1] = xr[c];
  }
  if (p.silu) silu_block(acc);
  for (int64_t c = 0; c < n; ++c) store(o, c, acc[c]);
}

template <typename T>
void item(const CausalConv1dParams& p, int64_t s, int64_t c0) {
  if (p.rows.cu_seqlens[s + 1] - p.rows.cu_seqlens[s] != 1 || !p.rows.has_state[s])
    return run_item<T>(p, s, c0);
  if (p.width == 4 && p.state_len == 4) return decode_item<T, 4, 4>(p, s, c0);
  if (p.width == 4 && p.state_len == 3) return decode_item<T, 4, 3>(p, s, c0);
  decode_item<T, 0, 0>(p, s, c0);
}

}  // namespace

Status causal_conv1d(const CausalConv1dParams& p) {
  const int64_t blocks = (p.channels + kBlock - 1) / kBlock;
  const int64_t work = std::max<int64_t>(p.rows.num_tokens(), 1) * p.channels * p.width;
  const bool bf16 = p.dtype == DType::kBFloat16;
  cpu::for_each_row_part(p.rows.cu_seqlens, p.rows.num_seqs, blocks, work, kWorkPerThread,
                         [&](int64_t s, int64_t block) {
                           bf16 ? item<uint16_t>(p, s, block * kBlock)
                                : item<float>(p, s, block * kBlock);
                         });
  return Status::Ok();
}

}  // namespace CBK_CPU_NS

#if CBK_CPU_PORTABLE
#if CBK_X86_BODIES
namespace cpu_avx512 {
Status causal_conv1d(const CausalConv1dParams& p);
}
#endif

namespace cpu {
Status causal_conv1d(const CausalConv1dParams& p, Isa isa) {
  if (const Status rows = check_rows(p.rows); !rows.ok()) return rows;
  if (p.channels <= 0 || p.width <= 0 || p.width > 16 ||
      p.state_len < p.width - 1 || p.x_stride < p.channels)
    return Status::Error("causal_conv1d: need channels > 0, 0 < width <= 16, "
                         "state_len >= width - 1, x_stride >= channels");
  if (p.dtype != DType::kFloat32 && p.dtype != DType::kBFloat16)
    return Status::Error("causal_conv1d: dtype must be float32 or bfloat16");
  if (p.rows.num_seqs == 0) return Status::Ok();
  if (!p.weight || (p.state_len > 0 && !p.conv_state))
    return Status::Error("causal_conv1d: null pointer");
  if (p.rows.num_tokens() > 0 && (!p.x || !p.out))
    return Status::Error("causal_conv1d: null pointer");   // (empty tensors may have none)
#if CBK_X86_BODIES
  if (gated_delta_rule_isa(isa) == Isa::kAvx512) return cpu_avx512::causal_conv1d(p);
#endif
  return cpu_portable::causal_conv1d(p);
}
}  // namespace cpu
#endif

}  // namespace cbk
