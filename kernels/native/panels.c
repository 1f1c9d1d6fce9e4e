/* y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) in fp32 on weights packed in panels: the
 * projections of a step of a few to a few dozen rows, where the row-major kernel
 * (skinny.c) runs out of multiply-adds before the memory runs out of bytes.
 *
 * Layout: the weight [N, K] in panels of NP output features, each panel k-major,
 * wp[p][k][j] = w[p * NP + j][k] (zeros past N). A panel is one sequential stream, as a
 * row-major weight read a row after another is, but a step over k brings NP features'
 * weights in two (AVX-512: 32 features, AVX2: 16) vectors, and each row of x is
 * broadcast one element at a time against them: a group of up to MRP rows of x keeps
 * MRP x 2 vector sums in registers (outputs, not partial dot products: nothing to sum
 * across lanes at the end), and per step loads 2 weight vectors and MRP broadcasts for
 * 2 x MRP multiply-adds. The row-major tiles load one vector per multiply-add, sum 16
 * lanes at the end of each dot product and re-read their x rows from L2 per tile.
 *
 * 100m model's fp32 projections, one pass, 2 threads, Xeon with AVX-512 (no bf16):
 * 16 rows 25 ms against 42-47 with the row-major tiles and 33 with oneDNN's prepacked
 * weights; 64 rows 64 against 133 and 70 (docs/benchmarks.md).
 *
 * Groups of x rows pass over a panel one after another (the first from memory, the rest
 * from L2); while they do, the panel after it is prefetched into L2, spread evenly over
 * the groups' steps, so the memory stream never waits on the multiply-adds or the other
 * way round. Each output is summed over k in order, one fused multiply-add at a time.
 * Threads split the panels (OpenMP).
 *
 * A call of one row reads each panel once, so there is nothing to stage in L2 for later
 * groups: it prefetches as `row_prefetch` says (llmq_panels_set_row_prefetch), which the
 * engine picks at start-up by timing. Zen 4, the 100m model's panels, alternated: a
 * one-row pass with no software prefetch or 2 KiB ahead of the stream took 0.79-0.84 of
 * the next-panel scheme's time on one thread and 0.93-0.97 on two. At 4 and 8 rows those
 * two took 1.09-1.11 of it on one thread, and 8 KiB ahead 0.88-1.01 in two runs (0.95-0.97
 * on two threads): calls of several rows keep the next panel.
 *
 * A call of up to STREAM_ROWS rows may also read `row_streams` panels at once
 * (llmq_panels_set_row_streams, timed at start-up on one-row calls; fewer where the rows'
 * sums would not fit in the registers): a thread's panels split into that many runs, read
 * side by side, so the memory sees several sequential streams where one thread's single
 * stream leaves it waiting between misses. Xeon Ice Lake (AVX-512, no bf16), the 100m
 * model's panels, 2 threads: a one-row pass in 17.6-18.9 ms with 4 to 8 streams against
 * 20.8-22.6 with one (MKL's `linear` on the plain weights: 19.1); 2 to 4 rows 18.0-20.6
 * against 22.3-24.2. Each output is the same sum in the same order either way. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "ops.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#define NP 32  /* output features a panel holds: two vectors */
#define MRP 12 /* x rows a group: 24 sums, 2 weight vectors and a broadcast in 32 registers */
typedef __m512 vec;
#define VZERO() _mm512_setzero_ps()
#define VLOAD(p) _mm512_loadu_ps(p)
#define VSTORE(p, v) _mm512_storeu_ps((p), (v))
#define VSET1(s) _mm512_set1_ps(s)
#define VFMA(a, b, c) _mm512_fmadd_ps((a), (b), (c))
#define VADD(a, b) _mm512_add_ps((a), (b))
#define VL 16
#define PANELS_VECTOR 1
#define STREAM_SUMS 24 /* vector sums streams x rows x 2 may hold */
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define NP 16
#define MRP 6 /* 12 sums, 2 weight vectors and a broadcast in 16 registers */
typedef __m256 vec;
#define VZERO() _mm256_setzero_ps()
#define VLOAD(p) _mm256_loadu_ps(p)
#define VSTORE(p, v) _mm256_storeu_ps((p), (v))
#define VSET1(s) _mm256_set1_ps(s)
#define VFMA(a, b, c) _mm256_fmadd_ps((a), (b), (c))
#define VADD(a, b) _mm256_add_ps((a), (b))
#define VL 8
#define PANELS_VECTOR 1
#define STREAM_SUMS 12
#else
#define NP 16
#define MRP 4
#endif

