// bfloat16 attention over the slot-addressed KV cache on Intel's AMX tiles (tp_worker, via
// ctypes; attention.cpp is the AVX-512 and portable kernel, and the float32 one).
//
// Work items are attention.cpp's (attention_common.h's plan): one row, one KV head, up to 16
// (query token, query head) lanes, one tile row each; the items of one row, KV head and set
// of query heads run together as a group (up to MAX_TILES tiles), which moves each block of
// keys and values into tile layout once for all of them. The order is fixed per lane here:
//   - score(key j) = q . k_j, the head dimension 32 at a time in ascending order, one
//     TDPBF16PS each (a tile of 16 lanes x 16 keys);
//   - in base 2: x_j = fma(score_j, scale * log2(e), -max) with max the largest
//     score_j * (scale * log2(e)) over the lane's visible keys; e_j = 2^x_j (exp.h's
//     exp2_16_fused), +0.0 for keys the lane does not see (with a soft-cap c, Gemma 2's:
//     score_j first becomes tanh(score_j * (scale / c)) * (c * log2(e)), exp.h's tanh_own,
//     and x_j = that - max); the denominator sums e_j in
//     float32 in 16 lanes (j mod 16, keys ascending) combined by tree_sum16; with sinks
//     (gpt-oss) the lane's sink in base 2 joins max, and 2^(sink - max) is added after
//     (attention_common.h's with_sink);
//   - out[d] = (sum over j of e_j v_j[d]) * (1 / denominator), the keys 32 at a time in
//     ascending order from a position that is a multiple of 32, e_j as two bfloat16 parts
//     (hi = bf16(e_j), lo = bf16(e_j - hi)), two TDPBF16PS per block (16 lanes x 16 of d).
// A tile's rows and columns never mix and one token alone (decode) runs the same tiles as in
// a prompt chunk, where the keys it does not see add products of +0.0 weights, so a token's
// output is bitwise the same alone, in a chunk, in any group or after a prefix-cache hit
// (tested).
// NOTE: one bfloat16 e_j (as flash-attention kernels round it) is measurably less accurate
// than torch's bfloat16 attention; hi + lo carries 16 bits of e_j, and the tiles have time to
// spare for the second product. TDPBF16PS rounds as the hardware does (linear_amx.cpp),
// so these are an AMX machine's own bits; TOKENMILL_CPU_AMX=0 runs attention.cpp instead.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include <omp.h>

#include "amx.h"
#include "attention_common.h"
#include "bf16.h"
#include "exp.h"
#include "kernels.h"

