// A whole MoE block, or a dense gated MLP, in one call (cb_kernels/moe_block.h says what it
// computes).
//
// Why: runner/hybrid_layers.py ran a Qwen3-Next MoE block as ~9 calls from Python per layer and
// step (the shared expert's gate_up GEMM, silu_mul, its down GEMM; the router's GEMM, the
// route; the experts; the shared gate's GEMM and its sigmoid, the product, the sum), each
// ~8-25 us of wrapper and allocation at 16 rows whatever its work, serial at any thread count.
// Here they are the same kernel calls back to back in C++ on buffers kept between calls, so
// each stage gives the bits of the call it replaces; the sigmoid gate is a loop over the tokens
// (torch's scalar formula), and the gated shared expert is added in moe_experts' last pass
// (each op rounded as torch's mul_ and add_). Block alone, bench_hybrid.py's Qwen3-Next shape
// (hidden 256, 8 experts x 128 top 2, shared 128), bf16, 16 rows, Zen 4: 1 thread 90 us as the
// separate calls from C++, 79 us with the sum in the experts' pass; 2 threads 55 us.
//
// Threads: each kernel forks and joins its own team. One team for the block (the router, route
// and gate beside the shared gate_up's panels, the SiLU rows, then the down's panels as extra
// items of the experts' team; each kernel called inside it runs as a nested, inactive region)
// measured 53.1 / 56.6 us (min / median of 25) against 54.5 / 56.6 us at 2 threads, and 62 us
// with one item per 32-column panel (a nested region each): no gain for its code, so not kept.
//
// Built portable only: the kernels inside dispatch to their own SIMD bodies (`isa` caps them).
#include "cb_kernels/moe_block.h"

#include <algorithm>
#include <cmath>
#include <mutex>
#include <vector>

#include "bf16_scalar.h"  // load, round_to
#include "cb_kernels/elementwise.h"
#include "cb_kernels/linear.h"
#include "cb_kernels/moe.h"
#include "cb_kernels/moe_route.h"
#include "moe_workspace.h"

