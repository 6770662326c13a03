// CUDA device queries behind cb_kernels/runtime.h: every call returns an error string instead of
// aborting, so a machine without a driver or GPU imports cb_kernels and gets a reason.
#include <cuda_runtime.h>

#include <string>

#include "cb_kernels/runtime.h"

namespace cbk {
namespace cuda {

std::string device_error() {
  int n = 0;
  cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    std::string msg = cudaGetErrorString(err);
    cudaGetLastError();  // clear the sticky-free error so later calls start clean
    return "no usable CUDA device (" + msg + ")";
  }
  if (n == 0) return "no CUDA device found";
  return "";
}

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

std::string device_name(int device) {
  cudaDeviceProp prop;
  if (cudaGetDeviceProperties(&prop, device) != cudaSuccess) {
    cudaGetLastError();
    return "";
  }
  return prop.name;
}

int device_sm(int device) {
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    cudaGetLastError();
    return -1;
  }
  return major * 10 + minor;
}

}  // namespace cuda
}  // namespace cbk
