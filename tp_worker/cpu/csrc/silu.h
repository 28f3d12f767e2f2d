// The MLP's gate activations, scalar and in 16 lanes with the same operations in the same
// order (tp_worker kernels: activation.cpp's act(gate) * up, and the linear kernels' fused
// form). ACTIVATION codes: 1 silu (Llama, ...), 2 gelu with the tanh approximation (Gemma's
// gelu_pytorch_tanh), 3 gpt-oss's clamped SwiGLU (its experts').
//
// silu(x) = x * sigmoid(x) = x / (1 + e) with e = exp(-|x|) from exp.h (x >= 0), or
// x * e / (1 + e) (x < 0), so exp never overflows. gelu_tanh(x) = x * (1 + tanh(u)) / 2 with
// u = sqrt(2 / pi) (x + 0.044715 x^3) is x * sigmoid(2u): the same form at z = 2u (z has x's
// sign), which keeps x < 0 free of the cancellation in 1 + tanh(u). gpt-oss's clamped SwiGLU
// is (clamp(up, -7, 7) + 1) * g * sigmoid(1.702 g), g = min(gate, 7), as transformers'
// GptOssExperts computes it: the sigmoid in the same form at z = 1.702 g, a NaN kept as NaN.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "bf16.h"
#include "exp.h"

namespace tokenmill {

constexpr int SILU = 1, GELU_TANH = 2, SWIGLU_OAI = 3;
// NOTE: gpt-oss's swiglu_alpha and swiglu_limit (model/config.py refuses other values)
constexpr float SWIGLU_ALPHA = 1.702f, SWIGLU_LIMIT = 7.0f;
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

inline float swiglu_oai_times(float gate, float up) {
  const float g = gate > SWIGLU_LIMIT ? SWIGLU_LIMIT : gate;
  const float u = up > SWIGLU_LIMIT ? SWIGLU_LIMIT : (up < -SWIGLU_LIMIT ? -SWIGLU_LIMIT : up);
  const float z = g * SWIGLU_ALPHA;
  const float e = exp_nonpositive(z >= 0.0f ? -z : z);
  const float glu = (z >= 0.0f ? g : g * e) / (1.0f + e);
  return (u + 1.0f) * glu;
}

// act(gate) * up in float32: the caller's store rounds it once to the output's dtype.
inline float silu_times(float gate, float up) { return silu(gate) * up; }

inline float glu_times(int activation, float gate, float up) {
  if (activation == SWIGLU_OAI) return swiglu_oai_times(gate, up);
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

// NOTE: min(limit, x) returns x where x is NaN (its second operand), as the scalar form does.
inline __m512 swiglu_oai_times16(__m512 gate, __m512 up) {
  const __m512 zero = _mm512_setzero_ps(), limit = _mm512_set1_ps(SWIGLU_LIMIT);
  const __m512 g = _mm512_min_ps(limit, gate);
  const __m512 u = _mm512_max_ps(_mm512_set1_ps(-SWIGLU_LIMIT), _mm512_min_ps(limit, up));
  const __m512 z = _mm512_mul_ps(g, _mm512_set1_ps(SWIGLU_ALPHA));
  const __mmask16 negative = _mm512_cmp_ps_mask(z, zero, _CMP_LT_OQ);
  const __m512 minus_abs = _mm512_mask_mov_ps(_mm512_sub_ps(zero, z), negative, z);
  const __m512 e = exp_nonpositive16(minus_abs);
  const __m512 num = _mm512_mask_mul_ps(g, negative, g, e);
  const __m512 glu = _mm512_div_ps(num, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
  return _mm512_mul_ps(_mm512_add_ps(u, _mm512_set1_ps(1.0f)), glu);
}

inline __m512 silu_times16(__m512 gate, __m512 up) { return _mm512_mul_ps(silu16(gate), up); }

inline __m512 glu_times16(int activation, __m512 gate, __m512 up) {
  if (activation == SWIGLU_OAI) return swiglu_oai_times16(gate, up);
  return _mm512_mul_ps(activation == GELU_TANH ? gelu_tanh16(gate) : silu16(gate), up);
}
#endif

}  // namespace tokenmill
