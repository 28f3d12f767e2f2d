// A decode token's one-row products streamed from memory (benchmarks/product_stream.py): as
// the layer stack calls them (every layer's q/k/v, o, gate/up and down, then the lm_head,
// each told the next) with the weights on 4 KiB pages, the same on 2 MiB pages (as
// huge_pages.py lays the server's), the same bytes as one product per kind (the layers'
// weights of a kind side by side, 4 KiB pages), and a plain two-thread read of 1 GiB (the
// floor's rate). The first against the third is what each product's start and end cost: its
// parallel region, the first panels asked for late, the last panel's wait for the other
// thread; against the second, what the pages cost. Calls the kernels' own library (its path
// on the command line). Not part of the server.
#include <dlfcn.h>
#include <sys/mman.h>
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace {

using Then = int (*)(const void*, int64_t, int64_t, int64_t, const void*, int64_t, const float*,
                     void*, int64_t, int, int, const void*, int, const void*, int64_t, int64_t);

struct Product {
  int64_t k, n;
  int glu, out_bf16;
  uint16_t* w;
};

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Packed weights of a [n, k] bfloat16 matrix (panels of 32, k padded to 32), ones-ish values;
// `huge`: in a mapping of its own that asks for 2 MiB pages, from a 2 MiB boundary.
uint16_t* weights(int64_t k, int64_t n, bool huge = false) {
  const int64_t elems = (k + 31) / 32 * 32 * ((n + 31) / 32 * 32);
  constexpr int64_t PAGE = 2 << 20;
  uint16_t* w = nullptr;
  if (huge) {
    const int64_t bytes = (elems * 2 + PAGE - 1) / PAGE * PAGE;
    void* m = mmap(nullptr, bytes + PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                   -1, 0);
    const uintptr_t at = (reinterpret_cast<uintptr_t>(m) + PAGE - 1) / PAGE * PAGE;
    madvise(reinterpret_cast<void*>(at), bytes, MADV_HUGEPAGE);
    w = reinterpret_cast<uint16_t*>(at);
  } else {
    w = static_cast<uint16_t*>(std::aligned_alloc(64, elems * 2));
  }
  for (int64_t i = 0; i < elems; ++i) w[i] = static_cast<uint16_t>(0x3c00 + i % 255);
  return w;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

// argv: library, AMX (0/1), hidden, query width, key (= value) width, inter, layers, vocab,
// rounds.
int main(int argc, char** argv) {
  if (argc != 10) return 2;
  void* lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  const bool amx = std::atoi(argv[2]) != 0;
  const int64_t hidden = std::atoll(argv[3]), q = std::atoll(argv[4]), kv = std::atoll(argv[5]);
  const int64_t inter = std::atoll(argv[6]), layers = std::atoll(argv[7]);
  const int64_t vocab = std::atoll(argv[8]), rounds = std::atoll(argv[9]);
  if (lib == nullptr) return 3;
  auto then = reinterpret_cast<Then>(dlsym(lib, amx ? "tm_linear_amx_then" : "tm_linear_then"));
  if (then == nullptr) return 4;
  if (amx && reinterpret_cast<int (*)()>(dlsym(lib, "tm_amx_ready"))() == 0) return 5;
  // NOTE: {k, n, glu, bfloat16 out}: q/k/v, o (into the float32 residual), gate/up, down.
  const int64_t kinds[4][4] = {
      {hidden, q + 2 * kv, 0, 1}, {q, hidden, 0, 0}, {hidden, 2 * inter, 1, 1}, {inter, hidden, 0, 0}};
  std::vector<Product> stack, huge, stacked;
  double bytes = 0;
  for (int64_t l = 0; l < layers; ++l)
    for (const auto& s : kinds) {
      for (bool on_huge : {false, true})
        (on_huge ? huge : stack)
            .push_back({s[0], s[1], static_cast<int>(s[2]), static_cast<int>(s[3]),
                        weights(s[0], s[1], on_huge)});
      bytes += 2.0 * s[0] * s[1];
    }
  stack.push_back({hidden, vocab, 0, 0, weights(hidden, vocab)});
  huge.push_back({hidden, vocab, 0, 0, weights(hidden, vocab, true)});
  bytes += 2.0 * hidden * vocab;
  for (const auto& s : kinds)
    stacked.push_back({s[0], s[1] * layers, static_cast<int>(s[2]), static_cast<int>(s[3]),
                       weights(s[0], s[1] * layers)});
  stacked.push_back({hidden, vocab, 0, 0, weights(hidden, vocab)});
  const int64_t widest = std::max({vocab, 2 * inter * layers, (q + 2 * kv) * layers});
  std::vector<uint16_t> x(std::max({hidden, inter, q}), 0x3c00);
  std::vector<float> out(widest), residual(widest, 0.0f);
  auto run = [&](const std::vector<Product>& ps) {
    for (size_t i = 0; i < ps.size(); ++i) {
      const Product& p = ps[i];
      const Product* q = i + 1 < ps.size() ? &ps[i + 1] : nullptr;
      then(x.data(), 1, p.k, p.k, p.w, p.n, nullptr, out.data(), p.n, 1, p.out_bf16,
           p.out_bf16 ? nullptr : residual.data(), p.glu, q ? q->w : nullptr, q ? q->n : 0,
           q ? q->k : 0);
    }
  };
  const int64_t floats = int64_t{1} << 28;
  auto* big = static_cast<float*>(std::aligned_alloc(64, floats * 4));
#pragma omp parallel for
  for (int64_t i = 0; i < floats; ++i) big[i] = 1.0f;
  auto read_rate = [&] {
    const double started = now();
    float total = 0.0f;
#pragma omp parallel reduction(+ : total)
    {
      const int t = omp_get_thread_num(), threads = omp_get_num_threads();
      const int64_t lo = floats / threads * t, hi = floats / threads * (t + 1);
      __m512 c0 = _mm512_setzero_ps(), c1 = c0, c2 = c0, c3 = c0;
      for (int64_t i = lo; i < hi; i += 64) {
        c0 = _mm512_add_ps(c0, _mm512_load_ps(big + i));
        c1 = _mm512_add_ps(c1, _mm512_load_ps(big + i + 16));
        c2 = _mm512_add_ps(c2, _mm512_load_ps(big + i + 32));
        c3 = _mm512_add_ps(c3, _mm512_load_ps(big + i + 48));
      }
      total += _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(c0, c1), _mm512_add_ps(c2, c3)));
    }
    const double seconds = now() - started;
    return total > 0 ? floats * 4.0 / seconds : 0.0;
  };
  run(stack);
  run(huge);
  run(stacked);
  std::printf("%.1f MB of weights a token, %zu products as the layer stack calls them\n",
              bytes / 1e6, stack.size());
  std::vector<double> ratios, pages;
  for (int64_t r = 0; r < rounds; ++r) {
    const double rate = std::max(read_rate(), read_rate());
    std::vector<double> a, h, b;
    for (int i = 0; i < 15; ++i) {
      double t = now();
      run(stack);
      a.push_back(now() - t);
      t = now();
      run(huge);
      h.push_back(now() - t);
      t = now();
      run(stacked);
      b.push_back(now() - t);
    }
    const double floor_ms = bytes / rate * 1e3, ma = median(a) * 1e3, mb = median(b) * 1e3;
    const double mh = median(h) * 1e3;
    ratios.push_back(ma / mb);
    pages.push_back(ma / mh);
    std::printf(
        "round %lld: read %.1f GB/s, floor %.2f ms | as called %.2f ms (%.2fx), on 2 MiB pages "
        "%.2f ms (%.2fx) | one product a kind %.2f ms (%.2fx)\n",
        static_cast<long long>(r + 1), rate / 1e9, floor_ms, ma, ma / floor_ms, mh,
        mh / floor_ms, mb, mb / floor_ms);
  }
  std::printf(
      "medians over %lld rounds: as called / one product a kind %.3f; 4 KiB / 2 MiB pages "
      "%.3f\n",
      static_cast<long long>(rounds), median(ratios), median(pages));
  return 0;
}
