/* y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) for few rows m: the decode step's
 * projections, which read every weight once per step and are bound by memory bandwidth.
 *
 * The weight stays in its checkpoint layout (row-major [N, K]) and is read as one
 * sequential stream per thread, prefetched ahead; each weight row is dotted with every
 * row of x while it is in registers (one row of x: a row at a time; more: tiles of four
 * weight rows with AVX-512, two with AVX2, and bf16 from five rows on AMX's tile multiply
 * where the CPU has it), so a weight byte is read from memory once per call
 * whatever M is. Sums are fp32; a bf16 output is rounded to nearest even. Threads split
 * the output features (OpenMP: the same runtime torch's CPU ops use, shared when both
 * are loaded in one process).
 *
 * Built at first use by kernels/native.py with -march=native: the AVX-512 paths are
 * compiled only where the building CPU has them, the AVX2 paths where it has AVX2 and FMA
 * but no AVX-512; elsewhere the plain loops below are left to the compiler's vectoriser
 * (which, without reassociation, leaves a dot product scalar). */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "bf16.h"
#include "ops.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__)
#include "avx2.h"
#define SKINNY_AVX2 1
#endif

#define MR 4   /* x rows per pass over a block */
#define NR 4   /* weight rows per tile (tile_*_rows) */
/* x rows per pass over a tile: on AVX2 six, a tile's 6 x 2 sums in 12 of the 16
 * registers beside its weight vectors (more multiply-adds in flight than 4 x 2; with the
 * blocks of WEIGHT_ROWS, 5-9% faster in bf16 from 5 rows on, Zen 3) */
#if defined(SKINNY_AVX2)
#define MR_TILE 6
#else
#define MR_TILE MR
#endif

/* Software prefetch ahead of the weight stream, into L2. One sequential stream per core
 * is bound by how many misses the core keeps in flight, not by the memory: on a Xeon
 * with AMX a 2-thread read ran at 29 GB/s plain and 36-38 GB/s prefetching 4-16 KiB
 * ahead (docs/benchmarks.md). The tiles (four weight rows side by side) prefetch
 * PREFETCH_BYTES ahead; the one-row bodies on AVX-512 `row_prefetch` bytes ahead, which
 * the engine picks at start-up by timing (llmq_skinny_set_row_prefetch): the same
 * 16 KiB that helps the Xeon made the one-row stream of Zen 4 a quarter slower than
 * 2 KiB or none (bf16 on one thread 18.9 against 25.4 GB/s). */
#define PREFETCH_BYTES 16384
#define PREFETCH_LINE(p) __builtin_prefetch((p), 0, 2)
static int64_t row_prefetch = PREFETCH_BYTES;
#define PREFETCH_AHEAD(p)                                                                 \
    do {                                                                                  \
        const char *ahead_ = (const char *)(p) + row_prefetch;                            \
        PREFETCH_LINE(ahead_);                                                            \
        PREFETCH_LINE(ahead_ + 64);                                                       \
    } while (0)

/* how far ahead the one-row bodies prefetch from now on (bytes, >= 0); set between
 * calls, not during one */
void llmq_skinny_set_row_prefetch(int64_t bytes) { row_prefetch = bytes < 0 ? 0 : bytes; }

/* weight rows a one-row bf16 call on AVX2 reads side by side (1 to MAX_ROW_STREAMS;
 * other builds keep one): set between calls, not during one (llmq_skinny_set_row_streams) */
#define MAX_ROW_STREAMS 3 /* streams_bf16f: 4 sums a row, 12 of the 16 registers */
static int64_t row_streams = 1;
void llmq_skinny_set_row_streams(int64_t streams) {
    row_streams = streams < 1 ? 1 : streams > MAX_ROW_STREAMS ? MAX_ROW_STREAMS : streams;
}

/* the first PREFETCH_BYTES of a run of `bytes`, asked for together */
static inline void prefetch_run(const void *start, int64_t bytes) {
    const char *p = start;
    for (int64_t i = 0; i < bytes && i < PREFETCH_BYTES; i += 64) PREFETCH_LINE(p + i);
}

/* The block bodies are inlined into one copy per x-row count (1..MR, a constant there):
 * with a constant count the accumulators stay in registers; indexed by a runtime count
 * they would live on the stack and every multiply-add would wait for a store. */
#define ALWAYS_INLINE inline __attribute__((always_inline))

/* Each block function dots ONE weight row with `mr` rows of x. Rows are taken one after
 * another, so a thread reads its share of the weight as one sequential stream: the
 * hardware prefetcher follows one stream at full speed, while four rows read side by side
 * (four short streams, a page boundary every few rows) ran at two thirds of it. */

/* ---- fp32 ------------------------------------------------------------------------ */

#if defined(__AVX512F__)
/* fp32 rows of x, a weight row of WT loaded 16 at a time as fp32 by LOAD_W (TAIL_W: the
 * first bits of a mask): two accumulators a row of x keep two FMAs in flight */
