// RMSNorm on the CPU with a reduction order fixed by this file (tp_worker, via ctypes).
//
// The rule, per row: the sum of squares is LANES partial sums (lane d % LANES, fma over d
// ascending) combined by a fixed tree; r = 1 / sqrt(sum / hidden + eps) (both correctly
// rounded); out = weight * (x * r) in float32, rounded once to the output's dtype. A row's
// result depends on nothing but the row: not on the batch, the thread or the CPU.
// x is the residual stream (float32 whatever the model's dtype: model/decoder.py), out the
// model's dtype, weight float32 in every model (a bfloat16 checkpoint's weight is exact in
// float32, and Gemma's 1 + w is a float32 sum in transformers: model/weights.py folds it). In
// float32 this is transformers' formula, Gemma's too; in bfloat16 transformers rounds x * r to
// bfloat16 before the weight multiplies it (Gemma excepted), a second rounding this skips.

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "bf16.h"
#include "kernels.h"

namespace {

constexpr int LANES = 16;

using tokenmill::load;
using tokenmill::store;
#if defined(__AVX512F__)
using tokenmill::load16;
using tokenmill::store16;
#endif


template <typename T>
float sum_of_squares(const T* x, int64_t hidden) {
  alignas(64) float lane[LANES] = {};
  int64_t d = 0;
#if defined(__AVX512F__)
  if (hidden >= LANES) {
    __m512 acc = _mm512_setzero_ps();
    for (; d + LANES <= hidden; d += LANES) {
      const __m512 v = load16(x + d);
      acc = _mm512_fmadd_ps(v, v, acc);
    }
    _mm512_store_ps(lane, acc);
  }
#endif
  for (; d < hidden; ++d) {
    const float v = load(x + d);
    lane[d % LANES] = std::fma(v, v, lane[d % LANES]);
  }
  return tokenmill::tree_sum16(lane);
}

// r = 1 / sqrt(sum / width + eps), both correctly rounded.
inline float inverse_rms(float sum, int64_t width, float eps) {
  return 1.0f / std::sqrt(sum / static_cast<float>(width) + eps);
}

// One row of `hidden` elements: out = weight * (x * inv), in float32, rounded once. `out` may
// be `x` (every element is read before it is written).
template <typename In, typename T>
inline void scale_row(const In* row, const float* weight, T* o, int64_t hidden, float inv) {
  int64_t d = 0;
#if defined(__AVX512F__)
  // NOTE: the loop below in 16 lanes, the same operations per element.
  const __m512 inv16 = _mm512_set1_ps(inv);
  for (; d + LANES <= hidden; d += LANES) {
    const __m512 n = _mm512_mul_ps(load16(row + d), inv16);
    store16(o + d, _mm512_mul_ps(_mm512_loadu_ps(weight + d), n));
  }
#endif
  for (; d < hidden; ++d)
    store(o + d, weight[d] * (load(row + d) * inv));
}

// One row of `hidden` elements: out = weight * (x * r), in float32, rounded once. `out` may
// be `x` (every element is read before it is written, after the sum of squares is taken).
template <typename In, typename T>
inline void norm_row(const In* row, const float* weight, T* o, int64_t hidden, float eps) {
  scale_row(row, weight, o, hidden, inverse_rms(sum_of_squares(row, hidden), hidden, eps));
}

template <typename In, typename T>
void rms_norm(const In* x, const float* weight, T* out, int64_t rows, int64_t hidden,
              int64_t out_stride, float eps) {
  // NOTE: threads from ~16K elements: a decode step's 32 rows of 768 took 17 us on one
  // thread and 11 on two with the vector loop below (a 2-core Xeon, kernel_ab.py --only
  // small), where the old bound of 256K elements left them on one.
#pragma omp parallel for schedule(static) if (rows * hidden >= (1 << 14))
  for (int64_t r = 0; r < rows; ++r) norm_row(x + r * hidden, weight, out + r * out_stride, hidden, eps);
}

// Each token's first q_count slices of q_dim elements normed by q_weight [q_dim] and the next
// k_count slices of k_dim by k_weight [k_dim], in place: rows [tokens, width] hold them side by
// side from the first element (Qwen3: each q and k head; OLMo 2: all of q, then all of k).
template <typename T>
void head_norm(T* rows, int64_t tokens, int64_t width, int64_t q_count, int64_t q_dim,
               int64_t k_count, int64_t k_dim, const float* q_weight, const float* k_weight,
               float eps) {
#pragma omp parallel for schedule(static) if (tokens * (q_count * q_dim + k_count * k_dim) >= (1 << 14))
  for (int64_t t = 0; t < tokens; ++t) {
    T* row = rows + t * width;
    for (int64_t h = 0; h < q_count; ++h) norm_row(row + h * q_dim, q_weight, row + h * q_dim, q_dim, eps);
    T* ks = row + q_count * q_dim;
    for (int64_t h = 0; h < k_count; ++h) norm_row(ks + h * k_dim, k_weight, ks + h * k_dim, k_dim, eps);
  }
}

// x[r] += RMSNorm(y[r]) rounded to y's dtype (a norm after a layer's attention or MLP, before
// the residual add: OLMo 2, Gemma 2). x float32 [rows, hidden]; y [rows, hidden] y_stride apart.
template <typename T>
void norm_add(const T* y, const float* weight, float* x, int64_t rows, int64_t hidden,
              int64_t y_stride, float eps) {
#pragma omp parallel for schedule(static) if (rows * hidden >= (1 << 14))
  for (int64_t r = 0; r < rows; ++r) {
    const T* row = y + r * y_stride;
    float* out = x + r * hidden;
    const float inv = inverse_rms(sum_of_squares(row, hidden), hidden, eps);
    for (int64_t d = 0; d < hidden; ++d) {
      T normed;
      store(&normed, weight[d] * (load(row + d) * inv));
      out[d] += load(&normed);
    }
  }
}

// x float32 [rows, hidden] into out [rows, hidden] (out_stride apart) in out's dtype, rounded
// as torch rounds: a layer's input where it has no norm before it (OLMo 2).
template <typename T>
void cast_rows(const float* x, T* out, int64_t rows, int64_t hidden, int64_t out_stride) {
#pragma omp parallel for schedule(static) if (rows * hidden >= (1 << 14))
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t d = 0; d < hidden; ++d) store(out + r * out_stride + d, x[r * hidden + d]);
}

