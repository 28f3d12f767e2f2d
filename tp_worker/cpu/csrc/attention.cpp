// Attention over the slot-addressed KV cache on the CPU (tp_worker, via ctypes).
//
// A work item is one KV head, one row and a block of up to LANES (query token, query head)
// pairs of that row that share the KV head: one lane each. The reduction order is fixed per
// lane by this file, not by a math library, and is the same whatever else is in the item,
// the batch, the chunk or the thread that runs it:
//   - score(key j) = (scale * log2(e)) * sum over d ascending of fma(q[d], k_j[d]) (one
//     accumulator; the factor is one float, rounded once): the score in base 2. In bfloat16
//     the sum runs over the pairs (d, d + 1) ascending, each as one VDPBF16PS lane adds it
//     (bf16.h's dot_pair: the odd product, then the even one, each rounded once);
//   - max over the lane's visible keys; e_j = 2^(score_j - max), exp.h's exp2_nonpositive (a
//     fused-multiply-add series and an exact power of two, not libm's), and e_j = +0.0 for
//     keys the lane does not see;
//   - the denominator sums e_j over ascending j, and out[d] = (sum over j ascending of
//     fma(e_j, v_j[d])) * (1 / denominator): a +0.0 term leaves these sums unchanged bit for
//     bit (they start at +0.0 and are never -0.0), so unseen keys change nothing.
// With a soft-cap c (Gemma 2), the factor is scale / c instead and each score then becomes
// tanh(score) * (c * log2(e)) (exp.h's tanh_own, one pass over the scores before the max).
// With sinks (gpt-oss), a lane's sink (in base 2) joins its max, and the denominator is the
// keys' sum plus 2^(sink - max) (attention_common.h's with_sink), in both vectorisations.
// So a token's output is bitwise the same alone (decode), in a prompt chunk, or after a
// prefix-cache hit, whichever of the two vectorisations below computes it (queries in the
// vector lanes for prompt chunks, keys in the vector lanes for one token). Built with
// -ffp-contract=off and without -ffast-math: the compiler vectorises the lane loops but never
// fuses or reassociates what the source does not.
//
// Keys are read where they lie: position p of table row r is slot table[r * stride + p], so
// an item costs work in proportion to its own row's context (causal, or the sliding window).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include <omp.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "attention_common.h"
#include "bf16.h"
#include "exp.h"
#include "kernels.h"

namespace {

constexpr int LANES = tokenmill::ITEM_LANES;
constexpr int KEY_BLOCK = 8;  // keys scored together: independent accumulator chains

using tokenmill::bf16_to_float;
using tokenmill::Item;
using tokenmill::plan;
using tokenmill::ScratchVector;
using tokenmill::Shape;
#if defined(__AVX512F__)
using tokenmill::prefetch_rows;
using tokenmill::transpose16;
using tokenmill::transpose_key_pairs;
#endif
#if defined(__AVX512F__)
using tokenmill::load16;
#endif
using tokenmill::exp2_nonpositive;
using tokenmill::store;
#if defined(__AVX512F__)
using tokenmill::exp2_nonpositive16;
#endif

// The factor the dot products are scaled by (see the top).
inline float score_factor(const Shape& s) {
  return s.softcap > 0.0f ? s.scale / s.softcap : s.scale * tokenmill::LOG2E;
}

// scores[0..n) = tanh(scores) * (c * log2(e)) where the model soft-caps (c > 0), in place.
inline void cap_scores(float* scores, int64_t n, float softcap) {
  if (softcap <= 0.0f) return;
  const float out = softcap * tokenmill::LOG2E;
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(scores + i, _mm512_mul_ps(tokenmill::tanh_own16(_mm512_loadu_ps(scores + i)),
                                               _mm512_set1_ps(out)));
#endif
  for (; i < n; ++i) scores[i] = tokenmill::tanh_own(scores[i]) * out;
}

inline void to_float(const float* src, float* dst, int64_t n) {
  std::memcpy(dst, src, n * sizeof(float));
}

inline void to_float(const uint16_t* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_float(src[i]);
}

// For each key, the lanes that see it: e_j = exp(score - max) in those, +0.0 in the others;
// max and the denominator over the visible lanes only, and the first `lanes` lanes' sinks
// (null: none).
void softmax_numerators(float* scores, const uint16_t* masks, int64_t num_keys, float* den,
                        const float* sinks, int64_t lanes) {
#if defined(__AVX512F__)
  // NOTE: four running maxima, not one: a max is exact in any order, and one chain waited
  // on the latency of each max in turn (a third of this function's time).
  __m512 m[4];
  for (int c = 0; c < 4; ++c) m[c] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t j = 0;
  for (; j + 4 <= num_keys; j += 4)
    for (int c = 0; c < 4; ++c) {
      const __m512 s = _mm512_loadu_ps(scores + (j + c) * LANES);
      m[c] = _mm512_mask_max_ps(m[c], masks[j + c], m[c], s);
    }
  for (; j < num_keys; ++j)
    m[0] = _mm512_mask_max_ps(m[0], masks[j], m[0], _mm512_loadu_ps(scores + j * LANES));
  __m512 max = _mm512_max_ps(_mm512_max_ps(m[0], m[1]), _mm512_max_ps(m[2], m[3]));
  if (sinks != nullptr)
    max = _mm512_mask_max_ps(max, static_cast<__mmask16>((1u << lanes) - 1u), max,
                             _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << lanes) - 1u), sinks));
  __m512 sum = _mm512_setzero_ps();
  for (j = 0; j < num_keys; ++j) {
    const __m512 x = _mm512_sub_ps(_mm512_loadu_ps(scores + j * LANES), max);
    const __m512 e = _mm512_maskz_mov_ps(masks[j], exp2_nonpositive16(x));
    _mm512_storeu_ps(scores + j * LANES, e);
    sum = _mm512_add_ps(sum, e);
  }
  _mm512_storeu_ps(den, sum);
  if (sinks != nullptr) {
    float maxes[LANES];
    _mm512_storeu_ps(maxes, max);
    for (int64_t l = 0; l < lanes; ++l) den[l] = tokenmill::with_sink(den[l], sinks[l], maxes[l]);
  }
