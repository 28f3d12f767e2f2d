// What both CPU attention kernels share (tp_worker): the problem's shape, its split into work
// items, and the AVX-512 moves of keys (attention.cpp: AVX-512 and portable, float32 and
// bfloat16; attention_amx.cpp: bfloat16 on AMX tiles).
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <new>
#include <utility>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "exp.h"

namespace tokenmill {

// (query token, query head) pairs per work item: one vector lane, or one tile row, each.
constexpr int ITEM_LANES = 16;

// A kernel's scratch: a vector whose new elements are left as the memory holds them, not
// zeroed. The kernels write what they read (a thread's items already find the item before's
// leftovers there), and zeroing was most of what a long context cost beyond its keys and
// values: 16 lanes of scores and weights, ~0.9 MiB a thread at 7,000 keys, for every layer.
template <typename T>
struct Uninitialized : std::allocator<T> {
  template <typename U>
  struct rebind {
    using other = Uninitialized<U>;
  };
  Uninitialized() = default;
  template <typename U>
  Uninitialized(const Uninitialized<U>&) noexcept {}
  template <typename U>
  void construct(U* p) noexcept {
    ::new (static_cast<void*>(p)) U;
  }
  template <typename U, typename... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};

template <typename T>
using ScratchVector = std::vector<T, Uninitialized<T>>;

struct Shape {
  int64_t num_heads, num_kv_heads, head_dim, table_stride, window;
  int64_t head_stride, slot_stride;  // elements between KV heads, between slots of a head
  float scale;
  float softcap;  // > 0: each score s becomes softcap * tanh(s / softcap) (Gemma 2)
  // NOTE: null, or each query head's sink logit (gpt-oss): a key that every token sees, of
  // that score and no value. In the kernels' base 2 it joins the lane's max, and its term
  // 2^(sink - max) is added to the denominator after the keys' sum (exp.h's
  // exp2_nonpositive in every path, so the paths agree).
  const float* sinks;
};

// A block of consecutive query tokens of one row (positions first_pos...), one KV head, and
// the query heads [head0, head0 + num_heads) of each token that share it.
struct Item {
  int64_t row, token0, num_tokens, first_pos, kv_head, head0, num_heads;
};

// The first position a token at `pos` sees: 0, or the start of its sliding window.
inline int64_t first_seen(const Shape& s, int64_t pos) {
  return s.window > 0 ? std::max<int64_t>(0, pos - s.window + 1) : 0;
}

// The item's lanes' sinks in base 2 (lane i * num_heads + h: query head head0 + h) into
// lanes, or null where the model has none.
inline const float* item_sinks(const Shape& s, const Item& it, float* lanes) {
  if (s.sinks == nullptr) return nullptr;
  for (int64_t i = 0; i < it.num_tokens; ++i)
    for (int64_t h = 0; h < it.num_heads; ++h)
      lanes[i * it.num_heads + h] = s.sinks[it.head0 + h] * LOG2E;
  return lanes;
}

// A denominator with the sink's term, lane max `max` (which the sink joined).
inline float with_sink(float den, float sink, float max) {
  return den + exp2_nonpositive(sink - max);
}

// Keys each item of a decode step must reach before the threads share the items left over
// when they do not divide among them (attention.cpp's and attention_amx.cpp's attend_shared):
// under them the rounds' barriers cost more than a thread left idle (measured: 0.96x at
// 2,048 keys, 1.08x at 3,000 on SmolLM2's three KV heads).
constexpr int64_t SHARED_KEYS = 3072;

// Whether a step's items leave threads idle that attend_shared would put to work: a decode
// step of a row or two (each item one token's query heads of a KV head) whose items do not
// divide among the threads, every one past SHARED_KEYS keys. One row of a model with 3 KV
// heads on two threads otherwise leaves one idle for a third of the attention. (One-token
// items are each a group of their own in attention_amx.cpp: no two share a row, KV head and
// first query head.)
inline bool shares_items(const std::vector<Item>& items, const Shape& s, int threads) {
  const int64_t n = static_cast<int64_t>(items.size());
  if (threads < 2 || n % threads == 0 || n > 2 * threads) return false;
  for (const Item& it : items)
    if (it.num_tokens != 1 || it.first_pos + 1 - first_seen(s, it.first_pos) < SHARED_KEYS)
      return false;
  return true;
}

// Which of the shared items block b of one flat list belongs to: first_block[i] is item i's
// first block, its last entry the blocks' count (attend_shared's rounds over key blocks).
inline int64_t block_owner(const std::vector<int64_t>& first_block, int64_t b) {
  return std::upper_bound(first_block.begin(), first_block.end(), b) - first_block.begin() - 1;
}

// Splits every row's tokens into items: each KV head's query heads in chunks of at most
// ITEM_LANES, and as many consecutive tokens as fit the lanes with them. Items of one row,
// KV head and set of query heads come one after the other, tokens ascending (the AMX kernel
// runs such a run of items as one group).
inline std::vector<Item> plan(const int64_t* rows, const int64_t* token_starts,
                       const int64_t* num_tokens, const int64_t* first_pos, int64_t num_rows,
                       const Shape& s) {
  const int64_t group = s.num_heads / s.num_kv_heads;
  const int64_t heads = std::min<int64_t>(group, ITEM_LANES);
  const int64_t tokens_per_item = ITEM_LANES / heads;
  std::vector<Item> items;
  for (int64_t b = 0; b < num_rows; ++b)
    for (int64_t kv = 0; kv < s.num_kv_heads; ++kv)
      for (int64_t h = 0; h < group; h += heads)
        for (int64_t t = 0; t < num_tokens[b]; t += tokens_per_item)
          items.push_back(Item{rows[b], token_starts[b] + t,
                               std::min(tokens_per_item, num_tokens[b] - t), first_pos[b] + t,
                               kv, kv * group + h, std::min(heads, group - h)});
  return items;
}

#if defined(__AVX512F__)
// Transposes 16 rows of 16 32-bit elements in registers.
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 2]);
    const __m512d c = _mm512_castps_pd(t[4 * i + 1]), d = _mm512_castps_pd(t[4 * i + 3]);
    r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
    r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
    r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[4 + i], 0x88);
    t[4 + i] = _mm512_shuffle_f32x4(r[i], r[4 + i], 0xdd);
    t[8 + i] = _mm512_shuffle_f32x4(r[8 + i], r[12 + i], 0x88);
    t[12 + i] = _mm512_shuffle_f32x4(r[8 + i], r[12 + i], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0x88);
    r[4 + i] = _mm512_shuffle_f32x4(t[4 + i], t[12 + i], 0x88);
    r[8 + i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0xdd);
    r[12 + i] = _mm512_shuffle_f32x4(t[4 + i], t[12 + i], 0xdd);
  }
}

