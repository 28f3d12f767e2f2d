// LoRA deltas on the CPU (tp_worker, via ctypes, and csrc/layer_stack.cpp): for each row m
// whose adapter slot s = slots[m] is not -1, u = A_s x[m] (shrink), then y[m] += B_s u per
// output segment (expand), in float32. Rows of slot -1 are not touched: the base's bits stay
// its own.
//
// The rule that keeps a row's bits its own in any batch: each u[r] sums its k products in
// ascending k, from +0; each delta d[j] sums its rank products in ascending r, from +0; y
// then adds d once. No sum depends on the other rows, their adapters, the threads or the
// vector width (the AVX-512 lanes run over independent sums, and compute each as the
// portable loop does), and with -ffp-contract=off no multiply fuses into an add: the same
// bits on every x86 machine. The scaling (lora_alpha / r, or over sqrt(r) with rslora) is
// folded into B at load.
//
// The table, per slot, int64 words (TABLE_WORDS): A's address (float32 [k, rank], A
// transposed: the rank of one k side by side), rank (all segments' together), then
// MAX_SEGMENTS times (B's address (float32 [r, n]), first output column, n, first u, r);
// n = 0 ends the segments. A fused projection (q/k/v, gate/up) has one segment per part.
//
// Rows go by slot, ROW_BLOCK at a time, so that one pass over an adapter's A or B serves
// several rows (a decode step of many users on few adapters streams each B once a block);
// a block is one work item, its shrink then its expand (u stays in the core's cache).
//
// With LORA_PANELS in mode, y's rows are a gate/up product's in the linear kernels' panel
// order (cpu/ops.py's gate_up_panels: 16 gate then the same 16 up features per 32): column c
// of the table's gate-then-up order, half = ldy / 2, is at (c mod half) / 16 * 32 +
// (c / half) * 16 + c mod 16. The segments' columns and widths are then multiples of 16.

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "bf16.h"
#include "kernels.h"

namespace {

constexpr int64_t MAX_SEGMENTS = 3;
constexpr int64_t TABLE_WORDS = 2 + 5 * MAX_SEGMENTS;
constexpr int LORA_PANELS = 4;  // a mode bit: y in the gate/up panel order (above)
constexpr int64_t ROW_BLOCK = 8;  // rows whose sums interleave (independent chains)
constexpr int64_t LANES = 16;
constexpr int64_t PARALLEL_WORK = 1 << 18;  // multiply-adds from which a call splits

using tokenmill::load;

struct Rows {
  const int64_t* index;  // the block's row numbers
  int64_t count;  // 1..ROW_BLOCK
};

// Up to SPAN lanes (GROUPS vectors) of the rank or the output columns taken at once: with
// ROW_BLOCK rows, ROW_BLOCK x GROUPS accumulators and GROUPS weight vectors fit the 32
// registers (a lone row's chain is bound by the adds' latency, not their count).
constexpr int64_t GROUPS = 3;
constexpr int64_t SPAN = GROUPS * LANES;

// Where a row's output column c (of the table's order) lies in y: c itself, or (half
// nonzero: LORA_PANELS) its place in the gate/up panels of a row 2 * half wide.
struct Columns {
  int64_t half;
  int64_t at(int64_t c) const {
    return half == 0 ? c : (c % half) / LANES * 2 * LANES + c / half * LANES + c % LANES;
  }
};

#if defined(__AVX512F__)
// 16 lanes of an adapter's A or B from p: float32 under the mask; bfloat16 whole, which the
// weights' 16 elements of slack past their end keep in bounds (model/lora.py's slack), the
// lanes past the mask never stored.
inline __m512 weights16(const float* p, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, p); }
inline __m512 weights16(const uint16_t* p, __mmask16) { return tokenmill::load16(p); }

