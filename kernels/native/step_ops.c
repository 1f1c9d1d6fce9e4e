/* The small operations of a model step, one call each instead of several torch ops:
 * RMSNorm (with the residual add), rotary embedding, the gated activation, the KV store
 * and paged decode attention.
 *
 * At a decode step of few sequences each of these works on a few kilobytes, so a chain of
 * torch ops costs its dispatch, allocations and conversions more than its arithmetic.
 * Each function here does the arithmetic of the pure-torch reference (kernels/norms.py,
 * rotary.py, activation.py, attention.py) in the same order, with bf16 results rounded
 * to nearest even at the points where the reference's bf16 ops round; sums are fp32.
 *
 * Built with kernels/native/skinny.c into one library (kernels/native.py), with
 * -ffp-contract=off so that `a * b - c * d` is not fused into one rounding. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#include "bf16.h"
#include "ops.h"

#if defined(__AVX512F__)
#include <immintrin.h>

/* e^x for 16 floats: x = n ln2 + r, |r| <= ln2 / 2, e^r by a degree-6 polynomial
 * (Cephes' expf coefficients), scaled by 2^n; within 2 ulp of expf over the range the
 * activations reach, inf above 88.7, 0 below -103 */
static inline __m512 exp512(__m512 x) {
    const __m512 hi = _mm512_set1_ps(88.7228f), lo = _mm512_set1_ps(-103.9721f);
    __m512 xc = _mm512_min_ps(_mm512_max_ps(x, lo), hi);
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), xc);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    /* 2^n by scalef: exact, and it saturates to inf / 0 past the exponent's range */
    __m512 y = _mm512_scalef_ps(p, n);
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, hi, _CMP_GT_OQ), y,
                                _mm512_set1_ps(INFINITY));
}

static inline __m512 load16_f32(const float *p) { return _mm512_loadu_ps(p); }
static inline __m512 load16_bf16(const uint16_t *p) {
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
/* round to bf16 (nearest even; NaN stays NaN) and back, as a bf16 op's result */
static inline __m512 round16_bf16(__m512 v) {
    __m512i bits = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    rounded = _mm512_and_si512(rounded, _mm512_set1_epi32((int)0xffff0000u));
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    return _mm512_mask_blend_ps(nan, _mm512_castsi512_ps(rounded), v);
}
static inline __m512 round16_f32(__m512 v) { return v; }
static inline void store16_f32(float *p, __m512 v) { _mm512_storeu_ps(p, v); }
static inline void store16_bf16(uint16_t *p, __m512 v) {
    __m512i bits = _mm512_castps_si512(round16_bf16(v));
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
}
#elif defined(__AVX2__) && defined(__FMA__)
#include "avx2.h"
#endif

/* ask for the cache lines of one head's key or value row */
#define PREFETCH_ROW(row, bytes, hint)                                                    \
    for (int c = 0; c < (bytes); c += 64) _mm_prefetch((const char *)(row) + c, hint)
/* while keys t0 .. t0 + width - 1 are scored: ask for the next `width` keys, and into L2
 * for these keys' values (the sums read them next) */
#define PREFETCH_BLOCK(k_cache, v_cache, rows, t0, width, L, row_bytes)                   \
    do {                                                                                  \
        for (int64_t j_ = (t0) + (width); j_ < (t0) + 2 * (width) && j_ < (L); ++j_)      \
            PREFETCH_ROW((k_cache) + (rows)[j_], row_bytes, _MM_HINT_T0);                 \
        for (int64_t j_ = (t0); j_ < (t0) + (width) && j_ < (L); ++j_)                    \
            PREFETCH_ROW((v_cache) + (rows)[j_], row_bytes, _MM_HINT_T1);                 \
    } while (0)

#define LOAD_F32(p, i) ((p)[i])
#define STORE_F32(p, i, v) ((p)[i] = (v))
#define ROUND_F32(v) (v)
#define LOAD_BF16(p, i) bf16_to_float((p)[i])
#define STORE_BF16(p, i, v) ((p)[i] = float_to_bf16(v))
#define ROUND_BF16(v) round_bf16(v)

/* below this many elements an operation runs on one thread: a parallel region costs more */
#define PARALLEL_ELEMENTS (1 << 15)

/* sum of x[i] * y[i], in 16 lanes the compiler vectorises (then summed pairwise) */
#define LANES 16
#define DOT(name, T, LOAD)                                                                \
    static inline float name(const float *x, const T *y, int64_t n) {                    \
        float lanes[LANES] = {0};                                                         \
        int64_t i = 0;                                                                    \
        for (; i + LANES <= n; i += LANES)                                                \
            for (int j = 0; j < LANES; ++j) lanes[j] += x[i + j] * LOAD(y, i + j);        \
        float sum = 0.f;                                                                  \
        for (int j = 0; j < LANES; ++j) sum += lanes[j];                                  \
        for (; i < n; ++i) sum += x[i] * LOAD(y, i);                                      \
        return sum;                                                                       \
    }

/* the vector body of silu_and_mul: 16 at a time, the same roundings as the scalar tail */
#if defined(__AVX512F__)
#define SILU_VECTOR(S)                                                                    \
    for (; k + 16 <= d; k += 16) {                                                        \
        __m512 g = load16_##S(gate + k);                                                  \
        __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), g));                         \
        __m512 s = round16_##S(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e)));  \
        store16_##S(o + k, _mm512_mul_ps(s, load16_##S(up + k)));                         \
    }
#elif defined(__AVX2__) && defined(__FMA__)
#define SILU_VECTOR(S)                                                                    \
    for (; k + 8 <= d; k += 8) {                                                          \
        __m256 g = load8_##S(gate + k);                                                   \
        __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), g));                         \
        __m256 s = round8_##S(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), e)));   \
        store8_##S(o + k, _mm256_mul_ps(s, load8_##S(up + k)));                           \
    }
