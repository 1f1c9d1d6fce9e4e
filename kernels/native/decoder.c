/* Every decoder layer of a decode step in one call: the same native operations the
 * layer-by-layer path calls from Python (skinny.c or panels.c, step_ops.c), in the same order on the
 * same inputs, so the results are bit for bit those of that path.
 *
 * Why: at a decode step of few rows the arithmetic of a layer is its weight reads and a
 * few kilobytes of small operations; the Python between them (module calls, checks,
 * tensor allocations, a dozen ctypes calls) cost 4-5 ms of a 13 ms bf16 step of the 100m
 * model on a Xeon with AMX, more than the small operations themselves, and more again
 * because the weight stream evicts the interpreter's data from the caches between calls
 * (docs/benchmarks.md, "CPU speed"). Here a layer costs its operations alone.
 *
 * Layout is Llama's (also Qwen2's and Qwen3's): an RMSNorm with the residual add, fused
 * QKV (optional bias), optional per-head q/k RMSNorm (Qwen3), rotary (neox halves), the
 * paged KV store, decode attention, the output projection, an RMSNorm with the residual
 * add, fused gate/up (optional bias), SiLU-and-multiply and the down projection. The
 * output and down projections take no bias here (a row-parallel layer adds its bias
 * after the product, rounded apart), and one tensor-parallel rank (no collectives). */

#include <stdint.h>
#include <string.h>

#include "ops.h"

/* a model's shapes and constants (kernels/native.py fills it) */
struct llmq_decoder {
    int64_t hidden, heads, kv_heads, head_dim, intermediate;
    /* one layer's K (and V) cache: strides of a block and of a token, in elements (the
     * heads of a token are contiguous), and the tokens a block holds */
    int64_t cache_block_stride, cache_token_stride, block_size;
    float eps;   /* every RMSNorm's */
    float scale; /* the attention's, head_dim ** -0.5 as a float */
    /* fp32: 1 when the projections' weights are packed in panels (panels.c), 0 when they
     * are row-major (skinny.c); bf16 weights are always row-major */
    int64_t panels;
};

/* y = x w^T (+ bias): 0, or -1 when the kernel could not allocate its scratch */
static inline int project_f32(const struct llmq_decoder *d, const float *x, const void *w,
                              const void *bias, float *y, int64_t M, int64_t N, int64_t K,
                              int64_t ldx, int threads) {
    if (d->panels) return llmq_panels_f32(x, w, bias, y, M, N, K, ldx, threads);
    llmq_skinny_f32(x, w, bias, y, M, N, K, ldx, threads);
    return 0;
}
static inline int project_bf16(const struct llmq_decoder *d, const uint16_t *x,
                               const void *w, const void *bias, uint16_t *y, int64_t M,
                               int64_t N, int64_t K, int64_t ldx, int threads) {
    (void)d;
    llmq_skinny_bf16(x, w, bias, y, M, N, K, ldx, threads);
    return 0;
}

/* one layer's weights (row-major [out, in], or fp32 panels) and caches; absent parts are
 * NULL */
struct llmq_layer {
    const void *input_norm, *qkv, *qkv_bias, *q_norm, *k_norm, *o, *post_norm;
    const void *gate_up, *gate_up_bias, *down;
    void *k_cache, *v_cache;
};

/* elements of scratch `llmq_decode_layers_*` needs for `rows` rows */
int64_t llmq_decode_scratch(const struct llmq_decoder *d, int64_t rows) {
    int64_t q = d->heads * d->head_dim, kv = d->kv_heads * d->head_dim;
    /* normed, qkv, q and k normed, q and k rotated, attention, output, gate/up, act */
    return rows * (2 * d->hidden + (q + 2 * kv) + 2 * (q + kv) + q + 3 * d->intermediate);
}

/* hidden [rows, H]: the embeddings (residual_given 0) or the previous layers' output
 * (residual_given 1, with `residual` their residual stream); on return, hidden holds the
 * last layer's output and residual its residual stream, as the Python loop leaves them.
 * cos, sin [rows, head_dim / 2], rows `cos_stride` apart; slot_blocks / slot_offsets:
 * where each row's K and V go; tables / starts / lens: each row's blocks and context
 * length, as `llmq_decode_attention_*` takes them. `stop` (NULL: never): before each layer
 * l < stop_before the call reads *stop and, when another thread has set it, returns 1 + l
 * at once (the step is given up: its outputs and the KV rows already written are
 * rewritten when it runs again). Returns 0, or -1 when attention or a projection could not
 * allocate its scratch. */
