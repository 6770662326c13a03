// A/B of the CPU paged attention's avx512_bf16 body: an older commit's kernel ("old") against
// the checkout's ("new") in one process on the same bf16 K/V, alternating which runs first, each
// output compared bit for bit, with a plain read of the same K/V in block-table order beside them.
// Layers: one K/V pool each, called in turn, so that K/V come from DRAM as in an engine step
// (pass 1 layer to time them in cache). Shapes (bench/RESULTS.md, paged_attention, issue #32):
//   1b    16 decode rows, 32 / 8 heads, contexts 100-200, 16 layers
//   1bl   the same at contexts 400-800 (two partitions and their merge)
//   smol  128 decode rows, 9 / 3 heads, contexts 128-192, 30 layers
//   pre   16 x 128-token prompts, 9 / 3 heads, 4 layers
//   mix   15 x 128-token prompts and 109 decode rows (a burst step), 4 layers
//   g1/g2 small GQA 1 / 2 chunks (bit checks)
// Build and run (from the checkout; OLD = the commit to compare with):
//   mkdir -p /tmp/pa_old && for f in paged_attention.cpp paged_attention_bf16.h \
//     paged_attention_items.h attention_vec.h threads.h; do git show OLD:csrc/cpu/$f > /tmp/pa_old/$f; done
//   (if OLD has paged_attention_bf16_items.h, take it too)
//   FL="-O3 -ffp-contract=fast -fno-math-errno -mavx2 -mfma -mf16c -mavx512f -mavx512bw -mavx512vl
//       -mavx512dq -mavx512vnni -mavx512bf16 -fopenmp -DCBK_CPU_PORTABLE=0 -DCBK_X86_BODIES=1
//       -Icsrc/include"
//   g++ $FL -DCBK_CPU_NS=cpu_old -I/tmp/pa_old -c /tmp/pa_old/paged_attention.cpp -o old.o
//   g++ $FL -DCBK_CPU_NS=cpu_new -c csrc/cpu/paged_attention.cpp -o new.o
//   g++ $FL -Icsrc/cpu -c bench/paged_attention_ab.cpp -o ab.o && g++ -fopenmp ab.o old.o new.o -o ab
//   ./ab SHAPE THREADS REPS [LAYERS [SOFTCAP [WINDOW]]]
// One thread is timed in thread CPU time (a shared machine's other jobs do not count), more in
// wall time.

