// CUDA cache kernels: write_kv, block copies (copy_blocks, and swap_blocks over mapped pinned
// memory), and batched copy-engine swaps through cuMemcpyBatchAsync looked up at run time.
// Everything moves bytes with the widest vector the pointers, strides and sizes allow.
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

#include "cb_kernels/cache_ops.h"

namespace cbk {
namespace cuda {

namespace {

constexpr int kThreads = 256;
// One CTA of the block-copy kernel moves at most this many bytes of one block: 256 threads x
// 16 B x 8 iterations. Large blocks are split so a handful of pairs still fills every SM.
constexpr int64_t kChunkBytes = 32 << 10;

inline Status launch_status() {
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? Status::Ok() : Status::Error(cudaGetErrorString(err));
}

// Largest of 16/8/4/2/1 that divides every value (pointers and byte counts).
inline int vector_width(std::initializer_list<int64_t> values) {
  int64_t bits = 0;
  for (int64_t v : values) bits |= v;
  for (int w = 16; w > 1; w >>= 1)
    if ((bits & (w - 1)) == 0) return w;
  return 1;
}

template <int W> struct VecOf;
template <> struct VecOf<16> { using T = uint4; };
template <> struct VecOf<8> { using T = uint2; };
template <> struct VecOf<4> { using T = uint32_t; };
template <> struct VecOf<2> { using T = uint16_t; };
template <> struct VecOf<1> { using T = uint8_t; };

// One CTA per token: every thread moves W-byte pieces of the token's K and V rows.
template <int W>
__global__ void write_kv_kernel(WriteKvParams p) {
  using V = typename VecOf<W>::T;
  const int64_t t = blockIdx.x;
  const int64_t slot = p.slot_mapping[t];
  if (slot < 0 || slot >= p.num_slots) return;
  const int64_t block = slot / p.block_size, off = slot % p.block_size;
  const int64_t per_row = p.row_bytes / W;
  const int64_t total = per_row * p.num_kv_heads;
  const char* ks = p.key + t * p.key_stride[0];
  const char* vs = p.value + t * p.value_stride[0];
  char* kd = p.k_cache + block * p.k_cache_stride[0] + off * p.k_cache_stride[1];
  char* vd = p.v_cache + block * p.v_cache_stride[0] + off * p.v_cache_stride[1];
  for (int64_t i = threadIdx.x; i < total; i += blockDim.x) {
    const int64_t h = i / per_row, j = (i % per_row) * W;
    const V k = *reinterpret_cast<const V*>(ks + h * p.key_stride[1] + j);
    const V v = *reinterpret_cast<const V*>(vs + h * p.value_stride[1] + j);
    *reinterpret_cast<V*>(kd + h * p.k_cache_stride[2] + j) = k;
    *reinterpret_cast<V*>(vd + h * p.v_cache_stride[2] + j) = v;
  }
}

// grid (num_pairs * chunks, num_tensors): CTA (x, y) copies chunk x % chunks of pair x / chunks
// in tensor y. Each thread keeps four loads in flight before storing: reads of mapped host
// memory cross PCIe/C2C, and bandwidth there comes from many outstanding requests.
// table: int64 [num_tensors, 5] as in cache_ops.h; pairs: int64 [num_pairs, 2] (src, dst).
template <int W>
__global__ void copy_blocks_kernel(const int64_t* __restrict__ table, const int64_t* __restrict__ pairs,
                                   int64_t chunks) {
  using V = typename VecOf<W>::T;
  constexpr int kUnroll = 4;
  const int64_t* row = table + 5 * blockIdx.y;
  const int64_t block_bytes = row[2];
  const int64_t pair = blockIdx.x / chunks, chunk = blockIdx.x % chunks;
  const int64_t begin = chunk * kChunkBytes;
  if (begin >= block_bytes) return;
  const int64_t end = min(block_bytes, begin + kChunkBytes);
  const char* src = reinterpret_cast<const char*>(row[0]) + pairs[2 * pair] * row[3];
  char* dst = reinterpret_cast<char*>(row[1]) + pairs[2 * pair + 1] * row[4];
  const V* s = reinterpret_cast<const V*>(src + begin);
  V* d = reinterpret_cast<V*>(dst + begin);
  const int64_t n = (end - begin) / W;
  int64_t i = threadIdx.x;
  for (; i + (kUnroll - 1) * blockDim.x < n; i += kUnroll * blockDim.x) {
    V r[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) r[u] = s[i + u * blockDim.x];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) d[i + u * blockDim.x] = r[u];
  }
  for (; i < n; i += blockDim.x) d[i] = s[i];
}

struct BatchApi {
  PFN_cuMemcpyBatchAsync_v12080 fn = nullptr;
  PFN_cuGetErrorName_v6000 error_name = nullptr;  // names a CUresult in the error message
  std::string error;
};

// Looked up once through the runtime, so the module links no libcuda and imports without a driver.
// The 12.8 ABI (with failIdx) is requested: every driver that has the call provides it.
const BatchApi& batch_api() {
  static BatchApi api;
  static std::once_flag once;
  std::call_once(once, [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult status = cudaDriverEntryPointSymbolNotFound;
    const cudaError_t err =
        cudaGetDriverEntryPointByVersion("cuMemcpyBatchAsync", &fn, 12080, cudaEnableDefault, &status);
    if (err != cudaSuccess) {
      api.error = std::string("driver entry point lookup failed: ") + cudaGetErrorString(err);
      cudaGetLastError();
    } else if (status != cudaDriverEntryPointSuccess || fn == nullptr) {
      api.error = "the CUDA driver has no cuMemcpyBatchAsync (needs driver 12.8+)";
    } else {
      api.fn = reinterpret_cast<PFN_cuMemcpyBatchAsync_v12080>(fn);
    }
    void* name_fn = nullptr;
    if (cudaGetDriverEntryPointByVersion("cuGetErrorName", &name_fn, 6000, cudaEnableDefault, &status) == cudaSuccess &&
        status == cudaDriverEntryPointSuccess)
      api.error_name = reinterpret_cast<PFN_cuGetErrorName_v6000>(name_fn);
    cudaGetLastError();
  });
  return api;
}

// (src, dst, bytes) of every copy, merging runs of consecutive blocks where both sides are
// packed (block stride == block bytes): contiguous ids become one large copy.
struct CopyList {
  std::vector<CUdeviceptr> src, dst;
  std::vector<size_t> bytes;
};

CopyList copy_list(const BlockCopyParams& p) {
  CopyList c;
  for (int64_t t = 0; t < p.num_tensors; ++t) {
    const int64_t bb = p.block_bytes[t];
    const bool mergeable = p.src_block_stride[t] == bb && p.dst_block_stride[t] == bb;
    for (int64_t k = 0; k < p.num_pairs; ++k) {
      const int64_t s = p.block_mapping[2 * k], d = p.block_mapping[2 * k + 1];
      int64_t run = 1;
      while (mergeable && k + run < p.num_pairs && p.block_mapping[2 * (k + run)] == s + run &&
             p.block_mapping[2 * (k + run) + 1] == d + run)
        ++run;
      c.src.push_back(static_cast<CUdeviceptr>(p.src_base[t] + s * p.src_block_stride[t]));
      c.dst.push_back(static_cast<CUdeviceptr>(p.dst_base[t] + d * p.dst_block_stride[t]));
      c.bytes.push_back(static_cast<size_t>(bb * run));
      k += run - 1;
    }
  }
  return c;
}

}  // namespace

Status write_kv(const WriteKvParams& p, void* stream) {
  if (p.num_tokens <= 0) return Status::Ok();
  const int w = vector_width({reinterpret_cast<int64_t>(p.key), reinterpret_cast<int64_t>(p.value),
                              reinterpret_cast<int64_t>(p.k_cache), reinterpret_cast<int64_t>(p.v_cache),
                              p.row_bytes, p.key_stride[0], p.key_stride[1], p.value_stride[0],
                              p.value_stride[1], p.k_cache_stride[0], p.k_cache_stride[1], p.k_cache_stride[2],
                              p.v_cache_stride[0], p.v_cache_stride[1], p.v_cache_stride[2]});
  const int64_t pieces = p.num_kv_heads * p.row_bytes / w;
  const int threads = static_cast<int>(pieces >= kThreads ? kThreads : ((pieces + 31) / 32) * 32);
  if (p.num_tokens > 0x7fffffff) return Status::Error("write_kv: more than 2^31-1 tokens");
  const dim3 grid(static_cast<unsigned>(p.num_tokens));
  auto s = static_cast<cudaStream_t>(stream);
  switch (w) {
    case 16: write_kv_kernel<16><<<grid, threads, 0, s>>>(p); break;
    case 8: write_kv_kernel<8><<<grid, threads, 0, s>>>(p); break;
    case 4: write_kv_kernel<4><<<grid, threads, 0, s>>>(p); break;
    case 2: write_kv_kernel<2><<<grid, threads, 0, s>>>(p); break;
    default: write_kv_kernel<1><<<grid, threads, 0, s>>>(p); break;
  }
  return launch_status();
}

Status copy_blocks(const BlockCopyParams& p, const int64_t* table_dev, const int64_t* pairs_dev, void* stream) {
  if (p.num_pairs <= 0 || p.num_tensors <= 0) return Status::Ok();
  if (p.num_tensors > 65535) return Status::Error("copy_blocks: more than 65535 tensors in one call");
  int64_t bits = 0, max_bytes = 0;
  for (int64_t t = 0; t < p.num_tensors; ++t) {
    bits |= static_cast<int64_t>(p.src_base[t]) | static_cast<int64_t>(p.dst_base[t]) | p.block_bytes[t] |
            p.src_block_stride[t] | p.dst_block_stride[t];
    max_bytes = p.block_bytes[t] > max_bytes ? p.block_bytes[t] : max_bytes;
  }
  const int w = vector_width({bits});
  const int64_t chunks = (max_bytes + kChunkBytes - 1) / kChunkBytes;
  if (p.num_pairs * chunks > 0x7fffffff) return Status::Error("copy_blocks: too many blocks in one call");
  const dim3 grid(static_cast<unsigned>(p.num_pairs * chunks), static_cast<unsigned>(p.num_tensors));
  auto s = static_cast<cudaStream_t>(stream);
  switch (w) {
    case 16: copy_blocks_kernel<16><<<grid, kThreads, 0, s>>>(table_dev, pairs_dev, chunks); break;
    case 8: copy_blocks_kernel<8><<<grid, kThreads, 0, s>>>(table_dev, pairs_dev, chunks); break;
    case 4: copy_blocks_kernel<4><<<grid, kThreads, 0, s>>>(table_dev, pairs_dev, chunks); break;
    case 2: copy_blocks_kernel<2><<<grid, kThreads, 0, s>>>(table_dev, pairs_dev, chunks); break;
    default: copy_blocks_kernel<1><<<grid, kThreads, 0, s>>>(table_dev, pairs_dev, chunks); break;
  }
  return launch_status();
}

// The failed batch's message: the CUDA result (name and number) and the copy it failed at, when
// the driver names one. Kept per thread, since Status carries a pointer: valid until this
// thread's next failed batch, after the binding has raised it.
const char* batch_failure(const BatchApi& api, CUresult r, size_t fail_idx, const CopyList& c) {
  thread_local std::string msg;
  const char* name = nullptr;
  if (api.error_name == nullptr || api.error_name(r, &name) != CUDA_SUCCESS || name == nullptr) name = "CUresult";
  msg = std::string("swap_blocks: cuMemcpyBatchAsync failed: ") + name + " (" + std::to_string(static_cast<int>(r)) + ")";
  if (fail_idx < c.bytes.size()) {
    msg += " at copy " + std::to_string(fail_idx) + " of " + std::to_string(c.bytes.size()) + " (" +
           std::to_string(c.bytes[fail_idx]) + " bytes)";
  } else {
    msg += " (the driver names no single copy)";
  }
  return msg.c_str();
}

Status memcpy_blocks(const BlockCopyParams& p, bool batched, void* stream) {
  if (p.num_pairs <= 0 || p.num_tensors <= 0) return Status::Ok();
  CopyList c = copy_list(p);
  auto s = static_cast<cudaStream_t>(stream);
  if (batched) {
    const BatchApi& api = batch_api();
    if (!api.fn) return Status::Error("swap_blocks: cuMemcpyBatchAsync is not available on this driver");
    CUmemcpyAttributes attr = {};
    attr.srcAccessOrder = CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
    attr.flags = CU_MEMCPY_FLAG_DEFAULT;
    size_t attr_idx = 0, fail_idx = 0;
    const CUresult r = api.fn(c.dst.data(), c.src.data(), c.bytes.data(), c.bytes.size(), &attr, &attr_idx, 1,
                              &fail_idx, reinterpret_cast<CUstream>(s));
    return r == CUDA_SUCCESS ? Status::Ok() : Status::Error(batch_failure(api, r, fail_idx, c));
  }
  for (size_t i = 0; i < c.bytes.size(); ++i) {
    const cudaError_t err = cudaMemcpyAsync(reinterpret_cast<void*>(c.dst[i]), reinterpret_cast<const void*>(c.src[i]),
                                            c.bytes[i], cudaMemcpyDefault, s);
    if (err != cudaSuccess) {
      cudaGetLastError();
      return Status::Error(cudaGetErrorString(err));
    }
  }
  return Status::Ok();
}

int swap_method(int64_t min_block_bytes, void* stream, int requested, int64_t batch_min_bytes) {
  if (requested != 0) return requested;
  const bool batch_ok = batch_api().fn != nullptr && stream != nullptr;
  return batch_ok && min_block_bytes >= batch_min_bytes ? 1 : 2;
}

std::string batch_memcpy_error() { return batch_api().error; }

uintptr_t host_device_pointer(uintptr_t host_ptr) {
  cudaPointerAttributes attr;
  if (cudaPointerGetAttributes(&attr, reinterpret_cast<const void*>(host_ptr)) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  if (attr.type != cudaMemoryTypeHost || attr.devicePointer == nullptr) return 0;
  return reinterpret_cast<uintptr_t>(attr.devicePointer);
}

}  // namespace cuda
}  // namespace cbk
