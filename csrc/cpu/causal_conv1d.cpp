// The short causal conv1d with its state over a variable-length batch (cb_kernels/causal_conv1d.h
// says what it computes). A work item is one row and a block of kBlock channels: its tokens in
// order, the channels inner (packed in x and out, so the loop vectorises), the weights of the
// block transposed once to [width, kBlock]. Items are independent: OpenMP threads split them and
// a row's result never depends on the batch. No ISA-specific body: -O3 vectorises the channel
// loop, and the op moves ~width x 2 floats per output (memory-bound next to the gated delta rule).
#include <algorithm>
#include <cmath>
#include <vector>

#include "cb_kernels/causal_conv1d.h"
#include "threads.h"

namespace cbk {
namespace cpu {
namespace {

constexpr int64_t kBlock = 64;
constexpr int64_t kParallelWork = int64_t{1} << 15;   // outputs x width below which one thread runs

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const uint16_t* p, int64_t i) { return bf16_to_float(p[i]); }
inline void store(float* p, int64_t i, float x) { p[i] = x; }
inline void store(uint16_t* p, int64_t i, float x) { p[i] = float_to_bf16(x); }
inline float round_as(const float*, float x) { return x; }
inline float round_as(const uint16_t*, float x) { return bf16_to_float(float_to_bf16(x)); }

template <typename T>
void run_item(const CausalConv1dParams& p, int64_t s, int64_t c0) {
  const int64_t W = p.width, L = p.state_len, C = p.channels;
  const int64_t n = std::min(kBlock, C - c0);
  const int64_t t0 = p.cu_seqlens[s], t1 = p.cu_seqlens[s + 1];
  const T* x = static_cast<const T*>(p.x);
  const T* w = static_cast<const T*>(p.weight);
  const T* bias = static_cast<const T*>(p.bias);
  T* state = static_cast<T*>(p.conv_state) + (p.slots[s] * C + c0) * L;   // [n, L] of this block
  T* out = static_cast<T*>(p.out);
  const bool continuing = p.has_state[s] != 0;
  float wt[16][kBlock];                 // [width, channel] (width <= 16, checked)
  for (int64_t c = 0; c < n; ++c)
    for (int64_t k = 0; k < W; ++k) wt[k][c] = load(w, (c0 + c) * W + k);
  // Input at position pos (absolute token index; < t0: the state's window or zeros), channel c.
  auto input = [&](int64_t pos, int64_t c) -> float {
    if (pos >= t0) return load(x, pos * p.x_stride + c0 + c);
    const int64_t back = t0 - pos;                      // 1 = the newest state entry
    return continuing && back <= L ? load(state, c * L + L - back) : 0.0f;
  };
  float acc[kBlock];
  for (int64_t t = t0; t < t1; ++t) {
    for (int64_t c = 0; c < n; ++c) acc[c] = bias ? load(bias, c0 + c) : 0.0f;
    for (int64_t k = 0; k < W; ++k) {
      const int64_t pos = t - W + 1 + k;
      if (pos >= t0) {
        const T* xr = x + pos * p.x_stride + c0;
        for (int64_t c = 0; c < n; ++c) acc[c] += wt[k][c] * load(xr, c);
      } else {
        for (int64_t c = 0; c < n; ++c) acc[c] += wt[k][c] * input(pos, c);
      }
    }
    T* o = out + t * C + c0;
    for (int64_t c = 0; c < n; ++c) {
      float y = round_as(o, acc[c]);
      if (p.silu) y = y / (1.0f + std::exp(-y));
      store(o, c, y);
    }
  }
  // The new window: the last L inputs; reading index i + len before writing i is safe in
  // ascending i (the source lies at or after the destination).
  for (int64_t c = 0; c < n; ++c)
    for (int64_t i = 0; i < L; ++i) store(state, c * L + i, input(t1 - L + i, c));
}

}  // namespace

Status causal_conv1d(const CausalConv1dParams& p) {
  if (p.num_seqs < 0 || p.channels <= 0 || p.width <= 0 || p.width > 16 || p.state_len < 0 ||
      p.x_stride < p.channels)
    return Status::Error("causal_conv1d: need num_seqs >= 0, channels > 0, 0 < width <= 16, "
                         "state_len >= 0, x_stride >= channels");
  if (p.dtype != DType::kFloat32 && p.dtype != DType::kBFloat16)
    return Status::Error("causal_conv1d: dtype must be float32 or bfloat16");
  if (p.num_seqs == 0) return Status::Ok();
  if (!p.weight || !p.slots || !p.cu_seqlens || !p.has_state || (p.state_len > 0 && !p.conv_state))
    return Status::Error("causal_conv1d: null pointer");
  if (p.cu_seqlens[p.num_seqs] > 0 && (!p.x || !p.out))
    return Status::Error("causal_conv1d: null pointer");   // (empty tensors may have none)
  const int64_t blocks = (p.channels + kBlock - 1) / kBlock;
  const int64_t items = p.num_seqs * blocks;
  const int64_t work = std::max<int64_t>(p.cu_seqlens[p.num_seqs], 1) * p.channels * p.width;
  const bool bf16 = p.dtype == DType::kBFloat16;
#pragma omp parallel for schedule(dynamic, 1) num_threads(max_threads()) \
    if (items > 1 && work >= kParallelWork)
  for (int64_t it = 0; it < items; ++it) {
    const int64_t s = it / blocks, c0 = (it % blocks) * kBlock;
    bf16 ? run_item<uint16_t>(p, s, c0) : run_item<float>(p, s, c0);
  }
  return Status::Ok();
}

}  // namespace cpu
}  // namespace cbk
