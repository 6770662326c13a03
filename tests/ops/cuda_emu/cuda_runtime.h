// Test-only CPU stand-in for the CUDA primitives csrc/cuda/paged_attention.cu uses, so its kernel
// logic runs where no GPU exists (tests/ops/test_paged_attention_cuda_emu.py). A CTA runs as
// blockDim std::threads: __syncthreads is a barrier over them, __shfl_xor_sync an exchange through
// a per-warp buffer between two barriers; CTAs run one after another, so a `static` stands in for
// __shared__. Timing, memory coalescing and races between CTAs are not modelled.
#pragma once
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};
struct uint4 {
  unsigned x, y, z, w;
};
struct float2 {
  float x, y;
};
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }

inline thread_local dim3 threadIdx, blockIdx;
inline dim3 gridDim;
inline std::barrier<>* emu_block_barrier = nullptr;
inline std::vector<std::barrier<>*> emu_warp_barriers;
inline std::vector<float> emu_warp_buffer;

inline void __syncthreads() { emu_block_barrier->arrive_and_wait(); }

inline float __shfl_xor_sync(unsigned, float v, int lane_mask) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  emu_warp_buffer[warp * 32 + lane] = v;
  emu_warp_barriers[warp]->arrive_and_wait();
  const float r = emu_warp_buffer[warp * 32 + (lane ^ lane_mask)];
  emu_warp_barriers[warp]->arrive_and_wait();
  return r;
}

template <typename T>
inline T __ldg(const T* p) { return *p; }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline float __uint_as_float(unsigned u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float exp2f(float x) { return std::exp2(x); }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline long min(long a, long b) { return a < b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }

typedef void* cudaStream_t;
typedef int cudaError_t;
constexpr int cudaSuccess = 0;
inline cudaError_t cudaGetLastError() { return cudaSuccess; }
inline const char* cudaGetErrorString(cudaError_t) { return "emulated launch failed"; }

// Stands in for kernel<<<grid, threads, 0, stream>>>(params) (the test rewrites launches to this).
template <typename P>
void emu_launch(void (*kernel)(P), dim3 grid, int threads, const P& params) {
  gridDim = grid;
  std::barrier<> block_barrier(threads);
  std::vector<std::unique_ptr<std::barrier<>>> warps;
  std::vector<std::barrier<>*> warp_ptrs;
  for (int w = 0; w < threads / 32; ++w) {
    warps.push_back(std::make_unique<std::barrier<>>(32));
    warp_ptrs.push_back(warps.back().get());
  }
  emu_block_barrier = &block_barrier;
  emu_warp_barriers = warp_ptrs;
  emu_warp_buffer.assign(threads, 0.f);
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        std::vector<std::thread> team;
        for (int t = 0; t < threads; ++t)
          team.emplace_back([&, t] {
            threadIdx = dim3(t);
            blockIdx = dim3(x, y, z);
            kernel(params);
          });
        for (auto& th : team) th.join();
      }
}