// The masks of `width` lanes (<= SPAN) in vectors of LANES; returns how many vectors.
inline int64_t lane_masks(int64_t width, __mmask16* masks) {
  for (int64_t g = 0; g < GROUPS; ++g) {
    const int64_t w = std::clamp<int64_t>(width - g * LANES, 0, LANES);
    masks[g] = static_cast<__mmask16>((1u << w) - 1u);
  }
  return (width + LANES - 1) / LANES;
}

// Both halves' one product: for each of NB rows b and each lane of NG vectors g, the sum over
// t in [0, len), ascending from +0, of w[t * stride + lane] * s[b][t] (shrink: w = A's rank
// lanes, s = x; expand: w = B's columns, s = u); stored at out[b] + at[g] (ADD: added to it).
// NOTE: NB and NG known at compile time, so that the accumulators stay in registers (loop
// bounds known only at run time kept them in memory: 3x slower).
template <int NB, int NG, bool ADD, typename W>
void lanes_fixed(const float* const* s, int64_t len, const W* w, int64_t stride,
                 const __mmask16* masks, float* const* out, const int64_t* at) {
  __m512 acc[NB][NG];
  for (int b = 0; b < NB; ++b)
    for (int g = 0; g < NG; ++g) acc[b][g] = _mm512_setzero_ps();
  for (int64_t t = 0; t < len; ++t) {
    __m512 wt[NG];
    for (int g = 0; g < NG; ++g) wt[g] = weights16(w + t * stride + g * LANES, masks[g]);
    for (int b = 0; b < NB; ++b) {
      const __m512 st = _mm512_set1_ps(s[b][t]);  // NOTE: a broadcast from memory, no shuffle
      for (int g = 0; g < NG; ++g) acc[b][g] = _mm512_add_ps(acc[b][g], _mm512_mul_ps(wt[g], st));
    }
  }
  for (int b = 0; b < NB; ++b)
    for (int g = 0; g < NG; ++g) {
      float* o = out[b] + at[g];
      const __m512 v = ADD ? _mm512_add_ps(_mm512_maskz_loadu_ps(masks[g], o), acc[b][g])
                           : acc[b][g];
      _mm512_mask_storeu_ps(o, masks[g], v);
    }
}

template <int NB, bool ADD, typename W>
void lanes_rows(int64_t groups, const float* const* s, int64_t len, const W* w, int64_t stride,
                const __mmask16* masks, float* const* out, const int64_t* at) {
  switch (groups) {
    case 1: return lanes_fixed<NB, 1, ADD>(s, len, w, stride, masks, out, at);
    case 2: return lanes_fixed<NB, 2, ADD>(s, len, w, stride, masks, out, at);
    default: return lanes_fixed<NB, 3, ADD>(s, len, w, stride, masks, out, at);
  }
}

// lanes_fixed for `rows` rows (<= ROW_BLOCK) and `width` lanes (<= SPAN).
template <bool ADD, typename W>
void lanes(int64_t rows, int64_t width, const float* const* s, int64_t len, const W* w,
           int64_t stride, float* const* out, const int64_t* at) {
  __mmask16 masks[GROUPS];
  const int64_t groups = lane_masks(width, masks);
  switch (rows) {
    case 1: return lanes_rows<1, ADD>(groups, s, len, w, stride, masks, out, at);
    case 2: return lanes_rows<2, ADD>(groups, s, len, w, stride, masks, out, at);
    case 3: return lanes_rows<3, ADD>(groups, s, len, w, stride, masks, out, at);
    case 4: return lanes_rows<4, ADD>(groups, s, len, w, stride, masks, out, at);
    case 5: return lanes_rows<5, ADD>(groups, s, len, w, stride, masks, out, at);
    case 6: return lanes_rows<6, ADD>(groups, s, len, w, stride, masks, out, at);
    case 7: return lanes_rows<7, ADD>(groups, s, len, w, stride, masks, out, at);
    default: return lanes_rows<8, ADD>(groups, s, len, w, stride, masks, out, at);
  }
}
#else
// lanes_fixed's sums, one lane at a time.
template <bool ADD, typename W>
void lanes(int64_t rows, int64_t width, const float* const* s, int64_t len, const W* w,
           int64_t stride, float* const* out, const int64_t* at) {
  for (int64_t b = 0; b < rows; ++b)
    for (int64_t lane = 0; lane < width; ++lane) {
      float acc = 0.0f;
      for (int64_t t = 0; t < len; ++t) acc += load(w + t * stride + lane) * s[b][t];
      float* o = out[b] + at[lane / LANES] + lane % LANES;
      *o = ADD ? *o + acc : acc;
    }
}
#endif

