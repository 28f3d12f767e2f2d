// bfloat16 <-> float32, bit-exact and the same on every CPU (tp_worker kernels).
#pragma once

#include <cstdint>
#include <cstring>

namespace tokenmill {

inline float bf16_to_float(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Round to nearest even, as torch does; NaN stays NaN.
inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

inline void store(float* dst, float v) { *dst = v; }
inline void store(uint16_t* dst, float v) { *dst = float_to_bf16(v); }

// Partial sums lane[0..15] combined pairwise by halves: (i, i + 8), (i, i + 4), (i, i + 2),
// (i, i + 1). The fixed order every kernel uses where it reduces across lanes.
inline float tree_sum16(float* lane) {
  for (int width = 8; width > 0; width /= 2)
    for (int i = 0; i < width; ++i) lane[i] = lane[i] + lane[i + width];
  return lane[0];
}

}  // namespace tokenmill
