// The float32 product with quantized panels (tp_worker: linear.cpp's tm_quant_linear_then;
// dequant.h's layout): the bits of the packed product of gguf's float32 weights. Up to
// EXACT_ROWS rows the panel is dequantized in registers as it is multiplied (a decode step
// reads the blocks once); more rows, into a thread's buffer for linear.cpp's microkernels.
// Each output sums its products in linear.cpp's kernel_f32 order (blocks of 64 k from zero,
// the block sums in ascending order).
// NOTE: why float32 keeps this arithmetic and bfloat16 does not (quant_kernels.h): float32 is
// the mode whose numbers are the file's model to the last bit, and gguf's model is the
// float32-rounded weight A q - B. The factored sums A (x . q) - B (sum of x) compute the
// unrounded weight instead: close (SmolLM2 largest 1.7e-5 from float64, transformers float32
// 1.3e-5) but a model of its own.
#pragma once

#include <algorithm>
#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "dequant.h"

namespace tokenmill {

constexpr int EXACT_ROWS = 4;  // rows up to which the product dequantizes in registers

using ExactKernel = void (*)(const float* x, int64_t lda, const uint8_t* panel, int64_t k_len,
                             float* acc);

struct ExactKernels {
  void (*dequant)(const uint8_t* panel, int64_t k_len, float* out);  // the panel [K][32]
  ExactKernel fused[EXACT_ROWS + 1];  // by rows; all null where the build has none
};

// dequant's portable form: one weight at a time.
template <int TYPE>
void dequant_portable(const uint8_t* src, int64_t k_len, float* out) {
  constexpr QuantLayout l = quant_layout(TYPE);
  for (int64_t b0 = 0; b0 < k_len; b0 += l.block_k, src += l.block_bytes()) {
    const QuantBlock b(l, src);
    for (int64_t k = 0; k < l.block_k; ++k)
      for (int lane = 0; lane < 32; ++lane)
        out[(b0 + k) * 32 + lane] = dequant_one(l, b, false, k, lane);
  }
}

#if defined(__AVX512F__)
constexpr int64_t EXACT_KB = 64;  // linear.cpp's KB

// body(k, k within its block, block, the group's A and B) for every k of a panel, ascending,
// block by block, group by group (the scales stay in registers).
template <int TYPE, typename Body>
inline void walk_panel(const uint8_t* panel, int64_t k_len, Body&& body) {
  using F = Format<TYPE>;
  const QuantLayout layout = quant_layout(TYPE);
  constexpr int64_t unit_bytes = F::BYTES ? 32 : 16;
  for (int64_t b0 = 0; b0 < k_len; b0 += F::S, panel += layout.block_bytes()) {
    const QuantBlock block(layout, panel);
    for (int64_t g = 0; g < F::S / F::G; ++g) {
      const GroupScales scales = group_scales<TYPE>(block, g);
      for (int64_t k = g * F::G; k < (g + 1) * F::G; ++k) {
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

// k's 32 weights of a block (k within it), lanes 0-15 and 16-31: A q - B, one rounding.
template <int TYPE>
inline void exact_lanes(const QuantBlock& block, const GroupScales& s, int64_t k,
                        __m512 (&w)[2]) {
  __m512i q[2];
  quant_unit<TYPE>(block, k, q);
  for (int h = 0; h < 2; ++h) w[h] = _mm512_fmsub_ps(s.a[h], _mm512_cvtepi32_ps(q[h]), s.b[h]);
}

template <int TYPE>
void dequant_f32(const uint8_t* panel, int64_t k_len, float* out) {
  walk_panel<TYPE>(panel, k_len, [&](int64_t k, int64_t in_block, const QuantBlock& block,
                                     const GroupScales& scales) {
    __m512 w[2];
    exact_lanes<TYPE>(block, scales, in_block, w);
    _mm512_storeu_ps(out + k * 32, w[0]);
    _mm512_storeu_ps(out + k * 32 + 16, w[1]);
  });
}

// acc [R][32] = x [R rows] . panel, linear.cpp's kernel_f32 order.
template <int TYPE, int R>
void fused_f32(const float* x, int64_t lda, const uint8_t* panel, int64_t k_len, float* acc) {
  // NOTE: a block of 64 k ends inside or at the end of a group (every G divides 64)
  __m512 total[R][2], c[R][2];
  walk_panel<TYPE>(panel, k_len, [&](int64_t k, int64_t in_block, const QuantBlock& block,
                                     const GroupScales& scales) {
    if (k % EXACT_KB == 0)
      for (int r = 0; r < R; ++r) c[r][0] = c[r][1] = _mm512_setzero_ps();
    __m512 w[2];
    exact_lanes<TYPE>(block, scales, in_block, w);
    for (int r = 0; r < R; ++r) {
      const __m512 v = _mm512_set1_ps(x[r * lda + k]);
      c[r][0] = _mm512_fmadd_ps(v, w[0], c[r][0]);
      c[r][1] = _mm512_fmadd_ps(v, w[1], c[r][1]);
    }
    if ((k + 1) % EXACT_KB == 0 || k + 1 == k_len)
      for (int r = 0; r < R; ++r)
        for (int h = 0; h < 2; ++h)
          total[r][h] = k < EXACT_KB ? c[r][h] : _mm512_add_ps(total[r][h], c[r][h]);
  });
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(acc + r * 32, total[r][0]);
    _mm512_storeu_ps(acc + r * 32 + 16, total[r][1]);
  }
}
#endif

// NOTE: static, so that its table is this library's own: as an inline function's static
// local it would be one symbol (STB_GNU_UNIQUE) for the whole process, and a second build
// loaded beside this one (the portable build in tests/test_quantized.py) would run this one's
// kernels through it.
template <int TYPE>
static const ExactKernels* exact_of() {
#if defined(__AVX512F__)
  static const ExactKernels k{
      dequant_f32<TYPE>,
      {nullptr, fused_f32<TYPE, 1>, fused_f32<TYPE, 2>, fused_f32<TYPE, 3>, fused_f32<TYPE, 4>}};
#else
  static const ExactKernels k{dequant_portable<TYPE>, {}};
#endif
  return &k;
}

// The float32 kernels for panels of `type`, or null for a type not served in blocks.
inline const ExactKernels* exact_kernels(int type) {
  return by_type(type, [](auto t) { return exact_of<decltype(t)::value>(); });
}

}  // namespace tokenmill
