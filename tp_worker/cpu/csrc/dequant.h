// GGUF's quantized weights, kept in their blocks, as linear.cpp multiplies them (tp_worker:
// tm_quant_linear_then). cpu/quantized.py writes the layout below from a file's blocks; this
// file gives back, for each k, the weights of the float32 or bfloat16 panel that cpu/ops.py's
// pack makes of the dequantized weight, bit for bit.
//
// Every type served here dequantizes as w = A q - B per group of G weights of a row: q an
// unsigned integer of 4, 5, 6 or 8 bits, A = d * sc (d where a type has no sc), B = dmin * m
// (Q4_K, Q5_K), -m (Q4_1, Q5_1: their float16 m stored negated as dmin) or A * OFFSET (the
// signed types, their q stored with OFFSET added: Q8_0 128, Q4_0 8, Q5_0 16, Q6_K 32); d and
// dmin float16 per block of S weights, sc and m small integers per group. A and B are exact in
// float32 (at most 11 + 8 bits) and so is A q for 4 and 5 bits, so one fused multiply-subtract
// gives the `gguf` package's float32 value: its (d * sc) * q - dmin * m (or d * q + m) rounds
// the exact result once, as the fma does; for Q6_K and Q8_0 its A * (q - OFFSET) is the same
// exact value, rounded once. Every w is 0 or at least 2^-24 in
// magnitude (a whole multiple of float16's smallest step), never a float32 subnormal, so the
// hardware's bfloat16 conversion rounds it as torch does.
//
// A panel holds 32 rows (output features), lane j = row j, and is a sequence of blocks of S k;
// a block, in bytes (each part a multiple of 64):
//   d     float16 [32]               dmin  float16 [32]        (Q4_K, Q5_K, Q4_1, Q5_1)
//   sc    int8 [S / G][32]           m     int8 [S / G][32]    (sc: K types; m: Q4_K, Q5_K)
//   q     [S] units of 32 values: 16 bytes, byte i holding value i in its low 4 bits and value
//         16 + i in its high ones (Q8_0 and Q6_K: 32 bytes, value i in byte i)
//   bits  uint32 [S][PLANES]: bit i of plane p is value i's bit 4 + p (Q5_*: 1 plane)
// NOTE: Q6_K's q in whole bytes (8 bits a weight, not the file's 6.56): with two bit planes
// its one-row product took longer on a 2-core Zen 4, under the dequantizing arithmetic (17.5
// against 22.7 G weights/s) and under quant_kernels.h's (1.33x the time, kernels_ab.py).
// Which (k, lane) a unit's value i is depends on the panel's dtype. float32 ("lanes"): unit k
// holds k's 32 lanes in order. bfloat16 ("pairs"): units k and k + 1 (k even) hold the pair
// (k, k + 1) of lanes 0-15, then of lanes 16-31, each as 16 values (k, j), (k + 1, j) for j
// in 8 lanes, so that one VCVTNE2PS2BF16 of two such vectors is a row of the bfloat16 panel
// [K/2][32][2] (lane j's pair in one 32-bit word) with no shuffle.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "bf16.h"

namespace tokenmill {

// ggml's type codes (gguf's GGMLQuantizationType) of the types served in blocks.
enum QuantType { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

struct QuantLayout {
  int64_t block_k, group_k;  // S and G
  bool scales, mins, bytes;  // sc present, dmin present (with m where scales), q in whole bytes
  int offset, planes;

