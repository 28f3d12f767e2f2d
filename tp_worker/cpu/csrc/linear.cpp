// y = x W^T (+ b) (+ r) on the CPU with a reduction order fixed by this file (tp_worker, via
// ctypes). r, a residual added in the epilogue, gives the bits of `r + y` in torch: y rounded
// to the output dtype first, then one float32 add, rounded again. With `glu`, each panel holds
// 16 gate and then the same 16 up features (cpu/ops.py's gate_up_panels' order for an MLP's
// gate_up) and the epilogue writes act(gate) * up for those 16 columns instead (glu: silu.h's
// activation code), with the bits
// of activation.cpp over the unfused output (epilogue.h, shared with linear_amx.cpp).
//
// The rule: every output element sums its K products in float32 in an order fixed by K alone,
// whatever M is, wherever the row sits in its block and whichever thread runs it. bfloat16:
// one accumulator over ascending pairs of k, each pair as one VDPBF16PS lane does it. float32:
// blocks of KB = 64 k, each summed from zero in ascending k (one fma a step), and the block
// sums added in ascending order (the last block may be shorter). So a row's result is the same
// alone, in a batch of 64 or in a prefill chunk of 2,048: no padding to a fixed row count is
// needed, and decode pays for one row, not 32.
// NOTE: why blocks in float32: one accumulator over K = 576..14,336 products rounds against an
// ever larger sum; a block's sum stays small. On SmolLM2-135M (K 576 and 1,536) the blocked sums
// took tokenmill float32 from 4.0e-5 largest / 4.5e-6 mean logprob error against a float64
// reference to 1.3e-5 / 1.3e-6 (transformers float32: 1.7e-5 / 2.2e-6), for 2-4% of a float32
// product's time (benchmarks/serving/float64_distance.py, kernel_ab.py --dtype float32; a 2-core
// Zen 4).
// In bfloat16 the rounding of the inputs dominates: blocks would change nothing measurable.
//
// W is packed once at load time into panels of NR = 32 output features:
//   float32  [N/32][K][32]        bfloat16  [N/32][K/2][32][2]
// (N zero-padded to whole panels; in bfloat16 K to a multiple of 32, the depth of an AMX
// tile, so that linear_amx.cpp takes the same panels) so the inner loop reads each panel
// sequentially. With AVX-512 (and AVX512_BF16) the
// accumulators live in registers; without it a portable loop does the same operations in the
// same order (std::fma: one rounding, as VFMADD231PS), so every x86 build gives the same bits.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include <omp.h>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#include "bf16.h"
#include "epilogue.h"
#include "panel_queue.h"
#include "quant_exact.h"
#include "quant_kernels.h"
#include "kernels.h"

namespace {

constexpr int NR = 32;
constexpr int MR = 12;
constexpr int64_t KB = 64;  // float32: k per block sum (the rule above)
constexpr int64_t AHEAD = 32;  // k steps (float32) or pairs of k (bfloat16) ahead, 4 KiB

using tokenmill::store;

// Where a microkernel asks for its panel ahead of its loads (ask_ahead): not at all (a block
// that finds the panel in L2), into L1 or into L2.
enum Ask { NO_ASK, INTO_L1, INTO_L2 };

// The two cache lines `elements` on from `panel`, asked for into ASK's level. A microkernel's loop
// keeps too few of its own loads in flight to stream weights from memory (a 12-row block's
// loop body is ~40 instructions), so a decode step's products waited on memory between short
// bursts of arithmetic: asking AHEAD steps on streams them under it. Near the end of a panel
// of `end` elements the stream goes on `after` bytes past its end: 0, the next panel (panels
// lie one after the other), or a thread's next panel elsewhere (the first of its share of the
// product that follows: panel_queue.h's NextProduct). Changes no result.
// NOTE: the address is an integer's: past the last panel it points at nothing, and a
// prefetch of it never faults.
#if defined(__AVX512F__)
template <Ask ASK, typename T>
inline void ask_ahead(const T* panel, int64_t elements, int64_t end, intptr_t after) {
  uintptr_t at = reinterpret_cast<uintptr_t>(panel) + static_cast<uintptr_t>(elements) * sizeof(T);
  if (elements >= end) at += static_cast<uintptr_t>(after);
  const auto* ahead = reinterpret_cast<const char*>(at);
  constexpr auto hint = ASK == INTO_L2 ? _MM_HINT_T1 : _MM_HINT_T0;
  _mm_prefetch(ahead, hint);
  _mm_prefetch(ahead + 64, hint);
}
#endif

// --- microkernels: acc[R][NR] = A[R rows, K] . panel[K][NR] -------------------------------

#if defined(__AVX512F__)
// c[R][2] += A[R rows, k0 .. k0 + COUNT) . panel (COUNT < 0: k0 .. k_len).
template <int R, Ask ASK, int64_t COUNT>
inline void block_f32(const float* a, int64_t lda, const float* panel, int64_t k0, int64_t k_len,
                      intptr_t after, __m512 (&c)[R][2]) {
  // NOTE: a whole block counts to a constant: with its bound in a register of its own, gcc
  // (out of general registers with 12 rows' pointers) kept it on the stack, 5% slower.
  const int64_t count = COUNT < 0 ? k_len - k0 : COUNT;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t k = k0 + i;
    if (ASK != NO_ASK) ask_ahead<ASK>(panel, (k + AHEAD) * NR, k_len * NR, after);
    const __m512 b0 = _mm512_loadu_ps(panel + k * NR);
    const __m512 b1 = _mm512_loadu_ps(panel + k * NR + 16);
    for (int r = 0; r < R; ++r) {
      const __m512 x = _mm512_set1_ps(a[r * lda + k]);
      c[r][0] = _mm512_fmadd_ps(x, b0, c[r][0]);
      c[r][1] = _mm512_fmadd_ps(x, b1, c[r][1]);
    }
  }
}

