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
// its one-row product ran at 17.5 G weights/s on a 2-core Zen 4, in bytes at 22.7 (at one
// row every type but Q8_0 is bound by this arithmetic, not by memory).
// Which (k, lane) a unit's value i is depends on the panel's dtype. float32 ("lanes"): unit k
// holds k's 32 lanes in order. bfloat16 ("pairs"): units k and k + 1 (k even) hold the pair
// (k, k + 1) of lanes 0-15, then of lanes 16-31, each as 16 values (k, j), (k + 1, j) for j
// in 8 lanes, so that one VCVTNE2PS2BF16 of two such vectors is a row of the bfloat16 panel
// [K/2][32][2] (lane j's pair in one 32-bit word) with no shuffle.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

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

  int64_t groups() const { return block_k / group_k; }
  int64_t d_bytes() const { return 64 * (mins ? 2 : 1); }
  int64_t sc_bytes() const { return (scales ? 32 : 0) * groups() * (mins ? 2 : 1); }
  int64_t q_bytes() const { return block_k * (bytes ? 32 : 16); }
  int64_t block_bytes() const { return d_bytes() + sc_bytes() + q_bytes() + block_k * planes * 4; }
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

// (k, lane)'s weight of a block: A q - B, one rounding.
inline float dequant_one(const QuantLayout& l, const QuantBlock& b, bool pairs, int64_t k,
                         int lane) {
  int64_t unit;
  int value;
  quant_slot(pairs, k, lane, unit, value);
  uint32_t q;
  if (l.bytes) {
    q = b.q[unit * 32 + value];
  } else {
    const uint8_t byte = b.q[unit * 16 + (value & 15)];
    q = value < 16 ? byte & 15u : byte >> 4;
    for (int p = 0; p < l.planes; ++p) {
      uint32_t plane;
      std::memcpy(&plane, b.bits + (unit * l.planes + p) * 4, 4);
      q |= ((plane >> value) & 1u) << (4 + p);
    }
  }
  const int64_t g = k / l.group_k;
  float a = half_to_float(b.d[lane]);
  if (l.scales) a = a * static_cast<float>(b.sc[g * 32 + lane]);
  float m = a * static_cast<float>(l.offset);
  if (l.mins) {
    m = half_to_float(b.d[32 + lane]);
    if (l.scales) m = m * static_cast<float>(b.sc[(l.groups() + g) * 32 + lane]);
  }
  return std::fma(a, static_cast<float>(q), -m);
}

// Lane `lane` of panel `src` (one row, k_len weights) in float32 (an embedding's rows).
inline void dequant_lane(const QuantLayout& l, const uint8_t* src, int64_t k_len, bool pairs,
                         int lane, float* out) {
  for (int64_t b0 = 0; b0 < k_len; b0 += l.block_k, src += l.block_bytes()) {
    const QuantBlock b(l, src);
    for (int64_t k = 0; k < l.block_k; ++k) out[b0 + k] = dequant_one(l, b, pairs, k, lane);
  }
}