#define ALWAYS_INLINE inline __attribute__((always_inline))
#define LINE 64
/* weight elements below which a call runs on one thread (as skinny.c's SERIAL_ELEMENTS) */
#define SERIAL_ELEMENTS (1 << 16)
/* bytes of a thread's first panel asked for at once, before its first step */
#define FIRST_BYTES 16384

/* a one-row call's prefetch: -1 the next panel (as calls of more rows), 0 none, else
 * this many bytes ahead of the stream it reads */
static int64_t row_prefetch = -1;

/* panels a call of few rows reads side by side (1..MAX_STREAMS) */
#define MAX_STREAMS 8
/* rows a call may have and read its panels side by side (each adds sums to hold) */
#define STREAM_ROWS 4
static int64_t row_streams = 1;

int64_t llmq_panel_width(void) { return NP; }

/* how a one-row call prefetches from now on (see row_prefetch); set between calls, not
 * during one */
void llmq_panels_set_row_prefetch(int64_t bytes) { row_prefetch = bytes < -1 ? -1 : bytes; }

/* how many panels a call of up to STREAM_ROWS rows reads at once from now on (clamped to
 * 1..MAX_STREAMS); set between calls, not during one */
void llmq_panels_set_row_streams(int64_t streams) {
    row_streams = streams < 1 ? 1 : streams > MAX_STREAMS ? MAX_STREAMS : streams;
}

/* wp [ceil(N / NP)][K][NP] from w [N, K] row-major */
void llmq_pack_panels_f32(const float *w, float *wp, int64_t N, int64_t K, int threads) {
    int64_t panels = (N + NP - 1) / NP;
    if (N * K < SERIAL_ELEMENTS) threads = 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t p = 0; p < panels; ++p) {
        float *out = wp + p * K * NP;
        for (int64_t j = 0; j < NP; ++j) {
            int64_t n = p * NP + j;
            if (n < N) {
                const float *row = w + n * K;
                for (int64_t k = 0; k < K; ++k) out[k * NP + j] = row[k];
            } else {
                for (int64_t k = 0; k < K; ++k) out[k * NP + j] = 0.f;
            }
        }
    }
}

/* the sums of `mr` rows of x against one panel: xt [K][mr] (x transposed), the panel
 * [K][NP]; out [mr][NP]. At step k it prefetches the line `ahead + base + k * step / 2^16`
 * (and the next): its share of the panel after this one (`ahead` NULL: nothing). */
static ALWAYS_INLINE void panel_rows(const float *xt, const float *wp, int64_t K, int64_t mr,
                                     float *out, const char *ahead, int64_t base,
                                     int64_t step) {
#if defined(PANELS_VECTOR)
    vec acc[MRP][2];
    for (int64_t i = 0; i < mr; ++i) acc[i][0] = acc[i][1] = VZERO();
    for (int64_t k = 0; k < K; ++k) {
        if (ahead) {
            const char *a = ahead + ((base + ((k * step) >> 16)) & ~(int64_t)(LINE - 1));
            __builtin_prefetch(a, 0, 2);
            __builtin_prefetch(a + LINE, 0, 2);
        }
        const float *wk = wp + k * NP;
        vec w0 = VLOAD(wk), w1 = VLOAD(wk + VL);
        const float *xk = xt + k * mr;
        for (int64_t i = 0; i < mr; ++i) {
            vec xb = VSET1(xk[i]);
            acc[i][0] = VFMA(xb, w0, acc[i][0]);
            acc[i][1] = VFMA(xb, w1, acc[i][1]);
        }
    }
    for (int64_t i = 0; i < mr; ++i) {
        VSTORE(out + i * NP, acc[i][0]);
        VSTORE(out + i * NP + VL, acc[i][1]);
    }
#else
    (void)ahead, (void)base, (void)step;
    float acc[MRP][NP];
    for (int64_t i = 0; i < mr; ++i)
        for (int64_t j = 0; j < NP; ++j) acc[i][j] = 0.f;
    for (int64_t k = 0; k < K; ++k)
        for (int64_t i = 0; i < mr; ++i)
            for (int64_t j = 0; j < NP; ++j) acc[i][j] += xt[k * mr + i] * wp[k * NP + j];
    for (int64_t i = 0; i < mr; ++i)
        for (int64_t j = 0; j < NP; ++j) out[i * NP + j] = acc[i][j];
#endif
}