#define AVX512_BLOCK(name, WT, LOAD_W, TAIL_W)                                            \
    static ALWAYS_INLINE void name(const float *x, const WT *w, float *out, int64_t K,    \
                                   int64_t mr, int64_t ldx) {                             \
        __m512 acc[MR][2];                                                                \
        for (int64_t i = 0; i < mr; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();    \
        int64_t k = 0;                                                                    \
        for (; k + 32 <= K; k += 32) {                                                    \
            PREFETCH_AHEAD(w + k);                                                        \
            __m512 a = LOAD_W(w + k), b = LOAD_W(w + k + 16);                             \
            for (int64_t i = 0; i < mr; ++i) {                                            \
                acc[i][0] = _mm512_fmadd_ps(_mm512_loadu_ps(x + i * ldx + k), a, acc[i][0]); \
                acc[i][1] = _mm512_fmadd_ps(_mm512_loadu_ps(x + i * ldx + k + 16), b,     \
                                            acc[i][1]);                                   \
            }                                                                             \
        }                                                                                 \
        for (; k < K; k += 16) {                                                          \
            int64_t left = K - k < 16 ? K - k : 16;                                       \
            __mmask16 m = (__mmask16)((1u << left) - 1);                                  \
            __m512 a = TAIL_W(m, w + k);                                                  \
            for (int64_t i = 0; i < mr; ++i)                                              \
                acc[i][0] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, x + i * ldx + k), a, \
                                            acc[i][0]);                                   \
        }                                                                                 \
        for (int64_t i = 0; i < mr; ++i)                                                  \
            out[i] = _mm512_reduce_add_ps(_mm512_add_ps(acc[i][0], acc[i][1]));           \
    }
AVX512_BLOCK(block_f32_rows, float, _mm512_loadu_ps, _mm512_maskz_loadu_ps)
#elif defined(SKINNY_AVX2)
/* 8 lanes: two accumulators a row (16 weights an iteration) keep two FMAs in flight per
 * row; x's rows are fp32 */
static ALWAYS_INLINE void block_f32_rows(const float *x, const float *w, float *out,
                                         int64_t K, int64_t mr, int64_t ldx) {
    __m256 acc[MR][2];
    for (int64_t i = 0; i < mr; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        __m256 a = _mm256_loadu_ps(w + k), b = _mm256_loadu_ps(w + k + 8);
        for (int64_t i = 0; i < mr; ++i) {
            acc[i][0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + i * ldx + k), a, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(_mm256_loadu_ps(x + i * ldx + k + 8), b, acc[i][1]);
        }
    }
    for (; k + 8 <= K; k += 8) {
        __m256 a = _mm256_loadu_ps(w + k);
        for (int64_t i = 0; i < mr; ++i)
            acc[i][0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + i * ldx + k), a, acc[i][0]);
    }
    for (int64_t i = 0; i < mr; ++i) {
        float sum = reduce_add8(_mm256_add_ps(acc[i][0], acc[i][1]));
        for (int64_t j = k; j < K; ++j) sum += x[i * ldx + j] * w[j];
        out[i] = sum;
    }
}

/* The one-row bf16 body on AVX2 prefetches 1 KiB ahead, not PREFETCH_BYTES: on Zen 3
 * (AVX2 only) it streamed a decode step's bf16 weights 8% faster than the body before
 * it (median of seven alternated runs, docs/benchmarks.md), 1-6% without the prefetch
 * and no better 2-16 KiB ahead; a prefetch in the fp32 body moved it less than the
 * host's spread, so it has none. The tiles keep PREFETCH_BYTES: at two rows of x, 1 KiB
 * ahead read fp32 a third slower. */
#define PREFETCH_ROW_BYTES 1024

/* A bf16 weight on AVX2, 16 elements from one 32-byte load: the 32-bit lane i holds
 * elements 2i (low half) and 2i + 1 (high half), so a shift gives the even elements as
 * fp32 and a mask the odd ones, where a zero-extend (a shuffle) and a shift per 8 would
 * be needed otherwise. x is widened once per call with each whole block of 16 stored
 * even elements first, then odd (widen_x); a tail of K % 16 stays in order. */
#define PAIRED 16
static ALWAYS_INLINE void load_bf16_paired(const uint16_t *p, __m256 *even, __m256 *odd) {
    __m256i v = _mm256_loadu_si256((const __m256i *)p);
    *even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    *odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u)));
}

static ALWAYS_INLINE void block_bf16f_rows(const float *x, const uint16_t *w, float *out,
                                           int64_t K, int64_t mr, int64_t ldx) {
    __m256 acc[MR][4];
    for (int64_t i = 0; i < mr; ++i)
        for (int64_t j = 0; j < 4; ++j) acc[i][j] = _mm256_setzero_ps();
    int64_t k = 0;
    if (mr == 1) /* 32 weights (one cache line) an iteration, four sums in flight */
        for (; k + 2 * PAIRED <= K; k += 2 * PAIRED) {
            PREFETCH_LINE((const char *)(w + k) + PREFETCH_ROW_BYTES);
            __m256 e0, o0, e1, o1;
            load_bf16_paired(w + k, &e0, &o0);
            load_bf16_paired(w + k + PAIRED, &e1, &o1);
            acc[0][0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), e0, acc[0][0]);
            acc[0][1] = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 8), o0, acc[0][1]);
            acc[0][2] = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 16), e1, acc[0][2]);
            acc[0][3] = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 24), o1, acc[0][3]);
        }
    for (; k + PAIRED <= K; k += PAIRED) {
        if (!(k & 31)) PREFETCH_LINE((const char *)(w + k) + PREFETCH_ROW_BYTES);
        __m256 e, o;
        load_bf16_paired(w + k, &e, &o);
        for (int64_t i = 0; i < mr; ++i) {
            acc[i][0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + i * ldx + k), e, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(_mm256_loadu_ps(x + i * ldx + k + 8), o, acc[i][1]);
        }
    }
    for (int64_t i = 0; i < mr; ++i) {
        float sum = reduce_add8(_mm256_add_ps(_mm256_add_ps(acc[i][0], acc[i][1]),
                                              _mm256_add_ps(acc[i][2], acc[i][3])));
        for (int64_t j = k; j < K; ++j) sum += x[i * ldx + j] * bf16_to_float(w[j]);
        out[i] = sum;
    }
}

