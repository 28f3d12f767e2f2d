// The AMX tile set-up both tile kernels share (linear_amx.cpp, attention_amx.cpp; tp_worker).
#pragma once

#include <cstdint>

// NOTE: every AMX CPU has AVX512-BF16 too; the attention kernel's softmax converts with it.
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define TOKENMILL_AMX 1

extern "C" int tm_amx_ready();

namespace tokenmill {

struct TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

constexpr TileConfig all_tiles_16_by_64() {
  TileConfig config{};
  config.palette = 1;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = 16;
    config.colsb[t] = 64;
  }
  return config;
}

// Every tile 16 rows of 64 bytes (16 float32 or 32 bfloat16 a row), for the calling thread;
// each kernel gives its tiles their roles. NOTE: the configuration is a constant in memory:
// GCC's _tile_loadconfig does not tell the optimiser that it reads its argument, so the
// stores of a configuration built on the stack may be dropped (seen: ldtilecfg faulting).
inline void configure_tiles() {
  alignas(64) static constexpr TileConfig config = all_tiles_16_by_64();
  _tile_loadconfig(&config);
}

}  // namespace tokenmill
#endif