template <int R, Ask ASK>
void kernel_f32(const float* a, int64_t lda, const float* panel, int64_t k_len, float* acc,
                intptr_t after) {
  for (int64_t k0 = 0; k0 < k_len; k0 += KB) {
    __m512 c[R][2];
    for (int r = 0; r < R; ++r) c[r][0] = c[r][1] = _mm512_setzero_ps();
    if (k0 + KB <= k_len)
      block_f32<R, ASK, KB>(a, lda, panel, k0, k_len, after, c);
    else
      block_f32<R, ASK, -1>(a, lda, panel, k0, k_len, after, c);
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < 2; ++h) {
        float* out = acc + r * NR + 16 * h;
        _mm512_storeu_ps(out, k0 == 0 ? c[r][h] : _mm512_add_ps(_mm512_loadu_ps(out), c[r][h]));
      }
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
// AVX2 (no AVX-512): tiles of up to 6 rows by 16 columns, their 12 accumulators in ymm
// registers, each broadcast of x feeding two FMAs. Each output's sum is the portable
// kernel's below, bit for bit: one fused multiply-add per k in order within a block of KB,
// block sums added in order.
template <int R>
inline void tile_f32(const float* a, int64_t lda, const float* panel, int64_t k0, int64_t k1,
                     int half, bool first, float* acc) {
  __m256 c0[R], c1[R];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) c0[r] = c1[r] = _mm256_setzero_ps();
  for (int64_t k = k0; k < k1; ++k) {
    const float* p = panel + k * NR + 16 * half;
    const __m256 b0 = _mm256_loadu_ps(p);
    const __m256 b1 = _mm256_loadu_ps(p + 8);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m256 x = _mm256_broadcast_ss(a + r * lda + k);
      c0[r] = _mm256_fmadd_ps(x, b0, c0[r]);
      c1[r] = _mm256_fmadd_ps(x, b1, c1[r]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    float* out = acc + r * NR + 16 * half;
    _mm256_storeu_ps(out, first ? c0[r] : _mm256_add_ps(_mm256_loadu_ps(out), c0[r]));
    _mm256_storeu_ps(out + 8, first ? c1[r] : _mm256_add_ps(_mm256_loadu_ps(out + 8), c1[r]));
  }
}

template <int R, Ask>
void kernel_f32(const float* a, int64_t lda, const float* panel, int64_t k_len, float* acc,
                intptr_t) {
  constexpr int TOP = R > 6 ? 6 : R;
  for (int64_t k0 = 0; k0 < k_len; k0 += KB) {
    const int64_t k1 = std::min(k_len, k0 + KB);
    for (int half = 0; half < 2; ++half) {
      tile_f32<TOP>(a, lda, panel, k0, k1, half, k0 == 0, acc);
      if constexpr (R > 6)
        tile_f32<R - 6>(a + 6 * lda, lda, panel, k0, k1, half, k0 == 0, acc + 6 * NR);
    }
  }
}
#else
template <int R, Ask>
void kernel_f32(const float* a, int64_t lda, const float* panel, int64_t k_len, float* acc,
                intptr_t) {
  float block[R * NR];
  for (int64_t k0 = 0; k0 < k_len; k0 += KB) {
    std::fill(block, block + R * NR, 0.0f);
    const int64_t k1 = std::min(k_len, k0 + KB);
    for (int64_t k = k0; k < k1; ++k)
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < NR; ++j)
          block[r * NR + j] = std::fma(a[r * lda + k], panel[k * NR + j], block[r * NR + j]);
    for (int i = 0; i < R * NR; ++i) acc[i] = k0 == 0 ? block[i] : acc[i] + block[i];
  }
}
#endif

