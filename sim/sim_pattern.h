/* sim/sim_pattern.h - the simulated weights' pattern, one definition for the host code
 * (sim/sim.c) and the CUDA kernels (sim/sim_cuda.cu): element gidx of a tensor at a version
 * holds the low bytes of sim_pattern(salt of the tensor's name, version, gidx). */
#ifndef RF_SIM_PATTERN_H
#define RF_SIM_PATTERN_H

#include <stdint.h>

#ifdef __CUDACC__
#define SIM_HD __host__ __device__
#else
#define SIM_HD
#endif

static inline SIM_HD uint64_t sim_mix(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    x ^= x >> 33;
    return x;
}

/* In a salt: every element a finite number (sim_weight_bf16 without its edge cases), as a
 * trained model's weights are; the clients' --finite-weights, for benchmarks. sim_name_salt
 * never sets it. */
#define SIM_FINITE (1ULL << 63)

static inline uint64_t sim_name_salt(const char *s)
{
    uint64_t h = 1469598103934665603ULL;

    for (; *s; s++)
        h = (h ^ (uint8_t)*s) * 1099511628211ULL;
    return h & ~SIM_FINITE;
}

/* Bits 0-15 of an element from its hash h, read as bf16: a number shaped like a weight, so that
 * FP8 engines quantize something that checks them (issue 15). Random sign and mantissa; the
 * exponent 2^(k-21) with k geometric (k with probability 2^-(k+1), up to 20): most values are
 * small and a few large, so the amax of a block, and with it its scale, comes from a handful of
 * its elements and differs from block to block (a scale put on the wrong block is caught), and
 * each block's elements quantize to many FP8 codes (a moved element is caught). Random bits
 * would give almost every 128x128 block the same amax (the largest finite bf16) and quantize
 * 93% of elements to zero. One element in 4096 is an edge case instead: +-Inf, a NaN, +-0 or
 * a subnormal (none where edges is 0). */
static inline SIM_HD uint64_t sim_weight_bf16(uint64_t h, int edges)
{
    uint32_t sign = (uint32_t)(h >> 63) << 15, mant = (uint32_t)h & 0x7F, k = 0;
    uint32_t g = (uint32_t)(h >> 32) | 0x100000u;

    while (!(g & 1)) {
        g >>= 1;
        k++;
    }
    if (edges && ((h >> 52) & 0xFFF) == 0) {
        switch ((h >> 7) & 3) {
        case 0: return sign | 0x7F80;                      /* +-Inf */
        case 1: return sign | 0x7FC0 | mant;               /* NaN */
        case 2: return sign;                               /* +-0 */
        default: return sign | (mant ? mant : 1);          /* subnormal */
        }
    }
    return sign | (106 + k) << 7 | mant;
}

/* The value of element gidx of a tensor at a version: its low bytes are what the element
 * holds, whatever the dtype; the low 16 bits are sim_weight_bf16's number (the higher bytes
 * of wider dtypes need not make a meaningful one). */
static inline SIM_HD uint64_t sim_pattern(uint64_t salt, uint64_t version, uint64_t gidx)
{
    uint64_t h = sim_mix(salt ^ (version * 0x9e3779b97f4a7c15ULL) ^
                         (gidx * 0xd6e8feb86659fd93ULL));

    return (h & ~0xFFFFULL) | sim_weight_bf16(h, !(salt & SIM_FINITE));
}

#endif
