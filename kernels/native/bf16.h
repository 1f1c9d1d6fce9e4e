/* bf16 <-> fp32 for the native kernels: a bf16 is the high half of an fp32; rounding to
 * it is to nearest even, and a NaN stays a (quiet) NaN. */
#ifndef LLMQ_BF16_H
#define LLMQ_BF16_H

#include <stdint.h>
#include <string.h>

static inline float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* what a value becomes when a bf16 op stores it */
static inline float round_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }

#endif