/* One row of x against `S` weight rows at once (ws[s]: row s), out[s] their sums: the
 * one-row bf16 body read side by side. A thread's weight rows split into S runs and a
 * call takes the i-th row of each, so the memory sees S sequential streams where one
 * thread's single stream leaves it waiting between misses (the fp32 panels do the same,
 * panels.c). Each sum is block_bf16f_rows' with one row: four sums over 32 weights a
 * step, then two over 16, then one weight at a time, added up in the same order. */
static ALWAYS_INLINE void streams_bf16f(const float *x, const uint16_t *const *ws, float *out,
                                        int64_t K, int S) {
    __m256 acc[MAX_ROW_STREAMS][4];
    for (int s = 0; s < S; ++s)
        for (int j = 0; j < 4; ++j) acc[s][j] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 2 * PAIRED <= K; k += 2 * PAIRED)
        for (int s = 0; s < S; ++s) {
            const uint16_t *w = ws[s];
            PREFETCH_LINE((const char *)(w + k) + PREFETCH_ROW_BYTES);
            __m256 e0, o0, e1, o1;
            load_bf16_paired(w + k, &e0, &o0);
            load_bf16_paired(w + k + PAIRED, &e1, &o1);
            acc[s][0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), e0, acc[s][0]);
            acc[s][1] = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 8), o0, acc[s][1]);
            acc[s][2] = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 16), e1, acc[s][2]);
            acc[s][3] = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 24), o1, acc[s][3]);
        }
    for (; k + PAIRED <= K; k += PAIRED)
        for (int s = 0; s < S; ++s) {
            __m256 e, o;
            load_bf16_paired(ws[s] + k, &e, &o);
            acc[s][0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), e, acc[s][0]);
            acc[s][1] = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 8), o, acc[s][1]);
        }
    for (int s = 0; s < S; ++s) {
        float sum = reduce_add8(_mm256_add_ps(_mm256_add_ps(acc[s][0], acc[s][1]),
                                              _mm256_add_ps(acc[s][2], acc[s][3])));
        for (int64_t j = k; j < K; ++j) sum += x[j] * bf16_to_float(ws[s][j]);
        out[s] = sum;
    }
}

/* streams_bf16f with S a constant: its sums stay in registers */
static void streams_bf16f_any(const float *x, const uint16_t *const *ws, float *out,
                              int64_t K, int S) {
    switch (S) {
    case 1: streams_bf16f(x, ws, out, K, 1); break;
    case 2: streams_bf16f(x, ws, out, K, 2); break;
    default: streams_bf16f(x, ws, out, K, MAX_ROW_STREAMS); break;
    }
}

/* tiles of NR_AVX2 weight rows with `mr` rows of x (see tile_f32_rows): 16 registers hold
 * MR x 2 sums, the weight vectors and an x vector */
#define NR_AVX2 2
static ALWAYS_INLINE void tile_f32_rows(const float *x, const float *w, float *out,
                                        int64_t K, int64_t mr, int64_t ldx) {
    __m256 acc[MR_TILE][NR_AVX2];
    for (int64_t i = 0; i < mr; ++i)
        for (int64_t j = 0; j < NR_AVX2; ++j) acc[i][j] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        __m256 wv[NR_AVX2];
        for (int64_t j = 0; j < NR_AVX2; ++j) {
            PREFETCH_LINE((const char *)(w + j * K + k) + PREFETCH_BYTES);
            wv[j] = _mm256_loadu_ps(w + j * K + k);
        }
        for (int64_t i = 0; i < mr; ++i) {
            __m256 xv = _mm256_loadu_ps(x + i * ldx + k);
            for (int64_t j = 0; j < NR_AVX2; ++j)
                acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
        }
    }
    for (int64_t i = 0; i < mr; ++i)
        for (int64_t j = 0; j < NR_AVX2; ++j) {
            float sum = reduce_add8(acc[i][j]);
            for (int64_t t = k; t < K; ++t) sum += x[i * ldx + t] * w[j * K + t];
            out[i * NR_AVX2 + j] = sum;
        }
}

/* tile_f32_rows for a bf16 weight, 16 elements a row an iteration as even and odd
 * vectors (load_bf16_paired), against x paired the same way: MR x 2 sums, four weight
 * vectors, an x vector */
static ALWAYS_INLINE void tile_bf16f_rows(const float *x, const uint16_t *w, float *out,
                                          int64_t K, int64_t mr, int64_t ldx) {
    __m256 acc[MR_TILE][NR_AVX2];
    for (int64_t i = 0; i < mr; ++i)
        for (int64_t j = 0; j < NR_AVX2; ++j) acc[i][j] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + PAIRED <= K; k += PAIRED) {
        __m256 even[NR_AVX2], odd[NR_AVX2];
        for (int64_t j = 0; j < NR_AVX2; ++j) {
            if (!(k & 31)) PREFETCH_LINE((const char *)(w + j * K + k) + PREFETCH_BYTES);
            load_bf16_paired(w + j * K + k, &even[j], &odd[j]);
        }
        for (int64_t i = 0; i < mr; ++i) {
            __m256 xe = _mm256_loadu_ps(x + i * ldx + k);
            __m256 xo = _mm256_loadu_ps(x + i * ldx + k + 8);
            for (int64_t j = 0; j < NR_AVX2; ++j)
                acc[i][j] = _mm256_fmadd_ps(xo, odd[j], _mm256_fmadd_ps(xe, even[j], acc[i][j]));
        }
    }
    for (int64_t i = 0; i < mr; ++i)
        for (int64_t j = 0; j < NR_AVX2; ++j) {
            float sum = reduce_add8(acc[i][j]);
            for (int64_t t = k; t < K; ++t) sum += x[i * ldx + t] * bf16_to_float(w[j * K + t]);
            out[i * NR_AVX2 + j] = sum;
        }
}
#define NR_WIDE NR_AVX2 /* weight rows per tile of tile_bf16f_rows */
#else
static ALWAYS_INLINE void block_f32_rows(const float *x, const float *w, float *out,
                                         int64_t K, int64_t mr, int64_t ldx) {
    for (int64_t i = 0; i < mr; ++i) {
        const float *xr = x + i * ldx;
        float sum = 0.f;
        for (int64_t k = 0; k < K; ++k) sum += xr[k] * w[k];
        out[i] = sum;
    }
}
#endif