// u[row][0 : rank] for each row of the block: the sum over k of a[i][r] * x[row][i].
template <typename T, typename W>
void shrink_block(const T* x, int64_t ldx, int64_t k, const W* a, int64_t rank, Rows rows,
                  float* u, int64_t ldu) {
  const float* xs[ROW_BLOCK];
  float* u_rows[ROW_BLOCK];
  thread_local std::vector<float> converted;  // NOTE: bfloat16 rows in float32 (exact)
  if constexpr (!std::is_same_v<T, float>) converted.resize(static_cast<size_t>(ROW_BLOCK * k));
  for (int64_t b = 0; b < rows.count; ++b) {
    const T* row = x + rows.index[b] * ldx;
    u_rows[b] = u + rows.index[b] * ldu;
    if constexpr (std::is_same_v<T, float>) {
      xs[b] = row;
    } else {
      float* out = converted.data() + b * k;
      for (int64_t i = 0; i < k; ++i) out[i] = load(row + i);
      xs[b] = out;
    }
  }
  for (int64_t r0 = 0; r0 < rank; r0 += SPAN) {
    int64_t at[GROUPS];
    for (int64_t g = 0; g < GROUPS; ++g) at[g] = r0 + g * LANES;
    lanes<false>(rows.count, std::min(SPAN, rank - r0), xs, k, a + r0, rank, u_rows, at);
  }
}

// One segment of an adapter's expand for a block: y[row][cols.at(col + j)] += the sum over r
// of b[r][j] * u[row][u0 + r], for j in [0, n).
template <typename W>
void expand_block(const W* bm, int64_t n, int64_t rank, const float* u, int64_t ldu,
                  int64_t u0, Rows rows, float* y, int64_t ldy, int64_t col, Columns cols) {
  const float* u_rows[ROW_BLOCK];
  float* y_rows[ROW_BLOCK];
  for (int64_t b = 0; b < rows.count; ++b) {
    u_rows[b] = u + rows.index[b] * ldu + u0;
    y_rows[b] = y + rows.index[b] * ldy;
  }
  for (int64_t j0 = 0; j0 < n; j0 += SPAN) {
    int64_t at[GROUPS];
    for (int64_t g = 0; g < GROUPS; ++g) at[g] = cols.at(col + j0 + g * LANES);
    lanes<true>(rows.count, std::min(SPAN, n - j0), u_rows, rank, bm + j0, n, y_rows, at);
  }
}

// f(0..items-1), over the threads where `parallel` (a small call stays on this thread: a
// team costs more than the work). Each item's sums are its own either way.
template <typename F>
void for_items(int64_t items, bool parallel, const F& f) {
  if (!parallel) {
    for (int64_t item = 0; item < items; ++item) f(item);
    return;
  }
#pragma omp parallel for schedule(static)
  for (int64_t item = 0; item < items; ++item) f(item);
}

// One work item: a block of one slot's rows.
struct Block {
  const int64_t* slot;
  Rows rows;
};

