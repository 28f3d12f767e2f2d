// The bfloat16 product with quantized panels (tp_worker: linear.cpp's tm_quant_linear_then;
// dequant.h's layout), for every row count: up to QUANT_ROWS rows at a time, the panel's
// blocks read as they are and never written out dequantized (float32: quant_exact.h).
//
// The arithmetic: a group's weights are A q - B, so a row's product with them is
// A (x . q) - B (sum of x), and that is what each output sums, group by group in ascending
// order: c = x . (q + bias) from zero (one VDPBF16PS accumulator over ascending pairs; bias =
// dequant.h's quant_bias, which lets 4-8 bit values widen to bfloat16 by one OR), then
// total = fma(A, c, total), then total = fma(-(B + bias A), xs, total) with xs the group's
// sum of x (group_sums, in ascending k). Every step is fixed by K alone, so a row's bits are
// the same alone or with any others, in any tile and any thread; the portable form below
// takes the same steps one lane at a time.
// NOTE: why not the dequantized weights' product (what float32 keeps): at one row the
// dequantization was the bound, 2-3x the work of the product (one-row Q4_K at 31 G weights/s
// on a 2-core Zen 4, 18 GB/s of blocks, the memory giving 33). And it rounded each weight to
// bfloat16 first; here q + bias is exact in bfloat16 and A, B stay float32, so the weights
// are gguf's to float32 precision (the sums in another order).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "bf16.h"
#include "dequant.h"