#if defined(__AVX512BF16__)
// One pair of k into the R x 2 accumulators: word(r) is row r's pair of x.
template <int R, typename Word>
inline void pair_step(__m512 (&c)[R][2], const uint16_t* panel_pair, Word word) {
  const __m512bh b0 = (__m512bh)_mm512_loadu_si512(panel_pair);
  const __m512bh b1 = (__m512bh)_mm512_loadu_si512(panel_pair + NR);
  for (int r = 0; r < R; ++r) {
    const __m512bh x = (__m512bh)_mm512_set1_epi32(static_cast<int>(word(r)));
    c[r][0] = _mm512_dpbf16_ps(c[r][0], x, b0);
    c[r][1] = _mm512_dpbf16_ps(c[r][1], x, b1);
  }
}

template <int R, Ask ASK>
void kernel_bf16(const uint16_t* a, int64_t lda, const uint16_t* panel, int64_t k_len,
                 float* acc, intptr_t after) {
  __m512 c[R][2];
  const int64_t end = (k_len + 31) / 32 * 32 * NR;  // the panel's elements (K padded)
  for (int r = 0; r < R; ++r) c[r][0] = c[r][1] = _mm512_setzero_ps();
  // NOTE: an odd k's last pair comes after the loop, not as a branch inside it: with the
  // branch and the prefetch in one loop, gcc kept the accumulators on the stack (3x slower).
  const int64_t full_pairs = k_len / 2;
  for (int64_t kp = 0; kp < full_pairs; ++kp) {
    if (ASK != NO_ASK) ask_ahead<ASK>(panel, (kp + AHEAD) * 2 * NR, end, after);
    pair_step<R>(c, panel + kp * 2 * NR, [&](int r) {
      uint32_t word;
      std::memcpy(&word, a + r * lda + 2 * kp, 4);
      return word;
    });
  }
  if (k_len % 2)
    pair_step<R>(c, panel + full_pairs * 2 * NR,
                 [&](int r) { return tokenmill::pair_word(a + r * lda, full_pairs, k_len); });
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(acc + r * NR, c[r][0]);
    _mm512_storeu_ps(acc + r * NR + 16, c[r][1]);
  }
}
#else
// VDPBF16PS, lane by lane (bf16.h's dot_pair).
template <int R, Ask>
void kernel_bf16(const uint16_t* a, int64_t lda, const uint16_t* panel, int64_t k_len,
                 float* acc, intptr_t) {
  std::fill(acc, acc + R * NR, 0.0f);
  const int64_t pairs = (k_len + 1) / 2;
  for (int64_t kp = 0; kp < pairs; ++kp)
    for (int r = 0; r < R; ++r) {
      const uint32_t word = tokenmill::pair_word(a + r * lda, kp, k_len);
      for (int j = 0; j < NR; ++j) {
        uint32_t w;
        std::memcpy(&w, panel + (kp * NR + j) * 2, 4);
        acc[r * NR + j] = tokenmill::dot_pair(acc[r * NR + j], word, w);
      }
    }
}
#endif

template <typename T>
using Kernel = void (*)(const T*, int64_t, const T*, int64_t, float*, intptr_t);

template <int R, Ask ASK>
struct F32 {
  static constexpr Kernel<float> fn = kernel_f32<R, ASK>;
};
template <int R, Ask ASK>
struct BF16 {
  static constexpr Kernel<uint16_t> fn = kernel_bf16<R, ASK>;
};