#if defined(TOKENMILL_AMX)
namespace {

using tokenmill::Item;
using tokenmill::ScratchVector;
using tokenmill::Shape;

constexpr int LANES = tokenmill::ITEM_LANES;
constexpr int KEYS = 16;      // keys per score tile
constexpr int KEY_PAIRS = 32;  // keys per weighted-values step: 16 pairs
constexpr int PASS_D = 64;    // head columns per pass of weighted values: four tiles of 16

// Lane tiles of one row and KV head share one move of the keys and values into tile layout.
constexpr int64_t MAX_TILES = 8;
// Scores and weights of a group's tiles together stay within about this many bytes (L2).
constexpr int64_t GROUP_BYTES = 1 << 20;

// Consecutive token blocks (items) of one row, KV head and set of query heads: items
// [first, first + count) of the kernel's plan.
struct Group {
  int64_t first, count;
};

struct Scratch {
  ScratchVector<uint16_t> q;           // [tiles][LANES][dim] queries
  ScratchVector<uint16_t> e_hi, e_lo;  // [tiles][LANES][padded] weights as two bfloat16 parts
  ScratchVector<uint32_t> kt;  // [dim / 2][KEYS] key pairs, transposed (a B tile per 32 d)
  ScratchVector<float> scores;  // [tiles][LANES][padded]
  ScratchVector<float> acc;     // [tiles][LANES][PASS_D] weighted values, between key blocks
  alignas(64) uint16_t vt[KEY_PAIRS / 2][PASS_D * 2];  // values of 16 key pairs, interleaved
  int tile_rows = 16;  // rows of tiles 0-5 as the thread's tiles are configured now
};

// What a group's tiles share: the keys from first_key (a multiple of KEY_PAIRS, the
// earliest any of its lanes sees), num_keys of them up to its last token, padded rows.
struct Span {
  const int32_t* slots;
  int64_t first_key, num_keys, padded;
};

// Rows lo..hi (inclusive) of keys a lane sees, as indices from the span's first key.
struct Visible {
  int64_t lo, hi;
};

Visible visible(const Shape& s, const Item& it, int64_t first_key, int64_t lane) {
  const int64_t pos = it.first_pos + lane / it.num_heads;
  return {tokenmill::first_seen(s, pos) - first_key, pos - first_key};
}

// Where lane l of an item reads its query and writes its output: a (token, head) row.
int64_t head_row(const Shape& s, const Item& it, int64_t l) {
  return (it.token0 + l / it.num_heads) * s.num_heads + it.head0 + l % it.num_heads;
}

int64_t round_up(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

// Keys of a tile: up to its last token, padded to whole key blocks.
int64_t tile_padded(const Item& it, const Span& sp) {
  return round_up(it.first_pos + it.num_tokens - sp.first_key, KEY_PAIRS);
}

// Keys j0..j0+15 of the span transposed into w.kt (zeros past the last), the next block's
// keys and this block's values asked into the L2 cache meanwhile (for weighted_values).
void fetch_key_block(const uint16_t* keys, const uint16_t* values, const Span& sp, int64_t j0,
                     int64_t stride, int64_t dim, Scratch& w) {
  const int64_t left = std::max<int64_t>(0, sp.num_keys - j0);
  const int nk = static_cast<int>(std::min<int64_t>(KEYS, left));
  tokenmill::prefetch_rows(keys, sp.slots + j0 + KEYS,
                           std::clamp<int64_t>(left - KEYS, 0, KEYS), stride, dim);
  tokenmill::prefetch_rows(values, sp.slots + j0, nk, stride, dim);
  tokenmill::transpose_key_pairs(keys, sp.slots + j0, nk, stride, dim, w.kt.data());
}

// One tile of queries q (rows dim apart) against the 16 keys in w.kt: their scores into
// `scores`, rows `row_stride` floats apart.
void score_tile(const uint16_t* q, int64_t dim, const Scratch& w, float* scores,
                int64_t row_stride) {
  _tile_zero(0);
  for (int64_t c = 0; c < dim; c += 32) {
    _tile_loadd(4, q + c, dim * 2);
    _tile_loadd(6, w.kt.data() + c / 2 * KEYS, KEYS * 4);
    _tile_dpbf16ps(0, 4, 6);
  }
  _tile_stored(0, scores, row_stride * 4);
}

// scores[t][l][j] = q_l . k_j (unscaled) for each tile t of the group, 16 keys at a time:
// each block of keys is transposed once for all the tiles that see into it.
void score_keys(const uint16_t* keys, const uint16_t* values, const Span& sp, const Item* its,
                int64_t tiles, int64_t stride, int64_t dim, Scratch& w) {
  for (int64_t j0 = 0; j0 < sp.padded; j0 += KEYS) {
    fetch_key_block(keys, values, sp, j0, stride, dim, w);
    for (int64_t t = 0; t < tiles; ++t) {
      if (j0 >= tile_padded(its[t], sp)) continue;
      score_tile(w.q.data() + t * LANES * dim, dim, w,
                 w.scores.data() + t * LANES * sp.padded + j0, sp.padded);
    }
  }
}

// The keys j0..j0+15 that a lane sees, as a mask.
__mmask16 seen(int64_t j0, Visible v) {
  if (j0 >= v.lo && j0 + 15 <= v.hi) return 0xffff;
  const int64_t from = std::clamp<int64_t>(v.lo - j0, 0, 16);
  const int64_t to = std::clamp<int64_t>(v.hi - j0 + 1, 0, 16);
  return static_cast<__mmask16>(((1u << to) - 1u) & ~((1u << from) - 1u));
}

// A lane's weights e_j = 2^(s_j * scale * log2(e) - max) = exp(scale * s_j - max') over its
// padded row of keys (float32 into the denominator; into hi and lo as bf16(e) and
// bf16(e - bf16(e))), +0.0 for keys it does not see; returns the denominator: lane i of 16
// sums the keys j = i (mod 16) ascending, then tree_sum16, so the sum does not depend on how
// many keys past the lane's last the row holds. NOTE: the hardware conversion to bfloat16
// flushes a subnormal lo to zero, as the tile products would flush it anyway (AMX takes no
// subnormal inputs).
float lane_weights(float* scores, uint16_t* hi, uint16_t* lo, Visible v, int64_t padded,
                   float scale, float softcap, const float* sink) {
  __m512 sc = _mm512_set1_ps(scale * tokenmill::LOG2E);  // scores to base 2
  if (softcap > 0.0f) {  // NOTE: capped in place, in base 2; then scaled by 1 (exact)
    const __m512 in = _mm512_set1_ps(scale / softcap), out = _mm512_set1_ps(softcap * tokenmill::LOG2E);
    for (int64_t j0 = 0; j0 < padded; j0 += 16)
      _mm512_storeu_ps(scores + j0, _mm512_mul_ps(tokenmill::tanh_own16(_mm512_mul_ps(
                                                      _mm512_loadu_ps(scores + j0), in)),
                                                  out));
    sc = _mm512_set1_ps(1.0f);
  }
  __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j0 = 0; j0 < padded; j0 += 16)
    m = _mm512_mask_max_ps(m, seen(j0, v), m, _mm512_mul_ps(_mm512_loadu_ps(scores + j0), sc));
  float top = _mm512_reduce_max_ps(m);
  if (sink != nullptr) top = std::max(top, *sink);
  const __m512 max = _mm512_set1_ps(top);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j0 = 0; j0 < padded; j0 += 16) {
    const __m512 x = _mm512_fmsub_ps(_mm512_loadu_ps(scores + j0), sc, max);
    const __m512 w = tokenmill::exp2_16_fused(x, seen(j0, v));
    sum = _mm512_add_ps(sum, w);
    const __m256bh w_hi = _mm512_cvtneps_pbh(w);
    const __m256bh w_lo = _mm512_cvtneps_pbh(_mm512_sub_ps(w, _mm512_cvtpbh_ps(w_hi)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + j0),
                        reinterpret_cast<const __m256i&>(w_hi));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + j0),
                        reinterpret_cast<const __m256i&>(w_lo));
  }
  alignas(64) float lane[16];
  _mm512_store_ps(lane, sum);
  const float den = tokenmill::tree_sum16(lane);
  return sink == nullptr ? den : tokenmill::with_sink(den, *sink, top);
}

