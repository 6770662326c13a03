// The MoE top-k softmax router after its logits (cb_kernels/moe_route.h says what it computes).
//
// Why: transformers' router is a softmax in fp32, topk, a sum, a division and a cast back to
// the logits' dtype, and the experts op then reads the weights in fp32 again: ~8 torch ops per
// MoE layer per step, each 10-20 us inside a decode step of the 4-layer bench model on the
// 2-core Zen 4 (bf16, the recurrent state keeps the caches cold), for a [16, 8] softmax. Here
// one pass a token, in one call. exp is libm's (torch's vectorised exp differs by an ulp at
// most: the weights agree to fp32 rounding; a top-k choice can differ only where two experts'
// probabilities tie to that ulp). Portable body only: E is a few hundred values a token.
#include "cb_kernels/moe_route.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include "threads.h"

namespace cbk {

#if CBK_CPU_PORTABLE
namespace {

// Token-experts products below which one thread does the call (a [16, 8] decode is 128).
constexpr int64_t kParallelElems = int64_t{1} << 15;

inline float bf16_to_float(uint16_t x) {
  const uint32_t b = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}
// float -> bf16 -> float, round to nearest even, NaN kept quiet.
inline float round_bf16(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  uint32_t r = (b + 0x7fffu + ((b >> 16) & 1u)) & 0xffff0000u;
  if ((b & 0x7fffffffu) > 0x7f800000u) r = (b | 0x400000u) & 0xffff0000u;
  float out;
  std::memcpy(&out, &r, 4);
  return out;
}

void route_token(const MoeRouteParams& p, int64_t t, std::vector<float>& prob) {
  const int64_t e_count = p.num_experts;
  prob.resize(static_cast<size_t>(e_count));
  const bool bf16 = p.dtype == DType::kBFloat16;
  for (int64_t e = 0; e < e_count; ++e)
    prob[e] = bf16 ? bf16_to_float(static_cast<const uint16_t*>(p.logits)[t * p.logits_stride + e])
                   : static_cast<const float*>(p.logits)[t * p.logits_stride + e];
  float mx = prob[0];
  for (int64_t e = 1; e < e_count; ++e) mx = prob[e] > mx ? prob[e] : mx;
  float sum = 0.0f;
  for (int64_t e = 0; e < e_count; ++e) {
    prob[e] = std::exp(prob[e] - mx);
    sum += prob[e];
  }
  const float inv = 1.0f / sum;
  for (int64_t e = 0; e < e_count; ++e) prob[e] *= inv;
  float* w = p.weights + t * p.top_k;
  int64_t* ids = p.ids + t * p.top_k;
  // The top_k as torch.topk picks them (ATen's TopKImpl.h, largest, sorted): (value, id) pairs
  // in id order through std::partial_sort when k * 64 <= E, else std::nth_element and a sort
  // of the first k - 1, with its comparator (NaN first, then larger). Same algorithm, same
  // standard library: the same experts in the same order where probabilities tie (bf16 logits
  // tie often), not only a valid top-k.
  thread_local std::vector<std::pair<float, int64_t>> queue;
  queue.resize(static_cast<size_t>(e_count));
  for (int64_t e = 0; e < e_count; ++e) queue[e] = {prob[e], e};
  const auto larger = [](const std::pair<float, int64_t>& x, const std::pair<float, int64_t>& y) {
    return (std::isnan(x.first) && !std::isnan(y.first)) || x.first > y.first;
  };
  const int64_t k = p.top_k;
  if (k * 64 <= e_count) {
    std::partial_sort(queue.begin(), queue.begin() + k, queue.end(), larger);
  } else {
    std::nth_element(queue.begin(), queue.begin() + k - 1, queue.end(), larger);
    std::sort(queue.begin(), queue.begin() + k - 1, larger);
  }
  for (int64_t j = 0; j < k; ++j) {
    w[j] = queue[j].first;
    ids[j] = queue[j].second;
  }
  if (p.renormalize) {
    float s = 0.0f;
    for (int64_t k = 0; k < p.top_k; ++k) s += w[k];
    for (int64_t k = 0; k < p.top_k; ++k) w[k] /= s;
  }
  if (bf16)
    for (int64_t k = 0; k < p.top_k; ++k) w[k] = round_bf16(w[k]);
}

}  // namespace

namespace cpu {
Status moe_route(const MoeRouteParams& p) {
  if (p.num_tokens < 0 || p.num_experts <= 0 || p.top_k <= 0 || p.top_k > p.num_experts ||
      p.logits_stride < p.num_experts)
    return Status::Error("moe_route: need num_tokens >= 0, 0 < top_k <= num_experts and "
                         "logits_stride >= num_experts");
  if (p.dtype != DType::kFloat32 && p.dtype != DType::kBFloat16)
    return Status::Error("moe_route: logits must be float32 or bfloat16");
  if (p.num_tokens == 0) return Status::Ok();
  if (!p.logits || !p.weights || !p.ids) return Status::Error("moe_route: null pointer");
  const bool par = p.num_tokens > 1 && p.num_tokens * p.num_experts >= kParallelElems;
#pragma omp parallel num_threads(cpu::max_threads()) if (par)
  {
    std::vector<float> prob;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < p.num_tokens; ++t) route_token(p, t, prob);
  }
  return Status::Ok();
}
}  // namespace cpu
#endif

}  // namespace cbk
