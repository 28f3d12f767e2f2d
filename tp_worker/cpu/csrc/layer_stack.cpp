// The decoder layers of one step in one call (tp_worker, via ctypes: cpu/layer_stack.py).
//
// The same kernels, in the same order, on the same operands as model/decoder.py's DecoderLayer runs
// them through ctypes one by one, so every bit is the one the Python loop computes: RMSNorm,
// the fused q/k/v product, the per-head q/k norms where the model has them, RoPE and the KV
// write, paged attention, the output product added to the float32 residual stream in its
// epilogue, RMSNorm, act(gate) x up in the gate/up product's epilogue, the down product added in its epilogue
// (or, in a mixture of experts' layer, the router, the top-k and the experts: run_experts). What goes is what lay between
// them: at one decode row, a layer's eight calls cost more in Python and ctypes (argument
// conversion, torch's allocations and views) than RMSNorm, RoPE and attention take to run.
//
// The residual stream x is updated in place: a residual epilogue reads each element before
// it writes the same element (epilogue.h), on the thread that owns its panel. Each product is
// told which product runs next (tm_linear_then), so that each thread streams in its first
// panel of that one under its last panel of this one (panel_queue.h's NextProduct).

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "bf16.h"
#include "kernels.h"

namespace {

template <typename T>
inline const void* at(int64_t address) {
  return reinterpret_cast<const T*>(static_cast<uintptr_t>(address));
}

inline void* mutable_at(int64_t address) {
  return reinterpret_cast<void*>(static_cast<uintptr_t>(address));
}

// A layer's row of the weights table (int64 addresses; 0 for no bias), cpu/layer_stack.py's order.
// Q_NORM and K_NORM: the norms of q and k before RoPE (Shape's qk_norm says over what), or
// both 0. INPUT_NORM and POST_NORM (before attention, before the MLP) are 0 where the model has
// none (OLMo 2: the residual stream is rounded into the product's rows instead); ATTN_OUT_NORM
// and MLP_OUT_NORM, where nonzero, norm the attention's and the MLP's outputs before the
// residual add (OLMo 2, Gemma 2 and 3). WINDOW is not an address: the layer's sliding window
// (0 none), and LOCAL_ROPE 1 where the layer rotates by the local RoPE table (Gemma 3's
// sliding layers), else 0.
// ROUTER: a mixture of experts' layer's router (its packed panels; 0 in a dense layer, whose
// GATE_UP and DOWN run instead), EXPERTS the address of its experts' panels (num_experts
// gate/up addresses, then num_experts down ones), MOE_INDEX its place among the MoE layers
// (where Scratch.routed keeps each one's routing).
// gpt-oss's parts, 0 where a model has none: SINKS each query head's sink logit (float32),
// O_BIAS the output product's bias, ROUTER_BIAS the router's, EXPERT_BIASES the address of
// num_experts gate/up bias addresses, then num_experts down ones (float32, as packed).
// LORA_QKV, LORA_O, LORA_GATE_UP, LORA_DOWN: the adapters' tables of those products
// (csrc/lora.cpp's layout, one row per slot), 0 where LoRA is off or a product has none.
// QUANTIZED is not an address: a bit per product (QuantBit) whose weights are a GGUF file's
// blocks, its field then the panels' table that tm_quant_linear_then takes.
enum Field {
  INPUT_NORM, QKV, QKV_BIAS, O, POST_NORM, GATE_UP, DOWN, K_CACHE, V_CACHE, Q_NORM, K_NORM,
  ATTN_OUT_NORM, MLP_OUT_NORM, WINDOW, LOCAL_ROPE, ROUTER, EXPERTS, MOE_INDEX, SINKS, O_BIAS,
  ROUTER_BIAS, EXPERT_BIASES, LORA_QKV, LORA_O, LORA_GATE_UP, LORA_DOWN, QUANTIZED, FIELDS
};
enum QuantBit { QKV_BIT = 1, O_BIT = 2, GATE_UP_BIT = 4, DOWN_BIT = 8 };

// The model's shape, cpu/layer_stack.py's order.
// qk_norm: 1 per head, 2 per projection; activation: silu.h's code for the gate/up epilogue;
// the experts (0 where none): their count, the k a token takes, each one's width, whether
// the k weights are renormalized, and the tokens a pass through them takes at most
// (model/moe.py's TOKENS_PER_PASS).
struct Shape {
  int64_t hidden, heads, kv_heads, head_dim, inter, dtype, linear_amx, attention_amx,
      activation, head_stride, slot_stride, rotary_dim, qk_norm, experts, top_k, moe_inter,
      renormalize, pass_tokens;
};

// The step's RoPE tables (cos, sin [tokens, rotary_dim]): the global one, and the local one
// (the global one again where the model has one table).
struct Rope {
  const void *cos, *sin, *local_cos, *local_sin;
};

// The step's attention plan (cpu/attention.py's PagedAttention's tensors).
struct Plan {
  const int32_t* table;
  int64_t table_stride;
  const int64_t *rows, *token_starts, *num_tokens, *first_pos;
  int64_t num_rows;
};

// Where a layer's intermediate rows go (cpu/layer_stack.py plans them once per step, laid out as
// the products read them: cpu/ops.py's product_rows).
struct Scratch {
  void* normed;
  int64_t normed_stride;
  void* qkv;  // [T, (heads + 2 kv_heads) * head_dim], contiguous
  void* q;  // [T, heads, head_dim], contiguous
  void* attended;  // [T, heads * head_dim], contiguous (the attention kernel's layout)
  void* attended_rows;  // null, or attended copied into rows that do not alias in L1
  int64_t attended_stride;
  void* activated;  // [T, inter]
  int64_t activated_stride;
  float* logits;  // [T, experts] the router's, float32 (null without experts)
  int64_t* ids;  // [T, top_k] each token's experts
  float* weights;  // [T, top_k] their weights
  float* moe_out;  // [T, hidden] the experts' weighted sum
  int64_t* routed;  // [MoE layers, T, top_k] every MoE layer's ids, or null (not kept)
  // With adapters (null without): u [T, lora_u_stride], a product's float32 output y
  // [T, widest product but gate/up] and the gate/up one's in its panel order [T, 2 inter]
  float* lora_u;
  int64_t lora_u_stride;
  float* lora_y;
  float* lora_gate_up;
};

// The step's adapter of each token (csrc/lora.cpp's slots; null: no token has one).
struct Lora {
  const int32_t* slots;
  int64_t num_slots;