#else
  float max[LANES];
  for (int l = 0; l < LANES; ++l) {
    max[l] = -std::numeric_limits<float>::infinity();
    den[l] = 0.0f;
  }
  for (int64_t j = 0; j < num_keys; ++j)
    for (int l = 0; l < LANES; ++l)
      if ((masks[j] >> l) & 1) max[l] = std::max(max[l], scores[j * LANES + l]);
  if (sinks != nullptr)
    for (int64_t l = 0; l < lanes; ++l) max[l] = std::max(max[l], sinks[l]);
  for (int64_t j = 0; j < num_keys; ++j)
    for (int l = 0; l < LANES; ++l) {
      float* sc = scores + j * LANES + l;
      *sc = ((masks[j] >> l) & 1) ? exp2_nonpositive(*sc - max[l]) : 0.0f;
      den[l] = den[l] + *sc;
    }
  if (sinks != nullptr)
    for (int64_t l = 0; l < lanes; ++l) den[l] = tokenmill::with_sink(den[l], sinks[l], max[l]);
#endif
}

// scores[kk][l] = scale * sum over d ascending of fma(q_t[d][l], keys[kk][d]), for the
// KEY_BLOCK keys of a block (rows past the last key hold leftovers and are never read).
void score_block(const float* q_t, const float* keys, int64_t dim, float scale, float* scores) {
#if defined(__AVX512F__)
  __m512 acc[KEY_BLOCK];
  for (int kk = 0; kk < KEY_BLOCK; ++kk) acc[kk] = _mm512_setzero_ps();
  for (int64_t d = 0; d < dim; ++d) {
    const __m512 qd = _mm512_loadu_ps(q_t + d * LANES);
    for (int kk = 0; kk < KEY_BLOCK; ++kk)
      acc[kk] = _mm512_fmadd_ps(qd, _mm512_set1_ps(keys[kk * dim + d]), acc[kk]);
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int kk = 0; kk < KEY_BLOCK; ++kk)
    _mm512_storeu_ps(scores + kk * LANES, _mm512_mul_ps(acc[kk], sc));
#else
  float acc[KEY_BLOCK][LANES] = {};
  for (int64_t d = 0; d < dim; ++d)
    for (int kk = 0; kk < KEY_BLOCK; ++kk)
      for (int l = 0; l < LANES; ++l)
        acc[kk][l] = std::fma(q_t[d * LANES + l], keys[kk * dim + d], acc[kk][l]);
  for (int kk = 0; kk < KEY_BLOCK; ++kk)
    for (int l = 0; l < LANES; ++l) scores[kk * LANES + l] = acc[kk][l] * scale;
#endif
}

// Softmax numerators e[j][l], laid out [key][LANES] (or [lane][keys] for one token).
struct Weights {
  const float* e;
  int64_t key_step, lane_step;
  float at(int64_t j, int64_t l) const { return e[j * key_step + l * lane_step]; }
};

#if defined(__AVX512F__)
// weighted_values' AVX-512 loop, 16 columns at a time; weight(j, l) is e[j][l].
template <int NL, typename W, typename T>
void weighted_values16(W weight, const T* values, const int32_t* slots, int64_t num_keys,
                       int64_t stride, int64_t dim, float* out) {
  for (int64_t d0 = 0; d0 < dim; d0 += 16) {
    __m512 acc[NL];
    for (int l = 0; l < NL; ++l) acc[l] = _mm512_setzero_ps();
    for (int64_t j = 0; j < num_keys; ++j) {
      const __m512 v = load16(values + slots[j] * stride + d0);
      for (int l = 0; l < NL; ++l)
        acc[l] = _mm512_fmadd_ps(_mm512_set1_ps(weight(j, l)), v, acc[l]);
    }
    for (int l = 0; l < NL; ++l) _mm512_storeu_ps(out + l * dim + d0, acc[l]);
  }
}
#endif

// out[l][d] = sum over keys j ascending of fma(e[j][l], v_j[d]) for the first NL lanes, where
// v_j is the row at values + slots[j] * stride. Lanes that do not see key j have e = +0.0,
// which adds nothing (a sum that starts at +0.0 is never -0.0).
template <int NL, typename T>
void weighted_values(Weights e, const T* values, const int32_t* slots, int64_t num_keys,
                     int64_t stride, int64_t dim, float* out) {
#if defined(__AVX512F__)
  if (dim % 16 == 0 && e.key_step == LANES && e.lane_step == 1) {
    // NOTE: the prompt path's [key][LANES] weights, their strides known here: each lane's
    // weight is a fixed offset from one pointer per key, not a pointer per lane.
    const float* w = e.e;
    weighted_values16<NL>([w](int64_t j, int l) { return w[j * LANES + l]; }, values, slots,
                          num_keys, stride, dim, out);
    return;
  }
  if (dim % 16 == 0) {
    weighted_values16<NL>([e](int64_t j, int l) { return e.at(j, l); }, values, slots, num_keys,
                          stride, dim, out);
    return;
  }
#endif
  std::fill(out, out + NL * dim, 0.0f);
  std::vector<float> v(dim);
  for (int64_t j = 0; j < num_keys; ++j) {
    to_float(values + slots[j] * stride, v.data(), dim);
    for (int l = 0; l < NL; ++l)
      for (int64_t d = 0; d < dim; ++d)
        out[l * dim + d] = std::fma(e.at(j, l), v[d], out[l * dim + d]);
  }
}

