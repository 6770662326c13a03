// Qwen3-Next's full-attention layer up to its MLP in one call (cb_kernels/fused_gated_attention.h
// says what it computes).
//
// Why: runner/hybrid_layers.py ran this layer as ~15 calls from Python a step: the input norm,
// the packed q(+gate)/k/v GEMM, the split, q_norm and k_norm (each after a reshape copy), rotary
// on q and on k, the KV write, paged attention, the gate's reshape copy, sigmoid and multiply,
// o_proj and the post norm. At 16 decode rows each costs ~8-25 us of wrapper, allocation or
// torch dispatch whatever its size, serial at any thread count: with two threads that glue
// does not shrink, and it bounded the step's 2-thread speed-up (bench/RESULTS.md "Where a step
// goes"). Here the kernels run back to back on a workspace the caller owns; the copies and the
// gate are loops over a few thousand elements. Measured (bench/bench_hybrid_step.py
// --separate-attention --rounds 5 and 6, Qwen3-Next hd128, bf16 16-row decode, Zen 4 AVX-512/
// VNNI/AVX512-BF16, 2 cores shared, load 1.3-2.1; medians of the rounds, two runs): the step's
// torch glue 1.12-1.34 -> 0.90-0.95 ms at one thread, 1.12-1.26 -> 0.86 at two; the decode step
// 5.67-6.35 -> 5.58-5.64 ms at one thread, 4.62-4.97 -> 4.19-4.41 ms at two (with the attention
// split below; the layer's call 0.45 ms at one thread, 0.31-0.36 at two).
//
// Built portable only: the loops here are copies and one multiply per element; the kernels
// inside dispatch to their own AVX-512 bodies (`isa` caps them all, for tests).
#include "cb_kernels/fused_gated_attention.h"

#include <omp.h>

#include <algorithm>
#include <cstring>

#include "bf16_scalar.h"  // widen, rne
#include "cb_kernels/cache_ops.h"
#include "cb_kernels/elementwise.h"
#include "cb_kernels/linear.h"
#include "cb_kernels/offset_rms_norm.h"
#include "cb_kernels/paged_attention.h"
#include "paged_attention_call.h"
#include "threads.h"