#if defined(__AVX512F__)
/* NR weight rows (consecutive in memory) dotted with `mr` rows of x at once: mr x NR
 * sums in registers, each weight vector loaded once for all rows of x and each x vector
 * once for all NR weight rows. From two rows of x on, the multiply-adds, not the weight
 * stream, bound a call; one weight row at a time (block_f32_rows) issues a load for each
 * multiply-add, this one half a load (16 rows x 4096 x 768 twelve times, 2 threads:
 * 11.7 -> 9.1 ms on a Xeon with AMX, docs/benchmarks.md). out: [mr][NR].
 *
 * One body for every dtype: x rows of XT and a weight of WT, as VT vectors of STEP
 * elements loaded with LOAD_X and LOAD_W, multiplied into the fp32 sums with
 * MADD(acc, x, w) (fp32: a fused multiply-add of 16; bf16: vdpbf16ps on 32 pairs; a bf16
 * weight beside fp32 x: widened as loaded, then a fused multiply-add); the tail, fewer
 * than STEP elements, 16 at a time as fp32 loaded (widened for bf16) under a mask by
 * TAIL_X and TAIL_W. */
#define AVX512_TILE(name, XT, WT, VT, STEP, LOAD_X, LOAD_W, MADD, TAIL_X, TAIL_W)          \
    static ALWAYS_INLINE void name(const XT *x, const WT *w, float *out, int64_t K,        \
                                   int64_t mr, int64_t ldx) {                              \
        __m512 acc[MR][NR];                                                                 \
        for (int64_t i = 0; i < mr; ++i)                                                    \
            for (int64_t j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();               \
        int64_t k = 0;                                                                      \
        for (; k + STEP <= K; k += STEP) {                                                  \
            VT wv[NR];                                                                      \
            for (int64_t j = 0; j < NR; ++j) {                                              \
                PREFETCH_LINE((const char *)(w + j * K + k) + PREFETCH_BYTES);              \
                wv[j] = LOAD_W(w + j * K + k);                                              \
            }                                                                               \
            for (int64_t i = 0; i < mr; ++i) {                                              \
                VT xv = LOAD_X(x + i * ldx + k);                                            \
                for (int64_t j = 0; j < NR; ++j) acc[i][j] = MADD(acc[i][j], xv, wv[j]);    \
            }                                                                               \
        }                                                                                   \
        for (; k < K; k += 16) {                                                            \
            int64_t left = K - k < 16 ? K - k : 16;                                         \
            __mmask16 m = (__mmask16)((1u << left) - 1);                                    \
            __m512 wv[NR];                                                                  \
            for (int64_t j = 0; j < NR; ++j) wv[j] = TAIL_W(m, w + j * K + k);              \
            for (int64_t i = 0; i < mr; ++i) {                                              \
                __m512 xv = TAIL_X(m, x + i * ldx + k);                                     \
                for (int64_t j = 0; j < NR; ++j)                                            \
                    acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);                      \
            }                                                                               \
        }                                                                                   \
        for (int64_t i = 0; i < mr; ++i)                                                    \
            for (int64_t j = 0; j < NR; ++j) out[i * NR + j] = _mm512_reduce_add_ps(acc[i][j]); \
    }

static ALWAYS_INLINE __m512 fmadd_f32(__m512 acc, __m512 x, __m512 w) {
    return _mm512_fmadd_ps(x, w, acc);
}
AVX512_TILE(tile_f32_rows, float, float, __m512, 16, _mm512_loadu_ps, _mm512_loadu_ps,
            fmadd_f32, _mm512_maskz_loadu_ps, _mm512_maskz_loadu_ps)
#endif

/* ---- bf16 ------------------------------------------------------------------------ */