// Values of keys j0..j0+31, columns d0..d0+63, as B tiles: vt[p][2 d + i] = v_{j0+2p+i}[d0+d]
// (zeros past the last key: their weights are zero, and a product must not be NaN); or only
// the halves [first_half, end_half) of the columns, 32 each.
void interleave_values(const uint16_t* values, const Span& sp, int64_t j0, int64_t stride,
                       int64_t d0, Scratch& w, int first_half = 0, int end_half = 2) {
  static const __m512i lo_idx = [] {
    alignas(64) uint16_t idx[32];
    for (int t = 0; t < 16; ++t) idx[2 * t] = t, idx[2 * t + 1] = 32 + t;
    return _mm512_load_si512(idx);
  }();
  const __m512i hi_idx = _mm512_add_epi16(lo_idx, _mm512_set1_epi16(16));
  for (int p = 0; p < KEY_PAIRS / 2; ++p) {
    for (int half = first_half; half < end_half; ++half) {
      __m512i row[2];
      for (int i = 0; i < 2; ++i) {
        const int64_t j = j0 + 2 * p + i;
        row[i] = j < sp.num_keys
                     ? _mm512_loadu_si512(values + sp.slots[j] * stride + d0 + half * 32)
                     : _mm512_setzero_si512();
      }
      _mm512_store_si512(w.vt[p] + half * 64, _mm512_permutex2var_epi16(row[0], lo_idx, row[1]));
      _mm512_store_si512(w.vt[p] + half * 64 + 32,
                         _mm512_permutex2var_epi16(row[0], hi_idx, row[1]));
    }
  }
}