  // The table of a layer's product where this step adds its adapters' deltas, else null.
  const int64_t* table(const int64_t* w, int64_t field) const {
    return slots != nullptr && w[field] != 0 ? static_cast<const int64_t*>(at<int64_t>(w[field]))
                                             : nullptr;
  }
};

// y [tokens, n] float32 += each token's adapter delta for `in` (csrc/lora.cpp; the
// adapters' weights are in the model's dtype, as `in` is); `panels`: y is a gate/up
// product's panels.
int add_deltas(const Lora& l, const int64_t* table, const void* in, int64_t tokens, int64_t k,
               int64_t lda, const Scratch& b, float* y, int64_t n, int dtype,
               bool panels = false) {
  constexpr int both = 3, in_panels = 4;  // NOTE: csrc/lora.cpp's modes
  return tm_lora(in, tokens, k, lda, dtype, l.slots, l.num_slots, table, b.lora_u,
                 b.lora_u_stride, y, n, both | (panels ? in_panels : 0), dtype);
}

// cpu/ops.py's row_stride: a lone row's stride is its width.
inline int64_t row_stride(int64_t rows, int64_t stride, int64_t width) {
  return rows > 1 ? stride : width;
}

// The residual stream x normed (norm nonzero) or rounded (0) into the scratch rows a product
// reads.
int norm_or_cast(float* x, int64_t norm, const Scratch& b, int64_t tokens, int64_t hidden,
                 float eps, int dtype) {
  if (norm == 0) return tm_cast_rows(x, b.normed, tokens, hidden, b.normed_stride, dtype);
  return tm_rms_norm(x, at<void>(norm), b.normed, tokens, hidden, b.normed_stride, eps, dtype, 0);
}

using Linear = int (*)(const void*, int64_t, int64_t, int64_t, const void*, int64_t, const float*,
                       void*, int64_t, int, int, const void*, int, const void*, int64_t,
                       int64_t);

// residual_product with adapters (model/parallel.py's ShardedLinear._with_lora): the product's
// float32 output, each token's delta added, then x + y, or (out_norm) y rounded, normed and
// added as tm_norm_add adds it.
int adapted_residual_product(Linear linear, const void* in, int64_t tokens, int64_t k,
                             int64_t lda, int64_t weight, const float* bias, int64_t out_norm,
                             const Shape& s, const Scratch& b, float* x, float eps, int64_t then,
                             int64_t then_n, int64_t then_k, const Lora& lora,
                             const int64_t* table) {
  const int dtype = static_cast<int>(s.dtype);
  int status = linear(in, tokens, k, lda, at<void>(weight), s.hidden, bias, b.lora_y, s.hidden,
                      dtype, 0, nullptr, 0, at<void>(then), then_n, then_k);
  status |= add_deltas(lora, table, in, tokens, k, lda, b, b.lora_y, s.hidden, dtype);
  if (out_norm == 0) {
    const int64_t elements = tokens * s.hidden;
#pragma omp parallel for schedule(static) if (elements >= (1 << 14))
    for (int64_t i = 0; i < elements; ++i) x[i] = x[i] + b.lora_y[i];
    return status;
  }
  const int64_t ldc = row_stride(tokens, b.normed_stride, s.hidden);
  status |= tm_cast_rows(b.lora_y, b.normed, tokens, s.hidden, ldc, dtype);
  return status | tm_norm_add(b.normed, at<void>(out_norm), x, tokens, s.hidden, ldc, eps, dtype);
}

// The gate/up product with adapters: its float32 sums (in the panel order: cpu/ops.py's
// gate_up_panels), each token's delta added there, then act(gate) * up rounded once into the
// activated rows (tm_glu_mul_panels: the bits of the fused epilogue over the same sums).
int adapted_gate_up(Linear linear, const int64_t* w, int64_t then, const Shape& s,
                    const Scratch& b, int64_t tokens, int64_t normed_lda, const Lora& lora,
                    const int64_t* table) {
  const int dtype = static_cast<int>(s.dtype);
  const int64_t width = 2 * s.inter;
  int status = linear(b.normed, tokens, s.hidden, normed_lda, at<void>(w[GATE_UP]), width,
                      nullptr, b.lora_gate_up, width, dtype, 0, nullptr, 0, at<void>(then),
                      s.hidden, s.inter);
  status |= add_deltas(lora, table, b.normed, tokens, s.hidden, normed_lda, b, b.lora_gate_up,
                       width, dtype, true);
  return status | tm_glu_mul_panels(b.lora_gate_up, b.activated, tokens, s.inter,
                                    b.activated_stride, dtype, static_cast<int>(s.activation));
}

// x += the product of `in` and `weight` [hidden x k] (+ bias, 0 for none): in its epilogue,
// or (out_norm nonzero) through the scratch rows and tm_norm_add.
int residual_product(Linear linear, const void* in, int64_t tokens, int64_t k, int64_t lda,
                     int64_t weight, int64_t bias, int64_t out_norm, const Shape& s,
                     const Scratch& b, float* x, float eps, int64_t then, int64_t then_n,
                     int64_t then_k, const Lora& lora, const int64_t* table) {
  const int dtype = static_cast<int>(s.dtype);
  const auto* added = static_cast<const float*>(at<float>(bias));
  if (table != nullptr)
    return adapted_residual_product(linear, in, tokens, k, lda, weight, added, out_norm, s, b,
                                    x, eps, then, then_n, then_k, lora, table);
  if (out_norm == 0)
    return linear(in, tokens, k, lda, at<void>(weight), s.hidden, added, x, s.hidden, dtype, 0,
                  x, 0, at<void>(then), then_n, then_k);
  const int64_t ldc = row_stride(tokens, b.normed_stride, s.hidden);
  int status = linear(in, tokens, k, lda, at<void>(weight), s.hidden, added, b.normed, ldc,
                      dtype, dtype, nullptr, 0, at<void>(then), then_n, then_k);
  return status | tm_norm_add(b.normed, at<void>(out_norm), x, tokens, s.hidden, ldc, eps, dtype);
}

// A mixture of experts' layer after attention (model/moe.py's SparseMoe, the same kernels in
// the same order): the router's logits in float32, rounded to the model's dtype as
// transformers computes them, each token's top-k (tm_route), the experts in passes
// (tm_moe_experts), their sum added to the residual stream.
int run_experts(const int64_t* w, const Shape& s, const Scratch& b, float* x, int64_t tokens,
                int64_t normed_lda, Linear linear, int64_t next_qkv) {
  const int dtype = static_cast<int>(s.dtype);
  int status = linear(b.normed, tokens, s.hidden, normed_lda, at<void>(w[ROUTER]), s.experts,
                      static_cast<const float*>(at<float>(w[ROUTER_BIAS])), b.logits, s.experts,
                      dtype, 0, nullptr, 0, nullptr, 0, 0);
  if (dtype == 1)
    for (int64_t i = 0; i < tokens * s.experts; ++i)
      b.logits[i] = tokenmill::round_to(b.logits[i], static_cast<const uint16_t*>(nullptr));
  status |= tm_route(b.logits, tokens, s.experts, s.top_k, static_cast<int>(s.renormalize),
                     b.ids, b.weights);
  if (status != 0) return status;
  if (b.routed != nullptr)
    std::memcpy(b.routed + w[MOE_INDEX] * tokens * s.top_k, b.ids,
                tokens * s.top_k * sizeof(int64_t));
  const auto* panels = static_cast<const void* const*>(at<void>(w[EXPERTS]));
  const auto* biases = static_cast<const float* const*>(at<void>(w[EXPERT_BIASES]));
  const int64_t elem = dtype == 0 ? 4 : 2, qkv_n = (s.heads + 2 * s.kv_heads) * s.head_dim;
  for (int64_t first = 0; first < tokens; first += s.pass_tokens) {
    const int64_t count = std::min(s.pass_tokens, tokens - first);
    const bool last = first + count == tokens;
    status |= tm_moe_experts(
        static_cast<const char*>(b.normed) + first * b.normed_stride * elem, count, s.hidden,
        row_stride(count, b.normed_stride, s.hidden), b.ids + first * s.top_k,
        b.weights + first * s.top_k, s.top_k, panels, panels + s.experts, biases,
        biases ? biases + s.experts : nullptr, s.experts, s.moe_inter, dtype, static_cast<int>(s.activation), static_cast<int>(s.linear_amx),
        b.moe_out + first * s.hidden, last ? at<void>(next_qkv) : nullptr, qkv_n, s.hidden);
  }
  const int64_t elements = tokens * s.hidden;
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < elements; ++i) x[i] = x[i] + b.moe_out[i];
  return status;
}