#else
#define SILU_VECTOR(S)
#endif

/* a query head . a key: 16 lanes of fp32 multiply-adds, then one reduction; the lane
 * loop of `dot_*` where the head size is not a multiple of 16 or there is no AVX-512 */
#if defined(__AVX512F__)
static inline float head_dot_f32(const float *q, const float *k, int64_t D) {
    __m512 a = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) a = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), load16_f32(k + d), a);
    return _mm512_reduce_add_ps(a);
}
static inline float head_dot_bf16(const float *q, const uint16_t *k, int64_t D) {
    __m512 a = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) a = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), load16_bf16(k + d), a);
    return _mm512_reduce_add_ps(a);
}
#define HEAD_DOT(S, q, k, D) ((D) % 16 == 0 ? head_dot_##S(q, k, D) : dot_##S(q, k, D))

/* the lanes of a 16-wide step that hold one of the `left` remaining elements */
static inline __mmask16 tail_mask(int64_t left) {
    return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
}

/* softmax of one row of scores in place, then rounded as the dtype's softmax rounds */
#define SOFTMAX(S, ROUND16)                                                               \
    static inline void softmax_##S(float *s, int64_t L) {                                 \
        __m512 top = _mm512_set1_ps(-INFINITY), total = _mm512_setzero_ps();              \
        for (int64_t t = 0; t < L; t += 16) {                                             \
            __mmask16 m = tail_mask(L - t);                                               \
            top = _mm512_mask_max_ps(top, m, top, _mm512_maskz_loadu_ps(m, s + t));       \
        }                                                                                 \
        __m512 peak = _mm512_set1_ps(_mm512_reduce_max_ps(top));                          \
        for (int64_t t = 0; t < L; t += 16) {                                             \
            __mmask16 m = tail_mask(L - t);                                               \
            __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + t), peak));      \
            _mm512_mask_storeu_ps(s + t, m, e);                                           \
            total = _mm512_mask_add_ps(total, m, total, e);                               \
        }                                                                                 \
        __m512 sum = _mm512_set1_ps(_mm512_reduce_add_ps(total));                         \
        for (int64_t t = 0; t < L; t += 16) {                                             \
            __mmask16 m = tail_mask(L - t);                                               \
            __m512 v = ROUND16(_mm512_div_ps(_mm512_maskz_loadu_ps(m, s + t), sum));      \
            _mm512_mask_storeu_ps(s + t, m, v);                                           \
        }                                                                                 \
    }
SOFTMAX(f32, round16_f32)
SOFTMAX(bf16, round16_bf16)

/* acc[g] = sum over t of p[g][t] * value[t], 16 features at a time in registers (the
 * values of a key are read once per query head, from L1); 0 where D is not a multiple
 * of 16 (the caller's loop then does it) */