template <typename T, template <int, Ask> class K, Ask ASK>
Kernel<T> kernel_of(int rows) {
  static const Kernel<T> table[MR + 1] = {
      nullptr,        K<1, ASK>::fn,  K<2, ASK>::fn,  K<3, ASK>::fn,  K<4, ASK>::fn,
      K<5, ASK>::fn,  K<6, ASK>::fn,  K<7, ASK>::fn,  K<8, ASK>::fn,  K<9, ASK>::fn,
      K<10, ASK>::fn, K<11, ASK>::fn, K<12, ASK>::fn};
  return table[rows];
}

// Where a block that streams its panel asks for it. Intel: into L2. With the lines asked into
// L1, a one-row bfloat16 product on a Xeon's AVX-512 kernels read ~0.85-0.9 of what plain
// vector loads read from memory (the L1 fill buffers that the asks hold are what a load's own
// misses need); into L2, 1.04-1.12x faster (kernel_ab.py, TOKENMILL_CPU_AMX=0), float32 the
// same. AMD: into L1, as AHEAD was measured on a Zen 4 (Zen 4 takes T1 into L2 too, but is
// reported to drop some of them; not measured here).
Ask streaming_ask() {
#if defined(__x86_64__) || defined(__i386__)
  static const Ask ask = [] {
    __builtin_cpu_init();
    return __builtin_cpu_is("intel") ? INTO_L2 : INTO_L1;
  }();
  return ask;
#else
  return INTO_L1;
#endif
}

// `stream`: the microkernel that asks for its panel ahead of its loads (see ask_ahead; `after`
// where its stream goes past its end).
template <typename T, template <int, Ask> class K>
Kernel<T> kernel_for(int rows, bool stream) {
  if (!stream) return kernel_of<T, K, NO_ASK>(rows);
  return streaming_ask() == INTO_L2 ? kernel_of<T, K, INTO_L2>(rows)
                                    : kernel_of<T, K, INTO_L1>(rows);
}

// Rows of x a pass over every panel takes: about 512 KiB of x, so that it stays in each core's
// L2 while the panels stream past (a whole prefill chunk's x, 12-32 MiB at 8,192 rows, came
// from L3 or memory once per panel). Whole row blocks, so that blocks of MR rows fall as before.
inline int64_t rows_per_pass(int64_t k_len, int64_t elem_bytes) {
  const int64_t rows = (int64_t{512} << 10) / (k_len * elem_bytes) / MR * MR;
  return std::max<int64_t>(MR, rows);
}

// One product's operands; `panel` runs one panel over rows [first, last) of x.
template <typename T, typename Out, template <int, Ask> class K>
struct Product {
  const T* x;
  int64_t k_len, lda;
  const T* packed;
  int64_t panel_elems, n;
  const float* bias;
  Out* out;
  int64_t ldc;
  const Out* residual;
  int glu;  // NOTE: 0, or silu.h's activation code

  // `after`: ask_ahead's, for the first block (the one that streams the panel in).
  void panel(int64_t p, int64_t first, int64_t last, intptr_t after) const {
    panel_from(packed + p * panel_elems, p, first, last, after, true);
  }

  // Panel p's outputs from its weights at `weights` (packed, or a panel dequantized into a
  // thread's buffer: `stream` false, as it is in the core's cache already).
  void panel_from(const T* weights, int64_t p, int64_t first, int64_t last, intptr_t after,
                  bool stream) const {
    alignas(64) float acc[MR * NR];
    for (int64_t m0 = first; m0 < last; m0 += MR) {
      const int rows = static_cast<int>(std::min<int64_t>(MR, last - m0));
      // NOTE: the first block of a pass brings the panel in; the others find it in L2.
      kernel_for<T, K>(rows, stream && m0 == first)(x + m0 * lda, lda, weights, k_len, acc,
                                                    after);
      write(acc, p, m0, rows);
    }
  }

  // Rows m0 .. m0 + rows of panel p from their float32 sums acc [rows][NR]: the epilogue.
  void write(const float* acc, int64_t p, int64_t m0, int rows) const {
    const int64_t col0 = p * NR, cols = std::min<int64_t>(NR, n - col0);
    const float* b = bias ? bias + col0 : nullptr;
    for (int r = 0; r < rows; ++r) {
      const int64_t row = m0 + r;
      if (glu) {
        tokenmill::write_glu_row(acc + r * NR, b, out + row * ldc + p * NR / 2, glu);
      } else {
        tokenmill::write_row(acc + r * NR, cols, b, out + row * ldc + col0,
                             residual ? residual + row * ldc + col0 : nullptr);
      }
    }
  }
};