// The portable form of dequant_panel: the float32 panel [K][32] (Out float, lanes) or the
// bfloat16 one [K/2][32][2] (Out uint16_t, pairs), one element at a time.
template <typename Out>
void dequant_panel_portable(const QuantLayout& l, const uint8_t* src, int64_t k_len, Out* out) {
  constexpr bool pairs = sizeof(Out) == 2;
  for (int64_t b0 = 0; b0 < k_len; b0 += l.block_k, src += l.block_bytes()) {
    const QuantBlock b(l, src);
    for (int64_t k = 0; k < l.block_k; ++k)
      for (int lane = 0; lane < 32; ++lane) {
        const float w = dequant_one(l, b, pairs, k, lane);
        const int64_t kk = b0 + k;
        if constexpr (pairs)
          out[(kk / 2 * 32 + lane) * 2 + kk % 2] = float_to_bf16(w);
        else
          out[kk * 32 + lane] = w;
      }
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

// A group's A and B in vectors: float32 (lanes) a[0..1] for lanes 0-15 and 16-31; bfloat16
// (pairs) a[v] for vector v of a pair's four (lanes 8v .. 8v + 7, each twice: k, k + 1).
struct GroupScales {
  __m512 a[4], b[4];
};

template <int TYPE, bool PAIRS>
inline GroupScales group_scales(const QuantBlock& block, int64_t g) {
  using F = Format<TYPE>;
  GroupScales out;
  __m512 a[2], b[2];
  for (int h = 0; h < 2; ++h) {
    a[h] = half16(block.d + 16 * h);
    if constexpr (F::SCALES) a[h] = _mm512_mul_ps(a[h], int8_16(block.sc + g * 32 + 16 * h));
    if constexpr (F::MINS && F::SCALES)
      b[h] = _mm512_mul_ps(half16(block.d + 32 + 16 * h),
                           int8_16(block.sc + (F::S / F::G + g) * 32 + 16 * h));
    else if constexpr (F::MINS)
      b[h] = half16(block.d + 32 + 16 * h);
    else
      b[h] = _mm512_mul_ps(a[h], _mm512_set1_ps(static_cast<float>(F::OFFSET)));
  }
  if constexpr (!PAIRS) {
    for (int h = 0; h < 2; ++h) out.a[h] = a[h], out.b[h] = b[h];
  } else {
    const __m512i low = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i high = _mm512_add_epi32(low, _mm512_set1_epi32(8));
    for (int v = 0; v < 4; ++v) {
      const __m512i idx = v % 2 ? high : low;
      out.a[v] = _mm512_permutexvar_ps(idx, a[v / 2]);
      out.b[v] = _mm512_permutexvar_ps(idx, b[v / 2]);
    }
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

// float32: k's 32 weights of a block (k within it), lanes 0-15 and 16-31.
template <int TYPE>
inline void quant_lanes(const QuantBlock& block, const GroupScales& s, int64_t k, __m512 (&w)[2]) {
  __m512i q[2];
  quant_unit<TYPE>(block, k, q);
  for (int h = 0; h < 2; ++h) w[h] = _mm512_fmsub_ps(s.a[h], _mm512_cvtepi32_ps(q[h]), s.b[h]);
}

#if defined(__AVX512BF16__)
// bfloat16, k even (within the block): the panel's row of the pair (k, k + 1), lanes 0-15
// and 16-31.
template <int TYPE>
inline void quant_pair(const QuantBlock& block, const GroupScales& s, int64_t k,
                       __m512i (&row)[2]) {
  __m512i q[4];
  quant_unit<TYPE>(block, k, q);
  quant_unit<TYPE>(block, k + 1, q + 2);
  __m512 w[4];
  for (int v = 0; v < 4; ++v) w[v] = _mm512_fmsub_ps(s.a[v], _mm512_cvtepi32_ps(q[v]), s.b[v]);
  row[0] = (__m512i)_mm512_cvtne2ps_pbh(w[1], w[0]);
  row[1] = (__m512i)_mm512_cvtne2ps_pbh(w[3], w[2]);
}
#endif

// Bytes ahead of its q that a panel's walk asks for: a decode step's loop keeps too few loads
// in flight to stream the blocks from memory (Q6_K's product waited on its loads half its
// time on a Zen 4); asked ahead, they arrive under the arithmetic. Past the panel's end the
// address points at the next panel or at nothing (a prefetch never faults).
constexpr int64_t QUANT_AHEAD = 4096;

// body(k, k within its block, block, scales) for every k of a panel of k_len weights a row,
// in ascending order (float32: each k; bfloat16: each even k), block by block, group by
// group: loops whose scales stay in registers (a reader object whose state crossed the
// blocks ran at half the speed with blocks of 256).
template <int TYPE, int STEP, typename Body>
inline void walk_panel(const uint8_t* panel, int64_t k_len, Body&& body) {
  using F = Format<TYPE>;
  const QuantLayout layout = quant_layout(TYPE);
  constexpr int64_t unit_bytes = F::BYTES ? 32 : 16;
  for (int64_t b0 = 0; b0 < k_len; b0 += F::S, panel += layout.block_bytes()) {
    const QuantBlock block(layout, panel);
    for (int64_t g = 0; g < F::S / F::G; ++g) {
      const GroupScales scales = group_scales<TYPE, STEP == 2>(block, g);
      for (int64_t k = g * F::G; k < (g + 1) * F::G; k += STEP) {
        const auto ahead = reinterpret_cast<uintptr_t>(block.q) + k * unit_bytes + QUANT_AHEAD;
        _mm_prefetch(reinterpret_cast<const char*>(ahead), _MM_HINT_T0);
        if constexpr (F::PLANES > 0) {  // NOTE: the bit planes: a stream of their own
          const auto bits = reinterpret_cast<uintptr_t>(block.bits) + k * F::PLANES * 4;
          _mm_prefetch(reinterpret_cast<const char*>(bits + QUANT_AHEAD), _MM_HINT_T0);
        }
        body(b0 + k, k, block, scales);
      }
    }
  }
}
#endif

}  // namespace tokenmill