#define VALUES(S, T)                                                                      \
    static inline int weighted_values_##S(const float *p, int64_t L, int64_t G,           \
                                          int64_t D, const T *v_cache,                    \
                                          const int64_t *rows, float *acc) {              \
        if (D % 16) return 0;                                                             \
        for (int64_t g = 0; g < G; ++g)                                                   \
            for (int64_t d = 0; d < D; d += 16) {                                         \
                __m512 a = _mm512_setzero_ps();                                           \
                for (int64_t t = 0; t < L; ++t) {                                         \
                    const T *value = v_cache + rows[t];                                   \
                    a = _mm512_fmadd_ps(_mm512_set1_ps(p[g * L + t]),                     \
                                        load16_##S(value + d), a);                        \
                }                                                                         \
                _mm512_storeu_ps(acc + g * D + d, a);                                     \
            }                                                                             \
        return 1;                                                                         \
    }
VALUES(f32, float)
VALUES(bf16, uint16_t)
#define WEIGHTED_VALUES(S, ...) weighted_values_##S(__VA_ARGS__)

/* The totals of sixteen keys' dot products at once: a[j] holds key j's 16 lane sums; the
 * result holds the 16 totals in key order, each summed in the pairing of
 * _mm512_reduce_add_ps (lane i + lane i+8, then +4, +2, +1), so each is `head_dot`'s
 * total bit for bit, for 15 shuffle pairs instead of sixteen reductions */
static inline __m512 reduce_add16x16(const __m512 *a) {
    __m512 r[8], s[4], u[2];
    for (int m = 0; m < 8; ++m)
        r[m] = _mm512_add_ps(
            _mm512_shuffle_f32x4(a[2 * m], a[2 * m + 1], _MM_SHUFFLE(1, 0, 1, 0)),
            _mm512_shuffle_f32x4(a[2 * m], a[2 * m + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    /* r[m]: lanes 0-7 key 2m's half sums, 8-15 key 2m+1's */
    for (int m = 0; m < 4; ++m)
        s[m] = _mm512_add_ps(
            _mm512_shuffle_f32x4(r[2 * m], r[2 * m + 1], _MM_SHUFFLE(2, 0, 2, 0)),
            _mm512_shuffle_f32x4(r[2 * m], r[2 * m + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    /* s[m]: 128-bit lane l holds key 4m + l's four sums */
    for (int m = 0; m < 2; ++m)
        u[m] = _mm512_add_ps(
            _mm512_shuffle_ps(s[2 * m], s[2 * m + 1], _MM_SHUFFLE(1, 0, 1, 0)),
            _mm512_shuffle_ps(s[2 * m], s[2 * m + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    /* u[m]: lane l holds key 8m + l's two sums, then key 8m + 4 + l's */
    __m512 w = _mm512_add_ps(_mm512_shuffle_ps(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_ps(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
    /* w: element 4l + e is key l + 4e's total */
    const __m512i order =
        _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(order, w);
}

/* the scores of one query head (q [NV]) against 16 keys (fewer: n), key j's vector v
 * loaded by KEY(j, v, NV), reduced, rounded and stored at `out` */
#define HEAD_SCORES(S, NV, KEY, out)                                                      \
    do {                                                                                  \
        __m512 a[16];                                                                     \
        _Pragma("GCC unroll 16")                                                          \
        for (int j = 0; j < 16; ++j) {                                                    \
            a[j] = _mm512_setzero_ps();                                                   \
            if (j < n) {                                                                  \
                _Pragma("GCC unroll 8")                                                   \
                for (int v = 0; v < NV; ++v)                                              \
                    a[j] = _mm512_fmadd_ps(q[v], KEY(j, v, NV), a[j]);                    \
            }                                                                             \
        }                                                                                 \
        _mm512_mask_storeu_ps(out, tail_mask(n), round16_##S(reduce_add16x16(a)));        \
    } while (0)

/* One sequence's query heads sharing a KV head (G of them, scaled, as `qs` [G, D]) over
 * its L keys and values (`rows`: where each lies), D = 16 NV features: the scores 16 keys
 * at a time, every head's for a block of keys before the next block (block-major: a key
 * row is read from memory once and, in bf16, widened to fp32 once for all G heads; head
 * by head, bf16 keys were widened G times, and bf16 attention with grouped heads ran no
 * faster than fp32 on half the bytes), then the weighted values with every head's sums
 * in registers, each value read once for all G heads. The same sums in the same order
 * as `head_dot`, `softmax_*` and `weighted_values_*`: the results are theirs bit for
 * bit. Each row is asked for ahead of its use (the heads' rows lie 1 KB or more apart,
 * in blocks anywhere in the cache: the hardware's prefetchers miss them). */
#define ATTEND_NV(S, T, NV)                                                               \
    static void attend_##S##_##NV(const float *qs, int64_t G, int64_t L,                  \
                                  const T *k_cache, const T *v_cache,                     \
                                  const int64_t *rows, float *p, float *acc) {            \
        const int row_bytes = 16 * NV * (int)sizeof(T);                                   \
        /* a block's keys as fp32 (bf16 with G > 1), key j's vector v at (j NV + v) 16 */ \
        float wide[16 * 16 * NV];                                                         \
        const int widen = sizeof(T) != sizeof(float) && G > 1;                            \
        for (int64_t t0 = 0; t0 < L; t0 += 16) {                                          \
            int64_t n = L - t0 < 16 ? L - t0 : 16;                                        \
            const T *key[16];                                                             \
            PREFETCH_BLOCK(k_cache, v_cache, rows, t0, 16, L, row_bytes);                 \
            for (int j = 0; j < n; ++j) key[j] = k_cache + rows[t0 + j];                  \
            if (widen)                                                                    \
                for (int j = 0; j < n; ++j)                                               \
                    for (int v = 0; v < NV; ++v)                                          \
                        _mm512_storeu_ps(wide + (j * NV + v) * 16,                        \
                                         load16_##S(key[j] + 16 * v));                    \
            for (int64_t g = 0; g < G; ++g) {                                             \
                __m512 q[NV];                                                             \
                for (int v = 0; v < NV; ++v) q[v] = _mm512_loadu_ps(qs + (g * NV + v) * 16); \
                if (widen)                                                                \
                    HEAD_SCORES(S, NV, WIDE_KEY, p + g * L + t0);                         \
                else                                                                      \
                    HEAD_SCORES(S, NV, CACHED_KEY_##S, p + g * L + t0);                   \
            }                                                                             \
        }                                                                                 \
        for (int64_t g = 0; g < G; ++g) softmax_##S(p + g * L, L);                        \
        for (int64_t g0 = 0; g0 < G; g0 += 16 / NV) {                                     \
            int64_t heads = G - g0 < 16 / NV ? G - g0 : 16 / NV;                          \
            __m512 a[16];                                                                 \
            for (int j = 0; j < 16; ++j) a[j] = _mm512_setzero_ps();                      \
            for (int64_t t = 0; t < L; ++t) {                                             \
                const T *value = v_cache + rows[t];                                       \
                __m512 x[NV];                                                             \
                if (t + 16 < L)                                                           \
                    PREFETCH_ROW(v_cache + rows[t + 16], row_bytes, _MM_HINT_T0);         \
                _Pragma("GCC unroll 8")                                                   \
                for (int v = 0; v < NV; ++v) x[v] = load16_##S(value + 16 * v);           \
                _Pragma("GCC unroll 16")                                                  \
                for (int h = 0; h < 16 / NV; ++h)                                         \
                    if (h < heads) {                                                      \
                        __m512 pt = _mm512_set1_ps(p[(g0 + h) * L + t]);                  \
                        _Pragma("GCC unroll 8")                                           \
                        for (int v = 0; v < NV; ++v)                                      \
                            a[h * NV + v] = _mm512_fmadd_ps(pt, x[v], a[h * NV + v]);     \
                    }                                                                     \
            }                                                                             \
            for (int h = 0; h < heads; ++h)                                               \
                for (int v = 0; v < NV; ++v)                                              \
                    _mm512_storeu_ps(acc + ((g0 + h) * NV + v) * 16, a[h * NV + v]);      \
        }                                                                                 \
    }
/* key j's vector v in ATTEND_NV: from its block's widened copy, or from the cache */
#define WIDE_KEY(j, v, NV) _mm512_loadu_ps(wide + ((j) * (NV) + (v)) * 16)
#define CACHED_KEY_f32(j, v, NV) _mm512_loadu_ps(key[j] + 16 * (v))
#define CACHED_KEY_bf16(j, v, NV) load16_bf16(key[j] + 16 * (v))
#define ATTEND_ALL(S, T)                                                                  \
    ATTEND_NV(S, T, 1)                                                                    \
    ATTEND_NV(S, T, 2)                                                                    \
    ATTEND_NV(S, T, 4)                                                                    \
    ATTEND_NV(S, T, 8)                                                                    \
    static inline int attend_##S(const float *qs, int64_t G, int64_t D, int64_t L,        \
                                 const T *k_cache, const T *v_cache, const int64_t *rows, \
                                 float *p, float *acc) {                                  \
        switch (D) {                                                                      \
        case 16: attend_##S##_1(qs, G, L, k_cache, v_cache, rows, p, acc); return 1;      \
        case 32: attend_##S##_2(qs, G, L, k_cache, v_cache, rows, p, acc); return 1;      \
        case 64: attend_##S##_4(qs, G, L, k_cache, v_cache, rows, p, acc); return 1;      \
        case 128: attend_##S##_8(qs, G, L, k_cache, v_cache, rows, p, acc); return 1;     \
        default: return 0;                                                                \
        }                                                                                 \
    }
ATTEND_ALL(f32, float)
ATTEND_ALL(bf16, uint16_t)
#define ATTEND(S, ...) attend_##S(__VA_ARGS__)
#elif defined(__AVX2__) && defined(__FMA__)
/* a query head . a key (D % 8 == 0): a0 sums features 16j..16j+7 and a1 16j+8..16j+15,
 * the 16 lanes of the AVX-512 form (where D % 16 == 0 the same sums in the same order,
 * reduced alike), and two chains of fmadd in flight instead of one */
#define HEAD_DOT8(S, T)                                                                   \
    static inline float head_dot_##S(const float *q, const T *k, int64_t D) {             \
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();                        \
        int64_t d = 0;                                                                    \
        for (; d + 16 <= D; d += 16) {                                                    \
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8_##S(k + d), a0);           \
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 8), load8_##S(k + d + 8), a1);   \
        }                                                                                 \
        if (d < D) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8_##S(k + d), a0);    \
        return reduce_add8(_mm256_add_ps(a1, a0));                                        \
    }
HEAD_DOT8(f32, float)
HEAD_DOT8(bf16, uint16_t)
#define HEAD_DOT(S, q, k, D) ((D) % 8 == 0 ? head_dot_##S(q, k, D) : dot_##S(q, k, D))

/* the lanes of an 8-wide step that hold one of the `left` (< 8) remaining elements, as
 * maskload / maskstore take them (masked stores are slow on AMD: only the last, partial
 * step of a row uses them) */
static inline __m256i tail_mask8(int64_t left) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)left),
                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* softmax of one row of scores in place, then rounded as the dtype's softmax rounds; the
 * tail's lanes past L are left out of the max (-inf) and of the total (0). The total is
 * two vectors taking alternate steps (`now` this one, `next` the one after): the 16
 * lanes of the AVX-512 form, the same sums */
#define SOFTMAX(S, ROUND8)                                                                \
    static inline void softmax_##S(float *s, int64_t L) {                                 \
        int64_t full = L & ~(int64_t)7;                                                   \
        __m256i m = tail_mask8(L - full);                                                 \
        __m256 mf = _mm256_castsi256_ps(m), top = _mm256_set1_ps(-INFINITY);             \
        for (int64_t t = 0; t < full; t += 8)                                             \
            top = _mm256_max_ps(top, _mm256_loadu_ps(s + t));                             \
        if (full < L) {                                                                   \
            __m256 x = _mm256_maskload_ps(s + full, m);                                   \
            top = _mm256_max_ps(top, _mm256_blendv_ps(top, x, mf));                       \
        }                                                                                 \
        __m256 peak = _mm256_set1_ps(reduce_max8(top));                                   \
        __m256 now = _mm256_setzero_ps(), next = now;                                     \
        for (int64_t t = 0; t < full; t += 8) {                                           \
            __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + t), peak));               \
            _mm256_storeu_ps(s + t, e);                                                   \
            __m256 added = _mm256_add_ps(now, e);                                         \
            now = next;                                                                   \
            next = added;                                                                 \
        }                                                                                 \
        if (full < L) {                                                                   \
            __m256 e = exp256(_mm256_sub_ps(_mm256_maskload_ps(s + full, m), peak));      \
            _mm256_maskstore_ps(s + full, m, e);                                          \
            now = _mm256_add_ps(now, _mm256_and_ps(e, mf));                               \
        }                                                                                 \
        __m256 sum = _mm256_set1_ps(reduce_add8(_mm256_add_ps(next, now)));               \
        for (int64_t t = 0; t < full; t += 8)                                             \
            _mm256_storeu_ps(s + t, ROUND8(_mm256_div_ps(_mm256_loadu_ps(s + t), sum)));  \
        if (full < L) {                                                                   \
            __m256 v = _mm256_div_ps(_mm256_maskload_ps(s + full, m), sum);               \
            _mm256_maskstore_ps(s + full, m, ROUND8(v));                                  \
        }                                                                                 \
    }
SOFTMAX(f32, round8_f32)
SOFTMAX(bf16, round8_bf16)

/* acc[g] = sum over t of p[g][t] * value[t], each feature's sum as the AVX-512 form's
 * (fmadd over t, in order); 32 features at a time, four chains of fmadd in flight where
 * one would wait on its own latency at every key. 0 where D % 8 (the caller's loop) */
#define VALUES(S, T)                                                                      \
    static inline int weighted_values_##S(const float *p, int64_t L, int64_t G,           \
                                          int64_t D, const T *v_cache,                    \
                                          const int64_t *rows, float *acc) {              \
        if (D % 8) return 0;                                                              \
        const int row_bytes = (int)(D * sizeof(T));                                       \
        for (int64_t g = 0; g < G; ++g) {                                                 \
            const float *pg = p + g * L;                                                  \
            float *ag = acc + g * D;                                                      \
            int64_t d = 0;                                                                \
            for (; d + 32 <= D; d += 32) {                                                \
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;               \
                for (int64_t t = 0; t < L; ++t) {                                         \
                    const T *value = v_cache + rows[t] + d;                               \
                    if (g == 0 && d == 0 && t + 16 < L)                                   \
                        PREFETCH_ROW(v_cache + rows[t + 16], row_bytes, _MM_HINT_T0);     \
                    __m256 pt = _mm256_set1_ps(pg[t]);                                    \
                    a0 = _mm256_fmadd_ps(pt, load8_##S(value), a0);                       \
                    a1 = _mm256_fmadd_ps(pt, load8_##S(value + 8), a1);                   \
                    a2 = _mm256_fmadd_ps(pt, load8_##S(value + 16), a2);                  \
                    a3 = _mm256_fmadd_ps(pt, load8_##S(value + 24), a3);                  \
                }                                                                         \
                _mm256_storeu_ps(ag + d, a0);                                             \
                _mm256_storeu_ps(ag + d + 8, a1);                                         \
                _mm256_storeu_ps(ag + d + 16, a2);                                        \
                _mm256_storeu_ps(ag + d + 24, a3);                                        \
            }                                                                             \
            for (; d < D; d += 8) {                                                       \
                __m256 a = _mm256_setzero_ps();                                           \
                for (int64_t t = 0; t < L; ++t)                                           \
                    a = _mm256_fmadd_ps(_mm256_set1_ps(pg[t]),                            \
                                        load8_##S(v_cache + rows[t] + d), a);             \
                _mm256_storeu_ps(ag + d, a);                                              \
            }                                                                             \
        }                                                                                 \
        return 1;                                                                         \
    }
VALUES(f32, float)
VALUES(bf16, uint16_t)
#define WEIGHTED_VALUES(S, ...) weighted_values_##S(__VA_ARGS__)

/* The totals of eight keys' dot products at once: v[j] holds key j's 8 lane sums (a1 +
 * a0 of `head_dot`); the result holds the 8 totals in key order, each summed in the
 * pairing of `reduce_add8` (lane i + lane i+4, then +2, +1): `head_dot`'s totals bit for
 * bit */
static inline __m256 reduce_add8x8(const __m256 *v) {
    __m256 r[4], s[2];
    for (int m = 0; m < 4; ++m)
        r[m] = _mm256_add_ps(_mm256_permute2f128_ps(v[2 * m], v[2 * m + 1], 0x20),
                             _mm256_permute2f128_ps(v[2 * m], v[2 * m + 1], 0x31));
    /* r[m]: lanes 0-3 key 2m's four sums, 4-7 key 2m+1's */
    for (int m = 0; m < 2; ++m)
        s[m] = _mm256_add_ps(
            _mm256_shuffle_ps(r[2 * m], r[2 * m + 1], _MM_SHUFFLE(1, 0, 1, 0)),
            _mm256_shuffle_ps(r[2 * m], r[2 * m + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    /* s[m]: lanes 0-1 key 4m's two sums, 2-3 key 4m+2's; 4-5 key 4m+1's, 6-7 4m+3's */
    __m256 w = _mm256_add_ps(_mm256_shuffle_ps(s[0], s[1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm256_shuffle_ps(s[0], s[1], _MM_SHUFFLE(3, 1, 3, 1)));
    /* w: keys 0, 2, 4, 6, 1, 3, 5, 7 */
    return _mm256_permutevar8x32_ps(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* One sequence's query heads sharing a KV head (as the AVX-512 form, D % 16 == 0): the
 * scores of 8 keys at a time with one reduction, every query head's for a block of keys
 * before the next block (the block's key rows read from memory once for all the heads:
 * bf16, Zen 3, 57 sequences, 7% faster at 370 keys, 18% at 1,000, against each head
 * passing over every key in turn), each block asked for ahead of its use, then
 * `weighted_values_*`. The same results as `head_dot`, bit for bit. */
#define ATTEND_AVX2(S, T)                                                                 \
    static inline int attend_##S(const float *qs, int64_t G, int64_t D, int64_t L,        \
                                 const T *k_cache, const T *v_cache, const int64_t *rows, \
                                 float *p, float *acc) {                                  \
        if (D % 16) return 0;                                                             \
        const int row_bytes = (int)(D * sizeof(T));                                       \
        for (int64_t t0 = 0; t0 < L; t0 += 8) {                                           \
            int64_t n = L - t0 < 8 ? L - t0 : 8;                                          \
            PREFETCH_BLOCK(k_cache, v_cache, rows, t0, 8, L, row_bytes);                  \
            for (int64_t g = 0; g < G; ++g) {                                             \
                const float *q = qs + g * D;                                              \
                __m256 v[8];                                                              \
                _Pragma("GCC unroll 8")                                                   \
                for (int j = 0; j < 8; ++j) {                                             \
                    v[j] = _mm256_setzero_ps();                                           \
                    if (j < n) {                                                          \
                        const T *key = k_cache + rows[t0 + j];                            \
                        __m256 a0 = _mm256_setzero_ps(), a1 = a0;                         \
                        for (int64_t d = 0; d < D; d += 16) {                             \
                            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d),                  \
                                                 load8_##S(key + d), a0);                 \
                            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 8),              \
                                                 load8_##S(key + d + 8), a1);             \
                        }                                                                 \
                        v[j] = _mm256_add_ps(a1, a0);                                     \
                    }                                                                     \
                }                                                                         \
                __m256 w = round8_##S(reduce_add8x8(v));                                  \
                if (n == 8)                                                               \
                    _mm256_storeu_ps(p + g * L + t0, w);                                  \
                else                                                                      \
                    _mm256_maskstore_ps(p + g * L + t0, tail_mask8(n), w);                \
            }                                                                             \
        }                                                                                 \
        for (int64_t g = 0; g < G; ++g) softmax_##S(p + g * L, L);                        \
        return weighted_values_##S(p, L, G, D, v_cache, rows, acc);                       \
    }
ATTEND_AVX2(f32, float)
ATTEND_AVX2(bf16, uint16_t)
#define ATTEND(S, ...) attend_##S(__VA_ARGS__)
#else
#define WEIGHTED_VALUES(S, ...) 0
#define HEAD_DOT(S, q, k, D) dot_##S(q, k, D)
#define SOFTMAX(S, ROUND)                                                                 \
    static inline void softmax_##S(float *s, int64_t L) {                                 \
        float top = -INFINITY, total = 0.f;                                               \
        for (int64_t t = 0; t < L; ++t) top = s[t] > top ? s[t] : top;                    \
        for (int64_t t = 0; t < L; ++t) {                                                 \
            s[t] = expf(s[t] - top);                                                      \
            total += s[t];                                                                \
        }                                                                                 \
        for (int64_t t = 0; t < L; ++t) s[t] = ROUND(s[t] / total);                       \
    }
SOFTMAX(f32, ROUND_F32)
SOFTMAX(bf16, ROUND_BF16)
#endif

#ifndef ATTEND
#define ATTEND(S, ...) 0
#endif

/* vector bodies of the norm, the residual add and rotary: 16 at a time, the same
 * roundings as the scalar tails after them */
#if defined(__AVX512F__)
#define NORM_VECTOR(S, FP32)                                                              \
    for (__m512 rv = _mm512_set1_ps(r); i + 16 <= d; i += 16) {                           \
        __m512 xr = _mm512_mul_ps(load16_##S(x + i), rv);                                 \
        if (!(FP32)) xr = round16_##S(xr);                                                \
        store16_##S(out + i, _mm512_mul_ps(xr, load16_##S(w + i)));                       \
    }
#define ADD_VECTOR(S)                                                                     \
    for (; k + 16 <= d; k += 16)                                                          \
        store16_##S(sum + k, _mm512_add_ps(load16_##S(x + i * d + k),                     \
                                           load16_##S(residual + i * d + k)));
#define ROTARY_VECTOR(S)                                                                  \
    for (; k + 16 <= half; k += 16) {                                                     \
        __m512 x1 = load16_##S(row + k), x2 = load16_##S(row + k + half);                 \
        __m512 c = load16_##S(cr + k), s = load16_##S(sr + k);                            \
        store16_##S(o + k, _mm512_sub_ps(round16_##S(_mm512_mul_ps(x1, c)),               \
                                         round16_##S(_mm512_mul_ps(x2, s))));             \
        store16_##S(o + k + half, _mm512_add_ps(round16_##S(_mm512_mul_ps(x2, c)),        \
                                                round16_##S(_mm512_mul_ps(x1, s))));      \
    }
#elif defined(__AVX2__) && defined(__FMA__)
#define NORM_VECTOR(S, FP32)                                                              \
    for (__m256 rv = _mm256_set1_ps(r); i + 8 <= d; i += 8) {                             \
        __m256 xr = _mm256_mul_ps(load8_##S(x + i), rv);                                  \
        if (!(FP32)) xr = round8_##S(xr);                                                 \
        store8_##S(out + i, _mm256_mul_ps(xr, load8_##S(w + i)));                         \
    }
#define ADD_VECTOR(S)                                                                     \
    for (; k + 8 <= d; k += 8)                                                            \
        store8_##S(sum + k, _mm256_add_ps(load8_##S(x + i * d + k),                       \
                                          load8_##S(residual + i * d + k)));
#define ROTARY_VECTOR(S)                                                                  \
    for (; k + 8 <= half; k += 8) {                                                       \
        __m256 x1 = load8_##S(row + k), x2 = load8_##S(row + k + half);                   \
        __m256 c = load8_##S(cr + k), s = load8_##S(sr + k);                              \
        store8_##S(o + k, _mm256_sub_ps(round8_##S(_mm256_mul_ps(x1, c)),                 \
                                        round8_##S(_mm256_mul_ps(x2, s))));               \
        store8_##S(o + k + half, _mm256_add_ps(round8_##S(_mm256_mul_ps(x2, c)),          \
                                               round8_##S(_mm256_mul_ps(x1, s))));        \
    }
#else
#define NORM_VECTOR(S, FP32)
#define ADD_VECTOR(S)
#define ROTARY_VECTOR(S)
#endif

/* The decode items (sequence, KV head) [first, last) of thread `tid` of `nt`: contiguous
 * runs of about equal numbers of keys (an item's time is its keys), each item to the
 * thread its middle key falls to. Equal numbers of items left one thread up to a tenth
 * more keys than the other with the contexts of a mixed workload. */
static void keys_share(const int64_t *lens, int64_t nd, int64_t kvh, int tid, int nt,
                       int64_t *first, int64_t *last) {
    int64_t total = 0;
    for (int64_t i = 0; i < nd; ++i) total += (lens[i] + 1) * kvh;
    int64_t lo = total * tid / nt, hi = total * (tid + 1) / nt, seen = 0;
    *first = *last = nd * kvh;
    for (int64_t item = 0; item < nd * kvh; ++item) {
        int64_t cost = lens[item / kvh] + 1, middle = 2 * seen + cost;  /* twice the middle */
        seen += cost;
        if (*first == nd * kvh && middle >= 2 * lo) *first = item;
        if (middle >= 2 * hi) { *last = item; break; }
    }
    if (*first > *last) *first = *last;
}

#define STEP_OPS(S, T, LOAD, STORE, ROUND, FP32)                                          \
    DOT(dot_##S, T, LOAD)                                                                 \
                                                                                          \
    static inline float sum_squares_##S(const T *x, int64_t n) {                          \
        float lanes[LANES] = {0};                                                         \
        int64_t i = 0;                                                                    \
        for (; i + LANES <= n; i += LANES)                                                \
            for (int j = 0; j < LANES; ++j) {                                             \
                float v = LOAD(x, i + j);                                                 \
                lanes[j] += v * v;                                                        \
            }                                                                             \
        float sum = 0.f;                                                                  \
        for (int j = 0; j < LANES; ++j) sum += lanes[j];                                  \
        for (; i < n; ++i) sum += LOAD(x, i) * LOAD(x, i);                                \
        return sum;                                                                       \
    }                                                                                     \
                                                                                          \
    /* one row: fp32 `x * rsqrt(mean(x^2) + eps) * w`; bf16 rounds the normalised     */  \
    /* value, then multiplies by the weight (the HF order)                             */  \
    static inline void norm_row_##S(const T *x, const T *w, float eps, int64_t d,         \
                                    T *out) {                                             \
        float r = 1.f / sqrtf(sum_squares_##S(x, d) / (float)d + eps);                    \
        int64_t i = 0;                                                                    \
        NORM_VECTOR(S, FP32)                                                              \
        for (; i < d; ++i) {                                                              \
            float v = FP32 ? LOAD(x, i) * r * LOAD(w, i)                                  \
                           : ROUND(LOAD(x, i) * r) * LOAD(w, i);                          \
            STORE(out, i, v);                                                             \
        }                                                                                 \
    }                                                                                     \
                                                                                          \
    /* x [a, b, d] with strides (sa, sb, 1) -> out [a, b, d] contiguous */                \
    void llmq_rms_norm_##S(const T *x, int64_t a, int64_t b, int64_t d, int64_t sa,       \
                           int64_t sb, const T *w, float eps, T *out, int threads) {      \
        if (a * b * d < PARALLEL_ELEMENTS) threads = 1;                                   \
        _Pragma("omp parallel for num_threads(threads) schedule(static)")                 \
        for (int64_t i = 0; i < a; ++i)                                                   \
            for (int64_t j = 0; j < b; ++j)                                               \
                norm_row_##S(x + i * sa + j * sb, w, eps, d, out + (i * b + j) * d);      \
    }                                                                                     \
                                                                                          \
    /* residual_out = x + residual (rounded as the dtype's add); out = its norm */         \
    void llmq_add_rms_norm_##S(const T *x, const T *residual, int64_t n, int64_t d,       \
                               const T *w, float eps, T *out, T *residual_out,            \
                               int threads) {                                             \
        if (n * d < PARALLEL_ELEMENTS) threads = 1;                                       \
        _Pragma("omp parallel for num_threads(threads) schedule(static)")                 \
        for (int64_t i = 0; i < n; ++i) {                                                 \
            T *sum = residual_out + i * d;                                                \
            int64_t k = 0;                                                                \
            ADD_VECTOR(S)                                                                 \
            for (; k < d; ++k)                                                            \
                STORE(sum, k, LOAD(x, i * d + k) + LOAD(residual, i * d + k));            \
            norm_row_##S(sum, w, eps, d, out + i * d);                                    \
        }                                                                                 \
    }                                                                                     \
                                                                                          \
    /* x [n, h, D] strides (sn, sh, 1); cos, sin [n, D/2] rows sc apart; out          */ \
    /* contiguous: [x1 * c - x2 * s, x2 * c + x1 * s], each product rounded as its own */ \
    /* op                                                                              */ \
    void llmq_rotary_##S(const T *x, int64_t n, int64_t h, int64_t D, int64_t sn,         \
                         int64_t sh, const T *cos, const T *sin, int64_t sc, T *out,      \
                         int threads) {                                                   \
        int64_t half = D / 2;                                                             \
        if (n * h * D < PARALLEL_ELEMENTS) threads = 1;                                   \
        _Pragma("omp parallel for num_threads(threads) schedule(static)")                 \
        for (int64_t i = 0; i < n; ++i)                                                   \
            for (int64_t j = 0; j < h; ++j) {                                             \
                const T *row = x + i * sn + j * sh;                                       \
                T *o = out + (i * h + j) * D;                                             \
                const T *cr = cos + i * sc, *sr = sin + i * sc;                           \
                int64_t k = 0;                                                            \
                ROTARY_VECTOR(S)                                                          \
                for (; k < half; ++k) {                                                   \
                    float x1 = LOAD(row, k), x2 = LOAD(row, k + half);                    \
                    float c = LOAD(cr, k), s = LOAD(sr, k);                               \
                    STORE(o, k, ROUND(x1 * c) - ROUND(x2 * s));                           \
                    STORE(o, k + half, ROUND(x2 * c) + ROUND(x1 * s));                    \
                }                                                                         \
            }                                                                             \
    }                                                                                     \
                                                                                          \
    /* x [n, 2d] = [gate, up] -> out [n, d] = silu(gate) * up, rows over threads */      \
    void llmq_silu_and_mul_##S(const T *x, int64_t n, int64_t d, T *out, int threads) {   \
        if (n * d < PARALLEL_ELEMENTS) threads = 1;                                       \
        _Pragma("omp parallel for num_threads(threads) schedule(static)")                 \
        for (int64_t i = 0; i < n; ++i) {                                                 \
            const T *gate = x + i * 2 * d, *up = gate + d;                                \
            T *o = out + i * d;                                                           \
            int64_t k = 0;                                                                \
            SILU_VECTOR(S)                                                                \
            for (; k < d; ++k) {                                                          \
                float g = LOAD(gate, k);                                                  \
                float s = ROUND(g / (1.f + expf(-g)));                                    \
                STORE(o, k, s * LOAD(up, k));                                             \
            }                                                                             \
        }                                                                                 \
    }                                                                                     \
                                                                                          \
    /* k, v [n, kvh, D] with token strides sk, sv (heads contiguous) into their slots  */ \
    /* of one layer's caches (strides: block cb, token ct; heads contiguous)           */ \
    void llmq_store_kv_##S(const T *k, const T *v, int64_t n, int64_t row, int64_t sk,    \
                           int64_t sv, T *k_cache, T *v_cache, int64_t cb, int64_t ct,    \
                           const int64_t *blocks, const int64_t *offsets) {               \
        for (int64_t i = 0; i < n; ++i) {                                                 \
            int64_t slot = blocks[i] * cb + offsets[i] * ct;                              \
            memcpy(k_cache + slot, k + i * sk, row * sizeof(T));                          \
            memcpy(v_cache + slot, v + i * sv, row * sizeof(T));                          \
        }                                                                                 \
    }                                                                                     \
                                                                                          \
    /* One new token per sequence attends over its cached context.                     */ \
    /* q [nd, H, D] contiguous; caches: block stride cb, token stride ct, head stride  */ \
    /* ch; tables: sequence i's blocks at tables[starts[i]...]; lens[i] keys; out      */ \
    /* [nd, H, D]. As the reference: q * scale rounded, scores rounded, softmax in     */ \
    /* fp32 rounded, then fp32 sums of p * v, rounded once.                            */ \
    int llmq_decode_attention_##S(const T *q, int64_t nd, int64_t H, int64_t KVH,         \
                                  int64_t D, const T *k_cache, const T *v_cache,          \
                                  int64_t cb, int64_t ct, int64_t ch, int64_t block_size, \
                                  const int64_t *tables, const int64_t *starts,           \
                                  const int64_t *lens, float scale, T *out,               \
                                  int threads) {                                          \
        int64_t G = H / KVH, max_len = 0;                                                 \
        for (int64_t i = 0; i < nd; ++i) max_len = lens[i] > max_len ? lens[i] : max_len; \
        int failed = 0;                                                                   \
        int64_t work = nd * KVH;                                                          \
        if (work < threads) threads = (int)(work > 0 ? work : 1);                         \
        _Pragma("omp parallel num_threads(threads)")                                      \
        {                                                                                 \
            float *qs = malloc(sizeof(float) * G * D);                                    \
            float *acc = malloc(sizeof(float) * G * D);                                   \
            float *p = malloc(sizeof(float) * G * (max_len > 0 ? max_len : 1));           \
            int64_t *rows = malloc(sizeof(int64_t) * (max_len > 0 ? max_len : 1));        \
            if (!qs || !acc || !p || !rows) {                                             \
                _Pragma("omp atomic write") failed = 1;                                   \
            } else {                                                                      \
                int64_t first, last;                                                      \
                keys_share(lens, nd, KVH, omp_get_thread_num(), omp_get_num_threads(),    \
                           &first, &last);                                                \
                for (int64_t item = first; item < last; ++item) {                         \
                    int64_t i = item / KVH, hk = item % KVH, L = lens[i];                 \
                    const int64_t *table = tables + starts[i];                            \
                    for (int64_t g = 0; g < G; ++g)                                       \
                        for (int64_t d = 0; d < D; ++d)                                   \
                            qs[g * D + d] =                                               \
                                ROUND(LOAD(q, (i * H + hk * G + g) * D + d) * scale);     \
                    /* where each key's (and value's) head lies in the caches */          \
                    for (int64_t t = 0, b = 0; t < L; ++b)                                \
                        for (int64_t o = 0; o < block_size && t < L; ++o, ++t)            \
                            rows[t] = table[b] * cb + o * ct + hk * ch;                   \
                    /* the vector path where the head size has one; else the loops */     \
                    if (!ATTEND(S, qs, G, D, L, k_cache, v_cache, rows, p, acc)) {        \
                        for (int64_t t = 0; t < L; ++t) {                                 \
                            const T *key = k_cache + rows[t];                             \
                            for (int64_t g = 0; g < G; ++g)                               \
                                p[g * L + t] = ROUND(HEAD_DOT(S, qs + g * D, key, D));    \
                        }                                                                 \
                        for (int64_t g = 0; g < G; ++g) softmax_##S(p + g * L, L);        \
                        if (!WEIGHTED_VALUES(S, p, L, G, D, v_cache, rows, acc)) {        \
                            memset(acc, 0, sizeof(float) * G * D);                        \
                            for (int64_t t = 0; t < L; ++t) {                             \
                                const T *value = v_cache + rows[t];                       \
                                for (int64_t g = 0; g < G; ++g) {                         \
                                    float pt = p[g * L + t];                              \
                                    float *a = acc + g * D;                               \
                                    for (int64_t d = 0; d < D; ++d)                       \
                                        a[d] += pt * LOAD(value, d);                      \
                                }                                                         \
                            }                                                             \
                        }                                                                 \
                    }                                                                     \
                    for (int64_t g = 0; g < G; ++g)                                       \
                        for (int64_t d = 0; d < D; ++d)                                   \
                            STORE(out, (i * H + hk * G + g) * D + d, acc[g * D + d]);     \
                }                                                                         \
            }                                                                             \
            free(qs);                                                                     \
            free(acc);                                                                    \
            free(p);                                                                      \
            free(rows);                                                                   \
        }                                                                                 \
        return failed ? -1 : 0;                                                           \
    }

STEP_OPS(f32, float, LOAD_F32, STORE_F32, ROUND_F32, 1)
STEP_OPS(bf16, uint16_t, LOAD_BF16, STORE_BF16, ROUND_BF16, 0)