#if defined(__AVX512F__)
// The same sums for few lanes and a head of DC * 16 columns: every accumulator in a register
// and each value row read once (NL * DC independent fma chains instead of NL).
template <int NL, int DC, typename T>
void weighted_values_small(Weights e, const T* values, const int32_t* slots,
                           int64_t num_keys, int64_t stride, int64_t dim, float* out) {
  __m512 acc[NL][DC];
  for (int l = 0; l < NL; ++l)
    for (int c = 0; c < DC; ++c) acc[l][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < num_keys; ++j) {
    const T* row = values + slots[j] * stride;
    for (int c = 0; c < DC; ++c) {
      const __m512 v = load16(row + c * 16);
      for (int l = 0; l < NL; ++l)
        acc[l][c] = _mm512_fmadd_ps(_mm512_set1_ps(e.at(j, l)), v, acc[l][c]);
    }
  }
  for (int l = 0; l < NL; ++l)
    for (int c = 0; c < DC; ++c) _mm512_storeu_ps(out + l * dim + c * 16, acc[l][c]);
}
#endif

template <typename T>
using WeightedValues = void (*)(Weights, const T*, const int32_t*, int64_t, int64_t, int64_t,
                                float*);

#if defined(__AVX512F__)
// weighted_values_small<NL, DC> for NL = lanes, among the lane counts L + 1 given.
template <int DC, typename T, int... L>
WeightedValues<T> small_of(int64_t lanes, std::integer_sequence<int, L...>) {
  static const WeightedValues<T> table[] = {weighted_values_small<L + 1, DC, T>...};
  return lanes <= static_cast<int64_t>(sizeof...(L)) ? table[lanes - 1] : nullptr;
}

// weighted_values_small over `columns` of a head of `dim` (all of them, or the first or
// second half: the caller offsets values and out), or null: few enough lanes that each lane
// and 16 columns keep an accumulator in a register.
template <typename T>
WeightedValues<T> small_values_for(int64_t lanes, int64_t dim, int64_t columns) {
  if (dim == 64)
    return columns == 64 ? small_of<4, T>(lanes, std::make_integer_sequence<int, 6>())
                         : small_of<2, T>(lanes, std::make_integer_sequence<int, 6>());
  if (dim == 128)
    return columns == 128 ? small_of<8, T>(lanes, std::make_integer_sequence<int, 3>())
                          : small_of<4, T>(lanes, std::make_integer_sequence<int, 3>());
  return nullptr;
}
#endif

template <typename T>
WeightedValues<T> weighted_values_for(int64_t lanes, int64_t dim) {
#if defined(__AVX512F__)
  if (const WeightedValues<T> small = small_values_for<T>(lanes, dim, dim)) return small;
#endif
  static const WeightedValues<T> table[LANES] = {
      weighted_values<1, T>,  weighted_values<2, T>,  weighted_values<3, T>,
      weighted_values<4, T>,  weighted_values<5, T>,  weighted_values<6, T>,
      weighted_values<7, T>,  weighted_values<8, T>,  weighted_values<9, T>,
      weighted_values<10, T>, weighted_values<11, T>, weighted_values<12, T>,
      weighted_values<13, T>, weighted_values<14, T>, weighted_values<15, T>,
      weighted_values<16, T>};
  return table[lanes - 1];
}

#if defined(__AVX512F__)
// The head sizes the keys-in-lanes path takes: whole 16-lane blocks of 32-bit words.
inline bool sixteen_fits(const float*, int64_t dim) { return dim % 16 == 0; }
inline bool sixteen_fits(const uint16_t*, int64_t dim) { return dim % 32 == 0; }

// Up to 16 keys (rows keys + slots[kk] * stride) as float32 columns: kt[d][kk]; missing keys
// are zeros.
inline void transpose_keys(const float* keys, const int32_t* slots, int nk, int64_t stride,
                           int64_t dim, float* kt) {
  for (int64_t c = 0; c < dim; c += 16) {
    __m512 r[16];
    for (int kk = 0; kk < 16; ++kk)
      r[kk] = kk < nk ? _mm512_loadu_ps(keys + slots[kk] * stride + c) : _mm512_setzero_ps();
    transpose16(r);
    for (int i = 0; i < 16; ++i) _mm512_storeu_ps(kt + (c + i) * 16, r[i]);
  }
}

// The NH accumulators of a keys-in-lanes block, scaled: lane kk of acc[h] is the score of key
// kk for head h, stored at scores[kk * key_step + h * lane_step].
template <int NH>
void store_scores(const __m512* acc, float scale, int nk, float* scores, int64_t key_step,
                  int64_t lane_step) {
  alignas(64) float lane[16];
  for (int h = 0; h < NH; ++h) {
    const __m512 scaled = _mm512_mul_ps(acc[h], _mm512_set1_ps(scale));
    if (key_step == 1) {  // NOTE: writes all 16; the caller's rows are padded to 16 keys
      _mm512_storeu_ps(scores + h * lane_step, scaled);
      continue;
    }
    _mm512_store_ps(lane, scaled);
    for (int kk = 0; kk < nk; ++kk) scores[kk * key_step + h * lane_step] = lane[kk];
  }
}