// Tiles 0-3: the float32 sums of 16 lanes x 64 columns, to and from acc [16][PASS_D].
void zero_sums() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

void load_sums(const float* acc) {
  _tile_loadd(0, acc, PASS_D * 4);
  _tile_loadd(1, acc + 16, PASS_D * 4);
  _tile_loadd(2, acc + 32, PASS_D * 4);
  _tile_loadd(3, acc + 48, PASS_D * 4);
}

void store_sums(float* acc) {
  _tile_stored(0, acc, PASS_D * 4);
  _tile_stored(1, acc + 16, PASS_D * 4);
  _tile_stored(2, acc + 32, PASS_D * 4);
  _tile_stored(3, acc + 48, PASS_D * 4);
}

// Adds one block of 32 keys to the sums: its weights' hi parts (rows of `stride` elements
// from hi), then its lo parts, times the interleaved values in w.vt.
void add_block(const uint16_t* hi, const uint16_t* lo, int64_t stride, const Scratch& w) {
  _tile_loadd(4, hi, stride * 2);
  _tile_loadd(5, lo, stride * 2);
  _tile_loadd(6, w.vt[0], PASS_D * 4);
  _tile_dpbf16ps(0, 4, 6);
  _tile_dpbf16ps(0, 5, 6);
  _tile_loadd(6, w.vt[0] + 32, PASS_D * 4);
  _tile_dpbf16ps(1, 4, 6);
  _tile_dpbf16ps(1, 5, 6);
  _tile_loadd(6, w.vt[0] + 64, PASS_D * 4);
  _tile_dpbf16ps(2, 4, 6);
  _tile_dpbf16ps(2, 5, 6);
  _tile_loadd(6, w.vt[0] + 96, PASS_D * 4);
  _tile_dpbf16ps(3, 4, 6);
  _tile_dpbf16ps(3, 5, 6);
}

// add_block for one half of the columns (32 of them, the vt tiles 2 half and 2 half + 1) into
// tiles 0 and 1: each column tile takes the same two products as in add_block.
void add_half(const uint16_t* hi, const uint16_t* lo, int64_t stride, const Scratch& w,
              int half) {
  _tile_loadd(4, hi, stride * 2);
  _tile_loadd(5, lo, stride * 2);
  _tile_loadd(6, w.vt[0] + 64 * half, PASS_D * 4);
  _tile_dpbf16ps(0, 4, 6);
  _tile_dpbf16ps(0, 5, 6);
  _tile_loadd(6, w.vt[0] + 64 * half + 32, PASS_D * 4);
  _tile_dpbf16ps(1, 4, 6);
  _tile_dpbf16ps(1, 5, 6);
}

// acc[t][l][d] = sum over j of e[t][l][j] v_j[d0 + d], d < 64, for each tile t, 32 keys at a
// time. The values of a block are interleaved once for all the tiles; with more than one
// tile, a tile's float32 sums go to memory and back between blocks (exactly: the bits are
// those of sums that stay in the registers, as a lone tile's do).
void weighted_values(const uint16_t* values, const Span& sp, const Item* its, int64_t tiles,
                     int64_t stride, int64_t d0, Scratch& w) {
  const bool resident = tiles == 1;
  for (int64_t j0 = 0; j0 < sp.padded; j0 += KEY_PAIRS) {
    interleave_values(values, sp, j0, stride, d0, w);
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t padded = tile_padded(its[t], sp);
      if (j0 >= padded) continue;
      float* acc = w.acc.data() + t * LANES * PASS_D;
      if (j0 == 0)
        zero_sums();
      else if (!resident)
        load_sums(acc);
      const int64_t e = t * LANES * sp.padded + j0;
      add_block(w.e_hi.data() + e, w.e_lo.data() + e, sp.padded, w);
      if (!resident || j0 + KEY_PAIRS == padded) store_sums(acc);
    }
  }
}

