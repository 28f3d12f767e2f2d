// bfloat16 attention over the slot-addressed KV cache on Intel's AMX tiles (tp_worker, via
// ctypes; attention.cpp is the AVX-512 and portable kernel, and the float32 one).
//
// Work items are attention.cpp's (attention_common.h's plan): one row, one KV head, up to 16
// (query token, query head) lanes, one tile row each. The order is fixed per lane here:
//   - score(key j) = scale * (q . k_j), the head dimension 32 at a time in ascending order,
//     one TDPBF16PS each (a tile of 16 lanes x 16 keys);
//   - max over the lane's visible keys; e_j = exp(score_j - max) (exp.h), +0.0 for keys the
//     lane does not see; the denominator sums e_j in float32 in 16 lanes (j mod 16, keys
//     ascending) combined by tree_sum16;
//   - out[d] = (sum over j of e_j v_j[d]) * (1 / denominator), the keys 32 at a time in
//     ascending order from a position that is a multiple of 32, e_j as two bfloat16 parts
//     (hi = bf16(e_j), lo = bf16(e_j - hi)), two TDPBF16PS per block (16 lanes x 16 of d).
// A tile's rows and columns never mix and one token alone (decode) runs the same tiles as in
// a prompt chunk, where the keys it does not see add products of +0.0 weights, so a token's
// output is bitwise the same alone, in a chunk or after a prefix-cache hit (tested).
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

#include "amx.h"
#include "attention_common.h"
#include "bf16.h"
#include "exp.h"

#if defined(TOKENMILL_AMX)
namespace {

using tokenmill::Item;
using tokenmill::Shape;

constexpr int LANES = tokenmill::ITEM_LANES;
constexpr int KEYS = 16;      // keys per score tile
constexpr int KEY_PAIRS = 32;  // keys per weighted-values step: 16 pairs
constexpr int PASS_D = 64;    // head columns per pass of weighted values: four tiles of 16

struct Scratch {
  std::vector<uint16_t> q;  // [LANES][dim] queries
  std::vector<uint16_t> e_hi, e_lo;  // [LANES][padded] weights as two bfloat16 parts
  std::vector<uint32_t> kt;    // [dim / 2][KEYS] key pairs, transposed (a B tile per 32 d)
  std::vector<float> scores;   // [LANES][padded]
  alignas(64) uint16_t vt[KEY_PAIRS / 2][PASS_D * 2];  // values of 16 key pairs, interleaved
  alignas(64) float acc[LANES][PASS_D];
};

// Rows lo..hi (inclusive) of keys a lane sees, as indices from the item's first key.
struct Visible {
  int64_t lo, hi;
};

Visible visible(const Shape& s, const Item& it, int64_t first_key, int64_t lane) {
  const int64_t pos = it.first_pos + lane / it.num_heads;
  return {tokenmill::first_seen(s, pos) - first_key, pos - first_key};
}

// scores[l][j] = q_l . k_j (unscaled) for the item's keys, 16 at a time.
void score_keys(const uint16_t* keys, const uint16_t* values, const int32_t* slots,
                int64_t num_keys, int64_t stride, int64_t dim, int64_t padded, Scratch& w) {
  for (int64_t j0 = 0; j0 < num_keys; j0 += KEYS) {
    const int nk = static_cast<int>(std::min<int64_t>(KEYS, num_keys - j0));
    tokenmill::prefetch_rows(keys, slots + j0 + KEYS,
                             std::min<int64_t>(KEYS, num_keys - j0 - KEYS), stride, dim);
    tokenmill::prefetch_rows(values, slots + j0, nk, stride, dim);
    tokenmill::transpose_key_pairs(keys, slots + j0, nk, stride, dim, w.kt.data());
    _tile_zero(0);
    for (int64_t c = 0; c < dim; c += 32) {
      _tile_loadd(4, w.q.data() + c, dim * 2);
      _tile_loadd(6, w.kt.data() + c / 2 * KEYS, KEYS * 4);
      _tile_dpbf16ps(0, 4, 6);
    }
    _tile_stored(0, w.scores.data() + j0, padded * 4);
  }
}

// The keys j0..j0+15 that a lane sees, as a mask.
__mmask16 seen(int64_t j0, Visible v) {
  const int64_t from = std::clamp<int64_t>(v.lo - j0, 0, 16);
  const int64_t to = std::clamp<int64_t>(v.hi - j0 + 1, 0, 16);
  return static_cast<__mmask16>(((1u << to) - 1u) & ~((1u << from) - 1u));
}

// A lane's weights e over its padded row of keys (float32 into the denominator; into hi and
// lo as bf16(e) and bf16(e - bf16(e))), +0.0 for keys it does not see; returns the
// denominator: lane i of 16 sums the keys
// j = i (mod 16) ascending, then tree_sum16, so the sum does not depend on how many keys
// past the lane's last the row holds.
float lane_weights(float* scores, uint16_t* hi, uint16_t* lo, Visible v, int64_t padded,
                   float scale) {
  const __m512 sc = _mm512_set1_ps(scale);
  __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j0 = 0; j0 < padded; j0 += 16) {
    const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(scores + j0), sc);
    _mm512_storeu_ps(scores + j0, x);
    m = _mm512_mask_max_ps(m, seen(j0, v), m, x);
  }
  const __m512 max = _mm512_set1_ps(_mm512_reduce_max_ps(m));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j0 = 0; j0 < padded; j0 += 16) {
    const __m512 x = _mm512_sub_ps(_mm512_loadu_ps(scores + j0), max);
    const __m512 w = _mm512_maskz_mov_ps(seen(j0, v), tokenmill::exp_nonpositive16(x));
    sum = _mm512_add_ps(sum, w);
    const __m512 w_hi = tokenmill::round16(w, hi);
    tokenmill::store16(hi + j0, w_hi);
    tokenmill::store16(lo + j0, _mm512_sub_ps(w, w_hi));
  }
  alignas(64) float lane[16];
  _mm512_store_ps(lane, sum);
  return tokenmill::tree_sum16(lane);
}