// One query token's NH heads against 16 transposed bfloat16 keys: dot_pair over the pairs
// ascending, keys in the lanes (the same sums as score_block_pairs, heads in the lanes).
template <int NH>
void score_key_pairs(const uint32_t* q_pairs, const uint32_t* kt, int64_t dim, float scale,
                     int nk, float* scores, int64_t key_step, int64_t lane_step) {
  __m512 acc[NH];
  for (int h = 0; h < NH; ++h) acc[h] = _mm512_setzero_ps();
  for (int64_t p = 0; p < dim / 2; ++p) {
    const __m512i k = _mm512_loadu_si512(kt + p * 16);
    for (int h = 0; h < NH; ++h)
      acc[h] = tokenmill::dot_pair16(
          acc[h], k, _mm512_set1_epi32(static_cast<int>(q_pairs[p * LANES + h])));
  }
  store_scores<NH>(acc, scale, nk, scores, key_step, lane_step);
}

using ScorePairs = void (*)(const uint32_t*, const uint32_t*, int64_t, float, int, float*,
                            int64_t, int64_t);

inline ScorePairs score_key_pairs_for(int64_t heads) {
  static const ScorePairs table[8] = {score_key_pairs<1>, score_key_pairs<2>,
                                      score_key_pairs<3>, score_key_pairs<4>,
                                      score_key_pairs<5>, score_key_pairs<6>,
                                      score_key_pairs<7>, score_key_pairs<8>};
  return table[heads - 1];
}

// One query token's NH heads against 16 transposed keys: the same fma chain over d per score
// as score_block, with the keys in the lanes instead of the heads.
template <int NH>
void score_keys(const float* q_t, const float* kt, int64_t dim, float scale, int nk,
                float* scores, int64_t key_step, int64_t lane_step) {
  __m512 acc[NH];
  for (int h = 0; h < NH; ++h) acc[h] = _mm512_setzero_ps();
  for (int64_t d = 0; d < dim; ++d) {
    const __m512 k = _mm512_loadu_ps(kt + d * 16);
    for (int h = 0; h < NH; ++h) acc[h] = _mm512_fmadd_ps(_mm512_set1_ps(q_t[d * LANES + h]), k, acc[h]);
  }
  store_scores<NH>(acc, scale, nk, scores, key_step, lane_step);
}

using ScoreKeys = void (*)(const float*, const float*, int64_t, float, int, float*, int64_t,
                           int64_t);

inline ScoreKeys score_keys_for(int64_t heads) {
  static const ScoreKeys table[8] = {score_keys<1>, score_keys<2>, score_keys<3>, score_keys<4>,
                                     score_keys<5>, score_keys<6>, score_keys<7>, score_keys<8>};
  return table[heads - 1];
}
#endif

struct Scratch {
  ScratchVector<float> q_t, scores, acc, keys;  // float32: q_t [dim][LANES] queries, transposed
  ScratchVector<uint32_t> q_pairs, key_pairs;  // bfloat16: [dim / 2][LANES], [dim / 2][16]
  ScratchVector<uint16_t> key_rows;  // bfloat16: a block's keys side by side, [16][dim]
  ScratchVector<uint16_t> masks;  // [num_keys] lanes that see each key
};

#if defined(__AVX512F__)
// scores[kk][l] = scale * dot_pair over the pairs p ascending of q_pairs[p][l] and word(kk, p),
// key kk's pair p, for NK keys, queries in the lanes: NK independent sums in flight.
template <int NK, typename Word>
void score_pairs16(const uint32_t* q_pairs, int64_t pairs, Word word, float scale,
                   float* scores) {
  __m512 acc[NK];
  for (int kk = 0; kk < NK; ++kk) acc[kk] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    const __m512i q = _mm512_loadu_si512(q_pairs + p * LANES);
    for (int kk = 0; kk < NK; ++kk)
      acc[kk] = tokenmill::dot_pair16(acc[kk], q,
                                      _mm512_set1_epi32(static_cast<int>(word(kk, p))));
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int kk = 0; kk < NK; ++kk)
    _mm512_storeu_ps(scores + kk * LANES, _mm512_mul_ps(acc[kk], sc));
}
#endif

// bfloat16, queries in the lanes: scores[kk][l] = scale * dot_pair over the pairs ascending
// of q_pairs[p][l] and key kk's pair p, for the nk (<= KEY_BLOCK) keys of a block starting at
// `slots` (rows past nk hold leftovers and are never read).
void score_block_pairs(const uint32_t* q_pairs, const uint16_t* keys, const int32_t* slots,
                       int nk, int64_t stride, int64_t dim, float scale, float* scores) {
  const uint16_t* rows[KEY_BLOCK];
  for (int kk = 0; kk < KEY_BLOCK; ++kk) rows[kk] = keys + slots[std::min(kk, nk - 1)] * stride;
  const int64_t pairs = (dim + 1) / 2;
#if defined(__AVX512F__)
  score_pairs16<KEY_BLOCK>(
      q_pairs, pairs,
      [&](int kk, int64_t p) {
        uint32_t word;
        if (2 * p + 1 < dim) {
          std::memcpy(&word, rows[kk] + 2 * p, 4);  // NOTE: one broadcast load
        } else {
          word = tokenmill::pair_word(rows[kk], p, dim);
        }
        return word;
      },
      scale, scores);
#else
  for (int kk = 0; kk < nk; ++kk)
    for (int l = 0; l < LANES; ++l) {
      float acc = 0.0f;
      for (int64_t p = 0; p < pairs; ++p)
        acc = tokenmill::dot_pair(acc, q_pairs[p * LANES + l],
                                     tokenmill::pair_word(rows[kk], p, dim));
      scores[kk * LANES + l] = acc * scale;
    }
#endif
}

