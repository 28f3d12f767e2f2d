// silu(x) = x * sigmoid(x), scalar and in 16 lanes with the same operations in the same order
// (tp_worker kernels: activation.cpp's silu(gate) * up, and the linear kernels' fused form).
//
// silu(x) = x / (1 + e) with e = exp(-|x|) from exp.h (x >= 0), or x * e / (1 + e) (x < 0),
// so exp never overflows.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "bf16.h"
#include "exp.h"

namespace tokenmill {

inline float silu(float x) {
  const float e = exp_nonpositive(x >= 0.0f ? -x : x);
  return (x >= 0.0f ? x : x * e) / (1.0f + e);
}

// silu(gate) * up in float32: the caller's store rounds it once to the output's dtype.
inline float silu_times(float gate, float up) { return silu(gate) * up; }

#if defined(__AVX512F__)
inline __m512 silu16(__m512 x) {
  const __m512 zero = _mm512_setzero_ps();
  const __mmask16 negative = _mm512_cmp_ps_mask(x, zero, _CMP_LT_OQ);
  const __m512 minus_abs = _mm512_mask_mov_ps(_mm512_sub_ps(zero, x), negative, x);
  const __m512 e = exp_nonpositive16(minus_abs);
  const __m512 num = _mm512_mask_mul_ps(x, negative, x, e);
  return _mm512_div_ps(num, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}

inline __m512 silu_times16(__m512 gate, __m512 up) { return _mm512_mul_ps(silu16(gate), up); }
#endif

}  // namespace tokenmill
