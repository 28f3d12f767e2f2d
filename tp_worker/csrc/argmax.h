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

inline void row_max(const float* x, int64_t n, float* max, int64_t* index) {
  float best = -std::numeric_limits<float>::infinity();
  int64_t at = 0;
  int64_t j = 0;
#if defined(__AVX512F__)
  const int64_t whole = n / 16 * 16;
  if (whole > 0) {
    __m512 lane_best = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    __m512i lane_at = _mm512_set1_epi32(0);
    __mmask16 nan = 0;
    __m512i column = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (; j < whole; j += 16) {
      const __m512 v = _mm512_loadu_ps(x + j);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      const __mmask16 greater = _mm512_cmp_ps_mask(v, lane_best, _CMP_GT_OQ);
      lane_best = _mm512_mask_mov_ps(lane_best, greater, v);
      lane_at = _mm512_mask_mov_epi32(lane_at, greater, column);
      column = _mm512_add_epi32(column, _mm512_set1_epi32(16));
    }
    if (nan) {  // NOTE: rare; the scalar loop below finds the first NaN
      j = 0;
    } else {
      alignas(64) float values[16];
      alignas(64) int32_t indices[16];
      _mm512_store_ps(values, lane_best);
      _mm512_store_si512(indices, lane_at);
      best = values[0];
      at = indices[0];
      for (int l = 1; l < 16; ++l)
        if (values[l] > best || (values[l] == best && indices[l] < at)) {
          best = values[l];
          at = indices[l];
        }
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