// bfloat16: up to 16 keys' pairs (d, d + 1) as 32-bit words, transposed: kt[p][kk] is pair p
// of key kk; zeros for missing keys.
inline void transpose_key_pairs(const uint16_t* keys, const int32_t* slots, int nk,
                                int64_t stride, int64_t dim, uint32_t* kt) {
  for (int64_t c = 0; c < dim; c += 32) {
    __m512 r[16];
    for (int kk = 0; kk < 16; ++kk)
      r[kk] = kk < nk ? _mm512_castsi512_ps(_mm512_loadu_si512(keys + slots[kk] * stride + c))
                      : _mm512_setzero_ps();
    transpose16(r);
    for (int p = 0; p < 16; ++p)
      _mm512_storeu_si512(kt + (c / 2 + p) * 16, _mm512_castps_si512(r[p]));
  }
}

// Asks for rows base + slots[i] * stride (dim elements each, i < n) to come into the L2
// cache; changes no result. NOTE: into L2, not L1 (T0): the L1's few miss buffers fill up and
// stall the prefetches themselves (measured: a decode layer at batch 64 took 1.0 ms with T0,
// 0.65 ms with T1, on a Zen 4).
template <typename T>
inline void prefetch_rows(const T* base, const int32_t* slots, int64_t n, int64_t stride,
                          int64_t dim) {
  for (int64_t i = 0; i < n; ++i) {
    const char* row = reinterpret_cast<const char*>(base + slots[i] * stride);
    for (int64_t b = 0; b < dim * static_cast<int64_t>(sizeof(T)); b += 64)
      _mm_prefetch(row + b, _MM_HINT_T1);
  }
}

#endif

}  // namespace tokenmill