  constexpr int64_t groups() const { return block_k / group_k; }
  constexpr int64_t d_bytes() const { return 64 * (mins ? 2 : 1); }
  constexpr int64_t sc_bytes() const { return (scales ? 32 : 0) * groups() * (mins ? 2 : 1); }
  constexpr int64_t q_bytes() const { return block_k * (bytes ? 32 : 16); }
  constexpr int64_t block_bytes() const { return d_bytes() + sc_bytes() + q_bytes() + block_k * planes * 4; }
};

// The layout of `type`, or a layout with block_k 0 for a type not served in blocks.
constexpr QuantLayout quant_layout(int type) {
  switch (type) {
    case Q8_0: return {32, 32, false, false, true, 128, 0};
    case Q4_0: return {32, 32, false, false, false, 8, 0};
    case Q4_1: return {32, 32, false, true, false, 0, 0};
    case Q5_0: return {32, 32, false, false, false, 16, 1};
    case Q5_1: return {32, 32, false, true, false, 0, 1};
    case Q4_K: return {256, 32, true, true, false, 0, 0};
    case Q5_K: return {256, 32, true, true, false, 0, 1};
    case Q6_K: return {256, 16, true, false, true, 32, 0};
    default: return {0, 1, false, false, false, 0, 0};
  }
}

// What a bfloat16 product adds to each q before it multiplies (quant_kernels.h): 128, which
// lets a 4-6 bit q widen to the bfloat16 128 + q by one OR; Q8_0, -128 (its signed q).
constexpr int quant_bias(int type) { return type == Q8_0 ? -128 : 128; }

// Whether a bfloat16 product's accumulators hold its lanes as quant_words gives them for the
// 4- and 5-bit types (0-7, 16-23, then 8-15, 24-31) rather than in order.
constexpr bool quant_swapped(int type) { return !quant_layout(type).bytes; }

// pick(std::integral_constant<int, TYPE>) for a type served in blocks, or null: one list of
// the served types for every table of kernels (quant_exact.h, quant_kernels.h).
template <typename Pick>
auto by_type(int type, Pick&& pick) -> decltype(pick(std::integral_constant<int, Q8_0>{})) {
  switch (type) {
    case Q8_0: return pick(std::integral_constant<int, Q8_0>{});
    case Q4_0: return pick(std::integral_constant<int, Q4_0>{});
    case Q4_1: return pick(std::integral_constant<int, Q4_1>{});
    case Q5_0: return pick(std::integral_constant<int, Q5_0>{});
    case Q5_1: return pick(std::integral_constant<int, Q5_1>{});
    case Q4_K: return pick(std::integral_constant<int, Q4_K>{});
    case Q5_K: return pick(std::integral_constant<int, Q5_K>{});
    case Q6_K: return pick(std::integral_constant<int, Q6_K>{});
    default: return nullptr;
  }
}

// float16 -> float32, exact (subnormals included), as VCVTPH2PS.
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // NOTE: a subnormal half is a normal float: shift its mantissa up
    exp = 113;
    while ((man & 0x400u) == 0) {
      man <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((man & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// The block's parts, from its first byte.
struct QuantBlock {
  const uint16_t* d;
  const int8_t* sc;
  const uint8_t* q;
  const uint8_t* bits;

  QuantBlock(const QuantLayout& l, const uint8_t* src)
      : d(reinterpret_cast<const uint16_t*>(src)),
        sc(reinterpret_cast<const int8_t*>(src + l.d_bytes())),
        q(src + l.d_bytes() + l.sc_bytes()),
        bits(src + l.d_bytes() + l.sc_bytes() + l.q_bytes()) {}
};

// Where (k, lane) of a block sits: its unit and its value in the unit (the layouts above).
inline void quant_slot(bool pairs, int64_t k, int lane, int64_t& unit, int& value) {
  if (!pairs) {
    unit = k;
    value = lane;
    return;
  }
  unit = k / 2 * 2 + lane / 16;
  value = (lane % 16) / 8 * 16 + (lane % 8) * 2 + static_cast<int>(k % 2);
}

// (k, lane)'s q of a block, as stored (unsigned).
inline uint32_t quant_q(const QuantLayout& l, const QuantBlock& b, bool pairs, int64_t k,
                        int lane) {
  int64_t unit;
  int value;
  quant_slot(pairs, k, lane, unit, value);
  if (l.bytes) return b.q[unit * 32 + value];
  const uint8_t byte = b.q[unit * 16 + (value & 15)];
  uint32_t q = value < 16 ? byte & 15u : byte >> 4;
  for (int p = 0; p < l.planes; ++p) {
    uint32_t plane;
    std::memcpy(&plane, b.bits + (unit * l.planes + p) * 4, 4);
    q |= ((plane >> value) & 1u) << (4 + p);
  }
  return q;
}

// Group g's A and B for `lane` of a block (exact in float32).
inline void quant_scales(const QuantLayout& l, const QuantBlock& b, int64_t g, int lane,
                         float& a, float& m) {
  a = half_to_float(b.d[lane]);
  if (l.scales) a = a * static_cast<float>(b.sc[g * 32 + lane]);
  m = a * static_cast<float>(l.offset);
  if (l.mins) {
    m = half_to_float(b.d[32 + lane]);
    if (l.scales) m = m * static_cast<float>(b.sc[(l.groups() + g) * 32 + lane]);
  }
}

// (k, lane)'s weight of a block: A q - B, one rounding (gguf's float32 value).
inline float dequant_one(const QuantLayout& l, const QuantBlock& b, bool pairs, int64_t k,
                         int lane) {
  float a, m;
  quant_scales(l, b, k / l.group_k, lane, a, m);
  return std::fma(a, static_cast<float>(quant_q(l, b, pairs, k, lane)), -m);
}

// Lane `lane` of panel `src` (one row, k_len weights) in float32 (an embedding's rows).
inline void dequant_lane(const QuantLayout& l, const uint8_t* src, int64_t k_len, bool pairs,
                         int lane, float* out) {
  for (int64_t b0 = 0; b0 < k_len; b0 += l.block_k, src += l.block_bytes()) {
    const QuantBlock b(l, src);
    for (int64_t k = 0; k < l.block_k; ++k) out[b0 + k] = dequant_one(l, b, pairs, k, lane);
  }
}

#if defined(__AVX512F__)
// quant_layout(TYPE) as compile-time constants, for the kernels' templates.
template <int TYPE>
struct Format {
  static constexpr QuantLayout L = quant_layout(TYPE);
  static constexpr int64_t S = L.block_k, G = L.group_k;
  static constexpr bool SCALES = L.scales, MINS = L.mins, BYTES = L.bytes;
  static constexpr int OFFSET = L.offset, PLANES = L.planes;
};

inline __m512 half16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

inline __m512 int8_16(const int8_t* p) {
  return _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// A group's A and B for lanes 0-15 and 16-31.
struct GroupScales {
  __m512 a[2], b[2];
};

template <int TYPE>
inline GroupScales group_scales(const QuantBlock& block, int64_t g) {
  using F = Format<TYPE>;
  GroupScales out;
  for (int h = 0; h < 2; ++h) {
    __m512 a = half16(block.d + 16 * h);
    if constexpr (F::SCALES) a = _mm512_mul_ps(a, int8_16(block.sc + g * 32 + 16 * h));
    out.a[h] = a;
    if constexpr (F::MINS && F::SCALES)
      out.b[h] = _mm512_mul_ps(half16(block.d + 32 + 16 * h),
                               int8_16(block.sc + (F::S / F::G + g) * 32 + 16 * h));
    else if constexpr (F::MINS)
      out.b[h] = half16(block.d + 32 + 16 * h);
    else
      out.b[h] = _mm512_mul_ps(a, _mm512_set1_ps(static_cast<float>(F::OFFSET)));
  }
  return out;
}

// Unit u's 32 values (a block's q and bits) as two vectors of 16 integers.
template <int TYPE>
inline void quant_unit(const QuantBlock& block, int64_t u, __m512i* q) {
  using F = Format<TYPE>;
  if constexpr (F::BYTES) {
    const auto* p = reinterpret_cast<const __m128i*>(block.q + u * 32);
    q[0] = _mm512_cvtepu8_epi32(_mm_loadu_si128(p));
    q[1] = _mm512_cvtepu8_epi32(_mm_loadu_si128(p + 1));
  } else {
    const __m512i v =
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block.q + u * 16)));
    q[0] = _mm512_and_si512(v, _mm512_set1_epi32(15));
    q[1] = _mm512_srli_epi32(v, 4);
    for (int p = 0; p < F::PLANES; ++p) {
      uint32_t plane;
      std::memcpy(&plane, block.bits + (u * F::PLANES + p) * 4, 4);
      const __m512i bit = _mm512_set1_epi32(16 << p);
      q[0] = _mm512_mask_or_epi32(q[0], static_cast<__mmask16>(plane), q[0], bit);
      q[1] = _mm512_mask_or_epi32(q[1], static_cast<__mmask16>(plane >> 16), q[1], bit);
    }
  }
}

// Bytes ahead of its q that a panel's walk asks for: a decode step's loop keeps too few loads
// in flight to stream the blocks from memory (Q6_K's product waited on its loads half its
// time on a Zen 4); asked ahead, they arrive under the arithmetic. Past the panel's end the
// address points at the next panel or at nothing (a prefetch never faults).
constexpr int64_t QUANT_AHEAD = 4096;

#if defined(__AVX512BF16__)
// The pair (k, k + 1) (k even, within the block) of a unit pair's 32 lanes as two vectors of
// bfloat16 pairs, each value q + quant_bias (exact). Q6_K: lanes 0-15, then 16-31. The 4-
// and 5-bit types: lanes 0-7 and 16-23, then 8-15 and 24-31 (QUANT_SWAPPED: the order in
// which their two units' nibbles widen to words with one zero-extension and no shuffle).
template <int TYPE>
inline void quant_words(const QuantBlock& block, int64_t k, __m512i (&w)[2]) {
  using F = Format<TYPE>;
  const __m512i magic = _mm512_set1_epi16(0x4300);  // bfloat16 128.0: 0x4300 | q is 128 + q
  if constexpr (TYPE == Q8_0) {  // NOTE: q - 128, signed, exact in bfloat16 (8 bits)
    for (int h = 0; h < 2; ++h) {
      const auto* p = reinterpret_cast<const __m128i*>(block.q + (k + h) * 32);
      const __m128i flip = _mm_set1_epi8(static_cast<char>(0x80));
      const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_xor_si128(_mm_loadu_si128(p), flip)));
      const __m512 hi =
          _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_xor_si128(_mm_loadu_si128(p + 1), flip)));
      w[h] = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
    }
  } else if constexpr (F::BYTES) {
    for (int h = 0; h < 2; ++h)
      w[h] = _mm512_or_si512(_mm512_cvtepu8_epi16(_mm256_loadu_si256(
                                 reinterpret_cast<const __m256i*>(block.q + (k + h) * 32))),
                             magic);
  } else {
    const __m512i bytes =
        _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block.q + k * 16)));
    w[0] = _mm512_ternarylogic_epi32(bytes, _mm512_set1_epi16(15), magic, 0xEA);  // (a & b) | c
    w[1] = _mm512_or_si512(_mm512_srli_epi16(bytes, 4), magic);
    for (int p = 0; p < F::PLANES; ++p) {
      uint32_t p0, p1;
      std::memcpy(&p0, block.bits + (k * F::PLANES + p) * 4, 4);
      std::memcpy(&p1, block.bits + ((k + 1) * F::PLANES + p) * 4, 4);
      const __m512i bit = _mm512_set1_epi16(static_cast<int16_t>(16 << p));
      // NOTE: the bit is clear until set: an add is the OR
      w[0] = _mm512_mask_add_epi16(w[0], (p0 & 0xffffu) | (p1 << 16), w[0], bit);
      w[1] = _mm512_mask_add_epi16(w[1], (p0 >> 16) | (p1 & 0xffff0000u), w[1], bit);
    }
  }
}
#endif

#endif

}  // namespace tokenmill
