// bfloat16 <-> float32 and loads of either, bit-exact and the same on every CPU (tp_worker
// kernels), and the one order in which the kernels reduce across lanes.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace tokenmill {

inline float bf16_to_float(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Round to nearest even, as torch does; NaN stays NaN.
inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

inline void store(float* dst, float v) { *dst = v; }
inline void store(uint16_t* dst, float v) { *dst = float_to_bf16(v); }

// One element of a float32 or bfloat16 tensor as float32, and a float32 rounded to the
// tensor's dtype and back (the second argument only picks the dtype).
inline float load(const float* p) { return *p; }
inline float load(const uint16_t* p) { return bf16_to_float(*p); }
inline float round_to(float v, const float*) { return v; }
inline float round_to(float v, const uint16_t*) { return bf16_to_float(float_to_bf16(v)); }

#if defined(__AVX512F__)
// 16 consecutive elements as float32 lanes.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
#endif

// Partial sums lane[0..15] combined pairwise by halves: (i, i + 8), (i, i + 4), (i, i + 2),
// (i, i + 1). The fixed order every kernel uses where it reduces across lanes.
inline float tree_sum16(float* lane) {
  for (int width = 8; width > 0; width /= 2)
    for (int i = 0; i < width; ++i) lane[i] = lane[i] + lane[i + width];
  return lane[0];
}

}  // namespace tokenmill