/* panel_rows with mr a constant (1..MRP): its sums stay in registers */
#define PANEL_CASE(n)                                                                     \
    case n:                                                                               \
        panel_rows(xt, wp, K, (n) < MRP ? (n) : MRP, out, ahead, base, step);             \
        break;
static void panel_any(const float *xt, const float *wp, int64_t K, int64_t mr, float *out,
                      const char *ahead, int64_t base, int64_t step) {
    switch (mr) {
        PANEL_CASE(1) PANEL_CASE(2) PANEL_CASE(3) PANEL_CASE(4) PANEL_CASE(5)
        PANEL_CASE(6) PANEL_CASE(7) PANEL_CASE(8) PANEL_CASE(9) PANEL_CASE(10)
        PANEL_CASE(11)
    default:
        panel_rows(xt, wp, K, MRP, out, ahead, base, step);
        break;
    }
}

#if defined(PANELS_VECTOR)
/* `mr` rows of x (xt [K][mr], x transposed; one row is its own) against `S` panels at
 * once (wps[s]: panel s), out [S][mr][NP]; with `ahead` > 0 each stream prefetches that
 * many bytes ahead of itself */
static ALWAYS_INLINE void panel_streams(const float *xt, int64_t mr, const float *const *wps,
                                        int S, int64_t K, float *out, int64_t ahead) {
    vec acc[MAX_STREAMS][STREAM_ROWS][2];
    for (int s = 0; s < S; ++s)
        for (int64_t i = 0; i < mr; ++i) acc[s][i][0] = acc[s][i][1] = VZERO();
    for (int64_t k = 0; k < K; ++k) {
        const float *xk = xt + k * mr;
        for (int s = 0; s < S; ++s) {
            const float *wk = wps[s] + k * NP;
            if (ahead) __builtin_prefetch((const char *)wk + ahead, 0, 2);
            vec w0 = VLOAD(wk), w1 = VLOAD(wk + VL);
            for (int64_t i = 0; i < mr; ++i) {
                vec xb = VSET1(xk[i]);
                acc[s][i][0] = VFMA(xb, w0, acc[s][i][0]);
                acc[s][i][1] = VFMA(xb, w1, acc[s][i][1]);
            }
        }
    }
    for (int s = 0; s < S; ++s)
        for (int64_t i = 0; i < mr; ++i) {
            VSTORE(out + (s * mr + i) * NP, acc[s][i][0]);
            VSTORE(out + (s * mr + i) * NP + VL, acc[s][i][1]);
        }
}

/* panel_streams with mr and S constants: its sums stay in registers */
#define STREAMS_CASE(r, n)                                                                \
    case (r) * 16 + (n):                                                                  \
        panel_streams(xt, r, wps, n, K, out, ahead);                                      \
        break;
static void panel_streams_any(const float *xt, int64_t mr, const float *const *wps, int S,
                              int64_t K, float *out, int64_t ahead) {
    switch (mr * 16 + S) {
        STREAMS_CASE(1, 1) STREAMS_CASE(1, 2) STREAMS_CASE(1, 3) STREAMS_CASE(1, 4)
        STREAMS_CASE(1, 5) STREAMS_CASE(1, 6) STREAMS_CASE(1, 7) STREAMS_CASE(1, 8)
        STREAMS_CASE(2, 1) STREAMS_CASE(2, 2) STREAMS_CASE(2, 3) STREAMS_CASE(2, 4)
        STREAMS_CASE(2, 5) STREAMS_CASE(2, 6)
        STREAMS_CASE(3, 1) STREAMS_CASE(3, 2) STREAMS_CASE(3, 3) STREAMS_CASE(3, 4)
        STREAMS_CASE(4, 1) STREAMS_CASE(4, 2) STREAMS_CASE(4, 3)
    default: /* not reached: S <= STREAM_SUMS / (2 * mr), mr <= STREAM_ROWS */
        abort();
    }
}
#endif

