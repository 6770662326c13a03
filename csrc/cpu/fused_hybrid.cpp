// The stateful middle of a hybrid layer in one call (cb_kernels/fused_hybrid.h says what it
// computes).
//
// Why: around the conv, scan and norm kernels a gated delta-net layer ran ~20 torch ops a step
// in Python (the split of qkvz into the conv's channel order: 3 copies into a new buffer; the
// gates: sigmoid, casts, softplus, add, multiply; the outputs' allocations), each 5-25 us in a
// decode step whose recurrent state keeps the caches cold, serial at any thread count: with
// the rest of the forward's glue ~1.3-1.8 ms of a 4-6 ms step at hidden 256 (bench/RESULTS.md
// "Where a step goes"), which bounded two threads at ~1.4x one. Here the split and the gates
// are two loops over the tokens and the kernels run back to back on a workspace the caller
// owns. The kernels are the ops' own (same bodies, same bits); the gates are fp32 scalar math
// (std::exp, std::log1p: torch's vectorised exp/log1p may differ from them in the last bit).
//
// The blocks (mamba2_block, gated_delta_net_block) take the rest of the layer's calls into the
// same C++ call: its norms with their residual adds and its packed linears, which from Python
// cost ~8 us of wrapper each at 16 rows whatever their size. Measured in the engine (bench/
// RESULTS.md "Where a step goes", bf16, 16-row decode, Zen 4): the glue of a step from 1.21-1.26
// to 0.80-0.87 ms on Qwen3-Next hd128, 0.76-0.98 to 0.51-0.65 ms on Mamba-2 ds128.
//
// Built portable only: the loops here are copies and a few scalars per token and head; the
// kernels inside dispatch to their own AVX-512 bodies (`isa` caps the stateful ones, for tests;
// the norms and linears run their best, as the engine's separate calls do).
#include "cb_kernels/fused_hybrid.h"

#include <omp.h>

#include <cmath>
#include <cstring>

#include "bf16_scalar.h"  // load, round_to, rne, widen
#include "cb_kernels/causal_conv1d.h"
#include "cb_kernels/gated_delta.h"
#include "cb_kernels/elementwise.h"
#include "cb_kernels/gated_rms_norm.h"
#include "cb_kernels/linear.h"
#include "cb_kernels/offset_rms_norm.h"
#include "cb_kernels/selective_scan.h"
#include "threads.h"

