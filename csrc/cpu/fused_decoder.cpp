// See cb_kernels/fused_decoder.h. ISA-free: each step goes through its kernel's run-time dispatch.
#include "cb_kernels/fused_decoder.h"

#include <string>

#include "cb_kernels/elementwise.h"
#include "cb_kernels/linear.h"
#include "cb_kernels/paged_attention.h"
#include "paged_attention_call.h"

namespace cbk {
namespace cpu {

namespace {

// The decoder's dtype picks the kernel.
Status run_linear(const FusedDecoderParams& p, const void* x, int64_t k, const void* packed,
                  const float* bias, int64_t n, void* y) {
  // y [tokens, n] = x [tokens, k] @ W^T (+ bias), rows packed
  if (p.dtype == DType::kBFloat16)
    return linear_bf16(
        linear_params<LinearBf16Params, uint16_t>(x, p.tokens, k, k, packed, n, bias, y, n));
  return linear(linear_params<LinearParams, float>(x, p.tokens, k, k, packed, n, bias, y, n));
}

// x += residual (when given), out = norm(x) * weight.
Status run_norm(const FusedDecoderParams& p, const void* residual, const void* weight, void* out) {
  RmsNormParams r;
  r.x = p.x;
  r.residual = residual;
  r.weight = weight;
  r.out = out;
  r.rows = p.tokens;
  r.dim = p.hidden;
  r.x_stride = r.residual_stride = r.out_stride = p.hidden;
  r.eps = p.eps;
  r.dtype = p.dtype;
  return rms_norm(r);
}

#define CBK_TRY(call)            \
  do {                           \
    const Status s_ = (call);    \
    if (!s_.ok()) return s_;     \
  } while (0)

}  // namespace

Status fused_decoder(const FusedDecoderParams& p) {
  if (p.num_layers <= 0 || p.layers == nullptr)
    return Status::Error("fused_decoder: need at least one layer");
  if (p.dtype != DType::kFloat32 && p.dtype != DType::kBFloat16)
    return Status::Error("fused_decoder: dtype must be float32 or bfloat16");
  if (p.tokens <= 0) return Status::Ok();
  const int64_t q_n = p.heads * p.head_dim, kv_n = p.kv_heads * p.head_dim;
  const int64_t qkv_n = q_n + 2 * kv_n;
  const int64_t es = dtype_size(p.dtype);
  char* qkv = static_cast<char*>(p.qkv);

  // One check of the index tensors for every layer (they are the step's, shared).
  PagedAttentionParams a = layer_attention_params(p, p.tokens, p.heads, p.kv_heads);
  a.q = qkv;
  a.out = p.attn;
  a.q_stride_token = qkv_n;
  a.out_stride_token = q_n;
  // (ops/fused_decoder.py checked them with messages; this keeps a bad index from reading out of bounds)
  if (!paged_attention_index_error(a).empty())
    return Status::Error("fused_decoder: invalid block_tables, seq_lens or cu_seqlens_q");

  RopeWriteKvParams r;
  r.q.x = qkv;
  r.k.x = qkv + q_n * es;
  r.value = qkv + (q_n + kv_n) * es;
  r.q.cos = r.k.cos = p.cos;
  r.q.sin = r.k.sin = p.sin;
  r.q.tokens = r.k.tokens = p.tokens;
  r.q.heads = p.heads;
  r.k.heads = p.kv_heads;
  r.q.head_dim = r.k.head_dim = p.head_dim;
  r.q.token_stride = r.k.token_stride = r.value_token_stride = qkv_n;
  r.q.head_stride = r.k.head_stride = r.value_head_stride = p.head_dim;
  r.q.dtype = r.k.dtype = p.dtype;
  for (int i = 0; i < 3; ++i) {
    r.k_cache_stride[i] = p.k_stride[i];
    r.v_cache_stride[i] = p.v_stride[i];
  }
  r.slot_mapping = p.slot_mapping;
  r.block_size = p.block_size;
  r.num_slots = p.num_blocks * p.block_size;

  SiluMulParams s;
  s.gate_up = p.gate_up;
  s.out = p.act;
  s.rows = p.tokens;
  s.dim = p.intermediate;
  s.in_stride = 2 * p.intermediate;
  s.out_stride = p.intermediate;
  s.dtype = p.dtype;

  for (int64_t i = 0; i < p.num_layers; ++i) {
    const FusedDecoderLayer& l = p.layers[i];
    // The last sublayer's output (sub) joins the residual stream in this norm's pass.
    CBK_TRY(run_norm(p, i == 0 ? nullptr : p.sub, l.in_norm, p.h));
    CBK_TRY(run_linear(p, p.h, p.hidden, l.qkv, l.qkv_bias, qkv_n, p.qkv));
    r.k_cache = l.k_cache;
    r.v_cache = l.v_cache;
    CBK_TRY(rope_write_kv(r));
    a.k_cache = l.k_cache;
    a.v_cache = l.v_cache;
    a.sliding_window = l.sliding_window;
    CBK_TRY(paged_attention(a));
    CBK_TRY(run_linear(p, p.attn, q_n, l.o, l.o_bias, p.hidden, p.sub));
    CBK_TRY(run_norm(p, p.sub, l.post_norm, p.h));
    CBK_TRY(run_linear(p, p.h, p.hidden, l.gate_up, l.gate_up_bias, 2 * p.intermediate,
                       p.gate_up));
    CBK_TRY(silu_mul(s));
    CBK_TRY(run_linear(p, p.act, p.intermediate, l.down, l.down_bias, p.hidden, p.sub));
  }
  return run_norm(p, p.sub, p.final_norm, p.out);
}

}  // namespace cpu
}  // namespace cbk
