// Random sampling of one token per row: temperature, top-k, top-p and min-p, then the
// exponential race (tp_worker, via ctypes). The torch path in sampling.py states the
// distribution; this is the same distribution and the same noise, computed per row without
// a sort of the vocabulary or any [rows, vocab] temporary.
//
// Per row, with s_j = logit_j / T and m = max s:
//   e_j = exp(s_j - m) (exp.h's), so the most likely token has e = 1 exactly;
//   the kept tokens are a prefix of the order "larger e first, of equal e the smaller id":
//   at most top_k of them, and (top-p) those whose mass before them, the sum of e over the
//   tokens ahead in that order, is below top_p x the mass of the top-k set; min-p then drops
//   the kept tokens with e < min_p (e relative to the kept maximum, which is 1);
//   the sampled id is the kept j with the largest e_j / E_j, E_j = -log(u_j) the hash noise
//   of sampling.py (exponential_noise), the smaller id on a tie (tokens whose e_j is too
//   small for any noise to make them win are not raced: race_tokens).
// Masses are summed in double: per bucket in ascending id, buckets in descending order (the
// cut is found by radix selection on e's bits, 11 + 11 + 10 bits), ties at the cut in
// ascending id; the whole vocabulary's mass (top-p without top-k) in mass_of's 32 lanes, a
// top-k set's in ascending id. Everything depends on the row, its parameters, its seed and
// its position alone: not on the batch, the thread count or the CPU (no library math; log
// is ours).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "argmax.h"
#include "exp.h"

