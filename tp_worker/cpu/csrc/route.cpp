// A mixture of experts' router on the CPU (tp_worker, via ctypes): each token's top-k experts
// and their weights from its router logits, in an order fixed by this file.
//
// Per row of E logits (float32): p_e = e_e / S with e_e = exp(l_e - max) (exp.h's
// exp_nonpositive) and S their sum over ascending e; the k largest p in descending order, of
// equal p the smaller expert id first (torch.topk names no order for ties); their weights
// p, or (renormalize) p / (the sum of the k, in that order). transformers computes the same
// softmax and top-k (Qwen3-MoE, OLMoE, Mixtral); a row's result depends on the row alone.
// gpt-oss's router instead takes the k largest logits (the same order and tie rule) and
// weighs them by the softmax of those k alone: e_j = exp(l_j - l_best), over their sum in
// top-k order (mode CHOSEN_SOFTMAX).

#include <cstdint>
#include <vector>

#include "exp.h"
#include "kernels.h"

namespace {

constexpr int CHOSEN_SOFTMAX = 2;  // the renormalize argument's third mode

// The k largest of v[0..n) into ids, descending, of equal values the smaller index first.
void top_k(const float* v, int64_t n, int64_t k, int64_t* ids) {
  for (int64_t j = 0; j < k; ++j) {
    int64_t best = -1;
    for (int64_t e = 0; e < n; ++e) {
      bool taken = false;
      for (int64_t i = 0; i < j; ++i) taken = taken || ids[i] == e;
      if (!taken && (best < 0 || v[e] > v[best])) best = e;
    }
    ids[j] = best;
  }
}

void chosen_softmax_row(const float* logits, int64_t experts, int64_t k, int64_t* ids,
                        float* weights) {
  top_k(logits, experts, k, ids);
  float sum = 0.0f;
  for (int64_t j = 0; j < k; ++j) {
    weights[j] = tokenmill::exp_nonpositive(logits[ids[j]] - logits[ids[0]]);
    sum = sum + weights[j];
  }
  for (int64_t j = 0; j < k; ++j) weights[j] = weights[j] / sum;
}

void route_row(const float* logits, int64_t experts, int64_t k, bool renormalize, int64_t* ids,
               float* weights, std::vector<float>& p) {
  float max = logits[0];
  for (int64_t e = 1; e < experts; ++e) max = logits[e] > max ? logits[e] : max;
  float sum = 0.0f;
  for (int64_t e = 0; e < experts; ++e) {
    p[e] = tokenmill::exp_nonpositive(logits[e] - max);
    sum = sum + p[e];
  }
  for (int64_t e = 0; e < experts; ++e) p[e] = p[e] / sum;
  top_k(p.data(), experts, k, ids);
  float kept = 0.0f;
  for (int64_t j = 0; j < k; ++j) {
    weights[j] = p[ids[j]];
    kept = kept + weights[j];
  }
  if (renormalize)
    for (int64_t j = 0; j < k; ++j) weights[j] = weights[j] / kept;
}

}  // namespace

extern "C" {

// logits [tokens, experts] float32 -> ids [tokens, k] int64 and weights [tokens, k] float32
// (see the top); renormalize: 0 no, 1 yes, 2 CHOSEN_SOFTMAX (gpt-oss). Returns 0, or -1 for
// k outside 1..experts.
int tm_route(const float* logits, int64_t tokens, int64_t experts, int64_t k, int renormalize,
             int64_t* ids, float* weights) {
  if (k < 1 || k > experts) return -1;
  std::vector<float> p(experts);
  for (int64_t t = 0; t < tokens; ++t) {
    if (renormalize == CHOSEN_SOFTMAX) {
      chosen_softmax_row(logits + t * experts, experts, k, ids + t * k, weights + t * k);
    } else {
      route_row(logits + t * experts, experts, k, renormalize != 0, ids + t * k, weights + t * k,
                p);
    }
  }
  return 0;
}

}  // extern "C"
