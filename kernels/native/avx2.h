/* 8-lane fp32 helpers for the AVX2 (+FMA) bodies of the native kernels, on CPUs without
 * AVX-512: exp, bf16 loads / rounding / stores, horizontal sums and maxima. Each rounds
 * as its 16-lane AVX-512 counterpart in step_ops.c does. */
#ifndef LLMQ_AVX2_H
#define LLMQ_AVX2_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>

/* e^x for 8 floats: exp512's range reduction and polynomial. AVX2 has no scalef: 2^n is
 * built from exponent bits in two halves n1 = floor(n / 2), n2 = n - n1 (each a normal
 * float for n in [-150, 128]), so p * 2^n1 is exact and * 2^n2 rounds once, into the
 * denormals or to inf as scalef does. NaN gives exp512's result, 0: max / min return
 * their second operand on NaN, so it is clamped to -103.97 */
static inline __m256 exp256(__m256 x) {
    const __m256 hi = _mm256_set1_ps(88.7228f), lo = _mm256_set1_ps(-103.9721f);
    __m256 xc = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), xc);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    __m256i ni = _mm256_cvtps_epi32(n), bias = _mm256_set1_epi32(127);
    __m256i n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
    __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
    __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
    __m256 y = _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
    return _mm256_blendv_ps(y, _mm256_set1_ps(INFINITY), _mm256_cmp_ps(x, hi, _CMP_GT_OQ));
}

static inline __m256 load8_f32(const float *p) { return _mm256_loadu_ps(p); }
static inline __m256 load8_bf16(const uint16_t *p) {
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
/* round to bf16 (nearest even; NaN stays NaN) and back, as round16_bf16 */
static inline __m256 round8_bf16(__m256 v) {
    __m256i bits = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
    rounded = _mm256_and_si256(rounded, _mm256_set1_epi32((int)0xffff0000u));
    __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
    return _mm256_blendv_ps(_mm256_castsi256_ps(rounded), v, nan);
}
static inline __m256 round8_f32(__m256 v) { return v; }
static inline void store8_f32(float *p, __m256 v) { _mm256_storeu_ps(p, v); }
static inline void store8_bf16(uint16_t *p, __m256 v) {
    /* the high halves, 0..0xffff, so the unsigned saturation of the pack never bites */
    __m256i bits = _mm256_srli_epi32(_mm256_castps_si256(round8_bf16(v)), 16);
    _mm_storeu_si128((__m128i *)p, _mm_packus_epi32(_mm256_castsi256_si128(bits),
                                                    _mm256_extracti128_si256(bits, 1)));
}

static inline float reduce_add8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static inline float reduce_max8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

#endif