namespace {

using tokenmill::exp_nonpositive;
using tokenmill::row_max;
#if defined(__AVX512F__)
using tokenmill::exp_nonpositive16;
#endif

constexpr int64_t LANES = 16;

uint32_t mix(uint32_t x) {  // lowbias32, as sampling.py's _mix
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  return x ^ (x >> 16);
}

uint32_t row_key(int64_t seed, int64_t position) {
  const uint64_t s = static_cast<uint64_t>(seed);
  uint32_t key = static_cast<uint32_t>(s) ^ mix(static_cast<uint32_t>(s >> 32));
  return mix(key + static_cast<uint32_t>(static_cast<uint64_t>(position) * 0x9E3779B1u));
}

// -log(u) for u in (0, 1): u = 2^n f with f in [sqrt(1/2), sqrt(2)), log f = 2 atanh(t),
// t = (f - 1) / (f + 1), |t| < 0.172, by its odd series to t^11 (error below float's ulp).
float neg_log_unit(float u) {
  uint32_t bits;
  std::memcpy(&bits, &u, 4);
  int32_t n = static_cast<int32_t>(bits >> 23) - 127;
  uint32_t mant = (bits & 0x007FFFFFu) | 0x3F800000u;
  float f;
  std::memcpy(&f, &mant, 4);
  const bool high = f > 1.41421356f;
  f = high ? f * 0.5f : f;
  n = high ? n + 1 : n;
  const float t = (f - 1.0f) / (f + 1.0f);
  const float t2 = t * t;
  float p = 0.0909090909f;
  p = p * t2 + 0.111111111f;
  p = p * t2 + 0.142857143f;
  p = p * t2 + 0.2f;
  p = p * t2 + 0.333333333f;
  p = p * t2 + 1.0f;
  const float log_f = 2.0f * t * p;
  return -(static_cast<float>(n) * 0.693147181f + log_f);
}

// NOTE: inlined where it is called, or the race's loop does not vectorise (gcc leaves a call
// to it in the loop once it has two callers).
[[gnu::always_inline]] inline float noise(uint32_t key, int64_t token) {
  const uint32_t bits = mix(mix(key ^ (static_cast<uint32_t>(token) * 0x85EBCA77u)));
  // NOTE: the grid's top step one down, as sampling.py takes it: (2^24 - 1) + 0.5 rounds to
  // 2^24 in float32, u = 1 and a noise of -0.0. In arithmetic, not a min or a branch, which
  // keep gcc from vectorising the race.
  const uint32_t raw = bits >> 8;
  const uint32_t step = raw - ((raw + 1) >> 24);
  const float u = (static_cast<float>(step) + 0.5f) * (1.0f / 16777216.0f);
  return neg_log_unit(u);
}

uint32_t bits_of(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return b;
}

// A prefix of the order (larger e first, then smaller id): the tokens with bits(e) > above,
// and the first `ties` (in ascending id) of those with bits(e) == above.
struct Cut {
  uint32_t above = 0;
  int64_t ties = std::numeric_limits<int64_t>::max();  // default: everything kept
  bool shorter_than(const Cut& o) const {
    return above > o.above || (above == o.above && ties < o.ties);
  }
};

// The cut that keeps at most `count` tokens (count >= 1) and stops at the first token whose
// mass before it is >= mass_limit (with no limit: infinity). e >= 0 everywhere.
Cut find_cut(const float* e, int64_t n, int64_t count, double mass_limit) {
  std::vector<int32_t> members(n), next;
  for (int64_t j = 0; j < n; ++j) members[j] = static_cast<int32_t>(j);
  uint32_t prefix = 0;      // the bits fixed so far
  int64_t count_ahead = 0;  // tokens in the buckets before the current one
  double mass_ahead = 0.0;
  const int shifts[3] = {21, 10, 0};
  const int widths[3] = {11, 11, 10};
  for (int level = 0; level < 3; ++level) {
    const int shift = shifts[level];
    const uint32_t mask = (1u << widths[level]) - 1;
    std::vector<int64_t> counts(mask + 1, 0);
    std::vector<double> masses(mask + 1, 0.0);
    for (int32_t j : members) {
      const uint32_t b = (bits_of(e[j]) >> shift) & mask;
      counts[b] += 1;
      masses[b] += e[j];
    }
    int64_t b = mask;
    for (; b > 0; --b) {
      if (counts[b] == 0) continue;
      if (count_ahead + counts[b] >= count || mass_ahead + masses[b] >= mass_limit) break;
      count_ahead += counts[b];
      mass_ahead += masses[b];
    }
    prefix |= static_cast<uint32_t>(b) << shift;
    next.clear();
    for (int32_t j : members)
      if (((bits_of(e[j]) >> shift) & mask) == static_cast<uint32_t>(b)) next.push_back(j);
    members.swap(next);
  }
  // members: the tokens whose e is exactly the cut value, in ascending id.
  Cut cut;
  cut.above = prefix;
  cut.ties = 0;
  for (int32_t j : members) {
    if (count_ahead >= count || mass_ahead >= mass_limit) break;
    cut.ties += 1;
    count_ahead += 1;
    mass_ahead += e[j];
  }
  return cut;
}

// The sum of e[0..n) in double: MASS_LANES partial sums (j mod MASS_LANES, j ascending),
// combined pairwise by halves. Lane-wise, so that it vectorises (a serial sum of a 32K
// vocabulary waits on each add: ~0.05 ms a row).
constexpr int64_t MASS_LANES = 32;

double mass_of(const float* e, int64_t n) {
  double lane[MASS_LANES] = {};
  int64_t j0 = 0;
  for (; j0 + MASS_LANES <= n; j0 += MASS_LANES)
    for (int64_t l = 0; l < MASS_LANES; ++l) lane[l] += static_cast<double>(e[j0 + l]);
  for (int64_t l = 0; j0 + l < n; ++l) lane[l] += static_cast<double>(e[j0 + l]);
  for (int64_t width = MASS_LANES / 2; width > 0; width /= 2)
    for (int64_t l = 0; l < width; ++l) lane[l] += lane[l + width];
  return lane[0];
}

bool kept_by(const Cut& cut, float e, int64_t& ties_seen) {
  const uint32_t b = bits_of(e);
  if (b != cut.above) return b > cut.above;
  return ties_seen++ < cut.ties;
}

void exp_shifted(float* e, int64_t n, float m) {  // e[j] = exp(e[j] - m), in place
  int64_t j = 0;
#if defined(__AVX512F__)
  const __m512 shift = _mm512_set1_ps(m);
  for (; j + LANES <= n; j += LANES)
    _mm512_storeu_ps(e + j, exp_nonpositive16(_mm512_sub_ps(_mm512_loadu_ps(e + j), shift)));
#endif
  for (; j < n; ++j) e[j] = exp_nonpositive(e[j] - m);
}

// No noise is below -log(1 - 2^-23) ~ 2^-23 (u <= 1 - 2^-23, noise()'s top step); a quarter
// of it, for rounding's sake.
constexpr float NOISE_FLOOR = 0x1p-25f;
constexpr int64_t RACE_BLOCK = 256;

// Whether any of e[0..n) is >= x.
bool any_at_least(const float* e, int64_t n, float x) {
#if defined(__AVX512F__)
  if (n == RACE_BLOCK) {
    const __m512 bound = _mm512_set1_ps(x);
    __mmask16 found = 0;
    for (int64_t j = 0; j < RACE_BLOCK; j += LANES)
      found |= _mm512_cmp_ps_mask(_mm512_loadu_ps(e + j), bound, _CMP_GE_OQ);
    return found != 0;
  }
#endif
  for (int64_t j = 0; j < n; ++j)
    if (e[j] >= x) return true;
  return false;
}

// race[j] = e[j] / noise(key, j), except for tokens that cannot win, which get -1 without
// their noise: the top token (e = 1, noise top_noise) races 1 / top_noise, and a token with
// e_j < NOISE_FLOOR / top_noise races below it whatever its noise. So the winner is the same
// as with every race computed, and a peaked distribution (most of the vocabulary far below
// its top) skips most of the noise, the race's costly part.
void race_tokens(const float* e, int64_t vocab, uint32_t key, float top_noise, float* race) {
  const float hopeless = NOISE_FLOOR / top_noise;
  int64_t in_it = 0;
  for (int64_t j = 0; j < vocab; ++j) in_it += e[j] >= hopeless ? 1 : 0;
  // NOTE: where most tokens can win (a flat distribution), one plain loop: the blocks' checks
  // cost ~10% there, for nothing.
  if (in_it * 4 > vocab) {
    for (int64_t j = 0; j < vocab; ++j) race[j] = e[j] / noise(key, j);
    return;
  }
  for (int64_t j0 = 0; j0 < vocab; j0 += RACE_BLOCK) {
    const int64_t j1 = std::min<int64_t>(vocab, j0 + RACE_BLOCK);
    if (any_at_least(e + j0, j1 - j0, hopeless)) {
      for (int64_t j = j0; j < j1; ++j) race[j] = e[j] / noise(key, j);
    } else {
      for (int64_t j = j0; j < j1; ++j) race[j] = -1.0f;
    }
  }
}

int64_t sample_row(const float* logits, int64_t vocab, float temperature, int64_t top_k,
                   float top_p, float min_p, uint32_t key, float* e, float* race) {
  for (int64_t j = 0; j < vocab; ++j) e[j] = logits[j] / temperature;
  float m;
  int64_t at;
  row_max(e, vocab, &m, &at);
  if (!std::isfinite(m)) {  // a NaN, +inf or nothing finite: torch's argmax of the logits
    row_max(logits, vocab, &m, &at);
    return at;
  }
  exp_shifted(e, vocab, m);
  Cut cut;
  const bool by_count = top_k > 0 && top_k < vocab;
  if (by_count) cut = find_cut(e, vocab, top_k, std::numeric_limits<double>::infinity());
  if (top_p < 1.0f) {
    double kept_mass = by_count ? 0.0 : mass_of(e, vocab);  // the top-k set's mass
    int64_t ties_seen = 0;
    if (by_count)  // NOTE: in ascending id
      for (int64_t j = 0; j < vocab; ++j)
        if (kept_by(cut, e[j], ties_seen)) kept_mass += e[j];
    const Cut by_mass = find_cut(e, vocab, vocab, static_cast<double>(top_p) * kept_mass);
    if (by_mass.shorter_than(cut)) cut = by_mass;
  }
  // NOTE: the race of every token that can win, in loops the compiler vectorises; the
  // filtered ones then get -1 (a kept token's race is >= 0, and the top token's > 0).
  race_tokens(e, vocab, key, noise(key, at), race);
  if (by_count || top_p < 1.0f || min_p > 0.0f) {
    int64_t ties_seen = 0;
    for (int64_t j = 0; j < vocab; ++j)
      if (!kept_by(cut, e[j], ties_seen) || e[j] < min_p) race[j] = -1.0f;
  }
  float best;
  int64_t best_at;
  row_max(race, vocab, &best, &best_at);
  return best_at;
}

}  // namespace

extern "C" {

// logits [*, vocab] float32, rows row_stride apart; for each of `count` rows (rows[i]), its
// temperature (> 0), top_k (0 = off), top_p (1 = off), min_p (0 = off), seed and position
// (of the token being sampled) -> out[i], the sampled id.
void tm_sample(const float* logits, int64_t vocab, int64_t row_stride, const int64_t* rows,
               int64_t count, const float* temperature, const int64_t* top_k, const float* top_p,
               const float* min_p, const int64_t* seed, const int64_t* position, int64_t* out) {
#pragma omp parallel if (count * vocab >= (1 << 16))
  {
    std::vector<float> e(vocab), race(vocab);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < count; ++i)
      out[i] = sample_row(logits + rows[i] * row_stride, vocab, temperature[i], top_k[i],
                          top_p[i], min_p[i], row_key(seed[i], position[i]), e.data(),
                          race.data());
  }
}

}  // extern "C"