/* outputs [rows][NP] of panel p into y [rows, N] (+ bias) */
static void put_panel(float *y, const float *out, int64_t rows, int64_t p, int64_t N,
                      const float *bias) {
    int64_t valid = N - p * NP < NP ? N - p * NP : NP;
    for (int64_t i = 0; i < rows; ++i) {
        float *dst = y + i * N + p * NP;
        const float *src = out + i * NP;
        if (bias) {
            for (int64_t j = 0; j < valid; ++j) dst[j] = src[j] + bias[p * NP + j];
        } else {
            memcpy(dst, src, sizeof(float) * (size_t)valid);
        }
    }
}

/* x [M, K] (row stride ldx), wp packed by llmq_pack_panels_f32 from a weight [N, K],
 * bias [N] or NULL, y [M, N] contiguous. Returns 0, or -1 when it could not allocate its
 * scratch (x transposed: M x K floats). */
int llmq_panels_f32(const float *x, const float *wp, const float *bias, float *y, int64_t M,
                    int64_t N, int64_t K, int64_t ldx, int threads) {
    const int64_t panels = (N + NP - 1) / NP, groups = (M + MRP - 1) / MRP;
    /* each group's rows of x, transposed ([K][rows]), one group after another: the
     * broadcasts of a step read consecutive floats. One row is its own transpose. */
    float *xt = NULL;
    const float *xs = x;
    if (M > 1) {
        xt = malloc(sizeof(float) * (size_t)(M * K));
        if (!xt) return -1;
        for (int64_t g = 0; g < groups; ++g) {
            int64_t m = g * M / groups, mr = (g + 1) * M / groups - m;
            float *dst = xt + m * K;
            for (int64_t i = 0; i < mr; ++i) {
                const float *row = x + (m + i) * ldx;
                for (int64_t k = 0; k < K; ++k) dst[k * mr + i] = row[k];
            }
        }
        xs = xt;
    }
    if (N * K < SERIAL_ELEMENTS) threads = 1;
    const int64_t panel_bytes = K * NP * (int64_t)sizeof(float);
#pragma omp parallel num_threads(threads)
    {
        int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
        int64_t first = panels * me / team, end = panels * (me + 1) / team;
        if (first < end) {
            const char *start = (const char *)(wp + first * K * NP);
            for (int64_t b = 0; b < panel_bytes && b < FIRST_BYTES; b += LINE)
                __builtin_prefetch(start + b, 0, 2);
        }
        float out[(MRP > MAX_STREAMS * STREAM_ROWS ? MRP : MAX_STREAMS * STREAM_ROWS) * NP];
#if defined(PANELS_VECTOR)
        /* panels read side by side: as many as set, and as the rows' sums fit */
        int64_t S = M > STREAM_ROWS ? 1 : STREAM_SUMS / (2 * M);
        if (S > row_streams) S = row_streams;
        if (S > 1) {
            /* the thread's panels in S runs; step i reads the i-th of each */
            int64_t per = llmq_run_length(first, end, S), ps[MAX_STREAMS];
            for (int64_t i = 0; i < per; ++i) {
                const float *wps[MAX_STREAMS];
                int n = llmq_runs_step(first, end, S, i, ps);
                for (int s = 0; s < n; ++s) wps[s] = wp + ps[s] * K * NP;
                panel_streams_any(xs, M, wps, n, K, out, row_prefetch > 0 ? row_prefetch : 0);
                for (int s = 0; s < n; ++s) put_panel(y, out + s * M * NP, M, ps[s], N, bias);
            }
            first = end; /* done: the loop below has nothing left */
        }
#endif
        for (int64_t p = first; p < end; ++p) {
            const float *panel = wp + p * K * NP;
            /* the next panel, or this one again (already near) after the last; one row:
             * as row_prefetch says */
            const char *ahead = (const char *)(p + 1 < end ? panel + K * NP : panel);
            if (M == 1 && row_prefetch >= 0)
                ahead = row_prefetch ? (const char *)panel + row_prefetch : NULL;
            for (int64_t g = 0; g < groups; ++g) {
                int64_t m = g * M / groups, mr = (g + 1) * M / groups - m;
                /* this group fetches its share of the next panel: 1 / groups of its
                 * bytes, over its K steps */
                panel_any(xs + m * K, panel, K, mr, out, ahead, g * panel_bytes / groups,
                          ((int64_t)NP * (int64_t)sizeof(float) << 16) / groups);
                put_panel(y + m * N, out, mr, p, N, bias);
            }
        }
    }
    free(xt);
    return 0;
}