namespace cbk {
namespace cpu {
namespace {

using cpu_portable::rne;
using cpu_portable::widen;

constexpr int64_t align64(int64_t n) { return (n + 63) / 64 * 64; }

// The workspace, in this order (qkv first: the caller reads it between the two halves).
struct Buffers {
  char *qkv, *h, *q_in, *q, *k_in, *k, *attn, *o;
  int32_t* cu;  // [num_seqs + kMaxParts]: the parts' cu_seqlens_q when the attention is split
};

struct Widths {
  int64_t q, kv, qkv;  // q: num_heads head_dim; kv: num_kv_heads head_dim; qkv: the GEMM's
};

Widths widths(const GatedAttentionParams& p) {
  const int64_t q = p.num_heads * p.head_dim, kv = p.num_kv_heads * p.head_dim;
  return {q, kv, 2 * q + 2 * kv};
}

Buffers buffers(const GatedAttentionParams& p) {
  const int64_t n = p.num_tokens, es = dtype_size(p.dtype);
  const Widths w = widths(p);
  Buffers b;
  b.qkv = static_cast<char*>(p.workspace);
  b.h = b.qkv + align64(n * w.qkv * es);
  b.q_in = b.h + align64(n * p.hidden * es);
  b.q = b.q_in + align64(n * w.q * es);
  b.k_in = b.q + align64(n * w.q * es);
  b.k = b.k_in + align64(n * w.kv * es);
  b.attn = b.k + align64(n * w.kv * es);
  b.o = b.attn + align64(n * w.q * es);
  b.cu = reinterpret_cast<int32_t*>(b.o + align64(n * p.hidden * es));
  return b;
}

// y [m, n] = x [m, k] @ W^T (+ bias) on a packed weight of the dtype, rows packed.
Status packed_linear(DType dt, const void* x, int64_t m, int64_t k, const void* packed, int64_t n,
                     const float* bias, void* y, Isa isa) {
  if (dt == DType::kBFloat16)
    return linear_bf16(linear_params<LinearBf16Params, uint16_t>(x, m, k, k, packed, n, bias, y, n),
                       isa);
  return linear(linear_params<LinearParams, float>(x, m, k, k, packed, n, bias, y, n), isa);
}

// out [rows, dim] packed = offset_rms_norm(x) (x += residual first, when given).
Status norm(const GatedAttentionParams& p, void* x, const void* residual, const void* weight,
            float eps, void* out, int64_t rows, int64_t dim, Isa isa) {
  OffsetRmsNormParams r;
  r.x = x;
  r.residual = residual;
  r.weight = weight;
  r.out = out;
  r.rows = rows, r.dim = dim, r.x_stride = r.residual_stride = dim;
  r.eps = eps;
  r.dtype = p.dtype;
  return offset_rms_norm(r, isa);
}

// dst [tokens, heads, len] packed = src's rows: token t, head h at src + t * token_stride +
// h * head_stride (elements). The separate calls' reshape copies before q_norm / k_norm.
void gather_heads(char* dst, const char* src, int64_t tokens, int64_t heads, int64_t len,
                  int64_t token_stride, int64_t head_stride, int64_t es) {
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t h = 0; h < heads; ++h)
      std::memcpy(dst + (t * heads + h) * len * es, src + (t * token_stride + h * head_stride) * es,
                  len * es);
}

Status rope_heads(const GatedAttentionParams& p, void* x, int64_t heads, Isa isa) {
  RopeParams r;
  r.x = x;
  r.cos = p.cos;
  r.sin = p.sin;
  r.tokens = p.num_tokens;
  r.heads = heads;
  r.head_dim = p.rotary_dim;
  r.token_stride = heads * p.head_dim;
  r.head_stride = p.head_dim;
  r.dtype = p.dtype;
  return rope(r, isa);
}

// attn [n, num_heads head_dim] *= sigmoid(gate), in the dtype (torch's mul_: the product of the
// two values in fp32, rounded once). The gate of token t, head h: qkv + t * qkv width +
// h * 2 head_dim + head_dim.
Status apply_gate(const GatedAttentionParams& p, const Buffers& b) {
  const int64_t n = p.num_tokens, hd = p.head_dim, heads = p.num_heads;
  const Widths w = widths(p);
  if (p.dtype == DType::kFloat32) {  // (gated_attention_rest checked that a sigmoid is given)
    float* a = reinterpret_cast<float*>(b.attn);
    const float* s = static_cast<const float*>(p.gate_sigmoid);
    for (int64_t i = 0; i < n * w.q; ++i) a[i] *= s[i];
    return Status::Ok();
  }
  uint16_t* a = reinterpret_cast<uint16_t*>(b.attn);
  if (p.gate_sigmoid) {
    const uint16_t* s = static_cast<const uint16_t*>(p.gate_sigmoid);
    for (int64_t i = 0; i < n * w.q; ++i)
      a[i] = static_cast<uint16_t>(rne(widen(a[i]) * widen(s[i])) >> 16);
    return Status::Ok();
  }
  const uint16_t* table = p.sigmoid_table;
  const uint16_t* qkv = reinterpret_cast<const uint16_t*>(b.qkv);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t h = 0; h < heads; ++h) {
      const uint16_t* g = qkv + t * w.qkv + h * 2 * hd + hd;
      uint16_t* at = a + (t * heads + h) * hd;
      for (int64_t i = 0; i < hd; ++i)
        at[i] = static_cast<uint16_t>(rne(widen(at[i]) * widen(table[g[i]])) >> 16);
    }
  return Status::Ok();
}

// The paged attention call of the separate path: q and out packed [n, num_heads, head_dim].
PagedAttentionParams attention_params(const GatedAttentionParams& p, const Buffers& b) {
  PagedAttentionParams a = layer_attention_params(p, p.num_tokens, p.num_heads, p.num_kv_heads);
  a.q = b.q;
  a.out = b.attn;
  a.k_cache = p.k_cache;
  a.v_cache = p.v_cache;
  a.q_stride_token = a.out_stride_token = p.num_heads * p.head_dim;
  return a;
}

// The index tensors the attention trusts (ops/gated_attention.py checks them with messages;
// this keeps a bad index on the engine's unchecked path from reading out of bounds, and runs
// before anything is written).
Status check_indices(const GatedAttentionParams& p, const Buffers& b) {
  if (p.num_seqs <= 0 || !paged_attention_index_error(attention_params(p, b)).empty())
    return Status::Error("gated_attention: invalid block_tables, seq_lens or cu_seqlens_q");
  return Status::Ok();
}

// The paged attention kernel keeps a call under 2 x 4096 (query row, key) pairs on one thread
// (kGrainWork, csrc/cpu/paged_attention_items.h: ~40 us a grain at head_dim 64). At the bench's
// 16-row decode over ~100-token contexts (4 q heads x 128) that is ~6400 pairs, ~0.3 ms a step
// in the engine on one thread at any thread count. Its result for a sequence does not depend on
// the rest of the batch (paged_attention.cpp's contract), so calls over consecutive runs of the
// sequences, one a thread, give the same bits. A part gets at least kPartWork pairs: below that
// the fork costs about what the part saves.
constexpr int64_t kKernelSerialWork = 2 * 4096;
constexpr int64_t kPartWork = 512;
constexpr int64_t kMaxParts = kKernelSerialWork / kPartWork;

int64_t seq_work(const GatedAttentionParams& p, int64_t i) {
  return int64_t{p.cu_seqlens_q[i + 1] - p.cu_seqlens_q[i]} * p.num_heads * p.seq_lens[i];
}

Status run_attention(const GatedAttentionParams& p, const Buffers& b, Isa isa) {
  const PagedAttentionParams a = attention_params(p, b);
  int64_t work = 0;
  for (int64_t i = 0; i < p.num_seqs; ++i) work += seq_work(p, i);
  const int64_t parts = std::min<int64_t>({max_threads(), p.num_seqs, work / kPartWork});
  if (parts < 2 || work >= kKernelSerialWork) return paged_attention(a, isa);
  // Part k: sequences cut[k] .. cut[k + 1] - 1, cut where the running work passes k / parts.
  int64_t cut[kMaxParts + 1] = {0};
  int64_t count = 1, done = 0;
  for (int64_t i = 0; i + 1 < p.num_seqs && count < parts; ++i) {
    done += seq_work(p, i);
    if (done * parts >= count * work) cut[count++] = i + 1;
  }
  cut[count] = p.num_seqs;
  PagedAttentionParams part[kMaxParts];
  const int64_t es = dtype_size(p.dtype);
  for (int64_t k = 0; k < count; ++k) {
    const int64_t s0 = cut[k], s1 = cut[k + 1], t0 = p.cu_seqlens_q[s0];
    int32_t* cu = b.cu + s0 + k;  // this part's cu_seqlens_q, from 0
    for (int64_t i = s0; i <= s1; ++i) cu[i - s0] = p.cu_seqlens_q[i] - static_cast<int32_t>(t0);
    part[k] = a;
    part[k].q = static_cast<const char*>(a.q) + t0 * a.q_stride_token * es;
    part[k].out = static_cast<char*>(a.out) + t0 * a.out_stride_token * es;
    part[k].block_tables = a.block_tables + s0 * a.block_table_stride;
    part[k].seq_lens = a.seq_lens + s0;
    part[k].cu_seqlens_q = cu;
    part[k].num_seqs = s1 - s0;
    part[k].num_tokens = p.cu_seqlens_q[s1] - t0;
  }
  Status st[kMaxParts];
#pragma omp parallel num_threads(static_cast<int>(count))
  {  // (a smaller team, where OpenMP gives fewer threads, runs the parts in turn)
    for (int64_t k = omp_get_thread_num(); k < count; k += omp_get_num_threads())
      st[k] = paged_attention(part[k], isa);
  }
  for (int64_t k = 0; k < count; ++k)
    if (!st[k].ok()) return st[k];
  return Status::Ok();
}

Status check(const GatedAttentionParams& p) {
  if (p.dtype != DType::kFloat32 && p.dtype != DType::kBFloat16)
    return Status::Error("gated_attention: dtype must be float32 or bfloat16");
  if (p.num_tokens < 0 || p.hidden <= 0 || p.num_heads <= 0 || p.num_kv_heads <= 0 ||
      p.num_heads % p.num_kv_heads || p.head_dim <= 0 || p.rotary_dim < 0 || p.rotary_dim % 2 ||
      p.rotary_dim > p.head_dim)
    return Status::Error("gated_attention: need hidden, head_dim > 0, num_heads a multiple of "
                         "num_kv_heads > 0, rotary_dim even in [0, head_dim]");
  if (p.num_tokens > 0 &&
      (!p.x || !p.in_norm_weight || !p.post_norm_weight || !p.q_norm_weight || !p.k_norm_weight ||
       !p.qkv_packed || !p.o_packed || !p.k_cache || !p.v_cache || !p.slot_mapping ||
       !p.block_tables || !p.seq_lens || !p.cu_seqlens_q || !p.h_out || !p.workspace ||
       (p.rotary_dim > 0 && (!p.cos || !p.sin))))
    return Status::Error("gated_attention: null pointer");
  return Status::Ok();
}

}  // namespace

