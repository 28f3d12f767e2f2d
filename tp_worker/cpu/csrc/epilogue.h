// How both linear kernels write a row of float32 sums out (tp_worker: linear.cpp, the AVX-512
// and portable kernel, and linear_amx.cpp): + bias, + a residual, or act(gate) * up, with
// the same operations in 16 lanes and in the scalar tail, so every build gives the same bits.
#pragma once

#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "bf16.h"
#include "silu.h"

namespace tokenmill {

// dst[j] = acc[j] (+ bias[j]) for j < cols; with a residual, res[j] + that rounded to the
// output's dtype first: the bits of `res + y` in torch (one float32 add, rounded again).
template <typename Out>
inline void write_row(const float* acc, int64_t cols, const float* bias, Out* dst,
                      const Out* res) {
  int64_t j = 0;
#if defined(__AVX512F__)
  for (; j + 16 <= cols; j += 16) {
    __m512 v = _mm512_loadu_ps(acc + j);
    if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + j));
    if (res) v = _mm512_add_ps(round16(v, dst), load16(res + j));
    store16(dst + j, v);
  }
#endif
  for (; j < cols; ++j) {
    const float v = bias ? acc[j] + bias[j] : acc[j];
    store(dst + j, res ? round_to(v, dst) + load(res + j) : v);
  }
}

// A row of a gate/up panel's sums (16 gate features, then the same 16 up features) as 16
// columns of act(gate) * up from the float32 sums (silu.h's activation codes), rounded once
// by the store: the bits of activation.cpp over the unfused product's float32 output.
template <typename Out>
inline void write_glu_row(const float* acc, const float* bias, Out* dst, int activation) {
#if defined(__AVX512F__)
  __m512 g = _mm512_loadu_ps(acc), u = _mm512_loadu_ps(acc + 16);
  if (bias) {
    g = _mm512_add_ps(g, _mm512_loadu_ps(bias));
    u = _mm512_add_ps(u, _mm512_loadu_ps(bias + 16));
  }
  store16(dst, glu_times16(activation, g, u));
#else
  for (int j = 0; j < 16; ++j) {
    const float g = bias ? acc[j] + bias[j] : acc[j];
    const float u = bias ? acc[j + 16] + bias[j + 16] : acc[j + 16];
    store(dst + j, glu_times(activation, g, u));
  }
#endif
}

}  // namespace tokenmill
