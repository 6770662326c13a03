// CPU instruction sets the kernels have bodies for, and the one run-time choice among them.
//
// Every kernel with an ISA-specific path is built once per ISA it has a body for: the same source
// compiled with that ISA's flags into namespace cbk::cpu_<isa> (CMakeLists.txt lists which file
// gets which ISAs), always including a portable body. cbk::cpu::<kernel>(params, isa), at the end
// of the kernel's own file (built once, in the portable compile: CBK_CPU_PORTABLE), runs the
// highest body that is neither above `isa` nor above what this CPU reports (`pick`), so one wheel
// runs on any x86-64 and tests can force every body the machine runs.
// Compiling whole files, not target-attributed functions, lets GCC vectorise the GCC-vector code
// of attention_vec.h for the ISA, inlined helpers included.
#pragma once

#include <cstdint>

namespace cbk {

// Ordered: each ISA implies the ones before it (true of every x86-64 CPU that has it).
enum class Isa : int32_t {
  kAuto = -1,       // the best this CPU runs
  kPortable = 0,    // plain C++ (SSE2 on x86-64)
  kAvx2 = 1,        // AVX2 + FMA + F16C
  kAvx512 = 2,      // AVX-512 F/BW/VL/DQ
  kAvx512Vnni = 3,  // AVX-512 VNNI (int8 dot products)
  kAvx512Bf16 = 4,  // AVX512-BF16 (bf16 pair dot products, vdpbf16ps) on top of VNNI
};
constexpr int kNumIsas = 5;

namespace cpu {
const char* isa_name(Isa isa);  // "auto", "portable", "avx2", "avx512", "avx512_vnni", "avx512_bf16"
bool parse_isa(const char* name, Isa* isa);     // false: not one of isa_name()'s names
bool isa_supported(Isa isa);                    // this CPU runs it (kAuto: true)
Isa best_isa();                                 // the highest ISA this CPU runs

// The highest ISA at or below `cap` (kAuto: no cap) that this CPU runs, among `bodies`
// (ascending, starting with kPortable): the body a kernel's dispatcher runs.
template <int N>
inline Isa pick(Isa cap, const Isa (&bodies)[N]) {
  const Isa top = cap == Isa::kAuto || cap > best_isa() ? best_isa() : cap;
  Isa chosen = Isa::kPortable;
  for (Isa b : bodies)
    if (b <= top) chosen = b;
  return chosen;
}
}  // namespace cpu

}  // namespace cbk
