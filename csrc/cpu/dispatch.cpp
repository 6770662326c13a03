// The run-time ISA choice of every CPU kernel with an ISA-specific path (see cb_kernels/isa.h).
// Each dispatcher lists the bodies its kernel is built with (CMakeLists.txt, CBK_ISA_SOURCES_*);
// CBK_X86_BODIES is 0 where only the portable bodies are built (not x86-64).
#include <cstring>

#include "cb_kernels/elementwise.h"
#include "cb_kernels/greedy_head.h"
#include "cb_kernels/isa.h"
#include "cb_kernels/linear.h"
#include "cb_kernels/paged_attention.h"
#include "cb_kernels/greedy_tokens.h"

// Each kernel file defines its body in namespace cbk::CBK_CPU_NS; these are the bodies built.
#define CBK_DECLARE_BODIES(ns)                        \
  namespace cbk {                                     \
  namespace ns {                                      \
  Status paged_attention(const PagedAttentionParams&); \
  Status rms_norm(const RmsNormParams&);              \
  Status silu_mul(const SiluMulParams&);              \
  Status rope(const RopeParams&);                     \
  Status rope_write_kv(const RopeWriteKvParams&);     \
  Status greedy_tokens(const GreedyTokensParams&);     \
  Status linear(const LinearParams&);                 \
  Status linear_bf16(const LinearBf16Params&);        \
  Status greedy_head(const GreedyHeadParams&);        \
  }                                                   \
  }
CBK_DECLARE_BODIES(cpu_portable)
#if CBK_X86_BODIES
CBK_DECLARE_BODIES(cpu_avx2)
CBK_DECLARE_BODIES(cpu_avx512)
CBK_DECLARE_BODIES(cpu_avx512_vnni)
CBK_DECLARE_BODIES(cpu_avx512_bf16)
#endif

