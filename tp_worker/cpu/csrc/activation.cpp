// The MLP's activation on the CPU: out = silu(gate) * up in one pass (tp_worker, via ctypes).
//
// silu is silu.h's; silu(gate) * up is computed in float32 and rounded once to the output's
// dtype (torch's bfloat16 `F.silu(gate) * up` rounds silu(gate) first). Element-wise: a row's
// result depends on nothing but the row, and is the same in the AVX-512 and the portable form
// (and in the linear kernels' fused form over their float32 sums: csrc/linear.cpp).

#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "bf16.h"
#include "silu.h"

namespace {

using tokenmill::load;
using tokenmill::silu_times;
using tokenmill::store;
#if defined(__AVX512F__)
using tokenmill::load16;
using tokenmill::silu_times16;
using tokenmill::store16;
#endif

template <typename T, typename Out>
void silu_mul(const T* gate_up, Out* out, int64_t rows, int64_t inter) {
#pragma omp parallel for schedule(static) if (rows * inter >= (1 << 16))
  for (int64_t r = 0; r < rows; ++r) {
    const T* gate = gate_up + r * 2 * inter;
    const T* up = gate + inter;
    Out* o = out + r * inter;
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= inter; i += 16) {
      store16(o + i, silu_times16(load16(gate + i), load16(up + i)));
    }
#endif
    for (; i < inter; ++i) store(o + i, silu_times(load(gate + i), load(up + i)));
  }
}

}  // namespace

extern "C" {

// gate_up [rows, 2 * inter] (gate, then up, per row) in dtype; out [rows, inter] in out_dtype.
// Codes 0 = float32, 1 = bfloat16. Returns 0, or -1 for an unknown combination.
int tm_silu_mul(const void* gate_up, void* out, int64_t rows, int64_t inter, int dtype,
                int out_dtype) {
  if (dtype == 0 && out_dtype == 0) {
    silu_mul(static_cast<const float*>(gate_up), static_cast<float*>(out), rows, inter);
  } else if (dtype == 0 && out_dtype == 1) {
    silu_mul(static_cast<const float*>(gate_up), static_cast<uint16_t*>(out), rows, inter);
  } else if (dtype == 1 && out_dtype == 1) {
    silu_mul(static_cast<const uint16_t*>(gate_up), static_cast<uint16_t*>(out), rows, inter);
  } else {
    return -1;
  }
  return 0;
}

}  // extern "C"