// The group's keys: from the earliest its first tile's lanes see (rounded down to a block
// of KEY_PAIRS) to its last tile's last token.
Span span(const Shape& s, const int32_t* table, const Item* its, int64_t tiles) {
  const Item& last = its[tiles - 1];
  const int64_t first_key = tokenmill::first_seen(s, its[0].first_pos) / KEY_PAIRS * KEY_PAIRS;
  const int64_t num_keys = last.first_pos + last.num_tokens - first_key;
  return {table + its[0].row * s.table_stride + first_key, first_key, num_keys,
          round_up(num_keys, KEY_PAIRS)};
}

// Queries of each tile into w.q; the scratch sized for the group. NOTE: a tile's rows past
// its item's lanes hold whatever the scratch last held (never zeroed: any bits, even NaN):
// tile rows never mix, and those rows' results are never read.
void load_queries(const uint16_t* q, const Shape& s, const Item* its, int64_t tiles,
                  int64_t padded, Scratch& w) {
  const int64_t dim = s.head_dim;
  w.q.resize(tiles * LANES * dim);
  for (int64_t t = 0; t < tiles; ++t)
    for (int64_t l = 0; l < its[t].num_tokens * its[t].num_heads; ++l)
      std::memcpy(w.q.data() + (t * LANES + l) * dim, q + head_row(s, its[t], l) * dim, dim * 2);
  w.kt.resize(dim / 2 * KEYS);
  w.scores.resize(tiles * LANES * padded);
  w.acc.resize(tiles * LANES * PASS_D);
  w.e_hi.resize(tiles * LANES * padded);
  w.e_lo.resize(tiles * LANES * padded);
}

// Attends the group's tiles: items of one row, KV head and query heads, in token order.
void attend_group(const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache,
                  const int32_t* table, uint16_t* out, const Shape& s, const Item* its,
                  int64_t tiles, Scratch& w) {
  // NOTE: keys go into the weighted sum 32 at a time from a multiple of 32: a token's keys
  // pair and group alike alone and in a chunk (a sliding window's first token sees from lo),
  // and the blocks before a lane's first visible key add only +0.0.
  const Span sp = span(s, table, its, tiles);
  const int64_t dim = s.head_dim;
  // NOTE: as many tile rows as the group has live lanes (3 at a decode token of a model with
  // 3 query heads a KV head, not 16): rows never mix, so these are the bits of 16-row tiles.
  int live = 1;
  for (int64_t t = 0; t < tiles; ++t)
    live = std::max(live, static_cast<int>(its[t].num_tokens * its[t].num_heads));
  if (live != w.tile_rows) tokenmill::configure_tiles(live), w.tile_rows = live;
  const uint16_t* keys = k_cache + its[0].kv_head * s.head_stride;
  const uint16_t* values = v_cache + its[0].kv_head * s.head_stride;
  load_queries(q, s, its, tiles, sp.padded, w);
  score_keys(keys, values, sp, its, tiles, s.slot_stride, dim, w);
  float den[MAX_TILES * LANES];
  for (int64_t t = 0; t < tiles; ++t) {
    float lane_sinks[LANES];
    const float* sinks = tokenmill::item_sinks(s, its[t], lane_sinks);
    for (int64_t l = 0; l < its[t].num_tokens * its[t].num_heads; ++l) {
      const int64_t at = (t * LANES + l) * sp.padded;
      den[t * LANES + l] =
          lane_weights(w.scores.data() + at, w.e_hi.data() + at, w.e_lo.data() + at,
                       visible(s, its[t], sp.first_key, l), tile_padded(its[t], sp), s.scale,
                       s.softcap, sinks == nullptr ? nullptr : sinks + l);
    }
  }
  for (int64_t d0 = 0; d0 < dim; d0 += PASS_D) {
    weighted_values(values, sp, its, tiles, s.slot_stride, d0, w);
    for (int64_t t = 0; t < tiles; ++t)
      for (int64_t l = 0; l < its[t].num_tokens * its[t].num_heads; ++l) {
        const float inv = 1.0f / den[t * LANES + l];
        const float* acc = w.acc.data() + (t * LANES + l) * PASS_D;
        uint16_t* o = out + head_row(s, its[t], l) * dim + d0;
        for (int64_t d = 0; d < PASS_D; ++d) tokenmill::store(o + d, acc[d] * inv);
      }
  }
}

