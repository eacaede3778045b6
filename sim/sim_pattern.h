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

static inline uint64_t sim_name_salt(const char *s)
{
    uint64_t h = 1469598103934665603ULL;

    for (; *s; s++)
        h = (h ^ (uint8_t)*s) * 1099511628211ULL;
    return h;
}

/* The value of element gidx of a tensor at a version: its low bytes are what the element
 * holds, whatever the dtype (the bytes need not be a meaningful number). */
static inline SIM_HD uint64_t sim_pattern(uint64_t salt, uint64_t version, uint64_t gidx)
{
    return sim_mix(salt ^ (version * 0x9e3779b97f4a7c15ULL) ^ (gidx * 0xd6e8feb86659fd93ULL));
}

#endif