// A layer's products: the dense kernel (Shape's, on AMX or not), or tm_quant_linear_then where
// a product's weights are blocks (QUANTIZED); and what a product streams in under its last
// panels, none where the next product's weights are blocks (their table is no panel).
struct Products {
  const int64_t* w;
  Linear dense;

  Linear of(int bit) const { return (w[QUANTIZED] & bit) ? tm_quant_linear_then : dense; }
  int64_t then(Field field, int bit) const { return (w[QUANTIZED] & bit) ? 0 : w[field]; }
};

// `next_qkv`: the next layer's q/k/v panels, or 0 after the last layer of the call (or where
// they are blocks).
int run_layer(const int64_t* w, const Shape& s, const Plan& p, const Scratch& b, float* x,
              int64_t tokens, const Rope& rope, const int64_t* slots, float eps, float scale,
              float softcap, int64_t next_qkv, const Lora& lora) {
  const Products products{w, s.linear_amx ? tm_linear_amx_then : tm_linear_then};
  const Linear qkv_product = products.of(QKV_BIT);
  auto* attention = s.attention_amx ? tm_paged_attention_amx : tm_paged_attention;
  const int dtype = static_cast<int>(s.dtype);
  const int64_t qkv_n = (s.heads + 2 * s.kv_heads) * s.head_dim, q_width = s.heads * s.head_dim;
  const int64_t normed_lda = row_stride(tokens, b.normed_stride, s.hidden);
  int status = norm_or_cast(x, w[INPUT_NORM], b, tokens, s.hidden, eps, dtype);
  const auto* qkv_bias = static_cast<const float*>(at<float>(w[QKV_BIAS]));
  if (const int64_t* table = lora.table(w, LORA_QKV)) {
    status |= qkv_product(b.normed, tokens, s.hidden, normed_lda, at<void>(w[QKV]), qkv_n,
                          qkv_bias, b.lora_y, qkv_n, dtype, 0, nullptr, 0,
                          at<void>(products.then(O, O_BIT)), s.hidden, q_width);
    status |= add_deltas(lora, table, b.normed, tokens, s.hidden, normed_lda, b, b.lora_y, qkv_n,
                          dtype);
    status |= tm_cast_rows(b.lora_y, b.qkv, tokens, qkv_n, qkv_n, dtype);
  } else {
    status |= qkv_product(b.normed, tokens, s.hidden, normed_lda, at<void>(w[QKV]), qkv_n,
                          qkv_bias, b.qkv, qkv_n, dtype, dtype, nullptr, 0,
                          at<void>(products.then(O, O_BIT)), s.hidden, q_width);
  }
  if (w[Q_NORM] != 0) {
    const bool whole = s.qk_norm == 2;
    status |= tm_head_norm(b.qkv, tokens, qkv_n, whole ? 1 : s.heads,
                           whole ? q_width : s.head_dim, whole ? 1 : s.kv_heads,
                           whole ? s.kv_heads * s.head_dim : s.head_dim, at<void>(w[Q_NORM]),
                           at<void>(w[K_NORM]), eps, dtype);
  }
  const bool local = w[LOCAL_ROPE] != 0;
  status |= tm_rope_store_partial(b.qkv, local ? rope.local_cos : rope.cos,
                                  local ? rope.local_sin : rope.sin, slots, b.q,
                                  mutable_at(w[K_CACHE]),
                                  mutable_at(w[V_CACHE]), tokens, s.heads, s.kv_heads,
                                  s.head_dim, s.rotary_dim, s.head_stride, s.slot_stride, dtype);
  status |= attention(b.q, at<void>(w[K_CACHE]), at<void>(w[V_CACHE]), p.table, p.rows,
                      p.token_starts, p.num_tokens, p.first_pos, b.attended, p.num_rows, s.heads,
                      s.kv_heads, s.head_dim, s.head_stride, s.slot_stride, p.table_stride,
                      w[WINDOW], scale, softcap, static_cast<const float*>(at<float>(w[SINKS])),
                      dtype);
  const void* attended = b.attended;
  int64_t attended_lda = q_width;
  if (b.attended_rows != nullptr) {
    const int64_t elem = dtype == 0 ? 4 : 2;
    for (int64_t t = 0; t < tokens; ++t)
      std::memcpy(static_cast<char*>(b.attended_rows) + t * b.attended_stride * elem,
                  static_cast<const char*>(b.attended) + t * q_width * elem, q_width * elem);
    attended = b.attended_rows;
    attended_lda = row_stride(tokens, b.attended_stride, q_width);
  }
  const bool moe = w[ROUTER] != 0;
  status |= residual_product(products.of(O_BIT), attended, tokens, q_width, attended_lda, w[O],
                             w[O_BIAS], w[ATTN_OUT_NORM], s, b, x, eps,
                             moe ? w[ROUTER] : products.then(GATE_UP, GATE_UP_BIT),
                             moe ? s.experts : 2 * s.inter, s.hidden, lora,
                             lora.table(w, LORA_O));
  status |= norm_or_cast(x, w[POST_NORM], b, tokens, s.hidden, eps, dtype);
  if (moe) return status | run_experts(w, s, b, x, tokens, normed_lda, products.dense, next_qkv);
  const Linear gate_up = products.of(GATE_UP_BIT);
  if (const int64_t* table = lora.table(w, LORA_GATE_UP)) {
    status |= adapted_gate_up(gate_up, w, products.then(DOWN, DOWN_BIT), s, b, tokens,
                              normed_lda, lora, table);
  } else {
    status |= gate_up(b.normed, tokens, s.hidden, normed_lda, at<void>(w[GATE_UP]), 2 * s.inter,
                      nullptr, b.activated, b.activated_stride, dtype, dtype, nullptr,
                      static_cast<int>(s.activation), at<void>(products.then(DOWN, DOWN_BIT)),
                      s.hidden, s.inter);
  }
  status |= residual_product(products.of(DOWN_BIT), b.activated, tokens, s.inter,
                             row_stride(tokens, b.activated_stride, s.inter), w[DOWN], 0,
                             w[MLP_OUT_NORM], s, b, x, eps, next_qkv,
                             (s.heads + 2 * s.kv_heads) * s.head_dim, s.hidden, lora,
                             lora.table(w, LORA_DOWN));
  return status;
}

}  // namespace

