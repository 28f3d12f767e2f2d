// The MLP's activation on the CPU: out = silu(gate) * up in one pass (tp_worker, via ctypes).
//
// silu(x) = x / (1 + e) with e = exp(-|x|) from exp.h (x >= 0), or x * e / (1 + e) (x < 0),
// so exp never overflows; in bfloat16, silu(gate) is rounded before the product and the
// product rounded again, as torch's `F.silu(gate) * up` does. Element-wise: a row's result
// depends on nothing but the row, and is the same in the AVX-512 and the portable form.

#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "bf16.h"
#include "exp.h"

namespace {

using tokenmill::exp_nonpositive;
using tokenmill::load;
using tokenmill::round_to;
using tokenmill::store;
#if defined(__AVX512F__)
using tokenmill::load16;
using tokenmill::round16;
using tokenmill::store16;
#endif

inline float silu(float x) {
  const float e = exp_nonpositive(x >= 0.0f ? -x : x);
  return (x >= 0.0f ? x : x * e) / (1.0f + e);
}

#if defined(__AVX512F__)
inline __m512 silu16(__m512 x) {
  const __m512 zero = _mm512_setzero_ps();
  const __mmask16 negative = _mm512_cmp_ps_mask(x, zero, _CMP_LT_OQ);
  const __m512 minus_abs = _mm512_mask_mov_ps(_mm512_sub_ps(zero, x), negative, x);
  const __m512 e = tokenmill::exp_nonpositive16(minus_abs);
  const __m512 num = _mm512_mask_mul_ps(x, negative, x, e);
  return _mm512_div_ps(num, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}
#endif

template <typename T>
void silu_mul(const T* gate_up, T* out, int64_t rows, int64_t inter) {
#pragma omp parallel for schedule(static) if (rows * inter >= (1 << 16))
  for (int64_t r = 0; r < rows; ++r) {
    const T* gate = gate_up + r * 2 * inter;
    const T* up = gate + inter;
    T* o = out + r * inter;
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= inter; i += 16) {
      const __m512 act = round16(silu16(load16(gate + i)), gate);
      store16(o + i, _mm512_mul_ps(act, load16(up + i)));
    }
#endif
    for (; i < inter; ++i) store(o + i, round_to(silu(load(gate + i)), gate) * load(up + i));
  }
}

}  // namespace

extern "C" {

// gate_up [rows, 2 * inter] (gate, then up, per row); out [rows, inter].
// dtype 0 = float32, 1 = bfloat16. Returns 0, or -1 for an unknown dtype.
int tm_silu_mul(const void* gate_up, void* out, int64_t rows, int64_t inter, int dtype) {
  if (dtype == 0) {
    silu_mul(static_cast<const float*>(gate_up), static_cast<float*>(out), rows, inter);
  } else if (dtype == 1) {
    silu_mul(static_cast<const uint16_t*>(gate_up), static_cast<uint16_t*>(out), rows, inter);
  } else {
    return -1;
  }
  return 0;
}

}  // extern "C"