// A norm whose row is split across tensor-parallel ranks (OLMo 2's q/k norms over the whole
// projection): each rank's sums of squares of its slices (sum_of_squares' order), then,
// once the ranks' sums are added, each slice scaled by the whole row's r.
template <typename T>
void slice_sums(const T* rows, int64_t tokens, int64_t stride, int64_t width, float* sums) {
  for (int64_t t = 0; t < tokens; ++t) sums[t] = sum_of_squares(rows + t * stride, width);
}

template <typename T>
void scale_slices(T* rows, int64_t tokens, int64_t stride, int64_t width, const float* sums,
                  int64_t whole, const float* weight, float eps) {
  for (int64_t t = 0; t < tokens; ++t)
    scale_row(rows + t * stride, weight, rows + t * stride, width,
              inverse_rms(sums[t], whole, eps));
}

}  // namespace

extern "C" {

// sums[t] = the sum of squares of rows[t * stride .. + width) in dtype (0 float32, 1 bfloat16),
// in RMSNorm's order. Returns 0, or -1 for an unknown dtype.
int tm_slice_sums(const void* rows, int64_t tokens, int64_t stride, int64_t width, float* sums,
                  int dtype) {
  if (dtype == 0) {
    slice_sums(static_cast<const float*>(rows), tokens, stride, width, sums);
  } else if (dtype == 1) {
    slice_sums(static_cast<const uint16_t*>(rows), tokens, stride, width, sums);
  } else {
    return -1;
  }
  return 0;
}

// In place: each slice rows[t * stride .. + width) = weight * (x * r), r = 1 / sqrt(sums[t] /
// whole + eps), rounded once to dtype; weight [width] float32. Returns 0, or -1.
int tm_scale_slices(void* rows, int64_t tokens, int64_t stride, int64_t width, const float* sums,
                    int64_t whole, const void* weight, float eps, int dtype) {
  const float* w = static_cast<const float*>(weight);
  if (dtype == 0) {
    scale_slices(static_cast<float*>(rows), tokens, stride, width, sums, whole, w, eps);
  } else if (dtype == 1) {
    scale_slices(static_cast<uint16_t*>(rows), tokens, stride, width, sums, whole, w, eps);
  } else {
    return -1;
  }
  return 0;
}

// x [rows, hidden] in x_dtype; out [rows, hidden] in dtype with rows out_stride elements apart;
// weight [hidden] float32; dtype codes 0 = float32, 1 = bfloat16. Returns 0, or -1 for an
// unknown dtype.
int tm_rms_norm(const void* x, const void* weight, void* out, int64_t rows, int64_t hidden,
                int64_t out_stride, float eps, int dtype, int x_dtype) {
  if (dtype == 0 && x_dtype == 0) {
    rms_norm(static_cast<const float*>(x), static_cast<const float*>(weight),
             static_cast<float*>(out), rows, hidden, out_stride, eps);
  } else if (dtype == 1 && x_dtype == 0) {
    rms_norm(static_cast<const float*>(x), static_cast<const float*>(weight),
             static_cast<uint16_t*>(out), rows, hidden, out_stride, eps);
  } else if (dtype == 1 && x_dtype == 1) {
    rms_norm(static_cast<const uint16_t*>(x), static_cast<const float*>(weight),
             static_cast<uint16_t*>(out), rows, hidden, out_stride, eps);
  } else {
    return -1;
  }
  return 0;
}

// rows [tokens, width] in dtype (0 = float32, 1 = bfloat16): from each row's first element,
// q_count slices of q_dim normed with q_weight [q_dim], then k_count slices of k_dim with
// k_weight [k_dim] (both float32), in place, by RMSNorm's rule above. Returns 0, or -1 for an unknown dtype.
int tm_head_norm(void* rows, int64_t tokens, int64_t width, int64_t q_count, int64_t q_dim,
                 int64_t k_count, int64_t k_dim, const void* q_weight, const void* k_weight,
                 float eps, int dtype) {
  if (dtype == 0) {
    head_norm(static_cast<float*>(rows), tokens, width, q_count, q_dim, k_count, k_dim,
              static_cast<const float*>(q_weight), static_cast<const float*>(k_weight), eps);
  } else if (dtype == 1) {
    head_norm(static_cast<uint16_t*>(rows), tokens, width, q_count, q_dim, k_count, k_dim,
              static_cast<const float*>(q_weight), static_cast<const float*>(k_weight), eps);
  } else {
    return -1;
  }
  return 0;
}

// x float32 [rows, hidden] += RMSNorm(y) by weight [hidden] float32, y [rows, hidden] in dtype with
// rows y_stride apart; the norm's output rounded to dtype before the float32 add. Returns 0, or
// -1 for an unknown dtype.
int tm_norm_add(const void* y, const void* weight, float* x, int64_t rows, int64_t hidden,
                int64_t y_stride, float eps, int dtype) {
  if (dtype == 0) {
    norm_add(static_cast<const float*>(y), static_cast<const float*>(weight), x, rows, hidden,
             y_stride, eps);
  } else if (dtype == 1) {
    norm_add(static_cast<const uint16_t*>(y), static_cast<const float*>(weight), x, rows,
             hidden, y_stride, eps);
  } else {
    return -1;
  }
  return 0;
}

// x float32 [rows, hidden] into out (rows out_stride apart) in dtype. Returns 0, or -1.
int tm_cast_rows(const float* x, void* out, int64_t rows, int64_t hidden, int64_t out_stride,
                 int dtype) {
  if (dtype == 0) {
    cast_rows(x, static_cast<float*>(out), rows, hidden, out_stride);
  } else if (dtype == 1) {
    cast_rows(x, static_cast<uint16_t*>(out), rows, hidden, out_stride);
  } else {
    return -1;
  }
  return 0;
}

}  // extern "C"