namespace cbk {
namespace cpu {

namespace {
constexpr const char* kNames[kNumIsas] = {"portable", "avx2", "avx512", "avx512_vnni",
                                           "avx512_bf16"};

bool detect(Isa isa) {
#if CBK_X86_BODIES
  switch (isa) {
    case Isa::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("f16c");
    case Isa::kAvx512:
      return detect(Isa::kAvx2) && __builtin_cpu_supports("avx512f") &&
             __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
             __builtin_cpu_supports("avx512dq");
    case Isa::kAvx512Vnni:
      return detect(Isa::kAvx512) && __builtin_cpu_supports("avx512vnni");
    case Isa::kAvx512Bf16:
      return detect(Isa::kAvx512Vnni) && __builtin_cpu_supports("avx512bf16");
    default:
      return true;
  }
#else
  return isa == Isa::kPortable;
#endif
}

// The highest ISA at or below `cap` (kAuto: no cap) that this CPU runs, among `bodies`
// (ascending, starting with kPortable).
template <int N>
Isa pick(Isa cap, const Isa (&bodies)[N]) {
  const Isa top = cap == Isa::kAuto || cap > best_isa() ? best_isa() : cap;
  Isa chosen = Isa::kPortable;
  for (Isa b : bodies)
    if (b <= top) chosen = b;
  return chosen;
}

constexpr Isa kAvx2Bodies[] = {Isa::kPortable, Isa::kAvx2};
constexpr Isa kBf16AttentionBodies[] = {Isa::kPortable, Isa::kAvx2, Isa::kAvx512Bf16};
constexpr Isa kElementwiseBodies[] = {Isa::kPortable, Isa::kAvx2, Isa::kAvx512Bf16};
}  // namespace

const char* isa_name(Isa isa) {
  return isa == Isa::kAuto ? "auto" : kNames[static_cast<int>(isa)];
}

bool parse_isa(const char* name, Isa* isa) {
  if (std::strcmp(name, "auto") == 0) {
    *isa = Isa::kAuto;
    return true;
  }
  for (int i = 0; i < kNumIsas; ++i) {
    if (std::strcmp(name, kNames[i]) == 0) {
      *isa = static_cast<Isa>(i);
      return true;
    }
  }
  return false;
}

bool isa_supported(Isa isa) { return isa == Isa::kAuto || isa <= best_isa(); }

Isa best_isa() {
  static const Isa best = [] {
    Isa b = Isa::kPortable;
    for (int i = 1; i < kNumIsas && detect(static_cast<Isa>(i)); ++i) b = static_cast<Isa>(i);
    return b;
  }();
  return best;
}

Isa paged_attention_isa(Isa isa) { return pick(isa, kAvx2Bodies); }
Isa paged_attention_bf16_isa(int64_t head_dim, Isa isa) {
  const Isa b = pick(isa, kBf16AttentionBodies);
  return b == Isa::kAvx512Bf16 && head_dim % 32 != 0 ? pick(isa, kAvx2Bodies) : b;
}
Isa linear_isa(Isa isa) { return pick(isa, {Isa::kPortable, Isa::kAvx2, Isa::kAvx512}); }
Isa greedy_head_isa(Isa isa) { return pick(isa, {Isa::kPortable, Isa::kAvx512Vnni}); }
Isa linear_bf16_isa(Isa isa) { return pick(isa, {Isa::kPortable, Isa::kAvx512Bf16}); }

#if CBK_X86_BODIES
#define CBK_RUN_AVX2_OR_PORTABLE(name, p, isa) \
  return pick(isa, kAvx2Bodies) == Isa::kAvx2 ? cpu_avx2::name(p) : cpu_portable::name(p)
#else
#define CBK_RUN_AVX2_OR_PORTABLE(name, p, isa) return cpu_portable::name(p)
#endif

Status paged_attention(const PagedAttentionParams& p, Isa isa) {
#if CBK_X86_BODIES
  // bf16 K/V with head_dim % 32 == 0: the vdpbf16ps kernel where the CPU has AVX512-BF16 (the
  // fp32 math of the avx2 body otherwise: its AVX-512 compile was slower, see the kernel).
  if (p.dtype == DType::kBFloat16 &&
      paged_attention_bf16_isa(p.head_dim, isa) == Isa::kAvx512Bf16)
    return cpu_avx512_bf16::paged_attention(p);
#endif
  CBK_RUN_AVX2_OR_PORTABLE(paged_attention, p, isa);
}
Status rms_norm(const RmsNormParams& p, Isa isa) { CBK_RUN_AVX2_OR_PORTABLE(rms_norm, p, isa); }
Status silu_mul(const SiluMulParams& p, Isa isa) {
#if CBK_X86_BODIES
  // 16 lanes and vcvtneps2bf16 where the CPU has AVX512-BF16; the avx2 body's bits (tests)
  if (pick(isa, kElementwiseBodies) == Isa::kAvx512Bf16) return cpu_avx512_bf16::silu_mul(p);
#endif
  CBK_RUN_AVX2_OR_PORTABLE(silu_mul, p, isa);
}
Status rope(const RopeParams& p, Isa isa) { CBK_RUN_AVX2_OR_PORTABLE(rope, p, isa); }
Status rope_write_kv(const RopeWriteKvParams& p, Isa isa) {
  CBK_RUN_AVX2_OR_PORTABLE(rope_write_kv, p, isa);
}
Status greedy_tokens(const GreedyTokensParams& p, Isa isa) {
  CBK_RUN_AVX2_OR_PORTABLE(greedy_tokens, p, isa);
}

Status linear(const LinearParams& p, Isa isa) {
#if CBK_X86_BODIES
  switch (linear_isa(isa)) {
    case Isa::kAvx512: return cpu_avx512::linear(p);
    case Isa::kAvx2: return cpu_avx2::linear(p);
    default: break;
  }
#endif
  return cpu_portable::linear(p);
}

Status linear_bf16(const LinearBf16Params& p, Isa isa) {
#if CBK_X86_BODIES
  if (linear_bf16_isa(isa) == Isa::kAvx512Bf16) return cpu_avx512_bf16::linear_bf16(p);
#endif
  return cpu_portable::linear_bf16(p);
}

Status greedy_head(const GreedyHeadParams& p, Isa isa) {
#if CBK_X86_BODIES
  if (greedy_head_isa(isa) == Isa::kAvx512Vnni) return cpu_avx512_vnni::greedy_head(p);
#endif
  return cpu_portable::greedy_head(p);
}

}  // namespace cpu
}  // namespace cbk
