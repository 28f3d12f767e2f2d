// LoRA deltas on the CPU (tp_worker, via ctypes): for each row m whose adapter slot
// s = slots[m] is not -1, u = A_s x[m] (shrink), then y[m] += B_s u per output segment
// (expand), in float32. Rows of slot -1 are not touched: the base's bits stay its own.
//
// The rule that keeps a row's bits its own in any batch: each u[r] sums its k products in
// ascending k, from +0; each delta d[j] sums its rank products in ascending r, from +0; y
// then adds d once. No sum depends on the other rows, their adapters, the threads or the
// vector width (lanes run over independent sums), and with -ffp-contract=off no multiply
// fuses into an add: the same bits on every x86 machine. The scaling (lora_alpha / r, or
// over sqrt(r) with rslora) is folded into B at load.
//
// The table, per slot, int64 words (TABLE_WORDS): A's address (float32 [k, rank], A
// transposed: the rank of one k side by side), rank (all segments' together), then
// MAX_SEGMENTS times (B's address (float32 [r, n]), first output column, n, first u, r);
// n = 0 ends the segments. A fused projection (q/k/v, gate/up) has one segment per part.

#include <cstdint>
#include <vector>

#include "bf16.h"

namespace {

constexpr int64_t MAX_SEGMENTS = 3;
constexpr int64_t TABLE_WORDS = 2 + 5 * MAX_SEGMENTS;
constexpr int64_t ROW_BLOCK = 4;  // rows whose sums interleave (independent chains)

using tokenmill::load;

template <typename T>
void shrink_rows(const T* const* x, int64_t rows, int64_t k, const float* a, int64_t rank,
                 float* const* u) {
  for (int64_t b = 0; b < rows; ++b) {
    for (int64_t r = 0; r < rank; ++r) u[b][r] = 0.0f;
  }
  for (int64_t i = 0; i < k; ++i) {
    const float* ai = a + i * rank;
    for (int64_t b = 0; b < rows; ++b) {
      const float xi = load(x[b] + i);
      float* ub = u[b];
      for (int64_t r = 0; r < rank; ++r) ub[r] += ai[r] * xi;
    }
  }
}

void expand_row(const float* u, const int64_t* slot, float* y, std::vector<float>& d) {
  for (int64_t s = 0; s < MAX_SEGMENTS; ++s) {
    const int64_t* seg = slot + 2 + 5 * s;
    const int64_t n = seg[2];
    if (n == 0) break;
    const float* b = reinterpret_cast<const float*>(seg[0]);
    const float* us = u + seg[3];
    float* ys = y + seg[1];
    d.assign(n, 0.0f);
    float* dp = d.data();
    for (int64_t r = 0; r < seg[4]; ++r) {
      const float ur = us[r];
      const float* br = b + r * n;
      for (int64_t j = 0; j < n; ++j) dp[j] += br[j] * ur;
    }
    for (int64_t j = 0; j < n; ++j) ys[j] += dp[j];
  }
}

// The rows of one slot, in blocks of ROW_BLOCK: [first, end) of `order`.
template <typename T>
void shrink(const T* x, int64_t ldx, int64_t k, const int64_t* slot, const int64_t* order,
            int64_t count, float* u, int64_t ldu) {
  const float* a = reinterpret_cast<const float*>(slot[0]);
  const int64_t rank = slot[1];
#pragma omp parallel for schedule(static) if (count * k * rank >= (1 << 18))
  for (int64_t first = 0; first < count; first += ROW_BLOCK) {
    const int64_t n = first + ROW_BLOCK <= count ? ROW_BLOCK : count - first;
    const T* xs[ROW_BLOCK];
    float* us[ROW_BLOCK];
    for (int64_t b = 0; b < n; ++b) {
      xs[b] = x + order[first + b] * ldx;
      us[b] = u + order[first + b] * ldu;
    }
    shrink_rows(xs, n, k, a, rank, us);
  }
}

template <typename T>
int run(const T* x, int64_t rows, int64_t k, int64_t ldx, const int32_t* slots,
        int64_t num_slots, const int64_t* table, float* u, int64_t ldu, float* y, int64_t ldy,
        int mode) {
  // NOTE: rows grouped by slot so that one slot's A streams once per block of rows
  std::vector<std::vector<int64_t>> by_slot(num_slots);
  for (int64_t m = 0; m < rows; ++m) {
    if (slots[m] < 0) continue;
    if (slots[m] >= num_slots) return -2;
    by_slot[slots[m]].push_back(m);
  }
  if (mode & 1) {
    for (int64_t s = 0; s < num_slots; ++s) {
      if (!by_slot[s].empty()) {
        shrink(x, ldx, k, table + s * TABLE_WORDS, by_slot[s].data(),
               static_cast<int64_t>(by_slot[s].size()), u, ldu);
      }
    }
  }
  if (mode & 2) {
#pragma omp parallel if (rows * ldy >= (1 << 16))
    {
      std::vector<float> d;
#pragma omp for schedule(static)
      for (int64_t m = 0; m < rows; ++m) {
        if (slots[m] >= 0) expand_row(u + m * ldu, table + slots[m] * TABLE_WORDS, y + m * ldy, d);
      }
    }
  }
  return 0;
}

}  // namespace

extern "C" {

// x [rows, k] (row stride ldx) in dtype (0 float32, 1 bfloat16); slots [rows] int32 (-1:
// none); table [num_slots, TABLE_WORDS]; u [rows, ldu] float32, written by the shrink and
// read by the expand; y [rows, ldy] float32, added to by the expand. mode: 1 shrink, 2
// expand (from u as given: at tensor parallel, the ranks' shrinks all-reduced), 3 both.
// Returns 0, -1 for an unknown dtype, -2 for a slot past the table.
int tm_lora(const void* x, int64_t rows, int64_t k, int64_t ldx, int dtype, const int32_t* slots,
            int64_t num_slots, const int64_t* table, float* u, int64_t ldu, float* y,
            int64_t ldy, int mode) {
  if (dtype == 0) {
    return run(static_cast<const float*>(x), rows, k, ldx, slots, num_slots, table, u, ldu, y,
               ldy, mode);
  }
  if (dtype == 1) {
    return run(static_cast<const uint16_t*>(x), rows, k, ldx, slots, num_slots, table, u, ldu,
               y, ldy, mode);
  }
  return -1;
}

}  // extern "C"