template <typename T, typename Out, template <int, Ask> class K>
void linear(const T* x, int64_t m, int64_t k_len, int64_t lda, const T* packed, int64_t n,
            const float* bias, Out* out, int64_t ldc, const Out* residual, int glu,
            const tokenmill::NextProduct& then) {
  const int64_t num_panels = (n + NR - 1) / NR;
  const int64_t panel_elems = (std::is_same<T, float>::value ? k_len : (k_len + 31) / 32 * 32) * NR;
  const Product<T, Out, K> product{x, k_len, lda, packed, panel_elems, n,
                                   bias, out, ldc, residual, glu};
  const int64_t pass_rows = rows_per_pass(k_len, sizeof(T));
  const int64_t num_passes = (m + pass_rows - 1) / pass_rows;
  // NOTE: no barrier between passes: each has its own shares (panel_queue.h).
  tokenmill::PanelQueue queue(num_passes, omp_get_max_threads(), num_panels);
#pragma omp parallel
  {
    const int thread = omp_get_thread_num();
    for (int64_t pass = 0; pass < num_passes; ++pass) {
      const int64_t first = pass * pass_rows, last = std::min(m, first + pass_rows);
      for (int64_t p = queue.next(pass, thread); p >= 0; p = queue.next(pass, thread)) {
        // NOTE: a stolen panel's stream runs on into the next in memory, as it always did.
        const T* next = queue.successor(pass, thread, p, packed, panel_elems, then);
        const auto end = reinterpret_cast<intptr_t>(packed + (p + 1) * panel_elems);
        product.panel(p, first, last, next ? reinterpret_cast<intptr_t>(next) - end : 0);
      }
    }
  }
}

// The float32 product of x and quantized panels (dequant.h: `table` holds each panel's type
// and address), with the bits of the packed product of gguf's weights (quant_exact.h): up to
// EXACT_ROWS rows the microkernels dequantize in registers as they multiply; more rows, the
// panel is dequantized into the thread's buffer and multiplied as a packed one.
int exact_linear(const float* x, int64_t m, int64_t k_len, int64_t lda, const int64_t* table,
                 int64_t n, const float* bias, float* out, int64_t ldc, const float* residual,
                 int glu) {
  const int64_t num_panels = (n + NR - 1) / NR;
  const int64_t panel_elems = k_len * NR;  // NOTE: GGUF rows are whole blocks of 32 k
  const Product<float, float, F32> product{x, k_len, lda, nullptr, panel_elems, n,
                                           bias, out, ldc, residual, glu};
  const int64_t pass_rows = rows_per_pass(k_len, sizeof(float));
  const int64_t num_passes = (m + pass_rows - 1) / pass_rows;
  tokenmill::PanelQueue queue(num_passes, omp_get_max_threads(), num_panels);
  int status = 0;
#pragma omp parallel reduction(| : status)
  {
    static thread_local std::vector<float> buffer;
    const int thread = omp_get_thread_num();
    for (int64_t pass = 0; pass < num_passes; ++pass) {
      const int64_t first = pass * pass_rows, last = std::min(m, first + pass_rows);
      for (int64_t p = queue.next(pass, thread); p >= 0; p = queue.next(pass, thread)) {
        const auto* kernels = tokenmill::exact_kernels(static_cast<int>(table[2 * p]));
        const auto* src = reinterpret_cast<const uint8_t*>(static_cast<uintptr_t>(table[2 * p + 1]));
        if (kernels == nullptr) {
          status = 1;
          continue;
        }
        if (last - first <= tokenmill::EXACT_ROWS && kernels->fused[1] != nullptr) {
          alignas(64) float acc[tokenmill::EXACT_ROWS * NR];
          const int rows = static_cast<int>(last - first);
          kernels->fused[rows](x + first * lda, lda, src, k_len, acc);
          product.write(acc, p, first, rows);
          continue;
        }
        if (buffer.size() < static_cast<size_t>(panel_elems)) buffer.resize(panel_elems);
        kernels->dequant(src, k_len, buffer.data());
        product.panel_from(buffer.data(), p, first, last, 0, false);
      }
    }
  }
  return status;
}