namespace cbk {
namespace cpu {
namespace {

using cpu_portable::load;
using cpu_portable::rne;
using cpu_portable::round_to;
using cpu_portable::widen;

// Bytes a copy loop moves before it is worth a parallel region (a 16-row decode copies ~32 KiB).
constexpr int64_t kParallelBytes = int64_t{1} << 20;

constexpr int64_t align64(int64_t n) { return (n + 63) / 64 * 64; }

// torch's softplus (beta 1, threshold 20).
inline float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }

// The causal conv1d + SiLU of a mixer (GatedDeltaNetParams or Mamba2MixerParams: the same conv
// fields) over `channels` channels of x (tokens x_stride elements apart) into out (packed).
template <typename Mixer>
CausalConv1dParams conv_params(const Mixer& p, const void* x, int64_t x_stride, int64_t channels,
                               void* out) {
  CausalConv1dParams c;
  c.x = x;
  c.weight = p.conv_weight;
  c.bias = p.conv_bias;
  c.conv_state = p.conv_state;
  c.out = out;
  c.rows = p.rows;
  c.channels = channels;
  c.width = p.conv_width;
  c.state_len = p.state_len;
  c.x_stride = x_stride;
  c.silu = true;
  c.dtype = p.dtype;
  return c;
}

}  // namespace

int64_t gated_delta_net_workspace_bytes(const GatedDeltaNetParams& p) {
  const int64_t n = p.rows.num_tokens(), es = dtype_size(p.dtype);
  const int64_t conv_dim = 2 * p.num_k_heads * p.k_dim + p.num_v_heads * p.v_dim;
  return 2 * align64(n * conv_dim * es) + 2 * align64(n * p.num_v_heads * 4) +
         align64(n * p.num_v_heads * p.v_dim * es);
}

Status gated_delta_net(const GatedDeltaNetParams& p, Isa isa) {
  if (const Status rows = check_rows(p.rows); !rows.ok()) return rows;
  if (p.num_k_heads <= 0 || p.num_v_heads <= 0 || p.num_v_heads % p.num_k_heads ||
      p.k_dim <= 0 || p.v_dim <= 0)
    return Status::Error("gated_delta_net: need num_v_heads a positive multiple of num_k_heads, "
                         "k_dim > 0, v_dim > 0");
  if (p.dtype != DType::kFloat32 && p.dtype != DType::kBFloat16)
    return Status::Error("gated_delta_net: dtype must be float32 or bfloat16");
  const int64_t n = p.rows.num_tokens();
  if (p.rows.num_seqs == 0 || n == 0) return Status::Ok();
  if (!p.qkvz || !p.ba || !p.conv_weight || !p.conv_state || !p.state || !p.dt_bias ||
      !p.neg_a || !p.norm_weight || !p.out || !p.workspace)
    return Status::Error("gated_delta_net: null pointer");
  const int64_t es = dtype_size(p.dtype), nk = p.num_k_heads, hv = p.num_v_heads;
  const int64_t r = hv / nk, hk = p.k_dim, vd = p.v_dim, key_dim = nk * hk;
  const int64_t conv_dim = 2 * key_dim + hv * vd, width = 2 * hk + 2 * r * vd;
  if (p.qkvz_stride < nk * width || p.ba_stride < nk * 2 * r)
    return Status::Error("gated_delta_net: qkvz_stride or ba_stride below a token's width");
  char* ws = static_cast<char*>(p.workspace);
  char* mixed = ws;
  char* conv = mixed + align64(n * conv_dim * es);
  float* g = reinterpret_cast<float*>(conv + align64(n * conv_dim * es));
  float* beta = reinterpret_cast<float*>(reinterpret_cast<char*>(g) + align64(n * hv * 4));
  char* core = reinterpret_cast<char*>(beta) + align64(n * hv * 4);

  // The split into the conv's channel order, and the gates, token by token.
  const char* qkvz = static_cast<const char*>(p.qkvz);
  const DType dt = p.dtype;
#pragma omp parallel for schedule(static) num_threads(max_threads()) \
    if (n * conv_dim * es > kParallelBytes)
  for (int64_t t = 0; t < n; ++t) {
    char* dst = mixed + t * conv_dim * es;
    for (int64_t kh = 0; kh < nk; ++kh) {
      const char* src = qkvz + (t * p.qkvz_stride + kh * width) * es;
      std::memcpy(dst + kh * hk * es, src, hk * es);
      std::memcpy(dst + (key_dim + kh * hk) * es, src + hk * es, hk * es);
      std::memcpy(dst + (2 * key_dim + kh * r * vd) * es, src + 2 * hk * es, r * vd * es);
    }
    for (int64_t h = 0; h < hv; ++h) {
      const int64_t at = t * p.ba_stride + (h / r) * 2 * r + h % r;
      const float b = load(p.ba, at, dt), a = load(p.ba, at + r, dt);
      beta[t * hv + h] = round_to(1.0f / (1.0f + std::exp(-b)), dt);
      g[t * hv + h] = softplus(a + load(p.dt_bias, h, dt)) * p.neg_a[h];
    }
  }

  if (const Status s = causal_conv1d(conv_params(p, mixed, conv_dim, conv_dim, conv), isa); !s.ok())
    return s;

  GatedDeltaParams d;
  d.q = conv;
  d.k = conv + key_dim * es;
  d.v = conv + 2 * key_dim * es;
  d.g = g;
  d.beta = beta;
  d.state = p.state;
  d.out = core;
  d.rows = p.rows;
  d.num_k_heads = nk;
  d.num_v_heads = hv;
  d.k_dim = hk;
  d.v_dim = vd;
  d.q_stride[0] = d.k_stride[0] = d.v_stride[0] = conv_dim;
  d.q_stride[1] = d.k_stride[1] = hk;
  d.v_stride[1] = vd;
  d.scale = p.scale;
  d.l2norm_qk = true;
  d.dtype = dt;
  if (const Status s = gated_delta_rule(d, isa); !s.ok()) return s;

  GatedRmsNormParams m;
  m.x = core;
  m.gate = qkvz + (2 * hk + r * vd) * es;
  m.weight = p.norm_weight;
  m.out = p.out;
  m.tokens = n;
  m.num_groups = hv;
  m.group_size = vd;
  m.weight_len = vd;
  m.x_stride = hv * vd;
  m.gate_token_stride = p.qkvz_stride;
  m.gate_block_stride = width;
  m.groups_per_block = r;
  m.eps = p.norm_eps;
  m.norm_before_gate = true;
  m.dtype = dt;
  return gated_rms_norm(m, isa);
}

int64_t mamba2_mixer_workspace_bytes(const Mamba2MixerParams& p) {
  return mamba2_mixer_workspace_bytes(p, p.rows.num_tokens());
}

int64_t mamba2_mixer_workspace_bytes(const Mamba2MixerParams& p, int64_t n) {
  const int64_t es = dtype_size(p.dtype);
  const int64_t inner = p.num_heads * p.head_dim;
  const int64_t conv_dim = inner + 2 * p.num_groups * p.d_state;
  return align64(n * conv_dim * es) + align64(n * p.num_heads * 4) + align64(n * inner * es);
}

Status mamba2_mixer(const Mamba2MixerParams& p, Isa isa) {
  if (const Status rows = check_rows(p.rows); !rows.ok()) return rows;
  if (p.num_heads <= 0 || p.head_dim <= 0 || p.num_groups <= 0 ||
      p.num_heads % p.num_groups || p.d_state <= 0 || p.norm_group_size <= 0 ||
      (p.num_heads * p.head_dim) % p.norm_group_size)
    return Status::Error("mamba2_mixer: need num_heads a positive multiple of num_groups, "
                         "head_dim, d_state > 0, norm_group_size dividing num_heads * head_dim");
  if (p.dtype != DType::kFloat32 && p.dtype != DType::kBFloat16)
    return Status::Error("mamba2_mixer: dtype must be float32 or bfloat16");
  const int64_t n = p.rows.num_tokens();
  if (p.rows.num_seqs == 0 || n == 0) return Status::Ok();
  if (!p.proj || !p.conv_weight || !p.conv_state || !p.state || !p.A || !p.D || !p.dt_bias ||
      !p.norm_weight || !p.out || !p.workspace)
    return Status::Error("mamba2_mixer: null pointer");
  const int64_t es = dtype_size(p.dtype), nh = p.num_heads, inner = nh * p.head_dim;
  const int64_t bc = p.num_groups * p.d_state, conv_dim = inner + 2 * bc;
  if (p.proj_stride < inner + conv_dim + nh)
    return Status::Error("mamba2_mixer: proj_stride below a token's width");
  char* conv = static_cast<char*>(p.workspace);
  float* dt = reinterpret_cast<float*>(conv + align64(n * conv_dim * es));
  char* y = reinterpret_cast<char*>(dt) + align64(n * nh * 4);
  const char* proj = static_cast<const char*>(p.proj);

  if (const Status s =
          causal_conv1d(conv_params(p, proj + inner * es, p.proj_stride, conv_dim, conv), isa);
      !s.ok())
    return s;

  for (int64_t t = 0; t < n; ++t)       // dt in fp32, exactly (transformers' dt.float())
    for (int64_t h = 0; h < nh; ++h)
      dt[t * nh + h] = load(p.proj, t * p.proj_stride + inner + conv_dim + h, p.dtype);

  SelectiveScanParams s;
  s.x = conv;
  s.dt = dt;
  s.A = p.A;
  s.B = conv + inner * es;
  s.C = conv + (inner + bc) * es;
  s.D = p.D;
  s.dt_bias = p.dt_bias;
  s.state = p.state;
  s.out = y;
  s.rows = p.rows;
  s.num_heads = nh;
  s.head_dim = p.head_dim;
  s.num_groups = p.num_groups;
  s.d_state = p.d_state;
  s.x_stride = s.b_stride = s.c_stride = conv_dim;
  s.dt_softplus = true;
  s.dt_min = s.dt_max = 0.0f;          // transformers' (0, inf): no clamp
  s.dtype = p.dtype;
  if (const Status st = selective_scan(s, isa); !st.ok()) return st;

  GatedRmsNormParams m;
  m.x = y;
  m.gate = proj;
  m.weight = p.norm_weight;
  m.out = p.out;
  m.tokens = n;
  m.num_groups = inner / p.norm_group_size;
  m.group_size = p.norm_group_size;
  m.weight_len = inner;
  m.x_stride = inner;
  m.gate_token_stride = p.proj_stride;
  m.gate_block_stride = 0;
  m.groups_per_block = inner / p.norm_group_size;
  m.eps = p.norm_eps;
  m.norm_before_gate = false;
  m.dtype = p.dtype;
  return gated_rms_norm(m, isa);
}

namespace {

// y = x W^T (+ bias) on a packed weight of the dtype: rows packed, m rows.
Status packed_linear(DType dt, const void* x, int64_t m, int64_t k, const void* packed,
                     int64_t n, const float* bias, void* y, Isa isa) {
  if (dt == DType::kBFloat16) {
    LinearBf16Params l;
    l.x = static_cast<const uint16_t*>(x);
    l.packed = static_cast<const uint16_t*>(packed);
    l.y = static_cast<uint16_t*>(y);
    l.m = m, l.k = k, l.n = n, l.x_stride = k, l.y_stride = n, l.bias = bias;
    return linear_bf16(l, isa);
  }
  LinearParams l;
  l.x = static_cast<const float*>(x);
  l.packed = static_cast<const float*>(packed);
  l.y = static_cast<float*>(y);
  l.m = m, l.k = k, l.n = n, l.x_stride = k, l.y_stride = n, l.bias = bias;
  return linear(l, isa);
}

int64_t in_width(const Mamba2MixerParams& m) {
  const int64_t inner = m.num_heads * m.head_dim;
  return 2 * inner + 2 * m.num_groups * m.d_state + m.num_heads;
}

}  // namespace

int64_t mamba2_block_workspace_bytes(const Mamba2BlockParams& p) {
  return mamba2_block_workspace_bytes(p, p.mixer.rows.num_tokens());
}

int64_t mamba2_block_workspace_bytes(const Mamba2BlockParams& p, int64_t n) {
  const int64_t es = dtype_size(p.mixer.dtype);
  const Mamba2MixerParams& m = p.mixer;
  return 2 * align64(n * p.hidden * es) + align64(n * in_width(m) * es) +
         align64(n * m.num_heads * m.head_dim * es) + mamba2_mixer_workspace_bytes(m, n);
}

Status mamba2_block(const Mamba2BlockParams& p, Isa isa) {
  const DType dt = p.mixer.dtype;
  if (p.x_dtype != DType::kFloat32 && p.x_dtype != dt)
    return Status::Error("mamba2_block: x must be float32 or the mixer's dtype");
  if (p.hidden <= 0) return Status::Error("mamba2_block: need hidden > 0");
  const int64_t n = p.mixer.rows.num_tokens();
  if (p.mixer.rows.num_seqs == 0 || n == 0) return Status::Ok();
  if (!p.x || !p.norm_weight || !p.in_packed || !p.out_packed || !p.workspace)
    return Status::Error("mamba2_block: null pointer");
  const int64_t es = dtype_size(dt), hidden = p.hidden, width = in_width(p.mixer);
  const int64_t inner = p.mixer.num_heads * p.mixer.head_dim;
  char* h = static_cast<char*>(p.workspace);            // the norm's input, then its output
  char* o = h + align64(n * hidden * es);
  char* proj = o + align64(n * hidden * es);
  char* y = proj + align64(n * width * es);
  char* mixer_ws = y + align64(n * inner * es);

  // h = x rounded to the dtype (transformers' x.to(dtype) before the norm), normalised in place.
  void* norm_in = p.x;
  if (p.x_dtype != dt) {
    const float* x = static_cast<const float*>(p.x);
    uint16_t* hb = reinterpret_cast<uint16_t*>(h);
    for (int64_t i = 0; i < n * hidden; ++i) hb[i] = static_cast<uint16_t>(rne(x[i]) >> 16);
    norm_in = h;
  }
  RmsNormParams r;
  r.x = norm_in;
  r.weight = p.norm_weight;
  r.out = o;                                           // o: a free buffer until out_proj
  r.rows = n, r.dim = hidden, r.x_stride = r.out_stride = hidden;
  r.eps = p.norm_eps;
  r.dtype = dt;
  if (const Status s = rms_norm(r); !s.ok()) return s;      // the engine's norm: auto
  if (const Status s = packed_linear(dt, o, n, hidden, p.in_packed, width, p.in_bias, proj,
                                     Isa::kAuto);
      !s.ok())
    return s;
  Mamba2MixerParams m = p.mixer;
  m.proj = proj;
  m.proj_stride = width;
  m.out = y;
  m.workspace = mixer_ws;
  if (const Status s = mamba2_mixer(m, isa); !s.ok()) return s;
  if (const Status s = packed_linear(dt, y, n, inner, p.out_packed, hidden, p.out_bias, o,
                                     Isa::kAuto);
      !s.ok())
    return s;
  // The residual add in x's dtype (transformers' residual + hidden_states).
  if (p.x_dtype == DType::kFloat32) {
    float* x = static_cast<float*>(p.x);
    for (int64_t i = 0; i < n * hidden; ++i) x[i] += load(o, i, dt);
  } else {
    uint16_t* x = static_cast<uint16_t*>(p.x);
    const uint16_t* ob = reinterpret_cast<const uint16_t*>(o);
    for (int64_t i = 0; i < n * hidden; ++i)
      x[i] = static_cast<uint16_t>(rne(widen(x[i]) + widen(ob[i])) >> 16);
  }
  return Status::Ok();
}

namespace {
struct GdnWidths {
  int64_t qkvz, ba, value;
};
GdnWidths gdn_widths(const GatedDeltaNetParams& m) {
  const int64_t r = m.num_v_heads / m.num_k_heads;
  return {m.num_k_heads * (2 * m.k_dim + 2 * r * m.v_dim), m.num_k_heads * 2 * r,
          m.num_v_heads * m.v_dim};
}
}  // namespace

int64_t gated_delta_net_block_workspace_bytes(const GatedDeltaNetBlockParams& p) {
  const int64_t n = p.mixer.rows.num_tokens(), es = dtype_size(p.mixer.dtype);
  const GdnWidths w = gdn_widths(p.mixer);
  return 2 * align64(n * p.hidden * es) + align64(n * w.qkvz * es) + align64(n * w.ba * es) +
         align64(n * w.value * es) + gated_delta_net_workspace_bytes(p.mixer);
}

Status gated_delta_net_block(const GatedDeltaNetBlockParams& p, Isa isa) {
  const DType dt = p.mixer.dtype;
  if (p.hidden <= 0 || p.mixer.num_k_heads <= 0 || p.mixer.num_v_heads % p.mixer.num_k_heads)
    return Status::Error("gated_delta_net_block: need hidden > 0 and num_v_heads a multiple of "
                         "num_k_heads > 0");
  const int64_t n = p.mixer.rows.num_tokens();
  if (p.mixer.rows.num_seqs == 0 || n == 0) return Status::Ok();
  if (!p.x || !p.in_norm_weight || !p.post_norm_weight || !p.qkvz_packed || !p.ba_packed ||
      !p.out_packed || !p.h_out || !p.workspace)
    return Status::Error("gated_delta_net_block: null pointer");
  const int64_t es = dtype_size(dt), hidden = p.hidden;
  const GdnWidths w = gdn_widths(p.mixer);
  char* h = static_cast<char*>(p.workspace);
  char* o = h + align64(n * hidden * es);
  char* qkvz = o + align64(n * hidden * es);
  char* ba = qkvz + align64(n * w.qkvz * es);
  char* normed = ba + align64(n * w.ba * es);
  char* mixer_ws = normed + align64(n * w.value * es);

  OffsetRmsNormParams r;                 // the engine's norms run their best body (auto)
  r.x = p.x;
  r.residual = p.pending;
  r.weight = p.in_norm_weight;
  r.out = h;
  r.rows = n, r.dim = hidden, r.x_stride = r.residual_stride = hidden;
  r.eps = p.in_norm_eps;
  r.dtype = dt;
  if (const Status s = offset_rms_norm(r); !s.ok()) return s;
  if (const Status s = packed_linear(dt, h, n, hidden, p.qkvz_packed, w.qkvz, p.qkvz_bias, qkvz,
                                     Isa::kAuto);
      !s.ok())
    return s;
  if (const Status s = packed_linear(dt, h, n, hidden, p.ba_packed, w.ba, p.ba_bias, ba,
                                     Isa::kAuto);
      !s.ok())
    return s;
  GatedDeltaNetParams m = p.mixer;
  m.qkvz = qkvz;
  m.ba = ba;
  m.qkvz_stride = w.qkvz;
  m.ba_stride = w.ba;
  m.out = normed;
  m.workspace = mixer_ws;
  if (const Status s = gated_delta_net(m, isa); !s.ok()) return s;
  if (const Status s = packed_linear(dt, normed, n, w.value, p.out_packed, hidden, p.out_bias, o,
                                     Isa::kAuto);
      !s.ok())
    return s;
  r.residual = o;
  r.weight = p.post_norm_weight;
  r.out = p.h_out;
  r.eps = p.post_norm_eps;
  return offset_rms_norm(r);
}

}  // namespace cpu
}  // namespace cbk
