// What a float32 log-softmax needs of each row of logits, in one read of the row and without
// writing a [rows, vocab] matrix (tp_worker, via ctypes): the max, the index of its first
// occurrence (the greedy token), and logsum = log(sum over j of exp(x_j - max)), so that
// logprob_j = (x_j - max) - logsum for whichever j the caller wants, as torch's log_softmax
// computes it.
//
// The sum's order is fixed here: lane l of 16 sums exp(x_j - max) over the columns
// j = l (mod 16) below the last whole block of 16, in ascending order: in float32 within each
// run of 256 columns (16 terms a lane), each run's float32 sum then added to the lane's double
// total; the lanes combine by a fixed tree (as tree_sum16's); the leftover columns follow one
// by one, ascending, in double.
// exp(d) is exp.h's exp2_nonpositive(d * log2(e)) in float (d = x_j - max, so the max itself
// adds exactly 1; terms below 2^-125 add +0.0, which no sum of at least 1 would notice); the log
// is taken in double and rounded to float.
// NOTE: why double: a trained model's 49,152-token tail is thousands of terms each below half
// an ulp of a float sum near 1, which float32 lanes drop: the logsum came out low and every
// logprob high, by 6e-6 on average on SmolLM2-135M (torch's float32 log_softmax too); with
// double totals the bias is gone. Runs of 16 float32 terms a lane before the double add keep
// the pass as fast as before (0.97-1.03x, kernel_ab.py; a double add per term cost 27%); a run
// loses a tail term only beside one near 1, in the few runs that hold one.
// So a row's numbers depend on the row alone, and are the same in the AVX-512 and the portable
// form. A row whose max is not finite (a NaN or a +inf logit, or every logit -inf) gets logsum
// NaN, as torch's log_softmax gives NaN there.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "argmax.h"
#include "bf16.h"
#include "exp.h"

namespace {

using tokenmill::exp2_nonpositive;
using tokenmill::LOG2E;
using tokenmill::row_max;
#if defined(__AVX512F__)
using tokenmill::exp2_nonpositive16;
#endif

constexpr int LANES = 16;
constexpr int64_t BLOCK = 16 * LANES;  // columns summed in float32 before the double lanes

float row_logsum(const float* x, int64_t n, float max) {
  if (!std::isfinite(max)) return std::numeric_limits<float>::quiet_NaN();
  const int64_t whole = n / LANES * LANES;
  alignas(64) double lane[LANES] = {};
#if defined(__AVX512F__)
  __m512d low = _mm512_setzero_pd(), high = _mm512_setzero_pd();
  const __m512 m = _mm512_set1_ps(max), to_base2 = _mm512_set1_ps(LOG2E);
  for (int64_t b = 0; b < whole; b += BLOCK) {
    const int64_t end = std::min(whole, b + BLOCK);
    __m512 part = _mm512_setzero_ps();
    for (int64_t j = b; j < end; j += LANES) {
      const __m512 d = _mm512_sub_ps(_mm512_loadu_ps(x + j), m);
      part = _mm512_add_ps(part, exp2_nonpositive16(_mm512_mul_ps(d, to_base2)));
    }
    low = _mm512_add_pd(low, _mm512_cvtps_pd(_mm512_castps512_ps256(part)));
    // NOTE: the upper 8 lanes through a double-typed extract (AVX512F; the float one needs DQ).
    const __m256 upper = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(part), 1));
    high = _mm512_add_pd(high, _mm512_cvtps_pd(upper));
  }
  _mm512_store_pd(lane, low);
  _mm512_store_pd(lane + 8, high);
#else
  for (int64_t b = 0; b < whole; b += BLOCK) {
    const int64_t end = std::min(whole, b + BLOCK);
    float part[LANES] = {};
    for (int64_t j = b; j < end; j += LANES)
      for (int l = 0; l < LANES; ++l)
        part[l] = part[l] + exp2_nonpositive((x[j + l] - max) * LOG2E);
    for (int l = 0; l < LANES; ++l) lane[l] = lane[l] + static_cast<double>(part[l]);
  }
#endif
  for (int width = 8; width > 0; width /= 2)
    for (int l = 0; l < width; ++l) lane[l] = lane[l] + lane[l + width];
  double sum = lane[0];
  for (int64_t j = whole; j < n; ++j)
    sum = sum + static_cast<double>(exp2_nonpositive((x[j] - max) * LOG2E));
  return static_cast<float>(std::log(sum));
}

// The k largest logits of a row (k <= vocab) into ids / values, largest first; of equal
// values the smaller index first (NaN rows are the caller's: it asks only for rows without).
void row_top(const float* x, int64_t n, int64_t k, int32_t* ids, float* values) {
  int64_t filled = 0;
  auto insert = [&](int64_t j) {  // into the sorted prefix, after any equal value
    int64_t at = filled < k ? filled++ : k - 1;
    while (at > 0 && x[j] > values[at - 1]) {
      values[at] = values[at - 1];
      ids[at] = ids[at - 1];
      --at;
    }
    values[at] = x[j];
    ids[at] = static_cast<int32_t>(j);
  };
  int64_t j = 0;
  for (; j < n && filled < k; ++j) insert(j);
#if defined(__AVX512F__)
  // NOTE: most blocks hold nothing above the current k-th value: one compare skips them.
  for (; j + LANES <= n; j += LANES) {
    __mmask16 above = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + j), _mm512_set1_ps(values[k - 1]),
                                         _CMP_GT_OQ);
    for (int l = 0; above; ++l, above >>= 1)
      if ((above & 1) && x[j + l] > values[k - 1]) insert(j + l);
  }
#endif
  for (; j < n; ++j)
    if (x[j] > values[k - 1]) insert(j);
}

}  // namespace

extern "C" {

// logits [rows, vocab] float32, rows row_stride apart; max_out, logsum_out [rows] float32,
// argmax_out [rows] int64; with top > 0 (and <= vocab), the top largest logits of each row
// whose max is not NaN into top_ids [rows, top] int32 and top_values [rows, top] float32.
void tm_log_softmax_stats(const float* logits, int64_t rows, int64_t vocab, int64_t row_stride,
                          float* max_out, int64_t* argmax_out, float* logsum_out, int64_t top,
                          int32_t* top_ids, float* top_values) {
#pragma omp parallel for schedule(static) if (rows * vocab >= (1 << 16))
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = logits + r * row_stride;
    row_max(x, vocab, max_out + r, argmax_out + r);
    logsum_out[r] = row_logsum(x, vocab, max_out[r]);
    if (top > 0 && !std::isnan(max_out[r]))
      row_top(x, vocab, top, top_ids + r * top, top_values + r * top);
  }
}

// The max and argmax alone (tm_log_softmax_stats' first read, the same answers): greedy ids
// where no logprob is read. NOTE: torch's argmax of a [32, 32768] float32 took 1.3 ms on a
// 2-core Xeon, this 0.1-0.2.
void tm_row_argmax(const float* logits, int64_t rows, int64_t vocab, int64_t row_stride,
                   float* max_out, int64_t* argmax_out) {
#pragma omp parallel for schedule(static) if (rows * vocab >= (1 << 16))
  for (int64_t r = 0; r < rows; ++r)
    row_max(logits + r * row_stride, vocab, max_out + r, argmax_out + r);
}

}  // extern "C"