// Values of keys j0..j0+31, columns d0..d0+63, as B tiles: vt[p][2 d + i] = v_{j0+2p+i}[d0+d]
// (zeros past the last key: their weights are zero, and a product must not be NaN).
void interleave_values(const uint16_t* values, const int32_t* slots, int64_t num_keys,
                       int64_t j0, int64_t stride, int64_t d0, Scratch& w) {
  static const __m512i lo_idx = [] {
    alignas(64) uint16_t idx[32];
    for (int t = 0; t < 16; ++t) idx[2 * t] = t, idx[2 * t + 1] = 32 + t;
    return _mm512_load_si512(idx);
  }();
  const __m512i hi_idx = _mm512_add_epi16(lo_idx, _mm512_set1_epi16(16));
  for (int p = 0; p < KEY_PAIRS / 2; ++p) {
    for (int half = 0; half < 2; ++half) {
      __m512i row[2];
      for (int i = 0; i < 2; ++i) {
        const int64_t j = j0 + 2 * p + i;
        row[i] = j < num_keys ? _mm512_loadu_si512(values + slots[j] * stride + d0 + half * 32)
                              : _mm512_setzero_si512();
      }
      _mm512_store_si512(w.vt[p] + half * 64, _mm512_permutex2var_epi16(row[0], lo_idx, row[1]));
      _mm512_store_si512(w.vt[p] + half * 64 + 32,
                         _mm512_permutex2var_epi16(row[0], hi_idx, row[1]));
    }
  }
}

// w.acc[l][d] = sum over j of e[l][j] v_j[d0 + d], d < 64, 32 keys at a time: each block's
// hi parts, then its lo parts.
void weighted_values(const uint16_t* values, const int32_t* slots, int64_t num_keys,
                     int64_t stride, int64_t d0, int64_t padded, Scratch& w) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t j0 = 0; j0 < padded; j0 += KEY_PAIRS) {
    interleave_values(values, slots, num_keys, j0, stride, d0, w);
    _tile_loadd(4, w.e_hi.data() + j0, padded * 2);
    _tile_loadd(5, w.e_lo.data() + j0, padded * 2);
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
  _tile_stored(0, &w.acc[0][0], PASS_D * 4);
  _tile_stored(1, &w.acc[0][16], PASS_D * 4);
  _tile_stored(2, &w.acc[0][32], PASS_D * 4);
  _tile_stored(3, &w.acc[0][48], PASS_D * 4);
}

