// The microkernels of a product with quantized panels (tp_worker: linear.cpp's
// tm_quant_linear_then; dequant.h's layout): for each type, the panel dequantized into a
// thread's buffer (the packed panel of the dequantized weight, for linear.cpp's microkernels),
// and, for a few rows, the product with the panel dequantized in registers as it goes. Each
// output sums its products in linear.cpp's order (float32: blocks of 64 k from zero, the block
// sums in ascending order; bfloat16: one VDPBF16PS accumulator over ascending pairs), so both
// give the packed product's bits.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "dequant.h"

namespace tokenmill {

constexpr int FUSED_ROWS = 4;  // rows up to which the product dequantizes in registers

template <typename T>
using FusedKernel = void (*)(const T* x, int64_t lda, const uint8_t* panel, int64_t k_len,
                             float* acc);

template <typename T>
struct QuantKernels {
  void (*dequant)(const uint8_t* panel, int64_t k_len, T* out);
  FusedKernel<T> fused[FUSED_ROWS + 1];  // by rows; all null where the build has none
};

template <int TYPE, typename T>
void dequant_portable(const uint8_t* panel, int64_t k_len, T* out) {
  dequant_panel_portable(quant_layout(TYPE), panel, k_len, out);
}

#if defined(__AVX512F__)
constexpr int64_t QUANT_NR = 32, QUANT_KB = 64;  // linear.cpp's NR and KB

template <int TYPE>
void dequant_f32(const uint8_t* panel, int64_t k_len, float* out) {
  walk_panel<TYPE, 1>(panel, k_len, [&](int64_t k, int64_t in_block, const QuantBlock& block,
                                        const GroupScales& scales) {
    __m512 w[2];
    quant_lanes<TYPE>(block, scales, in_block, w);
    _mm512_storeu_ps(out + k * QUANT_NR, w[0]);
    _mm512_storeu_ps(out + k * QUANT_NR + 16, w[1]);
  });
}

// acc [R][32] = x [R rows] . panel in float32, linear.cpp's kernel_f32 order.
template <int TYPE, int R>
void fused_f32(const float* x, int64_t lda, const uint8_t* panel, int64_t k_len, float* acc) {
  // NOTE: a block of 64 k ends inside or at the end of a group (every G divides 64)
  __m512 total[R][2], c[R][2];
  walk_panel<TYPE, 1>(panel, k_len, [&](int64_t k, int64_t in_block, const QuantBlock& block,
                                        const GroupScales& scales) {
    if (k % QUANT_KB == 0)
      for (int r = 0; r < R; ++r) c[r][0] = c[r][1] = _mm512_setzero_ps();
    __m512 w[2];
    quant_lanes<TYPE>(block, scales, in_block, w);
    for (int r = 0; r < R; ++r) {
      const __m512 v = _mm512_set1_ps(x[r * lda + k]);
      c[r][0] = _mm512_fmadd_ps(v, w[0], c[r][0]);
      c[r][1] = _mm512_fmadd_ps(v, w[1], c[r][1]);
    }
    if ((k + 1) % QUANT_KB == 0 || k + 1 == k_len)
      for (int r = 0; r < R; ++r)
        for (int h = 0; h < 2; ++h)
          total[r][h] = k < QUANT_KB ? c[r][h] : _mm512_add_ps(total[r][h], c[r][h]);
  });
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(acc + r * QUANT_NR, total[r][0]);
    _mm512_storeu_ps(acc + r * QUANT_NR + 16, total[r][1]);
  }
}
#endif

#if defined(__AVX512BF16__)
template <int TYPE>
void dequant_bf16(const uint8_t* panel, int64_t k_len, uint16_t* out) {
  walk_panel<TYPE, 2>(panel, k_len, [&](int64_t k, int64_t in_block, const QuantBlock& block,
                                        const GroupScales& scales) {
    __m512i row[2];
    quant_pair<TYPE>(block, scales, in_block, row);
    _mm512_storeu_si512(out + k * QUANT_NR, row[0]);
    _mm512_storeu_si512(out + k * QUANT_NR + 32, row[1]);
  });
}

// acc [R][32] = x [R rows] . panel in bfloat16, linear.cpp's kernel_bf16 order (k even).
template <int TYPE, int R>
void fused_bf16(const uint16_t* x, int64_t lda, const uint8_t* panel, int64_t k_len,
                float* acc) {
  __m512 c[R][2];
  for (int r = 0; r < R; ++r) c[r][0] = c[r][1] = _mm512_setzero_ps();
  walk_panel<TYPE, 2>(panel, k_len, [&](int64_t k, int64_t in_block, const QuantBlock& block,
                                        const GroupScales& scales) {
    __m512i row[2];
    quant_pair<TYPE>(block, scales, in_block, row);
    for (int r = 0; r < R; ++r) {
      uint32_t word;
      std::memcpy(&word, x + r * lda + k, 4);
      const __m512bh v = (__m512bh)_mm512_set1_epi32(static_cast<int>(word));
      c[r][0] = _mm512_dpbf16_ps(c[r][0], v, (__m512bh)row[0]);
      c[r][1] = _mm512_dpbf16_ps(c[r][1], v, (__m512bh)row[1]);
    }
  });
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(acc + r * QUANT_NR, c[r][0]);
    _mm512_storeu_ps(acc + r * QUANT_NR + 16, c[r][1]);
  }
}
#endif

template <int TYPE>
const QuantKernels<float>* kernels_f32() {
#if defined(__AVX512F__)
  static const QuantKernels<float> k{
      dequant_f32<TYPE>,
      {nullptr, fused_f32<TYPE, 1>, fused_f32<TYPE, 2>, fused_f32<TYPE, 3>, fused_f32<TYPE, 4>}};
#else
  static const QuantKernels<float> k{dequant_portable<TYPE, float>, {}};
#endif
  return &k;
}

template <int TYPE>
const QuantKernels<uint16_t>* kernels_bf16() {
#if defined(__AVX512BF16__)
  static const QuantKernels<uint16_t> k{
      dequant_bf16<TYPE>,
      {nullptr, fused_bf16<TYPE, 1>, fused_bf16<TYPE, 2>, fused_bf16<TYPE, 3>,
       fused_bf16<TYPE, 4>}};
#else
  static const QuantKernels<uint16_t> k{dequant_portable<TYPE, uint16_t>, {}};
#endif
  return &k;
}

template <typename T, int TYPE>
const QuantKernels<T>* kernels_of() {
  if constexpr (sizeof(T) == 4)
    return kernels_f32<TYPE>();
  else
    return kernels_bf16<TYPE>();
}

// The kernels for panels of `type` in T's layout (float32: lanes, bfloat16: pairs), or null
// for a type not served in blocks.
template <typename T>
const QuantKernels<T>* quant_kernels(int type) {
  switch (type) {
    case Q8_0: return kernels_of<T, Q8_0>();
    case Q4_0: return kernels_of<T, Q4_0>();
    case Q4_1: return kernels_of<T, Q4_1>();
    case Q5_0: return kernels_of<T, Q5_0>();
    case Q5_1: return kernels_of<T, Q5_1>();
    case Q4_K: return kernels_of<T, Q4_K>();
    case Q5_K: return kernels_of<T, Q5_K>();
    case Q6_K: return kernels_of<T, Q6_K>();
    default: return nullptr;
  }
}

}  // namespace tokenmill