#if defined(__AVX512F__)
// score_block_pairs for 16 keys and a head of DIM columns, the keys side by side: every key's
// pair is then one fixed offset from one pointer, so 16 independent sums stay in flight with
// no address juggling. The same sums, in the same order, as score_block_pairs. Where the 16
// keys already lie so in the cache (consecutive slots DIM apart: the slot pool hands out a
// row's positions in runs) they are read there; else they are copied into `copy` first
// (rows past nk repeat the last key: leftovers, never read).
template <int DIM>
void score_copied_block(const uint32_t* q_pairs, const uint16_t* keys, const int32_t* slots,
                        int nk, int64_t stride, float scale, uint16_t* copy, float* scores) {
  bool in_place = nk == 16 && stride == DIM;
  for (int kk = 1; kk < 16 && in_place; ++kk) in_place = slots[kk] == slots[0] + kk;
  const uint16_t* rows = copy;
  if (in_place) {
    rows = keys + slots[0] * stride;
  } else {
    for (int kk = 0; kk < 16; ++kk)
      std::memcpy(copy + kk * DIM, keys + slots[std::min(kk, nk - 1)] * stride, DIM * 2);
  }
  score_pairs16<16>(
      q_pairs, DIM / 2,
      [rows](int kk, int64_t p) {
        uint32_t word;
        std::memcpy(&word, rows + kk * DIM + 2 * p, 4);
        return word;
      },
      scale, scores);
}

// Every key scored by score_copied_block, where the head size has one (64 or 128 columns).
inline bool scored_by_copied_blocks(const uint16_t* keys, const int32_t* slots,
                                    int64_t num_keys, int64_t stride, int64_t dim, float scale,
                                    Scratch& w) {
  using Fn = void (*)(const uint32_t*, const uint16_t*, const int32_t*, int, int64_t, float,
                      uint16_t*, float*);
  const Fn fn = dim == 64    ? score_copied_block<64>
                : dim == 128 ? score_copied_block<128>
                             : nullptr;
  if (!fn) return false;
  w.key_rows.resize(16 * dim);
  for (int64_t j0 = 0; j0 < num_keys; j0 += 16) {
    const int nk = static_cast<int>(std::min<int64_t>(16, num_keys - j0));
    fn(w.q_pairs.data(), keys, slots + j0, nk, stride, scale, w.key_rows.data(),
       w.scores.data() + j0 * LANES);
  }
  return true;
}
#endif

// One block of up to KEY_BLOCK keys, queries in the lanes: scores[kk][l] (float32: the keys
// converted into w.keys first; bfloat16: straight from the cache by pairs).
inline void score_block_of(const float* keys, const int32_t* slots, int nk, int64_t stride,
                           int64_t dim, float scale, Scratch& w, float* scores) {
  w.keys.resize(KEY_BLOCK * dim);
  for (int kk = 0; kk < nk; ++kk)
    to_float(keys + slots[kk] * stride, w.keys.data() + kk * dim, dim);
  score_block(w.q_t.data(), w.keys.data(), dim, scale, scores);
}

inline void score_block_of(const uint16_t* keys, const int32_t* slots, int nk, int64_t stride,
                           int64_t dim, float scale, Scratch& w, float* scores) {
  score_block_pairs(w.q_pairs.data(), keys, slots, nk, stride, dim, scale, scores);
}

#if defined(__AVX512F__)
// Up to 16 keys scored for `lanes` (<= 8) query lanes, keys in the vector lanes: key kk of
// lane l at scores[kk * key_step + l * lane_step] (the head size as sixteen_fits takes it).
inline void score_sixteen(const float* keys, const int32_t* slots, int nk, int64_t stride,
                          int64_t dim, float scale, int64_t lanes, Scratch& w, float* scores,
                          int64_t key_step, int64_t lane_step) {
  w.keys.resize(16 * dim);
  transpose_keys(keys, slots, nk, stride, dim, w.keys.data());
  score_keys_for(lanes)(w.q_t.data(), w.keys.data(), dim, scale, nk, scores, key_step,
                        lane_step);
}

inline void score_sixteen(const uint16_t* keys, const int32_t* slots, int nk, int64_t stride,
                          int64_t dim, float scale, int64_t lanes, Scratch& w, float* scores,
                          int64_t key_step, int64_t lane_step) {
  w.key_pairs.resize(8 * dim);
  transpose_key_pairs(keys, slots, nk, stride, dim, w.key_pairs.data());
  score_key_pairs_for(lanes)(w.q_pairs.data(), w.key_pairs.data(), dim, scale, nk, scores,
                             key_step, lane_step);
}
#endif