int64_t gated_attention_workspace_bytes(const GatedAttentionParams& p) {
  const int64_t n = p.num_tokens, es = dtype_size(p.dtype);
  const Widths w = widths(p);
  return align64(n * w.qkv * es) + 2 * align64(n * p.hidden * es) + 3 * align64(n * w.q * es) +
         2 * align64(n * w.kv * es) + align64((p.num_seqs + kMaxParts) * 4);
}

Status gated_attention_qkv(const GatedAttentionParams& p, Isa isa) {
  if (const Status s = check(p); !s.ok()) return s;
  if (p.num_tokens == 0) return Status::Ok();
  const Buffers b = buffers(p);
  if (const Status s = check_indices(p, b); !s.ok()) return s;
  if (const Status s = norm(p, p.x, p.pending, p.in_norm_weight, p.in_norm_eps, b.h, p.num_tokens,
                            p.hidden, isa);
      !s.ok())
    return s;
  return packed_linear(p.dtype, b.h, p.num_tokens, p.hidden, p.qkv_packed, widths(p).qkv,
                       p.qkv_bias, b.qkv, isa);
}

Status gated_attention_rest(const GatedAttentionParams& p, Isa isa) {
  if (const Status s = check(p); !s.ok()) return s;
  if (!p.gate_sigmoid && (p.dtype != DType::kBFloat16 || !p.sigmoid_table))
    return Status::Error("gated_attention_rest: need gate_sigmoid (or bf16 and sigmoid_table)");
  const int64_t n = p.num_tokens, hd = p.head_dim, es = dtype_size(p.dtype);
  if (n == 0) return Status::Ok();
  const Buffers b = buffers(p);
  const Widths w = widths(p);

  if (const Status s = check_indices(p, b); !s.ok()) return s;

  // q and k out of the GEMM's rows, packed (the separate calls' reshape copies), normed per head.
  gather_heads(b.q_in, b.qkv, n, p.num_heads, hd, w.qkv, 2 * hd, es);
  gather_heads(b.k_in, b.qkv + 2 * w.q * es, n, p.num_kv_heads, hd, w.qkv, hd, es);
  if (const Status s = norm(p, b.q_in, nullptr, p.q_norm_weight, p.q_norm_eps, b.q,
                            n * p.num_heads, hd, isa);
      !s.ok())
    return s;
  if (const Status s = norm(p, b.k_in, nullptr, p.k_norm_weight, p.k_norm_eps, b.k,
                            n * p.num_kv_heads, hd, isa);
      !s.ok())
    return s;
  if (p.rotary_dim > 0) {
    if (const Status s = rope_heads(p, b.q, p.num_heads, isa); !s.ok()) return s;
    if (const Status s = rope_heads(p, b.k, p.num_kv_heads, isa); !s.ok()) return s;
  }

  WriteKvParams kv;
  kv.key = b.k;
  kv.value = b.qkv + (2 * w.q + w.kv) * es;
  kv.k_cache = static_cast<char*>(p.k_cache);
  kv.v_cache = static_cast<char*>(p.v_cache);
  kv.slot_mapping = p.slot_mapping;
  kv.num_tokens = n;
  kv.num_kv_heads = p.num_kv_heads;
  kv.block_size = p.block_size;
  kv.num_slots = p.num_blocks * p.block_size;
  kv.row_bytes = hd * es;
  kv.key_stride[0] = w.kv * es;
  kv.key_stride[1] = hd * es;
  kv.value_stride[0] = w.qkv * es;
  kv.value_stride[1] = hd * es;
  for (int i = 0; i < 3; ++i) {
    kv.k_cache_stride[i] = p.k_stride[i] * es;
    kv.v_cache_stride[i] = p.v_stride[i] * es;
  }
  if (const Status s = write_kv(kv); !s.ok()) return s;
  if (const Status s = run_attention(p, b, isa); !s.ok()) return s;
  if (const Status s = apply_gate(p, b); !s.ok()) return s;
  if (const Status s = packed_linear(p.dtype, b.attn, n, w.q, p.o_packed, p.hidden, p.o_bias, b.o,
                                     isa);
      !s.ok())
    return s;
  return norm(p, p.x, b.o, p.post_norm_weight, p.post_norm_eps, p.h_out, n, p.hidden, isa);
}

Status gated_attention_block(const GatedAttentionParams& p, Isa isa) {
  if (p.dtype != DType::kBFloat16 || !p.sigmoid_table)
    return Status::Error("gated_attention_block: one call needs bf16 and sigmoid_table (fp32: "
                         "gated_attention_qkv, the gate's sigmoid, gated_attention_rest)");
  if (const Status s = gated_attention_qkv(p, isa); !s.ok()) return s;
  return gated_attention_rest(p, isa);
}

}  // namespace cpu
}  // namespace cbk