#define DECODE_LAYERS(S, T)                                                               \
    int llmq_decode_layers_##S(const struct llmq_decoder *d, const struct llmq_layer *layers, \
                               int64_t num_layers, int64_t rows, T *hidden, T *residual,  \
                               int residual_given, const T *cos, const T *sin,            \
                               int64_t cos_stride, const int64_t *slot_blocks,            \
                               const int64_t *slot_offsets, const int64_t *tables,        \
                               const int64_t *starts, const int64_t *lens, T *scratch,    \
                               const volatile int32_t *stop, int64_t stop_before,         \
                               int threads) {                                             \
        const int64_t H = d->hidden, D = d->head_dim, I = d->intermediate;                \
        const int64_t q_size = d->heads * D, kv_size = d->kv_heads * D;                  \
        const int64_t qkv_size = q_size + 2 * kv_size;                                    \
        T *normed = scratch, *qkv = normed + rows * H, *q_normed = qkv + rows * qkv_size; \
        T *k_normed = q_normed + rows * q_size, *q_rot = k_normed + rows * kv_size;      \
        T *k_rot = q_rot + rows * q_size, *attn = k_rot + rows * kv_size;                \
        T *out = attn + rows * q_size, *gate_up = out + rows * H;                         \
        T *act = gate_up + rows * 2 * I;                                                  \
        for (int64_t l = 0; l < num_layers; ++l) {                                        \
            if (stop && l < stop_before && *stop) return 1 + (int)l;                      \
            const struct llmq_layer *L = layers + l;                                      \
            if (l == 0 && !residual_given) {                                              \
                memcpy(residual, hidden, sizeof(T) * rows * H);                           \
                llmq_rms_norm_##S(hidden, rows, 1, H, H, 0, L->input_norm, d->eps, normed, \
                                  threads);                                               \
            } else {                                                                      \
                llmq_add_rms_norm_##S(hidden, residual, rows, H, L->input_norm, d->eps,   \
                                      normed, residual, threads);                         \
            }                                                                             \
            if (project_##S(d, normed, L->qkv, L->qkv_bias, qkv, rows, qkv_size, H, H,    \
                            threads))                                                     \
                return -1;                                                                \
            /* q, k, v: views of each row of qkv */                                       \
            const T *q = qkv, *k = qkv + q_size, *v = qkv + q_size + kv_size;             \
            int64_t q_row = qkv_size, k_row = qkv_size;                                   \
            if (L->q_norm) {                                                              \
                llmq_rms_norm_##S(q, rows, d->heads, D, qkv_size, D, L->q_norm, d->eps,   \
                                  q_normed, threads);                                     \
                llmq_rms_norm_##S(k, rows, d->kv_heads, D, qkv_size, D, L->k_norm,        \
                                  d->eps, k_normed, threads);                             \
                q = q_normed, k = k_normed, q_row = q_size, k_row = kv_size;              \
            }                                                                             \
            llmq_rotary_##S(q, rows, d->heads, D, q_row, D, cos, sin, cos_stride, q_rot,  \
                            threads);                                                     \
            llmq_rotary_##S(k, rows, d->kv_heads, D, k_row, D, cos, sin, cos_stride,      \
                            k_rot, threads);                                              \
            llmq_store_kv_##S(k_rot, v, rows, kv_size, kv_size, qkv_size, L->k_cache,     \
                              L->v_cache, d->cache_block_stride, d->cache_token_stride,   \
                              slot_blocks, slot_offsets);                                 \
            if (llmq_decode_attention_##S(q_rot, rows, d->heads, d->kv_heads, D,          \
                                          L->k_cache, L->v_cache, d->cache_block_stride,  \
                                          d->cache_token_stride, D, d->block_size,        \
                                          tables, starts, lens, d->scale, attn, threads)) \
                return -1;                                                                \
            if (project_##S(d, attn, L->o, NULL, out, rows, H, q_size, q_size, threads))  \
                return -1;                                                                \
            llmq_add_rms_norm_##S(out, residual, rows, H, L->post_norm, d->eps, normed,   \
                                  residual, threads);                                     \
            if (project_##S(d, normed, L->gate_up, L->gate_up_bias, gate_up, rows, 2 * I, \
                            H, H, threads))                                               \
                return -1;                                                                \
            llmq_silu_and_mul_##S(gate_up, rows, I, act, threads);                        \
            if (project_##S(d, act, L->down, NULL, hidden, rows, H, I, I, threads))       \
                return -1;                                                                \
        }                                                                                 \
        return 0;                                                                         \
    }

DECODE_LAYERS(f32, float)
DECODE_LAYERS(bf16, uint16_t)