extern "C" {

// Runs `num_layers` decoder layers (rows of `weights`, FIELDS int64 each) over the float32
// residual stream x [tokens, hidden] (contiguous, updated in place). shape: Shape's fields;
// cos, sin [tokens, rotary_dim] in the model's dtype, local_cos and local_sin the same for
// the layers whose LOCAL_ROPE is 1 (or null); softcap: attention's (0: none); slots [tokens] the KV slot each token
// writes; the attention plan's table and rows as tm_paged_attention takes them; scratch: the
// Scratch fields in order (addresses and strides, int64); lora_slots [tokens] each token's
// adapter slot (-1: none) in the LORA_* tables of num_lora_slots rows, or null where no
// token has one. Returns 0, or nonzero where a kernel refused its dtypes.
int tm_layer_stack(const int64_t* weights, int64_t num_layers, const int64_t* shape, float eps,
                   float scale, float softcap, float* x, int64_t tokens, const void* cos,
                   const void* sin, const void* local_cos, const void* local_sin,
                   const int64_t* slots, const int32_t* table, int64_t table_stride,
                   const int64_t* rows, const int64_t* token_starts, const int64_t* num_tokens,
                   const int64_t* first_pos, int64_t num_rows, const int64_t* scratch,
                   const int32_t* lora_slots, int64_t num_lora_slots) {
  const Shape s{shape[0],  shape[1],  shape[2],  shape[3],  shape[4],  shape[5],
                shape[6],  shape[7],  shape[8],  shape[9],  shape[10], shape[11],
                shape[12], shape[13], shape[14], shape[15], shape[16], shape[17]};
  const Plan p{table, table_stride, rows, token_starts, num_tokens, first_pos, num_rows};
  const Scratch b{mutable_at(scratch[0]), scratch[1], mutable_at(scratch[2]),
                  mutable_at(scratch[3]), mutable_at(scratch[4]), mutable_at(scratch[5]),
                  scratch[6], mutable_at(scratch[7]), scratch[8],
                  static_cast<float*>(mutable_at(scratch[9])),
                  static_cast<int64_t*>(mutable_at(scratch[10])),
                  static_cast<float*>(mutable_at(scratch[11])),
                  static_cast<float*>(mutable_at(scratch[12])),
                  static_cast<int64_t*>(mutable_at(scratch[13])),
                  static_cast<float*>(mutable_at(scratch[14])), scratch[15],
                  static_cast<float*>(mutable_at(scratch[16])),
                  static_cast<float*>(mutable_at(scratch[17]))};
  const Lora lora{lora_slots, num_lora_slots};
  const Rope rope{cos, sin, local_cos ? local_cos : cos, local_sin ? local_sin : sin};
  for (int64_t layer = 0; layer < num_layers; ++layer) {
    const int64_t* next = weights + (layer + 1) * FIELDS;
    const int64_t next_qkv = layer + 1 < num_layers && !(next[QUANTIZED] & QKV_BIT) ? next[QKV] : 0;
    const int status = run_layer(weights + layer * FIELDS, s, p, b, x, tokens, rope, slots, eps,
                                 scale, softcap, next_qkv, lora);
    if (status != 0) return status;
  }
  return 0;
}

}  // extern "C"
