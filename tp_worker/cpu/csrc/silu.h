// The MLP's gate activations, scalar and in 16 lanes with the same operations in the same
// order (tp_worker kernels: activation.cpp's act(gate) * up, and the linear kernels' fused
// form). ACTIVATION codes: 1 silu (Llama, ...), 2 gelu with the tanh approximation (Gemma's
// gelu_pytorch_tanh).
//
// silu(x) = x * sigmoid(x) = x / (1 + e) with e = exp(-|x|) from exp.h (x >= 0), or
// x * e / (1 + e) (x < 0), so exp never overflows. gelu_tanh(x) = x * (1 + tanh(u)) / 2 with
// u = sqrt(2 / pi) (x + 0.044715 x^3) is x * sigmoid(2u): the same form at z = 2u (z has x's
// sign), which keeps x < 0 free of the cancellation in 1 + tanh(u).
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "bf16.h"
#include "exp.h"

namespace tokenmill {

constexpr int SILU = 1, GELU_TANH = 2;
constexpr float GELU_C1 = 1.5957691216057308f;  // 2 sqrt(2 / pi)
constexpr float GELU_C3 = 0.0713548162726009f;  // 2 sqrt(2 / pi) 0.044715

inline float silu(float x) {
  const float e = exp_nonpositive(x >= 0.0f ? -x : x);
  return (x >= 0.0f ? x : x * e) / (1.0f + e);
}

inline float gelu_tanh(float x) {
  const float z = x * (GELU_C1 + GELU_C3 * (x * x));
  const float e = exp_nonpositive(z >= 0.0f ? -z : z);
  return (x >= 0.0f ? x : x * e) / (1.0f + e);
}

// act(gate) * up in float32: the caller's store rounds it once to the output's dtype.
inline float silu_times(float gate, float up) { return silu(gate) * up; }

inline float glu_times(int activation, float gate, float up) {
  return (activation == GELU_TANH ? gelu_tanh(gate) : silu(gate)) * up;
}

#if defined(__AVX512F__)
inline __m512 silu16(__m512 x) {
  const __m512 zero = _mm512_setzero_ps();
  const __mmask16 negative = _mm512_cmp_ps_mask(x, zero, _CMP_LT_OQ);
  const __m512 minus_abs = _mm512_mask_mov_ps(_mm512_sub_ps(zero, x), negative, x);
  const __m512 e = exp_nonpositive16(minus_abs);
  const __m512 num = _mm512_mask_mul_ps(x, negative, x, e);
  return _mm512_div_ps(num, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}

inline __m512 gelu_tanh16(__m512 x) {
  const __m512 zero = _mm512_setzero_ps();
  const __m512 z = _mm512_mul_ps(
      x, _mm512_add_ps(_mm512_set1_ps(GELU_C1),
                       _mm512_mul_ps(_mm512_set1_ps(GELU_C3), _mm512_mul_ps(x, x))));
  const __mmask16 negative = _mm512_cmp_ps_mask(x, zero, _CMP_LT_OQ);
  const __mmask16 z_negative = _mm512_cmp_ps_mask(z, zero, _CMP_LT_OQ);
  const __m512 minus_abs = _mm512_mask_mov_ps(_mm512_sub_ps(zero, z), z_negative, z);
  const __m512 e = exp_nonpositive16(minus_abs);
  const __m512 num = _mm512_mask_mul_ps(x, negative, x, e);
  return _mm512_div_ps(num, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}

inline __m512 silu_times16(__m512 gate, __m512 up) { return _mm512_mul_ps(silu16(gate), up); }

inline __m512 glu_times16(int activation, __m512 gate, __m512 up) {
  return _mm512_mul_ps(activation == GELU_TANH ? gelu_tanh16(gate) : silu16(gate), up);
}
#endif

}  // namespace tokenmill