// Every slot's blocks of rows; `work` += the multiply-adds of the halves `mode` asks for.
std::vector<Block> blocks_of(const std::vector<std::vector<int64_t>>& by_slot,
                             const int64_t* table, int64_t k, int mode, int64_t& work) {
  std::vector<Block> blocks;
  for (size_t s = 0; s < by_slot.size(); ++s) {
    const int64_t* slot = table + s * TABLE_WORDS;
    const int64_t count = static_cast<int64_t>(by_slot[s].size());
    if (count == 0 || slot[1] == 0) continue;
    int64_t per_row = mode & 1 ? k * slot[1] : 0;
    for (int64_t seg = 0; (mode & 2) && seg < MAX_SEGMENTS && slot[2 + 5 * seg + 2]; ++seg)
      per_row += slot[2 + 5 * seg + 2] * slot[2 + 5 * seg + 4];
    work += count * per_row;
    for (int64_t first = 0; first < count; first += ROW_BLOCK)
      blocks.push_back(Block{slot, Rows{by_slot[s].data() + first,
                                        std::min(ROW_BLOCK, count - first)}});
  }
  return blocks;
}

template <typename T, typename W>
int run(const T* x, int64_t rows, int64_t k, int64_t ldx, const int32_t* slots,
        int64_t num_slots, const int64_t* table, float* u, int64_t ldu, float* y, int64_t ldy,
        int mode) {
  std::vector<std::vector<int64_t>> by_slot(num_slots);
  for (int64_t m = 0; m < rows; ++m) {
    if (slots[m] < 0) continue;
    if (slots[m] >= num_slots) return -2;
    by_slot[slots[m]].push_back(m);
  }
  const Columns cols{mode & LORA_PANELS ? ldy / 2 : 0};
  int64_t work = 0;
  const std::vector<Block> blocks = blocks_of(by_slot, table, k, mode, work);
  // NOTE: one team for every slot's blocks (a decode step of many users on a few adapters
  // has many small ones), each block's shrink then its expand
  for_items(static_cast<int64_t>(blocks.size()), work >= PARALLEL_WORK, [&](int64_t i) {
    const Block& bl = blocks[i];
    if (mode & 1)
      shrink_block(x, ldx, k, reinterpret_cast<const W*>(bl.slot[0]), bl.slot[1], bl.rows, u,
                   ldu);
    for (int64_t seg = 0; (mode & 2) && seg < MAX_SEGMENTS; ++seg) {
      const int64_t* e = bl.slot + 2 + 5 * seg;
      if (e[2] == 0) break;
      expand_block(reinterpret_cast<const W*>(e[0]), e[2], e[4], u, ldu, e[3], bl.rows, y, ldy,
                   e[1], cols);
    }
  });
  return 0;
}

}  // namespace

extern "C" {

// x [rows, k] (row stride ldx) in dtype (0 float32, 1 bfloat16); the table's A and B in
// weight_dtype (bfloat16 ones with 16 elements of slack past their end); slots [rows] int32 (-1:
// none); table [num_slots, TABLE_WORDS]; u [rows, ldu] float32, written by the shrink and
// read by the expand; y [rows, ldy] float32, added to by the expand. mode: 1 shrink, 2
// expand (from u as given: at tensor parallel, the ranks' shrinks all-reduced), 3 both; plus
// 4 (LORA_PANELS) where y is a gate/up product's panels (the header's column order).
// Returns 0, -1 for an unknown dtype, -2 for a slot past the table.
int tm_lora(const void* x, int64_t rows, int64_t k, int64_t ldx, int dtype, const int32_t* slots,
            int64_t num_slots, const int64_t* table, float* u, int64_t ldu, float* y,
            int64_t ldy, int mode, int weight_dtype) {
  const auto* xf = static_cast<const float*>(x);
  const auto* xb = static_cast<const uint16_t*>(x);
  const auto args = [&](auto typed_x, auto weight) {
    return run<std::remove_cv_t<std::remove_pointer_t<decltype(typed_x)>>,
               decltype(weight)>(typed_x, rows, k, ldx, slots, num_slots, table, u, ldu, y,
                                 ldy, mode);
  };
  if (dtype == 0 && weight_dtype == 0) return args(xf, 0.0f);
  if (dtype == 0 && weight_dtype == 1) return args(xf, uint16_t{});
  if (dtype == 1 && weight_dtype == 0) return args(xb, 0.0f);
  if (dtype == 1 && weight_dtype == 1) return args(xb, uint16_t{});
  return -1;
}

}  // extern "C"
