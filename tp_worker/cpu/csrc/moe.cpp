// A mixture of experts' experts over one pass of tokens on the CPU (tp_worker, via ctypes):
// model/moe.py's loop over the experts in one call, with the same bits.
//
// The tokens routed to each expert (ids [T, k], route.cpp's) are gathered, expert by expert
// in ascending id and each expert's in token order, into rows that its gate/up product takes
// at once (its weights stream once for all of them), act(gate) * up in that product's
// epilogue, then its down product in float32 (each with the expert's bias where it has one:
// gpt-oss); each row's sums are its own (linear.cpp's
// rule), so which rows share an expert changes nothing. A token's k outputs are then added,
// weighted, in the order of its top-k: out = o_0 w_0, then out = out + o_j w_j, each product
// and sum rounded to float32 (-ffp-contract=off), as model/moe.py adds them with torch.
//
// Scratch buffers grow once to the largest pass and are reused: the worker calls this from
// one thread.

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "kernels.h"

namespace {

struct Freer {
  void operator()(void* p) const { std::free(p); }
};

// A 64-byte-aligned buffer that only grows.
class Scratch {
 public:
  void* get(size_t bytes) {
    if (bytes > size_) {
      const size_t rounded = (bytes + 63) / 64 * 64;
      data_.reset(std::aligned_alloc(64, rounded));
      size_ = data_ ? rounded : 0;
    }
    return data_.get();
  }

 private:
  std::unique_ptr<void, Freer> data_;
  size_t size_ = 0;
};

// ops.py's product_rows: rows whose length is a multiple of 4 KiB get a cache line more.
int64_t row_stride(int64_t width, int64_t itemsize) {
  return width + ((width * itemsize) % 4096 == 0 ? 64 / itemsize : 0);
}

Scratch rows_in, activated, expert_out, outputs, order;

using Linear = int (*)(const void*, int64_t, int64_t, int64_t, const void*, int64_t,
                       const float*, void*, int64_t, int, int, const void*, int, const void*,
                       int64_t, int64_t);

}  // namespace

extern "C" {

// x [tokens, hidden] (row stride ldx; dtype 0 float32, 1 bfloat16), ids [tokens, k] int64 and
// weights [tokens, k] float32 (route.cpp's), gate_up[e] / down[e]: expert e's packed panels
// (gate/up as glu panels, 2 * inter outputs; down, hidden outputs of inter inputs), out
// [tokens, hidden] float32. gate_up_bias[e] / down_bias[e]: expert e's biases (float32, the
// gate/up one in its panels' order), or both arrays null (no biases; gpt-oss has them).
// activation: silu.h's code; amx: the AMX kernels (bfloat16); then_*: the product that runs
// after the last expert's (null for none).
// Returns 0, or -1 for an expert id out of range or an unsupported product.
int tm_moe_experts(const void* x, int64_t tokens, int64_t hidden, int64_t ldx,
                   const int64_t* ids, const float* weights, int64_t k,
                   const void* const* gate_up, const void* const* down,
                   const float* const* gate_up_bias, const float* const* down_bias,
                   int64_t num_experts, int64_t inter, int dtype, int activation, int amx,
                   float* out, const void* then_packed, int64_t then_n, int64_t then_k) {
  const int64_t itemsize = dtype == 1 ? 2 : 4;
  const int64_t entries = tokens * k;
  std::vector<int64_t> starts(num_experts + 1, 0);
  for (int64_t i = 0; i < entries; ++i) {
    if (ids[i] < 0 || ids[i] >= num_experts) return -1;
    ++starts[ids[i] + 1];
  }
  for (int64_t e = 0; e < num_experts; ++e) starts[e + 1] += starts[e];
  auto* entry = static_cast<int64_t*>(order.get(entries * sizeof(int64_t)));
  std::vector<int64_t> next(starts.begin(), starts.end() - 1);
  for (int64_t i = 0; i < entries; ++i) entry[next[ids[i]]++] = i;  // NOTE: token order

  int64_t most = 0;
  for (int64_t e = 0; e < num_experts; ++e) most = std::max(most, starts[e + 1] - starts[e]);
  const int64_t in_stride = row_stride(hidden, itemsize), act_stride = row_stride(inter, itemsize);
  auto* rows = static_cast<char*>(rows_in.get(most * in_stride * itemsize));
  auto* act = activated.get(most * act_stride * itemsize);
  auto* down_rows = static_cast<float*>(expert_out.get(most * hidden * sizeof(float)));
  auto* each = static_cast<float*>(outputs.get(entries * hidden * sizeof(float)));
  const Linear linear = amx ? tm_linear_amx_then : tm_linear_then;
  const auto* xs = static_cast<const char*>(x);

  std::vector<int64_t> used;
  for (int64_t e = 0; e < num_experts; ++e)
    if (starts[e + 1] > starts[e]) used.push_back(e);
  for (size_t u = 0; u < used.size(); ++u) {
    const int64_t e = used[u], first = starts[e], count = starts[e + 1] - first;
    for (int64_t r = 0; r < count; ++r) {
      const int64_t token = entry[first + r] / k;
      std::memcpy(rows + r * in_stride * itemsize, xs + token * ldx * itemsize,
                  hidden * itemsize);
    }
    // NOTE: each product names the one after it, whose weights the threads then stream in
    // (panel_queue.h): the down product, then the next expert's gate/up.
    if (linear(rows, count, hidden, in_stride, gate_up[e], 2 * inter,
               gate_up_bias ? gate_up_bias[e] : nullptr, act, act_stride, dtype, dtype, nullptr, activation, down[e], hidden,
               inter) != 0)
      return -1;
    const bool last = u + 1 == used.size();
    const void* then = last ? then_packed : gate_up[used[u + 1]];
    if (linear(act, count, inter, act_stride, down[e], hidden,
               down_bias ? down_bias[e] : nullptr, down_rows, hidden,
               dtype, 0, nullptr, 0, then, last ? then_n : 2 * inter, last ? then_k : hidden) != 0)
      return -1;
    for (int64_t r = 0; r < count; ++r)
      std::memcpy(each + entry[first + r] * hidden, down_rows + r * hidden,
                  hidden * sizeof(float));
  }

#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < tokens; ++t) {
    float* o = out + t * hidden;
    const float* first = each + t * k * hidden;
    const float w0 = weights[t * k];
    for (int64_t h = 0; h < hidden; ++h) o[h] = first[h] * w0;
    for (int64_t j = 1; j < k; ++j) {
      const float* part = first + j * hidden;
      const float w = weights[t * k + j];
      for (int64_t h = 0; h < hidden; ++h) {
        const float weighted = part[h] * w;
        o[h] = o[h] + weighted;
      }
    }
  }
  return 0;
}

}  // extern "C"
