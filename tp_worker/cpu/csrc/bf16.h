// bfloat16 <-> float32 and loads of either, bit-exact and the same on every CPU (tp_worker
// kernels), and the one order in which the kernels reduce across lanes.
#pragma once

#include <cmath>
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

// float_to_bf16 in 16 lanes (the bfloat16 bits in the low half of each 32-bit lane), with
// integer operations: the same bits as the scalar form, NaN and subnormals included (the
// hardware conversion, VCVTNEPS2BF16, treats subnormals differently).
inline __m512i bf16_bits16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  const __m512i quiet = _mm512_or_si512(bits, _mm512_set1_epi32(0x400000));
  rounded = _mm512_mask_mov_epi32(rounded, nan, quiet);
  return _mm512_srli_epi32(rounded, 16);
}

// round_to and store for 16 lanes: 16 consecutive elements of the tag's dtype.
inline __m512 round16(__m512 v, const float*) { return v; }
inline __m512 round16(__m512 v, const uint16_t*) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits16(v), 16));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(uint16_t* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bits16(v)));
}
#endif

// Elements 2p and 2p + 1 of a bfloat16 row as one 32-bit word (low, high), as VDPBF16PS takes
// a pair; a zero high half past an odd length n.
inline uint32_t pair_word(const uint16_t* row, int64_t p, int64_t n) {
  const uint32_t lo = row[2 * p];
  const uint32_t hi = 2 * p + 1 < n ? row[2 * p + 1] : 0u;
  return lo | (hi << 16);
}

// One step of a bfloat16 dot product over pairs, as one VDPBF16PS lane takes it: acc plus the
// high (odd) halves' product, rounded, plus the low (even) halves' product, rounded (each
// product of two bfloat16 values is exact in float32). a and b hold a pair in 32 bits.
inline float dot_pair(float acc, uint32_t a, uint32_t b) {
  acc = std::fma(bf16_to_float(static_cast<uint16_t>(a >> 16)),
                 bf16_to_float(static_cast<uint16_t>(b >> 16)), acc);
  return std::fma(bf16_to_float(static_cast<uint16_t>(a & 0xffffu)),
                  bf16_to_float(static_cast<uint16_t>(b & 0xffffu)), acc);
}

#if defined(__AVX512F__)
// dot_pair in 16 lanes: VDPBF16PS where the CPU has it, the same two roundings elsewhere.
inline __m512 dot_pair16(__m512 acc, __m512i a, __m512i b) {
#if defined(__AVX512BF16__)
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
#else
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  acc = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(a, high)),
                        _mm512_castsi512_ps(_mm512_and_si512(b, high)), acc);
  return _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(a, 16)),
                         _mm512_castsi512_ps(_mm512_slli_epi32(b, 16)), acc);
#endif
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