// scores[j][l] for every key j and lane l (the lanes' queries transposed in w).
template <typename T>
void score_all(const T* keys, const int32_t* slots, int64_t num_keys, int64_t stride,
               int64_t dim, float scale, int64_t lanes, Scratch& w) {
#if defined(__AVX512F__)
  // NOTE: few lanes (a decode token's heads): keys in the lanes instead, 16 at a time.
  if (lanes <= 8 && sixteen_fits(keys, dim)) {
    for (int64_t j0 = 0; j0 < num_keys; j0 += 16) {
      const int nk = static_cast<int>(std::min<int64_t>(16, num_keys - j0));
      score_sixteen(keys, slots + j0, nk, stride, dim, scale, lanes, w,
                    w.scores.data() + j0 * LANES, LANES, 1);
    }
    return;
  }
  if constexpr (std::is_same<T, uint16_t>::value) {
    if (scored_by_copied_blocks(keys, slots, num_keys, stride, dim, scale, w)) return;
  }
#endif
  for (int64_t j0 = 0; j0 < num_keys; j0 += KEY_BLOCK) {
    const int nk = static_cast<int>(std::min<int64_t>(KEY_BLOCK, num_keys - j0));
    score_block_of(keys, slots + j0, nk, stride, dim, scale, w, w.scores.data() + j0 * LANES);
  }
}

// out = (sum of e-weighted values) / denominator, for every lane of the item.
template <typename T>
void finish_item(Weights e, const T* v_cache, T* out, const Shape& s, const Item& it,
                 int64_t num_keys, const int32_t* slots, const float* den, Scratch& w) {
  const int64_t dim = s.head_dim, hs = it.num_heads, lanes = it.num_tokens * hs;
  weighted_values_for<T>(lanes, dim)(e, v_cache + it.kv_head * s.head_stride, slots, num_keys,
                                     s.slot_stride, dim, w.acc.data());
  for (int64_t i = 0; i < it.num_tokens; ++i)
    for (int64_t h = 0; h < hs; ++h) {
      const int64_t l = i * hs + h;
      const float inv = 1.0f / den[l];
      T* o = out + ((it.token0 + i) * s.num_heads + it.head0 + h) * dim;
      for (int64_t d = 0; d < dim; ++d) store(o + d, w.acc[l * dim + d] * inv);
    }
}

#if defined(__AVX512F__)
// Keys [j0, j0 + 16) of one query token scored for its `lanes` lanes into rows `stride` apart
// ([lane][keys]): the next block's keys and this block's values asked for meanwhile.
template <typename T>
void score_one_token_block(const T* keys, const T* values, const int32_t* slots,
                           int64_t num_keys, int64_t j0, int64_t stride, int64_t dim,
                           float scale, int64_t lanes, Scratch& w, float* scores,
                           int64_t row_stride) {
  const int nk = static_cast<int>(std::min<int64_t>(16, num_keys - j0));
  // NOTE: a decode step waits on memory (a row's keys lie in runs, not in one piece): the
  // next block's keys and this block's values are asked for while this block is scored.
  prefetch_rows(keys, slots + j0 + 16, std::min<int64_t>(16, num_keys - j0 - 16), stride, dim);
  prefetch_rows(values, slots + j0, nk, stride, dim);
  score_sixteen(keys, slots + j0, nk, stride, dim, scale, lanes, w, scores + j0, 1, row_stride);
}

// Lanes [l0, l1) of rows `stride` apart: scores into numerators e_j = 2^(s_j - max), and
// den[l] their sum over ascending keys (with lane l's sink, sinks[l], where not null).
inline void one_token_weights(float* scores, int64_t stride, int64_t l0, int64_t l1,
                              int64_t num_keys, float softcap, float* den, const float* sinks) {
  float maxes[8];
  for (int64_t l = l0; l < l1; ++l) {
    float* sc = scores + l * stride;
    cap_scores(sc, num_keys, softcap);
    __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t j0 = 0; j0 < num_keys; j0 += 16) {
      const int64_t nk = std::min<int64_t>(16, num_keys - j0);
      const __mmask16 valid = static_cast<__mmask16>((1u << nk) - 1u);
      m = _mm512_mask_max_ps(m, valid, m, _mm512_loadu_ps(sc + j0));
    }
    float top = _mm512_reduce_max_ps(m);
    if (sinks != nullptr) top = std::max(top, sinks[l]);
    maxes[l - l0] = top;
    const __m512 max = _mm512_set1_ps(top);
    for (int64_t j0 = 0; j0 < num_keys; j0 += 16)
      _mm512_storeu_ps(sc + j0, exp2_nonpositive16(_mm512_sub_ps(_mm512_loadu_ps(sc + j0), max)));
  }
  // NOTE: each lane's sum runs over ascending keys; the lanes' chains advance together so
  // that their additions overlap instead of waiting on one another.
  float sums[8] = {};
  for (int64_t j = 0; j < num_keys; ++j)
    for (int64_t l = l0; l < l1; ++l) sums[l - l0] = sums[l - l0] + scores[l * stride + j];
  for (int64_t l = l0; l < l1; ++l)
    den[l] = sinks == nullptr ? sums[l - l0]
                              : tokenmill::with_sink(sums[l - l0], sinks[l], maxes[l - l0]);
}

// One query token sees every key from lo to its position, so no lane masks: scores, then
// numerators e, per lane in a row of `padded` keys ([lane][keys]), and the denominators summed
// over ascending keys; the same values as the general path. False where it does not apply.
template <typename T>
bool one_token_numerators(const T* keys, const T* values, const int32_t* slots,
                          int64_t num_keys, int64_t stride, int64_t dim, float scale,
                          int64_t lanes, Scratch& w, int64_t padded, float softcap, float* den,
                          const float* sinks) {
  if (lanes > 8 || !sixteen_fits(keys, dim)) return false;
  w.scores.resize(std::max<size_t>(w.scores.size(), lanes * padded));
  for (int64_t j0 = 0; j0 < num_keys; j0 += 16)
    score_one_token_block(keys, values, slots, num_keys, j0, stride, dim, scale, lanes, w,
                          w.scores.data(), padded);
  one_token_weights(w.scores.data(), padded, 0, lanes, num_keys, softcap, den, sinks);
  return true;
}
#endif

