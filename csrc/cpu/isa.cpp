// What this CPU runs (see cb_kernels/isa.h): the ISA names, their detection and the best one.
// Each kernel's run-time pick among its bodies sits in that kernel's file (cpu::pick).
#include "cb_kernels/isa.h"

#include <cstring>

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

}  // namespace cpu
}  // namespace cbk
