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
// (each op rounded as torch's mul_ and add_).
//
// Built portable only: the kernels inside dispatch to their own SIMD bodies (`isa` caps them).
#include "cb_kernels/moe_block.h"

#include <cmath>
#include <mutex>
#include <vector>

#include "cb_kernels/elementwise.h"
#include "cb_kernels/linear.h"
#include "cb_kernels/moe.h"
#include "cb_kernels/moe_route.h"
#include "moe_workspace.h"

namespace cbk {

#if CBK_CPU_PORTABLE
namespace cpu {
namespace {

// What the calling thread keeps from call to call: the router's logits and top-k, the shared
// expert's gate_up, activation and output, the gate's logits (one 64-byte aligned piece each).
struct BlockBuffers : moe_ws::Buffers {
  std::vector<char> bytes_;
  int64_t bytes() const override { return moe_ws::capacity_bytes(bytes_); }
  void clear() override { moe_ws::free_vector(bytes_); }
};

constexpr int64_t align64(int64_t n) { return (n + 63) / 64 * 64; }

// y = x W^T (+ bias) on a packed [n, k] weight of the dtype, m rows.
Status packed_linear(DType dt, const void* x, int64_t m, int64_t k, int64_t x_stride,
                     const void* packed, int64_t n, const float* bias, void* y, int64_t y_stride,
                     Isa isa) {
  if (dt == DType::kBFloat16)
    return linear_bf16(linear_params<LinearBf16Params, uint16_t>(x, m, k, x_stride, packed, n,
                                                                 bias, y, y_stride), isa);
  return linear(linear_params<LinearParams, float>(x, m, k, x_stride, packed, n, bias, y,
                                                   y_stride), isa);
}

inline float load(const void* base, int64_t i, DType dt) {
  return dt == DType::kBFloat16 ? bf16_to_float(static_cast<const uint16_t*>(base)[i])
                                : static_cast<const float*>(base)[i];
}

inline float round_to(float v, DType dt) {
  return dt == DType::kBFloat16 ? bf16_to_float(float_to_bf16(v)) : v;
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
  if (!shared && p.shared_gate) return Status::Error("moe_block: a shared gate with no shared expert");
  if (routed && (p.num_experts <= 0 || p.top_k <= 0 || p.top_k > p.num_experts ||
                 !p.experts_gate_up || !p.experts_down || p.experts_inter <= 0))
    return Status::Error("moe_block: the router needs 0 < top_k <= num_experts and the experts");
  if (p.num_tokens == 0) return Status::Ok();
  if (!p.x || !p.y) return Status::Error("moe_block: null pointer");
  const DType dt = p.dtype;
  const int64_t n = p.num_tokens, H = p.hidden, es = dtype_size(dt), I = p.shared_inter;

  thread_local BlockBuffers w;
  std::lock_guard<std::mutex> lock(w.mu);
  const int64_t logits_b = align64(n * p.num_experts * es), weights_b = align64(n * p.top_k * 4);
  const int64_t ids_b = align64(n * p.top_k * 8), gate_up_b = align64(n * 2 * I * es);
  const int64_t act_b = align64(n * I * es), out_b = align64(n * H * es);
  const int64_t gate_b = align64(n * es), sig_b = align64(n * 4);
  const int64_t total = 64 + (routed ? logits_b + weights_b + ids_b : 0) +
                        (shared ? gate_up_b + act_b + out_b + gate_b + sig_b : 0);
  if (static_cast<int64_t>(w.bytes_.size()) < total) w.bytes_.resize(static_cast<size_t>(total));
  char* at = w.bytes_.data();
  at += (64 - reinterpret_cast<uintptr_t>(at) % 64) % 64;
  auto take = [&at](int64_t b) {
    char* r = at;
    at += b;
    return r;
  };

  // The shared expert first: the experts' last pass adds it to their sum (MoeExpertsParams'
  // `add`), inside their parallel region, where a pass of its own here ran serially.
  void* out = nullptr;             // the shared expert's output; y itself for a dense MLP
  float* sig = nullptr;            // [n] sigmoid of the shared gate, rounded to the dtype
  if (shared) {
    void* gate_up = take(gate_up_b);
    void* act = take(act_b);
    out = routed ? take(out_b) : p.y;
    const int64_t out_stride = routed ? H : p.y_stride;
    if (Status s = packed_linear(dt, p.x, n, H, p.x_stride, p.shared_gate_up, 2 * I,
                                 p.shared_gate_up_bias, gate_up, 2 * I, isa); !s.ok())
      return s;
    SiluMulParams sm;
    sm.gate_up = gate_up, sm.out = act, sm.rows = n, sm.dim = I, sm.in_stride = 2 * I;
    sm.out_stride = I, sm.dtype = dt;
    if (Status s = silu_mul(sm, isa); !s.ok()) return s;
    if (Status s = packed_linear(dt, act, n, I, I, p.shared_down, H, p.shared_down_bias, out,
                                 out_stride, isa); !s.ok())
      return s;
    if (!routed) return Status::Ok();
    if (p.shared_gate) {
      void* gate = take(gate_b);
      sig = reinterpret_cast<float*>(take(sig_b));
      if (Status s = packed_linear(dt, p.x, n, H, p.x_stride, p.shared_gate, 1,
                                   p.shared_gate_bias, gate, 1, isa); !s.ok())
        return s;
      // torch's scalar sigmoid (1 / (1 + exp(-g)) in fp32, libm's expf), rounded to the dtype.
      for (int64_t t = 0; t < n; ++t)
        sig[t] = round_to(1.0f / (1.0f + std::exp(-load(gate, t, dt))), dt);
    }
  }

  void* logits = take(logits_b);
  float* weights = reinterpret_cast<float*>(take(weights_b));
  int64_t* ids = reinterpret_cast<int64_t*>(take(ids_b));
  if (Status s = packed_linear(dt, p.x, n, H, p.x_stride, p.router, p.num_experts,
                               p.router_bias, logits, p.num_experts, isa); !s.ok())
    return s;
  MoeRouteParams r;
  r.logits = logits;
  r.num_tokens = n, r.num_experts = p.num_experts, r.logits_stride = p.num_experts;
  r.top_k = p.top_k, r.renormalize = p.renormalize, r.dtype = dt;
  r.weights = weights, r.ids = ids;
  if (Status s = moe_route(r); !s.ok()) return s;
  MoeExpertsParams e;
  e.dtype = dt;
  e.x = p.x, e.num_tokens = n, e.hidden = H, e.x_stride = p.x_stride;
  e.topk_ids = ids, e.topk_weights = weights, e.top_k = p.top_k;
  e.num_experts = p.num_experts, e.inter = p.experts_inter;
  e.gate_up = p.experts_gate_up, e.gate_up_stride = p.experts_gate_up_stride;
  e.down = p.experts_down, e.down_stride = p.experts_down_stride;
  e.y = p.y, e.y_stride = p.y_stride;
  e.add = out, e.add_stride = H, e.add_scale = sig;
  return moe_experts(e, isa);
}

}  // namespace cpu
#endif

}  // namespace cbk