void attend_item(const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache,
                 const int32_t* table, uint16_t* out, const Shape& s, const Item& it,
                 Scratch& w) {
  const int64_t dim = s.head_dim, hs = it.num_heads, lanes = it.num_tokens * hs;
  const int64_t last_pos = it.first_pos + it.num_tokens - 1;
  // NOTE: keys go into the weighted sum 32 at a time from a multiple of 32: a token's keys
  // pair and group alike alone and in a chunk (a sliding window's first token sees from lo).
  const int64_t first_key = tokenmill::first_seen(s, it.first_pos) / KEY_PAIRS * KEY_PAIRS;
  const int64_t num_keys = last_pos - first_key + 1;
  const int64_t padded = (num_keys + KEY_PAIRS - 1) / KEY_PAIRS * KEY_PAIRS;
  const int32_t* slots = table + it.row * s.table_stride + first_key;
  const uint16_t* keys = k_cache + it.kv_head * s.head_stride;
  const uint16_t* values = v_cache + it.kv_head * s.head_stride;
  auto head_row = [&](int64_t l) { return (it.token0 + l / hs) * s.num_heads + it.head0 + l % hs; };
  // NOTE: the tiles' rows past the item's lanes are zeros (their results are never read);
  // every other row is written whole below.
  w.q.resize(LANES * dim);
  std::fill(w.q.begin() + lanes * dim, w.q.end(), uint16_t{0});
  for (int64_t l = 0; l < lanes; ++l)
    std::memcpy(w.q.data() + l * dim, q + head_row(l) * dim, dim * 2);
  w.kt.resize(dim / 2 * KEYS);
  w.scores.resize(LANES * padded);
  for (auto* e : {&w.e_hi, &w.e_lo}) {
    e->resize(LANES * padded);
    std::fill(e->begin() + lanes * padded, e->end(), uint16_t{0});
  }
  score_keys(keys, values, slots, num_keys, s.slot_stride, dim, padded, w);
  float den[LANES];
  for (int64_t l = 0; l < lanes; ++l)
    den[l] = lane_weights(w.scores.data() + l * padded, w.e_hi.data() + l * padded,
                          w.e_lo.data() + l * padded, visible(s, it, first_key, l), padded,
                          s.scale);
  for (int64_t d0 = 0; d0 < dim; d0 += PASS_D) {
    weighted_values(values, slots, num_keys, s.slot_stride, d0, padded, w);
    for (int64_t l = 0; l < lanes; ++l) {
      const float inv = 1.0f / den[l];
      uint16_t* o = out + head_row(l) * dim + d0;
      for (int64_t d = 0; d < PASS_D; ++d) tokenmill::store(o + d, w.acc[l][d] * inv);
    }
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
                           int64_t window, float scale, int dtype) {
#if defined(TOKENMILL_AMX)
  if (dtype != 1 || head_dim % PASS_D != 0 || !tm_amx_ready()) return -1;
  const Shape s{num_heads, num_kv_heads, head_dim, table_stride, window,
                head_stride, slot_stride, scale};
  const std::vector<Item> items =
      tokenmill::plan(rows, token_starts, num_tokens, first_pos, num_rows, s);
  const int64_t num_items = static_cast<int64_t>(items.size());
#pragma omp parallel
  {
    tokenmill::configure_tiles();
    Scratch scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_items; ++i)
      attend_item(static_cast<const uint16_t*>(q), static_cast<const uint16_t*>(k_cache),
                  static_cast<const uint16_t*>(v_cache), table, static_cast<uint16_t*>(out), s,
                  items[i], scratch);
    _tile_release();
  }
  return 0;
#else
  (void)q, (void)k_cache, (void)v_cache, (void)table, (void)rows, (void)token_starts;
  (void)num_tokens, (void)first_pos, (void)out, (void)num_rows, (void)num_heads;
  (void)num_kv_heads, (void)head_dim, (void)head_stride, (void)slot_stride, (void)table_stride;
  (void)window, (void)scale, (void)dtype;
  return -1;
#endif
}

}  // extern "C"
