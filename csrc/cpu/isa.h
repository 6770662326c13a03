// Run-time ISA choice for the CPU kernels. CMakeLists.txt compiles every csrc/cpu/*.cpp twice
// on x86-64: once plain (namespace cbk::cpu_generic, CBK_CPU_PRIMARY=1) and once with
// -mavx2 -mfma -mf16c (namespace cbk::cpu_avx2). A kernel file defines its per-ISA body in
// `namespace cbk { namespace CBK_CPU_NS { ... } }` and then writes, once:
//
//   CBK_CPU_DISPATCH(Status, paged_attention, const PagedAttentionParams&)
//
// which, in the primary compile only, defines cbk::cpu::paged_attention() forwarding to the best
// variant this machine supports.
#pragma once

namespace cbk {
namespace cpu {
inline bool has_avx2() {
#if defined(__x86_64__) || defined(_M_X64)
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                         __builtin_cpu_supports("f16c");
  return ok;
#else
  return false;
#endif
}
}  // namespace cpu
}  // namespace cbk

#if CBK_CPU_PRIMARY
#if CBK_HAVE_AVX2_VARIANT
#define CBK_CPU_DISPATCH(Ret, name, Arg)                                    \
  namespace cbk {                                                           \
  namespace cpu_avx2 {                                                      \
  Ret name(Arg);                                                            \
  }                                                                         \
  namespace cpu {                                                           \
  Ret name(Arg p) { return has_avx2() ? cpu_avx2::name(p) : cpu_generic::name(p); } \
  }                                                                         \
  }
#else
#define CBK_CPU_DISPATCH(Ret, name, Arg)                                    \
  namespace cbk {                                                           \
  namespace cpu {                                                           \
  Ret name(Arg p) { return cpu_generic::name(p); }                          \
  }                                                                         \
  }
#endif
#else
#define CBK_CPU_DISPATCH(Ret, name, Arg)
#endif
