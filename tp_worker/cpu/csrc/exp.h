// exp(x) for x <= 0, our own (not libm's), scalar and in 16 lanes with the same operations
// in the same order: the same bits on every CPU and in either form (tp_worker kernels).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace tokenmill {

constexpr float LOG2E = 1.44269504f;  // log2(e) in float: x * LOG2E takes exp to base 2

// exp(x) for x <= 0: 2^n * p(r) with r = x - n ln2 in [-ln2/2, ln2/2]; ~2 ulp. Written
// without branches so that the lane loops vectorise; the same operations run in every lane.
inline float exp_nonpositive(float x) {
  const float xc = std::max(x, -87.0f);
  const float n = static_cast<float>(static_cast<int32_t>(xc * LOG2E - 0.5f));
  const float r = (xc - n * 0.693145752f) - n * 1.42860677e-6f;
  float p = 1.98756912e-4f;
  p = p * r + 1.39819994e-3f;
  p = p * r + 8.33345205e-3f;
  p = p * r + 4.16657962e-2f;
  p = p * r + 1.66666657e-1f;
  p = p * r + 0.5f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return x < -87.0f ? 0.0f : p * scale;
}

#if defined(__AVX512F__)
// exp_nonpositive in 16 lanes: the same operations in the same order, lane by lane.
inline __m512 exp_nonpositive16(__m512 x) {
  const __m512 xc = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512i ni = _mm512_cvttps_epi32(
      _mm512_sub_ps(_mm512_mul_ps(xc, _mm512_set1_ps(LOG2E)), _mm512_set1_ps(0.5f)));
  const __m512 n = _mm512_cvtepi32_ps(ni);
  const __m512 r = _mm512_sub_ps(_mm512_sub_ps(xc, _mm512_mul_ps(n, _mm512_set1_ps(0.693145752f))),
                                 _mm512_mul_ps(n, _mm512_set1_ps(1.42860677e-6f)));
  __m512 p = _mm512_set1_ps(1.98756912e-4f);
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.39819994e-3f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(8.33345205e-3f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(4.16657962e-2f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.66666657e-1f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(0.5f));
  p = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(p, r), r), r), _mm512_set1_ps(1.0f));
  const __m512 scale = _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23));
  const __mmask16 under = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ);
  return _mm512_maskz_mul_ps(static_cast<__mmask16>(~under), p, scale);
}
#endif

// 2^f for f in [-1/2, 1/2]: its Taylor series to degree 6 in fused multiply-adds (relative
// error below 2e-7), the half of 2^x = 2^n * 2^f (n = round(x), f = x - n exact) that both
// exp2 forms below share; scalar and 16 lanes, the same operations in the same order.
constexpr float EXP2_SERIES[7] = {1.5403530393381606e-4f, 1.3333558146428443e-3f,
                                  9.6181291076284772e-3f, 5.5504108664821580e-2f,
                                  2.4022650695910071e-1f, 6.9314718055994531e-1f, 1.0f};

inline float exp2_fraction(float f) {
  float p = EXP2_SERIES[0];
  for (int i = 1; i < 7; ++i) p = std::fma(p, f, EXP2_SERIES[i]);
  return p;
}

#if defined(__AVX512F__)
// n = round(x) into *n, and 2^(x - n).
inline __m512 exp2_split16(__m512 x, __m512* n) {
  *n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, *n);
  __m512 p = _mm512_set1_ps(EXP2_SERIES[0]);
  for (int i = 1; i < 7; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP2_SERIES[i]));
  return p;
}
#endif

// 2^x for x <= 0: 2^n * 2^f as above; +0.0 for x < -125, so that 2^n is a normal number and
// the product is exact: no rounding that a CPU or a form could do differently. Scalar and 16
// lanes, the same bits (the log-softmax's sum; ~half the work of exp_nonpositive, whose bits
// its other users keep).
inline float exp2_nonpositive(float x) {
  if (!(x >= -125.0f)) return 0.0f;  // NOTE: NaN too, as the lanes' mask has it
  const float n = std::nearbyint(x);
  const float p = exp2_fraction(x - n);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

#if defined(__AVX512F__)
inline __m512 exp2_nonpositive16(__m512 x) {
  __m512 n;
  const __m512 p = exp2_split16(x, &n);
  const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-125.0f), _CMP_GE_OQ);
  const __m512i e = _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_maskz_mov_ps(keep, n)),
                                     _mm512_set1_epi32(127));
  return _mm512_maskz_mul_ps(keep, p, _mm512_castsi512_ps(_mm512_slli_epi32(e, 23)));
}

// 2^x in the lanes of `keep` (+0.0 in the others) for x <= ~127, 2^n * 2^f as above scaled
// by VSCALEFPS: half of exp_nonpositive16's operations, and not its bits. For kernels whose
// bits are their CPU's own anyway (attention_amx.cpp).
inline __m512 exp2_16_fused(__m512 x, __mmask16 keep) {
  __m512 n;  // NOTE: from -150, where 2^-150 scales to +0.0
  const __m512 p = exp2_split16(_mm512_max_ps(x, _mm512_set1_ps(-150.0f)), &n);
  return _mm512_maskz_scalef_ps(keep, p, n);
}
#endif

// tanh(x), our own: for |x| < 1/4 its odd series to x^9, else (1 - e) / (1 + e) with
// e = exp(-2|x|) (exp_nonpositive), the sign put back; ~3 ulp. Scalar and 16 lanes, the same
// operations in the same order (plain multiplies and adds: no fused form a compiler or a CPU
// could pick differently). The soft-caps of Gemma 2's attention and logits use it.
constexpr float TANH_SERIES[4] = {62.0f / 2835.0f, -17.0f / 315.0f, 2.0f / 15.0f, -1.0f / 3.0f};

inline float tanh_own(float x) {
  const float a = std::fabs(x), a2 = a * a;
  float p = TANH_SERIES[0];
  for (int i = 1; i < 4; ++i) p = p * a2 + TANH_SERIES[i];
  const float small = a + a * (a2 * p);
  const float e = exp_nonpositive(-2.0f * a);
  const float big = (1.0f - e) / (1.0f + e);
  return std::copysign(a < 0.25f ? small : big, x);
}

#if defined(__AVX512F__)
inline __m512 tanh_own16(__m512 x) {
  const __m512 sign = _mm512_castsi512_ps(
      _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(static_cast<int>(0x80000000u))));
  const __m512 a = _mm512_castsi512_ps(
      _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7fffffff)));
  const __m512 a2 = _mm512_mul_ps(a, a);
  __m512 p = _mm512_set1_ps(TANH_SERIES[0]);
  for (int i = 1; i < 4; ++i)
    p = _mm512_add_ps(_mm512_mul_ps(p, a2), _mm512_set1_ps(TANH_SERIES[i]));
  const __m512 small = _mm512_add_ps(a, _mm512_mul_ps(a, _mm512_mul_ps(a2, p)));
  const __m512 e = exp_nonpositive16(_mm512_mul_ps(_mm512_set1_ps(-2.0f), a));
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 big = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
  const __mmask16 is_small = _mm512_cmp_ps_mask(a, _mm512_set1_ps(0.25f), _CMP_LT_OQ);
  const __m512 r = _mm512_mask_mov_ps(big, is_small, small);
  return _mm512_castsi512_ps(
      _mm512_or_si512(_mm512_castps_si512(r), _mm512_castps_si512(sign)));
}
#endif

}  // namespace tokenmill
