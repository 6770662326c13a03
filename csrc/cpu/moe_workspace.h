// The MoE kernels' work buffers (moe_experts.cpp, moe_block.cpp): one registry over every
// thread's, so that cpu::moe_release_workspaces() frees them all. Include only from csrc/cpu.
#pragma once

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <vector>

namespace cbk {
namespace cpu {
namespace moe_ws {
// Every thread's MoE buffers (moe_experts' routing lists and [num_pairs, hidden] fp32
// contributions, each worker's GEMM scratch; moe_block's logits, top-k and shared-expert
// activations) sit in one registry, so that moe_release_workspaces() can free them:
// Engine.sleep(level=2) does, since the contributions of one long prefill (8192 tokens x top 10
// x hidden 2048) reach 640 MiB. A call holds its buffers' mutex; release only try_locks (a
// buffer in use stays, and no lock order can cycle). Inline, so every build of every file that
// includes this shares one registry.
struct Buffers;
inline std::mutex& registry_mutex() {
  static std::mutex* m = new std::mutex;   // never destroyed: thread exits may outlive statics
  return *m;
}
inline std::vector<Buffers*>& registry() {
  static std::vector<Buffers*>* r = new std::vector<Buffers*>;
  return *r;
}
struct Buffers {
  std::mutex mu;
  Buffers() {
    std::lock_guard<std::mutex> lock(registry_mutex());
    registry().push_back(this);
  }
  virtual ~Buffers() {
    std::lock_guard<std::mutex> lock(registry_mutex());
    auto& r = registry();
    r.erase(std::remove(r.begin(), r.end(), this), r.end());
  }
  Buffers(const Buffers&) = delete;
  Buffers& operator=(const Buffers&) = delete;
  virtual int64_t bytes() const = 0;
  virtual void clear() = 0;
};
template <typename V>
int64_t capacity_bytes(const V& v) {
  return static_cast<int64_t>(v.capacity() * sizeof(typename V::value_type));
}
template <typename V>
void free_vector(V& v) {
  V().swap(v);
}
}  // namespace moe_ws
}  // namespace cpu
}  // namespace cbk
