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

// Every tile 64 bytes a row (16 float32 or 32 bfloat16); tiles 0-5 `rows` rows, tiles 6-7 16.
constexpr TileConfig tiles_of_rows(int rows) {
  TileConfig config{};
  config.palette = 1;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = static_cast<uint8_t>(t < 6 ? rows : 16);
    config.colsb[t] = 64;
  }
  return config;
}

struct TileConfigs {
  TileConfig by_rows[16];  // [rows - 1]
};

constexpr TileConfigs all_tile_configs() {
  TileConfigs configs{};
  for (int rows = 1; rows <= 16; ++rows) configs.by_rows[rows - 1] = tiles_of_rows(rows);
  return configs;
}

// The calling thread's tiles: every tile 16 rows of 64 bytes (the default), or tiles 0-5 of
// `rows` rows (1-16) and 6-7 of 16; each kernel gives its tiles their roles. Tile loads,
// stores and products of fewer rows take fewer cycles, and the rows of a tile never mix, so a
// kernel whose tiles hold few live rows (attention at a decode token: a KV head's few query
// heads; a product of one decode row) asks for that many: the same bits, sooner (on a Xeon
// with AMX, kernel_ab.py: a 64-row decode layer's attention 1.13x, a 1-row decode step's
// products 1.05x). NOTE: the configurations are constants in
// memory: GCC's _tile_loadconfig does not tell the optimiser that it reads its argument, so
// the stores of a configuration built on the stack may be dropped (seen: ldtilecfg faulting).
inline void configure_tiles(int rows = 16) {
  alignas(64) static constexpr TileConfigs configs = all_tile_configs();
  _tile_loadconfig(&configs.by_rows[rows - 1]);
}

}  // namespace tokenmill
#endif