#include <omp.h>
#include <algorithm>
#include <chrono>
#include <ctime>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>
#include "cb_kernels/paged_attention.h"
#include "threads.h"
#include <immintrin.h>
static int diffdummy = 0;
namespace cbk { namespace cpu_old { Status paged_attention(const PagedAttentionParams&); }
namespace cpu_new { Status paged_attention(const PagedAttentionParams&); } }
using namespace cbk;
static uint16_t bf(float f) { uint32_t b; std::memcpy(&b, &f, 4); return uint16_t((b + 0x7fff + ((b >> 16) & 1)) >> 16); }
struct Layer { std::vector<uint16_t> k, v, q, o1, o2; std::vector<int32_t> bt, sl, cu; int64_t nb, mb; };
int main(int argc, char** argv) {
  std::string shape = argc > 1 ? argv[1] : "1b";
  int threads = argc > 2 ? atoi(argv[2]) : 1;
  int reps = argc > 3 ? atoi(argv[3]) : 9;
  int H = 32, KV = 8, L = 16; const int D = 64, BS = 16;
  std::mt19937 g(1);
  std::vector<std::pair<int,int>> seqs;
  if (shape == "1b") { for (int i = 0; i < 16; ++i) seqs.push_back({100 + int(g() % 101), 1}); }
  else if (shape == "1bl") { for (int i = 0; i < 16; ++i) seqs.push_back({400 + int(g() % 401), 1}); }
  else if (shape == "g2") { H = 4; KV = 2; L = 2; for (int i = 0; i < 5; ++i) seqs.push_back({300 + int(g() % 301), 2}); }
  else if (shape == "g1") { H = 3; KV = 3; L = 2; for (int i = 0; i < 5; ++i) seqs.push_back({300 + int(g() % 301), 3}); }
  else if (shape == "smol") { H = 9; KV = 3; L = 30; for (int i = 0; i < 128; ++i) seqs.push_back({128 + int(g() % 65), 1}); }
  else if (shape == "pre") { H = 9; KV = 3; L = 4; for (int i = 0; i < 16; ++i) seqs.push_back({128, 128}); }
  else if (shape == "mix") { H = 9; KV = 3; L = 4; for (int i = 0; i < 109; ++i) seqs.push_back({130 + int(g() % 50), 1}); for (int i = 0; i < 15; ++i) seqs.push_back({128, 128}); }
  if (argc > 4) L = atoi(argv[4]);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<Layer> layers(L);
  int64_t ntok = 0; for (auto& s : seqs) ntok += s.second;
  int64_t kvtok = 0; double pairs = 0;
  for (auto& s : seqs) { kvtok += s.first; pairs += double(s.second) * (s.first - s.second) + s.second * (s.second + 1) / 2.0; }
  for (auto& l : layers) {
    std::vector<int> counts; int64_t nb = 0, mb = 0;
    for (auto& s : seqs) { int c = (s.first + BS - 1) / BS; counts.push_back(c); nb += c; mb = std::max<int64_t>(mb, c); }
    l.nb = nb; l.mb = mb;
    l.k.resize(nb * BS * KV * D); l.v.resize(l.k.size());
    for (auto& x : l.k) x = bf(nd(g)); for (auto& x : l.v) x = bf(nd(g));
    std::vector<int32_t> order(nb); std::iota(order.begin(), order.end(), 0); std::shuffle(order.begin(), order.end(), g);
    l.bt.assign(seqs.size() * mb, 0); int64_t st = 0;
    for (size_t i = 0; i < seqs.size(); ++i) for (int j = 0; j < counts[i]; ++j) l.bt[i * mb + j] = order[st++];
    l.cu.push_back(0); for (auto& s : seqs) { l.sl.push_back(s.first); l.cu.push_back(l.cu.back() + s.second); }
    l.q.resize(ntok * H * D); for (auto& x : l.q) x = bf(nd(g));
    l.o1.assign(l.q.size(), 0); l.o2.assign(l.q.size(), 0);
  }
  auto params = [&](Layer& l, uint16_t* out) {
    PagedAttentionParams p; p.q = l.q.data(); p.k_cache = l.k.data(); p.v_cache = l.v.data(); p.out = out;
    p.block_tables = l.bt.data(); p.seq_lens = l.sl.data(); p.cu_seqlens_q = l.cu.data();
    p.num_seqs = seqs.size(); p.num_heads = H; p.num_kv_heads = KV; p.head_dim = D; p.block_size = BS;
    p.q_stride_token = H * D; p.q_stride_head = D; p.out_stride_token = H * D; p.out_stride_head = D;
    p.k_stride_block = BS * KV * D; p.k_stride_token = KV * D; p.k_stride_head = D;
    p.v_stride_block = BS * KV * D; p.v_stride_token = KV * D; p.v_stride_head = D;
    p.block_table_stride = l.mb; p.dtype = DType::kBFloat16; p.scale = 0.125f; p.softcap = argc > 5 ? atof(argv[5]) : 0.f; p.sliding_window = argc > 6 ? atoi(argv[6]) : 0;
    p.num_tokens = ntok; p.num_blocks = l.nb; p.max_blocks_per_seq = l.mb; return p; };
  cpu::thread_setting() = threads;
  // flush buffer to evict caches between reps
  std::vector<char> junk(64 << 20, 1);
  auto run = [&](bool nw) {
    for (auto& l : layers) { auto p = params(l, nw ? l.o2.data() : l.o1.data());
      Status s = nw ? cpu_new::paged_attention(p) : cpu_old::paged_attention(p); if (!s.ok()) { printf("%s\n", s.message); exit(1);} } };
  double best[2] = {1e9, 1e9};
  std::vector<double> all[2];
  for (int r = 0; r < reps; ++r) for (int w0 = 0; w0 < 2; ++w0) { const int w = (r & 1) ? 1 - w0 : w0;
    timespec a0, a1; clock_gettime(threads == 1 ? CLOCK_THREAD_CPUTIME_ID : CLOCK_MONOTONIC, &a0); run(w);
    clock_gettime(threads == 1 ? CLOCK_THREAD_CPUTIME_ID : CLOCK_MONOTONIC, &a1);
    double t = ((a1.tv_sec - a0.tv_sec) + 1e-9 * (a1.tv_nsec - a0.tv_nsec)) / L;
    best[w] = std::min(best[w], t); all[w].push_back(t);
  }
  // pure read of the same K/V in block-table order (all heads of a token row together)
  double bestr = 1e9;
  for (int r = 0; r < reps; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    __m512i acc = _mm512_setzero_si512();
    for (auto& l : layers) {
      #pragma omp parallel for num_threads(threads) reduction(|:diffdummy) schedule(dynamic,1)
      for (size_t s = 0; s < seqs.size(); ++s) {
        __m512i a = _mm512_setzero_si512();
        int nb = (seqs[s].first + BS - 1) / BS;
        for (int b = 0; b < nb; ++b) {
          const char* kb = (const char*)(l.k.data() + (int64_t)l.bt[s * l.mb + b] * BS * KV * D);
          const char* vb = (const char*)(l.v.data() + (int64_t)l.bt[s * l.mb + b] * BS * KV * D);
          for (int64_t o = 0; o < BS * KV * D * 2; o += 64) {
            a = _mm512_xor_si512(a, _mm512_loadu_si512(kb + o));
            a = _mm512_xor_si512(a, _mm512_loadu_si512(vb + o));
          }
        }
        diffdummy |= _mm512_reduce_or_epi32(a);
      }
    }
    (void)acc;
    double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / L;
    bestr = std::min(bestr, t);
  }
  printf("read-only %.4f ms/layer  %.1f GB/s  ", bestr * 1e3, double(kvtok) * KV * D * 4 / bestr / 1e9);
  size_t diff = 0; float maxd = 0;
  for (auto& l : layers) for (size_t i = 0; i < l.o1.size(); ++i) if (l.o1[i] != l.o2[i]) { ++diff;
      uint32_t a = uint32_t(l.o1[i]) << 16, b = uint32_t(l.o2[i]) << 16; float fa, fb; memcpy(&fa, &a, 4); memcpy(&fb, &b, 4); maxd = std::max(maxd, std::fabs(fa - fb)); }
  double kvb = double(kvtok) * KV * D * 4;
  for (int w = 0; w < 2; ++w) { std::sort(all[w].begin(), all[w].end()); }
  printf("%-5s thr %d  old %.4f ms (med %.4f)  new %.4f ms (med %.4f)  new/old %.3f  kv %.2f MB  %.1f GB/s-kv-new  flop %.3f G %.1f GFLOP/s-new  diff %zu (max %.3g)\n",
         shape.c_str(), threads, best[0] * 1e3, all[0][reps / 2] * 1e3, best[1] * 1e3, all[1][reps / 2] * 1e3, best[1] / best[0], kvb / 1e6,
         kvb / best[1] / 1e9, 4 * pairs * H * D / 1e9, 4 * pairs * H * D / best[1] / 1e9, diff, maxd);
}