namespace tokenmill {

constexpr int QUANT_ROWS = 8;      // rows a microkernel takes
constexpr int64_t QUANT_NR = 32;   // outputs a panel holds (linear.cpp's NR)

// acc [R][32] = x [R rows] . panel, xs [R][k_len / G] the rows' group sums.
using QuantKernel = void (*)(const uint16_t* x, int64_t lda, const float* xs, int64_t ldxs,
                             const uint8_t* panel, int64_t k_len, float* acc);

struct QuantKernels {
  int64_t group_k;                   // G: xs's group
  QuantKernel rows[QUANT_ROWS + 1];  // by rows
};

// xs [m][k_len / g]: each row's sums of g x in ascending k, from zero.
inline void group_sums(const uint16_t* x, int64_t m, int64_t k_len, int64_t lda, int64_t g,
                       float* xs) {
  const int64_t groups = k_len / g;
  for (int64_t r = 0; r < m; ++r)
    for (int64_t j = 0; j < groups; ++j) {
      const uint16_t* v = x + r * lda + j * g;
      float s = 0.0f;
      for (int64_t i = 0; i < g; ++i) s += bf16_to_float(v[i]);
      xs[r * groups + j] = s;
    }
}

template <int TYPE, int R>
void quant_portable(const uint16_t* x, int64_t lda, const float* xs, int64_t ldxs,
                    const uint8_t* panel, int64_t k_len, float* acc) {
  constexpr QuantLayout l = quant_layout(TYPE);
  const float bias = static_cast<float>(quant_bias(TYPE));
  for (int lane = 0; lane < 32; ++lane)
    for (int r = 0; r < R; ++r) {
      const uint16_t* row = x + r * lda;
      const uint8_t* src = panel;
      float total = 0.0f;
      for (int64_t b0 = 0; b0 < k_len; b0 += l.block_k, src += l.block_bytes()) {
        const QuantBlock b(l, src);
        for (int64_t g = 0; g < l.groups(); ++g) {
          float a, m, c = 0.0f;
          quant_scales(l, b, g, lane, a, m);
          for (int64_t k = g * l.group_k; k < (g + 1) * l.group_k; k += 2) {
            const auto s = [&](int64_t kk) {
              return float_to_bf16(static_cast<float>(quant_q(l, b, true, kk, lane)) + bias);
            };
            const uint32_t sw = static_cast<uint32_t>(s(k)) | (static_cast<uint32_t>(s(k + 1)) << 16);
            c = dot_pair(c, pair_word(row, (b0 + k) / 2, k_len), sw);
          }
          total = std::fma(a, c, total);
          total = std::fma(-std::fma(bias, a, m), xs[r * ldxs + (b0 / l.group_k) + g], total);
        }
      }
      acc[r * QUANT_NR + lane] = total;
    }
}

#if defined(__AVX512BF16__)
// A group's step after its sums: total [R][2] += A c - B' xs, lanes as c holds them.
template <int R>
inline void group_end(const __m512 (&c)[R][2], const __m512 (&a)[2], const __m512 (&b)[2],
                      const float* xs, int64_t ldxs, int64_t group, __m512 (&total)[R][2]) {
  for (int r = 0; r < R; ++r) {
    const __m512 sum = _mm512_set1_ps(xs[r * ldxs + group]);
    for (int h = 0; h < 2; ++h)
      total[r][h] = _mm512_fnmadd_ps(b[h], sum, _mm512_fmadd_ps(a[h], c[r][h], total[r][h]));
  }
}

// Group g's A and B + bias A (dequant.h's quant_bias), in the lanes quant_words leaves.
template <int TYPE>
inline void group_ab(const QuantBlock& block, int64_t g, __m512 (&a)[2], __m512 (&b)[2]) {
  const GroupScales s = group_scales<TYPE>(block, g);
  const __m512 bias = _mm512_set1_ps(static_cast<float>(quant_bias(TYPE)));
  for (int h = 0; h < 2; ++h) a[h] = s.a[h], b[h] = _mm512_fmadd_ps(bias, s.a[h], s.b[h]);
  if constexpr (quant_swapped(TYPE)) {
    const __m512 a0 = a[0], b0 = b[0];
    a[0] = _mm512_shuffle_f32x4(a0, a[1], 0x44);
    a[1] = _mm512_shuffle_f32x4(a0, a[1], 0xee);
    b[0] = _mm512_shuffle_f32x4(b0, b[1], 0x44);
    b[1] = _mm512_shuffle_f32x4(b0, b[1], 0xee);
  }
}

// c [R][2] += the pair of x at k (each row's) . the pair's words w.
template <int R>
inline void dot_words(__m512 (&c)[R][2], const uint16_t* x, int64_t lda, int64_t k,
                      const __m512i (&w)[2]) {
  for (int r = 0; r < R; ++r) {
    uint32_t word;
    std::memcpy(&word, x + r * lda + k, 4);
    const __m512bh v = (__m512bh)_mm512_set1_epi32(static_cast<int>(word));
    c[r][0] = _mm512_dpbf16_ps(c[r][0], v, (__m512bh)w[0]);
    c[r][1] = _mm512_dpbf16_ps(c[r][1], v, (__m512bh)w[1]);
  }
}

// acc's lanes back in order where quant_words swapped them.
template <bool SWAPPED, int R>
inline void lanes_in_order(float* acc) {
  if constexpr (SWAPPED)
    for (int r = 0; r < R; ++r) {
      float* out = acc + r * QUANT_NR;
      const __m512 lo = _mm512_loadu_ps(out), hi = _mm512_loadu_ps(out + 16);
      _mm512_storeu_ps(out, _mm512_shuffle_f32x4(lo, hi, 0x44));
      _mm512_storeu_ps(out + 16, _mm512_shuffle_f32x4(lo, hi, 0xee));
    }
}

template <int TYPE, int R>
void quant_bf16(const uint16_t* x, int64_t lda, const float* xs, int64_t ldxs,
                const uint8_t* panel, int64_t k_len, float* acc) {
  using F = Format<TYPE>;
  const QuantLayout layout = quant_layout(TYPE);
  constexpr int64_t block_bytes = quant_layout(TYPE).block_bytes();
  __m512 total[R][2];
  for (int r = 0; r < R; ++r) total[r][0] = total[r][1] = _mm512_setzero_ps();
  for (int64_t b0 = 0; b0 < k_len; b0 += F::S, panel += block_bytes) {
    const QuantBlock block(layout, panel);
    const auto start = reinterpret_cast<uintptr_t>(panel);
    for (int64_t g = 0; g < F::S / F::G; ++g) {
      __m512 a[2], b[2];
      group_ab<TYPE>(block, g, a, b);
      __m512 c[R][2];
      for (int r = 0; r < R; ++r) c[r][0] = c[r][1] = _mm512_setzero_ps();
      for (int64_t k = g * F::G; k < (g + 1) * F::G; k += 2) {
        // NOTE: one cursor over the whole block (scales, q and bits) at the rate a pair
        // consumes it, so that no line of the next blocks goes unasked
        const auto ahead = start + k * block_bytes / F::S + QUANT_AHEAD;
        _mm_prefetch(reinterpret_cast<const char*>(ahead), _MM_HINT_T0);
        if constexpr (2 * block_bytes > 64 * F::S)
          _mm_prefetch(reinterpret_cast<const char*>(ahead + 64), _MM_HINT_T0);
        __m512i w[2];
        quant_words<TYPE>(block, k, w);
        dot_words<R>(c, x + b0, lda, k, w);
      }
      group_end<R>(c, a, b, xs, ldxs, b0 / F::G + g, total);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(acc + r * QUANT_NR, total[r][0]);
    _mm512_storeu_ps(acc + r * QUANT_NR + 16, total[r][1]);
  }
  lanes_in_order<quant_swapped(TYPE), R>(acc);
}

#endif

#define TM_ROWS(f)                                                                      \
  {nullptr, f<TYPE, 1>, f<TYPE, 2>, f<TYPE, 3>, f<TYPE, 4>, f<TYPE, 5>, f<TYPE, 6>, \
   f<TYPE, 7>, f<TYPE, 8>}
template <int TYPE>
static const QuantKernels* table_of() {  // NOTE: static: quant_exact.h's exact_of says why
#if defined(__AVX512BF16__)
  static const QuantKernels k{quant_layout(TYPE).group_k, TM_ROWS(quant_bf16)};
#else
  static const QuantKernels k{quant_layout(TYPE).group_k, TM_ROWS(quant_portable)};
#endif
  return &k;
}
#undef TM_ROWS

// The bfloat16 kernels for panels of `type`, or null for a type not served in blocks.
inline const QuantKernels* quant_kernels(int type) {
  return by_type(type, [](auto t) { return table_of<decltype(t)::value>(); });
}

}  // namespace tokenmill