// The plan's items in groups: runs of one row, KV head and set of query heads (the plan
// lists them together, tokens ascending), at most MAX_TILES (fewer for long contexts, so
// that a group's scores stay in L2).
std::vector<Group> group_items(const std::vector<Item>& items) {
  std::vector<Group> groups;
  const int64_t n = static_cast<int64_t>(items.size());
  for (int64_t i = 0; i < n;) {
    const Item& a = items[i];
    const int64_t keys = round_up(a.first_pos + a.num_tokens, KEY_PAIRS);
    const int64_t cap = std::clamp<int64_t>(GROUP_BYTES / (LANES * keys * 8), 1, MAX_TILES);
    int64_t count = 1;
    while (i + count < n && count < cap && items[i + count].row == a.row &&
           items[i + count].kv_head == a.kv_head && items[i + count].head0 == a.head0)
      ++count;
    groups.push_back({i, count});
    i += count;
  }
  return groups;
}

// The items (one token each: tokenmill::shares_items), each a group of its own, as whole
// groups, as many to each thread as there are for all, then the rest with their work shared
// among the threads in three rounds: their blocks of keys scored, each lane's weights
// (lane_weights), then each half of their columns weighed (add_half, the blocks in ascending
// order). Every sum runs as in attend_group, so the bits are its own.
void attend_shared(const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache,
                   const int32_t* table, uint16_t* out, const Shape& s, const Item* all,
                   int64_t num_items, int threads) {
  const int64_t whole = num_items / threads * threads, rest = num_items - whole;
  const Item* its = all + whole;  // the groups shared
  const int64_t dim = s.head_dim, halves = dim / PASS_D * 2;
  std::vector<Span> spans;
  std::vector<int64_t> first_block{0};  // the shared groups' blocks of KEYS keys, one list
  int64_t most = 0;
  int live = 1;
  for (int64_t g = 0; g < rest; ++g) {
    spans.push_back(span(s, table, its + g, 1));
    first_block.push_back(first_block.back() + spans[g].padded / KEYS);
    most = std::max(most, spans[g].padded);
    live = std::max(live, static_cast<int>(its[g].num_heads));
  }
  // NOTE: [group][lane][most]: one row a lane, as attend_group's scratch has them.
  ScratchVector<float> scores(rest * live * most);
  ScratchVector<uint16_t> e_hi(scores.size()), e_lo(scores.size());
  std::vector<float> den(rest * live);
#pragma omp parallel num_threads(threads)
  {
    tokenmill::configure_tiles();
    Scratch w;
#pragma omp for schedule(static) nowait
    for (int64_t g = 0; g < whole; ++g)
      attend_group(q, k_cache, v_cache, table, out, s, all + g, 1, w);
    tokenmill::configure_tiles(live);
    w.kt.resize(dim / 2 * KEYS);
    w.acc.resize(LANES * PASS_D);
    w.q.resize(rest * LANES * dim);
    for (int64_t g = 0; g < rest; ++g)
      for (int64_t l = 0; l < its[g].num_heads; ++l)
        std::memcpy(w.q.data() + (g * LANES + l) * dim, q + head_row(s, its[g], l) * dim,
                    dim * 2);
#pragma omp for schedule(static)
    for (int64_t b = 0; b < first_block.back(); ++b) {
      const int64_t g = tokenmill::block_owner(first_block, b);
      const int64_t head = its[g].kv_head * s.head_stride;
      const int64_t j0 = (b - first_block[g]) * KEYS;
      fetch_key_block(k_cache + head, v_cache + head, spans[g], j0, s.slot_stride, dim, w);
      score_tile(w.q.data() + g * LANES * dim, dim, w, scores.data() + g * live * most + j0,
                 most);
    }
#pragma omp for schedule(static)
    for (int64_t gl = 0; gl < rest * live; ++gl) {
      const int64_t g = gl / live, l = gl % live, at = gl * most;
      float lane_sinks[LANES];
      const float* sinks = tokenmill::item_sinks(s, its[g], lane_sinks);
      if (l < its[g].num_heads)
        den[gl] = lane_weights(scores.data() + at, e_hi.data() + at, e_lo.data() + at,
                               visible(s, its[g], spans[g].first_key, l), spans[g].padded,
                               s.scale, s.softcap, sinks == nullptr ? nullptr : sinks + l);
    }
#pragma omp for schedule(static)
    for (int64_t gh = 0; gh < rest * halves; ++gh) {
      const int64_t g = gh / halves, d0 = gh % halves / 2 * PASS_D;
      const int half = static_cast<int>(gh % 2);
      const uint16_t* values = v_cache + its[g].kv_head * s.head_stride;
      _tile_zero(0);
      _tile_zero(1);
      for (int64_t j0 = 0; j0 < spans[g].padded; j0 += KEY_PAIRS) {
        interleave_values(values, spans[g], j0, s.slot_stride, d0, w, half, half + 1);
        const int64_t e = g * live * most + j0;
        add_half(e_hi.data() + e, e_lo.data() + e, most, w, half);
      }
      _tile_stored(0, w.acc.data() + 32 * half, PASS_D * 4);
      _tile_stored(1, w.acc.data() + 32 * half + 16, PASS_D * 4);
      for (int64_t l = 0; l < its[g].num_heads; ++l) {
        const float inv = 1.0f / den[g * live + l];
        const float* acc = w.acc.data() + l * PASS_D + 32 * half;
        uint16_t* o = out + head_row(s, its[g], l) * dim + d0 + 32 * half;
        for (int64_t d = 0; d < 32; ++d) tokenmill::store(o + d, acc[d] * inv);
      }
    }
    _tile_release();
  }
}

}  // namespace
#endif

