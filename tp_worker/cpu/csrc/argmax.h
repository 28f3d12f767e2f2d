// The largest value of a float row and its first index, in one read (tp_worker kernels).
// A NaN counts as the max (its first index), as torch's argmax; the AVX-512 and the
// portable loops give the same answer (a max involves no rounding).
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace tokenmill {

#if defined(__AVX512F__)
// Lane l of `best` / `at`: the largest value of the columns it saw and the first of them
// to hold it (a strictly greater value replaces, so the lane's columns come in ascending).
struct LaneMax {
  __m512 best = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512i at = _mm512_set1_epi32(0);

  inline void see(__m512 v, __m512i column) {
    const __mmask16 greater = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
    best = _mm512_mask_mov_ps(best, greater, v);
    at = _mm512_mask_mov_epi32(at, greater, column);
  }

  // The max over the lanes, and of its holders the smallest column: the row's first max.
  inline void merge_into(float* max, int64_t* index) const {
    alignas(64) float values[16];
    alignas(64) int32_t columns[16];
    _mm512_store_ps(values, best);
    _mm512_store_si512(columns, at);
    for (int l = 0; l < 16; ++l)
      if (values[l] > *max || (values[l] == *max && columns[l] < *index)) {
        *max = values[l];
        *index = columns[l];
      }
  }
};
#endif

inline void row_max(const float* x, int64_t n, float* max, int64_t* index) {
  float best = -std::numeric_limits<float>::infinity();
  int64_t at = 0;
  int64_t j = 0;
#if defined(__AVX512F__)
  // NOTE: four chains, each its own blocks of 16 columns: one chain's compare waits on the
  // compare before it (a 32K-column row took ~2.4 us a row with one). Which chain sees a
  // column changes nothing: the merge takes the max, and of equal ones the first column.
  const int64_t whole = n / 16 * 16;
  if (whole > 0) {
    LaneMax chains[4];
    __mmask16 nan = 0;
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (; j + 64 <= whole; j += 64) {
      for (int c = 0; c < 4; ++c) {
        const __m512 v = _mm512_loadu_ps(x + j + 16 * c);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        chains[c].see(v, _mm512_add_epi32(lanes, _mm512_set1_epi32(static_cast<int>(j + 16 * c))));
      }
    }
    for (; j < whole; j += 16) {
      const __m512 v = _mm512_loadu_ps(x + j);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      chains[0].see(v, _mm512_add_epi32(lanes, _mm512_set1_epi32(static_cast<int>(j))));
    }
    if (nan) {  // NOTE: rare; the scalar loop below finds the first NaN
      j = 0;
    } else {
      for (const LaneMax& chain : chains) chain.merge_into(&best, &at);
    }
  }
#endif
  for (; j < n; ++j) {
    if (std::isnan(x[j])) {
      best = x[j];
      at = j;
      break;
    }
    if (x[j] > best) {
      best = x[j];
      at = j;
    }
  }
  *max = best;
  *index = at;
}

}  // namespace tokenmill