// The bfloat16 product of x and quantized panels in quant_kernels.h's arithmetic: each
// panel's blocks are read as they are, by microkernels of up to QUANT_ROWS rows, and no panel
// is written dequantized.
template <typename Out>
int quant_linear(const uint16_t* x, int64_t m, int64_t k_len, int64_t lda, const int64_t* table,
                 int64_t n, const float* bias, Out* out, int64_t ldc, const Out* residual,
                 int glu) {
  const int64_t num_panels = (n + NR - 1) / NR;
  const Product<uint16_t, Out, BF16> product{x,    k_len, lda, nullptr,  0,  n,
                                             bias, out,   ldc, residual, glu};
  // NOTE: the rows' group sums, once for every panel, for each group size the panels use
  bool by16 = false, by32 = false;
  for (int64_t p = 0; p < num_panels; ++p) {
    const tokenmill::QuantLayout l = tokenmill::quant_layout(static_cast<int>(table[2 * p]));
    if (l.block_k == 0) return 1;
    (l.group_k == 16 ? by16 : by32) = true;
  }
  static thread_local std::vector<float> sums16, sums32;
  const int64_t ld16 = k_len / 16, ld32 = k_len / 32;
  if (by16) sums16.resize(m * ld16);
  if (by32) sums32.resize(m * ld32);
  // NOTE: the calling thread's buffers, by pointer (in the parallel regions a thread_local
  // name is each thread's own)
  float* xs16 = sums16.data();
  float* xs32 = sums32.data();
#pragma omp parallel for schedule(static) if (m > 16)
  for (int64_t r = 0; r < m; ++r) {
    if (by16) tokenmill::group_sums(x + r * lda, 1, k_len, lda, 16, xs16 + r * ld16);
    if (by32) tokenmill::group_sums(x + r * lda, 1, k_len, lda, 32, xs32 + r * ld32);
  }
  const int64_t pass_rows = rows_per_pass(k_len, sizeof(uint16_t));
  const int64_t num_passes = (m + pass_rows - 1) / pass_rows;
  tokenmill::PanelQueue queue(num_passes, omp_get_max_threads(), num_panels);
#pragma omp parallel
  {
    const int thread = omp_get_thread_num();
    for (int64_t pass = 0; pass < num_passes; ++pass) {
      const int64_t first = pass * pass_rows, last = std::min(m, first + pass_rows);
      for (int64_t p = queue.next(pass, thread); p >= 0; p = queue.next(pass, thread)) {
        const auto* kernels = tokenmill::quant_kernels(static_cast<int>(table[2 * p]));
        const auto* src = reinterpret_cast<const uint8_t*>(static_cast<uintptr_t>(table[2 * p + 1]));
        const bool small = kernels->group_k == 16;
        const float* xs = small ? xs16 : xs32;
        const int64_t ldxs = small ? ld16 : ld32;
        alignas(64) float acc[tokenmill::QUANT_ROWS * NR];
        for (int64_t m0 = first; m0 < last; m0 += tokenmill::QUANT_ROWS) {
          const int rows = static_cast<int>(std::min<int64_t>(tokenmill::QUANT_ROWS, last - m0));
          kernels->rows[rows](x + m0 * lda, lda, xs + m0 * ldxs, ldxs, src, k_len, acc);
          product.write(acc, p, m0, rows);
        }
      }
    }
  }
  return 0;
}

}  // namespace

