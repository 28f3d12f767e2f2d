// The C entry points of the kernels one native call chains (layer_stack.cpp), declared once:
// each defining file includes this too, so a signature that drifts from its declaration is
// a compile error rather than a silent mismatch (tp_worker).
#pragma once

#include <cstdint>

extern "C" {
int tm_rms_norm(const void* x, const void* weight, void* out, int64_t rows, int64_t hidden,
                int64_t out_stride, float eps, int dtype, int x_dtype);
int tm_head_norm(void* rows, int64_t tokens, int64_t width, int64_t q_count, int64_t q_dim,
                 int64_t k_count, int64_t k_dim, const void* q_weight, const void* k_weight,
                 float eps, int dtype);
int tm_norm_add(const void* y, const void* weight, float* x, int64_t rows, int64_t hidden,
                int64_t y_stride, float eps, int dtype);
int tm_cast_rows(const float* x, void* out, int64_t rows, int64_t hidden, int64_t out_stride,
                 int dtype);
int tm_linear(const void* x, int64_t m, int64_t k, int64_t lda, const void* packed, int64_t n,
              const float* bias, void* out, int64_t ldc, int dtype, int out_dtype,
              const void* residual, int glu);
int tm_linear_amx(const void* x, int64_t m, int64_t k, int64_t lda, const void* packed,
                  int64_t n, const float* bias, void* out, int64_t ldc, int dtype, int out_dtype,
                  const void* residual, int glu);
// The two above with the product that runs next on the same threads (panel_queue.h's
// NextProduct: its packed weights, n and k; then_packed null for none).
int tm_linear_then(const void* x, int64_t m, int64_t k, int64_t lda, const void* packed,
                   int64_t n, const float* bias, void* out, int64_t ldc, int dtype, int out_dtype,
                   const void* residual, int glu, const void* then_packed, int64_t then_n,
                   int64_t then_k);
int tm_linear_amx_then(const void* x, int64_t m, int64_t k, int64_t lda, const void* packed,
                       int64_t n, const float* bias, void* out, int64_t ldc, int dtype,
                       int out_dtype, const void* residual, int glu, const void* then_packed,
                       int64_t then_n, int64_t then_k);
// tm_linear_then's operands with quantized panels (linear.cpp, dequant.h): `table` holds
// each panel's GGUF type and blocks' address.
int tm_quant_linear_then(const void* x, int64_t m, int64_t k, int64_t lda, const void* table,
                         int64_t n, const float* bias, void* out, int64_t ldc, int dtype,
                         int out_dtype, const void* residual, int glu, const void* then_packed,
                         int64_t then_n, int64_t then_k);
int tm_quant_rows(const void* table, const int64_t* ids, int64_t count, int64_t k, int pairs,
                  float* out);
int tm_glu_mul(const void* gate_up, void* out, int64_t rows, int64_t inter, int dtype,
               int out_dtype, int act);
int tm_glu_mul_panels(const float* panels, void* out, int64_t rows, int64_t inter, int64_t ldo,
                      int out_dtype, int act);
int tm_lora(const void* x, int64_t rows, int64_t k, int64_t ldx, int dtype, const int32_t* slots,
            int64_t num_slots, const int64_t* table, float* u, int64_t ldu, float* y,
            int64_t ldy, int mode, int weight_dtype);
int tm_route(const float* logits, int64_t tokens, int64_t experts, int64_t k, int renormalize,
             int64_t* ids, float* weights);
// then_packed, then_n, then_k: the product after the last expert's (as tm_linear_then's).
int tm_moe_experts(const void* x, int64_t tokens, int64_t hidden, int64_t ldx,
                   const int64_t* ids, const float* weights, int64_t k,
                   const void* const* gate_up, const void* const* down,
                   const float* const* gate_up_bias, const float* const* down_bias,
                   int64_t num_experts, int64_t inter, int dtype, int activation, int amx,
                   float* out, const void* then_packed, int64_t then_n, int64_t then_k);
int tm_rope_store(const void* qkv, const void* cos, const void* sin, const int64_t* slots,
                  void* q_out, void* k_cache, void* v_cache, int64_t tokens, int64_t heads,
                  int64_t kv_heads, int64_t dim, int64_t head_stride, int64_t slot_stride,
                  int dtype);
int tm_rope_store_partial(const void* qkv, const void* cos, const void* sin,
                          const int64_t* slots, void* q_out, void* k_cache, void* v_cache,
                          int64_t tokens, int64_t heads, int64_t kv_heads, int64_t dim,
                          int64_t rotary_dim, int64_t head_stride, int64_t slot_stride,
                          int dtype);
int tm_paged_attention(const void* q, const void* k_cache, const void* v_cache,
                       const int32_t* table, const int64_t* rows, const int64_t* token_starts,
                       const int64_t* num_tokens, const int64_t* first_pos, void* out,
                       int64_t num_rows, int64_t num_heads, int64_t num_kv_heads,
                       int64_t head_dim, int64_t head_stride, int64_t slot_stride,
                       int64_t table_stride, int64_t window, float scale, float softcap,
                       const float* sinks, int dtype);
int tm_paged_attention_amx(const void* q, const void* k_cache, const void* v_cache,
                           const int32_t* table, const int64_t* rows,
                           const int64_t* token_starts, const int64_t* num_tokens,
                           const int64_t* first_pos, void* out, int64_t num_rows,
                           int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                           int64_t head_stride, int64_t slot_stride, int64_t table_stride,
                           int64_t window, float scale, float softcap, const float* sinks,
                           int dtype);
}