extern "C" {

// tm_paged_attention's bfloat16 case on AMX tiles (the same arguments; dtype must be 1 and
// head_dim a multiple of 64). Returns 0, or -1 where this build or process has no AMX or the
// case is not one it takes.
int tm_paged_attention_amx(const void* q, const void* k_cache, const void* v_cache,
                           const int32_t* table, const int64_t* rows,
                           const int64_t* token_starts, const int64_t* num_tokens,
                           const int64_t* first_pos, void* out, int64_t num_rows,
                           int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                           int64_t head_stride, int64_t slot_stride, int64_t table_stride,
                           int64_t window, float scale, float softcap, const float* sinks,
                           int dtype) {
#if defined(TOKENMILL_AMX)
  if (dtype != 1 || head_dim % PASS_D != 0 || !tm_amx_ready()) return -1;
  const Shape s{num_heads, num_kv_heads, head_dim, table_stride, window,
                head_stride, slot_stride, scale, softcap, sinks};
  const std::vector<Item> items =
      tokenmill::plan(rows, token_starts, num_tokens, first_pos, num_rows, s);
  const int threads = omp_get_max_threads();
  if (tokenmill::shares_items(items, s, threads)) {
    attend_shared(static_cast<const uint16_t*>(q), static_cast<const uint16_t*>(k_cache),
                  static_cast<const uint16_t*>(v_cache), table, static_cast<uint16_t*>(out), s,
                  items.data(), static_cast<int64_t>(items.size()), threads);
    return 0;
  }
  const std::vector<Group> groups = group_items(items);
  const int64_t num_groups = static_cast<int64_t>(groups.size());
#pragma omp parallel
  {
    tokenmill::configure_tiles();
    Scratch scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t g = 0; g < num_groups; ++g)
      attend_group(static_cast<const uint16_t*>(q), static_cast<const uint16_t*>(k_cache),
                   static_cast<const uint16_t*>(v_cache), table, static_cast<uint16_t*>(out), s,
                   items.data() + groups[g].first, groups[g].count, scratch);
    _tile_release();
  }
  return 0;
#else
  (void)q, (void)k_cache, (void)v_cache, (void)table, (void)rows, (void)token_starts;
  (void)num_tokens, (void)first_pos, (void)out, (void)num_rows, (void)num_heads;
  (void)num_kv_heads, (void)head_dim, (void)head_stride, (void)slot_stride, (void)table_stride;
  (void)window, (void)scale, (void)softcap, (void)sinks, (void)dtype;
  return -1;
#endif
}

}  // extern "C"