extern "C" {

// tm_linear_then's product with quantized weights: `table` [panels][2] int64, each panel's
// GGUF type code and the address of its blocks (dequant.h's layout), k a multiple of 32.
// No product runs next (then_*: ignored); -1 for an unsupported combination or type.
int tm_quant_linear_then(const void* x, int64_t m, int64_t k, int64_t lda, const void* table,
                         int64_t n, const float* bias, void* out, int64_t ldc, int dtype,
                         int out_dtype, const void* residual, int glu, const void*, int64_t,
                         int64_t) {
  if ((glu && (n % NR != 0 || residual != nullptr)) || k % 32 != 0) return -1;
  const auto* panels = static_cast<const int64_t*>(table);
  int status = -1;
  if (dtype == 0 && out_dtype == 0) {
    status = exact_linear(static_cast<const float*>(x), m, k, lda, panels, n, bias,
                          static_cast<float*>(out), ldc, static_cast<const float*>(residual), glu);
  } else if (dtype == 1 && out_dtype == 1) {
    status = quant_linear<uint16_t>(static_cast<const uint16_t*>(x), m, k, lda, panels, n, bias,
                                    static_cast<uint16_t*>(out), ldc,
                                    static_cast<const uint16_t*>(residual), glu);
  } else if (dtype == 1 && out_dtype == 0) {
    status = quant_linear<float>(static_cast<const uint16_t*>(x), m, k, lda, panels, n, bias,
                                 static_cast<float*>(out), ldc, static_cast<const float*>(residual),
                                 glu);
  }
  return status == 0 ? 0 : -1;
}


// x [m, k] (row stride lda), packed: W [n, k] packed as above, bias [n] float32 or null,
// out [m, n] (row stride ldc), residual [m, n] in out's dtype and row stride, or null.
// dtype: 0 = float32 x and W, 1 = bfloat16 x and W; out_dtype: 0 = float32, 1 = bfloat16.
// glu: 0, or W packed as gate/up panels (n a multiple of 32, no residual) and out [m, n / 2]
// act(gate) * up, act silu.h's code (1 silu, 2 gelu_tanh).
// Returns 0, or -1 for an unsupported combination.
int tm_linear(const void* x, int64_t m, int64_t k, int64_t lda, const void* packed, int64_t n,
              const float* bias, void* out, int64_t ldc, int dtype, int out_dtype,
              const void* residual, int glu) {
  return tm_linear_then(x, m, k, lda, packed, n, bias, out, ldc, dtype, out_dtype, residual, glu,
                        nullptr, 0, 0);
}

int tm_linear_then(const void* x, int64_t m, int64_t k, int64_t lda, const void* packed,
                   int64_t n, const float* bias, void* out, int64_t ldc, int dtype, int out_dtype,
                   const void* residual, int glu, const void* then_packed, int64_t then_n,
                   int64_t then_k) {
  if (glu && (n % NR != 0 || residual != nullptr)) return -1;
  const tokenmill::NextProduct then{then_packed, then_n, then_k};
  if (dtype == 0 && out_dtype == 0) {
    linear<float, float, F32>(static_cast<const float*>(x), m, k, lda,
                              static_cast<const float*>(packed), n, bias,
                              static_cast<float*>(out), ldc, static_cast<const float*>(residual),
                              glu, then);
  } else if (dtype == 1 && out_dtype == 1) {
    linear<uint16_t, uint16_t, BF16>(static_cast<const uint16_t*>(x), m, k, lda,
                                     static_cast<const uint16_t*>(packed), n, bias,
                                     static_cast<uint16_t*>(out), ldc,
                                     static_cast<const uint16_t*>(residual), glu, then);
  } else if (dtype == 1 && out_dtype == 0) {
    linear<uint16_t, float, BF16>(static_cast<const uint16_t*>(x), m, k, lda,
                                  static_cast<const uint16_t*>(packed), n, bias,
                                  static_cast<float*>(out), ldc,
                                  static_cast<const float*>(residual), glu, then);
  } else {
    return -1;
  }
  return 0;
}

// Rows `ids` [count] of quantized panels (`table` as tm_quant_linear_then's, k weights a row,
// packed for bfloat16 where `pairs`) into out [count, k] float32: an embedding's lookup. -1
// for a type not served in blocks.
int tm_quant_rows(const void* table, const int64_t* ids, int64_t count, int64_t k, int pairs,
                  float* out) {
  const auto* panels = static_cast<const int64_t*>(table);
  int status = 0;
#pragma omp parallel for schedule(static) reduction(| : status)
  for (int64_t i = 0; i < count; ++i) {
    const int64_t p = ids[i] / NR;
    const tokenmill::QuantLayout l = tokenmill::quant_layout(static_cast<int>(panels[2 * p]));
    if (l.block_k == 0) {
      status = 1;
      continue;
    }
    const auto* src = reinterpret_cast<const uint8_t*>(static_cast<uintptr_t>(panels[2 * p + 1]));
    tokenmill::dequant_lane(l, src, k, pairs != 0, static_cast<int>(ids[i] % NR), out + i * k);
  }
  return status == 0 ? 0 : -1;
}

// Which microkernels this build has: 1 = AVX-512 float32, 2 = AVX512_BF16 (bit flags).
int tm_linear_isa() {
  int isa = 0;
#if defined(__AVX512F__)
  isa |= 1;
#endif
#if defined(__AVX512BF16__)
  isa |= 2;
#endif
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
  isa |= 4;  // the AVX2 float32 kernel
#endif
  return isa;
}

}  // extern "C"
