// CUDA device queries that never abort: used by cb_kernels.ops to explain why a CUDA path
// cannot run (no driver, no GPU, an arch the build does not cover).
#pragma once

#include <string>

namespace cbk {
namespace cuda {
// Returns "" when at least one device is usable, else a message that says why not.
std::string device_error();
int device_count();  // 0 when no driver / no device
std::string device_name(int device);
int device_sm(int device);  // major*10+minor, or -1
}  // namespace cuda
}  // namespace cbk