// The item's lanes' queries, transposed into w: float32 [dim][LANES], bfloat16 as pairs
// [dim / 2][LANES]; unused lanes zero.
void transpose_queries(const float* q, const Shape& s, const Item& it, Scratch& w) {
  const int64_t dim = s.head_dim, hs = it.num_heads;
  w.q_t.assign(dim * LANES, 0.0f);
  for (int64_t i = 0; i < it.num_tokens; ++i)
    for (int64_t h = 0; h < hs; ++h) {
      const float* row = q + ((it.token0 + i) * s.num_heads + it.head0 + h) * dim;
      for (int64_t d = 0; d < dim; ++d) w.q_t[d * LANES + i * hs + h] = row[d];
    }
}

void transpose_queries(const uint16_t* q, const Shape& s, const Item& it, Scratch& w) {
  const int64_t dim = s.head_dim, hs = it.num_heads, pairs = (dim + 1) / 2;
  w.q_pairs.assign(pairs * LANES, 0u);
  for (int64_t i = 0; i < it.num_tokens; ++i)
    for (int64_t h = 0; h < hs; ++h) {
      const uint16_t* row = q + ((it.token0 + i) * s.num_heads + it.head0 + h) * dim;
      for (int64_t p = 0; p < pairs; ++p)
        w.q_pairs[p * LANES + i * hs + h] = tokenmill::pair_word(row, p, dim);
    }
}

template <typename T>
void attend_item(const T* q, const T* k_cache, const T* v_cache, const int32_t* table,
                 T* out, const Shape& s, const Item& it, Scratch& w) {
  const int64_t dim = s.head_dim, hs = it.num_heads;
  const int64_t last_pos = it.first_pos + it.num_tokens - 1;
  const int64_t lo = tokenmill::first_seen(s, it.first_pos);
  const int64_t num_keys = last_pos - lo + 1;
  const int32_t* slots = table + it.row * s.table_stride + lo;
  w.scores.resize((num_keys + 16) * LANES);  // whole blocks: a block writes 8 or 16 rows
  w.acc.resize(LANES * dim);
  transpose_queries(q, s, it, w);
  const int64_t lanes = it.num_tokens * hs;
  float den[LANES], lane_sinks[LANES];
  const float* sinks = tokenmill::item_sinks(s, it, lane_sinks);
  const T* keys = k_cache + it.kv_head * s.head_stride;
  const int64_t stride = s.slot_stride;
  const float scale2 = score_factor(s);  // scores in base 2: e_j = 2^(s_j - max)
#if defined(__AVX512F__)
  const int64_t padded = (num_keys + 15) / 16 * 16;
  if (it.num_tokens == 1 &&
      one_token_numerators(keys, v_cache + it.kv_head * s.head_stride, slots, num_keys, stride,
                           dim, scale2, lanes, w, padded, s.softcap, den, sinks)) {
    finish_item(Weights{w.scores.data(), 1, padded}, v_cache, out, s, it, num_keys, slots, den,
                w);
    return;
  }
#endif
  // Key position lo + j is seen by the lanes of tokens i with pos_i - window < lo + j <= pos_i.
  w.masks.resize(num_keys);
  for (int64_t j = 0; j < num_keys; ++j) {
    const int64_t rel = lo + j - it.first_pos;  // the first token that sees it
    const int64_t first = std::max<int64_t>(0, rel);
    const int64_t end = s.window > 0 ? std::min(it.num_tokens, rel + s.window) : it.num_tokens;
    const uint32_t below_end = end > first ? (1u << (end * hs)) - 1u : 0u;
    w.masks[j] = static_cast<uint16_t>(below_end & ~((1u << (first * hs)) - 1u));
  }
  score_all(keys, slots, num_keys, stride, dim, scale2, lanes, w);
  cap_scores(w.scores.data(), num_keys * LANES, s.softcap);
  softmax_numerators(w.scores.data(), w.masks.data(), num_keys, den, sinks, lanes);
  finish_item(Weights{w.scores.data(), LANES, 1}, v_cache, out, s, it, num_keys, slots, den, w);
}

