// Attention over the slot-addressed KV cache on the CPU (tp_worker, via ctypes).
//
// The reduction order is fixed by this file, not by a math library: one query token and one
// KV head are one work item, and within an item every sum runs over the same index ranges in
// the same order whatever the batch, the chunk, the step or the thread that runs it:
//   - q.k over head_dim: LANES partial sums (lane d % LANES), combined by a fixed tree;
//   - softmax: exact max, then exp (our own polynomial, not libm) summed in LANES partial
//     sums over key positions, combined by the same tree;
//   - p.V: one accumulator per output element, keys in ascending position.
// Built with -ffp-contract=off and without -ffast-math, so the compiler may vectorise these
// loops but never reassociate them: the same source gives the same bits on any x86 CPU.
//
// Keys are read where they lie: position j of the request in table row r is slot
// table[r * table_stride + j], so a row costs work in proportion to its own context.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int LANES = 16;

inline float bf16_to_float(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  bits += 0x7fffu + ((bits >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(bits >> 16);
}

template <typename T>
inline void to_float(const T* src, float* dst, int64_t n);

template <>
inline void to_float<float>(const float* src, float* dst, int64_t n) {
  std::memcpy(dst, src, n * sizeof(float));
}

template <>
inline void to_float<uint16_t>(const uint16_t* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_float(src[i]);
}

inline void store(float* dst, float v) { *dst = v; }
inline void store(uint16_t* dst, float v) { *dst = float_to_bf16(v); }

// exp(x) for x <= 0: 2^n * p(r) with r = x - n ln2 in [-ln2/2, ln2/2]; ~2 ulp. Our own so that
// the result does not depend on which libm variant the machine dispatches to.
inline float exp_nonpositive(float x) {
  if (x < -87.0f) return 0.0f;
  const float n = static_cast<float>(static_cast<int>(x * 1.44269504f - 0.5f));
  const float r = (x - n * 0.693145752f) - n * 1.42860677e-6f;
  float p = 1.98756912e-4f;
  p = p * r + 1.39819994e-3f;
  p = p * r + 8.33345205e-3f;
  p = p * r + 4.16657962e-2f;
  p = p * r + 1.66666657e-1f;
  p = p * r + 0.5f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

inline float tree_sum(float* lane) {
  for (int width = LANES / 2; width > 0; width /= 2)
    for (int i = 0; i < width; ++i) lane[i] = lane[i] + lane[i + width];
  return lane[0];
}

inline float dot(const float* a, const float* b, int64_t n) {
  float lane[LANES] = {};
  int64_t d = 0;
  for (; d + LANES <= n; d += LANES)
    for (int i = 0; i < LANES; ++i) lane[i] = lane[i] + a[d + i] * b[d + i];
  for (int i = 0; d + i < n; ++i) lane[i] = lane[i] + a[d + i] * b[d + i];
  return tree_sum(lane);
}

struct Shape {
  int64_t num_tokens, num_heads, num_kv_heads, head_dim, table_stride, window;
  float scale;
};

// One query token t, one KV head: the group of query heads that share it.
template <typename T>
void attend_item(const T* q, const T* k_cache, const T* v_cache, const int32_t* table,
                 const int64_t* rows, const int64_t* positions, T* out, const Shape& s, int64_t t,
                 int64_t kv_head, std::vector<float>& scratch) {
  const int64_t group = s.num_heads / s.num_kv_heads, dim = s.head_dim;
  const int64_t pos = positions[t];
  const int64_t first = s.window > 0 ? std::max<int64_t>(0, pos - s.window + 1) : 0;
  const int64_t num_keys = pos - first + 1;
  const int32_t* slots = table + rows[t] * s.table_stride + first;
  scratch.resize(group * (num_keys + 2 * dim + 1) + dim);
  float* scores = scratch.data();              // [group, num_keys]
  float* queries = scores + group * num_keys;  // [group, dim]
  float* acc = queries + group * dim;          // [group, dim]
  float* inv = acc + group * dim;              // [group] 1 / softmax denominator
  float* row = inv + group;                    // [dim] one key or value as float
  const int64_t head0 = kv_head * group;
  to_float(q + (t * s.num_heads + head0) * dim, queries, group * dim);
  for (int64_t j = 0; j < num_keys; ++j) {
    to_float(k_cache + (slots[j] * s.num_kv_heads + kv_head) * dim, row, dim);
    for (int64_t g = 0; g < group; ++g)
      scores[g * num_keys + j] = dot(queries + g * dim, row, dim) * s.scale;
  }
  for (int64_t g = 0; g < group; ++g) {
    float* sc = scores + g * num_keys;
    float max = sc[0];
    for (int64_t j = 1; j < num_keys; ++j) max = std::max(max, sc[j]);
    float lane[LANES] = {};
    for (int64_t j = 0; j < num_keys; ++j) {
      sc[j] = exp_nonpositive(sc[j] - max);
      lane[j % LANES] = lane[j % LANES] + sc[j];
    }
    inv[g] = 1.0f / tree_sum(lane);
  }
  std::fill(acc, acc + group * dim, 0.0f);
  for (int64_t j = 0; j < num_keys; ++j) {
    to_float(v_cache + (slots[j] * s.num_kv_heads + kv_head) * dim, row, dim);
    for (int64_t g = 0; g < group; ++g) {
      const float p = scores[g * num_keys + j];
      float* a = acc + g * dim;
      for (int64_t d = 0; d < dim; ++d) a[d] = a[d] + p * row[d];
    }
  }
  T* o = out + (t * s.num_heads + head0) * dim;
  for (int64_t i = 0; i < group * dim; ++i) store(o + i, acc[i] * inv[i / dim]);
}

template <typename T>
void attend_all(const void* q, const void* k_cache, const void* v_cache, const int32_t* table,
                const int64_t* rows, const int64_t* positions, void* out, const Shape& s) {
  const int64_t num_items = s.num_tokens * s.num_kv_heads;
#pragma omp parallel
  {
    std::vector<float> scratch;
#pragma omp for schedule(static)
    for (int64_t item = 0; item < num_items; ++item)
      attend_item<T>(static_cast<const T*>(q), static_cast<const T*>(k_cache),
                     static_cast<const T*>(v_cache), table, rows, positions,
                     static_cast<T*>(out), s, item / s.num_kv_heads, item % s.num_kv_heads,
                     scratch);
  }
}

}  // namespace

extern "C" {

// q, out [num_tokens, num_heads, head_dim]; k_cache, v_cache [slots, num_kv_heads, head_dim];
// table [rows, table_stride] int32 slot of each position; rows, positions [num_tokens] int64.
// dtype 0 = float32, 1 = bfloat16 (all four tensors alike). window <= 0: no sliding window.
// Returns 0, or -1 for an unknown dtype.
int tm_paged_attention(const void* q, const void* k_cache, const void* v_cache,
                       const int32_t* table, const int64_t* rows, const int64_t* positions,
                       void* out, int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads,
                       int64_t head_dim, int64_t table_stride, int64_t window, float scale,
                       int dtype) {
  const Shape s{num_tokens, num_heads, num_kv_heads, head_dim, table_stride, window, scale};
  if (dtype == 0) {
    attend_all<float>(q, k_cache, v_cache, table, rows, positions, out, s);
  } else if (dtype == 1) {
    attend_all<uint16_t>(q, k_cache, v_cache, table, rows, positions, out, s);
  } else {
    return -1;
  }
  return 0;
}

}  // extern "C"
