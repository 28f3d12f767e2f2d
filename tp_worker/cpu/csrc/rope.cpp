// Rotary embedding of the fused q/k/v projection, and the new keys and values written into
// the KV cache, in one pass (tp_worker, via ctypes).
//
// Per element, the operations of `x * cos + rotate_half(x) * sin` as torch runs them in the
// model's dtype: the two products and the sum each rounded to that dtype (in bfloat16: three
// roundings, as torch's element-wise ops round every result), never fused. So a token's
// rotated q and k are bitwise what the torch path gives, and depend on nothing but the token.

#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "bf16.h"
#include "kernels.h"

namespace {

using tokenmill::load;
using tokenmill::round_to;
using tokenmill::store;
#if defined(__AVX512F__)
using tokenmill::load16;
using tokenmill::round16;
using tokenmill::store16;
#endif

// x * cos + rot * sin for one element, rounded as torch rounds it (see the top of the file).
template <typename T>
inline float rotate(float x, float rot, float c, float s, const T* tag) {
  const float a = round_to(x * c, tag);
  const float b = round_to(rot * s, tag);
  return a + b;
}

// One head of `dim` elements into dst (which may lie in the KV cache): its first `rot` rotated
// (pairs i, i + rot / 2), the rest copied as they are (partial rotary, as Phi-4-mini's).
template <typename T>
void rope_head(const T* src, const T* cos, const T* sin, int64_t rot, int64_t dim, T* dst) {
  for (int64_t i = rot; i < dim; ++i) dst[i] = src[i];
  const int64_t half = rot / 2;
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= half; i += 16) {
    const __m512 x1 = load16(src + i), x2 = load16(src + i + half);
    const __m512 minus_x2 = _mm512_castsi512_ps(  // -x2: the sign bit flipped, zeros too
        _mm512_xor_si512(_mm512_castps_si512(x2), _mm512_set1_epi32(INT32_MIN)));
    const __m512 c1 = load16(cos + i), s1 = load16(sin + i);
    const __m512 c2 = load16(cos + i + half), s2 = load16(sin + i + half);
    store16(dst + i, _mm512_add_ps(round16(_mm512_mul_ps(x1, c1), src),
                                   round16(_mm512_mul_ps(minus_x2, s1), src)));
    store16(dst + i + half, _mm512_add_ps(round16(_mm512_mul_ps(x2, c2), src),
                                          round16(_mm512_mul_ps(x1, s2), src)));
  }
#endif
  for (; i < half; ++i) {
    const float x1 = load(src + i), x2 = load(src + i + half);
    store(dst + i, rotate(x1, -x2, load(cos + i), load(sin + i), src));
    store(dst + i + half, rotate(x2, x1, load(cos + i + half), load(sin + i + half), src));
  }
}

template <typename T>
void copy_head(const T* src, int64_t dim, T* dst) {
  for (int64_t i = 0; i < dim; ++i) dst[i] = src[i];
}

template <typename T>
void rope_store(const T* qkv, const T* cos, const T* sin, const int64_t* slots, T* q_out,
                T* k_cache, T* v_cache, int64_t tokens, int64_t heads, int64_t kv_heads,
                int64_t dim, int64_t rot, int64_t head_stride, int64_t slot_stride) {
  const int64_t width = (heads + 2 * kv_heads) * dim;
  // NOTE: threads from ~8K elements (a few tokens): 32 decode tokens of 1,280 took 28-50 us
  // on one thread and 24-25 on two (a 2-core Xeon, kernel_ab.py --only small).
#pragma omp parallel for schedule(static) if (tokens * width >= (1 << 13))
  for (int64_t t = 0; t < tokens; ++t) {
    const T* row = qkv + t * width;
    const T* c = cos + t * rot;
    const T* s = sin + t * rot;
    for (int64_t h = 0; h < heads; ++h)
      rope_head(row + h * dim, c, s, rot, dim, q_out + (t * heads + h) * dim);
    const int64_t at = slots[t] * slot_stride;
    for (int64_t h = 0; h < kv_heads; ++h) {
      rope_head(row + (heads + h) * dim, c, s, rot, dim, k_cache + h * head_stride + at);
      copy_head(row + (heads + kv_heads + h) * dim, dim, v_cache + h * head_stride + at);
    }
  }
}

}  // namespace

extern "C" {

// qkv [tokens, (heads + 2 * kv_heads) * dim]: q heads, then k heads, then v heads;
// cos, sin [tokens, rotary_dim]: each head's first rotary_dim elements are rotated, the rest
// copied; q_out [tokens, heads, dim]; token t's k and v heads go to slot slots[t] of k_cache
// and v_cache (head h of slot s at h * head_stride + s * slot_stride). dtype 0 = float32,
// 1 = bfloat16 (every tensor alike). Returns 0, or -1 for an unknown dtype or rotary_dim.
int tm_rope_store_partial(const void* qkv, const void* cos, const void* sin,
                          const int64_t* slots, void* q_out, void* k_cache, void* v_cache,
                          int64_t tokens, int64_t heads, int64_t kv_heads, int64_t dim,
                          int64_t rotary_dim, int64_t head_stride, int64_t slot_stride,
                          int dtype) {
  if (rotary_dim <= 0 || rotary_dim > dim || rotary_dim % 2 != 0) return -1;
  if (dtype == 0) {
    rope_store(static_cast<const float*>(qkv), static_cast<const float*>(cos),
               static_cast<const float*>(sin), slots, static_cast<float*>(q_out),
               static_cast<float*>(k_cache), static_cast<float*>(v_cache), tokens, heads,
               kv_heads, dim, rotary_dim, head_stride, slot_stride);
  } else if (dtype == 1) {
    rope_store(static_cast<const uint16_t*>(qkv), static_cast<const uint16_t*>(cos),
               static_cast<const uint16_t*>(sin), slots, static_cast<uint16_t*>(q_out),
               static_cast<uint16_t*>(k_cache), static_cast<uint16_t*>(v_cache), tokens,
               heads, kv_heads, dim, rotary_dim, head_stride, slot_stride);
  } else {
    return -1;
  }
  return 0;
}

// tm_rope_store_partial with every element of each head rotated (rotary_dim = dim).
int tm_rope_store(const void* qkv, const void* cos, const void* sin, const int64_t* slots,
                  void* q_out, void* k_cache, void* v_cache, int64_t tokens, int64_t heads,
                  int64_t kv_heads, int64_t dim, int64_t head_stride, int64_t slot_stride,
                  int dtype) {
  return tm_rope_store_partial(qkv, cos, sin, slots, q_out, k_cache, v_cache, tokens, heads,
                               kv_heads, dim, dim, head_stride, slot_stride, dtype);
}

}  // extern "C"
