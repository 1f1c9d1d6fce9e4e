/* The library's entry points that other files of it call: the projection kernels
 * (skinny.c, panels.c) and the step operations (step_ops.c), per dtype suffix S and element type
 * T. Each file includes this, so a definition that drifts from its declaration fails to
 * compile. */
#ifndef LLMQ_OPS_H
#define LLMQ_OPS_H

#include <stdint.h>

#define LLMQ_OPS(S, T)                                                                    \
    void llmq_skinny_##S(const T *x, const T *w, const T *bias, T *y, int64_t M,          \
                         int64_t N, int64_t K, int64_t ldx, int threads);                 \
    void llmq_rms_norm_##S(const T *x, int64_t a, int64_t b, int64_t d, int64_t sa,       \
                           int64_t sb, const T *w, float eps, T *out, int threads);       \
    void llmq_add_rms_norm_##S(const T *x, const T *residual, int64_t n, int64_t d,       \
                               const T *w, float eps, T *out, T *residual_out,            \
                               int threads);                                              \
    void llmq_rotary_##S(const T *x, int64_t n, int64_t h, int64_t D, int64_t sn,         \
                         int64_t sh, const T *cos, const T *sin, int64_t sc, T *out,      \
                         int threads);                                                    \
    void llmq_silu_and_mul_##S(const T *x, int64_t n, int64_t d, T *out, int threads);    \
    void llmq_store_kv_##S(const T *k, const T *v, int64_t n, int64_t row, int64_t sk,    \
                           int64_t sv, T *k_cache, T *v_cache, int64_t cb, int64_t ct,    \
                           const int64_t *blocks, const int64_t *offsets);                \
    int llmq_decode_attention_##S(const T *q, int64_t nd, int64_t H, int64_t KVH,         \
                                  int64_t D, const T *k_cache, const T *v_cache,          \
                                  int64_t cb, int64_t ct, int64_t ch, int64_t block_size, \
                                  const int64_t *tables, const int64_t *starts,           \
                                  const int64_t *lens, float scale, T *out, int threads);

LLMQ_OPS(f32, float)
LLMQ_OPS(bf16, uint16_t)

/* fp32 projections on weights packed in panels (panels.c) */
int64_t llmq_panel_width(void);
void llmq_panels_set_row_prefetch(int64_t bytes);
void llmq_panels_set_row_streams(int64_t streams);
void llmq_pack_panels_f32(const float *w, float *wp, int64_t N, int64_t K, int threads);
int llmq_panels_f32(const float *x, const float *wp, const float *bias, float *y, int64_t M,
                    int64_t N, int64_t K, int64_t ldx, int threads);

/* Reading S runs side by side (panels.c's panels, skinny.c's bf16 weight rows): a
 * thread's items [first, end) split into S runs of `llmq_run_length` items; step i takes
 * the i-th item of each run that has one, into picked[], and returns how many. */
static inline int64_t llmq_run_length(int64_t first, int64_t end, int64_t S) {
    return (end - first + S - 1) / S;
}
static inline int llmq_runs_step(int64_t first, int64_t end, int64_t S, int64_t i,
                                 int64_t *picked) {
    int64_t per = llmq_run_length(first, end, S);
    int n = 0;
    for (int64_t s = 0; s < S; ++s)
        if (first + s * per + i < end) picked[n++] = first + s * per + i;
    return n;
}

#endif