namespace cbk {

#if CBK_CPU_PORTABLE
namespace cpu {
namespace {

using cpu_portable::load;
using cpu_portable::round_to;

// What the calling thread keeps from call to call: the router's logits and top-k, the shared
// expert's gate_up, activation and output, the gate's logits (one 64-byte aligned piece each).
struct BlockBuffers : moe_ws::Buffers {
  std::vector<char> bytes_;
  int64_t bytes() const override { return moe_ws::capacity_bytes(bytes_); }
  void clear() override { moe_ws::free_vector(bytes_); }
};

constexpr int64_t align64(int64_t n) { return (n + 63) / 64 * 64; }

// One call's buffers; `error` the first failure (a stage returns false after setting it).
struct Stage {
  const MoeBlockParams& p;
  Isa isa;
  void* gate_up;      // [n, 2 * shared_inter]
  void* act;          // [n, shared_inter]
  void* out;          // [n, hidden]: the shared expert's output (y itself for a dense MLP)
  void* gate;         // [n, 1]
  float* sig;         // [n]: sigmoid of the gate, rounded to the dtype; nullptr: no gate
  void* logits;       // [n, num_experts]
  float* weights;     // [n, top_k]
  int64_t* ids;       // [n, top_k]
  Status error;
  bool failed(Status s) {
    if (s.ok()) return false;
    error = s;
    return true;
  }
};

// Columns [32 * p0, 32 * p1) of y = x W^T (+ bias), W packed [n, k] (its panels p0 .. p1 - 1):
// each column's sum is the whole linear's, so a split by panels keeps its bits.
bool packed_linear(Stage& s, const void* x, int64_t k, int64_t x_stride, const void* packed,
                   int64_t p0, int64_t n, const float* bias, void* y, int64_t y_stride,
                   int64_t p1 = -1) {
  const DType dt = s.p.dtype;
  const int64_t c0 = p0 * kLinearPanel;
  const int64_t c1 = p1 < 0 ? n : std::min(n, p1 * kLinearPanel);
  const int64_t panel = (dt == DType::kBFloat16 ? (k + 1) / 2 * 2 : k) * kLinearPanel;
  const int64_t es = dtype_size(dt), m = s.p.num_tokens;
  const void* w = static_cast<const char*>(packed) + p0 * panel * es;
  void* out = static_cast<char*>(y) + c0 * es;
  const float* b = bias ? bias + c0 : nullptr;
  if (dt == DType::kBFloat16)
    return !s.failed(linear_bf16(linear_params<LinearBf16Params, uint16_t>(
                                     x, m, k, x_stride, w, c1 - c0, b, out, y_stride), s.isa));
  return !s.failed(linear(linear_params<LinearParams, float>(x, m, k, x_stride, w, c1 - c0, b,
                                                             out, y_stride), s.isa));
}

bool gate_up_cols(Stage& s, int64_t p0, int64_t p1) {
  const MoeBlockParams& p = s.p;
  return packed_linear(s, p.x, p.hidden, p.x_stride, p.shared_gate_up, p0, 2 * p.shared_inter,
                       p.shared_gate_up_bias, s.gate_up, 2 * p.shared_inter, p1);
}

bool silu_rows(Stage& s, int64_t r0, int64_t r1) {
  if (r1 <= r0) return true;
  const int64_t I = s.p.shared_inter, es = dtype_size(s.p.dtype);
  SiluMulParams sm;
  sm.gate_up = static_cast<const char*>(s.gate_up) + r0 * 2 * I * es;
  sm.out = static_cast<char*>(s.act) + r0 * I * es;
  sm.rows = r1 - r0, sm.dim = I, sm.in_stride = 2 * I, sm.out_stride = I, sm.dtype = s.p.dtype;
  return !s.failed(silu_mul(sm, s.isa));
}

// The router's logits and top-k; with a shared gate its logits and sigmoid (torch's scalar
// formula, 1 / (1 + exp(-g)) in fp32 with libm's expf, rounded to the dtype).
bool route(Stage& s) {
  const MoeBlockParams& p = s.p;
  if (!packed_linear(s, p.x, p.hidden, p.x_stride, p.router, 0, p.num_experts, p.router_bias,
                     s.logits, p.num_experts))
    return false;
  MoeRouteParams r;
  r.logits = s.logits;
  r.num_tokens = p.num_tokens, r.num_experts = p.num_experts, r.logits_stride = p.num_experts;
  r.top_k = p.top_k, r.renormalize = p.renormalize, r.dtype = p.dtype;
  r.weights = s.weights, r.ids = s.ids;
  if (s.failed(moe_route(r))) return false;
  if (!s.sig) return true;
  if (!packed_linear(s, p.x, p.hidden, p.x_stride, p.shared_gate, 0, 1, p.shared_gate_bias,
                     s.gate, 1))
    return false;
  for (int64_t t = 0; t < p.num_tokens; ++t)
    s.sig[t] = round_to(1.0f / (1.0f + std::exp(-load(s.gate, t, p.dtype))), p.dtype);
  return true;
}

// The routed experts into y, the gated shared expert added in their last pass (MoeExpertsParams'
// `add`, inside their parallel region, where a pass of its own here ran serially).
Status experts(Stage& s) {
  const MoeBlockParams& p = s.p;
  MoeExpertsParams e;
  e.dtype = p.dtype;
  e.x = p.x, e.num_tokens = p.num_tokens, e.hidden = p.hidden, e.x_stride = p.x_stride;
  e.topk_ids = s.ids, e.topk_weights = s.weights, e.top_k = p.top_k;
  e.num_experts = p.num_experts, e.inter = p.experts_inter;
  e.gate_up = p.experts_gate_up, e.gate_up_stride = p.experts_gate_up_stride;
  e.down = p.experts_down, e.down_stride = p.experts_down_stride;
  e.y = p.y, e.y_stride = p.y_stride;
  e.add = s.out, e.add_stride = p.hidden, e.add_scale = s.sig;
  const Status r = moe_experts(e, s.isa);
  return r.ok() ? s.error : r;
}

}  // namespace

Status moe_block(const MoeBlockParams& p, Isa isa) {
  if (p.dtype != DType::kFloat32 && p.dtype != DType::kBFloat16)
    return Status::Error("moe_block: dtype must be float32 or bfloat16");
  if (p.num_tokens < 0 || p.hidden <= 0 || p.x_stride < p.hidden || p.y_stride < p.hidden)
    return Status::Error("moe_block: need num_tokens >= 0, hidden > 0, strides >= hidden");
  const bool shared = p.shared_gate_up != nullptr, routed = p.router != nullptr;
  if (!shared && !routed) return Status::Error("moe_block: neither a shared expert nor a router");
  if (shared && (!p.shared_down || p.shared_inter <= 0))
    return Status::Error("moe_block: the shared expert needs its down weight and inter > 0");
  if (p.shared_gate && !(shared && routed))
    return Status::Error("moe_block: a shared gate needs a shared expert and a router");
  if (routed && (p.num_experts <= 0 || p.top_k <= 0 || p.top_k > p.num_experts ||
                 !p.experts_gate_up || !p.experts_down || p.experts_inter <= 0))
    return Status::Error("moe_block: the router needs 0 < top_k <= num_experts and the experts");
  if (p.num_tokens == 0) return Status::Ok();
  if (!p.x || !p.y) return Status::Error("moe_block: null pointer");
  const int64_t n = p.num_tokens, H = p.hidden, es = dtype_size(p.dtype);
  const int64_t I = shared ? p.shared_inter : 0;

  thread_local BlockBuffers w;
  std::lock_guard<std::mutex> lock(w.mu);
  const int64_t E = routed ? p.num_experts : 0, K = routed ? p.top_k : 0;
  const int64_t logits_b = align64(n * E * es), weights_b = align64(n * K * 4);
  const int64_t ids_b = align64(n * K * 8), gate_up_b = align64(n * 2 * I * es);
  const int64_t act_b = align64(n * I * es), out_b = align64(routed ? n * H * es : 0);
  const int64_t gate_b = align64(p.shared_gate ? n * es : 0), sig_b = align64(n * 4);
  const int64_t total = 64 + logits_b + weights_b + ids_b + gate_up_b + act_b + out_b + gate_b +
                        sig_b;         // the parts a call does not use have zero size
  if (static_cast<int64_t>(w.bytes_.size()) < total) w.bytes_.resize(static_cast<size_t>(total));
  char* at = w.bytes_.data();
  at += (64 - reinterpret_cast<uintptr_t>(at) % 64) % 64;
  auto take = [&at](int64_t b) {
    char* r = at;
    at += b;
    return r;
  };

  Stage st{p, isa, take(gate_up_b), take(act_b), nullptr, take(gate_b),
           reinterpret_cast<float*>(take(sig_b)), take(logits_b),
           reinterpret_cast<float*>(take(weights_b)), reinterpret_cast<int64_t*>(take(ids_b))};
  if (!p.shared_gate) st.sig = nullptr;
  if (!shared) return route(st) ? experts(st) : st.error;
  st.out = routed ? take(out_b) : p.y;        // a dense MLP writes y directly
  const int64_t panels = (2 * I + kLinearPanel - 1) / kLinearPanel;
  if (!gate_up_cols(st, 0, panels) || !silu_rows(st, 0, n) ||
      !packed_linear(st, st.act, I, I, p.shared_down, 0, H, p.shared_down_bias, st.out,
                     routed ? H : p.y_stride))
    return st.error;
  if (!routed) return Status::Ok();
  return route(st) ? experts(st) : st.error;
}

}  // namespace cpu
#endif

}  // namespace cbk