#if defined(__AVX512F__)
// The items (one token each: tokenmill::shares_items) as whole items, as many to each thread
// as there are for all, then the rest with their work shared among the threads in three
// rounds: their blocks of keys scored, their lanes' numerators and denominators (a thread's
// share of each item's lanes), then each half of their columns weighed (small_values_for's
// kernel over half the columns: the same chains, each as the whole head's kernel runs it).
// Every sum runs as in attend_item's one-token path, so the bits are its own.
template <typename T>
void attend_shared(const T* q, const T* k_cache, const T* v_cache, const int32_t* table,
                   T* out, const Shape& s, const std::vector<Item>& items, int threads) {
  const int64_t n = static_cast<int64_t>(items.size()), whole = n / threads * threads;
  const int64_t rest = n - whole, dim = s.head_dim, stride = s.slot_stride;
  const Item* its = items.data() + whole;  // the items shared
  const float scale2 = score_factor(s);
  std::vector<int64_t> num_keys, first_block{0};  // the shared items' blocks of 16 keys
  std::vector<const int32_t*> slots;
  int64_t most = 0, lanes = 0;
  for (int64_t i = 0; i < rest; ++i) {
    const int64_t lo = tokenmill::first_seen(s, its[i].first_pos);
    num_keys.push_back(its[i].first_pos - lo + 1);
    slots.push_back(table + its[i].row * s.table_stride + lo);
    first_block.push_back(first_block.back() + (num_keys[i] + 15) / 16);
    most = std::max(most, (num_keys[i] + 15) / 16 * 16);
    lanes = std::max(lanes, its[i].num_heads);
  }
  ScratchVector<float> scores(rest * lanes * most);  // [item][lane][most]
  std::vector<float> den(rest * lanes);
#pragma omp parallel num_threads(threads)
  {
    Scratch w;
    const int t = omp_get_thread_num();
#pragma omp for schedule(static) nowait
    for (int64_t i = 0; i < whole; ++i)
      attend_item<T>(q, k_cache, v_cache, table, out, s, items[i], w);
    int64_t queries_of = -1;  // the item whose queries w holds
#pragma omp for schedule(static)
    for (int64_t b = 0; b < first_block.back(); ++b) {
      const int64_t i = tokenmill::block_owner(first_block, b);
      if (i != queries_of) transpose_queries(q, s, its[i], w), queries_of = i;
      const int64_t head = its[i].kv_head * s.head_stride;
      score_one_token_block(k_cache + head, v_cache + head, slots[i], num_keys[i],
                            (b - first_block[i]) * 16, stride, dim, scale2, its[i].num_heads,
                            w, scores.data() + i * lanes * most, most);
    }
    for (int64_t i = 0; i < rest; ++i) {
      const int64_t h = its[i].num_heads;
      float lane_sinks[LANES];
      one_token_weights(scores.data() + i * lanes * most, most, h * t / threads,
                        h * (t + 1) / threads, num_keys[i], s.softcap, den.data() + i * lanes,
                        tokenmill::item_sinks(s, its[i], lane_sinks));
    }
#pragma omp barrier
    w.acc.resize(lanes * dim);
#pragma omp for schedule(static)
    for (int64_t ih = 0; ih < rest * 2; ++ih) {
      const int64_t i = ih / 2, c0 = ih % 2 * dim / 2, h = its[i].num_heads;
      const T* values = v_cache + its[i].kv_head * s.head_stride + c0;
      small_values_for<T>(h, dim, dim / 2)(Weights{scores.data() + i * lanes * most, 1, most},
                                           values, slots[i], num_keys[i], stride, dim,
                                           w.acc.data() + c0);
      for (int64_t l = 0; l < h; ++l) {
        const float inv = 1.0f / den[i * lanes + l];
        T* o = out + (its[i].token0 * s.num_heads + its[i].head0 + l) * dim + c0;
        for (int64_t d = 0; d < dim / 2; ++d) store(o + d, w.acc[l * dim + c0 + d] * inv);
      }
    }
  }
}
#endif

template <typename T>
void attend_all(const void* q, const void* k_cache, const void* v_cache, const int32_t* table,
                void* out, const Shape& s, const std::vector<Item>& items) {
  const int64_t num_items = static_cast<int64_t>(items.size());
#if defined(__AVX512F__)
  const int threads = omp_get_max_threads();
  if (tokenmill::shares_items(items, s, threads) &&
      std::all_of(items.begin(), items.end(), [&](const Item& it) {
        return small_values_for<T>(it.num_heads, s.head_dim, s.head_dim / 2) != nullptr;
      })) {
    attend_shared(static_cast<const T*>(q), static_cast<const T*>(k_cache),
                  static_cast<const T*>(v_cache), table, static_cast<T*>(out), s, items,
                  threads);
    return;
  }
#endif
#pragma omp parallel
  {
    Scratch scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_items; ++i)
      attend_item<T>(static_cast<const T*>(q), static_cast<const T*>(k_cache),
                     static_cast<const T*>(v_cache), table, static_cast<T*>(out), s, items[i],
                     scratch);
  }
}

}  // namespace

extern "C" {

// q, out [tokens, num_heads, head_dim]; k_cache, v_cache hold head h's key of slot s at
// h * head_stride + s * slot_stride (elements; head_dim contiguous), both alike;
// table [table rows, table_stride] int32 slot of each position. Batch row b holds
// num_tokens[b] query tokens from index token_starts[b], at positions first_pos[b]...,
// of table row rows[b]. dtype 0 = float32, 1 = bfloat16 (all four tensors alike).
// window <= 0: no sliding window; softcap <= 0: none; sinks: null, or each query head's sink
// logit (float32 [num_heads]). Returns 0, or -1 for an unknown dtype.
int tm_paged_attention(const void* q, const void* k_cache, const void* v_cache,
                       const int32_t* table, const int64_t* rows, const int64_t* token_starts,
                       const int64_t* num_tokens, const int64_t* first_pos, void* out,
                       int64_t num_rows, int64_t num_heads, int64_t num_kv_heads,
                       int64_t head_dim, int64_t head_stride, int64_t slot_stride,
                       int64_t table_stride, int64_t window, float scale, float softcap,
                       const float* sinks, int dtype) {
  const Shape s{num_heads, num_kv_heads, head_dim, table_stride, window,
                head_stride, slot_stride, scale, softcap, sinks};
  const std::vector<Item> items = plan(rows, token_starts, num_tokens, first_pos, num_rows, s);
  if (dtype == 0) {
    attend_all<float>(q, k_cache, v_cache, table, out, s, items);
  } else if (dtype == 1) {
    attend_all<uint16_t>(q, k_cache, v_cache, table, out, s, items);
  } else {
    return -1;
  }
  return 0;
}

}  // extern "C"
