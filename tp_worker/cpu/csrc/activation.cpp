// Element-wise kernels on the CPU (tp_worker, via ctypes): the MLP's out = act(gate) * up in
// one pass, and the logits' soft-cap.
//
// act is silu.h's (silu, or Gemma's gelu_tanh); act(gate) * up is computed in float32 and
// rounded once to the output's dtype (torch's bfloat16 `F.silu(gate) * up` rounds silu(gate)
// first). The soft-cap is cap * tanh(x / cap) with exp.h's tanh. Element-wise: an element's
// result depends on nothing but the element, and is the same in the AVX-512 and the portable
// form (and in the linear kernels' fused form over their float32 sums: csrc/linear.cpp).

#include <algorithm>
#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "bf16.h"
#include "kernels.h"
#include "silu.h"

namespace {

using tokenmill::load;
using tokenmill::glu_times;
using tokenmill::store;
#if defined(__AVX512F__)
using tokenmill::load16;
using tokenmill::glu_times16;
using tokenmill::store16;
#endif

template <typename T, typename Out>
void glu_mul(const T* gate_up, Out* out, int64_t rows, int64_t inter, int act) {
#pragma omp parallel for schedule(static) if (rows * inter >= (1 << 16))
  for (int64_t r = 0; r < rows; ++r) {
    const T* gate = gate_up + r * 2 * inter;
    const T* up = gate + inter;
    Out* o = out + r * inter;
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= inter; i += 16) {
      store16(o + i, glu_times16(act, load16(gate + i), load16(up + i)));
    }
#endif
    for (; i < inter; ++i) store(o + i, glu_times(act, load(gate + i), load(up + i)));
  }
}

// glu_mul over a gate/up product's float32 panels (cpu/ops.py's gate_up_panels: each 32
// hold 16 gate then the same 16 up features; inter a multiple of 16), out rows ldo apart.
template <typename Out>
void glu_mul_panels(const float* panels, Out* out, int64_t rows, int64_t inter, int64_t ldo,
                    int act) {
#pragma omp parallel for schedule(static) if (rows * inter >= (1 << 16))
  for (int64_t r = 0; r < rows; ++r) {
    const float* p = panels + r * 2 * inter;
    Out* o = out + r * ldo;
    for (int64_t i = 0; i < inter; i += 16) {
#if defined(__AVX512F__)
      store16(o + i, glu_times16(act, load16(p + 2 * i), load16(p + 2 * i + 16)));
#else
      for (int64_t l = 0; l < 16; ++l)
        store(o + i + l, glu_times(act, p[2 * i + l], p[2 * i + 16 + l]));
#endif
    }
  }
}

void soft_cap(float* x, int64_t n, float cap) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 c = _mm512_set1_ps(cap);
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_div_ps(_mm512_loadu_ps(x + i), c);
    _mm512_storeu_ps(x + i, _mm512_mul_ps(tokenmill::tanh_own16(v), c));
  }
#endif
  for (; i < n; ++i) x[i] = tokenmill::tanh_own(x[i] / cap) * cap;
}

}  // namespace

extern "C" {

// gate_up [rows, 2 * inter] (gate, then up, per row) in dtype; out [rows, inter] in out_dtype,
// act(gate) * up with act silu.h's code (1 silu, 2 gelu_tanh). Codes 0 = float32,
// 1 = bfloat16. Returns 0, or -1 for an unknown combination.
int tm_glu_mul(const void* gate_up, void* out, int64_t rows, int64_t inter, int dtype,
               int out_dtype, int act) {
  if (dtype == 0 && out_dtype == 0) {
    glu_mul(static_cast<const float*>(gate_up), static_cast<float*>(out), rows, inter, act);
  } else if (dtype == 0 && out_dtype == 1) {
    glu_mul(static_cast<const float*>(gate_up), static_cast<uint16_t*>(out), rows, inter, act);
  } else if (dtype == 1 && out_dtype == 1) {
    glu_mul(static_cast<const uint16_t*>(gate_up), static_cast<uint16_t*>(out), rows, inter, act);
  } else {
    return -1;
  }
  return 0;
}

// panels [rows, 2 * inter] float32 in the gate/up panel order; out [rows, ldo] in out_dtype
// (0 float32, 1 bfloat16), act(gate) * up as tm_glu_mul computes it. Returns 0, or -1 for an
// unknown dtype or an inter that is not a multiple of 16.
int tm_glu_mul_panels(const float* panels, void* out, int64_t rows, int64_t inter, int64_t ldo,
                      int out_dtype, int act) {
  if (inter % 16 != 0) return -1;
  if (out_dtype == 0) {
    glu_mul_panels(panels, static_cast<float*>(out), rows, inter, ldo, act);
  } else if (out_dtype == 1) {
    glu_mul_panels(panels, static_cast<uint16_t*>(out), rows, inter, ldo, act);
  } else {
    return -1;
  }
  return 0;
}

// x [n] float32 = sigmoid(x) = (x >= 0 ? 1 : e) / (1 + e), e = exp(-|x|) (silu.h's form), in
// place (a shared expert's gate: Qwen2-MoE).
void tm_sigmoid(float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float e = tokenmill::exp_nonpositive(x[i] >= 0.0f ? -x[i] : x[i]);
    x[i] = (x[i] >= 0.0f ? 1.0f : e) / (1.0f + e);
  }
}

// x [n] float32 = cap * tanh(x / cap), in place (Gemma 2's final-logit soft-cap).
void tm_soft_cap(float* x, int64_t n, float cap) {
#pragma omp parallel for schedule(static) if (n >= (1 << 18))
  for (int64_t i0 = 0; i0 < n; i0 += 1 << 14) soft_cap(x + i0, std::min<int64_t>(n - i0, 1 << 14), cap);
}

}  // extern "C"