#if defined(__AVX512F__)
/* the first bits of m: as _mm512_maskz_loadu_ps, for bf16 (widened to fp32) */
static inline __m512 widen_bf16_masked(__mmask16 m, const uint16_t *p) {
    __m256i h = _mm256_maskz_loadu_epi16(m, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

#if defined(__AVX512BF16__)
/* vdpbf16ps: 32 bf16 pairs per instruction, each pair's products summed into fp32 */
static ALWAYS_INLINE void block_bf16_rows(const uint16_t *x, const uint16_t *w,
                                          float *out, int64_t K, int64_t mr, int64_t ldx) {
    __m512 acc[MR][2];
    for (int64_t i = 0; i < mr; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
        PREFETCH_AHEAD(w + k);
        __m512bh a = (__m512bh)_mm512_loadu_si512(w + k),
                 b = (__m512bh)_mm512_loadu_si512(w + k + 32);
        for (int64_t i = 0; i < mr; ++i) {
            acc[i][0] = _mm512_dpbf16_ps(acc[i][0],
                                         (__m512bh)_mm512_loadu_si512(x + i * ldx + k), a);
            acc[i][1] = _mm512_dpbf16_ps(acc[i][1],
                                         (__m512bh)_mm512_loadu_si512(x + i * ldx + k + 32), b);
        }
    }
    for (; k < K; k += 16) { /* the tail, widened to fp32 16 at a time */
        int64_t left = K - k < 16 ? K - k : 16;
        __mmask16 m = (__mmask16)((1u << left) - 1);
        __m512 a = widen_bf16_masked(m, w + k);
        for (int64_t i = 0; i < mr; ++i)
            acc[i][0] = _mm512_fmadd_ps(widen_bf16_masked(m, x + i * ldx + k), a, acc[i][0]);
    }
    for (int64_t i = 0; i < mr; ++i) out[i] = _mm512_reduce_add_ps(_mm512_add_ps(acc[i][0], acc[i][1]));
}
#elif defined(__AVX512F__)
static ALWAYS_INLINE void block_bf16_rows(const uint16_t *x, const uint16_t *w,
                                          float *out, int64_t K, int64_t mr, int64_t ldx) {
    __m512 acc[MR];
    for (int64_t i = 0; i < mr; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        int64_t left = K - k < 16 ? K - k : 16;
        __mmask16 m = (__mmask16)((1u << left) - 1);
        __m512 a = widen_bf16_masked(m, w + k);
        for (int64_t i = 0; i < mr; ++i)
            acc[i] = _mm512_fmadd_ps(widen_bf16_masked(m, x + i * ldx + k), a, acc[i]);
    }
    for (int64_t i = 0; i < mr; ++i) out[i] = _mm512_reduce_add_ps(acc[i]);
}
#else
static ALWAYS_INLINE void block_bf16_rows(const uint16_t *x, const uint16_t *w,
                                          float *out, int64_t K, int64_t mr, int64_t ldx) {
    for (int64_t i = 0; i < mr; ++i) {
        const uint16_t *xr = x + i * ldx;
        float sum = 0.f;
        for (int64_t k = 0; k < K; ++k) sum += bf16_to_float(xr[k]) * bf16_to_float(w[k]);
        out[i] = sum;
    }
}
#endif

#if defined(__AVX512F__) && !defined(__AVX512BF16__)
/* AVX-512 without a bf16 dot product (Ice Lake, some Sapphire Rapids guests): as on AVX2,
 * x is widened to fp32 once per call (llmq_skinny_bf16) and the weight as it streams in,
 * 16 at a time (a zero-extend and a shift), in block_f32_rows' body. block_bf16_rows
 * above (left for when the widened copy of x cannot be allocated) widens x again for
 * every weight row and keeps one FMA chain a row: it read bf16 weights at half the rate
 * of fp32 ones, and 16 rows took twice as long as in fp32 (docs/benchmarks.md, "Intel
 * Xeon with AVX-512 and no bf16") */
#define SKINNY_WIDEN_X 1
#define NR_WIDE NR /* weight rows per tile of tile_bf16f_rows */
static inline __m512 widen_bf16(const uint16_t *p) {
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
AVX512_BLOCK(block_bf16f_rows, uint16_t, widen_bf16, widen_bf16_masked)
/* tile_f32_rows for a bf16 weight beside fp32 x: each weight vector widened once for all
 * the rows of x */
AVX512_TILE(tile_bf16f_rows, float, uint16_t, __m512, 16, _mm512_loadu_ps, widen_bf16,
            fmadd_f32, _mm512_maskz_loadu_ps, widen_bf16_masked)
#endif

#if defined(__AVX512BF16__)
/* tile_f32_rows for bf16 (AVX512_TILE above) */
static ALWAYS_INLINE __m512bh load32_bf16(const uint16_t *p) {
    return (__m512bh)_mm512_loadu_si512(p);
}
AVX512_TILE(tile_bf16_rows, uint16_t, uint16_t, __m512bh, 32, load32_bf16, load32_bf16,
            _mm512_dpbf16_ps, widen_bf16_masked, widen_bf16_masked)
#endif

/* name(...): name##_rows for x rows of type XT and weight rows of type WT, with mr (at
 * most MAXR) a constant */
#define BY_ROW_COUNT_UPTO(name, XT, WT, MAXR)                                             \
    static void name(const XT *x, const WT *w, float *out, int64_t K, int64_t mr,         \
                     int64_t ldx) {                                                       \
        switch (mr) {                                                                     \
        case 1: name##_rows(x, w, out, K, 1, ldx); break;                                \
        case 2: name##_rows(x, w, out, K, 2, ldx); break;                                \
        case 3: name##_rows(x, w, out, K, 3, ldx); break;                                \
        case 4: name##_rows(x, w, out, K, 4 < (MAXR) ? 4 : (MAXR), ldx); break;          \
        case 5: name##_rows(x, w, out, K, 5 < (MAXR) ? 5 : (MAXR), ldx); break;          \
        default: name##_rows(x, w, out, K, MAXR, ldx); break;                            \
        }                                                                                 \
    }
#define BY_ROW_COUNT(name, XT, WT) BY_ROW_COUNT_UPTO(name, XT, WT, MR)
#define BY_TILE_ROW_COUNT(name, XT, WT) BY_ROW_COUNT_UPTO(name, XT, WT, MR_TILE)
BY_ROW_COUNT(block_f32, float, float)
BY_ROW_COUNT(block_bf16, uint16_t, uint16_t)
#if defined(__AVX512F__) || defined(SKINNY_AVX2)
BY_TILE_ROW_COUNT(tile_f32, float, float)
#endif
#if defined(__AVX512BF16__)
BY_TILE_ROW_COUNT(tile_bf16, uint16_t, uint16_t)
#endif
#if defined(SKINNY_AVX2) || defined(SKINNY_WIDEN_X)
BY_ROW_COUNT(block_bf16f, float, uint16_t)
BY_TILE_ROW_COUNT(tile_bf16f, float, uint16_t)
#endif

/* ---- entry points ------------------------------------------------------------------ */

/* Weight rows below this many elements in all go on one thread: a parallel region costs
 * more than it saves. */
#define SERIAL_ELEMENTS (1 << 16)

/* weight rows [from, to) in groups of NB: BLOCK dots NB weight rows with up to MRB rows of
 * x (row stride ldx) into part [mr][NB]; the sums, with the bias, go to y. TO_F32 /
 * FROM_F32 convert one element of the output dtype. The rows go in blocks of NBLK: a
 * block's weight rows (48 KB of bf16 at K = 768) stay in L2 while every group of x rows
 * passes over them, and a group's x rows stay in L1 while it passes; the groups split M
 * evenly (8 rows: 4 and 4, not 6 and 2). With the six-row AVX2 tiles (Zen 3, the 100m
 * model's weights, 2 threads): bf16 5-9% faster from 5 to 64 rows of x, fp32 16% at 12
 * and 16 rows (docs/benchmarks.md). Other builds take a block of one tile: every group of
 * x rows passes over a tile before the next (AVX-512 on a Xeon with AMX: blocks of 32 weight
 * rows 1.03-1.09x the time of single tiles in fp32 from 8 rows, and one block of all the
 * rows 1.46-1.65x, as every group then streams the weights from memory again). */
#if defined(SKINNY_AVX2)
#define NBLK(NB) 32
#else
#define NBLK(NB) (NB)
#endif
#define WEIGHT_ROWS(BLOCK, NB, MRB, x, ldx, from, to, TO_F32, FROM_F32)                   \
    for (int64_t nb = (from), groups = (M + (MRB) - 1) / (MRB); nb < (to);                \
         nb += NBLK(NB))                                                                  \
        for (int64_t g = 0; g < groups; ++g)                                              \
            for (int64_t n = nb, m = g * M / groups, mr = (g + 1) * M / groups - m;       \
                 n + (NB) <= (to) && n < nb + NBLK(NB); n += (NB)) {                      \
                float part[(MRB) * (NB)];                                                 \
                BLOCK((x) + m * (ldx), w + n * K, part, K, mr, ldx);                      \
                for (int64_t i = 0; i < mr; ++i)                                          \
                    for (int64_t j = 0; j < (NB); ++j)                                    \
                        y[(m + i) * N + n + j] = FROM_F32(                                \
                            part[i * (NB) + j] + (bias ? TO_F32(bias[n + j]) : 0.f));     \
            }

/* weight rows [from, to): tiles of NRT rows (TILE, MR_TILE rows of x at a time), then the
 * rows left one at a time (BLOCK, MR rows of x); NRT 1: BLOCK alone (TILE is BLOCK) */
#define TILES_THEN_ROWS(TILE, BLOCK, NRT, x, ldx, from, to, TO_F32, FROM_F32)             \
    do {                                                                                  \
        int64_t tiled_end = (from) + ((to) - (from)) / (NRT) * (NRT);                     \
        WEIGHT_ROWS(TILE, NRT, (NRT) > 1 ? MR_TILE : MR, x, ldx, from, tiled_end, TO_F32, \
                    FROM_F32)                                                             \
        WEIGHT_ROWS(BLOCK, 1, MR, x, ldx, tiled_end, to, TO_F32, FROM_F32)                \
    } while (0)

/* the loop over output features, split between threads: each thread takes a contiguous
 * run of whole tiles of NRT weight rows (NRT 1: rows, TILE = BLOCK), the last thread also
 * the N % NRT rows left, and asks for the first PREFETCH_BYTES of its run at once (the
 * block loops keep that far ahead from then on) */
#define SKINNY_LOOP(TILE, BLOCK, NRT, x, ldx, TO_F32, FROM_F32)                           \
    do {                                                                                  \
        if (N * K < SERIAL_ELEMENTS) threads = 1;                                         \
        _Pragma("omp parallel num_threads(threads)")                                      \
        {                                                                                 \
            int64_t team = omp_get_num_threads(), me = omp_get_thread_num();              \
            int64_t tiles = N / (NRT), first = tiles * me / team * (NRT);                 \
            int64_t end = me == team - 1 ? N : tiles * (me + 1) / team * (NRT);           \
            prefetch_run(w + first * K, (end - first) * K * (int64_t)sizeof(*w));         \
            TILES_THEN_ROWS(TILE, BLOCK, NRT, x, ldx, first, end, TO_F32, FROM_F32);      \
        }                                                                                 \
    } while (0)
#define SAME_F32(v) (v)

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define SKINNY_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

/* bf16 projections of two rows or more on AMX's tile multiply (Xeon 4th generation on):
 * C[16 weight rows][up to 16 rows of x] += A[16 weight rows][32 k] . B[16 k pairs][x rows
 * x 2], fp32 sums. A loads straight from the plain weight (rows K apart); B is x
 * transposed into pairs once per call. Four C tiles (64 weight rows) share each B tile.
 * Twelve 4096 x 768 weights at 16 rows, 2 threads: 3.8 ms against 8.7 ms for the
 * AVX-512 tiles (docs/benchmarks.md). */
#define AMX_ROWS 16     /* weight rows (and at most x rows) of a tile */
#define AMX_K 32        /* bf16 of k per tile multiply */
#define AMX_C_TILES 4   /* C tiles, weight rows AMX_ROWS apart, sharing a B tile */
/* rows of x from which the tiles take a call: below, the vector tiles were faster */
#define AMX_MIN_ROWS 5

/* The kernel asks the OS for the tile state once per process; -1 refused, 1 granted */
static int amx_permitted(void) {
    static int state;
    int known = __atomic_load_n(&state, __ATOMIC_ACQUIRE);
    if (!known) {
        /* ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA */
        known = syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 1 : -1;
        __atomic_store_n(&state, known, __ATOMIC_RELEASE);
    }
    return known > 0;
}

struct amx_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* tiles 0-3: C, 16 weight rows x `xr` fp32; 4: A, 16 weight rows x 32 bf16; 5: B, 16 k
 * pairs x `xr` pairs */
static void amx_configure(int64_t xr) {
    struct amx_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < AMX_C_TILES; ++t) {
        c.rows[t] = AMX_ROWS;
        c.colsb[t] = (uint16_t)(xr * 4);
    }
    c.rows[4] = AMX_ROWS;
    c.colsb[4] = AMX_K * 2;
    c.rows[5] = AMX_K / 2;
    c.colsb[5] = (uint16_t)(xr * 4);
    _tile_loadconfig(&c);
}

/* `tiles` C tiles (1 or AMX_C_TILES) of weight rows from n against the xr rows of x at
 * m (xv: their pairs), into y */
#define AMX_BLOCK(TILES)                                                                  \
    do {                                                                                  \
        _tile_zero(0);                                                                    \
        if ((TILES) > 1) {                                                                \
            _tile_zero(1);                                                                \
            _tile_zero(2);                                                                \
            _tile_zero(3);                                                                \
        }                                                                                 \
        for (int64_t k = 0; k < K; k += AMX_K) {                                          \
            _tile_loadd(5, xv + k * xr, xr * 4);                                          \
            _tile_loadd(4, w + n * K + k, K * 2);                                         \
            _tile_dpbf16ps(0, 4, 5);                                                      \
            if ((TILES) > 1) {                                                            \
                _tile_loadd(4, w + (n + AMX_ROWS) * K + k, K * 2);                        \
                _tile_dpbf16ps(1, 4, 5);                                                  \
                _tile_loadd(4, w + (n + 2 * AMX_ROWS) * K + k, K * 2);                    \
                _tile_dpbf16ps(2, 4, 5);                                                  \
                _tile_loadd(4, w + (n + 3 * AMX_ROWS) * K + k, K * 2);                    \
                _tile_dpbf16ps(3, 4, 5);                                                  \
            }                                                                             \
        }                                                                                 \
        _tile_stored(0, c[0], AMX_ROWS * 4);                                              \
        if ((TILES) > 1) {                                                                \
            _tile_stored(1, c[1], AMX_ROWS * 4);                                          \
            _tile_stored(2, c[2], AMX_ROWS * 4);                                          \
            _tile_stored(3, c[3], AMX_ROWS * 4);                                          \
        }                                                                                 \
        for (int t = 0; t < (TILES); ++t)                                                 \
            for (int64_t i = 0; i < AMX_ROWS; ++i) {                                      \
                int64_t row = n + t * AMX_ROWS + i;                                       \
                float b = bias ? bf16_to_float(bias[row]) : 0.f;                          \
                for (int64_t j = 0; j < xr; ++j)                                          \
                    y[(m + j) * N + row] = float_to_bf16(c[t][i][j] + b);                 \
            }                                                                             \
    } while (0)

/* y = x w^T (+ bias) on the tiles; 0 when done, -1 when it cannot run here (no tile
 * permission, K not a multiple of AMX_K, no memory): the caller takes the vector path */
static int skinny_bf16_amx(const uint16_t *x, const uint16_t *w, const uint16_t *bias,
                           uint16_t *y, int64_t M, int64_t N, int64_t K, int64_t ldx,
                           int threads) {
    if (K % AMX_K || N < AMX_ROWS || !amx_permitted()) return -1;
    /* x in pairs, per block of up to 16 rows: block b's row j, pair r at
     * xv_all[b * 16 * K + (r * xr + j) * 2] */
    int64_t blocks = (M + AMX_ROWS - 1) / AMX_ROWS;
    uint16_t *xv_all = aligned_alloc(64, sizeof(uint16_t) * (size_t)(blocks * AMX_ROWS * K));
    if (!xv_all) return -1;
    for (int64_t b = 0; b < blocks; ++b) {
        int64_t m = b * AMX_ROWS, xr = M - m < AMX_ROWS ? M - m : AMX_ROWS;
        uint16_t *xv = xv_all + b * AMX_ROWS * K;
        for (int64_t r = 0; r < K / 2; ++r)
            for (int64_t j = 0; j < xr; ++j) {
                xv[(r * xr + j) * 2] = x[(m + j) * ldx + 2 * r];
                xv[(r * xr + j) * 2 + 1] = x[(m + j) * ldx + 2 * r + 1];
            }
    }
    if (N * K < SERIAL_ELEMENTS) threads = 1;
    _Pragma("omp parallel num_threads(threads)")
    {
        /* a thread's run: whole units of AMX_ROWS weight rows; the last thread's also the
         * N % AMX_ROWS rows left, on the vector tiles */
        int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
        int64_t units = N / AMX_ROWS;
        int64_t first = units * me / team * AMX_ROWS, end = units * (me + 1) / team * AMX_ROWS;
        prefetch_run(w + first * K, (end - first) * K * (int64_t)sizeof(*w));
        float c[AMX_C_TILES][AMX_ROWS][AMX_ROWS];
        for (int64_t b = 0; b < blocks; ++b) {
            int64_t m = b * AMX_ROWS, xr = M - m < AMX_ROWS ? M - m : AMX_ROWS;
            const uint16_t *xv = xv_all + b * AMX_ROWS * K;
            amx_configure(xr);
            int64_t n = first;
            for (; n + AMX_C_TILES * AMX_ROWS <= end; n += AMX_C_TILES * AMX_ROWS)
                AMX_BLOCK(AMX_C_TILES);
            for (; n < end; n += AMX_ROWS) AMX_BLOCK(1);
        }
        _tile_release();
        if (me == team - 1) /* the rows left, on the vector tiles */
            TILES_THEN_ROWS(tile_bf16, block_bf16, NR, x, ldx, end, N, bf16_to_float,
                            float_to_bf16);
    }
    free(xv_all);
    return 0;
}
#endif

#if defined(SKINNY_AVX2)
/* One row of x (xf, widened) against the bf16 weight w [N, K]: each thread's weight rows
 * in `row_streams` runs read side by side (streams_bf16f). */
static void rows_side_by_side_bf16(const float *xf, const uint16_t *w, const uint16_t *bias,
                                   uint16_t *y, int64_t N, int64_t K, int threads) {
    if (N * K < SERIAL_ELEMENTS) threads = 1;
    const int S = (int)row_streams;
    _Pragma("omp parallel num_threads(threads)")
    {
        int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
        int64_t first = N * me / team, end = N * (me + 1) / team;
        int64_t per = llmq_run_length(first, end, S), rows[MAX_ROW_STREAMS];
        for (int s = 0; s < S && first + s * per < end; ++s) /* each run's start */
            prefetch_run(w + (first + s * per) * K, PREFETCH_BYTES / S);
        for (int64_t i = 0; i < per; ++i) {
            const uint16_t *ws[MAX_ROW_STREAMS];
            int n = llmq_runs_step(first, end, S, i, rows);
            for (int s = 0; s < n; ++s) ws[s] = w + rows[s] * K;
            float part[MAX_ROW_STREAMS];
            streams_bf16f_any(xf, ws, part, K, n);
            for (int s = 0; s < n; ++s)
                y[rows[s]] = float_to_bf16(part[s] + (bias ? bf16_to_float(bias[rows[s]]) : 0.f));
        }
    }
}
#endif

#if defined(SKINNY_AVX2) || defined(SKINNY_WIDEN_X)
/* x [M, K] (row stride ldx) widened to fp32 into xf [M, K]; on AVX2 each whole block of
 * PAIRED elements as its even elements, then its odd ones: the order load_bf16_paired
 * gives a weight's */
static void widen_x(const uint16_t *x, int64_t ldx, int64_t M, int64_t K, float *xf) {
    for (int64_t m = 0; m < M; ++m) {
        const uint16_t *row = x + m * ldx;
        float *out = xf + m * K;
        int64_t k = 0;
#if defined(SKINNY_AVX2)
        for (; k + PAIRED <= K; k += PAIRED)
            for (int64_t i = 0; i < PAIRED / 2; ++i) {
                out[k + i] = bf16_to_float(row[k + 2 * i]);
                out[k + PAIRED / 2 + i] = bf16_to_float(row[k + 2 * i + 1]);
            }
#endif
        for (; k < K; ++k) out[k] = bf16_to_float(row[k]);
    }
}
#endif

/* x [M, K] (row stride ldx), w [N, K] contiguous, bias [N] or NULL, y [M, N] contiguous */
void llmq_skinny_f32(const float *x, const float *w, const float *bias, float *y, int64_t M,
                     int64_t N, int64_t K, int64_t ldx, int threads) {
#if defined(__AVX512F__)
    if (M >= 2) {
        SKINNY_LOOP(tile_f32, block_f32, NR, x, ldx, SAME_F32, SAME_F32);
        return;
    }
#elif defined(SKINNY_AVX2)
    if (M >= 2) {
        SKINNY_LOOP(tile_f32, block_f32, NR_AVX2, x, ldx, SAME_F32, SAME_F32);
        return;
    }
#endif
    SKINNY_LOOP(block_f32, block_f32, 1, x, ldx, SAME_F32, SAME_F32);
}

void llmq_skinny_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias,
                      uint16_t *y, int64_t M, int64_t N, int64_t K, int64_t ldx,
                      int threads) {
#if defined(SKINNY_AVX2) || defined(SKINNY_WIDEN_X)
    /* no bf16 dot product (AVX2, or AVX-512 without BF16): x is widened to fp32 once here
     * (M x K, a few KB), so the inner loop widens only the streamed weight */
    float *xf = malloc(sizeof(float) * (size_t)(M * K));
    if (xf) {
        widen_x(x, ldx, M, K, xf);
        if (M >= 2)
            SKINNY_LOOP(tile_bf16f, block_bf16f, NR_WIDE, xf, K, bf16_to_float, float_to_bf16);
#if defined(SKINNY_AVX2)
        else if (row_streams > 1)
            rows_side_by_side_bf16(xf, w, bias, y, N, K, threads);
#endif
        else
            SKINNY_LOOP(block_bf16f, block_bf16f, 1, xf, K, bf16_to_float, float_to_bf16);
        free(xf);
        return;
    }
    /* out of memory for the widened copy: the plain loops below */
#endif
#if defined(SKINNY_AMX)
    if (M >= AMX_MIN_ROWS && skinny_bf16_amx(x, w, bias, y, M, N, K, ldx, threads) == 0)
        return;
#endif
#if defined(__AVX512BF16__)
    if (M >= 2) {
        SKINNY_LOOP(tile_bf16, block_bf16, NR, x, ldx, bf16_to_float, float_to_bf16);
        return;
    }
#endif
    SKINNY_LOOP(block_bf16, block_bf16, 1, x, ldx, bf16_to_float, float_to_bf16);
}

/* which code path this build took, for the start-up log */
const char *llmq_skinny_isa(void) {
#if defined(SKINNY_AMX)
    return "amx_bf16";
#elif defined(__AVX512BF16__)
    return "avx512_bf16";
#elif defined(__AVX512F__)
    return "avx512f";
#elif defined(SKINNY_AVX2)
    return "avx2";
#else
    return "generic";
#endif
}
